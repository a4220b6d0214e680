#!/usr/bin/env python3
"""Soak driver for `hilum serve` (standard library only; called by `scripts/deploy/load_test.sh --soak`).

SESSIONS threads each own one session and ask, one question after another until SECONDS have
passed, a question whose scripted model calls `segment_lungs` on one of the uploaded images; each
streamed answer is read to its end and checked. A question in flight at the deadline is finished,
not cut, so every run the server starts is a completed run. Meanwhile the server's resident set
(VmRSS) is sampled every few seconds from /proc.

Prints one JSON object: the runs, errors, latency, RSS samples and peak (VmHWM).
"""
import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request


def rss_kib(pid, field="VmRSS"):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def ask(base, token, session, image, timeout):
    """One question; returns (ok, why) after reading the NDJSON stream to its end."""
    body = json.dumps({"question": "How large are the lungs in this image?", "images": [image]}).encode()
    req = urllib.request.Request(
        f"{base}/v1/sessions/{session}/messages",
        data=body,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            events = [json.loads(l) for l in resp.read().splitlines() if l.strip()]
    except urllib.error.HTTPError as e:
        return False, f"HTTP {e.code}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        return False, type(e).__name__
    kinds = [e.get("type") for e in events]
    if "error" in kinds or "tool_failed" in kinds:
        bad = next(e for e in events if e.get("type") in ("error", "tool_failed"))
        return False, bad.get("type") + ": " + str(bad.get("message") or bad.get("error"))[:120]
    done = [e for e in events if e.get("type") == "tool_finished" and e.get("name") == "segment_lungs"]
    complete = [e for e in events if e.get("type") == "complete"]
    final = [e for e in events if e.get("type") == "final"]
    if len(done) != 1 or not final or not complete or not complete[-1].get("ok"):
        return False, "incomplete stream: " + ",".join(str(k) for k in kinds[-4:])
    return True, ""


def main():
    base, token, pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
    seconds = float(sys.argv[4])
    sessions = sys.argv[5].split(",")
    images = sys.argv[6].split(",")
    deadline = time.monotonic() + seconds
    lock = threading.Lock()
    latencies, errors = [], {}
    samples = []

    def worker(i):
        n = 0
        while time.monotonic() < deadline:
            image = images[(i + n) % len(images)]
            n += 1
            t0 = time.monotonic()
            ok, why = ask(base, token, sessions[i], image, timeout=float(os.environ.get("SOAK_REQUEST_TIMEOUT", "300")))
            ms = (time.monotonic() - t0) * 1e3
            with lock:
                if ok:
                    latencies.append(ms)
                else:
                    errors[why] = errors.get(why, 0) + 1

    def sampler():
        start = time.monotonic()
        while time.monotonic() < deadline:
            kib = rss_kib(pid)
            if kib is not None:
                with lock:
                    samples.append((round(time.monotonic() - start, 1), round(kib / 1024, 1), len(latencies)))
            time.sleep(5)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(sessions))]
    threads.append(threading.Thread(target=sampler))
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    latencies.sort()

    def pct(p):
        return round(latencies[min(len(latencies) - 1, int(p / 100 * len(latencies)))], 1) if latencies else None

    print(json.dumps({
        "sessions": len(sessions),
        "seconds": round(wall, 1),
        "runs_ok": len(latencies),
        "runs_per_s": round(len(latencies) / wall, 2),
        "latency_ms": {"p50": pct(50), "p95": pct(95), "max": pct(100)},
        "errors": errors,
        "rss_mib_samples": samples,
        "peak_rss_mib": round((rss_kib(pid, "VmHWM") or 0) / 1024, 1),
    }))


if __name__ == "__main__":
    main()
