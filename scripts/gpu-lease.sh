#!/usr/bin/env bash
# The GPU checks in two calls of a lent machine whose calls carry at most 64 MiB each (the pack of
# scripts/gpu-pack.sh is about 110 MB, 98 of them the default model, which does not compress).
# Stage 1 brings the program, the test binaries and the model's first part, and runs what needs
# no model: the compile gate, every CUDA op, NCCL, the loader, the autotuner, and the PyTorch
# baseline. Stage 2 brings the model's rest (the machine keeps /tmp while it stays warm between
# the two calls) and runs the model's GPU == CPU test, scripts/gpu-bench.sh (tuned already, the
# PyTorch rows from stage 1), the memory plan against the device's high-water mark, and the f32
# forward beside the bf16 one on the same GPU.
#
#   here:  bash scripts/gpu-pack.sh && bash scripts/gpu-lease.sh prepare    (carry/s1, carry/s2)
#   there: bash scripts/gpu-lease.sh stage1 "$OUT"    (device call 1, carry carry/s1)
#          bash scripts/gpu-lease.sh stage2 "$OUT"    (device call 2, carry carry/s2, at once)
# Each stage leaves at most 8 files in OUT (logs, and one archive of the raw results).
set -uo pipefail
cd "$(dirname "$0")/.."
stage="${1:?prepare, stage1 or stage2}"
S=/tmp/fp-lease
t0=$(date +%s)
mark() { echo "[$(($(date +%s) - t0)) s] $*"; }

case "$stage" in
prepare)
  set -e
  [ -f gpu-pack/manifest ] || { echo "no gpu-pack: run scripts/gpu-pack.sh first" >&2; exit 2; }
  model=$(ls gpu-pack/home/models/*.gguf | head -n1)
  rm -rf carry/s1 carry/s2 && mkdir -p carry/s1 carry/s2
  tar -C . --exclude=gpu-pack/home -cJf carry/s1/pack.tar.xz gpu-pack
  # Stage 1 travels with the scripts: fill it to 62 MiB, the rest of the model goes in stage 2.
  room=$((62 * 1024 * 1024 - $(stat -c %s carry/s1/pack.tar.xz)))
  head -c "$room" "$model" > carry/s1/model.a
  tail -c +"$((room + 1))" "$model" > carry/s2/model.b
  (cd gpu-pack/home/models && sha256sum "$(basename "$model")") > carry/s2/model.sha256
  du -b carry/s1/* carry/s2/*
  ;;
stage1)
  out="${2:?OUT}"
  rm -rf "$S" && mkdir -p "$S/res"
  tar -xJf carry/s1/pack.tar.xz -C "$S" && cp carry/s1/model.a "$S/"
  export FLOWPREFILL_PACK="$S/gpu-pack"
  . scripts/gpu-env.sh
  {
    mark "machine"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    "$FP" devices
    for t in cuda_compile_gate cuda_ops nccl_smoke cuda_libs; do
      mark "test $t"
      timeout 150 "$PACK_TESTS/$t" --nocapture 2>&1 | tee "$S/res/test-$t.log" | grep -E "^test |test result|SKIPPED|skipped|panicked|FAILED" || true
    done
    mark "tune"
    timeout 120 "$FP" tune --device cuda:0 2>&1 | tee "$S/res/tune.txt"
    "$FP" devices > "$S/res/devices-tuned.txt"
    mark "pytorch baseline"
    python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' | tee "$S/res/baseline.txt"
    timeout 150 python3 scripts/torch_baseline.py --shape smollm2-135m --lengths 2048,4096,8000 --runs 3 \
      --decode-context 7036 --decode-tokens 34 > "$S/torch-smollm2-135m.jsonl"
    timeout 240 python3 scripts/torch_baseline.py --shape llama-3.1-8b --lengths 2048,8192,16384,32768 --runs 3 \
      --decode-context 7036 --decode-tokens 34 > "$S/torch-llama-3.1-8b.jsonl"
    cat "$S"/torch-*.jsonl
    mark "stage 1 done"
  } 2>&1 | tee "$out/stage1.log"
  cp "$S"/torch-*.jsonl "$S/res/"
  tar -C "$S" -czf "$out/stage1-results.tgz" res
  ;;
stage2)
  out="${2:?OUT}"
  [ -d "$S/gpu-pack" ] || { echo "stage 1 has not run on this machine (it was given back between the calls)" >&2; exit 2; }
  export FLOWPREFILL_PACK="$S/gpu-pack"
  name=$(awk '{ print $2 }' carry/s2/model.sha256)
  mkdir -p "$S/gpu-pack/home/models"
  cat "$S/model.a" carry/s2/model.b > "$S/gpu-pack/home/models/$name"
  (cd "$S/gpu-pack/home/models" && sha256sum -c "$OLDPWD/carry/s2/model.sha256") || exit 2
  . scripts/gpu-env.sh
  mkdir -p "$S/res2" "$S/bench"
  cp "$S"/torch-*.jsonl "$S/bench/" 2>/dev/null || true
  {
    mark "test cuda (the real model, GPU == CPU)"
    timeout 240 "$PACK_TESTS/cuda" --nocapture 2>&1 | tee "$S/res2/test-cuda.log" | grep -E "^test |test result|SKIPPED|skipped|panicked|FAILED|logit" || true
    mark "gpu-bench"
    GPU_BENCH_TUNE=0 timeout 330 bash scripts/gpu-bench.sh "$S/bench" > "$S/res2/bench.log" 2>&1
    echo "gpu-bench rc=$?"
    cat "$S/bench/bench.md" 2>/dev/null
    mark "f32 forward beside the bf16 one (same GPU, same call)"
    for w in bf16 f32; do
      timeout 60 "$FP" bench prefill --device cuda --weights "$w" --tokens 2048,8000 --runs 3 2>&1 | grep -v "^note" | tail -n 4
      timeout 120 "$FP" --model synthetic:llama-3.1-8b bench prefill --device cuda --weights "$w" --tokens 8192 --runs 3 2>&1 | grep -v "^note" | tail -n 3
    done
    mark "memory plan against the device's high-water mark"
    memory_plan_runs
    mark "stage 2 done"
  } 2>&1 | tee "$out/stage2.log"
  tar -C "$S" -czf "$out/stage2-results.tgz" res2 bench
  ;;
*)
  echo "unknown stage $stage: prepare, stage1 or stage2" >&2
  exit 2
  ;;
esac
