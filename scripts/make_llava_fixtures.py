#!/usr/bin/env python3
"""Reference fixtures for Hilum's native LLaVA (crates/hilum-models/src/llava.rs).

Builds TINY `LlavaForConditionalGeneration` models with Hugging Face transformers (CLIP vision
tower, 2-layer MLP projector with GELU, Llama or Mistral text model) from seeded weights, runs
them on a real radiograph preprocessed by the Hugging Face image processors, and writes to
tests/fixtures/llava/:

  <name>/model.safetensors   weights as `save_pretrained` writes them (the published layout:
                             vision_tower.vision_model.*, multi_modal_projector.*,
                             language_model.model.*, language_model.lm_head.weight)
  <name>/config.json         the HF LlavaConfig
  <name>/tokenizer.json      a tiny BPE tokenizer (Llama-style: "▁" for spaces, <s> prepended)
  <name>/reference.safetensors
      pixel_values           (1, 3, S, S) what the processor made of the radiograph
      input_ids              (1, T) prompt with <image> expanded to one token per patch
      prompt_ids             (1, t) prompt as tokenised, one <image> token
      logits                 (1, T, V) full forward of the prompt
      greedy_ids             (1, N) greedy continuation (generate, KV cache, do_sample=False)
      greedy_logits          (1, T + N - 1, V) full forward of prompt + continuation (no cache)
  <name>/reference.json      prompt, decoded answer, preprocessing, margins, versions
  full_size_params.json      name -> shape of the full-size llava-1.5-7b and
                             llava-med-v1.5-mistral-7b layouts (meta device, no RAM)

Run: scripts/.venv-llava/bin/python scripts/make_llava_fixtures.py
(venv: python3 -m venv scripts/.venv-llava && scripts/.venv-llava/bin/pip install -r
scripts/requirements-llava.txt)
"""

import json
import os
import sys

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file
import tokenizers
from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
import transformers
from transformers import (
    CLIPImageProcessor,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    MistralConfig,
    PreTrainedTokenizerFast,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "llava")
IMAGE = os.path.join(ROOT, "..", "shared", "data", "cxr", "images", "medrax_effusion1.png")
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
IMAGE_SIZE = 28
PATCH = 7
MAX_NEW_TOKENS = 12

CORPUS = [
    "is there a pleural effusion on the left side",
    "the heart is enlarged and the lungs are clear",
    "no pneumothorax is seen and the lines are in place",
    "what is the abnormality in this chest x ray",
    "there is an opacity in the right lower lobe",
    "the cardiac silhouette is normal in size",
    "describe the findings of this radiograph",
    "small bilateral effusions with basal atelectasis",
    "[INST] is the mediastinum widened [/INST]",
    "USER: where is the tube ASSISTANT: in the trachea",
]


def tiny_tokenizer():
    """A Llama-style BPE tokenizer (legacy SentencePiece layout in tokenizer.json)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=118, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens(["<image>", "<pad>"])
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tok


def llava_config(text, vocab, image_token):
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
        projection_dim=32,
        hidden_act="quick_gelu",
        layer_norm_eps=1e-5,
    )
    common = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=image_token + 1,
        tie_word_embeddings=False,
    )
    if text == "llama":
        tc = LlamaConfig(rope_theta=10000.0, **common)
    else:
        tc = MistralConfig(rope_theta=1000000.0, sliding_window=None, **common)
    return LlavaConfig(
        vision_config=vision,
        text_config=tc,
        image_token_index=image_token,
        projector_hidden_act="gelu",
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        image_seq_length=(IMAGE_SIZE // PATCH) ** 2,
    )


def seeded(model, seed):
    """Weights large enough that logits spread (greedy has clear winners)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name or "layrnorm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * noise)
            else:
                p.copy_(0.15 * noise)


def processor_for(tok, aspect):
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        do_center_crop=True,
        do_resize=True,
        resample=3,  # bicubic, as in openai/clip-vit-large-patch14-336
        image_mean=CLIP_MEAN,
        image_std=CLIP_STD,
        do_convert_rgb=True,
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token="<image>",
    ), aspect


def expand2square(img, colour):
    """LLaVA-1.5's `image_aspect_ratio = "pad"` (llava/mm_utils.py): pad to a square with the
    processor's mean colour, image centred."""
    w, h = img.size
    if w == h:
        return img
    side = max(w, h)
    out = Image.new(img.mode, (side, side), colour)
    out.paste(img, ((side - w) // 2, (side - h) // 2))
    return out


def make(name, text, seed, aspect, template, question, tok_json):
    prompt = template.replace("{question}", question)
    torch.manual_seed(seed)
    d = os.path.join(OUT, name)
    os.makedirs(d, exist_ok=True)
    raw = Tokenizer.from_str(tok_json)
    image_token = raw.token_to_id("<image>")
    vocab = 128
    cfg = llava_config(text, vocab, image_token)
    model = LlavaForConditionalGeneration(cfg).eval()
    seeded(model, seed)
    model.save_pretrained(d, safe_serialization=True)
    with open(os.path.join(d, "tokenizer.json"), "w") as f:
        f.write(tok_json)
    keys = sorted(json.load(open(os.path.join(d, "model.safetensors.index.json")))["weight_map"]) \
        if os.path.exists(os.path.join(d, "model.safetensors.index.json")) else None
    assert keys is None, "tiny model must be one file"

    fast = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=["<image>"],
    )
    processor, aspect = processor_for(fast, aspect)
    img = Image.open(IMAGE).convert("RGB")
    if aspect == "pad":
        img = expand2square(img, tuple(int(m * 255) for m in CLIP_MEAN))
    inputs = processor(images=img, text=prompt, return_tensors="pt")
    prompt_ids = torch.tensor([raw.encode(prompt).ids])
    n_img = int((inputs["input_ids"] == image_token).sum())
    assert n_img == (IMAGE_SIZE // PATCH) ** 2, n_img

    with torch.no_grad():
        out = model(input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"])
        gen = model.generate(
            input_ids=inputs["input_ids"],
            pixel_values=inputs["pixel_values"],
            attention_mask=inputs["attention_mask"],
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            num_beams=1,
            eos_token_id=cfg.text_config.eos_token_id,
            pad_token_id=cfg.text_config.pad_token_id,
        )
        t = inputs["input_ids"].shape[1]
        greedy = gen[:, t:]
        full = torch.cat([inputs["input_ids"], greedy[:, :-1]], dim=1)
        out_full = model(input_ids=full, pixel_values=inputs["pixel_values"])
    # Margins between best and second-best logit along the greedy path: ties would make
    # token-for-token comparisons meaningless.
    lg = out_full.logits[0, t - 1 :]
    top2 = torch.topk(lg, 2, dim=-1).values
    margins = (top2[:, 0] - top2[:, 1]).tolist()
    assert min(margins) > 1e-3, margins

    save_file(
        {
            "pixel_values": inputs["pixel_values"].float().contiguous(),
            "input_ids": inputs["input_ids"].to(torch.int64).contiguous(),
            "prompt_ids": prompt_ids.to(torch.int64).contiguous(),
            "logits": out.logits.float().contiguous(),
            "greedy_ids": greedy.to(torch.int64).contiguous(),
            "greedy_logits": out_full.logits.float().contiguous(),
        },
        os.path.join(d, "reference.safetensors"),
    )
    answer = raw.decode(greedy[0].tolist(), skip_special_tokens=True)
    meta = {
        "prompt": prompt,
        "prompt_template": template,
        "question": question,
        "image": "../shared/data/cxr/images/" + os.path.basename(IMAGE),
        "image_aspect_ratio": aspect,
        "image_size": IMAGE_SIZE,
        "resample": "bicubic",
        "answer": answer,
        "greedy_ids": greedy[0].tolist(),
        "max_new_tokens": MAX_NEW_TOKENS,
        "min_greedy_margin": min(margins),
        "text_model": text,
        "seed": seed,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }
    with open(os.path.join(d, "reference.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(f"wrote {d}: {len(list(model.state_dict()))} tensors, prompt {t} tokens, "
          f"greedy {greedy[0].tolist()} -> {answer!r}, min margin {min(margins):.4f}")


def full_size_lists():
    """Names and shapes of the full-size checkpoints, as save_pretrained writes them."""
    clip_l_336 = CLIPVisionConfig(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        image_size=336,
        patch_size=14,
        projection_dim=768,
        hidden_act="quick_gelu",
    )
    configs = {
        # llava-hf/llava-1.5-7b-hf: Vicuna-7B (Llama) text model, vocab padded to 32064.
        "llava-1.5-7b": LlavaConfig(
            vision_config=clip_l_336,
            text_config=LlamaConfig(
                vocab_size=32064,
                hidden_size=4096,
                intermediate_size=11008,
                num_hidden_layers=32,
                num_attention_heads=32,
                max_position_embeddings=4096,
                rms_norm_eps=1e-5,
            ),
            image_token_index=32000,
        ),
        # LLaVA-Med v1.5 (Mistral-7B-Instruct-v0.2 text model) in the HF Llava layout.
        "llava-med-v1.5-mistral-7b": LlavaConfig(
            vision_config=clip_l_336,
            text_config=MistralConfig(
                vocab_size=32064,
                hidden_size=4096,
                intermediate_size=14336,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=8,
                max_position_embeddings=32768,
                rope_theta=1000000.0,
                sliding_window=None,
                rms_norm_eps=1e-5,
            ),
            image_token_index=32000,
        ),
    }
    out = {}
    for name, cfg in configs.items():
        with torch.device("meta"):
            model = LlavaForConditionalGeneration(cfg)
        # save_pretrained writes the published names: undo the in-memory renaming.
        reverse = {v: k for k, v in model._checkpoint_conversion_mapping.items()}
        params = {}
        for k, v in model.state_dict().items():
            for new, old in reverse.items():
                if k.startswith(new.lstrip("^")):
                    k = old.lstrip("^") + k[len(new.lstrip("^")):]
                    break
            params[k] = list(v.shape)
        out[name] = {"config": cfg.to_diff_dict(), "params": dict(sorted(params.items()))}
        print(f"{name}: {len(params)} tensors, "
              f"{sum(int(np.prod(s)) for s in params.values()) / 1e9:.2f} B parameters")
    path = os.path.join(OUT, "full_size_params.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
    print(f"wrote {path}")


def main():
    os.makedirs(OUT, exist_ok=True)
    tok_json = tiny_tokenizer().to_str(pretty=True)
    question = "is there a pleural effusion?"
    # llava-hf/llava-1.5 style: Llama, CLIPImageProcessor centre crop, USER/ASSISTANT prompt.
    make("tiny_llama", "llama", 7, "crop", "USER: <image>\n{question} ASSISTANT:", question,
         tok_json)
    # LLaVA-Med v1.5 style (models/llava-med-v1.5.toml): Mistral, pad to square,
    # mistral_instruct prompt.
    make("tiny_mistral", "mistral", 11, "pad", "[INST] <image>\n{question} [/INST]", question,
         tok_json)
    full_size_lists()


if __name__ == "__main__":
    sys.exit(main())
