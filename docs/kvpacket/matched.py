# Matched-case comparison of docs/eval records with the kvpacket runs: python3 matched.py RESULTS.json [EXTRA.json LABEL]...
import json, sys, statistics, math, collections
# usage: analyze.py results.json [extra_results.json label]...
main = json.load(open(sys.argv[1]))['records']
extra = []
for i in range(2, len(sys.argv), 2):
    extra += [dict(r, method=sys.argv[i+1]) for r in json.load(open(sys.argv[i]))['records'] if r['method'] == 'kvpacket']
recs = main + extra
def lab(r):
    return r['method'] + ('@%g' % r['ratio'] if r.get('ratio') is not None else '')
methods = ['full', 'none', 'kvpacket', 'kvpacket-e1', 'kvpacket-e0', 'infoflow@0.15', 'cacheblend@0.15', 'epic@0.15']
groups = {'NIAH': lambda t: t.startswith('niah'), 'VT': lambda t: t == 'variable_tracking', 'QA': lambda t: t.startswith('qa'), 'all': lambda t: True}
def sign_p(w, l):
    n = w + l
    if n == 0: return 1.0
    k = min(w, l)
    p = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * p)
for L in sorted({r['length'] for r in recs}):
    by = collections.defaultdict(dict)
    for r in recs:
        if r['length'] == L and r['sample'] < 10:
            by[(r['task'], r['sample'])][lab(r)] = r
    present = [m for m in methods if any(m in v for v in by.values())]
    cases = [k for k, v in by.items() if all(m in v for m in present)]
    print(f'== {L} tokens: {len(cases)} matched cases; methods {present}')
    print('method'.ljust(16), ' '.join(g.rjust(8) for g in groups), ' retNIAH  retAll  keptNIAH   keptAll  TTFTmed_ms')
    solved = [c for c in cases if by[c]['full']['score'] >= 1 - 1e-9]
    full = {g: sum(by[c]['full']['score'] for c in cases if groups[g](c[0])) for g in groups}
    for m in present:
        row = []
        for g in groups:
            sc = [by[c][m]['score'] for c in cases if groups[g](c[0])]
            row.append(100 * sum(sc) / max(1, len(sc)))
        ret_n = 100 * sum(by[c][m]['score'] for c in cases if groups['NIAH'](c[0])) / max(1e-9, full['NIAH'])
        ret_a = 100 * sum(by[c][m]['score'] for c in cases) / max(1e-9, full['all'])
        tt = statistics.median(by[c][m]['ttft_ms'] for c in cases)
        # strict conditional retention: of the cases full answers fully, the share m answers fully
        kept = lambda cs: f"{sum(by[c][m]['score'] >= 1 - 1e-9 for c in cs):>3}/{len(cs):<3}"
        kn = kept([c for c in solved if groups['NIAH'](c[0])])
        print(m.ljust(16), ' '.join(f'{x:8.1f}' for x in row), f'{ret_n:7.1f} {ret_a:7.1f}   {kn}   {kept(solved)} {tt:10.0f}')
    for a, b in [('kvpacket', 'none'), ('kvpacket-e1', 'none'), ('kvpacket', 'kvpacket-e1'), ('infoflow@0.15', 'kvpacket'), ('kvpacket', 'cacheblend@0.15'), ('kvpacket', 'epic@0.15')]:
        if a in present and b in present:
            w = sum(by[c][a]['score'] > by[c][b]['score'] for c in cases)
            l = sum(by[c][a]['score'] < by[c][b]['score'] for c in cases)
            print(f'  {a} vs {b}: {w} better / {l} worse, sign test p = {sign_p(w, l):.3f}')
