//! `bench load`: concurrent clients against a `serve` process: latency percentiles,
//! throughput, failures by kind, server memory over time.

use crate::Result;
use std::time::{Duration, Instant};

/// One answered (or lost) request: seconds, HTTP status (0: no response), kind.
pub type Outcome = (f64, u16, String);

/// How the clients drive the server.
#[derive(Clone, Copy, Debug)]
pub struct Drive {
    /// Concurrent clients.
    pub clients: usize,
    /// Seconds to keep issuing jobs.
    pub duration: f64,
    /// Upper bound of jobs issued in total.
    pub max_jobs: usize,
}

/// The clients' runs: every outcome, the wall time, the server's RSS samples (s, MB).
pub struct Driven {
    /// What each request got.
    pub outcomes: Vec<Outcome>,
    /// Seconds from the first request to the last answer.
    pub wall: f64,
    /// Seconds the clients issued jobs: the duration, or less when they were told to stop.
    pub issuing: f64,
    /// The server's RSS over the run: (seconds, MB).
    pub rss: Vec<(f64, f64)>,
    /// The server's peak RSS (VmHWM, MB) at the last sample.
    pub peak: Option<f64>,
}

/// A line of `/proc/PID/status` (e.g. `VmRSS:`) in MB.
pub fn status_mb(pid: u32, key: &str) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = s.lines().find(|l| l.starts_with(key))?;
    line[key.len()..].trim().trim_end_matches("kB").trim().parse::<f64>().ok().map(|kb| kb / 1024.0)
}

/// Job bodies: `sets` document sets of about `doc_tokens` tokens each, asked with `method`.
pub fn bodies(
    tok: &flowprefill_worker::tokenizer::Tokenizer,
    sets: usize,
    doc_tokens: usize,
    method: &flowprefill_coordinator::MethodSpec,
    max_tokens: usize,
) -> Result<Vec<Vec<u8>>> {
    (0..sets)
        .map(|i| {
            let docs = super::bench_docs(tok, doc_tokens, 256, 100 + i as u64)?;
            // The ratio is the method's (`NAME@RATIO`), else the service's default.
            serde_json::to_vec(&serde_json::json!({
                "documents": docs, "query": "What is the access code for the north gate?",
                "method": method, "max_tokens": max_tokens,
            }))
            .map_err(|source| crate::LabError::Json { path: "(job body)".into(), source })
        })
        .collect()
}

/// One client's request and what came back.
fn request(addr: &str, body: &[u8]) -> (Outcome, Option<f64>) {
    let t = Instant::now();
    let r = crate::http::request(
        addr,
        "POST",
        "/v1/jobs",
        &[("Content-Type", "application/json")],
        body,
        Duration::from_secs(3600),
    );
    let secs = t.elapsed().as_secs_f64();
    match r {
        Ok(resp) => {
            let kind = serde_json::from_slice::<serde_json::Value>(&resp.body)
                .ok()
                .and_then(|v| v["error"]["kind"].as_str().map(String::from))
                .unwrap_or_else(|| if resp.status == 200 { "ok".into() } else { format!("http_{}", resp.status) });
            ((secs, resp.status, kind), resp.header("retry-after").and_then(|v| v.parse::<f64>().ok()))
        }
        Err(e) => ((secs, 0, format!("lost ({})", e.kind())), None),
    }
}

/// `d.clients` threads issuing the bodies in turn until the duration, the job bound or `stop`
/// (Ctrl-C: the jobs in flight finish, no new one starts), while the server's (`pid`) RSS is
/// sampled every 0.5 s.
pub fn drive(
    d: Drive,
    addr: &str,
    bodies: Vec<Vec<u8>>,
    pid: Option<u32>,
    stop: &std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> Driven {
    use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    let bodies = Arc::new(bodies);
    let issued = Arc::new(AtomicUsize::new(0));
    let results: Arc<Mutex<Vec<Outcome>>> = Arc::new(Mutex::new(Vec::new()));
    let rss: Arc<Mutex<Vec<(f64, f64)>>> = Arc::new(Mutex::new(Vec::new()));
    let t0 = Instant::now();
    let stop_at = t0 + Duration::from_secs_f64(d.duration);
    let done = Arc::new(AtomicBool::new(false));
    // The last VmHWM sampled, as f64 bits (NaN: none yet).
    let hwm = Arc::new(AtomicU64::new(f64::NAN.to_bits()));
    let sampler = pid.map(|p| {
        let (rss, done, hwm) = (rss.clone(), done.clone(), hwm.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                if let Some(mb) = status_mb(p, "VmRSS:") {
                    rss.lock().unwrap_or_else(|e| e.into_inner()).push((t0.elapsed().as_secs_f64(), mb));
                }
                if let Some(mb) = status_mb(p, "VmHWM:") {
                    hwm.store(mb.to_bits(), Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(500));
            }
        })
    });
    // Milliseconds from the start to the first client that saw `stop`.
    let stopped_ms = Arc::new(AtomicU64::new(u64::MAX));
    let clients: Vec<_> = (0..d.clients)
        .map(|c| {
            let (addr, bodies, issued, results) = (addr.to_string(), bodies.clone(), issued.clone(), results.clone());
            let (stop, stopped_ms) = (stop.clone(), stopped_ms.clone());
            let max_jobs = d.max_jobs;
            std::thread::spawn(move || loop {
                if Instant::now() >= stop_at || issued.load(Ordering::Relaxed) >= max_jobs {
                    return;
                }
                if stop.load(Ordering::Relaxed) {
                    stopped_ms.fetch_min(t0.elapsed().as_millis() as u64, Ordering::Relaxed);
                    return;
                }
                let n = issued.fetch_add(1, Ordering::Relaxed);
                if Instant::now() >= stop_at || n >= max_jobs {
                    return;
                }
                let (outcome, retry) = request(&addr, &bodies[(n + c) % bodies.len()]);
                results.lock().unwrap_or_else(|e| e.into_inner()).push(outcome);
                if let Some(s) = retry {
                    // A well-behaved client waits as told before trying again.
                    std::thread::sleep(Duration::from_secs_f64(s.min(5.0)));
                }
            })
        })
        .collect();
    for c in clients {
        let _ = c.join();
    }
    let wall = t0.elapsed().as_secs_f64();
    let issuing = match stopped_ms.load(Ordering::Relaxed) {
        u64::MAX => d.duration,
        ms => d.duration.min(ms as f64 / 1e3),
    };
    done.store(true, Ordering::Relaxed);
    if let Some(s) = sampler {
        let _ = s.join();
    }
    let outcomes = results.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let rss = rss.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let peak = Some(f64::from_bits(hwm.load(Ordering::Relaxed))).filter(|mb| mb.is_finite());
    Driven { outcomes, wall, issuing, rss, peak }
}

/// The `q` quantile of `v` (NaN when empty).
fn pctl(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    s[((q * (s.len() - 1) as f64).round() as usize).min(s.len() - 1)]
}

/// The report: latency percentiles, throughput, outcomes and the server's memory over the run
/// (lines to print), and the requests that got no response at all.
pub fn report(d: Drive, run: &Driven, peak: Option<f64>) -> (Vec<String>, usize) {
    let (results, wall, rss) = (&run.outcomes, run.wall, &run.rss);
    let ok: Vec<f64> = results.iter().filter(|r| r.1 == 200).map(|r| r.0).collect();
    let mut by_kind: std::collections::BTreeMap<String, usize> = std::collections::BTreeMap::new();
    for r in results {
        *by_kind.entry(r.2.clone()).or_default() += 1;
    }
    let mut lines = vec![
        format!(
            "load: {} clients, {:.0} s issuing{} + drain ({:.1} s wall), {} requests, {} ok",
            d.clients,
            run.issuing,
            if run.issuing < d.duration {
                format!(" (of --duration {:.0}: interrupted)", d.duration)
            } else {
                String::new()
            },
            wall,
            results.len(),
            ok.len()
        ),
        format!(
            "latency of ok jobs: p50 {:.2} s  p90 {:.2} s  p99 {:.2} s  max {:.2} s;  throughput {:.3} jobs/s",
            pctl(&ok, 0.5),
            pctl(&ok, 0.9),
            pctl(&ok, 0.99),
            pctl(&ok, 1.0),
            ok.len() as f64 / wall
        ),
        format!("outcomes: {by_kind:?}"),
    ];
    let lost = results.iter().filter(|r| r.1 == 0).count();
    lines.push(format!("lost (no response at all): {lost}"));
    if let (Some(first), Some(last)) = (rss.first(), rss.last()) {
        let (lo, hi) = rss.iter().fold((f64::MAX, 0f64), |(lo, hi), r| (lo.min(r.1), hi.max(r.1)));
        // Memory after warm-up: the first third of the run fills the chunk store.
        let settled: Vec<f64> = rss.iter().filter(|r| r.0 > wall / 3.0).map(|r| r.1).collect();
        let (slo, shi) = settled.iter().fold((f64::MAX, 0f64), |(lo, hi), &r| (lo.min(r), hi.max(r)));
        lines.push(format!(
            "server RSS: first {:.0} MB, last {:.0} MB, min {:.0}, max {:.0}; after warm-up {:.0}..{:.0} MB; peak (VmHWM) {:.0} MB",
            first.1,
            last.1,
            lo,
            hi,
            slo,
            shi,
            peak.unwrap_or(f64::NAN)
        ));
    }
    (lines, lost)
}
