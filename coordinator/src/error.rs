//! Typed errors of the coordinator. Every error says whose fault it is ([`CoordError::class`]),
//! which is what the service maps to an HTTP status and the CLI to an exit code, and whether
//! the world of ranks survives it ([`CoordError::breaks_world`]).

use flowprefill_comm::{CommError, ErrorClass};
use flowprefill_kernels::{either, gib, OomAdvice};
use flowprefill_worker::{InputError, WorkerError};

/// What can go wrong running a request.
#[derive(Debug, thiserror::Error)]
pub enum CoordError {
    /// The caller's input (request or options) is invalid.
    #[error(transparent)]
    Input(#[from] InputError),
    /// A worker step failed (model, tokenizer, kernels, communication, a stopped job).
    #[error(transparent)]
    Worker(#[from] WorkerError),
    /// Another rank found the job's input invalid before any work started (every rank runs the
    /// same checks; they agree on the outcome).
    #[error("{message}")]
    Remote {
        /// The rank that reported it.
        rank: usize,
        /// Whose fault.
        class: ErrorClass,
        /// Its message (as the CLI words it).
        message: String,
        /// Its message for the HTTP API.
        api_message: String,
    },
    /// A rank panicked: a bug; the world must be rebuilt.
    #[error("rank {rank} panicked: {message} (a bug in flowprefill; please report it)")]
    Panicked {
        /// The rank.
        rank: usize,
        /// The panic's message.
        message: String,
    },
    /// The ranks cannot run jobs any more (a rank was lost earlier).
    #[error("the ranks are down: {0}")]
    WorldDown(String),
    /// The job's memory plan does not fit in what its device has free (refused at admission).
    #[error(transparent)]
    DoesNotFit(Box<DoesNotFit>),
    /// An invariant of the coordinator does not hold: a bug.
    #[error("internal error: {0} (a bug in flowprefill; please report it)")]
    Internal(String),
}

impl From<CommError> for CoordError {
    fn from(e: CommError) -> Self {
        Self::Worker(WorkerError::Comm(e))
    }
}

impl From<flowprefill_kernels::KernelError> for CoordError {
    fn from(e: flowprefill_kernels::KernelError) -> Self {
        Self::Worker(WorkerError::Kernel(e))
    }
}

impl CoordError {
    /// Whose fault the error is.
    pub fn class(&self) -> ErrorClass {
        match self {
            CoordError::Input(_) => ErrorClass::Caller,
            CoordError::Worker(e) => e.class(),
            CoordError::Remote { class, .. } => *class,
            CoordError::Panicked { .. } | CoordError::Internal(_) => ErrorClass::Internal,
            CoordError::WorldDown(_) => ErrorClass::Peer,
            CoordError::DoesNotFit(_) => ErrorClass::TooLarge,
        }
    }

    /// Whether the world of ranks is unusable after this error (a rank lost, stuck or
    /// panicked): thread ranks must be rebuilt, an MPI job must end. Everything else leaves
    /// every rank in step for the next job.
    pub fn breaks_world(&self) -> bool {
        match self {
            CoordError::Worker(WorkerError::Comm(e)) => !e.world_intact(),
            CoordError::Panicked { .. } | CoordError::WorldDown(_) => true,
            _ => false,
        }
    }

    /// Whether this rank learnt of the error from a peer's abort (the peer told every rank).
    pub fn from_peer_abort(&self) -> bool {
        matches!(self, CoordError::Worker(WorkerError::Comm(CommError::Aborted { .. })))
    }

    /// The device that ran out of memory (`cuda:N`, `cpu`) for a resource error; `None` for
    /// any other error. A peer's error crossed the ranks as text: its device is read from
    /// the message (`needs X more on DEVICE (...)`).
    pub fn out_of_memory_device(&self) -> Option<String> {
        if self.class() != ErrorClass::Resource {
            return None;
        }
        if let CoordError::Worker(WorkerError::Kernel(flowprefill_kernels::KernelError::OutOfMemory {
            device, ..
        })) = self
        {
            return Some(device.clone());
        }
        let msg = self.to_string();
        let device = msg.split(" more on ").nth(1).and_then(|rest| rest.split_whitespace().next());
        Some(device.unwrap_or("unknown").to_string())
    }

    /// This error with `advice` when it is a kernel's out-of-memory error (any other unchanged):
    /// see [`flowprefill_kernels::KernelError::advised`].
    pub fn advised(self, advice: OomAdvice) -> Self {
        match self {
            CoordError::Worker(e) => CoordError::Worker(e.advised(advice)),
            e => e,
        }
    }

    /// The message for the HTTP API: input errors name JSON fields rather than flags.
    pub fn api_message(&self) -> String {
        match self {
            CoordError::Input(e) => e.api_message(),
            CoordError::Worker(e) => e.api_message(),
            CoordError::Remote { api_message, .. } => api_message.clone(),
            e => e.to_string(),
        }
    }
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, CoordError>;

/// An internal-invariant error (a bug).
pub(crate) fn internal(msg: impl Into<String>) -> CoordError {
    CoordError::Internal(msg.into())
}

/// The message of a caught panic.
pub fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into())
}

/// `need` and `free` written so that they differ (MiB, then bytes, where GiB to two places
/// would read "needs 0.02 GiB but 0.02 GiB is free").
fn sizes(need: usize, free: usize) -> (String, String) {
    let (n, f) = (gib(need), gib(free));
    if n != f {
        return (n, f);
    }
    let mib = |b: usize| format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64);
    let (n, f) = (mib(need), mib(free));
    if n != f {
        return (n, f);
    }
    (format!("{need} bytes"), format!("{free} bytes"))
}

/// A job that does not fit in the memory free for it (the memory plan's verdict,
/// [`crate::memory::fits`]). Its advice names only what would make room: more ranks only where
/// the job spreads over them and each has a device of its own ([`DoesNotFit::more_ranks_help`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the job needs {} on {device} (rank {rank}, at its {phase} peak: {parts}) but {}; {}",
    sizes(*need, *free).0,
    if *capped {
        format!("--memory-limit allows {}", sizes(*need, *free).1)
    } else if *store > 0 {
        format!("{} is free with the chunk store emptied ({} of it held by the store)", sizes(*need, *free).1, gib(*store))
    } else {
        format!("{} is free", sizes(*need, *free).1)
    },
    self.advice()
)]
pub struct DoesNotFit {
    /// The rank that cannot hold it.
    pub rank: usize,
    /// Its device.
    pub device: String,
    /// Bytes the job needs there.
    pub need: usize,
    /// Bytes free there, the store's included.
    pub free: usize,
    /// Bytes of that held by the chunk store.
    pub store: usize,
    /// The phase of the peak.
    pub phase: &'static str,
    /// What the job holds then.
    pub parts: String,
    /// `free` is the operator's cap (`--memory-limit`), not the device's.
    pub capped: bool,
    /// K/V are already bf16 (halving them is no advice).
    pub kv_bf16: bool,
    /// The method holds the whole context on rank 0 (`full`): more ranks do not spread it.
    pub whole_on_rank_0: bool,
    /// Ranks whose jobs share this device's memory (1: a device of its own): more of them on
    /// it add to what it holds rather than split it.
    pub peers: usize,
}

impl DoesNotFit {
    /// Whether more ranks would make room: only where the job spreads over its ranks and each
    /// has a device of its own.
    pub fn more_ranks_help(&self) -> bool {
        !self.whole_on_rank_0 && self.peers <= 1
    }

    /// What to change ("give fewer context tokens, run on more ranks, or keep K/V in bf16 ..."),
    /// and, where more ranks would not help, why.
    fn advice(&self) -> String {
        let mut parts = vec!["give fewer context tokens"];
        parts.extend(self.more_ranks_help().then_some("run on more ranks"));
        parts.extend((!self.kv_bf16).then_some("keep K/V in bf16 (--kv-dtype bf16)"));
        let mut why = Vec::new();
        if self.whole_on_rank_0 {
            why.push("`full` holds the whole context on rank 0".to_string());
        }
        if self.peers > 1 {
            why.push(format!("the job's {} ranks share the memory of {}", self.peers, self.device));
        }
        if why.is_empty() {
            either(&parts)
        } else {
            format!("{} ({})", either(&parts), why.join("; "))
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn need_and_free_are_written_so_that_they_differ() {
        assert_eq!(super::sizes(24_000_000, 22_000_000), ("22.9 MiB".to_string(), "21.0 MiB".to_string()));
        assert_eq!(super::sizes(3 << 30, 1 << 30), ("3.00 GiB".to_string(), "1.00 GiB".to_string()));
        assert_eq!(super::sizes(1_000_001, 1_000_000), ("1000001 bytes".to_string(), "1000000 bytes".to_string()));
    }

    #[test]
    fn a_stranded_device_exchange_breaks_the_world_with_the_peers_class() {
        use flowprefill_comm::{CommError, ErrorClass};
        let stranded = |class, reason: &str| {
            super::CoordError::Worker(flowprefill_worker::WorkerError::Comm(CommError::Stranded {
                rank: 1,
                op: "ring.kv".into(),
                class,
                reason: reason.into(),
            }))
        };
        // Out of memory for the receive buffers: retried as the peer's resource error.
        let oom = stranded(ErrorClass::Resource, "needs 1.00 GiB more on cuda:1 (0 bytes free)");
        assert!(oom.breaks_world() && !oom.from_peer_abort());
        assert_eq!((oom.class(), oom.out_of_memory_device().as_deref()), (ErrorClass::Resource, Some("cuda:1")));
        // The peer's GPU lost: the device's class, which stops the service.
        let lost = stranded(ErrorClass::Device, "rank 1's GPU failed");
        assert_eq!(lost.class(), ErrorClass::Device);
        let down = super::CoordError::Worker(flowprefill_worker::WorkerError::Comm(CommError::PlaneDown {
            op: "ring.kv".into(),
            why: "stranded".into(),
        }));
        assert!(down.breaks_world() && down.class() == ErrorClass::Peer);
    }
}
