//! LookaheadKV as a selection signal (issue 31; no paper tries it): the adapter's trained rows
//! run after the prompt over the placed context, and the attention mass they pay each context
//! token at InfoFlow's scoring layers decides what is recomputed, in place of the prompt's own
//! rows. The rows were trained to attend where the model's answer will (paper 004, eq. 5).
//!
//! ```text
//!   [head][chunk a][chunk b]...[prompt][r_1 .. r_32]     s_j = sum_{l in scoring layers} sum_{i,h} A^l_{r_i j}
//!                                      (LoRA active on the rows only; softmax over every context
//!                                       key, the prompt's keys and the rows' own causal keys)
//! ```
//!
//! Cost over InfoFlow's probe: the prompt through every layer (its keys are what the rows read)
//! and 32 rows to the last scoring layer.

use super::{pooled, ScoreCtx, Selector};
use crate::error::Result;
use flowprefill_kernels::Backend;

/// The lookahead policy.
pub struct Lookahead;

impl<B: Backend> Selector<B> for Lookahead {
    fn score(&self, ctx: &mut ScoreCtx<'_, '_, B>) -> Result<Vec<Vec<f32>>> {
        let w = ctx.score_layer_weights()?;
        let g = ctx.opts.geometry;
        Ok(pooled(ctx.opts, ctx.probe_lookahead(g, &w)?))
    }
}
