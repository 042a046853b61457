//! Errors of the `flowprefill` binary say what to change: bad flags and values (negative numbers
//! reach the range checks), missing or empty inputs, what a method would ignore, a damaged
//! calibration file (real model, real process).

use crate::common::{bin, run, write_docs};

#[test]
fn errors_say_what_to_change() {
    let (ok, _, err) = run(&["generate", "--model", "/nonexistent/model.gguf", "--prompt", "hi"]);
    assert!(!ok);
    assert!(err.contains("cannot open") && err.contains("--model"), "{err}");
    // Values are checked before the model loads (a missing model would be named first).
    let (ok, _, err) = run(&["--model", "/nonexistent/model.gguf", "demo", "--ratio", "2"]);
    assert!(!ok && err.contains("--ratio: 2 is outside [0, 1]"), "{err}");
    let (dir, docs) = write_docs("before-load", &["A document."]);
    let docs: Vec<&str> = docs.iter().map(String::as_str).collect();
    let (ok, _, err) =
        run(&[&["--model", "/nonexistent/model.gguf", "run"][..], &docs, &["--query", "q", "--max-tokens", "0"]]
            .concat());
    assert!(!ok && err.contains("--max-tokens: must be at least 1"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
    let (ok, _, err) = run(&["generate", "--prompt", "  "]);
    assert!(!ok);
    assert!(err.contains("--prompt is empty"), "{err}");
    let (ok, _, err) = run(&["bench", "prefill", "--tokens", "9000", "--runs", "1"]);
    assert!(!ok);
    assert!(err.contains("context window of 8192"), "{err}");
    for cmd in [&["bench", "prefill"][..], &["generate", "--prompt", "hi"][..]] {
        let (ok, _, err) = run(&[cmd, &["--prefill-chunk", "0"]].concat());
        assert!(!ok);
        assert!(err.contains("--prefill-chunk") && err.contains("at least 1"), "{cmd:?}: {err}");
    }
    let (ok, _, err) = run(&["generate", "--prompt", "hi", "--temperature", "-1"]);
    assert!(!ok && err.contains("--temperature: -1 must be"), "{err}");
    // write-gguf: a shape error names --shape (the flag given), before any model is needed.
    let gguf = std::env::temp_dir().join(format!("fp-wg-{}.gguf", std::process::id()));
    std::fs::write(&gguf, b"a user's file").unwrap();
    let (ok, _, err) = run(&["write-gguf", "--shape", "nosuch", "--out", gguf.to_str().unwrap(), "--force"]);
    assert!(!ok && err.contains("--shape: ") && err.contains("no shape `nosuch`"), "{err}");
    assert_eq!(std::fs::read(&gguf).unwrap(), b"a user's file", "--out untouched by a failed write-gguf");
    let _ = std::fs::remove_file(&gguf);
    // bench faults: a `.json` --out would be written twice (the table, then the JSON over it).
    let (ok, _, err) = run(&["bench", "faults", "--out", "rows.json"]);
    assert!(!ok && err.contains("--out rows.json: give the Markdown table's path"), "{err}");
}

#[test]
fn run_errors_say_what_to_change() {
    let (dir, docs) = write_docs("run-err", &["Some text about the harbour.", "   "]);
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
    // A negative number is a value, not a flag: the range check answers, not clap's "unexpected
    // argument '-0'".
    check(&["--query", "q?", "--ratio", "-0.1"], one, "--ratio: -0.1 is outside [0, 1]");
    check(&["--query", "q?", "--comm-timeout", "-1"], one, "--comm-timeout -1: give a positive number of seconds");
    // What a method would ignore is refused, not dropped.
    check(&["--query", "q?", "--method", "full", "--ratio", "0.3"], one, "method full computes every token");
    check(&["--query", "q?", "--aux-model", "x.gguf"], one, "--aux-model is CacheClip's");
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
    // `auto` with a damaged calibration file: the refusal says why and which file to fix (a
    // job that names its method is not told about it).
    let home = dir.join("home");
    std::fs::create_dir_all(&home).unwrap();
    std::fs::write(home.join("calibration.json"), "{damaged").unwrap();
    let model = flowprefill_worker::fetch::default_model_path().unwrap();
    let with_home = |method: &str| {
        let mut a = vec!["run".to_string(), "--model".into(), model.to_string_lossy().into_owned()];
        a.extend(one.iter().cloned());
        a.extend(["--query", "q?", "--max-tokens", "2", "--method", method].map(String::from));
        bin().args(&a).env("FLOWPREFILL_HOME", &home).output().expect("run")
    };
    let out = with_home("auto");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("calibration.json") && err.contains("fix or delete") && err.contains("name a method"),
        "{err}"
    );
    let out = with_home("full");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && !err.contains("calibration"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

/// Output paths and ranges are checked before any work: a file where `--out`'s folder should
/// be costs nothing and is left as it was, values that would measure nothing or crash are the
/// caller's error (exit 2) naming the flag; a closed standard output ends the program quietly.
#[test]
fn outputs_and_ranges_are_checked_before_any_work() {
    let (dir, docs) = write_docs("out-checks", &["Some text about the harbour."]);
    let file = dir.join("precious.txt");
    std::fs::write(&file, b"a user's file").unwrap();
    let f = file.to_str().unwrap();
    let under = file.join("c.json");
    let refused = |args: &[&str], want: &str| {
        let out = bin().args(args).output().expect("run flowprefill");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(want) && !err.contains("panicked"), "{args:?}: {err}");
        err.into_owned()
    };
    let doc = docs[1].as_str();
    refused(&["bench", "ttft", "--lengths", "256", "--runs", "1", "--out", f], "--out");
    refused(&["bench", "decode", "--doc", doc, "--evict", "none", "--max-tokens", "2", "--out", f], "a file is there");
    refused(&["bench", "calibrate", "--seconds", "0.05", "--out", under.to_str().unwrap()], "--out");
    // A file that is not a profile file is not replaced by one.
    refused(&["bench", "calibrate", "--seconds", "0.05", "--out", f], "not a profile file");
    refused(&["bench", "stream", "--corpus", "2", "--doc-tokens", "0", "--queries", "1"], "--doc-tokens");
    refused(&["bench", "ttft", "--lengths", "0", "--runs", "1"], "--lengths");
    refused(&["check", "--lengths", "256", "--depths", "nan", "--methods", "full"], "--depths");
    // One cell twice: one id for two cases, and --dump-cases would mix their documents in one folder.
    refused(&["check", "--lengths", "256", "--depths", "0.5,0.5", "--methods", "full"], "--depths gives 0.5 twice");
    // ... before the model loads (a missing model would be named first).
    let nomodel = ["--model", "/nonexistent/model.gguf", "check", "--lengths", "256,256", "--methods", "full"];
    refused(&nomodel, "--lengths gives 256 twice");
    // eval: a value given twice would run twice and count twice in the paired tables.
    let eval = ["eval", "--tasks", "niah_single", "--lengths", "256", "--samples", "1"];
    refused(&[&eval[..], &["--methods", "full,infoflow,infoflow"]].concat(), "--methods gives infoflow twice");
    refused(&[&eval[..], &["--methods", "full,infoflow", "--ratios", "0.1,0.1"]].concat(), "--ratios gives 0.1 twice");
    refused(
        &["eval", "--tasks", "qa_onehop,qa_onehop", "--lengths", "256", "--samples", "1"],
        "--tasks gives qa_onehop twice",
    );
    let e10 = dir.join("e10");
    let eval = ["eval", "--tasks", "niah_single", "--methods", "full,infoflow", "--ratios", "0.3", "--lengths", "256"];
    refused(&[&eval[..], &["--out", e10.to_str().unwrap()]].concat(), "--table-ratio 0.15 is not among --ratios");
    refused(&["--threads", "0", "run", "--doc", doc, "--query", "q?"], "--threads 0");
    refused(&["serve", "--max-body-bytes", "0"], "--max-body-bytes");
    let project = ["bench", "project", "--shape", "qwen3-14b", "--target", "h100-sxm", "--link", "nvlink4"];
    refused(&[&project[..], &["--calibrate", "full,1,8192,0"]].concat(), "MS a positive number");
    // A cell no efficiency reaches would leave every figure scaled by the search's bound.
    refused(&[&project[..], &["--calibrate", "full,1,8192,0.001"]].concat(), "cannot reach 0.001 ms");
    refused(&[&project[..], &["--methods", "ring", "--ranks", "1"]].concat(), "nothing to project");
    refused(&[&project[..], &["--lengths", "8192,8192"]].concat(), "--lengths gives 8192 twice");
    // The bench commands' values, refused before the model loads (no "loaded" line).
    for (args, want) in [
        (&["bench", "ttft", "--lengths", "256", "--ratio", "1.5"][..], "outside [0, 1]"),
        (&["bench", "ttft", "--lengths", "256,512,256"][..], "--lengths gives 256 twice"),
        (&["bench", "ttft", "--lengths", "256", "--ranks", "1,1"][..], "--ranks gives 1 twice"),
        (&["bench", "prefill", "--tokens", "0"][..], "must be positive"),
        (&["bench", "prefill", "--tokens", "9000"][..], "context window of 8192"),
        (&["bench", "load", "--max-jobs", "0"][..], "--max-jobs"),
        (&["bench", "stream", "--slack", "0,0.5,0"][..], "--slack gives 0 twice"),
        // Cases go to the model directly: a context past the window is refused, not run.
        (&["train", "lookahead", "--length", "8000", "--out", "/tmp/fp-never"][..], "give at most 7680"),
        (&["importance", "--lengths", "300,9000"][..], "--lengths 9000: the model's window is 8192"),
        (&["importance", "--lengths", "300", "--budgets", "16,16"][..], "--budgets gives 16 twice"),
    ] {
        let err = refused(args, want);
        assert!(!err.contains("loaded "), "{args:?} loaded the model first: {err}");
    }
    // The caller's errors that exited 1, as an unclassed failure, exit 2 as the README says.
    refused(
        &["bench", "project", "--shape", "bogus", "--target", "h100-sxm", "--link", "nvlink4"],
        "unknown model shape",
    );
    refused(&["generate", "--prompt", ""], "--prompt is empty");
    let missing = dir.join("missing.txt");
    refused(&["run", "--doc", missing.to_str().unwrap(), "--query", "q?"], "missing.txt: No such file");
    refused(&["generate", "--prompt", "q?", "--context-file", missing.to_str().unwrap()], "--context-file");
    let latin1 = dir.join("latin1.txt");
    std::fs::write(&latin1, b"caf\xe9 au lait").unwrap();
    refused(&["run", "--doc", latin1.to_str().unwrap(), "--query", "q?"], "not UTF-8 text (byte 3 is not)");
    refused(&["generate", "--prompt", "q?", "--context-file", latin1.to_str().unwrap()], "iconv -f LATIN1");
    refused(&["run", "--doc", doc, "--query", "q?", "--score-layers", "abc"], "--score-layers `abc`");
    refused(&["--store", "off", "store", "stats"], "--store off");
    refused(&["run", "--doc", doc, "--query", "q?", "--ranks", "2000"], "give at most 256");
    assert_eq!(std::fs::read(&file).unwrap(), b"a user's file", "left as it was");
    // `flowprefill ... | head` where head is gone before the first line: exit 141, no panic.
    let script = format!("{{ sleep 1; '{}' fetch-model --list; }} | true", env!("CARGO_BIN_EXE_flowprefill"));
    let out = std::process::Command::new("bash").args(["-o", "pipefail", "-c", &script]).output().expect("bash");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(141), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

/// A build without MPI started by mpirun as one of several processes (the launcher's
/// `OMPI_COMM_WORLD_SIZE` or `PMI_SIZE`) refuses every command that computes across ranks with
/// a usage error saying to rebuild with the feature, instead of each copy running alone on one
/// output and exiting 0.
#[cfg(not(feature = "mpi"))]
#[test]
fn mpirun_without_the_mpi_feature_is_refused() {
    let (dir, docs) = write_docs("no-mpi", &["The north gate opens with code 4471."]);
    let out_dir = dir.join("out");
    let out = out_dir.to_str().unwrap();
    let doc = docs[1].as_str();
    let store = dir.join("store");
    let store = store.to_str().unwrap();
    let commands: [&[&str]; 4] = [
        &["run", "--doc", doc, "--query", "What opens the north gate?", "--max-tokens", "2"],
        &["bench", "ttft", "--lengths", "256", "--ranks", "1", "--methods", "none", "--runs", "1", "--out", out],
        &["bench", "decode", "--doc", doc, "--evict", "none", "--max-tokens", "2", "--out", out],
        // Every process ingested every document, each saying it ran on one rank.
        &["ingest", "--store", store, "--doc", doc],
    ];
    for var in ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"] {
        for args in commands {
            let o = bin().args(args).env(var, "2").output().expect("run flowprefill");
            let err = String::from_utf8_lossy(&o.stderr);
            assert_eq!(o.status.code(), Some(2), "{var}=2 {args:?}: {err}");
            assert!(err.contains("--features mpi") && err.contains("one of 2 processes"), "{args:?}: {err}");
            assert!(!out_dir.join("ttft.csv").exists(), "{args:?}: nothing measured");
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// A fresh folder holding a previous run's `ttft.csv` (its content is [`LAST_CSV`]).
fn folder_with_last_csv(tag: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("fp-ttft-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let csv = dir.join("ttft.csv");
    std::fs::write(&csv, LAST_CSV).unwrap();
    (dir, csv)
}

/// What [`folder_with_last_csv`] writes.
const LAST_CSV: &str = "the last run's results\n";

/// `bench ttft` with no (method × rank count) to measure (full runs on one rank only; no
/// method at all) is refused with exit 2 before the model loads, saying why, and the last
/// run's ttft.csv is left as it was.
#[test]
fn bench_ttft_that_measures_nothing_is_refused_and_keeps_the_last_csv() {
    let (dir, csv) = folder_with_last_csv("nothing");
    let out = dir.to_str().unwrap();
    for (methods, ranks, want) in [("full", "2", "full prefill runs on one rank only"), ("", "1", "--methods")] {
        let args = ["bench", "ttft", "--lengths", "256", "--ranks", ranks, "--methods", methods, "--out", out];
        let o = bin().args(args).output().expect("run flowprefill");
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(want) && !err.contains("loaded"), "{args:?}: {err}");
        assert_eq!(std::fs::read_to_string(&csv).unwrap(), LAST_CSV, "{args:?}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// `bench ttft --lengths` with a length over the model's window (SmolLM2: 8192) is refused
/// before any length is measured, and the last run's ttft.csv is left as it was (before, the
/// lengths before it were measured and written over the CSV, then the run failed).
#[test]
fn bench_ttft_checks_every_length_against_the_window_before_measuring() {
    let (dir, csv) = folder_with_last_csv("window");
    let args = ["bench", "ttft", "--lengths", "256,9000", "--doc-tokens", "64", "--ranks", "1", "--methods", "none"];
    let o = bin().args(args).args(["--runs", "1", "--out", dir.to_str().unwrap()]).output().expect("run flowprefill");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("--lengths 9000 does not fit"), "{err}");
    assert!(!err.contains("P=1"), "nothing measured: {err}");
    assert_eq!(std::fs::read_to_string(&csv).unwrap(), LAST_CSV);
    let _ = std::fs::remove_dir_all(dir);
}

/// `bench ttft` and `bench stream` refuse, before loading anything, what they cannot run:
/// `--link` or `--profiles` without `--project` (they only shape the projection), more thread
/// ranks than one process holds (as `run` does), and a stream asking more distinct documents
/// per question than its corpus has (the error names both numbers).
#[test]
fn bench_ttft_and_stream_refuse_flags_and_ranks_they_cannot_use() {
    let refused = |args: &[&str], want: &[&str]| {
        let out = bin().args(args).output().expect("run flowprefill");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(want.iter().all(|w| err.contains(w)) && !err.contains("panicked"), "{args:?}: {err}");
    };
    let ttft = ["bench", "ttft", "--lengths", "256", "--runs", "1"];
    refused(&[&ttft[..], &["--link", "cpu-mpi"]].concat(), &["--project"]);
    refused(&[&ttft[..], &["--profiles", "cpu-local.json"]].concat(), &["--project"]);
    refused(&[&ttft[..], &["--ranks", "1,300"]].concat(), &["--ranks 300", "at most 256"]);
    let stream = ["bench", "stream", "--queries", "1", "--ranks", "2"];
    refused(
        &[&stream[..], &["--corpus", "3", "--docs-per-query", "5"]].concat(),
        &["--docs-per-query 5", "3 documents"],
    );
    refused(&["bench", "stream", "--queries", "1", "--ranks", "300"], &["--ranks 300", "at most 256"]);
}

/// `check` keeps the cases that finished: a method that fails at the second case (an injected
/// out-of-memory error) prints the first case's table, marked partial, and exits with the
/// failure's code; a Ctrl-C finishes the case in progress, prints the finished cases' table
/// and exits with the cancelled code (6). Nothing the run measured is lost to either.
#[test]
fn check_keeps_the_finished_cases_when_a_method_fails_or_it_is_interrupted() {
    let cases = |depths: &str| {
        ["check", "--lengths", "600", "--depths", depths, "--per-cell", "1", "--methods", "full,infoflow"]
            .map(String::from)
            .to_vec()
    };
    // The second recomputation of the run (infoflow on case 2) runs out of memory.
    let out = bin()
        .args(cases("0.3,0.7"))
        .arg("--json")
        .env("FLOWPREFILL_FAULT", "rank:0,phase:recompute,mode:oom,after:1")
        .output()
        .expect("check");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(75), "out of memory is a resource failure: {stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}\n{stderr}"));
    assert_eq!((v["cases"].as_u64(), v["cases_planned"].as_u64()), (Some(1), Some(2)), "{v}");
    let stopped = v["stopped"].as_str().unwrap_or_default();
    assert!(stopped.starts_with("infoflow on case niah-600-d0.70-0 failed: ") && stopped.contains("injected"), "{v}");
    let rows = v["results"].as_array().expect("results");
    assert!(rows.len() == 2 && rows.iter().all(|r| r["cases"] == 1 && r["median_ttft_ms"].as_f64() > Some(0.0)), "{v}");
    assert!(
        stderr.contains("infoflow on case niah-600-d0.70-0 failed (1 of 2 cases finished; their table is above)"),
        "{stderr}"
    );

    // Ctrl-C once the first case is done: the case in progress finishes, the rest do not run.
    let (out, seen) = interrupted_after_the_first(bin().args(cases("0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9")), 9, "cases");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(6), "interrupted is cancelled: {seen}");
    assert!(seen.contains("stopping after the case in progress (Ctrl-C again stops at once)"), "{seen}");
    let first = stdout.lines().next().unwrap_or_default();
    let done: usize = first
        .strip_prefix("PARTIAL: ")
        .and_then(|r| r.strip_suffix(" of 9 cases finished (interrupted)"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{stdout}\n{seen}"));
    assert!((1..9).contains(&done), "{stdout}");
    assert!(stdout.contains(&format!(": {done} cases (lengths [600]")), "the table is of the finished cases: {stdout}");
    assert!(stdout.lines().any(|l| l.starts_with("infoflow ")), "{stdout}");
    assert!(seen.contains(&format!("interrupted after {done} of 9 cases (their table is above)")), "{seen}");
}

/// Runs `cmd` (a command of `n` steps called `unit`), sends it SIGINT once its progress says
/// the first is done, and waits for it: its output, and its stderr.
fn interrupted_after_the_first(
    cmd: &mut std::process::Command,
    n: usize,
    unit: &str,
) -> (std::process::Output, String) {
    interrupted_after(cmd, &|line| line.starts_with(&format!("[1/{n} {unit}]")))
}

/// Runs `cmd`, sends it SIGINT once a line of its stderr is `first`, and waits for it: its
/// output, and its stderr.
fn interrupted_after(cmd: &mut std::process::Command, first: &dyn Fn(&str) -> bool) -> (std::process::Output, String) {
    use std::io::BufRead as _;
    let mut child =
        cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().expect("the command");
    let mut err_lines = std::io::BufReader::new(child.stderr.take().expect("stderr")).lines();
    let mut seen = String::new();
    for line in err_lines.by_ref() {
        let line = line.expect("stderr line");
        seen += &line;
        seen.push('\n');
        if first(&line) {
            let pid = child.id().to_string();
            assert!(std::process::Command::new("kill").args(["-INT", &pid]).status().expect("kill").success());
            break;
        }
    }
    seen.extend(err_lines.map_while(Result::ok).map(|l| l + "\n"));
    (child.wait_with_output().expect("the command ends"), seen)
}

/// `importance` keeps the cases that finished: a Ctrl-C finishes the case in progress, prints
/// the finished cases' table marked partial and writes it with their rows into `--out`; a
/// second run into that folder is refused (it would write over those rows from its first case).
#[test]
fn importance_keeps_the_finished_cases_when_interrupted_and_a_second_run_leaves_them() {
    let dir = std::env::temp_dir().join(format!("fp-importance-stop-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let args = ["importance", "--tasks", "niah_single", "--lengths", "300", "--samples", "3", "--budgets", "16,64"];
    let (out, seen) = interrupted_after_the_first(bin().args(args).args(["--out", dir.to_str().unwrap()]), 3, "cases");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(6), "interrupted is cancelled: {seen}");
    let done: usize = stdout
        .lines()
        .next()
        .and_then(|l| l.strip_prefix("PARTIAL: "))
        .and_then(|r| r.strip_suffix(" of 3 cases finished (interrupted)"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{stdout}\n{seen}"));
    assert!((1..3).contains(&done), "{stdout}");
    assert!(stdout.contains(&format!("| all | 300 | 64 | {done} |")), "the table is of the finished cases: {stdout}");
    let rows: Vec<serde_json::Value> =
        serde_json::from_slice(&std::fs::read(dir.join("importance.json")).expect("importance.json")).expect("json");
    assert_eq!(rows.len(), 2 * done, "two budgets per finished case");
    let md = std::fs::read_to_string(dir.join("importance.md")).expect("importance.md");
    assert!(md.starts_with(&format!("PARTIAL: {done} of 3 cases finished")), "{md}");
    let (ok, _, err) = run(&[&args[..], &["--out", dir.to_str().unwrap()]].concat());
    assert!(!ok && err.contains("holds the rows of a run that stopped before its end"), "{err}");
    assert_eq!(std::fs::read_to_string(dir.join("importance.md")).expect("importance.md"), md, "left as it was");
    let _ = std::fs::remove_dir_all(dir);
}

/// `bench prefill --json` keeps the lengths it timed: a Ctrl-C ends the run in progress and the
/// object holds the lengths timed (the one cut short with its timed runs), `stopped` and
/// `lengths_planned`; before, it printed nothing until its last length.
#[test]
fn bench_prefill_keeps_the_lengths_it_timed_when_interrupted() {
    let args = ["bench", "prefill", "--tokens", "64,96,128,160,192,224,256", "--runs", "2", "--json"];
    let (out, seen) = interrupted_after_the_first(bin().args(args), 7, "lengths");
    assert_eq!(out.status.code(), Some(6), "interrupted is cancelled: {seen}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}\n{seen}"));
    assert_eq!((v["stopped"].as_str(), v["lengths_planned"].as_u64()), (Some("interrupted"), Some(7)), "{v}");
    let rows = v["results"].as_array().expect("results");
    assert!((1..7).contains(&rows.len()) && rows[0]["tokens"] == 64 && rows[0]["runs"] == 2, "{v}");
    assert!(rows.iter().all(|r| r["runs"].as_u64().is_some_and(|n| (1..=2).contains(&n))), "{v}");
    let full = rows.iter().filter(|r| r["runs"] == 2).count();
    assert!(seen.contains(&format!("interrupted after {full} of 7 lengths")), "{seen}");
}

/// `bench ttft` stopped by Ctrl-C after its first point: the point in progress finishes, and the
/// table, the CSV and the chart of the points so far are made before it exits with the
/// cancelled code (6).
#[test]
fn bench_ttft_interrupted_keeps_the_points_so_far() {
    let dir = std::env::temp_dir().join(format!("fp-ttft-stop-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let args = ["bench", "ttft", "--lengths", "200,300,400,500", "--methods", "full,none", "--runs", "1"];
    let (out, seen) = interrupted_after(bin().args(args).args(["--out", dir.to_str().unwrap()]), &|l| {
        l.trim_start().starts_with("200 tokens  P=1")
    });
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(6), "interrupted is cancelled: {stdout}{seen}");
    let points: usize = stdout
        .lines()
        .find_map(|l| l.strip_prefix("PARTIAL: ")?.strip_suffix(" points measured (interrupted)")?.parse().ok())
        .unwrap_or_else(|| panic!("{stdout}\n{seen}"));
    assert!((1..8).contains(&points), "{stdout}");
    let csv = std::fs::read_to_string(dir.join("ttft.csv")).expect("ttft.csv");
    assert!(csv.lines().count() > points, "a header and a row per timed run: {csv}");
    assert!(dir.join("ttft.png").is_file(), "the chart of the points so far: {stdout}");
    assert!(seen.contains(&format!("interrupted after {points} points")), "{seen}");
    let _ = std::fs::remove_dir_all(dir);
}
