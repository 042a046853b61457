//! `merge_partial`: combine two partial attention results over disjoint key sets.
//!
//! A partial result over keys S is `(out_S, lse_S)` with `out_S = softmax-weighted mean of V`
//! over S and `lse_S = log Σ_{j∈S} exp(s_j)`. Over S ∪ T:
//! `lse = log(e^{lse_S} + e^{lse_T})`, `out = e^{lse_S - lse} out_S + e^{lse_T - lse} out_T`.
//! Computed in the stable form `lse = max + log1p(exp(min - max))`, in f32, so that neither
//! exponent overflows. This is the only place partial attention merges: the split-key path of
//! the attention kernel, context + self attention in the forward, the probe across ranks, the
//! exact recompute scope, ring attention and sharded decoding all call it.

use crate::error::{check_len, KernelError, Result};

/// Merges `(block_out, block_lse)` into `(out, lse)` in place. `out`/`block_out` hold
/// `lse.len()` rows of `head_dim` values. A row with `lse = -inf` (no visible key) is empty:
/// merging with it returns the other side unchanged. The result does not depend on which side
/// is `out` and which is `block` (bitwise).
pub fn merge_partial(
    out: &mut [f32],
    lse: &mut [f32],
    block_out: &[f32],
    block_lse: &[f32],
    head_dim: usize,
) -> Result<()> {
    let rows = lse.len();
    check_len("merge_partial", "block_lse", block_lse.len(), rows)?;
    check_len("merge_partial", "out", out.len(), rows * head_dim)?;
    check_len("merge_partial", "block_out", block_out.len(), rows * head_dim)?;
    if head_dim == 0 {
        return Err(KernelError::Shape { op: "merge_partial", detail: "head_dim is 0".into() });
    }
    for (r, (o, b)) in out.chunks_exact_mut(head_dim).zip(block_out.chunks_exact(head_dim)).enumerate() {
        let (a_lse, b_lse) = (lse[r], block_lse[r]);
        if b_lse == f32::NEG_INFINITY {
            continue;
        }
        if a_lse == f32::NEG_INFINITY {
            o.copy_from_slice(b);
            lse[r] = b_lse;
            continue;
        }
        let (hi, lo) = if a_lse >= b_lse { (a_lse, b_lse) } else { (b_lse, a_lse) };
        let new_lse = hi + (lo - hi).exp().ln_1p();
        let wa = (a_lse - new_lse).exp();
        let wb = (b_lse - new_lse).exp();
        for (x, &y) in o.iter_mut().zip(b) {
            *x = wa * *x + wb * y;
        }
        lse[r] = new_lse;
    }
    Ok(())
}
