#!/usr/bin/env bash
# Step 1 of 2 for a GPU machine without network or cargo (the usual lent machine): run this
# where cargo and the network are, then copy the folder it prints to the GPU machine (with the
# checkout's scripts/) and run step 2 there: `bash scripts/gpu-check.sh` or
# `bash scripts/gpu-bench.sh` (they find ./gpu-pack by themselves, or FLOWPREFILL_PACK=DIR).
#
# The pack: the program built with CUDA and NCCL, the CUDA test binaries (stripped), the default
# model (its tokenizer serves the synthetic shapes too), and `manifest` (what each test binary
# expects: test binaries embed the program's absolute build path, so step 2 puts a copy there).
# No CUDA library is packed: the GPU machine's own CUDA 12 or 13 is found where it is installed.
#
#   bash scripts/gpu-pack.sh [OUT]      (default OUT: ./gpu-pack; about 130 MB, 115 of them the model)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu-pack}"
features=(--features flowprefill/cuda --features flowprefill/nccl)
mkdir -p "$out/tests"
cargo build --release -p flowprefill "${features[@]}"
tests=$(cargo test --release --workspace "${features[@]}" --no-run --message-format=json \
  --test cuda --test cuda_ops --test cuda_hopper_fallback --test cuda_compile_gate --test nccl_smoke --test cuda_libs 2>/dev/null |
  python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and "test" in m.get("target", {}).get("kind", []):
        print(m["target"]["name"], m["executable"])')
strip -o "$out/flowprefill" target/release/flowprefill
# The attention kernels timed alone (flash2 and, on a Hopper GPU, flash_hopper): gpu-check.sh.
cargo build --release -p flowprefill-kernels --features cuda --example cuda_attention_bench
strip -o "$out/cuda_attention_bench" target/release/examples/cuda_attention_bench
{
  echo "bin $(pwd)/target/release/flowprefill"
  while read -r name exe; do
    strip -o "$out/tests/$name" "$exe"
    echo "test $name"
  done <<< "$tests"
} > "$out/manifest"
# The kernel sources of an earlier commit, for an A/B on the device without a rebuild
# (FLOWPREFILL_CUDA_SOURCES=gpu-pack/ab: the GPU backend compiles those instead of its own):
# GPU_PACK_AB=<commit>, by default the commit before the Hopper key loop's change of 2026-11-27.
ab="${GPU_PACK_AB-4095cc1}"
rm -rf "$out/ab"
if [ -n "$ab" ]; then
  mkdir -p "$out/ab"
  for f in $(git ls-tree --name-only "$ab" kernels/cuda/); do
    case "$f" in *.cu | *.cuh) git show "$ab:$f" > "$out/ab/$(basename "$f")" ;; esac
  done
  echo "ab: kernel sources of $(git rev-parse --short "$ab") in $out/ab" >&2
fi
model=$(./target/release/flowprefill fetch-model | tail -n1)
mkdir -p "$out/home/models"
cp "$model" "$out/home/models/"
echo "pack ready: $out ($(du -sh "$out" | cut -f1)); copy it and scripts/ to the GPU machine" >&2
echo "$out"
