//! Fault injection for the failure tests: a [`FaultPlan`] makes rank R misbehave when it
//! reaches phase P (`load`: the process's model load, R its MPI rank; `ingest`: a document's
//! ingestion, after its head's cache; `prefill` (full), `chunk_prefill`, `probe`, `recompute`,
//! `final_prompt`, `evict`, `decode`). Modes:
//! `exit` (the process exits with status [`EXIT_STATUS`], like a crashed MPI rank), `panic`
//! (the rank's thread panics), `hang` (the rank stops answering), `stall:MS` (the rank is
//! busy for MS milliseconds without looking at cancellations or deadlines, then goes on: a
//! slow step, for timing what happens after it), `oom` (the rank's next step fails with the
//! backend's out-of-memory error, as a GPU whose memory another tenant took), `device-lost`
//! (the step fails as after a kernel fault, and so does every later step of the rank: a GPU
//! whose context is lost stays lost for the process's life).
//!
//! A plan fires once (so that a service can recover by rebuilding its ranks; `device-lost`
//! keeps failing, as the driver does), the first time the rank reaches the phase or, with
//! `after:N`, the time after its first N (a fault in the third job of a run of many), and is
//! shared by the engines of a world. Every engine starts with the process's plan from
//! `FLOWPREFILL_FAULT=rank:R,phase:P,mode:M[,after:N]` ([`FaultPlan::from_env`]); tests set one
//! directly.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Exit status of the `exit` mode.
pub const EXIT_STATUS: i32 = 99;

/// What the rank does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultMode {
    /// The process exits.
    Exit,
    /// The rank's thread panics.
    Panic,
    /// The rank stops answering (sleeps forever).
    Hang,
    /// The rank is busy for this long, then continues.
    Stall(Duration),
    /// The rank's step fails for want of memory (device `injected`).
    OutOfMemory,
    /// The rank's device is lost: this step and every later one of the rank fail.
    DeviceLost,
}

/// One planned fault.
#[derive(Debug)]
pub struct FaultPlan {
    /// The rank that misbehaves.
    pub rank: usize,
    /// Where.
    pub phase: String,
    /// How.
    pub mode: FaultMode,
    /// Times the rank reaches the phase unharmed before the fault.
    pub after: usize,
    reached: AtomicUsize,
    fired: AtomicBool,
}

impl FaultPlan {
    /// A plan: `rank` misbehaves as `mode` when it reaches `phase`.
    pub fn new(rank: usize, phase: &str, mode: FaultMode) -> Arc<Self> {
        Self::after(rank, phase, mode, 0)
    }

    /// A plan that lets `rank` reach `phase` `after` times, then misbehaves as `mode` there.
    pub fn after(rank: usize, phase: &str, mode: FaultMode, after: usize) -> Arc<Self> {
        let (reached, fired) = (AtomicUsize::new(0), AtomicBool::new(false));
        Arc::new(Self { rank, phase: phase.to_string(), mode, after, reached, fired })
    }

    /// Parses `rank:R,phase:P,mode:M[,after:N]` (`None` if malformed).
    pub fn parse(s: &str) -> Option<Arc<Self>> {
        let (mut rank, mut phase, mut mode, mut after) = (None, None, None, 0);
        for part in s.split(',') {
            let (k, v) = part.split_once(':')?;
            let v = v.trim();
            match k.trim() {
                "rank" => rank = Some(v.parse().ok()?),
                "after" => after = v.parse().ok()?,
                "phase" => phase = Some(v.to_string()),
                "mode" => {
                    mode = Some(match v {
                        "exit" => FaultMode::Exit,
                        "panic" => FaultMode::Panic,
                        "hang" => FaultMode::Hang,
                        "oom" => FaultMode::OutOfMemory,
                        "device-lost" => FaultMode::DeviceLost,
                        _ => {
                            let ms = v.strip_prefix("stall")?.trim_start_matches([':', '=']);
                            FaultMode::Stall(Duration::from_millis(ms.parse().ok()?))
                        }
                    })
                }
                _ => return None,
            }
        }
        Some(Self::after(rank?, &phase.filter(|p| !p.is_empty())?, mode?, after))
    }

    /// The plan in `FLOWPREFILL_FAULT`, if any (a malformed value is reported and ignored):
    /// one per process, so that it fires once whatever the engines built (every engine starts
    /// with it; see [`crate::Engine::with_faults`]).
    pub fn from_env() -> Option<Arc<Self>> {
        static PLAN: std::sync::OnceLock<Option<Arc<FaultPlan>>> = std::sync::OnceLock::new();
        PLAN.get_or_init(|| {
            let s = std::env::var("FLOWPREFILL_FAULT").ok()?;
            let plan = Self::parse(&s);
            if plan.is_none() {
                tracing::warn!(value = %s, "FLOWPREFILL_FAULT ignored: expected rank:R,phase:P,mode:exit|panic|hang|stall:MS|oom|device-lost[,after:N]");
            }
            plan
        })
        .clone()
    }

    /// Misbehaves here if the plan says so (once); the `oom` mode is an error of the step, the
    /// `device-lost` mode of this step and of every later one of the rank, whatever its phase.
    pub fn point(&self, rank: usize, phase: &str) -> Result<(), flowprefill_kernels::KernelError> {
        let lost = || flowprefill_kernels::KernelError::DeviceLost {
            device: "injected".into(),
            detail: format!("an injected fault at rank {rank}'s {phase} (FLOWPREFILL_FAULT)"),
            hung: false,
        };
        if self.rank == rank && self.mode == FaultMode::DeviceLost && self.fired.load(Ordering::Relaxed) {
            return Err(lost());
        }
        if self.rank != rank || self.phase != phase || self.fired.load(Ordering::Relaxed) {
            return Ok(());
        }
        if self.reached.fetch_add(1, Ordering::Relaxed) < self.after || self.fired.swap(true, Ordering::Relaxed) {
            return Ok(());
        }
        tracing::warn!(rank, phase, mode = ?self.mode, "injected fault");
        match self.mode {
            FaultMode::Exit => std::process::exit(EXIT_STATUS),
            FaultMode::Panic => panic!("injected fault: rank {rank} at {phase}"),
            FaultMode::Hang => loop {
                std::thread::sleep(Duration::from_secs(3600));
            },
            FaultMode::Stall(d) => std::thread::sleep(d),
            FaultMode::OutOfMemory => {
                return Err(flowprefill_kernels::KernelError::OutOfMemory {
                    device: "injected".into(),
                    requested: 1 << 30,
                    free: Some(0),
                    advice: flowprefill_kernels::OomAdvice::default(),
                })
            }
            FaultMode::DeviceLost => return Err(lost()),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_specs() {
        let p = FaultPlan::parse("rank:1,phase:probe,mode:hang").unwrap();
        assert_eq!((p.rank, p.phase.as_str(), p.mode), (1, "probe", FaultMode::Hang));
        let p = FaultPlan::parse("rank:0, phase:decode, mode:stall:250").unwrap();
        assert_eq!(p.mode, FaultMode::Stall(Duration::from_millis(250)));
        assert!(FaultPlan::parse("rank:x,phase:probe,mode:hang").is_none());
        assert!(FaultPlan::parse("phase:probe").is_none());
        assert!(FaultPlan::parse("rank:1,phase:probe,mode:explode").is_none());
        let p = FaultPlan::parse("rank:1,phase:recompute,mode:oom").unwrap();
        assert!(p.point(1, "recompute").is_err_and(|e| e.to_string().contains("needs 1.00 GiB more on injected")));
        assert!(p.point(1, "recompute").is_ok(), "fires once");
        // `after:N`: the first N arrivals pass, the next fails, and only it.
        let p = FaultPlan::parse("rank:0,phase:recompute,mode:oom,after:2").unwrap();
        assert_eq!(p.after, 2);
        assert!(p.point(0, "recompute").is_ok() && p.point(0, "probe").is_ok() && p.point(0, "recompute").is_ok());
        assert!(p.point(0, "recompute").is_err(), "the third arrival");
        assert!(p.point(0, "recompute").is_ok(), "fires once");
        assert!(FaultPlan::parse("rank:0,phase:probe,mode:oom,after:x").is_none());
        // A lost device stays lost: every later step of the rank fails, another rank's does not.
        let p = FaultPlan::parse("rank:1,phase:probe,mode:device-lost").unwrap();
        assert!(p.point(1, "chunk_prefill").is_ok(), "not before the planned phase");
        let e = p.point(1, "probe").unwrap_err();
        assert!(matches!(e, flowprefill_kernels::KernelError::DeviceLost { .. }), "{e:?}");
        assert!(e.to_string().contains("injected failed: an injected fault at rank 1's probe"), "{e}");
        assert!(e.to_string().contains("restart the process"), "{e}");
        assert!(p.point(1, "decode").is_err() && p.point(1, "probe").is_err(), "sticky");
        assert!(p.point(0, "probe").is_ok(), "only the planned rank");
    }

    #[test]
    fn fires_once_and_only_where_planned() {
        let p = FaultPlan::new(1, "probe", FaultMode::Stall(Duration::from_millis(1)));
        p.point(0, "probe").unwrap();
        p.point(1, "decode").unwrap();
        assert!(!p.fired.load(Ordering::Relaxed));
        p.point(1, "probe").unwrap();
        assert!(p.fired.load(Ordering::Relaxed));
    }
}
