#!/usr/bin/env python3
"""Reference fixtures for Hilum's torchxrayvision classifiers (crates/hilum-models).

Builds torchxrayvision's DenseNet and torchvision's ResNet (as torchxrayvision uses it) with
small configurations and seeded weights, and writes under tests/fixtures/classifier/:
  densenet_small.safetensors / resnet_small.safetensors   weights, checkpoint names unchanged
  densenet_small_io.safetensors / resnet_small_io.safetensors   input (2,1,64,64) and logits
  small_configs.json                                        the configurations used
  op_norm.json                                              sigmoid probabilities -> op_norm outputs
  densenet121-res224-all.params.json / resnet50-res512-all.params.json
      names, shapes and dtypes of the full-size published architectures' state dicts

Run:  python3 -m venv scripts/.venv-fixtures
      scripts/.venv-fixtures/bin/pip install -r scripts/requirements-fixtures.txt
      scripts/.venv-fixtures/bin/python scripts/make_fixtures.py
"""
import json
import os
import sys

import numpy as np
import torch
import torchvision
import torchxrayvision as xrv
from safetensors.torch import save_file
from torchvision.models.resnet import Bottleneck

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "classifier")
SEED = 1234


def calibrate(model, make_batch, steps=4):
    """Sets BN running statistics to real activation statistics (so activations stay O(1) like
    a trained network's), then gives every BN a random affine transform."""
    gen = torch.Generator().manual_seed(SEED + 1)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.reset_running_stats()
            m.momentum = None  # cumulative average over the calibration batches
    model.train()
    with torch.no_grad():
        for _ in range(steps):
            model(make_batch())
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.weight.copy_(1.0 + 0.2 * torch.randn(m.weight.shape, generator=gen))
                m.bias.copy_(0.2 * torch.randn(m.bias.shape, generator=gen))
            elif isinstance(m, torch.nn.Linear):
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=gen))
    model.eval()


def xrv_like_input(gen, n, size):
    """Smooth random images in torchxrayvision's [-1024, 1024] range."""
    x = torch.rand((n, 1, size // 8, size // 8), generator=gen)
    x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear")
    x = x + 0.1 * torch.randn((n, 1, size, size), generator=gen)
    return (x.clamp(0, 1) * 2 - 1) * 1024


def state(model):
    return {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}


def param_list(model):
    return [
        {"name": k, "shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")}
        for k, v in model.state_dict().items()
    ]


def write(name, tensors):
    path = os.path.join(OUT, name)
    save_file(tensors, path)
    print(f"wrote {os.path.relpath(path, ROOT)} ({os.path.getsize(path)} bytes)")


def write_json(name, obj):
    path = os.path.join(OUT, name)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    print(f"wrote {os.path.relpath(path, ROOT)} ({os.path.getsize(path)} bytes)")


def small_resnet(cfg):
    """torchvision's ResNet built by its own _make_layer, with narrow stages."""
    model = torchvision.models.resnet50(num_classes=cfg["num_classes"], weights=None)
    model.inplanes = cfg["stem_channels"]
    model.conv1 = torch.nn.Conv2d(cfg["in_channels"], cfg["stem_channels"], 7, 2, 3, bias=False)
    model.bn1 = torch.nn.BatchNorm2d(cfg["stem_channels"])
    for i, (n, planes) in enumerate(zip(cfg["layers"], cfg["planes"])):
        stage = model._make_layer(Bottleneck, planes, n, stride=1 if i == 0 else 2)
        setattr(model, f"layer{i + 1}", stage)
    model.fc = torch.nn.Linear(cfg["planes"][-1] * cfg["expansion"], cfg["num_classes"])
    return model


def main():
    os.makedirs(OUT, exist_ok=True)
    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, torchvision {torchvision.__version__}, torchxrayvision {xrv.__version__}")
    gen = torch.Generator().manual_seed(SEED)

    dcfg = dict(growth_rate=8, block_config=[2, 3, 2], num_init_features=16, bn_size=2,
                num_classes=18, in_channels=1)
    dn = xrv.models.DenseNet(weights=None, **{**dcfg, "block_config": tuple(dcfg["block_config"])})
    calibrate(dn, lambda: xrv_like_input(gen, 4, 64))
    x = xrv_like_input(gen, 2, 64)
    with torch.no_grad():
        logits = dn(x)
    write("densenet_small.safetensors", state(dn))
    write("densenet_small_io.safetensors", {"input": x.contiguous(), "logits": logits.contiguous()})
    print("densenet logits range", float(logits.min()), float(logits.max()))

    rcfg = dict(layers=[1, 2, 1, 1], stem_channels=16, planes=[8, 16, 32, 64], expansion=4,
                num_classes=18, in_channels=1)
    rn = small_resnet(rcfg)
    calibrate(rn, lambda: xrv_like_input(gen, 4, 64))
    x = xrv_like_input(gen, 2, 64)
    with torch.no_grad():
        logits = rn(x)
    write("resnet_small.safetensors", state(rn))
    write("resnet_small_io.safetensors", {"input": x.contiguous(), "logits": logits.contiguous()})
    print("resnet logits range", float(logits.min()), float(logits.max()))

    write_json("small_configs.json", {"densenet": dcfg, "resnet": rcfg, "seed": SEED,
                                      "versions": {"torch": torch.__version__,
                                                   "torchxrayvision": xrv.__version__}})

    # op_norm: the published thresholds of both models (the ResNet's contain NaN).
    cases = []
    for wid in ["densenet121-res224-all", "resnet50-res512-all"]:
        th = torch.tensor(xrv.models.model_urls[wid]["op_threshs"], dtype=torch.float32)
        probs = torch.rand((3, th.shape[0]), generator=gen)
        probs[0] = th.nan_to_num(0.5)  # exactly at the threshold
        out = xrv.models.op_norm(probs, th)
        cases.append({"model": wid, "op_threshs": [None if np.isnan(t) else float(t) for t in th],
                      "probs": probs.tolist(), "outputs": out.tolist()})
    write_json("op_norm.json", cases)

    # Full-size architectures, names and shapes only (no weights are downloaded).
    write_json("densenet121-res224-all.params.json", param_list(xrv.models.DenseNet(weights=None)))
    full_rn = torchvision.models.resnet50(num_classes=18, weights=None)
    full_rn.conv1 = torch.nn.Conv2d(1, 64, kernel_size=7, stride=2, padding=3, bias=False)  # as xrv
    write_json("resnet50-res512-all.params.json", param_list(full_rn))
    return 0


if __name__ == "__main__":
    sys.exit(main())
