//! ProphetKV (paper 000, eq. 7 and Algorithm 1): the query's attention to each context token,
//! averaged uniformly over all L layers of a lightweight pass of the prompt over the assembled
//! caches; one global top set is recomputed at every layer.

use super::{ScoreCtx, Selector};
use crate::error::Result;
use flowprefill_kernels::Backend;

/// The ProphetKV policy.
pub struct Prophet;

impl<B: Backend> Selector<B> for Prophet {
    fn score(&self, ctx: &mut ScoreCtx<'_, '_, B>) -> Result<Vec<Vec<f32>>> {
        let n = ctx.lm.model.config().n_layers;
        let g = ctx.opts.geometry;
        ctx.probe(g, &vec![1.0 / n as f32; n])
    }
}
