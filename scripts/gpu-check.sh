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
#      driving every GPU; a killed rank under mpirun named within 30 s) and TTFT over the GPUs.
set -euo pipefail
cd "$(dirname "$0")/.."
libs=$(bash scripts/cuda-wheels.sh --runtime --nccl)
export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export FLOWPREFILL_REQUIRE_NVRTC=1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
cargo build --release --features cuda
./target/release/flowprefill devices
cargo test --release -p flowprefill-kernels --features cuda -- --nocapture
cargo test --release -p flowprefill --features cuda --test cuda -- --nocapture
./target/release/flowprefill bench prefill --device cuda --tokens 512,2048,4096,8000 --runs 3
./target/release/flowprefill bench prefill --device cuda --kv-dtype f32 --tokens 2048,8000 --runs 3
./target/release/flowprefill bench prefill --device cuda --weights f32 --kv-dtype f32 --tokens 2048 --runs 3
cargo run --release -p flowprefill-kernels --features cuda --example cuda_attention_bench
gpus=$(./target/release/flowprefill devices | grep -c '^cuda:[0-9]' || true)
if [ "$gpus" -ge 2 ]; then
  cargo test --release -p flowprefill --features cuda --test cuda p_gpus -- --nocapture
  if command -v mpirun >/dev/null 2>&1; then
    cargo test --release -p flowprefill --features cuda,mpi --test mpi killed -- --nocapture
  fi
  ranks=$(seq -s, 1 "$gpus")
  ./target/release/flowprefill bench ttft --device cuda --lengths 8000,16000,32000 --ranks "$ranks" --methods full,ring,infoflow --runs 3
else
  echo "one GPU: the NCCL checks need two (skipped)"
fi
