//! Every op of the CUDA backend against the CPU backend on the same inputs (odd shapes,
//! grouped-query heads, no visible key). Needs a GPU: without one each test says SKIPPED and
//! returns (it does not pass silently: run `scripts/gpu-check.sh` on a GPU machine).
#![cfg(feature = "cuda")]

use flowprefill_kernels::attention::AttnShape;
use flowprefill_kernels::cuda::{CudaBackend, WeightType};
use flowprefill_kernels::matmul::Matrix;
use flowprefill_kernels::rope::{RopeStyle, RopeTable};
use flowprefill_kernels::{Backend, Cpu};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// f32 ops on the GPU against the CPU: different summation orders, device expf.
const OP_TOL: f32 = 1e-4;
/// bf16 GEMM against the f32 CPU GEMM: inputs rounded to 8 significant bits, relative to the
/// output scale.
const BF16_GEMM_TOL: f32 = 2e-2;

fn gpu(weights: WeightType) -> Option<CudaBackend> {
    match flowprefill_kernels::cuda::devices() {
        Ok(d) if !d.is_empty() => Some(CudaBackend::new(0, weights).unwrap_or_else(|e| panic!("{e}"))),
        other => {
            eprintln!(
                "SKIPPED (no CUDA device): {}",
                other.err().map(|e| e.to_string()).unwrap_or_else(|| "none".into())
            );
            None
        }
    }
}

fn rand_vec(r: &mut StdRng, n: usize, amp: f32) -> Vec<f32> {
    (0..n).map(|_| r.random_range(-amp..amp)).collect()
}

fn max_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(&x, &y)| {
            if x.is_infinite() || y.is_infinite() {
                if x == y {
                    0.0
                } else {
                    f32::INFINITY
                }
            } else {
                (x - y).abs() / y.abs().max(1.0)
            }
        })
        .fold(0.0, f32::max)
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
    let mut co = vec![0f32; x.len()];
    c.rms_norm(&x, &w, 1e-5, &mut co).unwrap();
    assert!(max_err(&g.download(&go).unwrap(), &co) <= OP_TOL, "rms_norm");

    let table = RopeTable::new(64, 64, 10000.0, RopeStyle::Neox, None, 50).unwrap();
    let pos: Vec<u32> = vec![0, 3, 49, 50, 900];
    let xr = rand_vec(&mut r, pos.len() * 3 * 64, 2.0);
    let mut gxr = g.upload(&xr).unwrap();
    g.rope(&mut gxr, 3, &pos, &table).unwrap();
    let mut cxr = xr.clone();
    c.rope(&mut cxr, 3, &pos, &table).unwrap();
    assert!(max_err(&g.download(&gxr).unwrap(), &cxr) <= OP_TOL, "rope");

    let gu = rand_vec(&mut r, rows * 2 * 33, 4.0);
    let mut gs = g.zeros(rows * 33).unwrap();
    g.silu_mul(&g.upload(&gu).unwrap(), 33, &mut gs).unwrap();
    let mut cs = vec![0f32; rows * 33];
    c.silu_mul(&gu, 33, &mut cs).unwrap();
    assert!(max_err(&g.download(&gs).unwrap(), &cs) <= OP_TOL, "silu_mul");

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
        let (mut co, mut cl) = (vec![0f32; q.len()], vec![0f32; m * heads]);
        c.attention(&shape, &q, &qpos, &k, &v, &kpos, &mut co, &mut cl).unwrap();
        let (gq, gk, gv) = (g.upload(&q).unwrap(), g.upload(&k).unwrap(), g.upload(&v).unwrap());
        let (mut go, mut gl) = (g.zeros(q.len()).unwrap(), g.zeros(m * heads).unwrap());
        g.attention(&shape, &gq, &qpos, &gk, &gv, &kpos, &mut go, &mut gl).unwrap();
        assert!(max_err(&g.download(&go).unwrap(), &co) <= OP_TOL, "attention out m={m} n={n}");
        assert!(max_err(&g.download(&gl).unwrap(), &cl) <= OP_TOL, "attention lse m={m} n={n}");
        let mut cs = vec![0f32; n];
        c.attention_scores(&shape, &q, &qpos, &k, &kpos, &cl, &mut cs).unwrap();
        let mut gs = g.zeros(n).unwrap();
        g.attention_scores(&shape, &gq, &qpos, &gk, &kpos, &gl, &mut gs).unwrap();
        assert!(max_err(&g.download(&gs).unwrap(), &cs) <= OP_TOL * (m * heads) as f32, "scores m={m} n={n}");
    }
}

#[test]
fn gemms_match_the_cpu_in_f32_and_in_bf16() {
    let mut r = StdRng::seed_from_u64(3);
    let (m, k, n) = (33, 577, 129);
    let x = rand_vec(&mut r, m * k, 1.0);
    let w = Matrix::new(n, k, rand_vec(&mut r, n * k, 0.1)).unwrap();
    let mut want = vec![0f32; m * n];
    Cpu.matmul_t(&x, m, &w, &mut want).unwrap();
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
        let mut cemb = vec![0f32; ids.len() * k];
        Cpu.embedding(&w, &ids, &mut cemb).unwrap();
        assert!(max_err(&g.download(&emb).unwrap(), &cemb) <= tol, "{weights:?} embedding");
    }
}
