//! The model on a GPU against the model on the CPU (feature `cuda`): the real model's first
//! logits and greedy answers, through the binary's `--device`. Without a GPU the comparisons
//! say SKIPPED; what must hold everywhere is that `--device cuda` fails with a clear message.
#![cfg(feature = "cuda")]

use std::process::Command;

/// First-token logits, GPU (f32 weights, f32 KV cache) against CPU: same weights, GEMMs and
/// attention in another order (logits span about 40).
const F32_LOGIT_TOL: f64 = 5e-2;
/// GPU (f32 weights, bf16 KV cache: tensor-core attention, which also rounds the queries and the
/// probabilities to bf16) against the CPU with a bf16 KV cache: bf16 rounding of Q and P on top
/// of the same cache values.
const BF16_KV_LOGIT_TOL: f64 = 0.5;
/// The bf16 forward (bf16 weights and activations) against the CPU's f32 forward: on the CPU
/// with the same roundings the first-token logits moved by up to 1.35e-2 of their range (about
/// 40) over ten methods (`tests/tests/suite/bf16_forward.rs`), 0.54; the tensor cores' rounding
/// of the probabilities on top. Measured on an H200 (2026-11-26): 0.23 with an f32 cache, 0.06
/// with a bf16 one.
const BF16_FORWARD_LOGIT_TOL: f64 = 1.2;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_flowprefill"))
}

fn has_gpu() -> bool {
    match flowprefill_kernels::cuda::devices() {
        Ok(d) if !d.is_empty() => true,
        other => {
            flowprefill_kernels::testing::skipped(
                "no CUDA device",
                other.err().map(|e| e.to_string()).unwrap_or_else(|| "none".into()),
            );
            false
        }
    }
}

#[test]
fn cuda_without_a_gpu_is_a_clear_error() {
    if flowprefill_kernels::cuda::devices().is_ok_and(|d| !d.is_empty()) {
        flowprefill_kernels::testing::skipped("a GPU is present", "this test checks the error without one");
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

/// `flowprefill tune`: the launch-shape header of each configuration needs no GPU (the
/// `#define`s the kernels are compiled with, the others renamed), a configuration that does not
/// exist is refused, and timing without a GPU is a clear error.
#[test]
fn tune_prints_headers_anywhere_and_needs_a_gpu_to_time() {
    let n = flowprefill_kernels::gpu::shapes::FA2_CONFIGS.len();
    for c in 0..n {
        let out = bin().args(["tune", "--header", &c.to_string()]).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(String::from_utf8_lossy(&out.stdout), flowprefill_kernels::gpu::shapes::header(c));
    }
    let out = bin().args(["tune", "--header", &n.to_string()]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains(&format!("0 to {}", n - 1)));
    let out = bin().args(["tune", "--shapes", "96:8/8"]).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("64 or 128"), "a bad shape before any GPU work");
    if flowprefill_kernels::cuda::devices().is_ok_and(|d| !d.is_empty()) {
        flowprefill_kernels::testing::skipped("a GPU is present", "tune's no-GPU error (the GPU test times it)");
        return;
    }
    let out = bin().args(["tune"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "a configuration error: {err}");
    assert!(err.contains("driver"), "{err}");
}

fn generate(device: &str, weights: &str, kv: &str) -> serde_json::Value {
    let out = bin()
        .args(["generate", "--device", device, "--weights", weights, "--kv-dtype", kv, "--json", "--max-tokens", "16"])
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
    // The same first token, and each of the GPU's three best tokens among the CPU's ten best with
    // its logit within `tol`. Tokens whose logits lie within `tol` of each other may change places
    // (on the H200, 2026-11-26, the bf16 forward swapped the 2nd and 3rd of the f32 CPU's); a
    // swap of tokens further apart fails through the per-token bound.
    let close = |cpu: &serde_json::Value, gpu: &serde_json::Value, tol: f64, what: &str| {
        let (a, b) = (cpu["first_top_logits"].as_array().unwrap(), gpu["first_top_logits"].as_array().unwrap());
        assert!(a.len() >= 3 && b.len() >= 3, "{what}: top logits missing (CPU {a:?}, GPU {b:?})");
        assert_eq!(a[0][0], b[0][0], "{what}: the same best first token (CPU {a:?}, GPU {b:?})");
        for y in b.iter().take(3) {
            let x = a.iter().find(|x| x[0] == y[0]);
            let x = x.unwrap_or_else(|| panic!("{what}: GPU token {} not among the CPU's ten best ({a:?})", y[0]));
            let d = (x[1].as_f64().unwrap() - y[1].as_f64().unwrap()).abs();
            assert!(d <= tol, "{what}: logit of token {} differs by {d} (tolerance {tol}; CPU {a:?}, GPU {b:?})", y[0]);
        }
    };
    let cpu = generate("cpu", "f32", "f32");
    let cpu_bf16_kv = generate("cpu", "f32", "bf16");
    for (weights, kv) in [("f32", "f32"), ("f32", "bf16"), ("bf16", "f32"), ("bf16", "bf16")] {
        let gpu = generate("cuda", weights, kv);
        eprintln!("cuda, {weights} weights, {kv} KV cache: {}", gpu["answer"]);
        eprintln!("  first top logits, GPU {:?}; CPU {:?}", top3(&gpu), top3(&cpu));
        assert_eq!(gpu["answer"], cpu["answer"], "{weights} weights, {kv} KV: greedy answers differ");
        match (weights, kv) {
            ("f32", "f32") => close(&cpu, &gpu, F32_LOGIT_TOL, "f32 weights, f32 KV (simple attention)"),
            ("f32", "bf16") => close(&cpu_bf16_kv, &gpu, BF16_KV_LOGIT_TOL, "f32 weights, bf16 KV (tensor cores)"),
            _ => close(&cpu, &gpu, BF16_FORWARD_LOGIT_TOL, &format!("the bf16 forward, {kv} KV")),
        }
    }
}

/// The three best first tokens with their logits, for the log.
fn top3(v: &serde_json::Value) -> Vec<(i64, f64)> {
    let top =
        v["first_top_logits"].as_array().map(|a| a.iter().take(3).cloned().collect::<Vec<_>>()).unwrap_or_default();
    top.iter().map(|x| (x[0].as_i64().unwrap_or(-1), x[1].as_f64().unwrap_or(f64::NAN))).collect()
}

/// GPUs of this machine (0 without a driver).
fn gpus() -> usize {
    flowprefill_kernels::cuda::devices().map_or(0, |d| d.len())
}

#[cfg(feature = "nccl")]
fn run_json(args: &[String]) -> serde_json::Value {
    let out = bin().arg("run").args(args).args(["--json", "--max-tokens", "8"]).output().unwrap();
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn same_top_logits(a: &serde_json::Value, b: &serde_json::Value, tag: &str) {
    let (a, b) = (a["first_top_logits"].as_array().unwrap(), b["first_top_logits"].as_array().unwrap());
    assert!(!a.is_empty() && a.len() == b.len(), "{tag}: top logits of {} and {} tokens", a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x[0], y[0], "{tag}: the same top tokens in the same order");
        let d = (x[1].as_f64().unwrap() - y[1].as_f64().unwrap()).abs();
        assert!(d <= F32_LOGIT_TOL, "{tag}: logit of token {} differs by {d}", x[0]);
    }
}

/// One process driving P GPUs (`--ranks P --device cuda`, NCCL between them): the exact scope
/// equals one GPU, ring attention equals full prefill on one GPU. Needs two GPUs.
#[cfg(feature = "nccl")]
#[test]
fn p_gpus_equal_one_gpu_and_ring_equals_full_over_nccl() {
    let n = gpus();
    if n < 2 {
        flowprefill_kernels::testing::skipped(
            "fewer than 2 CUDA devices",
            format!("found {n}: P GPUs == 1 GPU over NCCL"),
        );
        return;
    }
    let dir = std::env::temp_dir().join(format!("fp-gpus-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut docs = Vec::new();
    for i in 0..6 {
        let p = dir.join(format!("d{i}.txt"));
        let mut text = format!("Tower {i} stands by the river. ").repeat(30);
        if i == 3 {
            text.push_str("The access code for the north gate is 4729. ");
        }
        std::fs::write(&p, text).unwrap();
        docs.push("--doc".to_string());
        docs.push(p.to_string_lossy().into_owned());
    }
    let base: Vec<&str> = docs.iter().map(String::as_str).collect();
    let q = ["--query", "What is the access code for the north gate?", "--device", "cuda", "--weights", "f32"];
    let with = |extra: &[&str]| -> Vec<String> { base.iter().chain(&q).chain(extra).map(|s| s.to_string()).collect() };
    for p in 2..=n.min(4) {
        let ps = p.to_string();
        for method in ["infoflow", "none"] {
            let one = run_json(&with(&["--method", method, "--scope", "exact", "--ranks", "1"]));
            let many = run_json(&with(&["--method", method, "--scope", "exact", "--ranks", &ps]));
            let tag = format!("{method} on {p} GPUs");
            assert_eq!(many["answer"], one["answer"], "{tag}: answer");
            assert_eq!(many["selected"], one["selected"], "{tag}: selection");
            same_top_logits(&many, &one, &tag);
        }
        let full = run_json(&with(&["--method", "full", "--ranks", "1"]));
        let ring = run_json(&with(&["--method", "ring", "--ranks", &ps]));
        assert_eq!(ring["answer"], full["answer"], "ring on {p} GPUs: answer");
        same_top_logits(&ring, &full, &format!("ring on {p} GPUs"));
        let nccl_bytes: u64 = ring["rank_stats"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|s| s["comm"]["ops"].as_object().unwrap().iter())
            .filter(|(op, _)| op.ends_with("@nccl"))
            .map(|(_, o)| o["bytes_sent"].as_u64().unwrap())
            .sum();
        assert!(nccl_bytes > 0, "ring on {p} GPUs: K/V blocks went over NCCL");
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn more_ranks_than_gpus_is_a_clear_error() {
    let n = gpus();
    let dir = std::env::temp_dir().join(format!("fp-gpus-err-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let doc = dir.join("d.txt");
    std::fs::write(&doc, "The harbour of Redwater is quiet.").unwrap();
    let ranks = (n + 1).max(2).to_string();
    let out = bin()
        .args([
            "run",
            "--device",
            "cuda",
            "--ranks",
            &ranks,
            "--doc",
            doc.to_str().unwrap(),
            "--query",
            "Which harbour?",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains(&format!("needs {ranks} GPUs")) && err.contains(&format!("has {n}")), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

/// Decode steps recorded once as a CUDA graph and replayed per token (the default on one GPU)
/// give the answer of steps run op by op (`FLOWPREFILL_DECODE_GRAPH=off`), over up to 148 tokens
/// (past one block of 128 rows ahead when the model counts that far), for full prefill and
/// InfoFlow; steps were replayed (`decode_replayed`) and no recording fell back (the fallback
/// says so on stderr).
#[test]
fn decode_graphs_give_the_answers_of_steps_run_op_by_op() {
    if !has_gpu() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("fp-graph-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let doc = dir.join("d.txt");
    let text = "The harbour of Redwater is quiet. Its lighthouse keeper, Ada Voss, logs every ship. ".repeat(40);
    std::fs::write(&doc, text).unwrap();
    let tokens = (flowprefill_worker::steps::AHEAD + 20).to_string();
    for method in ["full", "infoflow"] {
        let run = |graphs: &str| {
            let out = bin()
                .env("FLOWPREFILL_DECODE_GRAPH", graphs)
                .args(["run", "--device", "cuda", "--method", method, "--json", "--max-tokens", &tokens])
                .args(["--doc", doc.to_str().unwrap(), "--query", "Count from 1 to 100, one number per line."])
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr).to_string();
            assert!(out.status.success(), "{method}, graphs {graphs}: {err}");
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            (v, err)
        };
        let (eager, _) = run("off");
        let (graphs, err) = run("on");
        assert!(!err.contains("decode steps run op by op"), "{method}: recording fell back: {err}");
        let per = |v: &serde_json::Value| v["decode_ms_per_token"].clone();
        eprintln!("{method}: {} ms/token with graphs, {} op by op; {}", per(&graphs), per(&eager), graphs["answer"]);
        assert_eq!(graphs["answer"], eager["answer"], "{method}: answers differ with decode graphs");
        assert_eq!(eager["decode_replayed"], 0, "{method}: FLOWPREFILL_DECODE_GRAPH=off replays nothing");
        // Steps 1 and 2 run op by op, step 3 is checked: a longer answer has replayed steps.
        let long = eager["answer"].as_str().is_some_and(|a| a.len() >= 16);
        let replayed = graphs["decode_replayed"].as_u64().unwrap_or(0);
        assert!(!long || replayed > 0, "{method}: no step was replayed");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// InfoFlow on one GPU with the segments' keys gathered into one attention call (the default,
/// `FLOWPREFILL_GATHERED_KEYS`) against one call and merge per segment (`=0`): the same
/// selection and answer, the first logits within the f32 bound. A bad value is refused.
#[test]
fn gathered_segments_on_a_gpu_equal_one_call_per_segment() {
    if !has_gpu() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("fp-gather-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut args: Vec<String> = Vec::new();
    for i in 0..6 {
        let p = dir.join(format!("d{i}.txt"));
        let mut text = format!("Bridge {i} crosses the canal at dawn. ").repeat(30);
        if i == 4 {
            text.push_str("The ferry to the island leaves at 7:40. ");
        }
        std::fs::write(&p, text).unwrap();
        args.extend(["--doc".to_string(), p.to_string_lossy().into_owned()]);
    }
    let q = ["--query", "When does the ferry to the island leave?", "--device", "cuda", "--weights", "f32"];
    args.extend(q.iter().map(|s| s.to_string()));
    args.extend(["--method", "infoflow", "--json", "--max-tokens", "8"].iter().map(|s| s.to_string()));
    let run = |keys: Option<&str>| {
        let mut c = bin();
        // The host profile's table (stderr, at exit) counts the attention calls.
        c.arg("run").args(&args).env("FLOWPREFILL_HOST_PROFILE", "1");
        if let Some(k) = keys {
            c.env("FLOWPREFILL_GATHERED_KEYS", k);
        }
        c.output().unwrap()
    };
    let json = |out: std::process::Output| -> (serde_json::Value, usize) {
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{err}");
        let calls = err
            .lines()
            .find_map(|l| l.strip_prefix("attention ").and_then(|r| r.split_whitespace().next()?.parse().ok()))
            .unwrap_or_else(|| panic!("no attention row in the host profile: {err}"));
        (serde_json::from_slice(&out.stdout).unwrap(), calls)
    };
    let ((gathered, fewer), (each, calls)) = (json(run(None)), json(run(Some("0"))));
    eprintln!(
        "gathered: {} ({fewer} attention calls); one call per segment: {} ({calls})",
        gathered["answer"], each["answer"]
    );
    assert!(fewer < calls, "gathering made {fewer} attention calls, one call per segment {calls}");
    assert_eq!(gathered["selected"], each["selected"], "the same selection");
    assert_eq!(gathered["answer"], each["answer"], "the same answer");
    same_top_logits(&gathered, &each, "gathered against one call per segment");
    let bad = run(Some("many"));
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("FLOWPREFILL_GATHERED_KEYS"));
    let _ = std::fs::remove_dir_all(&dir);
}
