#!/usr/bin/env bash
# Installs the Python side of Hilum's models into scripts/.venv-models:
#  - onnxruntime 1.31.1, whose libonnxruntime.so the `ort` crate loads at run time (load-dynamic);
#  - h5py + numpy, for the Keras fixtures (scripts/fixtures/make_keras_fixtures.py; `hilum models import`
#    reads .h5 files itself).
# Prints the environment to export (CI: eval "$(scripts/setup_onnxruntime.sh)").
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.venv-models"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv" >&2
fi
"$venv/bin/pip" install -q -r "$here/requirements-models.txt" >&2
lib="$("$venv/bin/python" - <<'PY'
import glob, os, onnxruntime
capi = os.path.join(os.path.dirname(onnxruntime.__file__), "capi")
libs = sorted(glob.glob(os.path.join(capi, "libonnxruntime.so*")) + glob.glob(os.path.join(capi, "libonnxruntime*.dylib")))
print(libs[-1] if libs else "")
PY
)"
if [ -z "$lib" ]; then
  echo "onnxruntime installed but no libonnxruntime found in its capi/ folder" >&2
  exit 1
fi
echo "export ORT_DYLIB_PATH=$lib"
