# call B (on the machine call A left warm): the model whole; the 8B shape's prefill, the real model GPU == CPU, SmolLM2 prefill and TTFT
set -uo pipefail
out="$1"; S=/tmp/fp-lease; t0=$(date +%s); mark() { echo "[$(($(date +%s) - t0)) s] $*"; }
[ -d "$S/gpu-pack" ] || { echo "call A's pack is gone (the machine was given back)"; exit 2; }
export FLOWPREFILL_PACK="$S/gpu-pack"
name=$(awk '{ print $2 }' carry/m2/model.sha256); mkdir -p "$S/gpu-pack/home/models"
cat "$S/model.a" carry/m2/model.b > "$S/gpu-pack/home/models/$name"
(cd "$S/gpu-pack/home/models" && sha256sum -c "$OLDPWD/carry/m2/model.sha256") || exit 2
. scripts/gpu-env.sh
{
mark "8B shape prefill, the autotuner's kernel"
timeout 170 "$FP" --model synthetic:llama-3.1-8b bench prefill --device cuda --tokens 8192,32768 --runs 3 2>&1 | grep -v "^note" | tail -n 5
mark "test cuda (the real model, GPU == CPU)"
timeout 200 "$PACK_TESTS/cuda" --nocapture > "$out/test-cuda.log" 2>&1; grep -E "^test |test result|skipped|panicked|FAILED" "$out/test-cuda.log"
mark "SmolLM2 prefill 8000 tokens: ours, then PyTorch"
timeout 60 "$FP" bench prefill --device cuda --tokens 2048,8000 --runs 3 2>&1 | grep -v "^note" | tail -n 4
timeout 90 python3 scripts/torch_baseline.py --shape smollm2-135m --lengths 2048,8000 --runs 3 --decode-context 7036 --decode-tokens 34
mark "bench ttft 8000, one rank"
timeout 150 "$FP" bench ttft --device cuda --lengths 8000 --ranks 1 --methods full,infoflow,none --runs 3 --out "$S/ttft" 2>&1 | tail -n 12
cp "$S"/ttft/*.csv "$out/" 2>/dev/null
mark "B done"
} 2>&1 | tee "$out/b.log"
