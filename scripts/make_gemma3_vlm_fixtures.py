#!/usr/bin/env python3
"""Reference fixtures for Hilum's Gemma 3 multimodal model (MedGemma 4B's architecture).

Writes into crates/hilum-llm-local/tests/fixtures/gemma3_vlm/:
- tiny/: a seeded TINY Gemma3ForConditionalGeneration saved by save_pretrained (config.json +
  model.safetensors, f32) and reference.safetensors + reference.json: the two test images (u8),
  the image processor's pixel values, the image features (projector output), the logits of every
  position of a prompt with two images and a text-only turn, and greedy tokens from `generate`.
  The tiny vocabulary has no tokenizer: the prompt is written as token ids laid out as the
  chat template and Gemma3Processor lay them out (the real SentencePiece tokenizer is proven
  separately against llama.cpp).
- medgemma_4b_params.json: the parameter names and shapes of MedGemma 4B as its checkpoint
  stores them, from transformers' model built on the meta device with the published config.

Install: python3 -m venv scripts/.venv-vlm && scripts/.venv-vlm/bin/pip install -r scripts/requirements-vlm.txt
Run:     scripts/.venv-vlm/bin/python scripts/make_gemma3_vlm_fixtures.py
"""

import json
import re
import sys
from pathlib import Path

import numpy as np
import gguf
import torch
from PIL import Image
from safetensors.torch import save_file, load_file
from transformers import Gemma3Config, Gemma3ForConditionalGeneration
from transformers.models.gemma3.image_processing_gemma3 import Gemma3ImageProcessor

OUT = Path(__file__).resolve().parent.parent / "crates/hilum-llm-local/tests/fixtures/gemma3_vlm"

# Token ids of the tiny vocabulary (the real model's are in brackets).
PAD, EOS, BOS = 0, 1, 2
START_TURN, END_TURN = 105, 106  # <start_of_turn>, <end_of_turn> (105, 106)
NL, NL2 = 107, 108  # "\n", "\n\n" (107, 108)
USER, MODEL = 20, 21  # the words "user" and "model"
BOI, EOI = 255, 256  # <start_of_image>, <end_of_image> (255999, 256000)
IMAGE = 262  # <image_soft_token> (262144)
VOCAB = 300

MM_TOKENS = 16


def tiny_config() -> Gemma3Config:
    text = dict(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=88,
        num_hidden_layers=3,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=20,
        # Differs from head_dim so the query scale is read from the config.
        query_pre_attn_scalar=24,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_local_base_freq=1000.0,
        # MedGemma 4B scales its global rotary positions linearly (factor 8).
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        # Shorter than an image block (16 tokens), so the bidirectional image mask reaches past
        # the window of the local layers.
        sliding_window=10,
        # Layers 0 and 2 local, layer 1 global.
        sliding_window_pattern=2,
        max_position_embeddings=256,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=BOS,
    )
    vision = dict(
        hidden_size=36,
        intermediate_size=50,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_channels=3,
        image_size=32,
        patch_size=4,  # 8x8 patches, pooled 2x2 -> 4x4 = 16 soft tokens
        layer_norm_eps=1e-6,
        vision_use_head=False,
    )
    return Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=MM_TOKENS,
        boi_token_index=BOI,
        eoi_token_index=EOI,
        image_token_index=IMAGE,
        attn_implementation="eager",
    )


def medgemma_4b_config() -> Gemma3Config:
    """google/medgemma-4b-it's published config.json (the same architecture as gemma-3-4b-it)."""
    return Gemma3Config(
        text_config=dict(
            hidden_size=2560,
            intermediate_size=10240,
            num_hidden_layers=34,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            query_pre_attn_scalar=256,
            rms_norm_eps=1e-6,
            rope_theta=1_000_000.0,
            rope_local_base_freq=10_000.0,
            rope_scaling={"factor": 8.0, "rope_type": "linear"},
            sliding_window=1024,
            sliding_window_pattern=6,
            vocab_size=262208,
            max_position_embeddings=131072,
        ),
        vision_config=dict(
            hidden_size=1152,
            intermediate_size=4304,
            num_hidden_layers=27,
            num_attention_heads=16,
            image_size=896,
            patch_size=14,
            layer_norm_eps=1e-6,
            vision_use_head=False,
        ),
        mm_tokens_per_image=256,
        boi_token_index=255999,
        eoi_token_index=256000,
        image_token_index=262144,
        eos_token_id=[1, 106],
    )


def image_span():
    # Gemma3Processor replaces each <start_of_image> by "\n\n<start_of_image>" + 256 x
    # <image_soft_token> + "<end_of_image>\n\n".
    return [NL2, BOI] + [IMAGE] * MM_TOKENS + [EOI, NL2]


def prompt_ids():
    """Two images and a question, a model answer, then a text-only question; ends with the
    generation prompt (the Gemma 3 chat template: <start_of_turn>user\\n ... <end_of_turn>\\n)."""
    words1 = [40, 41, 42, 43, 44]
    answer = [50, 51, 52, 53]
    words2 = [60, 61, 62, 63, 64, 65]
    ids = [BOS, START_TURN, USER, NL]
    ids += image_span() + [30, 31] + image_span() + words1
    ids += [END_TURN, NL, START_TURN, MODEL, NL] + answer + [END_TURN, NL]
    ids += [START_TURN, USER, NL] + words2 + [END_TURN, NL, START_TURN, MODEL, NL]
    return ids


def test_images():
    rng = np.random.default_rng(7)
    # An RGB image smaller than one axis of the model's input and larger than the other.
    h, w = 45, 27
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([x * 255 / w, y * 255 / h, (x + y) * 3 % 256], axis=-1)
    rgb = np.clip(rgb + rng.normal(0, 20, rgb.shape), 0, 255).astype(np.uint8)
    # A grey "radiograph", converted to RGB by the processor.
    gh, gw = 70, 53
    yy, xx = np.mgrid[0:gh, 0:gw]
    grey = 128 + 90 * np.sin(xx / 6.0) * np.cos(yy / 9.0) + rng.normal(0, 15, (gh, gw))
    grey = np.clip(grey, 0, 255).astype(np.uint8)
    return rgb, grey


def published_names(state_dict_names):
    """transformers >= 4.52 names the parameters model.language_model.* etc.; checkpoints (the
    published MedGemma files and save_pretrained's output) keep the original names."""
    rules = [
        (r"^model\.language_model", "language_model.model"),
        (r"^model\.vision_tower", "vision_tower"),
        (r"^model\.multi_modal_projector", "multi_modal_projector"),
    ]
    out = []
    for n in state_dict_names:
        if n == "lm_head.weight":
            continue  # tied to the embeddings, not stored
        for pat, rep in rules:
            n2 = re.sub(pat, rep, n)
            if n2 != n:
                n = n2
                break
        out.append(n)
    return out


def make_tiny():
    torch.manual_seed(1234)
    cfg = tiny_config()
    model = Gemma3ForConditionalGeneration(cfg).eval()
    # Non-trivial weights everywhere: random norms (Gemma's (1 + w) form is then tested), larger
    # projector and embedding scales so image features matter to the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.3)
            else:
                p.copy_(torch.randn_like(p) * 0.08)
        model.model.multi_modal_projector.mm_input_projection_weight.mul_(4.0)
        # Smaller token embeddings, so the tied output layer does not just repeat the last token.
        model.model.language_model.embed_tokens.weight.mul_(0.25)
        model.model.vision_tower.vision_model.embeddings.position_embedding.weight.mul_(4.0)

    d = OUT / "tiny"
    d.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(d, safe_serialization=True)
    (d / "generation_config.json").unlink(missing_ok=True)  # not read by Hilum
    saved = load_file(d / "model.safetensors")
    expected = published_names(model.state_dict().keys())
    assert sorted(saved.keys()) == sorted(expected), (sorted(saved.keys()), sorted(expected))

    rgb, grey = test_images()
    proc = Gemma3ImageProcessor(size={"height": 32, "width": 32})
    pil = [Image.fromarray(rgb), Image.fromarray(grey)]  # RGB and L
    pixel_values = proc(images=pil, return_tensors="pt")["pixel_values"].float()
    assert pixel_values.shape == (2, 3, 32, 32), pixel_values.shape

    ids = prompt_ids()
    input_ids = torch.tensor([ids])
    token_type_ids = (input_ids == IMAGE).long()
    with torch.no_grad():
        features = model.get_image_features(pixel_values)
        out = model(
            input_ids=input_ids,
            pixel_values=pixel_values,
            token_type_ids=token_type_ids,
            attention_mask=torch.ones_like(input_ids),
        )
        logits = out.logits[0].float()
        gen = model.generate(
            input_ids=input_ids,
            pixel_values=pixel_values,
            token_type_ids=token_type_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=PAD,
            output_scores=True,
            return_dict_in_generate=True,
        )
        # The smallest top-1 / top-2 gap of the greedy steps: no near tie to flip.
        margin = min(float(sc[0].topk(2).values[0] - sc[0].topk(2).values[1]) for sc in gen.scores)
        gen = gen.sequences
        # The same prompt with no image bidirectionality (token types all 0): shows the mask matters.
        causal = model(
            input_ids=input_ids,
            pixel_values=pixel_values,
            attention_mask=torch.ones_like(input_ids),
        ).logits[0].float()
    greedy = gen[0, len(ids):].tolist()

    save_file(
        {
            "image0_rgb": torch.from_numpy(rgb.copy()),
            "image1_grey": torch.from_numpy(grey.copy()),
            "pixel_values": pixel_values.contiguous(),
            "image_features": features.float().contiguous(),
            "logits": logits.contiguous(),
        },
        d / "reference.safetensors",
    )
    (d / "reference.json").write_text(
        json.dumps(
            {
                "prompt_ids": ids,
                "greedy": greedy,
                "max_new_tokens": 12,
                "causal_only_max_logit_diff": float((causal - logits).abs().max()),
                "greedy_min_top2_margin": margin,
                "transformers": __import__("transformers").__version__,
                "torch": torch.__version__,
            },
            indent=1,
        )
        + "\n"
    )
    make_gguf(model, cfg, d)
    print(
        f"tiny: {sum(p.numel() for p in model.parameters())} parameters, prompt {len(ids)} tokens,"
        f" greedy {greedy} (min margin {margin:.3f}), mask effect {float((causal - logits).abs().max()):.3f}"
    )


def vocab():
    tokens = [f"<unused{i}>" for i in range(VOCAB)]
    for i, t in [(PAD, "<pad>"), (EOS, "<eos>"), (BOS, "<bos>"), (START_TURN, "<start_of_turn>"),
                 (END_TURN, "<end_of_turn>"), (NL, "\n"), (NL2, "\n\n"), (BOI, "<start_of_image>"),
                 (EOI, "<end_of_image>"), (IMAGE, "<image_soft_token>")]:
        tokens[i] = t
    return tokens


def write_gguf(path, arch, kv, tensors):
    w = gguf.GGUFWriter(str(path), arch)
    for key, (kind, val) in kv.items():
        if "." in key:
            getattr(w, f"add_{kind}")(key, val)  # a raw key
        else:
            getattr(w, f"add_{key}")(val)  # the writer's helper for `{arch}.<key>`
    for name, t in tensors:
        w.add_tensor(name, t.detach().float().contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def make_gguf(model, cfg, d):
    """The tiny model in llama.cpp's layout (convert_hf_to_gguf.py's Gemma3Model and
    Gemma3VisionModel, f32): a text GGUF (norm weights stored as 1 + w) and an mmproj GGUF (SigLIP
    names mapped to v.*, only mm.soft_emb_norm stored as 1 + w)."""
    t, v = cfg.text_config, cfg.vision_config
    sd = {k: p for k, p in model.state_dict().items()}
    text = []
    lm = "model.language_model."
    norms = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
    }
    mats = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    text.append(("token_embd.weight", sd[lm + "embed_tokens.weight"]))
    text.append(("output_norm.weight", sd[lm + "norm.weight"] + 1))
    for i in range(t.num_hidden_layers):
        for hf, gg in norms.items():
            text.append((f"blk.{i}.{gg}.weight", sd[f"{lm}layers.{i}.{hf}.weight"] + 1))
        for hf, gg in mats.items():
            text.append((f"blk.{i}.{gg}.weight", sd[f"{lm}layers.{i}.{hf}.weight"]))
    write_gguf(
        d / "text.gguf",
        "gemma3",
        {
            "context_length": ("uint32", t.max_position_embeddings),
            "embedding_length": ("uint32", t.hidden_size),
            "block_count": ("uint32", t.num_hidden_layers),
            "feed_forward_length": ("uint32", t.intermediate_size),
            "head_count": ("uint32", t.num_attention_heads),
            "head_count_kv": ("uint32", t.num_key_value_heads),
            "key_length": ("uint32", t.head_dim),
            "value_length": ("uint32", t.head_dim),
            "layer_norm_rms_eps": ("float32", t.rms_norm_eps),
            "rope_freq_base": ("float32", t.rope_theta),
            "sliding_window": ("uint32", t.sliding_window),
            "rope_scaling_type": ("", gguf.RopeScalingType.LINEAR),
            "rope_scaling_factor": ("float32", t.rope_scaling["factor"]),
            # Not written by llama.cpp's converter (it assumes 10 000 and every sixth layer).
            "gemma3.rope.freq_base_swa": ("float32", t.rope_local_base_freq),
            "gemma3.attention.sliding_window_pattern": ("uint32", 2),
            # Placeholder pieces; only the special tokens' ids are read.
            "tokenizer.ggml.tokens": ("array", vocab()),
        },
        text,
    )
    vm = "model.vision_tower.vision_model."
    vis = [
        ("v.patch_embd.weight", sd[vm + "embeddings.patch_embedding.weight"]),
        ("v.patch_embd.bias", sd[vm + "embeddings.patch_embedding.bias"]),
        ("v.position_embd.weight", sd[vm + "embeddings.position_embedding.weight"]),
        ("v.post_ln.weight", sd[vm + "post_layernorm.weight"]),
        ("v.post_ln.bias", sd[vm + "post_layernorm.bias"]),
        ("mm.input_projection.weight", sd["model.multi_modal_projector.mm_input_projection_weight"]),
        ("mm.soft_emb_norm.weight", sd["model.multi_modal_projector.mm_soft_emb_norm.weight"] + 1),
    ]
    blk = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.out_proj": "attn_out",
        "layer_norm1": "ln1",
        "layer_norm2": "ln2",
        "mlp.fc1": "ffn_up",
        "mlp.fc2": "ffn_down",
    }
    for i in range(v.num_hidden_layers):
        for hf, gg in blk.items():
            for kind in ("weight", "bias"):
                vis.append((f"v.blk.{i}.{gg}.{kind}", sd[f"{vm}encoder.layers.{i}.{hf}.{kind}"]))
    write_gguf(
        d / "mmproj.gguf",
        "clip",
        {
            "clip.projector_type": ("string", "gemma3"),
            "clip.has_vision_encoder": ("bool", True),
            "clip.vision.image_size": ("uint32", v.image_size),
            "clip.vision.patch_size": ("uint32", v.patch_size),
            "clip.vision.embedding_length": ("uint32", v.hidden_size),
            "clip.vision.feed_forward_length": ("uint32", v.intermediate_size),
            "clip.vision.projection_dim": ("uint32", t.hidden_size),
            "clip.vision.block_count": ("uint32", v.num_hidden_layers),
            "clip.vision.attention.head_count": ("uint32", v.num_attention_heads),
            "clip.vision.attention.layer_norm_epsilon": ("float32", v.layer_norm_eps),
            "clip.vision.image_mean": ("array", [0.5, 0.5, 0.5]),
            "clip.vision.image_std": ("array", [0.5, 0.5, 0.5]),
            "clip.vision.projector.scale_factor": ("uint32", 2),
        },
        vis,
    )


def make_full_names():
    cfg = medgemma_4b_config()
    with torch.device("meta"):
        model = Gemma3ForConditionalGeneration(cfg)
    sd = model.state_dict()
    names = published_names(sd.keys())
    by_new = dict(zip([n for n in sd.keys() if n != "lm_head.weight"], names))
    params = sorted([[by_new[k], list(v.shape)] for k, v in sd.items() if k != "lm_head.weight"])
    (OUT / "medgemma_4b_config.json").write_text(cfg.to_json_string())
    (OUT / "medgemma_4b_params.json").write_text(
        "[\n" + ",\n".join(json.dumps(p) for p in params) + "\n]\n"
    )
    total = sum(int(np.prod(s)) for _, s in params)
    print(f"medgemma 4b: {len(params)} tensors, {total} parameters")


if __name__ == "__main__":
    torch.set_num_threads(2)
    make_tiny()
    if "--tiny-only" not in sys.argv:
        make_full_names()
