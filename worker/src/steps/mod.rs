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
mod recompute;
mod replicated;
mod ring;

pub use chunk_prefill::{prefill_chunk, prefill_chunks, ChunkJob, DEFAULT_BATCH_TOKENS};
pub use recompute::{recompute, value_deviation, Scope, Target};
pub use replicated::{LocalSegment, Replicated};
pub use ring::{ring_prefill, zigzag_pieces, RingOutput};

/// A communication failure as a worker error.
pub(crate) fn comm_err(e: flowprefill_comm::CommError) -> WorkerError {
    WorkerError::Comm(e)
}

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
pub(crate) fn group_targets<S: std::ops::Deref<Target = KvCache<B>>, B: Backend>(
    targets: &[Target],
    segments: &[S],
) -> Result<Vec<TargetGroup>> {
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

/// Packs row positions and f32 payloads: `[n u32][positions u32 x n][floats...]`.
pub(crate) fn pack(positions: &[u32], parts: &[&[f32]]) -> Vec<u8> {
    let mut b = Vec::with_capacity(4 + 4 * positions.len() + parts.iter().map(|p| 4 * p.len()).sum::<usize>());
    b.extend_from_slice(&(positions.len() as u32).to_le_bytes());
    b.extend_from_slice(bytemuck::cast_slice(positions));
    for p in parts {
        b.extend_from_slice(bytemuck::cast_slice(p));
    }
    b
}

/// `(positions, floats)` from [`pack`].
pub(crate) fn unpack(rank: usize, b: &[u8]) -> Result<(Vec<u32>, Vec<f32>)> {
    let bad = || WorkerError::Input(format!("malformed message from rank {rank}"));
    let n = b.get(..4).map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]])).ok_or_else(bad)? as usize;
    let pos_end = 4 + 4 * n;
    let pos = b
        .get(4..pos_end)
        .ok_or_else(bad)?
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let rest = b.get(pos_end..).ok_or_else(bad)?;
    if rest.len() % 4 != 0 {
        return Err(bad());
    }
    Ok((pos, rest.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()))
}
