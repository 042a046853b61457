//! CacheBlend (as LMCache's blender and ProphetKV Table 3 describe it): every context token
//! is recomputed through the first layers under the global layout, and the tokens whose value
//! vectors moved most from their cached (chunk-local) values at the check layer are selected:
//! `score_j = ||V_new(j) - V_cached(j)||^2` at layer 1. Later layers recompute only those;
//! the first layers keep every token's recomputed K/V (the probe writes them into the placed
//! chunks), as CacheBlend fuses them: a token not selected has its cached K/V from layer 2 on.

use super::{ScoreCtx, Selector};
use crate::error::Result;
use flowprefill_kernels::Backend;
use flowprefill_worker::steps::{value_deviation, Selection, Target};

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
    fn score(&self, ctx: &mut ScoreCtx<'_, '_, B>) -> Result<Vec<Vec<f32>>> {
        let check = self.check_layer.min(ctx.lm.model.config().n_layers - 1);
        // Local segments: the head on rank 0, then the placed local chunks.
        let first_chunk = usize::from(ctx.head.is_some());
        let mut targets = Vec::new();
        let mut tokens = Vec::new();
        for (j, &c) in ctx.local.iter().enumerate() {
            for (row, &t) in ctx.layout.chunks[c].iter().enumerate() {
                targets.push(Target { segment: first_chunk + j, row });
                tokens.push(t);
            }
        }
        // Every context token of every rank is recomputed through the first layers.
        let p = ctx.layout.head.len() as u32;
        let all: Vec<u32> = (p..p + ctx.layout.n_context() as u32).collect();
        let watch = ctx.watch;
        let mut stop = || watch.check(crate::timings::phase::PROBE);
        let sel = Selection { targets: &targets, tokens: &tokens, all_positions: &all };
        let dev = value_deviation(&ctx.lm.model, ctx.comm, ctx.head, ctx.placed, &sel, check, &mut stop)?;
        let mut it = dev.into_iter();
        Ok(ctx.local.iter().map(|&c| it.by_ref().take(ctx.layout.chunks[c].len()).collect()).collect())
    }
}
