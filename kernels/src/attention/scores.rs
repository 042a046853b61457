//! Attention mass each key receives: `score[j] = Σ_i Σ_h softmax_ih(j)`.
//!
//! Given the queries' log-sum-exp (from [`super::attention`], or merged across ranks), the
//! probability query row (i, h) puts on key j is `exp(q_ih·k_j·scale - lse_ih)`; summing over
//! rows gives the column mass InfoFlow and ProphetKV select by. Because `lse` is an input, a
//! rank holding only part of the keys computes exact global probabilities for its own keys.
//! Rows with `lse = -inf` contribute nothing; invisible pairs (`kpos > qpos`) are skipped.
//!
//! Keys are processed in blocks, one parallel task per block (disjoint outputs); inside a
//! task the score tile is a small GEMM as in the attention kernel.

use super::{AttnShape, KvRef};
use crate::error::{check_len, Result};
use crate::simd;
use rayon::prelude::*;

const KEY_BLOCK: usize = 128;
const ROW_TILE: usize = 96;

fn check(
    op: &'static str,
    shape: &AttnShape,
    q: &[f32],
    qpos: &[u32],
    kv: &KvRef<'_>,
    lse: &[f32],
    scores: &[f32],
) -> Result<()> {
    let (k, kpos) = (kv.k, kv.pos);
    super::check_layout(op, shape)?;
    check_len(op, "q", q.len(), qpos.len() * shape.q_dim())?;
    check_len(op, "k", k.len(), kpos.len() * shape.kv_dim())?;
    check_len(op, "lse", lse.len(), qpos.len() * shape.n_heads)?;
    check_len(op, "scores", scores.len(), kpos.len())?;
    Ok(())
}

/// Adds to `scores[j]` (one per key) the attention mass key j receives from every query row.
/// `kv.v` is not read.
pub fn attention_scores(
    shape: &AttnShape,
    q: &[f32],
    qpos: &[u32],
    kv: KvRef<'_>,
    lse: &[f32],
    scores: &mut [f32],
) -> Result<()> {
    check("attention_scores", shape, q, qpos, &kv, lse, scores)?;
    let (d, g, hq, hkv) = (shape.head_dim, shape.group(), shape.n_heads, shape.n_kv_heads);
    let m = qpos.len();
    if m == 0 || kv.pos.is_empty() {
        return Ok(());
    }
    let rows = m * g;
    let qscale = shape.scale * std::f32::consts::LOG2_E;
    // Packed queries per KV head: rows (token, grouped head), pre-scaled; lse in base 2.
    let mut qp = vec![0f32; hkv * rows * d];
    let mut lse2 = vec![0f32; hkv * rows];
    let mut rowpos = vec![0u32; rows];
    for t in 0..m {
        for gi in 0..g {
            rowpos[t * g + gi] = qpos[t];
        }
    }
    for kh in 0..hkv {
        for t in 0..m {
            for gi in 0..g {
                let h = kh * g + gi;
                let r = t * g + gi;
                let src = &q[(t * hq + h) * d..][..d];
                for (x, &y) in qp[(kh * rows + r) * d..][..d].iter_mut().zip(src) {
                    *x = y * qscale;
                }
                lse2[kh * rows + r] = lse[t * hq + h] * std::f32::consts::LOG2_E;
            }
        }
    }
    let kstride = hkv * d;
    scores.par_chunks_mut(KEY_BLOCK).enumerate().for_each_init(Vec::new, |s, (b, out)| {
        let start = b * KEY_BLOCK;
        let nb = out.len();
        let kpos = &kv.pos[start..start + nb];
        let kmin = kpos.iter().copied().min().unwrap_or(u32::MAX);
        s.resize(ROW_TILE * nb, 0.0);
        for kh in 0..hkv {
            for r0 in (0..rows).step_by(ROW_TILE) {
                let rn = ROW_TILE.min(rows - r0);
                if rowpos[r0..r0 + rn].iter().all(|&p| p < kmin) {
                    continue;
                }
                let st = &mut s[..rn * nb];
                let qblk = &qp[(kh * rows + r0) * d..][..rn * d];
                let kblk = &kv.k[start * kstride + kh * d..];
                super::score_tile(qblk, rn, d, kblk, nb, kstride, st);
                accumulate(st, nb, &rowpos[r0..r0 + rn], kpos, &lse2[kh * rows + r0..][..rn], out);
            }
        }
    });
    Ok(())
}

crate::multiversion! {
    fn accumulate(s: &[f32], nb: usize, rowpos: &[u32], kpos: &[u32], lse2: &[f32], out: &mut [f32]) {
        for ((row, &p), &l) in s.chunks_exact(nb).zip(rowpos).zip(lse2) {
            if l == f32::NEG_INFINITY {
                continue;
            }
            for ((o, &x), &kp) in out.iter_mut().zip(row).zip(kpos) {
                let w = simd::exp2(x - l);
                *o += if kp <= p { w } else { 0.0 };
            }
        }
    }
}

/// Slow reference of [`attention_scores`] in f64.
pub fn attention_scores_ref(
    shape: &AttnShape,
    q: &[f32],
    qpos: &[u32],
    kv: KvRef<'_>,
    lse: &[f32],
    scores: &mut [f32],
) -> Result<()> {
    check("attention_scores_ref", shape, q, qpos, &kv, lse, scores)?;
    let (d, g, hq, hkv) = (shape.head_dim, shape.group(), shape.n_heads, shape.n_kv_heads);
    for (i, &p) in qpos.iter().enumerate() {
        for h in 0..hq {
            let l = lse[i * hq + h] as f64;
            if l == f64::NEG_INFINITY {
                continue;
            }
            let qv = &q[(i * hq + h) * d..][..d];
            for (j, &kp) in kv.pos.iter().enumerate() {
                if kp > p {
                    continue;
                }
                let kj = &kv.k[(j * hkv + h / g) * d..][..d];
                let s = qv.iter().zip(kj).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() * shape.scale as f64;
                scores[j] += (s - l).exp() as f32;
            }
        }
    }
    Ok(())
}
