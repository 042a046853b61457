import json, subprocess, sys, time, urllib.request, statistics, re, os
fp = "/work/main/target/release/flowprefill"
words = "the river carried light over stones while a quiet town counted its bells and kept its records".split()
docs = []
for d in range(4):
    t = " ".join(words[(i + d) % len(words)] for i in range(360))
    if d == 2:
        t += " The access code for the north gate is 4729."
    docs.append(t)
rows = []
for rate in ["0", "0.1", "1"]:
    env = dict(os.environ, FLOWPREFILL_STORE="off")
    p = subprocess.Popen([fp, "serve", "--listen", "127.0.0.1:0", "--verify-rate", rate], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    addr = None
    for line in p.stdout:
        m = re.search(r"http://(\S+)", line)
        if m:
            addr = m.group(1); break
    lat, ttft, ver = [], [], 0
    for i in range(21):
        body = json.dumps({"documents": docs, "query": f"What is the access code for the north gate? ({i})", "method": "infoflow", "max_tokens": 12}).encode()
        t = time.time()
        r = urllib.request.urlopen(urllib.request.Request(f"http://{addr}/v1/jobs", data=body, headers={"Content-Type": "application/json"}), timeout=600)
        v = json.loads(r.read())
        dt = (time.time() - t) * 1e3
        if i == 0:
            continue  # the first job fills the chunk caches
        lat.append(dt); ttft.append(v["ttft_ms"]); ver += v.get("quality") is not None
    p.terminate(); p.wait()
    rows.append((rate, len(lat), ver, statistics.mean(ttft), statistics.median(lat), statistics.mean(lat)))
    print(rows[-1], flush=True)
print("| verify rate | jobs | verified | mean TTFT (ms) | median response (ms) | mean response (ms) |")
print("| ---: | ---: | ---: | ---: | ---: | ---: |")
for r in rows:
    print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.0f} | {r[4]:.0f} | {r[5]:.0f} |")
