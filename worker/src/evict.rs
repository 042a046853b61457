//! KV eviction before decoding: how much each cached context row matters to each (layer, KV
//! head), and a cache that keeps only the best rows of every head.
//!
//! SnapKV (the baseline of paper 004) scores a row by the attention the prompt's last
//! [`SNAPKV_WINDOW`] query rows pay it, summed over the query heads of the row's KV group (GQA)
//! and smoothed over [`SNAPKV_POOL`] neighbouring rows, and keeps the top N rows of every
//! (layer, KV head) independently: head 0 of a layer may keep token 17 while head 1 drops it.
//!
//! A packed cache stores that without a per-head layout: its rows are *slots*, and head `h` of
//! slot `i` holds head `h`'s `i`-th kept token, already rotated to its own position.
//!
//! ```text
//!   kept (one layer)   head 0: tokens 3, 9, 40       packed rows   [k3_h0 | k5_h1]
//!                      head 1: tokens 5, 9, 41   ->                [k9_h0 | k9_h1]
//!                                                                  [k40_h0| k41_h1]
//! ```
//! Attention over cached rows is a sum over keys, so the order of a head's keys does not
//! matter, and every kept token lies before the tokens decoded after it, so no mask separates
//! the slots: a slot's position is only a bound (the latest of its tokens). Decoding over a
//! packed cache is therefore exactly decoding over the kept tokens of each head. Every layer
//! and head keeps the same number of slots, so a packed cache is an ordinary [`KvCache`].

use crate::error::{internal, Result};
use crate::kv::{KeyForm, KvCache, LayerKv};
use flowprefill_kernels::attention::{attention_scores_ref, AttnShape, KvRef};
use flowprefill_kernels::rope::RopeTable;
use flowprefill_kernels::Backend;

/// SnapKV's observation window: the prompt's last 32 query rows (paper 004, §5).
pub const SNAPKV_WINDOW: usize = 32;
/// SnapKV's pooling kernel over neighbouring rows.
pub const SNAPKV_POOL: usize = 7;

/// Attention mass per KV head from the last `window` query rows: one buffer of `kpos.len()`
/// scores per KV head, `out[kh][j] = Σ_{i in window} Σ_{h in group(kh)} softmax_ih(j)` under
/// the given (merged) `lse`, so that a rank holding part of the keys scores its own keys
/// exactly. `q` is `[m, q_dim]` (f32), `k` `[n, kv_dim]` rotated (any KV element type), `lse`
/// `[m, n_heads]`. All on the device: column and row copies and the backend's score kernel.
#[allow(clippy::too_many_arguments)]
pub fn kv_head_scores<B: Backend>(
    be: &B,
    shape: &AttnShape,
    q: &B::Buf,
    qpos: &[u32],
    k: &B::Buf,
    kpos: &[u32],
    lse: &B::Buf,
    window: usize,
) -> Result<Vec<B::Buf>> {
    let (hq, hkv, d) = (shape.n_heads, shape.n_kv_heads, shape.head_dim);
    let (qd, kvd, g) = (shape.q_dim(), shape.kv_dim(), shape.group());
    let (m, n) = (qpos.len(), kpos.len());
    let w = window.min(m);
    let mut out = Vec::with_capacity(hkv);
    if w == 0 || n == 0 {
        for _ in 0..hkv {
            out.push(be.zeros(n)?);
        }
        return Ok(out);
    }
    let src: Vec<usize> = (m - w..m).collect();
    let dst: Vec<usize> = (0..w).collect();
    let mut qw = be.zeros_as(w * qd, be.dtype(q))?;
    be.copy_rows(q, &src, &mut qw, &dst, qd)?;
    let mut lw = be.zeros_as(w * hq, be.dtype(lse))?;
    be.copy_rows(lse, &src, &mut lw, &dst, hq)?;
    let qpos_w = &qpos[m - w..];
    let one = AttnShape { n_heads: g, n_kv_heads: 1, head_dim: d, scale: shape.scale };
    for kh in 0..hkv {
        let mut qh = be.zeros_as(w * g * d, be.dtype(q))?;
        be.copy_columns(&qw, qd, kh * g * d, g * d, &mut qh)?;
        let mut lh = be.zeros_as(w * g, be.dtype(lse))?;
        be.copy_columns(&lw, hq, kh * g, g, &mut lh)?;
        let mut kk = be.zeros_as(n * d, be.dtype(k))?;
        be.copy_columns(k, kvd, kh * d, d, &mut kk)?;
        let mut sc = be.zeros(n)?;
        be.attention_scores(&one, &qh, qpos_w, &kk, kpos, &lh, &mut sc)?;
        out.push(sc);
    }
    Ok(out)
}

/// Slow reference of [`kv_head_scores`] on host slices: the all-heads reference score kernel
/// with every query row outside the window, and every head outside the group, silenced by an
/// `lse` of -inf (rows with `lse = -inf` contribute nothing).
#[allow(clippy::too_many_arguments)]
pub fn kv_head_scores_ref(
    shape: &AttnShape,
    q: &[f32],
    qpos: &[u32],
    k: &[f32],
    kpos: &[u32],
    lse: &[f32],
    window: usize,
) -> Result<Vec<Vec<f32>>> {
    let (hq, g) = (shape.n_heads, shape.group());
    let m = qpos.len();
    let first = m - window.min(m);
    let v = vec![0.0; k.len()];
    let mut out = Vec::with_capacity(shape.n_kv_heads);
    for kh in 0..shape.n_kv_heads {
        let mut masked = lse.to_vec();
        for (i, row) in masked.chunks_exact_mut(hq).enumerate() {
            for (h, x) in row.iter_mut().enumerate() {
                if i < first || h / g != kh {
                    *x = f32::NEG_INFINITY;
                }
            }
        }
        let mut sc = vec![0.0; kpos.len()];
        attention_scores_ref(shape, q, qpos, KvRef { k, v: &v, pos: kpos }, &masked, &mut sc)?;
        out.push(sc);
    }
    Ok(out)
}

/// Rows of the `n` highest scores, in row order (ties: the earlier row).
pub fn top_rows(scores: &[f32], n: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    idx.truncate(n);
    idx.sort_unstable();
    idx
}

/// A cache rows are kept from, attended at `positions` (a pre-RoPE cache is rotated to them).
pub struct PackSource<'a, B: Backend> {
    /// The cache.
    pub cache: &'a KvCache<B>,
    /// Where its rows are attended.
    pub positions: &'a [u32],
}

/// The packed cache (see the module docs) of `keep[layer][kv_head]`: `(source, row)` pairs,
/// the same number for every layer and head. Keys come out rotated.
pub fn pack<B: Backend>(
    be: &B,
    rope: &RopeTable,
    sources: &[PackSource<'_, B>],
    keep: &[Vec<Vec<(usize, usize)>>],
    n_kv_heads: usize,
) -> Result<KvCache<B>> {
    let Some(first) = sources.first() else {
        return Err(internal("packing a cache from no sources"));
    };
    let (n_layers, kvd, dtype) = (first.cache.n_layers(), first.cache.kv_dim(), first.cache.dtype());
    if keep.len() != n_layers || n_kv_heads == 0 || kvd % n_kv_heads != 0 {
        return Err(internal(format!(
            "packing {} layers of {n_kv_heads} heads into a cache of {n_layers} layers, {kvd} values a row",
            keep.len()
        )));
    }
    let d = kvd / n_kv_heads;
    let slots = keep.first().and_then(|l| l.first()).map_or(0, Vec::len);
    for (i, s) in sources.iter().enumerate() {
        if s.cache.n_layers() != n_layers || s.cache.kv_dim() != kvd || s.cache.dtype() != dtype {
            return Err(internal(format!("pack source {i} has another shape or element type")));
        }
        if s.positions.len() != s.cache.len() {
            return Err(internal(format!(
                "pack source {i}: {} positions for {} rows",
                s.positions.len(),
                s.cache.len()
            )));
        }
    }
    let mut positions = vec![0u32; slots];
    let mut layers = Vec::with_capacity(n_layers);
    for (l, heads) in keep.iter().enumerate() {
        if heads.len() != n_kv_heads || heads.iter().any(|h| h.len() != slots) {
            return Err(internal(format!("layer {l}: every KV head must keep {slots} rows")));
        }
        let mut k = be.zeros_as(slots * kvd, dtype)?;
        let mut v = be.zeros_as(slots * kvd, dtype)?;
        for (si, s) in sources.iter().enumerate() {
            // Rows of `d` values: row (token * heads + head) is one head of one token.
            let (mut src, mut dst) = (Vec::new(), Vec::new());
            for (h, rows) in heads.iter().enumerate() {
                for (slot, &(from, row)) in rows.iter().enumerate() {
                    if from != si {
                        continue;
                    }
                    let Some(&p) = s.positions.get(row) else {
                        return Err(internal(format!("layer {l} head {h}: row {row} outside source {si}")));
                    };
                    positions[slot] = positions[slot].max(p);
                    src.push(row * n_kv_heads + h);
                    dst.push(slot * n_kv_heads + h);
                }
            }
            if src.is_empty() {
                continue;
            }
            let layer = s.cache.layer(l);
            let rotated = match s.cache.form() {
                KeyForm::PreRope => Some(be.rope_copy(&layer.k, n_kv_heads, s.positions, rope)?),
                KeyForm::Rotated if s.positions != s.cache.positions() => {
                    return Err(internal("a rotated cache can only be packed at its own positions"));
                }
                KeyForm::Rotated => None,
            };
            be.copy_rows(rotated.as_ref().unwrap_or(&layer.k), &src, &mut k, &dst, d)?;
            be.copy_rows(&layer.v, &src, &mut v, &dst, d)?;
        }
        layers.push(LayerKv { k, v });
    }
    KvCache::from_parts(be, layers, positions, KeyForm::Rotated, kvd)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flowprefill_kernels::attention::attention;
    use flowprefill_kernels::rope::RopeStyle;
    use flowprefill_kernels::{Cpu, DType};
    use rand::{Rng, SeedableRng};

    /// Named tolerance: the blocked f32 score kernel against the f64 reference, per score.
    const SCORE_TOL: f32 = 2e-5;

    fn random(rng: &mut rand::rngs::StdRng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    #[test]
    fn per_head_scores_match_the_reference_and_sum_to_the_all_heads_scores() {
        let be = Cpu;
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for (hq, hkv, d, m, n, window) in [(6, 2, 16, 5, 40, 3), (4, 4, 8, 9, 33, 32), (8, 2, 16, 1, 7, 32)] {
            let shape = AttnShape::new(hq, hkv, d).unwrap();
            let q = random(&mut rng, m * hq * d);
            let k = random(&mut rng, n * hkv * d);
            let v = random(&mut rng, n * hkv * d);
            let kpos: Vec<u32> = (0..n as u32).collect();
            let qpos: Vec<u32> = (n as u32..(n + m) as u32).collect();
            let (mut o, mut lse) = (vec![0.0; m * hq * d], vec![0.0; m * hq]);
            attention(&shape, &q, &qpos, KvRef { k: &k, v: &v, pos: &kpos }, &mut o, &mut lse).unwrap();
            let fast = kv_head_scores(
                &be,
                &shape,
                &q.clone().into(),
                &qpos,
                &k.clone().into(),
                &kpos,
                &lse.clone().into(),
                window,
            )
            .unwrap();
            let slow = kv_head_scores_ref(&shape, &q, &qpos, &k, &kpos, &lse, window).unwrap();
            assert_eq!(fast.len(), hkv);
            let mut total = vec![0.0f32; n];
            for (f, s) in fast.iter().zip(&slow) {
                let f = be.download(f).unwrap();
                for (j, (a, b)) in f.iter().zip(s).enumerate() {
                    assert!((a - b).abs() <= SCORE_TOL, "head scores differ at key {j}: {a} vs {b}");
                    total[j] += a;
                }
            }
            // Every query row in the window puts mass 1 on the keys (no key is hidden here).
            let w = window.min(m);
            let sum: f32 = total.iter().sum();
            // f32 sums of up to a few hundred probabilities per row: 1e-3 of mass in all.
            const MASS_TOL: f32 = 1e-3;
            assert!((sum - (w * hq) as f32).abs() < MASS_TOL, "mass {sum} for {w} rows x {hq} heads");
        }
    }

    #[test]
    fn attention_over_a_packed_cache_is_each_heads_attention_over_its_kept_tokens() {
        let (hq, hkv, d, n, m, slots) = (6, 3, 8, 20, 2, 7);
        let (qd, kvd, g) = (hq * d, hkv * d, hq / hkv);
        let shape = AttnShape::new(hq, hkv, d).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let be = Cpu;
        let rope = RopeTable::new(d, d, 10000.0, RopeStyle::Neox, None, 64).unwrap();
        let (k, v, q) = (random(&mut rng, n * kvd), random(&mut rng, n * kvd), random(&mut rng, m * qd));
        let pos: Vec<u32> = (0..n as u32).collect();
        let cache = KvCache::from_parts(
            &be,
            vec![LayerKv { k: k.clone().into(), v: v.clone().into() }],
            pos.clone(),
            KeyForm::Rotated,
            kvd,
        )
        .unwrap();
        // Each head keeps its own rows.
        let rows: Vec<Vec<usize>> = (0..hkv)
            .map(|h| {
                (0..slots)
                    .map(|i| (i * (h + 2) + h) % n)
                    .collect::<std::collections::BTreeSet<_>>()
                    .into_iter()
                    .collect()
            })
            .collect();
        let slots = rows.iter().map(Vec::len).min().unwrap();
        let keep: Vec<Vec<Vec<(usize, usize)>>> =
            vec![rows.iter().map(|r| r[..slots].iter().map(|&x| (0, x)).collect()).collect()];
        let packed = pack(&be, &rope, &[PackSource { cache: &cache, positions: &pos }], &keep, hkv).unwrap();
        let qpos = vec![n as u32 + 5; m];
        let pk = be.download(&packed.layer(0).k).unwrap();
        let pv = be.download(&packed.layer(0).v).unwrap();
        let (mut out, mut lse) = (vec![0.0; m * qd], vec![0.0; m * hq]);
        attention(&shape, &q, &qpos, KvRef { k: &pk, v: &pv, pos: packed.positions() }, &mut out, &mut lse).unwrap();
        // Reference: per KV head, its group's queries over that head's kept tokens alone.
        let one = AttnShape::new(g, 1, d).unwrap();
        for (h, kept) in keep[0].iter().enumerate() {
            let cols = |src: &[f32], width: usize, col: usize, w: usize, rows: &[usize]| -> Vec<f32> {
                rows.iter().flat_map(|&r| src[r * width + col..][..w].to_vec()).collect()
            };
            let kr: Vec<usize> = kept.iter().map(|&(_, r)| r).collect();
            let kh = cols(&k, kvd, h * d, d, &kr);
            let vh = cols(&v, kvd, h * d, d, &kr);
            let qh = cols(&q, qd, h * g * d, g * d, &(0..m).collect::<Vec<_>>());
            let kp: Vec<u32> = kr.iter().map(|&r| pos[r]).collect();
            let (mut o, mut l) = (vec![0.0; m * g * d], vec![0.0; m * g]);
            attention(&one, &qh, &qpos, KvRef { k: &kh, v: &vh, pos: &kp }, &mut o, &mut l).unwrap();
            let got = cols(&out, qd, h * g * d, g * d, &(0..m).collect::<Vec<_>>());
            // The same f32 kernel over the same keys, read in place or from a per-head copy.
            const PACKED_TOL: f32 = 1e-5;
            for (a, b) in got.iter().zip(&o) {
                assert!((a - b).abs() < PACKED_TOL, "head {h}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn top_rows_keeps_the_best_in_row_order() {
        assert_eq!(top_rows(&[0.1, 0.9, 0.5, 0.9, 0.2], 3), [1, 2, 3]);
        assert_eq!(top_rows(&[0.3, 0.3, 0.3], 2), [0, 1], "ties keep the earlier row");
        assert_eq!(top_rows(&[1.0, 2.0], 5), [0, 1]);
        assert!(top_rows(&[1.0], 0).is_empty());
    }

    #[test]
    fn a_packed_cache_holds_each_heads_rows_rotated() {
        let (layers, hkv, d, n) = (2, 3, 4, 6);
        let kvd = hkv * d;
        for dtype in [DType::F32, DType::Bf16] {
            let be = Cpu::with_kv_dtype(dtype);
            let rope = RopeTable::new(d, d, 10000.0, RopeStyle::Neox, None, 64).unwrap();
            // Two pre-RoPE sources placed at positions 0..6 and 6..12.
            let mut caches = Vec::new();
            for s in 0..2 {
                let mut ls = Vec::new();
                for l in 0..layers {
                    let val = |c: usize| {
                        (0..n * kvd).map(|i| (s * 1000 + l * 100 + i + c) as f32 / 7.0).collect::<Vec<f32>>()
                    };
                    let mut k = be.zeros_as(n * kvd, dtype).unwrap();
                    be.copy_columns(&val(0).into(), kvd, 0, kvd, &mut k).unwrap();
                    let mut v = be.zeros_as(n * kvd, dtype).unwrap();
                    be.copy_columns(&val(1).into(), kvd, 0, kvd, &mut v).unwrap();
                    ls.push(LayerKv { k, v });
                }
                caches.push(KvCache::from_parts(&be, ls, (0..n as u32).collect(), KeyForm::PreRope, kvd).unwrap());
            }
            let pos: Vec<Vec<u32>> = vec![(0..6).collect(), (6..12).collect()];
            let sources: Vec<PackSource<'_, Cpu>> =
                caches.iter().zip(&pos).map(|(cache, p)| PackSource { cache, positions: p }).collect();
            // Layer l, head h keeps three (source, row) pairs of its own.
            let keep: Vec<Vec<Vec<(usize, usize)>>> = (0..layers)
                .map(|l| (0..hkv).map(|h| vec![(0, (l + h) % n), (1, h), (1, (h + 3 + l) % n)]).collect())
                .collect();
            let packed = pack(&be, &rope, &sources, &keep, hkv).unwrap();
            assert_eq!((packed.len(), packed.form(), packed.dtype()), (3, KeyForm::Rotated, dtype));
            for (l, heads) in keep.iter().enumerate() {
                let pk = be.download(&packed.layer(l).k).unwrap();
                let pv = be.download(&packed.layer(l).v).unwrap();
                for (h, rows) in heads.iter().enumerate() {
                    for (slot, &(s, row)) in rows.iter().enumerate() {
                        let layer = caches[s].layer(l);
                        let rk = be.rope_copy(&layer.k, hkv, &pos[s], &rope).unwrap();
                        let want_k = &be.download(&rk).unwrap()[(row * hkv + h) * d..][..d];
                        let want_v = &be.download(&layer.v).unwrap()[(row * hkv + h) * d..][..d];
                        assert_eq!(&pk[(slot * hkv + h) * d..][..d], want_k, "layer {l} head {h} slot {slot}");
                        assert_eq!(&pv[(slot * hkv + h) * d..][..d], want_v, "layer {l} head {h} slot {slot}");
                    }
                }
            }
            // A slot's position bounds its tokens: the latest of them.
            let want: Vec<u32> = (0..3)
                .map(|slot| keep.iter().flatten().map(|rows| pos[rows[slot].0][rows[slot].1]).max().unwrap())
                .collect();
            assert_eq!(packed.positions(), want.as_slice());
        }
    }
}
