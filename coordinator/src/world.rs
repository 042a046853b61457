//! Running jobs over a world of ranks: threads of this process, or MPI processes.
//!
//! ```text
//!   rank 0 (the caller's thread):  lead(job) ... lead(job) ... stop()
//!   ranks 1..P (threads or processes):  follow()  -- run each job rank 0 broadcasts, until stop
//! ```
//! A follower that panics or stops answering breaks the world: rank 0's collective fails with
//! an error naming it (immediately for a dead thread, after the deadline for a hung one), the
//! world is marked broken, and [`ThreadRanks::rebuild`] starts fresh followers. A hung thread
//! cannot be killed; it is abandoned, never waited for.

use crate::engine::{Engine, RunResult};
use crate::error::{invalid, CoordError, Result};
use crate::request::Job;
use flowprefill_comm::local::LocalComm;
use flowprefill_comm::Communicator;
use flowprefill_kernels::Backend;
use flowprefill_worker::{LoadedModel, WorkerError};
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

fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
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
        Self::build(lm, None, ranks, store_bytes, timeout)
    }

    /// The same world with `aux` as CacheClip's auxiliary model on every rank.
    pub fn with_aux(self, aux: Arc<LoadedModel<B>>) -> Result<Self> {
        let ranks = self.size();
        let (lm, store_bytes, timeout) = (self.lm.clone(), self.store_bytes, self.timeout);
        drop(self);
        Self::build(lm, Some(aux), ranks, store_bytes, timeout)
    }

    fn engine(lm: &Arc<LoadedModel<B>>, aux: &Option<Arc<LoadedModel<B>>>, store_bytes: usize) -> Result<Engine<B>> {
        let e = Engine::new(lm.clone(), store_bytes);
        match aux {
            Some(a) => e.with_aux(a.clone()),
            None => Ok(e),
        }
    }

    fn build(
        lm: Arc<LoadedModel<B>>,
        aux: Option<Arc<LoadedModel<B>>>,
        ranks: usize,
        store_bytes: usize,
        timeout: Duration,
    ) -> Result<Self> {
        if ranks == 0 {
            return Err(invalid("--ranks must be at least 1"));
        }
        let leader = Self::engine(&lm, &aux, store_bytes)?;
        let (comm, followers) = Self::spawn(&lm, &aux, ranks, store_bytes, timeout)?;
        Ok(Self { lm, aux, store_bytes, timeout, ranks, leader, comm, followers, broken: None })
    }

    fn spawn(
        lm: &Arc<LoadedModel<B>>,
        aux: &Option<Arc<LoadedModel<B>>>,
        ranks: usize,
        store_bytes: usize,
        timeout: Duration,
    ) -> Result<(LocalComm, Vec<JoinHandle<Result<usize>>>)> {
        let mut comms = LocalComm::group(ranks).into_iter();
        let mut comm = comms.next().ok_or_else(|| invalid("no rank 0"))?;
        comm.set_timeout(timeout);
        let mut followers = Vec::with_capacity(ranks - 1);
        for mut c in comms {
            c.set_timeout(timeout);
            let engine = Self::engine(lm, aux, store_bytes)?;
            let rank = c.rank();
            let h = std::thread::Builder::new()
                .name(format!("rank-{rank}"))
                .spawn(move || {
                    let run = std::panic::AssertUnwindSafe(|| engine.follow(&mut c));
                    std::panic::catch_unwind(run)
                        .unwrap_or_else(|p| Err(invalid(format!("rank {rank} panicked: {}", panic_message(p)))))
                })
                .map_err(|e| invalid(format!("cannot start rank {rank}: {e}")))?;
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
        if let Some(why) = &self.broken {
            return Err(invalid(format!("the ranks are down ({why}); restart them")));
        }
        match self.leader.lead(&mut self.comm, job, on_text) {
            Ok(r) => Ok(r),
            Err(e @ CoordError::Worker(WorkerError::Comm(_))) => {
                let root = self.root_cause();
                let msg = match root {
                    Some(r) => format!("{r} (rank 0 saw: {e})"),
                    None => e.to_string(),
                };
                self.broken = Some(msg.clone());
                Err(invalid(msg))
            }
            Err(e) => Err(e),
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

    /// Abandons the current followers (a hung thread is left behind, never waited for) and
    /// starts new ones with empty chunk stores.
    pub fn rebuild(&mut self) -> Result<()> {
        let (comm, followers) = Self::spawn(&self.lm, &self.aux, self.ranks, self.store_bytes, self.timeout)?;
        // Dropping the old rank-0 communicator disconnects every old follower that still reads.
        self.comm = comm;
        self.followers = followers;
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
