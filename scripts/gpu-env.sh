# Sourced by gpu-check.sh and gpu-bench.sh: sets FP (the flowprefill program to run: FLOWPREFILL_BIN
# if set) and, with a
# pack from scripts/gpu-pack.sh, FLOWPREFILL_HOME (its model) and the test binaries' expected
# program path. Without a pack, builds with cargo when cargo is here; else says what to do.
pack="${FLOWPREFILL_PACK:-gpu-pack}"
if [ -n "${FLOWPREFILL_BIN:-}" ]; then
  # A program built already (with --features cuda): used as it is, tests through cargo.
  FP="$FLOWPREFILL_BIN"
  PACK_TESTS=""
elif [ -f "$pack/manifest" ]; then
  FP="$(cd "$pack" && pwd)/flowprefill"
  export FLOWPREFILL_HOME="${FLOWPREFILL_HOME:-$(cd "$pack" && pwd)/home}"
  want=$(awk '$1 == "bin" { print $2 }' "$pack/manifest")
  # Test binaries run the program at the absolute path of the machine that built them.
  if [ -n "$want" ] && [ ! -x "$want" ]; then
    mkdir -p "$(dirname "$want")" 2>/dev/null && cp "$FP" "$want" ||
      echo "warning: cannot place the program at $want: the CLI-driven GPU tests will fail" >&2
  fi
  PACK_TESTS="$(cd "$pack" && pwd)/tests"
elif command -v cargo >/dev/null 2>&1; then
  libs=$(bash scripts/cuda-wheels.sh --runtime --nccl)
  export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  cargo build --release --features flowprefill/cuda --features flowprefill/nccl -p flowprefill >&2
  FP="$(pwd)/target/release/flowprefill"
  PACK_TESTS=""
else
  echo "no cargo here and no pack at $pack: on a machine with cargo run \`bash scripts/gpu-pack.sh\`, copy gpu-pack/" >&2
  echo "and scripts/ here, then run this again (or set FLOWPREFILL_PACK to the pack's folder)" >&2
  exit 2
fi
export FLOWPREFILL_REQUIRE_NVRTC=1
# CUDA 12 or 13 wherever it is: the program finds and links it (`flowprefill devices`); the test
# binaries get the same loader path.
ld=$("$FP" devices | sed -n 's/^LD_LIBRARY_PATH=//p')
if [ -n "$ld" ]; then export LD_LIBRARY_PATH="$ld"; fi

# write_context FILE WORDS: a prose context of WORDS words (the decode and placement measurements
# of gpu-bench.sh and gpu-flash-ab.sh; the exact token count comes back in each JSON).
write_context() {
  python3 - "$1" "$2" <<'PY'
import sys
words = "the river carried light over stones while a quiet town counted its bells and kept its records".split()
open(sys.argv[1], "w").write(" ".join(words[i % len(words)] for i in range(int(sys.argv[2]))))
PY
}

# memory_plan_runs: the memory plan admission relies on against the device pool's high-water mark
# (`run --stats` prints both), about 7K context tokens in four documents, full and InfoFlow.
memory_plan_runs() {
  local docs m d i
  docs=$(mktemp -d)
  for d in 1 2 3 4; do
    for i in $(seq 1 85); do echo "On day $i the boats of Redwater $d rested in the harbour while the keeper counted lanterns."; done > "$docs/$d.txt"
  done
  for m in full infoflow; do
    "$FP" run --device cuda --stats --method "$m" --doc "$docs/1.txt" --doc "$docs/2.txt" --doc "$docs/3.txt" --doc "$docs/4.txt" \
      --query "Which harbour do the boats rest in?" --max-tokens 8 | grep "memory plan" || true
  done
  rm -rf "$docs"
}
