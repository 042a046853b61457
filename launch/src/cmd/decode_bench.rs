//! `flowprefill bench decode`: decoding speed and the context's KV bytes, with and without KV
//! eviction before decoding (`--evict snapkv|lookahead --kv-budget N`).
//!
//! One context and one question with a long answer; every setting (the whole cache, then each
//! policy at each budget) runs `--runs` times, in rounds (all settings once, then again), so a
//! machine's drift spreads over every setting alike. Full prefill with eviction keeps the
//! context's cache in the chunk store, so after the first eviction run the others copy it
//! instead of prefilling again: the bench costs one prefill per run of the whole cache and one
//! in all for the evicting settings. Decoding is what is timed: milliseconds per token after the
//! first, the median of the runs.

use super::bench::median;
use crate::Common;
use anyhow::Result;
use flowprefill_coordinator::{Context, EvictPolicy, Job, MethodSpec, Request, RunOptions, RunResult, World};
use std::path::PathBuf;

/// Arguments of `bench decode`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Context tokens of generated prose (documents of --doc-tokens), unless --doc is given.
    #[arg(long, default_value_t = 4096)]
    pub tokens: usize,
    /// Tokens per generated document (one chunk each).
    #[arg(long, default_value_t = 512)]
    pub doc_tokens: usize,
    /// Documents to use as the context instead of generated prose (repeat the flag).
    #[arg(long = "doc")]
    pub docs: Vec<PathBuf>,
    /// The question; ask for a long answer, so that every setting decodes --max-tokens.
    #[arg(long, default_value = "Write a long, detailed summary of these documents, section by section.")]
    pub query: String,
    /// Eviction settings: none (the whole cache kept), snapkv, lookahead; comma-separated.
    #[arg(long, default_value = "none,snapkv,lookahead")]
    pub evict: String,
    /// Context KV entries kept per (layer, KV head) by each policy; comma-separated.
    #[arg(long, default_value = "64,128,512", value_parser = super::parse_list::<usize>)]
    pub kv_budget: Vec<Vec<usize>>,
    /// Answer tokens at most (decoding also stops at the model's end of turn).
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// Runs per setting; the median is reported.
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// The prefill before decoding: full, or any method (`NAME@RATIO` for its ratio).
    #[arg(long, default_value = "full")]
    pub method: String,
    /// Thread ranks (default 1); under `mpirun` every process of the world is a rank, and
    /// --ranks, if given, must be their number.
    #[arg(long)]
    pub ranks: Option<usize>,
    /// Output folder for decode.csv.
    #[arg(long, default_value = "bench-out")]
    pub out: PathBuf,
}

/// One setting: the eviction, if any.
type Setting = Option<flowprefill_coordinator::Evict>;

/// The settings asked for: the whole cache first (if asked for), then every policy at every
/// budget.
fn settings(a: &Args) -> Result<Vec<Setting>> {
    use clap::ValueEnum;
    let (mut whole, mut policies) = (false, Vec::new());
    for name in a.evict.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        if name == "none" {
            crate::ensure_usage!(!whole, "--evict none is asked for twice");
            whole = true;
            continue;
        }
        let Ok(policy) = EvictPolicy::from_str(name, true) else {
            let names: Vec<String> = EvictPolicy::value_variants().iter().map(ToString::to_string).collect();
            let why = format!("--evict {name}: give none or {} (comma-separated)", names.join(", "));
            return Err(anyhow::Error::new(crate::exit::Usage(why)));
        };
        policies.push(policy);
    }
    let budgets = a.kv_budget.concat();
    crate::ensure_usage!(policies.is_empty() || !budgets.is_empty(), "--evict {} needs --kv-budget N[,N...]", a.evict);
    let evicts = super::evict_grid(&policies, &budgets)?;
    let out: Vec<Setting> = whole.then_some(None).into_iter().chain(evicts.into_iter().map(Some)).collect();
    crate::ensure_usage!(!out.is_empty(), "--evict needs at least one of none, snapkv, lookahead");
    Ok(out)
}

fn label(s: &Setting) -> String {
    s.map_or_else(|| "none".to_string(), |e| format!("{}-{}", e.policy, e.budget))
}

/// The request: the --doc files, or generated prose of about --tokens tokens.
fn request(a: &Args, lm: &flowprefill_worker::LoadedModel<flowprefill_kernels::Device>) -> Result<Request> {
    crate::ensure_usage!(!a.query.trim().is_empty(), "--query is empty; give the question to answer");
    let docs = if a.docs.is_empty() {
        crate::ensure_usage!(a.tokens >= 1 && a.doc_tokens >= 1, "--tokens and --doc-tokens must be at least 1");
        super::bench::bench_docs(&lm.tokenizer, a.tokens, a.doc_tokens, 11)?
    } else {
        let mut docs = Vec::new();
        for p in &a.docs {
            let text = std::fs::read_to_string(p)
                .map_err(|e| anyhow::anyhow!("reading --doc {}: {e}; give a readable text file", p.display()))?;
            crate::ensure_usage!(
                !text.trim().is_empty(),
                "--doc {} is empty; remove it or give it some text",
                p.display()
            );
            docs.push(text);
        }
        docs
    };
    Ok(Request { context: Context::Documents(docs), query: a.query.clone(), system: None, answer_prefix: None })
}

/// One run's measures.
struct Sample {
    decode_ms: f64,
    tokens: usize,
    ttft_ms: f64,
    evict_ms: f64,
    kept: usize,
    kv_bytes: usize,
    cache_hits: u64,
}

/// The measures of a finished run: `full_kv` is the whole context cache's bytes (what a run
/// without eviction keeps).
fn sample(r: &RunResult, full_kv: usize) -> Option<Sample> {
    let decode_ms = super::run::decode_ms_per_token(r)?;
    let ph = |n: &str| r.phases.get(n).as_secs_f64() * 1e3;
    let (kept, kv_bytes) =
        r.eviction.as_ref().map_or((r.n_head_tokens + r.n_context_tokens, full_kv), |e| (e.kept(), e.bytes_after));
    Some(Sample {
        decode_ms,
        tokens: r.tokens.len(),
        ttft_ms: r.ttft.as_secs_f64() * 1e3,
        evict_ms: ph(flowprefill_coordinator::timings::phase::EVICT),
        kept,
        kv_bytes,
        cache_hits: r.cache_hits,
    })
}

/// Runs the benchmark.
pub fn run(common: &Common, a: Args) -> Result<()> {
    crate::ensure_usage!(a.runs >= 1, "--runs must be at least 1");
    crate::ensure_usage!(
        a.max_tokens >= 2,
        "--max-tokens must be at least 2 (decoding is timed after the first token)"
    );
    let ranks = a.ranks.unwrap_or(1);
    crate::ensure_usage!(ranks >= 1, "--ranks must be at least 1");
    let settings = settings(&a)?;
    let specs = MethodSpec::parse_list(&a.method)?;
    crate::ensure_usage!(specs.len() == 1, "--method takes one method, e.g. full or infoflow@0.15");
    let spec = specs[0];
    super::check_thread_world(common, ranks)?;
    let lm = std::sync::Arc::new(super::load_model(common)?);
    let req = request(&a, &lm)?;
    let timeout = std::time::Duration::from_secs(600);
    let mut world = match super::mpi_world(common, &lm, timeout, true)? {
        Some(w) => w,
        None => World::Threads(super::thread_world(common, lm.clone(), ranks, timeout)?),
    };
    if let (Some(size), Some(asked)) = (world.max_ranks(), a.ranks) {
        crate::ensure_usage!(
            asked == size,
            "--ranks {asked} under mpirun -np {size}: leave --ranks out or give {size}"
        );
    }
    let cfg = lm.model.config();
    let lead = world.lead();
    let mut runs: Vec<Vec<Sample>> = settings.iter().map(|_| Vec::new()).collect();
    let mut n_ctx = 0;
    let mut csv = String::from(
        "setting,run,decode_ms_per_token,tokens,ttft_ms,evict_ms,kept_per_head,context_kv_bytes,cache_hits\n",
    );
    // Every setting's job, admitted before any work: a refusal (no LookaheadKV adapter for the
    // model, a context over its window) comes before the first prefill.
    let jobs: Vec<Job> = settings
        .iter()
        .map(|s| Job {
            request: req.clone(),
            options: RunOptions { max_new_tokens: a.max_tokens, evict: *s, ..spec.options(0.15) },
        })
        .collect();
    for job in &jobs {
        flowprefill_coordinator::admit(&lm, job, &flowprefill_coordinator::Limits::NONE)?;
    }
    for round in 0..a.runs {
        for (i, (s, job)) in settings.iter().zip(&jobs).enumerate() {
            let Some(r) = world.run(job, &mut |_| true)? else { continue };
            n_ctx = r.n_context_tokens;
            let full_kv = (r.n_head_tokens + r.n_context_tokens) * cfg.n_layers * cfg.kv_dim() * 2 * r.kv_bytes;
            let Some(m) = sample(&r, full_kv) else {
                eprintln!(
                    "  {} run {round}: the answer stopped after {} token(s); nothing to time",
                    label(s),
                    r.tokens.len()
                );
                continue;
            };
            eprintln!(
                "  {:<16} run {round}: {:>8.2} ms/token over {} tokens, evict {:.0} ms, TTFT {:.0} ms",
                label(s),
                m.decode_ms,
                m.tokens,
                m.evict_ms,
                m.ttft_ms
            );
            csv.push_str(&format!(
                "{},{round},{:.3},{},{:.1},{:.1},{},{},{}\n",
                label(s),
                m.decode_ms,
                m.tokens,
                m.ttft_ms,
                m.evict_ms,
                m.kept,
                m.kv_bytes,
                m.cache_hits
            ));
            runs[i].push(m);
        }
    }
    if !lead {
        return Ok(());
    }
    std::fs::create_dir_all(&a.out)?;
    let path = a.out.join("decode.csv");
    std::fs::write(&path, &csv)?;
    let world = world.describe(rayon::current_num_threads());
    println!(
        "decode after {spec} prefill of {n_ctx} context tokens, {world}, median of {} runs, at most {} answer tokens",
        a.runs, a.max_tokens
    );
    table(&settings, &mut runs);
    println!("wrote {}", path.display());
    Ok(())
}

/// The table: medians per setting, and decoding against the whole cache's.
fn table(settings: &[Setting], runs: &mut [Vec<Sample>]) {
    let med = |v: &mut Vec<f64>| if v.is_empty() { f64::NAN } else { median(v) };
    println!(
        "{:<16} {:>10} {:>14} {:>14} {:>16} {:>10} {:>8} {:>10} {:>10}",
        "setting",
        "kept/head",
        "context KV MiB",
        "decode ms/tok",
        "(min..max)",
        "vs none",
        "tokens",
        "evict ms",
        "TTFT ms"
    );
    let mut none_ms = None;
    for (s, r) in settings.iter().zip(runs.iter_mut()) {
        if r.is_empty() {
            println!("{:<16} (no run decoded two tokens or more)", label(s));
            continue;
        }
        let mut d: Vec<f64> = r.iter().map(|m| m.decode_ms).collect();
        let (lo, hi) = d.iter().fold((f64::MAX, 0f64), |(lo, hi), &x| (lo.min(x), hi.max(x)));
        let dm = med(&mut d);
        if s.is_none() {
            none_ms = Some(dm);
        }
        let vs = none_ms.filter(|_| s.is_some()).map_or("-".to_string(), |n| format!("{:.2}x", n / dm));
        let tokens = med(&mut r.iter().map(|m| m.tokens as f64).collect());
        let evict = med(&mut r.iter().map(|m| m.evict_ms).collect());
        let ttft = med(&mut r.iter().map(|m| m.ttft_ms).collect());
        let last = &r[r.len() - 1];
        println!(
            "{:<16} {:>10} {:>14.1} {:>14.2} {:>16} {:>10} {:>8.0} {:>10.0} {:>10.0}",
            label(s),
            last.kept,
            last.kv_bytes as f64 / (1u64 << 20) as f64,
            dm,
            format!("{lo:.1}..{hi:.1}"),
            vs,
            tokens,
            evict,
            ttft
        );
    }
}
