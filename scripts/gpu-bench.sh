#!/usr/bin/env bash
# One command on a GPU machine: flowprefill beside the baseline its users have (PyTorch +
# transformers, SDPA, bf16, random weights of the same shape; scripts/torch_baseline.py) on one
# GPU, and one table: flowprefill, PyTorch, ratio (flowprefill / PyTorch: below 1 is faster).
#   - full prefill at 2K-32K tokens: SmolLM2-135M and the Llama-3.1-8B shape (synthetic weights);
#   - decode, ms per token, at 8K context, both shapes;
#   - placement of the chunk caches (`assemble`) and the op split of an infoflow run (--stats);
#   - bench ttft full / infoflow / none on one GPU, SmolLM2 (flowprefill only: no PyTorch twin).
# SmolLM2's own window is 8192 tokens: its lengths stop at 8000; the 8B shape goes to 32K.
# Without torch or transformers there, flowprefill alone (the PyTorch column says so).
# Writes OUT/bench.csv, OUT/bench.md and every raw JSON; the README's GPU section quotes bench.md.
#
#   bash scripts/gpu-bench.sh [OUT]           (default OUT: gpu-bench-out)
#   GPU_BENCH_QUICK=1 bash scripts/gpu-bench.sh   (2K and 8K only, 2 runs: a few minutes)
#
# Same two ways to run as scripts/gpu-check.sh (cargo here, or a pack from scripts/gpu-pack.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu-env.sh
out="${1:-gpu-bench-out}"
mkdir -p "$out"
# GPU_BENCH_DEVICE, _BIG, _RUNS, _SMOL, _LARGE, _TTFT, _CONTEXT_WORDS override the defaults (a dry
# run of the script on the CPU: GPU_BENCH_DEVICE=cpu GPU_BENCH_BIG=synthetic:llama-3.1-8b:1 ...).
dev="${GPU_BENCH_DEVICE:-cuda}"
big="${GPU_BENCH_BIG:-synthetic:llama-3.1-8b}"
runs="${GPU_BENCH_RUNS:-3}"
smol_lengths="${GPU_BENCH_SMOL:-2048,4096,8000}"
big_lengths="${GPU_BENCH_LARGE:-2048,8192,16384,32768}"
ttft_lengths="${GPU_BENCH_TTFT:-2048,4096,8000}"
words="${GPU_BENCH_CONTEXT_WORDS:-7000}"
if [ -n "${GPU_BENCH_QUICK:-}" ]; then runs=2; smol_lengths=2048,8000; big_lengths=2048,8192; ttft_lengths=8000; fi
"$FP" devices | tee "$out/devices.txt"
# The attention autotuner first (issue 51): every configuration timed, the decisions kept for
# the runs below (and listed by devices); its table and the kernels' occupancy in tune.txt.
# GPU_BENCH_TUNE=0 skips it (tuned earlier in the same FLOWPREFILL_HOME: scripts/gpu-lease.sh).
if [ "${GPU_BENCH_TUNE:-1}" != 0 ]; then
  "$FP" tune --device cuda:0 2>&1 | tee "$out/tune.txt"
fi
"$FP" devices | tee "$out/devices-tuned.txt"
torch=0
python3 -c 'import torch, transformers; assert torch.cuda.is_available()' 2>/dev/null && torch=1
echo "PyTorch baseline: $([ $torch = 1 ] && python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' || echo "not available (flowprefill alone)")" | tee "$out/baseline.txt"

# A context of about N tokens for decode (prose; the exact count comes back in the JSON).
write_context "$out/context.txt" "$words"

for model in default "$big"; do
  m=(); [ "$model" = default ] || m=(--model "$model")
  # The PyTorch shape: SmolLM2, or the synthetic shape's name (its layer count cut alike).
  tag=smollm2-135m; layers=0
  if [ "$model" != default ]; then IFS=: read -r _ tag layers <<< "$model"; layers=${layers:-0}; fi
  lengths=$([ "$model" = default ] && echo "$smol_lengths" || echo "$big_lengths")
  "$FP" "${m[@]}" bench prefill --device "$dev" --tokens "$lengths" --runs "$runs" --json > "$out/fp-prefill-$tag.json"
  "$FP" "${m[@]}" generate --device "$dev" --context-file "$out/context.txt" --prompt "Summarise." \
    --max-tokens 34 --json > "$out/fp-decode-$tag.json"
  # A baseline measured earlier in the same lease (scripts/gpu-lease.sh, stage 1) is kept.
  if [ $torch = 1 ] && [ ! -s "$out/torch-$tag.jsonl" ]; then
    python3 scripts/torch_baseline.py --shape "$tag" --layers "$layers" --lengths "$lengths" --runs "$runs" \
      --decode-context "$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["prompt_tokens"])' "$out/fp-decode-$tag.json")" \
      --decode-tokens 34 > "$out/torch-$tag.jsonl"
  fi
done
# Placement (`assemble`: four chunk caches rotated to their global positions) and where the
# GPU's time goes (op families from CUDA events, --stats): infoflow over the same context, cut
# into 4 chunks; rank 0's phases and op split come back in the JSON.
chunk=$(( $(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["prompt_tokens"])' "$out/fp-decode-smollm2-135m.json") / 4 ))
"$FP" run --device "$dev" --method infoflow --doc "$out/context.txt" --chunk-tokens "$chunk" \
  --query "Summarise." --max-tokens 8 --stats --json > "$out/fp-run-infoflow.json"
"$FP" bench ttft --device "$dev" --lengths "$ttft_lengths" --ranks 1 --methods full,infoflow,none --runs "$runs" \
  --out "$out/ttft" | tee "$out/ttft.txt"

python3 - "$out" "$torch" <<'PY'
import csv, json, os, re, sys
out, torch = sys.argv[1], sys.argv[2] == "1"
rows = []
def torch_rows(tag):
    p = os.path.join(out, f"torch-{tag}.jsonl")
    return [json.loads(l) for l in open(p)] if torch and os.path.exists(p) else []
for tag in sorted({f[11:-5] for f in os.listdir(out) if f.startswith("fp-prefill-")}, key=lambda t: t != "smollm2-135m"):
    fp = json.load(open(os.path.join(out, f"fp-prefill-{tag}.json")))
    tr = torch_rows(tag)
    for r in fp["results"]:
        t = next((x["ms"] for x in tr if x["what"] == "prefill" and x["tokens"] == r["tokens"]), None)
        rows.append((tag, f"full prefill, {r['tokens']} tokens (ms)", 1e3 * r["median_s"], t))
    d = json.load(open(os.path.join(out, f"fp-decode-{tag}.json")))
    per = d["decode_ms"] / max(d["generated_tokens"] - 1, 1)
    t = next((x["ms_per_token"] for x in tr if x["what"] == "decode"), None)
    rows.append((tag, f"decode at {d['prompt_tokens']} tokens (ms/token)", per, t))
run = json.load(open(os.path.join(out, "fp-run-infoflow.json")))
phases = dict(run["phases"])
rows.append(("smollm2-135m", f"placement of {run['n_context_tokens']} tokens in 4 chunks (assemble, ms)", phases.get("assemble", float("nan")), None))
for name, ms in run["rank_stats"][0].get("ops", []):
    rows.append(("smollm2-135m", f"infoflow run, model time in {name} (ms of device time)", ms, None))
with open(os.path.join(out, "bench.csv"), "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["model", "what", "flowprefill", "pytorch", "ratio"])
    for tag, what, a, b in rows:
        w.writerow([tag, what, f"{a:.2f}", "" if b is None else f"{b:.2f}", "" if b is None else f"{a / b:.2f}"])
dev = open(os.path.join(out, "devices.txt")).read().splitlines()
gpu = next((l for l in dev if re.match(r"cuda:\d", l)), "no GPU listed (" + dev[-1] + ")")
base = open(os.path.join(out, "baseline.txt")).read().strip()
md = [f"GPU: {gpu}  ", f"{base}  ", "ratio = flowprefill / PyTorch (below 1: flowprefill faster); medians", "",
      "| model | what | flowprefill | PyTorch | ratio |", "| --- | --- | ---: | ---: | ---: |"]
for tag, what, a, b in rows:
    md.append(f"| {tag} | {what} | {a:.2f} | {'n/a' if b is None else f'{b:.2f}'} | {'' if b is None else f'{a / b:.2f}x'} |")
md += ["", "bench ttft (one device, SmolLM2):", "", "```", open(os.path.join(out, "ttft.txt")).read().strip(), "```"]
open(os.path.join(out, "bench.md"), "w").write("\n".join(md) + "\n")
print("\n".join(md))
PY
echo "written: $out/bench.csv $out/bench.md" >&2
