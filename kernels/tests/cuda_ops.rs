//! Every op of the CUDA backend against the CPU backend on the same inputs (odd shapes,
//! grouped-query heads, no visible key), the tensor-core self-check against a plain product,
//! and the tensor-core attention over a bf16 KV cache at sizes the emulation cannot reach
//! (prefill at 2K-4K tokens, a decode step over 8K keys split over many blocks). Needs a GPU:
//! without one each test says SKIPPED and returns (it does not pass silently: run
//! `scripts/gpu-check.sh` on a GPU machine).
#![cfg(feature = "cuda")]

use flowprefill_kernels::attention::AttnShape;
use flowprefill_kernels::cuda::{CudaBackend, WeightType};
use flowprefill_kernels::gpu::ops::FlashKernel;
use flowprefill_kernels::matmul::Matrix;
use flowprefill_kernels::rope::{RopeStyle, RopeTable};
use flowprefill_kernels::{Backend, Cpu, DType, HostBuf};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// f32 ops on the GPU against the CPU: different summation orders, device expf.
const OP_TOL: f32 = 1e-4;
/// bf16 GEMM against the f32 CPU GEMM: inputs rounded to 8 significant bits, relative to the
/// output scale.
const BF16_GEMM_TOL: f32 = 2e-2;
/// Tensor-core attention over bf16 Q/K/V against the CPU on the same bf16 values: the bf16
/// rounding of the probabilities moves each weight by at most 2^-9 of itself (FlashAttention-2's
/// bound), so the outputs differ by at most this times max|V|.
const FLASH_OUT_TOL: f32 = 4e-3;
/// Its log-sum-exp, relative to max(1, |lse|).
const FLASH_LSE_TOL: f32 = 2e-5;
/// The mma self-check: exact bf16 products, f32 sums of 16 terms, relative to the scale.
const PROBE_TOL: f32 = 1e-5;

fn gpu(weights: WeightType) -> Option<CudaBackend> {
    gpu_with(weights, DType::F32)
}

fn gpu_with(weights: WeightType, kv: DType) -> Option<CudaBackend> {
    match flowprefill_kernels::cuda::devices() {
        Ok(d) if !d.is_empty() => Some(CudaBackend::new(0, weights, kv).unwrap_or_else(|e| panic!("{e}"))),
        other => {
            flowprefill_kernels::testing::skipped(
                "no CUDA device",
                other.err().map(|e| e.to_string()).unwrap_or_else(|| "none".into()),
            );
            None
        }
    }
}

fn rand_vec(r: &mut StdRng, n: usize, amp: f32) -> Vec<f32> {
    (0..n).map(|_| r.random_range(-amp..amp)).collect()
}

/// A CPU buffer of `v`.
fn h(v: &[f32]) -> HostBuf {
    HostBuf::F32(v.to_vec())
}

/// A zeroed CPU buffer.
fn hz(n: usize) -> HostBuf {
    HostBuf::zeros(n, DType::F32)
}

/// `x` rounded to bf16 and widened back (the values a bf16 buffer holds).
fn bf16_values(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| flowprefill_kernels::backend::from_bf16(flowprefill_kernels::backend::to_bf16(v))).collect()
}

/// Max of |a - b| / max(1, |b|); infinite where a value is NaN or only one side is infinite.
fn max_err(a: &[f32], b: &[f32]) -> f32 {
    flowprefill_kernels::testing::max_rel_diff(a, b, 1.0)
}

#[test]
fn elementwise_norm_rope_merge_match_the_cpu() {
    let Some(g) = gpu(WeightType::F32) else { return };
    let c = Cpu;
    let mut r = StdRng::seed_from_u64(1);
    let (rows, cols) = (37, 577);
    let x = rand_vec(&mut r, rows * cols, 3.0);
    let w = rand_vec(&mut r, cols, 1.0);
    let (gx, gw) = (g.upload(&x).unwrap(), g.upload(&w).unwrap());
    let mut go = g.zeros(x.len()).unwrap();
    g.rms_norm(&gx, &gw, 1e-5, &mut go).unwrap();
    let mut co = hz(x.len());
    c.rms_norm(&h(&x), &h(&w), 1e-5, &mut co).unwrap();
    assert!(max_err(&g.download(&go).unwrap(), &co.to_f32()) <= OP_TOL, "rms_norm");

    let table = RopeTable::new(64, 64, 10000.0, RopeStyle::Neox, None, 50).unwrap();
    let pos: Vec<u32> = vec![0, 3, 49, 50, 900];
    let xr = rand_vec(&mut r, pos.len() * 3 * 64, 2.0);
    let mut gxr = g.upload(&xr).unwrap();
    g.rope(&mut gxr, 3, &pos, &table).unwrap();
    let mut cxr = h(&xr);
    c.rope(&mut cxr, 3, &pos, &table).unwrap();
    assert!(max_err(&g.download(&gxr).unwrap(), &cxr.to_f32()) <= OP_TOL, "rope");
    // RoPE on a bf16 buffer: the same rotation, rounded once.
    let mut gxb = g.zeros_as(xr.len(), DType::Bf16).unwrap();
    g.copy_columns(&g.upload(&xr).unwrap(), 64, 0, 64, &mut gxb).unwrap();
    g.rope(&mut gxb, 3, &pos, &table).unwrap();
    let mut cxb = HostBuf::zeros(xr.len(), DType::Bf16);
    c.copy_columns(&h(&xr), 64, 0, 64, &mut cxb).unwrap();
    c.rope(&mut cxb, 3, &pos, &table).unwrap();
    assert_eq!(g.download_typed(&gxb).unwrap(), cxb, "rope on bf16: the same bits as the CPU");
    // Placing in one pass: the same bits as a copy and the in-place rotation, on both types;
    // a duplicate is the same bits; the positions were uploaded once for all of these.
    let placed = g.rope_copy(&g.upload(&xr).unwrap(), 3, &pos, &table).unwrap();
    assert_eq!(g.download(&placed).unwrap(), g.download(&gxr).unwrap(), "rope_copy f32");
    let mut src_b = g.zeros_as(xr.len(), DType::Bf16).unwrap();
    g.copy_columns(&g.upload(&xr).unwrap(), 64, 0, 64, &mut src_b).unwrap();
    let placed_b = g.rope_copy(&src_b, 3, &pos, &table).unwrap();
    assert_eq!(g.download_typed(&placed_b).unwrap(), cxb, "rope_copy bf16");
    assert_eq!(g.download_typed(&g.duplicate(&placed_b).unwrap()).unwrap(), cxb, "duplicate bf16");
    // The QKV split in one launch against the CPU's ops one by one (bf16 cache: the same bits).
    let heads = (3, 1);
    let qkvd = (heads.0 + 2 * heads.1) * 64;
    let qkv = rand_vec(&mut r, pos.len() * qkvd, 2.0);
    let (n_q, n_kv) = (pos.len() * heads.0 * 64, pos.len() * heads.1 * 64);
    let mut gq = g.zeros(n_q).unwrap();
    let mut gk: Vec<_> = (0..3).map(|_| g.zeros_as(n_kv, DType::Bf16).unwrap()).collect();
    let (gkp, rest) = gk.split_at_mut(1);
    let (gkr, gv) = rest.split_at_mut(1);
    g.split_qkv_rope(&g.upload(&qkv).unwrap(), heads, &pos, &table, &mut gq, &mut gkp[0], &mut gkr[0], &mut gv[0])
        .unwrap();
    let mut cq = hz(n_q);
    let mut ck: Vec<_> = (0..3).map(|_| HostBuf::zeros(n_kv, DType::Bf16)).collect();
    let (ckp, rest) = ck.split_at_mut(1);
    let (ckr, cv) = rest.split_at_mut(1);
    c.split_qkv_rope(&h(&qkv), heads, &pos, &table, &mut cq, &mut ckp[0], &mut ckr[0], &mut cv[0]).unwrap();
    assert!(max_err(&g.download(&gq).unwrap(), &cq.to_f32()) <= OP_TOL, "split_qkv_rope q");
    for (i, what) in ["k_pre", "k", "v"].iter().enumerate() {
        assert_eq!(g.download_typed(&gk[i]).unwrap(), ck[i], "split_qkv_rope {what}: the same bits as the CPU");
    }
    // Marks time device work without a host wait in between: later marks, longer spans.
    let m0 = g.mark().unwrap();
    for _ in 0..20 {
        g.rms_norm(&gx, &gw, 1e-5, &mut go).unwrap();
    }
    let m1 = g.mark().unwrap();
    let (a, b) = (g.seconds_between(&m0, &m1).unwrap(), g.seconds_between(&m0, &m0).unwrap());
    assert!(a > 0.0 && b == 0.0 && a < 10.0, "20 norms took {a} s by the events, an empty span {b} s");

    let gu = rand_vec(&mut r, rows * 2 * 33, 4.0);
    let mut gs = g.zeros(rows * 33).unwrap();
    g.silu_mul(&g.upload(&gu).unwrap(), 33, &mut gs).unwrap();
    let mut cs = hz(rows * 33);
    c.silu_mul(&h(&gu), 33, &mut cs).unwrap();
    assert!(max_err(&g.download(&gs).unwrap(), &cs.to_f32()) <= OP_TOL, "silu_mul");

    // Appends grow the buffer without losing what it held; rows move device to device.
    let mut acc = g.zeros(0).unwrap();
    let mut want = Vec::new();
    for i in 0..50 {
        let part = vec![i as f32; 7];
        g.append(&mut acc, &g.upload(&part).unwrap()).unwrap();
        want.extend(part);
    }
    assert_eq!(g.download(&acc).unwrap(), want);
    let mut dst = g.zeros(10 * 7).unwrap();
    g.copy_rows(&acc, &[49, 0, 7], &mut dst, &[9, 0, 3], 7).unwrap();
    let d = g.download(&dst).unwrap();
    assert_eq!((&d[63..70], &d[0..7], &d[21..28]), (&[49.0; 7][..], &[0.0; 7][..], &[7.0; 7][..]));
}

#[test]
fn attention_and_scores_match_the_cpu() {
    let Some(g) = gpu(WeightType::F32) else { return };
    let c = Cpu;
    let mut r = StdRng::seed_from_u64(2);
    for &(m, n, heads, kv, d) in &[(5, 70, 9, 3, 64), (37, 37, 14, 2, 64), (3, 100, 7, 1, 128), (4, 0, 2, 1, 16)] {
        let shape = AttnShape::new(heads, kv, d).unwrap();
        let (q, k, v) = (
            rand_vec(&mut r, m * heads * d, 2.0),
            rand_vec(&mut r, n * kv * d, 2.0),
            rand_vec(&mut r, n * kv * d, 1.0),
        );
        let qpos: Vec<u32> = (0..m as u32).map(|i| i * 17 % 130).collect();
        let kpos: Vec<u32> = (0..n as u32).collect();
        let (mut co, mut cl) = (hz(q.len()), hz(m * heads));
        c.attention(&shape, &h(&q), &qpos, &h(&k), &h(&v), &kpos, &mut co, &mut cl).unwrap();
        let (co, cl) = (co.to_f32(), cl.to_f32());
        let (gq, gk, gv) = (g.upload(&q).unwrap(), g.upload(&k).unwrap(), g.upload(&v).unwrap());
        let (mut go, mut gl) = (g.zeros(q.len()).unwrap(), g.zeros(m * heads).unwrap());
        g.attention(&shape, &gq, &qpos, &gk, &gv, &kpos, &mut go, &mut gl).unwrap();
        assert!(max_err(&g.download(&go).unwrap(), &co) <= OP_TOL, "attention out m={m} n={n}");
        assert!(max_err(&g.download(&gl).unwrap(), &cl) <= OP_TOL, "attention lse m={m} n={n}");
        let mut cs = hz(n);
        c.attention_scores(&shape, &h(&q), &qpos, &h(&k), &kpos, &h(&cl), &mut cs).unwrap();
        let cs = cs.to_f32();
        let mut gs = g.zeros(n).unwrap();
        g.attention_scores(&shape, &gq, &qpos, &gk, &kpos, &gl, &mut gs).unwrap();
        // A key's score sums m x heads probabilities; the bound grows with them. It is loose (a
        // relative error of OP_TOL per summed row, on top of max_err's own scaling): to tighten
        // on the next GPU run, from the error it prints.
        const SCORES_TOL_PER_ROW: f32 = OP_TOL;
        let err = max_err(&g.download(&gs).unwrap(), &cs);
        eprintln!("scores m={m} n={n}: error {err:e}");
        assert!(err <= SCORES_TOL_PER_ROW * (m * heads) as f32, "scores m={m} n={n}: {err}");
    }
}

#[test]
fn gemms_match_the_cpu_in_f32_and_in_bf16() {
    let mut r = StdRng::seed_from_u64(3);
    let (m, k, n) = (33, 577, 129);
    let x = rand_vec(&mut r, m * k, 1.0);
    let w = Matrix::new(n, k, rand_vec(&mut r, n * k, 0.1)).unwrap();
    let mut want = hz(m * n);
    Cpu.matmul_t(&h(&x), m, &w, &mut want).unwrap();
    let want = want.to_f32();
    for (weights, tol) in [(WeightType::F32, OP_TOL), (WeightType::Bf16, BF16_GEMM_TOL)] {
        let Some(g) = gpu(weights) else { return };
        let gw = g.matrix(w.clone()).unwrap();
        let mut out = g.zeros(m * n).unwrap();
        g.matmul_t(&g.upload(&x).unwrap(), m, &gw, &mut out).unwrap();
        let e = max_err(&g.download(&out).unwrap(), &want);
        assert!(e <= tol, "{weights:?} GEMM error {e}");
        let ids = [0u32, 128, 5];
        let mut emb = g.zeros(ids.len() * k).unwrap();
        g.embedding(&gw, &ids, &mut emb).unwrap();
        let mut cemb = hz(ids.len() * k);
        Cpu.embedding(&w, &ids, &mut cemb).unwrap();
        assert!(max_err(&g.download(&emb).unwrap(), &cemb.to_f32()) <= tol, "{weights:?} embedding");
    }
}

#[test]
fn tensor_core_layouts_match_a_plain_product_on_the_hardware() {
    let Some(g) = gpu(WeightType::Bf16) else { return };
    let mut r = StdRng::seed_from_u64(4);
    let a = bf16_values(&rand_vec(&mut r, 256, 2.0));
    let b = bf16_values(&rand_vec(&mut r, 256, 2.0));
    let bits = |v: &[f32]| v.iter().map(|&x| flowprefill_kernels::backend::to_bf16(x)).collect::<Vec<u16>>();
    let b_nk: Vec<f32> = (0..256).map(|i| b[(i % 16) * 16 + i / 16]).collect();
    let (d_nk, d_kn) = g.probe_mma(&bits(&a), &bits(&b_nk), &bits(&b)).unwrap_or_else(|e| panic!("{e}"));
    let want: Vec<f32> = (0..256)
        .map(|e| (0..16).map(|k| a[(e / 16) * 16 + k] as f64 * b[k * 16 + e % 16] as f64).sum::<f64>() as f32 / 64.0)
        .collect();
    let scaled = |d: &[f32]| d.iter().map(|x| x / 64.0).collect::<Vec<f32>>();
    assert!(max_err(&scaled(&d_nk), &want) <= PROBE_TOL, "mma with an [n][k] B (how K is loaded)");
    assert!(max_err(&scaled(&d_kn), &want) <= PROBE_TOL, "mma with a [k][n] B (how V is loaded)");
}

/// Hopper's self-check (`hopper_probe.cu`: TMA into swizzled shared memory, an mbarrier,
/// wgmma from descriptors and from registers, B K-major and transposed) in every swizzle mode,
/// against a plain product: the layouts the CPU emulation assumes (kernels-emu/tests/hopper.rs)
/// checked against the hardware. Compute capability 9.0 only; elsewhere it says skipped.
#[test]
fn hopper_layouts_match_a_plain_product_on_the_hardware() {
    let Some(g) = gpu(WeightType::Bf16) else { return };
    if !g.has_hopper() {
        flowprefill_kernels::testing::skipped("not a Hopper GPU", format!("{} has no sm_90a kernels", g.arch()));
        return;
    }
    let mut r = StdRng::seed_from_u64(6);
    let a = bf16_values(&rand_vec(&mut r, 64 * 64, 2.0));
    let b = bf16_values(&rand_vec(&mut r, 64 * 128, 2.0));
    let bits = |v: &[f32]| v.iter().map(|&x| flowprefill_kernels::backend::to_bf16(x)).collect::<Vec<u16>>();
    let b_nk: Vec<f32> = (0..128 * 64).map(|i| b[(i % 64) * 128 + i / 64]).collect();
    let scale = 4.0 * 64.0;
    let want: Vec<f32> = (0..64 * 128)
        .map(|e| {
            (0..64).map(|k| a[(e / 128) * 64 + k] as f64 * b[k * 128 + e % 128] as f64).sum::<f64>() as f32 / scale
        })
        .collect();
    let scaled = |d: &[f32]| d.iter().map(|x| x / scale).collect::<Vec<f32>>();
    for s in flowprefill_kernels::gpu::tma::Swizzle::ALL {
        let (d_ss, d_rs) = g.hopper_probe(s, &bits(&a), &bits(&b_nk), &bits(&b)).unwrap_or_else(|e| panic!("{e}"));
        assert!(max_err(&scaled(&d_ss), &want) <= PROBE_TOL, "{s:?}: wgmma from descriptors, B K-major");
        assert!(max_err(&scaled(&d_rs), &want) <= PROBE_TOL, "{s:?}: wgmma with A from registers, B transposed");
    }
}

#[test]
fn tensor_core_attention_over_a_bf16_cache_matches_the_cpu() {
    let Some(g) = gpu_with(WeightType::Bf16, DType::Bf16) else { return };
    let c = Cpu::with_kv_dtype(DType::Bf16);
    let mut r = StdRng::seed_from_u64(5);
    // (queries, keys, heads, KV heads, head_dim, scattered positions): prefill of SmolLM2's and
    // an 8B model's heads, a decode step over 8K keys (split over many blocks), a prompt over a
    // long context, and positions out of order with queries that see nothing.
    for &(m, n, heads, kv, d, scattered) in &[
        (2048, 2048, 9, 3, 64, false),
        (1024, 4096, 32, 8, 128, false),
        (1, 8192, 9, 3, 64, false),
        (1, 8191, 32, 8, 128, false),
        (40, 5000, 14, 2, 64, false),
        (333, 1000, 28, 4, 128, true),
    ] {
        check_flash(&g, &c, &mut r, (m, n, heads, kv, d), scattered, "");
    }
}

/// The tensor-core attention (and the per-key scores) of one shape on the GPU against the CPU on
/// the same bf16 values; `tag` names the kernel configuration in messages.
fn check_flash(
    g: &CudaBackend,
    c: &Cpu,
    r: &mut StdRng,
    (m, n, heads, kv, d): (usize, usize, usize, usize, usize),
    scattered: bool,
    tag: &str,
) {
    let shape = AttnShape::new(heads, kv, d).unwrap();
    // bf16 values from the start: the GPU rounds its queries to bf16, the CPU does not.
    let q = bf16_values(&rand_vec(r, m * heads * d, 2.0));
    let (k, v) = (rand_vec(r, n * kv * d, 2.0), rand_vec(r, n * kv * d, 1.0));
    let (qpos, kpos): (Vec<u32>, Vec<u32>) = if scattered {
        let kpos = (0..n).map(|_| r.random_range(5..3000)).collect();
        ((0..m).map(|i| if i % 7 == 0 { r.random_range(0..5) } else { r.random_range(0..3200) }).collect(), kpos)
    } else {
        ((n - m..n).map(|p| p as u32).collect(), (0..n as u32).collect())
    };
    let kvd = kv * d;
    let (mut gk, mut gv) = (g.zeros_as(n * kvd, DType::Bf16).unwrap(), g.zeros_as(n * kvd, DType::Bf16).unwrap());
    g.copy_columns(&g.upload(&k).unwrap(), kvd, 0, kvd, &mut gk).unwrap();
    g.copy_columns(&g.upload(&v).unwrap(), kvd, 0, kvd, &mut gv).unwrap();
    let (mut ck, mut cv) = (HostBuf::zeros(n * kvd, DType::Bf16), HostBuf::zeros(n * kvd, DType::Bf16));
    c.copy_columns(&h(&k), kvd, 0, kvd, &mut ck).unwrap();
    c.copy_columns(&h(&v), kvd, 0, kvd, &mut cv).unwrap();
    assert_eq!(g.download_typed(&gk).unwrap(), ck, "the same bf16 keys on both");
    let gq = g.upload(&q).unwrap();
    let (mut go, mut gl) = (g.zeros(q.len()).unwrap(), g.zeros(m * heads).unwrap());
    g.attention(&shape, &gq, &qpos, &gk, &gv, &kpos, &mut go, &mut gl).unwrap();
    let (mut co, mut cl) = (hz(q.len()), hz(m * heads));
    c.attention(&shape, &h(&q), &qpos, &ck, &cv, &kpos, &mut co, &mut cl).unwrap();
    let label = format!("{tag}m={m} n={n} heads={heads}/{kv} d={d}");
    let out_err = max_err(&g.download(&go).unwrap(), &co.to_f32());
    assert!(out_err <= FLASH_OUT_TOL, "{label}: out error {out_err:e}");
    let lse_err = max_err(&g.download(&gl).unwrap(), &cl.to_f32());
    assert!(lse_err <= FLASH_LSE_TOL, "{label}: lse error {lse_err:e}");
    // Into a bf16 output (the bf16 forward's): the f32 output rounded once, value for value
    // (from the kernel's epilogue, or the combine's with key splits), the same log-sum-exp.
    let (mut gb, mut gl2) = (g.zeros_as(q.len(), DType::Bf16).unwrap(), g.zeros(m * heads).unwrap());
    g.attention(&shape, &gq, &qpos, &gk, &gv, &kpos, &mut gb, &mut gl2).unwrap();
    let rounded: Vec<u16> =
        g.download(&go).unwrap().iter().map(|&x| flowprefill_kernels::backend::to_bf16(x)).collect();
    let HostBuf::Bf16(got) = g.download_typed(&gb).unwrap() else { panic!("{label}: a bf16 buffer") };
    let first = got.iter().zip(&rounded).position(|(a, b)| a != b);
    assert!(first.is_none(), "{label}: bf16 output value {first:?} is not the f32 output rounded");
    assert!(g.download(&gl2).unwrap() == g.download(&gl).unwrap(), "{label}: lse with a bf16 output");
    // The per-key mass of the first queries on tensor cores, against the CPU.
    let mp = m.min(32);
    let (qp, lp) = (&q[(m - mp) * heads * d..], &cl.to_f32()[(m - mp) * heads..]);
    let mut gs = g.zeros(n).unwrap();
    g.attention_scores(&shape, &g.upload(qp).unwrap(), &qpos[m - mp..], &gk, &kpos, &g.upload(lp).unwrap(), &mut gs)
        .unwrap();
    let mut cs = hz(n);
    c.attention_scores(&shape, &h(qp), &qpos[m - mp..], &ck, &kpos, &h(lp), &mut cs).unwrap();
    let (gs, cs) = (g.download(&gs).unwrap(), cs.to_f32());
    // Relative (with a floor for keys of almost no mass): the same f32 sums in another order.
    const TC_SCORES_FLOOR: f32 = 1e-3;
    const TC_SCORES_TOL: f32 = 1e-4;
    let worst = flowprefill_kernels::testing::max_rel_diff(&gs, &cs, TC_SCORES_FLOOR);
    assert!(worst <= TC_SCORES_TOL, "{label}: scores error {worst:e}");
}

/// Every configuration of flash2 (the autotuner's candidates), the reference and, on a Hopper
/// GPU, every configuration of the Hopper kernel (after its self-check) on the hardware against the CPU,
/// then the autotuner on synthetic inputs: a decision per class, kept in the decisions file,
/// and the tuned backend still matches the CPU.
#[test]
fn every_attention_configuration_matches_the_cpu_and_tuning_decides() {
    let Some(mut g) = gpu_with(WeightType::Bf16, DType::Bf16) else { return };
    let c = Cpu::with_kv_dtype(DType::Bf16);
    let mut r = StdRng::seed_from_u64(6);
    for k in FlashKernel::every() {
        if k.is_hopper() && !g.has_hopper() {
            flowprefill_kernels::testing::skipped("not a Hopper GPU", format!("{}: no sm_90a attention", g.arch()));
            continue;
        }
        g.fix_attention(k).unwrap_or_else(|e| panic!("{k:?}: {e}"));
        let tag = format!("{} ", k.name());
        for &(shape, scattered) in &[
            ((1024, 4096, 32, 8, 128), false),
            ((1, 8192, 9, 3, 64), false),
            ((333, 1000, 28, 4, 128), true),
            ((700, 700, 9, 3, 64), false),
        ] {
            check_flash(&g, &c, &mut r, shape, scattered, &tag);
        }
    }
    for (d, heads, kv) in [(64, 9, 3), (128, 32, 8)] {
        let entries = g.tune_synthetic(d, heads, kv, 2048).unwrap();
        // A prefill (unless 2048 tokens are narrow on this GPU), a narrow and a decode decision,
        // each of the class of the shape it was timed on.
        let classes: Vec<_> = entries.iter().map(|e| e.key.class).collect();
        {
            use flowprefill_kernels::gpu::tune::ShapeClass::{self, Decode, Narrow};
            assert!(classes.contains(&Narrow) && classes.last() == Some(&Decode), "{classes:?}");
            for e in &entries {
                let (m, n) = e.timed_on;
                let dims =
                    flowprefill_kernels::gpu::ops::AttnDims { m, n, n_heads: heads, n_kv_heads: kv, head_dim: d };
                assert_eq!(ShapeClass::of(dims, g.sm_count()), e.key.class, "{e:?}");
            }
        }
        for e in &entries {
            assert!(e.config < flowprefill_kernels::gpu::tune::CONFIGS, "flash2's or the Hopper kernel's");
            assert!(e.candidates.len() >= flowprefill_kernels::gpu::shapes::FA2_CONFIGS.len());
            println!("tuned d{d} {}: {:?}", e.key.class, e);
        }
        let t =
            flowprefill_kernels::gpu::tune::TuneTable::load(&flowprefill_kernels::gpu::tune::default_path()).unwrap();
        assert!(entries.iter().all(|e| t.get(&e.key) == Some(e)), "the decisions are on file");
    }
    g.auto_attention();
    check_flash(&g, &c, &mut r, (1024, 4096, 32, 8, 128), false, "tuned ");
    check_flash(&g, &c, &mut r, (1, 8192, 9, 3, 64), false, "tuned ");
}

/// The bf16 forward's ops on the GPU against the CPU backend with the same roundings
/// (`Cpu::with_activations(Bf16)`): GEMMs bf16 in and out and with the residual added in the
/// epilogue (beta 1), logits bf16 in and f32 out, RMSNorm of bf16 rows (one warp per row),
/// SiLU-gate, bias and residual adds into bf16. Differences: cuBLAS's summation order, which
/// can move an f32 result across a bf16 rounding boundary (one bf16 unit, 2^-8 relative).
#[test]
fn the_bf16_forward_ops_match_the_cpu_with_its_roundings() {
    let Some(g) = gpu(WeightType::Bf16) else { return };
    let c = Cpu.with_activations(DType::Bf16);
    assert_eq!(g.act_dtype(), DType::Bf16);
    let mut r = StdRng::seed_from_u64(9);
    let (m, k, n) = (33, 576, 136);
    let bf = |v: &[f32]| {
        let mut b = HostBuf::zeros(v.len(), DType::Bf16);
        c.copy_columns(&h(v), v.len(), 0, v.len(), &mut b).unwrap();
        b
    };
    let x = bf(&rand_vec(&mut r, m * k, 1.0));
    let w = Matrix::new(n, k, rand_vec(&mut r, n * k, 0.1)).unwrap();
    let (cw, gw) = (c.matrix(w.clone()).unwrap(), g.matrix(w).unwrap());
    let gx = g.upload_typed(&x).unwrap();
    // One bf16 unit of the output scale.
    let close = |got: &HostBuf, want: &HostBuf, what: &str| {
        assert_eq!(got.dtype(), want.dtype(), "{what}: element type");
        let (a, b) = (got.to_f32(), want.to_f32());
        let scale = b.iter().fold(1f32, |s, v| s.max(v.abs()));
        let e = max_err(&a, &b);
        // One bf16 rounding of outputs of this scale: 2^-7 of it.
        const BF16_OP_TOL: f32 = 1.0 / 128.0;
        assert!(e <= BF16_OP_TOL * scale, "{what}: error {e} at scale {scale}");
    };
    for out_type in [DType::Bf16, DType::F32] {
        let mut want = HostBuf::zeros(m * n, out_type);
        c.matmul_t(&x, m, &cw, &mut want).unwrap();
        let mut got = g.zeros_as(m * n, out_type).unwrap();
        g.matmul_t(&gx, m, &gw, &mut got).unwrap();
        close(&g.download_typed(&got).unwrap(), &want, &format!("GEMM bf16 -> {out_type}"));
    }
    let resid = bf(&rand_vec(&mut r, m * n, 2.0));
    let mut want = resid.clone();
    c.matmul_t_acc(&x, m, &cw, &mut want).unwrap();
    let mut got = g.upload_typed(&resid).unwrap();
    g.matmul_t_acc(&gx, m, &gw, &mut got).unwrap();
    close(&g.download_typed(&got).unwrap(), &want, "GEMM with the residual in the epilogue");

    let nw = rand_vec(&mut r, k, 1.5);
    let mut want = HostBuf::zeros(m * k, DType::Bf16);
    c.rms_norm(&x, &h(&nw), 1e-5, &mut want).unwrap();
    let mut got = g.zeros_as(m * k, DType::Bf16).unwrap();
    g.rms_norm(&gx, &g.upload(&nw).unwrap(), 1e-5, &mut got).unwrap();
    close(&g.download_typed(&got).unwrap(), &want, "RMSNorm of bf16 rows");

    let ffn = k / 2;
    let mut want = HostBuf::zeros(m * ffn, DType::Bf16);
    c.silu_mul(&x, ffn, &mut want).unwrap();
    let mut got = g.zeros_as(m * ffn, DType::Bf16).unwrap();
    g.silu_mul(&gx, ffn, &mut got).unwrap();
    close(&g.download_typed(&got).unwrap(), &want, "SiLU-gate into bf16");

    let bias = rand_vec(&mut r, k, 0.5);
    let (mut want, mut got) = (x.clone(), g.upload_typed(&x).unwrap());
    c.add_bias(&mut want, &h(&bias)).unwrap();
    g.add_bias(&mut got, &g.upload(&bias).unwrap()).unwrap();
    assert_eq!(g.download_typed(&got).unwrap(), want, "bias add into bf16, bit for bit");
}

/// Several chunks batched into one buffer: `attention_rows` reading each chunk's rows in place
/// (pointer offsets) gives bit for bit what `attention` gives on the rows gathered, on the same
/// GPU, into exactly the chunk's rows of the shared output (the rows around it untouched);
/// `append_rows` and contiguous `copy_rows` (one copy each) equal the gathered forms.
#[test]
fn rows_in_place_equal_the_gathered_rows() {
    let Some(g) = gpu_with(WeightType::Bf16, DType::Bf16) else { return };
    let mut r = StdRng::seed_from_u64(17);
    for &(heads, kv, d) in &[(9, 3, 64), (32, 8, 128)] {
        let shape = AttnShape::new(heads, kv, d).unwrap();
        let (qd, kvd) = (heads * d, kv * d);
        // Chunks of 300, 517 and 64 rows, each at local positions 0.., in one batch.
        let lens = [300usize, 517, 64];
        let rows: usize = lens.iter().sum();
        let bf = |v: Vec<f32>| {
            let host = HostBuf::F32(v);
            let mut b = HostBuf::zeros(host.len(), DType::Bf16);
            Cpu.copy_columns(&host, host.len(), 0, host.len(), &mut b).unwrap();
            g.upload_typed(&b).unwrap()
        };
        let q = bf(rand_vec(&mut r, rows * qd, 2.0));
        let (k, v) = (bf(rand_vec(&mut r, rows * kvd, 2.0)), bf(rand_vec(&mut r, rows * kvd, 1.0)));
        let mut out = g.upload(&vec![7.0; rows * qd]).unwrap();
        let mut lse = g.upload(&vec![7.0; rows * heads]).unwrap();
        let mut first = 0;
        for (i, &n) in lens.iter().enumerate() {
            let pos: Vec<u32> = (0..n as u32).collect();
            if i != 1 {
                g.attention_rows(&shape, &q, first, &pos, &k, &v, first, &pos, &mut out, &mut lse).unwrap();
            }
            // The same rows gathered, through `attention`.
            let take = |b: &flowprefill_kernels::cuda::DeviceBuf, width: usize| {
                let mut t = g.zeros_as(n * width, g.dtype(b)).unwrap();
                let (from, to): (Vec<usize>, Vec<usize>) = (0..n).map(|j| (first + j, j)).unzip();
                g.copy_rows(b, &from, &mut t, &to, width).unwrap();
                t
            };
            let (gq, gk, gv) = (take(&q, qd), take(&k, kvd), take(&v, kvd));
            let (mut o, mut l) = (g.zeros(n * qd).unwrap(), g.zeros(n * heads).unwrap());
            g.attention(&shape, &gq, &pos, &gk, &gv, &pos, &mut o, &mut l).unwrap();
            let (all_o, all_l) = (g.download(&out).unwrap(), g.download(&lse).unwrap());
            if i == 1 {
                assert!(
                    all_o[first * qd..(first + n) * qd].iter().all(|&x| x == 7.0),
                    "d={d}: rows not asked for are untouched"
                );
                assert!(all_l[first * heads..(first + n) * heads].iter().all(|&x| x == 7.0));
            } else {
                assert_eq!(&all_o[first * qd..(first + n) * qd], &g.download(&o).unwrap()[..], "d={d} chunk {i}: out");
                assert_eq!(
                    &all_l[first * heads..(first + n) * heads],
                    &g.download(&l).unwrap()[..],
                    "d={d} chunk {i}: lse"
                );
            }
            // append_rows == append of the gathered rows; a contiguous copy_rows == the kernel's.
            let mut a = g.zeros_as(0, DType::Bf16).unwrap();
            g.append(&mut a, &g.zeros_as(kvd, DType::Bf16).unwrap()).unwrap();
            let mut b = g.duplicate(&a).unwrap();
            g.append_rows(&mut a, &k, first, n, kvd).unwrap();
            g.append(&mut b, &gk).unwrap();
            assert_eq!(g.download_typed(&a).unwrap(), g.download_typed(&b).unwrap(), "d={d} chunk {i}: append_rows");
            first += n;
        }
        // A bad range is an error, not a read past the buffer.
        let pos: Vec<u32> = (0..10).collect();
        let e = g.attention_rows(&shape, &q, rows - 5, &pos, &k, &v, 0, &pos, &mut out, &mut lse).unwrap_err();
        assert!(e.to_string().contains("outside"), "{e}");
        assert!(g.append_rows(&mut g.zeros_as(0, DType::Bf16).unwrap(), &k, rows - 1, 2, kvd).is_err());
    }
}

/// `download_many` and `upload_many` (one staging area, one wait) equal the copies one at a
/// time, bit for bit, for f32 and bf16 buffers of odd lengths, an empty one among them, and a
/// second batch larger than the first (the staging area grows).
#[test]
fn batched_copies_equal_copies_one_at_a_time() {
    let Some(g) = gpu_with(WeightType::Bf16, DType::Bf16) else { return };
    let mut r = StdRng::seed_from_u64(29);
    for lens in [vec![3usize, 0, 1000, 77, 4096], vec![70_001, 5, 130_000, 1, 2]] {
        let hosts: Vec<HostBuf> = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let v = rand_vec(&mut r, n, 3.0);
                if i % 2 == 0 {
                    HostBuf::F32(v)
                } else {
                    HostBuf::Bf16(v.iter().map(|&x| flowprefill_kernels::backend::to_bf16(x)).collect())
                }
            })
            .collect();
        let refs: Vec<&HostBuf> = hosts.iter().collect();
        let up = g.upload_many(&refs).unwrap();
        assert_eq!(up.len(), hosts.len());
        for (b, h) in up.iter().zip(&hosts) {
            assert_eq!(&g.download_typed(b).unwrap(), h, "upload_many, {} values", h.len());
        }
        let singles: Vec<_> = hosts.iter().map(|h| g.upload_typed(h).unwrap()).collect();
        let down = g.download_many(&singles.iter().collect::<Vec<_>>()).unwrap();
        assert_eq!(down, hosts, "download_many");
    }
}
