#!/usr/bin/env python3
"""Replays the failures of the hardening issue (issue 16) against a flowprefill binary and
prints what a client sees, one line per finding. Run it on two binaries (before and after)
to compare:

    python3 scripts/hardening-replay.py target/release/flowprefill

Each finding starts its own `serve` on a free port (thread ranks, the default model) and stops
it afterwards. Nothing here is a test: it reports, it does not judge.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

BIN = sys.argv[1] if len(sys.argv) > 1 else "target/release/flowprefill"


def start(args=(), env=None):
    e = dict(os.environ)
    e.update(env or {})
    p = subprocess.Popen([BIN, "serve", "--listen", "127.0.0.1:0", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, env=e, text=True)
    for line in p.stdout:
        if "http://" in line:
            return p, line.split("http://")[1].split()[0]
    raise RuntimeError("the server did not start")


def stop(p):
    if p.poll() is None:
        p.kill()
    p.wait()


def post(addr, body, path="/v1/jobs", headers=None, timeout=120):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{addr}{path}", data=data,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    t = time.time()
    try:
        r = urllib.request.urlopen(req, timeout=timeout)
        return r.status, r.read().decode()[:140], time.time() - t
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()[:140], time.time() - t
    except Exception as e:  # noqa: BLE001 - a client sees any failure as "no answer"
        return "no answer", type(e).__name__ + ": " + str(e)[:80], time.time() - t


def get(addr, path):
    try:
        r = urllib.request.urlopen(f"http://{addr}{path}", timeout=10)
        return r.status, r.read().decode()[:140]
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()[:140]
    except Exception as e:  # noqa: BLE001
        return "no answer", str(e)[:80]


def docs(n, sentences, tag):
    out = []
    for i in range(n):
        t = "".join(f"The {tag} keeper of tower {i} counted {s * 3 + i} lanterns in {1800 + s}. " for s in range(sentences))
        if i == n // 2:
            t += "The access code for the north gate is 4729. "
        out.append(t)
    return out


def job(d, **kw):
    return {"documents": d, "query": "What is the access code for the north gate?", "max_tokens": 8, **kw}


def show(item, what, seen):
    print(f"{item:<4} {what:<62} {seen}")


def fmt(r):
    status, body, t = r
    return f"{status} in {t:.1f} s  {body[:90]!r}"


def item1():
    p, a = start()
    show("1", "deadline_s 1e20", fmt(post(a, job(docs(3, 6, "a"), deadline_s=1e20))))
    stop(p)


def item2():
    p, a = start(["--ranks", "2"], {"FLOWPREFILL_FAULT": "rank:0,phase:probe,mode:panic"})
    show("2", "panic on rank 0 (2 thread ranks): the job", fmt(post(a, job(docs(3, 6, "b")))))
    show("2", "  then /readyz", get(a, "/readyz"))
    show("2", "  then the next job", fmt(post(a, job(docs(3, 6, "c")))))
    stop(p)


def item3():
    p, a = start(["--ranks", "2"])
    show("3", "60 documents (6000 tokens), deadline_s 2", fmt(post(a, job(docs(60, 4, "d"), deadline_s=2))))
    show("3", "  the next small job", fmt(post(a, job(docs(2, 4, "e")))))
    body = json.dumps(job(docs(60, 4, "f"))).encode()
    c = socket.create_connection(tuple(a.split(":")))
    c.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    time.sleep(0.6)
    c.close()
    show("3", "client of a 6000-token job hangs up at 0.6 s; next small job", fmt(post(a, job(docs(2, 4, "g")))))
    tiny = {"text": "word " * 3000, "chunk_tokens": 1, "query": "q?", "max_tokens": 4}
    show("3", "3000 one-token chunks (15 KB)", fmt(post(a, tiny, timeout=60)))
    show("3", "  the next small job", fmt(post(a, job(docs(2, 4, "h")), timeout=600)))
    stop(p)


def item4():
    for label, args, env in [("--token '' on 0.0.0.0", ["--listen", "0.0.0.0:0", "--token", ""], {}),
                             ("FLOWPREFILL_TOKEN='' on 0.0.0.0", ["--listen", "0.0.0.0:0"], {"FLOWPREFILL_TOKEN": ""})]:
        e = dict(os.environ)
        e.update(env)
        p = subprocess.Popen([BIN, "serve", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=e, text=True)
        try:
            out, err = p.communicate(timeout=20)
            show("4", label, f"exit {p.returncode}: {err.strip().splitlines()[-1][:90] if err.strip() else ''}")
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            show("4", label, "started serving (still running after 20 s)")


def item5():
    p, a = start(["--token", "s3cret"])
    c = socket.create_connection(tuple(a.split(":")))
    c.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 8000000\r\n\r\n")
    c.settimeout(10)
    t = time.time()
    try:
        got = c.recv(200).decode(errors="replace").split("\r\n")[0]
    except socket.timeout:
        got = "nothing"
    show("5", "no token, Content-Length 8 MB, body not sent", f"{got!r} after {time.time() - t:.1f} s")
    c.close()
    stop(p)


def item6():
    p, a = start()
    c = socket.create_connection(tuple(a.split(":")))
    c.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"{" * 300)
    time.sleep(0.3)
    t = time.time()
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=60)
        show("6", "half-sent request, then SIGTERM", f"exited {p.returncode} after {time.time() - t:.1f} s")
    except subprocess.TimeoutExpired:
        show("6", "half-sent request, then SIGTERM", "still running 60 s after SIGTERM")
    c.close()
    stop(p)


def item7():
    p, a = start()
    d = docs(2, 3, "i")
    content = f"{d[0]}\n---\n{d[1]}\n---\nWhat is the access code for the north gate?"
    for field, value in [("n", 3), ("stop", ["\n"]), ("logprobs", True), ("frobnicate", 1)]:
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 8, field: value}
        show("7", f"chat completion with {field}={value!r}", fmt(post(a, body, path="/v1/chat/completions")))
    stop(p)


def item8():
    p, a = start()
    show("8", "score_layers [28, 35]", fmt(post(a, job(docs(3, 4, "j"), score_layers=[28, 35]))))
    show("8", "score_layers [28, 35], stream", fmt(post(a, job(docs(3, 4, "k"), score_layers=[28, 35], stream=True))))
    stop(p)


def item9():
    p, a = start(["--token", "s3cret"])
    body = job(docs(2, 3, "l"))
    show("9", "Authorization: bearer s3cret (lower case)", fmt(post(a, body, headers={"Authorization": "bearer s3cret"})))
    blank = {"documents": ["a document"], "query": " "}
    show("9", "an empty query (does the error name a CLI flag?)", fmt(post(a, blank, headers={"Authorization": "Bearer s3cret"})))
    arr = json.dumps([docs(1, 2, "n"), None, None, "What is it?"]).encode()
    show("9", "a JSON array as the body", fmt(post(a, arr, headers={"Authorization": "Bearer s3cret"})))
    stop(p)
    e = dict(os.environ, FLOWPREFILL_TOKEN="t0ps3cret")
    out = subprocess.run([BIN, "serve", "--help"], capture_output=True, text=True, env=e)
    show("9", "serve --help with FLOWPREFILL_TOKEN set", "prints the token" if "t0ps3cret" in out.stdout else "token not shown")
    q = subprocess.Popen([BIN, "serve", "--listen", "127.0.0.1:0", "--metrics-listen", "0.0.0.0:0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, err = q.communicate(timeout=20)
        show("9", "--metrics-listen 0.0.0.0:0 without a token", f"exit {q.returncode}")
    except subprocess.TimeoutExpired:
        q.kill()
        q.communicate()
        show("9", "--metrics-listen 0.0.0.0:0 without a token", "started serving")


if __name__ == "__main__":
    only = sys.argv[2:] or ["1", "2", "3", "4", "5", "6", "7", "8", "9"]
    for n in only:
        globals()[f"item{n}"]()
