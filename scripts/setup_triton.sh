#!/usr/bin/env bash
# Creates scripts/.venv-triton: a real Triton Inference Server for the kserve backend's tests
# and benchmarks. PyPI's nvidia-pytriton 0.7.0 bundles tritonserver 2.51.0 with the Python
# backend only, so scripts/deploy/triton_serve.py runs each exported model.onnx with ONNX Runtime
# inside its callable. The venv needs pyenv's Python 3.12.1: the backend stub loads its
# libpython3.12.so.1.0 (under 3.11 the models' initialize fails); triton_serve.py puts that
# Python's lib/ on LD_LIBRARY_PATH. The kserve tests find the venv at this path.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.venv-triton"
pyroot="$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"
python="$pyroot/versions/3.12.1/bin/python"
if [ ! -x "$python" ]; then
  echo "setup_triton: $python is missing: install it with \`pyenv install 3.12.1\`" >&2
  exit 1
fi
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv" >&2
fi
"$venv/bin/pip" install -q --disable-pip-version-check -r "$here/requirements-triton.txt" >&2
"$venv/bin/python" -c "import pytriton, onnxruntime, importlib.metadata as m; print('nvidia-pytriton', m.version('nvidia-pytriton'), 'onnxruntime', onnxruntime.__version__)" >&2
