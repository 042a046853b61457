"""Eviction eval: SnapKV vs LookaheadKV vs the full cache, paired on the same cases."""
import json, sys, os, math, collections
import pathlib
root = str(pathlib.Path(__file__).resolve().parents[1] / 'eval')
base = {(r['task'], r['length'], r['sample']): r['score'] for r in json.load(open(f'{root}/qwen/results.json'))['records']
        if r['method'] == 'full'}
fam = lambda t: 'NIAH' if t.startswith('niah') else ('VT' if t == 'variable_tracking' else 'QA')
def load(p):
    path = f'{root}/lookahead/{p}/results.json'
    if not os.path.exists(path): return {}
    return {(r['task'], r['length'], r['sample']): r['score'] for r in json.load(open(path))['records'] if r['method'] == 'full'}
def fmt(p):
    return f'{p:.1e}' if p < 0.001 else f'{p:.3f}'
def sign(b, w):
    n = b + w
    if n == 0: return 1.0
    k = min(b, w)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)
budgets = [int(b) for b in (sys.argv[1] if len(sys.argv) > 1 else '64,128,512').split(',')]
for length in (2048, 4096):
    rows = []
    for b in budgets:
        s, l = load(f'evict-qwen/snapkv-{b}'), load(f'evict-qwen/lookahead-{b}')
        keys = sorted(k for k in s if k in l and k[1] == length)
        if not keys: continue
        def mean(d, f=None):
            ks = [k for k in keys if f is None or fam(k[0]) == f]
            return sum(d[k] for k in ks) / max(1, len(ks)), len(ks)
        line = f'| {length} | {b} | {len(keys)} |'
        for f in ('NIAH', 'QA', 'VT', None):
            (fs, n), (ss, _), (ls, _) = mean(base, f), mean(s, f), mean(l, f)
            line += f' {100*fs:.1f} / {100*ss:.1f} / {100*ls:.1f} ({n}) |' if n else ' - |'
        bt = sum(1 for k in keys if l[k] > s[k]); wo = sum(1 for k in keys if l[k] < s[k])
        bs = sum(1 for k in keys if s[k] < base[k]); bl = sum(1 for k in keys if l[k] < base[k])
        line += f' {bt} / {wo} (p = {fmt(sign(bt, wo))}) | {bs} / {bl} |'
        rows.append(line)
    if rows:
        print('| length | budget | cases | NIAH full / SnapKV / LookaheadKV | QA | VT | all | LookaheadKV better / worse than SnapKV | below full: SnapKV / LookaheadKV |')
        print('|---|---|---|---|---|---|---|---|---|')
        print('\n'.join(rows))
    # Per task: mean score of the full cache, then SnapKV / LookaheadKV at each budget, on the
    # cases every budget of both policies has.
    data = {b: (load(f'evict-qwen/snapkv-{b}'), load(f'evict-qwen/lookahead-{b}')) for b in budgets}
    common = [k for k in base if k[1] == length and all(k in s and k in l for s, l in data.values())]
    if not common: continue
    tasks = sorted({k[0] for k in common}, key=lambda t: (fam(t), t))
    print(f'\nPer task at {length} tokens ({len(common)} cases with every budget), full / then SnapKV / LookaheadKV:\n')
    print('| task | cases | full | ' + ' | '.join(f'N = {b}' for b in budgets) + ' |')
    print('|---|---:|---:|' + '---:|' * len(budgets))
    for t in tasks + [None]:
        ks = [k for k in common if t is None or k[0] == t]
        m = lambda d: 100 * sum(d[k] for k in ks) / len(ks)
        cells = [f'{m(s):.1f} / {m(l):.1f}' for s, l in data.values()]
        print(f'| {t or "all"} | {len(ks)} | {m(base):.1f} | ' + ' | '.join(cells) + ' |')
