//! The model on a GPU against the model on the CPU (feature `cuda`): the real model's first
//! logits and greedy answers, through the binary's `--device`. Without a GPU the comparisons
//! say SKIPPED; what must hold everywhere is that `--device cuda` fails with a clear message.
#![cfg(feature = "cuda")]

use std::process::Command;

/// First-token logits, GPU (f32 weights) against CPU: same weights, GEMMs and attention in
/// another order (logits span about 40).
const F32_LOGIT_TOL: f64 = 5e-2;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_flowprefill"))
}

fn has_gpu() -> bool {
    match flowprefill_kernels::cuda::devices() {
        Ok(d) if !d.is_empty() => true,
        other => {
            eprintln!(
                "SKIPPED (no CUDA device): {}",
                other.err().map(|e| e.to_string()).unwrap_or_else(|| "none".into())
            );
            false
        }
    }
}

#[test]
fn cuda_without_a_gpu_is_a_clear_error() {
    if flowprefill_kernels::cuda::devices().is_ok_and(|d| !d.is_empty()) {
        eprintln!("SKIPPED: this machine has a GPU");
        return;
    }
    let dir = std::env::temp_dir().join(format!("fp-cuda-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let doc = dir.join("d.txt");
    std::fs::write(&doc, "The harbour of Redwater is quiet.").unwrap();
    let out = bin()
        .args(["run", "--device", "cuda", "--doc", doc.to_str().unwrap(), "--query", "Which harbour?"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("--device cuda") && (err.contains("driver") || err.contains("GPU")), "{err}");
    assert_eq!(out.status.code(), Some(3), "a configuration error: {err}");
    let _ = std::fs::remove_dir_all(dir);
}

fn generate(device: &str, weights: &str) -> serde_json::Value {
    let out = bin()
        .args(["generate", "--device", device, "--weights", weights, "--json", "--max-tokens", "16"])
        .args(["--prompt", "What is the capital of France? Answer in one sentence."])
        .output()
        .unwrap();
    assert!(out.status.success(), "{device}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn gpu_logits_and_answers_match_the_cpu() {
    if !has_gpu() {
        return;
    }
    let cpu = generate("cpu", "f32");
    for weights in ["f32", "bf16"] {
        let gpu = generate("cuda", weights);
        assert_eq!(gpu["answer"], cpu["answer"], "{weights}: greedy answers differ");
        if weights == "f32" {
            let (a, b) = (cpu["first_top_logits"].as_array().unwrap(), gpu["first_top_logits"].as_array().unwrap());
            for (x, y) in a.iter().zip(b) {
                assert_eq!(x[0], y[0], "the same top tokens in the same order");
                let d = (x[1].as_f64().unwrap() - y[1].as_f64().unwrap()).abs();
                assert!(d <= F32_LOGIT_TOL, "logit of token {} differs by {d}", x[0]);
            }
        }
    }
}
