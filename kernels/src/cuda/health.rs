//! A GPU that stopped answering. A kernel that never finishes (a barrier no copy completes,
//! on a GPU whose driver encodes a tensor map unlike the emulation) holds the backend's one
//! stream: every later op queues behind it and the next download waits forever. The waits
//! that run a kernel on this GPU for the first time (the Hopper kernel's self-check, the
//! autotuner's timings) are bounded ([`CudaBackend::finish_within`]); one that runs out marks
//! the GPU hung for the process, and from then on every launch and every wait for the stream
//! of any backend on it fails at once with [`KernelError::DeviceLost`] instead of joining the
//! queue. (A copy that waits, a download, still can: the job's error comes from its launches
//! first, and the engine then writes nothing of that job.) A fault (an illegal address) needs
//! no mark: the driver itself answers every later call with it (`super::err`).

use super::backend::CudaBackend;
use super::err;
use crate::error::{KernelError, Result};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a first run on this GPU may take before its kernel is taken for one that never
/// finishes, unless `FLOWPREFILL_GPU_FIRST_RUN_LIMIT` says otherwise: the self-check's problems
/// take milliseconds, the autotuner's one run of a call well under a second, even on a GPU
/// time-sliced between processes.
pub(super) const FIRST_RUN_LIMIT: Duration = Duration::from_secs(60);

/// Why a GPU of this process is held by a kernel that never finished, once one was seen, by
/// ordinal: the process's, not one backend's (ranks rebuilt in the process on that GPU would
/// queue behind the same kernel).
static HUNG: Mutex<Vec<(usize, String)>> = Mutex::new(Vec::new());

/// Fails with [`KernelError::DeviceLost`] once a kernel on GPU `ordinal` was seen not to
/// finish.
pub(super) fn check_hung(ordinal: usize) -> Result<()> {
    let hung = HUNG.lock().unwrap_or_else(|p| p.into_inner());
    match hung.iter().find(|(o, _)| *o == ordinal) {
        Some((_, why)) => Err(lost(ordinal, why.clone())),
        None => Ok(()),
    }
}

fn mark_hung(ordinal: usize, why: &str) {
    let mut hung = HUNG.lock().unwrap_or_else(|p| p.into_inner());
    if !hung.iter().any(|(o, _)| *o == ordinal) {
        hung.push((ordinal, why.to_string()));
    }
}

fn lost(ordinal: usize, detail: String) -> KernelError {
    KernelError::DeviceLost { device: format!("cuda:{ordinal}"), detail, hung: true }
}

impl CudaBackend {
    /// `e`, a library call's failure on this GPU (cuBLAS's), or the device's loss behind it:
    /// after an asynchronous fault the first call to notice may be a library's, whose error
    /// does not say so (it was classed as the model's). [`super::err`] asks the thread's current
    /// context; this asks this GPU's, made current first.
    pub(super) fn or_lost(&self, e: KernelError) -> KernelError {
        if !matches!(e, KernelError::Backend { .. }) {
            return e;
        }
        let probe = || match self.stream.context().bind_to_thread() {
            Ok(()) => super::sticky_error(),
            Err(d) => Some(d.0),
        };
        match super::classify(e.to_string(), None, probe) {
            lost @ KernelError::DeviceLost { .. } => lost,
            _ => e,
        }
    }

    /// Waits until everything queued on the stream so far has run, at most the backend's first
    /// run limit: past it, the backend is marked hung (every later launch fails) and the error
    /// says `what` did not finish, and how to allow longer. The host polls an event rather than
    /// blocking in the driver, which would not return.
    pub(super) fn finish_within(&self, what: &str) -> Result<()> {
        let limit = self.first_run_limit;
        let event = self.stream.record_event(None).map_err(|e| err(what, e))?;
        let start = Instant::now();
        while !event.try_is_complete().map_err(|e| err(what, e))? {
            if start.elapsed() >= limit {
                let why = format!(
                    "{what} did not finish within {} s (on a GPU shared with other work that is slow rather than \
                     hung, {}=SECONDS allows longer)",
                    limit.as_secs_f64(),
                    super::settings::FIRST_RUN_ENV
                );
                mark_hung(self.ordinal(), &why);
                return Err(lost(self.ordinal(), why));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok(())
    }
}
