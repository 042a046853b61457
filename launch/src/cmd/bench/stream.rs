//! `bench stream`: a stream of questions over a corpus whose documents are asked about with
//! Zipf-distributed popularity, several documents per question in retrieval order, on thread
//! ranks whose chunk stores live through the stream: the chunk-store hit rate and TTFT with
//! positional placement (`--slack 0`) against cache-aware placement (issue 52, item 4).

use crate::Common;
use anyhow::Result;
use flowprefill_coordinator::{MethodSpec, RunOptions};
use flowprefill_lab::bench::{bench_docs, stream as lab_stream};

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

/// Runs the command.
pub fn run(common: &Common, a: StreamArgs) -> Result<()> {
    let ranks: Vec<usize> = a.ranks.concat();
    let slacks: Vec<f64> = a.slack.concat();
    crate::ensure_usage!(
        a.corpus >= 1 && a.queries >= 1 && a.docs_per_query >= 1 && a.doc_tokens >= 1,
        "--corpus, --queries, --docs-per-query and --doc-tokens must be at least 1"
    );
    crate::ensure_usage!(a.zipf >= 0.0 && a.zipf.is_finite(), "--zipf must be a number >= 0");
    crate::ensure_usage!(ranks.iter().all(|&r| r >= 1), "--ranks must be at least 1");
    crate::ensure_usage!(slacks.iter().all(|s| (0.0..=1.0).contains(s)), "--slack values must be in [0, 1]");
    crate::ensure_usage!(!ranks.is_empty() && !slacks.is_empty(), "give --ranks and --slack (nothing to measure)");
    flowprefill_lab::each_once("--ranks", "rank count", &ranks)?;
    flowprefill_lab::each_once("--slack", "slack", &slacks)?;
    crate::ensure_usage!(
        a.docs_per_query <= a.corpus,
        "--docs-per-query {} is more than the {} documents of --corpus: a question's documents are distinct; \
         give at most {} (or a larger --corpus)",
        a.docs_per_query,
        a.corpus,
        a.corpus
    );
    // Thread ranks, as many as the machine holds, checked as `run` does before anything is
    // loaded.
    crate::cmd::check_thread_world(common, ranks.iter().copied().max().unwrap_or(1))?;
    crate::cmd::out_dir("--out", &a.out)?;
    // Every configuration starts with empty chunk stores and keeps them in RAM only: a disk
    // tier (a configured --store) would hand each configuration what the earlier ones wrote,
    // and cache-aware placement would win by running second.
    if common.disk_tier()?.is_some() {
        crate::say!("note: bench stream keeps chunk caches in RAM only; the configured --store is not used");
    }
    let common = &crate::Common { store: Some("off".into()), ..common.clone() };
    let lm = std::sync::Arc::new(crate::cmd::load_model(common)?);
    let corpus = bench_docs(&lm.tokenizer, a.corpus * a.doc_tokens, a.doc_tokens, a.seed)?;
    let shape = lab_stream::Stream {
        corpus: a.corpus,
        queries: a.queries,
        docs_per_query: a.docs_per_query,
        zipf: a.zipf,
        seed: a.seed,
    };
    let questions = lab_stream::questions(&shape);
    let base =
        MethodSpec::merge(Some(a.method), None, None, None, RunOptions { max_new_tokens: 1, ..RunOptions::default() })?;
    let csv_path = a.out.join("stream.csv");
    // Written whole after every configuration: an earlier study's file stays until this one has
    // a row, and a study stopped part way keeps its rows.
    let mut csv = format!("{}\n", lab_stream::CSV_HEADER);
    println!(
        "{} questions over {} documents of {} tokens ({} each, Zipf {}), method {}, thread ranks, chunk stores kept through the stream",
        a.queries, a.corpus, a.doc_tokens, a.docs_per_query, a.zipf, a.method
    );
    println!(
        "one untimed question first per configuration (documents outside the corpus), so that every rank's store holds \
         the head (the template before the documents); lookups, hits and the hit rate count the documents' chunks only"
    );
    println!("{}", lab_stream::header());
    for &p in &ranks {
        for &slack in &slacks {
            let mut world = crate::cmd::thread_world(common, lm.clone(), p, std::time::Duration::from_secs(600))?;
            let row = lab_stream::run(&mut world, &corpus, &questions, &base, slack)?;
            println!("{}", row.line());
            csv += &format!("{}\n", row.csv());
            flowprefill_lab::eval::write_atomic(&csv_path, csv.as_bytes())?;
        }
    }
    println!("wrote {}", csv_path.display());
    Ok(())
}
