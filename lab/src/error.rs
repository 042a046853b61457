//! Errors of the lab (all typed; the binary turns them into messages and exit codes).

use crate::plot::PlotError;
use crate::project::ProjectError;
use std::path::PathBuf;

/// What can go wrong while measuring or reporting.
#[derive(Debug, thiserror::Error)]
pub enum LabError {
    /// A file that could not be read, written or copied.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// "reading", "writing", "copying ... to".
        what: String,
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A chart that could not be drawn.
    #[error(transparent)]
    Plot(#[from] PlotError),
    /// The projection refused its input.
    #[error(transparent)]
    Project(#[from] ProjectError),
    /// A file that is not an eval's results file.
    #[error("{} is not a results file ({source}); pass another --out", path.display())]
    NotResults {
        /// The file.
        path: PathBuf,
        /// Why it does not parse.
        source: serde_json::Error,
    },
    /// A study folder that does not hold what its report reads.
    #[error("{}: {detail}", path.display())]
    Study {
        /// The file or folder.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// Training failed.
    #[error(transparent)]
    Train(#[from] crate::train::TrainError),
    /// Results that do not serialise.
    #[error("{}: {source}", path.display())]
    Json {
        /// The file they were for.
        path: PathBuf,
        /// The cause.
        source: serde_json::Error,
    },
}

/// Results of the lab.
pub type Result<T> = std::result::Result<T, LabError>;

/// An IO error with what was being done and to which file.
pub(crate) fn io(what: impl Into<String>, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> LabError {
    let (what, path) = (what.into(), path.into());
    move |source| LabError::Io { what, path, source }
}
