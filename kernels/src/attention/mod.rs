//! Attention with explicit positions, returning the output AND the log-sum-exp.
//!
//! Layouts (token-major, as the projections produce them):
//! ```text
//!   q   [M, n_heads,    head_dim]   qpos [M]
//!   k,v [N, n_kv_heads, head_dim]   kpos [N]
//!   out [M, n_heads,    head_dim]   lse  [M, n_heads]   (natural log)
//! ```
//! Key j is visible to query i iff `kpos[j] <= qpos[i]`: causality comes from positions, so the
//! same kernel serves plain prefill, a chunk at local positions, a prompt over a placed cache
//! and recomputed tokens at global positions. Query head h reads KV head `h / (n_heads /
//! n_kv_heads)` (grouped-query attention). A query with no visible key gets `out = 0`,
//! `lse = -inf`, which [`crate::merge::merge_partial`] treats as empty.
//!
//! [`attention`] is the fast blocked kernel ([`flash`]); [`attention_ref`] the slow reference.

mod flash;
mod reference;
mod scores;

pub use flash::attention;
pub use reference::attention_ref;
pub use scores::{attention_scores, attention_scores_ref};

use crate::error::{check_len, KernelError, Result};

/// Head layout of one attention call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnShape {
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (divides `n_heads`).
    pub n_kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// Softmax scale, `1/sqrt(head_dim)` by default.
    pub scale: f32,
}

impl AttnShape {
    /// Checks the head layout and sets the default scale.
    pub fn new(n_heads: usize, n_kv_heads: usize, head_dim: usize) -> Result<Self> {
        if n_kv_heads == 0 || n_heads == 0 || !n_heads.is_multiple_of(n_kv_heads) {
            return Err(KernelError::HeadLayout { op: "AttnShape::new", n_heads, n_kv_heads });
        }
        if head_dim == 0 {
            return Err(KernelError::Shape { op: "AttnShape::new", detail: "head_dim is 0".into() });
        }
        Ok(Self { n_heads, n_kv_heads, head_dim, scale: 1.0 / (head_dim as f32).sqrt() })
    }

    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }

    /// Values per token in q/out.
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// Values per token in k/v.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

/// Keys and values with their positions.
#[derive(Clone, Copy, Debug)]
pub struct KvRef<'a> {
    /// `[N, n_kv_heads, head_dim]`, already rotated to `pos`.
    pub k: &'a [f32],
    /// `[N, n_kv_heads, head_dim]`.
    pub v: &'a [f32],
    /// `[N]` positions.
    pub pos: &'a [u32],
}

impl KvRef<'_> {
    /// Number of keys.
    pub fn len(&self) -> usize {
        self.pos.len()
    }

    /// True when there are no keys.
    pub fn is_empty(&self) -> bool {
        self.pos.is_empty()
    }
}

/// Checks a head layout that may not come from [`AttnShape::new`] (the fields are public):
/// heads and KV heads positive, the query heads a multiple of the KV heads, a positive head
/// size. A zero would divide by zero in the kernels, or make every buffer empty.
pub(crate) fn check_layout(op: &'static str, shape: &AttnShape) -> Result<()> {
    if shape.n_kv_heads == 0 || shape.n_heads == 0 || !shape.n_heads.is_multiple_of(shape.n_kv_heads) {
        return Err(KernelError::HeadLayout { op, n_heads: shape.n_heads, n_kv_heads: shape.n_kv_heads });
    }
    if shape.head_dim == 0 {
        return Err(KernelError::Shape { op, detail: "head_dim is 0".into() });
    }
    Ok(())
}

/// Checks all buffer lengths of an attention call.
pub(crate) fn check_shapes(
    op: &'static str,
    shape: &AttnShape,
    q: &[f32],
    qpos: &[u32],
    kv: &KvRef<'_>,
    out_len: usize,
    lse_len: usize,
) -> Result<()> {
    check_layout(op, shape)?;
    let m = qpos.len();
    let n = kv.pos.len();
    check_len(op, "q", q.len(), m * shape.q_dim())?;
    check_len(op, "k", kv.k.len(), n * shape.kv_dim())?;
    check_len(op, "v", kv.v.len(), n * shape.kv_dim())?;
    check_len(op, "out", out_len, m * shape.q_dim())?;
    check_len(op, "lse", lse_len, m * shape.n_heads)?;
    Ok(())
}

/// `s[rows, nb] = q[rows, d] · Kᵀ`, where key j's head vector is `k[j*kstride..][..d]`.
/// The small GEMM both the attention and the scores kernels are built on.
pub(crate) fn score_tile(q: &[f32], rows: usize, d: usize, k: &[f32], nb: usize, kstride: usize, s: &mut [f32]) {
    assert!(q.len() >= rows * d && s.len() >= rows * nb, "score_tile: q or s too short");
    assert!(nb == 0 || k.len() >= (nb - 1) * kstride + d, "score_tile: k too short");
    if rows == 0 || nb == 0 {
        return;
    }
    // SAFETY: the asserts above bound every access: s is rows x nb (row stride nb), q is
    // rows x d (row stride d), Kᵀ element (e, j) is k[j*kstride + e] with e < d, j < nb.
    // read_dst is false, so s is only written.
    unsafe {
        gemm::gemm(
            rows,
            nb,
            d,
            s.as_mut_ptr(),
            1,
            nb as isize,
            false,
            q.as_ptr(),
            1,
            d as isize,
            k.as_ptr(),
            kstride as isize,
            1,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// `o[rows, d] += p[rows, nb] · V`, where key j's value vector is `v[j*kstride..][..d]`.
pub(crate) fn accumulate_pv(p: &[f32], rows: usize, nb: usize, v: &[f32], kstride: usize, d: usize, o: &mut [f32]) {
    assert!(p.len() >= rows * nb && o.len() >= rows * d, "accumulate_pv: p or o too short");
    assert!(nb == 0 || v.len() >= (nb - 1) * kstride + d, "accumulate_pv: v too short");
    if rows == 0 || nb == 0 {
        return;
    }
    // SAFETY: the asserts above bound every access: p is rows x nb (row stride nb), V element
    // (j, e) is v[j*kstride + e] with j < nb, e < d, o is rows x d (row stride d) and is read
    // then written (read_dst, alpha = 1, beta = 1).
    unsafe {
        gemm::gemm(
            rows,
            d,
            nb,
            o.as_mut_ptr(),
            1,
            d as isize,
            true,
            p.as_ptr(),
            1,
            nb as isize,
            v.as_ptr(),
            1,
            kstride as isize,
            1.0f32,
            1.0f32,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

#[cfg(test)]
mod tests;
