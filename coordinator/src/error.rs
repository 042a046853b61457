//! Typed errors of the coordinator. Input errors say what to change.

use flowprefill_worker::WorkerError;

/// What can go wrong running a request.
#[derive(Debug, thiserror::Error)]
pub enum CoordError {
    /// The request or its options are invalid.
    #[error("{0}")]
    Invalid(String),
    /// A worker step failed (model, tokenizer, kernels).
    #[error(transparent)]
    Worker(#[from] WorkerError),
}

impl From<flowprefill_comm::CommError> for CoordError {
    fn from(e: flowprefill_comm::CommError) -> Self {
        Self::Worker(WorkerError::Comm(e))
    }
}

impl From<flowprefill_kernels::KernelError> for CoordError {
    fn from(e: flowprefill_kernels::KernelError) -> Self {
        Self::Worker(WorkerError::Kernel(e))
    }
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, CoordError>;

pub(crate) fn invalid(msg: impl Into<String>) -> CoordError {
    CoordError::Invalid(msg.into())
}
