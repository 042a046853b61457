#!/usr/bin/env bash
# The two tensor-core attention kernels side by side in one run on a GPU machine
# (FLOWPREFILL_FLASH_KERNEL=reference: flash.cu; fa2, the default: flash2.cu), with PyTorch
# beside them when it is there: full prefill of SmolLM2 and of the Llama-3.1-8B shape, and
# decode at about 7K context tokens. Same two ways to run as scripts/gpu-check.sh.
#   bash scripts/gpu-flash-ab.sh [OUT]     (default OUT: gpu-bench-out/flash-ab)
# GPU_AB_SMOL / GPU_AB_LARGE / GPU_AB_RUNS override the lengths and the runs.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu-env.sh
out="${1:-gpu-bench-out/flash-ab}"
mkdir -p "$out"
runs="${GPU_AB_RUNS:-3}"
write_context "$out/context.txt" 7000
for model in default synthetic:llama-3.1-8b; do
  m=(); [ "$model" = default ] || m=(--model "$model")
  tag=$([ "$model" = default ] && echo smollm2-135m || echo llama-3.1-8b)
  lengths=$([ "$model" = default ] && echo "${GPU_AB_SMOL:-2048,8000}" || echo "${GPU_AB_LARGE:-8192,32768}")
  for kernel in reference fa2; do
    FLOWPREFILL_FLASH_KERNEL=$kernel "$FP" "${m[@]}" bench prefill --device cuda --tokens "$lengths" --runs "$runs" \
      --json > "$out/prefill-$tag-$kernel.json"
    FLOWPREFILL_FLASH_KERNEL=$kernel "$FP" "${m[@]}" generate --device cuda --context-file "$out/context.txt" \
      --prompt "Summarise." --max-tokens 34 --json > "$out/decode-$tag-$kernel.json"
  done
  if python3 -c 'import torch, transformers; assert torch.cuda.is_available()' 2>/dev/null; then
    python3 scripts/torch_baseline.py --shape "$tag" --lengths "$lengths" --runs "$runs" > "$out/torch-$tag.jsonl"
  fi
done
python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
print(f"{'model':<14} {'what':<28} {'reference':>10} {'fa2':>10} {'fa2/ref':>8} {'PyTorch':>9} {'fa2/PyTorch':>11}")
for tag in ("smollm2-135m", "llama-3.1-8b"):
    tp = os.path.join(out, f"torch-{tag}.jsonl")
    torch = [json.loads(l) for l in open(tp)] if os.path.exists(tp) else []
    pre = {k: json.load(open(os.path.join(out, f"prefill-{tag}-{k}.json")))["results"] for k in ("reference", "fa2")}
    for a, b in zip(pre["reference"], pre["fa2"]):
        t = next((x["ms"] for x in torch if x["what"] == "prefill" and x["tokens"] == a["tokens"]), None)
        ra, rb = 1e3 * a["median_s"], 1e3 * b["median_s"]
        ts = f"{t:9.1f} {rb / t:10.2f}x" if t else f"{'n/a':>9}"
        print(f"{tag:<14} {'prefill ' + str(a['tokens']) + ' tokens (ms)':<28} {ra:10.1f} {rb:10.1f} {rb / ra:7.2f}x {ts}")
    dec = {k: json.load(open(os.path.join(out, f"decode-{tag}-{k}.json"))) for k in ("reference", "fa2")}
    per = {k: d["decode_ms"] / max(d["generated_tokens"] - 1, 1) for k, d in dec.items()}
    same = dec["reference"]["answer"] == dec["fa2"]["answer"]
    print(f"{tag:<14} {'decode at ' + str(dec['fa2']['prompt_tokens']) + ' (ms/token)':<28} {per['reference']:10.2f} "
          f"{per['fa2']:10.2f} {per['fa2'] / per['reference']:7.2f}x   answers {'equal' if same else 'DIFFER'}")
PY
