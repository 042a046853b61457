//! Where a forward's time goes: per op family and calling thread, read from backend marks
//! only when asked (no host synchronisation in the forward on a GPU).

use crate::error::Result;
use flowprefill_kernels::Backend;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::thread::ThreadId;

/// The op families a forward's time is split into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Slot {
    Matmul = 0,
    Attention = 1,
    NormRope = 2,
    Elementwise = 3,
    Logits = 4,
}

/// Seconds per [`Slot`].
type Totals = [f64; 5];

/// Where forward time goes, accumulated over calls, per op family and per calling thread (each
/// rank of a thread world runs on its own thread).
///
/// A forward brackets each group of ops with [`Backend::mark`]s and leaves the pairs here
/// unread; they are read (`Backend::seconds_between`) when someone asks for the totals, so on
/// a GPU the profile is device time from CUDA events and adds no host synchronisation to the
/// forward. At most [`OpProfile::PENDING`] pairs wait; beyond that the oldest half is read.
pub struct OpProfile<B: Backend> {
    enabled: AtomicBool,
    state: Mutex<ProfileState<B::Mark>>,
}

pub(super) struct ProfileState<M> {
    pub(super) pending: Vec<(ThreadId, Slot, M, M)>,
    pub(super) totals: Totals,
    by_thread: HashMap<ThreadId, Totals>,
}

/// A snapshot of [`OpProfile`] in seconds.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct OpTimes {
    /// Projections and FFN GEMMs.
    pub matmul_s: f64,
    /// The `Attend` step (attention kernels, merges, cache appends, communication).
    pub attention_s: f64,
    /// RMSNorm and RoPE.
    pub norm_rope_s: f64,
    /// Embedding, SiLU, residual adds, splits.
    pub elementwise_s: f64,
    /// Final norm and output projection.
    pub logits_s: f64,
}

impl OpTimes {
    /// Sum of all parts.
    pub fn total_s(&self) -> f64 {
        self.matmul_s + self.attention_s + self.norm_rope_s + self.elementwise_s + self.logits_s
    }

    /// `(family, milliseconds)` for reports: matmul, attention, norm_rope, other (elementwise
    /// and the logits' norm and projection).
    pub fn families_ms(&self) -> Vec<(String, f64)> {
        [
            ("matmul", self.matmul_s),
            ("attention", self.attention_s),
            ("norm_rope", self.norm_rope_s),
            ("other", self.elementwise_s + self.logits_s),
        ]
        .into_iter()
        .map(|(n, s)| (n.to_string(), s * 1e3))
        .collect()
    }

    fn of(t: &Totals) -> Self {
        OpTimes { matmul_s: t[0], attention_s: t[1], norm_rope_s: t[2], elementwise_s: t[3], logits_s: t[4] }
    }
}

impl<B: Backend> Default for OpProfile<B> {
    fn default() -> Self {
        Self {
            enabled: AtomicBool::new(true),
            state: Mutex::new(ProfileState { pending: Vec::new(), totals: [0.0; 5], by_thread: HashMap::new() }),
        }
    }
}

impl<B: Backend> OpProfile<B> {
    /// Pairs of marks left unread before the oldest half is read.
    pub const PENDING: usize = 8192;

    /// Turns the profile on or off (on by default). Off, a forward records no marks (on a
    /// GPU: no events).
    pub fn set_enabled(&self, on: bool) {
        self.enabled.store(on, Ordering::Relaxed);
    }

    /// Whether forwards record marks.
    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, ProfileState<B::Mark>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn push(&self, be: &B, laps: Vec<(ThreadId, Slot, B::Mark, B::Mark)>) -> Result<()> {
        let mut st = self.lock();
        st.pending.extend(laps);
        if st.pending.len() > Self::PENDING {
            let old: Vec<_> = st.pending.drain(..Self::PENDING / 2).collect();
            Self::read(be, &mut st, old)?;
        }
        Ok(())
    }

    fn read(be: &B, st: &mut ProfileState<B::Mark>, laps: Vec<(ThreadId, Slot, B::Mark, B::Mark)>) -> Result<()> {
        for (thread, slot, a, b) in laps {
            let s = be.seconds_between(&a, &b)?;
            st.totals[slot as usize] += s;
            st.by_thread.entry(thread).or_default()[slot as usize] += s;
        }
        Ok(())
    }

    fn settle(&self, be: &B) -> Result<std::sync::MutexGuard<'_, ProfileState<B::Mark>>> {
        let mut st = self.lock();
        let laps = std::mem::take(&mut st.pending);
        Self::read(be, &mut st, laps)?;
        Ok(st)
    }

    /// Totals of every thread since the last reset (waits for the device to reach the last
    /// mark).
    pub fn snapshot(&self, be: &B) -> Result<OpTimes> {
        Ok(OpTimes::of(&self.settle(be)?.totals))
    }

    /// This thread's totals since its last `take_thread`; its counters restart.
    pub fn take_thread(&self, be: &B) -> Result<OpTimes> {
        let mut st = self.settle(be)?;
        Ok(OpTimes::of(&st.by_thread.remove(&std::thread::current().id()).unwrap_or_default()))
    }

    /// Resets all totals to zero (marks not read yet are dropped).
    pub fn reset(&self) {
        let mut st = self.lock();
        st.pending.clear();
        st.totals = [0.0; 5];
        st.by_thread.clear();
    }
}

/// The marks of one forward: each [`Laps::lap`] closes the group of ops since the previous
/// mark and names its family. Handed to the profile when dropped (an error part way included).
pub(super) struct Laps<'a, B: Backend> {
    be: &'a B,
    profile: &'a OpProfile<B>,
    last: Option<B::Mark>,
    done: Vec<(ThreadId, Slot, B::Mark, B::Mark)>,
    thread: ThreadId,
}

impl<'a, B: Backend> Laps<'a, B> {
    pub(super) fn start(be: &'a B, profile: &'a OpProfile<B>) -> Result<Self> {
        let on = profile.enabled() && !UNTIMED.with(|u| u.get());
        let last = if on { Some(be.mark()?) } else { None };
        Ok(Self { be, profile, last, done: Vec::new(), thread: std::thread::current().id() })
    }

    pub(super) fn lap(&mut self, slot: Slot) -> Result<()> {
        if let Some(prev) = self.last.take() {
            let now = self.be.mark()?;
            self.done.push((self.thread, slot, prev, now.clone()));
            self.last = Some(now);
        }
        Ok(())
    }
}

impl<B: Backend> Drop for Laps<'_, B> {
    fn drop(&mut self) {
        if !self.done.is_empty() {
            if let Err(e) = self.profile.push(self.be, std::mem::take(&mut self.done)) {
                tracing::warn!("op profile: {e}");
            }
        }
    }
}

thread_local! {
    /// Set while this thread records a step ([`untimed`]): a recording queues no timing marks.
    static UNTIMED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with the op profile off on this thread: a recorded step (a CUDA graph) cannot hold
/// the profile's timing marks, which are read back later.
pub(crate) fn untimed<R>(f: impl FnOnce() -> R) -> R {
    let before = UNTIMED.with(|u| u.replace(true));
    let out = f();
    UNTIMED.with(|u| u.set(before));
    out
}
