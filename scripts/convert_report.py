#!/usr/bin/env python3
"""Packs a Hugging Face snapshot of a CheXpert-Plus report model into one safetensors file for
`hilum models import`: the weights under their own names, plus config.json and tokenizer.json in
the file's metadata (`hilum.config`, `hilum.tokenizer`), so the installed model is one file.

Usage: convert_report.py SNAPSHOT_DIR OUT.safetensors
  SNAPSHOT_DIR holds model.safetensors (or pytorch_model.bin), config.json and the tokenizer
  (tokenizer.json, or vocab.txt + tokenizer_config.json as the published repos have).
  e.g. huggingface-cli download IAMJB/chexpert-mimic-cxr-findings-baseline --local-dir snap
Needs: safetensors and numpy; torch for pytorch_model.bin; transformers for vocab.txt
(pip install -r scripts/fixtures/requirements-report.txt).
"""
import json
import os
import sys


def load_tensors(snap):
    st = os.path.join(snap, "model.safetensors")
    if os.path.exists(st):
        from safetensors.numpy import load_file
        return load_file(st)
    binf = os.path.join(snap, "pytorch_model.bin")
    if os.path.exists(binf):
        import torch
        sd = torch.load(binf, map_location="cpu", weights_only=True)
        return {k: v.float().numpy() for k, v in sd.items() if v.is_floating_point()}
    sys.exit(f"{snap}: no model.safetensors or pytorch_model.bin")


def tokenizer_json(snap):
    tj = os.path.join(snap, "tokenizer.json")
    if os.path.exists(tj):
        with open(tj) as f:
            return f.read()
    if os.path.exists(os.path.join(snap, "vocab.txt")):
        from transformers import BertTokenizerFast
        return BertTokenizerFast.from_pretrained(snap).backend_tokenizer.to_str()
    sys.exit(f"{snap}: no tokenizer.json or vocab.txt")


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    snap, out = sys.argv[1], sys.argv[2]
    if os.path.isfile(snap):
        snap = os.path.dirname(snap)
    with open(os.path.join(snap, "config.json")) as f:
        config = json.load(f)
    if config.get("model_type") != "vision-encoder-decoder":
        sys.exit(f"{snap}/config.json is not a vision-encoder-decoder model")
    tensors = load_tensors(snap)
    # The tied LM head is stored once (the word embeddings), as save_pretrained does.
    tensors.pop("decoder.cls.predictions.decoder.weight", None)
    tensors.pop("decoder.cls.predictions.decoder.bias", None)
    from safetensors.numpy import save_file
    meta = {"hilum.config": json.dumps(config), "hilum.tokenizer": tokenizer_json(snap)}
    save_file({k: v.astype("float32") for k, v in tensors.items()}, out, metadata=meta)
    n = sum(v.size for v in tensors.values())
    print(f"wrote {out}: {len(tensors)} tensors, {n / 1e6:.1f} M parameters, config and tokenizer embedded")


if __name__ == "__main__":
    main()
