#!/usr/bin/env python3
"""A random mid-size LLaVA for speed measurements of the native backend (not for answers):
the real vision side of LLaVA-1.5 / LLaVA-Med (CLIP ViT-L/14 at 336 px, 576 image tokens,
projector) and a 4-layer Mistral-shaped decoder slice (hidden 4096, GQA 32/8, MLP 14336), so
per-layer costs are those of the 7B model. The vocabulary is the tiny fixture tokenizer's (128),
so answers decode to text; the real lm_head (32064 x 4096) costs about 0.6 of one layer.

    scripts/.venv-llava/bin/python scripts/make_llava_bench_model.py OUT_DIR
    HILUM_MODELS_DIR=/tmp/m target/release/hilum models import llava-med-v1.5 OUT_DIR/model.safetensors

Uses the tiny fixture tokenizer (its <image> id becomes image_token_index).
"""

import os
import shutil
import sys

import torch
from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration, MistralConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOK = os.path.join(ROOT, "tests", "fixtures", "llava", "tiny_mistral", "tokenizer.json")


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/llava_bench_model"
    torch.manual_seed(0)
    cfg = LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
            num_attention_heads=16, image_size=336, patch_size=14, projection_dim=768,
            hidden_act="quick_gelu",
        ),
        text_config=MistralConfig(
            vocab_size=128, hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
            rope_theta=1000000.0, sliding_window=None, rms_norm_eps=1e-5,
        ),
        image_token_index=118,  # <image> of the tiny tokenizer
    )
    model = LlavaForConditionalGeneration(cfg).eval().to(torch.float16)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="100GB")
    shutil.copyfile(TOK, os.path.join(out, "tokenizer.json"))
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {n / 1e9:.2f} B parameters (f16), config.json, tokenizer.json")


if __name__ == "__main__":
    main()
