//! `cargo run --release -p flowprefill-kernels --features cuda --example cuda_attention_bench`
//! (`-- --quick` for fewer shapes and runs; `-- --sdpa FILE` for PyTorch's figures beside ours:
//! FILE is what `scripts/sdpa_baseline.py` printed on the same GPU, best in the same call): the
//! CUDA attention kernels on prefill and decode
//! shapes, the tensor-core kernel (bf16 K/V, `flash.cu`) beside the simple FP32-core kernel
//! (f32 K/V, `attention.cu`). Prefill: median ms, TFLOP/s (4 x head_dim x heads x visible
//! pairs, the convention of FlashAttention's and PyTorch's figures) and the share of the dense
//! BF16 tensor peak of the device's spec sheet (H100 SXM 989). Decode (one query over N keys):
//! median ms and the K/V bytes read per second. Each call is timed on the device (events around
//! it, as `scripts/sdpa_baseline.py` times PyTorch's SDPA) and on the host (the stream
//! synchronized around it, so launch and wait included), after a warm-up; the TFLOP/s are the
//! device's. The tensor-core calls take bf16 queries, as the bf16 forward gives them (f32 ones
//! would add a conversion the forward does not run). Needs a GPU.

use flowprefill_kernels::attention::AttnShape;
use flowprefill_kernels::cuda::{devices, CudaBackend, WeightType};
use flowprefill_kernels::{Backend, DType};
use std::time::Instant;

/// Spec-sheet dense BF16 tensor-core peaks (TFLOP/s) and memory bandwidths (TB/s), by a part of
/// the device name (the first match wins: put specific names first).
const PEAKS: &[(&str, f64, f64)] = &[
    ("H100 PCIe", 756.0, 2.0),
    ("H100 NVL", 835.0, 3.9),
    ("H100", 989.0, 3.35),
    ("H200", 989.0, 4.8),
    ("A100", 312.0, 2.0),
    ("L40S", 362.0, 0.86),
    ("L4", 121.0, 0.3),
    ("RTX 4090", 165.0, 1.0),
];

/// PyTorch SDPA's prefill TFLOP/s by (n, heads, kv heads, head_dim), from the output of
/// `scripts/sdpa_baseline.py` (rows `n heads/kv d ms TF/s` before its decode table). No fixed
/// figures: PyTorch's SDPA on one H100 went from 320 TFLOP/s (2026-11-23) to 573 (torch
/// 2.11 + CUDA 13, 2026-11-28) at 8192 32/8 d128, so only the same GPU and session compare.
fn sdpa_figures(path: &str) -> Vec<((usize, usize, usize, usize), f64)> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| {
        eprintln!("--sdpa {path}: {e} (give the output of scripts/sdpa_baseline.py)");
        std::process::exit(2);
    });
    let mut rows = Vec::new();
    for line in text.lines() {
        if line.starts_with("decode") {
            break;
        }
        let f: Vec<&str> = line.split_whitespace().collect();
        let heads = f.get(1).and_then(|h| h.split_once('/'));
        if let ([n, _, d, _, tf], Some((h, kv))) = (f.as_slice(), heads) {
            if let (Ok(n), Ok(h), Ok(kv), Ok(d), Ok(tf)) = (n.parse(), h.parse(), kv.parse(), d.parse(), tf.parse()) {
                rows.push(((n, h, kv, d), tf));
            }
        }
    }
    if rows.is_empty() {
        eprintln!(
            "--sdpa {path}: no prefill rows (n heads/kv d ms TF/s) in it; give the output of scripts/sdpa_baseline.py"
        );
        std::process::exit(2);
    }
    rows
}

fn fill(len: usize, seed: usize) -> Vec<f32> {
    (0..len).map(|i| (((i + seed) * 2654435761) % 1000) as f32 / 1000.0 - 0.5).collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

struct Bufs {
    q: flowprefill_kernels::cuda::DeviceBuf,
    k: flowprefill_kernels::cuda::DeviceBuf,
    v: flowprefill_kernels::cuda::DeviceBuf,
    out: flowprefill_kernels::cuda::DeviceBuf,
    lse: flowprefill_kernels::cuda::DeviceBuf,
}

fn buffers(be: &CudaBackend, m: usize, n: usize, h: usize, kv: usize, d: usize, dtype: DType) -> Bufs {
    let ok = |e: flowprefill_kernels::KernelError| -> ! { panic!("{e}") };
    let typed = |rows: usize, width: usize, seed| {
        let mut b = be.zeros_as(rows * width, dtype).unwrap_or_else(|e| ok(e));
        be.copy_columns(&be.upload(&fill(rows * width, seed)).unwrap_or_else(|e| ok(e)), width, 0, width, &mut b)
            .unwrap_or_else(|e| ok(e));
        b
    };
    Bufs {
        q: typed(m, h * d, 1),
        k: typed(n, kv * d, 2),
        v: typed(n, kv * d, 3),
        out: be.zeros(m * h * d).unwrap_or_else(|e| ok(e)),
        lse: be.zeros(m * h).unwrap_or_else(|e| ok(e)),
    }
}

/// Median seconds of `runs` calls of `attention` (after one warm-up): on the device (events
/// around the call) and on the host (the stream synchronized before and after).
fn time(be: &CudaBackend, shape: &AttnShape, b: &mut Bufs, qpos: &[u32], kpos: &[u32], runs: usize) -> (f64, f64) {
    let fail = |e: flowprefill_kernels::KernelError| -> ! { panic!("{e}") };
    let mut run = || -> (f64, f64) {
        be.synchronize().unwrap_or_else(|e| fail(e));
        let t = Instant::now();
        let start = be.mark().unwrap_or_else(|e| fail(e));
        be.attention(shape, &b.q, qpos, &b.k, &b.v, kpos, &mut b.out, &mut b.lse).unwrap_or_else(|e| fail(e));
        let end = be.mark().unwrap_or_else(|e| fail(e));
        be.synchronize().unwrap_or_else(|e| fail(e));
        let wall = t.elapsed().as_secs_f64();
        (be.seconds_between(&start, &end).unwrap_or_else(|e| fail(e)), wall)
    };
    run();
    let (device, wall): (Vec<f64>, Vec<f64>) = (0..runs).map(|_| run()).unzip();
    (median(device), median(wall))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let sdpa = match args.iter().position(|a| a == "--sdpa") {
        Some(i) => match args.get(i + 1) {
            Some(path) => sdpa_figures(path),
            None => {
                eprintln!("--sdpa needs a file: the output of scripts/sdpa_baseline.py");
                std::process::exit(2);
            }
        },
        None => Vec::new(),
    };
    let list = match devices() {
        Ok(l) if !l.is_empty() => l,
        other => {
            eprintln!("no CUDA device: {}", other.err().map(|e| e.to_string()).unwrap_or_else(|| "none".into()));
            std::process::exit(2);
        }
    };
    let d = &list[0];
    let (peak, bw) = PEAKS.iter().find(|(n, _, _)| d.name.contains(n)).map_or((None, None), |p| (Some(p.1), Some(p.2)));
    let be = CudaBackend::new(0, WeightType::Bf16, DType::Bf16).unwrap_or_else(|e| panic!("{e}"));
    println!(
        "{} (sm_{}{}, {} SMs), dense BF16 peak {}, memory {}",
        d.name,
        d.compute_capability.0,
        d.compute_capability.1,
        be.sm_count(),
        peak.map_or("unknown".into(), |p| format!("{p} TFLOP/s")),
        bw.map_or("unknown".into(), |b| format!("{b} TB/s"))
    );
    // FLOWPREFILL_FLASH_KERNEL=hopper: the Hopper kernel, once its self-check passed here.
    let kernel = be.fixed_attention().map_or_else(
        || "the autotuner's choice per head size (`flowprefill tune` prints it)".to_string(),
        |k| k.name(),
    );
    println!("tensor-core attention kernel: {kernel}");
    let runs = if quick { 5 } else { 21 };
    println!(
        "\nprefill (causal), median of {runs}; old = simple kernel (f32 K/V, FP32 cores), new = tensor cores (bf16 Q/K/V);\n\
         ms and TF/s on the device (events around the call), host ms with launch and wait"
    );
    println!(
        "{:>6} {:>9} {:>4} {:>11} {:>9} {:>11} {:>9} {:>9} {:>7} {:>7} {:>12}",
        "n", "heads", "d", "old ms", "old TF/s", "new ms", "new TF/s", "host ms", "% peak", "x old", "x SDPA"
    );
    let mut shapes: Vec<(usize, usize, usize, usize)> = vec![
        (2048, 9, 3, 64),
        (4096, 14, 2, 64),
        (8192, 14, 2, 64),
        (2048, 32, 8, 128),
        (8192, 32, 8, 128),
        (16384, 32, 8, 128),
        (32768, 32, 8, 128),
        (32768, 14, 2, 64),
    ];
    if quick {
        shapes.retain(|s| s.0 <= 8192);
    }
    for &(n, h, kv, dim) in &shapes {
        let shape = AttnShape::new(h, kv, dim).unwrap_or_else(|e| panic!("{e}"));
        let pos: Vec<u32> = (0..n as u32).collect();
        let flops = (n * (n + 1)) as f64 / 2.0 * (h * dim) as f64 * 4.0;
        let mut nb = buffers(&be, n, n, h, kv, dim, DType::Bf16);
        let (new, host) = time(&be, &shape, &mut nb, &pos, &pos, runs);
        drop(nb);
        // The old kernel takes seconds at 32K: a few runs, and only up to 16K unless asked.
        let old = (n <= 16384 || std::env::args().any(|a| a == "--old-all")).then(|| {
            let mut ob = buffers(&be, n, n, h, kv, dim, DType::F32);
            time(&be, &shape, &mut ob, &pos, &pos, 3).0
        });
        let tf = |s: f64| flops / s / 1e12;
        let theirs = sdpa.iter().find(|s| s.0 == (n, h, kv, dim)).map(|s| s.1);
        println!(
            "{n:>6} {:>9} {dim:>4} {:>11} {:>9} {:>11.3} {:>9.1} {:>9.3} {:>7} {:>7} {:>12}",
            format!("{h}/{kv}"),
            old.map_or("-".into(), |s| format!("{:.3}", s * 1e3)),
            old.map_or("-".into(), |s| format!("{:.2}", tf(s))),
            new * 1e3,
            tf(new),
            host * 1e3,
            peak.map_or("-".into(), |p| format!("{:.1}%", 100.0 * tf(new) / p)),
            old.map_or("-".into(), |s| format!("{:.0}x", s / new)),
            theirs.map_or("-".into(), |t| format!("{:.2}x", tf(new) / t)),
        );
    }
    println!("\ndecode (one query over n keys), median of {runs}");
    println!("{:>6} {:>9} {:>4} {:>11} {:>11} {:>9} {:>9}", "n", "heads", "d", "old ms", "new ms", "GB/s", "% of BW");
    for &(n, h, kv, dim) in &[(8192, 9, 3, 64), (32768, 9, 3, 64), (8192, 32, 8, 128), (32768, 32, 8, 128)] {
        let shape = AttnShape::new(h, kv, dim).unwrap_or_else(|e| panic!("{e}"));
        let kpos: Vec<u32> = (0..n as u32).collect();
        let qpos = [n as u32];
        let mut nb = buffers(&be, 1, n, h, kv, dim, DType::Bf16);
        let new = time(&be, &shape, &mut nb, &qpos, &kpos, runs).0;
        drop(nb);
        let mut ob = buffers(&be, 1, n, h, kv, dim, DType::F32);
        let old = time(&be, &shape, &mut ob, &qpos, &kpos, runs.min(5)).0;
        let gbs = (2 * n * kv * dim * 2) as f64 / new / 1e9;
        println!(
            "{n:>6} {:>9} {dim:>4} {:>11.3} {:>11.3} {gbs:>9.0} {:>9}",
            format!("{h}/{kv}"),
            old * 1e3,
            new * 1e3,
            bw.map_or("-".into(), |b| format!("{:.1}%", 100.0 * gbs / (b * 1e3)))
        );
    }
}
