#!/usr/bin/env python3
"""PyTorch SDPA (bf16, causal, GQA) alone on the shapes of kernels/examples/cuda_attention_bench.rs:
the attention baseline a PyTorch user has on the same GPU. Median of CUDA-event timings after a
warm-up, random inputs (never zeros), several input sets rotated so repeated runs do not measure
the cache. TFLOP/s by the convention of FlashAttention's figures (4 x head_dim x heads x visible
pairs). Decode shapes: one query over n keys, K/V bytes read per second.

  python3 scripts/sdpa_baseline.py [--runs 21]
"""
import argparse
import statistics

PREFILL = [(2048, 9, 3, 64), (4096, 14, 2, 64), (8192, 14, 2, 64), (2048, 32, 8, 128), (8192, 32, 8, 128),
           (16384, 32, 8, 128), (32768, 32, 8, 128), (32768, 14, 2, 64)]
DECODE = [(8192, 9, 3, 64), (32768, 9, 3, 64), (8192, 32, 8, 128), (32768, 32, 8, 128)]


def timed(f, runs):
    import torch
    for _ in range(3):
        f(0)
    ts = []
    for i in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f(i)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=21)
    a = ap.parse_args()
    import torch
    import torch.nn.functional as F
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, SDPA backend chosen by PyTorch")
    print(f"{'n':>6} {'heads':>9} {'d':>4} {'ms':>9} {'TF/s':>8}")
    for n, h, kv, d in PREFILL:
        sets = [[torch.randn(1, x, n, d, device="cuda", dtype=torch.bfloat16) for x in (h, kv, kv)] for _ in range(2)]
        dt = timed(lambda i: F.scaled_dot_product_attention(*sets[i % 2], is_causal=True, enable_gqa=True), a.runs)
        flops = 4 * n * (n + 1) / 2 * h * d
        print(f"{n:>6} {f'{h}/{kv}':>9} {d:>4} {dt * 1e3:>9.3f} {flops / dt / 1e12:>8.1f}")
        del sets
    print(f"decode (one query over n keys)\n{'n':>6} {'heads':>9} {'d':>4} {'ms':>9} {'GB/s':>8}")
    for n, h, kv, d in DECODE:
        sets = [[torch.randn(1, h, 1, d, device="cuda", dtype=torch.bfloat16)] +
                [torch.randn(1, kv, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)] for _ in range(4)]
        dt = timed(lambda i: F.scaled_dot_product_attention(*sets[i % 4], enable_gqa=True), a.runs)
        print(f"{n:>6} {f'{h}/{kv}':>9} {d:>4} {dt * 1e3:>9.3f} {2 * n * kv * d * 2 / dt / 1e9:>8.0f}")
        del sets


if __name__ == "__main__":
    main()
