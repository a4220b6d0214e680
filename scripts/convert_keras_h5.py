#!/usr/bin/env python3
"""Convert a Keras HDF5 checkpoint (.h5) into safetensors for Hilum.

Each weight `<layer>/<layer>/<name>:0` becomes `<layer>.<name>` with its Keras shape and
values unchanged (conv kernels stay HWIO). Needs h5py and numpy (scripts/requirements-models.txt).

usage: convert_keras_h5.py IN.h5 OUT.safetensors

`hilum models import ID FILE.h5` no longer runs it: Hilum reads .h5 files in Rust
(crates/hilum-models/src/checkpoint/keras.rs) and writes the same bytes. It stays as the
reference scripts/fixtures/make_keras_fixtures.py checks the Rust reader against.
"""
import json
import struct
import sys

import h5py
import numpy as np


def weights(f):
    root = f["model_weights"] if "model_weights" in f else f
    out = {}
    for layer in root.attrs.get("layer_names", []):
        layer = layer.decode() if isinstance(layer, bytes) else layer
        group = root[layer]
        for wname in group.attrs.get("weight_names", []):
            wname = wname.decode() if isinstance(wname, bytes) else wname
            short = wname.split("/")[-1].split(":")[0]
            key = f"{layer}.{short}"
            if key in out:
                raise SystemExit(f"duplicate weight name {key}")
            out[key] = np.ascontiguousarray(group[wname][()], dtype="<f4")
    return out


def write_safetensors(tensors, path, metadata):
    header = {"__metadata__": metadata}
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(blob)))
        out.write(blob)
        for name in sorted(tensors):
            out.write(tensors[name].tobytes())


def main():
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    src, dst = sys.argv[1], sys.argv[2]
    with h5py.File(src, "r") as f:
        tensors = weights(f)
        meta = {"converted_from": "keras-h5"}
        for k in ("keras_version", "backend"):
            v = f.attrs.get(k)
            if v is not None:
                meta[k] = v.decode() if isinstance(v, bytes) else str(v)
    if not tensors:
        raise SystemExit(f"{src}: no weights found (is it a Keras model or weights file?)")
    write_safetensors(tensors, dst, meta)
    n = sum(t.size for t in tensors.values())
    print(f"wrote {dst}: {len(tensors)} tensors, {n} parameters")


if __name__ == "__main__":
    main()
