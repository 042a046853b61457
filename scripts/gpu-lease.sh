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
#          bash scripts/gpu-lease.sh slim      (only scripts/ travels; `unslim` after the lease)
#   there: bash scripts/gpu-lease.sh stage1 "$OUT"    (device call 1, carry carry/s1)
#          bash scripts/gpu-lease.sh stage2 "$OUT"    (device call 2, carry carry/s2, at once)
#          again1 / again2: a shorter second round after a fix (the CUDA ops; then TTFT with caches
#          cold / RAM / disk, decode with and without CUDA graphs, ncu per kernel, memcheck)
# Each stage leaves at most 8 files in OUT (logs, and one archive of the raw results).
set -uo pipefail
cd "$(dirname "$0")/.."
stage="${1:?prepare, stage1 or stage2}"
S=/tmp/fp-lease
t0=$(date +%s)
mark() { echo "[$(($(date +%s) - t0)) s] $*"; }
# kernel_env KERNEL CMD...: CMD with the attention kernel fixed (FLOWPREFILL_FLASH_KERNEL), or as
# the autotuner decides (auto).
kernel_env() {
  local k="$1"; shift
  if [ "$k" = auto ]; then env -u FLOWPREFILL_FLASH_KERNEL "$@"; else FLOWPREFILL_FLASH_KERNEL="$k" "$@"; fi
}

# pack_test NAME SECONDS LOG [ARGS...]: a test binary of the pack, its lines of interest shown; a
# failure (a failed test, a panic, a timeout) is recorded in $S/failed and a test that skipped in
# $S/skips (FLOWPREFILL_SKIP_LOG), both reported at the stage's end (`stage_end`), which then
# exits non-zero: a GPU run whose tests failed must not read as a good one.
pack_test() {
  local t="$1" secs="$2" log="$3"
  shift 3
  FLOWPREFILL_SKIP_LOG="$S/skips" timeout "$secs" "$PACK_TESTS/$t" "$@" --nocapture 2>&1 | tee "$log" |
    grep -E "^test |test result|SKIPPED|skipped|panicked|FAILED|self-check|hopper|logit"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || echo "$t (exit $rc$([ "$rc" = 124 ] && echo ': timed out'))" >>"$S/failed"
}
# stage_end: the failed and skipped tests of this stage; non-zero when a test failed.
stage_end() {
  [ ! -s "$S/skips" ] || { echo "tests that said skipped:"; cut -f1 "$S/skips" | sort | uniq -c; }
  if [ -s "$S/failed" ]; then
    echo "FAILED: $(paste -sd, "$S/failed")"
    return 1
  fi
}

# unpack: the pack of carry/s1 and the model's first part into $S (call 1 of a round).
unpack() {
  rm -rf "$S" && mkdir -p "$S/res"
  tar -xJf carry/s1/pack.tar.xz -C "$S" && cp carry/s1/model.a "$S/"
  export FLOWPREFILL_PACK="$S/gpu-pack"
}
# join_model FIRST: the model whole again from its first part (call 1) and carry/s2's rest,
# checked (call 2 of a round, on the machine call 1 left warm).
join_model() {
  [ -d "$S/gpu-pack" ] || { echo "$1 has not run on this machine (it was given back between the calls)" >&2; exit 2; }
  export FLOWPREFILL_PACK="$S/gpu-pack"
  local name
  name=$(awk '{ print $2 }' carry/s2/model.sha256)
  mkdir -p "$S/gpu-pack/home/models"
  cat "$S/model.a" carry/s2/model.b > "$S/gpu-pack/home/models/$name"
  (cd "$S/gpu-pack/home/models" && sha256sum -c "$OLDPWD/carry/s2/model.sha256") || exit 2
}

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
prepare-one)
  # The pack without the model (stage `one`), and the model's tokenizer alone (1.8 MB, for the
  # synthetic 8B shape's prefill and TTFT): carry carry/one.
  set -e
  [ -f gpu-pack/manifest ] || { echo "no gpu-pack: run scripts/gpu-pack.sh first" >&2; exit 2; }
  model=$(ls gpu-pack/home/models/*.gguf | head -n1)
  rm -rf carry/one && mkdir -p carry/one
  tar -C . --exclude=gpu-pack/home -cJf carry/one/pack.tar.xz gpu-pack
  gpu-pack/flowprefill --tokenizer "$model" write-gguf --tokenizer-only --out carry/one/tokenizer.gguf
  du -b carry/one/*
  ;;
slim)
  # The checkout travels with every call and counts towards its 64 MiB (about 63 MiB tracked on
  # 2026-11-27, docs/eval and adapters/ most of it): for the lease only scripts/ travels. The
  # index is kept aside and everything else made untracked and ignored (no file is touched);
  # `unslim` puts the index back.
  set -e
  [ ! -e .git/index.lease ] || { echo "slim already (run unslim first)" >&2; exit 2; }
  cp .git/index .git/index.lease
  [ ! -e .git/info/exclude ] || cp .git/info/exclude .git/info/exclude.lease
  git rm -r --cached -q .
  git add scripts
  mkdir -p .git/info && printf '/*\n!/scripts/\n' > .git/info/exclude
  echo "travels: $(git ls-files | wc -l) files, $(git ls-files -z | xargs -0 stat -c %s | awk '{s+=$1} END {print s}') bytes, and carry/"
  ;;
unslim)
  set -e
  [ -e .git/index.lease ] || { echo "not slim" >&2; exit 2; }
  mv .git/index.lease .git/index
  if [ -e .git/info/exclude.lease ]; then mv .git/info/exclude.lease .git/info/exclude; else rm -f .git/info/exclude; fi
  git status --short
  ;;
stage1)
  out="${2:?OUT}"
  unpack
  . scripts/gpu-env.sh
  {
    mark "machine"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    "$FP" devices
    for t in cuda_compile_gate cuda_ops cuda_hopper_fallback nccl_smoke cuda_libs; do
      mark "test $t"
      pack_test "$t" 150 "$S/res/test-$t.log"
    done
    mark "tune"
    timeout 120 "$FP" tune --device cuda:0 2>&1 | tee "$S/res/tune.txt"
    "$FP" devices > "$S/res/devices-tuned.txt"
    # The attention kernels alone, PyTorch SDPA on the same shapes first (the benches print the
    # ratio to it): the autotuner's choice, then each Hopper configuration fixed.
    mark "pytorch sdpa"
    timeout 120 python3 scripts/sdpa_baseline.py 2>&1 | tee "$S/res/sdpa.txt"
    for k in auto hopper hopper:c1 hopper:c2 hopper:c3; do
      mark "attention bench: $k"
      kernel_env "$k" timeout 120 "$S/gpu-pack/cuda_attention_bench" --sdpa "$S/res/sdpa.txt" 2>&1 | tee "$S/res/attention-${k/:/-}.txt"
    done
    # The polynomial exp2 configurations, three consumers at d64 and the persistent kernel (new
    # 2026-11-27), up to 8K.
    for k in hopper:c4 hopper:c5 hopper:c6 hopper:c7; do
      mark "attention bench: $k"
      kernel_env "$k" timeout 60 "$S/gpu-pack/cuda_attention_bench" --quick --sdpa "$S/res/sdpa.txt" 2>&1 | tee "$S/res/attention-${k/:/-}.txt"
    done
    # A/B against the kernel sources packed from an earlier commit (gpu-pack/ab, GPU_PACK_AB of
    # scripts/gpu-pack.sh), the Hopper kernel fixed, alternating, up to 8K.
    if [ -d "$S/gpu-pack/ab" ]; then
      for r in 1 2 3; do
        for v in before after; do
          mark "attention A/B: $v, round $r"
          src=""
          [ "$v" = before ] && src="$S/gpu-pack/ab"
          FLOWPREFILL_CUDA_SOURCES="$src" FLOWPREFILL_FLASH_KERNEL=hopper timeout 60 \
            "$S/gpu-pack/cuda_attention_bench" --quick > "$S/res/ab-$v-$r.txt" 2>&1
          grep -E "built with|8192|4096" "$S/res/ab-$v-$r.txt" | head -n 8
        done
      done
      # Per prefill shape: the median over the rounds of each side's device TF/s, and their ratio.
      python3 scripts/ab-summary.py "$S"/res/ab-*.txt
    fi
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
  stage_end
  ;;
stage2)
  out="${2:?OUT}"
  join_model "stage 1"
  rm -f "$S/failed" "$S/skips"
  . scripts/gpu-env.sh
  mkdir -p "$S/res2" "$S/bench"
  cp "$S"/torch-*.jsonl "$S/bench/" 2>/dev/null || true
  {
    mark "test cuda (the real model, GPU == CPU)"
    pack_test cuda 240 "$S/res2/test-cuda.log"
    mark "InfoFlow, 8B shape, 32768 tokens: segments gathered into one attention call (default) or one call each (=0)"
    for g in default 0 default 0; do
      echo "FLOWPREFILL_GATHERED_KEYS: $g"
      if [ "$g" = default ]; then set -- env -u FLOWPREFILL_GATHERED_KEYS; else set -- env FLOWPREFILL_GATHERED_KEYS=0; fi
      "$@" timeout 120 "$FP" --model synthetic:llama-3.1-8b bench ttft --device cuda --lengths 32768 --ranks 1 \
        --methods full,infoflow --runs 3 --out "$S/gather-$g" 2>&1 | grep "P=1"
    done
    mark "gpu-bench"
    GPU_BENCH_TUNE=0 timeout 330 bash scripts/gpu-bench.sh "$S/bench" > "$S/res2/bench.log" 2>&1
    echo "gpu-bench rc=$?"
    cat "$S/bench/bench.md" 2>/dev/null
    mark "prefill in forwards of 2048 tokens against the GPU's 8192 (alternating, same call)"
    for c in 2048 8192 2048 8192; do
      echo "prefill chunk $c"
      timeout 60 "$FP" bench prefill --device cuda --prefill-chunk "$c" --tokens 8000 --runs 3 2>&1 | grep -v "^note" | tail -n 2
      timeout 120 "$FP" --model synthetic:llama-3.1-8b bench prefill --device cuda --prefill-chunk "$c" --tokens 32768 --runs 3 2>&1 | grep -v "^note" | tail -n 2
    done
    mark "decode: steps replayed from a CUDA graph against op by op, alternating"
    write_context "$S/decode.txt" 7000
    for g in on off on off on off; do
      FLOWPREFILL_DECODE_GRAPH=$g timeout 60 "$FP" run --device cuda --method full --json --max-tokens 150 \
        --doc "$S/decode.txt" --query "Count from 1 to 100, one number per line." > "$S/res2/decode-$g.json" 2> "$S/res2/decode-$g.err"
      python3 -c 'import json,sys; d=json.load(open(sys.argv[2])); print("decode graphs", sys.argv[1], d["n_context_tokens"], "tokens:", d["decode_ms_per_token"], "ms/token, replayed", d.get("decode_replayed"), "answer", hash(d["answer"]))' "$g" "$S/res2/decode-$g.json"
      cat "$S/res2/decode-$g.err"
    done
    mark "8B shape prefill: flash2 against the Hopper kernel (same call)"
    for k in fa2 hopper auto; do
      echo "kernel $k"
      kernel_env "$k" timeout 150 "$FP" --model synthetic:llama-3.1-8b bench prefill --device cuda --tokens 8192,32768 --runs 3 2>&1 | grep -v "^note" | tail -n 4
    done
    mark "bench ttft: caches cold, in RAM, on disk (disk -> pinned host -> device)"
    timeout 200 "$FP" bench ttft --device cuda --lengths 2048,8000 --ranks 1 --methods full,infoflow,none \
      --cache cold,ram,disk --runs 3 --out "$S/ttft-cache" 2>&1 | tail -n 30
    cp "$S"/ttft-cache/*.csv "$S"/ttft-cache/*.txt "$S/res2/" 2>/dev/null
    mark "memory plan against the device's high-water mark"
    memory_plan_runs
    mark "stage 2 done"
  } 2>&1 | tee "$out/stage2.log"
  tar -C "$S" -czf "$out/stage2-results.tgz" res2 bench
  stage_end
  ;;
again1)
  # A second round in the same session, after a fix (about 3 minutes in all with again2): the
  # pack and the model's first part, the CUDA ops against the CPU (the new batched copies too).
  out="${2:?OUT}"
  unpack
  . scripts/gpu-env.sh
  {
    mark "machine"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    mark "test cuda_ops"
    pack_test cuda_ops 150 "$S/res/test-cuda_ops.log"
    mark "again1 done"
  } 2>&1 | tee "$out/again1.log"
  stage_end
  ;;
again2)
  # The model's rest, then TTFT with chunk caches cold / in RAM / on disk (the disk tier's
  # batched copies and writes after the answer), and decode with steps replayed from a CUDA
  # graph against op by op (bench decode: answers of --max-tokens tokens), alternating.
  out="${2:?OUT}"
  join_model again1
  rm -f "$S/failed" "$S/skips"
  . scripts/gpu-env.sh
  mkdir -p "$S/res2"
  {
    mark "bench ttft: caches cold, in RAM, on disk"
    timeout 200 "$FP" bench ttft --device cuda --lengths 2048,8000 --ranks 1 --methods full,infoflow,none \
      --cache cold,ram,disk --runs 3 --out "$S/ttft-cache" 2>&1 | grep -v "^ *[0-9]* tokens  P=" | tail -n 22
    cp "$S"/ttft-cache/*.csv "$S/res2/" 2>/dev/null
    mark "bench decode: graphs on / off, alternating"
    for g in on off on off on off; do
      echo "decode graphs $g"
      FLOWPREFILL_DECODE_GRAPH=$g timeout 90 "$FP" bench decode --device cuda --tokens 7000 --evict none \
        --max-tokens 128 --runs 3 --out "$S/decode-$g" 2>&1 | tail -n 4
      cat "$S/decode-$g"/*.csv > "$S/res2/decode-$g.csv" 2>/dev/null
    done
    # Where a SmolLM2 prefill's GPU time goes, kernel by kernel (Nsight Compute's durations;
    # the clocks left alone), and the Hopper attention under the memory checker.
    if command -v ncu >/dev/null; then
      mark "ncu: SmolLM2 full prefill at 8000 tokens, per kernel"
      timeout 100 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
        "$FP" bench prefill --device cuda --tokens 8000 --runs 1 > "$S/res2/ncu-prefill-8000.csv" 2> "$S/res2/ncu.err"
      echo "ncu rc $? ($(wc -l < "$S/res2/ncu-prefill-8000.csv") lines)"
    fi
    cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n1)
    if [ -n "$cs" ]; then
      mark "compute-sanitizer memcheck: the Hopper kernel (self-check, prefill 2K-4K, decode over 8K keys)"
      FLOWPREFILL_FLASH_KERNEL=hopper timeout 90 "$cs" --tool memcheck "$PACK_TESTS/cuda_ops" \
        tensor_core_attention_over_a_bf16_cache --nocapture 2>&1 | tail -n 8
    fi
    mark "again2 done"
  } 2>&1 | tee "$out/again2.log"
  tar -C "$S" -czf "$out/again2-results.tgz" res2 res
  stage_end
  ;;
one)
  # A whole round in one call, for a lease whose machine start leaves about 10 minutes: the model
  # does not travel (carry carry/one: the pack and the model's tokenizer alone, `prepare-one`), so
  # the real model's GPU == CPU test waits for stage2; the synthetic 8B shape runs with the
  # tokenizer file (`--tokenizer`). Most telling first, each step only while time is left
  # (FP_ONE_SECONDS, default 540): the CUDA ops on this GPU, the autotuner, the attention against
  # PyTorch SDPA (two rounds), the A/B against gpu-pack/ab's sources, the 8B shape's prefill,
  # InfoFlow's TTFT with its segments gathered or not, PyTorch's 8B prefill. No racecheck: it
  # does not follow the Hopper kernel's mbarrier handoff (docs/gpu.md, "The sixth run");
  # memcheck and synccheck run in again2.
  out="${2:?OUT}"
  rm -rf "$S" && mkdir -p "$S/res"
  tar -xJf carry/one/pack.tar.xz -C "$S"
  export FLOWPREFILL_PACK="$S/gpu-pack"
  . scripts/gpu-env.sh
  if ! ls "$S"/gpu-pack/home/models/*.gguf >/dev/null 2>&1 && [ -f carry/one/tokenizer.gguf ]; then
    export FLOWPREFILL_TOKENIZER="$(pwd)/carry/one/tokenizer.gguf"
  fi
  end=$((t0 + ${FP_ONE_SECONDS:-540}))
  # room SECONDS WHAT: whether SECONDS are left before the end (else says WHAT is skipped).
  room() { [ $((end - $(date +%s))) -ge "$1" ] || { mark "skipped (under $1 s left): $2"; return 1; }; }
  {
    mark "machine"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    "$FP" devices
    for t in cuda_ops cuda_hopper_fallback; do
      mark "test $t"
      pack_test "$t" 120 "$out/test-$t.log"
    done
    if room 60 "tune"; then
      mark "tune"
      timeout 120 "$FP" tune --device cuda:0 2>&1 | tee "$S/res/tune.txt"
    fi
    # What the host review of 2026-11-29 changed without a GPU (docs/gpu.md, "What a first GPU
    # run would have hit"): a fixed flash2 configuration other than 0 runs (it failed every call),
    # a value FLOWPREFILL_TUNE does not take is refused at start.
    if room 60 "first-run checks" && { [ -n "${FLOWPREFILL_TOKENIZER:-}" ] || ls "$S"/gpu-pack/home/models/*.gguf >/dev/null 2>&1; }; then
      mark "first-run checks: FLOWPREFILL_FLASH_KERNEL=fa2:c2 runs; FLOWPREFILL_TUNE=0 is refused"
      FLOWPREFILL_FLASH_KERNEL=fa2:c2 timeout 40 "$FP" --model synthetic:llama-3.1-8b:2 bench prefill --device cuda \
        --tokens 4096 --runs 1 2>&1 | tail -n 2
      FLOWPREFILL_TUNE=0 timeout 20 "$FP" --model synthetic:llama-3.1-8b:2 bench prefill --device cuda --tokens 256 \
        --runs 1 2>&1 | tail -n 1
    fi
    # SDPA, ours, twice over (the medians of rounds; the benches print the ratio to the SDPA
    # round just before them).
    for r in 1 2; do
      room 60 "attention against SDPA, round $r" || continue
      mark "pytorch sdpa, round $r"
      timeout 60 python3 scripts/sdpa_baseline.py 2>&1 | tee "$S/res/sdpa-$r.txt"
      mark "attention bench: the autotuner's choice, round $r"
      timeout 60 "$S/gpu-pack/cuda_attention_bench" --sdpa "$S/res/sdpa-$r.txt" 2>&1 | tee "$S/res/attention-auto-$r.txt"
    done
    if [ -d "$S/gpu-pack/ab" ]; then
      for r in 1 2; do
        for v in before after; do
          room 25 "A/B $v, round $r" || continue
          mark "attention A/B: $v, round $r"
          src=""
          [ "$v" = before ] && src="$S/gpu-pack/ab"
          FLOWPREFILL_CUDA_SOURCES="$src" FLOWPREFILL_FLASH_KERNEL=hopper timeout 40 \
            "$S/gpu-pack/cuda_attention_bench" --quick > "$S/res/ab-$v-$r.txt" 2>&1
        done
      done
      python3 scripts/ab-summary.py "$S"/res/ab-*.txt
    fi
    if [ -z "${FLOWPREFILL_TOKENIZER:-}" ] && ! ls "$S"/gpu-pack/home/models/*.gguf >/dev/null 2>&1; then
      mark "skipped: the 8B shape's prefill and TTFT (no tokenizer: run prepare-one again)"
    else
      if room 100 "8B prefill"; then
        mark "8B shape prefill (the autotuner's kernel)"
        timeout 150 "$FP" --model synthetic:llama-3.1-8b bench prefill --device cuda --tokens 8192,32768 --runs 3 2>&1 | grep -v "^note" | tail -n 4
      fi
      mark "InfoFlow, 8B shape, 32768 tokens: segments gathered into few attention calls (default) or one call each (=0), alternating"
      for g in default 0 default 0; do
        room 70 "TTFT with FLOWPREFILL_GATHERED_KEYS $g" || continue
        echo "FLOWPREFILL_GATHERED_KEYS: $g"
        if [ "$g" = default ]; then set -- env -u FLOWPREFILL_GATHERED_KEYS; else set -- env FLOWPREFILL_GATHERED_KEYS=0; fi
        "$@" timeout 120 "$FP" --model synthetic:llama-3.1-8b bench ttft --device cuda --lengths 32768 --ranks 1 \
          --methods full,infoflow --runs 3 --out "$S/res/gather-$g" 2>&1 | grep "P=1"
      done
      # Host time per backend op, control data copied through the page-locked ring (default)
      # and from pageable memory (FLOWPREFILL_PINNED_CONTROL=0, which waits for the stream).
      for pc in 1 0; do
        room 60 "InfoFlow's host profile, pinned control $pc" || continue
        mark "InfoFlow, 8B shape, 32768 tokens, gathered, FLOWPREFILL_PINNED_CONTROL=$pc: host time per op"
        FLOWPREFILL_PINNED_CONTROL=$pc FLOWPREFILL_HOST_PROFILE=1 timeout 100 "$FP" --model synthetic:llama-3.1-8b \
          bench ttft --device cuda --lengths 32768 --ranks 1 --methods infoflow --runs 1 --out "$S/res/prof8b-$pc" \
          > "$S/res/prof8b-infoflow-pinned$pc.txt" 2>&1
        grep -E "P=1|^op |^attention|^merge|^copy_rows|^append_rows|^zeros" "$S/res/prof8b-infoflow-pinned$pc.txt"
      done
    fi
    if room 90 "pytorch 8B prefill"; then
      mark "pytorch baseline (8B shape)"
      python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
      timeout 150 python3 scripts/torch_baseline.py --shape llama-3.1-8b --lengths 8192,32768 --runs 3 \
        --decode-context 7036 --decode-tokens 34 | tee "$S/res/torch-llama-3.1-8b.jsonl"
    fi
    mark "one done"
  } 2>&1 | tee "$out/one.log"
  tar -C "$S" -czf "$out/one-results.tgz" res
  stage_end
  ;;
*)
  echo "unknown stage $stage: prepare, prepare-one, slim, unslim, stage1, stage2, one, again1 or again2" >&2
  exit 2
  ;;
esac
