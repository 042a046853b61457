//! Uniformly random recomputation targets, reproducible from `--seed`: the floor any
//! informed policy must beat.

use super::{ScoreCtx, Selector};
use crate::error::Result;
use flowprefill_kernels::Backend;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The random policy.
pub struct Random;

impl<B: Backend> Selector<B> for Random {
    fn score(&self, ctx: &ScoreCtx<'_, B>) -> Result<Vec<Vec<f32>>> {
        let mut rng = StdRng::seed_from_u64(ctx.opts.seed);
        Ok(ctx.order.iter().map(|&c| (0..ctx.layout.chunks[c].len()).map(|_| rng.random::<f32>()).collect()).collect())
    }
}
