//! Projection of TTFT for hardware we do not have: the engine's own work accounting
//! ([`work`]) turned into time by device and link profiles ([`time`]).
//!
//! ```text
//!   request (lengths, chunking) + method + ranks
//!     -> work::plan: per rank, per phase: forwards (GEMM rows), attention calls (visible
//!        pairs), score passes, messages (bytes per collective per layer), ring steps
//!     -> time::project: roofline per op class (FLOP/s x efficiency by size, bytes / bandwidth),
//!        latency + bytes / bandwidth per message, the ring's transfers overlapped with its
//!        attention step by step, the sparse K/V all-gather's sends behind the sender's own
//!        work (its receivers wait for them); a phase lasts as long as its slowest rank
//!     -> TTFT and where it goes (compute, communication, exposed communication)
//! ```
//! Every constant of a profile carries its source (`profiles.json`); measured profiles of this
//! machine come from `flowprefill bench calibrate`. Figures made here are projections and are
//! labelled so wherever they are printed.

pub mod bench;
pub mod shape;
pub mod time;
pub mod work;

pub use bench::{load_profiles, project_run};
pub use shape::{Cost, Shape};
pub use time::{project, Device, Link, Profiles, Projection};
pub use work::{plan, range_pairs, Counts, Request, Work};

/// Errors of the projection (all of them the caller's to fix).
#[derive(Debug, thiserror::Error)]
pub enum ProjectError {
    /// A model shape that is not built in.
    #[error("unknown model shape `{name}`: give a GGUF file or one of: {known}")]
    UnknownShape {
        /// Name given.
        name: String,
        /// Built-in names.
        known: String,
    },
    /// A device or link not in the profiles.
    #[error("unknown {kind} `{name}`: use one of: {known} (or add it to a profiles file given with --profiles)")]
    UnknownProfile {
        /// "device" or "link".
        kind: &'static str,
        /// Name given.
        name: String,
        /// Names known.
        known: String,
    },
    /// A profiles file that cannot be used.
    #[error("profiles file {path}: {detail}")]
    Profiles {
        /// The file.
        path: String,
        /// What is wrong.
        detail: String,
    },
    /// A method the projection does not cover.
    #[error("the projection covers full, ring, infoflow and none; not {method}")]
    Unsupported {
        /// The method.
        method: String,
    },
    /// Arguments that make no plan.
    #[error("{0}")]
    Invalid(String),
}
