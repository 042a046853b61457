//! `cargo run --release -p flowprefill-kernels --features cuda --example cuda_attention_bench`:
//! the CUDA attention kernel on causal prefill shapes, in TFLOP/s and as a share of the
//! device's FP32 (non-tensor-core) peak from its spec sheet. The kernel runs on the FP32 cores
//! (no tensor cores yet), so that is the peak it can be held to. Needs a GPU.

use flowprefill_kernels::attention::AttnShape;
use flowprefill_kernels::cuda::{devices, CudaBackend, WeightType};
use flowprefill_kernels::Backend;
use std::time::Instant;

/// Spec-sheet FP32 peaks (TFLOP/s, non-tensor), by a part of the device name.
const FP32_PEAK_TFLOPS: &[(&str, f64)] = &[
    ("H100 PCIe", 51.2),
    ("H100", 66.9),
    ("H200", 66.9),
    ("A100", 19.5),
    ("L40S", 91.6),
    ("L4", 30.3),
    ("A10", 31.2),
    ("RTX 4090", 82.6),
    ("V100", 15.7),
];

fn main() {
    let list = match devices() {
        Ok(l) if !l.is_empty() => l,
        other => {
            eprintln!("no CUDA device: {}", other.err().map(|e| e.to_string()).unwrap_or_else(|| "none".into()));
            std::process::exit(2);
        }
    };
    let d = &list[0];
    let peak = FP32_PEAK_TFLOPS.iter().find(|(n, _)| d.name.contains(n)).map(|p| p.1);
    println!(
        "{} (sm_{}{}), FP32 peak {}",
        d.name,
        d.compute_capability.0,
        d.compute_capability.1,
        peak.map_or("unknown".into(), |p| format!("{p} TFLOP/s"))
    );
    let be = CudaBackend::new(0, WeightType::Bf16).unwrap_or_else(|e| panic!("{e}"));
    // (tokens, query heads, KV heads, head_dim): SmolLM2-135M, Qwen2.5-0.5B, Llama-3.1-8B.
    for &(n, h, kv, dim) in
        &[(2048usize, 9usize, 3usize, 64usize), (8192, 14, 2, 64), (8192, 32, 8, 128), (32768, 32, 8, 128)]
    {
        let shape = AttnShape::new(h, kv, dim).unwrap_or_else(|e| panic!("{e}"));
        let fill = |len: usize| (0..len).map(|i| ((i * 2654435761) % 1000) as f32 / 1000.0 - 0.5).collect::<Vec<f32>>();
        let (q, k, v) = (
            be.upload(&fill(n * h * dim)).unwrap(),
            be.upload(&fill(n * kv * dim)).unwrap(),
            be.upload(&fill(n * kv * dim)).unwrap(),
        );
        let pos: Vec<u32> = (0..n as u32).collect();
        let (mut out, mut lse) = (be.zeros(n * h * dim).unwrap(), be.zeros(n * h).unwrap());
        let mut run = || {
            be.attention(&shape, &q, &pos, &k, &v, &pos, &mut out, &mut lse).unwrap_or_else(|e| panic!("{e}"));
            be.synchronize().unwrap_or_else(|e| panic!("{e}"));
        };
        run();
        let runs = 5;
        let mut times: Vec<f64> = (0..runs)
            .map(|_| {
                let t = Instant::now();
                run();
                t.elapsed().as_secs_f64()
            })
            .collect();
        times.sort_by(|a, b| a.total_cmp(b));
        let s = times[runs / 2];
        // Causal: n^2/2 visible pairs, two products of 2*head_dim flops per pair and head.
        let tflops = (n * n) as f64 / 2.0 * (h * dim) as f64 * 4.0 / s / 1e12;
        let share = peak.map_or(String::new(), |p| format!("  {:.1}% of peak", 100.0 * tflops / p));
        println!("attention n={n:>6} heads {h}/{kv} d={dim}: {:9.3} ms  {tflops:7.2} TFLOP/s{share}", s * 1e3);
    }
}
