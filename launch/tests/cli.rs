//! The `flowprefill` binary end to end: real model, real process.

use std::process::Command;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_flowprefill"))
}

fn run(args: &[&str]) -> (bool, String, String) {
    let out = bin().args(args).output().expect("run flowprefill");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn generate_answers_the_capital_of_france() {
    let (ok, out, err) = run(&["generate", "--prompt", "What is the capital of France?"]);
    assert!(ok, "stderr: {err}");
    assert!(out.contains("Paris"), "answer: {out}");
    assert!(err.contains("TTFT"), "stderr: {err}");
}

#[test]
fn generate_json_and_context_file() {
    let dir = std::env::temp_dir().join(format!("fp-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ctx = dir.join("ctx.txt");
    std::fs::write(&ctx, "The secret code of the lighthouse is 4417.").unwrap();
    let (ok, out, err) = run(&[
        "generate",
        "--context-file",
        ctx.to_str().unwrap(),
        "--prompt",
        "What is the secret code of the lighthouse?",
        "--json",
    ]);
    assert!(ok, "stderr: {err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert!(v["answer"].as_str().unwrap().contains("4417"), "{v}");
    assert!(v["ttft_ms"].as_f64().unwrap() > 0.0);
    assert!(v["prompt_tokens"].as_u64().unwrap() > 20);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn bench_prefill_json_has_the_documented_fields() {
    let (ok, out, err) = run(&["bench", "prefill", "--tokens", "64,130", "--runs", "1", "--json"]);
    assert!(ok, "stderr: {err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    let results = v["results"].as_array().expect("results");
    assert_eq!(results.len(), 2);
    for (r, n) in results.iter().zip([64, 130]) {
        assert_eq!(r["tokens"].as_u64(), Some(n));
        for k in ["median_s", "tok_per_s", "peak_rss_mb"] {
            assert!(r[k].as_f64().is_some_and(|x| x > 0.0), "{k} in {r}");
        }
    }
}

#[test]
fn errors_say_what_to_change() {
    let (ok, _, err) = run(&["generate", "--model", "/nonexistent/model.gguf", "--prompt", "hi"]);
    assert!(!ok);
    assert!(err.contains("cannot open") && err.contains("--model"), "{err}");
    let (ok, _, err) = run(&["generate", "--prompt", "  "]);
    assert!(!ok);
    assert!(err.contains("--prompt is empty"), "{err}");
    let (ok, _, err) = run(&["bench", "prefill", "--tokens", "9000", "--runs", "1"]);
    assert!(!ok);
    assert!(err.contains("context window of 8192"), "{err}");
}

#[test]
fn fetch_model_into_a_fresh_home() {
    let home = std::env::temp_dir().join(format!("fp-home-{}", std::process::id()));
    let out = bin().arg("fetch-model").env("FLOWPREFILL_HOME", &home).output().expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("checking its SHA-256"), "{err}");
    let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(path.starts_with(home.to_str().unwrap()) && path.ends_with(".gguf"), "{path}");
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 98_362_432);
    // A second call finds it and does not download.
    let out = bin().arg("fetch-model").env("FLOWPREFILL_HOME", &home).output().expect("run");
    assert!(out.status.success());
    assert!(!String::from_utf8_lossy(&out.stderr).contains("downloading"));
    let _ = std::fs::remove_dir_all(home);
}
