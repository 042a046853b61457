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

thread_local! {
    static CURRENT: std::cell::Cell<Option<&'static str>> = const { std::cell::Cell::new(None) };
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
        let out = f();
        if let Some(s) = &self.settle {
            (s.0)();
        }
        CURRENT.with(|c| c.set(outer));
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
