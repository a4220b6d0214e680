#!/usr/bin/env python3
"""Serves a Triton model repository written by `hilum models export-triton` with a real Triton
Inference Server (PyTriton's bundled tritonserver, KServe v2 protocol), on 127.0.0.1.

PyTriton's tritonserver has no ONNX Runtime backend, so each model's callable runs the exported
`<model>/1/model.onnx` with ONNX Runtime; its inputs, outputs, max_batch_size, dynamic batching
and instance count come from the exported `config.pbtxt`, as a full Triton would read them.

    scripts/.venv-triton/bin/python scripts/deploy/triton_serve.py REPO --http-port 8000

Set up with scripts/setup_triton.sh. Prints `ready http://127.0.0.1:PORT` once serving (and,
with --ready-file, writes that URL to the file: tritonserver logs to the same stdout from its own
threads, so a reader that must not miss the line waits for the file instead); stops on
SIGTERM/SIGINT.
"""

import argparse
import os
import re
import signal
import sys
import sysconfig
import threading
from pathlib import Path


def ensure_libpython_on_path():
    # Triton's Python backend stub loads libpython3.12.so.1.0 from the loader's path.
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    paths = os.environ.get("LD_LIBRARY_PATH", "").split(":")
    if libdir and libdir not in paths:
        os.environ["LD_LIBRARY_PATH"] = ":".join([libdir] + [p for p in paths if p])


TOKEN = re.compile(r'\s*(?:#[^\n]*\n?)*\s*("(?:[^"\\]|\\.)*"|[{}\[\]:,]|[^\s{}\[\]:,"#]+)')


def parse_pbtxt(text):
    """Protobuf text format, the subset config.pbtxt uses: a dict per message, repeated
    fields (and `[...]` lists) as lists."""
    tokens, pos = [], 0
    while True:
        m = TOKEN.match(text, pos)
        if not m:
            if text[pos:].strip():
                raise ValueError(f"config.pbtxt: cannot parse near {text[pos:pos + 30]!r}")
            break
        tokens.append(m.group(1))
        pos = m.end()
    it = iter(tokens + [None])
    tok = [next(it)]

    def take():
        t = tok[0]
        tok[0] = next(it)
        return t

    def scalar(t):
        if t.startswith('"'):
            return bytes(t[1:-1], "utf-8").decode("unicode_escape")
        try:
            return int(t)
        except ValueError:
            try:
                return float(t)
            except ValueError:
                return t  # an enum such as TYPE_FP32

    def value():
        if tok[0] == "{":
            take()
            return message("}")
        if tok[0] == "[":
            take()
            items = []
            while tok[0] != "]":
                items.append(value())
                if tok[0] == ",":
                    take()
            take()
            return items
        return scalar(take())

    def message(end):
        out = {}
        while tok[0] != end:
            key = take()
            if tok[0] == ":":
                take()
            v = value()
            if isinstance(v, list):
                out.setdefault(key, []).extend(v)
            elif key in out:
                prev = out[key]
                out[key] = (prev if isinstance(prev, list) else [prev]) + [v]
            else:
                out[key] = v
            if tok[0] in (",", ";"):
                take()
        if end is not None:
            take()
        return out

    return message(None)


def as_list(v):
    return v if isinstance(v, list) else [v]


def bind_model(triton, model_dir, threads):
    import numpy as np
    import onnxruntime as ort
    from pytriton.decorators import batch
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor

    cfg = parse_pbtxt((model_dir / "config.pbtxt").read_text())
    name = cfg.get("name", model_dir.name)
    max_batch = int(cfg.get("max_batch_size", 0))
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    session = ort.InferenceSession(
        str(model_dir / "1" / "model.onnx"), opts, providers=["CPUExecutionProvider"]
    )
    ins = [t for t in as_list(cfg.get("input", [])) if t]
    outs = [t for t in as_list(cfg.get("output", [])) if t]
    for t in ins + outs:
        if t.get("data_type") != "TYPE_FP32":
            raise ValueError(f"{name}: only TYPE_FP32 tensors are served, not {t.get('data_type')}")
    in_names = [t["name"] for t in ins]
    out_names = [t["name"] for t in outs]

    def run(**inputs):
        feeds = {n: np.ascontiguousarray(inputs[n], dtype=np.float32) for n in in_names}
        return dict(zip(out_names, (o.astype(np.float32) for o in session.run(out_names, feeds))))

    infer = batch(run) if max_batch > 0 else run
    batcher = None
    if "dynamic_batching" in cfg and max_batch > 0:
        db = cfg["dynamic_batching"] or {}
        batcher = DynamicBatcher(
            max_queue_delay_microseconds=int(db.get("max_queue_delay_microseconds", 0)),
            preferred_batch_size=[int(b) for b in as_list(db.get("preferred_batch_size", []))] or None,
        )
    instances = sum(int(g.get("count", 1)) * max(1, len(as_list(g.get("gpus", []))))
                    for g in as_list(cfg.get("instance_group", [{}])) if isinstance(g, dict))
    tensor = lambda t: Tensor(name=t["name"], dtype=np.float32, shape=tuple(int(d) for d in as_list(t["dims"])))
    triton.bind(
        model_name=name,
        infer_func=[infer] * max(1, instances),
        inputs=[tensor(t) for t in ins],
        outputs=[tensor(t) for t in outs],
        config=ModelConfig(max_batch_size=max_batch, batcher=batcher) if batcher else ModelConfig(max_batch_size=max_batch),
        strict=True,
    )
    return name, max_batch, max(1, instances)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("repo", type=Path, help="the directory `hilum models export-triton` wrote")
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--grpc-port", type=int, default=8001)
    ap.add_argument("--metrics-port", type=int, default=8002)
    ap.add_argument("--models", default="", help="comma-separated model names (default: all)")
    ap.add_argument("--workspace", type=Path, default=None,
                    help="PyTriton's working directory (default: a new one under ~/.cache/pytriton)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="ONNX Runtime intra-op threads per model")
    ap.add_argument("--ready-file", type=Path, default=None,
                    help="once every model is bound and serving, write the server's URL here "
                         "(atomically: a reader never sees a partial file)")
    args = ap.parse_args()
    ensure_libpython_on_path()

    from pytriton.triton import Triton, TritonConfig

    wanted = {m for m in args.models.split(",") if m}
    dirs = sorted(d for d in args.repo.iterdir() if (d / "config.pbtxt").is_file())
    dirs = [d for d in dirs if not wanted or d.name in wanted]
    if not dirs:
        sys.exit(f"no model (DIR/<model>/config.pbtxt) in {args.repo}: run `hilum models export-triton {args.repo}`")
    config = TritonConfig(
        http_address="127.0.0.1",
        http_port=args.http_port,
        grpc_address="127.0.0.1",
        grpc_port=args.grpc_port,
        metrics_address="127.0.0.1",
        metrics_port=args.metrics_port,
        allow_gpu_metrics=False,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with Triton(config=config, workspace=args.workspace) as triton:
        for d in dirs:
            name, max_batch, instances = bind_model(triton, d, args.threads)
            print(f"bound {name}: max_batch_size {max_batch}, {instances} instance(s)", flush=True)
        triton.run()
        url = f"http://127.0.0.1:{args.http_port}"
        if args.ready_file:
            tmp = args.ready_file.with_name(args.ready_file.name + ".tmp")
            tmp.write_text(url + "\n")
            os.replace(tmp, args.ready_file)
        print(f"ready {url}", flush=True)
        stop.wait()


if __name__ == "__main__":
    main()
