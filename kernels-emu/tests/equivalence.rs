//! Every CUDA kernel, run on the CPU through the launch shim, against the Rust references of
//! the kernels crate, on seeded random inputs with odd shapes: grouped-query ratios 1, 3 and 7,
//! lengths that are not multiples of any tile (warp of 32 keys, 4 query rows per block, 256
//! threads per row), queries that see no key, positions with gaps and repeats. The tensor-core
//! kernels (flash.cu) have their own file, `tensor_cores.rs`.

use flowprefill_kernels::attention::{attention_ref, attention_scores_ref, KvRef};
use flowprefill_kernels::elementwise::{add_assign as cpu_add_assign, add_bias as cpu_add_bias, silu_mul_ref};
use flowprefill_kernels::matmul::Matrix;
use flowprefill_kernels::merge::merge_partial as cpu_merge;
use flowprefill_kernels::norm::rms_norm_ref;
use flowprefill_kernels::rope::{rope_ref, RopeStyle, RopeTable};
use flowprefill_kernels_emu as emu;

mod common;
use common::{assert_close, bf16_ref, case, max_err, rand_vec, rng};
use rand::Rng;

/// Attention outputs (values of order 1) against the f64 reference: f32 accumulation in a
/// different order (a key per lane, online rescaling per tile of 32).
const ATTN_OUT_TOL: f32 = 5e-5;
/// Log-sum-exp, relative to max(1, |lse|).
const ATTN_LSE_TOL: f32 = 5e-5;
/// Per-key attention mass, per contributing (row, head).
const SCORES_TOL_PER_ROW: f32 = 2e-6;
/// RMSNorm against the f64 reference, relative to max(1, |y|) (rsqrtf is within 2 ulp).
const NORM_TOL: f32 = 2e-6;
/// RoPE against the reference: the same table and formula, products in another order.
const ROPE_TOL: f32 = 2e-6;
/// SiLU-gate: expf of the device against the reference's.
const SILU_TOL: f32 = 2e-6;
/// merge_partial: the same stable formula in f32; expf/log1pf may differ in the last bits.
const MERGE_TOL: f32 = 2e-6;
/// Exact: copies, gathers, bias and residual adds, bf16 conversion.
const EXACT: f32 = 0.0;

#[test]
fn elementwise_kernels_match_exactly() {
    let mut r = rng(1);
    let (rows, cols) = (37, 45);
    let table = rand_vec(&mut r, 101 * cols, 3.0);
    let ids: Vec<u32> = (0..rows).map(|_| r.random_range(0..101)).collect();
    let mut got = vec![0f32; rows * cols];
    emu::embedding(&table, cols, &ids, &mut got);
    let mut want = vec![0f32; rows * cols];
    flowprefill_kernels::elementwise::embedding(&Matrix::new(101, cols, table.clone()).unwrap(), &ids, &mut want)
        .unwrap();
    assert_close("embedding_f32", &got, &want, EXACT);

    let x = rand_vec(&mut r, rows * cols, 5.0);
    let bias = rand_vec(&mut r, cols, 1.0);
    let (mut a, mut b) = (x.clone(), x.clone());
    emu::add_bias(&mut a, &bias);
    cpu_add_bias(&mut b, &bias).unwrap();
    assert_close("add_bias", &a, &b, EXACT);

    let y = rand_vec(&mut r, rows * cols, 5.0);
    let (mut a, mut b) = (x.clone(), x.clone());
    emu::add_assign(&mut a, &y);
    cpu_add_assign(&mut b, &y).unwrap();
    assert_close("add_assign", &a, &b, EXACT);

    let (src_cols, col, width) = (45, 7, 19);
    let mut got = vec![0f32; rows * width];
    emu::copy_columns(&x, src_cols, col, width, &mut got);
    let mut want = vec![0f32; rows * width];
    flowprefill_kernels::elementwise::copy_columns(&x, src_cols, col, width, &mut want).unwrap();
    assert_close("copy_columns", &got, &want, EXACT);

    // Gather some rows of x into scattered rows of a destination.
    let src_rows: Vec<u32> = vec![3, 0, 36, 17, 17];
    let dst_rows: Vec<u32> = vec![9, 2, 0, 5, 11];
    let mut got = vec![-1f32; 12 * cols];
    emu::copy_rows(&x, &src_rows, &mut got, &dst_rows, cols);
    let mut want = vec![-1f32; 12 * cols];
    for (&s, &d) in src_rows.iter().zip(&dst_rows) {
        want[d as usize * cols..][..cols].copy_from_slice(&x[s as usize * cols..][..cols]);
    }
    assert_close("copy_rows", &got, &want, EXACT);

    let mut f = vec![0f32; 1000];
    emu::fill(&mut f, f32::NEG_INFINITY);
    assert!(f.iter().all(|&v| v == f32::NEG_INFINITY));
}

#[test]
fn bf16_conversions_round_to_nearest_even() {
    let mut r = rng(2);
    let mut x = rand_vec(&mut r, 4097, 1e4);
    x.extend([0.0, -0.0, 1.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0]);
    let bits = emu::f32_to_bf16(&x);
    for (&v, &b) in x.iter().zip(&bits) {
        assert_eq!(b, bf16_ref(v), "{v}");
    }
    let back = emu::bf16_to_f32(&bits);
    for (&v, &b) in x.iter().zip(&back) {
        if v.is_finite() {
            // bf16 keeps 8 significant bits: rounding moves a value by at most half a step,
            // 2^-8 of it.
            assert!((b - v).abs() <= v.abs() * (1.0 / 256.0), "{v} -> {b}");
        }
    }
    // A bf16 embedding table gathers the same values as its f32 expansion.
    let cols = 33;
    let table: Vec<u16> = emu::f32_to_bf16(&rand_vec(&mut r, 50 * cols, 2.0));
    let ids = [4u32, 49, 0, 4];
    let mut got = vec![0f32; ids.len() * cols];
    emu::embedding(&table, cols, &ids, &mut got);
    let wide = emu::bf16_to_f32(&table);
    for (i, &id) in ids.iter().enumerate() {
        assert_close("embedding_bf16", &got[i * cols..][..cols], &wide[id as usize * cols..][..cols], EXACT);
    }
}

#[test]
fn silu_mul_matches_the_reference() {
    let mut r = rng(3);
    for (rows, ffn) in [(1, 1), (7, 33), (65, 300)] {
        let gu = rand_vec(&mut r, rows * 2 * ffn, 8.0);
        let mut got = vec![0f32; rows * ffn];
        emu::silu_mul(&gu, ffn, &mut got);
        let mut want = vec![0f32; rows * ffn];
        silu_mul_ref(&gu, ffn, &mut want).unwrap();
        assert_close("silu_mul", &got, &want, SILU_TOL);
    }
}

#[test]
fn rms_norm_matches_the_reference() {
    let mut r = rng(4);
    // Columns below, at and above the block of 256 threads, and not a multiple of a warp.
    for (rows, cols) in [(1, 1), (3, 200), (5, 256), (9, 577), (2, 1537)] {
        let x = rand_vec(&mut r, rows * cols, 3.0);
        let w = rand_vec(&mut r, cols, 1.5);
        let mut got = vec![0f32; rows * cols];
        emu::rms_norm(&x, &w, 1e-5, &mut got);
        let mut want = vec![0f32; rows * cols];
        rms_norm_ref(&x, &w, 1e-5, &mut want).unwrap();
        assert_close(&format!("rms_norm {rows}x{cols}"), &got, &want, NORM_TOL);
    }
}

/// Rows whose sum of squares overflows f32 (one |x| ~ 1e20: x² = 1e40; a row of ±1e19s: 1e38
/// each, past f32::MAX after four; a ramp of 1e18s; values up to f32::MAX), between normal rows:
/// the kernel sums them again scaled by 2^-80 and matches the f64 reference (finite), and the
/// normal rows keep the one-pass values. Widths below and above the block of 256 threads.
#[test]
fn rms_norm_of_rows_whose_squares_overflow_f32_matches_the_reference() {
    let mut r = rng(14);
    for cols in [64usize, 577] {
        let mut x = rand_vec(&mut r, cols, 3.0);
        x.extend((0..cols).map(|i| if i == 5 { 1e20 } else { 0.5 }));
        x.extend(rand_vec(&mut r, cols, 3.0));
        x.extend((0..cols).map(|i| if i % 2 == 0 { 1e19 } else { -1e19 }));
        x.extend((0..cols).map(|i| (i as f32 - 30.0) * 1e18));
        x.extend((0..cols).map(|i| f32::MAX / (i as f32 + 1.0)));
        x.extend(rand_vec(&mut r, cols, 3.0));
        let w = rand_vec(&mut r, cols, 1.5);
        let mut got = vec![0f32; x.len()];
        emu::rms_norm(&x, &w, 1e-5, &mut got);
        let mut want = vec![0f32; x.len()];
        rms_norm_ref(&x, &w, 1e-5, &mut want).unwrap();
        assert!(want.iter().all(|v| v.is_finite()), "the reference is finite");
        eprintln!(
            "rms_norm overflowing rows, {cols} columns: max error {:e} (NORM_TOL {NORM_TOL:e})",
            max_err(&got, &want)
        );
        assert_close(&format!("rms_norm overflowing rows, {cols} columns"), &got, &want, NORM_TOL);
        // The lone 1e20 is its row's whole mean square: it normalizes to about sqrt(cols) * w.
        let y = got[cols + 5] / w[5];
        assert!((y - (cols as f32).sqrt()).abs() < 1e-3 * (cols as f32).sqrt(), "{y}");
    }
}

#[test]
fn rope_matches_the_reference_inside_and_beyond_the_table() {
    let mut r = rng(5);
    for (style, head_dim, rot_dim) in
        [(RopeStyle::Interleaved, 64, 64), (RopeStyle::Neox, 64, 64), (RopeStyle::Neox, 80, 32)]
    {
        let table = RopeTable::new(head_dim, rot_dim, 10000.0, style, None, 100).unwrap();
        let n_heads = 3;
        // Positions inside the table, at its end and past it (computed on the spot).
        let positions: Vec<u32> = vec![0, 1, 99, 100, 101, 4000, 17, 17];
        let x = rand_vec(&mut r, positions.len() * n_heads * head_dim, 2.0);
        let (mut got, mut want) = (x.clone(), x.clone());
        emu::rope(&mut got, n_heads, &positions, &table);
        rope_ref(&mut want, n_heads, &positions, &table).unwrap();
        assert_close(&format!("rope {style:?} {head_dim}/{rot_dim}"), &got, &want, ROPE_TOL);
    }
}

/// Placing a pre-RoPE cache in one pass (`fp_rope_copy`) writes exactly what a copy followed
/// by the in-place rotation writes (the same arithmetic: bit for bit), every dimension past
/// `rot_dim` included, and leaves the source as it was.
#[test]
fn rope_copy_is_a_copy_then_the_rotation_bit_for_bit() {
    let mut r = rng(15);
    for (style, head_dim, rot_dim) in [
        (RopeStyle::Interleaved, 64, 64),
        (RopeStyle::Neox, 64, 64),
        (RopeStyle::Neox, 80, 32),
        (RopeStyle::Interleaved, 48, 16),
    ] {
        let table = RopeTable::new(head_dim, rot_dim, 10000.0, style, None, 100).unwrap();
        let n_heads = 3;
        let positions: Vec<u32> = vec![0, 1, 99, 100, 101, 4000, 17, 17, 250];
        let src = rand_vec(&mut r, positions.len() * n_heads * head_dim, 2.0);
        let before = src.clone();
        // NaN everywhere: a value the kernel did not write would show.
        let mut got = vec![f32::NAN; src.len()];
        emu::rope_copy(&src, &mut got, n_heads, &positions, &table);
        assert_eq!(src, before, "the source is read only");
        let mut want = src.clone();
        emu::rope(&mut want, n_heads, &positions, &table);
        let what = format!("rope_copy {style:?} {head_dim}/{rot_dim}");
        assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{what}: differs from copy + rope");
        let mut reference = src.clone();
        rope_ref(&mut reference, n_heads, &positions, &table).unwrap();
        assert_close(&what, &got, &reference, ROPE_TOL);
    }
}

#[test]
fn attention_matches_the_reference() {
    let mut r = rng(6);
    for &(m, n, heads, kv_heads, d, scattered) in &[
        (1, 1, 1, 1, 1, false),
        (5, 70, 9, 3, 64, false),   // SmolLM2's heads
        (37, 37, 14, 2, 64, false), // Qwen2.5-0.5B's heads, prefill of a chunk
        (3, 100, 7, 1, 33, true),
        (9, 65, 4, 4, 128, true),
        (6, 0, 2, 1, 16, false),   // no keys at all
        (2, 31, 2, 2, 256, false), // the largest head dimension
    ] {
        let c = case(&mut r, m, n, heads, kv_heads, d, scattered);
        let (mut out, mut lse) = (vec![9f32; c.q.len()], vec![9f32; m * heads]);
        emu::attention(&c.shape, &c.q, &c.qpos, &c.k, &c.v, &c.kpos, &mut out, &mut lse);
        let (mut want_out, mut want_lse) = (vec![0f32; c.q.len()], vec![0f32; m * heads]);
        attention_ref(&c.shape, &c.q, &c.qpos, KvRef { k: &c.k, v: &c.v, pos: &c.kpos }, &mut want_out, &mut want_lse)
            .unwrap();
        let label = format!("attention m={m} n={n} heads={heads}/{kv_heads} d={d}");
        assert_close(&format!("{label} out"), &out, &want_out, ATTN_OUT_TOL);
        assert_close(&format!("{label} lse"), &lse, &want_lse, ATTN_LSE_TOL);
    }
}

#[test]
fn attention_scores_match_the_reference() {
    let mut r = rng(7);
    for &(m, n, heads, kv_heads, d, scattered) in
        &[(4, 50, 9, 3, 64, false), (11, 300, 14, 2, 64, true), (3, 17, 7, 1, 33, true), (1, 1, 1, 1, 8, false)]
    {
        let c = case(&mut r, m, n, heads, kv_heads, d, scattered);
        // The queries' lse from the reference attention (it may come from another rank).
        let (mut o, mut lse) = (vec![0f32; c.q.len()], vec![0f32; m * heads]);
        let kv = KvRef { k: &c.k, v: &c.v, pos: &c.kpos };
        attention_ref(&c.shape, &c.q, &c.qpos, kv, &mut o, &mut lse).unwrap();
        let mut got = vec![0.25f32; n];
        emu::attention_scores(&c.shape, &c.q, &c.qpos, &c.k, &c.kpos, &lse, &mut got);
        let mut want = vec![0.25f32; n];
        attention_scores_ref(&c.shape, &c.q, &c.qpos, kv, &lse, &mut want).unwrap();
        let tol = SCORES_TOL_PER_ROW * (m * heads) as f32;
        assert_close(&format!("attention_scores m={m} n={n}"), &got, &want, tol);
    }
}

#[test]
fn merge_partial_matches_and_splitting_keys_changes_nothing() {
    let mut r = rng(8);
    let (rows, d) = (23, 48);
    let mut out_a = rand_vec(&mut r, rows * d, 1.0);
    let mut lse_a = rand_vec(&mut r, rows, 30.0);
    let out_b = rand_vec(&mut r, rows * d, 1.0);
    let mut lse_b = rand_vec(&mut r, rows, 30.0);
    lse_a[3] = f32::NEG_INFINITY;
    lse_b[4] = f32::NEG_INFINITY;
    lse_a[5] = f32::NEG_INFINITY;
    lse_b[5] = f32::NEG_INFINITY;
    let (mut got_o, mut got_l) = (out_a.clone(), lse_a.clone());
    emu::merge_partial(&mut got_o, &mut got_l, &out_b, &lse_b, d);
    cpu_merge(&mut out_a, &mut lse_a, &out_b, &lse_b, d).unwrap();
    assert_close("merge_partial out", &got_o, &out_a, MERGE_TOL);
    assert_close("merge_partial lse", &got_l, &lse_a, MERGE_TOL);

    // Attention over all keys == attention over two halves merged (all on the emulated kernels).
    let c = case(&mut r, 9, 90, 6, 2, 32, true);
    let kvd = c.shape.kv_dim();
    let (mut whole_o, mut whole_l) = (vec![0f32; c.q.len()], vec![0f32; 9 * 6]);
    emu::attention(&c.shape, &c.q, &c.qpos, &c.k, &c.v, &c.kpos, &mut whole_o, &mut whole_l);
    let split = 41;
    let (mut o1, mut l1) = (vec![0f32; c.q.len()], vec![0f32; 9 * 6]);
    let (mut o2, mut l2) = (vec![0f32; c.q.len()], vec![0f32; 9 * 6]);
    emu::attention(
        &c.shape,
        &c.q,
        &c.qpos,
        &c.k[..split * kvd],
        &c.v[..split * kvd],
        &c.kpos[..split],
        &mut o1,
        &mut l1,
    );
    emu::attention(
        &c.shape,
        &c.q,
        &c.qpos,
        &c.k[split * kvd..],
        &c.v[split * kvd..],
        &c.kpos[split..],
        &mut o2,
        &mut l2,
    );
    emu::merge_partial(&mut o1, &mut l1, &o2, &l2, c.shape.head_dim);
    assert_close("split + merge out", &o1, &whole_o, ATTN_OUT_TOL);
    assert_close("split + merge lse", &l1, &whole_l, ATTN_LSE_TOL);
}
