//! `cargo bench -p flowprefill-kernels`: throughput of the attention kernel (causal prefill
//! and single-query decode) and of the weight GEMM at SmolLM2-135M shapes. Prints GFLOP/s,
//! median of several runs.

use flowprefill_kernels::attention::{attention, AttnShape, KvRef};
use flowprefill_kernels::matmul::{matmul_t, Matrix};
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn time<F: FnMut()>(runs: usize, mut f: F) -> f64 {
    f();
    median(
        (0..runs)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .collect(),
    )
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

fn main() {
    let filter: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let want = |name: &str| filter.is_empty() || filter.iter().any(|f| name.contains(f.as_str()));
    let shape = AttnShape::new(9, 3, 64).unwrap();
    println!("threads: {}, simd: {:?}", rayon::current_num_threads(), flowprefill_kernels::simd::level());
    for &n in &[512usize, 2048, 8000] {
        if !want("attention") {
            break;
        }
        let q = fill(n * shape.q_dim(), 1);
        let k = fill(n * shape.kv_dim(), 2);
        let v = fill(n * shape.kv_dim(), 3);
        let pos: Vec<u32> = (0..n as u32).collect();
        let mut out = vec![0f32; q.len()];
        let mut lse = vec![0f32; n * 9];
        let s = time(5, || attention(&shape, &q, &pos, KvRef { k: &k, v: &v, pos: &pos }, &mut out, &mut lse).unwrap());
        // Causal: about n^2/2 visible pairs, 2 GEMMs of 2*d flops per pair and head.
        let flops = (n * n) as f64 / 2.0 * 9.0 * 64.0 * 4.0;
        println!("attention causal n={n:5}: {:8.2} ms  {:6.1} GFLOP/s", s * 1e3, flops / s / 1e9);
        let qpos = [n as u32];
        let q1 = fill(shape.q_dim(), 4);
        let mut o1 = vec![0f32; shape.q_dim()];
        let mut l1 = vec![0f32; 9];
        let s =
            time(20, || attention(&shape, &q1, &qpos, KvRef { k: &k, v: &v, pos: &pos }, &mut o1, &mut l1).unwrap());
        println!(
            "attention decode  n={n:5}: {:8.3} ms  {:6.2} GB/s of K/V",
            s * 1e3,
            (2 * k.len() * 4) as f64 / s / 1e9
        );
    }
    for &(m, k, nn) in &[(2048usize, 576usize, 960usize), (2048, 576, 3072), (2048, 1536, 576), (1, 576, 3072)] {
        if !want("matmul") {
            break;
        }
        let x = fill(m * k, 5);
        let w = Matrix::new(nn, k, fill(nn * k, 6)).unwrap();
        let mut out = vec![0f32; m * nn];
        let s = time(5, || matmul_t(&x, m, &w, &mut out).unwrap());
        println!("matmul {m}x{k}x{nn}: {:8.3} ms  {:6.1} GFLOP/s", s * 1e3, 2.0 * (m * k * nn) as f64 / s / 1e9);
    }
}
