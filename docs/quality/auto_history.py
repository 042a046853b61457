#!/usr/bin/env python3
"""What `--method auto` would learn from a quality history, and what it would then choose.

Reads the results.json of `flowprefill eval --verify` runs (every verified run is what a
history line holds: the method, its first-token KL against the exact answer) and prints, per
file and method: the runs, the mean first-token KL (what the chooser compares with the floor),
the median, the share whose whole answer equals the exact one, the share *hurt* (scored below
the exact answer) and the mean score. Then, per floor, what the chooser's rule picks among
`none` and InfoFlow@0.15 (the fastest that meets the floor; `none` is faster wherever both
run, docs/quality.md's grid) or the exact method, by the mean and, for comparison, by the
median, with the mean score of that pick on these cases.

    python3 docs/quality/auto_history.py docs/quality/gate-qwen-2048/results.json ...
"""
import json
import statistics as st
import sys

FLOORS = [0.02, 0.05, 0.1, 0.15, 0.2, 0.25]
FASTEST_FIRST = ["none", "infoflow@0.15"]


def label(r):
    return r["method"] + ("@%g" % r["ratio"] if r.get("ratio") else "")


def main(paths):
    for path in paths:
        records = [r for r in json.load(open(path))["records"] if r.get("verified")]
        by = {}
        for r in records:
            by.setdefault(label(r), []).append(r)
        print(f"{path}: {len(records)} verified runs")
        print("| method | runs | mean KL | median KL | whole answer = exact | hurt | score |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        stats = {}
        for m, rs in by.items():
            kls = [r["verified"]["kl"] for r in rs]
            same = st.mean(r["verified"]["agree_tokens"] == r["verified"]["answer_tokens"] for r in rs)
            hurt = st.mean(r["score"] < r["verified"]["exact_score"] for r in rs)
            score = 100 * st.mean(r["score"] for r in rs)
            stats[m] = (st.mean(kls), st.median(kls), score)
            print(f"| {m} | {len(rs)} | {stats[m][0]:.3f} | {stats[m][1]:.3f} | {same:.2f} | {hurt:.2f} | {score:.1f} |")
        exact = next((m for m in ("full", "ring") if m in stats), None)
        print()
        print("| floor | auto by the mean (score) | by the median (score) |")
        print("| ---: | --- | --- |")
        for floor in FLOORS:
            cells = []
            for i in (0, 1):
                pick = next((m for m in FASTEST_FIRST if m in stats and stats[m][i] <= floor), exact)
                cells.append(f"{pick} ({stats[pick][2]:.1f})" if pick else "-")
            print(f"| {floor} | {cells[0]} | {cells[1]} |")
        print()


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
