//! `flowprefill serve` end to end: a real server process, real HTTP, real model.

use flowprefill_lab::http;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod promlint;

/// The document store through the service: ingestion, jobs naming documents by id, damaged
/// cache files.
mod documents;

/// The service as the ranks of an `mpirun` world: followers, deadlines and each kind of failure.
#[cfg(feature = "mpi")]
mod under_mpirun;

struct Server {
    child: Child,
    addr: String,
}

impl Server {
    fn start(args: &[&str], env: &[(&str, &str)]) -> Server {
        let mut c = Command::new(env!("CARGO_BIN_EXE_flowprefill"));
        c.arg("serve").arg("--listen").arg("127.0.0.1:0").args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
        for (k, v) in env {
            c.env(k, v);
        }
        let mut child = c.spawn().expect("start server");
        let out = child.stdout.take().unwrap();
        let mut lines = BufReader::new(out).lines();
        let addr = loop {
            let l = lines.next().expect("server exited before listening").unwrap();
            if let Some(rest) = l.split("http://").nth(1) {
                break rest.split_whitespace().next().unwrap().to_string();
            }
        };
        std::thread::spawn(move || for _ in lines {});
        Server { child, addr }
    }

    fn req(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> http::Response {
        http::request(&self.addr, method, path, headers, body, Duration::from_secs(300)).expect("request")
    }

    fn post(&self, path: &str, body: &serde_json::Value) -> http::Response {
        self.req("POST", path, &[("Content-Type", "application/json")], body.to_string().as_bytes())
    }

    /// A scrape of `/metrics`, which must pass Prometheus' lint (every scrape of every test).
    fn metrics(&self) -> String {
        let m = self.req("GET", "/metrics", &[], b"").text();
        let problems = promlint::lint(&m);
        assert!(problems.is_empty(), "/metrics fails Prometheus' lint: {problems:#?}\n{m}");
        m
    }

    fn term(&mut self) -> (bool, String) {
        Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status().unwrap();
        self.wait_exit()
    }

    /// Waits (60 s at most) for the process to exit: its success and stderr.
    fn wait_exit(&mut self) -> (bool, String) {
        let (code, err) = self.wait_code();
        (code == Some(0), err)
    }

    /// Waits (60 s at most) for the process to exit: its exit code and stderr.
    fn wait_code(&mut self) -> (Option<i32>, String) {
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(60) {
            if let Some(s) = self.child.try_wait().unwrap() {
                let mut err = String::new();
                if let Some(mut e) = self.child.stderr.take() {
                    let _ = e.read_to_string(&mut err);
                }
                return (s.code(), err);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        panic!("the server did not stop within 60 s of SIGTERM");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn docs(n: usize, sentences: usize) -> Vec<String> {
    (0..n)
        .map(|i| {
            let mut t = String::new();
            for s in 0..sentences {
                t.push_str(&format!(
                    "The keeper of tower {i} counted {} lanterns by the river in {}. ",
                    s * 3 + i,
                    1800 + s
                ));
                if i == n / 2 && s == sentences / 2 {
                    t.push_str("The access code for the north gate is 4729. ");
                }
            }
            t
        })
        .collect()
}

fn job(docs: &[String]) -> serde_json::Value {
    // 16 tokens: the answer's sentence with the whole code (12 cut it to "472").
    serde_json::json!({ "documents": docs, "query": "What is the access code for the north gate?", "max_tokens": 16 })
}

/// A streaming job of `max_tokens` over `docs`, sent by hand, its first bytes read: the
/// connection to drop (a client that goes away) or keep.
fn streaming(addr: &str, docs: &[String], max_tokens: usize) -> TcpStream {
    let mut body = job(docs);
    body["stream"] = true.into();
    body["max_tokens"] = max_tokens.into();
    let payload = body.to_string();
    let mut c = TcpStream::connect(addr).unwrap();
    write!(
        c,
        "POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{payload}",
        payload.len()
    )
    .unwrap();
    let mut first = [0u8; 64];
    let _ = c.read(&mut first).unwrap();
    c
}

/// /readyz once it answers 503 (a signal was handled), within 10 s.
fn ready_503(addr: &str) -> http::Response {
    let t = Instant::now();
    loop {
        let r = http::request(addr, "GET", "/readyz", &[], b"", Duration::from_secs(5)).unwrap();
        if r.status == 503 {
            return r;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "/readyz still {} 10 s after the signal", r.status);
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The phases `flowprefill_job_phase` shows at 1.
fn live_phases(metrics: &str) -> Vec<String> {
    promlint::samples(metrics)
        .into_iter()
        .filter(|x| x.name == "flowprefill_job_phase" && x.value == 1.0)
        .flat_map(|x| x.labels.into_iter().filter(|(k, _)| k == "phase").map(|(_, v)| v))
        .collect()
}

fn json(r: &http::Response) -> serde_json::Value {
    serde_json::from_slice(&r.body).unwrap_or_else(|e| panic!("{e}: {}", r.text()))
}

#[test]
fn endpoints_streaming_openai_and_metrics() {
    let s = Server::start(&["--ranks", "2"], &[]);
    assert_eq!(s.req("GET", "/healthz", &[], b"").status, 200);
    let ready = s.req("GET", "/readyz", &[], b"");
    assert_eq!(ready.status, 200, "{}", ready.text());
    assert_eq!(json(&ready)["ranks"], 2);

    let d = docs(3, 6);
    let r = s.post("/v1/jobs", &job(&d));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = json(&r);
    assert!(v["answer"].as_str().unwrap().contains("4729"), "{v}");
    assert!(v["ttft_ms"].as_f64().unwrap() > 0.0);
    assert_eq!(v["ranks"], 2);
    assert!(v["phases"]["recompute"].as_f64().is_some());
    let after_one_job = s.metrics();

    // KV eviction before decoding: each KV head keeps 64 context entries over the two ranks.
    let mut body = job(&d);
    body["evict"] = "snapkv".into();
    body["kv_budget"] = 64.into();
    let r = s.post("/v1/jobs", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let e = json(&r)["eviction"].clone();
    let kept: u64 = e["kept_per_rank"].as_array().expect("eviction reported").iter().map(|x| x.as_u64().unwrap()).sum();
    assert!(kept == 64 && e["bytes_after"].as_u64() < e["bytes_before"].as_u64(), "{e}");

    // Streamed: token events, then a done event carrying the stats.
    let mut body = job(&d);
    body["stream"] = true.into();
    let r = s.post("/v1/jobs", &body);
    assert_eq!(r.status, 200);
    assert!(r.header("content-type").unwrap().starts_with("text/event-stream"));
    let t = r.text();
    assert!(t.contains("event: token") && t.contains("event: done") && t.contains("\"ttft_ms\""), "{t}");

    // OpenAI-style: documents and question separated by `---` lines.
    let content = format!("{}\n---\n{}\n---\n{}\n---\nWhat is the access code for the north gate?", d[0], d[1], d[2]);
    let chat = serde_json::json!({
        "model": "smollm2", "messages": [{"role": "user", "content": content}], "max_tokens": 12,
        "flowprefill": {"method": "infoflow", "ratio": 0.2}
    });
    let r = s.post("/v1/chat/completions", &chat);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = json(&r);
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 100);
    assert_eq!(v["flowprefill"]["ratio"], 0.2);
    let mut chat_stream = chat.clone();
    chat_stream["stream"] = true.into();
    let t = s.post("/v1/chat/completions", &chat_stream).text();
    assert!(t.contains("chat.completion.chunk") && t.trim_end().ends_with("data: [DONE]"), "{t}");
    // The streamed deltas join up to the answer, and with `include_usage` a last chunk before
    // [DONE] carries the counts (it was accepted and ignored).
    let chunks: Vec<serde_json::Value> = t
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).expect("a JSON chunk"))
        .collect();
    let streamed: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(streamed, v["choices"][0]["message"]["content"].as_str().unwrap(), "the stream is the answer: {t}");
    assert!(chunks.iter().all(|c| c.get("usage").is_none()), "no usage chunk unless asked: {t}");
    chat_stream["stream_options"] = serde_json::json!({"include_usage": true});
    let t = s.post("/v1/chat/completions", &chat_stream).text();
    let last: serde_json::Value = t
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .rfind(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).expect("a JSON chunk"))
        .expect("chunks");
    assert!(last["choices"].as_array().is_some_and(Vec::is_empty), "{t}");
    assert_eq!(last["usage"], v["usage"], "the counts of the same job: {t}");
    // A follow-up about the same documents, without them: the conversation after the question
    // is in the prompt (more prompt tokens, the same context tokens), and the documents' chunk
    // caches are the first turn's.
    let answer = v["choices"][0]["message"]["content"].clone();
    let follow_up = serde_json::json!({
        "messages": [{"role": "user", "content": content}, {"role": "assistant", "content": answer},
                     {"role": "user", "content": "Which gate was that code for?"}],
        "max_tokens": 4, "flowprefill": {"method": "infoflow", "ratio": 0.2}
    });
    let r = s.post("/v1/chat/completions", &follow_up);
    assert_eq!(r.status, 200, "{}", r.text());
    let w = json(&r);
    let (first, then) = (&v["flowprefill"], &w["flowprefill"]);
    assert_eq!(then["n_context_tokens"], first["n_context_tokens"], "{w}");
    assert!(then["n_prompt_tokens"].as_u64() > first["n_prompt_tokens"].as_u64(), "{w}");
    assert!(then["cache_misses"] == 0 && then["cache_hits"] == first["cache_hits"], "{w}");

    // Errors name what to change.
    let bad = |body: &[u8], want: &str| {
        let r = s.req("POST", "/v1/jobs", &[("Content-Type", "application/json")], body);
        assert_eq!(r.status, 400, "{}", r.text());
        assert!(r.text().contains(want), "{want}: {}", r.text());
    };
    bad(b"{not json", "malformed JSON");
    bad(br#"{"documents": ["a"]}"#, "query");
    bad(br#"{"documents": ["a"], "query": "q", "method": "magic"}"#, "unknown method `magic`");
    bad(br#"{"documents": ["a"], "query": "q", "ratio": 2}"#, "field `ratio`");
    bad(br#"{"documents": ["a", " "], "query": "q"}"#, "field `documents[1]`: the document is empty");
    bad(br#"{"documents": ["a"], "query": "q", "ratoi": 0.1}"#, "ratoi");
    bad(br#"{"documents": ["a"], "query": "q", "evict": "snapkv"}"#, "field `kv_budget`: missing");

    // Every metric the dashboard and the alert rules query is exported.
    let m = s.metrics();
    let mut wanted = std::collections::BTreeSet::new();
    let dash: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string("../dashboards/grafana-flowprefill.json").unwrap()).unwrap();
    let mut exprs = Vec::new();
    for p in dash["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().unwrap() {
            exprs.push(t["expr"].as_str().unwrap().to_string());
        }
    }
    exprs.push(std::fs::read_to_string("../dashboards/alerts.yml").unwrap());
    for e in &exprs {
        for w in e.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            if w.starts_with("flowprefill_") {
                wanted.insert(
                    w.trim_end_matches("_bucket").trim_end_matches("_sum").trim_end_matches("_count").to_string(),
                );
            }
        }
    }
    assert!(wanted.len() >= 12, "{wanted:?}");
    for name in &wanted {
        assert!(m.contains(&format!("# TYPE {name} ")), "{name} is queried by the dashboards but not exported:\n{m}");
    }
    assert!(m.contains("rank=\"1\""), "per-rank series");
    assert!(m.contains("flowprefill_errors_total{kind=\"bad_request\"}"), "{m}");

    // Time is counted in seconds (promtool: base units), with fractions, per op family and rank
    // and per collective, transport and rank; the jobs since the first scrape added to them, and
    // no counter went down.
    let seconds = |text: &str, name: &str| -> f64 {
        promlint::samples(text).iter().filter(|x| x.name == name).map(|x| x.value).sum()
    };
    for name in ["flowprefill_op_seconds_total", "flowprefill_collective_wait_seconds_total"] {
        assert!(m.contains(&format!("# TYPE {name} counter")), "{name}:\n{m}");
        let (first, now) = (seconds(&after_one_job, name), seconds(&m, name));
        assert!(first > 0.0 && now > first, "{name}: {first} s after one job, {now} s now");
    }
    for rank in ["0", "1"] {
        for op in ["matmul", "attention", "norm_rope", "other"] {
            let series = promlint::samples(&m).into_iter().find(|x| {
                x.name == "flowprefill_op_seconds_total"
                    && x.labels.contains(&("op".into(), op.into()))
                    && x.labels.contains(&("rank".into(), rank.into()))
            });
            assert!(series.is_some_and(|x| x.value > 0.0), "{op} on rank {rank}:\n{m}");
        }
    }
    let now = promlint::samples(&m);
    for before in promlint::samples(&after_one_job) {
        if before.name.ends_with("_total") {
            let after = now.iter().find(|x| x.name == before.name && x.labels == before.labels);
            assert!(after.is_some_and(|a| a.value >= before.value), "{before:?} went down or away:\n{m}");
        }
    }
}

#[test]
fn auth_body_limit_and_loopback_default() {
    let s = Server::start(&["--token", "s3cret", "--max-body-bytes", "20000"], &[]);
    let d = docs(2, 4);
    let body = job(&d).to_string();
    let r = s.req("POST", "/v1/jobs", &[("Content-Type", "application/json")], body.as_bytes());
    assert_eq!(r.status, 401);
    assert_eq!(r.header("www-authenticate"), Some("Bearer"));
    let r = s.req("POST", "/v1/jobs", &[("Authorization", "Bearer wrong")], body.as_bytes());
    assert_eq!(r.status, 401);
    let r = s.req("POST", "/v1/jobs", &[("Authorization", "Bearer s3cret")], body.as_bytes());
    assert_eq!(r.status, 200, "{}", r.text());
    let big = serde_json::json!({"documents": ["x".repeat(50_000)], "query": "q"}).to_string();
    let r = s.req("POST", "/v1/jobs", &[("Authorization", "Bearer s3cret")], big.as_bytes());
    assert_eq!(r.status, 413, "{}", r.text());
    assert!(r.text().contains("too_large"));
    // A public address without a token is refused at start.
    let out =
        Command::new(env!("CARGO_BIN_EXE_flowprefill")).args(["serve", "--listen", "0.0.0.0:0"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("without --token"));
}

#[test]
fn queue_full_disconnect_and_graceful_shutdown() {
    let mut s = Server::start(&["--queue", "1"], &[]);
    let d = docs(8, 30);
    let body = job(&d).to_string();
    // Fill: one job computing, one queued; the next gets 429 with Retry-After.
    let spawn = |addr: String, body: String| {
        std::thread::spawn(move || {
            http::request(&addr, "POST", "/v1/jobs", &[], body.as_bytes(), Duration::from_secs(300)).unwrap()
        })
    };
    let a = spawn(s.addr.clone(), body.clone());
    std::thread::sleep(Duration::from_millis(400));
    let b = spawn(s.addr.clone(), body.clone());
    std::thread::sleep(Duration::from_millis(400));
    let r = s.req("POST", "/v1/jobs", &[], body.as_bytes());
    assert_eq!(r.status, 429, "{}", r.text());
    assert!(r.header("retry-after").is_some_and(|v| v.parse::<u64>().is_ok()));
    assert_eq!(a.join().unwrap().status, 200);
    assert_eq!(b.join().unwrap().status, 200);
    // Between jobs: no phase, no start time; the answers' tokens counted.
    let m = s.metrics();
    assert!(live_phases(&m).is_empty() && m.contains("flowprefill_job_start_time_seconds 0\n"), "{m}");
    let generated = promlint::samples(&m).into_iter().find(|x| x.name == "flowprefill_generated_tokens_total");
    assert!(generated.is_some_and(|x| x.value >= 2.0), "two jobs' answers: {m}");

    // A client that disconnects mid-job: the job is cancelled, the server carries on.
    drop(streaming(&s.addr, &d, 200));
    let t = Instant::now();
    loop {
        let m = s.metrics();
        if m.contains("flowprefill_errors_total{kind=\"cancelled\"}") {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(120), "the cancelled job was not recorded:\n{m}");
        std::thread::sleep(Duration::from_millis(300));
    }
    assert_eq!(s.req("GET", "/readyz", &[], b"").status, 200);

    // SIGTERM with a job in flight: it completes, then the server exits cleanly. While it
    // drains, the port still answers: new work gets 503, /readyz 503, /metrics its figures.
    let inflight = spawn(s.addr.clone(), body.clone());
    // Signalled once the job is in flight (a sleep here was a guess at a loaded machine's pace).
    let t = Instant::now();
    while !s.metrics().contains("flowprefill_jobs_in_flight 1") {
        assert!(t.elapsed() < Duration::from_secs(60), "the job never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    // A job in flight shows what it is doing before it ends: the phase it is in, and its start.
    let m = loop {
        let m = s.metrics();
        if !live_phases(&m).is_empty() {
            break m;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "no phase shown while the job ran:\n{m}");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(live_phases(&m).len(), 1, "one phase at a time: {:?}", live_phases(&m));
    let started = promlint::samples(&m).into_iter().find(|x| x.name == "flowprefill_job_start_time_seconds");
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
    assert!(started.is_some_and(|x| x.value > now - 120.0 && x.value <= now + 1.0), "{m}");
    let addr = s.addr.clone();
    Command::new("kill").args(["-TERM", &s.child.id().to_string()]).status().unwrap();
    let r = ready_503(&s.addr);
    assert!(r.text().contains("shutting down"), "{} {}", r.status, r.text());
    let r = s.req("POST", "/v1/jobs", &[], body.as_bytes());
    assert!(r.status == 503 && r.text().contains("shutting_down"), "{} {}", r.status, r.text());
    assert!(s.metrics().contains("flowprefill_jobs_in_flight 1"), "the drain is visible");
    let (ok, err) = s.wait_exit();
    let r = inflight.join().unwrap();
    assert_eq!(r.status, 200, "the in-flight job finished: {}", r.text());
    assert!(ok, "clean exit: {err}");
    assert!(err.contains("shutting down") && err.contains("stopped"), "{err}");
    assert!(TcpStream::connect(&addr).is_err(), "no longer accepting");
}

#[test]
fn a_failed_thread_rank_gives_503_and_the_service_recovers() {
    let s = Server::start(
        &["--ranks", "2", "--comm-timeout", "5"],
        &[("FLOWPREFILL_FAULT", "rank:1,phase:probe,mode:panic")],
    );
    let d = docs(3, 6);
    let r = s.post("/v1/jobs", &job(&d));
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(r.text().contains("rank 1 panicked"), "{}", r.text());
    // The ranks are rebuilt: the next job succeeds.
    let r = s.post("/v1/jobs", &job(&d));
    assert_eq!(r.status, 200, "{}", r.text());
    let m = s.metrics();
    assert!(m.contains("flowprefill_errors_total{kind=\"rank_failure\"} 1"), "{m}");
    assert_eq!(s.req("GET", "/readyz", &[], b"").status, 200);
}

/// Waits on rank 0 alone longer than `--comm-timeout` are not a lost rank 0: a service idle
/// for several deadlines keeps its ranks, and a `full` job whose prefill on rank 0 outlasts
/// the deadline (an injected 9 s stall, the deadline 4 s; the watchdog's limit is 16 s) is
/// answered. (A deadline of 2 s was within a loaded 2-core machine's reach for the InfoFlow
/// job's own collectives.)
#[test]
fn waits_on_rank_0_longer_than_the_comm_timeout_keep_the_ranks_up() {
    let s = Server::start(
        &["--ranks", "2", "--comm-timeout", "4"],
        &[("FLOWPREFILL_FAULT", "rank:0,phase:prefill,mode:stall:9000")],
    );
    std::thread::sleep(Duration::from_secs(9));
    let d = docs(3, 6);
    let r = s.post("/v1/jobs", &job(&d));
    assert_eq!(r.status, 200, "after 9 s idle: {}", r.text());
    let mut full = job(&d);
    full["method"] = "full".into();
    let t = Instant::now();
    let r = s.post("/v1/jobs", &full);
    assert_eq!(r.status, 200, "full with rank 0 stalled for 9 s: {}", r.text());
    assert!(t.elapsed() >= Duration::from_secs(9), "the stall fired: {:?}", t.elapsed());
    assert!(json(&r)["answer"].as_str().is_some_and(|a| a.contains("4729")), "{}", r.text());
    let m = s.metrics();
    // At 0 from the start (the alert's increase needs a series before the first failure).
    assert!(m.contains("flowprefill_errors_total{kind=\"rank_failure\"} 0\n"), "{m}");
}

#[test]
fn sigterm_with_a_half_sent_request_still_exits() {
    let mut s = Server::start(&["--shutdown-grace", "1"], &[]);
    // Headers and half the body, then silence: the server must not wait for the rest.
    let mut c = TcpStream::connect(&s.addr).unwrap();
    write!(c, "POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{}", "{".repeat(300)).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    let (ok, err) = s.term();
    assert!(ok, "clean exit: {err}");
    assert!(t.elapsed() < Duration::from_secs(15), "exited {:?} after SIGTERM", t.elapsed());
    drop(c);
}

#[test]
fn a_second_signal_stops_at_once_and_a_port_in_use_is_found_before_the_model_loads() {
    let s = Server::start(&[], &[]);
    // The port is taken: the error says so, before the model (a missing file here) is read.
    let out = Command::new(env!("CARGO_BIN_EXE_flowprefill"))
        .args(["serve", "--listen", &s.addr, "--model", "/nonexistent/model.gguf"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("cannot listen on") && err.contains("in use"), "{err}");
    assert!(!err.contains("nonexistent"), "the model was read before the port: {err}");
    drop(s);

    // A long job in flight: the first SIGTERM drains (the job would run on), the second stops.
    let mut s = Server::start(&[], &[]);
    let c = streaming(&s.addr, &docs(8, 30), 2000);
    let pid = s.child.id().to_string();
    Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    // The first signal was handled (the service drains), so the second is a second one.
    ready_503(&s.addr);
    assert!(s.child.try_wait().unwrap().is_none(), "the first signal drains: the job runs on");
    let t = Instant::now();
    Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    let status = exit_within(&mut s.child, Duration::from_secs(20));
    let mut err = String::new();
    let _ = s.child.stderr.take().unwrap().read_to_string(&mut err);
    assert_eq!(status.code(), Some(130), "{err}");
    assert!(err.contains("a second Ctrl-C or SIGTERM stops at once") && err.contains("a second signal"), "{err}");
    assert!(t.elapsed() < Duration::from_secs(10), "stopped {:?} after the second signal", t.elapsed());
    drop(c);
}

#[cfg(feature = "mpi")]
fn mpirun_serve(env: &[(&str, &str)], extra: &[&str]) -> (Child, String) {
    let mut c = Command::new("mpirun");
    c.args(["--oversubscribe", "-np", "2", env!("CARGO_BIN_EXE_flowprefill"), "serve", "--listen", "127.0.0.1:0"])
        .args(extra)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        c.env(k, v);
    }
    let mut child = c.spawn().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let addr = loop {
        let l = lines.next().expect("server exited").unwrap();
        if let Some(rest) = l.split("http://").nth(1) {
            break rest.split_whitespace().next().unwrap().to_string();
        }
    };
    std::thread::spawn(move || for _ in lines {});
    (child, addr)
}

#[cfg(feature = "mpi")]
fn post_small_job(addr: &str) -> http::Response {
    let body = job(&docs(3, 6)).to_string();
    http::request(addr, "POST", "/v1/jobs", &[], body.as_bytes(), Duration::from_secs(120)).unwrap()
}

fn exit_within(child: &mut Child, limit: Duration) -> std::process::ExitStatus {
    let t = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        assert!(t.elapsed() < limit, "the process did not exit within {limit:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Out of memory on a rank mid-job (injected: the GPU's memory taken by another tenant) is a
/// resource error: 503 with Retry-After and kind `resource`, counted per device; the ranks
/// stay up and the next job succeeds.
#[test]
fn out_of_memory_on_a_rank_gives_503_with_retry_after_and_the_next_job_runs() {
    let s = Server::start(&["--ranks", "2"], &[("FLOWPREFILL_FAULT", "rank:1,phase:recompute,mode:oom")]);
    let d = docs(3, 6);
    let r = s.post("/v1/jobs", &job(&d));
    assert_eq!(r.status, 503, "{}", r.text());
    let v = json(&r);
    assert_eq!(v["error"]["kind"], "resource", "{v}");
    let msg = v["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("needs 1.00 GiB more on injected (0.0 MiB free)") && msg.contains("retry"), "{msg}");
    let retry: u64 = r.header("retry-after").and_then(|h| h.parse().ok()).expect("a Retry-After header");
    assert!(retry >= 1, "{retry}");
    let r = s.post("/v1/jobs", &job(&d));
    assert_eq!(r.status, 200, "{}", r.text());
    let m = s.metrics();
    assert!(m.contains("flowprefill_out_of_memory_total{device=\"injected\"} 1"), "{m}");
    assert!(m.contains("flowprefill_errors_total{kind=\"resource\"} 1"), "{m}");
    // The server's fault (the error-rate alert counts it), then a job done; the TTFT of the one
    // that produced a token only.
    assert!(m.contains("flowprefill_jobs_total{method=\"infoflow\",outcome=\"error\"} 1"), "{m}");
    assert!(m.contains("flowprefill_jobs_total{method=\"infoflow\",outcome=\"ok\"} 1"), "{m}");
    assert!(m.contains("flowprefill_ttft_seconds_count{method=\"infoflow\"} 1"), "{m}");
    assert_eq!(s.req("GET", "/readyz", &[], b"").status, 200);
}

/// The tokens a job produced before it failed are counted as generated: rank 1 runs out of
/// memory (injected) as the second job's decoding starts, after rank 0 took (and streamed) the
/// first token; the counter grows by exactly that one.
#[test]
fn tokens_a_failed_job_produced_are_counted() {
    let s = Server::start(&["--ranks", "2"], &[("FLOWPREFILL_FAULT", "rank:1,phase:decode,mode:oom,after:1")]);
    let generated = |m: &str| {
        promlint::samples(m)
            .into_iter()
            .filter(|x| x.name == "flowprefill_generated_tokens_total")
            .map(|x| x.value)
            .sum::<f64>()
    };
    let d = docs(3, 6);
    let r = s.post("/v1/jobs", &job(&d));
    assert_eq!(r.status, 200, "{}", r.text());
    let first = generated(&s.metrics());
    assert!(first >= 1.0, "the first job's answer: {first}");
    let r = s.post("/v1/jobs", &job(&d));
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(json(&r)["error"]["kind"], "resource", "{}", r.text());
    let m = s.metrics();
    assert!(m.contains("flowprefill_jobs_total{method=\"infoflow\",outcome=\"error\"} 1"), "{m}");
    assert_eq!(generated(&m), first + 1.0, "the failed job's one token counted: {m}");
}

/// A GPU lost mid-job (injected on rank 1: a kernel fault, which CUDA keeps for the process's
/// life) stops the service: rebuilt ranks would meet the same GPU and every later job would
/// fail while /readyz said ready. The job gets 503 `device_failure` naming it, and the process
/// exits 69 so that its supervisor starts a new one.
#[test]
fn a_lost_gpu_fails_its_job_with_503_and_the_service_exits_69() {
    let mut s = Server::start(&["--ranks", "2"], &[("FLOWPREFILL_FAULT", "rank:1,phase:probe,mode:device-lost")]);
    let r = s.post("/v1/jobs", &job(&docs(3, 6)));
    assert_eq!(r.status, 503, "{}", r.text());
    let v = json(&r);
    assert_eq!(v["error"]["kind"], "device_failure", "{v}");
    let msg = v["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("an injected fault at rank 1's probe") && msg.contains("restart the process"), "{msg}");
    let (code, err) = s.wait_code();
    assert_eq!(code, Some(69), "{err}");
    assert!(err.contains("a GPU can no longer be used by this process") && err.contains("start it again"), "{err}");
}

#[test]
fn a_job_larger_than_the_memory_limit_gets_413_before_queueing_and_readyz_watches_free_memory() {
    // 256 MiB per job on this (CPU) device, two thread ranks sharing it.
    let s = Server::start(&["--ranks", "2", "--memory-limit", "0.25"], &[]);
    let ready = s.req("GET", "/readyz", &[], b"");
    assert_eq!(ready.status, 200, "{}", ready.text());
    assert_eq!(json(&ready)["memory_free_bytes"], 256u64 << 20, "{}", ready.text());
    // About 4K tokens: two copies of their K/V alone are over 256 MiB.
    let r = s.post("/v1/jobs", &job(&docs(6, 40)));
    assert_eq!(r.status, 413, "{}", r.text());
    let v = json(&r);
    assert_eq!(v["error"]["kind"], "too_large", "{v}");
    let msg = v["error"]["message"].as_str().unwrap_or_default();
    let shared = "the job's 2 ranks share the memory of cpu";
    for want in ["the job needs", "on cpu", "--memory-limit allows 0.25 GiB", "fewer context tokens", shared] {
        assert!(msg.contains(want), "{want:?} missing from: {msg}");
    }
    // More thread ranks on this device would add to its memory, not split it.
    assert!(!msg.contains("more ranks"), "{msg}");
    // The small job fits and runs.
    let r = s.post("/v1/jobs", &job(&docs(3, 6)));
    assert_eq!(r.status, 200, "{}", r.text());
    let m = s.metrics();
    assert!(m.contains("flowprefill_errors_total{kind=\"too_large\"} 1"), "{m}");
    assert!(m.contains("flowprefill_memory_free_bytes{device=\"cpu\"} 268435456"), "{m}");
    assert!(
        !m.contains("flowprefill_jobs_total{method=\"infoflow\",outcome=\"error\"}"),
        "the large job was queued: {m}"
    );
    drop(s);
    // Below what the smallest job needs, the server is up but not ready.
    let s = Server::start(&["--memory-limit", "0.0005"], &[]);
    let r = s.req("GET", "/readyz", &[], b"");
    assert_eq!(r.status, 503, "{}", r.text());
    let reason = json(&r)["reason"].as_str().unwrap_or_default().to_string();
    assert!(reason.contains("below the") && reason.contains("the smallest job needs"), "{reason}");
}

/// [`flowprefill_lab::tasks::TWO_HOP_DOCS`] with `none`: it answers 3817, the exact answer 5264.
fn two_hop_job() -> serde_json::Value {
    use flowprefill_lab::tasks::{TWO_HOP_DOCS, TWO_HOP_QUERY};
    serde_json::json!({ "documents": TWO_HOP_DOCS, "query": TWO_HOP_QUERY, "method": "none", "max_tokens": 14 })
}

/// Verification on the service: a job asks for it and a gate (the exact answer replaces a
/// breached one); `--verify-rate 0.5` verifies every second job by itself; the metrics count
/// both; bad values are 400s naming the field, a bad rate stops the start.
#[test]
fn jobs_are_verified_gated_and_counted() {
    let s = Server::start(&["--verify-rate", "0.5"], &[]);
    let mut body = two_hop_job();
    body["verify"] = true.into();
    body["quality_floor"] = 0.001.into();
    let r = s.post("/v1/jobs", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = json(&r);
    let q = &v["quality"];
    assert_eq!(q["exact_method"], "full", "{v}");
    assert!(q["kl"].as_f64().unwrap() > 0.001 && q["breached"] == true && q["fell_back"] == true, "{q}");
    assert!(v["answer"].as_str().unwrap().contains(flowprefill_lab::tasks::TWO_HOP_ANSWER), "the exact answer: {v}");
    // Not asked: with --verify-rate 0.5 one of the next two jobs is verified.
    let verified: usize = (0..2)
        .map(|_| {
            let r = s.post("/v1/jobs", &two_hop_job());
            assert_eq!(r.status, 200, "{}", r.text());
            usize::from(!json(&r)["quality"].is_null())
        })
        .sum();
    assert_eq!(verified, 1, "half of the jobs that did not ask");
    let m = s.metrics();
    assert!(m.contains("flowprefill_verified_total{method=\"none\",verdict=\"breached\"} 1"), "{m}");
    assert!(m.contains("flowprefill_verified_total{method=\"none\",verdict=\"ok\"} 1"), "{m}");
    assert!(m.contains("flowprefill_quality_fallbacks_total{method=\"none\"} 1"), "{m}");
    assert!(m.contains("flowprefill_quality_kl_count{method=\"none\"} 2"), "{m}");
    // Field errors.
    let mut bad = two_hop_job();
    bad["verify"] = true.into();
    bad["quality_floor"] = (-1.0).into();
    let r = s.post("/v1/jobs", &bad);
    assert_eq!(r.status, 400);
    assert!(r.text().contains("quality_floor"), "{}", r.text());
    let mut bad = two_hop_job();
    bad["on_breach"] = "flag".into();
    let r = s.post("/v1/jobs", &bad);
    assert_eq!(r.status, 400);
    assert!(r.text().contains("on_breach"), "{}", r.text());
    let out = Command::new(env!("CARGO_BIN_EXE_flowprefill"))
        .args(["serve", "--listen", "127.0.0.1:0", "--verify-rate", "1.5"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "a usage error");
    assert!(String::from_utf8_lossy(&out.stderr).contains("--verify-rate"));
}
