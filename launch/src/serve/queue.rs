//! The bounded job queue, the executor that owns the world of ranks, and the watchdog that
//! replaces an executor stuck on a job.
//!
//! ```text
//!   HTTP handlers ── try_send ──> [ queue (bounded) ] ──> executor thread (rank 0)
//!        ^                          full: 429 + Retry-After     │ one job at a time, over all
//!        │                                                      │ ranks; a panic fails the job
//!        └──── events (admitted, text, result or error) ────────┘ and the world is rebuilt
//!   watchdog: a job still running well past its deadline means rank 0 is stuck: the job gets
//!             503, and a new executor with a new world takes the queue over (thread ranks),
//!             or the service stops with an error (MPI: a world cannot be rebuilt)
//! ```
//! A handler that goes away (client disconnected) drops its [`CancelOnDrop`], which flags the
//! job: a queued job is skipped, a running one stops before its next layer on every rank.
//! Each job has a deadline (queueing included), checked the same way. A failed rank marks the
//! world down: the job gets a 503, `/readyz` says why, and thread ranks are rebuilt before the
//! next job. Errors are counted where they are answered (the handler); the executor counts
//! only cancellations, which nobody answers.

use super::api::ApiError;
use super::metrics;
use flowprefill_coordinator::world::panic_message;
use flowprefill_coordinator::{Control, CoordError, ErrorClass, Job, JobProgress, RunResult};
use flowprefill_kernels::Device;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;

/// What a job sends back to its handler.
#[derive(Debug)]
pub enum Event {
    /// Every rank accepted the job (its input passed every check); work starts.
    Admitted,
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
    /// When it was accepted (queued).
    pub accepted: Instant,
    /// When its request arrived (before reading the body and admission).
    pub arrived: Instant,
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

/// The ranks the executor computes with (thread ranks, or rank 0 of an MPI job).
pub type World = flowprefill_coordinator::World<Device>;

/// Builds a fresh world (thread ranks) when the executor's is stuck.
pub type WorldFactory = Box<dyn Fn() -> anyhow::Result<World> + Send + Sync>;

/// A job being computed, as the watchdog sees it.
struct Running {
    method: String,
    /// Past this, rank 0 is considered stuck.
    hard_deadline: Instant,
    events: UnboundedSender<Event>,
    /// What rank 0 made known of the job (the method `auto` chose, the answer's tokens).
    progress: Arc<JobProgress>,
}

/// `method` (the request's label) or, once `auto` has chosen, the chosen method's.
fn label_of(progress: &JobProgress, method: &str) -> String {
    progress.chosen().map_or_else(|| method.to_string(), |(m, reorder)| metrics::method_label(m, reorder))
}

/// State shared between the executor, the watchdog and the handlers.
pub struct Shared {
    /// Jobs waiting.
    pub depth: AtomicUsize,
    /// Jobs accepted and not finished (waiting or computing).
    pub outstanding: AtomicUsize,
    /// Queue capacity.
    pub capacity: usize,
    /// All ranks usable.
    pub ready: AtomicBool,
    /// Why not ready.
    pub reason: Mutex<Option<String>>,
    /// Ranks of the world.
    pub ranks: usize,
    /// Set when the world failed and cannot be rebuilt: the service must stop.
    pub fatal: AtomicBool,
    /// The fatal failure was a GPU this process can no longer use (exit 69, not 4).
    pub device_lost: AtomicBool,
    /// Wakes whoever waits for a fatal failure or for the last job to finish.
    pub changed: tokio::sync::Notify,
    /// Recent job durations (seconds), for Retry-After.
    pub recent: Mutex<Vec<f64>>,
    /// The executor that owns the world; an older one is abandoned (stuck).
    generation: AtomicU64,
    running: Mutex<Option<Running>>,
    /// How long past its deadline a job may run before rank 0 is declared stuck.
    hang_grace: Duration,
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
        metrics::ranks(self.ranks, if ready { self.ranks } else { 0 });
    }

    fn set_fatal(&self, reason: String) {
        self.set_ready(false, Some(reason));
        self.fatal.store(true, Ordering::SeqCst);
        self.changed.notify_waiters();
    }

    /// A GPU this process can no longer use (`e`, of [`ErrorClass::Device`]): rebuilt ranks
    /// would meet it again and every later job would fail on it, so the service stops (exit
    /// 69) for whatever runs it to start a new process. A job's and an ingestion's alike.
    pub(super) fn lose_device(&self, e: &CoordError) {
        self.device_lost.store(true, Ordering::SeqCst);
        self.set_fatal(format!("a GPU can no longer be used by this process: {e}"));
    }

    pub(super) fn finished_one(&self) {
        if self.outstanding.fetch_sub(1, Ordering::Relaxed) == 1 {
            self.changed.notify_waiters();
        }
    }

    /// The answer to a job the service can no longer compute (the ranks failed for good).
    fn stopping(&self) -> ApiError {
        let why = self.reason.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let why = why.unwrap_or_else(|| "the ranks failed".into());
        let kind = if self.device_lost.load(Ordering::SeqCst) { "device_failure" } else { "rank_failure" };
        ApiError::new(503, kind, format!("the service is stopping: {why}"))
    }

    /// The job computing now (`None`: none), shown by the jobs-in-flight gauge. The gauge follows
    /// this slot, not the executor's stack: a job the watchdog gave up on leaves it at once.
    fn set_running(&self, job: Option<Running>) {
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        metrics::jobs_in_flight(usize::from(job.is_some()));
        *running = job;
    }

    /// Takes the running job if `pred` holds for it; the gauge drops to 0 when one is taken.
    fn take_running_if(&self, pred: impl FnOnce(&Running) -> bool) -> Option<Running> {
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        let taken = running.take_if(|r| pred(r));
        if taken.is_some() {
            metrics::jobs_in_flight(0);
        }
        taken
    }

    fn record_duration(&self, secs: f64) {
        let mut r = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        r.push(secs);
        let n = r.len();
        if n > 32 {
            r.drain(..n - 32);
        }
    }
}

/// Handle to submit jobs.
#[derive(Clone)]
pub struct Queue {
    tx: Arc<Mutex<Option<SyncSender<Queued>>>>,
    shared: Arc<Shared>,
}

/// The threads behind a queue.
pub struct Workers {
    executor: Arc<Mutex<Option<std::thread::JoinHandle<()>>>>,
    watchdog: Option<std::thread::JoinHandle<()>>,
}

impl Workers {
    /// Waits for the current executor to drain the queue and stop its world, at most `limit`
    /// (a stuck executor is left behind).
    pub fn join(mut self, limit: Duration) {
        let t = Instant::now();
        let exec = self.executor.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(h) = exec {
            while !h.is_finished() && t.elapsed() < limit {
                std::thread::sleep(Duration::from_millis(20));
            }
            if h.is_finished() {
                let _ = h.join();
            }
        }
        if let Some(w) = self.watchdog.take() {
            let _ = w.join();
        }
    }
}

impl Queue {
    /// Starts the executor owning `world` and the watchdog; `factory` builds a replacement
    /// world when an executor is stuck (none: the service stops instead).
    pub fn start(
        world: World,
        factory: Option<WorldFactory>,
        capacity: usize,
        hang_grace: Duration,
    ) -> std::io::Result<(Self, Arc<Shared>, Workers)> {
        let (tx, rx) = sync_channel::<Queued>(capacity.max(1));
        let shared = Arc::new(Shared {
            depth: AtomicUsize::new(0),
            outstanding: AtomicUsize::new(0),
            capacity: capacity.max(1),
            ready: AtomicBool::new(true),
            reason: Mutex::new(None),
            ranks: world.size(),
            fatal: AtomicBool::new(false),
            device_lost: AtomicBool::new(false),
            changed: tokio::sync::Notify::new(),
            recent: Mutex::new(Vec::new()),
            generation: AtomicU64::new(0),
            running: Mutex::new(None),
            hang_grace,
        });
        metrics::ranks(shared.ranks, shared.ranks);
        metrics::queue_capacity(shared.capacity);
        metrics::queue_depth(0);
        metrics::jobs_in_flight(0);
        let rx = Arc::new(Mutex::new(rx));
        let executor = Arc::new(Mutex::new(Some(spawn_executor(world, rx.clone(), shared.clone(), 0)?)));
        let watchdog = {
            let (shared, executor) = (shared.clone(), executor.clone());
            std::thread::Builder::new()
                .name("job-watchdog".into())
                .spawn(move || watchdog(shared, rx, executor, factory))?
        };
        let queue = Self { tx: Arc::new(Mutex::new(Some(tx))), shared: shared.clone() };
        Ok((queue, shared, Workers { executor, watchdog: Some(watchdog) }))
    }

    /// Enqueues a job, or says the queue is full.
    pub fn submit(&self, q: Queued, closing: &AtomicBool) -> Result<(), ApiError> {
        let tx = self.tx.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let Some(tx) = tx else {
            return Err(ApiError::new(503, "shutting_down", "the service is shutting down"));
        };
        // Counted before the flags are read: a drain that starts meanwhile either sees this job
        // outstanding and waits for it, or this job sees the drain and is refused (a job taken
        // between the flag's check and the count was dropped unanswered by the closing server).
        self.shared.outstanding.fetch_add(1, Ordering::SeqCst);
        if self.shared.fatal.load(Ordering::SeqCst) {
            self.shared.finished_one();
            return Err(self.shared.stopping());
        }
        if closing.load(Ordering::SeqCst) {
            self.shared.finished_one();
            return Err(ApiError::new(503, "shutting_down", "the service is shutting down"));
        }
        self.shared.depth.fetch_add(1, Ordering::Relaxed);
        match tx.try_send(q) {
            Ok(()) => {
                metrics::queue_depth(self.shared.depth.load(Ordering::Relaxed));
                Ok(())
            }
            Err(e) => {
                self.shared.depth.fetch_sub(1, Ordering::Relaxed);
                self.shared.finished_one();
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

    /// Takes no more jobs: the executor finishes the queued ones, stops the ranks and ends.
    pub fn close(&self) {
        self.tx.lock().unwrap_or_else(|p| p.into_inner()).take();
    }
}

fn spawn_executor(
    world: World,
    rx: Arc<Mutex<Receiver<Queued>>>,
    shared: Arc<Shared>,
    generation: u64,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new().name(format!("job-executor-{generation}")).spawn(move || {
        executor(world, rx, shared, generation);
    })
}

/// The executor's loop: one job at a time until the queue closes or a newer executor took
/// over (this one was declared stuck).
fn executor(mut world: World, rx: Arc<Mutex<Receiver<Queued>>>, shared: Arc<Shared>, generation: u64) {
    let current = |s: &Shared| s.generation.load(Ordering::Relaxed) == generation;
    let tick = world.idle_every();
    loop {
        let next = {
            let rx = rx.lock().unwrap_or_else(|p| p.into_inner());
            if !current(&shared) {
                break;
            }
            rx.recv_timeout(tick)
        };
        let q = match next {
            Ok(q) => q,
            // No job: the followers hear that rank 0 is alive (their wait for the next job
            // has the comm timeout's deadline). A lost follower shows here; the next job finds
            // the world down and rebuilds it (thread ranks) or fails it (MPI).
            Err(RecvTimeoutError::Timeout) => {
                if let Err(e) = world.idle() {
                    // Not ready until the ranks are rebuilt (thread ranks), or for good (MPI):
                    // the next job is refused at once instead of waiting out the deadline.
                    tracing::warn!("between jobs, a rank did not answer rank 0: {e}");
                    shared.set_ready(false, Some(format!("between jobs, a rank did not answer rank 0: {e}")));
                    if world.repair() {
                        shared.set_ready(true, None);
                    } else {
                        shared.set_fatal(format!(
                            "a rank did not answer between jobs, and an MPI world cannot be rebuilt: {e}"
                        ));
                        break;
                    }
                }
                let store = world.leader().store();
                metrics::store_bytes(store.stats().bytes, store.disk_stats());
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => break,
        };
        let depth = shared.depth.fetch_sub(1, Ordering::Relaxed).saturating_sub(1);
        metrics::queue_depth(depth);
        execute(&mut world, q, &shared, generation);
        if !current(&shared) {
            // Declared stuck while computing: the job was already answered; a newer executor
            // owns the queue now.
            return;
        }
        if shared.fatal.load(Ordering::Relaxed) {
            break;
        }
    }
    if current(&shared) {
        if shared.fatal.load(Ordering::SeqCst) {
            fail_waiting(&rx, &shared);
        }
        world.shutdown();
    }
}

/// After a fatal failure: answers every job still waiting with 503 and the reason. Dropped
/// with the queue, they were answered 500 "the job ended without a result", and never counted.
fn fail_waiting(rx: &Mutex<Receiver<Queued>>, shared: &Shared) {
    let rx = rx.lock().unwrap_or_else(|p| p.into_inner());
    while let Ok(q) = rx.try_recv() {
        let method = metrics::method_label(q.job.options.method, q.job.options.reorder);
        metrics::job_outcome(&method, "error");
        let _ = q.events.send(Event::Failed(shared.stopping()));
        let _ = shared.depth.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |d| Some(d.saturating_sub(1)));
        shared.finished_one();
    }
    metrics::queue_depth(shared.depth.load(Ordering::Relaxed));
}

/// Runs one dequeued job and answers it.
fn execute(world: &mut World, q: Queued, shared: &Arc<Shared>, generation: u64) {
    let method = metrics::method_label(q.job.options.method, q.job.options.reorder);
    let answer = |e: ApiError| {
        let _ = q.events.send(Event::Failed(e));
    };
    if q.cancel.load(Ordering::Relaxed) {
        metrics::job_outcome(&method, "cancelled");
        metrics::error("cancelled");
        shared.finished_one();
        return;
    }
    let now = Instant::now();
    ::metrics::histogram!(metrics::QUEUE_WAIT_SECONDS).record(now.duration_since(q.accepted).as_secs_f64());
    if now >= q.deadline {
        metrics::job_outcome(&method, "deadline");
        answer(ApiError::new(504, "deadline", "the job's deadline passed before it started (it counts from the request's arrival: admission and the queue)"));
        shared.finished_one();
        return;
    }
    if !shared.ready.load(Ordering::Relaxed) {
        if world.repair() {
            shared.set_ready(true, None);
        } else {
            let why = shared.reason.lock().unwrap_or_else(|p| p.into_inner()).clone();
            // Counted as the other rank failures are (the error-rate alert reads the outcome).
            metrics::job_outcome(&method, "error");
            answer(ApiError::new(503, "rank_failure", format!("the ranks are down: {}", why.unwrap_or_default())));
            shared.finished_one();
            return;
        }
    }
    let progress = Arc::new(JobProgress::default());
    shared.set_running(Some(Running {
        method: method.clone(),
        hard_deadline: q.deadline + shared.hang_grace,
        events: q.events.clone(),
        progress: progress.clone(),
    }));
    let (cancel, events) = (q.cancel.clone(), q.events.clone());
    let admitted = q.events.clone();
    let ctl = Control {
        cancel: Some(q.cancel.clone()),
        deadline: Some(q.deadline),
        on_admitted: Some(Box::new(move || {
            let _ = admitted.send(Event::Admitted);
        })),
        progress: Some(progress.clone()),
    };
    let mut on_text = |s: &str| !cancel.load(Ordering::Relaxed) && events.send(Event::Text(s.to_string())).is_ok();
    // The phase gauge follows rank 0's phases live (this thread leads the job), while the job is
    // this executor's: one the watchdog gave up on no longer moves it.
    let phases = {
        let (shared, last) = (shared.clone(), std::cell::Cell::new(None));
        flowprefill_coordinator::timings::watch_phases(move |p| {
            // Under the running slot's lock, as the watchdog takes the job and zeroes the
            // gauges: a job it took no longer sets a phase after that.
            let running = shared.running.lock().unwrap_or_else(|p| p.into_inner());
            if running.is_some() && shared.generation.load(Ordering::Relaxed) == generation {
                metrics::job_phase(last.replace(p), p);
            }
        })
    };
    let t = Instant::now();
    let out = std::panic::catch_unwind(AssertUnwindSafe(|| world.lead_with(&q.job, ctl, &mut on_text)))
        .unwrap_or_else(|p| Err(CoordError::Panicked { rank: 0, message: panic_message(p) }));
    drop(phases);
    shared.record_duration(t.elapsed().as_secs_f64());
    // The watchdog may have given up on this job (and this executor) meanwhile.
    let still_mine =
        shared.generation.load(Ordering::Relaxed) == generation && shared.take_running_if(|_| true).is_some();
    if !still_mine {
        return;
    }
    // From the request's arrival to the job's start on the ranks: what the client waited
    // before the engine's own clock started (reading the body, admission, the queue).
    let before = t.saturating_duration_since(q.arrived);
    // The same label for every outcome: the method as the job ran it.
    let method = label_of(&progress, &method);
    match out {
        Ok(r) if q.cancel.load(Ordering::Relaxed) => {
            metrics::job_outcome(&method, "cancelled");
            metrics::error("cancelled");
            // A client that left after its first tokens had them: that wait counts too.
            metrics::record_first_token(&r, before);
            metrics::generated_tokens(&r);
            // The store's faults the ranks reported with it are counted all the same.
            metrics::store_faults_of(&r);
        }
        Ok(r) => {
            let store = world.leader().store();
            metrics::record_job(&r, before, store.stats().bytes, store.disk_stats());
            let _ = q.events.send(Event::Done(Box::new(r)));
        }
        Err(e) => {
            // What it produced before it failed was produced (and streamed) all the same.
            metrics::generated_token_count(&method, progress.answer_tokens());
            let mut err = ApiError::from_coord(&e);
            if let Some(device) = e.out_of_memory_device() {
                // Not the request's fault: the same job may fit once memory is free.
                err.retry_after = Some(shared.retry_after());
                metrics::out_of_memory(&device);
            }
            metrics::job_outcome(&method, err.outcome());
            if err.kind == "cancelled" {
                metrics::error("cancelled");
            }
            if matches!(e, CoordError::Panicked { rank: 0, .. }) {
                world.abandon_job(&e.to_string());
            }
            if e.class() == ErrorClass::Device {
                shared.lose_device(&e);
            } else if e.breaks_world() {
                // Settle the world before answering: a client that retries at once finds the
                // ranks rebuilt (or the service stopping).
                shared.set_ready(false, Some(e.to_string()));
                if world.repair() {
                    shared.set_ready(true, None);
                } else {
                    shared.set_fatal(format!("the world of ranks failed and cannot be rebuilt: {e}"));
                }
            }
            answer(err);
        }
    }
    shared.finished_one();
}

/// Declares an executor stuck when its job runs `hang_grace` past its deadline, answers that
/// job, and hands the queue to a new executor with a new world (or stops the service).
fn watchdog(
    shared: Arc<Shared>,
    rx: Arc<Mutex<Receiver<Queued>>>,
    executor: Arc<Mutex<Option<std::thread::JoinHandle<()>>>>,
    factory: Option<WorldFactory>,
) {
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let finished = executor.lock().unwrap_or_else(|p| p.into_inner()).as_ref().is_none_or(|h| h.is_finished());
        if finished || shared.fatal.load(Ordering::Relaxed) {
            return;
        }
        let stuck = shared.take_running_if(|r| Instant::now() >= r.hard_deadline);
        let Some(job) = stuck else { continue };
        let generation = shared.generation.fetch_add(1, Ordering::Relaxed) + 1;
        let why = format!(
            "rank 0 did not finish a job within {} s after its deadline (stuck)",
            shared.hang_grace.as_secs_f64()
        );
        tracing::error!("{why}");
        let method = label_of(&job.progress, &job.method);
        metrics::job_outcome(&method, "error");
        metrics::generated_token_count(&method, job.progress.answer_tokens());
        shared.set_ready(false, Some(why.clone()));
        let _ = job.events.send(Event::Failed(ApiError::new(503, "rank_failure", why.clone())));
        shared.finished_one();
        let fresh =
            factory.as_ref().map(|f| f().and_then(|w| Ok(spawn_executor(w, rx.clone(), shared.clone(), generation)?)));
        match fresh {
            Some(Ok(h)) => {
                // The stuck thread is abandoned, never joined.
                *executor.lock().unwrap_or_else(|p| p.into_inner()) = Some(h);
                shared.set_ready(true, None);
                continue;
            }
            Some(Err(e)) => shared.set_fatal(format!("{why}, but a new world could not be built: {e}")),
            None => shared.set_fatal(format!("{why}; an MPI world cannot be rebuilt: stopping")),
        }
        // No executor is left to take the waiting jobs: they are answered here.
        return fail_waiting(&rx, &shared);
    }
}

/// Deadline of a job that arrived at `now`: its own, capped by the server's limit.
pub fn deadline_of(requested: Option<f64>, limit: Duration, now: Instant) -> Instant {
    // `try_from_secs_f64` refuses what does not fit a Duration (1e20 s): the server's limit
    // applies then, as it does to any request above it.
    let d = requested.and_then(|s| Duration::try_from_secs_f64(s).ok()).map_or(limit, |d| d.min(limit));
    now.checked_add(d).unwrap_or(now + limit)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A job's deadline counts from its arrival (the time given), capped by the server's limit.
    #[test]
    fn a_deadline_counts_from_the_arrival_and_the_limit_caps_it() {
        let arrived = Instant::now() - Duration::from_secs(3);
        let limit = Duration::from_secs(60);
        assert_eq!(deadline_of(Some(5.0), limit, arrived), arrived + Duration::from_secs(5));
        assert_eq!(deadline_of(None, limit, arrived), arrived + limit);
        assert_eq!(deadline_of(Some(600.0), limit, arrived), arrived + limit);
        assert_eq!(deadline_of(Some(1e20), limit, arrived), arrived + limit);
    }
}
