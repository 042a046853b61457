#!/usr/bin/env bash
# Installs CUDA libraries from PyPI into the user cache and prints the folders to put on
# LD_LIBRARY_PATH (colon-separated). No GPU and no CUDA toolkit are needed for NVRTC, which is
# all the tests need (the compile gate). `--runtime` adds cuBLAS, for a GPU machine without a
# CUDA toolkit. Installed once; later runs only print the folders.
#
#   export LD_LIBRARY_PATH="$(bash scripts/cuda-wheels.sh)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
set -euo pipefail
home="${FLOWPREFILL_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/flowprefill}"
dir="$home/cuda-wheels"
py="${FLOWPREFILL_PYTHON:-python3}"
# NVRTC 12.9: what cudarc's `cuda-12090` bindings were generated for.
wheels=("nvidia-cuda-nvrtc-cu12==12.9.86")
libs=("$dir/nvidia/cuda_nvrtc/lib")
if [ "${1:-}" = "--runtime" ]; then
  wheels+=("nvidia-cublas-cu12==12.9.1.4")
  libs+=("$dir/nvidia/cublas/lib")
fi
missing=()
for i in "${!wheels[@]}"; do
  ls "${libs[$i]}"/lib*.so* >/dev/null 2>&1 || missing+=("${wheels[$i]}")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing from PyPI into $dir: ${missing[*]}" >&2
  "$py" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --target "$dir" --upgrade "${missing[@]}" >&2
fi
(IFS=:; echo "${libs[*]}")
