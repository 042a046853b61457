//! Phase 4: selective recomputation (InfoFlow "KV Recomputation", ProphetKV stage II).
//!
//! The selected tokens run through every layer at their global positions. At each layer their
//! new K/V are written into the placed segments (their own rows) before attention, and they
//! attend causally (by position) to all segments: to the recomputed rows of this layer and to
//! the cached rows of everything else. Non-selected rows keep their cached values.
//!
//! ```text
//!  segments:  [prefix][ chunk a: . . X . . X ][ chunk b: X . . . ]     X = selected rows
//!  layer l:   write K/V of X  ->  X attends to all rows with pos <= its pos  ->  MLP
//! ```
//! Processing the targets in increasing position order in several forwards is exact: a target
//! never sees a later target's stale row (causality), and earlier targets have already written
//! all their layers.

use super::group_targets;
use crate::attend::{attend_over, Attend, KvSource, LayerInput};
use crate::error::{Result, WorkerError};
use crate::kv::{KeyForm, KvCache};
use crate::model::{Logits, Model};
use flowprefill_kernels::Backend;

/// One selected row: `segments[segment]` row `row`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Target {
    /// Segment index.
    pub segment: usize,
    /// Row within the segment.
    pub row: usize,
}

struct Recompute<'a, B: Backend> {
    segments: &'a mut [KvCache<B>],
    groups: Vec<super::TargetGroup>,
}

impl<B: Backend> Attend<B> for Recompute<'_, B> {
    fn attend(&mut self, x: &LayerInput<'_, B>, out: &mut B::Buf) -> Result<()> {
        let be = x.backend;
        let kvd = x.shape.kv_dim();
        for (seg, toks, rows) in &self.groups {
            let layer = self.segments[*seg].layer_mut(x.layer);
            be.copy_rows(x.k, toks, &mut layer.k, rows, kvd)?;
            be.copy_rows(x.v, toks, &mut layer.v, rows, kvd)?;
        }
        let sources = self.segments.iter().map(|s| KvSource::layer(s, x.layer)).collect::<Result<Vec<_>>>()?;
        let mut lse = be.zeros(x.positions.len() * x.shape.n_heads)?;
        attend_over(be, x.shape, x.q, x.positions, &sources, out, &mut lse)
    }
}

/// Recomputes `targets` (token ids `tokens[i]` for `targets[i]`) in `segments` (rotated, at
/// their global positions), in forwards of at most `batch` tokens.
pub fn recompute<B: Backend>(
    model: &Model<B>,
    segments: &mut [KvCache<B>],
    targets: &[Target],
    tokens: &[u32],
    batch: usize,
) -> Result<()> {
    if targets.len() != tokens.len() {
        return Err(WorkerError::Input(format!("{} targets but {} tokens", targets.len(), tokens.len())));
    }
    if segments.iter().any(|s| s.form() != KeyForm::Rotated) {
        return Err(WorkerError::Input("recomputation needs placed (rotated) segments".into()));
    }
    group_targets(targets, segments)?;
    // Increasing position order (ties: segment, row) so that batches are exact.
    let mut order: Vec<usize> = (0..targets.len()).collect();
    order.sort_by_key(|&i| (segments[targets[i].segment].positions()[targets[i].row], targets[i]));
    for part in order.chunks(batch.max(1)) {
        let t: Vec<Target> = part.iter().map(|&i| targets[i]).collect();
        let ids: Vec<u32> = part.iter().map(|&i| tokens[i]).collect();
        let pos: Vec<u32> = t.iter().map(|t| segments[t.segment].positions()[t.row]).collect();
        let groups = group_targets(&t, segments)?;
        let mut att = Recompute { segments: &mut *segments, groups };
        model.forward(&ids, &pos, &mut att, Logits::None)?;
    }
    Ok(())
}
