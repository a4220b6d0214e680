"""Converts torchxrayvision's ChestX-Det PSPNet checkpoint to safetensors for Hilum.

Usage: python scripts/convert_pspnet.py pspnet_chestxray_best_model_4.pth model.safetensors
Names are kept (after stripping DataParallel's `module.`); BN counters and the training-only
auxiliary head (convbnrelu4_aux, aux_cls) are dropped. Needs torch + safetensors
(scripts/fixtures/requirements-anatomy.txt). `hilum models import` reads the .pth in Rust with these
rules (crates/hilum-models/src/checkpoint/), without Python; this script stays as their
reference.
"""
import sys

import torch
from safetensors.torch import save_file


def main(src, dst):
    sd = torch.load(src, map_location="cpu", weights_only=True)
    out = {}
    for k, v in sd.items():
        name = k[len("module."):] if k.startswith("module.") else k
        if name.endswith("num_batches_tracked") or name.startswith(("convbnrelu4_aux.", "aux_cls.")):
            continue
        out[name] = v.float().contiguous()
    save_file(out, dst)
    print(f"wrote {len(out)} tensors to {dst}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
