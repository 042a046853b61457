//! Two-stage chunk reordering (InfoFlow section 4.3).
//!
//! Stage 1 scores every chunk under HL-TP (chunks at their local positions, the prompt at its
//! global position), so no chunk is favoured for sitting near the prompt; within each chunk
//! the top `ratio` share of its tokens is "selected" and the chunk's importance is the mean
//! score of those tokens (a per-chunk selection, as the paper describes, length-normalised so
//! long chunks are not favoured), without the attention sink of a chunk prefilled from
//! position 0 (its first token: [`without_sink`]). Chunks are then ordered by increasing importance: the most
//! important chunk ends right before the prompt. Stage 2 is the normal selection under GLOBAL
//! positions of the new layout. Only positions change; no KV data moves.

use crate::error::{internal, Result};
use crate::request::Geometry;
use crate::select::ScoreCtx;
use flowprefill_comm::all_gather_value;
use flowprefill_kernels::topk::count_for_ratio;
use flowprefill_kernels::Backend;

/// The new order (chunk ids, first = farthest from the prompt) and each chunk's importance
/// (indexed by chunk id). `ctx.order` must be the request order. Collective: each rank scores
/// its chunks, the importances are all-gathered, every rank derives the same order.
pub fn reorder<B: Backend>(ctx: &mut ScoreCtx<'_, '_, B>, ratio: f64) -> Result<(Vec<usize>, Vec<f32>)> {
    let w = ctx.score_layer_weights()?;
    let scores = ctx.probe(Geometry::HlTp, &w)?;
    let local: Vec<(usize, f32)> = ctx
        .local
        .iter()
        .zip(ctx.chunks)
        .zip(&scores)
        .map(|((&c, kv), s)| (c, chunk_importance(without_sink(s, kv.positions()), ratio)))
        .collect();
    let all: Vec<Vec<(usize, f32)>> = all_gather_value(ctx.comm, "reorder.importance", &local)?;
    let mut importance = vec![0f32; ctx.layout.chunks.len()];
    for (c, v) in all.into_iter().flatten() {
        *importance.get_mut(c).ok_or_else(|| internal(format!("importance of unknown chunk {c}")))? = v;
    }
    Ok((order_by_importance(&importance), importance))
}

/// A chunk's scores without its attention sink: a chunk prefilled alone starts at local
/// position 0, and its first token draws the mass every row of the chunk had nowhere else to
/// put (60-65 against at most 0.9 for any other token, SmolLM2, 2026-11-28), the same in
/// every chunk whatever its content; counted, it ranked chunks by whether they start at 0 (the
/// first chunk, behind the head, always went farthest from the prompt) and not by content.
pub fn without_sink<'s>(scores: &'s [f32], positions: &[u32]) -> &'s [f32] {
    match positions.first() {
        Some(0) if scores.len() > 1 => &scores[1..],
        _ => scores,
    }
}

/// Mean of the top `max(1, round(ratio * n))` scores.
pub fn chunk_importance(scores: &[f32], ratio: f64) -> f32 {
    if scores.is_empty() {
        return 0.0;
    }
    let k = count_for_ratio(ratio, scores.len()).max(1);
    let mut s = scores.to_vec();
    s.sort_by(|a, b| b.total_cmp(a));
    s[..k].iter().sum::<f32>() / k as f32
}

/// Chunk ids by increasing importance (ties: original order), so the most important is last.
pub fn order_by_importance(importance: &[f32]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..importance.len()).collect();
    order.sort_by(|&a, &b| importance[a].total_cmp(&importance[b]).then(a.cmp(&b)));
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn most_important_goes_last() {
        assert_eq!(order_by_importance(&[0.5, 0.9, 0.1, 0.5]), vec![2, 0, 3, 1]);
        assert_eq!(order_by_importance(&[1.0]), vec![0]);
    }

    #[test]
    fn a_chunk_that_starts_at_0_is_scored_without_its_sink() {
        assert_eq!(without_sink(&[60.0, 0.2, 0.9], &[0, 1, 2]), &[0.2, 0.9]);
        assert_eq!(without_sink(&[60.0, 0.2, 0.9], &[12, 13, 14]), &[60.0, 0.2, 0.9], "behind the head: no sink");
        assert_eq!(without_sink(&[5.0], &[0]), &[5.0], "a one-token chunk keeps its token");
    }

    #[test]
    fn importance_is_mean_of_top_share() {
        assert_eq!(chunk_importance(&[1.0, 3.0, 2.0, 0.0], 0.5), 2.5);
        assert_eq!(chunk_importance(&[1.0, 3.0], 0.0), 3.0);
        assert_eq!(chunk_importance(&[], 0.5), 0.0);
    }
}
