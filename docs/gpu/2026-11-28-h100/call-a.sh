# call A: the pack, the model's first part; memcheck of the Hopper kernel, a second attention round beside SDPA
set -uo pipefail
out="$1"; S=/tmp/fp-lease; t0=$(date +%s); mark() { echo "[$(($(date +%s) - t0)) s] $*"; }
rm -rf "$S" && mkdir -p "$S/res" && tar -xJf carry/one/pack.tar.xz -C "$S" && cp carry/m1/model.a "$S/"
export FLOWPREFILL_PACK="$S/gpu-pack"; . scripts/gpu-env.sh
cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n1)
{
mark "tune (kept for call B)"; timeout 60 "$FP" tune --device cuda:0 2>&1 | grep "tuned for"
mark "memcheck: the Hopper kernel"
FLOWPREFILL_FLASH_KERNEL=hopper timeout 90 "$cs" --tool memcheck "$PACK_TESTS/cuda_ops" tensor_core_attention_over_a_bf16_cache --nocapture > "$out/memcheck.log" 2>&1; echo "rc $?"; tail -n 4 "$out/memcheck.log"
mark "synccheck: the Hopper kernel"
FLOWPREFILL_FLASH_KERNEL=hopper timeout 60 "$cs" --tool synccheck "$PACK_TESTS/cuda_ops" tensor_core_attention_over_a_bf16_cache --nocapture > "$out/synccheck.log" 2>&1; echo "rc $?"; tail -n 4 "$out/synccheck.log"
for r in 2 3; do
mark "attention auto, round $r"; timeout 60 "$S/gpu-pack/cuda_attention_bench" > "$out/attention-auto-$r.txt" 2>&1; grep -E "^ +[0-9]+ +[0-9]+/" "$out/attention-auto-$r.txt" | head -8
mark "sdpa, round $r"; timeout 60 python3 scripts/sdpa_baseline.py > "$out/sdpa-$r.txt" 2>&1; head -n 10 "$out/sdpa-$r.txt"
done
mark "A done"
} 2>&1 | tee "$out/a.log"
