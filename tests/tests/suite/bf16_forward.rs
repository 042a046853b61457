//! The bf16 forward (what a GPU runs by default: bf16 weights, activations and K/V, f32 sums
//! inside GEMMs, norms and softmax) through the whole engine on the CPU backend made with a
//! GPU's roundings (`Cpu::with_kv_dtype(Bf16).with_activations(Bf16)`), against the f32 forward:
//! the same greedy answers for every method, first-token logits within bf16's rounding, on the
//! real SmolLM2 and on tiny llama / qwen2 (biases) / qwen3 (per-head norms) models. The CUDA
//! kernels of that forward are held to the same CPU ops, op by op, by the emulation tests
//! (`kernels-emu/tests/bf16_forward.rs`).

use flowprefill_coordinator::{Job, Method, RunOptions, RunResult, ThreadRanks};
use flowprefill_kernels::{Backend, DType};
use flowprefill_tests::{default_model_path, gate_request, rel_diff, temp_dir, write_tiny_gguf, TinySpec};
use flowprefill_worker::attend::SelfOnly;
use flowprefill_worker::model::Logits;
use flowprefill_worker::{Cpu, LoadedModel, Model};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// First-token logits of the bf16 forward against the f32 forward, relative to the logit
/// range. Every activation is rounded to 8 significant bits (2^-9 relative) at each of about
/// ten stores per layer, through 30 layers, and the weights are rounded once; the errors are
/// independent, so they grow like the square root of their number: 2^-9 x sqrt(300) is about
/// 3.4e-2 at worst. Measured on this request (2026-11-26): 7.3e-3 (cacheclip) to 1.35e-2
/// (none) over the ten methods.
const BF16_FORWARD_LOGIT_TOL: f32 = 3e-2;
/// The first answer token's distribution, KL(f32 || bf16) in nats: measured 1.5e-4 to 9.3e-4.
const BF16_FORWARD_KL_TOL: f64 = 5e-3;
/// Tiny random models (3 layers, 64 wide): fewer roundings; measured 1.6e-3 to 1.8e-3.
const TINY_LOGIT_TOL: f32 = 1e-2;

/// The CPU backend with a GPU's bf16 forward.
fn gpu_numerics() -> Cpu {
    Cpu::with_kv_dtype(DType::Bf16).with_activations(DType::Bf16)
}

fn lm(bf16: bool) -> Arc<LoadedModel<Cpu>> {
    static F32: OnceLock<Arc<LoadedModel<Cpu>>> = OnceLock::new();
    static BF16: OnceLock<Arc<LoadedModel<Cpu>>> = OnceLock::new();
    let (cell, be) = if bf16 { (&BF16, gpu_numerics()) } else { (&F32, Cpu) };
    cell.get_or_init(|| Arc::new(LoadedModel::load(&default_model_path(), be).expect("load"))).clone()
}

fn run(bf16: bool, ranks: usize, opts: RunOptions) -> RunResult {
    let mut world = ThreadRanks::new(lm(bf16), ranks, 1 << 30, Duration::from_secs(120)).expect("ranks");
    let job = Job { request: gate_request(), options: RunOptions { max_new_tokens: 6, ..opts } };
    world.run(&job, &mut |_| true).unwrap_or_else(|e| panic!("bf16 forward {bf16}, {ranks} ranks: {e}"))
}

fn softmax(x: &[f32]) -> Vec<f64> {
    let m = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let e: Vec<f64> = x.iter().map(|&v| (v as f64 - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.into_iter().map(|v| v / s).collect()
}

/// KL(p || q) of two logit vectors' softmaxes, in nats.
fn kl(p: &[f32], q: &[f32]) -> f64 {
    let (p, q) = (softmax(p), softmax(q));
    p.iter().zip(&q).filter(|(a, _)| **a > 0.0).map(|(a, b)| a * (a / b.max(1e-300)).ln()).sum()
}

fn argmax(x: &[f32]) -> usize {
    x.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0
}

#[test]
fn the_bf16_forward_answers_like_the_f32_forward_for_every_method() {
    assert_eq!(lm(true).model.backend().act_dtype(), DType::Bf16);
    // Every method but the trained ones, which need an adapter trained for this model
    // (kvpacket.rs and lookahead.rs train tiny ones and test them on the f32 forward).
    let methods = Method::ALL.into_iter().filter(|m| !matches!(m, Method::Kvpacket | Method::Lookahead));
    for m in methods {
        let opts = RunOptions { method: m, ratio: 0.15, ..Default::default() };
        let ranks = if matches!(m, Method::Ring | Method::Star) { 2 } else { 1 };
        let (f, b) = (run(false, ranks, opts.clone()), run(true, ranks, opts));
        let d = rel_diff(&b.first_logits, &f.first_logits);
        let k = kl(&f.first_logits, &b.first_logits);
        eprintln!(
            "{m}: bf16 vs f32 forward: first-token logits differ by {d:.2e} of their range, KL {k:.2e} nats, top-1 {}; {:?}",
            if argmax(&b.first_logits) == argmax(&f.first_logits) { "same" } else { "DIFFERENT" },
            b.answer
        );
        assert!(d > 0.0, "{m}: the bf16 forward gave the f32 logits bit for bit: it did not run in bf16");
        assert_eq!(b.tokens, f.tokens, "{m}: the greedy answer changed with the bf16 forward");
        assert!(d <= BF16_FORWARD_LOGIT_TOL, "{m}: relative logit difference {d}");
        assert!(k <= BF16_FORWARD_KL_TOL, "{m}: KL {k}");
    }
}

#[test]
fn the_bf16_forward_of_tiny_llama_qwen2_and_qwen3_stays_within_bf16_rounding() {
    for arch in ["llama", "qwen2", "qwen3"] {
        let dir = temp_dir(&format!("bf16-forward-{arch}"));
        let path = dir.join("tiny.gguf");
        write_tiny_gguf(&path, &TinySpec { vocab: 101, layers: 3, seed: 5, ..TinySpec::new(arch) });
        let f32m = Model::load(&path, Cpu).expect("f32 model");
        let bf16m = Model::load(&path, gpu_numerics()).expect("bf16 model");
        let tokens: Vec<u32> = (0..61).map(|i| (i * 37 % 101) as u32).collect();
        let positions: Vec<u32> = (0..61).collect();
        let a = f32m.forward(&tokens, &positions, &mut SelfOnly, Logits::All).expect("f32 forward").logits;
        let b = bf16m.forward(&tokens, &positions, &mut SelfOnly, Logits::All).expect("bf16 forward").logits;
        let d = rel_diff(&b, &a);
        let rows = a.len() / 101;
        let same = (0..rows).filter(|&r| argmax(&a[r * 101..][..101]) == argmax(&b[r * 101..][..101])).count();
        eprintln!(
            "{arch}: bf16 vs f32 forward, logits differ by {d:.2e} of their range; top-1 equal in {same}/{rows} rows"
        );
        assert!(d > 0.0 && d <= TINY_LOGIT_TOL, "{arch}: relative logit difference {d}");
        assert!(same * 10 >= rows * 9, "{arch}: top-1 equal in only {same} of {rows} rows");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
