"""Reference fixtures for SAM / MedSAM (crates/hilum-models/src/sam.rs).

Writes tests/fixtures/medsam/:
  sam_small.safetensors      seeded weights of a small SAM built from segment-anything's own
                             modules (ImageEncoderViT, PromptEncoder, MaskDecoder,
                             TwoWayTransformer): 128 px, patch 16, embed 32, depth 2, 2 heads,
                             window 3 (padded 8 -> 9), block 1 global
  sam_small_io.safetensors   the input image (1,3,128,128), the image embedding, the dense
                             positional encoding, and per prompt case the sparse/dense prompt
                             embeddings, every mask token's low-res logits and IoU predictions
  sam_small_config.json      the configuration, in the Rust `sam::Config` field names
  sam_small_cases.json       the prompts (box / points / labels / mask input), 128-px frame
  sam_vit_b_params.json      name -> shape of sam_model_registry["vit_b"]() (no checkpoint):
                             the state dict layout of medsam_vit_b.pth

Run: scripts/.venv-medsam/bin/python scripts/make_medsam_fixtures.py
(versions pinned in scripts/requirements-medsam.txt)
"""
import json
import os
from functools import partial

import torch
from safetensors.torch import save_file
from segment_anything import sam_model_registry
from segment_anything.modeling import (
    ImageEncoderViT,
    MaskDecoder,
    PromptEncoder,
    Sam,
    TwoWayTransformer,
)

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "medsam")

CFG = {
    "image_size": 128,
    "patch_size": 16,
    "encoder_embed_dim": 32,
    "encoder_depth": 2,
    "encoder_num_heads": 2,
    "window_size": 3,
    "global_attn_indexes": [1],
    "prompt_embed_dim": 32,
    "mask_in_chans": 8,
    "decoder_depth": 2,
    "decoder_num_heads": 2,
    "decoder_mlp_dim": 64,
    "num_multimask_outputs": 3,
    "iou_head_depth": 3,
    "iou_head_hidden_dim": 32,
}


def build_small(c):
    """build_sam.py's _build_sam with the sizes taken from `c`."""
    g = c["image_size"] // c["patch_size"]
    return Sam(
        image_encoder=ImageEncoderViT(
            depth=c["encoder_depth"],
            embed_dim=c["encoder_embed_dim"],
            img_size=c["image_size"],
            mlp_ratio=4,
            norm_layer=partial(torch.nn.LayerNorm, eps=1e-6),
            num_heads=c["encoder_num_heads"],
            patch_size=c["patch_size"],
            qkv_bias=True,
            use_rel_pos=True,
            global_attn_indexes=c["global_attn_indexes"],
            window_size=c["window_size"],
            out_chans=c["prompt_embed_dim"],
        ),
        prompt_encoder=PromptEncoder(
            embed_dim=c["prompt_embed_dim"],
            image_embedding_size=(g, g),
            input_image_size=(c["image_size"], c["image_size"]),
            mask_in_chans=c["mask_in_chans"],
        ),
        mask_decoder=MaskDecoder(
            num_multimask_outputs=c["num_multimask_outputs"],
            transformer=TwoWayTransformer(
                depth=c["decoder_depth"],
                embedding_dim=c["prompt_embed_dim"],
                mlp_dim=c["decoder_mlp_dim"],
                num_heads=c["decoder_num_heads"],
            ),
            transformer_dim=c["prompt_embed_dim"],
            iou_head_depth=c["iou_head_depth"],
            iou_head_hidden_dim=c["iou_head_hidden_dim"],
        ),
    ).eval()


def main():
    os.makedirs(OUT, exist_ok=True)
    torch.manual_seed(20260105)
    sam = build_small(CFG)
    # Every parameter random (SAM zero-initialises rel_pos, LayerNorms start at 1/0), so the
    # comparison exercises all of them.
    with torch.no_grad():
        for name, p in sam.state_dict().items():
            if p.dim() > 1 and "gaussian" not in name:
                p.copy_(torch.randn_like(p) / (p.numel() / p.shape[0]) ** 0.5)
            else:
                p.copy_(torch.randn_like(p) * 0.5)
    state = {k: v.contiguous() for k, v in sam.state_dict().items()}
    save_file(state, os.path.join(OUT, "sam_small.safetensors"))

    s = CFG["image_size"]
    low = 4 * (s // CFG["patch_size"])
    image = torch.rand(1, 3, s, s)
    cases = {
        "box": {"box": [20.0, 31.0, 97.0, 88.0], "points": [], "labels": []},
        "points": {"box": None, "points": [[40.0, 50.0], [90.0, 30.0]], "labels": [1.0, 0.0]},
        "box_point": {"box": [10.0, 12.0, 60.0, 70.0], "points": [[33.0, 41.0]], "labels": [1.0]},
        "box_mask": {"box": [50.0, 5.0, 120.0, 100.0], "points": [], "labels": [], "mask": True},
    }
    io = {"image": image}
    with torch.no_grad():
        emb = sam.image_encoder(image)
        io["embedding"] = emb
        pe = sam.prompt_encoder.get_dense_pe()
        io["dense_pe"] = pe
        for name, c in cases.items():
            pts = None
            if c["points"]:
                pts = (torch.tensor([c["points"]]), torch.tensor([c["labels"]]))
            box = torch.tensor([[c["box"]]]) if c["box"] is not None else None
            mask = None
            if c.get("mask"):
                mask = torch.randn(1, 1, low, low) * 3.0
                io[f"{name}_mask_input"] = mask
            sparse, dense = sam.prompt_encoder(points=pts, boxes=box, masks=mask)
            masks, iou = sam.mask_decoder.predict_masks(
                image_embeddings=emb,
                image_pe=pe,
                sparse_prompt_embeddings=sparse,
                dense_prompt_embeddings=dense,
            )
            single, single_iou = sam.mask_decoder(
                image_embeddings=emb,
                image_pe=pe,
                sparse_prompt_embeddings=sparse,
                dense_prompt_embeddings=dense,
                multimask_output=False,
            )
            assert torch.equal(single, masks[:, 0:1]) and torch.equal(single_iou, iou[:, 0:1])
            io[f"{name}_sparse"] = sparse
            io[f"{name}_dense"] = dense
            io[f"{name}_masks"] = masks
            io[f"{name}_iou"] = iou
    save_file({k: v.contiguous() for k, v in io.items()}, os.path.join(OUT, "sam_small_io.safetensors"))
    with open(os.path.join(OUT, "sam_small_config.json"), "w") as f:
        json.dump(CFG, f, indent=1)
    with open(os.path.join(OUT, "sam_small_cases.json"), "w") as f:
        json.dump(cases, f, indent=1)

    full = sam_model_registry["vit_b"]()
    names = {k: list(v.shape) for k, v in full.state_dict().items()}
    with open(os.path.join(OUT, "sam_vit_b_params.json"), "w") as f:
        json.dump(names, f, indent=0, sort_keys=True)

    for fn in sorted(os.listdir(OUT)):
        print(f"wrote {os.path.join('tests/fixtures/medsam', fn)} ({os.path.getsize(os.path.join(OUT, fn))} bytes)")
    print(f"small SAM: {sum(v.numel() for v in state.values())} parameters; ViT-B: {len(names)} tensors, "
          f"{sum(torch.Size(v).numel() for v in names.values())} parameters; torch {torch.__version__}")


if __name__ == "__main__":
    main()
