#!/usr/bin/env bash
# Installs a pinned CUDA 13.0 build toolchain (nvcc, headers, cuBLAS, cuRAND, NVRTC, runtime)
# from PyPI into scripts/.venv-cuda and lays it out as a CUDA_HOME in scripts/.cuda, so that
#   eval "$(scripts/setup_cuda_build.sh)"
#   cargo build --release -p hilum-cli --features cuda
# compiles on a machine with no CUDA toolkit and no GPU. The driver library (libcuda.so.1) is not
# on PyPI: a link-time stub exporting the driver API's names is generated here; at run time the
# GPU machine's own driver is loaded. Prints the environment to export on stdout; progress on
# stderr. COMPUTE_CAP (default 90, Hopper) picks the GPU generation the static kernels target;
# WITH_CUDNN=1 adds cuDNN 9.21 for `--features cudnn`.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.venv-cuda"
home="$here/.cuda"
cap="${COMPUTE_CAP:-90}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  echo "creating $venv" >&2
  "$python" -m venv "$venv" >&2
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$here/requirements-cuda.txt" >&2
if [ "${WITH_CUDNN:-0}" = 1 ]; then
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$here/requirements-cudnn.txt" >&2
fi

cu="$("$venv/bin/python" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')"
[ -x "$cu/bin/nvcc" ] || { echo "nvcc not found under $cu" >&2; exit 1; }

# CUDA_HOME layout: bin/ and include/ from the wheels, lib64/ with the unversioned names the
# linker asks for, and lib64/stubs/libcuda.so.
rm -rf "$home"
mkdir -p "$home/lib64/stubs"
ln -s "$cu/bin" "$home/bin"
mkdir -p "$home/include"
ln -s "$cu"/include/* "$home/include/"
[ -d "$cu/nvvm" ] && ln -s "$cu/nvvm" "$home/nvvm"
for so in "$cu"/lib/lib*.so.*; do
  base="$(basename "$so")"
  ln -sf "$so" "$home/lib64/$base"
  ln -sf "$so" "$home/lib64/${base%%.so.*}.so"
done

cudnn="$(dirname "$cu")/cudnn"
if [ "${WITH_CUDNN:-0}" = 1 ] && [ -d "$cudnn" ]; then
  ln -sf "$cudnn"/include/* "$home/include/"
  for so in "$cudnn"/lib/lib*.so.*; do
    base="$(basename "$so")"
    ln -sf "$so" "$home/lib64/$base"
    ln -sf "$so" "$home/lib64/${base%%.so.*}.so"
  done
fi

# The driver stub: every cu* function cuda.h declares, as an empty symbol, in a library whose
# SONAME is the real driver's, so the binary records libcuda.so.1 and resolves it at start.
stub_c="$home/lib64/stubs/cuda_stub.c"
grep -ohE '\bCUDAAPI[[:space:]]+cu[A-Za-z0-9_]+[[:space:]]*\(' "$cu/include/cuda.h" \
  | sed -E 's/CUDAAPI[[:space:]]+//; s/[[:space:]]*\($//' | sort -u \
  | awk '{print "void " $1 "(void) {}"}' > "$stub_c"
# cuda.h renames many entry points to their _v2/_v3 forms with #define; export those too.
grep -ohE '^#define[[:space:]]+cu[A-Za-z0-9_]+[[:space:]]+cu[A-Za-z0-9_]+_v[0-9]+' "$cu/include/cuda.h" \
  | awk '{print "void " $3 "(void) {}"}' | sort -u >> "$stub_c"
sort -u -o "$stub_c" "$stub_c"
cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$home/lib64/stubs/libcuda.so" "$stub_c" >&2
ln -sf stubs/libcuda.so "$home/lib64/libcuda.so"

version="$("$home/bin/nvcc" --version | grep -oE 'release [0-9.]+' || true)"
echo "CUDA toolchain ready in $home ($version, compute capability $cap)" >&2
cat <<ENV
export CUDA_HOME="$home"
export CUDA_PATH="$home"
export CUDA_ROOT="$home"
export NVCC="$home/bin/nvcc"
export PATH="$home/bin:\$PATH"
export CUDA_COMPUTE_CAP="$cap"
export LIBRARY_PATH="$home/lib64:$home/lib64/stubs\${LIBRARY_PATH:+:\$LIBRARY_PATH}"
ENV
