//! What can go wrong between ranks ([`CommError`]) and whose fault it is ([`ErrorClass`]).

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
    /// This rank's own device failed during a device exchange (its context is lost: a GPU
    /// kernel fault); not a peer's fault, and the process cannot use the device again.
    #[error(
        "rank {rank}'s GPU failed during `{op}` ({detail}); its context is lost (every later call on it in this \
         process fails): restart the process"
    )]
    Device {
        /// This rank.
        rank: usize,
        /// The collective in progress.
        op: String,
        /// What failed.
        detail: String,
    },
    /// A peer did not answer in time.
    #[error(
        "{} did not answer within {secs:.0} s during `{op}` ({}); raise --comm-timeout \
         if ranks legitimately compute longer between collectives",
        who(*rank),
        timeout_cause(*unsent)
    )]
    Timeout {
        /// The rank waited for (`usize::MAX`: not known, a collective of every rank).
        rank: usize,
        /// The collective in progress.
        op: String,
        /// The deadline.
        secs: f64,
        /// Bytes this rank was still sending in the exchange when the deadline passed (0 when
        /// unknown or all delivered): a slow link rather than a lost peer.
        unsent: u64,
    },
    /// The API was used out of order (e.g. wait before post).
    #[error("communicator misuse: {0}")]
    Misuse(String),
    /// A message could not be decoded (or, with `rank` = `usize::MAX`, this rank's own could
    /// not be encoded).
    #[error("{}: {detail}", message_of(*rank, op))]
    Decode {
        /// The sender (`usize::MAX`: this rank, encoding).
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
    /// A message too large for the transport: a numeric section holds at most `u32::MAX`
    /// values (its length prefix), an MPI message at most `i32::MAX` bytes (MPI's count).
    #[error(
        "`{op}`: {what} is too large for one message ({size} against a limit of {limit}); give the job \
         fewer tokens, or spread it over more ranks"
    )]
    TooLarge {
        /// The collective (or `packet` while a message is built).
        op: String,
        /// What is too large: a section of values, or the message to a rank.
        what: String,
        /// Its size, in the limit's unit.
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// A peer sent a message of another collective than the one this rank waits for: the
    /// ranks no longer issue the same collectives in the same order (a bug).
    #[error(
        "rank {rank} sent a message of another collective while this rank waited for `{op}`: the ranks are \
         out of step (a bug in flowprefill; please report it)"
    )]
    OutOfStep {
        /// The sender.
        rank: usize,
        /// The collective this rank waited for.
        op: String,
    },
    /// A peer gave the current job up (its own error, a cancellation or a deadline) and told
    /// every rank why; the world itself is fine and the next job can run.
    #[error("rank {rank} gave the job up during `{op}`: {reason}")]
    Aborted {
        /// The rank that gave up.
        rank: usize,
        /// The collective this rank was in when it learnt of it.
        op: String,
        /// Whose fault the peer's error was.
        class: ErrorClass,
        /// The peer's error message.
        reason: String,
    },
    /// A peer gave the job up without its side of a device exchange this rank had started
    /// (it failed between the exchange's control rows and its transfers): this rank's transfers
    /// can never complete, and on NCCL, whose unmatched transfers stay queued, the plane had
    /// to be torn down. The job failed for the peer's reason; the world must be rebuilt.
    #[error(
        "rank {rank} gave the job up during `{op}` ({reason}) without its side of this device exchange, which \
         can never complete: the device plane was torn down (thread ranks are rebuilt for the next job; under \
         mpirun the job ends: start it again)"
    )]
    Stranded {
        /// The rank that gave up.
        rank: usize,
        /// The device exchange.
        op: String,
        /// Whose fault the peer's error was.
        class: ErrorClass,
        /// The peer's error message.
        reason: String,
    },
    /// This rank's device plane was torn down by an earlier failure (a timeout, a stranded
    /// exchange, a job that ended with its transfers unmatched): no exchange runs on it again.
    #[error(
        "`{op}`: the device plane was torn down earlier ({why}); the ranks must be rebuilt (thread ranks are, \
         for the next job; under mpirun, start the job again)"
    )]
    PlaneDown {
        /// The exchange refused.
        op: String,
        /// The first failure.
        why: String,
    },
}

impl CommError {
    /// Whether the world of ranks is still usable after this error: an abort leaves every rank
    /// in step, and so does this rank's lost device (its control channel works: it tells the
    /// others with an abort of class [`ErrorClass::Device`], and its process stops); the others
    /// mean a rank is lost, stuck or out of step, or a device plane was torn down.
    pub fn world_intact(&self) -> bool {
        matches!(self, CommError::Aborted { .. } | CommError::Device { .. })
    }

    /// A peer's abort that left a device exchange of this rank unfinished: the same rank,
    /// operation, class and reason as [`CommError::Stranded`] (any other error unchanged).
    pub fn stranded(self) -> Self {
        match self {
            CommError::Aborted { rank, op, class, reason } => CommError::Stranded { rank, op, class, reason },
            e => e,
        }
    }

    /// Whose fault the error is: a peer's abort carries its own class; a message too large is
    /// the request's; this rank's lost device the device's; misuse and ranks out of step a bug;
    /// a peer lost, stuck or garbled (and MPI's own failures) the peers'.
    pub fn class(&self) -> ErrorClass {
        match self {
            CommError::Aborted { class, .. } | CommError::Stranded { class, .. } => *class,
            CommError::TooLarge { .. } => ErrorClass::TooLarge,
            CommError::Device { .. } => ErrorClass::Device,
            CommError::OutOfStep { .. } | CommError::Misuse(_) => ErrorClass::Internal,
            CommError::RankLost { .. }
            | CommError::Timeout { .. }
            | CommError::Decode { .. }
            | CommError::BadRank { .. }
            | CommError::PlaneDown { .. }
            | CommError::Mpi(_) => ErrorClass::Peer,
        }
    }
}

/// Whose fault an error is: decides the HTTP status and exit code, and travels with an abort
/// so that every rank reports a job's failure the same way.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum ErrorClass {
    /// The caller's input (a bad option, an oversized request): fix the request.
    Caller,
    /// The model file or the configuration of the process.
    Model,
    /// Another rank was lost, stuck or out of step.
    Peer,
    /// A broken invariant: a bug.
    Internal,
    /// The caller went away.
    Cancelled,
    /// The job's deadline passed.
    Deadline,
    /// Not enough device or host memory for the job now (another tenant, fragmentation, a
    /// larger job than the memory allows): nothing is wrong with the request or the model; the
    /// same job may succeed later, or smaller, or over more ranks.
    Resource,
    /// The job needs more memory than its ranks have free for it even with nothing else
    /// running: refused before any work; the caller must make it smaller (fewer tokens, more
    /// ranks, bf16 K/V).
    TooLarge,
    /// A device that can run nothing more in this process (a kernel fault, an uncorrectable
    /// memory error, a kernel that never finished): only a new process has it again.
    Device,
}

impl ErrorClass {
    /// Lower-case name (a bounded metrics label).
    pub fn name(self) -> &'static str {
        match self {
            ErrorClass::Caller => "caller",
            ErrorClass::Model => "model",
            ErrorClass::Peer => "peer",
            ErrorClass::Internal => "internal",
            ErrorClass::Cancelled => "cancelled",
            ErrorClass::Deadline => "deadline",
            ErrorClass::Resource => "resource",
            ErrorClass::TooLarge => "too_large",
            ErrorClass::Device => "device",
        }
    }
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, CommError>;

/// The rank a timeout names: "rank R", or where the wait was on every rank at once (forming a
/// group, an abort poll) and none is known, "a rank of the world".
fn who(rank: usize) -> String {
    if rank == usize::MAX {
        "a rank of the world".into()
    } else {
        format!("rank {rank}")
    }
}

/// Where a message that cannot be decoded (or encoded) comes from: "message from rank R during
/// `op`", or for this rank's own (`usize::MAX`), "this rank's message (op)".
fn message_of(rank: usize, op: &str) -> String {
    if rank == usize::MAX {
        format!("this rank's message ({op})")
    } else {
        format!("message from rank {rank} during `{op}`")
    }
}

/// Why a peer may not have answered: lost or stuck, or (when this rank's own messages were not
/// delivered either) a link too slow for the deadline.
fn timeout_cause(unsent: u64) -> String {
    if unsent == 0 {
        "lost or stuck".to_string()
    } else {
        format!(
            "lost or stuck, or the link to it too slow: {:.1} MB this rank sent in this exchange were still undelivered",
            unsent as f64 / 1e6
        )
    }
}
