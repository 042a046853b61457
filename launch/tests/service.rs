//! The HTTP service in-process: `Service::start` on thread ranks with the real model, `serve` on
//! a port-0 listener with a shutdown future, real HTTP over loopback. One test per failure the
//! hardening issue found (numbered as there); each fails on the code before it.
//!
//! The tests run one at a time (a lock): each computes on the same two cores, and the timing
//! comparisons below compare a job with another job measured in the same test.

use flowprefill::serve::{self, ServeConfig, Service};
use flowprefill_coordinator::fault::{FaultMode, FaultPlan};
use flowprefill_kernels::{Cpu, Device};
use flowprefill_lab::http;
use flowprefill_worker::LoadedModel;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

fn lm() -> Arc<LoadedModel<Device>> {
    static LM: OnceLock<Arc<LoadedModel<Device>>> = OnceLock::new();
    LM.get_or_init(|| {
        let path = flowprefill_worker::fetch::ensure_default_model(&mut |l| eprintln!("{l}")).expect("default model");
        Arc::new(LoadedModel::load(&path, Device::Cpu(Cpu)).expect("load the default model"))
    })
    .clone()
}

static SERIAL: Mutex<()> = Mutex::new(());

struct Server {
    addr: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    done: Option<std::thread::JoinHandle<anyhow::Result<()>>>,
    _serial: MutexGuard<'static, ()>,
}

fn start(cfg: ServeConfig, ranks: usize, faults: Option<Arc<FaultPlan>>) -> Server {
    start_with(cfg, ranks, faults, true)
}

/// [`start`], with thread ranks that are rebuilt after a failure, or not (as under MPI).
fn start_with(cfg: ServeConfig, ranks: usize, faults: Option<Arc<FaultPlan>>, rebuilt: bool) -> Server {
    let serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let lm = lm();
    let (world, rebuild) = Service::thread_world(lm.clone(), ranks, Duration::from_secs(5), faults, None).unwrap();
    let service = Service::start(lm, world, rebuilt.then_some(rebuild), cfg).unwrap();
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let done = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
        let served = rt.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            let _ = addr_tx.send(listener.local_addr()?.to_string());
            serve::serve(listener, &service, async {
                let _ = stopped.await;
            })
            .await
        });
        rt.shutdown_timeout(Duration::from_secs(1));
        service.finish(Duration::from_secs(30));
        served
    });
    let addr = addr_rx.recv_timeout(Duration::from_secs(30)).expect("the server listens");
    Server { addr, stop: Some(stop), done: Some(done), _serial: serial }
}

impl Server {
    fn req(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> http::Response {
        http::request(&self.addr, method, path, headers, body, Duration::from_secs(300)).expect("a response")
    }

    fn post(&self, path: &str, body: &serde_json::Value) -> http::Response {
        self.req("POST", path, &[("Content-Type", "application/json")], body.to_string().as_bytes())
    }

    fn ready(&self) -> serde_json::Value {
        let r = self.req("GET", "/readyz", &[], b"");
        let v = json(&r);
        assert_eq!(r.status == 200, v["ready"] == true, "{v}");
        v
    }

    /// Stops the server; returns how long `serve` took to return and what it returned.
    fn stop(mut self) -> (Duration, anyhow::Result<()>) {
        let t = Instant::now();
        let _ = self.stop.take().map(|s| s.send(()));
        let r = self.done.take().map(|d| d.join().expect("the server thread")).unwrap_or(Ok(()));
        (t.elapsed(), r)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.stop.take().map(|s| s.send(()));
        if let Some(d) = self.done.take() {
            let _ = d.join();
        }
    }
}

/// `n` documents of `sentences` sentences; `tag` makes their text (and chunk caches) distinct.
fn docs(n: usize, sentences: usize, tag: &str) -> Vec<String> {
    (0..n)
        .map(|i| {
            let mut t = String::new();
            for s in 0..sentences {
                t.push_str(&format!("The {tag} keeper of tower {i} counted {} lanterns in {}. ", s * 3 + i, 1800 + s));
                if i == n / 2 && s == sentences / 2 {
                    t.push_str("The access code for the north gate is 4729. ");
                }
            }
            t
        })
        .collect()
}

fn job(docs: &[String]) -> serde_json::Value {
    serde_json::json!({ "documents": docs, "query": "What is the access code for the north gate?", "max_tokens": 8 })
}

fn json(r: &http::Response) -> serde_json::Value {
    serde_json::from_slice(&r.body).unwrap_or_else(|e| panic!("{e}: {}", r.text()))
}

fn error_kind(r: &http::Response) -> String {
    json(r)["error"]["kind"].as_str().unwrap_or_default().to_string()
}

/// Writes `head` (and `body`) on a raw connection, leaving it open.
fn raw(addr: &str, head: &str, body: &[u8]) -> TcpStream {
    let mut c = TcpStream::connect(addr).unwrap();
    c.write_all(head.as_bytes()).unwrap();
    c.write_all(body).unwrap();
    c
}

/// Reads whatever the server answers on `c` (until it closes, or `limit`).
fn read_answer(c: &mut TcpStream, limit: Duration) -> (String, Duration) {
    let t = Instant::now();
    c.set_read_timeout(Some(limit)).unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match c.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
        if t.elapsed() >= limit {
            break;
        }
    }
    (String::from_utf8_lossy(&out).into_owned(), t.elapsed())
}

#[test]
fn item1_a_deadline_too_large_for_a_duration_gets_an_answer() {
    let s = start(ServeConfig::default(), 1, None);
    let mut body = job(&docs(3, 6, "one"));
    body["deadline_s"] = 1e20.into();
    let r = s.post("/v1/jobs", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(json(&r)["answer"].as_str().is_some_and(|a| !a.is_empty()));
}

/// Ranks that fail for good (rank 0 stuck, and ranks that cannot be rebuilt, as under MPI):
/// the job that met the failure and the jobs waiting behind it are all answered 503
/// `rank_failure` with the reason. The waiting ones were left unanswered (no executor was left
/// to take them) until the stopping server closed their connections.
#[test]
fn jobs_waiting_when_the_ranks_fail_for_good_get_503_with_the_reason() {
    // The watchdog's 503 comes at the deadline + hang_grace; the handler's own 504 at the
    // deadline + 2 s: 200 ms leaves the watchdog a wide margin on a loaded machine.
    let cfg = ServeConfig { hang_grace: Duration::from_millis(200), ..ServeConfig::default() };
    // Stuck at the first step of the job, so that its 1 s deadline always passes during the
    // hang: stuck at the probe, a loaded CI machine (2026-11-29) took longer than 1 s over the
    // chunk prefill before it, and the job was answered 504 `deadline`.
    let s = start_with(cfg, 2, Some(FaultPlan::new(0, "chunk_prefill", FaultMode::Hang)), false);
    let d = docs(3, 6, "fatal");
    let addr = s.addr.clone();
    let answers: Vec<http::Response> = std::thread::scope(|sc| {
        let posts: Vec<_> = (0..3u64)
            .map(|i| {
                let mut body = job(&d);
                body["deadline_s"] = 1.0.into();
                let (addr, body) = (addr.clone(), body.to_string());
                sc.spawn(move || {
                    // The first job computes; the others wait behind it.
                    std::thread::sleep(Duration::from_millis(40 * i));
                    let h = [("Content-Type", "application/json")];
                    http::request(&addr, "POST", "/v1/jobs", &h, body.as_bytes(), Duration::from_secs(300))
                        .expect("an answer")
                })
            })
            .collect();
        posts.into_iter().map(|p| p.join().expect("a client thread")).collect()
    });
    for (i, r) in answers.iter().enumerate() {
        assert_eq!((r.status, error_kind(r).as_str()), (503, "rank_failure"), "job {i}: {}", r.text());
        assert!(r.text().contains("stuck"), "job {i} names the failure: {}", r.text());
    }
    let (_, served) = s.stop();
    assert!(served.is_err(), "the service stops when its ranks cannot be rebuilt");
}

#[test]
fn item2_a_panic_on_rank_0_fails_that_job_and_the_service_recovers() {
    for ranks in [1, 2] {
        let s = start(ServeConfig::default(), ranks, Some(FaultPlan::new(0, "probe", FaultMode::Panic)));
        let d = docs(3, 6, "two");
        let r = s.post("/v1/jobs", &job(&d));
        assert_eq!(r.status, 500, "{}", r.text());
        assert!(r.text().contains("rank 0 panicked"), "{}", r.text());
        let ready = s.ready();
        assert_eq!(ready["ready"], true, "ranks rebuilt: {ready}");
        assert_eq!(ready["ranks_up"], ranks);
        let r = s.post("/v1/jobs", &job(&d));
        assert_eq!(r.status, 200, "the next job runs on the rebuilt ranks: {}", r.text());
    }
}

#[test]
fn item3_deadlines_and_disconnects_stop_the_prefill_on_every_rank() {
    let s = start(ServeConfig::default(), 2, None);
    let small = job(&docs(2, 4, "small"));
    // A long job (about 6000 context tokens), uncancelled: what a client would wait behind.
    let t = Instant::now();
    let r = s.post("/v1/jobs", &job(&docs(60, 4, "full")));
    assert_eq!(r.status, 200, "{}", r.text());
    let full = t.elapsed();

    // The same size with a 1 s deadline: answered as a deadline that stopped the chunk
    // prefill, and the ranks are free right after it.
    let mut body = job(&docs(60, 4, "deadline"));
    body["deadline_s"] = 1.0.into();
    let t = Instant::now();
    let r = s.post("/v1/jobs", &body);
    assert_eq!(r.status, 504, "{}", r.text());
    assert!(r.text().contains("during chunk_prefill"), "the ranks stopped between layers: {}", r.text());
    let answered = t.elapsed();
    let t = Instant::now();
    assert_eq!(s.post("/v1/jobs", &small).status, 200);
    let next = t.elapsed();
    assert!(
        answered + next < full / 2,
        "deadline answered after {answered:?}, next job {next:?}; the uncancelled job takes {full:?}"
    );

    // A client that hangs up during the prefill: the next job does not wait for the abandoned one.
    let payload = job(&docs(60, 4, "gone")).to_string();
    let head = format!("POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n", payload.len());
    let c = raw(&s.addr, &head, payload.as_bytes());
    std::thread::sleep(Duration::from_millis(600));
    drop(c);
    let t = Instant::now();
    let mut small2 = small.clone();
    small2["query"] = "Which tower is mentioned first?".into();
    assert_eq!(s.post("/v1/jobs", &small2).status, 200);
    let next = t.elapsed();
    assert!(next < full / 2, "the next job took {next:?}; the abandoned job alone takes {full:?}");

    // Requests over the cost bounds are refused before they are queued: thousands of one-token
    // chunks, more context tokens than the server takes.
    let tiny = serde_json::json!({ "text": "word ".repeat(3000), "chunk_tokens": 1, "query": "q?" });
    let r = s.post("/v1/jobs", &tiny);
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("at most 256"), "{}", r.text());
}

#[test]
fn item4_an_empty_token_does_not_turn_authentication_off() {
    let lm = lm();
    let (world, _) = Service::thread_world(lm.clone(), 1, Duration::from_secs(5), None, None).unwrap();
    let cfg = ServeConfig { token: Some(String::new()), ..ServeConfig::default() };
    let e = Service::start(lm, world, None, cfg).err().expect("an empty token is refused");
    assert!(e.to_string().contains("empty"), "{e}");
    // The command refuses it before loading anything, from the flag and from the environment.
    let bin = env!("CARGO_BIN_EXE_flowprefill");
    for (args, env) in [(vec!["--token", ""], None), (vec![], Some(""))] {
        let mut c = std::process::Command::new(bin);
        c.args(["serve", "--listen", "0.0.0.0:0"]).args(&args);
        if let Some(v) = env {
            c.env("FLOWPREFILL_TOKEN", v);
        }
        let out = c.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "a usage error: {err}");
        assert!(err.contains("empty"), "{err}");
    }
}

#[test]
fn item5_the_token_is_checked_before_the_body_is_read_and_slow_bodies_time_out() {
    let cfg =
        ServeConfig { token: Some("s3cret".into()), read_timeout: Duration::from_secs(1), ..ServeConfig::default() };
    let s = start(cfg, 1, None);
    // Headers announcing 8 MB and no token: 401 at once, nothing of the body read or buffered.
    let mut c = raw(&s.addr, "POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 8000000\r\n\r\n", b"");
    let (answer, took) = read_answer(&mut c, Duration::from_secs(10));
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    // With the token, a body that stalls halfway gets 408 after the read timeout.
    let mut c = raw(
        &s.addr,
        "POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\nContent-Length: 1000\r\n\r\n",
        &[b' '; 400],
    );
    let (answer, took) = read_answer(&mut c, Duration::from_secs(20));
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(took < Duration::from_secs(10), "{took:?}");
    // Headers that never end: the connection is closed after the read timeout.
    let mut c = raw(&s.addr, "POST /v1/jobs HTTP/1.1\r\nHost: x\r\n", b"");
    let (_, took) = read_answer(&mut c, Duration::from_secs(20));
    assert!(took < Duration::from_secs(10), "{took:?}");
}

#[test]
fn item6_a_half_sent_request_does_not_hold_the_shutdown() {
    let cfg = ServeConfig {
        read_timeout: Duration::from_secs(60),
        shutdown_grace: Duration::from_secs(1),
        ..ServeConfig::default()
    };
    let s = start(cfg, 1, None);
    let _c = raw(&s.addr, "POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n", &[b'{'; 300]);
    std::thread::sleep(Duration::from_millis(300));
    let (took, served) = s.stop();
    served.unwrap();
    assert!(took < Duration::from_secs(10), "serve returned {took:?} after the shutdown signal");
}

#[test]
fn item7_chat_refuses_options_it_would_ignore() {
    let s = start(ServeConfig::default(), 1, None);
    let d = docs(2, 3, "chat");
    let content = format!("{}\n---\n{}\n---\nWhat is the access code for the north gate?", d[0], d[1]);
    let base = serde_json::json!({ "messages": [{"role": "user", "content": content}], "max_tokens": 8 });
    for (field, value) in [
        ("n", serde_json::json!(3)),
        ("stop", serde_json::json!(["\n"])),
        ("tools", serde_json::json!([{"type": "function", "function": {"name": "f"}}])),
        ("logprobs", serde_json::json!(true)),
        ("frobnicate", serde_json::json!(1)),
    ] {
        let mut b = base.clone();
        b[field] = value;
        let r = s.post("/v1/chat/completions", &b);
        assert_eq!(r.status, 400, "{field}: {}", r.text());
        assert!(r.text().contains(field), "{field}: {}", r.text());
    }
    let r = s.post("/v1/chat/completions", &base);
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn item8_errors_found_before_the_work_get_their_own_status_when_streaming() {
    let s = start(ServeConfig::default(), 1, None);
    let d = docs(3, 4, "eight");
    for stream in [false, true] {
        let mut b = job(&d);
        b["stream"] = stream.into();
        b["score_layers"] = serde_json::json!([28, 35]);
        let r = s.post("/v1/jobs", &b);
        assert_eq!(r.status, 400, "stream={stream}: {}", r.text());
        assert!(r.text().contains("field `score_layers`: 28-35: the model has layers 0-29"), "{}", r.text());
    }
    // A deadline that passes while the job waits in the queue is a 504, not a 200 with an
    // error event: a longer job occupies the ranks meanwhile.
    let (addr, busy) = (s.addr.clone(), job(&docs(30, 4, "busy")).to_string());
    let first = std::thread::spawn(move || {
        http::request(&addr, "POST", "/v1/jobs", &[], busy.as_bytes(), Duration::from_secs(300)).unwrap().status
    });
    // Once the longer job is in flight (a sleep here was a guess at a loaded machine's pace).
    let t = Instant::now();
    while !s.req("GET", "/metrics", &[], b"").text().contains("flowprefill_jobs_in_flight 1") {
        assert!(t.elapsed() < Duration::from_secs(60), "the longer job never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut b = job(&d);
    b["stream"] = true.into();
    b["deadline_s"] = 0.2.into();
    let r = s.post("/v1/jobs", &b);
    assert_eq!(r.status, 504, "{}", r.text());
    assert_eq!(error_kind(&r), "deadline");
    assert_eq!(first.join().unwrap(), 200);
    // A streamed job that runs: events, then the result.
    b["deadline_s"] = 60.0.into();
    let r = s.post("/v1/jobs", &b);
    assert_eq!(r.status, 200);
    assert!(r.text().contains("event: done"), "{}", r.text());
}

#[test]
fn item9_small_things() {
    let s = start(ServeConfig { token: Some("s3cret".into()), ..ServeConfig::default() }, 1, None);
    let body = job(&docs(2, 3, "nine")).to_string();
    let post = |auth: &str, body: &[u8]| s.req("POST", "/v1/jobs", &[("Authorization", auth)], body);
    // The scheme is case-insensitive (RFC 7235).
    assert_eq!(post("bearer s3cret", body.as_bytes()).status, 200);
    assert_eq!(post("BEARER  s3cret", body.as_bytes()).status, 200);
    assert_eq!(post("Basic s3cret", body.as_bytes()).status, 401);
    // API errors name JSON fields, never command-line flags.
    for (bad, field) in [
        (r#"{"documents": ["a"], "query": "q", "ratio": 2}"#, "field `ratio`"),
        (r#"{"documents": ["a", " "], "query": "q"}"#, "field `documents[1]`"),
        (r#"{"documents": ["a"], "query": " "}"#, "field `query`"),
    ] {
        let r = post("Bearer s3cret", bad.as_bytes());
        assert_eq!(r.status, 400, "{}", r.text());
        assert!(r.text().contains(field) && !r.text().contains("--"), "{}", r.text());
    }
    // A JSON array is not a job.
    let r = post("Bearer s3cret", br#"[["a"], null, null, "q"]"#);
    assert_eq!(r.status, 400, "{}", r.text());
    // /metrics is behind the token too.
    assert_eq!(s.req("GET", "/metrics", &[], b"").status, 401);
    assert_eq!(s.req("GET", "/metrics", &[("Authorization", "Bearer s3cret")], b"").status, 200);
    drop(s);

    let bin = env!("CARGO_BIN_EXE_flowprefill");
    // --help does not print the token from the environment.
    let out = std::process::Command::new(bin)
        .args(["serve", "--help"])
        .env("FLOWPREFILL_TOKEN", "t0ps3cret")
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(!String::from_utf8_lossy(&out.stdout).contains("t0ps3cret"));
    // A public metrics address needs a token like the main one.
    let out = std::process::Command::new(bin).args(["serve", "--metrics-listen", "0.0.0.0:0"]).output().unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--metrics-listen"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A metrics port in use: an error at start that names the flag, before the service says
    // it serves (a client reading "serving on" would find no metrics).
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let out = std::process::Command::new(bin)
        .args(["serve", "--listen", "127.0.0.1:0", "--metrics-listen", &format!("127.0.0.1:{port}")])
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success() && stderr.contains("pass another --metrics-listen"), "{stderr}");
    assert!(!stdout.contains("serving on"), "{stdout}");
    drop(taken);
    let out = std::process::Command::new(bin).args(["serve", "--max-connections", "0"]).output().unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--max-connections must be"));
    // Logs written to a file carry no terminal colour codes.
    let out = std::process::Command::new(bin)
        .args(["generate", "--model", "/nonexistent/m.gguf", "--prompt", "hi"])
        .env("FLOWPREFILL_LOG", "info")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("loading the model"), "{err}");
    assert!(!err.contains('\u{1b}'), "ANSI codes in a log file: {err:?}");
    // A model that cannot be loaded is a model error: exit code 3.
    assert_eq!(out.status.code(), Some(3), "{err}");
}
