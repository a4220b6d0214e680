#!/usr/bin/env python3
"""End-to-end preprocessing and score fixtures made by the reference Python pipelines on real
radiographs from ../shared/data/cxr/images (read there at test time, never copied here).

For each image (JPEG, 8-bit PNG gray/RGB/RGBA, 16-bit PNG) it writes to tests/fixtures/xrv_parity/:
  <stem>.xrv224.f32   torchxrayvision 1.5.7's own classifier input, (224, 224) float32 LE in its
                      [-1024, 1024] range: `xrv.utils.load_image` (skimage.io.imread, normalize by
                      255, first channel) for 8-bit files; for 16-bit files, where load_image
                      refuses values above 255, `xrv.datasets.normalize(img, 65535)`; then
                      `XRayCenterCrop()` and `XRayResizer(224)` (skimage.transform.resize,
                      order 1, mode "constant", anti-aliasing).
  <stem>.psp512.f32   the ChestX-Det PSPNet's first input plane as torchxrayvision's
                      `PSPNet.forward` builds it from the whole (uncropped) image resized by
                      `XRayResizer(512)`: `(x + 1024) / 2048`, ImageNet-normalised channel 0;
                      only the rows listed in the manifest (`rows`), all 512 columns.
  <stem>.medsam1024.u8 MedSAM_Inference.py's `img_1024` before min-max scaling (8-bit files
                      only): `skimage.transform.resize(img_3c, (1024, 1024), order=3,
                      preserve_range=True, anti_aliasing=True).astype(np.uint8)`, channel 0,
                      the manifest's rows only (its whole-image min and max are in the manifest).
  manifest.json       per image: size, kind, max value, the files above, the logits and the
                      calibrated scores (`op_norm`, published thresholds) of a full-size
                      torchxrayvision DenseNet-121 (`densenet121-res224-all` architecture) with
                      Hilum's seeded weights (`hilum_models::xrv::synthetic_weights(arch, SEED)`,
                      ported below), classifier weight and bias times CLASSIFIER_SCALE so that the
                      sigmoids do not saturate; and checksums of those weights.

Run: scripts/.venv-parity/bin/python scripts/make_xrv_parity_fixtures.py
(versions pinned in scripts/requirements-parity.txt)
"""
import hashlib
import json
import os
import sys

import numpy as np
import skimage
import skimage.io
import skimage.transform
import torch
import torchvision
import torchxrayvision as xrv

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "..", "shared", "data", "cxr", "images")
OUT = os.path.join(HERE, "..", "tests", "fixtures", "xrv_parity")

SEED = 11
# 2^-10: exact in f32 on both sides; the seeded network's logits are in the thousands.
CLASSIFIER_SCALE = 2.0 ** -10

# (file, kind). covid_ARDSSevere.png is left out: it is a colour image (R != G != B), where
# torchxrayvision keeps the red channel and Hilum the luminance, by design.
IMAGES = [
    ("medrax_normal3.jpg", "jpeg"),                      # 2544x3056, the benchmark image
    ("kermany_IM-0025-0001_normal.jpeg", "jpeg"),        # 2720x2458
    ("covid_2c35005f.jpg", "jpeg"),                      # 2000x2000
    ("medrax_normal2_lateral.jpg", "jpeg"),              # 1616x2022
    ("medrax_normal5_pediatric.jpg", "jpeg"),            # 1442x1101
    ("kermany_person1946_bacteria_4874.jpeg", "jpeg"),   # 968x592
    ("covid_12941_2020_358_Fig1_HTML.jpg", "jpeg_rgb"),  # 898x898, RGB JPEG
    ("nih_00009745_000_cardiomegaly.png", "png8"),       # 1024x1024 gray
    ("nih_00000100_000_effusion_multi.png", "png8_rgba"),
    ("nih_00000001_000_cardiomegaly.png", "png8"),       # 512x512
    ("tbx11k_h0001_healthy.png", "png8_rgb"),            # 512x512 RGB
    ("medrax_effusion1.png", "png8_rgb"),                # 512x624 RGB, upsampled for the PSPNet
    ("derived_RG1_chest_pa_16bit.png", "png16"),         # 920x977
    ("derived_CR-MONO1-10-chest_16bit.png", "png16"),    # 440x440, upsampled for the PSPNet
]

ROW_STRIDE = 32


def sampled_rows(n):
    """Border rows (where padding modes matter) and every ROW_STRIDE-th row."""
    return sorted(set([0, 1, 2, n - 3, n - 2, n - 1]) | set(range(0, n, ROW_STRIDE)))


def seeded(shapes, seed):
    """hilum_models::weights::seeded: xorshift64* draws in name order, f32 arithmetic."""
    mask = (1 << 64) - 1
    state = max(seed, 1)
    out = {}
    for name in sorted(shapes):
        shape = shapes[name]
        n = int(np.prod(shape)) if shape else 1
        draws = np.empty(n, dtype=np.uint64)
        s = state
        for i in range(n):
            s ^= s >> 12
            s = (s ^ (s << 25)) & mask
            s ^= s >> 27
            draws[i] = ((s * 0x2545F4914F6CDD1D) & mask) >> 40
        state = s
        u = draws.astype(np.float32) / np.float32(1 << 24) - np.float32(0.5)
        fan_in = max(int(np.prod(shape[1:])) if len(shape) > 1 else 1, 1)
        if name.endswith("running_var"):
            v = np.float32(1.0) + u
        elif name.endswith("running_mean") or name.endswith("bias"):
            v = np.float32(0.2) * u
        elif len(shape) == 1:
            v = np.float32(1.0) + np.float32(0.4) * u
        else:
            v = u * np.sqrt(np.float32(24.0) / np.float32(fan_in))
        out[name] = v.astype(np.float32).reshape(shape)
    return out


def seeded_densenet():
    model = xrv.models.DenseNet(weights=None)
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()
              if not k.endswith("num_batches_tracked") and k != "op_threshs"}
    weights = seeded(shapes, SEED)
    checks = {
        "tensors": len(weights),
        "sum": float(sum(np.float64(v).sum() for v in weights.values())),
        "sha256": hashlib.sha256(b"".join(weights[k].tobytes() for k in sorted(weights))).hexdigest(),
    }
    scale = np.float32(CLASSIFIER_SCALE)
    weights["classifier.weight"] = weights["classifier.weight"] * scale
    weights["classifier.bias"] = weights["classifier.bias"] * scale
    missing, unexpected = model.load_state_dict(
        {k: torch.from_numpy(v) for k, v in weights.items()}, strict=False)
    assert all(k.endswith("num_batches_tracked") or k == "op_threshs" for k in missing), missing
    assert not unexpected, unexpected
    model.eval()
    return model, checks


def xrv_input(path, kind):
    """The image in torchxrayvision's [-1024, 1024] range, shape (1, H, W)."""
    if kind == "png16":
        img = skimage.io.imread(path)
        assert img.dtype == np.uint16 and img.ndim == 2
        return xrv.datasets.normalize(img, 65535)[None, ...], 65535
    return xrv.utils.load_image(path), 255


def medsam_1024(path):
    """MedSAM_Inference.py's img_1024 (uint8), channel 0."""
    img_np = skimage.io.imread(path)
    if img_np.ndim == 2:
        img_3c = np.repeat(img_np[:, :, None], 3, axis=-1)
    else:
        img_3c = img_np[:, :, :3]
    img_1024 = skimage.transform.resize(
        img_3c, (1024, 1024), order=3, preserve_range=True, anti_aliasing=True
    ).astype(np.uint8)
    return img_1024[:, :, 0]


def main():
    os.makedirs(OUT, exist_ok=True)
    torch.set_num_threads(2)
    model, checks = seeded_densenet()
    threshs = torch.tensor(xrv.models.model_urls["densenet121-res224-all"]["op_threshs"],
                           dtype=torch.float32)
    crop_resize = torchvision.transforms.Compose(
        [xrv.datasets.XRayCenterCrop(), xrv.datasets.XRayResizer(224)])
    resize512 = xrv.datasets.XRayResizer(512)
    normalize = torchvision.transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    records = []
    for name, kind in IMAGES:
        path = os.path.join(DATA, name)
        stem = os.path.splitext(name)[0]
        img, maxval = xrv_input(path, kind)
        _, h, w = img.shape
        x224 = crop_resize(img)
        assert x224.shape == (1, 224, 224) and x224.dtype == np.float32
        x224.tofile(os.path.join(OUT, f"{stem}.xrv224.f32"))
        with torch.no_grad():
            logits = model.classifier(model.features2(torch.from_numpy(x224)[None]))[0]
            scores = xrv.models.op_norm(torch.sigmoid(logits)[None], threshs)[0]
        # PSPNet.forward on the whole image resized to 512 (repeat, scale to [0, 1], ImageNet).
        x512 = torch.from_numpy(resize512(img))[None].repeat(1, 3, 1, 1)
        x512 = normalize((x512 + 1024) / 2048)[0, 0].numpy().astype(np.float32)
        rows512 = sampled_rows(512)
        x512[rows512].tofile(os.path.join(OUT, f"{stem}.psp512.f32"))
        rec = {
            "file": name, "kind": kind, "width": w, "height": h, "max_value": maxval,
            "xrv224": f"{stem}.xrv224.f32",
            "psp512": f"{stem}.psp512.f32", "psp512_rows": rows512,
            "logits": logits.tolist(), "scores": scores.tolist(),
        }
        if kind != "png16":
            rows1024 = sampled_rows(1024)
            m1024 = medsam_1024(path)
            m1024[rows1024].tofile(os.path.join(OUT, f"{stem}.medsam1024.u8"))
            rec["medsam1024"] = f"{stem}.medsam1024.u8"
            rec["medsam1024_rows"] = rows1024
            # The min-max scaling that follows uses the whole image's range.
            rec["medsam1024_min"] = int(m1024.min())
            rec["medsam1024_max"] = int(m1024.max())
        records.append(rec)
        print(f"{name}: {w}x{h} {kind}; logits {logits.min():.3f}..{logits.max():.3f}; "
              f"scores {scores.min():.3f}..{scores.max():.3f}")
    manifest = {
        "generator": "scripts/make_xrv_parity_fixtures.py",
        "versions": {"torch": torch.__version__, "torchxrayvision": xrv.__version__,
                     "scikit-image": skimage.__version__, "numpy": np.__version__},
        "seed": SEED, "classifier_scale": CLASSIFIER_SCALE, "weights": checks,
        "images": records,
    }
    with open(os.path.join(OUT, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
