//! `flowprefill bench ...`: throughput and TTFT studies.

use crate::{rss, Common};
use anyhow::Result;
use flowprefill_worker::corpus;
use flowprefill_worker::generate::{prefill_into, DEFAULT_PREFILL_CHUNK};
use flowprefill_worker::kv::{KeyForm, KvCache};
use flowprefill_worker::model::OpTimes;
use std::time::Instant;

/// Benchmarks.
#[derive(clap::Subcommand, Debug)]
pub enum Bench {
    /// Full prefill of generated English prose at several lengths: tokens/s, spread, peak RSS,
    /// and where the time goes.
    Prefill(PrefillArgs),
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
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn prefill(common: &Common, a: PrefillArgs) -> Result<()> {
    let lengths: Vec<usize> = a.tokens.concat();
    anyhow::ensure!(!lengths.is_empty(), "--tokens needs at least one length");
    anyhow::ensure!(a.runs >= 1, "--runs must be at least 1");
    let lm = super::load_model(common)?;
    let model = &lm.model;
    let cfg = model.config();
    let max_len = *lengths.iter().max().unwrap_or(&0);
    anyhow::ensure!(
        max_len <= cfg.context_length,
        "--tokens {max_len} exceeds the model's context window of {} tokens",
        cfg.context_length
    );
    anyhow::ensure!(lengths.iter().all(|&n| n > 0), "--tokens lengths must be positive");
    // Enough prose for the longest length (about 4 characters per token).
    let text = corpus::prose(a.seed, max_len * 6);
    let all_ids = lm.tokenizer.encode_text(&text)?;
    anyhow::ensure!(all_ids.len() >= max_len, "generated text has only {} tokens", all_ids.len());
    let threads = rayon::current_num_threads();
    let simd = format!("{:?}", flowprefill_kernels::simd::level());
    if !a.json {
        println!("full prefill, {} threads, SIMD {simd}, {} timed runs per length (+1 warm-up)", threads, a.runs);
        println!(
            "{:>7} {:>10} {:>10} {:>10} {:>9} {:>9} | {:>7} {:>7} {:>7} {:>7}",
            "tokens", "median s", "min s", "max s", "tok/s", "peak MB", "matmul", "attn", "norm+rope", "other"
        );
    }
    let mut results = Vec::new();
    for &n in &lengths {
        let ids = &all_ids[..n];
        let reset_ok = rss::reset_peak();
        let mut times = Vec::with_capacity(a.runs);
        let mut prof = OpTimes::default();
        for run in 0..=a.runs {
            let mut cache = KvCache::new(model.backend(), cfg.n_layers, cfg.kv_dim(), KeyForm::Rotated)?;
            model.profile().reset();
            let t = Instant::now();
            let logits = prefill_into(model, &mut cache, ids, 0, a.prefill_chunk)?;
            let dt = t.elapsed().as_secs_f64();
            anyhow::ensure!(logits.iter().all(|x| x.is_finite()), "non-finite logits at {n} tokens");
            if run > 0 {
                times.push(dt);
                let p = model.profile().snapshot();
                prof.matmul_s += p.matmul_s / a.runs as f64;
                prof.attention_s += p.attention_s / a.runs as f64;
                prof.norm_rope_s += p.norm_rope_s / a.runs as f64;
                prof.elementwise_s += p.elementwise_s / a.runs as f64;
                prof.logits_s += p.logits_s / a.runs as f64;
            }
        }
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
