#!/usr/bin/env python3
"""Exports a torchxrayvision classifier to ONNX with PyTorch, for sites that can run Python and
want the reference implementation's own graph (Hilum does not need it: without a model.onnx it
writes the same network from the installed safetensors itself, see crates/hilum-models/src/onnx_graph.rs).

The graph has Hilum's conventions: input `x` (batch, 1, size, size) already preprocessed
(values in [-1024, 1024], centre-cropped, resized), output `logits` (batch, 18) before sigmoid
and op_norm — Hilum applies those, like for its other backends. Batch size is dynamic.

Weights: a published torchxrayvision checkpoint (.pt, either form convert_xrv.py reads) or
Hilum's converted model.safetensors; --seeded exports random weights (to try the script).
With --check the graph is run in ONNX Runtime next to PyTorch and the max abs difference printed.

Run:
  scripts/.venv-fixtures/bin/python scripts/export_xrv_onnx.py --model densenet121-res224-all \\
      --weights ~/.local/share/hilum/models/densenet121-res224-all/model.safetensors --out model.onnx --check
  hilum models import densenet121-res224-all model.onnx --custom
      (the classifier then runs this graph with --backend onnx / HILUM_BACKEND=onnx)
"""
import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from convert_xrv import load_state, reference  # noqa: E402  (same folder)

MODELS = {
    "densenet121-res224-all": ("densenet121", 224),
    "resnet50-res512-all": ("resnet50", 512),
}


def load_weights(path):
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file
        return load_file(path)
    return load_state(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="densenet121-res224-all")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--weights", help="torchxrayvision .pt or Hilum model.safetensors")
    src.add_argument("--seeded", type=int, metavar="SEED", help="random weights with this seed")
    ap.add_argument("--out", required=True, help="where to write the .onnx")
    ap.add_argument("--opset", type=int, default=17)
    ap.add_argument("--check", action="store_true", help="compare with ONNX Runtime (needs onnxruntime)")
    args = ap.parse_args()

    arch, size = MODELS[args.model]
    if args.seeded is not None:
        torch.manual_seed(args.seeded)
    model = reference(arch)
    if args.weights:
        state = load_weights(args.weights)
        # num_batches_tracked is training bookkeeping that Hilum's files leave out.
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith("num_batches_tracked")]
        if missing or unexpected:
            raise SystemExit(f"{args.weights} does not fit {arch}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.eval()
    # torchxrayvision's wrapper applies sigmoid + op_norm only when op_threshs is set; the graph
    # stops at the logits.
    if getattr(model, "op_threshs", None) is not None:
        model.op_threshs = None

    example = torch.zeros((1, 1, size, size))
    torch.onnx.export(model, example, args.out, input_names=["x"], output_names=["logits"],
                      dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}},
                      opset_version=args.opset, dynamo=False)
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes): {args.model}, input x (batch, 1, {size}, {size}), output logits (batch, 18)")

    if args.check:
        import onnxruntime as ort
        x = (np.random.default_rng(0).random((2, 1, size, size), dtype=np.float32) * 2048 - 1024)
        with torch.inference_mode():
            want = model(torch.from_numpy(x)).numpy()
        sess = ort.InferenceSession(args.out, providers=["CPUExecutionProvider"])
        got = sess.run(["logits"], {"x": x})[0]
        print(f"ONNX Runtime {ort.__version__} vs PyTorch {torch.__version__}, batch 2: max abs diff {np.abs(got - want).max():.3g} (logits up to {np.abs(want).max():.3g})")


if __name__ == "__main__":
    main()
