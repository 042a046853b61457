#!/usr/bin/env python3
"""The A/B of scripts/gpu-lease.sh and scripts/gpu-check.sh: reads cuda_attention_bench outputs
named ab-before-N.txt and ab-after-N.txt (the Hopper kernel from gpu-pack/ab's sources, then from
the current ones) and prints, per prefill shape, the median device TF/s of each side over the
rounds and their ratio.

    python3 scripts/ab-summary.py DIR/ab-*.txt
"""
import statistics, sys
tf = {}
for path in sys.argv[1:]:
    side = "before" if "/ab-before-" in path else "after"
    prefill = False
    for line in open(path):
        if line.startswith("prefill"):
            prefill = True
        elif line.startswith("decode"):
            prefill = False
        f = line.split()
        if prefill and len(f) >= 7 and f[0].isdigit() and "/" in f[1]:
            tf.setdefault((int(f[0]), f[1], int(f[2])), {}).setdefault(side, []).append(float(f[6]))
print("A/B (median device TF/s over the rounds)\n     n     heads    d    before     after   after/before")
for k in sorted(tf, key=lambda k: (k[2], k[0])):
    b, a = (statistics.median(tf[k].get(s, [float("nan")])) for s in ("before", "after"))
    print(f"{k[0]:>6} {k[1]:>9} {k[2]:>4} {b:>9.1f} {a:>9.1f} {a / b:>13.3f}x")
