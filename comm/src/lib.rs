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
//! Backends: [`local`] (ranks are threads of one process; used by every test) and `mpi`
//! (feature `mpi`: one process per rank under `mpirun`). Both count bytes and time per named
//! collective ([`CommStats`]). A device backend (NCCL) fits the same trait: callers only use
//! the helpers below.

pub mod local;
#[cfg(feature = "mpi")]
pub mod mpi;

use serde::de::DeserializeOwned;
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::Duration;

/// Default deadline of a wait.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// What can go wrong talking to other ranks.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// A peer disappeared (its thread ended or its process died).
    #[error("rank {rank} was lost during `{op}` ({detail}); the job cannot continue without it")]
    RankLost {
        /// The lost rank.
        rank: usize,
        /// The collective in progress.
        op: String,
        /// What was observed.
        detail: String,
    },
    /// A peer did not answer in time.
    #[error(
        "rank {rank} did not answer within {secs:.0} s during `{op}` (lost or stuck); raise --comm-timeout \
         if ranks legitimately compute longer between collectives"
    )]
    Timeout {
        /// The rank waited for.
        rank: usize,
        /// The collective in progress.
        op: String,
        /// The deadline.
        secs: f64,
    },
    /// The API was used out of order (e.g. wait before post).
    #[error("communicator misuse: {0}")]
    Misuse(String),
    /// A message could not be decoded.
    #[error("message from rank {rank} during `{op}`: {detail}")]
    Decode {
        /// The sender.
        rank: usize,
        /// The collective.
        op: String,
        /// What is wrong.
        detail: String,
    },
    /// A rank number outside the world.
    #[error("rank {rank} does not exist in a world of {size}")]
    BadRank {
        /// The rank.
        rank: usize,
        /// World size.
        size: usize,
    },
    /// The MPI layer failed.
    #[error("MPI: {0}")]
    Mpi(String),
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, CommError>;

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
    /// Starts an exchange: queues `sends` (to, payload) and the ranks one message is expected
    /// from. Fails if an exchange is already pending.
    fn post(&mut self, op: &str, sends: Vec<(usize, Vec<u8>)>, from: Vec<usize>) -> Result<()>;
    /// Completes the pending exchange; messages come in the order of `from`.
    fn wait(&mut self) -> Result<Vec<Vec<u8>>>;
    /// Counters so far.
    fn stats(&self) -> &CommStats;
    /// Clears the counters.
    fn reset_stats(&mut self);
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

fn f32_bytes(data: &[f32]) -> Vec<u8> {
    bytemuck::cast_slice::<f32, u8>(data).to_vec()
}

fn bytes_f32(rank: usize, op: &str, b: &[u8]) -> Result<Vec<f32>> {
    if b.len() % 4 != 0 {
        return Err(CommError::Decode {
            rank,
            op: op.into(),
            detail: format!("{} bytes is not a whole number of f32", b.len()),
        });
    }
    // Received buffers are not necessarily 4-byte aligned: copy element by element.
    Ok(b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

/// All-gather of f32 slices of any length (the lengths travel with the data).
pub fn all_gather_f32(comm: &mut dyn Communicator, op: &str, data: &[f32]) -> Result<Vec<Vec<f32>>> {
    let got = all_gather_bytes(comm, op, f32_bytes(data))?;
    got.iter().enumerate().map(|(r, b)| bytes_f32(r, op, b)).collect()
}

/// Sends f32 data to `to` and receives from `from` (a ring step), split-phase: returns after
/// posting; complete with [`wait_f32`].
pub fn post_f32(comm: &mut dyn Communicator, op: &str, to: usize, data: &[f32], from: usize) -> Result<()> {
    comm.post(op, vec![(to, f32_bytes(data))], vec![from])
}

/// Completes a [`post_f32`].
pub fn wait_f32(comm: &mut dyn Communicator, op: &str, from: usize) -> Result<Vec<f32>> {
    let got = comm.wait()?;
    let b = got.into_iter().next().ok_or_else(|| CommError::Misuse("ring step lost its message".into()))?;
    bytes_f32(from, op, &b)
}

/// Encodes a control message.
pub fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>> {
    bincode::serde::encode_to_vec(value, bincode::config::standard()).map_err(|e| CommError::Decode {
        rank: usize::MAX,
        op: "encode".into(),
        detail: e.to_string(),
    })
}

/// Decodes a control message from `rank`.
pub fn decode<T: DeserializeOwned>(rank: usize, op: &str, bytes: &[u8]) -> Result<T> {
    bincode::serde::decode_from_slice(bytes, bincode::config::standard())
        .map(|(v, _)| v)
        .map_err(|e| CommError::Decode { rank, op: op.into(), detail: e.to_string() })
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
            assert_eq!((ring.calls, ring.bytes_sent, ring.bytes_received), (2, 32, 32));
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
