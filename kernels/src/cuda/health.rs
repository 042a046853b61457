//! A GPU that stopped answering. A kernel that never finishes (a barrier no copy completes,
//! on a GPU whose driver encodes a tensor map unlike the emulation) holds the backend's one
//! stream: every later op queues behind it and the next download waits forever. The waits
//! that run a kernel on this GPU for the first time (the Hopper kernel's self-check, the
//! autotuner's timings) are bounded ([`CudaBackend::finish_within`]); one that runs out marks
//! the backend hung, and from then on every launch fails at once with
//! [`KernelError::DeviceLost`] instead of joining the queue. A fault (an illegal address) needs
//! no mark: the driver itself answers every later call with it (`super::err`).

use super::backend::CudaBackend;
use super::err;
use crate::error::{KernelError, Result};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a first run on this GPU may take before its kernel is taken for one that never
/// finishes: the self-check's problems take milliseconds, the autotuner's one run of a call
/// well under a second, even on a GPU time-sliced between processes.
pub(super) const FIRST_RUN_LIMIT: Duration = Duration::from_secs(60);

/// Why the backend's stream is held by a kernel that never finished, once one was seen.
#[derive(Default)]
pub(super) struct Hung(Mutex<Option<String>>);

impl Hung {
    /// Fails with [`KernelError::DeviceLost`] once a kernel was seen not to finish.
    pub(super) fn check(&self, ordinal: usize) -> Result<()> {
        match self.0.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            Some(why) => Err(lost(ordinal, why.clone())),
            None => Ok(()),
        }
    }

    fn mark(&self, why: &str) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert_with(|| why.to_string());
    }
}

fn lost(ordinal: usize, detail: String) -> KernelError {
    KernelError::DeviceLost { device: format!("cuda:{ordinal}"), detail, hung: true }
}

impl CudaBackend {
    /// Waits until everything queued on the stream so far has run, at most `limit`: past it,
    /// the backend is marked hung (every later launch fails) and the error says `what` did not
    /// finish. The host polls an event rather than blocking in the driver, which would not
    /// return.
    pub(super) fn finish_within(&self, what: &str, limit: Duration) -> Result<()> {
        let event = self.stream.record_event(None).map_err(|e| err(what, e))?;
        let start = Instant::now();
        while !event.try_is_complete().map_err(|e| err(what, e))? {
            if start.elapsed() >= limit {
                let why = format!("{what} did not finish within {} s", limit.as_secs());
                self.hung.mark(&why);
                return Err(lost(self.ordinal(), why));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok(())
    }
}
