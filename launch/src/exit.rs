//! Whose fault an error is, mapped once: to the process's exit code (CLI) and to the HTTP
//! status and error kind (service).
//!
//! | class | exit code | HTTP | kind |
//! | --- | --- | --- | --- |
//! | caller's input | 2 | 400 | `bad_request` |
//! | model or configuration | 3 | 500 | `model` |
//! | another rank lost, stuck or out of step | 4 | 503 | `rank_failure` |
//! | deadline passed | 5 | 504 | `deadline` |
//! | cancelled | 6 | 499 | `cancelled` |
//! | internal (a bug) | 70 | 500 | `internal` |
//! | a device lost (its context: a kernel fault, a hung kernel) | 69 | 503 | `device_failure` |
//!
//! A bad flag value caught by the command is the caller's too ([`Usage`], exit 2, as clap's own
//! usage errors); any other unclassed failure (an IO error of the command itself) exits with 1.

use flowprefill_coordinator::{CoordError, ErrorClass};
use flowprefill_worker::WorkerError;

/// A mistake in a command's arguments that clap cannot see (a list that names nothing, an
/// output folder made with other settings): the caller's fault, exit code 2.
#[derive(Debug)]
pub struct Usage(pub String);

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Usage {}

/// A [`Usage`] error as an `anyhow::Error` (exit code 2).
pub fn usage(message: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(Usage(message.into()))
}

/// A command stopped by the user (Ctrl-C or SIGTERM) after keeping what it had done: exit
/// code 6, as a cancelled job.
#[derive(Debug)]
pub struct Interrupted(pub String);

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Interrupted {}

/// Why a service stopped on its own: a GPU of this process can run nothing more (a kernel
/// fault, a kernel that never finished). Exit 69: only a new process has the GPU again.
#[derive(Debug)]
pub struct DeviceStopped(pub String);

impl std::fmt::Display for DeviceStopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}; the service stopped: start it again", self.0)
    }
}

impl std::error::Error for DeviceStopped {}

/// `anyhow::ensure!` for argument checks: fails with [`Usage`] (exit code 2).
#[macro_export]
macro_rules! ensure_usage {
    ($cond:expr, $($arg:tt)+) => {
        if !$cond {
            return Err($crate::exit::usage(format!($($arg)+)));
        }
    };
}

/// `eprintln!` in one write: the line reaches stderr whole. Under `mpirun` every process's
/// stderr goes to one terminal, and `eprintln!` writes each formatted piece on its own (stderr
/// is unbuffered): a rank's "rank 0: " and the error after it were seen split by mpirun's own
/// lines (an abort notice between them).
#[macro_export]
macro_rules! say {
    ($($arg:tt)+) => {{
        let mut line = format!($($arg)+);
        line.push('\n');
        $crate::exit::write_stderr(&line);
    }};
}

/// Writes `text` to stderr in one call (a pipe takes up to 4 KiB in one piece); an error
/// (stderr closed) is ignored, as `eprintln!` would panic on it.
pub fn write_stderr(text: &str) {
    use std::io::Write as _;
    let _ = std::io::stderr().write_all(text.as_bytes());
}

/// Exit code of a command that failed with an error of `class`.
pub fn code(class: ErrorClass) -> i32 {
    match class {
        ErrorClass::Caller => 2,
        ErrorClass::Model => 3,
        ErrorClass::Peer => 4,
        ErrorClass::Deadline => 5,
        ErrorClass::Cancelled => 6,
        ErrorClass::Internal => 70,
        // sysexits' EX_TEMPFAIL: a temporary failure, the caller may retry.
        ErrorClass::Resource => 75,
        // The request must change, as for any other input error.
        ErrorClass::TooLarge => 2,
        // sysexits' EX_UNAVAILABLE: the GPU can do nothing more in this process; a new one may.
        ErrorClass::Device => 69,
    }
}

/// HTTP status and bounded error kind (a metrics label) of an error of `class`.
pub fn http(class: ErrorClass) -> (u16, &'static str) {
    match class {
        ErrorClass::Caller => (400, "bad_request"),
        ErrorClass::Model => (500, "model"),
        ErrorClass::Peer => (503, "rank_failure"),
        ErrorClass::Deadline => (504, "deadline"),
        ErrorClass::Cancelled => (499, "cancelled"),
        ErrorClass::Internal => (500, "internal"),
        ErrorClass::Resource => (503, "resource"),
        ErrorClass::TooLarge => (413, "too_large"),
        ErrorClass::Device => (503, "device_failure"),
    }
}

/// The class of the first typed error in an `anyhow` chain, if any.
pub fn class_of(e: &anyhow::Error) -> Option<ErrorClass> {
    e.chain().find_map(|c| {
        c.downcast_ref::<CoordError>()
            .map(CoordError::class)
            .or_else(|| c.downcast_ref::<WorkerError>().map(WorkerError::class))
            .or_else(|| c.downcast_ref::<flowprefill_worker::InputError>().map(|_| ErrorClass::Caller))
            .or_else(|| c.downcast_ref::<Usage>().map(|_| ErrorClass::Caller))
            .or_else(|| c.downcast_ref::<Interrupted>().map(|_| ErrorClass::Cancelled))
            .or_else(|| c.downcast_ref::<DeviceStopped>().map(|_| ErrorClass::Device))
            .or_else(|| c.downcast_ref::<flowprefill_lab::LabError>().and_then(flowprefill_lab::LabError::class))
            .or_else(|| c.downcast_ref::<flowprefill_lab::train::TrainError>().and_then(|e| e.class()))
            // A shape, device, link or profiles file the projection does not know: the caller's.
            .or_else(|| c.downcast_ref::<flowprefill_lab::project::ProjectError>().map(|_| ErrorClass::Caller))
            .or_else(|| c.downcast_ref::<flowprefill_comm::CommError>().map(flowprefill_comm::CommError::class))
            .or_else(|| {
                // A device that cannot be used (no driver, no GPU) is the machine's configuration.
                c.downcast_ref::<flowprefill_kernels::KernelError>().map(|e| match e {
                    flowprefill_kernels::KernelError::Shape { .. } => ErrorClass::Internal,
                    flowprefill_kernels::KernelError::OutOfMemory { .. } => ErrorClass::Resource,
                    flowprefill_kernels::KernelError::DeviceLost { .. } => ErrorClass::Device,
                    _ => ErrorClass::Model,
                })
            })
    })
}

/// Exit code for an `anyhow` error: by its class, else 1.
pub fn code_of(e: &anyhow::Error) -> i32 {
    class_of(e).map_or(1, code)
}

/// The message of `e` and its causes, joined by ": " as `{e:#}` does, without a cause whose
/// text the message already ends with (an error that shows its source in its own message and
/// also gives it as its source would print the OS's words twice).
pub fn message(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.is_empty() {
            out = text;
        } else if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use flowprefill_worker::{Field, InputError};

    /// An error that prints its source in its own message (the worker's and the lab's IO
    /// errors) gives the OS's words once; a context and a cause of other words keep both.
    #[test]
    fn a_cause_already_in_the_message_is_printed_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file or directory (os error 2)");
        let e = anyhow::Error::new(flowprefill_worker::WorkerError::Io { what: "creating nodir/x".into(), source: io });
        assert_eq!(format!("{e:#}").matches("os error 2").count(), 2, "the case this is for");
        assert_eq!(message(&e), "creating nodir/x: No such file or directory (os error 2)");
        let e = e.context("--out nodir/x");
        assert_eq!(message(&e), "--out nodir/x: creating nodir/x: No such file or directory (os error 2)");
        assert_eq!(message(&anyhow::anyhow!("plain")), "plain");
    }

    #[test]
    fn classes_map_to_distinct_codes_and_statuses() {
        let all = [
            ErrorClass::Caller,
            ErrorClass::Model,
            ErrorClass::Peer,
            ErrorClass::Deadline,
            ErrorClass::Cancelled,
            ErrorClass::Internal,
            ErrorClass::Resource,
        ];
        let codes: std::collections::BTreeSet<i32> = all.iter().map(|&c| code(c)).collect();
        assert_eq!(codes.len(), all.len());
        assert!(!codes.contains(&0) && !codes.contains(&1));
        // A job too large for the memory is the caller's to change: exit 2, its own status.
        assert_eq!(code(ErrorClass::TooLarge), code(ErrorClass::Caller));
        let statuses: std::collections::BTreeSet<(u16, &str)> =
            all.iter().chain([&ErrorClass::TooLarge]).map(|&c| http(c)).collect();
        assert_eq!(statuses.len(), all.len() + 1);
        assert_eq!(http(ErrorClass::TooLarge), (413, "too_large"));
        let e = anyhow::Error::from(CoordError::from(InputError::new(Field::Ratio, "1.5 is outside [0, 1]")))
            .context("running the job");
        assert_eq!(code_of(&e), 2);
        assert_eq!(http(class_of(&e).unwrap()), (400, "bad_request"));
        assert_eq!(code_of(&anyhow::anyhow!("plain")), 1);
    }
}
