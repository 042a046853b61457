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
mod outputs;
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
    /// The run's folder holds a checkpoint of another method's run or made with other settings
    /// (the caller's to fix: the same settings, or another `--out`).
    #[error("checkpoint {}: {detail}", path.display())]
    OtherRun {
        /// The file.
        path: PathBuf,
        /// What differs and what to do.
        detail: String,
    },
    /// The run's folder holds a checkpoint made with another model: resuming it would train
    /// that model's values on this one (the caller's to fix).
    #[error(
        "the checkpoint in {} was made with model {made}, not with {given}; give another --out, or the same --model",
        out.display()
    )]
    OtherModel {
        /// The run's folder (`--out`).
        out: PathBuf,
        /// The model the checkpoint was made with (name and fingerprint).
        made: String,
        /// The model given now.
        given: String,
    },
    /// A checkpoint whose tensors are not of this run's shape.
    #[error(
        "checkpoint {}: `{tensor}` has shape {found:?} where this run's is {expected:?}; it is not this run's: \
         delete it, or give another --out",
        path.display()
    )]
    CheckpointShape {
        /// The file.
        path: PathBuf,
        /// The tensor (`rows`, `m`, `v`).
        tensor: &'static str,
        /// Its shape in the file.
        found: Vec<usize>,
        /// The shape of this run's initial values.
        expected: Vec<usize>,
    },
    /// The loss curve could not be drawn.
    #[error(transparent)]
    Plot(#[from] crate::plot::PlotError),
}

impl TrainError {
    /// Whose fault the error is, where that is known (the binary maps it to an exit code):
    /// settings and a run folder of another run are the caller's.
    pub fn class(&self) -> Option<flowprefill_coordinator::ErrorClass> {
        use flowprefill_coordinator::ErrorClass;
        match self {
            TrainError::Settings(_)
            | TrainError::OtherModel { .. }
            | TrainError::OtherRun { .. }
            | TrainError::CheckpointShape { .. } => Some(ErrorClass::Caller),
            TrainError::Worker(e) => Some(e.class()),
            TrainError::Coord(e) => Some(e.class()),
            _ => None,
        }
    }
}

/// Results of training.
pub type Result<T> = std::result::Result<T, TrainError>;
