#!/usr/bin/env bash
# What a GPU owner runs first. It first ran on an H100 on 2026-11-23 (docs/gpu.md); the
# tensor-core attention, the bf16 KV cache and flash-decoding came after that run and have been
# verified only by compilation and CPU emulation: this checks them on the hardware.
#   1. the devices and the CUDA libraries found;
#   2. the kernels' compile gate for this GPU, every CUDA op against the CPU backend, the
#      tensor-core self-check (fragment layouts) and the tensor-core attention over a bf16 cache;
#   3. the real model on the GPU against the CPU (first logits, greedy answers);
#   4. full-prefill throughput on the GPU (bench prefill --device cuda; bf16 and f32 caches);
#   5. the attention kernels in TFLOP/s and as a share of the device's dense BF16 peak, the
#      simple kernel beside the tensor-core one, prefill and decode shapes;
#   6. with two or more GPUs: NCCL between them (P GPUs == 1 GPU, ring == full, one process
#      driving every GPU; a killed rank under mpirun named within 30 s) and TTFT over the GPUs;
#   7. the memory plan admission relies on against the device pool's own high-water mark
#      (`run --stats` prints both), about 7K context tokens, full and InfoFlow.
#
# Two ways to run it: on a GPU machine with cargo, `bash scripts/gpu-check.sh` builds and runs;
# on one without network or cargo, build a pack elsewhere (`bash scripts/gpu-pack.sh`), copy
# gpu-pack/ and scripts/ there, and run the same command (scripts/gpu-env.sh picks the pack).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu-env.sh
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
"$FP" devices
# Tests that say skipped are listed at the end: on a GPU machine a GPU test that skips is a
# finding, not a pass.
export FLOWPREFILL_SKIP_LOG="${FLOWPREFILL_SKIP_LOG:-$(mktemp)}"
# run_tests NAME [FILTER]: one CUDA test binary, from the pack or through cargo.
run_tests() {
  if [ -n "$PACK_TESTS" ]; then
    "$PACK_TESTS/$1" ${2:+"$2"} --nocapture
  else
    cargo test --release --workspace --features flowprefill/cuda --features flowprefill/nccl --test "$1" -- ${2:+"$2"} --nocapture
  fi
}
for t in cuda_compile_gate cuda_ops cuda_hopper_fallback nccl_smoke cuda_libs cuda; do run_tests "$t"; done
"$FP" bench prefill --device cuda --tokens 512,2048,4096,8000 --runs 3
# The same in forwards of 2048 tokens (the CPU's size, and the GPU's before 2026-11-27) against
# the GPU's 8192 (the default above): what the larger forwards bring.
"$FP" bench prefill --device cuda --tokens 8000 --runs 3 --prefill-chunk 2048
"$FP" bench prefill --device cuda --kv-dtype f32 --tokens 2048,8000 --runs 3
"$FP" bench prefill --device cuda --weights f32 --kv-dtype f32 --tokens 2048 --runs 3
# The attention kernels alone: the autotuner's choice, then each configuration of the Hopper
# kernel (on a GPU of compute capability 9.0 after its self-check; elsewhere the backend says it
# is not used and the tables are flash2's again), each with its ratio to PyTorch's SDPA timed
# just before on this GPU (where PyTorch is installed).
attention_bench() {
  if [ -n "$PACK_TESTS" ]; then "$PACK_TESTS/../cuda_attention_bench" "$@"
  else cargo run --release -p flowprefill-kernels --features cuda --example cuda_attention_bench -- "$@"; fi
}
sdpa=()
sdpa_file=$(mktemp)
if python3 scripts/sdpa_baseline.py | tee "$sdpa_file"; then sdpa=(--sdpa "$sdpa_file"); fi
attention_bench "${sdpa[@]}"
for k in hopper hopper:c1 hopper:c2 hopper:c3 hopper:c4 hopper:c5 hopper:c6 hopper:c7; do FLOWPREFILL_FLASH_KERNEL=$k attention_bench "${sdpa[@]}"; done
# The Hopper kernel from the kernel sources of an earlier commit (gpu-pack/ab, packed by
# scripts/gpu-pack.sh) against the current one, alternating: a kernel change timed in one run.
if [ -n "$PACK_TESTS" ] && [ -d "$pack/ab" ]; then
  ab_dir="$(cd "$pack/ab" && pwd)"
  ab_out=$(mktemp -d)
  for r in 1 2 3; do
    echo "A/B round $r: before ($ab_dir)"
    FLOWPREFILL_CUDA_SOURCES="$ab_dir" FLOWPREFILL_FLASH_KERNEL=hopper attention_bench --quick 2>&1 | tee "$ab_out/ab-before-$r.txt"
    echo "A/B round $r: after"
    FLOWPREFILL_FLASH_KERNEL=hopper attention_bench --quick 2>&1 | tee "$ab_out/ab-after-$r.txt"
  done
  python3 scripts/ab-summary.py "$ab_out"/ab-*.txt
  rm -rf "$ab_out"
fi
# Decode at about 7K tokens of context, steps recorded once as a CUDA graph and replayed (the
# default) against op by op, alternating, three calls each: ms per token over answers of 128
# tokens (`bench decode` asks for a long answer; a short one gives too few replayed steps to
# time: 13 of 16 on an H200, 2026-11-27).
decode_out=$(mktemp -d)
for g in on off on off on off; do
  echo "decode graphs $g"
  FLOWPREFILL_DECODE_GRAPH=$g "$FP" bench decode --device cuda --tokens 7000 --evict none --max-tokens 128 \
    --runs 3 --out "$decode_out/$g" | tail -n 3
done
rm -rf "$decode_out"
gpus=$("$FP" devices | grep -c '^cuda:[0-9]' || true)
if [ "$gpus" -ge 2 ]; then
  run_tests cuda p_gpus
  if command -v mpirun >/dev/null 2>&1 && [ -z "$PACK_TESTS" ]; then
    cargo test --release -p flowprefill --features nccl,mpi --test e2e killed -- --nocapture
  fi
  ranks=$(seq -s, 1 "$gpus")
  "$FP" bench ttft --device cuda --lengths 8000,16000,32000 --ranks "$ranks" --methods full,ring,infoflow --runs 3
else
  echo "one GPU: the NCCL checks need two (skipped)"
fi
memory_plan_runs
if [ -s "$FLOWPREFILL_SKIP_LOG" ]; then
  echo "tests that said skipped on this GPU machine (by reason):"
  cut -f1 "$FLOWPREFILL_SKIP_LOG" | sort | uniq -c
fi
