//! The bounded job queue and the worker that owns the world of ranks.
//!
//! ```text
//!   HTTP handlers ── try_send ──> [ queue (bounded) ] ──> worker thread (rank 0)
//!        ^                          full: 429 + Retry-After       │ runs one job at a time
//!        └──── events (text pieces, result or error) ─────────────┘ over all ranks
//! ```
//! A handler that goes away (client disconnected) drops its [`CancelOnDrop`], which flags
//! the job: a queued job is skipped, a running one stops at its next generated token. Each
//! job has a deadline (queueing included). A failed rank marks the world down: the job gets a
//! 503, `/readyz` reports it, and thread ranks are rebuilt before the next job; an MPI world
//! cannot be rebuilt, so the service shuts down cleanly instead. Errors are counted where they
//! are answered (the handler); the worker counts only cancellations, which nobody answers.

use super::api::ApiError;
use super::metrics;
use flowprefill_coordinator::{Engine, Job, RunResult, ThreadRanks};
use flowprefill_worker::Cpu;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;

/// What a job sends back to its handler.
#[derive(Debug)]
pub enum Event {
    /// A piece of the answer.
    Text(String),
    /// The finished job.
    Done(Box<RunResult>),
    /// The job failed.
    Failed(ApiError),
}

/// A queued job.
pub struct Queued {
    /// The job.
    pub job: Job,
    /// When it was accepted.
    pub accepted: Instant,
    /// When it must be finished.
    pub deadline: Instant,
    /// Set when the client went away.
    pub cancel: Arc<AtomicBool>,
    /// Where results go.
    pub events: UnboundedSender<Event>,
}

/// Flags a job as cancelled when the handler waiting for it is dropped before the end.
pub struct CancelOnDrop {
    flag: Arc<AtomicBool>,
    armed: bool,
}

impl CancelOnDrop {
    /// Guards `flag`.
    pub fn new(flag: Arc<AtomicBool>) -> Self {
        Self { flag, armed: true }
    }

    /// The job completed: dropping no longer cancels.
    pub fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.armed {
            self.flag.store(true, Ordering::Relaxed);
        }
    }
}

/// The ranks the worker computes with.
pub enum World {
    /// Thread ranks of this process.
    Threads(ThreadRanks<Cpu>),
    /// This process is rank 0 of an MPI job; the other ranks follow.
    #[cfg(feature = "mpi")]
    Mpi {
        /// Rank 0's communicator.
        comm: flowprefill_comm::mpi::MpiComm,
        /// Rank 0's engine.
        engine: Engine<Cpu>,
    },
}

impl World {
    fn size(&self) -> usize {
        match self {
            World::Threads(t) => t.size(),
            #[cfg(feature = "mpi")]
            World::Mpi { comm, .. } => flowprefill_comm::Communicator::size(comm),
        }
    }

    fn leader(&self) -> &Engine<Cpu> {
        match self {
            World::Threads(t) => t.leader(),
            #[cfg(feature = "mpi")]
            World::Mpi { engine, .. } => engine,
        }
    }

    fn run(&mut self, job: &Job, on_text: &mut dyn FnMut(&str) -> bool) -> Result<RunResult, (bool, String)> {
        match self {
            World::Threads(t) => t.run(job, on_text).map_err(|e| (t.broken().is_some(), e.to_string())),
            #[cfg(feature = "mpi")]
            World::Mpi { comm, engine } => engine.lead(comm, job, on_text).map_err(|e| {
                let lost =
                    matches!(e, flowprefill_coordinator::CoordError::Worker(flowprefill_worker::WorkerError::Comm(_)));
                (lost, e.to_string())
            }),
        }
    }

    /// Tries to get all ranks back; false when impossible (MPI).
    fn repair(&mut self) -> bool {
        match self {
            World::Threads(t) => t.rebuild().is_ok(),
            #[cfg(feature = "mpi")]
            World::Mpi { .. } => false,
        }
    }

    /// Stops the followers.
    fn shutdown(self) {
        match self {
            World::Threads(t) => drop(t),
            #[cfg(feature = "mpi")]
            World::Mpi { mut comm, .. } => {
                let _ = Engine::<Cpu>::stop(&mut comm);
            }
        }
    }
}

/// State shared between the worker and the handlers.
pub struct Shared {
    /// Jobs waiting.
    pub depth: AtomicUsize,
    /// Queue capacity.
    pub capacity: usize,
    /// All ranks usable.
    pub ready: AtomicBool,
    /// Why not ready.
    pub reason: Mutex<Option<String>>,
    /// Ranks of the world.
    pub ranks: usize,
    /// Set when the worker wants the server to stop (unrecoverable rank failure).
    pub fatal: tokio::sync::Notify,
    /// Recent job durations (seconds), for Retry-After.
    pub recent: Mutex<Vec<f64>>,
}

impl Shared {
    /// Seconds a new job would wait, roughly: queue depth times the median recent job.
    pub fn retry_after(&self) -> u64 {
        let recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        let mut v = recent.clone();
        v.sort_by(|a, b| a.total_cmp(b));
        let med = v.get(v.len() / 2).copied().unwrap_or(5.0);
        ((self.depth.load(Ordering::Relaxed) as f64 + 1.0) * med).ceil().clamp(1.0, 3600.0) as u64
    }

    fn set_ready(&self, ready: bool, reason: Option<String>) {
        self.ready.store(ready, Ordering::Relaxed);
        *self.reason.lock().unwrap_or_else(|p| p.into_inner()) = reason;
        metrics::ranks(self.ranks, if ready { self.ranks } else { 1 });
    }
}

/// Handle to submit jobs.
#[derive(Clone)]
pub struct Queue {
    tx: SyncSender<Queued>,
    shared: Arc<Shared>,
}

impl Queue {
    /// Starts the worker thread owning `world`; returns the queue and the worker's handle.
    pub fn start(world: World, capacity: usize) -> (Self, Arc<Shared>, std::thread::JoinHandle<()>) {
        let (tx, rx) = sync_channel::<Queued>(capacity.max(1));
        let shared = Arc::new(Shared {
            depth: AtomicUsize::new(0),
            capacity: capacity.max(1),
            ready: AtomicBool::new(true),
            reason: Mutex::new(None),
            ranks: world.size(),
            fatal: tokio::sync::Notify::new(),
            recent: Mutex::new(Vec::new()),
        });
        metrics::ranks(shared.ranks, shared.ranks);
        metrics::queue_capacity(shared.capacity);
        metrics::queue_depth(0);
        let s = shared.clone();
        let h = std::thread::Builder::new()
            .name("job-worker".into())
            .spawn(move || worker(world, rx, s))
            .unwrap_or_else(|e| panic!("cannot start the job worker: {e}"));
        (Self { tx, shared: shared.clone() }, shared, h)
    }

    /// Enqueues a job, or says the queue is full.
    pub fn submit(&self, q: Queued) -> Result<(), ApiError> {
        self.shared.depth.fetch_add(1, Ordering::Relaxed);
        match self.tx.try_send(q) {
            Ok(()) => {
                metrics::queue_depth(self.shared.depth.load(Ordering::Relaxed));
                Ok(())
            }
            Err(e) => {
                self.shared.depth.fetch_sub(1, Ordering::Relaxed);
                let mut err = match e {
                    TrySendError::Full(_) => ApiError::new(
                        429,
                        "queue_full",
                        format!("the job queue is full ({} jobs); retry later", self.shared.capacity),
                    ),
                    TrySendError::Disconnected(_) => {
                        ApiError::new(503, "shutting_down", "the service is shutting down")
                    }
                };
                err.retry_after = Some(self.shared.retry_after());
                Err(err)
            }
        }
    }
}

fn worker(mut world: World, rx: Receiver<Queued>, shared: Arc<Shared>) {
    for q in rx.iter() {
        let depth = shared.depth.fetch_sub(1, Ordering::Relaxed).saturating_sub(1);
        metrics::queue_depth(depth);
        let method = q.job.options.method.to_string();
        if q.cancel.load(Ordering::Relaxed) {
            metrics::job_outcome(&method, "cancelled");
            metrics::error("cancelled");
            continue;
        }
        let now = Instant::now();
        ::metrics::histogram!(metrics::QUEUE_WAIT_SECONDS).record(now.duration_since(q.accepted).as_secs_f64());
        if now >= q.deadline {
            metrics::job_outcome(&method, "deadline");
            let _ = q.events.send(Event::Failed(ApiError::new(
                504,
                "deadline",
                "the job's deadline passed while it was queued",
            )));
            continue;
        }
        if !shared.ready.load(Ordering::Relaxed) {
            if world.repair() {
                shared.set_ready(true, None);
            } else {
                let _ = q.events.send(Event::Failed(ApiError::new(503, "rank_failure", "the ranks are down")));
                continue;
            }
        }
        let _guard = metrics::InFlight::start();
        let (cancel, deadline, events) = (q.cancel.clone(), q.deadline, q.events.clone());
        let mut timed_out = false;
        let mut on_text = |s: &str| {
            if cancel.load(Ordering::Relaxed) {
                return false;
            }
            if Instant::now() >= deadline {
                timed_out = true;
                return false;
            }
            events.send(Event::Text(s.to_string())).is_ok()
        };
        let t = Instant::now();
        let out = world.run(&q.job, &mut on_text);
        let secs = t.elapsed().as_secs_f64();
        {
            let mut r = shared.recent.lock().unwrap_or_else(|p| p.into_inner());
            r.push(secs);
            let n = r.len();
            if n > 32 {
                r.drain(..n - 32);
            }
        }
        match out {
            Ok(_) if q.cancel.load(Ordering::Relaxed) => {
                metrics::job_outcome(&method, "cancelled");
                metrics::error("cancelled");
            }
            Ok(_) if timed_out => {
                metrics::job_outcome(&method, "deadline");
                let secs = q.deadline.duration_since(q.accepted).as_secs_f64();
                let _ = q.events.send(Event::Failed(ApiError::new(
                    504,
                    "deadline",
                    format!("the job exceeded its deadline of {secs:.0} s"),
                )));
            }
            Ok(r) => {
                metrics::record_job(&r, world.leader().store().stats().bytes);
                let _ = q.events.send(Event::Done(Box::new(r)));
            }
            Err((lost, msg)) => {
                if lost {
                    metrics::job_outcome(&method, "error");
                    shared.set_ready(false, Some(msg.clone()));
                    let _ = q.events.send(Event::Failed(ApiError::new(
                        503,
                        "rank_failure",
                        format!("a rank failed: {msg}"),
                    )));
                    if world.repair() {
                        shared.set_ready(true, None);
                    } else {
                        shared.fatal.notify_one();
                    }
                } else {
                    metrics::job_outcome(&method, "error");
                    let (status, kind) =
                        if msg.contains("context window") || msg.contains("empty") || msg.contains("missing") {
                            (400, "bad_request")
                        } else {
                            (500, "internal")
                        };
                    let _ = q.events.send(Event::Failed(ApiError::new(status, kind, msg)));
                }
            }
        }
    }
    world.shutdown();
}

/// Deadline of a job: its own, capped by the server's limit.
pub fn deadline_of(requested: Option<f64>, limit: Duration) -> Instant {
    let d = requested.map_or(limit, |s| Duration::from_secs_f64(s).min(limit));
    Instant::now() + d
}
