//! Our forward against candle-transformers' implementations on the same GGUF files.
//!
//! Real model: SmolLM2-135M-Instruct through `quantized_llama` with every weight dequantized to
//! f32 (`CANDLE_DEQUANTIZE_ALL=1`), a 200-token prompt. Tiny random-weight models check the
//! llama, qwen2 (QKV bias) and qwen3 (QK norm) variants against `quantized_llama`,
//! `quantized_qwen2` and `quantized_qwen3`.

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::models::{quantized_llama, quantized_qwen2, quantized_qwen3};
use flowprefill_tests::{
    default_model, default_model_path, max_abs_diff, range, temp_dir, write_tiny_gguf, TinySpec, TEXT,
};
use flowprefill_worker::attend::SelfOnly;
use flowprefill_worker::model::{Logits, Model};
use flowprefill_worker::Cpu;
use std::path::Path;

/// Max |our logit - candle's| relative to the range of candle's logits, real model.
const REAL_MODEL_LOGIT_TOL: f32 = 1e-3;
/// The same for tiny random models (fewer layers, less accumulated rounding).
const TINY_MODEL_LOGIT_TOL: f32 = 1e-4;

fn ours_last_logits(model: &Model<Cpu>, ids: &[u32]) -> Vec<f32> {
    let pos: Vec<u32> = (0..ids.len() as u32).collect();
    model.forward(ids, &pos, &mut SelfOnly, Logits::Last).expect("forward").last().to_vec()
}

fn candle_input(ids: &[u32]) -> Tensor {
    Tensor::new(ids, &Device::Cpu).and_then(|t| t.unsqueeze(0)).expect("input tensor")
}

fn candle_logits(t: Tensor) -> Vec<f32> {
    t.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("logits")
}

fn open(path: &Path) -> (std::fs::File, gguf_file::Content) {
    let mut f = std::fs::File::open(path).expect("open gguf");
    let c = gguf_file::Content::read(&mut f).expect("read gguf");
    (f, c)
}

#[test]
fn smollm2_logits_match_candle_quantized_llama_dequantized() {
    // candle reads this per thread when it builds its weights: set before loading.
    std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
    let lm = default_model();
    let mut ids = Vec::new();
    while ids.len() < 200 {
        ids.extend(lm.tokenizer.encode_text(TEXT).expect("tokenize"));
    }
    ids.truncate(200);
    let ours = ours_last_logits(&lm.model, &ids);

    let (mut f, content) = open(&default_model_path());
    let mut reference = quantized_llama::ModelWeights::from_gguf(content, &mut f, &Device::Cpu).expect("candle load");
    let theirs = candle_logits(reference.forward(&candle_input(&ids), 0).expect("candle forward"));

    assert_eq!(ours.len(), theirs.len(), "vocab sizes differ");
    let err = max_abs_diff(&ours, &theirs);
    let rel = err / range(&theirs);
    eprintln!("200 tokens: max |diff| {err:.3e}, logit range {:.2}, relative {rel:.2e}", range(&theirs));
    assert!(rel <= REAL_MODEL_LOGIT_TOL, "relative logit error {rel} > {REAL_MODEL_LOGIT_TOL}");
    assert_eq!(
        flowprefill_worker::sampling::argmax(&ours),
        flowprefill_worker::sampling::argmax(&theirs),
        "greedy next token differs"
    );
}

fn tiny_check(spec: TinySpec) {
    let dir = temp_dir(spec.arch);
    let path = dir.join("tiny.gguf");
    write_tiny_gguf(&path, &spec);
    let model = Model::load(&path, Cpu).expect("our load");
    let ids: Vec<u32> = (0..37u32).map(|i| (i * 31 + 7) % spec.vocab as u32).collect();
    let ours = ours_last_logits(&model, &ids);
    let (mut f, content) = open(&path);
    let theirs = match spec.arch {
        "llama" => quantized_llama::ModelWeights::from_gguf(content, &mut f, &Device::Cpu)
            .and_then(|mut m| m.forward(&candle_input(&ids), 0)),
        "qwen2" => quantized_qwen2::ModelWeights::from_gguf(content, &mut f, &Device::Cpu)
            .and_then(|mut m| m.forward(&candle_input(&ids), 0)),
        "qwen3" => quantized_qwen3::ModelWeights::from_gguf(content, &mut f, &Device::Cpu)
            .and_then(|mut m| m.forward(&candle_input(&ids), 0)),
        other => panic!("no reference for {other}"),
    }
    .expect("candle forward");
    let theirs = candle_logits(theirs);
    let rel = max_abs_diff(&ours, &theirs) / range(&theirs);
    eprintln!("{}: relative logit error {rel:.2e}", spec.arch);
    assert!(rel <= TINY_MODEL_LOGIT_TOL, "{}: relative logit error {rel} > {TINY_MODEL_LOGIT_TOL}", spec.arch);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn tiny_llama_matches_candle() {
    tiny_check(TinySpec::new("llama"));
}

#[test]
fn tiny_llama_untied_gqa4_matches_candle() {
    tiny_check(TinySpec { untied: true, heads: 8, kv_heads: 2, head_dim: 8, seed: 5, ..TinySpec::new("llama") });
}

#[test]
fn tiny_qwen2_with_qkv_bias_matches_candle() {
    tiny_check(TinySpec { untied: true, ..TinySpec::new("qwen2") });
}

#[test]
fn tiny_qwen3_with_qk_norm_matches_candle() {
    tiny_check(TinySpec { head_dim: 32, seed: 3, ..TinySpec::new("qwen3") });
}
