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
        "out of memory: needs {} more on {device} ({}); retry when memory is free, or give fewer \
         tokens, more ranks, or --kv-dtype bf16",
        gib(*requested),
        free.map_or("free memory unknown".to_string(), |f| format!("{} free", gib(f)))
    )]
    OutOfMemory {
        /// `cuda:N` or `cpu`.
        device: String,
        /// Bytes the failed allocation asked for.
        requested: usize,
        /// Bytes free on the device when it failed, when known.
        free: Option<usize>,
    },
    /// A backend (e.g. CUDA) is not available or failed.
    #[error("backend {backend}: {detail}")]
    Backend {
        /// Backend name.
        backend: &'static str,
        /// What failed.
        detail: String,
    },
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
