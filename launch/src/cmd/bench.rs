//! `flowprefill bench ...`: throughput and TTFT studies.

mod stream;
mod ttft;

use crate::{rss, Common};
use anyhow::Result;
use flowprefill_lab::bench::{load as lab_load, prefill as lab_prefill};
use flowprefill_lab::corpus;
use flowprefill_lab::Stop;
use flowprefill_worker::Backend;
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
    /// Tokens per prefill forward (default: the device's, 2048 on the CPU and 8192 on a GPU).
    #[arg(long, value_parser = super::parse_prefill_chunk)]
    pub prefill_chunk: Option<usize>,
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

fn prefill(common: &Common, a: PrefillArgs) -> Result<()> {
    let lengths: Vec<usize> = a.tokens.concat();
    crate::ensure_usage!(!lengths.is_empty(), "--tokens needs at least one length");
    crate::ensure_usage!(a.runs >= 1, "--runs must be at least 1");
    crate::ensure_usage!(lengths.iter().all(|&n| n > 0), "--tokens lengths must be positive");
    // The window from the file's header, before the weights load.
    let window = super::model_config(common)?.context_length;
    let max_len = *lengths.iter().max().unwrap_or(&0);
    crate::ensure_usage!(
        max_len <= window,
        "--tokens {max_len} exceeds the model's context window of {window} tokens; give at most {window}"
    );
    let lm = super::load_model(common)?;
    let model = &lm.model;
    let cfg = model.config();
    // Enough prose for the longest length (about 4 characters per token).
    let text = corpus::prose(a.seed, max_len * 6);
    let all_ids = lm.tokenizer.encode_text(&text)?;
    anyhow::ensure!(all_ids.len() >= max_len, "generated text has only {} tokens", all_ids.len());
    let threads = rayon::current_num_threads();
    let simd = format!("{:?}", flowprefill_kernels::simd::level());
    let chunk = a.prefill_chunk.unwrap_or_else(|| model.backend().prefill_rows());
    if !a.json {
        println!(
            "full prefill on {} ({} KV cache), {} threads, SIMD {simd}, {} timed runs per length (+1 warm-up), \
             forwards of up to {chunk} tokens; build {}",
            common.device,
            model.backend().kv_dtype(),
            threads,
            a.runs,
            crate::BUILD
        );
        println!("{}", lab_prefill::header());
    }
    let mut results = Vec::new();
    // Ctrl-C ends the run in progress and keeps the lengths timed (a length cut short keeps its
    // timed runs); a failure keeps the lengths before it.
    let asked = crate::progress::stop_on_signal("the run in progress");
    let stop = || asked.is_set();
    let (mut stopped, mut done) = (None, 0);
    // With --json nothing reaches stdout before the end: progress on stderr instead.
    let mut progress = a.json.then(|| crate::progress::Progress::new(lengths.len(), "lengths"));
    for (i, &n) in lengths.iter().enumerate() {
        let reset_ok = rss::reset_peak();
        let (times, prof) = match lab_prefill::time_prefills(&lm, &all_ids[..n], a.runs, chunk, &stop) {
            Ok(timed) => timed,
            Err(e) => {
                stopped = Some(Stop::Failed { at: format!("the prefill of {n} tokens"), error: Box::new(e) });
                break;
            }
        };
        let cut = times.len() < a.runs;
        if !times.is_empty() {
            let peak_mb = rss::peak_mb().unwrap_or(f64::NAN);
            let runs = times.len();
            done += usize::from(runs == a.runs);
            let row = lab_prefill::Row { tokens: n, runs, times, prof, peak_mb, peak_since_start: !reset_ok };
            if !a.json {
                println!("{}", row.line());
                if runs < a.runs {
                    println!("  (the row above: {runs} of {} timed runs, stopped)", a.runs);
                }
            }
            results.push(row.json());
            if let Some(p) = &mut progress {
                p.inc(&format!("{n} tokens"));
            }
        }
        // Cut short, or told to stop with lengths left (a signal after the last run stops nothing).
        if cut || (stop() && i + 1 < lengths.len()) {
            stopped = Some(Stop::Asked);
            break;
        }
    }
    if a.json && (!results.is_empty() || stopped.is_none()) {
        let mut obj = serde_json::json!({
            "bench": "prefill",
            "build": crate::BUILD,
            "model": cfg.name,
            "device": common.device.to_string(),
            "kv_dtype": model.backend().kv_dtype().to_string(),
            "threads": threads,
            "simd": simd,
            "prefill_chunk": chunk,
            "results": results,
        });
        if let Some(why) = &stopped {
            obj["stopped"] = why.to_string().into();
            obj["lengths_planned"] = lengths.len().into();
        }
        println!("{}", serde_json::to_string_pretty(&obj)?);
    }
    let shown = !results.is_empty();
    stopped.map_or(Ok(()), |s| Err(crate::progress::stopped(s, done, lengths.len(), "lengths", shown)))
}

/// Job bodies of `bench load`: document sets of about --doc-tokens tokens each.
fn load_bodies(common: &Common, a: &LoadArgs) -> Result<Vec<Vec<u8>>> {
    // The tokenizer alone (not the weights; a synthetic model's may be a tokenizer-only file).
    let file = flowprefill_worker::gguf::GgufFile::open(&super::tokenizer_path(common)?)?;
    let tokenizer = flowprefill_worker::tokenizer::Tokenizer::from_gguf(&file)?;
    Ok(lab_load::bodies(&tokenizer, a.doc_sets, a.doc_tokens, &a.method, a.max_tokens)?)
}

fn load(common: &Common, a: LoadArgs) -> Result<()> {
    crate::ensure_usage!(
        a.clients >= 1 && a.duration > 0.0 && a.doc_sets >= 1,
        "give --clients >= 1, --duration > 0, --doc-sets >= 1"
    );
    crate::ensure_usage!(
        a.max_jobs >= 1 && a.doc_tokens >= 1 && a.max_tokens >= 1,
        "give --max-jobs, --doc-tokens and --max-tokens of at least 1 (0 measures nothing)"
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
    let drive = lab_load::Drive { clients: a.clients, duration: a.duration, max_jobs: a.max_jobs };
    // Ctrl-C: no new job starts, those in flight finish (the server, told too, drains them), and
    // the report is of the jobs so far.
    let asked = crate::progress::stop_on_signal("the jobs in flight");
    if let Some(p) = pid {
        crate::progress::end_with_me(p);
    }
    crate::say!(
        "{} clients driving {addr} for {} s (Ctrl-C stops them and reports the jobs so far)",
        a.clients,
        a.duration
    );
    let driven = lab_load::drive(drive, &addr, bodies, pid, asked.flag());
    // The server's own peak; once it has exited (a Ctrl-C reaches it too), the last one sampled.
    let peak = pid.and_then(|p| lab_load::status_mb(p, "VmHWM:")).or(driven.peak);
    if let Some(c) = child {
        let id = c.id();
        c.stop("-TERM", std::time::Duration::from_secs(60));
        crate::progress::ended(id);
    }
    let (lines, lost) = lab_load::report(drive, &driven, peak);
    for l in lines {
        println!("{l}");
    }
    // Stopped by a signal that reached the server too: a request issued as it stopped may have
    // met it closed (counted as lost above); the interruption is the error then.
    let interrupted = driven.issuing < a.duration;
    anyhow::ensure!(lost == 0 || interrupted, "{lost} requests got no response");
    anyhow::ensure!(
        interrupted || driven.outcomes.is_empty() || driven.outcomes.iter().any(|r| r.1 == 200),
        "no job of {} succeeded (outcomes above): is {addr} a flowprefill server (`flowprefill serve`)?",
        driven.outcomes.len()
    );
    if interrupted {
        return Err(anyhow::Error::new(crate::exit::Interrupted(format!(
            "interrupted after {:.0} s of --duration {} (the report above is of the {} jobs so far)",
            driven.issuing,
            a.duration,
            driven.outcomes.len()
        ))));
    }
    Ok(())
}
