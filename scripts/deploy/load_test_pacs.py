#!/usr/bin/env python3
"""Load test of the DICOM node of `hilum serve`, on 127.0.0.1 only, bounded in time.

STUDIES copies of a shared CR (each its own study, series and instance UIDs) go to Hilum's node
by dcmtk's storescu over ASSOCIATIONS concurrent associations; the node runs the default
protocol on each (the real lung U-Net) and sends the SR, SEG and overlay to a real Orthanc by
STOW-RS. The script waits until every job is done, checks that Orthanc holds exactly one result
set (3 objects) per study and no more, and prints studies per minute and the p50/p95 time from a
study's last instance received to its results stored in Orthanc (the node's 1 s quiet period
included).

Run through `scripts/deploy/load_test.sh --pacs [STUDIES=200] [ASSOCIATIONS=4]`, which passes the
Python of scripts/setup_pacs_tools.sh (pydicom) and the hilum binary (HILUM_BIN, default
target/release/hilum).
"""
import json
import os
import re
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import pydicom
from pydicom.uid import generate_uid

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCE = os.path.join(ROOT, "..", "shared", "data", "cxr", "dicom",
                      "siim_pneumothorax_neg_cr_pa_jpegbaseline.dcm")
H5 = os.path.join(ROOT, "..", "shared", "data", "models", "lung_seg_unet", "lung_seg_valiou_088.h5")
DEADLINE_S = 1800


def free_port():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def get_json(url):
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.load(r)


def main():
    studies = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    assocs = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    hilum = os.environ.get("HILUM_BIN", os.path.join(ROOT, "target", "release", "hilum"))
    for tool in ("storescu",):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} is missing: run scripts/setup_pacs_tools.sh")
    work = tempfile.mkdtemp(prefix="hilum-pacs-load-")
    procs = []
    orthanc_pid = None
    try:
        # 1. The studies.
        files = []
        for i in range(studies):
            ds = pydicom.dcmread(SOURCE)
            ds.StudyInstanceUID = generate_uid()
            ds.SeriesInstanceUID = generate_uid()
            ds.SOPInstanceUID = generate_uid()
            ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID
            path = os.path.join(work, f"study_{i:04d}.dcm")
            ds.save_as(path)
            files.append(path)
        print(f"load_test --pacs: {studies} studies written", file=sys.stderr)

        # 2. The PACS.
        out = subprocess.run(["bash", os.path.join(ROOT, "scripts", "deploy", "orthanc_start.sh"), work],
                             capture_output=True, text=True, check=True).stdout
        env = dict(re.findall(r"^export (\w+)=(.*)$", out, re.M))
        orthanc, orthanc_pid = env["HILUM_ORTHANC_URL"], env["HILUM_ORTHANC_PID"]

        # 3. The node, with the real lung U-Net.
        henv = dict(os.environ, HILUM_MODELS_DIR=os.path.join(work, "models"), HILUM_CONFIG="/dev/null")
        henv.pop("HILUM_LLM", None)
        henv.pop("OPENAI_API_KEY", None)
        subprocess.run([hilum, "models", "import", "lung-unet", H5], env=henv, check=True,
                       capture_output=True)
        dicom_port = free_port()
        db = os.path.join(work, "h.db")
        log = open(os.path.join(work, "serve.log"), "w")
        serve = subprocess.Popen(
            [hilum, "serve", "--bind", "127.0.0.1:0", "--db", f"sqlite://{db}",
             "--dicom-port", str(dicom_port), "--dicom-dir", os.path.join(work, "pacs"),
             "--pacs-dest", f"{orthanc}/dicom-web", "--pacs-quiet-secs", "1"],
            env=henv, stdout=subprocess.DEVNULL, stderr=log)
        procs.append(serve)
        until = time.time() + 60
        while "DICOM node listening" not in open(log.name).read():
            if time.time() > until or serve.poll() is not None:
                sys.exit("hilum serve did not start its DICOM node: " + open(log.name).read()[-2000:])
            time.sleep(0.1)

        # 4. Send: one association per group of studies, all at once.
        groups = [files[i::assocs] for i in range(assocs)]
        t0 = time.time()
        senders = [subprocess.Popen(["storescu", "-aet", "LOADTEST", "-aec", "HILUM", "-xy",
                                     "127.0.0.1", str(dicom_port), *g],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                   for g in groups]
        for s in senders:
            _, err = s.communicate(timeout=DEADLINE_S)
            if s.returncode != 0:
                sys.exit(f"storescu failed: {err[-1000:]}")
        sent_s = time.time() - t0
        print(f"load_test --pacs: {studies} studies sent over {assocs} associations in {sent_s:.1f} s",
              file=sys.stderr)

        # 5. Wait for every job.
        until = time.time() + DEADLINE_S
        while True:
            con = sqlite3.connect(db)
            states = dict(con.execute("SELECT state, COUNT(*) FROM pacs_jobs GROUP BY state").fetchall())
            con.close()
            if states.get("failed"):
                sys.exit(f"{states['failed']} job(s) failed: see `hilum pacs jobs --db sqlite://{db}`")
            if states.get("done", 0) == studies:
                break
            if time.time() > until:
                sys.exit(f"not all jobs ended within {DEADLINE_S} s: {states}")
            time.sleep(0.5)
        con = sqlite3.connect(db)
        rows = con.execute(
            "SELECT j.updated_ms, (SELECT MAX(received_ms) FROM pacs_instances i WHERE i.study_uid = j.study_uid),"
            " (SELECT MIN(received_ms) FROM pacs_instances) FROM pacs_jobs j WHERE j.state = 'done'").fetchall()
        con.close()

        # 6. Exactly one result set per study in the PACS.
        stats = get_json(f"{orthanc}/statistics")
        if stats["CountStudies"] != studies or stats["CountInstances"] != 3 * studies:
            sys.exit(f"Orthanc holds {stats['CountStudies']} studies and {stats['CountInstances']} "
                     f"instances; expected {studies} and {3 * studies}")

        lat = sorted((done - last) / 1000.0 for done, last, _ in rows)
        first = min(r[2] for r in rows) / 1000.0
        last_done = max(r[0] for r in rows) / 1000.0
        per_min = studies / (last_done - first) * 60.0
        p50 = statistics.median(lat)
        p95 = lat[min(len(lat) - 1, int(round(0.95 * (len(lat) - 1))))]
        print(json.dumps({"studies": studies, "associations": assocs, "studies_per_min": round(per_min, 1),
                          "p50_s": round(p50, 2), "p95_s": round(p95, 2),
                          "result_objects_in_pacs": stats["CountInstances"]}))
        print(f"PACS load: {studies} studies over {assocs} associations: {per_min:.1f} studies/min; "
              f"last instance received → results stored in the PACS: p50 {p50:.2f} s, p95 {p95:.2f} s "
              f"(1 s quiet period included); {stats['CountInstances']} result objects, one set per study")
    finally:
        for p in procs:
            p.kill()
        if orthanc_pid:
            subprocess.run(["kill", orthanc_pid])
            time.sleep(0.5)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
