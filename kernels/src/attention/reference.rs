//! Slow reference attention: one query, one head at a time, f64 throughout.

use super::{check_shapes, AttnShape, KvRef};
use crate::error::Result;

/// Reference of [`super::attention`] with the same layouts and visibility rule.
pub fn attention_ref(
    shape: &AttnShape,
    q: &[f32],
    qpos: &[u32],
    kv: KvRef<'_>,
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<()> {
    check_shapes("attention_ref", shape, q, qpos, &kv, out.len(), lse.len())?;
    let (d, g, hq, hkv) = (shape.head_dim, shape.group(), shape.n_heads, shape.n_kv_heads);
    let n = kv.pos.len();
    for (i, &p) in qpos.iter().enumerate() {
        for h in 0..hq {
            let kh = h / g;
            let qv = &q[(i * hq + h) * d..][..d];
            let scores: Vec<Option<f64>> = (0..n)
                .map(|j| {
                    (kv.pos[j] <= p).then(|| {
                        let kj = &kv.k[(j * hkv + kh) * d..][..d];
                        qv.iter().zip(kj).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() * shape.scale as f64
                    })
                })
                .collect();
            // The largest visible score; NaN if one is NaN (f64::max would skip it, and a row
            // of NaN scores would read as one that sees no key).
            let mx = scores.iter().flatten().copied().fold(f64::NEG_INFINITY, |a, s| {
                if a.is_nan() || s.is_nan() {
                    f64::NAN
                } else {
                    a.max(s)
                }
            });
            let o = &mut out[(i * hq + h) * d..][..d];
            if mx == f64::NEG_INFINITY {
                o.fill(0.0);
                lse[i * hq + h] = f32::NEG_INFINITY;
                continue;
            }
            let mut acc = vec![0f64; d];
            let mut sum = 0f64;
            for (j, s) in scores.iter().enumerate() {
                if let Some(s) = s {
                    let w = (s - mx).exp();
                    sum += w;
                    let vj = &kv.v[(j * hkv + kh) * d..][..d];
                    for (a, &b) in acc.iter_mut().zip(vj) {
                        *a += w * b as f64;
                    }
                }
            }
            for (x, a) in o.iter_mut().zip(&acc) {
                *x = (a / sum) as f32;
            }
            lse[i * hq + h] = (mx + sum.ln()) as f32;
        }
    }
    Ok(())
}
