//! `bench stream`: a stream of questions over a corpus whose documents are asked about with
//! Zipf-distributed popularity, several documents per question in retrieval order, on thread
//! ranks whose chunk stores live through the stream: the chunk-store hit rate and TTFT with
//! positional placement (`--slack 0`) against cache-aware placement (issue 52, item 4).

use super::{bench_docs, median};
use crate::Common;
use anyhow::Result;
use flowprefill_coordinator::{Context, Job, MethodSpec, Request, RunOptions};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::io::Write;

/// Arguments of `bench stream`.
#[derive(clap::Args, Debug)]
pub struct StreamArgs {
    /// Documents in the corpus.
    #[arg(long, default_value_t = 24)]
    pub corpus: usize,
    /// Tokens per document (one chunk each).
    #[arg(long, default_value_t = 256)]
    pub doc_tokens: usize,
    /// Questions in the stream.
    #[arg(long, default_value_t = 30)]
    pub queries: usize,
    /// Documents per question (distinct, drawn by popularity).
    #[arg(long, default_value_t = 4)]
    pub docs_per_query: usize,
    /// Zipf exponent of document popularity (document i drawn with weight 1 / i^s).
    #[arg(long, default_value_t = 1.1)]
    pub zipf: f64,
    /// Rank counts (thread ranks).
    #[arg(long, default_value = "2,4", value_parser = crate::cmd::parse_list::<usize>)]
    pub ranks: Vec<Vec<usize>>,
    /// Cache-aware slacks to compare (0: positional placement).
    #[arg(long, default_value = "0,0.1", value_parser = crate::cmd::parse_list::<f64>)]
    pub slack: Vec<Vec<f64>>,
    /// Method of every question.
    #[arg(long, default_value = "infoflow")]
    pub method: MethodSpec,
    /// Seed of the corpus and of the stream (the same stream for every configuration).
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Output folder for stream.csv.
    #[arg(long, default_value = "bench-out")]
    pub out: std::path::PathBuf,
}

/// The questions: each a list of distinct document indices, most popular first drawn.
fn stream(a: &StreamArgs) -> Vec<Vec<usize>> {
    let weights: Vec<f64> = (1..=a.corpus).map(|i| 1.0 / (i as f64).powf(a.zipf)).collect();
    let total: f64 = weights.iter().sum();
    let mut rng = StdRng::seed_from_u64(a.seed ^ 0x5eed);
    (0..a.queries)
        .map(|_| {
            let mut picked: Vec<usize> = Vec::with_capacity(a.docs_per_query);
            while picked.len() < a.docs_per_query.min(a.corpus) {
                let mut x = rng.random_range(0.0..total);
                let d = weights.iter().position(|&w| {
                    x -= w;
                    x < 0.0
                });
                let d = d.unwrap_or(a.corpus - 1);
                if !picked.contains(&d) {
                    picked.push(d);
                }
            }
            picked
        })
        .collect()
}

/// Runs the command.
pub fn run(common: &Common, a: StreamArgs) -> Result<()> {
    let ranks: Vec<usize> = a.ranks.concat();
    let slacks: Vec<f64> = a.slack.concat();
    crate::ensure_usage!(
        a.corpus >= 1 && a.queries >= 1 && a.docs_per_query >= 1,
        "--corpus, --queries and --docs-per-query must be at least 1"
    );
    crate::ensure_usage!(a.zipf >= 0.0 && a.zipf.is_finite(), "--zipf must be a number >= 0");
    crate::ensure_usage!(ranks.iter().all(|&r| r >= 1), "--ranks must be at least 1");
    crate::ensure_usage!(slacks.iter().all(|s| (0.0..=1.0).contains(s)), "--slack values must be in [0, 1]");
    let lm = std::sync::Arc::new(crate::cmd::load_model(common)?);
    let corpus = bench_docs(&lm.tokenizer, a.corpus * a.doc_tokens, a.doc_tokens, a.seed)?;
    let questions = stream(&a);
    let base =
        MethodSpec::merge(Some(a.method), None, None, None, RunOptions { max_new_tokens: 1, ..RunOptions::default() })?;
    std::fs::create_dir_all(&a.out)?;
    let csv_path = a.out.join("stream.csv");
    let mut csv = std::fs::File::create(&csv_path)?;
    writeln!(csv, "ranks,slack,queries,lookups,ram_hits,disk_hits,misses,hit_rate,ttft_mean_ms,ttft_median_ms")?;
    println!(
        "{} questions over {} documents of {} tokens ({} each, Zipf {}), method {}, thread ranks, chunk stores kept through the stream",
        a.queries, a.corpus, a.doc_tokens, a.docs_per_query, a.zipf, a.method
    );
    println!(
        "{:>5} {:>6} {:>9} {:>7} {:>7} {:>9} {:>13} {:>15}",
        "ranks", "slack", "lookups", "hits", "misses", "hit rate", "TTFT mean ms", "TTFT median ms"
    );
    for &p in &ranks {
        for &slack in &slacks {
            let mut world = crate::cmd::thread_world(common, lm.clone(), p, std::time::Duration::from_secs(600))?;
            let (mut ram, mut disk, mut miss) = (0u64, 0u64, 0u64);
            let mut ttft = Vec::with_capacity(questions.len());
            for q in &questions {
                let req = Request {
                    context: Context::Documents(q.iter().map(|&d| corpus[d].clone()).collect()),
                    query: "Which place is named most often in these documents?".into(),
                    system: None,
                    answer_prefix: None,
                };
                let opts = RunOptions { cache_slack: slack, ..base.clone() };
                let r = world.run(&Job { request: req, options: opts }, &mut |_| true)?;
                for s in &r.rank_stats {
                    ram += s.cache_hits.saturating_sub(s.cache_disk_hits);
                    disk += s.cache_disk_hits;
                    miss += s.cache_misses;
                }
                ttft.push(r.ttft.as_secs_f64() * 1e3);
            }
            let lookups = ram + disk + miss;
            let rate = (ram + disk) as f64 / lookups.max(1) as f64;
            let mean = ttft.iter().sum::<f64>() / ttft.len() as f64;
            let med = median(&mut ttft);
            println!(
                "{p:>5} {slack:>6} {lookups:>9} {:>7} {miss:>7} {:>8.1}% {mean:>13.0} {med:>15.0}",
                ram + disk,
                100.0 * rate
            );
            writeln!(
                csv,
                "{p},{slack},{},{lookups},{ram},{disk},{miss},{rate:.4},{mean:.1},{med:.1}",
                questions.len()
            )?;
        }
    }
    println!("wrote {}", csv_path.display());
    Ok(())
}
