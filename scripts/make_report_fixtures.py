#!/usr/bin/env python3
"""Reference fixtures for Hilum's SwinV2 + BERT report model (crates/hilum-models/src/report).

Builds tiny Hugging Face `VisionEncoderDecoderModel`s (Swinv2Model encoder, BertLMHeadModel
decoder with cross-attention) with seeded weights and a tiny WordPiece tokenizer, and saves for
each: the checkpoint exactly as `save_pretrained` writes it, config.json, tokenizer.json,
input pixels, encoder output, decoder logits for a prefix, greedy and beam-search token ids and
their decoded text. Also dumps the parameter names/shapes of the full-size architecture of the
CheXpert-Plus baselines (SwinV2-Tiny + 2-layer BERT, random init).

Run:  python3 -m venv scripts/.venv-report
      scripts/.venv-report/bin/pip install -r scripts/requirements-report.txt
      scripts/.venv-report/bin/python scripts/make_report_fixtures.py
"""
import json
import os
import sys
import tempfile

import torch
import transformers
from safetensors.torch import save_file
from transformers import (
    BertConfig,
    BertLMHeadModel,
    BertTokenizerFast,
    GenerationConfig,
    Swinv2Config,
    Swinv2Model,
    VisionEncoderDecoderModel,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "report")

WORDS = (
    "the heart size is normal mediastinal contour lungs are clear no pleural effusion "
    "pneumothorax or focal consolidation there mild cardiomegaly small left right basilar "
    "atelectasis opacity stable compared with prior radiograph lines tubes in place "
    "degenerative changes of spine acute cardiopulmonary process"
).split()
PIECES = ["##s", "##ed", "##ing", "##al", "##ly", "##ic", "##ion", "##ity"]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def write_tokenizer(dirname):
    vocab = SPECIALS + [".", ",", ";", ":", "-", "/", "(", ")"] + sorted(set(WORDS)) + PIECES
    vocab += [f"w{i}" for i in range(100 - len(vocab))]
    path = os.path.join(dirname, "vocab.txt")
    with open(path, "w") as f:
        f.write("\n".join(vocab) + "\n")
    tok = BertTokenizerFast(vocab_file=path, do_lower_case=True)
    tok.save_pretrained(dirname)
    return tok, len(vocab)


def seed_weights(model, seed, eos_id, eos_boost):
    """Weights large enough that logits are well separated (no near-ties in top-k)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if "LayerNorm.weight" in name or "layernorm" in name.split(".")[-2:][0] or name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * r) if name.endswith("weight") else p.copy_(0.1 * r)
            elif name.endswith("logit_scale"):
                p.copy_(torch.log(torch.full(p.shape, 10.0)) + 0.3 * r)
            elif p.dim() == 1:
                p.copy_(0.1 * r)
            else:
                fan_in = p[0].numel()
                p.copy_(r * (1.5 / fan_in**0.5))
        model.decoder.cls.predictions.bias[eos_id] += eos_boost
    model.tie_weights()


def min_gap(logits):
    top = torch.topk(logits, 2, dim=-1).values
    return float((top[..., 0] - top[..., 1]).min())


# max_length is never 20: transformers adds the prompt length to a max_length equal to its
# default (20), a quirk Hilum does not copy.
CASES = {
    # Windows that do not divide the map (padding), shifts in both stages, an input whose
    # size is not a multiple of the patch, odd maps before patch merging; equal widths.
    "tiny_pad": dict(
        encoder=dict(image_size=32, patch_size=4, num_channels=3, embed_dim=16, depths=[2, 2],
                     num_heads=[2, 4], window_size=3, mlp_ratio=2.0),
        decoder=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64),
        pixels=(34, 30), seed=1, eos_boost=4.2,
        generation=[dict(num_beams=1, max_length=16), dict(num_beams=3, max_length=16),
                    dict(num_beams=2, max_length=24, length_penalty=0.7)],
    ),
    # Encoder narrower than the decoder (enc_to_dec_proj), a pretrained window size, three
    # stages, the last one fitting in a single window (no shift).
    "tiny_proj": dict(
        encoder=dict(image_size=64, patch_size=4, num_channels=3, embed_dim=8, depths=[2, 2, 2],
                     num_heads=[2, 2, 4], window_size=4, pretrained_window_sizes=[6, 0, 0],
                     mlp_ratio=4.0),
        decoder=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=48, max_position_embeddings=64),
        pixels=(64, 64), seed=8, eos_boost=4.2,
        generation=[dict(num_beams=1, max_length=18), dict(num_beams=4, max_length=18),
                    dict(num_beams=3, max_length=18, early_stopping=True)],
    ),
}


def build(case, tok, vocab_size):
    enc = Swinv2Model(Swinv2Config(**case["encoder"]))
    dec_cfg = BertConfig(vocab_size=vocab_size, is_decoder=True, add_cross_attention=True,
                         pad_token_id=tok.pad_token_id, **case["decoder"])
    dec = BertLMHeadModel(dec_cfg)
    model = VisionEncoderDecoderModel(encoder=enc, decoder=dec)
    model.config.decoder_start_token_id = tok.cls_token_id
    model.config.eos_token_id = tok.sep_token_id
    model.config.pad_token_id = tok.pad_token_id
    return model.eval()


def make_case(name, case):
    d = os.path.join(OUT, name)
    os.makedirs(d, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tok, vocab_size = write_tokenizer(tmp)
        tok.backend_tokenizer.save(os.path.join(d, "tokenizer.json"))
        model = build(case, tok, vocab_size)
        seed_weights(model, case["seed"], tok.sep_token_id, case["eos_boost"])
        model.save_pretrained(d, safe_serialization=True)
    for extra in ("generation_config.json",):
        p = os.path.join(d, extra)
        if os.path.exists(p):
            os.remove(p)

    g = torch.Generator().manual_seed(case["seed"] + 100)
    w, h = case["pixels"]
    pixels = torch.randn((1, 3, h, w), generator=g)
    with torch.no_grad():
        enc_out = model.encoder(pixel_values=pixels).last_hidden_state
        prefix = torch.tensor([[tok.cls_token_id] + [int(x) for x in torch.randint(5, vocab_size, (6,), generator=g)]])
        logits = model(pixel_values=pixels, decoder_input_ids=prefix).logits
    runs = []
    for gen in case["generation"]:
        cfg = GenerationConfig(decoder_start_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id,
                               pad_token_id=tok.pad_token_id, bos_token_id=tok.cls_token_id, **gen)
        with torch.no_grad():
            out = model.generate(pixels, generation_config=cfg, output_scores=True,
                                 return_dict_in_generate=True)
        ids = out.sequences[0].tolist()
        gap = min(min_gap(s) for s in out.scores)
        runs.append(dict(settings=gen, ids=ids, text=tok.decode(ids, skip_special_tokens=True),
                         min_top2_gap=gap, ended_with_eos=ids[-1] == tok.sep_token_id))
    save_file({"pixel_values": pixels.contiguous(), "encoder_output": enc_out.contiguous(),
               "prefix_ids": prefix.contiguous(), "logits": logits.contiguous()},
              os.path.join(d, "reference.safetensors"))
    ref = dict(transformers=transformers.__version__, torch=torch.__version__,
               cls=tok.cls_token_id, sep=tok.sep_token_id, pad=tok.pad_token_id,
               generation=runs,
               decode_check=dict(ids=prefix[0].tolist() + [tok.sep_token_id],
                                 text=tok.decode(prefix[0].tolist() + [tok.sep_token_id],
                                                 skip_special_tokens=True)))
    with open(os.path.join(d, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
    print(f"wrote {d}: encoder {tuple(enc_out.shape)}, logits {tuple(logits.shape)}")
    for r in runs:
        print(f"  {r['settings']}: {len(r['ids'])} ids, eos={r['ended_with_eos']}, "
              f"min top-2 gap {r['min_top2_gap']:.4f}: {r['text']!r}")
        if r["min_top2_gap"] < 1e-3:
            print("  WARNING: near-tie in the scores; change the seed", file=sys.stderr)


def full_size_names():
    """The CheXpert-Plus baselines: SwinV2-Tiny (patch 4, window 8, 256 px) + 2-layer BERT."""
    enc = Swinv2Model(Swinv2Config(image_size=256, patch_size=4, embed_dim=96, depths=[2, 2, 6, 2],
                                   num_heads=[3, 6, 12, 24], window_size=8))
    vocab = 30522  # placeholder: the tests read it back from this file
    dec = BertLMHeadModel(BertConfig(vocab_size=vocab, hidden_size=768, num_hidden_layers=2,
                                     num_attention_heads=12, intermediate_size=3072,
                                     max_position_embeddings=512, is_decoder=True,
                                     add_cross_attention=True))
    model = VisionEncoderDecoderModel(encoder=enc, decoder=dec)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        from safetensors import safe_open
        with safe_open(os.path.join(tmp, "model.safetensors"), "pt") as f:
            shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    path = os.path.join(OUT, "full_size_params.json")
    with open(path, "w") as f:
        json.dump(dict(transformers=transformers.__version__, vocab_size=vocab,
                       encoder=enc.config.to_diff_dict(), params=shapes), f, indent=0, sort_keys=True)
    n = sum(torch.Size(s).numel() for s in shapes.values())
    print(f"wrote {path}: {len(shapes)} tensors, {n / 1e6:.2f} M parameters at vocab {vocab}")


if __name__ == "__main__":
    torch.manual_seed(0)
    os.makedirs(OUT, exist_ok=True)
    for name, case in CASES.items():
        make_case(name, case)
    full_size_names()
