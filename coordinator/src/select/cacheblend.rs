//! CacheBlend (as LMCache's blender and ProphetKV Table 3 describe it): every context token
//! is recomputed through the first layers under the global layout, and the tokens whose value
//! vectors moved most from their cached (chunk-local) values at the check layer are selected:
//! `score_j = ||V_new(j) - V_cached(j)||^2` at layer 1. Later layers recompute only those.

use super::{ScoreCtx, Selector};
use crate::error::Result;
use flowprefill_kernels::Backend;
use flowprefill_worker::steps::{value_deviation, Target};

/// The CacheBlend policy.
pub struct CacheBlend {
    /// The layer whose value deviation is measured.
    pub check_layer: usize,
}

impl Default for CacheBlend {
    fn default() -> Self {
        Self { check_layer: 1 }
    }
}

impl<B: Backend> Selector<B> for CacheBlend {
    fn score(&self, ctx: &ScoreCtx<'_, B>) -> Result<Vec<Vec<f32>>> {
        let check = self.check_layer.min(ctx.lm.model.config().n_layers - 1);
        let mut targets = Vec::with_capacity(ctx.layout.n_context());
        let mut tokens = Vec::with_capacity(ctx.layout.n_context());
        for (i, &c) in ctx.order.iter().enumerate() {
            for (row, &t) in ctx.layout.chunks[c].iter().enumerate() {
                targets.push(Target { segment: i + 1, row });
                tokens.push(t);
            }
        }
        let dev = value_deviation(&ctx.lm.model, ctx.segments, &targets, &tokens, check)?;
        let mut it = dev.into_iter();
        Ok(ctx.order.iter().map(|&c| it.by_ref().take(ctx.layout.chunks[c].len()).collect()).collect())
    }
}
