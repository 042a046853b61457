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
use std::cmp::Ordering;

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

/// Mean of the top `max(1, round(ratio * n))` scores. A NaN score ranks below every number,
/// as in every top-k cut ([`flowprefill_kernels::topk::rank_order`]): the mean is of the top
/// scores that are numbers, and a chunk with no score that is a number has importance NaN
/// (least important: [`order_by_importance`]).
pub fn chunk_importance(scores: &[f32], ratio: f64) -> f32 {
    if scores.is_empty() {
        return 0.0;
    }
    let k = count_for_ratio(ratio, scores.len()).max(1);
    let mut s: Vec<f32> = scores.iter().copied().filter(|v| !v.is_nan()).collect();
    if s.is_empty() {
        return f32::NAN;
    }
    s.sort_by(|a, b| b.total_cmp(a));
    let top = &s[..k.min(s.len())];
    top.iter().sum::<f32>() / top.len() as f32
}

/// Chunk ids by increasing importance (ties: original order), so the most important is last.
/// A NaN importance (of either sign: the model gave the chunk no score that is a number) is
/// the least: such chunks go first, farthest from the prompt, in their original order.
/// `f32::total_cmp` alone put a positive NaN last (next to the prompt, as the most important)
/// and a negative one first.
pub fn order_by_importance(importance: &[f32]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..importance.len()).collect();
    order.sort_by(|&a, &b| {
        let (x, y) = (importance[a], importance[b]);
        y.is_nan()
            .cmp(&x.is_nan())
            .then_with(|| if x.is_nan() { Ordering::Equal } else { x.total_cmp(&y) })
            .then(a.cmp(&b))
    });
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

    /// A NaN score ranks below every number (as in the top-k cut): it neither becomes a
    /// chunk's top score nor spoils the mean; a chunk of NaN only is NaN.
    #[test]
    fn nan_scores_rank_below_every_number_within_a_chunk() {
        let nan = f32::NAN;
        assert_eq!(chunk_importance(&[nan, 1.0, 3.0, 2.0], 0.25), 3.0);
        assert_eq!(chunk_importance(&[-nan, 1.0, 3.0, 2.0], 0.5), 2.5);
        assert_eq!(chunk_importance(&[nan, -nan, 4.0, nan], 0.75), 4.0, "the numbers there are");
        assert_eq!(chunk_importance(&[nan, 1.0, f32::NEG_INFINITY], 1.0), f32::NEG_INFINITY);
        assert!(chunk_importance(&[nan, -nan], 0.5).is_nan());
    }

    /// NaN importance of either sign is the least: first (farthest from the prompt), in chunk
    /// order, whatever the numbers around it; `total_cmp` alone put NaN last and -NaN first.
    #[test]
    fn nan_importance_goes_first_in_chunk_order() {
        let nan = f32::NAN;
        assert_eq!(order_by_importance(&[0.5, nan, 0.1, -nan, 0.9]), vec![1, 3, 2, 0, 4]);
        assert_eq!(order_by_importance(&[-nan, 0.5, nan]), vec![0, 2, 1]);
        assert_eq!(order_by_importance(&[f32::NEG_INFINITY, nan, f32::INFINITY]), vec![1, 0, 2]);
        assert_eq!(order_by_importance(&[nan, nan]), vec![0, 1]);
        // The order does not depend on where the NaN sits among the numbers (a NaN is never
        // taken for the most important, however the sort meets it).
        for at in 0..5 {
            let mut imp = vec![0.3, 0.7, 0.1, 0.9];
            imp.insert(at, nan);
            let order = order_by_importance(&imp);
            assert_eq!(order[0], at, "{imp:?} -> {order:?}");
            let rest: Vec<f32> = order[1..].iter().map(|&c| imp[c]).collect();
            assert_eq!(rest, vec![0.1, 0.3, 0.7, 0.9], "{imp:?} -> {order:?}");
        }
    }
}
