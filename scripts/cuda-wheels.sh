#!/usr/bin/env bash
# Installs CUDA libraries from PyPI into the user cache and prints the folders to put on
# LD_LIBRARY_PATH (colon-separated). No GPU and no CUDA toolkit are needed for NVRTC, which is
# all the compile gate needs. `--runtime` adds cuBLAS, for a GPU machine without a CUDA
# toolkit; `--nccl` adds NCCL (its version and unique ids need no GPU: the CI smoke test).
# Options combine. Installed once; later runs only print the folders.
# `nvdisasm` (alone) installs the SASS disassembler instead and prints its path: the static
# gate of the compile-gate test reads the kernels' machine code with it (no GPU needed).
#
#   export LD_LIBRARY_PATH="$(bash scripts/cuda-wheels.sh)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
#   export FLOWPREFILL_NVDISASM="$(bash scripts/cuda-wheels.sh nvdisasm)"
set -euo pipefail
home="${FLOWPREFILL_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/flowprefill}"
dir="$home/cuda-wheels"
py="${FLOWPREFILL_PYTHON:-python3}"
if [ "${1:-}" = nvdisasm ]; then
  # 13.5: the only line on PyPI (there is no -cu12 wheel); it reads NVRTC 12.9's sm_80 and
  # sm_90a CUBINs.
  tool="$dir/nvdisasm/nvidia/cu13/bin/nvdisasm"
  if [ ! -x "$tool" ]; then
    echo "installing nvidia-cuda-nvdisasm==13.5.37 from PyPI into $dir/nvdisasm" >&2
    "$py" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps \
      --target "$dir/nvdisasm" --upgrade nvidia-cuda-nvdisasm==13.5.37 >&2
    chmod +x "$tool"
  fi
  "$tool" --version >/dev/null || { echo "cuda-wheels.sh: $tool does not run" >&2; exit 1; }
  echo "$tool"
  exit 0
fi
# NVRTC 12.9: what cudarc's `cuda-12090` bindings were generated for.
# Each wheel in its own folder: `pip install --target` replaces a top-level folder that is
# already there, and every one of these wheels installs into `nvidia/`.
# `needs` names the files the loaders open (cudarc dlopens by soname; NVRTC loads its builtins):
# a wheel counts as installed when they are there, not when any library is.
wheels=("nvidia-cuda-nvrtc-cu12==12.9.86")
libs=("$dir/nvrtc/nvidia/cuda_nvrtc/lib")
needs=("libnvrtc.so.12 libnvrtc-builtins.so.12.9")
for opt in "$@"; do
  case "$opt" in
    --runtime)
      wheels+=("nvidia-cublas-cu12==12.9.1.4")
      libs+=("$dir/cublas/nvidia/cublas/lib")
      needs+=("libcublas.so.12 libcublasLt.so.12")
      ;;
    # NCCL 2.30: what cudarc's `nccl` bindings (nccl-02030) were generated for.
    --nccl)
      wheels+=("nvidia-nccl-cu12==2.30.7")
      libs+=("$dir/nccl/nvidia/nccl/lib")
      needs+=("libnccl.so.2")
      ;;
    *)
      echo "cuda-wheels.sh: unknown option $opt (use --runtime, --nccl)" >&2
      exit 2
      ;;
  esac
done
for i in "${!wheels[@]}"; do
  lib="${libs[$i]}"
  have=1
  for f in ${needs[$i]}; do [ -e "$lib/$f" ] || have=0; done
  [ $have = 1 ] && continue
  target="${lib%/nvidia/*}"
  echo "installing ${wheels[$i]} from PyPI into $target" >&2
  "$py" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --target "$target" --upgrade "${wheels[$i]}" >&2
done
# The NCCL wheel ships libnccl.so.2 only; cudarc loads libnccl.so.
nccl="$dir/nccl/nvidia/nccl/lib"
if [ -e "$nccl/libnccl.so.2" ] && [ ! -e "$nccl/libnccl.so" ]; then
  ln -s libnccl.so.2 "$nccl/libnccl.so"
fi
(IFS=:; echo "${libs[*]}")
