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

use crate::engine::{Control, Engine, RunResult};
use crate::error::{internal, CoordError, Result};
use crate::fault::FaultPlan;
use crate::request::Job;
use flowprefill_comm::local::LocalComm;
use flowprefill_comm::Communicator;
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
        let r = engine.lead(comm, job, on_text);
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

/// The message of a caught panic.
pub fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into())
}

/// A persistent world of thread ranks sharing one model; each rank has its own engine (and
/// chunk store). Rank 0 runs on the caller's thread.
pub struct ThreadRanks<B: Backend> {
    lm: Arc<LoadedModel<B>>,
    aux: Option<Arc<LoadedModel<B>>>,
    faults: Option<Arc<FaultPlan>>,
    store_bytes: usize,
    timeout: Duration,
    ranks: usize,
    leader: Engine<B>,
    comm: LocalComm,
    followers: Vec<JoinHandle<Result<usize>>>,
    broken: Option<String>,
}

impl<B: Backend> ThreadRanks<B> {
    /// Starts `ranks - 1` follower threads.
    pub fn new(lm: Arc<LoadedModel<B>>, ranks: usize, store_bytes: usize, timeout: Duration) -> Result<Self> {
        Self::build(lm, None, FaultPlan::from_env(), ranks, store_bytes, timeout)
    }

    /// The same world with `aux` as CacheClip's auxiliary model on every rank.
    pub fn with_aux(self, aux: Arc<LoadedModel<B>>) -> Result<Self> {
        let ranks = self.size();
        let (lm, faults, store_bytes, timeout) = (self.lm.clone(), self.faults.clone(), self.store_bytes, self.timeout);
        drop(self);
        Self::build(lm, Some(aux), faults, ranks, store_bytes, timeout)
    }

    /// The same world with the faults of `plan` injected (failure tests; the plan fires once,
    /// also across rebuilds).
    pub fn with_faults(self, plan: Option<Arc<FaultPlan>>) -> Result<Self> {
        let ranks = self.size();
        let (lm, aux, store_bytes, timeout) = (self.lm.clone(), self.aux.clone(), self.store_bytes, self.timeout);
        drop(self);
        Self::build(lm, aux, plan, ranks, store_bytes, timeout)
    }

    fn engine(&self) -> Result<Engine<B>> {
        let e = Engine::new(self.lm.clone(), self.store_bytes).with_faults(self.faults.clone());
        match &self.aux {
            Some(a) => e.with_aux(a.clone()),
            None => Ok(e),
        }
    }

    fn build(
        lm: Arc<LoadedModel<B>>,
        aux: Option<Arc<LoadedModel<B>>>,
        faults: Option<Arc<FaultPlan>>,
        ranks: usize,
        store_bytes: usize,
        timeout: Duration,
    ) -> Result<Self> {
        if ranks == 0 {
            return Err(InputError::new(Field::Ranks, "must be at least 1").into());
        }
        let leader = Engine::new(lm.clone(), store_bytes);
        let mut w = Self {
            lm,
            aux,
            faults,
            store_bytes,
            timeout,
            ranks,
            leader,
            comm: LocalComm::group(1).pop().ok_or_else(|| internal("no rank 0"))?,
            followers: Vec::new(),
            broken: None,
        };
        w.leader = w.engine()?;
        let (comm, followers) = w.spawn()?;
        (w.comm, w.followers) = (comm, followers);
        Ok(w)
    }

    fn spawn(&self) -> Result<(LocalComm, Vec<JoinHandle<Result<usize>>>)> {
        let mut comms = LocalComm::group(self.ranks).into_iter();
        let mut comm = comms.next().ok_or_else(|| internal("no rank 0"))?;
        comm.set_timeout(self.timeout);
        let mut followers = Vec::with_capacity(self.ranks - 1);
        for mut c in comms {
            c.set_timeout(self.timeout);
            let engine = self.engine()?;
            let rank = c.rank();
            let h = std::thread::Builder::new()
                .name(format!("rank-{rank}"))
                .spawn(move || engine.follow(&mut c))
                .map_err(|e| internal(format!("cannot start rank {rank}: {e}")))?;
            followers.push(h);
        }
        Ok((comm, followers))
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.ranks
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
                let msg = match (&e, self.root_cause()) {
                    (CoordError::Panicked { .. }, _) | (_, None) => e.to_string(),
                    (_, Some(r)) => format!("{r} (rank 0 saw: {e})"),
                };
                self.broken = Some(msg);
                match e {
                    CoordError::Panicked { .. } => Err(e),
                    _ => Err(CoordError::WorldDown(self.broken.clone().unwrap_or_default())),
                }
            }
            out => out,
        }
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

    /// Abandons the current ranks (a hung thread is left behind, never waited for) and starts
    /// new ones with empty chunk stores; rank 0's engine is new too (a panic may have left its
    /// store mid-update).
    pub fn rebuild(&mut self) -> Result<()> {
        let leader = self.engine()?;
        let (comm, followers) = self.spawn()?;
        // Dropping the old rank-0 communicator disconnects every old follower that still reads.
        self.comm = comm;
        self.followers = followers;
        self.leader = leader;
        self.broken = None;
        Ok(())
    }
}

impl<B: Backend> Drop for ThreadRanks<B> {
    fn drop(&mut self) {
        if self.broken.is_none() {
            let _ = Engine::<B>::stop(&mut self.comm);
            let deadline = Instant::now() + self.timeout.min(Duration::from_secs(10));
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
}
