//! The measuring commands end to end (real model, real process): `flowprefill eval`'s
//! deterministic tables, resumable results and plots; the `bench` commands' rows and refusals.

use crate::common::{bin, run};
use std::process::Command;

fn eval(out: &std::path::Path, samples: usize) -> (bool, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_flowprefill"))
        .args([
            "eval",
            "--tasks",
            "niah_single,qa_twohop",
            "--lengths",
            "400",
            "--samples",
            &samples.to_string(),
            "--methods",
            "full,none,infoflow,infoflow+reorder",
            "--ratios",
            "0.15,0.3",
            "--table-ratio",
            "0.15",
            // Short answers keep the test's 36 runs fast (RULER's budget of 128 tokens for the
            // needle tasks made this the suite's slowest test); the budget is recorded as given.
            "--max-tokens",
            "24",
        ])
        .arg("--out")
        .arg(out)
        .output()
        .expect("run eval");
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn same_command_same_table_resume_and_plots() {
    let base = std::env::temp_dir().join(format!("fp-eval-{}", std::process::id()));
    let (a, b) = (base.join("a"), base.join("b"));
    let (ok, _, err) = eval(&a, 1);
    assert!(ok, "{err}");
    let (ok, _, err) = eval(&b, 1);
    assert!(ok, "{err}");
    let ta = std::fs::read_to_string(a.join("results.md")).unwrap();
    let tb = std::fs::read_to_string(b.join("results.md")).unwrap();
    assert_eq!(ta, tb, "the same command gives the same table");
    assert!(ta.contains("| niah_single |") && ta.contains("Retention") && ta.contains("token F1"), "{ta}");
    // 2 tasks x 1 sample x (full, none, 2 selective x 2 ratios) = 12 runs.
    let runs = |dir: &std::path::Path| {
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("results.json")).unwrap()).unwrap();
        v["records"].as_array().unwrap().len()
    };
    assert_eq!(runs(&a), 12);
    // Each run records the answer budget it decoded under (here --max-tokens; by default
    // RULER's per task, `flowprefill_lab::eval::answer_budget`) and whether it ran out of it.
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(a.join("results.json")).unwrap()).unwrap();
    for r in v["records"].as_array().unwrap() {
        assert_eq!(r["max_new_tokens"], 24, "{r}");
        assert!(r["hit_budget"].is_boolean(), "{r}");
    }
    assert!(ta.contains("| at budget |"), "{ta}");
    // Resume: one more sample only computes the new runs.
    let (ok, _, err) = eval(&a, 2);
    assert!(ok, "{err}");
    assert!(err.contains("resuming: 12 runs already"), "{err}");
    // The ETA counts only the runs left to compute, not the ones the resume skips.
    assert!(err.contains("12 of 24 planned runs are already done; 12 to compute"), "{err}");
    assert_eq!(runs(&a), 24);
    for f in [
        "accuracy_vs_ratio.png",
        "accuracy_vs_ratio_400.png",
        "pareto.png",
        "pareto_400.png",
        "retention_400.png",
        "heatmap_infoflow.png",
        "heatmap_full.png",
    ] {
        let m = std::fs::metadata(a.join(f)).unwrap_or_else(|_| panic!("{f} missing"));
        assert!(m.len() > 5_000, "{f} is {} bytes", m.len());
    }
    // A narrower rerun over the same folder computes nothing and reports only what it asked for.
    let o = Command::new(env!("CARGO_BIN_EXE_flowprefill"))
        .args(["eval", "--tasks", "niah_single", "--lengths", "400", "--samples", "2"])
        .args(["--methods", "full,none,infoflow,infoflow+reorder", "--ratios", "0.15,0.3", "--table-ratio", "0.15"])
        .args(["--max-tokens", "24"])
        .arg("--out")
        .arg(&a)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let narrow = std::fs::read_to_string(a.join("results.md")).unwrap();
    assert!(narrow.contains("2 cases;") && !narrow.contains("qa_twohop"), "{narrow}");
    assert!(!narrow.contains("token F1"), "no QA table without a QA task: {narrow}");
    assert_eq!(runs(&a), 24, "results.json keeps every run");
    // --report-only computes nothing: it counts what is missing and reports what is there.
    let report = |dir: &std::path::Path, samples: &str| {
        Command::new(env!("CARGO_BIN_EXE_flowprefill"))
            .args(["eval", "--tasks", "niah_single,qa_twohop", "--lengths", "400", "--samples", samples])
            .args(["--methods", "full,none,infoflow,infoflow+reorder", "--ratios", "0.15,0.3", "--table-ratio", "0.15"])
            .args(["--max-tokens", "24", "--report-only"])
            .arg("--out")
            .arg(dir)
            .output()
            .unwrap()
    };
    let o = report(&a, "5");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("report only: 24 of 60 planned runs are in") && err.contains("36 missing"), "{err}");
    assert!(!err.contains("loaded "), "a report loads no model: {err}");
    assert_eq!(runs(&a), 24);
    let full_report = std::fs::read_to_string(a.join("results.md")).unwrap();
    assert!(
        full_report.contains("4 cases;") && full_report.contains("Accuracy by ratio (400 tokens)"),
        "{full_report}"
    );
    let o = report(&a, "2");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && err.contains("report only: all 24 planned runs are in"), "{err}");
    // A report over fewer samples than the folder holds averages those samples only (every
    // method over the same cases).
    let o = report(&a, "1");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let one = std::fs::read_to_string(a.join("results.md")).unwrap();
    assert!(one.contains("2 cases;") && !one.contains("4 cases;"), "{one}");
    // A setting the file does not record (its runs were not verified) does not stop a report,
    // which says so and is labelled with the file's settings, not this command's flags.
    let o = Command::new(env!("CARGO_BIN_EXE_flowprefill"))
        .args(["eval", "--tasks", "niah_single,qa_twohop", "--lengths", "400", "--samples", "2"])
        .args(["--methods", "full,none,infoflow,infoflow+reorder", "--ratios", "0.15,0.3", "--table-ratio", "0.15"])
        .args(["--max-tokens", "24", "--report-only", "--verify"])
        .arg("--out")
        .arg(&a)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && err.contains("verify: was not recorded, now true"), "{err}");
    let labelled = std::fs::read_to_string(a.join("results.md")).unwrap();
    assert!(!labelled.contains("verify"), "labelled with what the runs were made with: {labelled}");
    // A file as --out is the caller's mistake (exit 2), before any model loads.
    let file = base.join("a-file");
    std::fs::write(&file, "mine").unwrap();
    let o = report(&file, "1");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.code() == Some(2) && err.contains("a file is there"), "{err}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "mine");
    let o = report(&base.join("nothing-here"), "1");
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("needs the runs of an earlier eval"));
    // Another configuration in the same folder is refused instead of mixed in.
    let o = Command::new(env!("CARGO_BIN_EXE_flowprefill"))
        .args(["eval", "--tasks", "niah_single", "--lengths", "400", "--samples", "1", "--seed", "99"])
        .arg("--out")
        .arg(&a)
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("other settings") && err.contains("seed: was 1, now 99"), "{err}");
    // Results of an earlier flowprefill, which did not record the model's content, are not
    // resumed (two files of one name are two models), but a report still reads them.
    let old = base.join("old");
    std::fs::create_dir_all(&old).unwrap();
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(a.join("results.json")).unwrap()).unwrap();
    assert!(v["config"]["model_digest"].as_str().is_some_and(|d| d.len() >= 16), "{}", v["config"]);
    v["config"].as_object_mut().unwrap().remove("model_digest");
    std::fs::write(old.join("results.json"), v.to_string()).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_flowprefill"))
        .args(["eval", "--tasks", "niah_single,qa_twohop", "--lengths", "400", "--samples", "3"])
        .args(["--methods", "full,none,infoflow,infoflow+reorder", "--ratios", "0.15,0.3", "--table-ratio", "0.15"])
        .args(["--max-tokens", "24"])
        .arg("--out")
        .arg(&old)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("model_digest: was not recorded"), "{err}");
    assert!(report(&old, "3").status.success(), "a report reads it");
    // So is an ablation (another scoring geometry) ...
    let ablation = |dir: &std::path::Path| {
        Command::new(env!("CARGO_BIN_EXE_flowprefill"))
            .args(["eval", "--tasks", "niah_single", "--lengths", "400", "--samples", "1"])
            .args(["--methods", "full,infoflow", "--ratios", "0.15", "--geometry", "tl-tp", "--max-tokens", "24"])
            .arg("--out")
            .arg(dir)
            .output()
            .unwrap()
    };
    let o = ablation(&a);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("other settings"));
    // ... which runs in its own folder and says what it changed.
    let c = base.join("c");
    let o = ablation(&c);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let tc = std::fs::read_to_string(c.join("results.md")).unwrap();
    assert!(tc.contains("Settings: geometry \"tl-tp\""), "{tc}");
    let _ = std::fs::remove_dir_all(base);
}

#[test]
fn an_eviction_sweep_writes_one_eval_per_setting() {
    let base = std::env::temp_dir().join(format!("fp-eval-sweep-{}", std::process::id()));
    let eval = |evict: &str, budgets: &str, out: &std::path::Path| {
        Command::new(env!("CARGO_BIN_EXE_flowprefill"))
            .args(["eval", "--tasks", "niah_single", "--lengths", "400", "--samples", "1", "--methods", "full"])
            .args(["--evict", evict, "--kv-budget", budgets])
            .arg("--out")
            .arg(out)
            .output()
            .expect("run eval")
    };
    let o = eval("snapkv,lookahead", "16,48", &base);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    for (policy, budget) in [("snapkv", 16), ("lookahead", 16), ("snapkv", 48), ("lookahead", 48)] {
        let dir = base.join(format!("{policy}-{budget}"));
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("results.json")).unwrap()).unwrap();
        assert_eq!((v["config"]["evict"].as_str(), v["config"]["kv_budget"].as_u64()), (Some(policy), Some(budget)));
        assert_eq!(v["records"].as_array().map(Vec::len), Some(1), "{dir:?}: {v}");
        // Without --max-tokens the budget is RULER's for the task (128 for the needle tasks).
        assert_eq!(v["records"][0]["max_new_tokens"], 128, "{v}");
        let md = std::fs::read_to_string(dir.join("results.md")).unwrap();
        assert!(md.contains(&format!("evict \"{policy}\"")) && md.contains(&format!("kv_budget {budget}")), "{md}");
        assert!(err.contains(&format!("niah_single|400|0|full|- {policy}-{budget}")), "{err}");
    }
    // A folder of the sweep is the eval of that one setting: asked alone, it resumes.
    let o = eval("lookahead", "48", &base.join("lookahead-48"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && err.contains("1 of 1 planned runs are already done; 0 to compute"), "{err}");
    // Runs evicted by LookaheadKV record its adapter; another adapter's runs are not mixed in.
    let path = base.join("lookahead-48").join("results.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    assert!(v["records"][0]["evict_adapter"].as_str().is_some_and(|h| !h.is_empty()), "{v}");
    v["records"][0]["evict_adapter"] = serde_json::json!("another-adapter");
    std::fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_flowprefill"))
        .args(["eval", "--tasks", "niah_single", "--lengths", "400", "--samples", "2", "--methods", "full"])
        .args(["--evict", "lookahead", "--kv-budget", "48"])
        .arg("--out")
        .arg(base.join("lookahead-48"))
        .output()
        .expect("run eval");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.code() == Some(2) && err.contains("evicted by LookaheadKV adapter another-adapter"), "{err}");
    // A setting asked twice is refused before any model loads.
    let o = eval("snapkv,snapkv", "16", &base.join("twice"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("asked for twice") && !err.contains("loaded "), "{err}");
    let o = eval("snapkv", "16,0", &base.join("zero"));
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("0 keeps nothing"));
    let _ = std::fs::remove_dir_all(base);
}

/// A run that fails ends the study with its error's exit status, keeps every run before it
/// (the case's earlier methods too), and the same command resumes at it.
#[test]
fn a_failed_run_keeps_the_runs_before_it_and_the_study_resumes_there() {
    let out = std::env::temp_dir().join(format!("fp-eval-fail-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let eval = |fault: Option<&str>| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_flowprefill"));
        c.args(["eval", "--tasks", "niah_single", "--lengths", "400", "--samples", "1"])
            .args(["--methods", "full,none,infoflow", "--ratios", "0.15", "--max-tokens", "8"])
            .arg("--out")
            .arg(&out);
        if let Some(f) = fault {
            c.env("FLOWPREFILL_FAULT", f);
        }
        c.output().expect("run eval")
    };
    let runs = || {
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("results.json")).unwrap()).unwrap();
        v["records"].as_array().map(|r| r.iter().map(|r| r["method"].as_str().unwrap_or("?").to_string()).collect())
    };
    // InfoFlow's probe runs out of memory (the injected fault): full and none are done.
    let o = eval(Some("rank:0,phase:probe,mode:oom"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(75), "out of memory is a resource failure: {err}");
    assert!(
        err.contains("run niah_single|400|0|infoflow|0.1500 failed") && err.contains("resumes at this one"),
        "{err}"
    );
    assert_eq!(runs(), Some(vec!["full".to_string(), "none".to_string()]), "the case's runs before it are kept");
    let o = eval(None);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && err.contains("2 of 3 planned runs are already done; 1 to compute"), "{err}");
    assert_eq!(runs().map(|r: Vec<String>| r.len()), Some(3));
    // Each run records the build that made it (`flowprefill --version`'s id); a resumed study
    // says how many runs other builds made, results.md names every build, and
    // --redo-other-builds computes those runs again.
    let version = Command::new(env!("CARGO_BIN_EXE_flowprefill")).arg("--version").output().expect("--version");
    let version = String::from_utf8_lossy(&version.stdout).into_owned();
    let build = version.split_once("(build ").and_then(|(_, b)| b.split_once(';')).map(|(b, _)| b.to_string());
    let build = build.unwrap_or_else(|| panic!("no build in {version:?}"));
    assert!(build.len() == 12 && build.chars().all(|c| c.is_ascii_hexdigit()), "{version:?}");
    assert!(version.contains("; commit "), "where the sources came from: {version:?}");
    // And how they were built (part of the id: a debug build's timings are not a release's).
    assert!(flowprefill::BUILD_CONFIG.contains(", opt-level "), "{}", flowprefill::BUILD_CONFIG);
    assert!(version.contains(&format!("; {})", flowprefill::BUILD_CONFIG)), "{version:?}");
    let file = out.join("results.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    let records = v["records"].as_array_mut().unwrap();
    assert!(records.iter().all(|r| r["build"] == build.as_str()), "{records:?}");
    records[0]["build"] = "0123456789ab".into();
    records[1].as_object_mut().unwrap().remove("build");
    std::fs::write(&file, v.to_string()).unwrap();
    let o = eval(None);
    let err = String::from_utf8_lossy(&o.stderr);
    let said = format!(
        "2 of the runs already in {} were made by other builds (0123456789ab: 1, not recorded: 1), not this one ({build})",
        file.display()
    );
    assert!(o.status.success() && err.contains(&said), "{err}");
    let md = std::fs::read_to_string(out.join("results.md")).unwrap();
    let named = ["0123456789ab (1 runs)", &format!("{build} (1 runs)"), "not recorded (1 runs)"];
    assert!(md.contains("built by several builds: ") && named.iter().all(|n| md.contains(n)), "{md}");
    let o = Command::new(env!("CARGO_BIN_EXE_flowprefill"))
        .args(["eval", "--tasks", "niah_single", "--lengths", "400", "--samples", "1"])
        .args(["--methods", "full,none,infoflow", "--ratios", "0.15", "--max-tokens", "8", "--redo-other-builds"])
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && err.contains("1 of 3 planned runs are already done; 2 to compute"), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    let records = v["records"].as_array().unwrap();
    assert!(records.len() == 3 && records.iter().all(|r| r["build"] == build.as_str()), "{records:?}");
    assert!(std::fs::read_to_string(out.join("results.md")).unwrap().contains(&format!("built by {build}")));
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn bench_prefill_json_has_the_documented_fields() {
    let (ok, out, err) = run(&["bench", "prefill", "--tokens", "64,130", "--runs", "1", "--json"]);
    assert!(ok, "stderr: {err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    // The forwards' size the run used: the CPU's (a GPU's is 8192), unless --prefill-chunk.
    assert_eq!(v["prefill_chunk"].as_u64(), Some(flowprefill_kernels::PREFILL_ROWS as u64), "{v}");
    // Where it ran, as the table's header says it: the device and the KV cache's data type.
    assert_eq!(v["device"].as_str(), Some("cpu"), "{v}");
    assert!(v["build"].as_str().is_some_and(|b| b.len() >= 12), "the build that measured: {v}");
    assert!(v["kv_dtype"].as_str().is_some_and(|d| !d.is_empty()), "{v}");
    let results = v["results"].as_array().expect("results");
    assert_eq!(results.len(), 2);
    for (r, n) in results.iter().zip([64, 130]) {
        assert_eq!(r["tokens"].as_u64(), Some(n));
        for k in ["median_s", "tok_per_s", "peak_rss_mb"] {
            assert!(r[k].as_f64().is_some_and(|x| x > 0.0), "{k} in {r}");
        }
    }
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

/// `bench load` against a server it starts itself: every job answered, none lost, latency
/// percentiles printed.
#[test]
fn bench_load_drives_its_own_server() {
    let (ok, out, err) = run(&[
        "bench",
        "load",
        "--clients",
        "2",
        "--duration",
        "60",
        "--max-jobs",
        "3",
        "--doc-tokens",
        "300",
        "--doc-sets",
        "2",
        "--max-tokens",
        "4",
        "--method",
        "infoflow@0.2",
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("3 requests, 3 ok"), "{out}");
    assert!(out.contains("lost (no response at all): 0") && out.contains("latency of ok jobs: p50"), "{out}");
}

/// `bench load` stopped by a Ctrl-C at its terminal (the signal reaches the server it started
/// too, which finishes the jobs it accepted): the report of the jobs so far is printed before it
/// exits with the cancelled code (6). (A request issued as the server stopped may meet it
/// closed: the report counts it as lost, and the interruption stays the error.)
#[test]
fn bench_load_interrupted_reports_the_jobs_so_far() {
    use std::io::BufRead as _;
    use std::os::unix::process::CommandExt as _;
    let mut child = bin()
        .args(["bench", "load", "--clients", "2", "--duration", "120", "--doc-tokens", "100", "--max-tokens", "2"])
        .process_group(0)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("bench load");
    let mut lines = std::io::BufReader::new(child.stderr.take().expect("stderr")).lines();
    let mut seen = String::new();
    for line in lines.by_ref().map_while(Result::ok) {
        seen += &line;
        seen.push('\n');
        if line.contains("clients driving") {
            break;
        }
    }
    std::thread::sleep(std::time::Duration::from_secs(3));
    let group = format!("-{}", child.id());
    assert!(std::process::Command::new("kill").args(["-INT", "--", &group]).status().expect("kill").success());
    seen.extend(lines.map_while(Result::ok).map(|l| l + "\n"));
    let out = child.wait_with_output().expect("bench load ends");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(6), "{stdout}{seen}");
    assert!(
        stdout.contains("(of --duration 120: interrupted)") && stdout.contains("lost (no response at all): "),
        "{stdout}"
    );
    assert!(seen.contains("interrupted after") && seen.contains("the report above is of the"), "{seen}");
}

/// `bench faults` runs a row of the fault matrix end to end; the row is the hung rank 0 of a
/// thread world (docs/faults.md): answered 504 at the deadline + 2 s, the ranks rebuilt, the
/// next job 200, a clean stop. Hung at the job's first step, so that the row's 10 s deadline
/// passes during the hang however slow the machine (a chunk prefill past it on a loaded CI
/// machine would answer 504 for want of time, and the probe's fault would hit the next job).
#[test]
fn bench_faults_a_hung_rank_0_is_answered_at_the_deadline_and_the_ranks_are_rebuilt() {
    let dir = std::env::temp_dir().join(format!("fp-faults-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let md = dir.join("faults.md");
    let (ok, out, err) = run(&[
        "bench",
        "faults",
        "--worlds",
        "threads",
        "--only",
        "hang on rank 0 at chunk_prefill",
        "--out",
        md.to_str().unwrap(),
    ]);
    assert!(ok, "{out}{err}");
    let rows: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(md.with_extension("json")).expect("the JSON beside")).unwrap();
    let rows = rows.as_array().expect("rows");
    assert_eq!(rows.len(), 1, "{rows:?}");
    let r = &rows[0];
    assert_eq!(
        (r["world"].as_str(), r["case"].as_str()),
        (Some("threads"), Some("hang on rank 0 at chunk_prefill")),
        "{r}"
    );
    assert_eq!(r["status"], "504", "{r}");
    // The fault rows' deadline is 10 s; the handler answers 2 s after it.
    let answered = r["answer_s"].as_f64().unwrap_or(0.0);
    assert!((11.5..15.0).contains(&answered), "answered after {answered} s: {r}");
    assert_eq!(r["next"], "200", "{r}");
    // The abandoned job left the jobs-in-flight gauge (it stayed at 1 before).
    assert_eq!(r["in_flight_after"], "0", "{r}");
    assert!(r["exit"].as_str().is_some_and(|e| e.starts_with("exit 0")), "{r}");
    let _ = std::fs::remove_dir_all(dir);
}

/// `bench ttft` with `auto`: each auto run's row names what ran and every candidate's
/// predicted TTFT (`label=ms;...`), so a grid can hold the predictions against what each
/// method measured (docs/quality/auto_grid.py).
#[test]
fn bench_ttft_records_what_auto_predicted() {
    let dir = std::env::temp_dir().join(format!("fp-ttft-auto-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.to_string_lossy().into_owned();
    // An earlier study's chart in the folder does not stand beside this study's CSV.
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("ttft.png"), b"an earlier study's chart").unwrap();
    let args = ["bench", "ttft", "--lengths", "300", "--doc-tokens", "100", "--ranks", "1", "--runs", "1"];
    let (ok, out, err) = run(&[&args[..], &["--methods", "full,auto", "--out", &d]].concat());
    assert!(ok, "{out}\n{err}");
    assert!(err.contains("ttft.png of an earlier study"), "{err}");
    assert!(std::fs::read(dir.join("ttft.png")).map_or(true, |b| b != b"an earlier study's chart"), "stale chart");
    let csv = std::fs::read_to_string(dir.join("ttft.csv")).expect("ttft.csv");
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().expect("header").split(',').collect();
    let col = |name: &str| header.iter().position(|h| *h == name).unwrap_or_else(|| panic!("no {name}: {csv}"));
    let (method, predicted, ran) = (col("method"), col("auto_predicted"), col("ran"));
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    assert!(rows.iter().all(|r| r.len() == header.len()), "{csv}");
    let auto = rows.iter().find(|r| r[method] == "auto").unwrap_or_else(|| panic!("no auto row: {csv}"));
    let cands: Vec<(&str, f64)> = auto[predicted]
        .split(';')
        .map(|c| c.rsplit_once('=').map(|(l, ms)| (l, ms.parse().expect("ms"))).expect("label=ms"))
        .collect();
    assert!(cands.iter().any(|(l, _)| *l == "full") && cands.iter().all(|(_, ms)| *ms > 0.0), "{csv}");
    assert!(cands.iter().any(|(l, _)| *l == auto[ran]), "what ran is a candidate: {csv}");
    let full = rows.iter().find(|r| r[method] == "full").expect("full row");
    assert!(full[predicted].is_empty(), "{csv}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `bench ttft --project cpu-local` projects on this machine's calibration file where `bench
/// calibrate` wrote one (`$FLOWPREFILL_HOME/calibration.json`, what `--method auto` predicts
/// with), and says which profile it used; `--profiles` replaces it. Every timed run follows an
/// untimed warm-up run, and the CSV holds the timed runs only.
#[test]
fn bench_ttft_names_the_profile_it_projects_on() {
    let home = std::env::temp_dir().join(format!("fp-ttft-profile-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&home);
    std::fs::create_dir_all(&home).unwrap();
    // The built-in cpu-local device under another description, as a calibration would write it.
    let builtin: serde_json::Value =
        serde_json::from_str(include_str!("../../../lab/profiles.json")).expect("the built-in profiles");
    let mut dev = builtin["devices"]["cpu-local"].clone();
    dev["description"] = serde_json::json!("calibrated here");
    let profile = serde_json::json!({ "devices": { "cpu-local": dev }, "links": {} });
    let calibration = home.join("calibration.json");
    std::fs::write(&calibration, profile.to_string()).unwrap();
    let given = home.join("given.json");
    std::fs::write(&given, profile.to_string()).unwrap();
    let out = home.join("out");
    // The model from where it is, not fetched again under the test's home.
    let model = match std::env::var_os("FLOWPREFILL_MODEL") {
        Some(m) => std::path::PathBuf::from(m),
        None => flowprefill_worker::fetch::default_model_path().expect("the default model's path"),
    };
    let bench = |extra: &[&str]| {
        let o = bin()
            .env("FLOWPREFILL_HOME", &home)
            .env("FLOWPREFILL_MODEL", &model)
            .args(["bench", "ttft", "--lengths", "256", "--doc-tokens", "64", "--ranks", "1", "--methods", "none"])
            .args(["--runs", "2", "--project", "cpu-local", "--out"])
            .arg(&out)
            .args(extra)
            .output()
            .expect("run flowprefill");
        let (stdout, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        assert!(o.status.success(), "{stdout}\n{err}");
        stdout.into_owned()
    };
    let said = bench(&[]);
    let want = format!("projected on device cpu-local ({}), link cpu-threads (built in)", calibration.display());
    assert!(said.contains(&want), "{said}");
    assert!(said.contains("2 timed runs after one untimed warm-up run"), "{said}");
    let csv = std::fs::read_to_string(out.join("ttft.csv")).expect("ttft.csv");
    assert_eq!(csv.lines().count(), 3, "the header and the two timed runs: {csv}");
    let said = bench(&["--profiles", given.to_str().unwrap(), "--link", "cpu-threads"]);
    assert!(said.contains(&format!("device cpu-local ({})", given.display())), "{said}");
    std::fs::remove_file(&calibration).unwrap();
    let said = bench(&[]);
    assert!(said.contains("projected on device cpu-local (built in)"), "{said}");
    let _ = std::fs::remove_dir_all(&home);
}
