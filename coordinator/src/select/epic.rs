//! EPIC (ProphetKV Table 3): a static policy recomputing the first tokens of every chunk (the
//! per-chunk attention sinks). Score = -(distance to the chunk start), so the global top-k
//! takes position 0 of every chunk, then position 1, ...: an even split of the budget across
//! chunks (earlier chunks get the remainder).

use super::{ScoreCtx, Selector};
use crate::error::Result;
use flowprefill_kernels::Backend;

/// The EPIC policy.
pub struct Epic;

impl<B: Backend> Selector<B> for Epic {
    fn score(&self, ctx: &mut ScoreCtx<'_, '_, B>) -> Result<Vec<Vec<f32>>> {
        Ok(ctx.local.iter().map(|&c| (0..ctx.layout.chunks[c].len()).map(|i| -(i as f32)).collect()).collect())
    }
}
