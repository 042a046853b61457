//! The bf16 forward's kernels (bf16 activations between ops), run on the CPU through the launch
//! shim, against the CPU backend made with bf16 activations (`Cpu::with_activations(Bf16)`),
//! which is the Rust reference of that forward: the same f32 arithmetic, rounded once where it
//! stores bf16. Where the arithmetic is the same expression (copies, gathers, bias and residual
//! adds, the QKV split and its rotations) the kernels must match bit for bit; where a function
//! of the device's maths library or a reduction order enters (`expf` in SiLU, `rsqrtf` and the
//! warp's sum in RMSNorm), within one bf16 unit in the last place. The GEMMs are cuBLAS's and
//! are not emulated; what they compute (bf16 products, f32 sums, one rounding, beta = 1 for the
//! residual) is what the CPU reference computes.

use flowprefill_kernels::matmul::Matrix;
use flowprefill_kernels::rope::{RopeStyle, RopeTable};
use flowprefill_kernels::{Backend, Cpu, DType, HostBuf};
use flowprefill_kernels_emu as emu;

mod common;
use common::{rand_vec, rng};
use rand::Rng;

/// The reference: the CPU backend with the bf16 forward's roundings.
fn reference() -> Cpu {
    Cpu.with_activations(DType::Bf16)
}

fn bf16s(x: &[f32]) -> Vec<u16> {
    x.iter().map(|&f| flowprefill_kernels::backend::to_bf16(f)).collect()
}

fn bits_of(b: &HostBuf) -> Vec<u16> {
    match b {
        HostBuf::Bf16(v) => v.clone(),
        HostBuf::F32(_) => panic!("expected a bf16 buffer"),
    }
}

/// Every value equal, or the neighbouring bf16 value (one unit in the last place, same sign):
/// the tolerance where `expf`/`rsqrtf` or a reduction order can move an f32 result across a
/// bf16 rounding boundary.
fn assert_within_one_ulp(what: &str, got: &[u16], want: &[u16]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mut off = 0;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let d = (g as i32 - w as i32).abs();
        assert!(d <= 1 && (g ^ w) & 0x8000 == 0 || g == w, "{what}: value {i}: {g:#06x} vs {w:#06x}");
        off += usize::from(d == 1);
    }
    // Boundary cases are rare: most values must agree exactly.
    assert!(off * 50 <= got.len().max(50), "{what}: {off} of {} values one unit apart", got.len());
}

#[test]
fn embedding_bias_and_residual_adds_into_bf16_match_bit_for_bit() {
    let mut r = rng(61);
    let (vocab, cols, rows) = (97, 40, 23);
    let table = rand_vec(&mut r, vocab * cols, 3.0);
    let ids: Vec<u32> = (0..rows).map(|_| r.random_range(0..vocab as u32)).collect();
    let be = reference();
    // An f32 table (rounded once) and a bf16 one (copied), into bf16 activations.
    let m = be.matrix(Matrix::new(vocab, cols, table.clone()).unwrap()).unwrap();
    let mut want = be.zeros_as(rows * cols, DType::Bf16).unwrap();
    be.embedding(&m, &ids, &mut want).unwrap();
    let mut got = vec![0u16; rows * cols];
    emu::embedding(&bf16s(&table), cols, &ids, &mut got);
    assert_eq!(got, bits_of(&want), "embedding, bf16 table");
    let exact = Matrix::new(vocab, cols, table.clone()).unwrap();
    let mut want = HostBuf::zeros(rows * cols, DType::Bf16);
    Cpu.embedding(&exact, &ids, &mut want).unwrap();
    let mut got = vec![0u16; rows * cols];
    emu::embedding(&table, cols, &ids, &mut got);
    assert_eq!(got, bits_of(&want), "embedding, f32 table rounded once");

    let x = bf16s(&rand_vec(&mut r, rows * cols, 5.0));
    let bias = rand_vec(&mut r, cols, 1.0);
    let mut want = HostBuf::Bf16(x.clone());
    be.add_bias(&mut want, &HostBuf::F32(bias.clone())).unwrap();
    let mut got = x.clone();
    emu::add_bias(&mut got, &bias);
    assert_eq!(got, bits_of(&want), "add_bias");

    let y = bf16s(&rand_vec(&mut r, rows * cols, 5.0));
    let mut want = HostBuf::Bf16(x.clone());
    be.add_assign(&mut want, &HostBuf::Bf16(y.clone())).unwrap();
    let mut got = x.clone();
    emu::add_assign(&mut got, &y);
    assert_eq!(got, bits_of(&want), "add_assign");
    assert!(be.add_assign(&mut HostBuf::Bf16(x.clone()), &HostBuf::F32(vec![0.0; x.len()])).is_err());

    // bf16 activations into an f32 cache: widened exactly.
    let (src_cols, col, width) = (cols, 5, 17);
    let mut got = vec![f32::NAN; rows * width];
    emu::copy_columns(&x, src_cols, col, width, &mut got);
    let mut want = HostBuf::zeros(rows * width, DType::F32);
    be.copy_columns(&HostBuf::Bf16(x.clone()), src_cols, col, width, &mut want).unwrap();
    assert_eq!(got, want.to_f32(), "copy_columns bf16 -> f32");
}

#[test]
fn silu_gate_into_bf16_is_within_one_unit() {
    let mut r = rng(62);
    let be = reference();
    for (rows, ffn) in [(1, 1), (7, 33), (65, 300)] {
        let gu = bf16s(&rand_vec(&mut r, rows * 2 * ffn, 8.0));
        let mut got = vec![0u16; rows * ffn];
        emu::silu_mul(&gu, ffn, &mut got);
        let mut want = HostBuf::zeros(rows * ffn, DType::Bf16);
        be.silu_mul(&HostBuf::Bf16(gu), ffn, &mut want).unwrap();
        assert_within_one_ulp(&format!("silu_mul {rows}x{ffn}"), &got, &bits_of(&want));
    }
}

/// bf16 has f32's range: rows whose sum of squares overflows f32 (a lone 1e20, ±1e19s, values
/// up to the largest bf16) between normal rows, 16-byte loads (64 columns) and single values
/// (577): the kernel's scaled second sum matches the CPU backend (which redoes such rows in
/// f64) within one bf16 unit, and every output is finite.
#[test]
fn rms_norm_of_bf16_rows_whose_squares_overflow_f32_is_within_one_unit() {
    let mut r = rng(64);
    let be = reference();
    for cols in [64usize, 577] {
        let mut x = rand_vec(&mut r, cols, 3.0);
        x.extend((0..cols).map(|i| if i == 5 { 1e20 } else { 0.5 }));
        x.extend((0..cols).map(|i| if i % 2 == 0 { 1e19 } else { -1e19 }));
        x.extend(rand_vec(&mut r, cols, 3.0));
        x.extend((0..cols).map(|i| 3.3e38 / (i as f32 + 1.0)));
        let rows = x.len() / cols;
        let x = bf16s(&x);
        let w = rand_vec(&mut r, cols, 1.5);
        let mut got = vec![0xffffu16; rows * cols];
        emu::rms_norm(&x, &w, 1e-5, &mut got);
        let mut want = HostBuf::zeros(rows * cols, DType::Bf16);
        be.rms_norm(&HostBuf::Bf16(x), &HostBuf::F32(w), 1e-5, &mut want).unwrap();
        let want = bits_of(&want);
        assert!(want.iter().all(|&b| b & 0x7f80 != 0x7f80), "the reference is finite");
        assert_within_one_ulp(&format!("rms_norm bf16 overflowing rows, {cols} columns"), &got, &want);
    }
}

/// One warp per row, 16-byte loads where a row is a multiple of 8 values (576: SmolLM2's
/// d_model; 64 and 128: head dims for the per-head norms), single values otherwise; row counts
/// that do not fill the last block of 4 warps.
#[test]
fn rms_norm_of_bf16_rows_is_within_one_unit() {
    let mut r = rng(63);
    let be = reference();
    for (rows, cols) in [(1, 1), (5, 8), (3, 64), (9, 128), (6, 576), (2, 577), (4, 2056)] {
        let x = bf16s(&rand_vec(&mut r, rows * cols, 3.0));
        let w = rand_vec(&mut r, cols, 1.5);
        let mut got = vec![0xffffu16; rows * cols];
        emu::rms_norm(&x, &w, 1e-5, &mut got);
        let mut want = HostBuf::zeros(rows * cols, DType::Bf16);
        be.rms_norm(&HostBuf::Bf16(x), &HostBuf::F32(w), 1e-5, &mut want).unwrap();
        assert_within_one_ulp(&format!("rms_norm bf16 {rows}x{cols}"), &got, &bits_of(&want));
    }
}

/// The QKV split of bf16 activations: q stays bf16 (rotated, rounded once), K/V in a bf16 or
/// an f32 cache; bit for bit what the emulated ops one by one write (copies, then in-place
/// rotations), and those within one unit of the CPU reference's rotation.
#[test]
fn split_qkv_rope_of_bf16_activations_is_the_ops_it_replaces() {
    let mut r = rng(64);
    for (style, head_dim, rot_dim, heads) in
        [(RopeStyle::Neox, 64, 64, (9, 3)), (RopeStyle::Interleaved, 64, 64, (4, 4)), (RopeStyle::Neox, 48, 16, (3, 1))]
    {
        let table = RopeTable::new(head_dim, rot_dim, 10000.0, style, None, 100).unwrap();
        let positions: Vec<u32> = vec![0, 7, 99, 100, 2500, 7];
        let rows = positions.len();
        let (qd, kvd) = (heads.0 * head_dim, heads.1 * head_dim);
        let qkvd = qd + 2 * kvd;
        let qkv = bf16s(&rand_vec(&mut r, rows * qkvd, 2.0));
        let what = format!("{style:?} {head_dim}/{rot_dim} heads {heads:?}");

        let mut q_want = vec![0u16; rows * qd];
        emu::copy_columns(&qkv, qkvd, 0, qd, &mut q_want);
        emu::rope(&mut q_want, heads.0, &positions, &table);
        let mut kp_want = vec![0u16; rows * kvd];
        emu::copy_columns(&qkv, qkvd, qd, kvd, &mut kp_want);
        let mut v_want = vec![0u16; rows * kvd];
        emu::copy_columns(&qkv, qkvd, qd + kvd, kvd, &mut v_want);
        let mut k_want = kp_want.clone();
        emu::rope(&mut k_want, heads.1, &positions, &table);
        let mut q = vec![0xffffu16; rows * qd];
        let (mut kp, mut k, mut v) =
            (vec![0xffffu16; rows * kvd], vec![0xffffu16; rows * kvd], vec![0xffffu16; rows * kvd]);
        emu::split_qkv_rope(&qkv, heads, &positions, &table, &mut q, &mut kp, &mut k, &mut v);
        assert_eq!(q, q_want, "{what}: q");
        assert_eq!((&kp, &k, &v), (&kp_want, &k_want, &v_want), "{what}: bf16 k_pre, k, v");

        // The CPU reference (its own rotation kernel), within one unit.
        let be = Cpu::with_kv_dtype(DType::Bf16).with_activations(DType::Bf16);
        let mut cq = HostBuf::zeros(rows * qd, DType::Bf16);
        let mut ckp = HostBuf::zeros(rows * kvd, DType::Bf16);
        let mut ck = HostBuf::zeros(rows * kvd, DType::Bf16);
        let mut cv = HostBuf::zeros(rows * kvd, DType::Bf16);
        be.split_qkv_rope(&HostBuf::Bf16(qkv.clone()), heads, &positions, &table, &mut cq, &mut ckp, &mut ck, &mut cv)
            .unwrap();
        assert_within_one_ulp(&format!("{what}: q against the CPU"), &q, &bits_of(&cq));
        assert_within_one_ulp(&format!("{what}: k against the CPU"), &k, &bits_of(&ck));
        assert_eq!((&kp, &v), (&bits_of(&ckp), &bits_of(&cv)), "{what}: copies against the CPU");

        // An f32 cache beside bf16 activations: K/V widened exactly, q as before.
        let (mut kp32, mut k32, mut v32) =
            (vec![f32::NAN; rows * kvd], vec![f32::NAN; rows * kvd], vec![f32::NAN; rows * kvd]);
        let mut q2 = vec![0xffffu16; rows * qd];
        emu::split_qkv_rope(&qkv, heads, &positions, &table, &mut q2, &mut kp32, &mut k32, &mut v32);
        assert_eq!(q2, q_want, "{what}: q (f32 cache)");
        let mut kp32_want = vec![0f32; rows * kvd];
        emu::copy_columns(&qkv, qkvd, qd, kvd, &mut kp32_want);
        let mut k32_want = kp32_want.clone();
        emu::rope(&mut k32_want, heads.1, &positions, &table);
        let mut v32_want = vec![0f32; rows * kvd];
        emu::copy_columns(&qkv, qkvd, qd + kvd, kvd, &mut v32_want);
        let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            (bits(&kp32), bits(&k32), bits(&v32)),
            (bits(&kp32_want), bits(&k32_want), bits(&v32_want)),
            "{what}: f32 k_pre, k, v"
        );
    }
}
