//! Blocked attention with an online softmax (flash-style), threaded over rayon.
//!
//! ```text
//!            key blocks of KEY_BLOCK keys  ->
//!          +--------+--------+--------+--------+
//!  query   | S=QKᵀ  | S=QKᵀ  |  skip  |  skip  |   tile = TQ tokens x (n_heads/n_kv_heads)
//!  tile    | online | masked |(kpos > |        |   heads sharing one KV head, so each K/V
//!  rows    | softmax| by pos | max q) |        |   block is read once for the whole group
//!          +--------+--------+--------+--------+
//! ```
//! Per (tile, KV head): Q rows are packed and pre-scaled by `scale·log2(e)`; for each key block
//! the score tile `S = Q Kᵀ` and the update `O += P V` are small GEMMs (the `gemm` crate's
//! micro-kernels), the softmax runs in base 2 with a vectorized polynomial `exp2`. Only the
//! `rows x KEY_BLOCK` score tile exists at a time: no N x N matrix or mask is ever built.
//! Blocks whose smallest position is beyond the tile's largest query position are skipped;
//! blocks entirely visible skip the mask test.
//!
//! Parallelism: query tiles are independent tasks. When there are too few tiles to keep every
//! thread busy (decoding: one query), the keys are also split into ranges computed as separate
//! partial results and combined with [`merge_partial`] (flash-decoding).

use super::{check_shapes, AttnShape, KvRef};
use crate::error::Result;
use crate::merge::merge_partial;
use crate::simd;
use rayon::prelude::*;

/// Keys per block.
const KEY_BLOCK: usize = 128;
/// Target query rows (token x grouped head) per tile.
const ROW_TARGET: usize = 96;

/// Position range of one key block.
#[derive(Clone, Copy)]
struct Block {
    start: usize,
    end: usize,
    min_pos: u32,
    max_pos: u32,
}

fn key_blocks(kpos: &[u32]) -> Vec<Block> {
    kpos.chunks(KEY_BLOCK)
        .enumerate()
        .map(|(b, ps)| Block {
            start: b * KEY_BLOCK,
            end: b * KEY_BLOCK + ps.len(),
            min_pos: ps.iter().copied().min().unwrap_or(u32::MAX),
            max_pos: ps.iter().copied().max().unwrap_or(0),
        })
        .collect()
}

/// Per-thread buffers of one tile.
#[derive(Default)]
struct Scratch {
    q: Vec<f32>,
    s: Vec<f32>,
    o: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
    rowpos: Vec<u32>,
}

/// Fast attention: see the module docs and [`super`] for layouts and visibility.
pub fn attention(
    shape: &AttnShape,
    q: &[f32],
    qpos: &[u32],
    kv: KvRef<'_>,
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<()> {
    check_shapes("attention", shape, q, qpos, &kv, out.len(), lse.len())?;
    let m = qpos.len();
    if m == 0 {
        return Ok(());
    }
    let blocks = key_blocks(kv.pos);
    let tq = (ROW_TARGET / shape.group()).max(1);
    let n_tiles = m.div_ceil(tq);
    let threads = simd::threads();
    let splits =
        if n_tiles >= 2 * threads || blocks.len() < 2 { 1 } else { (2 * threads).div_ceil(n_tiles).min(blocks.len()) };
    let qd = shape.q_dim();
    let h = shape.n_heads;

    let run_range = |blocks: &[Block], out: &mut [f32], lse: &mut [f32]| {
        q.par_chunks(tq * qd)
            .zip(qpos.par_chunks(tq))
            .zip(out.par_chunks_mut(tq * qd).zip(lse.par_chunks_mut(tq * h)))
            .for_each_init(Scratch::default, |scratch, ((tq_q, tq_pos), (tq_out, tq_lse))| {
                tile(shape, tq_q, tq_pos, &kv, blocks, tq_out, tq_lse, scratch);
            });
    };

    if splits == 1 {
        run_range(&blocks, out, lse);
        return Ok(());
    }
    let per = blocks.len().div_ceil(splits);
    let ranges: Vec<&[Block]> = blocks.chunks(per).collect();
    let mut parts_out = vec![0f32; ranges.len() * out.len()];
    let mut parts_lse = vec![0f32; ranges.len() * lse.len()];
    parts_out
        .par_chunks_mut(out.len())
        .zip(parts_lse.par_chunks_mut(lse.len()))
        .zip(ranges.par_iter())
        .for_each(|((po, pl), r)| run_range(r, po, pl));
    let mut chunks = parts_out.chunks(out.len()).zip(parts_lse.chunks(lse.len()));
    if let Some((o0, l0)) = chunks.next() {
        out.copy_from_slice(o0);
        lse.copy_from_slice(l0);
    }
    for (po, pl) in chunks {
        merge_partial(out, lse, po, pl, shape.head_dim)?;
    }
    Ok(())
}

/// One query tile against the given key blocks, all KV heads.
#[allow(clippy::too_many_arguments)]
fn tile(
    shape: &AttnShape,
    q: &[f32],
    qpos: &[u32],
    kv: &KvRef<'_>,
    blocks: &[Block],
    out: &mut [f32],
    lse: &mut [f32],
    sc: &mut Scratch,
) {
    let (d, g, hq, hkv) = (shape.head_dim, shape.group(), shape.n_heads, shape.n_kv_heads);
    let tokens = qpos.len();
    let rows = tokens * g;
    let qscale = shape.scale * std::f32::consts::LOG2_E;
    let qmin = qpos.iter().copied().min().unwrap_or(0);
    let qmax = qpos.iter().copied().max().unwrap_or(0);
    sc.q.resize(rows * d, 0.0);
    sc.s.resize(rows * KEY_BLOCK, 0.0);
    sc.o.resize(rows * d, 0.0);
    sc.m.resize(rows, 0.0);
    sc.l.resize(rows, 0.0);
    sc.rowpos.clear();
    for &p in qpos {
        for _ in 0..g {
            sc.rowpos.push(p);
        }
    }
    let kstride = hkv * d;
    for kh in 0..hkv {
        // Pack rows (token t, grouped head gi) = q[t, kh*g + gi, :] * qscale.
        for t in 0..tokens {
            for gi in 0..g {
                let src = &q[(t * hq + kh * g + gi) * d..][..d];
                let dst = &mut sc.q[(t * g + gi) * d..][..d];
                for (x, &y) in dst.iter_mut().zip(src) {
                    *x = y * qscale;
                }
            }
        }
        sc.m.fill(f32::NEG_INFINITY);
        sc.l.fill(0.0);
        sc.o.fill(0.0);
        for b in blocks {
            if b.min_pos > qmax {
                continue;
            }
            let nb = b.end - b.start;
            let s = &mut sc.s[..rows * nb];
            let kblk = &kv.k[b.start * kstride + kh * d..];
            super::score_tile(&sc.q, rows, d, kblk, nb, kstride, s);
            if b.max_pos > qmin {
                mask_rows(s, nb, &sc.rowpos, &kv.pos[b.start..b.end]);
            }
            softmax_update(s, nb, &mut sc.m, &mut sc.l, &mut sc.o, d);
            let vblk = &kv.v[b.start * kstride + kh * d..];
            super::accumulate_pv(s, rows, nb, vblk, kstride, d, &mut sc.o);
        }
        for t in 0..tokens {
            for gi in 0..g {
                let r = t * g + gi;
                let hidx = t * hq + kh * g + gi;
                let dst = &mut out[hidx * d..][..d];
                // l is NaN when a visible score was NaN or +inf (exp2 passes NaN on, and
                // +inf - +inf is NaN): out and lse are NaN then, as in the f64 reference,
                // never the "sees no key" of l = 0 that a merge would drop.
                if sc.l[r] > 0.0 || sc.l[r].is_nan() {
                    let inv = 1.0 / sc.l[r];
                    for (x, &y) in dst.iter_mut().zip(&sc.o[r * d..(r + 1) * d]) {
                        *x = y * inv;
                    }
                    lse[hidx] = (sc.m[r] + sc.l[r].log2()) * std::f32::consts::LN_2;
                } else {
                    dst.fill(0.0);
                    lse[hidx] = f32::NEG_INFINITY;
                }
            }
        }
    }
}

/// Sets S[r, j] = -inf where key j is not visible to row r.
fn mask_rows(s: &mut [f32], nb: usize, rowpos: &[u32], kpos: &[u32]) {
    for (row, &p) in s.chunks_exact_mut(nb).zip(rowpos) {
        for (x, &kp) in row.iter_mut().zip(kpos) {
            if kp > p {
                *x = f32::NEG_INFINITY;
            }
        }
    }
}

crate::multiversion! {
    /// Online softmax step in base 2: S becomes P = 2^(S - m_new), O and l are rescaled. A
    /// NaN score, or a +inf one (2^(inf - inf)), makes l NaN for good (see [`simd::exp2`]).
    fn softmax_update(s: &mut [f32], nb: usize, m: &mut [f32], l: &mut [f32], o: &mut [f32], d: usize) {
        for (r, row) in s.chunks_exact_mut(nb).enumerate() {
            let mb = simd::max_of(row);
            let m_new = if mb > m[r] { mb } else { m[r] };
            if m_new == f32::NEG_INFINITY {
                // Nothing visible yet (max_of skips NaN): P = 0 contributes nothing to O, but
                // a NaN score makes the row NaN (rare: only rows that saw no finite score).
                if row.iter().any(|x| x.is_nan()) {
                    l[r] = f32::NAN;
                }
                row.fill(0.0);
                continue;
            }
            let alpha = simd::exp2(m[r] - m_new);
            let mut sum = 0f32;
            let mut acc = [0f32; 16];
            let mut chunks = row.chunks_exact_mut(16);
            for c in &mut chunks {
                for i in 0..16 {
                    let p = simd::exp2(c[i] - m_new);
                    c[i] = p;
                    acc[i] += p;
                }
            }
            for x in chunks.into_remainder() {
                let p = simd::exp2(*x - m_new);
                *x = p;
                sum += p;
            }
            sum += acc.iter().sum::<f32>();
            l[r] = l[r] * alpha + sum;
            if alpha != 1.0 {
                for x in &mut o[r * d..(r + 1) * d] {
                    *x *= alpha;
                }
            }
            m[r] = m_new;
        }
    }
}
