//! The per-rank steps of a chunked request, each one forward with its own
//! [`crate::attend::Attend`], on one rank or many (a world of one needs no special case):
//!
//! ```text
//!  chunk_prefill  chunk tokens at local positions, behind an optional head   -> pre-RoPE cache   (no comm)
//!  replicated     prompt (or a decoded token) over the sharded segments + a
//!                 replicated tail; optional attention mass per key           -> probe scores,
//!                                                                               logits           (O(M d)/layer)
//!  recompute      selected tokens at global positions, K/V written into the
//!                 segments before each layer's attention (exact or sparse)   -> corrected cache  (O(k d)/layer)
//!  value_deviation  CacheBlend's |V_new - V_cached|^2 at the check layer     -> scores
//!  ring           exact full prefill with K/V blocks passed around the ring  -> ring baseline
//! ```

mod chunk_prefill;
mod decoding;
mod recompute;
mod replicated;
mod ring;
mod transport;

pub use chunk_prefill::{batches, prefill_chunk, prefill_chunks, ChunkJob, DEFAULT_BATCH_TOKENS};
pub use decoding::{decode_graphs_allowed, DecodeSteps, AHEAD, REPLAY_TOLERANCE};
pub use recompute::{recompute, value_deviation, RecomputeMode, Scope, Selection, Target};
pub use replicated::{HeadScores, LocalSegment, Replicated};
pub use ring::{ring_prefill, zigzag_pieces, RingOutput};

/// A communication failure as a worker error.
pub(crate) fn comm_err(e: flowprefill_comm::CommError) -> WorkerError {
    WorkerError::Comm(e)
}

use crate::error::{Result, WorkerError};
use crate::kv::KvCache;
use flowprefill_kernels::Backend;

/// Copy of a buffer on the backend (of its element type).
pub(crate) fn clone_buf<B: Backend>(be: &B, src: &B::Buf, row_len: usize) -> Result<B::Buf> {
    let len = be.len(src);
    let mut dst = be.zeros_as(len, be.dtype(src))?;
    if len > 0 {
        be.copy_columns(src, row_len, 0, row_len, &mut dst)?;
    }
    Ok(dst)
}

/// Targets of one segment: `(segment, indices into the target list, rows in the segment)`.
pub(crate) type TargetGroup = (usize, Vec<usize>, Vec<usize>);

/// Groups targets by segment.
pub(crate) fn group_targets<S: std::ops::Deref<Target = KvCache<B>>, B: Backend>(
    targets: &[Target],
    segments: &[S],
) -> Result<Vec<TargetGroup>> {
    let mut groups: Vec<TargetGroup> = Vec::new();
    for (i, t) in targets.iter().enumerate() {
        let seg = segments
            .get(t.segment)
            .ok_or_else(|| crate::error::internal(format!("segment {} does not exist", t.segment)))?;
        if t.row >= seg.len() {
            return Err(crate::error::internal(format!(
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

/// Merges a partial attention result into an accumulator on the device; the first partial
/// becomes the accumulator (what `merge_partial` does with an empty one, bit for bit).
pub(crate) fn merge_into<B: Backend>(
    be: &B,
    acc: &mut Option<(B::Buf, B::Buf)>,
    out: B::Buf,
    lse: B::Buf,
    head_dim: usize,
) -> Result<()> {
    match acc {
        None => *acc = Some((out, lse)),
        Some((ao, al)) => be.merge_partial(ao, al, &out, &lse, head_dim)?,
    }
    Ok(())
}

/// A message that cannot be decoded is the sender's protocol error.
pub(crate) fn protocol(e: flowprefill_comm::CommError) -> WorkerError {
    match e {
        flowprefill_comm::CommError::Decode { rank, op, detail } => {
            WorkerError::Protocol { rank, detail: format!("`{op}`: {detail}") }
        }
        e => WorkerError::Comm(e),
    }
}
