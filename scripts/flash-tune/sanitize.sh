#!/usr/bin/env bash
# compute-sanitizer (racecheck, synccheck, memcheck) over both tensor-core attention kernels at
# two small shapes (rows and keys not multiples of the tiles): scripts/flash-tune/harness.cu.
# The launch shapes come from `flowprefill tune --header 0` (the default configuration).
set -uo pipefail
source scripts/gpu-env.sh
w=/tmp/san; mkdir -p $w
"$FP" tune --header 0 > $w/shapes.h || exit 1
nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -lineinfo -I kernels/cuda -include $w/shapes.h -DVARIANT='"f2c0"' -DFLASH2 -DFLASH_SRC="\"$(pwd)/kernels/cuda/flash2.cu\"" scripts/flash-tune/harness.cu -o $w/f2 || exit 1
nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -lineinfo -I kernels/cuda -include $w/shapes.h -DVARIANT='"flash"' -DFLASH_SRC="\"$(pwd)/kernels/cuda/flash.cu\"" scripts/flash-tune/harness.cu -o $w/f1 || exit 1
run() {  # binary "n d" tool
  echo "=== $1 $2 $3"; timeout 90 compute-sanitizer --tool $3 --print-limit 5 $w/$1 1 $2 2>&1 | tail -4
}
for b in f2 f1; do for s in "777 64" "1000 128"; do run $b "$s" racecheck; done; done
for s in "777 64" "1000 128"; do run f2 "$s" memcheck; done
run f2 "1000 128" synccheck
