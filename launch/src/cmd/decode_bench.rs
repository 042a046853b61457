//! `flowprefill bench decode`: decoding speed and the context's KV bytes, with and without KV
//! eviction before decoding (`--evict snapkv|lookahead --kv-budget N`); the measurement:
//! `flowprefill_lab::bench::decode`.

use crate::Common;
use anyhow::Result;
use flowprefill_coordinator::{EvictPolicy, MethodSpec, World};
use flowprefill_lab::bench::decode::{self as lab_decode, Setting, Source};
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
            return Err(crate::exit::usage(why));
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

/// Runs the benchmark.
pub fn run(common: &Common, a: Args) -> Result<()> {
    super::setup::refuse_mpirun_without_mpi()?;
    crate::ensure_usage!(a.runs >= 1, "--runs must be at least 1");
    crate::ensure_usage!(
        a.max_tokens >= 2,
        "--max-tokens must be at least 2 (decoding is timed after the first token)"
    );
    let ranks = a.ranks.unwrap_or(1);
    crate::ensure_usage!(ranks >= 1, "--ranks must be at least 1");
    super::out_dir("--out", &a.out)?;
    let settings = settings(&a)?;
    let specs = MethodSpec::parse_list(&a.method)?;
    crate::ensure_usage!(specs.len() == 1, "--method takes one method, e.g. full or infoflow@0.15");
    let spec = specs[0];
    super::check_thread_world(common, ranks)?;
    let timeout = std::time::Duration::from_secs(600);
    let start = super::mpi_start(timeout)?;
    let lm = std::sync::Arc::new(super::load_model(common)?);
    let source = if a.docs.is_empty() {
        Source::Prose { tokens: a.tokens, doc_tokens: a.doc_tokens }
    } else {
        Source::Files(&a.docs)
    };
    let req = lab_decode::request(source, &a.query, &lm)?;
    let mut world = match super::mpi_world(common, &lm, start, true)? {
        Some(w) => w,
        None => World::Threads(super::thread_world(common, lm.clone(), ranks, timeout)?),
    };
    if let (Some(size), Some(asked)) = (world.max_ranks(), a.ranks) {
        crate::ensure_usage!(
            asked == size,
            "--ranks {asked} under mpirun -np {size}: leave --ranks out or give {size}"
        );
    }
    let lead = world.lead();
    let jobs = lab_decode::jobs(&lm, &req, &settings, spec, a.max_tokens)?;
    let mut log = |l: &str| crate::say!("{l}");
    let path = a.out.join("decode.csv");
    let measured = lab_decode::measure(&mut world, &lm, &settings, &jobs, a.runs, lead.then_some(&*path), &mut log)?;
    if !lead {
        return Ok(());
    }
    let world = world.describe(rayon::current_num_threads());
    println!(
        "decode after {spec} prefill of {} context tokens, {world}, median of {} runs, at most {} answer tokens",
        measured.n_ctx, a.runs, a.max_tokens
    );
    print!("{}", lab_decode::table(&settings, &measured.runs));
    println!("wrote {}", path.display());
    Ok(())
}
