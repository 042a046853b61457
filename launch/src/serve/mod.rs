//! `flowprefill serve`: long-context jobs over HTTP, with Prometheus metrics.
//!
//! ```text
//!   POST /v1/jobs               documents + query + method knobs -> answer and stats (or SSE)
//!   POST /v1/chat/completions   OpenAI-compatible; documents and question in the user message,
//!                               separated by lines of `---`
//!   POST /v1/documents          documents prefilled into the chunk store -> their ids and token
//!                               counts; a job names them by id (`document_ids`)
//!   GET  /healthz               the process answers
//!   GET  /readyz                model loaded and every rank up (503 otherwise)
//!   GET  /metrics               Prometheus text (rank 0 aggregates every rank)
//! ```
//! Loopback by default; a non-loopback address needs `--token` (bearer, compared in constant
//! time; checked before the body is read) unless `--insecure` is given. A bounded queue
//! answers 429 with Retry-After when full, bodies above `--max-body-bytes` get 413, bodies
//! slower than `--read-timeout` 408, malformed JSON or fields 400 naming the field, requests
//! over the cost bounds (`--max-documents`, `--max-chunks`) or the model's window 400 before
//! queueing, jobs past their deadline 504, a failed rank 503. SIGTERM (or Ctrl-C) turns new
//! work away (503; /readyz 503, /metrics still answers), finishes every accepted job (an
//! ingestion, its current document), then stops accepting, gives slow clients `--shutdown-grace`, stops the ranks
//! and exits. Under `mpirun`, rank 0 serves and the other ranks follow its broadcasts.
//!
//! In-process use (tests, embedding): [`Service::start`] with a world of ranks, then
//! [`serve`] with a listener and a shutdown future, in the manner of mini-redis.

pub mod api;
mod app;
pub mod metrics;
pub mod queue;
mod server;

use crate::Common;
use anyhow::{Context as _, Result};
use flowprefill_coordinator::{Limits, ThreadRanks};
use flowprefill_kernels::Device;
use flowprefill_worker::LoadedModel;
use queue::{Queue, Shared, World, WorldFactory};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Arguments of `serve`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Address to listen on (port 0 picks a free port, printed at start).
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: String,
    /// Thread ranks (under mpirun every process is one rank instead).
    #[arg(long)]
    pub ranks: Option<usize>,
    /// Bearer token required on the job endpoints and /metrics.
    #[arg(long, env = "FLOWPREFILL_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Allow a non-loopback address without a token.
    #[arg(long)]
    pub insecure: bool,
    /// Jobs that may wait in the queue.
    #[arg(long, default_value_t = 16)]
    pub queue: usize,
    /// Largest request body.
    #[arg(long, default_value_t = 8 << 20)]
    pub max_body_bytes: usize,
    /// Documents per request.
    #[arg(long, default_value_t = Limits::default().max_documents)]
    pub max_documents: usize,
    /// Chunks per request (documents, or pieces of a text).
    #[arg(long, default_value_t = Limits::default().max_chunks)]
    pub max_chunks: usize,
    /// Context tokens per request (default: the model's window is the only bound).
    #[arg(long)]
    pub max_context_tokens: Option<usize>,
    /// Longest a job may take, queueing included (a request may ask for less).
    #[arg(long, default_value_t = 900.0)]
    pub job_timeout: f64,
    /// Seconds a client has to send the request headers, and again the body.
    #[arg(long, default_value_t = 30.0)]
    pub read_timeout: f64,
    /// After SIGTERM and the last accepted job, seconds open connections may still take.
    #[arg(long, default_value_t = 5.0)]
    pub shutdown_grace: f64,
    /// Connections open at once.
    #[arg(long, default_value_t = 256)]
    pub max_connections: usize,
    /// Seconds a rank waits for another before declaring it lost. Rank 0 tells the others it
    /// is alive every quarter of it while it has no job or computes `full` alone, so neither
    /// counts against it.
    #[arg(long, default_value_t = 120.0)]
    pub comm_timeout: f64,
    /// Also serve /metrics on this address (non-loopback needs --token or --insecure).
    #[arg(long)]
    pub metrics_listen: Option<String>,
    /// Share of jobs, in [0, 1], the service verifies by itself against the exact answer
    /// (every 1/R-th job; a job may also ask with `"verify": true`); each costs the exact
    /// computation after the answer.
    #[arg(long, default_value_t = 0.0)]
    pub verify_rate: f64,
}

/// How the service behaves (everything but the world and the listener).
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// Bearer token of the job endpoints and /metrics (`None`: no authentication).
    pub token: Option<String>,
    /// Jobs that may wait.
    pub queue: usize,
    /// Largest request body.
    pub max_body_bytes: usize,
    /// Longest a job may take, queueing included.
    pub job_timeout: Duration,
    /// Time a client has for the headers, and again for the body.
    pub read_timeout: Duration,
    /// After the last accepted job at shutdown, time open connections may still take.
    pub shutdown_grace: Duration,
    /// Past its deadline, how long a job may run before rank 0 is declared stuck (the ranks'
    /// own deadline, the comm timeout, comes first).
    pub hang_grace: Duration,
    /// Connections open at once.
    pub max_connections: usize,
    /// Cost bounds of one request.
    pub limits: Limits,
    /// Model name for /readyz.
    pub model_name: String,
    /// At most this many bytes per job on each rank's device (`--memory-limit`).
    pub memory_limit: Option<usize>,
    /// The chunk store's disk tier (`--store`): where `POST /v1/documents` ingests to and
    /// `document_ids` are read from (`None`: `--store off`, no ingestion).
    pub store: Option<flowprefill_coordinator::DiskTier>,
    /// Share of jobs verified against the exact answer without asking (`--verify-rate`).
    pub verify_rate: f64,
}

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            token: None,
            queue: 16,
            max_body_bytes: 8 << 20,
            job_timeout: Duration::from_secs(900),
            read_timeout: Duration::from_secs(30),
            shutdown_grace: Duration::from_secs(5),
            hang_grace: Duration::from_secs(125),
            max_connections: 256,
            limits: Limits::default(),
            model_name: "model".into(),
            memory_limit: None,
            store: None,
            verify_rate: 0.0,
        }
    }
}

/// A running service: the queue, its executor and watchdog, and the routes.
pub struct Service {
    state: Arc<app::AppState>,
    workers: Option<queue::Workers>,
}

impl Service {
    /// Starts the executor on `world`; `rebuild` makes a fresh world when rank 0 is stuck
    /// (thread ranks; `None` for MPI, where the service stops instead).
    pub fn start(
        lm: Arc<LoadedModel<Device>>,
        world: World,
        rebuild: Option<WorldFactory>,
        cfg: ServeConfig,
    ) -> Result<Self> {
        crate::ensure_usage!(cfg.token.as_deref() != Some(""), "the bearer token is empty; give a real token or none");
        let prom = metrics::install()?;
        // Thread ranks share this process's device; MPI ranks the node's CPU, or a GPU where
        // there are fewer GPUs than processes on the node.
        let memory_peers = match &world {
            World::Threads(w) => w.size(),
            World::Mpi { engine, .. } => engine.memory_peers(),
        };
        let (queue, shared, workers) = Queue::start(world, rebuild, cfg.queue, cfg.hang_grace)?;
        let state = Arc::new(app::AppState::new(queue, shared, lm, cfg, prom, memory_peers));
        Ok(Self { state, workers: Some(workers) })
    }

    /// A thread-rank world of `ranks` on `lm`, and the factory that rebuilds it.
    pub fn thread_world(
        lm: Arc<LoadedModel<Device>>,
        ranks: usize,
        comm_timeout: Duration,
        faults: Option<Arc<flowprefill_coordinator::fault::FaultPlan>>,
        memory_limit: Option<usize>,
    ) -> Result<(World, WorldFactory)> {
        Self::thread_world_on(lm, ranks, comm_timeout, faults, memory_limit, None, None)
    }

    /// [`Service::thread_world`] with the chunk store's disk tier `disk` under every rank's
    /// store (also after a rebuild: the entries outlive the world).
    pub fn thread_world_on(
        lm: Arc<LoadedModel<Device>>,
        ranks: usize,
        comm_timeout: Duration,
        faults: Option<Arc<flowprefill_coordinator::fault::FaultPlan>>,
        memory_limit: Option<usize>,
        disk: Option<flowprefill_coordinator::DiskTier>,
        chooser: Option<Arc<dyn flowprefill_coordinator::auto::Chooser>>,
    ) -> Result<(World, WorldFactory)> {
        let make = move || -> Result<World> {
            let w = ThreadRanks::new(lm.clone(), ranks, flowprefill_coordinator::DEFAULT_STORE_BYTES, comm_timeout)?
                .with_faults(faults.clone())?
                .with_memory_limit(memory_limit)?
                .with_chooser(chooser.clone())?
                // Documents are ingested on another thread beside the jobs, on the same device:
                // a decode step being recorded would take in that thread's work.
                .with_decode_graphs(false)?;
            let w = match &disk {
                Some(t) => w.with_disk(Some(t.clone()))?,
                None => w,
            };
            Ok(World::Threads(w))
        };
        let world = make()?;
        Ok((world, Box::new(make)))
    }

    /// How the listeners treat connections: the header deadline, the bound on open ones, the
    /// grace at shutdown.
    fn conn_limits(&self) -> server::ConnLimits {
        let cfg = &self.state.cfg;
        server::ConnLimits {
            header_timeout: cfg.read_timeout,
            max_connections: cfg.max_connections,
            grace: cfg.shutdown_grace,
        }
    }

    /// All routes.
    pub fn router(&self) -> axum::Router {
        app::router(self.state.clone())
    }

    /// The state the executor shares (readiness, queue depth, failure).
    pub fn shared(&self) -> &Arc<Shared> {
        &self.state.shared
    }

    /// Stops taking jobs, lets the executor finish the queued ones and stop the ranks
    /// (waiting at most `limit`). Returns whether the world was still usable at the end.
    pub fn finish(mut self, limit: Duration) -> bool {
        self.state.shutting_down.store(true, Ordering::Relaxed);
        self.state.queue.close();
        if let Some(w) = self.workers.take() {
            w.join(limit);
        }
        !self.state.shared.fatal.load(Ordering::Relaxed)
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.state.queue.close();
    }
}

/// Serves `service` on `listener` until `shutdown` completes or the world fails for good, then
/// drains: accepted jobs finish, slow clients get `shutdown_grace` (see [`server`]). Returns an
/// error when the world failed.
pub async fn serve(
    listener: tokio::net::TcpListener,
    service: &Service,
    shutdown: impl Future<Output = ()>,
) -> Result<()> {
    let st = &service.state;
    let limits = service.conn_limits();
    let stop = || st.shutting_down.store(true, Ordering::SeqCst);
    server::run(listener, service.router(), st.shared.clone(), limits, shutdown, stop).await;
    if st.shared.fatal.load(Ordering::Relaxed) {
        let why = st.shared.reason.lock().unwrap_or_else(|p| p.into_inner()).clone().unwrap_or_default();
        if st.shared.device_lost.load(Ordering::SeqCst) {
            anyhow::bail!(crate::exit::DeviceStopped(why));
        }
        anyhow::bail!(flowprefill_coordinator::CoordError::WorldDown(why));
    }
    Ok(())
}

fn is_loopback(addr: &SocketAddr) -> bool {
    addr.ip().is_loopback()
}

/// Makes SIGTERM, SIGINT and SIGUSR1 no longer end this process (a follower rank: rank 0
/// decides when the job ends). Registering a handler replaces the default action for the
/// process's life.
#[cfg(feature = "mpi")]
fn keep_running_on_sigterm() -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        #[cfg(unix)]
        for kind in [
            tokio::signal::unix::SignalKind::terminate(),
            tokio::signal::unix::SignalKind::interrupt(),
            tokio::signal::unix::SignalKind::user_defined1(),
        ] {
            // The registration is what matters; the stream itself is never polled.
            let _registered = tokio::signal::unix::signal(kind)?;
        }
        std::io::Result::Ok(())
    })?;
    Ok(())
}

/// SIGTERM, Ctrl-C, or SIGUSR1 (what mpirun forwards to every rank without killing them: its
/// own SIGTERM kills every rank a second later, OpenMPI's `odls_base_sigkill_timeout`).
async fn signal() {
    #[cfg(unix)]
    let on = |kind| async move {
        match tokio::signal::unix::signal(kind) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(unix)]
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {},
        _ = on(tokio::signal::unix::SignalKind::terminate()) => {},
        _ = on(tokio::signal::unix::SignalKind::user_defined1()) => {},
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
}

impl Args {
    fn config(&self, model_name: String) -> Result<ServeConfig> {
        crate::ensure_usage!(self.queue >= 1, "--queue must be at least 1");
        crate::ensure_usage!(self.max_connections >= 1, "--max-connections must be at least 1");
        let secs = |name: &str, v: f64| -> Result<Duration> {
            crate::ensure_usage!(v > 0.0 && v.is_finite(), "{name} must be a positive number of seconds");
            Duration::try_from_secs_f64(v).with_context(|| format!("{name} {v} is too large"))
        };
        crate::ensure_usage!(
            self.max_documents >= 1 && self.max_chunks >= 1,
            "--max-documents and --max-chunks must be at least 1"
        );
        // Either at 0 would start a server that refuses every job while /readyz says ready.
        crate::ensure_usage!(
            self.max_body_bytes >= 1 && self.max_context_tokens != Some(0),
            "--max-body-bytes and --max-context-tokens must be at least 1 (0 would refuse every job)"
        );
        crate::ensure_usage!(
            (0.0..=1.0).contains(&self.verify_rate),
            "--verify-rate {} is outside [0, 1]; give the share of jobs to verify, e.g. 0.1",
            self.verify_rate
        );
        Ok(ServeConfig {
            token: self.token.clone(),
            queue: self.queue,
            max_body_bytes: self.max_body_bytes,
            job_timeout: secs("--job-timeout", self.job_timeout)?,
            read_timeout: secs("--read-timeout", self.read_timeout)?,
            shutdown_grace: secs("--shutdown-grace", self.shutdown_grace)?,
            hang_grace: crate::cmd::comm_timeout(self.comm_timeout)? + Duration::from_secs(5),
            max_connections: self.max_connections,
            limits: Limits {
                max_documents: self.max_documents,
                max_chunks: self.max_chunks,
                max_context_tokens: self.max_context_tokens.unwrap_or(Limits::default().max_context_tokens),
            },
            model_name,
            memory_limit: None,
            store: None,
            verify_rate: self.verify_rate,
        })
    }

    /// A non-loopback address needs a token or `--insecure`.
    fn guard(&self, addr: &SocketAddr, flag: &str) -> Result<()> {
        crate::ensure_usage!(
            is_loopback(addr) || self.token.is_some() || self.insecure,
            "refusing to serve on non-loopback address {addr} ({flag}) without --token (pass --insecure to allow it)"
        );
        Ok(())
    }
}

/// Runs the command.
pub fn run(common: &Common, a: Args) -> Result<()> {
    let (addr, maddr, comm_timeout) = a.checked()?;
    // MPI first (a build without it refuses mpirun here, before a port is bound or the model
    // loads), then a port in use is found now, in a second, not once the model has loaded.
    let start = crate::cmd::mpi_start(comm_timeout)?;
    crate::ensure_usage!(
        !start.is_mpi() || a.ranks.is_none_or(|r| r == 1),
        "--ranks is for thread ranks; under mpirun every process is one rank"
    );
    let early = bind_early(addr, maddr)?;
    let lm = Arc::new(crate::cmd::load_model(common)?);
    let model = crate::cmd::model_label(common)?;
    let cfg = ServeConfig { memory_limit: common.memory_limit, store: common.disk_tier()?, ..a.config(model)? };
    let Some((world, rebuild)) = world(common, &a, &lm, start, comm_timeout)? else {
        return Ok(());
    };
    let service = Service::start(lm, world, rebuild, cfg)?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    // Bound already, but on a rank 0 whose launcher named no rank in its environment.
    let listeners = match early {
        Some(l) => l,
        None => bind_both(addr, maddr)?,
    };
    let served = rt.block_on(listen(&service, listeners, a.queue));
    // Background tasks (metrics listener, upkeep) hold the state: stop them first.
    rt.shutdown_timeout(Duration::from_secs(2));
    // The executor drains (nothing is queued any more), stops the ranks and ends.
    let intact = service.finish(Duration::from_secs(30));
    served?;
    anyhow::ensure!(intact, "stopped after a rank failure");
    crate::say!("stopped");
    Ok(())
}

impl Args {
    /// The token, the addresses and the comm timeout checked before the model loads: the API's
    /// address, the metrics' (if any), the timeout.
    fn checked(&self) -> Result<(SocketAddr, Option<SocketAddr>, Duration)> {
        if self.token.as_deref().is_some_and(|t| t.trim().is_empty()) {
            crate::ensure_usage!(
                false,
                "the token (--token or FLOWPREFILL_TOKEN) is empty: that would turn authentication off; give a real \
                 token, or unset it and stay on loopback"
            );
        }
        let addr: SocketAddr = self.listen.parse().map_err(|_| {
            crate::exit::Usage(format!("--listen {}: expected IP:PORT, e.g. 127.0.0.1:8080", self.listen))
        })?;
        self.guard(&addr, "--listen")?;
        let maddr = match &self.metrics_listen {
            Some(m) => {
                let maddr: SocketAddr =
                    m.parse().map_err(|_| crate::exit::Usage(format!("--metrics-listen {m}: expected IP:PORT")))?;
                self.guard(&maddr, "--metrics-listen")?;
                Some(maddr)
            }
            None => None,
        };
        let comm_timeout = crate::cmd::comm_timeout(self.comm_timeout)?;
        Ok((addr, maddr, comm_timeout))
    }
}

/// The world the service computes with: its thread ranks (with the factory a failure rebuilds
/// them from), or under mpirun this process's rank. `None` on a follower rank, which has run
/// rank 0's jobs until rank 0 stopped it.
fn world(
    common: &Common,
    a: &Args,
    lm: &Arc<LoadedModel<Device>>,
    start: crate::cmd::MpiStart,
    comm_timeout: Duration,
) -> Result<Option<(World, Option<WorldFactory>)>> {
    let faults = flowprefill_coordinator::fault::FaultPlan::from_env();
    #[cfg(feature = "mpi")]
    if let Some(mut comm) = start.take() {
        use flowprefill_comm::Communicator;
        crate::cmd::setup::agree(&mut comm, lm)?;
        // With --device cuda: NCCL between the ranks' GPUs.
        crate::cmd::attach_device_plane(common, &mut comm)?;
        let engine = flowprefill_coordinator::Engine::new(lm.clone(), flowprefill_coordinator::DEFAULT_STORE_BYTES)
            .with_faults(faults)
            .with_memory_limit(common.memory_limit)
            .with_sharing_processes(crate::cmd::sharing_processes(common))
            .with_disk(common.disk_tier()?.as_ref())
            .with_decode_graphs(false)
            // `"method": "auto"` (refused without one: "auto needs a chooser").
            .with_chooser(crate::cmd::chooser(common, true));
        if comm.rank() != 0 {
            // Followers run rank 0's jobs until it stops them; mpirun forwards signals to every
            // rank, and only rank 0 acts on them (it drains, then stops the followers).
            keep_running_on_sigterm()?;
            let n = match engine.follow(&mut comm) {
                Ok(n) => n,
                Err(e) => {
                    // This rank left the world (it told the others why): it exits now, not after
                    // the collective MPI_Finalize that would wait for rank 0, so that mpirun's
                    // status is this rank's (a panic: 70) however fast rank 0 stops
                    // (docs/faults.md).
                    let e = anyhow::Error::from(e);
                    crate::say!("rank {}: error: {e:#}", comm.rank());
                    std::process::exit(crate::exit::code_of(&e));
                }
            };
            crate::say!("rank {}: stopped after {n} jobs", comm.rank());
            return Ok(None);
        }
        return Ok(Some((World::Mpi { comm: Box::new(comm), engine }, None)));
    }
    #[cfg(not(feature = "mpi"))]
    let _ = start;
    // Thread ranks (the world a failure rebuilds), every rank's store over the disk tier.
    let (ranks, disk) = (a.ranks.unwrap_or(1), common.disk_tier()?);
    let chooser = crate::cmd::chooser(common, false);
    let (w, f) = Service::thread_world_on(lm.clone(), ranks, comm_timeout, faults, common.memory_limit, disk, chooser)?;
    Ok(Some((w, Some(f))))
}

/// The API's and the metrics' listeners, bound before the model loads; `None` on a follower
/// rank under mpirun (only rank 0 serves HTTP).
type Bound = Option<Listeners>;

fn bind_one(addr: SocketAddr, flag: &str) -> Result<std::net::TcpListener> {
    let l = std::net::TcpListener::bind(addr).with_context(|| {
        format!("cannot listen on {addr} (is the port in use? pass another {flag}, or port 0 for a free one)")
    })?;
    l.set_nonblocking(true).with_context(|| format!("{flag} {addr}: cannot make the socket non-blocking"))?;
    Ok(l)
}

/// The API's listener and the metrics' (if any).
type Listeners = (std::net::TcpListener, Option<std::net::TcpListener>);

/// Takes both addresses.
fn bind_both(addr: SocketAddr, maddr: Option<SocketAddr>) -> Result<Listeners> {
    Ok((bind_one(addr, "--listen")?, maddr.map(|m| bind_one(m, "--metrics-listen")).transpose()?))
}

/// Takes both addresses (see [`Bound`]): a port in use is an error at start, before the model
/// loads and the ranks start.
fn bind_early(addr: SocketAddr, maddr: Option<SocketAddr>) -> Result<Bound> {
    #[cfg(feature = "mpi")]
    if flowprefill_comm::mpi::launched_by_mpirun() && flowprefill_comm::launcher_rank().is_some_and(|r| r != 0) {
        return Ok(None);
    }
    bind_both(addr, maddr).map(Some)
}

/// Serves the API (and the metrics) on `listeners` until a signal, then drains.
async fn listen(service: &Service, (api, metrics): Listeners, queue: usize) -> Result<()> {
    let listener = tokio::net::TcpListener::from_std(api)?;
    let metrics_listener = metrics.map(tokio::net::TcpListener::from_std).transpose()?;
    println!(
        "flowprefill serving on http://{} ({} rank(s), queue {queue}, pid {})",
        listener.local_addr()?,
        service.shared().ranks,
        std::process::id()
    );
    if let Some(ml) = metrics_listener {
        println!("metrics on http://{}/metrics", ml.local_addr()?);
        // The same header deadline and bound on connections as the API's listener: a slow
        // client cannot hold the scrape port open.
        let (mapp, limits) = (app::metrics_router(service.state.clone()), service.conn_limits());
        tokio::spawn(server::run_plain(ml, mapp, limits));
    }
    let upkeep = service.state.prom.clone();
    tokio::spawn(async move {
        let mut t = tokio::time::interval(Duration::from_secs(5));
        loop {
            t.tick().await;
            upkeep.run_upkeep();
        }
    });
    // The first signal drains; a second one (an operator who will not wait for the accepted
    // jobs) stops the process at once.
    let first = async {
        signal().await;
        tokio::spawn(async {
            signal().await;
            crate::say!("a second signal: stopping now, without finishing the accepted jobs");
            std::process::exit(130);
        });
    };
    serve(listener, service, first).await
}
