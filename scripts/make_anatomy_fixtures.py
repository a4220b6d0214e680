"""Reference fixtures for the ChestX-Det PSPNet (crates/hilum-models/src/pspnet.rs).

Writes tests/fixtures/anatomy/:
  pspnet_small.safetensors   seeded weights of a narrow PSPNet built from torchxrayvision's own
                             ptsemseg blocks (same forward code, smaller widths)
  pspnet_small_io.safetensors  input (1,3,96,96) and the reference logits (1,14,96,96)
  pspnet_small_config.json   the widths, so the Rust Config matches
  pspnet_full_params.json    name -> shape of the full published model (pspnet(14)), as in
                             pspnet_chestxray_best_model_4.pth after `module.` is stripped

Run: scripts/.venv-fixtures/bin/python scripts/make_anatomy_fixtures.py
(versions pinned in scripts/requirements-anatomy.txt)
"""
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file
from torchxrayvision.baseline_models.chestx_det.ptsemseg import pspnet as ref
from torchxrayvision.baseline_models.chestx_det.ptsemseg.utils import (
    conv2DBatchNormRelu,
    pyramidPooling,
    residualBlockPSP,
)

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "anatomy")
N_CLASSES = 14


class SmallPSPNet(nn.Module):
    """ptsemseg.pspnet.__init__ with the widths taken from `cfg`; forward copied from it."""

    def __init__(self, cfg):
        super().__init__()
        s = cfg["stem"]
        self.convbnrelu1_1 = conv2DBatchNormRelu(3, s[0], 3, 2, 1, bias=False)
        self.convbnrelu1_2 = conv2DBatchNormRelu(s[0], s[1], 3, 1, 1, bias=False)
        self.convbnrelu1_3 = conv2DBatchNormRelu(s[1], s[2], 3, 1, 1, bias=False)
        (m2, o2), (m3, o3), (m4, o4), (m5, o5) = cfg["stages"]
        b = cfg["block_config"]
        self.res_block2 = residualBlockPSP(b[0], s[2], m2, o2, 1, 1)
        self.res_block3 = residualBlockPSP(b[1], o2, m3, o3, 2, 1)
        self.res_block4 = residualBlockPSP(b[2], o3, m4, o4, 1, 2)
        self.res_block5 = residualBlockPSP(b[3], o4, m5, o5, 1, 4)
        self.pyramid_pooling = pyramidPooling(o5, cfg["pool_sizes"])
        self.cbr_final = conv2DBatchNormRelu(o5 * 2, cfg["final_channels"], 3, 1, 1, False)
        self.classification = nn.Conv2d(cfg["final_channels"], cfg["n_classes"], 1, 1, 0)

    def forward(self, x):
        inp_shape = x.shape[2:]
        x = self.convbnrelu1_3(self.convbnrelu1_2(self.convbnrelu1_1(x)))
        x = F.max_pool2d(x, 3, 2, 1)
        x = self.res_block4(self.res_block3(self.res_block2(x)))
        x = self.res_block5(x)
        x = self.pyramid_pooling(x)
        x = self.classification(self.cbr_final(x))
        return F.interpolate(x, size=inp_shape, mode="bilinear", align_corners=False)


def main():
    os.makedirs(OUT, exist_ok=True)
    torch.manual_seed(0)
    full = ref.pspnet(N_CLASSES)
    names = {k: list(v.shape) for k, v in full.state_dict().items()}
    with open(os.path.join(OUT, "pspnet_full_params.json"), "w") as f:
        json.dump(names, f, indent=0)

    cfg = {
        "n_classes": N_CLASSES,
        "stem": [8, 8, 16],
        "stages": [[8, 32], [16, 48], [16, 64], [24, 96]],
        "block_config": [2, 1, 2, 1],
        "pool_sizes": [6, 3, 2, 1],
        "final_channels": 32,
        "input_size": 96,
    }
    torch.manual_seed(1234)
    m = SmallPSPNet(cfg)
    # Non-trivial batch-norm statistics so folding/eval mode are really tested.
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
                mod.running_mean.uniform_(-0.2, 0.2)
                mod.running_var.uniform_(0.5, 1.5)
    m.eval()
    x = torch.randn(1, 3, cfg["input_size"], cfg["input_size"])
    with torch.no_grad():
        y = m(x)
    sd = {k: v.contiguous() for k, v in m.state_dict().items() if "num_batches_tracked" not in k}
    save_file(sd, os.path.join(OUT, "pspnet_small.safetensors"))
    save_file({"input": x.contiguous(), "logits": y.contiguous()},
              os.path.join(OUT, "pspnet_small_io.safetensors"))
    with open(os.path.join(OUT, "pspnet_small_config.json"), "w") as f:
        json.dump(cfg, f, indent=1)

    for fn in sorted(os.listdir(OUT)):
        print(fn, os.path.getsize(os.path.join(OUT, fn)), "bytes")
    print("torch", torch.__version__, "logits", tuple(y.shape), "abs max", float(y.abs().max()))


if __name__ == "__main__":
    main()
