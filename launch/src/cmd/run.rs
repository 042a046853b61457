//! `flowprefill run`: one question over documents with a chosen method.

use crate::Common;
use anyhow::{Context as _, Result};
use flowprefill_coordinator::engine::RunResult;
use flowprefill_coordinator::layout::Layout;
use flowprefill_coordinator::{
    explain, memory, Context, Coverage, Engine, Job, Method, MethodSpec, OnBreach, Request, RunOptions, Scope, World,
};
use flowprefill_kernels::{gib, Device};
use flowprefill_worker::sampling::SamplingConfig;
use flowprefill_worker::{Field, InputError, LoadedModel};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

/// Arguments of `run`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A document (one chunk each, in order); repeat for several.
    #[arg(long = "doc", required_unless_present = "doc_ids")]
    pub docs: Vec<PathBuf>,
    /// A document ingested before (`flowprefill ingest`), by its id; repeat for several (after
    /// the `--doc` files, in order). Its caches are read from the store.
    #[arg(long = "doc-id")]
    pub doc_ids: Vec<String>,
    /// The question.
    #[arg(long)]
    pub query: Option<String>,
    /// What the answer starts with: the assistant's turn opens with it and the answer continues
    /// it (e.g. "The access code is"); the probe scores with it as part of the prompt.
    #[arg(long)]
    pub answer_prefix: Option<String>,
    /// The system message (default: the chat template's own). Chunk caches depend on it:
    /// documents ingested with `ingest --system S` are found on disk by jobs with the same S.
    #[arg(long)]
    pub system: Option<String>,
    #[command(flatten)]
    pub method: MethodArgs,
    /// Ranks as threads of this process (under mpirun, each process is one rank instead).
    #[arg(long)]
    pub ranks: Option<usize>,
    /// Seconds a rank waits for another before declaring it lost. Rank 0 tells the others it
    /// is alive every quarter of it while it has no job or computes `full` alone, so neither
    /// counts against it.
    #[arg(long, default_value_t = 60.0)]
    pub comm_timeout: f64,
    /// Print per-rank phase times, model time per op family (matmul, attention, norm_rope,
    /// other; device time on a GPU) and bytes per collective.
    #[arg(long)]
    pub stats: bool,
    /// Show the selected spans in context (with --json: `explain`, per chunk its first 12 runs
    /// of selected tokens with 40 characters on each side).
    #[arg(long)]
    pub explain: bool,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    /// With --json: every context token's selection score (`scores`, per chunk in request
    /// order), to inspect the signal the method selected by.
    #[arg(long, requires = "json")]
    pub scores: bool,
}

/// Method options of `run`.
#[derive(clap::Args, Debug, Clone)]
pub struct MethodArgs {
    /// The method, written as everywhere else (`bench`, `eval`, the HTTP API):
    /// `NAME[+reorder][@RATIO|~COVERAGE]`, e.g. `infoflow`, `infoflow+reorder`, `infoflow@0.3`,
    /// `infoflow~0.9` (an unknown name is answered with the list of methods); `auto` picks,
    /// per request, the fastest of full, ring, none and infoflow (at --ratio or --coverage)
    /// whose expected KL meets --quality-floor (default 0.15), printing why.
    #[arg(long, default_value = "infoflow")]
    pub method: MethodSpec,
    /// Fraction of context tokens to recompute, in [0, 1] (default 0.15); the same as
    /// `--method NAME@RATIO` (giving both, they must agree).
    #[arg(long)]
    pub ratio: Option<f64>,
    /// A budget by attention coverage instead of the ratio: recompute the fewest tokens whose
    /// selection scores reach this share of the context's score mass, in (0, 1] (e.g. 0.9);
    /// the same as `--method NAME~SHARE`. For infoflow, prophet, cacheblend, cacheclip and
    /// lookahead. The chosen number is reported (`budget`, `coverage` in --json).
    #[arg(long)]
    pub coverage: Option<f64>,
    /// The coverage budget's least ratio of the context (default 0; with --coverage or
    /// `--method NAME~SHARE`).
    #[arg(long)]
    pub min_ratio: Option<f64>,
    /// The coverage budget's largest ratio of the context (default 1; with --coverage or
    /// `--method NAME~SHARE`).
    #[arg(long)]
    pub max_ratio: Option<f64>,
    /// Two-stage chunk reordering (documents only); the same as `--method NAME+reorder`.
    #[arg(long)]
    pub reorder: bool,
    /// Scoring geometry, layers and prefix mode.
    #[command(flatten)]
    pub scoring: super::ScoringArgs,
    /// KV eviction before decoding.
    #[command(flatten)]
    pub evict: super::EvictArgs,
    /// Split the joined documents into chunks of this many tokens instead of one chunk each.
    #[arg(long)]
    pub chunk_tokens: Option<usize>,
    /// Auxiliary model for CacheClip (default: the main model).
    #[arg(long)]
    pub aux_model: Option<PathBuf>,
    /// Maximum answer tokens.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// Seed of the random selector.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Recompute scope across ranks: exact (pass-Q, equals one rank) or sparse (the paper's).
    #[arg(long, value_enum, default_value_t = Scope::Exact)]
    pub scope: Scope,
    /// Cache-aware sharding on several ranks: a chunk goes to a rank whose chunk store holds
    /// it (RAM before disk) when every rank stays within this share above the positional
    /// split's largest load; 0 places by position only.
    #[arg(long, default_value_t = flowprefill_coordinator::request::DEFAULT_CACHE_SLACK)]
    pub cache_slack: f64,
    /// Also answer the request exactly (full prefill on one rank, ring on several) and report
    /// how far this answer was from it: KL of the first token's distribution, top-1, the
    /// leading tokens that agree, the exact TTFT (costs the exact computation).
    #[arg(long)]
    pub verify: bool,
    /// The quality gate (with --verify): a KL bound in nats on the first token's distribution;
    /// an answer above it breached the floor. With `--method auto`, also the floor the chosen
    /// method's expected KL meets (default 0.15).
    #[arg(long)]
    pub quality_floor: Option<f64>,
    /// What a breach does: fallback (answer from the exact computation) or flag (keep the
    /// answer, mark it).
    #[arg(long, value_enum, default_value_t = OnBreach::Fallback, requires = "quality_floor")]
    pub on_breach: OnBreach,
}

impl MethodArgs {
    /// Options for the coordinator.
    pub fn options(&self) -> Result<RunOptions> {
        let scoring = self.scoring.parse()?;
        let coverage = Coverage::requested(self.coverage, Some(self.method), self.min_ratio, self.max_ratio)?;
        let base = MethodSpec::merge(
            Some(self.method),
            self.ratio,
            coverage,
            self.reorder.then_some(true),
            RunOptions::default(),
        )?;
        Ok(scoring.apply(RunOptions {
            max_new_tokens: self.max_tokens,
            sampling: SamplingConfig::default(),
            seed: self.seed,
            scope: self.scope,
            evict: self.evict.parse()?,
            cache_slack: self.cache_slack,
            verify: self.verify,
            quality_floor: self.quality_floor,
            on_breach: self.on_breach,
            ..base
        }))
    }

    /// The context from document texts.
    pub fn context(&self, docs: Vec<String>) -> Context {
        match self.chunk_tokens {
            Some(n) => Context::Text { text: docs.join("\n\n"), chunk_tokens: n },
            None => Context::Documents(docs),
        }
    }
}

/// The engine of a command that times cold chunk caches against warm ones in this process
/// (`demo`, `check`): no disk tier, even where `--store` or `FLOWPREFILL_STORE` names one (its
/// entries would serve the "cold" runs: the figures would say cold and be disk hits); one note
/// on stderr says so. `bench ttft --cache disk` times the disk tier.
pub fn cold_engine(common: &Common, command: &str) -> Result<Engine<Device>> {
    if let crate::StoreFlag::Dir(d) = common.store_flag()? {
        crate::say!(
            "note: {command} times cold and warm chunk caches in this process; the disk store {} is not used \
             (bench ttft --cache disk times it)",
            d.display()
        );
    }
    let mut common = common.clone();
    common.store = Some("off".into());
    engine(&common, None)
}

/// Builds the engine (main model, optional auxiliary model).
pub fn engine(common: &Common, aux: Option<&PathBuf>) -> Result<Engine<Device>> {
    let lm = Arc::new(super::load_model(common)?);
    let engine = Engine::new(lm, flowprefill_coordinator::DEFAULT_STORE_BYTES)
        .with_memory_limit(common.memory_limit)
        .with_disk(common.disk_tier()?.as_ref());
    match aux {
        None => Ok(engine),
        Some(p) => {
            let aux = LoadedModel::load(p, super::device(common)?)
                .with_context(|| format!("loading --aux-model {}", p.display()))?;
            Ok(engine.with_aux(Arc::new(aux))?)
        }
    }
}

/// Runs the command.
pub fn run(common: &Common, args: Args) -> Result<()> {
    super::setup::refuse_mpirun_without_mpi()?;
    let query = args.query.clone().unwrap_or_default();
    if query.trim().is_empty() {
        return Err(InputError::new(Field::Query, "the query is missing: pass --query TEXT").into());
    }
    // Under mpirun the other ranks run the job rank 0 broadcasts: only rank 0 reads the inputs
    // (a --doc on its host alone, a --doc-id of its store: another host failed them).
    let follower = flowprefill_comm::launcher_rank().is_some_and(|r| r > 0) && cfg!(feature = "mpi");
    let mut docs = if follower {
        Vec::new()
    } else {
        args.docs.iter().map(|p| super::read_text("--doc", p)).collect::<Result<Vec<_>>>()?
    };
    if !args.doc_ids.is_empty() && !follower {
        let dir = super::store::folder(common).context("--doc-id reads ingested documents from the store")?;
        let registry = flowprefill_worker::store::documents::Documents::at(&dir);
        let texts = registry.resolve(&args.doc_ids).map_err(|e| crate::exit::usage(format!("--doc-id: {e}")))?;
        docs.extend(texts);
    }
    for (i, (p, d)) in args.docs.iter().zip(&docs).enumerate() {
        if d.trim().is_empty() {
            let problem = format!("{} is empty; remove it or give it some text", p.display());
            return Err(InputError::new(Field::Document(i), problem).into());
        }
    }
    let opts = RunOptions { keep_scores: args.scores, ..args.method.options()? };
    let req = Request {
        conversation: Default::default(),
        context: args.method.context(docs),
        query,
        system: args.system.clone(),
        answer_prefix: args.answer_prefix.clone(),
    };
    // Every check that needs no model, before it loads (a zero --max-tokens, a coverage for a
    // method without a score mass); rank 0's job is the one that runs.
    if !follower {
        flowprefill_coordinator::request::validate(&req, &opts)?;
    }
    let job = Job { request: req.clone(), options: opts };
    let timeout = super::comm_timeout(args.comm_timeout)?;
    let stream = !args.json;
    let mut stdout = std::io::stdout();
    let mut on_text = |s: &str| {
        if stream {
            // A reader that does not read (a paused pager) is not a stuck rank.
            WRITING.store(true, std::sync::atomic::Ordering::Relaxed);
            let _ = write!(stdout, "{s}");
            let _ = stdout.flush();
            WRITING.store(false, std::sync::atomic::Ordering::Relaxed);
            flowprefill_worker::interrupt::beat("answer");
        }
        true
    };
    let Some((r, engine_model)) = run_job(common, &args, &job, timeout, &mut on_text)? else {
        return Ok(()); // a follower rank under mpirun: rank 0 prints
    };
    let note = engine_model.synthetic.map(|s| s.notice());
    // What admission planned for this job on each rank (coordinator/src/memory.rs; for `auto`,
    // the method it chose): tokenized
    // again only when something prints it.
    let layout = if args.json || args.stats || args.explain { Some(Layout::build(&engine_model, &req)?) } else { None };
    let planned = layout.as_ref().map_or_else(Vec::new, |l| memory::plan_for(&engine_model, &r.opts, r.ranks, l));
    if args.json {
        let mut v = to_json(&r);
        if let Some(n) = &note {
            v["note"] = serde_json::json!(n);
        }
        v["memory_plan"] = serde_json::to_value(&planned)?;
        if let (true, Some(layout)) = (args.explain, &layout) {
            v["explain"] = serde_json::to_value(explain::spans(&engine_model.tokenizer, layout, &r, 12))?;
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!();
        if r.quality.as_ref().is_some_and(|q| q.fell_back) {
            // The streamed answer breached the quality floor: the exact one replaces it.
            println!("quality gate: the answer above breached the floor; the exact answer:\n{}", r.answer);
        }
        if let Some(n) = &note {
            println!("note: {n}");
        }
        print_summary(&r);
        if args.stats {
            print_stats(&r);
            for m in &planned {
                let measured = r.rank_stats.iter().find(|s| s.rank == m.rank).and_then(|s| s.memory_peak);
                println!(
                    "memory plan, rank {}: {} at its {} peak ({}){}",
                    m.rank,
                    gib(m.bytes()),
                    m.phase,
                    m.describe(),
                    measured.map_or(String::new(), |b| format!("; measured peak on the device {}", gib(b)))
                );
            }
        }
        if let (true, Some(layout)) = (args.explain, &layout) {
            println!("{}", explain::render(&engine_model.tokenizer, layout, &r, 12));
        }
    }
    Ok(())
}

/// Runs `job` over thread ranks, or as this process's rank under mpirun. Returns the result
/// and the model on rank 0; `None` on other MPI ranks.
fn run_job(
    common: &Common,
    args: &Args,
    job: &Job,
    timeout: std::time::Duration,
    on_text: &mut dyn FnMut(&str) -> bool,
) -> Result<Option<(RunResult, Arc<LoadedModel<Device>>)>> {
    #[cfg(feature = "mpi")]
    let under_mpirun = flowprefill_comm::mpi::launched_by_mpirun();
    #[cfg(not(feature = "mpi"))]
    let under_mpirun = false;
    let ranks = args.ranks.unwrap_or(1);
    if !under_mpirun {
        super::check_thread_world(common, ranks)?;
        anyhow::ensure!(
            ranks <= 1 || common.device == flowprefill_kernels::DeviceSpec::Cpu || args.method.aux_model.is_none(),
            "--aux-model with --ranks {ranks} --device cuda is not supported: run under mpirun, one process per GPU"
        );
    }
    crate::ensure_usage!(
        args.method.aux_model.is_none() || args.method.method.method == flowprefill_coordinator::Method::Cacheclip,
        "--aux-model is CacheClip's scoring model, and method {} does not use one: drop it, or give --method cacheclip",
        args.method.method
    );
    crate::ensure_usage!(
        !under_mpirun || args.ranks.is_none_or(|r| r == 1),
        "--ranks is for thread ranks; under mpirun every process is one rank (use -np N)"
    );
    let start = super::mpi_start(timeout)?;
    let lm = Arc::new(super::load_model(common)?);
    // On a GPU the op profile records an event per group of ops: only when --stats reads it.
    if common.device != flowprefill_kernels::DeviceSpec::Cpu && !args.stats {
        lm.model.profile().set_enabled(false);
    }
    let aux = match &args.method.aux_model {
        Some(p) => Some(Arc::new(
            LoadedModel::load(&super::resolve_model(Some(p))?, super::device(common)?)
                .with_context(|| format!("loading --aux-model {}", p.display()))?,
        )),
        None => None,
    };
    let mut world = match super::mpi_world(common, &lm, start, true)? {
        Some(w) => w,
        None => World::Threads(super::thread_world(common, lm.clone(), ranks, timeout)?),
    };
    if let Some(a) = aux {
        world = match world {
            World::Threads(t) => World::Threads(t.with_aux(a)?),
            World::Mpi { comm, engine } => World::Mpi { comm, engine: engine.with_aux(a)? },
        };
    }
    // A rank stuck in its own work (rank 0 above all: no follower's deadline reaches it, and
    // under mpirun the followers wait on its ticks) would hang the command for good.
    let limit = flowprefill_worker::interrupt::stuck_after(timeout);
    let _watchdog = (flowprefill_comm::launcher_rank().unwrap_or(0) == 0).then(|| Watchdog::start(limit));
    Ok(world.run(job, on_text)?.map(|r| (r, lm)))
}

/// Set while the answer is written to stdout (the watchdog does not count that time).
static WRITING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Ends the process (exit 4, a stuck rank) when no rank of it has finished a layer for
/// `limit` ([`flowprefill_worker::interrupt::since_beat`]); stops watching when dropped.
struct Watchdog(Arc<std::sync::atomic::AtomicBool>);

impl Watchdog {
    fn start(limit: std::time::Duration) -> Self {
        use std::sync::atomic::Ordering;
        flowprefill_worker::interrupt::beat("start");
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let s = stop.clone();
        let _ = std::thread::Builder::new().name("watchdog".into()).spawn(move || {
            while !s.load(Ordering::Relaxed) {
                std::thread::sleep(std::time::Duration::from_millis(250));
                let (gap, phase) = flowprefill_worker::interrupt::since_beat();
                if gap >= limit && !s.load(Ordering::Relaxed) && !WRITING.load(Ordering::Relaxed) {
                    crate::say!(
                        "rank 0: error: no layer has finished for {:.0} s (the last during `{phase}`): a rank is stuck; \
                         stopping (raise --comm-timeout if one layer legitimately takes longer than a quarter of this)",
                        // The limit, not the gap: polled every 250 ms, a gap of 8.6 s for a limit of 8 read "9 s".
                        limit.as_secs_f64()
                    );
                    std::process::exit(4);
                }
            }
        });
        Self(stop)
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Per-rank phase times and bytes per collective.
pub fn print_stats(r: &RunResult) {
    let mut names: Vec<&str> = Vec::new();
    for s in &r.rank_stats {
        for (n, _) in &s.phases {
            if !names.contains(&n.as_str()) {
                names.push(n);
            }
        }
    }
    print!("{:>4} {:>6} {:>7} {:>8} {:>14}", "rank", "chunks", "tokens", "selected", "ram/disk/miss");
    for n in &names {
        print!(" {:>13}", n);
    }
    println!("   (ms)");
    for s in &r.rank_stats {
        let lookups =
            format!("{}/{}/{}", s.cache_hits.saturating_sub(s.cache_disk_hits), s.cache_disk_hits, s.cache_misses);
        print!("{:>4} {:>6} {:>7} {:>8} {:>14}", s.rank, s.chunks, s.tokens, s.selected, lookups);
        for n in &names {
            let v = s.phases.iter().find(|(p, _)| p == n).map_or(0.0, |p| p.1);
            print!(" {:>13.1}", v);
        }
        println!();
    }
    if r.rank_stats.iter().any(|s| !s.ops.is_empty()) {
        // Every rank reports the same families (`OpTimes::families_ms`), in the same order.
        let families: Vec<&str> = r
            .rank_stats
            .iter()
            .find(|s| !s.ops.is_empty())
            .map_or(Vec::new(), |s| s.ops.iter().map(|(n, _)| n.as_str()).collect());
        print!("{:>4}", "rank");
        for n in &families {
            print!(" {:>11}", n);
        }
        println!("   (ms of model work per op family; device time on a GPU)");
        for s in &r.rank_stats {
            print!("{:>4}", s.rank);
            for n in &families {
                print!(" {:>11.1}", s.ops.iter().find(|(p, _)| p == n).map_or(0.0, |p| p.1));
            }
            println!();
        }
    }
    println!(
        "{:>4} {:<22} {:>6} {:>12} {:>12} {:>10}",
        "rank", "collective", "calls", "sent bytes", "recv bytes", "wait ms"
    );
    for s in &r.rank_stats {
        for (op, o) in &s.comm.ops {
            println!(
                "{:>4} {:<22} {:>6} {:>12} {:>12} {:>10.1}",
                s.rank,
                op,
                o.calls,
                o.bytes_sent,
                o.bytes_received,
                o.wait_s * 1e3
            );
        }
    }
}

/// Human-readable summary of a run.
pub fn print_summary(r: &RunResult) {
    println!(
        "method {}{}  {}  ranks {}  context {} tokens in {} chunks  selected {} (budget {})  TTFT {:.1} ms",
        r.method,
        if r.opts.reorder { "+reorder" } else { "" },
        match &r.coverage {
            Some(c) => format!("coverage {}", c.share),
            None => format!("ratio {:.2}", r.ratio),
        },
        r.ranks,
        r.n_context_tokens,
        r.chunk_tokens.len(),
        r.n_selected(),
        r.budget,
        r.ttft.as_secs_f64() * 1e3
    );
    let phases: Vec<String> =
        r.phases.entries().iter().map(|(n, d)| format!("{n} {:.1} ms", d.as_secs_f64() * 1e3)).collect();
    println!("phases: {}", phases.join(" | "));
    if let Some(a) = &r.auto {
        println!("auto chose {}", a.why);
        for (i, c) in a.candidates.iter().enumerate() {
            println!(
                "  {} {:<16} predicted TTFT {:>9.1} ms  expected KL {:.3} ({}){}",
                if i == a.winner { "*" } else { " " },
                c.label,
                c.ttft_ms,
                c.expected_kl,
                c.quality_from,
                if c.meets { "" } else { "  above the floor" }
            );
        }
    }
    if let (Some(c), Some(asked)) = (&r.coverage, &r.opts.coverage) {
        println!(
            "coverage {}: kept {} tokens ({:.1}% of the context) covering {:.1}% of the score mass (bounds {}-{} of the context)",
            c.share,
            c.k,
            100.0 * c.k as f64 / r.n_context_tokens.max(1) as f64,
            100.0 * c.covered,
            asked.min_ratio,
            asked.max_ratio
        );
    }
    println!("selected per chunk: {:?}", r.selected_counts());
    if r.order.iter().enumerate().any(|(i, &c)| i != c) {
        println!("chunk order (nearest the prompt last): {:?}", r.order);
    }
    if r.method != Method::Full {
        println!(
            "chunk store: {} hits ({} from disk), {} misses (prefix mode {})",
            r.cache_hits,
            r.cache_disk_hits,
            r.cache_misses,
            r.prefix.name()
        );
    }
    if let Some(e) = &r.eviction {
        let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
        println!(
            "evicted ({}, window {}): kept {} of {} context entries per (layer, KV head){}; context KV {:.1} MiB -> {:.1} MiB",
            e.policy,
            e.window,
            e.kept(),
            e.rows_before,
            if e.kept_per_rank.len() > 1 { format!(" (per rank {:?})", e.kept_per_rank) } else { String::new() },
            mib(e.bytes_before),
            mib(e.bytes_after)
        );
    }
    if let Some(ms) = decode_ms_per_token(r) {
        println!("decode: {ms:.2} ms per token after the first ({} tokens)", r.tokens.len());
    }
    if let Some(e) = &r.verify_error {
        println!("not verified: the exact computation failed ({e})");
    }
    if let Some(q) = &r.quality {
        println!(
            "verified against {} (TTFT {:.1} ms): KL {:.4} nats, top-1 {}, {} of {} answer tokens agree{}",
            q.exact_method,
            q.exact_ttft_ms,
            q.kl,
            if q.top1 { "the same" } else { "differs" },
            q.agree_tokens,
            q.answer_tokens,
            match (q.floor, q.breached, q.fell_back) {
                (None, _, _) => String::new(),
                (Some(f), false, _) => format!("; within the floor {f}"),
                (Some(f), true, true) => format!("; above the floor {f}: answered from the exact computation"),
                (Some(f), true, false) => format!("; above the floor {f}: flagged"),
            }
        );
    }
}

use flowprefill_lab::bench::decode_ms_per_token;

/// The JSON object of a run.
pub fn to_json(r: &RunResult) -> serde_json::Value {
    let phases: serde_json::Map<String, serde_json::Value> =
        r.phases.entries().iter().map(|(n, d)| (n.to_string(), serde_json::json!(d.as_secs_f64() * 1e3))).collect();
    serde_json::json!({
        "answer": r.answer,
        "build": crate::BUILD,
        "ttft_ms": r.ttft.as_secs_f64() * 1e3,
        "total_ms": r.total.as_secs_f64() * 1e3,
        "phases": phases,
        "selected": r.selected_counts(),
        "n_selected": r.n_selected(),
        "budget": r.budget,
        "coverage": r.coverage,
        "auto": r.auto,
        "method": r.method.name(),
        "reorder": r.opts.reorder,
        "geometry": r.opts.geometry.name(),
        "prefix": r.prefix.name(),
        "ratio": r.ratio,
        "n_context_tokens": r.n_context_tokens,
        "n_prompt_tokens": r.n_prompt_tokens,
        "chunk_tokens": r.chunk_tokens,
        "order": r.order,
        "importance": r.importance,
        "scores": r.scores,
        "cache_hits": r.cache_hits,
        "cache_misses": r.cache_misses,
        "cache_disk_hits": r.cache_disk_hits,
        "stop": r.stop,
        "ranks": r.ranks,
        "scope": r.opts.scope.name(),
        "owners": r.owners,
        "rank_stats": r.rank_stats,
        "first_top_logits": top_logits(&r.first_logits, 10),
        "eviction": r.eviction,
        "decode_ms_per_token": decode_ms_per_token(r),
        "decode_replayed": r.decode_replayed,
        "quality": r.quality,
        "verify_error": r.verify_error,
    })
}

/// The `n` largest logits as (token id, value), for comparing runs.
pub fn top_logits(logits: &[f32], n: usize) -> Vec<(usize, f32)> {
    let mut v: Vec<(usize, f32)> = logits.iter().copied().enumerate().collect();
    v.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    v.truncate(n);
    v
}
