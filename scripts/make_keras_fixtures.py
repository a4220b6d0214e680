"""Fixtures for Hilum's Keras .h5 reader (crates/hilum-models/src/checkpoint/keras.rs), written by
h5py (the HDF5 C library), with the expected output of scripts/convert_keras_h5.py, which the
Rust reader replaces and must match byte for byte.

Writes tests/fixtures/checkpoints/ (a few KB each, seeded):
  keras_model.h5       a whole-model file as Keras 2 writes it (default HDF5 format: superblock
      v0, symbol-table groups): `model_weights` with fixed-length `layer_names`/`weight_names`,
      an empty `weight_names` (Keras writes a float64 `[]`), variable-length `keras_version` /
      `backend` / `model_config` on the root; weights in f32, big-endian f32, f64, f16, a
      chunked gzip dataset, a scalar, a weight under a nested group, a non-ASCII layer name
  keras_weights_latest.h5   a `save_weights` file (layer_names on the root) in the newest HDF5
      format (`libver="latest"`: superblock v3, link messages, dense link and attribute
      storage in fractal heaps)
  keras_*.expected.safetensors   scripts/convert_keras_h5.py's output for each

Run: scripts/.venv-models/bin/python scripts/make_keras_fixtures.py
(versions pinned in scripts/requirements-models.txt: h5py 3.12.1, numpy 2.1.3)
"""
import hashlib
import os
import subprocess
import sys

import h5py
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "tests", "fixtures", "checkpoints")
rng = np.random.default_rng(17)


def names(xs):
    return np.array([x.encode() for x in xs])


def layer(parent, name, weights):
    """A Keras layer group: weights under `<name>/<weight>:0`, listed in `weight_names`."""
    g = parent.create_group(name)
    wnames = []
    for wname, arr, kwargs in weights:
        g.create_dataset(wname, data=arr, **kwargs)
        wnames.append(wname)
    g.attrs["weight_names"] = names(wnames) if wnames else np.array([], dtype="f8")
    return g


def whole_model(path):
    with h5py.File(path, "w") as f:
        f.attrs["keras_version"] = "2.2.4-tf"
        f.attrs["backend"] = "tensorflow"
        f.attrs["model_config"] = '{"class_name": "Model", "config": {"layers": []}}'
        mw = f.create_group("model_weights")
        mw.attrs["keras_version"] = "2.2.4-tf"
        mw.attrs["backend"] = "tensorflow"
        f32 = lambda *s: rng.standard_normal(s).astype("<f4")
        layers = [
            ("input_1", []),
            ("conv1", [
                ("conv1/kernel:0", f32(3, 3, 2, 4), {}),
                ("conv1/bias:0", f32(4), {}),
            ]),
            ("bn1", [
                ("bn1/gamma:0", f32(4).astype(">f4"), {}),
                ("bn1/beta:0", rng.standard_normal(4).astype("<f8"), {}),
                ("bn1/moving_mean:0", f32(4).astype("<f2"), {}),
                ("bn1/moving_variance:0", np.abs(f32(4)), {}),
            ]),
            ("dense", [
                ("dense/kernel:0", f32(40, 30), {"chunks": (8, 16), "compression": "gzip"}),
                ("dense/bias:0", f32(30), {"chunks": (7,), "shuffle": True}),
            ]),
            ("scale", [("scale/alpha:0", np.float32(0.25), {})]),
            ("block", [("block/inner/kernel:0", f32(2, 2), {})]),
            ("couche_é", [("couche_é/w:0", f32(3), {})]),
        ]
        for name, weights in layers:
            layer(mw, name, weights)
        mw.attrs["layer_names"] = names([n for n, _ in layers])


def weights_only_latest(path):
    with h5py.File(path, "w", libver="latest") as f:
        f.attrs["keras_version"] = "2.3.1"
        f.attrs["backend"] = "tensorflow"
        # Past 8 attributes and 8 links HDF5 moves them to dense storage (fractal heap).
        for i in range(10):
            f.attrs[f"note_{i}"] = f"padding attribute {i}"
        layer_names = []
        for i in range(12):
            name = f"dense_{i}"
            layer(f, name, [
                (f"{name}/kernel:0", rng.standard_normal((3, 2)).astype("<f4"), {}),
                (f"{name}/bias:0", rng.standard_normal(2).astype("<f4"), {}),
            ])
            layer_names.append(name)
        f.attrs["layer_names"] = names(layer_names)


def main():
    os.makedirs(OUT, exist_ok=True)
    for stem, write in [("keras_model", whole_model), ("keras_weights_latest", weights_only_latest)]:
        h5 = os.path.join(OUT, f"{stem}.h5")
        expected = os.path.join(OUT, f"{stem}.expected.safetensors")
        write(h5)
        subprocess.run(
            [sys.executable, os.path.join(HERE, "convert_keras_h5.py"), h5, expected], check=True
        )
        for p in (h5, expected):
            with open(p, "rb") as fh:
                data = fh.read()
            print(f"{os.path.relpath(p)}: {len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()}")


if __name__ == "__main__":
    main()
