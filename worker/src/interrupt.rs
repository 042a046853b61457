//! Stopping a job between layers: its client went away, its deadline passed, or (through the
//! caller's check) another rank gave it up.
//!
//! ```text
//!   forward:  layer 0 ─ check ─ layer 1 ─ check ─ ... ─ layer L-1
//!                         └─ Err(Stopped { phase, cause }) ends the forward there
//! ```
//! Long forwards take a `check` closure ([`crate::Model::forward_checked`], the chunk prefill,
//! recompute and ring steps); a [`Watch`] is the usual one. A stopped forward leaves caches as
//! they were (appends are rolled back by their `Attend`s).

use crate::error::{Result, StopCause, WorkerError};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The process's clock for [`beat`].
static EPOCH: OnceLock<Instant> = OnceLock::new();
/// Milliseconds from [`EPOCH`] to the last [`beat`].
static LAST_BEAT_MS: AtomicU64 = AtomicU64::new(0);
/// The phase of the last [`beat`].
static LAST_PHASE: Mutex<&'static str> = Mutex::new("start");

fn epoch_ms() -> u64 {
    EPOCH.get_or_init(Instant::now).elapsed().as_millis() as u64
}

/// A sign that this process is making progress in `phase`: every [`Watch::check`] (between
/// two layers of any forward) gives one. What a watchdog reads ([`since_beat`]) to tell a
/// stuck process from a slow one.
pub fn beat(phase: &'static str) {
    LAST_BEAT_MS.store(epoch_ms(), Ordering::Relaxed);
    *LAST_PHASE.lock().unwrap_or_else(|p| p.into_inner()) = phase;
}

/// How long a process may go without a [`beat`] before it counts as stuck, for a comm
/// deadline of `timeout`: four deadlines (a layer may outlast one deadline: a long context's
/// forward on a CPU; a rank that finished nothing for four is not coming back).
pub fn stuck_after(timeout: Duration) -> Duration {
    timeout.saturating_mul(4)
}

/// Time since the last [`beat`] of any thread of this process, and its phase.
pub fn since_beat() -> (Duration, &'static str) {
    let at = LAST_BEAT_MS.load(Ordering::Relaxed);
    let phase = *LAST_PHASE.lock().unwrap_or_else(|p| p.into_inner());
    (Duration::from_millis(epoch_ms().saturating_sub(at)), phase)
}

/// Called between layers of a long forward; an error stops it.
pub type Check<'a> = &'a mut dyn FnMut() -> Result<()>;

/// A check that never stops anything.
pub fn never() -> Result<()> {
    Ok(())
}

/// When a job must stop: a cancellation flag set by whoever waits for it, and a deadline.
#[derive(Clone, Debug, Default)]
pub struct Watch {
    cancel: Option<Arc<AtomicBool>>,
    deadline: Option<(Instant, Duration)>,
}

impl Watch {
    /// A watch on `cancel` (set when the job's client goes away) and a deadline `budget` from
    /// now.
    pub fn new(cancel: Option<Arc<AtomicBool>>, budget: Option<Duration>) -> Self {
        let now = Instant::now();
        // A budget too large for the clock (a client's 1e20 s) means no practical limit.
        let far = |b: Duration| now.checked_add(b).or_else(|| now.checked_add(Duration::from_secs(1 << 32)));
        Self { cancel, deadline: budget.and_then(|b| far(b).map(|at| (at, b))) }
    }

    /// Time left before the deadline (`None`: no deadline).
    pub fn remaining(&self) -> Option<Duration> {
        self.deadline.map(|(at, _)| at.saturating_duration_since(Instant::now()))
    }

    /// The budget the deadline was set from.
    pub fn budget(&self) -> Option<Duration> {
        self.deadline.map(|(_, b)| b)
    }

    /// Whether the job was cancelled.
    pub fn cancelled(&self) -> bool {
        self.cancel.as_ref().is_some_and(|c| c.load(Ordering::Relaxed))
    }

    /// `Err(Stopped)` naming `phase` if the job was cancelled or is past its deadline; a
    /// [`beat`] either way.
    pub fn check(&self, phase: &'static str) -> Result<()> {
        beat(phase);
        let cause = if self.cancelled() {
            StopCause::Cancelled
        } else {
            match self.deadline {
                Some((at, budget)) if Instant::now() >= at => StopCause::Deadline(budget.as_secs_f64()),
                _ => return Ok(()),
            }
        };
        Err(WorkerError::Stopped { phase: phase.to_string(), cause })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_watch_stops_on_cancel_and_on_deadline() {
        let flag = Arc::new(AtomicBool::new(false));
        let w = Watch::new(Some(flag.clone()), None);
        w.check("probe").unwrap();
        flag.store(true, Ordering::Relaxed);
        let e = w.check("probe").unwrap_err();
        assert!(matches!(&e, WorkerError::Stopped { cause: StopCause::Cancelled, phase } if phase == "probe"), "{e}");
        let w = Watch::new(None, Some(Duration::ZERO));
        let e = w.check("recompute").unwrap_err();
        assert!(e.to_string().contains("deadline of 0.0 s during recompute"), "{e}");
        // A huge budget (a client's 1e20 s) saturates instead of overflowing.
        let w = Watch::new(None, Some(Duration::from_secs(u64::MAX / 2)));
        w.check("decode").unwrap();
        assert!(w.remaining().is_some_and(|r| r > Duration::from_secs(1 << 30)));
        Watch::default().check("any").unwrap();
    }

    /// The beat is the process's: other tests of this binary beat from their threads at any
    /// time, so each step is tried until no other beat came between (a check that does not
    /// beat fails every try).
    #[test]
    fn every_check_is_a_beat() {
        let quiet_gap = (0..100).any(|_| {
            beat("before");
            std::thread::sleep(Duration::from_millis(30));
            let (gap, phase) = since_beat();
            gap >= Duration::from_millis(25) && phase == "before"
        });
        assert!(quiet_gap, "a beat ages, and keeps its phase");
        let beats = (0..100).any(|_| {
            beat("before");
            std::thread::sleep(Duration::from_millis(30));
            Watch::default().check("probe").is_ok() && since_beat().1 == "probe"
        });
        assert!(beats, "a check beats with its phase");
    }
}
