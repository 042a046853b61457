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
    /// A backend (e.g. CUDA) is not available or failed.
    #[error("backend {backend}: {detail}")]
    Backend {
        /// Backend name.
        backend: &'static str,
        /// What failed.
        detail: String,
    },
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
