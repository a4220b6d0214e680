#!/usr/bin/env python3
"""Converts a torchxrayvision checkpoint (.pt) to safetensors for Hilum, names unchanged.

Handles both published forms: the DenseNet files are whole pickled models (torchxrayvision
loads them and takes `.state_dict()`), the ResNet files are state dicts of torchvision's
resnet50 with a one-channel conv1. Tensors are written as float32 under their checkpoint
names; `*.num_batches_tracked` (integer training bookkeeping, unused at inference) is left out.
With --arch the names and shapes are checked against torchxrayvision's own architecture.
`hilum models import`/`fetch` no longer run this script: they read .pt files in Rust with the
same rules (crates/hilum-models/src/checkpoint/); it stays as the reference those are tested
against (scripts/fixtures/make_checkpoint_fixtures.py).

Run:  scripts/.venv-fixtures/bin/python scripts/convert_xrv.py IN.pt OUT.safetensors [--arch densenet121|resnet50]
      scripts/.venv-fixtures/bin/python scripts/convert_xrv.py --self-test
          (saves a seeded full-size model of each form locally, converts it, checks the result)
"""
import argparse
import os
import sys
import tempfile

import torch
import torchvision
import torchxrayvision as xrv
from safetensors.torch import load_file, save_file


def reference(arch):
    """torchxrayvision's architecture for the published weights (no download)."""
    if arch == "densenet121":
        return xrv.models.DenseNet(weights=None)
    if arch == "resnet50":
        m = torchvision.models.resnet50(num_classes=18, weights=None)
        m.conv1 = torch.nn.Conv2d(1, 64, kernel_size=7, stride=2, padding=3, bias=False)
        return m
    raise SystemExit(f"unknown --arch {arch}: use densenet121 or resnet50")


def load_state(path):
    obj = torch.load(path, map_location="cpu", weights_only=False)
    if isinstance(obj, torch.nn.Module):
        # Old pickled modules lack this attribute (torchxrayvision patches it the same way).
        for mod in obj.modules():
            if not hasattr(mod, "_non_persistent_buffers_set"):
                mod._non_persistent_buffers_set = set()
        return obj.state_dict()
    if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]
    if isinstance(obj, dict):
        return obj
    raise SystemExit(f"{path}: neither a model nor a state dict ({type(obj).__name__})")


def convert(src, dst, arch=None):
    state = load_state(src)
    tensors = {
        k: v.detach().to(torch.float32).contiguous()
        for k, v in state.items()
        if torch.is_tensor(v) and not k.endswith("num_batches_tracked")
    }
    if arch:
        want = {k: tuple(v.shape) for k, v in reference(arch).state_dict().items()
                if not k.endswith("num_batches_tracked")}
        got = {k: tuple(v.shape) for k, v in tensors.items()}
        missing = sorted(set(want) - set(got))
        extra = sorted(set(got) - set(want))
        wrong = sorted(k for k in set(want) & set(got) if want[k] != got[k])
        if missing or extra or wrong:
            raise SystemExit(f"{src} does not match {arch}: missing {missing[:5]}, "
                             f"unexpected {extra[:5]}, wrong shapes {wrong[:5]}")
    save_file(tensors, dst, metadata={"source": os.path.basename(src), "format": "pt"})
    n = sum(v.numel() for v in tensors.values())
    print(f"wrote {dst}: {len(tensors)} tensors, {n} parameters")
    return tensors


def self_test():
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        # DenseNet: a whole pickled model, as on the torchxrayvision releases.
        dn = xrv.models.DenseNet(weights=None)
        torch.save(dn, os.path.join(d, "dn.pt"))
        # ResNet: a state dict, as on the releases.
        rn = reference("resnet50")
        torch.save(rn.state_dict(), os.path.join(d, "rn.pt"))
        for name, model, arch in [("dn", dn, "densenet121"), ("rn", rn, "resnet50")]:
            out = os.path.join(d, f"{name}.safetensors")
            convert(os.path.join(d, f"{name}.pt"), out, arch)
            back = load_file(out)
            for k, v in model.state_dict().items():
                if k.endswith("num_batches_tracked"):
                    assert k not in back, k
                    continue
                assert torch.equal(back[k], v.float()), f"{k} changed"
            print(f"self-test {arch}: names and values unchanged ({len(back)} tensors)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", nargs="?")
    ap.add_argument("dst", nargs="?")
    ap.add_argument("--arch", choices=["densenet121", "resnet50"])
    ap.add_argument("--self-test", action="store_true")
    args = ap.parse_args()
    if args.self_test:
        self_test()
        return 0
    if not args.src or not args.dst:
        ap.error("give IN.pt and OUT.safetensors (or --self-test)")
    convert(args.src, args.dst, args.arch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
