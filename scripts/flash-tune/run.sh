#!/usr/bin/env bash
# On a GPU machine with nvcc (no cargo needed): builds kernels/cuda/flash.cu at several launch
# shapes (rows per block, keys per tile, threads), checks each against a plain attention and
# times it at the cuda_attention_bench shapes; then PyTorch SDPA on the same GPU, and Nsight
# Compute on the present shape at 8192 x 32/8 x d128 when ncu is there.
#   bash scripts/flash-tune/run.sh [OUT]     (default OUT: flash-tune-out)
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:-flash-tune-out}"
mkdir -p "$out"
work=$(mktemp -d)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$out/gpu.txt"
nvcc --version | tail -2 | tee -a "$out/gpu.txt"
# name rows keys threads min_blocks
variants="r64k64t128b2 64 64 128 2
r64k32t128b2 64 32 128 2
r64k128t128b1 64 128 128 1
r128k64t256b1 128 64 256 1
r128k32t256b1 128 32 256 1
r128k128t256b1 128 128 256 1"
while read -r name rows keys threads minb; do
  sed -e "s/^#define FP_FA_ROWS 64/#define FP_FA_ROWS $rows/" -e "s/^#define FP_FA_KEYS 64/#define FP_FA_KEYS $keys/" \
      -e "s/^#define FP_FA_THREADS 128/#define FP_FA_THREADS $threads/" \
      -e "s/__launch_bounds__(FP_FA_THREADS, 2)/__launch_bounds__(FP_FA_THREADS, $minb)/" kernels/cuda/flash.cu > "$work/$name.cu"
  ( nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -I kernels/cuda \
      -DFLASH_SRC="\"$work/$name.cu\"" -DVARIANT="\"$name\"" scripts/flash-tune/harness.cu -o "$work/$name" \
      > "$work/$name.build" 2>&1 || echo "BUILD FAILED $name" ) &
done <<< "$variants"
wait
for b in "$work"/*.build; do echo "== $b"; grep -A1 "fp_flash_attn" "$b" | grep -i "registers\|spill" ; grep -i "error\|FAILED" "$b"; done > "$out/build.txt" 2>&1
cat "$work"/*.build > "$out/builds.log"; cat "$out/build.txt"
printf "%-14s %6s %8s %4s %9s %8s %9s\n" variant n heads d ms TF/s relerr | tee "$out/tune.txt"
while read -r name _; do
  [ -x "$work/$name" ] && "$work/$name" 21 2>&1 | tee -a "$out/tune.txt"
done <<< "$variants"
python3 scripts/sdpa_baseline.py --runs 21 2>&1 | tee "$out/sdpa.txt"
if command -v ncu >/dev/null; then
  timeout 240 ncu --kernel-name regex:fp_flash_attn_d128 --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section InstructionStats \
    --section Occupancy --section SchedulerStats --section MemoryWorkloadAnalysis \
    "$work/r64k64t128b2" 3 8192 128 > "$out/ncu.txt" 2>&1; echo "ncu rc $?"
  grep -E "Duration|Throughput|Issued|Stall|Occupancy|Registers|Warp Cycles|Eligible|No Eligible|Executed Ipc" "$out/ncu.txt" | head -60
fi
