//! KV eviction between the prompt and decoding (`--evict snapkv|lookahead --kv-budget N`).
//!
//! SnapKV: the prompt's forward kept, at every layer, the attention its last
//! [`SNAPKV_WINDOW`] rows paid each context row of this rank, per KV head. LookaheadKV: the
//! model's lookahead rows run after the prompt over the same segments and the prompt's rows,
//! their LoRA active, and their attention is kept the same way (their own K/V are dropped
//! again; [`flowprefill_worker::lookahead`]). Each rank pools the scores
//! over [`SNAPKV_POOL`] rows (within a segment) and packs its kept rows into one cache
//! ([`flowprefill_worker::evict::pack`]); the segments it held are dropped, and decoding runs
//! over the packed cache and the prompt's own rows (always kept, as SnapKV keeps its window).
//!
//! # How the budget is split over ranks
//!
//! A packed cache keeps the same number of rows in every layer and head, so a rank cannot keep
//! a different count per head. Each rank sends its best `N` scores per (layer, KV head)
//! (`evict.top`, one all-gather of `layers x heads x N` floats per rank); every rank then finds
//! where the global top `N` of each (layer, head) lies, averages each rank's share over all
//! layers and heads, and rounds the shares to integers that sum to `N` (largest remainder,
//! ties to the lower rank). Rank `r` keeps its own top `k_r` of every (layer, head). So every
//! (layer, KV head) keeps exactly `N` context entries over all ranks; on one rank they are its
//! top `N` exactly, on several ranks each rank's share is the one the global ranking gives it
//! on average.

use super::{Engine, Outcome};
use crate::error::{internal, Result};
use crate::request::{Evict, EvictPolicy};
use crate::select::pool_mean;
use flowprefill_comm::{all_gather_value, Communicator};
use flowprefill_kernels::Backend;
use flowprefill_worker::evict::{pack, PackSource, SNAPKV_POOL, SNAPKV_WINDOW};
use flowprefill_worker::kv::KvCache;
use flowprefill_worker::steps::HeadScores;

/// What eviction kept (the same on every rank).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Eviction {
    /// The scoring.
    pub policy: EvictPolicy,
    /// Context entries kept per (layer, KV head), as asked.
    pub budget: usize,
    /// Observation window (query rows of the prompt that scored the cache).
    pub window: usize,
    /// Context rows held before eviction, all ranks.
    pub rows_before: usize,
    /// Rows kept per (layer, KV head) on each rank (their sum: the budget, or every row).
    pub kept_per_rank: Vec<usize>,
    /// Bytes of context K/V before eviction, all ranks.
    pub bytes_before: usize,
    /// Bytes of context K/V after eviction, all ranks.
    pub bytes_after: usize,
}

impl Eviction {
    /// Rows kept per (layer, KV head) over all ranks.
    pub fn kept(&self) -> usize {
        self.kept_per_rank.iter().sum()
    }
}

/// The observation window of a policy: SnapKV's last prompt rows, or the lookahead rows of
/// the model's adapter (`lookahead_rows`).
pub(super) fn window(policy: EvictPolicy, lookahead_rows: usize) -> usize {
    match policy {
        EvictPolicy::Snapkv => SNAPKV_WINDOW,
        EvictPolicy::Lookahead => lookahead_rows,
    }
}

/// One (layer, head)'s local candidates: (score, segment, row), in segment and row order.
type Candidates = Vec<(f32, usize, usize)>;

/// Best first; ties keep the earlier candidate (segment order, then row).
fn best_first(c: &mut Candidates) {
    c.sort_by(|a, b| b.0.total_cmp(&a.0).then((a.1, a.2).cmp(&(b.1, b.2))));
}

/// Rank shares of `n` entries per (layer, head): `tops[r][lh]` are rank r's best scores (best
/// first) per (layer, head). Each (layer, head)'s global top `n` (ties: lower rank, then
/// earlier entry) counted per rank, averaged over the (layer, head) pairs and rounded to
/// integers that sum to `n` (largest remainder, ties to the lower rank).
pub(crate) fn split_budget(tops: &[Vec<Vec<f32>>], n: usize) -> Vec<usize> {
    let ranks = tops.len();
    let pairs = tops.first().map_or(0, Vec::len);
    if pairs == 0 {
        return vec![0; ranks];
    }
    let mut counts = vec![0usize; ranks];
    for lh in 0..pairs {
        let mut all: Vec<(f32, usize, usize)> =
            tops.iter().enumerate().flat_map(|(r, t)| t[lh].iter().enumerate().map(move |(i, &s)| (s, r, i))).collect();
        all.sort_by(|a, b| b.0.total_cmp(&a.0).then((a.1, a.2).cmp(&(b.1, b.2))));
        for &(_, r, _) in all.iter().take(n) {
            counts[r] += 1;
        }
    }
    let floor: Vec<usize> = counts.iter().map(|c| c / pairs).collect();
    let total = counts.iter().sum::<usize>() / pairs;
    let mut rest: Vec<usize> = (0..ranks).collect();
    rest.sort_by(|&a, &b| (counts[b] % pairs).cmp(&(counts[a] % pairs)).then(a.cmp(&b)));
    let mut shares = floor.clone();
    for &r in rest.iter().take(total.saturating_sub(floor.iter().sum())) {
        shares[r] += 1;
    }
    shares
}

impl<B: Backend> Engine<B> {
    /// Evicts this rank's `segments` (id, placed cache) to its share of `ev.budget` by the
    /// prompt's `heads` scores (see the module docs); `None` when this rank keeps nothing.
    pub(super) fn evict(
        &self,
        comm: &mut dyn Communicator,
        segments: &[(usize, KvCache<B>)],
        heads: &HeadScores,
        ev: Evict,
        out: &mut Outcome,
    ) -> Result<Option<(usize, KvCache<B>)>> {
        let model = &self.lm.model;
        let cfg = model.config();
        let (layers, hkv) = (cfg.n_layers, cfg.n_kv_heads);
        let local_rows: usize = segments.iter().map(|(_, c)| c.len()).sum();
        // Local candidates per (layer, head), pooled within each segment.
        let mut cands: Vec<Candidates> = vec![Vec::with_capacity(local_rows); layers * hkv];
        for (si, (id, cache)) in segments.iter().enumerate() {
            if cache.is_empty() {
                continue;
            }
            let per_layer = heads.get(si).ok_or_else(|| internal(format!("no head scores for segment {id}")))?;
            for (l, per_head) in per_layer.iter().enumerate() {
                if per_head.len() != hkv || per_head.iter().any(|s| s.len() != cache.len()) {
                    return Err(internal(format!("segment {id} layer {l}: head scores of another shape")));
                }
                for (h, s) in per_head.iter().enumerate() {
                    let pooled = pool_mean(s, SNAPKV_POOL);
                    cands[l * hkv + h].extend(pooled.into_iter().enumerate().map(|(row, x)| (x, si, row)));
                }
            }
        }
        for c in &mut cands {
            best_first(c);
        }
        let tops: Vec<Vec<f32>> = cands.iter().map(|c| c.iter().take(ev.budget).map(|x| x.0).collect()).collect();
        let all: Vec<(usize, Vec<Vec<f32>>)> = all_gather_value(comm, "evict.top", &(local_rows, tops))?;
        let rows: Vec<usize> = all.iter().map(|a| a.0).collect();
        let tops: Vec<Vec<Vec<f32>>> = all.into_iter().map(|a| a.1).collect();
        let shares = split_budget(&tops, ev.budget);
        let mine = shares[comm.rank()];
        if mine > local_rows {
            return Err(internal(format!("eviction share {mine} above the {local_rows} rows held")));
        }
        let row_bytes = 2 * layers * cfg.kv_dim() * model.backend().kv_dtype().size();
        let rows_before: usize = rows.iter().sum();
        out.eviction = Some(Eviction {
            policy: ev.policy,
            budget: ev.budget,
            window: window(ev.policy, model.lookahead_rows()),
            rows_before,
            bytes_before: rows_before * row_bytes,
            bytes_after: shares.iter().sum::<usize>() * row_bytes,
            kept_per_rank: shares,
        });
        if mine == 0 {
            return Ok(None);
        }
        // Each head's best `mine`, in place order (segment, row).
        let keep: Vec<Vec<Vec<(usize, usize)>>> = (0..layers)
            .map(|l| {
                (0..hkv)
                    .map(|h| {
                        let mut k: Vec<(usize, usize)> =
                            cands[l * hkv + h].iter().take(mine).map(|&(_, s, r)| (s, r)).collect();
                        k.sort_unstable();
                        k
                    })
                    .collect()
            })
            .collect();
        let sources: Vec<PackSource<'_, B>> =
            segments.iter().map(|(_, cache)| PackSource { cache, positions: cache.positions() }).collect();
        let packed = pack(model.backend(), model.rope(), &sources, &keep, hkv)?;
        let id = segments.iter().map(|s| s.0).min().unwrap_or(0);
        Ok(Some((id, packed)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_is_split_by_where_the_global_top_lies() {
        // One (layer, head): rank 0 holds 3 of the global top 4.
        let tops = vec![vec![vec![9.0, 8.0, 7.0, 1.0]], vec![vec![7.5, 0.5, 0.2, 0.1]]];
        assert_eq!(split_budget(&tops, 4), [3, 1]);
        // Two pairs: shares 3+1 and 1+3 average to 2 and 2.
        let tops = vec![vec![vec![9.0, 8.0, 7.0], vec![1.0, 0.0, 0.0]], vec![vec![7.5, 0.0, 0.0], vec![5.0, 4.0, 3.0]]];
        assert_eq!(split_budget(&tops, 4), [2, 2]);
        // Shares 2.5 / 1.5 / 0: the larger remainder first, ties to the lower rank.
        let tops =
            vec![vec![vec![9.0, 8.0, 7.0], vec![9.0, 8.0, 0.0]], vec![vec![1.0], vec![7.0, 6.0]], vec![vec![], vec![]]];
        let s = split_budget(&tops, 4);
        assert_eq!((s.iter().sum::<usize>(), s), (4, vec![3, 1, 0]));
        // A budget above every row keeps every row.
        let tops = vec![vec![vec![1.0, 2.0]], vec![vec![3.0]]];
        assert_eq!(split_budget(&tops, 100), [2, 1]);
        // Ties go to the lower rank.
        let tops = vec![vec![vec![1.0]], vec![vec![1.0]]];
        assert_eq!(split_budget(&tops, 1), [1, 0]);
    }
}
