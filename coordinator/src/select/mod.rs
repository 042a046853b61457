//! Selection policies, one file each, and the machinery they share (what a policy sees, the
//! probe, the top-k and the coverage cut). What each method is (whether it selects, probes,
//! how deep) is its row in [`crate::method`].
//!
//! | policy | signal | source |
//! | --- | --- | --- |
//! | [`infoflow`] | prompt-to-context attention mass at the scoring layers (GLOBAL) | 003 eq. 7-8 |
//! | [`prophet`] | query attention averaged over all layers | 000 eq. 7 |
//! | [`cacheblend`] | `||V_new - V_cached||^2` at check layer 1 | 000 Table 3 |
//! | [`epic`] | the first tokens of each chunk | 000 Table 3 |
//! | [`cacheclip`] | auxiliary model's last-layer query attention + 8/5 windows | 002 §3.3 |
//! | [`random`] | uniform, seeded | - |
//! | [`lookahead`] | LookaheadKV's trained rows' attention mass at the scoring layers | 004 + issue 31 |
//!
//! Every policy returns one score per context token, per chunk in layout order; the top
//! `k = round(ratio * N)` over all context tokens are recomputed (ties: earlier token first),
//! and a policy may then adjust the set ([`Selector::refine`], CacheClip's windows). Template
//! tokens (the head, the prompt) are never candidates: they are not in any chunk.
//!
//! A budget by coverage (`--coverage C`, [`crate::request::Coverage`]) cuts the same ranking
//! elsewhere: after the fewest best tokens whose scores add up to share C of the whole
//! context's score mass ([`coverage_count`]), within its ratio bounds. The mass is summed per
//! chunk and then over the chunks in layout order, so the cut is the same on any number of
//! ranks.

pub mod cacheblend;
pub mod cacheclip;
pub mod epic;
pub mod infoflow;
pub mod lookahead;
pub mod prophet;
pub mod random;

use crate::error::{internal, Result};
use crate::layout::Layout;
use crate::request::{Geometry, Method, RunOptions};
use flowprefill_comm::Communicator;
use flowprefill_kernels::Backend;
use flowprefill_worker::interrupt::{Check, Watch};
use flowprefill_worker::kv::{KeyForm, KvCache};
use flowprefill_worker::steps::{LocalSegment, Replicated};
use flowprefill_worker::{LoadedModel, Model};
use std::sync::Arc;

/// A head cache and the caches of the requested chunks.
pub type HeadAndChunks<B> = (Arc<KvCache<B>>, Vec<Arc<KvCache<B>>>);

/// Caches of an auxiliary model over the same layout (CacheClip).
pub trait AuxCaches<B: Backend> {
    /// The auxiliary model.
    fn aux_model(&self) -> &LoadedModel<B>;
    /// Its head cache (pre-RoPE, 0..P) and the caches of `chunks` (ids), each prefilled
    /// behind the head (shared prefix).
    fn aux_caches(&self, layout: &Layout, chunks: &[usize], check: Check<'_>) -> Result<HeadAndChunks<B>>;
}

/// What a policy can look at on this rank.
pub struct ScoreCtx<'a, 'c, B: Backend> {
    /// The main model.
    pub lm: &'a LoadedModel<B>,
    /// The request's tokens.
    pub layout: &'a Layout,
    /// Chunk ids in layout order (all ranks).
    pub order: &'a [usize],
    /// Chunk ids this rank holds, in layout order.
    pub local: &'a [usize],
    /// Pre-RoPE caches of the local chunks (same order as `local`).
    pub chunks: &'a [Arc<KvCache<B>>],
    /// The head placed at 0..P, contributed by rank 0 only (segment 0).
    pub head: Option<&'a KvCache<B>>,
    /// The local chunks placed at their GLOBAL positions (same order as `local`); empty when
    /// only other geometries are scored. CacheBlend's probe writes the rows it recomputes
    /// (every context token, its first layers) into them: the recomputation starts from there.
    pub placed: &'a mut [KvCache<B>],
    /// Options of the run.
    pub opts: &'a RunOptions,
    /// Auxiliary caches provider.
    pub aux: &'a dyn AuxCaches<B>,
    /// The world.
    pub comm: &'c mut dyn Communicator,
    /// The job's cancellation and deadline (checked before every layer of the probe).
    pub watch: &'a Watch,
}

/// Global segment id of the chunk at layout index `i` (the head is segment 0).
pub fn segment_id(layout_index: usize) -> usize {
    layout_index + 1
}

/// Layout index of chunk `chunk`: its place in `order`. A chunk missing from the order is a
/// bug of the caller, reported as one (an internal error), never given another chunk's index.
pub fn layout_index(order: &[usize], chunk: usize) -> Result<usize> {
    order
        .iter()
        .position(|&o| o == chunk)
        .ok_or_else(|| internal(format!("chunk {chunk} is not in the chunk order {order:?}")))
}

impl<B: Backend> ScoreCtx<'_, '_, B> {
    /// Layout index of each local chunk.
    pub fn local_layout_indices(&self) -> Result<Vec<usize>> {
        self.local.iter().map(|&c| layout_index(self.order, c)).collect()
    }

    /// Attention mass of each local context token from the prompt (per local chunk), with
    /// `weights[l]` per layer, under `geometry`; a collective over all ranks.
    pub fn probe(&mut self, geometry: Geometry, weights: &[f32]) -> Result<Vec<Vec<f32>>> {
        self.probe_by(Queries::Prompt, geometry, weights)
    }

    /// As [`ScoreCtx::probe`], the mass from LookaheadKV's rows run after the prompt (the model's
    /// lookahead adapter) instead of from the prompt's own rows.
    pub fn probe_lookahead(&mut self, geometry: Geometry, weights: &[f32]) -> Result<Vec<Vec<f32>>> {
        self.probe_by(Queries::Lookahead, geometry, weights)
    }

    fn probe_by(&mut self, queries: Queries, geometry: Geometry, weights: &[f32]) -> Result<Vec<Vec<f32>>> {
        let positions_of: Vec<Vec<u32>> = self.order.iter().map(|&c| self.layout_positions(c)).collect();
        let local_pos: Vec<&[u32]> = positions_of.iter().map(Vec::as_slice).collect();
        let by_id: Vec<&[u32]> = (0..self.layout.chunks.len())
            .map(|c| self.order.iter().position(|&o| o == c).map_or(&[][..], |i| local_pos[i]))
            .collect();
        let (chunk_pos, prompt_pos) = self.layout.positions(geometry, self.order, &by_id);
        let mut segs = Vec::with_capacity(self.local.len() + 1);
        if let Some(h) = self.head {
            segs.push(LocalSegment::placed(0, h));
        }
        for (j, (&c, li)) in self.local.iter().zip(self.local_layout_indices()?).enumerate() {
            let id = segment_id(li);
            let seg = match (geometry, self.placed.get(j)) {
                (Geometry::Global, Some(p)) => LocalSegment::placed(id, p),
                _ => LocalSegment { id, cache: &self.chunks[j], positions: chunk_pos[li].clone() },
            };
            debug_assert_eq!(self.layout.chunks[c].len(), seg.positions.len());
            segs.push(seg);
        }
        let watch = self.watch;
        let mut check = || watch.check(crate::timings::phase::PROBE);
        let op = if queries == Queries::Prompt { "probe" } else { "probe.lookahead" };
        let (model, prompt) = (&self.lm.model, &self.layout.prompt);
        let mut scores = probe_with(queries, model, self.comm, op, segs, prompt, &prompt_pos, weights, &mut check)?;
        if self.head.is_some() {
            scores.remove(0);
        }
        Ok(scores)
    }

    /// Positions chunk `c` was prefilled at (its local positions).
    fn layout_positions(&self, c: usize) -> Vec<u32> {
        match self.local.iter().position(|&l| l == c) {
            Some(j) => self.chunks[j].positions().to_vec(),
            // Other ranks' chunks: only their lengths and starts matter for HL-HP; a chunk
            // behind the head starts at P, others at 0 (see the prefix modes).
            None => local_start(self.opts, self.layout, c),
        }
    }

    /// InfoFlow's scoring layers (inclusive): `--score-layers`, else depth 55%..65%
    /// (layers 22-25 of 40 in the paper).
    pub fn score_layers(&self) -> Result<(usize, usize)> {
        let n = self.lm.model.config().n_layers;
        let (a, b) = self.opts.score_layers.unwrap_or_else(|| default_score_layers(n));
        if b >= n {
            return Err(internal(format!("scoring layers {a}-{b} of a model of {n} layers passed admission")));
        }
        Ok((a, b))
    }

    /// Per-layer weights that are 1 on the scoring layers.
    pub fn score_layer_weights(&self) -> Result<Vec<f32>> {
        let (a, b) = self.score_layers()?;
        let n = self.lm.model.config().n_layers;
        Ok((0..n).map(|l| if (a..=b).contains(&l) { 1.0 } else { 0.0 }).collect())
    }

    /// Global index (layout order, over all context tokens) of row 0 of each local chunk.
    pub fn local_global_starts(&self) -> Vec<usize> {
        let mut start = vec![0usize; self.layout.chunks.len()];
        let mut acc = 0;
        for &c in self.order {
            start[c] = acc;
            acc += self.layout.chunks[c].len();
        }
        self.local.iter().map(|&c| start[c]).collect()
    }
}

/// Local positions of chunk `c` as its prefill placed it: behind the head (P..) for the first
/// chunk and under the shared prefix, after the anchor for later chunks in anchor mode, else 0..
pub fn local_start(opts: &RunOptions, layout: &Layout, c: usize) -> Vec<u32> {
    let p = layout.head.len() as u32;
    let n = layout.chunks[c].len() as u32;
    let start = match (opts.prefix_mode(), c) {
        (_, 0) | (crate::request::PrefixMode::Shared, _) => p,
        (crate::request::PrefixMode::None, _) => 0,
        (crate::request::PrefixMode::Anchor, _) => p + layout.chunks[0].len() as u32,
    };
    (start..start + n).collect()
}

/// Runs `prompt` over local segments (a collective over `comm`) and returns the weighted
/// attention mass of each segment row; stops after the last weighted layer.
#[allow(clippy::too_many_arguments)]
pub fn probe_local<B: Backend>(
    model: &Model<B>,
    comm: &mut dyn Communicator,
    op: &'static str,
    segs: Vec<LocalSegment<'_, B>>,
    prompt: &[u32],
    prompt_pos: &[u32],
    weights: &[f32],
    check: Check<'_>,
) -> Result<Vec<Vec<f32>>> {
    probe_with(Queries::Prompt, model, comm, op, segs, prompt, prompt_pos, weights, check)
}

/// Whose attention a probe measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Queries {
    /// The prompt's rows (InfoFlow and the other query-attention policies).
    Prompt,
    /// LookaheadKV's rows after the prompt.
    Lookahead,
}

/// [`probe_local`] for `Queries::Prompt`; for `Queries::Lookahead` the prompt runs over the
/// segments through every layer (its K/V kept: a forward that stops early keeps none of its
/// rows), then LookaheadKV's rows after it (positions following the prompt's, their LoRA
/// active) up to the last weighted layer, and the scores are the rows' weighted attention mass
/// (two forwards, both collectives over `comm`).
#[allow(clippy::too_many_arguments)]
pub fn probe_with<B: Backend>(
    queries: Queries,
    model: &Model<B>,
    comm: &mut dyn Communicator,
    op: &'static str,
    segs: Vec<LocalSegment<'_, B>>,
    prompt: &[u32],
    prompt_pos: &[u32],
    weights: &[f32],
    check: Check<'_>,
) -> Result<Vec<Vec<f32>>> {
    let Some(last) = weights.iter().rposition(|&w| w > 0.0) else {
        return Ok(segs.iter().map(|s| vec![0.0; s.cache.len()]).collect());
    };
    let be = model.backend();
    let c = model.config();
    let mut tail = KvCache::new(be, c.n_layers, c.kv_dim(), KeyForm::Rotated)?;
    if let Queries::Prompt = queries {
        let mut rep = Replicated::new(be, comm, op, segs, &mut tail, prompt_pos, weights.to_vec())?;
        model.forward_layers(prompt, prompt_pos, &mut rep, last + 1, check)?;
        return Ok(rep.commit()?);
    }
    let rows = model.lookahead_rows();
    if rows == 0 {
        return Err(internal("lookahead selection without a lookahead adapter passed admission"));
    }
    let mut rep = Replicated::new(be, comm, "probe.prompt", segs.clone(), &mut tail, prompt_pos, vec![])?;
    model.forward_layers(prompt, prompt_pos, &mut rep, c.n_layers, &mut *check)?;
    rep.commit()?;
    let next = prompt_pos.last().map_or(0, |p| p + 1);
    let positions: Vec<u32> = (next..next + rows as u32).collect();
    let mut rep = Replicated::new(be, comm, op, segs, &mut tail, &positions, weights.to_vec())?;
    model.forward_lookahead(&positions, &mut rep, last + 1, check)?;
    Ok(rep.commit()?)
}

/// Default InfoFlow scoring layers for a model of `n` layers: `[round(0.55 n), round(0.65 n))`.
pub fn default_score_layers(n: usize) -> (usize, usize) {
    let a = ((0.55 * n as f64).round() as usize).min(n.saturating_sub(1));
    let b = ((0.65 * n as f64).round() as usize).saturating_sub(1).clamp(a, n.saturating_sub(1));
    (a, b)
}

/// A selection policy.
pub trait Selector<B: Backend> {
    /// One score per context token of each local chunk (`ctx.local` order; higher =
    /// recompute first). Collective: every rank calls it, also with no local chunk.
    fn score(&self, ctx: &mut ScoreCtx<'_, '_, B>) -> Result<Vec<Vec<f32>>>;

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
        Method::Lookahead => Box::new(lookahead::Lookahead),
        Method::Full | Method::None | Method::Star | Method::Ring | Method::Kvpacket | Method::Auto => return None,
    })
}

/// `scores` pooled as `--score-pool` asks (unchanged when it is off or 1).
pub fn pooled(opts: &RunOptions, scores: Vec<Vec<f32>>) -> Vec<Vec<f32>> {
    match opts.score_pool {
        Some(window) if window > 1 => scores.iter().map(|s| pool_mean(s, window)).collect(),
        _ => scores,
    }
}

/// Each score replaced by the mean of the scores in a centred window of `window` tokens
/// (odd), cut at the chunk's ends (the mean of what is inside). `window` 1 changes nothing.
pub fn pool_mean(scores: &[f32], window: usize) -> Vec<f32> {
    let half = window / 2;
    let mut prefix = Vec::with_capacity(scores.len() + 1);
    prefix.push(0.0f64);
    for &s in scores {
        prefix.push(prefix[prefix.len() - 1] + f64::from(s));
    }
    (0..scores.len())
        .map(|i| {
            let (lo, hi) = (i.saturating_sub(half), (i + half + 1).min(scores.len()));
            ((prefix[hi] - prefix[lo]) / (hi - lo) as f64) as f32
        })
        .collect()
}

/// What a score adds to a coverage budget's mass: a finite positive score itself, anything
/// else nothing.
pub fn mass(score: f32) -> f64 {
    if score.is_finite() && score > 0.0 {
        f64::from(score)
    } else {
        0.0
    }
}

/// The mass of one chunk's scores (summed in row order).
pub fn chunk_mass(scores: &[f32]) -> f64 {
    scores.iter().map(|&s| mass(s)).sum()
}

/// How many of `best_first` (scores, highest first) a budget by coverage keeps, and the share
/// of `total` they cover: the fewest whose mass reaches `share` of `total`, at least `least`
/// (and at most all of them). A share of 1 keeps them all (rounding must not stop it one
/// short); a total of 0 has nothing to cover.
pub fn coverage_count(best_first: &[f32], total: f64, share: f64, least: usize) -> (usize, f64) {
    let most = best_first.len();
    let covered =
        |k: usize| if total > 0.0 { best_first[..k].iter().map(|&s| mass(s)).sum::<f64>() / total } else { 1.0 };
    let k = if share >= 1.0 {
        most
    } else {
        let goal = share * total;
        let mut acc = 0.0;
        let mut k = 0;
        while k < most && acc < goal {
            acc += mass(best_first[k]);
            k += 1;
        }
        k.max(least).min(most)
    };
    (k, covered(k).min(1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chunk_missing_from_the_order_is_an_error_not_chunk_zero() {
        let order = [2, 0, 1];
        assert_eq!(layout_index(&order, 1).unwrap(), 2);
        assert_eq!(segment_id(layout_index(&order, 2).unwrap()), 1);
        let e = layout_index(&order, 3).unwrap_err();
        assert!(matches!(e, crate::CoordError::Internal(_)), "{e:?}");
        assert!(e.to_string().contains("chunk 3 is not in the chunk order [2, 0, 1]"), "{e}");
    }

    #[test]
    fn a_selector_exactly_where_a_ratio_applies() {
        for m in Method::ALL.into_iter().chain([Method::Auto]) {
            assert_eq!(selector_for::<flowprefill_kernels::Cpu>(m).is_some(), m.selects(), "{m}");
        }
    }

    #[test]
    fn default_layers_match_the_paper_depth() {
        assert_eq!(default_score_layers(40), (22, 25));
        assert_eq!(default_score_layers(30), (17, 19));
        assert_eq!(default_score_layers(2), (1, 1));
        assert_eq!(default_score_layers(1), (0, 0));
    }

    #[test]
    fn pooling_averages_a_centred_window_cut_at_the_chunk_ends() {
        let s = [0.0, 3.0, 0.0, 0.0, 6.0];
        assert_eq!(pool_mean(&s, 1), s.to_vec());
        // Window 3: the ends average the two tokens inside the chunk.
        assert_eq!(pool_mean(&s, 3), vec![1.5, 1.0, 1.0, 2.0, 3.0]);
        let slow: Vec<f32> = (0..s.len())
            .map(|i| {
                let w: Vec<f32> = (i.saturating_sub(2)..(i + 3).min(s.len())).map(|j| s[j]).collect();
                w.iter().sum::<f32>() / w.len() as f32
            })
            .collect();
        assert_eq!(pool_mean(&s, 5), slow);
        assert!(pool_mean(&[], 7).is_empty());
        // The neighbours of a peak now outrank a lone smaller score elsewhere.
        let p = pool_mean(&[0.0, 0.0, 9.0, 0.0, 0.0, 0.0, 2.0, 0.0], 3);
        assert!(p[1] > p[6] && p[3] > p[6]);
    }

    #[test]
    fn coverage_keeps_the_fewest_tokens_reaching_the_share_within_its_bounds() {
        let best = [0.5f32, 0.2, 0.1, 0.1, 0.05, 0.05, 0.0];
        let total = 1.0;
        assert_eq!(coverage_count(&best, total, 0.5, 0).0, 1);
        assert_eq!(coverage_count(&best, total, 0.6, 0).0, 2);
        // 0.5 + 0.2 + 0.1 = 0.8 reaches 0.8 at three (not before).
        let (k, c) = coverage_count(&best, total, 0.8, 0);
        assert!(k == 3 && (c - 0.8).abs() < 1e-6, "{k} {c}");
        // The floor, the share 1 (every candidate, zero scores too) and candidates cut short.
        assert_eq!(coverage_count(&best, total, 0.5, 4).0, 4);
        assert_eq!(coverage_count(&best, total, 1.0, 0).0, 7);
        let (k, c) = coverage_count(&best[..2], total, 0.9, 0);
        assert!(k == 2 && (c - 0.7).abs() < 1e-6, "short of the share, every candidate: {k} {c}");
        // Nothing to cover; NaN and negative scores add nothing.
        assert_eq!(coverage_count(&[0.0, 0.0], 0.0, 0.9, 0), (0, 1.0));
        assert_eq!(coverage_count(&[0.0, 0.0], 0.0, 0.9, 1).0, 1);
        assert_eq!(mass(f32::NAN) + mass(-1.0) + mass(f32::INFINITY), 0.0);
        assert_eq!(chunk_mass(&[0.25, -3.0, 0.5]), 0.75);
    }
}
