//! Typed errors of the kernels crate.

/// What can go wrong in a kernel call. Shapes are checked before any unsafe code runs.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// Buffer lengths do not match the dimensions passed with them.
    #[error("{op}: {detail}")]
    Shape {
        /// The operation that rejected its inputs.
        op: &'static str,
        /// Which buffer and which lengths disagree.
        detail: String,
    },
    /// Grouped-query attention needs the query heads to be a multiple of the KV heads.
    #[error(
        "{op}: {n_heads} query heads cannot share {n_kv_heads} KV heads \
         (the query head count must be a positive multiple of the KV head count)"
    )]
    HeadLayout {
        /// The operation that rejected the layout.
        op: &'static str,
        /// Query heads.
        n_heads: usize,
        /// Key/value heads.
        n_kv_heads: usize,
    },
    /// A buffer of an element type the operation does not take (e.g. a bf16 buffer into a
    /// GEMM, whose activations are f32).
    #[error("{op}: {detail}")]
    Dtype {
        /// The operation that rejected its inputs.
        op: &'static str,
        /// Which buffer, its type, and what the operation takes.
        detail: String,
    },
    /// An allocation failed for want of memory: a resource error (the same job may succeed
    /// when memory is free), not the model's fault nor a bug.
    #[error(
        "out of memory: needs {} more on {device} ({}); retry when memory is free{}",
        gib(*requested),
        free.map_or("free memory unknown".to_string(), |f| format!("{} free", gib(f))),
        advice.remedies()
    )]
    OutOfMemory {
        /// `cuda:N` or `cpu`.
        device: String,
        /// Bytes the failed allocation asked for.
        requested: usize,
        /// Bytes free on the device when it failed, when known.
        free: Option<usize>,
        /// What else would make room: the kernels do not know what their buffers are for
        /// ([`OomAdvice::default`]); the code that does says ([`KernelError::advised`]).
        advice: OomAdvice,
    },
    /// A backend (e.g. CUDA) is not available or failed.
    #[error("backend {backend}: {detail}")]
    Backend {
        /// Backend name.
        backend: &'static str,
        /// What failed.
        detail: String,
    },
    /// The device can no longer run anything in this process: a kernel fault (an illegal
    /// address or instruction), an uncorrectable memory error, or a kernel that never finished.
    /// CUDA keeps such an error for the context's life, so every later call fails the same way
    /// and only a new process has the GPU again: a service stops rather than fail every job.
    #[error(
        "{device} failed: {detail}; its context is lost (every later call on it in this process fails): restart \
         the process{}",
        if *hung { " (the GPU stays busy with that kernel until this process ends)" } else { "" }
    )]
    DeviceLost {
        /// `cuda:N`, or `the GPU` where the failing call did not know its ordinal.
        device: String,
        /// The call that failed and the driver's words.
        detail: String,
        /// A kernel that never finished (it still holds the GPU), not a fault.
        hung: bool,
    },
}

/// What, besides memory being freed, would let an allocation that failed succeed
/// ([`KernelError::OutOfMemory`]): only what helps where it failed is named. More ranks help a
/// job only when it spreads over them and each has a device of its own: not `full` (the whole
/// context on rank 0), not ranks that share one device (thread ranks on the CPU), not loading
/// the weights (every device holds all of them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OomAdvice {
    /// A job's buffers: fewer tokens always help; more ranks where `more_ranks`; K/V in bf16
    /// unless they are (`kv_bf16`).
    Job {
        /// The job spreads over its ranks, each on a device of its own.
        more_ranks: bool,
        /// K/V are bf16 already.
        kv_bf16: bool,
    },
    /// The model's weights: only a smaller model makes room.
    Weights,
}

impl Default for OomAdvice {
    /// What the kernels assume: a job's buffers, spread over ranks or not, K/V not known to be
    /// bf16.
    fn default() -> Self {
        OomAdvice::Job { more_ranks: false, kv_bf16: false }
    }
}

impl OomAdvice {
    /// The tail of the message after "retry when memory is free": `, or give fewer tokens, more
    /// ranks, or --kv-dtype bf16` (the parts that help).
    pub fn remedies(self) -> String {
        match self {
            OomAdvice::Weights => ", or load a smaller model".into(),
            OomAdvice::Job { more_ranks, kv_bf16 } => {
                let mut parts = vec!["fewer tokens"];
                parts.extend(more_ranks.then_some("more ranks"));
                parts.extend((!kv_bf16).then_some("--kv-dtype bf16"));
                format!(", or give {}", either(&parts))
            }
        }
    }
}

/// `a`, `a or b`, `a, b, or c`: alternatives as a message lists them.
pub fn either(parts: &[&str]) -> String {
    match parts {
        [] => String::new(),
        [one] => one.to_string(),
        [a, b] => format!("{a} or {b}"),
        [rest @ .., last] => format!("{}, or {last}", rest.join(", ")),
    }
}

impl KernelError {
    /// This error with `advice` when it is [`KernelError::OutOfMemory`] (any other unchanged):
    /// for the code that knows what the memory was for.
    pub fn advised(self, advice: OomAdvice) -> Self {
        match self {
            KernelError::OutOfMemory { device, requested, free, .. } => {
                KernelError::OutOfMemory { device, requested, free, advice }
            }
            e => e,
        }
    }
}

/// `bytes` in GiB for messages (`1.50 GiB`; `0.01 GiB` and below as MiB).
pub fn gib(bytes: usize) -> String {
    let g = bytes as f64 / (1u64 << 30) as f64;
    if g >= 0.01 {
        format!("{g:.2} GiB")
    } else {
        format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
    }
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, KernelError>;

/// Checks `len == want`, naming the operation and buffer otherwise.
pub(crate) fn check_len(op: &'static str, what: &str, len: usize, want: usize) -> Result<()> {
    if len == want {
        Ok(())
    } else {
        Err(KernelError::Shape { op, detail: format!("{what} has {len} elements, expected {want}") })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn oom(advice: OomAdvice) -> String {
        KernelError::OutOfMemory { device: "cuda:0".into(), requested: 3 << 30, free: Some(1 << 30), advice }
            .to_string()
    }

    #[test]
    fn out_of_memory_names_only_what_would_make_room() {
        let spread = OomAdvice::Job { more_ranks: true, kv_bf16: false };
        assert_eq!(
            oom(spread),
            "out of memory: needs 3.00 GiB more on cuda:0 (1.00 GiB free); retry when memory is free, or give fewer \
             tokens, more ranks, or --kv-dtype bf16"
        );
        // `full`, or ranks sharing one device: more ranks do not make room.
        let msg = oom(OomAdvice::default());
        assert!(msg.ends_with("retry when memory is free, or give fewer tokens or --kv-dtype bf16"), "{msg}");
        assert!(!msg.contains("ranks"), "{msg}");
        // K/V already bf16: halving them is no advice.
        let msg = oom(OomAdvice::Job { more_ranks: true, kv_bf16: true });
        assert!(msg.ends_with("or give fewer tokens or more ranks") && !msg.contains("--kv-dtype"), "{msg}");
        assert!(oom(OomAdvice::Job { more_ranks: false, kv_bf16: true }).ends_with("or give fewer tokens"));
        // The weights: neither tokens nor ranks.
        let msg = oom(OomAdvice::Weights);
        assert!(msg.ends_with("retry when memory is free, or load a smaller model"), "{msg}");
        assert!(!msg.contains("tokens") && !msg.contains("ranks") && !msg.contains("--kv-dtype"), "{msg}");
    }

    #[test]
    fn advice_reaches_out_of_memory_errors_only() {
        let e =
            KernelError::OutOfMemory { device: "cpu".into(), requested: 1, free: None, advice: OomAdvice::default() };
        let e = e.advised(OomAdvice::Weights);
        assert!(matches!(e, KernelError::OutOfMemory { advice: OomAdvice::Weights, .. }), "{e:?}");
        let e = KernelError::Shape { op: "x", detail: "y".into() }.advised(OomAdvice::Weights);
        assert_eq!(e.to_string(), "x: y");
    }

    #[test]
    fn alternatives_are_listed_as_a_sentence_does() {
        assert_eq!(either(&[]), "");
        assert_eq!(either(&["a"]), "a");
        assert_eq!(either(&["a", "b"]), "a or b");
        assert_eq!(either(&["a", "b", "c"]), "a, b, or c");
    }
}
