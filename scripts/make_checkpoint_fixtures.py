"""Fixtures for Hilum's PyTorch checkpoint reader (crates/hilum-models/src/checkpoint/), written
by torch itself, and malicious pickles that the reader must refuse.

Writes tests/fixtures/checkpoints/ (a few KB each, seeded):
  state_dict_zip.pt / state_dict_legacy.pt   one state dict in torch.save's zip format and in
      the legacy (pre-1.6) format: f32, f16, bf16, f64, int64, int32 and bool tensors,
      non-contiguous views, storage offsets, a stride-0 expand, an empty tensor
  state_dict.expected.safetensors            each of them as `v.to(torch.float32).contiguous()`
  module_zip.pt / module_legacy.pt           a whole pickled tiny torchxrayvision DenseNet
      (`torch.save(model)`, as torchxrayvision publishes its weights) with an `op_threshs`
      buffer, a non-persistent buffer and a `pathologies` attribute; the legacy one has no
      `_non_persistent_buffers_set` and has a THNN `_backend`, like modules pickled by old torch
  module.expected.safetensors                scripts/convert_xrv.py's output for module_zip.pt
  pspnet_state.pth / pspnet.expected.safetensors   a DataParallel state dict of torchxrayvision's
      ptsemseg blocks with the training-only aux head; scripts/convert_pspnet.py's output
  sam_state.pth / sam.expected.safetensors   a {"model": state dict} with `module.` names and
      pixel_mean/pixel_std; expected by scripts/convert_medsam.py's rules (the script itself
      also checks full SAM ViT-B shapes, which a tiny fixture cannot pass)
  evil_*.pkl / evil_*.pt                     payloads (os.system, builtins.eval,
      subprocess.Popen, getattr chains, a reduce nested in a state dict) that create
      /tmp/hilum-ckpt-marker-<name> when Python unpickles them; each is proven live here by
      unpickling it in a child Python and seeing its marker appear (then removing it)

Run: scripts/.venv-fixtures/bin/python scripts/make_checkpoint_fixtures.py
(versions pinned in scripts/requirements-fixtures.txt)
"""
import collections
import copy
import os
import pickle
import pickletools
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torchxrayvision as xrv
from safetensors.torch import load_file, save_file
from torch.nn.backends.thnn import _get_thnn_function_backend
from torchxrayvision.baseline_models.chestx_det.ptsemseg.utils import conv2DBatchNormRelu

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import convert_pspnet  # noqa: E402
import convert_xrv  # noqa: E402

OUT = os.path.join(HERE, "..", "tests", "fixtures", "checkpoints")


def path(name):
    return os.path.join(OUT, name)


def as_expected(sd):
    # clone(): views of one storage must be separate tensors in a safetensors file.
    return {k: v.to(torch.float32).contiguous().clone() for k, v in sd.items()}


def state_dict_fixtures():
    torch.manual_seed(0)
    base = torch.randn(4, 6)
    sd = collections.OrderedDict()
    sd["conv.weight"] = torch.randn(3, 2, 3, 3)
    sd["conv.bias"] = torch.randn(3).half()
    sd["norm.weight"] = torch.randn(5).to(torch.bfloat16)
    sd["norm.running_var"] = torch.rand(5).double()
    sd["norm.num_batches_tracked"] = torch.tensor(7)
    sd["proj.weight_t"] = base.t()  # strides (1, 6)
    sd["proj.row"] = base[2]  # storage offset 12, same storage
    sd["proj.cols"] = base[1:, 1:5:2]  # offset and steps
    sd["proj.scalar"] = base[3, 5]  # zero-dimensional view
    sd["mask"] = torch.tensor([True, False, True])
    sd["counts"] = torch.arange(-2, 2, dtype=torch.int32)
    sd["bytes"] = torch.tensor([0, 7, 255], dtype=torch.uint8)
    sd["empty"] = torch.zeros(0, 3)
    sd["expand"] = torch.randn(3, 1).expand(3, 4)  # stride 0
    torch.save(sd, path("state_dict_zip.pt"))
    torch.save(sd, path("state_dict_legacy.pt"), _use_new_zipfile_serialization=False)
    save_file(as_expected(sd), path("state_dict.expected.safetensors"))


def tiny_densenet():
    torch.manual_seed(1)
    m = xrv.models.DenseNet(
        growth_rate=4,
        block_config=(1, 2),
        num_init_features=8,
        bn_size=2,
        num_classes=3,
        op_threshs=torch.rand(3),
    )
    # Non-zero running statistics and BN counters, as after training.
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.uniform_(-1, 1)
            mod.running_var.uniform_(0.5, 2)
            mod.num_batches_tracked.fill_(11)
    m.pathologies = ["Atelectasis", "Effusion", "Mass"]
    return m


def module_fixtures():
    m = tiny_densenet()
    m.register_buffer("scratch", torch.ones(2), persistent=False)
    torch.save(m, path("module_zip.pt"))
    # As torch < 1.6 pickled modules: no non-persistent buffers, no `_non_persistent_buffers_set`,
    # and (torch < 1.2) a `_backend` that pickles as a call of torch's THNN hook.
    old = copy.deepcopy(m)
    del old._buffers["scratch"]
    for mod in old.modules():
        del mod._non_persistent_buffers_set
        object.__setattr__(mod, "_backend", _Reduce(_get_thnn_function_backend, ()))
    torch.save(old, path("module_legacy.pt"), _use_new_zipfile_serialization=False)
    convert_xrv.convert(path("module_zip.pt"), path("module.expected.safetensors"))
    # Both forms must convert to the same tensors.
    tmp = path("module_legacy.check.safetensors")
    convert_xrv.convert(path("module_legacy.pt"), tmp)
    a, b = load_file(path("module.expected.safetensors")), load_file(tmp)
    os.remove(tmp)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "legacy differs"
    assert "op_threshs" in a and not any(k.endswith("scratch") for k in a)


class _TinyPSPNet(nn.Module):
    """Names of ptsemseg's pspnet: a trunk, the training-only aux head, the classifier."""

    def __init__(self):
        super().__init__()
        self.convbnrelu1_1 = conv2DBatchNormRelu(3, 4, 3, 2, 1, bias=False)
        self.convbnrelu4_aux = conv2DBatchNormRelu(4, 2, 3, 1, 1, bias=False)
        self.aux_cls = nn.Conv2d(2, 14, 1)
        self.classification = nn.Conv2d(4, 14, 1)


def pspnet_fixtures():
    torch.manual_seed(2)
    m = nn.DataParallel(_TinyPSPNet())
    torch.save(m.state_dict(), path("pspnet_state.pth"))
    convert_pspnet.main(path("pspnet_state.pth"), path("pspnet.expected.safetensors"))


def sam_fixtures():
    torch.manual_seed(3)
    sd = collections.OrderedDict()
    sd["module.image_encoder.patch_embed.proj.weight"] = torch.randn(4, 3, 2, 2)
    sd["module.image_encoder.pos_embed"] = torch.randn(1, 2, 2, 4)
    sd["module.mask_decoder.iou_token.weight"] = torch.randn(1, 4)
    sd["module.pixel_mean"] = torch.tensor([123.675, 116.28, 103.53]).view(-1, 1, 1)
    sd["module.pixel_std"] = torch.tensor([58.395, 57.12, 57.375]).view(-1, 1, 1)
    torch.save({"model": sd, "epoch": 3}, path("sam_state.pth"))
    # convert_medsam.py's rules: unwrap model/state_dict, strip `module.`, drop pixel_mean/std.
    out = {k[len("module."):]: v for k, v in sd.items()}
    out = {k: v for k, v in out.items() if k not in ("pixel_mean", "pixel_std")}
    save_file(as_expected(out), path("sam.expected.safetensors"))


def marker(name):
    return f"/tmp/hilum-ckpt-marker-{name}"


class _Reduce:
    """An object that pickles as `func(*args)`: how real pickle exploits are made."""

    def __init__(self, func, args):
        self.func, self.args = func, args

    def __reduce__(self):
        return (self.func, self.args)


def evil_fixtures():
    payloads = {}
    # os.system the classic way: GLOBAL 'os system', as hand-written exploits name it.
    payloads["evil_os_system.pkl"] = (
        pickle.PROTO + bytes([2]) + pickle.GLOBAL + b"os\nsystem\n" + pickle.MARK
        + pickle.BINUNICODE + len(f"touch {marker('os_system')}").to_bytes(4, "little")
        + f"touch {marker('os_system')}".encode() + pickle.TUPLE + pickle.REDUCE + pickle.STOP
    )
    # os.system as pickle.dumps writes it (its __module__ is posix).
    payloads["evil_posix_system.pkl"] = pickle.dumps(
        _Reduce(os.system, (f"touch {marker('posix_system')}",)), protocol=2)
    payloads["evil_eval.pkl"] = pickle.dumps(
        _Reduce(eval, (f"__import__('pathlib').Path('{marker('eval')}').touch()",)), protocol=4)
    payloads["evil_popen.pkl"] = pickle.dumps(
        _Reduce(subprocess.Popen, (["touch", marker("popen")],)), protocol=4)
    # getattr(__import__('os'), 'system')('touch ...'), written with STACK_GLOBAL.
    def sg(module, name):
        return (pickle.SHORT_BINUNICODE + bytes([len(module)]) + module.encode()
                + pickle.SHORT_BINUNICODE + bytes([len(name)]) + name.encode() + pickle.STACK_GLOBAL)
    cmd = f"touch {marker('getattr')}".encode()
    payloads["evil_getattr.pkl"] = (
        pickle.PROTO + bytes([4]) + sg("builtins", "getattr") + sg("builtins", "__import__")
        + pickle.SHORT_BINUNICODE + bytes([2]) + b"os" + pickle.TUPLE1 + pickle.REDUCE
        + pickle.SHORT_BINUNICODE + bytes([6]) + b"system" + pickle.TUPLE2 + pickle.REDUCE
        + pickle.SHORT_BINUNICODE + bytes([len(cmd)]) + cmd + pickle.TUPLE1 + pickle.REDUCE
        + pickle.STOP
    )
    for name, data in payloads.items():
        pickletools.dis(data, out=open(os.devnull, "w"))  # well-formed
        with open(path(name), "wb") as f:
            f.write(data)
    # A reduce nested in a real state dict, saved by torch in both formats.
    torch.manual_seed(4)
    for fmt, new in [("zip", True), ("legacy", False)]:
        name = f"nested_{fmt}"
        sd = collections.OrderedDict()
        sd["fc.weight"] = torch.randn(2, 2)
        sd["fc.bias"] = _Reduce(os.system, (f"touch {marker(name)}",))
        torch.save(sd, path(f"evil_{name}.pt"), _use_new_zipfile_serialization=new)
    # Prove each payload is live: Python's own unpickler runs it.
    live = [(n, n[len("evil_"):-len(".pkl")]) for n in payloads]
    live += [(f"evil_nested_{f}.pt", f"nested_{f}") for f in ("zip", "legacy")]
    for fname, mname in live:
        if os.path.exists(marker(mname)):
            os.remove(marker(mname))
        load = ("import torch,sys; torch.load(sys.argv[1], weights_only=False)"
                if fname.endswith(".pt") else
                "import pickle,sys; pickle.load(open(sys.argv[1],'rb'))")
        subprocess.run([sys.executable, "-c", load, path(fname)], check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(50):
            if os.path.exists(marker(mname)):
                break
            time.sleep(0.1)
        assert os.path.exists(marker(mname)), f"{fname} did not create its marker in Python"
        os.remove(marker(mname))
        print(f"  {fname}: Python's unpickler runs it (marker created, removed)")


def main():
    os.makedirs(OUT, exist_ok=True)
    print(f"torch {torch.__version__}, torchxrayvision {xrv.__version__}")
    state_dict_fixtures()
    module_fixtures()
    pspnet_fixtures()
    sam_fixtures()
    evil_fixtures()
    for name in sorted(os.listdir(OUT)):
        print(f"wrote {os.path.join('tests/fixtures/checkpoints', name)} "
              f"({os.path.getsize(path(name))} bytes)")


if __name__ == "__main__":
    main()
