#!/usr/bin/env python3
"""The baseline a PyTorch user has on the same GPU: a Hugging Face transformers model with random
weights (bf16, SDPA attention) of the shape flowprefill runs, timed on full prefill and on decode
with its KV cache. Weights are random: times only. One JSON object per measurement on stdout.

  python3 scripts/torch_baseline.py --shape smollm2-135m --lengths 2048,8192 --runs 3 \
      --decode-context 8192 --decode-tokens 32

Used by scripts/gpu-bench.sh; needs `torch` (with CUDA) and `transformers`.
"""
import argparse
import json
import statistics
import sys
import time

# Model shapes (public configuration values). `layers` may be cut with --layers, as
# flowprefill's `synthetic:SHAPE:LAYERS`.
SHAPES = {
    "smollm2-135m": dict(cls="Llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         rope_theta=100000.0, tie_word_embeddings=True, max_position_embeddings=8192),
    "llama-3.1-8b": dict(cls="Llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         rope_theta=500000.0, tie_word_embeddings=False, max_position_embeddings=131072),
    "qwen2.5-7b": dict(cls="Qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                       rope_theta=1000000.0, tie_word_embeddings=False, max_position_embeddings=131072),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=0, help="keep only this many layers (0: all)")
    ap.add_argument("--lengths", default="2048", help="prefill lengths in tokens, comma-separated")
    ap.add_argument("--runs", type=int, default=3, help="timed runs per length, after one warm-up")
    ap.add_argument("--decode-context", type=int, default=0, help="context of the decode measurement (0: none)")
    ap.add_argument("--decode-tokens", type=int, default=32)
    a = ap.parse_args()
    try:
        import torch
        import transformers
    except ImportError as e:
        sys.exit(f"torch_baseline.py needs torch and transformers: {e}")
    if not torch.cuda.is_available():
        sys.exit("torch_baseline.py: torch sees no CUDA device")
    kw = dict(SHAPES[a.shape])
    cls = kw.pop("cls")
    if a.layers:
        kw["num_hidden_layers"] = min(a.layers, kw["num_hidden_layers"])
    kw["max_position_embeddings"] = max(kw["max_position_embeddings"], a.decode_context + a.decode_tokens + 1,
                                        max(int(x) for x in a.lengths.split(",")))
    cfg = getattr(transformers, cls + "Config")(**kw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = getattr(transformers, cls + "ForCausalLM")(cfg).to(torch.bfloat16).eval()
    label = a.shape + (f":{kw['num_hidden_layers']}" if a.layers else "")
    dev = torch.cuda.get_device_name(0)

    def timed(fn):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t, out

    with torch.inference_mode():
        for n in [int(x) for x in a.lengths.split(",")]:
            ids = torch.randint(0, cfg.vocab_size, (1, n), device="cuda")
            # Prefill as a server does it: the logits of the last position only.
            step = lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1)
            timed(step)
            times = [timed(step)[0] for _ in range(a.runs)]
            print(json.dumps(dict(what="prefill", shape=label, tokens=n, ms=1e3 * statistics.median(times),
                                  runs=a.runs, device=dev)), flush=True)
        if a.decode_context:
            ids = torch.randint(0, cfg.vocab_size, (1, a.decode_context), device="cuda")
            _, out = timed(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1))
            past = out.past_key_values
            nxt = out.logits[:, -1:].argmax(-1)
            steps = []
            for _ in range(a.decode_tokens):
                dt, out = timed(lambda: model(input_ids=nxt, past_key_values=past, use_cache=True))
                past = out.past_key_values
                nxt = out.logits[:, -1:].argmax(-1)
                steps.append(dt)
            steps = steps[2:] or steps  # the first steps warm the decode path
            print(json.dumps(dict(what="decode", shape=label, context=a.decode_context,
                                  ms_per_token=1e3 * statistics.median(steps), tokens=len(steps), device=dev)),
                  flush=True)


if __name__ == "__main__":
    main()
