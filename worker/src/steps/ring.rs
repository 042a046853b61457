//! Ring attention (Liu et al. 2023), the exact sequence-parallel baseline.
//!
//! The whole sequence is cut into 2P pieces; rank r holds pieces r and 2P-1-r (zigzag), so
//! every rank has the same share of causal work whatever its place in the sequence:
//!
//! ```text
//!   pieces:  0   1   2   3 | 4   5   6   7        P = 4, any length (pieces may differ by one
//!   rank:    0   1   2   3 | 3   2   1   0        token, or be empty for very short inputs)
//!
//!   per layer, on every rank:
//!     blk = own K/V
//!     for step in 0..P:
//!         post: send blk to rank+1, receive from rank-1      (before computing)
//!         partial attention of own queries over blk (visibility by position), merge
//!         wait: blk = the received block                      (after computing)
//! ```
//! Partials merge through `merge_partial` in fp32; the result equals single-device prefill up
//! to rounding (InfoFlow appendix B). Each rank keeps its own rows' K/V for decoding.

use super::transport::{per_row, post_bufs, wait_bufs};
use super::{clone_buf, merge_into};
use crate::attend::{Attend, LayerInput};
use crate::error::Result;
use crate::interrupt::Check;
use crate::kv::{KeyForm, KvCache};
use crate::model::{Logits, Model};
use flowprefill_comm::Communicator;
use flowprefill_kernels::Backend;
use std::ops::Range;

/// Token ranges of each rank under the zigzag split of `n` tokens over `ranks` ranks.
pub fn zigzag_pieces(n: usize, ranks: usize) -> Vec<[Range<usize>; 2]> {
    let p = ranks.max(1);
    let cut = |i: usize| i * n / (2 * p);
    (0..p).map(|r| [cut(r)..cut(r + 1), cut(2 * p - 1 - r)..cut(2 * p - r)]).collect()
}

/// What one rank holds after a ring prefill.
pub struct RingOutput<B: Backend> {
    /// This rank's rows (rotated K, V) at their positions.
    pub cache: KvCache<B>,
    /// Logits of the last token, on the rank that holds it.
    pub last_logits: Option<Vec<f32>>,
}

struct Ring<'c, B: Backend> {
    comm: &'c mut dyn Communicator,
    cache: &'c mut KvCache<B>,
}

impl<B: Backend> Attend<B> for Ring<'_, B> {
    fn attend(&mut self, x: &LayerInput<'_, B>, out: &mut B::Buf) -> Result<()> {
        let be = x.backend;
        let (qd, kvd, h, d) = (x.shape.q_dim(), x.shape.kv_dim(), x.shape.n_heads, x.shape.head_dim);
        let m = x.positions.len();
        {
            let layer = self.cache.layer_mut(x.layer);
            be.append(&mut layer.k, x.k)?;
            be.append(&mut layer.v, x.v)?;
        }
        let (me, n) = (self.comm.rank(), self.comm.size());
        let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
        // The block held at this step, on the device: own K/V first.
        let mut blk_pos = x.positions.to_vec();
        let mut blk_k = clone_buf(be, x.k, kvd)?;
        let mut blk_v = clone_buf(be, x.v, kvd)?;
        let mut acc: Option<(B::Buf, B::Buf)> = None;
        let lens = per_row([kvd, kvd]);
        for step in 0..n {
            let last = step + 1 == n;
            // Post the block before computing on it: the transfer overlaps the attention
            // (on a device plane it runs on the communication stream meanwhile).
            let posted = if last {
                None
            } else {
                let sends = vec![(next, blk_pos.clone(), vec![&blk_k, &blk_v])];
                Some(post_bufs(&mut *self.comm, be, "ring.kv", sends, vec![prev], &lens)?)
            };
            if m > 0 && !blk_pos.is_empty() {
                let mut o = be.zeros(m * qd)?;
                let mut l = be.zeros(m * h)?;
                be.attention(x.shape, x.q, x.positions, &blk_k, &blk_v, &blk_pos, &mut o, &mut l)?;
                merge_into(be, &mut acc, o, l, d)?;
            }
            if let Some(posted) = posted {
                let got = wait_bufs(&mut *self.comm, be, posted, &lens)?;
                let (pos, bufs) =
                    got.into_iter().next().ok_or_else(|| crate::error::internal("ring step lost its block"))?;
                let [k, v]: [B::Buf; 2] =
                    bufs.try_into().map_err(|_| crate::error::internal("ring block without K and V"))?;
                (blk_pos, blk_k, blk_v) = (pos, k, v);
            }
        }
        *out = match acc {
            Some((o, _)) => o,
            None => be.zeros(m * qd)?,
        };
        Ok(())
    }
}

/// Exact prefill of `tokens` (positions 0..) spread over the ranks of `comm` with ring
/// attention. Every rank calls it with the same tokens; `check` runs before every layer.
pub fn ring_prefill<B: Backend>(
    model: &Model<B>,
    comm: &mut dyn Communicator,
    tokens: &[u32],
    check: Check<'_>,
) -> Result<RingOutput<B>> {
    let be = model.backend();
    let c = model.config();
    let pieces = zigzag_pieces(tokens.len(), comm.size());
    let mine = &pieces[comm.rank()];
    let rows: Vec<usize> = mine.iter().flat_map(|r| r.clone()).collect();
    let ids: Vec<u32> = rows.iter().map(|&i| tokens[i]).collect();
    let positions: Vec<u32> = rows.iter().map(|&i| i as u32).collect();
    let mut cache = KvCache::new(be, c.n_layers, c.kv_dim(), KeyForm::Rotated)?;
    let last_row = tokens.len().checked_sub(1).and_then(|last| rows.iter().position(|&i| i == last));
    let logit_rows: Vec<usize> = last_row.into_iter().collect();
    let out = {
        let mut ring = Ring { comm, cache: &mut cache };
        model.forward_checked(&ids, &positions, &mut ring, Logits::Rows(&logit_rows), check)?
    };
    cache.set_positions(positions);
    Ok(RingOutput { cache, last_logits: last_row.map(|_| out.last().to_vec()) })
}

#[cfg(test)]
mod tests {
    use super::zigzag_pieces;

    #[test]
    fn zigzag_covers_every_token_once_and_balances() {
        for n in [0usize, 1, 5, 7, 100, 1001] {
            for p in 1..=4 {
                let pieces = zigzag_pieces(n, p);
                let mut seen = vec![0u8; n];
                for ranges in &pieces {
                    for r in ranges {
                        for i in r.clone() {
                            seen[i] += 1;
                        }
                    }
                }
                assert!(seen.iter().all(|&s| s == 1), "n={n} p={p}");
                let sizes: Vec<usize> = pieces.iter().map(|r| r[0].len() + r[1].len()).collect();
                let (lo, hi) = (sizes.iter().min().copied().unwrap_or(0), sizes.iter().max().copied().unwrap_or(0));
                assert!(hi - lo <= 2, "n={n} p={p} {sizes:?}");
            }
        }
    }
}
