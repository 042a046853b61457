//! Ranks as threads of one process, connected by unbounded channels (one per ordered pair).
//!
//! ```text
//!   rank 0 ──tx[0→1]──> rank 1      each pair has its own FIFO channel, so messages between
//!      ^  <──tx[1→0]──     │        two ranks arrive in the order they were sent; sends never
//!      └────── ... ────────┘        block; a rank whose thread ended drops its channels and
//!                                   every peer waiting on it gets `RankLost` at once.
//! ```

use crate::wire::{find_abort, next_message, seal_abort, seal_data, seal_leave};
use crate::{check_rank, CommError, CommStats, Communicator, ErrorClass, Result, DEFAULT_TIMEOUT};
use std::collections::VecDeque;
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::time::{Duration, Instant};

struct Pending {
    op: String,
    from: Vec<usize>,
    sent: usize,
    /// The first peer a send could not reach (its thread had ended), reported after the wait.
    unsent: Option<usize>,
}

/// One thread rank.
pub struct LocalComm {
    rank: usize,
    size: usize,
    to: Vec<Option<Sender<Vec<u8>>>>,
    from: Vec<Option<Receiver<Vec<u8>>>>,
    timeout: Duration,
    pending: Option<Pending>,
    stats: CommStats,
    plane: Option<Box<dyn crate::plane::Plane>>,
    epoch: u64,
    /// Messages that arrived before they were waited for (seen by `poll_abort`), per peer.
    early: Vec<VecDeque<Vec<u8>>>,
}

impl std::fmt::Debug for LocalComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalComm").field("rank", &self.rank).field("size", &self.size).finish()
    }
}

impl LocalComm {
    /// A connected world of `n` ranks (index = rank).
    pub fn group(n: usize) -> Vec<LocalComm> {
        let mut to: Vec<Vec<Option<Sender<Vec<u8>>>>> = (0..n).map(|_| (0..n).map(|_| None).collect()).collect();
        let mut from: Vec<Vec<Option<Receiver<Vec<u8>>>>> = (0..n).map(|_| (0..n).map(|_| None).collect()).collect();
        for (a, row) in to.iter_mut().enumerate() {
            for (b, slot) in row.iter_mut().enumerate() {
                if a != b {
                    let (tx, rx) = channel();
                    *slot = Some(tx);
                    from[b][a] = Some(rx);
                }
            }
        }
        to.into_iter()
            .zip(from)
            .enumerate()
            .map(|(rank, (to, from))| LocalComm {
                rank,
                size: n,
                to,
                from,
                timeout: DEFAULT_TIMEOUT,
                pending: None,
                stats: CommStats::default(),
                plane: None,
                epoch: 0,
                early: (0..n).map(|_| VecDeque::new()).collect(),
            })
            .collect()
    }
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn backend(&self) -> &'static str {
        "local"
    }
    fn timeout(&self) -> Duration {
        self.timeout
    }
    fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
        if let Some(p) = &mut self.plane {
            p.set_timeout(timeout);
        }
    }

    fn post(&mut self, op: &str, sends: Vec<(usize, Vec<u8>)>, from: Vec<usize>) -> Result<()> {
        if let Some(p) = &self.pending {
            return Err(CommError::Misuse(format!("`{op}` posted while `{}` is still pending (wait first)", p.op)));
        }
        for &r in sends.iter().map(|(r, _)| r).chain(&from) {
            check_rank(r, self.size)?;
            if r == self.rank {
                return Err(CommError::Misuse(format!("`{op}`: rank {r} cannot message itself")));
            }
        }
        // Deliver to every live peer and report a failed send only after the wait: a peer
        // that ended after sending its part is not the one to blame, and the survivors then
        // name the rank that ended without contributing.
        let mut sent = 0;
        let mut unsent = None;
        for (r, data) in sends {
            sent += data.len();
            let tx = self.to[r].as_ref().ok_or(CommError::BadRank { rank: r, size: self.size })?;
            if tx.send(seal_data(data, op, self.epoch)).is_err() && unsent.is_none() {
                unsent = Some(r);
            }
        }
        self.pending = Some(Pending { op: op.to_string(), from, sent, unsent });
        Ok(())
    }

    fn wait(&mut self) -> Result<Vec<Vec<u8>>> {
        let p = self.pending.take().ok_or_else(|| CommError::Misuse("wait without a posted exchange".into()))?;
        let t0 = Instant::now();
        let deadline = crate::deadline_after(self.timeout);
        let mut got = Vec::with_capacity(p.from.len());
        for &r in &p.from {
            let rx = self.from[r].as_ref().ok_or(CommError::BadRank { rank: r, size: self.size })?;
            let (op, secs) = (&p.op, self.timeout.as_secs_f64());
            let recv = || match rx.recv_timeout(crate::time_left(deadline)) {
                Ok(m) => Ok(m),
                Err(RecvTimeoutError::Timeout) => Err(CommError::Timeout { rank: r, op: op.clone(), secs, unsent: 0 }),
                Err(RecvTimeoutError::Disconnected) => {
                    Err(CommError::RankLost { rank: r, op: op.clone(), detail: "its thread has ended".into() })
                }
            };
            got.push(next_message(r, op, self.epoch, &mut self.early[r], recv)?);
        }
        let received = got.iter().map(Vec::len).sum();
        self.stats.record(&p.op, p.sent, received, t0.elapsed());
        if let Some(rank) = p.unsent {
            return Err(CommError::RankLost { rank, op: p.op, detail: "its thread has ended".into() });
        }
        Ok(got)
    }

    fn abort(&mut self, class: ErrorClass, reason: &str) {
        self.pending = None;
        for tx in self.to.iter().flatten() {
            // A peer whose thread has ended needs no telling.
            let _ = tx.send(seal_abort(self.epoch, class, reason));
        }
    }

    fn leave(&mut self, reason: &str) {
        if let Some(p) = &mut self.plane {
            p.abort(reason);
        }
        self.pending = None;
        for tx in self.to.iter().flatten() {
            let _ = tx.send(seal_leave(self.epoch, reason));
        }
    }

    fn poll_abort(&mut self, op: &str) -> Result<()> {
        for r in 0..self.size {
            let Some(rx) = self.from[r].as_ref() else { continue };
            let ended = loop {
                match rx.try_recv() {
                    Ok(m) => self.early[r].push_back(m),
                    Err(TryRecvError::Empty) => break false,
                    Err(TryRecvError::Disconnected) => break true,
                }
            };
            // A peer that said why it gave up before its thread ended is reported with its reason.
            if let Some(e) = find_abort(r, op, self.epoch, &mut self.early[r])? {
                return Err(e);
            }
            if ended {
                return Err(CommError::RankLost { rank: r, op: op.to_string(), detail: "its thread has ended".into() });
            }
        }
        Ok(())
    }

    fn end_job(&mut self) {
        if let Some(p) = &mut self.plane {
            p.end_job();
        }
        self.pending = None;
        self.epoch += 1;
    }

    fn epoch(&self) -> u64 {
        self.epoch
    }

    fn stats(&self) -> &CommStats {
        &self.stats
    }

    fn reset_stats(&mut self) {
        self.stats = CommStats::default();
    }

    fn note(&mut self, op: &str, sent: usize, received: usize, wait: Duration) {
        self.stats.record(op, sent, received, wait);
    }

    fn plane(&mut self) -> Option<&mut (dyn crate::plane::Plane + 'static)> {
        self.plane.as_deref_mut()
    }

    fn set_plane(&mut self, mut plane: Box<dyn crate::plane::Plane>) {
        plane.set_timeout(self.timeout);
        self.plane = Some(plane);
    }

    fn take_plane(&mut self) -> Option<Box<dyn crate::plane::Plane>> {
        self.plane.take()
    }
}

/// Runs `f` on `n` thread ranks and returns each rank's result in rank order. A rank that
/// panics drops its channels (its peers get `RankLost`), and the panic is re-raised here once
/// every rank has finished.
pub fn run_ranks<T: Send>(n: usize, f: impl Fn(LocalComm) -> T + Sync) -> Vec<T> {
    let comms = LocalComm::group(n);
    let results: Vec<std::thread::Result<T>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let f = &f;
                let name = format!("rank-{}", c.rank);
                std::thread::Builder::new().name(name).spawn_scoped(s, move || f(c))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| match h {
                Ok(h) => h.join(),
                Err(e) => Err(Box::new(e.to_string()) as Box<dyn std::any::Any + Send>),
            })
            .collect()
    });
    let mut out = Vec::with_capacity(n);
    for r in results {
        match r {
            Ok(v) => out.push(v),
            Err(p) => std::panic::resume_unwind(p),
        }
    }
    out
}
