//! Selection policies: which context tokens to recompute.
//!
//! Every policy returns one score per context token, per chunk in layout order; the top
//! `k = round(ratio * N)` over all context tokens are recomputed (ties: earlier token first),
//! and a policy may then adjust the set ([`Selector::refine`], CacheClip's windows). Template
//! tokens (the head, the prompt) are never candidates: they are not in any chunk.
//!
//! | policy | signal | source |
//! | --- | --- | --- |
//! | [`infoflow`] | prompt-to-context attention mass at the scoring layers (GLOBAL) | 003 eq. 7-8 |
//! | [`prophet`] | query attention averaged over all layers | 000 eq. 7 |
//! | [`cacheblend`] | `||V_new - V_cached||^2` at check layer 1 | 000 Table 3 |
//! | [`epic`] | the first tokens of each chunk | 000 Table 3 |
//! | [`cacheclip`] | auxiliary model's last-layer query attention + 8/5 windows | 002 §3.3 |
//! | [`random`] | uniform, seeded | - |

pub mod cacheblend;
pub mod cacheclip;
pub mod epic;
pub mod infoflow;
pub mod prophet;
pub mod random;

use crate::error::{invalid, Result};
use crate::layout::Layout;
use crate::request::{Geometry, Method, RunOptions};
use flowprefill_kernels::topk::top_k;
use flowprefill_kernels::Backend;
use flowprefill_worker::kv::KvCache;
use flowprefill_worker::steps::{probe, ProbeSource};
use flowprefill_worker::LoadedModel;
use std::sync::Arc;

/// A head cache and the chunk caches (request order) of one layout.
pub type HeadAndChunks<B> = (Arc<KvCache<B>>, Vec<Arc<KvCache<B>>>);

/// Caches of an auxiliary model over the same layout (CacheClip).
pub trait AuxCaches<B: Backend> {
    /// The auxiliary model.
    fn aux_model(&self) -> &LoadedModel<B>;
    /// Its head cache (pre-RoPE, 0..P) and per-chunk caches (request order), each chunk
    /// prefilled behind the head (shared prefix).
    fn aux_caches(&self, layout: &Layout) -> Result<HeadAndChunks<B>>;
}

/// What a policy can look at.
pub struct ScoreCtx<'a, B: Backend> {
    /// The main model.
    pub lm: &'a LoadedModel<B>,
    /// The request's tokens.
    pub layout: &'a Layout,
    /// Chunk ids in layout order.
    pub order: &'a [usize],
    /// Chunk caches, pre-RoPE, in request order.
    pub chunks: &'a [Arc<KvCache<B>>],
    /// Placed segments: `[head, chunk order[0], ...]` rotated to GLOBAL positions. Only the
    /// head is required when scoring under another geometry.
    pub segments: &'a [KvCache<B>],
    /// Options of the run.
    pub opts: &'a RunOptions,
    /// Auxiliary caches provider.
    pub aux: &'a dyn AuxCaches<B>,
}

impl<B: Backend> ScoreCtx<'_, B> {
    /// Attention mass of each context token (per chunk, layout order) from the prompt, with
    /// `weights[l]` per layer, under `geometry`.
    pub fn probe(&self, geometry: Geometry, weights: &[f32]) -> Result<Vec<Vec<f32>>> {
        let head = self.segments.first().ok_or_else(|| invalid("no head segment"))?;
        let local: Vec<&[u32]> = self.chunks.iter().map(|c| c.positions()).collect();
        let (chunk_pos, prompt_pos) = self.layout.positions(geometry, self.order, &local);
        let mut sources = vec![ProbeSource { cache: head, positions: head.positions().to_vec() }];
        for (i, (&c, pos)) in self.order.iter().zip(chunk_pos).enumerate() {
            let placed = self.segments.get(i + 1).filter(|_| geometry == Geometry::Global);
            let cache: &KvCache<B> = placed.unwrap_or(&self.chunks[c]);
            sources.push(ProbeSource { cache, positions: pos });
        }
        let mut scores = probe(&self.lm.model, sources, &self.layout.prompt, &prompt_pos, weights)?;
        scores.remove(0);
        Ok(scores)
    }

    /// InfoFlow's scoring layers (inclusive): `--score-layers`, else depth 55%..65%
    /// (layers 22-25 of 40 in the paper).
    pub fn score_layers(&self) -> Result<(usize, usize)> {
        let n = self.lm.model.config().n_layers;
        let (a, b) = self.opts.score_layers.unwrap_or_else(|| default_score_layers(n));
        if b >= n {
            return Err(invalid(format!("--score-layers {a}-{b}: the model has layers 0-{}", n - 1)));
        }
        Ok((a, b))
    }

    /// Per-layer weights that are 1 on the scoring layers.
    pub fn score_layer_weights(&self) -> Result<Vec<f32>> {
        let (a, b) = self.score_layers()?;
        let n = self.lm.model.config().n_layers;
        Ok((0..n).map(|l| if (a..=b).contains(&l) { 1.0 } else { 0.0 }).collect())
    }
}

/// Default InfoFlow scoring layers for a model of `n` layers: `[round(0.55 n), round(0.65 n))`.
pub fn default_score_layers(n: usize) -> (usize, usize) {
    let a = ((0.55 * n as f64).round() as usize).min(n.saturating_sub(1));
    let b = ((0.65 * n as f64).round() as usize).saturating_sub(1).clamp(a, n.saturating_sub(1));
    (a, b)
}

/// A selection policy.
pub trait Selector<B: Backend> {
    /// One score per context token, per chunk in layout order (higher = recompute first).
    fn score(&self, ctx: &ScoreCtx<'_, B>) -> Result<Vec<Vec<f32>>>;

    /// Adjusts the top-k flags (per chunk, layout order). Default: unchanged.
    fn refine(&self, _scores: &[Vec<f32>], selected: Vec<Vec<bool>>) -> Vec<Vec<bool>> {
        selected
    }
}

/// The policy of a method (`None` for methods that select nothing).
pub fn selector_for<B: Backend>(method: Method) -> Option<Box<dyn Selector<B>>> {
    Some(match method {
        Method::Infoflow => Box::new(infoflow::InfoFlow),
        Method::Prophet => Box::new(prophet::Prophet),
        Method::Cacheblend => Box::new(cacheblend::CacheBlend::default()),
        Method::Epic => Box::new(epic::Epic),
        Method::Cacheclip => Box::new(cacheclip::CacheClip::default()),
        Method::Random => Box::new(random::Random),
        Method::Full | Method::None | Method::Star => return None,
    })
}

/// Flags of the `k` best tokens over all chunks (ties: earlier token in layout order).
pub fn top_k_flags(scores: &[Vec<f32>], k: usize) -> Vec<Vec<bool>> {
    let flat: Vec<f32> = scores.iter().flatten().copied().collect();
    let mut flags: Vec<Vec<bool>> = scores.iter().map(|s| vec![false; s.len()]).collect();
    let mut starts = Vec::with_capacity(scores.len());
    let mut acc = 0;
    for s in scores {
        starts.push(acc);
        acc += s.len();
    }
    for i in top_k(&flat, k) {
        let c = starts.partition_point(|&s| s <= i) - 1;
        flags[c][i - starts[c]] = true;
    }
    flags
}

/// Rows selected per chunk (layout order) from flags.
pub fn rows_of(flags: &[Vec<bool>]) -> Vec<Vec<usize>> {
    flags.iter().map(|f| f.iter().enumerate().filter(|(_, &s)| s).map(|(i, _)| i).collect()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_layers_match_the_paper_depth() {
        assert_eq!(default_score_layers(40), (22, 25));
        assert_eq!(default_score_layers(30), (17, 19));
        assert_eq!(default_score_layers(2), (1, 1));
        assert_eq!(default_score_layers(1), (0, 0));
    }

    #[test]
    fn top_k_flags_spans_chunks() {
        let s = vec![vec![0.1, 0.9], vec![0.5], vec![0.9, 0.0, 0.3]];
        let f = top_k_flags(&s, 3);
        assert_eq!(rows_of(&f), vec![vec![1], vec![0], vec![0]]);
        assert_eq!(rows_of(&top_k_flags(&s, 0)), vec![Vec::<usize>::new(); 3]);
    }
}
