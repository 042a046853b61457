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
    /// A mistake in the arguments of a measurement (the caller's to fix: exit code 2).
    #[error("{0}")]
    Usage(String),
    /// The engine or the ranks failed a run.
    #[error(transparent)]
    Coord(#[from] flowprefill_coordinator::CoordError),
    /// The model failed (loading, tokenizing, a forward).
    #[error(transparent)]
    Worker(#[from] flowprefill_worker::WorkerError),
    /// The caller's input, refused by the system.
    #[error(transparent)]
    Input(#[from] flowprefill_worker::InputError),
    /// A kernel failed (a measured op of the calibration).
    #[error(transparent)]
    Kernel(#[from] flowprefill_kernels::KernelError),
    /// Communication between ranks failed.
    #[error(transparent)]
    Comm(#[from] flowprefill_comm::CommError),
    /// A measurement that went wrong (a server that did not start, a run that made no number).
    #[error("{0}")]
    Failed(String),
    /// One run of a study failed; the runs before it are saved and a rerun resumes at it.
    #[error(
        "run {run} failed: {error}; every run before it is in results.json, and the same command resumes at this \
         one (leave its method, task or length out to go past it)"
    )]
    StudyRun {
        /// The run's key (task|length|sample|method|ratio, and its setting).
        run: String,
        /// Why (its class is the error's).
        error: flowprefill_coordinator::CoordError,
    },
    /// Results that do not serialise.
    #[error("{}: {source}", path.display())]
    Json {
        /// The file they were for.
        path: PathBuf,
        /// The cause.
        source: serde_json::Error,
    },
}

impl LabError {
    /// Whose fault the error is, where the system says (the binary maps it to an exit code);
    /// `None` for the lab's own failures (IO, plots, results files).
    pub fn class(&self) -> Option<flowprefill_coordinator::ErrorClass> {
        use flowprefill_coordinator::ErrorClass;
        match self {
            // A results file that is not eval's: the caller named the wrong --out.
            LabError::Usage(_) | LabError::Input(_) | LabError::NotResults { .. } => Some(ErrorClass::Caller),
            LabError::Coord(e) | LabError::StudyRun { error: e, .. } => Some(e.class()),
            LabError::Worker(e) => Some(e.class()),
            LabError::Train(e) => e.class(),
            LabError::Comm(e) => Some(e.class()),
            LabError::Kernel(e) => Some(match e {
                flowprefill_kernels::KernelError::Shape { .. } => ErrorClass::Internal,
                flowprefill_kernels::KernelError::OutOfMemory { .. } => ErrorClass::Resource,
                flowprefill_kernels::KernelError::DeviceLost { .. } => ErrorClass::Device,
                _ => ErrorClass::Model,
            }),
            _ => None,
        }
    }
}

/// An IO error said as `WHAT PATH: CAUSE` in one message (a [`LabError::Failed`]: no
/// separate source, so that a printed chain says the cause once).
pub(crate) fn io_said(what: impl Into<String>, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> LabError {
    let (what, path) = (what.into(), path.into());
    move |e| LabError::Failed(format!("{what} {}: {e}", path.display()))
}

/// An IO error as its own message alone (a [`LabError::Failed`]).
pub(crate) fn io_plain(e: std::io::Error) -> LabError {
    LabError::Failed(e.to_string())
}

/// Fails with [`LabError::Usage`] (the caller's mistake) unless `cond` holds.
macro_rules! ensure_usage {
    ($cond:expr, $($arg:tt)+) => {
        if !$cond {
            return Err($crate::LabError::Usage(format!($($arg)+)));
        }
    };
}
pub(crate) use ensure_usage;

/// Results of the lab.
pub type Result<T> = std::result::Result<T, LabError>;

/// Refuses a list (`flag`'s) that gives a value twice ("--lengths gives 1024 twice; give each
/// length once"): a measurement would run it twice and count it twice in its tables.
pub fn each_once<T: PartialEq + std::fmt::Display>(flag: &str, what: &str, values: &[T]) -> Result<()> {
    for (i, v) in values.iter().enumerate() {
        ensure_usage!(!values[..i].contains(v), "{flag} gives {v} twice; give each {what} once");
    }
    Ok(())
}

/// An IO error with what was being done and to which file.
pub(crate) fn io(what: impl Into<String>, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> LabError {
    let (what, path) = (what.into(), path.into());
    move |source| LabError::Io { what, path, source }
}

/// The first words of the table of a run that stopped before its last case (`PARTIAL: 2 of 5
/// cases finished (interrupted)`): `check`'s and `importance`'s, and what a second `importance`
/// run into the same folder looks for.
pub const PARTIAL: &str = "PARTIAL: ";

/// Why a measurement of many cases (`check`, `importance`) ended before its last case; what it
/// measured before is kept, and its table is printed marked partial.
#[derive(Debug)]
pub enum Stop {
    /// Asked to stop (Ctrl-C): the case in progress finished first.
    Asked,
    /// A step failed; the cases before it are kept.
    Failed {
        /// Where ("infoflow on case niah-600-d0.70-0").
        at: String,
        /// What failed.
        error: Box<LabError>,
    },
}

/// What a measurement of many cases made: the rows of the cases that finished, how many
/// finished, and why the run stopped before its last case if it did.
pub struct Outcome<R> {
    /// The finished cases' rows.
    pub rows: Vec<R>,
    /// Cases finished.
    pub done: usize,
    /// Why the run ended before its last case.
    pub stopped: Option<Stop>,
}

impl Stop {
    /// The first line of the table of the `done` of `planned` cases a run finished before it
    /// stopped for this reason: `PARTIAL: 2 of 5 cases finished (interrupted)`.
    pub fn headline(&self, done: usize, planned: usize) -> String {
        format!("{PARTIAL}{done} of {planned} cases finished ({self})")
    }
}

impl std::fmt::Display for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stop::Asked => f.write_str("interrupted"),
            Stop::Failed { at, error } => write!(f, "{at} failed: {error}"),
        }
    }
}
