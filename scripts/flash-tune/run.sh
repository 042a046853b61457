#!/usr/bin/env bash
# On a GPU machine with nvcc (no cargo needed): builds kernels/cuda/flash.cu and every
# configuration of kernels/cuda/flash2.cu (the launch-shape headers come from
# `flowprefill tune --header N`: the same #defines flowprefill compiles them with), checks each
# against a plain attention and times it at the cuda_attention_bench shapes; then PyTorch SDPA
# on the same GPU, and Nsight Compute on the default configuration at 8192 x 32/8 x d128 when
# ncu is there. (`flowprefill tune` times the same configurations inside flowprefill.)
#   bash scripts/flash-tune/run.sh [OUT]     (default OUT: flash-tune-out)
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/gpu-env.sh
out="${1:-flash-tune-out}"
mkdir -p "$out"
work=$(mktemp -d)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$out/gpu.txt"
nvcc --version | tail -2 | tee -a "$out/gpu.txt"
build() {  # name header flags...
  local name=$1 header=$2; shift 2
  nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -I kernels/cuda -include "$header" \
    -DVARIANT="\"$name\"" "$@" scripts/flash-tune/harness.cu -o "$work/$name" > "$work/$name.build" 2>&1 || echo "BUILD FAILED $name"
}
# Every configuration flowprefill has: headers 0, 1, ... until one is refused.
configs=""
while "$FP" tune --header "${c:=0}" > "$work/shapes_c$c.h" 2>/dev/null; do configs="$configs $c"; c=$((c + 1)); done
[ -n "$configs" ] || { echo "flowprefill tune --header 0 failed: is $FP a build with this change?" >&2; exit 1; }
old=flash
build flash "$work/shapes_c0.h" -DFLASH_SRC="\"$(pwd)/kernels/cuda/flash.cu\"" &
f2=""
for c in $configs; do
  f2="$f2 f2c$c"
  build "f2c$c" "$work/shapes_c$c.h" -DFLASH2 -DFLASH_SRC="\"$(pwd)/kernels/cuda/flash2.cu\"" &
done
wait
for b in "$work"/*.build; do echo "== $b"; grep -A2 "Compiling entry function 'fp_flash" "$b" | grep -i "registers\|spill"; grep -i "error\|FAILED" "$b"; done > "$out/build.txt" 2>&1
cat "$work"/*.build > "$out/builds.log"; cat "$out/build.txt"
printf "%-14s %6s %8s %4s %9s %8s %9s\n" variant n heads d ms TF/s relerr | tee "$out/tune.txt"
for name in $old $f2; do
  [ -x "$work/$name" ] && "$work/$name" 21 2>&1 | tee -a "$out/tune.txt"
done
python3 scripts/sdpa_baseline.py --runs 21 2>&1 | tee "$out/sdpa.txt"
if command -v ncu >/dev/null; then
  for name in ${NCU_VARIANTS:-f2c0}; do
    echo "=== ncu $name" >> "$out/ncu.txt"
    timeout 120 ncu --kernel-name regex:'fp_flash2?_attn_d128' --launch-skip 3 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section InstructionStats \
      --section Occupancy --section SchedulerStats --section MemoryWorkloadAnalysis_Tables "$work/$name" 3 8192 128 >> "$out/ncu.txt" 2>&1; echo "ncu $name rc $?"
  done
  grep -E "Duration|Throughput|Issued|Stall|Occupancy|Registers|Warp Cycles|Eligible|No Eligible|Executed Ipc" "$out/ncu.txt" | head -60
fi
