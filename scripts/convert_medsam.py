"""Converts MedSAM's published checkpoint (medsam_vit_b.pth, a segment-anything ViT-B state
dict) to safetensors for `hilum models import medsam-vit-b FILE.safetensors`.

The names are kept as they are (image_encoder.*, prompt_encoder.*, mask_decoder.*); a
`module.` prefix (DataParallel) or a {"model": ...} / {"state_dict": ...} wrapper is removed.
Before writing, every name and shape is checked against segment-anything's own ViT-B
(sam_model_registry["vit_b"](), built without a checkpoint), one to one.
`hilum models import` reads the .pth in Rust with these rules (crates/hilum-models/src/checkpoint/),
without Python; this script stays as their reference and for converting by hand.

Run: scripts/.venv-medsam/bin/python scripts/convert_medsam.py medsam_vit_b.pth medsam-vit-b.safetensors
(versions pinned in scripts/fixtures/requirements-medsam.txt)
"""
import argparse
import hashlib
import sys

import torch
from safetensors.torch import save_file
from segment_anything import sam_model_registry


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", help="medsam_vit_b.pth")
    ap.add_argument("output", help="where to write the .safetensors file")
    args = ap.parse_args()

    sd = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
    for key in ("model", "state_dict"):
        if isinstance(sd, dict) and key in sd and isinstance(sd[key], dict):
            sd = sd[key]
    if not isinstance(sd, dict):
        sys.exit(f"{args.checkpoint}: not a state dict (found {type(sd).__name__})")
    sd = {k[len("module."):] if k.startswith("module.") else k: v for k, v in sd.items()}
    sd = {k: v for k, v in sd.items() if k not in ("pixel_mean", "pixel_std")}

    want = {k: tuple(v.shape) for k, v in sam_model_registry["vit_b"]().state_dict().items()}
    missing = sorted(set(want) - set(sd))
    extra = sorted(set(sd) - set(want))
    wrong = sorted(k for k in set(want) & set(sd) if tuple(sd[k].shape) != want[k])
    if missing or extra or wrong:
        sys.exit(
            f"{args.checkpoint} is not a SAM ViT-B checkpoint: missing {missing[:5]}, "
            f"unexpected {extra[:5]}, wrong shape {wrong[:5]}"
        )
    out = {k: v.detach().to(torch.float32).contiguous() for k, v in sd.items()}
    save_file(out, args.output)
    print(f"source {args.checkpoint} sha256 {sha256(args.checkpoint)}")
    print(f"wrote {args.output}: {len(out)} tensors, {sum(v.numel() for v in out.values())} parameters")


if __name__ == "__main__":
    main()
