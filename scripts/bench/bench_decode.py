#!/usr/bin/env python3
"""Python counterpart of crates/hilum-imaging/benches/decode.rs: decode + torchxrayvision normalisation + centre
crop + resize to 224 of the largest JPEG and of the JPEG 2000 DICOM in ../shared/data/cxr.

The steps follow torchxrayvision 1.5.x (read_xray_dcm for DICOM: raw pixels, MONOCHROME1
fixed, normalised by 2^BitsStored - 1; xrv.datasets.normalize for 8-bit files; XRayCenterCrop;
XRayResizer = skimage.transform.resize with its default anti-aliasing). A second line times the
fastest common alternative resize (PIL BILINEAR on the float image).

Setup:  python3 -m venv scripts/.venv-imaging
        scripts/.venv-imaging/bin/pip install -r scripts/bench/requirements-bench-decode.txt
Run:    scripts/.venv-imaging/bin/python scripts/bench/bench_decode.py [--repeat 15]
Prints one JSON line per case: median and min milliseconds.
"""
import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import pydicom
import skimage.transform
from PIL import Image

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "cxr"
CASES = [
    ("jpeg_2544x3056", DATA / "images" / "medrax_normal3.jpg"),
    ("dicom_j2k_1841x1955", DATA / "dicom" / "RG1_chest_cr_pa_jpeg2000_lossy.dcm"),
]


def load(path: Path) -> np.ndarray:
    """The image as float32 in xrv's [-1024, 1024]."""
    if path.suffix == ".dcm":
        ds = pydicom.dcmread(path, force=True)
        maxval = 2 ** ds.BitsStored - 1
        data = ds.pixel_array.astype(np.float32)
        if ds.PhotometricInterpretation == "MONOCHROME1":
            data = maxval - data
    else:
        data = np.asarray(Image.open(path).convert("L"), dtype=np.float32)
        maxval = 255
    return (2 * (data / maxval) - 1.0) * 1024


def center_crop(img: np.ndarray) -> np.ndarray:
    y, x = img.shape
    c = min(y, x)
    sx, sy = x // 2 - c // 2, y // 2 - c // 2
    return img[sy:sy + c, sx:sx + c]


def xrv_pipeline(path: Path) -> np.ndarray:
    img = center_crop(load(path))
    return skimage.transform.resize(img[None], (1, 224, 224), mode="constant",
                                    preserve_range=True).astype(np.float32)


def pil_pipeline(path: Path) -> np.ndarray:
    img = center_crop(load(path))
    small = Image.fromarray(img, mode="F").resize((224, 224), Image.BILINEAR)
    return np.asarray(small, dtype=np.float32)[None]


def decode_only(path: Path) -> np.ndarray:
    if path.suffix == ".dcm":
        return pydicom.dcmread(path, force=True).pixel_array
    return np.asarray(Image.open(path).convert("L"))


def timeit(fn, path, repeat):
    fn(path)  # warm-up (imports, caches)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn(path)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), min(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    for name, path in CASES:
        for label, fn in [("xrv_skimage", xrv_pipeline), ("pil_bilinear", pil_pipeline),
                          ("decode_only", decode_only)]:
            med, best = timeit(fn, path, args.repeat)
            print(json.dumps({"case": name, "pipeline": label, "median_ms": round(med, 2),
                              "min_ms": round(best, 2), "repeat": args.repeat,
                              "threads_env": os.environ.get("OMP_NUM_THREADS", "default")}))


if __name__ == "__main__":
    main()
