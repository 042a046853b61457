//! `bench ttft`: TTFT against context length per method, rank count and chunk-cache state
//! (cold, in RAM, on disk), each run beside its projection when a device profile is given.

use crate::Common;
use anyhow::{Context, Result};
use flowprefill_coordinator::World;
use flowprefill_lab::bench::ttft::{self as lab_ttft, Cache, Measure};

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
    /// Timed runs per point, after one untimed warm-up run (for `--cache ram` and `disk`, the
    /// run that fills the caches); the median is reported.
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
    /// Print the projection of every run beside it, for this device profile (e.g. `cpu-local`:
    /// the built-in one, replaced by this machine's calibration file
    /// `$FLOWPREFILL_HOME/calibration.json` where `bench calibrate --out` wrote one there, and by
    /// --profiles); the output names the profiles used and where each came from.
    #[arg(long)]
    pub project: Option<String>,
    /// Link profile of the projection (default: cpu-mpi under mpirun, else cpu-threads).
    #[arg(long, requires = "project")]
    pub link: Option<String>,
    /// Profile files for --project, read after the calibration file (theirs replace its).
    #[arg(long, requires = "project")]
    pub profiles: Vec<std::path::PathBuf>,
    /// Chunk caches at each timed run: `cold` (none held: every chunk prefilled), `ram` (held in
    /// RAM from an untimed run), `disk` (in the store's disk tier from an untimed run, RAM
    /// emptied before each timed run: what a new process finds); comma-separated. `disk` uses
    /// a folder of its own, emptied first: `<out>/bench-store`, or with `--store DIR` (or
    /// `FLOWPREFILL_STORE`) `DIR/bench-ttft`, on that disk but apart from the store's entries,
    /// which the benchmark never reads or deletes; a folder there that it did not make is refused.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "cold")]
    pub cache: Vec<Cache>,
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

/// The file that marks a folder as `bench ttft`'s own disk tier: only a folder holding it (or a
/// new, empty one, which gets it) is ever emptied.
const MARKER: &str = ".flowprefill-bench-ttft";

/// With `disk` among `caches`, every rank's store gets the disk tier in a folder of the
/// benchmark's own, emptied first and before each cold run: `OUT/bench-store`, or
/// `DIR/bench-ttft` with a store `DIR` configured (the same disk; the store lists its own folder
/// only, so its entries are neither served to the benchmark nor deleted by it); without, the
/// measurement keeps no disk tier even where one is configured. A folder the benchmark did not
/// make (no marker file, not empty) is refused, never emptied. The settings to load with, and
/// the folder.
fn with_disk_tier(
    common: &Common,
    caches: &[Cache],
    out: &std::path::Path,
) -> Result<(Common, Option<std::path::PathBuf>)> {
    let mut common = common.clone();
    let disk = if caches.contains(&Cache::Disk) {
        let dir = match common.store_flag()? {
            crate::StoreFlag::Dir(d) => d.join("bench-ttft"),
            _ => out.join("bench-store"),
        };
        claim(&dir)?;
        flowprefill_worker::store::disk::clear(&dir)?;
        common.store = Some(dir.to_string_lossy().into_owned());
        Some(dir)
    } else {
        common.store = Some("off".into());
        None
    };
    Ok((common, disk))
}

/// Makes `dir` the benchmark's own (created, or found empty, and marked), or checks that it
/// is (marked); a folder with anything else in it is a usage error.
fn claim(dir: &std::path::Path) -> Result<()> {
    let marker = dir.join(MARKER);
    if marker.is_file() {
        return Ok(());
    }
    std::fs::create_dir_all(dir).map_err(|e| anyhow::anyhow!("{}: the folder cannot be made ({e})", dir.display()))?;
    let mut entries = std::fs::read_dir(dir).map_err(|e| anyhow::anyhow!("{}: {e}", dir.display()))?;
    crate::ensure_usage!(
        entries.next().is_none(),
        "--cache disk: {} holds files bench ttft did not make (no {MARKER}); the benchmark empties its \
         folder, so it will not use this one: move them away, or give another --out (or --store)",
        dir.display()
    );
    std::fs::write(&marker, b"bench ttft's disk tier: emptied before each measurement\n")
        .map_err(|e| anyhow::anyhow!("{}: {e}", marker.display()))?;
    Ok(())
}

/// A usage error when no method of `methods` runs at any of `ranks` (before anything is
/// loaded or written): full prefill is measured on one rank only, ring on two or more when
/// other rank counts are given.
fn measures_something(methods: &[flowprefill_coordinator::MethodSpec], ranks: &[usize]) -> Result<()> {
    crate::ensure_usage!(!methods.is_empty(), "--methods: give at least one method (e.g. full,ring,infoflow)");
    let any = methods.iter().any(|s| ranks.iter().any(|&p| lab_ttft::measured_at(s.method, p, ranks.len())));
    crate::ensure_usage!(
        any,
        "--methods {} at --ranks {ranks:?} measures nothing: full prefill runs on one rank only (add 1 to \
         --ranks), ring on two or more (add a count of at least 2, or give ring alone)",
        methods.iter().map(|m| m.to_string()).collect::<Vec<_>>().join(",")
    );
    Ok(())
}

/// The profile files of `--project`: this machine's calibration file where `bench calibrate`
/// wrote one (what `--method auto` predicts with), then `given` (theirs replace its).
fn profile_files(given: &[std::path::PathBuf]) -> Vec<std::path::PathBuf> {
    let calibration = crate::cmd::calibration_file().filter(|f| f.exists());
    calibration.into_iter().chain(given.iter().cloned()).collect()
}

/// Runs the benchmark.
pub(super) fn run(common: &Common, a: TtftArgs) -> Result<()> {
    crate::cmd::setup::refuse_mpirun_without_mpi()?;
    let (lengths, ranks) = (a.lengths.concat(), a.ranks.concat());
    crate::ensure_usage!(
        a.runs >= 1 && !lengths.is_empty() && !ranks.is_empty(),
        "give --lengths, --ranks and --runs >= 1"
    );
    crate::ensure_usage!(ranks.iter().all(|&r| r >= 1), "--ranks values must be at least 1");
    flowprefill_lab::tasks::check_lengths(&lengths)?;
    // A value twice would be measured twice, drawn as a line that doubles back, and (a rank
    // count) taken for a second count.
    flowprefill_lab::each_once("--lengths", "length", &lengths)?;
    flowprefill_lab::each_once("--ranks", "rank count", &ranks)?;
    crate::ensure_usage!(a.doc_tokens >= 1, "--doc-tokens must be at least 1 token");
    // Checked here, not by the first run's admission after the model loads.
    flowprefill_coordinator::request::check_ratio(a.ratio).map_err(|e| crate::exit::usage(e.to_string()))?;
    let methods = flowprefill_coordinator::MethodSpec::parse_list(&a.methods)?;
    flowprefill_lab::each_once("--methods", "method", &methods)?;
    measures_something(&methods, &ranks)?;
    crate::cmd::out_dir("--out", &a.out)?;
    let caches = a.cache.clone();
    crate::ensure_usage!(!caches.is_empty(), "--cache: give cold, ram or disk");
    // Thread ranks (not under mpirun, where --ranks counts processes): as many as the machine
    // holds, checked as `run` does before anything is loaded.
    #[cfg(feature = "mpi")]
    let under_mpirun = flowprefill_comm::mpi::launched_by_mpirun();
    #[cfg(not(feature = "mpi"))]
    let under_mpirun = false;
    if !under_mpirun {
        crate::cmd::check_thread_world(common, ranks.iter().copied().max().unwrap_or(1))?;
    }
    let (common, disk) = with_disk_tier(common, &caches, &a.out)?;
    let common = &common;
    let timeout = std::time::Duration::from_secs(600);
    let start = crate::cmd::mpi_start(timeout)?;
    let lm = std::sync::Arc::new(crate::cmd::load_model(common)?);
    // TTFT is the measure here: no op profile (on a GPU it records events).
    if common.device != flowprefill_kernels::DeviceSpec::Cpu {
        lm.model.profile().set_enabled(false);
    }
    let mut world = match crate::cmd::mpi_world(common, &lm, start, false)? {
        Some(w) => w,
        None => World::Threads(crate::cmd::thread_world(common, lm.clone(), 1, timeout)?),
    };
    if let Some(max) = world.max_ranks() {
        crate::ensure_usage!(
            ranks.iter().all(|&r| r <= max),
            "--ranks {ranks:?}: under mpirun every rank count must be at most the {max} processes (-np)"
        );
    }
    let target = match &a.project {
        Some(device) => {
            let link = a.link.as_deref().unwrap_or(if world.max_ranks().is_some() { "cpu-mpi" } else { "cpu-threads" });
            Some(lab_ttft::target(&profile_files(&a.profiles), device, link)?)
        }
        None => None,
    };
    let lead = world.lead();
    if lead {
        let describe = world.describe(rayon::current_num_threads());
        let c: Vec<&str> = caches.iter().map(|c| c.name()).collect();
        println!(
            "TTFT (median of {} timed runs after one untimed warm-up run; chunk caches {}), {describe}, ratio {}, scope {}, build {}",
            a.runs,
            c.join(", "),
            a.ratio,
            a.scope.name(),
            crate::BUILD
        );
        if let Some(t) = &target {
            println!("projected on {}", t.said);
        }
    }
    let projection = target.map(|t| (t.device, t.link));
    let csv_path = a.out.join("ttft.csv");
    let shape = lm.model.config().clone();
    let csv = lab_ttft::CSV_HEADER.to_string();
    let mut m = Measure { runs: a.runs, ratio: a.ratio, scope: a.scope, shape, projection, disk, csv };
    let mut log = |l: &str| crate::say!("{l}");
    let mut points = Vec::new();
    // Every length's request first: one over the model's window is refused before any is
    // measured (and before the CSV of a previous run is replaced).
    let requests =
        lengths.iter().map(|&len| lab_ttft::request(&lm, len, a.doc_tokens)).collect::<Result<Vec<_>, _>>()?;
    // The chart of an earlier study in this folder would stand beside this study's CSV until
    // the end (or for good, if this one stops): it goes as the first point replaces the CSV.
    // A study stopped before its first point leaves the earlier study's files as they were.
    let stale_chart = a.out.join("ttft.png");
    let mut stale = lead && stale_chart.is_file();
    // Ctrl-C ends the study after the point in progress, with the table and chart of the points
    // so far (their CSV is written after each). Thread ranks only: under mpirun every process
    // must leave the loop at the same point, and mpirun ends the job on a signal.
    let asked = match under_mpirun {
        true => crate::progress::Asked::never(),
        false => crate::progress::stop_on_signal("the point in progress"),
    };
    let asked = || asked.is_set();
    let mut interrupted = false;
    'study: for (&len, (req, n_ctx)) in lengths.iter().zip(requests) {
        for &p in &ranks {
            if asked() {
                interrupted = true;
                break 'study;
            }
            if !enter_block(common, &lm, &mut world, p)? {
                continue;
            }
            for spec in methods.iter().filter(|s| lab_ttft::measured_at(s.method, p, ranks.len())) {
                for &cache in &caches {
                    if asked() {
                        interrupted = true;
                        break 'study;
                    }
                    points.extend(m.point(&mut world, &req, spec, cache, len, n_ctx, p, &mut log)?);
                    // After every point: a long study stopped midway keeps what it measured.
                    if lead {
                        flowprefill_lab::eval::write_atomic(&csv_path, m.csv.as_bytes())?;
                    }
                    if std::mem::take(&mut stale) {
                        std::fs::remove_file(&stale_chart)
                            .with_context(|| format!("removing {}", stale_chart.display()))?;
                        crate::say!("removed {} of an earlier study (drawn again at the end)", stale_chart.display());
                    }
                }
            }
        }
    }
    if let Some(max) = world.max_ranks() {
        // Everyone back in one group, so that no process finishes MPI while others still work.
        world.use_group(max, std::time::Duration::from_secs(24 * 3600))?;
    }
    if !lead {
        return Ok(());
    }
    if interrupted {
        println!("{}{} points measured (interrupted)", flowprefill_lab::PARTIAL, points.len());
    }
    if interrupted && points.is_empty() {
        return Err(anyhow::Error::new(crate::exit::Interrupted("interrupted before the first point".into())));
    }
    print!("{}", lab_ttft::table(&points));
    let describe = world.describe(rayon::current_num_threads());
    let written = lab_ttft::chart(&points, &ranks, &a.out, &describe, &csv_path)?;
    println!("wrote {}", written.join(" and "));
    if interrupted {
        return Err(anyhow::Error::new(crate::exit::Interrupted(format!(
            "interrupted after {} points (the table above, the CSV and the chart are of those)",
            points.len()
        ))));
    }
    Ok(())
}
