# racecheck over the Hopper kernel with the stage word's accesses relaxed (A) or release/acquire (B); then A's speed beside this build's
set -uo pipefail
out="$1"; S=/tmp/fp-lease; t0=$(date +%s); mark() { echo "[$(($(date +%s) - t0)) s] $*"; }
rm -rf "$S" && mkdir -p "$S" && tar -xJf carry/one/pack.tar.xz -C "$S"
export FLOWPREFILL_PACK="$S/gpu-pack"; . scripts/gpu-env.sh
cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n1)
V=$(pwd)/carry/var
{
for v in A B; do
mark "racecheck, variant $v"
FLOWPREFILL_CUDA_SOURCES="$V/$v" FLOWPREFILL_FLASH_KERNEL=hopper timeout 60 "$cs" --tool racecheck "$PACK_TESTS/cuda_ops" tensor_core_attention_over_a_bf16_cache --nocapture > "$out/racecheck-$v.log" 2>&1; echo "rc $?"; grep -E "RACECHECK SUMMARY|test result" "$out/racecheck-$v.log"
done
for r in 1 2; do for v in build A; do
src=""; [ "$v" = A ] && src="$V/A"
mark "speed $v round $r"
FLOWPREFILL_CUDA_SOURCES="$src" FLOWPREFILL_FLASH_KERNEL=hopper timeout 40 "$S/gpu-pack/cuda_attention_bench" --quick > "$out/speed-$v-$r.txt" 2>&1; grep -E "^ +(4096|8192) " "$out/speed-$v-$r.txt" | head -4
done; done
mark done
} 2>&1 | tee "$out/var.log"
