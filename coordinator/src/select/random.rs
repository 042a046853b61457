//! Uniformly random recomputation targets, reproducible from `--seed`: the floor any
//! informed policy must beat. A token's score is a hash of the seed and its global index, so
//! the selection does not depend on how chunks are spread over ranks.

use super::{ScoreCtx, Selector};
use crate::error::Result;
use flowprefill_kernels::Backend;

/// The random policy.
pub struct Random;

impl<B: Backend> Selector<B> for Random {
    fn score(&self, ctx: &mut ScoreCtx<'_, '_, B>) -> Result<Vec<Vec<f32>>> {
        let starts = ctx.local_global_starts();
        Ok(ctx
            .local
            .iter()
            .zip(starts)
            .map(|(&c, s)| (0..ctx.layout.chunks[c].len()).map(|i| unit(ctx.opts.seed, (s + i) as u64)).collect())
            .collect())
    }
}

/// SplitMix64 of (seed, index) mapped to [0, 1).
fn unit(seed: u64, index: u64) -> f32 {
    let mut z = seed.wrapping_add(index.wrapping_mul(0x9E37_79B9_7F4A_7C15)).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 40) as f32 / (1u64 << 24) as f32
}
