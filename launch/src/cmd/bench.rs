//! `flowprefill bench ...`: throughput and TTFT studies.

use crate::{rss, Common};
use anyhow::Result;
use flowprefill_coordinator::World;
use flowprefill_lab::corpus;
use flowprefill_lab::project::Shape;
use flowprefill_worker::generate::{prefill_into, DEFAULT_PREFILL_CHUNK};
use flowprefill_worker::kv::{KeyForm, KvCache};
use flowprefill_worker::model::OpTimes;
use flowprefill_worker::Backend;
use std::time::Instant;

/// Benchmarks.
#[derive(clap::Subcommand, Debug)]
pub enum Bench {
    /// Full prefill of generated English prose at several lengths: tokens/s, spread, peak RSS,
    /// and where the time goes.
    Prefill(PrefillArgs),
    /// TTFT against context length per method and rank count: a CSV, a PNG plot and speedups.
    Ttft(TtftArgs),
    /// Concurrent clients against a `serve` process: latency percentiles, throughput,
    /// failures by kind, server memory over time.
    Load(LoadArgs),
    /// PROJECTED TTFT for hardware we do not have (a device and link profile, the engine's own
    /// work accounting): table, CSV and plots per method, rank count and length.
    Project(super::project::ProjectArgs),
    /// Measures this machine's GEMM and attention rates, memory bandwidth and links into a
    /// `cpu-local` profile for `bench project` and `bench ttft --project`.
    Calibrate(super::project::CalibrateArgs),
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

/// Arguments of `bench ttft`.
#[derive(clap::Args, Debug)]
pub struct TtftArgs {
    /// Context lengths in tokens.
    #[arg(long, default_value = "2048,4096,8000", value_parser = super::parse_list::<usize>)]
    pub lengths: Vec<Vec<usize>>,
    /// Rank counts: thread ranks of this process, or under `mpirun -np N` the first ranks of
    /// the N processes (each count at most N).
    #[arg(long, default_value = "1,2,4", value_parser = super::parse_list::<usize>)]
    pub ranks: Vec<Vec<usize>>,
    /// Methods: full, ring, infoflow, infoflow+reorder, or any other method name; `NAME@RATIO`
    /// (e.g. infoflow@0.3) runs at its own ratio instead of --ratio.
    #[arg(long, default_value = "full,ring,infoflow,infoflow+reorder")]
    pub methods: String,
    /// Runs per point (each with empty chunk stores); the median is reported.
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Recompute ratio of the selective methods.
    #[arg(long, default_value_t = 0.15)]
    pub ratio: f64,
    /// Recompute scope across ranks.
    #[arg(long, value_enum, default_value_t = flowprefill_coordinator::Scope::Exact)]
    pub scope: flowprefill_coordinator::Scope,
    /// Tokens per document (one chunk each).
    #[arg(long, default_value_t = 512)]
    pub doc_tokens: usize,
    /// Output folder for ttft.csv and ttft.png.
    #[arg(long, default_value = "bench-out")]
    pub out: std::path::PathBuf,
    /// Print the projection of every run beside it, for this device profile (e.g. `cpu-local`
    /// from `bench calibrate`, given with --profiles).
    #[arg(long)]
    pub project: Option<String>,
    /// Link profile of the projection (default: cpu-mpi under mpirun, else cpu-threads).
    #[arg(long)]
    pub link: Option<String>,
    /// Profile files for --project.
    #[arg(long)]
    pub profiles: Vec<std::path::PathBuf>,
    /// Chunk caches at each timed run: `cold` (none held: every chunk prefilled), `ram` (held in
    /// RAM from an untimed run), `disk` (in the store's disk tier from an untimed run, RAM
    /// emptied before each timed run: what a new process finds); comma-separated. `disk` uses
    /// `--store DIR`, else `<out>/store` (emptied first).
    #[arg(long, default_value = "cold")]
    pub cache: String,
}

/// Where `bench ttft` takes its chunk caches from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cache {
    Cold,
    Ram,
    Disk,
}

impl Cache {
    fn parse_list(s: &str) -> Result<Vec<Cache>> {
        let list = s
            .split(',')
            .map(|c| match c.trim() {
                "cold" => Ok(Cache::Cold),
                "ram" => Ok(Cache::Ram),
                "disk" => Ok(Cache::Disk),
                other => Err(anyhow::anyhow!("--cache `{other}`: give cold, ram or disk (comma-separated)")),
            })
            .collect::<Result<Vec<_>>>()?;
        crate::ensure_usage!(!list.is_empty(), "--cache: give cold, ram or disk");
        Ok(list)
    }

    fn name(self) -> &'static str {
        match self {
            Cache::Cold => "cold",
            Cache::Ram => "ram",
            Cache::Disk => "disk",
        }
    }
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
        Bench::Ttft(a) => ttft(common, a),
        Bench::Load(a) => load(common, a),
        Bench::Faults(a) => super::faults::run(common, a),
        Bench::Decode(a) => super::decode_bench::run(common, a),
        Bench::Project(a) => super::project::run_project(common, a),
        Bench::Calibrate(a) => super::project::run_calibrate(common, a),
    }
}

/// The median of `v` (sorted in place; `v` must not be empty).
pub(super) fn median(v: &mut [f64]) -> f64 {
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

/// Enters a block of `bench ttft` jobs on `p` ranks: thread ranks of this process (a world of
/// `p`), or the first `p` processes of an `mpirun` world (each process runs the same loop;
/// world rank 0 leads and reports). False: this process sits the block out.
fn enter_block(
    common: &Common,
    lm: &std::sync::Arc<flowprefill_worker::LoadedModel<flowprefill_kernels::Device>>,
    world: &mut World<flowprefill_kernels::Device>,
    p: usize,
) -> Result<bool> {
    if let World::Threads(t) = world {
        if t.size() != p {
            // On the CPU the ranks share the model; with --device cuda each has a GPU (NCCL).
            *t = super::thread_world(common, lm.clone(), p, std::time::Duration::from_secs(600))?;
        }
        return Ok(true);
    }
    // Processes outside the block wait here for the next one, however long it takes.
    let inside = world.use_group(p, std::time::Duration::from_secs(24 * 3600))?;
    // With --device cuda: NCCL between this block's GPUs (a communicator per block).
    #[cfg(feature = "mpi")]
    if let (true, Some(comm)) = (inside, world.process_comm()) {
        super::attach_device_plane(common, comm)?;
    }
    Ok(inside)
}

/// One measured point of `bench ttft`: medians over the runs.
struct Point {
    len: usize,
    ranks: usize,
    label: String,
    ms: f64,
    n_ctx: usize,
    projected: Option<f64>,
}

/// Whether `method` runs on `p` ranks: full is the single-device baseline; a ring of one is full
/// prefill (measured only when ring is the only rank count).
fn measured_at(method: flowprefill_coordinator::Method, p: usize, rank_counts: usize) -> bool {
    use flowprefill_coordinator::Method;
    !((method == Method::Full && p > 1) || (method == Method::Ring && p == 1 && rank_counts > 1))
}

/// The device and link the measurement is projected onto (`--project`), if asked for.
fn ttft_projection(
    a: &TtftArgs,
    world: &World<flowprefill_kernels::Device>,
) -> Result<Option<(flowprefill_lab::project::Device, flowprefill_lab::project::Link)>> {
    let Some(target) = &a.project else { return Ok(None) };
    let profiles = super::project::load_profiles(&a.profiles)?;
    let link = a.link.clone().unwrap_or_else(|| {
        if world.max_ranks().is_some() {
            "cpu-mpi".into()
        } else {
            "cpu-threads".into()
        }
    });
    Ok(Some((profiles.device(target)?.clone(), profiles.link(&link)?.clone())))
}

/// The request of `bench ttft` at `len` tokens, and its context tokens.
fn ttft_request(
    lm: &flowprefill_worker::LoadedModel<flowprefill_kernels::Device>,
    len: usize,
    doc_tokens: usize,
) -> Result<(flowprefill_coordinator::Request, usize)> {
    let docs = bench_docs(&lm.tokenizer, len, doc_tokens, 11)?;
    let req = flowprefill_coordinator::Request {
        context: flowprefill_coordinator::Context::Documents(docs),
        query: "What is the access code for the north gate?".into(),
        system: None,
        answer_prefix: None,
    };
    let n_ctx = flowprefill_coordinator::layout::Layout::build(lm, &req)?.n_context();
    let window = lm.model.config().context_length;
    crate::ensure_usage!(n_ctx + 64 < window, "--lengths {len} does not fit the model's window of {window}");
    Ok((req, n_ctx))
}

fn ttft(common: &Common, a: TtftArgs) -> Result<()> {
    let (lengths, ranks) = (a.lengths.concat(), a.ranks.concat());
    crate::ensure_usage!(
        a.runs >= 1 && !lengths.is_empty() && !ranks.is_empty(),
        "give --lengths, --ranks and --runs >= 1"
    );
    crate::ensure_usage!(ranks.iter().all(|&r| r >= 1), "--ranks values must be at least 1");
    let methods = flowprefill_coordinator::MethodSpec::parse_list(&a.methods)?;
    let caches = Cache::parse_list(&a.cache)?;
    // With `disk`, every rank's store gets the disk tier (emptied first, and before each cold
    // run); without, the measurement keeps no disk tier even where one is configured.
    let mut common = common.clone();
    let disk = if caches.contains(&Cache::Disk) {
        let dir = match common.store.as_deref() {
            Some(d) if d != "off" && d != "none" => std::path::PathBuf::from(d),
            _ => a.out.join("store"),
        };
        std::fs::create_dir_all(&dir)?;
        flowprefill_worker::store::disk::clear(&dir)?;
        common.store = Some(dir.to_string_lossy().into_owned());
        Some(dir)
    } else {
        common.store = Some("off".into());
        None
    };
    let common = &common;
    let lm = std::sync::Arc::new(super::load_model(common)?);
    // TTFT is the measure here: no op profile (on a GPU it records events).
    if common.device != flowprefill_kernels::DeviceSpec::Cpu {
        lm.model.profile().set_enabled(false);
    }
    let timeout = std::time::Duration::from_secs(600);
    let mut world = match super::mpi_world(common, &lm, timeout, false)? {
        Some(w) => w,
        None => World::Threads(super::thread_world(common, lm.clone(), 1, timeout)?),
    };
    if let Some(max) = world.max_ranks() {
        crate::ensure_usage!(
            ranks.iter().all(|&r| r <= max),
            "--ranks {ranks:?}: under mpirun every rank count must be at most the {max} processes (-np)"
        );
    }
    let projection = ttft_projection(&a, &world)?;
    let lead = world.lead();
    if lead {
        std::fs::create_dir_all(&a.out)?;
        let describe = world.describe(rayon::current_num_threads());
        let c: Vec<&str> = caches.iter().map(|c| c.name()).collect();
        println!(
            "TTFT (median of {} runs; chunk caches {}), {describe}, ratio {}, scope {}",
            a.runs,
            c.join(", "),
            a.ratio,
            a.scope.name()
        );
    }
    let csv_path = a.out.join("ttft.csv");
    let mut m = Measure { a: &a, shape: Shape::of_config(lm.model.config()), projection, disk, csv: String::from("length,context_tokens,ranks,method,scope,run,ttft_ms,projected_ms,chunk_prefill_ms,probe_ms,recompute_ms,final_prompt_ms,prefill_ms,bytes_sent,cache,disk_hits\n") };
    let mut points = Vec::new();
    for &len in &lengths {
        let (req, n_ctx) = ttft_request(&lm, len, a.doc_tokens)?;
        for &p in &ranks {
            if !enter_block(common, &lm, &mut world, p)? {
                continue;
            }
            for spec in methods.iter().filter(|s| measured_at(s.method, p, ranks.len())) {
                for &cache in &caches {
                    points.extend(m.point(&mut world, &req, spec, cache, len, n_ctx, p)?);
                }
            }
        }
        if lead {
            std::fs::write(&csv_path, &m.csv)?;
        }
    }
    if let Some(max) = world.max_ranks() {
        // Everyone back in one group, so that no process finishes MPI while others still work.
        world.use_group(max, std::time::Duration::from_secs(24 * 3600))?;
    }
    if !lead {
        return Ok(());
    }
    ttft_table(&points);
    let series = ttft_series(&points, &ranks);
    let png = a.out.join("ttft.png");
    let title = format!("TTFT vs context length ({})", world.describe(rayon::current_num_threads()));
    let drawn = flowprefill_lab::plot::line_chart(&png, &title, "context tokens", "TTFT (s)", &series)?;
    let written: Vec<String> =
        std::iter::once(csv_path.display().to_string()).chain(flowprefill_lab::plot::written(&png, drawn)).collect();
    println!("wrote {}", written.join(" and "));
    Ok(())
}

/// The measurement of `bench ttft`: its arguments, the projection beside it, the CSV so far.
struct Measure<'a> {
    a: &'a TtftArgs,
    shape: Shape,
    projection: Option<(flowprefill_lab::project::Device, flowprefill_lab::project::Link)>,
    /// The disk tier's folder (with `--cache disk`).
    disk: Option<std::path::PathBuf>,
    csv: String,
}

impl Measure<'_> {
    /// Empties every rank's RAM store, and with `disk` the disk tier's folder too (rank 0
    /// empties it before it starts the next job, which the other ranks wait for).
    fn forget(&self, world: &mut World<flowprefill_kernels::Device>, disk: bool) -> Result<()> {
        world.forget_caches()?;
        if let (true, Some(dir), true) = (disk, &self.disk, world.lead()) {
            flowprefill_worker::store::disk::clear(dir)?;
        }
        Ok(())
    }

    /// Runs `spec` --runs times on the block's `p` ranks with chunk caches from `cache`; the
    /// medians on the leader.
    #[allow(clippy::too_many_arguments)]
    fn point(
        &mut self,
        world: &mut World<flowprefill_kernels::Device>,
        req: &flowprefill_coordinator::Request,
        spec: &flowprefill_coordinator::MethodSpec,
        cache: Cache,
        len: usize,
        n_ctx: usize,
        p: usize,
    ) -> Result<Option<Point>> {
        let (a, scope) = (self.a, self.a.scope);
        let label = match cache {
            Cache::Cold => spec.to_string(),
            c => format!("{spec} {}", c.name()),
        };
        let opts = flowprefill_coordinator::RunOptions { scope, max_new_tokens: 1, ..spec.options(a.ratio) };
        let job = flowprefill_coordinator::Job { request: req.clone(), options: opts };
        if cache != Cache::Cold {
            // One untimed run from nothing fills RAM and the disk tier.
            self.forget(world, true)?;
            world.run(&job, &mut |_| true)?;
        }
        let (mut times, mut projected) = (Vec::new(), Vec::new());
        for run in 0..a.runs {
            match cache {
                Cache::Cold => self.forget(world, true)?,
                Cache::Ram => {}
                // RAM empty, the folder kept: what a new process finds.
                Cache::Disk => self.forget(world, false)?,
            }
            let Some(r) = world.run(&job, &mut |_| true)? else { continue };
            let ms = r.ttft.as_secs_f64() * 1e3;
            let proj = match &self.projection {
                Some((dev, link)) => super::project::project_run(&r, &self.shape, dev, link)
                    .map(|p| p.ttft_s * 1e3)
                    .map_err(|e| tracing::warn!(%e, "no projection for {label}"))
                    .ok(),
                None => None,
            };
            let ph = |n: &str| r.phases.get(n).as_secs_f64() * 1e3;
            let bytes: u64 = r.rank_stats.iter().map(|s| s.comm.bytes_sent()).sum();
            self.csv.push_str(&format!(
                "{len},{n_ctx},{p},{spec},{},{run},{ms:.1},{},{:.1},{:.1},{:.1},{:.1},{:.1},{bytes},{},{}\n",
                scope.name(),
                proj.map_or(String::new(), |x| format!("{x:.1}")),
                ph("chunk_prefill"),
                ph("probe"),
                ph("recompute"),
                ph("final_prompt"),
                ph("prefill"),
                cache.name(),
                r.cache_disk_hits
            ));
            times.push(ms);
            projected.extend(proj);
        }
        if !world.lead() {
            return Ok(None);
        }
        let ms = median(&mut times);
        let pm = (!projected.is_empty()).then(|| median(&mut projected));
        match pm {
            Some(x) => eprintln!("  {len:>5} tokens  P={p}  {label:<18} {ms:>9.1} ms  (projected {x:.1} ms)"),
            None => eprintln!("  {len:>5} tokens  P={p}  {label:<18} {ms:>9.1} ms"),
        }
        Ok(Some(Point { len, ranks: p, label, ms, n_ctx, projected: pm }))
    }
}

/// The table of `bench ttft`, with speedups against single-rank full prefill and ring at the
/// same rank count.
fn ttft_table(points: &[Point]) {
    let find = |len: usize, p: usize, label: &str| {
        points.iter().find(|m| m.len == len && m.ranks == p && m.label == label).map(|m| m.ms)
    };
    println!(
        "{:>7} {:>6} {:>5} {:<18} {:>11} {:>10} {:>10} {:>13} {:>8}",
        "length", "tokens", "ranks", "method", "TTFT ms", "vs full@1", "vs ring@P", "projected ms", "proj/meas"
    );
    for Point { len, ranks: p, label, ms, n_ctx, projected: pm } in points {
        let vs_full = find(*len, 1, "full").map_or("-".to_string(), |f| format!("{:.2}x", f / ms));
        let vs_ring = find(*len, *p, "ring").map_or("-".to_string(), |r| format!("{:.2}x", r / ms));
        let (proj, ratio) =
            pm.map_or(("-".to_string(), "-".to_string()), |x| (format!("{x:.1}"), format!("{:.2}", x / ms)));
        println!("{len:>7} {n_ctx:>6} {p:>5} {label:<18} {ms:>11.1} {vs_full:>10} {vs_ring:>10} {proj:>13} {ratio:>8}");
    }
}

/// One chart line per method (and cache) and rank count: TTFT (s) against context tokens.
fn ttft_series(points: &[Point], ranks: &[usize]) -> Vec<flowprefill_lab::plot::Series> {
    let mut series = Vec::new();
    for &p in ranks {
        let mut labels: Vec<&str> = Vec::new();
        for m in points.iter().filter(|m| m.ranks == p) {
            if !labels.contains(&m.label.as_str()) {
                labels.push(&m.label);
            }
        }
        for label in labels {
            let pts: Vec<(f64, f64)> = points
                .iter()
                .filter(|m| m.ranks == p && m.label == label)
                .map(|m| (m.n_ctx as f64, m.ms / 1e3))
                .collect();
            if !pts.is_empty() {
                series.push(flowprefill_lab::plot::Series { name: format!("{label} P={p}"), points: pts });
            }
        }
    }
    series
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
