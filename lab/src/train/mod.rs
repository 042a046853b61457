//! Training the trained seeds, on the CPU: the model as a differentiable candle function
//! ([`model`]), an AdamW whose state can be checkpointed ([`adamw`]), one training run for
//! every method ([`run`]: samples, steps, validation, checkpoints, the adapter), and what is
//! each method's own: KV Packet's self-distillation ([`kvpacket`]), LookaheadKV's ground truth
//! and loss ([`lookahead`]).

pub mod adamw;
mod checkpoint;
pub mod kvpacket;
pub mod lookahead;
pub mod model;
pub mod run;

use std::path::PathBuf;

/// What can go wrong while training.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The training model refused its weights or its input.
    #[error("training model: {0}")]
    Model(String),
    /// A tensor operation failed.
    #[error("tensor operation: {0}")]
    Candle(#[from] candle_core::Error),
    /// Loading the model, tokenizing, generating the teacher's continuation.
    #[error(transparent)]
    Worker(#[from] flowprefill_worker::WorkerError),
    /// Building a request's layout.
    #[error(transparent)]
    Coord(#[from] flowprefill_coordinator::CoordError),
    /// Settings that cannot train (the message says which flag to change).
    #[error("{0}")]
    Settings(String),
    /// A checkpoint that cannot be written, or read back to resume.
    #[error("checkpoint {}: {detail}", path.display())]
    Checkpoint {
        /// The file.
        path: PathBuf,
        /// What is wrong and what to do.
        detail: String,
    },
    /// The loss curve could not be drawn.
    #[error(transparent)]
    Plot(#[from] crate::plot::PlotError),
}

/// Results of training.
pub type Result<T> = std::result::Result<T, TrainError>;
