//! Wall time of each phase of a request.

use std::time::{Duration, Instant};

/// Phase names, in pipeline order.
pub mod phase {
    /// Single-pass full prefill (method `full`).
    pub const PREFILL: &str = "prefill";
    /// Chunk caches (store hits or chunk prefill).
    pub const CHUNK_PREFILL: &str = "chunk_prefill";
    /// Stage-1 scoring and reordering.
    pub const REORDER: &str = "reorder";
    /// Placing chunk caches at their global positions.
    pub const ASSEMBLE: &str = "assemble";
    /// Scoring (probe or the policy's own signal).
    pub const PROBE: &str = "probe";
    /// Top-k and refinement.
    pub const SELECTION: &str = "selection";
    /// Recomputing the selected tokens.
    pub const RECOMPUTE: &str = "recompute";
    /// The prompt over the assembled cache.
    pub const FINAL_PROMPT: &str = "final_prompt";
    /// KV eviction after the prompt (`--evict`).
    pub const EVICT: &str = "evict";
    /// Choosing the first token.
    pub const FIRST_TOKEN: &str = "first_token";
    /// Generating the rest of the answer (after TTFT).
    pub const DECODE: &str = "decode";
    /// Every phase, in pipeline order.
    pub const ALL: [&str; 11] = [
        PREFILL,
        CHUNK_PREFILL,
        REORDER,
        ASSEMBLE,
        PROBE,
        SELECTION,
        RECOMPUTE,
        FINAL_PROMPT,
        EVICT,
        FIRST_TOKEN,
        DECODE,
    ];
}

/// Ordered (phase, duration) pairs.
#[derive(Clone, Debug, Default)]
pub struct PhaseTimes {
    entries: Vec<(&'static str, Duration)>,
    settle: Option<Settle>,
}

/// What [`PhaseTimes::time`] calls when a phase's closure returns, before it reads the clock:
/// on a GPU, waiting for the work the phase queued, so that it is counted in its own phase
/// and not in the next one that waits for the device.
#[derive(Clone)]
pub struct Settle(std::sync::Arc<dyn Fn() + Send + Sync>);

impl Settle {
    /// A settle step.
    pub fn new(f: impl Fn() + Send + Sync + 'static) -> Self {
        Self(std::sync::Arc::new(f))
    }
}

impl std::fmt::Debug for Settle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Settle")
    }
}

/// What [`watch_phases`] calls.
type Watcher = std::rc::Rc<dyn Fn(Option<&'static str>)>;

thread_local! {
    static CURRENT: std::cell::Cell<Option<&'static str>> = const { std::cell::Cell::new(None) };
    static WATCHER: std::cell::RefCell<Option<Watcher>> = const { std::cell::RefCell::new(None) };
}

/// Calls `f` on this thread with each phase [`PhaseTimes::time`] enters, and with the phase it
/// goes back to when one ends (`None`: outside every phase), until the guard is dropped: what
/// the service's live phase gauge reads on the thread that leads a job. Phases that nest call
/// it again for the inner one.
pub fn watch_phases(f: impl Fn(Option<&'static str>) + 'static) -> PhaseWatch {
    let before = WATCHER.with(|w| w.replace(Some(std::rc::Rc::new(f))));
    PhaseWatch { before, _not_send: std::marker::PhantomData }
}

/// Stops [`watch_phases`]'s calls when dropped (the watcher before it is back).
pub struct PhaseWatch {
    before: Option<Watcher>,
    /// The watch belongs to the thread it was made on.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for PhaseWatch {
    fn drop(&mut self) {
        let before = self.before.take();
        // Replaced, then dropped outside the borrow (a watcher's captures may run code on drop).
        let mine = WATCHER.with(|w| w.replace(before));
        drop(mine);
    }
}

/// Restores this thread's phase to the one it holds when dropped, and tells the watcher.
struct Back(Option<&'static str>);

impl Drop for Back {
    fn drop(&mut self) {
        CURRENT.with(|c| c.set(self.0));
        notify(self.0);
    }
}

/// Tells this thread's watcher, if any, which phase the thread is in now.
fn notify(phase: Option<&'static str>) {
    // Cloned out first: a watcher that itself times a phase does not find the cell borrowed.
    if let Some(w) = WATCHER.with(|w| w.borrow().clone()) {
        w(phase);
    }
}

/// The phase this thread is inside ([`PhaseTimes::time`]), if any: lets instrumentation (a
/// counting backend in the tests, a profiler) attribute work to the engine's phases.
pub fn current_phase() -> Option<&'static str> {
    CURRENT.with(std::cell::Cell::get)
}

impl PhaseTimes {
    /// Phase times whose phases end with `settle` (see [`Settle`]).
    pub fn settled_by(settle: Settle) -> Self {
        Self { entries: Vec::new(), settle: Some(settle) }
    }

    /// Times `f` as phase `name` (adding to it if it ran before).
    pub fn time<T>(&mut self, name: &'static str, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let outer = CURRENT.with(|c| c.replace(Some(name)));
        notify(Some(name));
        // Back to the outer phase however `f` ends: a panic caught further up (a rank-0 panic
        // fails its job, and the thread leads the next one) leaves no stale phase behind.
        let back = Back(outer);
        let out = f();
        if let Some(s) = &self.settle {
            (s.0)();
        }
        drop(back);
        self.add(name, t.elapsed());
        out
    }

    /// Adds a duration to a phase.
    pub fn add(&mut self, name: &'static str, d: Duration) {
        match self.entries.iter_mut().find(|(n, _)| *n == name) {
            Some(e) => e.1 += d,
            None => self.entries.push((name, d)),
        }
    }

    /// The phases in order.
    pub fn entries(&self) -> &[(&'static str, Duration)] {
        &self.entries
    }

    /// Duration of one phase (zero if it did not run).
    pub fn get(&self, name: &str) -> Duration {
        self.entries.iter().find(|(n, _)| *n == name).map_or(Duration::ZERO, |e| e.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::rc::Rc;

    #[test]
    fn a_watcher_sees_each_phase_entered_and_left_until_its_guard_drops() {
        let seen = Rc::new(RefCell::new(Vec::new()));
        let mut t = PhaseTimes::default();
        t.time(phase::PROBE, || ());
        let watch = {
            let seen = seen.clone();
            watch_phases(move |p| seen.borrow_mut().push(p))
        };
        t.time(phase::RECOMPUTE, t_inner);
        // A watch inside gives the outer one back when it ends.
        let inner = watch_phases(|_| {});
        t.time(phase::EVICT, || ());
        drop(inner);
        // A panic inside a phase (caught further up) still goes back to the outer phase.
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            t.time(phase::PROBE, || PhaseTimes::default().time(phase::SELECTION, || panic!("a failing step")))
        }));
        assert!(caught.is_err());
        assert_eq!(current_phase(), None, "a panic left its phase behind");
        drop(watch);
        t.time(phase::DECODE, || ());
        let want = [
            Some(phase::RECOMPUTE),
            Some(phase::SELECTION),
            Some(phase::RECOMPUTE),
            None,
            Some(phase::PROBE),
            Some(phase::SELECTION),
            Some(phase::PROBE),
            None,
        ];
        assert_eq!(*seen.borrow(), want, "before the watch, inside another and after its guard: nothing");
        assert_eq!(current_phase(), None);
    }

    /// A phase timed inside another (with its own timer, as the engine's steps do).
    fn t_inner() {
        PhaseTimes::default().time(phase::SELECTION, || ());
    }
}
