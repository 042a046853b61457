#!/usr/bin/env python3
"""The `--method auto` grid of docs/quality.md from `bench ttft`'s ttft.csv: per cell (length,
ranks, cache state) auto's median TTFT, what it ran, and the best fixed method's median TTFT,
among the methods whose expected quality meets the default floor (full, ring, infoflow@0.15 under
the prior) and among all of them (none too). Full prefill runs on one rank whatever the world's
size and reads no chunk cache, so its one-rank cold time stands in every cell of its length."""
import csv
import statistics
import sys
from collections import Counter, defaultdict

rows = list(csv.DictReader(open(sys.argv[1])))
times = defaultdict(list)
ran = defaultdict(Counter)
for r in rows:
    key = (int(r["length"]), int(r["ranks"]), r["method"], r["cache"])
    times[key].append(float(r["ttft_ms"]))
    if r["method"] == "auto":
        ran[key][r["ran"]] += 1
med = {k: statistics.median(v) for k, v in times.items()}
cells = sorted({(l, p, c) for (l, p, m, c) in med if m == "auto"})
print("| length | ranks | cache | auto ran | auto ms | best meeting the floor | ms | auto / best | best of all | ms | auto / best of all |")
print("|---:|---:|---|---|---:|---|---:|---:|---|---:|---:|")
within = 0
for l, p, c in cells:
    auto = med[(l, p, "auto", c)]
    fixed = {}
    full = med.get((l, 1, "full", "cold"))
    if full is not None:
        fixed["full"] = full
    for m in ("ring", "infoflow", "none"):
        if (l, p, m, c) in med and not (m == "ring" and p == 1):
            fixed[m] = med[(l, p, m, c)]
    meeting = {m: t for m, t in fixed.items() if m != "none"}
    bm = min(meeting, key=meeting.get)
    ba = min(fixed, key=fixed.get)
    chose = ", ".join(f"{k} x{n}" for k, n in ran[(l, p, "auto", c)].most_common())
    ratio = auto / meeting[bm]
    within += ratio <= 1.10
    print(f"| {l} | {p} | {c} | {chose} | {auto:.1f} | {bm} | {meeting[bm]:.1f} | {ratio:.2f} | {ba} | {fixed[ba]:.1f} | {auto / fixed[ba]:.2f} |")
print(f"\nauto within 10% of the best method meeting the floor in {within} of {len(cells)} cells")

# How close auto's predictions came: each candidate's predicted TTFT (the median over auto's
# runs in the cell, from the `auto_predicted` column) against the same method's measured median
# in that cell (full: its one-rank cold time, as above).
if "auto_predicted" in rows[0]:
    preds = defaultdict(list)
    for r in rows:
        if r["method"] == "auto" and r["auto_predicted"]:
            for item in r["auto_predicted"].split(";"):
                label, ms = item.rsplit("=", 1)
                preds[(int(r["length"]), int(r["ranks"]), r["cache"], label)].append(float(ms))
    print("\n| length | ranks | cache | candidate | predicted ms | measured ms | error |")
    print("|---:|---:|---|---|---:|---:|---:|")
    errors = []
    for (l, p, c, label), v in sorted(preds.items()):
        m = label.split("@")[0]
        key = (l, 1, "full", "cold") if m == "full" else (l, p, m, c)
        if key not in med:
            continue
        pred, meas = statistics.median(v), med[key]
        errors.append(abs(pred - meas) / meas)
        print(f"| {l} | {p} | {c} | {label} | {pred:.1f} | {meas:.1f} | {(pred - meas) / meas:+.0%} |")
    if errors:
        print(f"\n{len(errors)} predictions: median |error| {statistics.median(errors):.1%}, "
              f"{sum(e <= 0.15 for e in errors)} within 15%, worst {max(errors):.0%}")
