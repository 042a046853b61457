//! Recorded steps: a decode step's ops recorded once and replayed per token
//! ([`crate::Backend::record`]), so that a device runs a token's hundreds of small ops without a
//! host launch each (a CUDA graph).
//!
//! A recording bakes in every argument of every op, so what changes from one token to the
//! next must not be an argument: it lives in device memory the replay rewrites. That is the
//! token, the query's position and the cache row the step writes ([`StepValues`]); everything
//! else a decode step reads is fixed while it replays. The caller sees to that: the KV cache's
//! rows for the coming tokens exist before the recording (zero keys and values, their future
//! positions already in place, so causal masking by position hides them until they are
//! written) and the step writes its row with [`crate::Backend::put_rows`] at
//! [`StepValues::row`].

use crate::error::Result;

/// What changes from one recorded step to the next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepValues {
    /// The token the step embeds (an embedding of exactly one id equal to it reads it here).
    pub token: u32,
    /// The query's position (one-element position lists equal to it read it here: the
    /// rotation of the query and the new key, the attention's query position).
    pub position: u32,
    /// The cache row the step writes ([`crate::Backend::put_rows`] at this row reads it here).
    pub row: u32,
}

/// Replays a recorded step with new values (the backend's side of [`Recorded`]).
pub trait Replay {
    /// Queues the recorded ops again with `values` in place of those recorded; returns when
    /// they are queued (a download afterwards waits for them).
    fn replay(&self, values: StepValues) -> Result<()>;
}

/// A step recorded by [`crate::Backend::record`].
pub struct Recorded(Box<dyn Replay>);

impl Recorded {
    /// Wraps a backend's recording.
    pub fn new(replay: Box<dyn Replay>) -> Self {
        Self(replay)
    }

    /// Queues the step again with `values` (see [`Replay::replay`]).
    pub fn replay(&self, values: StepValues) -> Result<()> {
        self.0.replay(values)
    }
}

impl std::fmt::Debug for Recorded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Recorded")
    }
}
