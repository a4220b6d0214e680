#!/usr/bin/env python3
"""The report models' input as transformers' ViTImageProcessor makes it (the CheXpert-Plus
checkpoints' preprocessor_config.json: RGB, PIL bilinear to 224x224, x/255, ImageNet mean/std),
for `cargo test -p hilum-models --test it report_fixture::the_recipe_is_the_vit_image_processor`.

Writes, per radiograph, the red plane back as bytes (`round((v * std + mean) * 255)`, exact since
the processor's input is 8-bit) to tests/fixtures/report_preprocess/<name>.u8, and the
plane's checks in manifest.json. Needs only transformers, numpy and Pillow (no torch):

    python3 -m venv /tmp/venv-vit && /tmp/venv-vit/bin/pip install transformers==4.57.6 numpy==2.4.6 pillow==13.0.0
    /tmp/venv-vit/bin/python scripts/make_report_preprocess_fixtures.py ../shared/data
"""
import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image
from transformers import ViTImageProcessor

FILES = ["cxr/images/nih_00000001_000_cardiomegaly.png", "cxr/images/covid_2c35005f.jpg"]
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def main():
    data = Path(sys.argv[1])
    out = Path(__file__).resolve().parent.parent / "tests/fixtures/report_preprocess"
    out.mkdir(parents=True, exist_ok=True)
    proc = ViTImageProcessor(do_resize=True, size={"height": 224, "width": 224}, resample=2,
                             do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
                             image_mean=MEAN, image_std=STD)
    manifest = []
    for rel in FILES:
        img = Image.open(data / rel).convert("RGB")
        px = proc(images=img, return_tensors="np")["pixel_values"][0]
        planes = [np.rint((px[c] * STD[c] + MEAN[c]) * 255.0) for c in range(3)]
        assert all(np.array_equal(planes[0], p) for p in planes[1:]), "grey in, grey out"
        back = (planes[0] * 1.0)
        assert np.abs((back / 255.0 - MEAN[0]) / STD[0] - px[0]).max() < 1e-5
        name = Path(rel).stem + ".u8"
        (out / name).write_bytes(planes[0].astype(np.uint8).tobytes())
        manifest.append({"file": rel, "plane": name, "size": 224})
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main()
