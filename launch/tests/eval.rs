//! `flowprefill eval`: deterministic tables, resumable results, plots.

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
            // Short answers keep the test's 60 runs fast (RULER's budget of 128 tokens for the
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
    let (ok, _, err) = eval(&a, 2);
    assert!(ok, "{err}");
    let (ok, _, err) = eval(&b, 2);
    assert!(ok, "{err}");
    let ta = std::fs::read_to_string(a.join("results.md")).unwrap();
    let tb = std::fs::read_to_string(b.join("results.md")).unwrap();
    assert_eq!(ta, tb, "the same command gives the same table");
    assert!(ta.contains("| niah_single |") && ta.contains("Retention") && ta.contains("token F1"), "{ta}");
    // 2 tasks x 2 samples x (full, none, 2 selective x 2 ratios) = 24 runs.
    let runs = |dir: &std::path::Path| {
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("results.json")).unwrap()).unwrap();
        v["records"].as_array().unwrap().len()
    };
    assert_eq!(runs(&a), 24);
    // Each run records the answer budget it decoded under (here --max-tokens; by default
    // RULER's per task, `flowprefill_lab::eval::answer_budget`) and whether it ran out of it.
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(a.join("results.json")).unwrap()).unwrap();
    for r in v["records"].as_array().unwrap() {
        assert_eq!(r["max_new_tokens"], 24, "{r}");
        assert!(r["hit_budget"].is_boolean(), "{r}");
    }
    assert!(ta.contains("| at budget |"), "{ta}");
    // Resume: one more sample only computes the new runs.
    let (ok, _, err) = eval(&a, 3);
    assert!(ok, "{err}");
    assert!(err.contains("resuming: 24 runs already"), "{err}");
    // The ETA counts only the runs left to compute, not the ones the resume skips.
    assert!(err.contains("24 of 36 planned runs are already done; 12 to compute"), "{err}");
    assert_eq!(runs(&a), 36);
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
        .args(["eval", "--tasks", "niah_single", "--lengths", "400", "--samples", "3"])
        .args(["--methods", "full,none,infoflow,infoflow+reorder", "--ratios", "0.15,0.3", "--table-ratio", "0.15"])
        .args(["--max-tokens", "24"])
        .arg("--out")
        .arg(&a)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let narrow = std::fs::read_to_string(a.join("results.md")).unwrap();
    assert!(narrow.contains("3 cases;") && !narrow.contains("qa_twohop"), "{narrow}");
    assert!(!narrow.contains("token F1"), "no QA table without a QA task: {narrow}");
    assert_eq!(runs(&a), 36, "results.json keeps every run");
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
    assert!(err.contains("report only: 36 of 60 planned runs are in") && err.contains("24 missing"), "{err}");
    assert!(!err.contains("loaded "), "a report loads no model: {err}");
    assert_eq!(runs(&a), 36);
    let full_report = std::fs::read_to_string(a.join("results.md")).unwrap();
    assert!(
        full_report.contains("6 cases;") && full_report.contains("Accuracy by ratio (400 tokens)"),
        "{full_report}"
    );
    let o = report(&a, "3");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && err.contains("report only: all 36 planned runs are in"), "{err}");
    // A report over fewer samples than the folder holds averages those samples only (every
    // method over the same cases).
    let o = report(&a, "2");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let two = std::fs::read_to_string(a.join("results.md")).unwrap();
    assert!(two.contains("4 cases;") && !two.contains("6 cases;"), "{two}");
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
    assert!(tc.contains("Selection settings: geometry \"tl-tp\""), "{tc}");
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
    // A setting asked twice is refused before any model loads.
    let o = eval("snapkv,snapkv", "16", &base.join("twice"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("asked for twice") && !err.contains("loaded "), "{err}");
    let o = eval("snapkv", "16,0", &base.join("zero"));
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("0 keeps nothing"));
    let _ = std::fs::remove_dir_all(base);
}
