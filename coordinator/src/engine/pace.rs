//! Keeping the followers' waits bounded while rank 0 has nothing for them, or works alone.
//!
//! Every wait of a rank has a deadline (`--comm-timeout`), so that a lost or stuck peer
//! becomes an error instead of a hang. Two waits are on rank 0 alone and may legitimately last
//! longer than any fixed deadline: the wait for the next job (a service can sit idle for
//! hours) and the wait while rank 0 computes a `full` job by itself (a long context's prefill
//! and its answer). In both, rank 0 tells the followers every quarter of the timeout that it
//! is still there (an idle tick on `request`, a progress tick on `lead.progress`), so a
//! follower's deadline is passed only when rank 0 has really gone silent. A progress tick is
//! sent only while rank 0's work moves: a layer finished within
//! [`flowprefill_worker::interrupt::stuck_after`] (four deadlines); a rank 0 stuck inside its
//! work stops ticking, and the followers' deadline ends the job (under mpirun, the launcher
//! then stops rank 0 too; `run` has its own watchdog on the same bound).
//!
//! ```text
//!   rank 0 (idle)        request: Idle ... Idle ... Job ─────────────> every rank runs the job
//!   rank 0 (full, alone) lead.progress: Working ... Working ... Done ─> every rank gathers stats
//! ```

use super::Envelope;
use crate::error::{internal, Result};
use flowprefill_comm::{broadcast_value, Communicator};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// What rank 0 broadcasts on `request`.
#[derive(serde::Serialize, serde::Deserialize)]
pub(super) enum Next {
    /// A job for every rank.
    Job(Box<Envelope>),
    /// Nothing yet; rank 0 is alive (see the module docs).
    Idle,
    /// No more work: the followers return.
    Stop,
}

/// What rank 0 broadcasts on `lead.progress` while it computes alone.
#[derive(serde::Serialize, serde::Deserialize, PartialEq, Eq, Debug)]
enum Progress {
    Working,
    Done,
}

const PROGRESS: &str = "lead.progress";

/// How often rank 0 tells the followers it is alive: a quarter of their deadline.
pub fn tick_period(timeout: Duration) -> Duration {
    (timeout / 4).max(Duration::from_millis(10))
}

/// Rank 0: runs `work`, which needs no other rank, while a thread beside it tells the others
/// every [`tick_period`] that it is still at it, then that it is done.
pub(super) fn lead_alone<T>(comm: &mut dyn Communicator, work: impl FnOnce() -> Result<T>) -> Result<T> {
    if comm.size() == 1 {
        return work();
    }
    let (stuck, period) = (flowprefill_worker::interrupt::stuck_after(comm.timeout()), tick_period(comm.timeout()));
    flowprefill_worker::interrupt::beat("lead");
    let done = AtomicBool::new(false);
    let (out, ticks) = std::thread::scope(|s| {
        let (c, done) = (&mut *comm, &done);
        let ticker = s.spawn(move || -> Result<()> {
            let mut last = Instant::now();
            while !done.load(Ordering::Relaxed) {
                std::thread::sleep(period.min(Duration::from_millis(20)));
                // Only while the work moves (a layer finished lately): a rank 0 stuck in its work
                // goes silent, and the followers' deadline says so.
                let moving = flowprefill_worker::interrupt::since_beat().0 < stuck;
                if last.elapsed() >= period && !done.load(Ordering::Relaxed) && moving {
                    broadcast_value(c, PROGRESS, 0, Some(&Progress::Working))?;
                    last = Instant::now();
                }
            }
            Ok(())
        });
        // Stops the ticks however the work ends (a panic too: the scope joins the ticker
        // before the panic goes on, which must not wait forever).
        let stop = StopOnDrop(done);
        let out = work();
        drop(stop);
        (out, ticker.join())
    });
    // The work's own error first; a tick that could not be sent means a follower is gone.
    let out = out?;
    ticks.map_err(|p| internal(format!("the progress thread panicked: {}", crate::error::panic_message(p))))??;
    broadcast_value(comm, PROGRESS, 0, Some(&Progress::Done))?;
    Ok(out)
}

/// Sets its flag when dropped.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// A follower, while rank 0 computes alone: waits until it is done (each tick renews the
/// deadline).
pub(super) fn wait_for_lead(comm: &mut dyn Communicator) -> Result<()> {
    while broadcast_value::<Progress>(comm, PROGRESS, 0, None)? == Progress::Working {}
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use flowprefill_comm::local::LocalComm;

    #[test]
    fn a_follower_waits_through_work_longer_than_its_deadline() {
        // Deadlines of 1 s (ticks every 250 ms): 80 ms left a loaded machine (tests run in
        // parallel on two cores) a tick late now and then, and 400 ms is within its reach.
        let mut comms = LocalComm::group(3);
        for c in &mut comms {
            c.set_timeout(Duration::from_secs(1));
        }
        let mut rest = comms.split_off(1);
        let mut lead = comms.pop().expect("rank 0");
        let followers: Vec<_> = rest
            .drain(..)
            .map(|mut c| std::thread::spawn(move || wait_for_lead(&mut c).map(|_| c.stats().clone())))
            .collect();
        // Five deadlines of work on rank 0 alone, a layer every 250 ms.
        let got = lead_alone(&mut lead, || {
            for _ in 0..20 {
                std::thread::sleep(Duration::from_millis(250));
                flowprefill_worker::interrupt::beat("prefill");
            }
            Ok(7)
        });
        assert_eq!(got.expect("rank 0's work"), 7);
        for f in followers {
            let stats = f.join().expect("follower thread").expect("the follower waited it out");
            assert!(stats.ops.get(PROGRESS).is_some_and(|s| s.calls >= 4), "ticks: {stats:?}");
        }
    }

    #[test]
    fn without_ticks_the_same_wait_times_out_naming_rank_0() {
        let mut comms = LocalComm::group(2);
        for c in &mut comms {
            c.set_timeout(Duration::from_millis(80));
        }
        let mut follower = comms.pop().expect("rank 1");
        let lead = comms.pop().expect("rank 0");
        let e = wait_for_lead(&mut follower).expect_err("rank 0 never said anything");
        assert!(e.to_string().contains("rank 0 did not answer"), "{e}");
        drop(lead);
    }

    #[test]
    fn a_panic_in_the_work_ends_the_ticks_and_goes_on() {
        let mut comms = LocalComm::group(2);
        let _follower = comms.pop().expect("rank 1");
        let mut lead = comms.pop().expect("rank 0");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                lead_alone::<()>(&mut lead, || panic!("inside the prefill"))
            }));
            let _ = tx.send(r.is_err());
        });
        let panicked = rx.recv_timeout(Duration::from_secs(10)).expect("lead_alone returned (no hang)");
        assert!(panicked, "the panic goes on to the caller");
    }

    #[test]
    fn a_failed_work_is_reported_and_the_followers_learn_of_it() {
        let mut comms = LocalComm::group(2);
        let mut follower = comms.pop().expect("rank 1");
        let mut lead = comms.pop().expect("rank 0");
        let f = std::thread::spawn(move || wait_for_lead(&mut follower));
        let e = lead_alone::<()>(&mut lead, || Err(internal("the prefill failed"))).expect_err("the work's error");
        assert!(e.to_string().contains("the prefill failed"), "{e}");
        lead.abort(flowprefill_comm::ErrorClass::Internal, &e.to_string());
        let seen = f.join().expect("follower thread").expect_err("the follower's wait ends with the abort");
        assert!(seen.to_string().contains("the prefill failed"), "{seen}");
    }
}
