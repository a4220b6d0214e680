#!/usr/bin/env python3
"""Times the real lung U-Net (../shared/data/models/lung_seg_unet) in PyTorch and in ONNX Runtime's
Python package: batch 1, 256x256x3, the same thread count, runs alternated, a pause before each
run as `xrv_profile unet` does (spinning worker pools otherwise take the next run's cores).
PyTorch runs the published ONNX graph of the Keras model converted by onnx2torch; its output is
checked against the Keras reference output first. Hilum's side: `xrv_profile -- unet`.

Run:  scripts/.venv-bench-unet/bin/python scripts/bench/bench_unet_torch.py [--threads 2] [--iters 40]
(venv: see scripts/bench/requirements-bench-unet.txt)
"""
import argparse
import pathlib
import statistics
import time

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx2torch import convert

ort.set_default_logger_severity(3)  # the graph's deprecated resize attribute warns on every load

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = ROOT.parent / "shared/data/models/lung_seg_unet"
REF = MODEL / "reference_outputs"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--pause-ms", type=float, default=20.0)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    graph = MODEL / "lung_seg_valiou_088.onnx"
    x = np.load(REF / "lung_seg_input_nih_00000001_000_cardiomegaly.npy").astype(np.float32)
    ref = np.load(REF / "lung_seg_output_nih_00000001_000_cardiomegaly.npy")
    net = convert(onnx.load(str(graph))).eval()
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = a.threads
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(str(graph), opts, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    xt = torch.from_numpy(x)
    with torch.inference_mode():
        y = net(xt).numpy()
    print(f"PyTorch output vs Keras reference: max abs diff {np.abs(y.reshape(ref.shape) - ref).max():.2e}")

    def torch_run():
        with torch.inference_mode():
            net(xt)

    def ort_run():
        sess.run(None, {name: x})

    times = {"pytorch": [], "onnxruntime": []}
    for fn in (torch_run, ort_run):
        fn()
    for _ in range(a.iters):
        for key, fn in (("pytorch", torch_run), ("onnxruntime", ort_run)):
            time.sleep(a.pause_ms / 1e3)
            t = time.perf_counter()
            fn()
            times[key].append((time.perf_counter() - t) * 1e3)
    for key, ts in times.items():
        print(f"{key:12s} lung U-Net 256x256 batch 1, {a.threads} threads: median {statistics.median(ts):.2f} ms "
              f"(min {min(ts):.2f}, {len(ts)} runs)")


if __name__ == "__main__":
    main()
