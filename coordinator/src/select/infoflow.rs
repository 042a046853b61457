//! InfoFlow KV (paper 003, eq. 7-8): the attention mass the prompt puts on each context token,
//! summed over prompt tokens, heads and the scoring layers, under the chosen geometry (GLOBAL by
//! default: the positions the model will decode with).
//!
//! ```text
//!   [head][chunk a][chunk b]...[prompt]        s_j = sum_{l in scoring layers} sum_{i,h} A^l_ij
//!                                                    (softmax over every context key + the
//!                                                     prompt's own causal keys)
//! ```
//!
//! `--score-pool W` (off by default) averages each token's score over a centred window of W
//! tokens within its chunk before the top-k (SnapKV's pooling, an ablation of issue 32): the
//! neighbours of an important token are recomputed with it, at the cost of fewer distinct
//! places within the same budget.

use super::{pooled, ScoreCtx, Selector};
use crate::error::Result;
use flowprefill_kernels::Backend;

/// The InfoFlow policy.
pub struct InfoFlow;

impl<B: Backend> Selector<B> for InfoFlow {
    fn score(&self, ctx: &mut ScoreCtx<'_, '_, B>) -> Result<Vec<Vec<f32>>> {
        let w = ctx.score_layer_weights()?;
        let g = ctx.opts.geometry;
        Ok(pooled(ctx.opts, ctx.probe(g, &w)?))
    }
}
