//! `bench ttft`: TTFT against context length per method, rank count and chunk-cache state
//! (cold, in RAM, on disk), each run beside its projection when a device profile is given.

use super::{bench_docs, median};
use crate::Common;
use anyhow::Result;
use flowprefill_coordinator::World;
use flowprefill_lab::project::Shape;

/// Arguments of `bench ttft`.
#[derive(clap::Args, Debug)]
pub struct TtftArgs {
    /// Context lengths in tokens.
    #[arg(long, default_value = "2048,4096,8000", value_parser = crate::cmd::parse_list::<usize>)]
    pub lengths: Vec<Vec<usize>>,
    /// Rank counts: thread ranks of this process, or under `mpirun -np N` the first ranks of
    /// the N processes (each count at most N).
    #[arg(long, default_value = "1,2,4", value_parser = crate::cmd::parse_list::<usize>)]
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
    #[arg(long, value_enum, value_delimiter = ',', default_value = "cold")]
    pub cache: Vec<Cache>,
}

/// Where `bench ttft` takes its chunk caches from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Cache {
    /// None held: every chunk prefilled.
    Cold,
    /// Held in RAM from an untimed run.
    Ram,
    /// On disk from an untimed run, RAM emptied.
    Disk,
}

impl Cache {
    fn name(self) -> &'static str {
        match self {
            Cache::Cold => "cold",
            Cache::Ram => "ram",
            Cache::Disk => "disk",
        }
    }
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
            *t = crate::cmd::thread_world(common, lm.clone(), p, std::time::Duration::from_secs(600))?;
        }
        return Ok(true);
    }
    // Processes outside the block wait here for the next one, however long it takes.
    let inside = world.use_group(p, std::time::Duration::from_secs(24 * 3600))?;
    // With --device cuda: NCCL between this block's GPUs (a communicator per block).
    #[cfg(feature = "mpi")]
    if let (true, Some(comm)) = (inside, world.process_comm()) {
        crate::cmd::attach_device_plane(common, comm)?;
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
    let profiles = crate::cmd::project::load_profiles(&a.profiles)?;
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

pub(super) fn run(common: &Common, a: TtftArgs) -> Result<()> {
    let (lengths, ranks) = (a.lengths.concat(), a.ranks.concat());
    crate::ensure_usage!(
        a.runs >= 1 && !lengths.is_empty() && !ranks.is_empty(),
        "give --lengths, --ranks and --runs >= 1"
    );
    crate::ensure_usage!(ranks.iter().all(|&r| r >= 1), "--ranks values must be at least 1");
    let methods = flowprefill_coordinator::MethodSpec::parse_list(&a.methods)?;
    let caches = a.cache.clone();
    crate::ensure_usage!(!caches.is_empty(), "--cache: give cold, ram or disk");
    // With `disk`, every rank's store gets the disk tier (emptied first, and before each cold
    // run); without, the measurement keeps no disk tier even where one is configured.
    let mut common = common.clone();
    let disk = if caches.contains(&Cache::Disk) {
        let dir = match common.store_flag()? {
            crate::StoreFlag::Dir(d) => d,
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
    let lm = std::sync::Arc::new(crate::cmd::load_model(common)?);
    // TTFT is the measure here: no op profile (on a GPU it records events).
    if common.device != flowprefill_kernels::DeviceSpec::Cpu {
        lm.model.profile().set_enabled(false);
    }
    let timeout = std::time::Duration::from_secs(600);
    let mut world = match crate::cmd::mpi_world(common, &lm, timeout, false)? {
        Some(w) => w,
        None => World::Threads(crate::cmd::thread_world(common, lm.clone(), 1, timeout)?),
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
    let mut m = Measure { a: &a, shape: Shape::of_config(lm.model.config()), projection, disk, csv: String::from("length,context_tokens,ranks,method,scope,run,ttft_ms,projected_ms,chunk_prefill_ms,probe_ms,recompute_ms,final_prompt_ms,prefill_ms,bytes_sent,bytes_sent_max,comm_wait_ms,projected_comm_ms,projected_exposed_comm_ms,cache,disk_hits,ran\n") };
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
            // One untimed run from nothing fills RAM and the disk tier (for `auto`, a job of
            // `none`: the chunk caches its approximate candidates read, whatever it chooses).
            self.forget(world, true)?;
            let fill = match spec.method {
                flowprefill_coordinator::Method::Auto => flowprefill_coordinator::Job {
                    options: flowprefill_coordinator::RunOptions {
                        method: flowprefill_coordinator::Method::None,
                        ..job.options.clone()
                    },
                    ..job.clone()
                },
                _ => job.clone(),
            };
            world.run(&fill, &mut |_| true)?;
        }
        let mut ran = String::new();
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
                Some((dev, link)) => crate::cmd::project::project_run(&r, &self.shape, dev, link)
                    .map_err(|e| tracing::warn!(%e, "no projection for {label}"))
                    .ok(),
                None => None,
            };
            let ph = |n: &str| r.phases.get(n).as_secs_f64() * 1e3;
            // Bytes every rank sent, the busiest rank's, and the longest time a rank waited in
            // collectives (communication not hidden behind its compute, and waiting for others).
            let bytes: u64 = r.rank_stats.iter().map(|s| s.comm.bytes_sent()).sum();
            let bytes_max = r.rank_stats.iter().map(|s| s.comm.bytes_sent()).max().unwrap_or(0);
            let wait_ms = r.rank_stats.iter().map(|s| s.comm.wait_s()).fold(0.0, f64::max) * 1e3;
            let opt = |x: Option<f64>| x.map_or(String::new(), |x| format!("{x:.1}"));
            // What ran: the method itself, or what `auto` chose.
            ran = flowprefill_coordinator::auto::label(&r.opts);
            self.csv.push_str(&format!(
                "{len},{n_ctx},{p},{spec},{},{run},{ms:.1},{},{:.1},{:.1},{:.1},{:.1},{:.1},{bytes},{bytes_max},{wait_ms:.1},{},{},{},{},{ran}\n",
                scope.name(),
                opt(proj.as_ref().map(|p| p.ttft_s * 1e3)),
                ph("chunk_prefill"),
                ph("probe"),
                ph("recompute"),
                ph("final_prompt"),
                ph("prefill"),
                opt(proj.as_ref().map(|p| p.sum(|t| t.comm_s) * 1e3)),
                opt(proj.as_ref().map(|p| p.sum(|t| t.exposed_comm_s) * 1e3)),
                cache.name(),
                r.cache_disk_hits
            ));
            let proj = proj.map(|p| p.ttft_s * 1e3);
            times.push(ms);
            projected.extend(proj);
        }
        if !world.lead() {
            return Ok(None);
        }
        let ms = median(&mut times);
        let pm = (!projected.is_empty()).then(|| median(&mut projected));
        let chose =
            if spec.method == flowprefill_coordinator::Method::Auto { format!("  (ran {ran})") } else { String::new() };
        match pm {
            Some(x) => eprintln!("  {len:>5} tokens  P={p}  {label:<18} {ms:>9.1} ms  (projected {x:.1} ms){chose}"),
            None => eprintln!("  {len:>5} tokens  P={p}  {label:<18} {ms:>9.1} ms{chose}"),
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
