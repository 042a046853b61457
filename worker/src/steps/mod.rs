//! The per-rank steps of a chunked request, each one forward with its own [`crate::attend::Attend`]:
//!
//! ```text
//!  chunk_prefill  chunk tokens at local positions, behind an optional head   -> pre-RoPE cache
//!  probe          prompt over placed chunks + itself, attention mass per key  -> scores
//!  deviation      all context tokens, first layers, |V_new - V_cached|^2       -> scores (CacheBlend)
//!  recompute      selected tokens at global positions, writing their K/V into
//!                 the placed segments before each layer's attention           -> corrected segments
//! ```
//! The final prompt pass and decoding use [`crate::attend::AppendAttend::with_context`] over
//! the same segments.

mod chunk_prefill;
mod deviation;
mod probe;
mod recompute;

pub use chunk_prefill::{prefill_chunk, prefill_chunks, ChunkJob, DEFAULT_BATCH_TOKENS};
pub use deviation::value_deviation;
pub use probe::{probe, ProbeSource};
pub use recompute::{recompute, Target};

use crate::error::{Result, WorkerError};
use crate::kv::KvCache;
use flowprefill_kernels::Backend;

/// Copy of a buffer on the backend.
pub(crate) fn clone_buf<B: Backend>(be: &B, src: &B::Buf, row_len: usize) -> Result<B::Buf> {
    let len = be.len(src);
    let mut dst = be.zeros(len)?;
    if len > 0 {
        be.copy_columns(src, row_len, 0, row_len, &mut dst)?;
    }
    Ok(dst)
}

/// Targets of one segment: `(segment, indices into the target list, rows in the segment)`.
pub(crate) type TargetGroup = (usize, Vec<usize>, Vec<usize>);

/// Groups targets by segment.
pub(crate) fn group_targets(targets: &[Target], segments: &[KvCache<impl Backend>]) -> Result<Vec<TargetGroup>> {
    let mut groups: Vec<TargetGroup> = Vec::new();
    for (i, t) in targets.iter().enumerate() {
        let seg = segments
            .get(t.segment)
            .ok_or_else(|| WorkerError::Input(format!("segment {} does not exist", t.segment)))?;
        if t.row >= seg.len() {
            return Err(WorkerError::Input(format!(
                "row {} outside segment {} of {} rows",
                t.row,
                t.segment,
                seg.len()
            )));
        }
        match groups.iter_mut().find(|g| g.0 == t.segment) {
            Some(g) => {
                g.1.push(i);
                g.2.push(t.row);
            }
            None => groups.push((t.segment, vec![i], vec![t.row])),
        }
    }
    Ok(groups)
}
