#!/usr/bin/env python3
"""Times torchxrayvision's DenseNet-121 (densenet121-res224-all architecture) in PyTorch and,
exported to ONNX, in ONNX Runtime: 224 px, batch 1 and 16, the same thread count for both.
The other side of the comparison is `cargo bench --bench classifier` (Hilum, same machine).
Weights are seeded (speed does not depend on their values; nothing is downloaded).

Run:  scripts/.venv-fixtures/bin/python scripts/bench/bench_torch.py [--threads 2] [--iters 30] [--json out.json]
"""
import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import numpy as np
import torch
import torchxrayvision as xrv


def timeit(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    ts.sort()
    return {
        "median_ms": round(statistics.median(ts), 2),
        "p95_ms": round(ts[min(len(ts) - 1, int(0.95 * len(ts)))], 2),
        "min_ms": round(ts[0], 2),
        "iters": iters,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = xrv.models.DenseNet(weights=None).eval()  # densenet121-res224-all's architecture
    results = {
        "model": "densenet121-res224-all (seeded weights)",
        "threads": args.threads,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "versions": {"torch": torch.__version__, "torchxrayvision": xrv.__version__},
        "pytorch": {},
        "onnxruntime": {},
    }
    batches = [int(b) for b in args.batches.split(",")]
    for b in batches:
        x = torch.rand((b, 1, 224, 224)) * 2048 - 1024
        with torch.inference_mode():
            iters = max(5, args.iters // b)
            results["pytorch"][f"batch{b}"] = timeit(lambda: model(x), args.warmup, iters)
        print(f"pytorch     batch {b:2}: {results['pytorch'][f'batch{b}']}")

    try:
        import onnxruntime as ort
    except ImportError:
        print("onnxruntime not installed: skipping the ONNX Runtime side")
        ort = None
    if ort is not None:
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "densenet121.onnx")
            torch.onnx.export(model, torch.zeros((1, 1, 224, 224)), path, input_names=["x"],
                              output_names=["logits"], dynamic_axes={"x": {0: "b"}},
                              opset_version=17, dynamo=False)
            so = ort.SessionOptions()
            so.intra_op_num_threads = args.threads
            so.inter_op_num_threads = 1
            sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
            results["versions"]["onnxruntime"] = ort.__version__
            for b in batches:
                x = (np.random.rand(b, 1, 224, 224).astype(np.float32) * 2048 - 1024)
                iters = max(5, args.iters // b)
                results["onnxruntime"][f"batch{b}"] = timeit(lambda: sess.run(None, {"x": x}), args.warmup, iters)
                print(f"onnxruntime batch {b:2}: {results['onnxruntime'][f'batch{b}']}")

    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        print("wrote", args.json)


if __name__ == "__main__":
    main()
