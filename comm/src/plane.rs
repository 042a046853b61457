//! The device plane: collectives that move a backend's buffers between ranks without passing
//! through host memory (NCCL between GPUs; a channel between thread ranks in tests).
//!
//! A rank's [`Communicator`](crate::Communicator) stays the control plane: every buffer-typed
//! exchange first sends its small control part (row indices, positions, segment ids) there,
//! which tells every receiver how long each buffer is; then the buffers go over the plane, as
//! one grouped set of point-to-point transfers:
//!
//! ```text
//!   control (host):  post(rows to each peer, from peers) ─ wait ─> lengths of every buffer
//!   data (device):   issue(sends, receives of known lengths) ── [compute] ── complete()
//! ```
//! A rank without a plane sends control and buffers together through the communicator
//! (host staging); both give the same bits.
//!
//! A plane has the communicator's deadline: [`BufPlane::complete`] returns
//! [`CommError::Timeout`] naming a peer and the operation instead of waiting for ever, and
//! after a timeout or a transport error the plane is torn down (NCCL: `ncclCommAbort`); every
//! later call fails at once with the first error.
//!
//! A peer's abort travels on the control channel, which the device transfers never read: a
//! rank that fails between an exchange's control rows and its transfers (out of memory for its
//! receive buffers, its GPU lost) leaves its peers' transfers without a partner. So
//! `complete` looks at the control channel while it waits ([`Watch`], every [`LOOK_EVERY`]):
//!
//! ```text
//!   transfers done ─────────────────────────────> the buffers (or the abort seen meanwhile)
//!   a peer's abort seen ── grace_for ───┬─ done ─> CommError::Aborted: the job is over, the plane is fine
//!                                       └─ not ──> CommError::Stranded: the plane is torn down
//! ```
//! within milliseconds of the abort instead of at the deadline. The grace lets transfers the
//! peer issued before it gave up finish, so that the plane survives aborts that leave every
//! transfer matched (a cancellation, a peer's failure in its own compute).

use crate::{CommError, Result};
use std::any::Any;
use std::time::{Duration, Instant};

/// How often a device wait looks at the control channel for a peer's abort.
pub const LOOK_EVERY: Duration = Duration::from_millis(20);

/// How long a device exchange may still finish after a peer's abort was seen, beyond the time
/// its bytes take at [`SLOWEST_LINK`] (see [`grace_for`]): the transfers the peer issued before
/// it gave up run at link speed.
pub const GRACE: Duration = Duration::from_secs(2);

/// Bytes per second that the grace after a peer's abort allows for an exchange's transfers
/// (a 1 Gb/s link between hosts), so that a large exchange the peer did issue is not taken
/// for a stranded one.
pub const SLOWEST_LINK: f64 = 100e6;

/// The grace of an exchange of `bytes` (sent and received) under the deadline `timeout`.
pub fn grace_for(bytes: u64, timeout: Duration) -> Duration {
    (GRACE + Duration::from_secs_f64(bytes as f64 / SLOWEST_LINK)).min(timeout)
}

/// Why a plane was torn down when a job ended with its exchange `op` unfinished after the
/// drain's `grace` (`e`: what the drain saw).
pub fn unfinished(op: &str, grace: Duration, e: &dyn std::fmt::Display) -> String {
    format!(
        "the job ended with its exchange `{op}` unfinished {:.1} s later ({e}): a peer gave the job up before \
         its side of it",
        grace.as_secs_f64()
    )
}

/// What a device wait calls to look for a peer's abort: the communicator's
/// [`poll_abort`](crate::Communicator::poll_abort) for the exchange.
pub type Look<'a> = &'a mut dyn FnMut() -> Result<()>;

/// A device wait's view of the control channel (see the module docs): the plane calls
/// [`Watch::check`] while its transfers are not done, and [`Watch::finish`] once they are.
pub struct Watch<'a> {
    look: Look<'a>,
    next: Instant,
    grace: Duration,
    /// A peer's abort seen while waiting, and the end of its grace.
    seen: Option<(CommError, Instant)>,
    /// False once a look failed for another reason (the control channel busy with another
    /// exchange): the wait keeps its deadline alone, as without a watch.
    looking: bool,
}

impl<'a> Watch<'a> {
    /// A watch for a wait of `grace` after a peer's abort ([`grace_for`] the exchange): the
    /// first look comes [`LOOK_EVERY`] after now (a quick exchange never looks).
    pub fn new(look: Look<'a>, grace: Duration) -> Self {
        let next = Instant::now() + LOOK_EVERY;
        Self { look, next, grace, seen: None, looking: true }
    }

    /// Called while the transfers are not done (as often as the plane likes: it looks at most
    /// every [`LOOK_EVERY`]). An error means: give the exchange up and tear the plane down
    /// (a peer's abort whose grace ran out, as [`CommError::Stranded`]; a peer lost).
    pub fn check(&mut self) -> Result<()> {
        let now = Instant::now();
        if let Some((_, until)) = &self.seen {
            if now < *until {
                return Ok(());
            }
            return self.seen.take().map_or(Ok(()), |(e, _)| Err(e.stranded()));
        }
        if !self.looking || now < self.next {
            return Ok(());
        }
        self.next = now + LOOK_EVERY;
        match (self.look)() {
            Ok(()) => Ok(()),
            Err(e @ CommError::Aborted { .. }) => {
                self.seen = Some((e, now + self.grace));
                Ok(())
            }
            Err(CommError::Misuse(_)) => {
                self.looking = false;
                Ok(())
            }
            // The control channel says a peer is lost: so is the exchange.
            Err(e) => Err(e),
        }
    }

    /// The transfers finished: the peer's abort seen meanwhile, if any (the job is over, and
    /// the poll took the abort off the channel: this is where the rank learns of it).
    pub fn finish(self) -> Result<()> {
        match self.seen {
            Some((e, _)) => Err(e),
            None => Ok(()),
        }
    }

    /// The wait failed with `e` before the grace ran out: where a peer's abort was seen and `e`
    /// tore the plane down (a deadline, a lost transfer), the job's error is that abort (the
    /// poll took it off the channel) as [`CommError::Stranded`]; any other error (this rank's
    /// own lost device, ranks out of step) stays what it is.
    pub fn fail(self, e: CommError) -> CommError {
        match (self.seen, e) {
            (Some((abort, _)), CommError::Timeout { .. } | CommError::RankLost { .. }) => abort.stranded(),
            (_, e) => e,
        }
    }
}

/// The part of a device plane that does not depend on the buffer type.
pub trait Plane: Send {
    /// Name (`nccl`, `threads`), used in counter names: `<op>@<name>`.
    fn name(&self) -> &'static str;
    /// Tears the plane down (NCCL: `ncclCommAbort`): transfers in flight are abandoned and
    /// every later call fails with `reason`. Used when the world breaks.
    fn abort(&mut self, reason: &str);
    /// Changes the deadline of [`BufPlane::complete`].
    fn set_timeout(&mut self, timeout: Duration);
    /// The job ended (see [`Communicator::end_job`](crate::Communicator::end_job)): a pending
    /// exchange is finished and dropped, and nothing of this job reaches the next one.
    fn end_job(&mut self);
    /// Why the plane was torn down, once it was (every later exchange fails with
    /// [`CommError::PlaneDown`]); `None` while it works.
    fn down(&self) -> Option<String>;
    /// For the typed part: `self` as [`Any`] (a [`Typed`] holder).
    fn as_any(&mut self) -> &mut dyn Any;
}

/// Transfers of `Buf`s: one grouped set of sends and receives at a time.
pub trait BufPlane<Buf>: Send {
    /// Name (`nccl`, `threads`).
    fn name(&self) -> &'static str;
    /// Starts the transfers of one exchange: `sends` (to, buffer) and `receives` (from, the
    /// buffer to receive into: its length and element type are what the sender must send), in
    /// an order both sides agree on (per peer, the order of posting). Returns at once; the
    /// transfers run while the caller computes. Fails if an exchange is already pending.
    fn issue(&mut self, op: &str, sends: &[(usize, &Buf)], receives: Vec<(usize, Buf)>) -> Result<()>;
    /// Waits for the pending exchange: the received buffers in the order of `receives`.
    /// Meanwhile it looks for a peer's abort with `look` (through a [`Watch`]).
    fn complete(&mut self, look: Look<'_>) -> Result<Vec<Buf>>;
    /// See [`Plane::abort`].
    fn abort(&mut self, reason: &str);
    /// See [`Plane::set_timeout`].
    fn set_timeout(&mut self, timeout: Duration);
    /// See [`Plane::end_job`].
    fn end_job(&mut self);
    /// See [`Plane::down`].
    fn down(&self) -> Option<String>;
}

/// A [`BufPlane`] behind the type-free [`Plane`] a communicator holds; the worker, which knows
/// the buffer type, gets it back with [`typed`].
pub struct Typed<Buf: 'static>(pub Box<dyn BufPlane<Buf>>);

impl<Buf: 'static> Plane for Typed<Buf> {
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn abort(&mut self, reason: &str) {
        self.0.abort(reason)
    }
    fn set_timeout(&mut self, timeout: Duration) {
        self.0.set_timeout(timeout)
    }
    fn end_job(&mut self) {
        self.0.end_job()
    }
    fn down(&self) -> Option<String> {
        self.0.down()
    }
    fn as_any(&mut self) -> &mut dyn Any {
        self
    }
}

/// The typed plane of `plane`, or an error if it moves another kind of buffer.
pub fn typed<Buf: 'static>(plane: &mut dyn Plane) -> Result<&mut dyn BufPlane<Buf>> {
    let name = plane.name();
    match plane.as_any().downcast_mut::<Typed<Buf>>() {
        Some(t) => Ok(t.0.as_mut()),
        None => Err(CommError::Misuse(format!(
            "the `{name}` device plane does not move this backend's buffers (the plane and the model are on \
             different backends)"
        ))),
    }
}

/// A device plane for thread ranks that moves buffers through channels, with NCCL's contract
/// (lengths known on both sides, grouped point-to-point transfers, a deadline): lets the tests
/// run the device path of every distributed step without a GPU. `Buf` is moved, never
/// serialized.
pub mod threads {
    use super::*;
    use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};

    /// (job, operation, buffer).
    type Msg<Buf> = (u64, String, Buf);

    /// One rank's end.
    pub struct ThreadPlane<Buf> {
        to: Vec<Option<Sender<Msg<Buf>>>>,
        from: Vec<Option<Receiver<Msg<Buf>>>>,
        epoch: u64,
        pending: Option<(String, Vec<(usize, Buf)>)>,
        timeout: Duration,
        broken: Option<String>,
        clone: fn(&Buf) -> Buf,
        describe: fn(&Buf) -> String,
    }

    /// Planes for `n` thread ranks; `clone` copies a buffer (a device-to-device copy) and
    /// `describe` names its length and element type (a received buffer must match the one
    /// posted to receive it).
    pub fn group<Buf: Send + 'static>(
        n: usize,
        clone: fn(&Buf) -> Buf,
        describe: fn(&Buf) -> String,
    ) -> Vec<ThreadPlane<Buf>> {
        let mut to: Vec<Vec<Option<Sender<Msg<Buf>>>>> = (0..n).map(|_| (0..n).map(|_| None).collect()).collect();
        let mut from: Vec<Vec<Option<Receiver<Msg<Buf>>>>> = (0..n).map(|_| (0..n).map(|_| None).collect()).collect();
        for (a, row) in to.iter_mut().enumerate() {
            for (b, slot) in row.iter_mut().enumerate() {
                if a != b {
                    let (s, r) = channel();
                    *slot = Some(s);
                    from[b][a] = Some(r);
                }
            }
        }
        to.into_iter()
            .zip(from)
            .map(|(to, from)| ThreadPlane {
                to,
                from,
                epoch: 0,
                pending: None,
                timeout: crate::DEFAULT_TIMEOUT,
                broken: None,
                clone,
                describe,
            })
            .collect()
    }

    impl<Buf: Send + 'static> BufPlane<Buf> for ThreadPlane<Buf> {
        fn name(&self) -> &'static str {
            "threads"
        }

        fn issue(&mut self, op: &str, sends: &[(usize, &Buf)], receives: Vec<(usize, Buf)>) -> Result<()> {
            if let Some(why) = &self.broken {
                return Err(CommError::PlaneDown { op: op.to_string(), why: why.clone() });
            }
            if self.pending.is_some() {
                return Err(CommError::Misuse(format!("`{op}` issued while another device exchange is pending")));
            }
            let n = self.to.len();
            for &(peer, b) in sends {
                crate::check_rank(peer, n)?;
                let tx = self.to[peer].as_ref().ok_or_else(|| CommError::Misuse(format!("`{op}`: send to self")))?;
                if tx.send((self.epoch, op.to_string(), (self.clone)(b))).is_err() {
                    return Err(CommError::RankLost {
                        rank: peer,
                        op: op.to_string(),
                        detail: "its end of the device plane is gone".into(),
                    });
                }
            }
            for (peer, _) in &receives {
                crate::check_rank(*peer, n)?;
            }
            self.pending = Some((op.to_string(), receives));
            Ok(())
        }

        fn complete(&mut self, look: Look<'_>) -> Result<Vec<Buf>> {
            let (op, receives) =
                self.pending.take().ok_or_else(|| CommError::Misuse("device complete without issue".into()))?;
            let deadline = crate::deadline_after(self.timeout);
            // Buffers of any type: the grace has no byte count (GRACE alone).
            let mut watch = Watch::new(look, grace_for(0, self.timeout));
            let mut out = Vec::with_capacity(receives.len());
            for (peer, want) in receives {
                let rx =
                    self.from[peer].as_ref().ok_or_else(|| CommError::Misuse(format!("`{op}`: receive from self")))?;
                let (got_op, b) = loop {
                    let left = crate::time_left(deadline);
                    match rx.recv_timeout(left.min(LOOK_EVERY)) {
                        // Left over from a job that ended early: dropped.
                        Ok((epoch, _, _)) if epoch < self.epoch => continue,
                        Ok((_, o, b)) => break (o, b),
                        Err(RecvTimeoutError::Timeout) if !left.is_zero() => {
                            if let Err(e) = watch.check() {
                                self.abort(&e.to_string());
                                return Err(e);
                            }
                        }
                        Err(RecvTimeoutError::Timeout) => {
                            let e = CommError::Timeout {
                                rank: peer,
                                op: op.clone(),
                                secs: self.timeout.as_secs_f64(),
                                unsent: 0,
                            };
                            self.broken = Some(e.to_string());
                            return Err(watch.fail(e));
                        }
                        Err(RecvTimeoutError::Disconnected) => {
                            let e = CommError::RankLost {
                                rank: peer,
                                op: op.clone(),
                                detail: "its end of the device plane is gone".into(),
                            };
                            self.broken = Some(e.to_string());
                            return Err(watch.fail(e));
                        }
                    }
                };
                if got_op != op {
                    return Err(watch.fail(CommError::OutOfStep { rank: peer, op }));
                }
                let (got, expected) = ((self.describe)(&b), (self.describe)(&want));
                if got != expected {
                    let e = CommError::Decode { rank: peer, op, detail: format!("{got}, expected {expected}") };
                    return Err(watch.fail(e));
                }
                out.push(b);
            }
            watch.finish()?;
            Ok(out)
        }

        fn abort(&mut self, reason: &str) {
            self.pending = None;
            self.broken.get_or_insert_with(|| reason.to_string());
            // Dropping the senders makes the peers' receives fail at once.
            for t in &mut self.to {
                *t = None;
            }
        }

        fn set_timeout(&mut self, timeout: Duration) {
            self.timeout = timeout;
        }

        fn end_job(&mut self) {
            // NCCL's drain: a pending exchange finishes within the grace, or the plane is torn
            // down (NCCL's unmatched transfers would stay queued in front of the next job's).
            // Only this job's messages can arrive meanwhile: every job starts with an agreement
            // of all ranks before any device exchange.
            if let Some((op, _)) = &self.pending {
                let (op, saved) = (op.clone(), self.timeout);
                self.timeout = grace_for(0, saved);
                match self.complete(&mut || Ok(())) {
                    Err(CommError::Timeout { .. }) => {
                        self.broken = Some(unfinished(&op, self.timeout, &"its transfers never arrived"))
                    }
                    Err(e @ CommError::RankLost { .. }) => self.broken = Some(unfinished(&op, self.timeout, &e)),
                    _ => {}
                }
                self.timeout = saved;
            }
            // Whatever this job sent and nobody received is dropped on arrival (its epoch).
            self.pending = None;
            self.epoch += 1;
        }

        fn down(&self) -> Option<String> {
            self.broken.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::threads::group;
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    fn planes(n: usize) -> Vec<threads::ThreadPlane<Vec<f32>>> {
        group::<Vec<f32>>(n, Vec::clone, |v| format!("a buffer of {} values", v.len()))
    }

    fn recv(from: usize, len: usize) -> (usize, Vec<f32>) {
        (from, vec![0.0; len])
    }

    /// A wait that never looks at a control channel.
    fn no_look() -> Result<()> {
        Ok(())
    }

    #[test]
    fn grouped_transfers_arrive_in_order_with_their_lengths() {
        let mut p = planes(3);
        let (a, b) = (vec![1.0, 2.0], vec![3.0]);
        p[0].issue("x", &[(1, &a), (1, &b), (2, &a)], vec![]).unwrap();
        p[1].issue("x", &[], vec![recv(0, 2), recv(0, 1)]).unwrap();
        p[2].issue("x", &[], vec![recv(0, 2)]).unwrap();
        assert_eq!(p[1].complete(&mut no_look).unwrap(), vec![a.clone(), b]);
        assert_eq!(p[2].complete(&mut no_look).unwrap(), vec![a]);
        assert!(p[0].complete(&mut no_look).unwrap().is_empty());
    }

    #[test]
    fn a_peer_that_never_sends_is_named_by_the_deadline_and_the_plane_is_torn_down() {
        let mut p = planes(2);
        p[1].set_timeout(Duration::from_millis(50));
        p[1].issue("ring.kv", &[], vec![recv(0, 4)]).unwrap();
        match p[1].complete(&mut no_look) {
            Err(CommError::Timeout { rank: 0, op, .. }) => assert_eq!(op, "ring.kv"),
            other => panic!("{other:?}"),
        }
        let e = p[1].issue("next", &[], vec![recv(0, 1)]).unwrap_err().to_string();
        assert!(e.contains("torn down") && e.contains("rank 0"), "{e}");
    }

    #[test]
    fn an_aborted_peer_is_reported_lost_at_once_and_lengths_are_checked() {
        let mut p = planes(2);
        let v = vec![0.5; 3];
        p[0].issue("a", &[(1, &v)], vec![]).unwrap();
        p[1].issue("a", &[], vec![recv(0, 2)]).unwrap();
        let e = p[1].complete(&mut no_look).unwrap_err().to_string();
        assert!(e.contains("3 values, expected a buffer of 2"), "{e}");
        p[1].end_job();
        p[0].end_job();
        p[0].abort("rank 0 failed");
        p[1].issue("b", &[], vec![recv(0, 1)]).unwrap();
        let t = std::time::Instant::now();
        assert!(matches!(p[1].complete(&mut no_look), Err(CommError::RankLost { rank: 0, .. })));
        assert!(t.elapsed() < Duration::from_secs(5), "lost at once, not after the deadline");
    }

    #[test]
    fn what_a_job_left_behind_never_reaches_the_next_one() {
        let mut p = planes(2);
        let (old, new) = (vec![1.0], vec![2.0]);
        // Rank 0 sends in job 0; rank 1 gave the job up before receiving it.
        p[0].issue("ring.kv", &[(1, &old)], vec![]).unwrap();
        p[0].complete(&mut no_look).unwrap();
        p[0].end_job();
        p[1].end_job();
        p[0].issue("ring.kv", &[(1, &new)], vec![]).unwrap();
        p[1].issue("ring.kv", &[], vec![recv(0, 1)]).unwrap();
        assert_eq!(p[1].complete(&mut no_look).unwrap(), vec![new]);
    }

    #[test]
    fn a_timeout_past_what_an_instant_holds_means_no_deadline() {
        // `now + timeout` panicked (overflow) for a --comm-timeout of 1e19 s.
        for huge in [Duration::MAX, Duration::from_secs_f64(1e19)] {
            let mut p = planes(2);
            p.iter_mut().for_each(|q| q.set_timeout(huge));
            let v = vec![7.0];
            p[0].issue("x", &[(1, &v)], vec![]).unwrap();
            p[1].issue("x", &[], vec![recv(0, 1)]).unwrap();
            assert_eq!(p[1].complete(&mut no_look).unwrap(), vec![v]);
        }
    }

    /// Two thread ranks with communicators and planes; rank 1 runs `peer` on its own thread
    /// (given a flag rank 0 raises once a look has found an abort) while rank 0 issues
    /// `ring.kv` (4 values from rank 1) and completes it looking at its communicator: rank 0's
    /// result, how long it waited, how often it looked, and its ends for a next job.
    #[allow(clippy::type_complexity)]
    fn device_wait(
        timeout: Duration,
        peer: impl FnOnce(&mut crate::local::LocalComm, &mut threads::ThreadPlane<Vec<f32>>, &AtomicBool) + Send,
    ) -> (Result<Vec<Vec<f32>>>, Duration, usize, crate::local::LocalComm, threads::ThreadPlane<Vec<f32>>) {
        use crate::Communicator;
        let mut comms = crate::local::LocalComm::group(2);
        let mut p = planes(2);
        let (mut c1, mut p1) = (comms.pop().unwrap(), p.pop().unwrap());
        let (mut c0, mut p0) = (comms.pop().unwrap(), p.pop().unwrap());
        c0.set_timeout(timeout);
        p0.set_timeout(timeout);
        let found = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| peer(&mut c1, &mut p1, &found));
            p0.issue("ring.kv", &[], vec![recv(1, 4)]).unwrap();
            let t = std::time::Instant::now();
            let mut looks = 0;
            let got = p0.complete(&mut || {
                looks += 1;
                let seen = c0.poll_abort("ring.kv");
                if seen.is_err() {
                    found.store(true, Ordering::SeqCst);
                }
                seen
            });
            (got, t.elapsed(), looks, c0, p0)
        })
    }

    /// Until rank 0 has found the abort (at most 30 s).
    fn until_found(found: &AtomicBool) {
        let t = std::time::Instant::now();
        while !found.load(Ordering::SeqCst) && t.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_peer_that_gives_up_before_its_transfers_strands_the_wait_within_the_grace_not_the_deadline() {
        use crate::{Communicator, ErrorClass};
        let (got, waited, _, _, mut p0) = device_wait(Duration::from_secs(60), |c1, _, _| {
            // Out of memory for its receive buffers: it never issues its side.
            c1.abort(ErrorClass::Resource, "out of memory on cuda:1");
        });
        let e = got.unwrap_err();
        assert!(
            matches!(&e, CommError::Stranded { rank: 1, class: ErrorClass::Resource, op, .. } if op == "ring.kv"),
            "{e:?}"
        );
        assert!(!e.world_intact() && e.to_string().contains("out of memory on cuda:1"), "{e}");
        assert!(
            waited >= GRACE && waited < GRACE + Duration::from_secs(20),
            "waited {waited:?}, not the 60 s deadline"
        );
        // Torn down, as NCCL's unmatched transfers leave no other way.
        let e = p0.issue("next", &[], vec![recv(1, 1)]).unwrap_err().to_string();
        assert!(e.contains("torn down") && e.contains("out of memory on cuda:1"), "{e}");
    }

    #[test]
    fn a_peer_that_gives_up_after_its_transfers_ends_the_job_and_the_plane_lives_on() {
        use crate::{Communicator, ErrorClass};
        let v = vec![1.0, 2.0, 3.0, 4.0];
        let (got, waited, _, mut c0, mut p0) = device_wait(Duration::from_secs(60), |c1, p1, found| {
            // Cancelled while its transfers were about to leave: the abort comes first (rank 0
            // finds it), the transfers within the grace.
            c1.abort(ErrorClass::Cancelled, "the client went away");
            until_found(found);
            p1.issue("ring.kv", &[(0, &v)], vec![]).unwrap();
            p1.complete(&mut no_look).unwrap();
            c1.end_job();
            p1.end_job();
            p1.issue("next", &[(0, &v)], vec![]).unwrap();
        });
        let e = got.unwrap_err();
        assert!(matches!(&e, CommError::Aborted { rank: 1, class: ErrorClass::Cancelled, .. }), "{e:?}");
        assert!(e.world_intact() && waited < GRACE, "waited {waited:?}");
        c0.end_job();
        p0.end_job();
        p0.issue("next", &[], vec![recv(1, 4)]).unwrap();
        assert_eq!(p0.complete(&mut no_look).unwrap(), vec![v]);
    }

    #[test]
    fn a_slow_peer_without_an_abort_is_waited_for_and_looked_at() {
        let v = vec![0.25; 4];
        let (got, waited, looks, _, _) = device_wait(Duration::from_secs(60), |_, p1, _| {
            std::thread::sleep(LOOK_EVERY * 8);
            p1.issue("ring.kv", &[(0, &v)], vec![]).unwrap();
        });
        assert_eq!(got.unwrap(), vec![v.clone()]);
        assert!(waited >= LOOK_EVERY * 8);
        let most = (waited.as_millis() / LOOK_EVERY.as_millis()) as usize;
        assert!(looks >= 2 && looks <= most, "{looks} looks in {waited:?}: at most one every {LOOK_EVERY:?}");
    }

    #[test]
    fn a_deadline_before_the_grace_ends_still_reports_the_peers_abort() {
        use crate::{Communicator, ErrorClass};
        // The abort comes 1.3 s before the 1.5 s deadline: the deadline ends the wait within
        // the grace, and the error is the peer's, not a bare timeout.
        let (got, waited, _, _, _) = device_wait(Duration::from_millis(1500), |c1, _, _| {
            std::thread::sleep(Duration::from_millis(200));
            c1.abort(ErrorClass::Resource, "out of memory on cuda:1");
        });
        let e = got.unwrap_err();
        assert!(matches!(&e, CommError::Stranded { rank: 1, class: ErrorClass::Resource, .. }), "{e:?}");
        assert!(waited < Duration::from_secs(10), "{waited:?}");
    }

    #[test]
    fn a_job_that_ends_with_an_unmatched_exchange_tears_the_plane_down_and_a_matched_one_does_not() {
        // Unmatched: the peer never sends; the drain waits the grace, then the next job's
        // exchange is refused with an error that breaks the world.
        let mut p = planes(2);
        p[1].issue("ring.kv", &[], vec![recv(0, 2)]).unwrap();
        let t = std::time::Instant::now();
        p[1].end_job();
        assert!(t.elapsed() >= GRACE && t.elapsed() < GRACE + Duration::from_secs(20), "{:?}", t.elapsed());
        let why = p[1].down().expect("torn down");
        assert!(
            why.contains("ended with its exchange `ring.kv` unfinished") && !why.contains("--comm-timeout"),
            "{why}"
        );
        let e = p[1].issue("next", &[], vec![recv(0, 1)]).unwrap_err();
        assert!(matches!(&e, CommError::PlaneDown { op, .. } if op == "next") && !e.world_intact(), "{e:?}");
        // Matched: the transfers came; the drain takes them and the next job runs.
        let mut p = planes(2);
        let v = vec![3.0, 4.0];
        p[1].issue("ring.kv", &[], vec![recv(0, 2)]).unwrap();
        p[0].issue("ring.kv", &[(1, &v)], vec![]).unwrap();
        p[1].end_job();
        p[0].end_job();
        assert!(p[1].down().is_none());
        p[0].issue("next", &[(1, &v)], vec![]).unwrap();
        p[1].issue("next", &[], vec![recv(0, 2)]).unwrap();
        assert_eq!(p[1].complete(&mut no_look).unwrap(), vec![v]);
    }

    #[test]
    fn the_grace_allows_for_the_bytes_at_the_slowest_link_within_the_deadline() {
        assert_eq!(grace_for(0, Duration::from_secs(60)), GRACE);
        assert_eq!(grace_for(1_000_000_000, Duration::from_secs(60)), GRACE + Duration::from_secs(10));
        assert_eq!(grace_for(u64::MAX, Duration::from_secs(60)), Duration::from_secs(60));
        assert_eq!(grace_for(0, Duration::from_millis(50)), Duration::from_millis(50));
    }

    #[test]
    fn a_lost_peer_ends_the_wait_at_once_and_a_busy_channel_leaves_the_deadline() {
        let mut p = planes(2);
        p[1].issue("x", &[], vec![recv(0, 1)]).unwrap();
        let t = std::time::Instant::now();
        let mut lost = || Err(CommError::RankLost { rank: 0, op: "x".into(), detail: "its thread has ended".into() });
        assert!(matches!(p[1].complete(&mut lost), Err(CommError::RankLost { rank: 0, .. })));
        assert!(t.elapsed() < Duration::from_secs(10));
        // A look refused (another exchange pending on the channel): the deadline decides.
        let mut p = planes(2);
        p[1].set_timeout(LOOK_EVERY * 5);
        p[1].issue("x", &[], vec![recv(0, 1)]).unwrap();
        let mut busy = || Err(CommError::Misuse("poll during `y` (wait first)".into()));
        assert!(matches!(p[1].complete(&mut busy), Err(CommError::Timeout { rank: 0, .. })));
    }

    #[test]
    fn a_plane_of_another_buffer_type_is_a_clear_error() {
        let end = planes(1).pop().unwrap();
        let mut held: Box<dyn Plane> = Box::new(Typed::<Vec<f32>>(Box::new(end)));
        assert!(typed::<Vec<f32>>(held.as_mut()).is_ok());
        let e = typed::<Vec<u8>>(held.as_mut()).err().unwrap().to_string();
        assert!(e.contains("does not move this backend's buffers"), "{e}");
    }
}
