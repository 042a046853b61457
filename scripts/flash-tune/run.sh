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
# flash.cu (today's kernel, the baseline of the same run): name rows keys threads min_blocks
old="r64k64t128b2 64 64 128 2"
# flash2.cu: name warps row-tiles-per-warp keys min_blocks [nvcc flags] (at both head dimensions;
# warps 0 builds the file's own per-dimension defaults)
f2="${FLASH2_VARIANTS:-f2default 0 0 0 0
f2w4m1k64b2 4 1 64 2
f2w4m2k64b1 4 2 64 1
f2w4m2k32b1 4 2 32 1
f2w8m2k64b1 8 2 64 1}"
build() {  # name flags...
  local name=$1; shift
  nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -I kernels/cuda -DVARIANT="\"$name\"" "$@" \
    scripts/flash-tune/harness.cu -o "$work/$name" > "$work/$name.build" 2>&1 || echo "BUILD FAILED $name"
}
while read -r name rows keys threads minb; do
  sed -e "s/^#define FP_FA_ROWS 64/#define FP_FA_ROWS $rows/" -e "s/^#define FP_FA_KEYS 64/#define FP_FA_KEYS $keys/" \
      -e "s/^#define FP_FA_THREADS 128/#define FP_FA_THREADS $threads/" \
      -e "s/__launch_bounds__(FP_FA_THREADS, 2)/__launch_bounds__(FP_FA_THREADS, $minb)/" kernels/cuda/flash.cu > "$work/$name.cu"
  build "$name" -DFLASH_SRC="\"$work/$name.cu\"" &
done <<< "$old"
while read -r name warps wm keys minb extra; do
  shape=(${extra:-})
  if [ "$warps" != 0 ]; then
    for d in 64 128; do
      shape+=(-DFP_FA2_D${d}_WARPS=$warps -DFP_FA2_D${d}_WM=$wm -DFP_FA2_D${d}_KEYS=$keys -DFP_FA2_D${d}_MINB=$minb)
    done
  fi
  build "$name" -DFLASH2 -DFLASH_SRC="\"$(pwd)/kernels/cuda/flash2.cu\"" "${shape[@]}" &
done <<< "$f2"
wait
for b in "$work"/*.build; do echo "== $b"; grep -A2 "Compiling entry function 'fp_flash" "$b" | grep -i "registers\|spill"; grep -i "error\|FAILED" "$b"; done > "$out/build.txt" 2>&1
cat "$work"/*.build > "$out/builds.log"; cat "$out/build.txt"
printf "%-14s %6s %8s %4s %9s %8s %9s\n" variant n heads d ms TF/s relerr | tee "$out/tune.txt"
for name in $(echo "$old" | cut -d' ' -f1) $(echo "$f2" | cut -d' ' -f1); do
  [ -x "$work/$name" ] && "$work/$name" 21 2>&1 | tee -a "$out/tune.txt"
done
python3 scripts/sdpa_baseline.py --runs 21 2>&1 | tee "$out/sdpa.txt"
if command -v ncu >/dev/null; then
  for name in ${NCU_VARIANTS:-f2default}; do
    echo "=== ncu $name" >> "$out/ncu.txt"
    timeout 120 ncu --kernel-name regex:'fp_flash2?_attn_d128' --launch-skip 3 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section InstructionStats \
      --section Occupancy --section SchedulerStats --section MemoryWorkloadAnalysis_Tables "$work/$name" 3 8192 128 >> "$out/ncu.txt" 2>&1; echo "ncu $name rc $?"
  done
  grep -E "Duration|Throughput|Issued|Stall|Occupancy|Registers|Warp Cycles|Eligible|No Eligible|Executed Ipc" "$out/ncu.txt" | head -60
fi
