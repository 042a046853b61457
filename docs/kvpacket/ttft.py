# Same-run warm TTFT of none vs kvpacket (and full) against a live `flowprefill serve`.
# usage: python3 ttft.py PORT LENGTHS(comma) ROUNDS
import json, sys, random, statistics, urllib.request
port, lengths, rounds = int(sys.argv[1]), [int(x) for x in sys.argv[2].split(',')], int(sys.argv[3])
words = ("the river market garden north tower bridge merchant quiet winter harbour lantern copper "
         "field stone morning letter village council road forest mill baker ledger window bell").split()
def post(body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/jobs", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)
for L in lengths:
    rng = random.Random(L)
    docs = []
    for d in range(8):
        n = int(L / 8 / 1.25)
        text = " ".join(rng.choice(words) for _ in range(n)) + "."
        if d == 5:
            text = text[: len(text) // 2] + " The access code for the north gate is 4729. " + text[len(text) // 2 :]
        docs.append(text)
    q = "What is the access code for the north gate?"
    body = lambda m: {"documents": docs, "query": q, "method": m, "max_tokens": 12}
    t = {"full": [], "none": [], "kvpacket": []}
    ans = {}
    for m in ("none", "kvpacket"):
        r = post(body(m)); print(L, m, "cold", round(r["ttft_ms"]), r["n_context_tokens"], repr(r["answer"]), flush=True)
    for i in range(rounds):
        for m in ("none", "kvpacket"):
            r = post(body(m)); t[m].append(r["ttft_ms"]); ans[m] = r["answer"]
            print(L, m, "warm", round(r["ttft_ms"]), r["cache_hits"], r["cache_misses"], flush=True)
    for i in range(3):
        r = post(body("full")); t["full"].append(r["ttft_ms"]); ans["full"] = r["answer"]
    med = {m: statistics.median(v) for m, v in t.items()}
    print(f"== {L} tokens (context {r['n_context_tokens']}): median TTFT ms full {med['full']:.0f} (3 runs), "
          f"none {med['none']:.0f}, kvpacket {med['kvpacket']:.0f} ({rounds} warm runs each, interleaved); "
          f"kvpacket/none = {med['kvpacket']/med['none']:.2f}; answers {ans}", flush=True)
