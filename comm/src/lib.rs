//! How flowprefill ranks talk to each other.
//!
//! Every collective is built on one split-phase primitive, the exchange: a rank *posts* the
//! messages it sends and names the ranks it expects one message from, computes, then *waits*
//! for those messages. Sends never block, so no ordering of sends and receives between two
//! ranks can deadlock, and every wait has a deadline, so a lost rank becomes an error naming
//! it instead of a hang.
//!
//! ```text
//!   post(sends, from) ──> [compute] ──> wait() -> messages in the order of `from`
//!   all_gather  = post(send to everyone, from everyone) + wait
//!   broadcast   = post(root: send to everyone / others: from root) + wait
//!   ring step   = post(send to next, from previous) ... compute block ... wait
//! ```
//! Rules every caller follows (the classic sources of NCCL/MPI hangs): every rank issues the
//! same collectives in the same order, also when it has nothing to contribute (an empty
//! message is still a message), and variable-size payloads carry their own length.
//!
//! Jobs and aborts: every message carries the number of the job (epoch) it belongs to. A rank
//! that cannot finish a job (its own error, a cancellation, a deadline) calls
//! [`Communicator::abort`]: each peer's next wait in that job returns [`CommError::Aborted`]
//! naming the rank and why, instead of waiting for a message that will never come. Every rank
//! then calls [`Communicator::end_job`], and whatever the job left in flight is dropped on
//! arrival, so the next job starts clean. Ranks that compute without communicating (chunk
//! prefill) look for aborts between layers with [`Communicator::poll_abort`].
//!
//! ```text
//!   rank 1: ... layer 5 fails ── abort(class, why) ──> every peer ── end_job
//!   rank 0: ... wait(layer 5) -> Aborted { rank 1, why } ───────────── end_job
//!   rank 2: ... chunk prefill: poll_abort() -> Aborted { rank 1, why } ─ end_job
//! ```
//!
//! Backends: [`local`] (ranks are threads of one process; used by every test) and `mpi`
//! (feature `mpi`: one process per rank under `mpirun`). Both count bytes and time per named
//! collective ([`CommStats`]). A rank may also hold a device plane ([`plane`]: NCCL between
//! GPUs) that moves backend buffers while the communicator carries only control data; its
//! traffic is counted here too (`<op>@nccl`).

mod error;
pub mod local;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod plane;
pub mod wire;

use serde::de::DeserializeOwned;
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::Duration;
pub use wire::{decode, encode, Packet, Unpack};

/// Default deadline of a wait.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// The shortest silence limit ([`Communicator::set_silence_limit`]; a shorter one is raised to
/// it): 20 beats, so that a process that a loaded machine left unscheduled for seconds is not
/// taken for a dead one.
pub const MIN_SILENCE: Duration = Duration::from_secs(10);

/// The silence limit that a wish of `limit` gets: within [`MIN_SILENCE`] and
/// [`DEFAULT_TIMEOUT`] (a process beats twice a second however long its work takes: a peer
/// silent for a minute is gone, or stopped, whatever the communicator's timeout).
pub fn silence_limit(limit: Duration) -> Duration {
    limit.clamp(MIN_SILENCE, DEFAULT_TIMEOUT)
}

/// The deadline `timeout` from now; `None` (no deadline) where it is past what an `Instant`
/// holds (a `--comm-timeout` of 1e19 seconds: `now + timeout` would panic).
pub(crate) fn deadline_after(timeout: Duration) -> Option<std::time::Instant> {
    std::time::Instant::now().checked_add(timeout)
}

/// Time left until `deadline` (zero once past; `Duration::MAX`, i.e. a blocking wait, without one).
pub(crate) fn time_left(deadline: Option<std::time::Instant>) -> Duration {
    deadline.map_or(Duration::MAX, |d| d.saturating_duration_since(std::time::Instant::now()))
}

/// This process's rank as an MPI launcher tells it in the environment, before MPI starts
/// (OpenMPI, PMI, PMIx); `None` when no launcher says (then it is rank 0 of a world of 1).
pub fn launcher_rank() -> Option<usize> {
    ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"].iter().find_map(|v| std::env::var(v).ok()?.trim().parse().ok())
}

/// Processes in the job as an MPI launcher tells it (1 without one).
pub fn launcher_size() -> usize {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"].iter().find_map(|v| std::env::var(v).ok()?.trim().parse().ok()).unwrap_or(1)
}

pub use error::{CommError, ErrorClass, Result};

/// Counters of one named collective.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OpStats {
    /// Times it ran.
    pub calls: u64,
    /// Payload bytes this rank sent.
    pub bytes_sent: u64,
    /// Payload bytes this rank received.
    pub bytes_received: u64,
    /// Seconds this rank spent waiting for it.
    pub wait_s: f64,
}

/// Per-collective counters of one rank.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CommStats {
    /// By collective name.
    pub ops: BTreeMap<String, OpStats>,
}

impl CommStats {
    fn record(&mut self, op: &str, sent: usize, received: usize, wait: Duration) {
        let e = self.ops.entry(op.to_string()).or_default();
        e.calls += 1;
        e.bytes_sent += sent as u64;
        e.bytes_received += received as u64;
        e.wait_s += wait.as_secs_f64();
    }

    /// Total bytes sent.
    pub fn bytes_sent(&self) -> u64 {
        self.ops.values().map(|o| o.bytes_sent).sum()
    }

    /// Total seconds this rank spent waiting in collectives.
    pub fn wait_s(&self) -> f64 {
        self.ops.values().map(|o| o.wait_s).sum()
    }

    /// Counters whose name starts with `prefix`, summed.
    pub fn sum_prefix(&self, prefix: &str) -> OpStats {
        let mut s = OpStats::default();
        for (k, v) in &self.ops {
            if k.starts_with(prefix) {
                s.calls += v.calls;
                s.bytes_sent += v.bytes_sent;
                s.bytes_received += v.bytes_received;
                s.wait_s += v.wait_s;
            }
        }
        s
    }
}

/// A rank's view of the world.
pub trait Communicator: Send {
    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// Backend name (`local`, `mpi`).
    fn backend(&self) -> &'static str;
    /// Deadline of every wait.
    fn timeout(&self) -> Duration;
    /// Changes the deadline.
    fn set_timeout(&mut self, timeout: Duration);
    /// From now on a wait also ends, with [`CommError::RankLost`], once the peer it waits on
    /// has been silent for `limit`, however far off its deadline is: for waits far longer than
    /// any peer should take to answer (the others loading their model at their own speed), so
    /// that a peer's process that died meanwhile is named within `limit`. MPI processes tell
    /// every other process they are alive twice a second from their communication thread,
    /// whatever their compute thread does; the limit is kept within 10 s and 60 s
    /// ([`silence_limit`]). `None`: the
    /// deadline alone (the default). Thread ranks live and die with their process: nothing to do.
    fn set_silence_limit(&mut self, _limit: Option<Duration>) {}
    /// Starts an exchange: queues `sends` (to, payload) and the ranks one message is expected
    /// from. Fails if an exchange is already pending.
    fn post(&mut self, op: &str, sends: Vec<(usize, Vec<u8>)>, from: Vec<usize>) -> Result<()>;
    /// Completes the pending exchange; messages come in the order of `from`. A peer that gave
    /// the job up makes it [`CommError::Aborted`].
    fn wait(&mut self) -> Result<Vec<Vec<u8>>>;
    /// Gives the current job up: every peer's next wait in this job returns
    /// [`CommError::Aborted`] with `class` and `reason`, and a pending exchange is forgotten.
    /// Best effort (a lost peer is not told); never blocks longer than the deadline.
    fn abort(&mut self, class: ErrorClass, reason: &str);
    /// Without blocking: [`CommError::Aborted`] if a peer has already given the current job
    /// up. Ranks that compute for long without communicating call it between layers.
    fn poll_abort(&mut self, op: &str) -> Result<()>;
    /// Leaves the world for good (this rank panicked, or lost another one): every peer that
    /// waits for it from now on, in any job, gets [`CommError::RankLost`] with `reason` at once
    /// instead of after its deadline. Best effort.
    fn leave(&mut self, reason: &str);
    /// Ends the current job on this rank (every rank calls it once per job, success or not);
    /// messages of that job still in flight are dropped when they arrive.
    fn end_job(&mut self);
    /// The current job's number (starts at 0, one more per [`Communicator::end_job`]).
    fn epoch(&self) -> u64;
    /// Counters so far.
    fn stats(&self) -> &CommStats;
    /// Clears the counters.
    fn reset_stats(&mut self);
    /// Counts traffic of this rank that went around the communicator (over its device plane):
    /// shows in [`Communicator::stats`] like the communicator's own collectives.
    fn note(&mut self, op: &str, sent: usize, received: usize, wait: Duration);
    /// The device plane of this rank, if it has one (see [`plane`]).
    fn plane(&mut self) -> Option<&mut (dyn plane::Plane + 'static)>;
    /// Gives this rank a device plane (NCCL on a GPU world): from now on the buffer-typed
    /// collectives move buffers over it and only control data through the communicator. The
    /// plane follows the communicator's deadline, jobs and departure.
    fn set_plane(&mut self, plane: Box<dyn plane::Plane>);
    /// Takes the device plane out (`set_plane` puts it back): a device wait holds the plane
    /// and this communicator apart, to look for a peer's abort while its transfers run (see
    /// [`plane::Watch`]).
    fn take_plane(&mut self) -> Option<Box<dyn plane::Plane>>;
}

/// A communicator over the processes of a launched world (`mpirun`) that can narrow its jobs
/// to the first processes: benchmarks run blocks of jobs on 1..P of them.
pub trait ProcessGroup: Communicator {
    /// Narrows the job group to the first `size` processes of the world; false: this process
    /// is outside the block and has waited (up to `timeout`) until the block ended.
    fn use_group(&mut self, size: usize, timeout: Duration) -> Result<bool>;
    /// This process's rank in the whole world (not the group).
    fn world_rank(&self) -> usize;
    /// Processes in the world.
    fn world_size(&self) -> usize;
}

/// Checks a rank number.
pub fn check_rank(rank: usize, size: usize) -> Result<()> {
    if rank < size {
        Ok(())
    } else {
        Err(CommError::BadRank { rank, size })
    }
}

/// post + wait.
pub fn exchange(
    comm: &mut dyn Communicator,
    op: &str,
    sends: Vec<(usize, Vec<u8>)>,
    from: Vec<usize>,
) -> Result<Vec<Vec<u8>>> {
    comm.post(op, sends, from)?;
    comm.wait()
}

/// Every rank gets every rank's payload (own included), in rank order.
pub fn all_gather_bytes(comm: &mut dyn Communicator, op: &str, data: Vec<u8>) -> Result<Vec<Vec<u8>>> {
    let (me, n) = (comm.rank(), comm.size());
    let others: Vec<usize> = (0..n).filter(|&r| r != me).collect();
    let sends = others.iter().map(|&r| (r, data.clone())).collect();
    let got = exchange(comm, op, sends, others)?;
    let mut out = Vec::with_capacity(n);
    let mut it = got.into_iter();
    for r in 0..n {
        out.push(if r == me { data.clone() } else { it.next().unwrap_or_default() });
    }
    Ok(out)
}

/// Rank `root`'s payload on every rank.
pub fn broadcast_bytes(comm: &mut dyn Communicator, op: &str, root: usize, data: Vec<u8>) -> Result<Vec<u8>> {
    let (me, n) = (comm.rank(), comm.size());
    check_rank(root, n)?;
    if me == root {
        let sends = (0..n).filter(|&r| r != me).map(|r| (r, data.clone())).collect();
        exchange(comm, op, sends, vec![])?;
        Ok(data)
    } else {
        exchange(comm, op, vec![], vec![root])?
            .pop()
            .ok_or_else(|| CommError::Misuse("broadcast lost its message".into()))
    }
}

/// Waits until every rank reached this point.
pub fn barrier(comm: &mut dyn Communicator, op: &str) -> Result<()> {
    all_gather_bytes(comm, op, Vec::new()).map(|_| ())
}

/// All-gather of f32 slices of any length (the lengths travel with the data).
pub fn all_gather_f32(comm: &mut dyn Communicator, op: &str, data: &[f32]) -> Result<Vec<Vec<f32>>> {
    let got = all_gather_bytes(comm, op, Packet::new().f32s(data).into_bytes()?)?;
    got.iter().enumerate().map(|(r, b)| unpack_f32(r, op, b)).collect()
}

fn unpack_f32(rank: usize, op: &str, b: &[u8]) -> Result<Vec<f32>> {
    let mut u = Unpack::new(rank, op, b);
    let v = u.f32s()?;
    u.finish()?;
    Ok(v)
}

/// Sends f32 data to `to` and receives from `from` (a ring step), split-phase: returns after
/// posting; complete with [`wait_f32`].
pub fn post_f32(comm: &mut dyn Communicator, op: &str, to: usize, data: &[f32], from: usize) -> Result<()> {
    comm.post(op, vec![(to, Packet::new().f32s(data).into_bytes()?)], vec![from])
}

/// Completes a [`post_f32`].
pub fn wait_f32(comm: &mut dyn Communicator, op: &str, from: usize) -> Result<Vec<f32>> {
    let got = comm.wait()?;
    let b = got.into_iter().next().ok_or_else(|| CommError::Misuse("ring step lost its message".into()))?;
    unpack_f32(from, op, &b)
}

/// Rank `root`'s value on every rank (bincode-encoded control message).
pub fn broadcast_value<T: Serialize + DeserializeOwned>(
    comm: &mut dyn Communicator,
    op: &str,
    root: usize,
    value: Option<&T>,
) -> Result<T> {
    let bytes = match value {
        Some(v) if comm.rank() == root => encode(v)?,
        _ => Vec::new(),
    };
    let got = broadcast_bytes(comm, op, root, bytes)?;
    decode(root, op, &got)
}

/// Every rank's value on every rank, in rank order.
pub fn all_gather_value<T: Serialize + DeserializeOwned>(
    comm: &mut dyn Communicator,
    op: &str,
    value: &T,
) -> Result<Vec<T>> {
    let got = all_gather_bytes(comm, op, encode(value)?)?;
    got.iter().enumerate().map(|(r, b)| decode(r, op, b)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::local::run_ranks;

    /// Whose fault each error is, in one place: this rank's lost device is the device's and
    /// leaves the ranks in step (it tells them with an abort); a lost peer breaks the world.
    #[test]
    fn classes_and_whether_the_world_goes_on() {
        let device = CommError::Device { rank: 1, op: "ring.kv".into(), detail: "d".into() };
        assert_eq!((device.class(), device.world_intact()), (ErrorClass::Device, true));
        assert!(device.to_string().starts_with("rank 1's GPU failed during `ring.kv` (d)"), "{device}");
        let lost = CommError::RankLost { rank: 2, op: "o".into(), detail: "d".into() };
        assert_eq!((lost.class(), lost.world_intact()), (ErrorClass::Peer, false));
        let abort = CommError::Aborted { rank: 1, op: "o".into(), class: ErrorClass::Device, reason: "r".into() };
        assert_eq!((abort.class(), abort.world_intact()), (ErrorClass::Device, true));
        assert_eq!(CommError::Misuse("m".into()).class(), ErrorClass::Internal);
        let big = CommError::TooLarge { op: "o".into(), what: "w".into(), size: 2, limit: 1 };
        assert_eq!(big.class(), ErrorClass::TooLarge);
    }

    #[test]
    fn collectives_on_threads() {
        for n in 1..=4 {
            let out = run_ranks(n, |mut c: local::LocalComm| -> Result<(Vec<Vec<f32>>, String, usize)> {
                let me = c.rank();
                let g = all_gather_f32(&mut c, "gather", &vec![me as f32; me + 1])?;
                let msg = if me == 0 { Some("hello".to_string()) } else { None };
                let b: String = broadcast_value(&mut c, "bcast", 0, msg.as_ref())?;
                barrier(&mut c, "barrier")?;
                let sizes: Vec<usize> = all_gather_value(&mut c, "sizes", &(me * 10))?;
                Ok((g, b, sizes.iter().sum()))
            });
            for (r, res) in out.into_iter().enumerate() {
                let (g, b, s) = res.expect("rank ok");
                assert_eq!(g.len(), n);
                for (src, v) in g.iter().enumerate() {
                    assert_eq!(v, &vec![src as f32; src + 1], "rank {r} from {src}");
                }
                assert_eq!(b, "hello");
                assert_eq!(s, (0..n).map(|x| x * 10).sum::<usize>());
            }
        }
    }

    #[test]
    fn ring_post_compute_wait_and_stats() {
        let n = 3;
        let out = run_ranks(n, |mut c: local::LocalComm| -> Result<(Vec<f32>, CommStats)> {
            let me = c.rank();
            let next = (me + 1) % n;
            let prev = (me + n - 1) % n;
            let mut blk = vec![me as f32; 4];
            let mut seen = vec![];
            for _ in 0..n - 1 {
                post_f32(&mut c, "ring", next, &blk, prev)?;
                seen.push(blk[0]);
                blk = wait_f32(&mut c, "ring", prev)?;
            }
            seen.push(blk[0]);
            Ok((seen, c.stats().clone()))
        });
        for (r, res) in out.into_iter().enumerate() {
            let (seen, stats) = res.unwrap();
            let want: Vec<f32> = (0..n).map(|s| ((r + n - s) % n) as f32).collect();
            assert_eq!(seen, want);
            let ring = stats.ops["ring"];
            // 4 floats and the packet's 4-byte length, twice.
            assert_eq!((ring.calls, ring.bytes_sent, ring.bytes_received), (2, 40, 40));
        }
    }

    #[test]
    fn misuse_is_a_typed_error() {
        let out = run_ranks(1, |mut c: local::LocalComm| -> Result<()> {
            assert!(matches!(c.wait(), Err(CommError::Misuse(_))));
            c.post("a", vec![], vec![])?;
            assert!(matches!(c.post("b", vec![], vec![]), Err(CommError::Misuse(_))));
            c.wait()?;
            assert!(matches!(c.post("c", vec![(3, vec![])], vec![]), Err(CommError::BadRank { rank: 3, size: 1 })));
            Ok(())
        });
        out.into_iter().for_each(|r| r.unwrap());
    }

    #[test]
    fn a_lost_rank_is_named_not_waited_for() {
        let out = run_ranks(3, |mut c: local::LocalComm| -> Result<()> {
            if c.rank() == 2 {
                return Err(CommError::Misuse("rank 2 gives up".into()));
            }
            c.set_timeout(Duration::from_secs(20));
            let t = std::time::Instant::now();
            let r = all_gather_f32(&mut c, "probe.layer3", &[1.0]);
            assert!(t.elapsed() < Duration::from_secs(5), "detected without waiting for the deadline");
            r.map(|_| ())
        });
        for r in &out[..2] {
            let e = r.as_ref().unwrap_err().to_string();
            assert!(e.contains("rank 2 was lost") && e.contains("probe.layer3"), "{e}");
        }
    }

    #[test]
    fn an_abort_reaches_every_rank_and_the_next_job_starts_clean() {
        let out = run_ranks(3, |mut c: local::LocalComm| -> Result<(String, Vec<Vec<f32>>)> {
            c.set_timeout(Duration::from_secs(20));
            let me = c.rank();
            // Job 0: rank 1 gives up instead of joining the layer's gather; the others had
            // already sent their parts (left in flight) and learn why at once.
            let first = if me == 1 {
                c.abort(ErrorClass::Deadline, "the deadline passed at layer 5");
                String::new()
            } else {
                let t = std::time::Instant::now();
                let e = all_gather_f32(&mut c, "probe.layer5", &[me as f32; 1000]).unwrap_err();
                assert!(t.elapsed() < Duration::from_secs(5));
                assert!(matches!(&e, CommError::Aborted { rank: 1, class: ErrorClass::Deadline, .. }), "{e}");
                assert!(e.world_intact());
                e.to_string()
            };
            c.end_job();
            // Job 1: what job 0 left in flight is dropped; the gather sees only job 1's data.
            let g = all_gather_f32(&mut c, "next", &[10.0 + me as f32])?;
            c.end_job();
            Ok((first, g))
        });
        for (r, res) in out.into_iter().enumerate() {
            let (first, g) = res.unwrap();
            if r != 1 {
                assert!(
                    first.contains("rank 1 gave the job up during `probe.layer5`") && first.contains("layer 5"),
                    "{first}"
                );
            }
            assert_eq!(g, vec![vec![10.0], vec![11.0], vec![12.0]], "rank {r}");
        }
    }

    #[test]
    fn a_computing_rank_polls_an_abort_behind_data() {
        let out = run_ranks(2, |mut c: local::LocalComm| -> Result<()> {
            c.set_timeout(Duration::from_secs(20));
            if c.rank() == 0 {
                // Data of a later collective, then the abort: the poll must look past the data.
                c.post("probe.layer0", vec![(1, vec![1, 2, 3])], vec![])?;
                c.wait()?;
                c.abort(ErrorClass::Cancelled, "the client went away");
                // A barrier rank 1 is no longer in: its next job's message says so at once
                // (and is kept for that job).
                let e = barrier(&mut c, "late").unwrap_err();
                assert!(e.to_string().contains("moved on to a later job"), "{e}");
                c.end_job();
                barrier(&mut c, "next")
            } else {
                let t = std::time::Instant::now();
                let e = loop {
                    if let Err(e) = c.poll_abort("chunk_prefill") {
                        break e;
                    }
                    assert!(t.elapsed() < Duration::from_secs(5), "the abort was never seen");
                    std::thread::sleep(Duration::from_millis(5));
                };
                assert!(
                    matches!(&e, CommError::Aborted { rank: 0, class: ErrorClass::Cancelled, op, .. } if op == "chunk_prefill"),
                    "{e}"
                );
                c.end_job();
                barrier(&mut c, "next")
            }
        });
        out.into_iter().for_each(|r| r.unwrap());
    }

    #[test]
    fn a_rank_that_leaves_is_named_at_once_even_while_its_thread_lives() {
        let out = run_ranks(3, |mut c: local::LocalComm| -> Result<()> {
            c.set_timeout(Duration::from_secs(20));
            if c.rank() == 2 {
                c.leave("rank 2 panicked: boom");
                std::thread::sleep(Duration::from_millis(1500));
                return Ok(());
            }
            let t = std::time::Instant::now();
            let e = all_gather_f32(&mut c, "probe.layer1", &[1.0]).unwrap_err();
            assert!(t.elapsed() < Duration::from_secs(1), "named before the thread ended");
            assert!(!e.world_intact());
            let m = e.to_string();
            assert!(m.contains("rank 2 was lost during `probe.layer1`") && m.contains("rank 2 panicked: boom"), "{m}");
            // In a later job too.
            c.end_job();
            let e = barrier(&mut c, "next").unwrap_err();
            assert!(e.to_string().contains("rank 2 panicked"), "{e}");
            Ok(())
        });
        out.into_iter().for_each(|r| r.unwrap());
    }

    #[test]
    fn a_timeout_past_what_an_instant_holds_means_no_deadline() {
        // `now + timeout` panicked (overflow) for a --comm-timeout of 1e19 s.
        for huge in [Duration::MAX, Duration::from_secs_f64(1e19)] {
            let out = run_ranks(2, |mut c: local::LocalComm| -> Result<Vec<Vec<f32>>> {
                c.set_timeout(huge);
                if c.rank() == 1 {
                    // The wait blocks until the message comes (no deadline, no panic).
                    std::thread::sleep(Duration::from_millis(50));
                }
                let me = c.rank() as f32;
                all_gather_f32(&mut c, "gather", &[me])
            });
            for r in out {
                assert_eq!(r.unwrap(), vec![vec![0.0], vec![1.0]]);
            }
        }
        assert_eq!(time_left(None), Duration::MAX);
        assert!(deadline_after(Duration::MAX).is_none());
    }

    #[test]
    fn a_silent_rank_times_out() {
        let out = run_ranks(2, |mut c: local::LocalComm| -> Result<()> {
            c.set_timeout(Duration::from_millis(300));
            if c.rank() == 1 {
                std::thread::sleep(Duration::from_millis(1500));
                return Ok(());
            }
            barrier(&mut c, "barrier")
        });
        let e = out[0].as_ref().unwrap_err().to_string();
        assert!(e.contains("rank 1 did not answer") && e.contains("barrier"), "{e}");
    }
}
