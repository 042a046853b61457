//! `flowprefill bench ...`: throughput and TTFT studies.

mod stream;
mod ttft;

use crate::{rss, Common};
use anyhow::Result;
use flowprefill_lab::corpus;
use flowprefill_worker::generate::{prefill_into, DEFAULT_PREFILL_CHUNK};
use flowprefill_worker::kv::{KeyForm, KvCache};
use flowprefill_worker::model::OpTimes;
use flowprefill_worker::Backend;
use std::time::Instant;
pub use ttft::TtftArgs;

/// Benchmarks.
#[derive(clap::Subcommand, Debug)]
pub enum Bench {
    /// Full prefill of generated English prose at several lengths: tokens/s, spread, peak RSS,
    /// and where the time goes.
    Prefill(PrefillArgs),
    /// TTFT against context length per method and rank count: a CSV, a PNG plot and speedups.
    Ttft(TtftArgs),
    /// A stream of questions over a corpus with Zipf-distributed document popularity: chunk-store
    /// hit rate and TTFT with positional against cache-aware placement (`--slack 0,0.1`).
    Stream(stream::StreamArgs),
    /// Concurrent clients against a `serve` process: latency percentiles, throughput,
    /// failures by kind, server memory over time.
    Load(LoadArgs),
    /// PROJECTED TTFT for hardware we do not have (a device and link profile, the engine's own
    /// work accounting): table, CSV and plots per method, rank count and length.
    Project(super::project::ProjectArgs),
    /// Measures this machine's GEMM and attention rates, memory bandwidth and links into a
    /// `cpu-local` profile for `bench project` and `bench ttft --project`.
    Calibrate(super::calibrate::CalibrateArgs),
    /// The network study's report: the `bench ttft` runs `scripts/network-study.sh` made across
    /// hosts at each link rate, with the projection for the same link, as a table, a CSV and a
    /// chart of TTFT against link rate (`network.md`, `network.csv`, `network.png` in DIR).
    Network(NetworkArgs),
    /// Decoding speed and the context's KV bytes with and without KV eviction before decoding
    /// (`--evict none,snapkv,lookahead --kv-budget 64,128,512`): medians and a CSV.
    Decode(super::decode_bench::Args),
    /// The service's fault matrix: every injected fault (panic, hang, exit on each rank and
    /// phase; client disconnects; deadlines) against what a client sees.
    Faults(super::faults::Args),
}

/// Arguments of `bench load`.
#[derive(clap::Args, Debug)]
pub struct LoadArgs {
    /// Concurrent clients.
    #[arg(long, default_value_t = 4)]
    pub clients: usize,
    /// Seconds to keep issuing jobs (jobs in flight are then awaited).
    #[arg(long, default_value_t = 60.0)]
    pub duration: f64,
    /// Upper bound of jobs issued in total.
    #[arg(long, default_value_t = 1000)]
    pub max_jobs: usize,
    /// Context tokens per job.
    #[arg(long, default_value_t = 2048)]
    pub doc_tokens: usize,
    /// Distinct document sets the jobs draw from (chunk caches are reused across jobs).
    #[arg(long, default_value_t = 4)]
    pub doc_sets: usize,
    /// Method of every job, as `run --method` writes it (`NAME[+reorder][@RATIO]`).
    #[arg(long, default_value = "infoflow")]
    pub method: flowprefill_coordinator::MethodSpec,
    /// Answer tokens per job.
    #[arg(long, default_value_t = 16)]
    pub max_tokens: usize,
    /// Target an already running server (host:port) instead of starting one.
    #[arg(long)]
    pub url: Option<String>,
    /// Thread ranks of the started server.
    #[arg(long, default_value_t = 1)]
    pub ranks: usize,
    /// Queue capacity of the started server.
    #[arg(long, default_value_t = 16)]
    pub queue: usize,
}

/// Arguments of `bench network`.
#[derive(clap::Args, Debug)]
pub struct NetworkArgs {
    /// The study's folder (what `scripts/network-study.sh DIR` wrote).
    pub dir: std::path::PathBuf,
}

/// Arguments of `bench prefill`.
#[derive(clap::Args, Debug)]
pub struct PrefillArgs {
    /// Prompt lengths in tokens, comma-separated.
    #[arg(long, default_value = "512,2048,8000", value_parser = super::parse_list::<usize>)]
    pub tokens: Vec<Vec<usize>>,
    /// Timed runs per length (after one warm-up run).
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// Tokens per prefill forward.
    #[arg(long, default_value_t = DEFAULT_PREFILL_CHUNK)]
    pub prefill_chunk: usize,
    /// Seed of the generated text.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Runs a benchmark.
pub fn run(common: &Common, bench: Bench) -> Result<()> {
    match bench {
        Bench::Prefill(a) => prefill(common, a),
        Bench::Ttft(a) => ttft::run(common, a),
        Bench::Stream(a) => stream::run(common, a),
        Bench::Load(a) => load(common, a),
        Bench::Faults(a) => super::faults::run(common, a),
        Bench::Decode(a) => super::decode_bench::run(common, a),
        Bench::Project(a) => super::project::run_project(common, a),
        Bench::Calibrate(a) => super::calibrate::run_calibrate(common, a),
        Bench::Network(a) => {
            let w = flowprefill_lab::network::report(&a.dir)?;
            print!("{}", w.table);
            println!("wrote {}", w.files.join(", "));
            Ok(())
        }
    }
}

/// The median (the lab's).
pub(super) use flowprefill_lab::median;

fn prefill(common: &Common, a: PrefillArgs) -> Result<()> {
    let lengths: Vec<usize> = a.tokens.concat();
    crate::ensure_usage!(!lengths.is_empty(), "--tokens needs at least one length");
    crate::ensure_usage!(a.runs >= 1, "--runs must be at least 1");
    let lm = super::load_model(common)?;
    let model = &lm.model;
    let cfg = model.config();
    let max_len = *lengths.iter().max().unwrap_or(&0);
    crate::ensure_usage!(
        max_len <= cfg.context_length,
        "--tokens {max_len} exceeds the model's context window of {} tokens",
        cfg.context_length
    );
    crate::ensure_usage!(lengths.iter().all(|&n| n > 0), "--tokens lengths must be positive");
    // Enough prose for the longest length (about 4 characters per token).
    let text = corpus::prose(a.seed, max_len * 6);
    let all_ids = lm.tokenizer.encode_text(&text)?;
    anyhow::ensure!(all_ids.len() >= max_len, "generated text has only {} tokens", all_ids.len());
    let threads = rayon::current_num_threads();
    let simd = format!("{:?}", flowprefill_kernels::simd::level());
    if !a.json {
        println!(
            "full prefill on {} ({} KV cache), {} threads, SIMD {simd}, {} timed runs per length (+1 warm-up)",
            common.device,
            model.backend().kv_dtype(),
            threads,
            a.runs
        );
        println!(
            "{:>7} {:>10} {:>10} {:>10} {:>9} {:>9} | {:>7} {:>7} {:>7} {:>7}",
            "tokens", "median s", "min s", "max s", "tok/s", "peak MB", "matmul", "attn", "norm+rope", "other"
        );
    }
    let mut results = Vec::new();
    for &n in &lengths {
        let reset_ok = rss::reset_peak();
        let (times, prof) = time_prefills(&lm, &all_ids[..n], a.runs, a.prefill_chunk)?;
        let peak = rss::peak_mb().unwrap_or(f64::NAN);
        let (min, max) = times.iter().fold((f64::MAX, 0f64), |(lo, hi), &t| (lo.min(t), hi.max(t)));
        let med = median(&mut times.clone());
        let total = prof.total_s().max(1e-12);
        let pct = |x: f64| 100.0 * x / total;
        if !a.json {
            println!(
                "{:>7} {:>10.3} {:>10.3} {:>10.3} {:>9.1} {:>9.0} | {:>6.1}% {:>6.1}% {:>8.1}% {:>6.1}%",
                n,
                med,
                min,
                max,
                n as f64 / med,
                peak,
                pct(prof.matmul_s),
                pct(prof.attention_s),
                pct(prof.norm_rope_s),
                pct(prof.elementwise_s + prof.logits_s)
            );
        }
        results.push(serde_json::json!({
            "tokens": n,
            "runs": a.runs,
            "median_s": med,
            "min_s": min,
            "max_s": max,
            "times_s": times,
            "tok_per_s": n as f64 / med,
            "peak_rss_mb": peak,
            "peak_rss_since_start": !reset_ok,
            "breakdown_s": prof,
        }));
    }
    if a.json {
        let obj = serde_json::json!({
            "bench": "prefill",
            "model": cfg.name,
            "threads": threads,
            "simd": simd,
            "prefill_chunk": a.prefill_chunk,
            "results": results,
        });
        println!("{}", serde_json::to_string_pretty(&obj)?);
    }
    Ok(())
}

/// Seconds of `runs` full prefills of `ids` (after one warm-up) and their mean op profile.
fn time_prefills<B: Backend>(
    lm: &flowprefill_worker::LoadedModel<B>,
    ids: &[u32],
    runs: usize,
    piece: usize,
) -> Result<(Vec<f64>, OpTimes)> {
    let model = &lm.model;
    let cfg = model.config();
    let mut times = Vec::with_capacity(runs);
    let mut prof = OpTimes::default();
    for run in 0..=runs {
        let mut cache = KvCache::new(model.backend(), cfg.n_layers, cfg.kv_dim(), KeyForm::Rotated)?;
        model.profile().reset();
        let t = Instant::now();
        let logits = prefill_into(model, &mut cache, ids, 0, piece)?;
        let dt = t.elapsed().as_secs_f64();
        anyhow::ensure!(logits.iter().all(|x| x.is_finite()), "non-finite logits at {} tokens", ids.len());
        if run > 0 {
            times.push(dt);
            let p = model.op_times()?;
            prof.matmul_s += p.matmul_s / runs as f64;
            prof.attention_s += p.attention_s / runs as f64;
            prof.norm_rope_s += p.norm_rope_s / runs as f64;
            prof.elementwise_s += p.elementwise_s / runs as f64;
            prof.logits_s += p.logits_s / runs as f64;
        }
    }
    Ok((times, prof))
}

/// Documents of about `doc_tokens` tokens each, about `total` tokens in all, with a needle. A
/// tokenizer error is the command's error (it once became empty documents, timed as if real).
pub(super) fn bench_docs(
    tok: &flowprefill_worker::tokenizer::Tokenizer,
    total: usize,
    doc_tokens: usize,
    seed: u64,
) -> flowprefill_worker::Result<Vec<String>> {
    docs_from(|t| tok.encode_text(t), |ids| tok.decode(ids), total, doc_tokens, seed)
}

/// [`bench_docs`] with the tokenizer's two functions given apart (so that a test can fail them).
fn docs_from<E>(
    encode: impl FnOnce(&str) -> std::result::Result<Vec<u32>, E>,
    decode: impl Fn(&[u32]) -> std::result::Result<String, E>,
    total: usize,
    doc_tokens: usize,
    seed: u64,
) -> std::result::Result<Vec<String>, E> {
    let n_docs = total.div_ceil(doc_tokens.max(1)).max(1);
    let text = corpus::prose(seed, total * 6);
    let ids = encode(&text)?;
    let per = total / n_docs;
    (0..n_docs)
        .map(|i| {
            let piece = &ids[(i * per).min(ids.len())..((i + 1) * per).min(ids.len())];
            let mut d = decode(piece)?;
            if i == n_docs / 2 {
                d.push_str(" The access code for the north gate is 4729.");
            }
            Ok(d)
        })
        .collect()
}

fn status_kb(pid: u32, key: &str) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = s.lines().find(|l| l.starts_with(key))?;
    line[key.len()..].trim().trim_end_matches("kB").trim().parse::<f64>().ok().map(|kb| kb / 1024.0)
}

/// One answered (or lost) request of `bench load`: seconds, HTTP status (0: no response), kind.
type Outcome = (f64, u16, String);

/// Job bodies of `bench load`: document sets of about --doc-tokens tokens each.
fn load_bodies(common: &Common, a: &LoadArgs) -> Result<Vec<Vec<u8>>> {
    let tok_lm = flowprefill_worker::LoadedModel::load(&super::tokenizer_path(common)?, flowprefill_worker::Cpu)?;
    (0..a.doc_sets)
        .map(|i| {
            let docs = bench_docs(&tok_lm.tokenizer, a.doc_tokens, 256, 100 + i as u64)?;
            // The ratio is the method's (`NAME@RATIO`), else the service's default.
            Ok(serde_json::to_vec(&serde_json::json!({
                "documents": docs, "query": "What is the access code for the north gate?",
                "method": a.method, "max_tokens": a.max_tokens,
            }))?)
        })
        .collect()
}

/// One client's request and what came back.
fn load_request(addr: &str, body: &[u8]) -> (Outcome, Option<f64>) {
    let t = Instant::now();
    let r = flowprefill_lab::http::request(
        addr,
        "POST",
        "/v1/jobs",
        &[("Content-Type", "application/json")],
        body,
        std::time::Duration::from_secs(3600),
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

/// --clients threads issuing the bodies in turn until --duration or --max-jobs, while the
/// server's RSS is sampled every 0.5 s; the outcomes, the wall time and the RSS samples.
fn drive_load(
    a: &LoadArgs,
    addr: &str,
    bodies: Vec<Vec<u8>>,
    pid: Option<u32>,
) -> (Vec<Outcome>, f64, Vec<(f64, f64)>) {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    let bodies = Arc::new(bodies);
    let issued = Arc::new(AtomicUsize::new(0));
    let results: Arc<Mutex<Vec<Outcome>>> = Arc::new(Mutex::new(Vec::new()));
    let rss: Arc<Mutex<Vec<(f64, f64)>>> = Arc::new(Mutex::new(Vec::new()));
    let t0 = Instant::now();
    let stop_at = t0 + std::time::Duration::from_secs_f64(a.duration);
    let done = Arc::new(AtomicBool::new(false));
    let sampler = pid.map(|p| {
        let (rss, done) = (rss.clone(), done.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                if let Some(mb) = status_kb(p, "VmRSS:") {
                    rss.lock().unwrap_or_else(|e| e.into_inner()).push((t0.elapsed().as_secs_f64(), mb));
                }
                std::thread::sleep(std::time::Duration::from_millis(500));
            }
        })
    });
    let clients: Vec<_> = (0..a.clients)
        .map(|c| {
            let (addr, bodies, issued, results) = (addr.to_string(), bodies.clone(), issued.clone(), results.clone());
            let max_jobs = a.max_jobs;
            std::thread::spawn(move || loop {
                let n = issued.fetch_add(1, Ordering::Relaxed);
                if Instant::now() >= stop_at || n >= max_jobs {
                    return;
                }
                let (outcome, retry) = load_request(&addr, &bodies[(n + c) % bodies.len()]);
                results.lock().unwrap_or_else(|e| e.into_inner()).push(outcome);
                if let Some(s) = retry {
                    // A well-behaved client waits as told before trying again.
                    std::thread::sleep(std::time::Duration::from_secs_f64(s.min(5.0)));
                }
            })
        })
        .collect();
    for c in clients {
        let _ = c.join();
    }
    let wall = t0.elapsed().as_secs_f64();
    done.store(true, Ordering::Relaxed);
    if let Some(s) = sampler {
        let _ = s.join();
    }
    let results = results.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let rss = rss.lock().unwrap_or_else(|e| e.into_inner()).clone();
    (results, wall, rss)
}

fn load(common: &Common, a: LoadArgs) -> Result<()> {
    crate::ensure_usage!(
        a.clients >= 1 && a.duration > 0.0 && a.doc_sets >= 1,
        "give --clients >= 1, --duration > 0, --doc-sets >= 1"
    );
    // The server: started here as a child process (so its memory is measured), or given.
    let mut child = None;
    let addr = match &a.url {
        Some(u) => u.trim_start_matches("http://").trim_end_matches('/').to_string(),
        None => {
            let (ranks, queue) = (a.ranks.to_string(), a.queue.to_string());
            let s = super::faults::spawn_server(common, &["--ranks", &ranks, "--queue", &queue], &[], None)?;
            let addr = s.addr.clone();
            child = Some(s);
            addr
        }
    };
    let pid = child.as_ref().map(|c| c.id());
    let bodies = load_bodies(common, &a)?;
    let (results, wall, rss) = drive_load(&a, &addr, bodies, pid);
    let peak = pid.and_then(|p| status_kb(p, "VmHWM:"));
    if let Some(c) = child {
        c.stop("-TERM", std::time::Duration::from_secs(60));
    }
    load_report(&a, &results, wall, &rss, peak)
}

/// Latency percentiles, throughput, outcomes and the server's memory over the run.
fn load_report(a: &LoadArgs, results: &[Outcome], wall: f64, rss: &[(f64, f64)], peak: Option<f64>) -> Result<()> {
    let ok: Vec<f64> = results.iter().filter(|r| r.1 == 200).map(|r| r.0).collect();
    let mut by_kind: std::collections::BTreeMap<String, usize> = std::collections::BTreeMap::new();
    for r in results {
        *by_kind.entry(r.2.clone()).or_default() += 1;
    }
    let pctl = |v: &[f64], q: f64| -> f64 {
        if v.is_empty() {
            return f64::NAN;
        }
        let mut s = v.to_vec();
        s.sort_by(|a, b| a.total_cmp(b));
        s[((q * (s.len() - 1) as f64).round() as usize).min(s.len() - 1)]
    };
    println!(
        "load: {} clients, {:.0} s issuing + drain ({:.1} s wall), {} requests, {} ok",
        a.clients,
        a.duration,
        wall,
        results.len(),
        ok.len()
    );
    println!(
        "latency of ok jobs: p50 {:.2} s  p90 {:.2} s  p99 {:.2} s  max {:.2} s;  throughput {:.3} jobs/s",
        pctl(&ok, 0.5),
        pctl(&ok, 0.9),
        pctl(&ok, 0.99),
        pctl(&ok, 1.0),
        ok.len() as f64 / wall
    );
    println!("outcomes: {by_kind:?}");
    let lost = results.iter().filter(|r| r.1 == 0).count();
    println!("lost (no response at all): {lost}");
    if let (Some(first), Some(last)) = (rss.first(), rss.last()) {
        let (lo, hi) = rss.iter().fold((f64::MAX, 0f64), |(lo, hi), r| (lo.min(r.1), hi.max(r.1)));
        // Memory after warm-up: the first third of the run fills the chunk store.
        let settled: Vec<f64> = rss.iter().filter(|r| r.0 > wall / 3.0).map(|r| r.1).collect();
        let (slo, shi) = settled.iter().fold((f64::MAX, 0f64), |(lo, hi), &r| (lo.min(r), hi.max(r)));
        println!(
            "server RSS: first {:.0} MB, last {:.0} MB, min {:.0}, max {:.0}; after warm-up {:.0}..{:.0} MB; peak (VmHWM) {:.0} MB",
            first.1,
            last.1,
            lo,
            hi,
            slo,
            shi,
            peak.unwrap_or(f64::NAN)
        );
    }
    anyhow::ensure!(lost == 0, "{lost} requests got no response");
    Ok(())
}

#[cfg(test)]
mod docs_tests {
    use super::docs_from;

    #[test]
    fn a_tokenizer_error_is_an_error_not_empty_documents() {
        let encode = |t: &str| Ok::<_, String>(t.split_whitespace().map(|w| w.len() as u32).collect());
        let decode = |ids: &[u32]| Ok::<_, String>(ids.iter().map(|i| format!("w{i} ")).collect());
        let docs = docs_from(encode, decode, 400, 100, 3).expect("a working tokenizer");
        assert_eq!(docs.len(), 4);
        assert!(docs.iter().all(|d| !d.is_empty()) && docs[2].contains("north gate is 4729"));
        let e = docs_from(|_: &str| Err("encode failed".to_string()), decode, 400, 100, 3).unwrap_err();
        assert_eq!(e, "encode failed");
        let e = docs_from(encode, |_: &[u32]| Err::<String, _>("decode failed".to_string()), 400, 100, 3).unwrap_err();
        assert_eq!(e, "decode failed");
    }
}
