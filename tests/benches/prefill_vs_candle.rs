//! Full-prefill throughput of flowprefill next to candle-transformers' `quantized_llama` with
//! f32 weights (`CANDLE_DEQUANTIZE_ALL=1`), same model file, same tokens, same process.
//!
//! `cargo bench -p flowprefill-tests --bench prefill_vs_candle -- --tokens 512,2048,4096,8000 --runs 3`
//!
//! candle's quantized_llama refuses prompts beyond its hard-coded MAX_SEQ_LEN (4096); those
//! rows print n/a for candle.

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama;
use flowprefill_tests::default_model_path;
use flowprefill_worker::corpus;
use flowprefill_worker::generate::{prefill_into, DEFAULT_PREFILL_CHUNK};
use flowprefill_worker::kv::{KeyForm, KvCache};
use flowprefill_worker::{Cpu, LoadedModel};
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

fn main() {
    std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
    let lengths: Vec<usize> = arg("--tokens")
        .unwrap_or_else(|| "512,2048,4096,8000".into())
        .split(',')
        .map(|s| s.trim().parse().expect("--tokens: numbers"))
        .collect();
    let runs: usize = arg("--runs").map_or(3, |s| s.parse().expect("--runs: a number"));
    let path = default_model_path();
    let lm = LoadedModel::load(&path, Cpu).expect("load");
    let model = &lm.model;
    let cfg = model.config();
    let max_len = lengths.iter().copied().max().unwrap_or(0);
    let ids_all = lm.tokenizer.encode_text(&corpus::prose(1, max_len * 6)).expect("tokenize");

    let mut file = std::fs::File::open(&path).expect("open");
    let content = gguf_file::Content::read(&mut file).expect("gguf");
    let mut candle = quantized_llama::ModelWeights::from_gguf(content, &mut file, &Device::Cpu).expect("candle load");

    println!("threads {}, {} runs per length (+1 warm-up), median", flowprefill_kernels::simd::threads(), runs);
    println!("{:>7} {:>14} {:>14} {:>9}", "tokens", "ours tok/s", "candle tok/s", "speedup");
    for &n in &lengths {
        let ids = &ids_all[..n];
        let ours: Vec<f64> = (0..=runs)
            .map(|_| {
                let mut cache =
                    KvCache::new(model.backend(), cfg.n_layers, cfg.kv_dim(), KeyForm::Rotated).expect("cache");
                let t = Instant::now();
                prefill_into(model, &mut cache, ids, 0, DEFAULT_PREFILL_CHUNK).expect("prefill");
                t.elapsed().as_secs_f64()
            })
            .skip(1)
            .collect();
        let ours = n as f64 / median(ours);
        let theirs = if n <= quantized_llama::MAX_SEQ_LEN {
            let input = Tensor::new(ids, &Device::Cpu).and_then(|t| t.unsqueeze(0)).expect("input");
            let times: Vec<f64> = (0..=runs)
                .map(|_| {
                    let t = Instant::now();
                    let out = candle.forward(&input, 0).expect("candle forward");
                    drop(out);
                    t.elapsed().as_secs_f64()
                })
                .skip(1)
                .collect();
            Some(n as f64 / median(times))
        } else {
            None
        };
        match theirs {
            Some(c) => println!("{n:>7} {ours:>14.1} {c:>14.1} {:>8.2}x", ours / c),
            None => println!("{n:>7} {ours:>14.1} {:>14} {:>9}", "n/a (>4096)", "-"),
        }
    }
}
