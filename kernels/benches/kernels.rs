//! `cargo bench -p flowprefill-kernels`: the attention kernel (causal prefill and one-query
//! decode), the weight GEMM and RMSNorm at SmolLM2-135M shapes, on divan.
//!
//! Throughput columns: `item/s` counts floating-point operations (so `Gitem/s` reads GFLOP/s)
//! for the causal attention and the GEMMs; `B/s` counts the K/V bytes read by a decode step
//! and the rows RMSNorm reads.
//! Filter like any divan bench: `cargo bench -p flowprefill-kernels -- matmul`.

use divan::counter::{BytesCount, ItemsCount};
use divan::Bencher;
use flowprefill_kernels::attention::{attention, AttnShape, KvRef};
use flowprefill_kernels::matmul::{matmul_t, Matrix};
use flowprefill_kernels::norm::rms_norm;

fn main() {
    println!("threads: {}, simd: {:?}", rayon::current_num_threads(), flowprefill_kernels::simd::level());
    divan::main();
}

fn fill(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2654435761).max(1);
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s as f32 / u32::MAX as f32) - 0.5
        })
        .collect()
}

/// SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64.
fn shape() -> AttnShape {
    AttnShape::new(9, 3, 64).unwrap_or_else(|e| panic!("{e}"))
}

struct Kv {
    k: Vec<f32>,
    v: Vec<f32>,
    pos: Vec<u32>,
}

fn kv(n: usize) -> Kv {
    let s = shape();
    Kv { k: fill(n * s.kv_dim(), 2), v: fill(n * s.kv_dim(), 3), pos: (0..n as u32).collect() }
}

#[divan::bench(args = [512, 2048, 8000], sample_count = 10, sample_size = 1)]
fn attention_causal(b: Bencher, n: usize) {
    let s = shape();
    let q = fill(n * s.q_dim(), 1);
    let c = kv(n);
    let (mut out, mut lse) = (vec![0f32; q.len()], vec![0f32; n * s.n_heads]);
    // Causal: about n^2/2 visible pairs, 2 products of 2*head_dim flops per pair and head.
    let flops = (n * n) as f64 / 2.0 * s.n_heads as f64 * s.head_dim as f64 * 4.0;
    b.counter(ItemsCount::new(flops as u64)).bench_local(|| {
        attention(&s, &q, &c.pos, KvRef { k: &c.k, v: &c.v, pos: &c.pos }, &mut out, &mut lse)
            .unwrap_or_else(|e| panic!("{e}"))
    });
}

#[divan::bench(args = [512, 2048, 8000], sample_count = 30)]
fn attention_decode(b: Bencher, n: usize) {
    let s = shape();
    let q = fill(s.q_dim(), 4);
    let c = kv(n);
    let qpos = [n as u32];
    let (mut out, mut lse) = (vec![0f32; s.q_dim()], vec![0f32; s.n_heads]);
    b.counter(BytesCount::new(2 * c.k.len() * 4)).bench_local(|| {
        attention(&s, &q, &qpos, KvRef { k: &c.k, v: &c.v, pos: &c.pos }, &mut out, &mut lse)
            .unwrap_or_else(|e| panic!("{e}"))
    });
}

/// `(rows, inner, outputs)`: the QKV, gate-up and down projections of a 2048-token prefill
/// forward, and one decoded token's gate-up.
#[divan::bench(args = [(2048, 576, 960), (2048, 576, 3072), (2048, 1536, 576), (1, 576, 3072)], sample_count = 10)]
fn matmul(b: Bencher, (m, k, n): (usize, usize, usize)) {
    let x = fill(m * k, 5);
    let w = Matrix::new(n, k, fill(n * k, 6)).unwrap_or_else(|e| panic!("{e}"));
    let mut out = vec![0f32; m * n];
    b.counter(ItemsCount::new(2 * m * k * n))
        .bench_local(|| matmul_t(&x, m, &w, &mut out).unwrap_or_else(|e| panic!("{e}")));
}

/// RMSNorm of `rows` rows of d_model 576 (the fast path: no row overflows f32).
#[divan::bench(args = [1, 64, 2048], sample_count = 30)]
fn rms_norm_rows(b: Bencher, rows: usize) {
    let dim = 576;
    let (x, w) = (fill(rows * dim, 7), fill(dim, 8));
    let mut out = vec![0f32; x.len()];
    b.counter(BytesCount::new(x.len() * 4))
        .bench_local(|| rms_norm(&x, &w, 1e-5, &mut out).unwrap_or_else(|e| panic!("{e}")));
}
