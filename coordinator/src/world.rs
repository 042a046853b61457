//! Running jobs over a world of ranks: threads of this process, or MPI processes.
//!
//! ```text
//!   rank 0 (the caller's thread):  lead(job) ... lead(job) ... stop()
//!   ranks 1..P (threads or processes):  follow()  -- run each job rank 0 broadcasts, until stop
//! ```
//! A job that fails (bad input, a cancellation, a deadline, an error on one rank) is over on
//! every rank and the world runs the next one (see the engine's module docs). A rank that
//! panics or stops answering breaks the world: rank 0's collective fails with an error naming
//! it (immediately for a dead thread, after the deadline for a hung one), or rank 0's own
//! panic is caught; the world is marked broken, and [`ThreadRanks::rebuild`] starts fresh
//! ranks. A hung thread cannot be killed; it is abandoned, never waited for.

use crate::engine::{Control, DiskTier, Engine, RunResult};
pub use crate::error::panic_message;
use crate::error::{internal, CoordError, Result};
use crate::fault::FaultPlan;
use crate::request::Job;
use flowprefill_comm::local::LocalComm;
use flowprefill_comm::{Communicator, ProcessGroup};
use flowprefill_kernels::Backend;
use flowprefill_worker::{Field, InputError, LoadedModel};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// One job on this process's rank of a world: rank 0 leads, broadcasts stop and returns the
/// result; the others follow until rank 0 stops them (one-shot use, e.g. under mpirun).
pub fn run_rank<B: Backend>(
    engine: &Engine<B>,
    comm: &mut dyn Communicator,
    job: &Job,
    on_text: &mut dyn FnMut(&str) -> bool,
) -> Result<Option<RunResult>> {
    if comm.rank() == 0 {
        let lead = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| engine.lead(comm, job, on_text)));
        let r = match lead {
            Ok(r) => r,
            Err(p) => {
                // The followers hear it now: they waited for rank 0's next word until their
                // deadline (60 s by default), and mpirun then reported their timeout, not this.
                let e = CoordError::Panicked { rank: 0, message: panic_message(p) };
                comm.leave(&e.to_string());
                return Err(e);
            }
        };
        // Stop the followers even after a failed job (they skip jobs that fail everywhere).
        let stopped = Engine::<B>::stop(comm);
        let r = r?;
        stopped?;
        Ok(Some(r))
    } else {
        engine.follow(comm)?;
        Ok(None)
    }
}

/// Sets a rank's device plane up (NCCL on its GPU) on the rank's own thread, every rank at
/// once (NCCL's communicator creation waits for all of them): given the rank's communicator
/// and its model's backend.
pub type PlaneSetup<B> = Arc<dyn Fn(&mut dyn Communicator, &B) -> std::result::Result<(), String> + Send + Sync>;

/// A persistent world of thread ranks; each rank has its own engine (and chunk store) and
/// either one shared model (the CPU) or a model of its own (one GPU per rank, with a device
/// plane between them). Rank 0 runs on the caller's thread.
pub struct ThreadRanks<B: Backend> {
    parts: Parts<B>,
    leader: Engine<B>,
    comm: LocalComm,
    followers: Vec<JoinHandle<Result<usize>>>,
    broken: Option<String>,
}

/// What a world is built from.
struct Parts<B: Backend> {
    lms: Vec<Arc<LoadedModel<B>>>,
    aux: Vec<Arc<LoadedModel<B>>>,
    faults: Option<Arc<FaultPlan>>,
    plane: Option<PlaneSetup<B>>,
    ranks: usize,
    store_bytes: usize,
    disk: Option<DiskTier>,
    memory_limit: Option<usize>,
    timeout: Duration,
    chooser: Option<Arc<dyn crate::auto::Chooser>>,
    decode_graphs: bool,
}

impl<B: Backend> Parts<B> {
    /// `ranks` ranks over `lms`, with the faults of the environment and nothing else.
    fn of(lms: Vec<Arc<LoadedModel<B>>>, ranks: usize, store_bytes: usize, timeout: Duration) -> Self {
        Parts {
            lms,
            aux: vec![],
            faults: FaultPlan::from_env(),
            plane: None,
            ranks,
            store_bytes,
            disk: None,
            memory_limit: None,
            timeout,
            chooser: None,
            decode_graphs: true,
        }
    }
}

impl<B: Backend> ThreadRanks<B> {
    /// Starts `ranks - 1` follower threads sharing `lm`.
    pub fn new(lm: Arc<LoadedModel<B>>, ranks: usize, store_bytes: usize, timeout: Duration) -> Result<Self> {
        Self::build(Parts::of(vec![lm], ranks, store_bytes, timeout))
    }

    /// A world of one rank per model (each on its own device): rank r runs `lms[r]`.
    pub fn per_rank(lms: Vec<Arc<LoadedModel<B>>>, store_bytes: usize, timeout: Duration) -> Result<Self> {
        let ranks = lms.len();
        Self::build(Parts::of(lms, ranks, store_bytes, timeout))
    }

    fn parts(&self) -> Parts<B> {
        let p = &self.parts;
        Parts {
            lms: p.lms.clone(),
            aux: p.aux.clone(),
            faults: p.faults.clone(),
            plane: p.plane.clone(),
            disk: p.disk.clone(),
            chooser: p.chooser.clone(),
            ..*p
        }
    }

    /// The same world with `aux` as CacheClip's auxiliary model on every rank.
    pub fn with_aux(self, aux: Arc<LoadedModel<B>>) -> Result<Self> {
        self.with_aux_per_rank(vec![aux])
    }

    /// The same world with an auxiliary model per rank (`aux[r]` on rank r; one is shared).
    pub fn with_aux_per_rank(self, aux: Vec<Arc<LoadedModel<B>>>) -> Result<Self> {
        let parts = Parts { aux, ..self.parts() };
        drop(self);
        Self::build(parts)
    }

    /// The same world with the faults of `plan` injected (failure tests; the plan fires once,
    /// also across rebuilds).
    pub fn with_faults(self, plan: Option<Arc<FaultPlan>>) -> Result<Self> {
        let parts = Parts { faults: plan, ..self.parts() };
        drop(self);
        Self::build(parts)
    }

    /// The same world planning every job within `bytes` of each rank's device (see
    /// [`Engine::with_memory_limit`]).
    pub fn with_memory_limit(self, bytes: Option<usize>) -> Result<Self> {
        let parts = Parts { memory_limit: bytes, ..self.parts() };
        drop(self);
        Self::build(parts)
    }

    /// The same world with its ranks' decode steps recorded and replayed or not (see
    /// [`Engine::with_decode_graphs`]).
    pub fn with_decode_graphs(self, on: bool) -> Result<Self> {
        let parts = Parts { decode_graphs: on, ..self.parts() };
        drop(self);
        Self::build(parts)
    }

    /// The same world with the chunk store's disk tier `tier` under every rank's store (they
    /// share its folder; see `flowprefill_worker::store::disk`).
    pub fn with_disk(self, tier: Option<DiskTier>) -> Result<Self> {
        let parts = Parts { disk: tier, ..self.parts() };
        drop(self);
        Self::build(parts)
    }

    /// The same world resolving `--method auto` with `chooser` (rank 0 asks it).
    pub fn with_chooser(self, chooser: Option<Arc<dyn crate::auto::Chooser>>) -> Result<Self> {
        let parts = Parts { chooser, ..self.parts() };
        drop(self);
        Self::build(parts)
    }

    /// The same world with a device plane on every rank, made by `setup` (also after a rebuild).
    pub fn with_plane(self, setup: PlaneSetup<B>) -> Result<Self> {
        let parts = Parts { plane: Some(setup), ..self.parts() };
        drop(self);
        Self::build(parts)
    }

    fn model(&self, rank: usize) -> Result<&Arc<LoadedModel<B>>> {
        self.parts.lms.get(rank % self.parts.lms.len().max(1)).ok_or_else(|| internal("a world without a model"))
    }

    fn engine(&self, rank: usize) -> Result<Engine<B>> {
        let e = Engine::new(self.model(rank)?.clone(), self.parts.store_bytes)
            .with_faults(self.parts.faults.clone())
            .with_disk(self.parts.disk.as_ref());
        // One model for every rank: one device's memory holds every rank's job.
        let e = if self.parts.lms.len() == 1 { e.with_memory_peers(self.parts.ranks) } else { e };
        let e = e.with_memory_limit(self.parts.memory_limit).with_chooser(self.parts.chooser.clone());
        let e = e.with_decode_graphs(self.parts.decode_graphs);
        match self.parts.aux.len() {
            0 => Ok(e),
            n => e.with_aux(self.parts.aux[rank % n].clone()),
        }
    }

    fn build(p: Parts<B>) -> Result<Self> {
        if p.ranks == 0 {
            return Err(InputError::new(Field::Ranks, "must be at least 1").into());
        }
        if p.lms.is_empty() || (p.lms.len() > 1 && p.lms.len() != p.ranks) {
            return Err(internal(format!("{} models for {} ranks", p.lms.len(), p.ranks)));
        }
        let leader = Engine::new(p.lms[0].clone(), p.store_bytes);
        let mut w = Self {
            parts: p,
            leader,
            comm: LocalComm::group(1).pop().ok_or_else(|| internal("no rank 0"))?,
            followers: Vec::new(),
            broken: None,
        };
        w.leader = w.engine(0)?;
        let (comm, followers) = w.spawn()?;
        (w.comm, w.followers) = (comm, followers);
        Ok(w)
    }

    fn spawn(&self) -> Result<(LocalComm, Vec<JoinHandle<Result<usize>>>)> {
        let mut comms = LocalComm::group(self.parts.ranks).into_iter();
        let mut comm = comms.next().ok_or_else(|| internal("no rank 0"))?;
        comm.set_timeout(self.parts.timeout);
        let mut followers = Vec::with_capacity(self.parts.ranks - 1);
        for mut c in comms {
            c.set_timeout(self.parts.timeout);
            let rank = c.rank();
            let engine = self.engine(rank)?;
            let (lm, plane) = (self.model(rank)?.clone(), self.parts.plane.clone());
            let h = std::thread::Builder::new()
                .name(format!("rank-{rank}"))
                .spawn(move || {
                    if let Some(setup) = plane {
                        if let Err(why) = setup(&mut c, lm.model.backend()) {
                            let e = internal(format!("rank {rank}: its device plane: {why}"));
                            c.leave(&e.to_string());
                            return Err(e);
                        }
                    }
                    engine.follow(&mut c)
                })
                .map_err(|e| internal(format!("cannot start rank {rank}: {e}")))?;
            followers.push(h);
        }
        if let Some(setup) = &self.parts.plane {
            if let Err(why) = setup(&mut comm, self.model(0)?.model.backend()) {
                let e = internal(format!("rank 0: its device plane: {why}"));
                comm.leave(&e.to_string());
                return Err(e);
            }
        }
        Ok((comm, followers))
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.parts.ranks
    }

    /// Rank 0's engine.
    pub fn leader(&self) -> &Engine<B> {
        &self.leader
    }

    /// Why the world is unusable, if it is.
    pub fn broken(&self) -> Option<&str> {
        self.broken.as_deref()
    }

    /// Runs one job on every rank; `on_text` receives the answer as it is generated.
    pub fn run(&mut self, job: &Job, on_text: &mut dyn FnMut(&str) -> bool) -> Result<RunResult> {
        self.run_with(job, Control::default(), on_text)
    }

    /// [`ThreadRanks::run`] under the caller's [`Control`]. A panic on rank 0 is caught: the
    /// job fails with [`CoordError::Panicked`] and the world is marked broken.
    pub fn run_with(
        &mut self,
        job: &Job,
        ctl: Control<'_>,
        on_text: &mut dyn FnMut(&str) -> bool,
    ) -> Result<RunResult> {
        if let Some(why) = &self.broken {
            return Err(CoordError::WorldDown(why.clone()));
        }
        let (leader, comm) = (&self.leader, &mut self.comm);
        let run = std::panic::AssertUnwindSafe(|| leader.lead_with(comm, job, ctl, on_text));
        let out = std::panic::catch_unwind(run)
            .unwrap_or_else(|p| Err(CoordError::Panicked { rank: 0, message: panic_message(p) }));
        match out {
            Err(e) if e.breaks_world() => {
                self.mark_broken(&e);
                match e {
                    // A stranded device exchange keeps the peer's class (its lost GPU stops
                    // the service; its out-of-memory error is retried).
                    CoordError::Panicked { .. }
                    | CoordError::Worker(flowprefill_worker::WorkerError::Comm(
                        flowprefill_comm::CommError::Stranded { .. },
                    )) => Err(e),
                    _ => Err(CoordError::WorldDown(self.broken.clone().unwrap_or_default())),
                }
            }
            out => out,
        }
    }

    /// Between jobs: tells the followers rank 0 is alive (see [`World::idle`]); a follower
    /// found gone marks the world broken, for the next job to rebuild.
    pub fn idle(&mut self) -> Result<()> {
        if self.broken.is_some() {
            return Ok(());
        }
        Engine::<B>::idle(&mut self.comm).inspect_err(|e| self.mark_broken(e))?;
        self.leader.release_unused();
        Ok(())
    }

    /// Marks the world broken by `e`, naming the follower that ended first where one did.
    fn mark_broken(&mut self, e: &CoordError) {
        let msg = match (e, self.root_cause()) {
            (CoordError::Panicked { .. }, _) | (_, None) => e.to_string(),
            (_, Some(r)) => format!("{r} (rank 0 saw: {e})"),
        };
        self.broken = Some(msg);
    }

    /// The first error of a follower that has ended (after a short grace period).
    fn root_cause(&mut self) -> Option<String> {
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(500) {
            if self.followers.iter().any(JoinHandle::is_finished) {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut i = 0;
        while i < self.followers.len() {
            if self.followers[i].is_finished() {
                let h = self.followers.remove(i);
                match h.join() {
                    Ok(Err(e)) => return Some(e.to_string()),
                    Err(p) => return Some(format!("a rank panicked: {}", panic_message(p))),
                    Ok(Ok(_)) => {}
                }
            } else {
                i += 1;
            }
        }
        None
    }

    /// Stops the current ranks and starts new ones with empty chunk stores; rank 0's engine is
    /// new too (a panic may have left its store mid-update). A working world's followers are
    /// stopped and joined first, as on drop, so that their engines (and the disk tier's writers,
    /// which finish their queued writes when dropped) are gone before this returns: a caller
    /// that empties the disk tier's folder next finds no write landing after it. A broken
    /// world's ranks are abandoned (a hung thread is left behind, never waited for).
    pub fn rebuild(&mut self) -> Result<()> {
        self.stop_followers();
        // The old rank 0's engine (and its disk writer) goes before the new ranks start.
        self.leader = self.engine(0)?;
        let (comm, followers) = self.spawn()?;
        // Dropping the old rank-0 communicator disconnects every old follower that still reads.
        self.comm = comm;
        self.followers = followers;
        self.broken = None;
        Ok(())
    }

    /// Tells a working world's followers to stop and joins those that end within the comm
    /// timeout (10 s at most); a broken world's are left alone (one may hang).
    fn stop_followers(&mut self) {
        if self.broken.is_some() {
            return;
        }
        let _ = Engine::<B>::stop(&mut self.comm);
        let deadline = Instant::now() + self.parts.timeout.min(Duration::from_secs(10));
        for h in self.followers.drain(..) {
            while !h.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            if h.is_finished() {
                let _ = h.join();
            }
        }
    }
}

impl<B: Backend> Drop for ThreadRanks<B> {
    fn drop(&mut self) {
        self.stop_followers();
    }
}

/// The ranks a command computes with: thread ranks of this process, or this process as one
/// rank of an `mpirun` world (world rank 0 leads and reports; the others follow inside
/// [`World::run`], or in their own loop for a service). `run`, `serve` and `bench` all use it.
// One per process, made once: the variants' size difference costs nothing.
#[allow(clippy::large_enum_variant)]
pub enum World<B: Backend> {
    /// Thread ranks of this process.
    Threads(ThreadRanks<B>),
    /// This process's rank of an MPI job, with its engine.
    Mpi {
        /// The process's communicator (narrowed to a group by [`World::use_group`]).
        comm: Box<dyn ProcessGroup>,
        /// This rank's engine.
        engine: Engine<B>,
    },
}

impl<B: Backend> World<B> {
    /// Ranks of the current group.
    pub fn size(&self) -> usize {
        match self {
            World::Threads(t) => t.size(),
            World::Mpi { comm, .. } => comm.size(),
        }
    }

    /// Whether this process leads and reports (always, for thread ranks).
    pub fn lead(&self) -> bool {
        match self {
            World::Threads(_) => true,
            World::Mpi { comm, .. } => comm.world_rank() == 0,
        }
    }

    /// Most ranks a group may have (`None`: thread ranks, as many as asked).
    pub fn max_ranks(&self) -> Option<usize> {
        match self {
            World::Threads(_) => None,
            World::Mpi { comm, .. } => Some(comm.world_size()),
        }
    }

    /// What the ranks are, in words (for a table's title).
    pub fn describe(&self, threads_per_rank: usize) -> String {
        match self {
            World::Threads(_) => {
                let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
                format!("thread ranks sharing {cores} cores")
            }
            World::Mpi { comm, .. } => {
                format!("MPI ranks (of {} processes), {threads_per_rank} threads each", comm.world_size())
            }
        }
    }

    /// This process's engine (rank 0's, for thread ranks).
    pub fn leader(&self) -> &Engine<B> {
        match self {
            World::Threads(t) => t.leader(),
            World::Mpi { engine, .. } => engine,
        }
    }

    /// One job on every rank of the group, the followers stopped after it (one-shot use, as
    /// `run` and `bench` do): the result on the leader, `None` on the other MPI ranks.
    pub fn run(&mut self, job: &Job, on_text: &mut dyn FnMut(&str) -> bool) -> Result<Option<RunResult>> {
        match self {
            World::Threads(t) => t.run(job, on_text).map(Some),
            World::Mpi { comm, engine } => run_rank(engine, comm.as_mut(), job, on_text),
        }
    }

    /// One job led by this process, the followers kept for the next one (a service's rank 0).
    pub fn lead_with(
        &mut self,
        job: &Job,
        ctl: Control<'_>,
        on_text: &mut dyn FnMut(&str) -> bool,
    ) -> Result<RunResult> {
        match self {
            World::Threads(t) => t.run_with(job, ctl, on_text),
            World::Mpi { comm, engine } => engine.lead_with(comm.as_mut(), job, ctl, on_text),
        }
    }

    /// Between jobs of a service: tells the followers rank 0 is alive, so that a world idle
    /// for longer than the comm timeout stays up. Call it every [`World::idle_every`].
    pub fn idle(&mut self) -> Result<()> {
        match self {
            World::Threads(t) => t.idle(),
            World::Mpi { comm, engine } => {
                Engine::<B>::idle(comm.as_mut())?;
                engine.release_unused();
                Ok(())
            }
        }
    }

    /// How often [`World::idle`] must run while there is no job.
    pub fn idle_every(&self) -> Duration {
        crate::engine::tick_period(match self {
            World::Threads(t) => t.parts.timeout,
            World::Mpi { comm, .. } => comm.timeout(),
        })
    }

    /// Forgets every chunk cache, so that the next job runs cold: fresh thread ranks, or this
    /// process's chunk stores emptied (every MPI process calls it at the same point).
    pub fn forget_caches(&mut self) -> Result<()> {
        match self {
            World::Threads(t) => t.rebuild(),
            World::Mpi { comm, engine } => {
                // Each process waits for its own disk writes. No barrier here: a process that
                // sits a narrowed block out never calls this, and a barrier hung `bench ttft`
                // under mpirun (rank 1 of 3 at P=1; fresh-clone CI of 7a585ac). Another process's
                // write may still land after rank 0 empties the folder (the cold-row check says so).
                let _ = comm;
                engine.clear_stores();
                Ok(())
            }
        }
    }

    /// Narrows an MPI world to its first `size` processes for a block of jobs; false: this
    /// process sits the block out (it has waited for the block to end). Thread ranks: true.
    pub fn use_group(&mut self, size: usize, timeout: Duration) -> Result<bool> {
        match self {
            World::Threads(_) => Ok(true),
            World::Mpi { comm, .. } => Ok(comm.use_group(size, timeout)?),
        }
    }

    /// The communicator of an MPI world (to attach a device plane to a new group).
    pub fn process_comm(&mut self) -> Option<&mut dyn ProcessGroup> {
        match self {
            World::Threads(_) => None,
            World::Mpi { comm, .. } => Some(comm.as_mut()),
        }
    }

    /// After rank 0 panicked mid-job: tells the other ranks the job is over, so that they wait
    /// for the next one (thread ranks are rebuilt instead, by [`World::repair`]).
    pub fn abandon_job(&mut self, why: &str) {
        if let World::Mpi { comm, .. } = self {
            comm.abort(flowprefill_comm::ErrorClass::Internal, why);
            comm.end_job();
        }
    }

    /// Tries to get all ranks back; false when impossible (MPI processes cannot be restarted).
    pub fn repair(&mut self) -> bool {
        match self {
            World::Threads(t) => t.rebuild().is_ok(),
            World::Mpi { .. } => false,
        }
    }

    /// Stops the followers.
    pub fn shutdown(self) {
        match self {
            World::Threads(t) => drop(t),
            World::Mpi { mut comm, .. } => {
                let _ = Engine::<B>::stop(comm.as_mut());
            }
        }
    }
}
