#!/usr/bin/env python3
"""Prepares a Hugging Face LlavaForConditionalGeneration snapshot for `hilum models import`.

    python3 scripts/convert_llava.py SNAPSHOT_DIR OUT_DIR
    hilum models import llava-med-v1.5 OUT_DIR/model.safetensors

SNAPSHOT_DIR is a downloaded HF-format LLaVA repository (e.g. llava-hf/llava-1.5-7b-hf or an
HF conversion of LLaVA-Med v1.5): config.json, tokenizer.json and one or more *.safetensors
shards. OUT_DIR receives one model.safetensors (tensors copied byte for byte, dtype kept: f16
checkpoints stay f16, ~14 GB for 7B), config.json and tokenizer.json.

Names are written in the published layout (vision_tower.*, multi_modal_projector.*,
language_model.model.*, language_model.lm_head.*); checkpoints saved with transformers'
in-memory names (model.language_model.*, lm_head.*) are renamed. Checkpoints in the original
LLaVA repository layout (model.mm_projector.*, no vision tower) are refused: convert them with
transformers' models/llava/convert_llava_weights_to_hf.py first.

Needs only the Python standard library (no torch): it streams the shards.
"""

import json
import os
import shutil
import struct
import sys

RENAMES = [
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
]


def header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        h = json.loads(f.read(n))
    return h, 8 + n


def published_name(k):
    for new, old in RENAMES:
        if k.startswith(new):
            return old + k[len(new):]
    return k


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    src, out = sys.argv[1], sys.argv[2]
    for need in ("config.json", "tokenizer.json"):
        if not os.path.isfile(os.path.join(src, need)):
            print(f"error: {src} has no {need} (download the whole repository snapshot)")
            return 1
    index = os.path.join(src, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
    else:
        shards = sorted(
            f for f in os.listdir(src) if f.startswith("model") and f.endswith(".safetensors")
        )
    if not shards:
        print(f"error: no .safetensors in {src}; for pytorch_model*.bin snapshots load and "
              "save_pretrained(safe_serialization=True) with transformers first")
        return 1
    entries = []  # (name, dtype, shape, shard, start, end)
    for s in shards:
        h, base = header(os.path.join(src, s))
        for k, v in h.items():
            if k == "__metadata__":
                continue
            a, b = v["data_offsets"]
            entries.append((published_name(k), v["dtype"], v["shape"], s, base + a, base + b))
    names = [e[0] for e in entries]
    if len(set(names)) != len(names):
        print("error: a tensor name appears in two shards")
        return 1
    if any(n.startswith("model.mm_projector") for n in names) or not any(
        n.startswith("vision_tower.") for n in names
    ):
        print("error: this is the original LLaVA repository layout (or has no vision tower); "
              "convert it to the HF Llava layout with transformers' "
              "convert_llava_weights_to_hf.py first")
        return 1
    entries.sort(key=lambda e: e[0])
    meta, offset = {}, 0
    for name, dtype, shape, _, a, b in entries:
        meta[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + b - a]}
        offset += b - a
    head = json.dumps(meta, separators=(",", ":")).encode()
    head += b" " * ((8 - len(head) % 8) % 8)
    os.makedirs(out, exist_ok=True)
    dst = os.path.join(out, "model.safetensors")
    with open(dst + ".partial", "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        handles = {}
        for name, _, _, shard, a, b in entries:
            h = handles.get(shard) or handles.setdefault(shard, open(os.path.join(src, shard), "rb"))
            h.seek(a)
            left = b - a
            while left:
                chunk = h.read(min(left, 64 << 20))
                if not chunk:
                    print(f"error: {shard} is truncated")
                    return 1
                f.write(chunk)
                left -= len(chunk)
        for h in handles.values():
            h.close()
    os.replace(dst + ".partial", dst)
    for f in ("config.json", "tokenizer.json"):
        shutil.copyfile(os.path.join(src, f), os.path.join(out, f))
    print(f"wrote {dst}: {len(entries)} tensors, {offset / 1e9:.2f} GB; and config.json, "
          f"tokenizer.json in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
