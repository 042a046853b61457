//! Ranks as MPI processes (`mpirun -np N flowprefill ...`), feature `mpi`.
//!
//! All MPI calls happen on one dedicated communication thread, which initialises MPI, so the
//! compute thread never blocks inside MPI:
//!
//! ```text
//!   compute thread                       comm thread (owns MPI)
//!   post(sends, from) ── job ──────────> isend all (scope) ; probe+recv each `from` ; wait sends
//!   ... compute the current block ...
//!   wait() <── reply (deadline) ──────── messages in the order of `from`
//! ```
//! Sends are immediate (non-blocking) and completed after the receives, so two ranks sending
//! to each other cannot deadlock whatever the message size. The compute side waits with a
//! deadline: a peer that died or hangs becomes [`CommError::Timeout`] naming the rank the comm
//! thread was blocked on. The comm thread is then abandoned and the process should exit.

use crate::{check_rank, CommError, CommStats, Communicator, Result, DEFAULT_TIMEOUT};
use mpi::point_to_point::{Destination, MatchedReceiveVec, Source};
use mpi::topology::Communicator as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

enum Job {
    Exchange { sends: Vec<(usize, Vec<u8>)>, from: Vec<usize> },
    Shutdown,
}

struct Pending {
    op: String,
    sent: usize,
    first_from: Option<usize>,
}

/// One MPI process rank.
pub struct MpiComm {
    rank: usize,
    size: usize,
    jobs: Sender<Job>,
    replies: Receiver<Vec<Vec<u8>>>,
    waiting_on: Arc<AtomicUsize>,
    timeout: Duration,
    pending: Option<Pending>,
    stats: CommStats,
    thread: Option<JoinHandle<()>>,
    healthy: bool,
}

/// True when this process was started by an MPI launcher (OpenMPI, MPICH/PMI, PMIx).
pub fn launched_by_mpirun() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"].iter().any(|v| std::env::var_os(v).is_some())
}

impl MpiComm {
    /// Initialises MPI on the communication thread. A process started without `mpirun` is
    /// rank 0 of a world of 1.
    pub fn init() -> Result<Self> {
        let (jobs_tx, jobs_rx) = channel::<Job>();
        let (reply_tx, reply_rx) = channel::<Vec<Vec<u8>>>();
        let (init_tx, init_rx) = channel::<Result<(usize, usize)>>();
        let waiting_on = Arc::new(AtomicUsize::new(usize::MAX));
        let waiting = waiting_on.clone();
        let thread = std::thread::Builder::new()
            .name("mpi-comm".into())
            .spawn(move || comm_thread(jobs_rx, reply_tx, init_tx, waiting))
            .map_err(|e| CommError::Mpi(format!("cannot start the communication thread: {e}")))?;
        let (rank, size) = init_rx
            .recv_timeout(Duration::from_secs(120))
            .map_err(|_| CommError::Mpi("MPI initialisation did not finish".into()))??;
        Ok(Self {
            rank,
            size,
            jobs: jobs_tx,
            replies: reply_rx,
            waiting_on,
            timeout: DEFAULT_TIMEOUT,
            pending: None,
            stats: CommStats::default(),
            thread: Some(thread),
            healthy: true,
        })
    }
}

fn comm_thread(
    jobs: Receiver<Job>,
    replies: Sender<Vec<Vec<u8>>>,
    init: Sender<Result<(usize, usize)>>,
    waiting: Arc<AtomicUsize>,
) {
    let Some((universe, _level)) = mpi::initialize_with_threading(mpi::Threading::Serialized) else {
        let _ = init.send(Err(CommError::Mpi("MPI was already initialised in this process".into())));
        return;
    };
    let world = universe.world();
    let _ = init.send(Ok((world.rank() as usize, world.size() as usize)));
    while let Ok(job) = jobs.recv() {
        match job {
            Job::Exchange { sends, from } => {
                let got = mpi::request::scope(|scope| {
                    let reqs: Vec<_> = sends
                        .iter()
                        .map(|(to, d)| world.process_at_rank(*to as i32).immediate_send(scope, &d[..]))
                        .collect();
                    let mut got = Vec::with_capacity(from.len());
                    for &src in &from {
                        waiting.store(src, Ordering::Relaxed);
                        let probed = world.process_at_rank(src as i32).matched_probe();
                        let (v, _status) = probed.matched_receive_vec::<u8>();
                        got.push(v);
                    }
                    for (i, r) in reqs.into_iter().enumerate() {
                        waiting.store(sends[i].0, Ordering::Relaxed);
                        r.wait();
                    }
                    waiting.store(usize::MAX, Ordering::Relaxed);
                    got
                });
                if replies.send(got).is_err() {
                    break;
                }
            }
            Job::Shutdown => break,
        }
    }
    drop(world);
    drop(universe); // MPI_Finalize
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn backend(&self) -> &'static str {
        "mpi"
    }
    fn timeout(&self) -> Duration {
        self.timeout
    }
    fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    fn post(&mut self, op: &str, sends: Vec<(usize, Vec<u8>)>, from: Vec<usize>) -> Result<()> {
        if let Some(p) = &self.pending {
            return Err(CommError::Misuse(format!("`{op}` posted while `{}` is still pending (wait first)", p.op)));
        }
        if !self.healthy {
            return Err(CommError::Misuse("the communicator failed earlier; the process must exit".into()));
        }
        for &r in sends.iter().map(|(r, _)| r).chain(&from) {
            check_rank(r, self.size)?;
            if r == self.rank {
                return Err(CommError::Misuse(format!("`{op}`: rank {r} cannot message itself")));
            }
        }
        let sent = sends.iter().map(|(_, d)| d.len()).sum();
        let first_from = from.first().copied().or(sends.first().map(|s| s.0));
        self.jobs
            .send(Job::Exchange { sends, from })
            .map_err(|_| CommError::Mpi("the communication thread has stopped".into()))?;
        self.pending = Some(Pending { op: op.to_string(), sent, first_from });
        Ok(())
    }

    fn wait(&mut self) -> Result<Vec<Vec<u8>>> {
        let p = self.pending.take().ok_or_else(|| CommError::Misuse("wait without a posted exchange".into()))?;
        let t0 = Instant::now();
        match self.replies.recv_timeout(self.timeout) {
            Ok(got) => {
                let received = got.iter().map(Vec::len).sum();
                self.stats.record(&p.op, p.sent, received, t0.elapsed());
                Ok(got)
            }
            Err(RecvTimeoutError::Timeout) => {
                self.healthy = false;
                let w = self.waiting_on.load(Ordering::Relaxed);
                let rank = if w == usize::MAX { p.first_from.unwrap_or(0) } else { w };
                Err(CommError::Timeout { rank, op: p.op, secs: self.timeout.as_secs_f64() })
            }
            Err(RecvTimeoutError::Disconnected) => {
                self.healthy = false;
                Err(CommError::Mpi("the communication thread stopped (MPI error)".into()))
            }
        }
    }

    fn stats(&self) -> &CommStats {
        &self.stats
    }

    fn reset_stats(&mut self) {
        self.stats = CommStats::default();
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        // A stuck communication thread (failed peer) cannot be joined; the process exits
        // without MPI_Finalize and mpirun reports it.
        if self.healthy && self.pending.is_none() {
            let _ = self.jobs.send(Job::Shutdown);
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
    }
}
