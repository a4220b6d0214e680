#!/usr/bin/env python3
"""What Pillow decodes from every JPEG in ../shared/data (read there at test time, never copied
here) and from small synthetic JPEGs this script writes, for crates/hilum-imaging's
`jpeg_pillow` test (`cargo test -p hilum-imaging --test it jpeg_pillow::`): Hilum's
libjpeg-turbo decode must give the same samples, bit for bit.

Writes to crates/hilum-imaging/tests/fixtures/jpeg/:
  synth_*.jpg     24x16 to 67x45 gradients with texture, encoded by Pillow: gray and YCbCr, baseline
                  and progressive, 4:4:4 / 4:2:2 / 4:2:0 (the upsampling paths), odd sizes (the
                  partial edge blocks), and one CMYK file (left to the `image` crate by Hilum).
  pillow.json     per file: size, Pillow's mode, sha256 and sum of `np.asarray(Image.open(f))`
                  (the decoder's own samples). Hilum's gray image is those samples for "L"; for
                  "RGB" it is the `image` crate's luminance of them (docs/images.md, JPEG), which the
                  test checks on the Rust side.

Setup:  python3 -m venv scripts/.venv-imaging
        scripts/.venv-imaging/bin/pip install -r scripts/requirements-bench-decode.txt
Run:    scripts/.venv-imaging/bin/python scripts/make_jpeg_fixtures.py
"""
import hashlib
import json
from pathlib import Path

import numpy as np
import PIL
from PIL import Image, features

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "data"
OUT = ROOT / "crates" / "hilum-imaging" / "tests" / "fixtures" / "jpeg"

# (name, mode, size, save options). Pillow's `subsampling`: 0 = 4:4:4, 1 = 4:2:2, 2 = 4:2:0.
SYNTH = [
    ("synth_gray_baseline.jpg", "L", (67, 45), {"quality": 90}),
    ("synth_gray_progressive.jpg", "L", (67, 45), {"quality": 90, "progressive": True}),
    ("synth_rgb_420_baseline.jpg", "RGB", (67, 45), {"quality": 85, "subsampling": 2}),
    ("synth_rgb_420_progressive.jpg", "RGB", (61, 53),
     {"quality": 85, "subsampling": 2, "progressive": True}),
    ("synth_rgb_422_baseline.jpg", "RGB", (67, 45), {"quality": 85, "subsampling": 1}),
    ("synth_rgb_444_progressive.jpg", "RGB", (40, 33),
     {"quality": 95, "subsampling": 0, "progressive": True}),
    ("synth_cmyk.jpg", "CMYK", (24, 16), {"quality": 90}),
]


def synth_pixels(mode: str, size: tuple[int, int]) -> np.ndarray:
    """A smooth ramp plus seeded noise per channel: both flat areas and edges for the IDCT."""
    w, h = size
    rng = np.random.default_rng(17)
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    planes = []
    for c in range({"L": 1, "RGB": 3, "CMYK": 4}[mode]):
        ramp = 255.0 * ((x / w) * (0.3 + 0.2 * c) + (y / h) * (0.7 - 0.2 * c))
        ring = 40.0 * np.sin((x - w / 2) ** 2 / 40.0 + (y - h / 2) ** 2 / (30.0 + 10 * c))
        planes.append(np.clip(ramp + ring + rng.normal(0, 12, (h, w)), 0, 255))
    stack = np.stack(planes, axis=-1).round().astype(np.uint8)
    return stack[..., 0] if mode == "L" else stack


def entry(path: Path, rel: str) -> dict:
    with Image.open(path) as im:
        im.load()
        mode = im.mode
        samples = np.asarray(im)
    return {
        "file": rel,
        "width": int(samples.shape[1]),
        "height": int(samples.shape[0]),
        "mode": mode,
        "samples_sha256": hashlib.sha256(np.ascontiguousarray(samples).tobytes()).hexdigest(),
        "samples_sum": int(samples.astype(np.uint64).sum()),
    }


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    files = []
    for name, mode, size, opts in SYNTH:
        path = OUT / name
        Image.fromarray(synth_pixels(mode, size), mode).save(path, "JPEG", **opts)
        files.append(entry(path, f"fixtures/jpeg/{name}"))
    shared = sorted(
        p for p in SHARED.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg") and p.is_file()
    )
    for path in shared:
        files.append(entry(path, f"shared/{path.relative_to(SHARED).as_posix()}"))
    manifest = {
        "made_by": "scripts/make_jpeg_fixtures.py",
        "pillow": PIL.__version__,
        "libjpeg_turbo": features.version("libjpeg_turbo"),
        "files": files,
    }
    (OUT / "pillow.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{len(files)} files ({len(shared)} shared) -> {OUT / 'pillow.json'}")


if __name__ == "__main__":
    main()
