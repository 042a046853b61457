//! The sharded pipeline under real MPI processes (built with `--features mpi`; the README's
//! test command enables it whenever OpenMPI is installed, and `.ci/run` installs it).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Top first-token logits of an MPI run vs a one-rank run, absolute (logit range is ~40).
const MPI_TOP_LOGIT_TOL: f64 = 1e-2;

use crate::mpi_support::{assert_same_answer, docs, json, rank_pids, run_args, started_rank, wait_gone};

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_flowprefill")
}

fn mpirun(np: usize) -> Command {
    let mut c = Command::new("mpirun");
    c.args(["--oversubscribe", "-np", &np.to_string()])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1");
    c
}

#[test]
fn mpi_np2_and_np4_equal_one_rank() {
    let (dir, doc_args) = docs("eq", 5, 9);
    // Every method's distributed steps equal one rank's over thread ranks (the suite's
    // sharded_equivalence, 2-4 ranks); here the MPI transport carries each kind of exchange:
    // InfoFlow's (probe scores, selected rows, the prompt), ring attention's K/V blocks, and
    // eviction's shares.
    for (method, extra) in [
        ("infoflow", vec![]),
        ("ring", vec![]),
        // Eviction that keeps every row: the same answer; each rank reports its share.
        ("infoflow", vec!["--evict", "snapkv", "--kv-budget", "100000"]),
    ] {
        let mut args = run_args(&doc_args, method, 14);
        args.extend(extra.iter().map(|s| s.to_string()));
        let one = json(&Command::new(bin()).args(&args).output().unwrap());
        // Agreement alone would pass two equally wrong answers: the one-rank answer is right.
        assert!(one["answer"].as_str().is_some_and(|a| a.contains("4729")), "{method} {extra:?}: {}", one["answer"]);
        for np in [2, 4] {
            let t = Instant::now();
            let many = json(&mpirun(np).arg(bin()).args(&args).output().unwrap());
            let tag = format!("{method} {extra:?} -np {np}");
            assert_same_answer(&tag, &many, &one, np, MPI_TOP_LOGIT_TOL);
            let sent: u64 = many["rank_stats"]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(|r| r["comm"]["ops"].as_object().unwrap().values())
                .map(|o| o["bytes_sent"].as_u64().unwrap())
                .sum();
            assert!(sent > 0, "{tag}: ranks communicated");
            if extra.contains(&"--evict") {
                let shares = many["eviction"]["kept_per_rank"].as_array().expect("eviction reported");
                assert_eq!(shares.len(), np, "{tag}");
                assert_eq!(many["eviction"]["rows_before"], one["eviction"]["rows_before"], "{tag}");
            }
            eprintln!("{tag}: {:.1} s", t.elapsed().as_secs_f64());
        }
    }
    // A small budget: every (layer, KV head) keeps exactly it, split over the processes.
    let mut args: Vec<String> = vec!["run".into()];
    args.extend(doc_args.iter().cloned());
    args.extend(
        ["--query", "Which code?", "--max-tokens", "4", "--json", "--evict", "snapkv", "--kv-budget", "40"]
            .map(String::from),
    );
    let e = json(&mpirun(3).arg(bin()).args(&args).output().unwrap())["eviction"].clone();
    let shares: Vec<u64> =
        e["kept_per_rank"].as_array().expect("eviction reported").iter().map(|v| v.as_u64().unwrap()).collect();
    assert_eq!((shares.len(), shares.iter().sum::<u64>()), (3, 40), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}

/// MPI processes of one machine share its memory: a job's plan counts both processes' shares
/// against it (each process took all the free memory as its own before, and together they
/// could overrun it), and the refusal does not advise more ranks, which would add up there too.
#[test]
fn mpi_ranks_on_one_machine_count_their_jobs_against_its_memory_together() {
    let (dir, doc_args) = docs("share", 4, 30);
    let mut args: Vec<String> = vec!["run".into()];
    args.extend(doc_args.iter().cloned());
    args.extend(["--query", "q?", "--max-tokens", "2", "--memory-limit", "0.001"].map(String::from));
    let needs = |out: &std::process::Output| -> (f64, String) {
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        let gib = err
            .split("the job needs ")
            .nth(1)
            .and_then(|r| r.split(" GiB").next())
            .and_then(|g| g.parse().ok())
            .unwrap_or_else(|| panic!("no need in GiB in: {err}"));
        (gib, err)
    };
    let (one, _) = needs(&Command::new(bin()).args(&args).output().unwrap());
    let (two, err) = needs(&mpirun(2).arg(bin()).args(&args).output().unwrap());
    assert!(err.contains("the job's 2 ranks share the memory of cpu"), "{err}");
    assert!(!err.contains("run on more ranks"), "{err}");
    // Two ranks' shares together: about one rank's whole job (each holds half the chunks), far
    // above one share alone (half of it).
    assert!(two > 0.8 * one, "2 processes need {two} GiB together, 1 needs {one} GiB");
    let _ = std::fs::remove_dir_all(dir);
}

fn wait_with_deadline(child: &mut std::process::Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let t = Instant::now();
    while t.elapsed() < limit {
        if let Ok(Some(s)) = child.try_wait() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    None
}

/// Ranks started with different settings (here rank 0 with `--kv-dtype bf16`, as when a
/// `FLOWPREFILL_*` variable reaches one host and not the other) are refused before any job,
/// every process naming rank 1 and what differs, each with exit status 2; before, the first
/// exchange failed on a truncated message (or, with another model of the same shape, answered).
#[test]
fn ranks_started_with_different_settings_are_refused_naming_what_differs() {
    let (dir, doc_args) = docs("setup", 3, 6);
    let run = |kv: Option<&str>| {
        let mut a: Vec<String> = kv.map(|t| vec!["--kv-dtype".to_string(), t.to_string()]).unwrap_or_default();
        a.push("run".into());
        a.extend(doc_args.iter().cloned());
        a.extend(["--query", "Which gate?", "--method", "infoflow", "--max-tokens", "2"].map(String::from));
        a
    };
    let out = mpirun(1)
        .arg(bin())
        .args(run(Some("bf16")))
        .args([":", "-np", "1"])
        .arg(bin())
        .args(run(None))
        .output()
        .expect("mpirun");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("the ranks were not started alike: rank 1: KV dtype f32 (rank 0: bf16)"), "{err}");
    assert!(err.contains("mpirun -x FLOWPREFILL_MODEL"), "says how to pass the settings: {err}");
    assert!(!err.contains("truncated") && !err.contains("out of step"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

/// Only rank 0 reads the inputs: a --doc that exists on rank 0's host alone (here: rank 1 is
/// given a path that does not exist) runs; the followers run the job rank 0 broadcasts.
#[test]
fn only_rank_0_reads_the_documents() {
    let (dir, doc_args) = docs("inputs", 5, 9);
    let query = ["--query", "What is the access code for the north gate?", "--method", "infoflow"];
    let query = [&query[..], &["--max-tokens", "14", "--json"]].concat();
    let missing = dir.join("not-on-this-host.txt");
    let out = mpirun(1)
        .arg(bin())
        .arg("run")
        .args(&doc_args)
        .args(&query)
        .args([":", "-np", "1"])
        .arg(bin())
        .args(["run", "--doc", missing.to_str().unwrap()])
        .args(&query)
        .output()
        .expect("mpirun");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(json(&out)["answer"].as_str().is_some_and(|a| a.contains("4729")), "{}", json(&out));
    let _ = std::fs::remove_dir_all(dir);
}

/// A panic on rank 0 under mpirun ends the job at once, both ranks saying why (the follower
/// told that rank 0 left); before, rank 0 sat in MPI's finalisation until the follower's
/// deadline (60 s) and mpirun reported the follower's timeout.
#[test]
fn a_panic_on_rank_0_ends_the_mpi_job_at_once() {
    let (dir, doc_args) = docs("panic0", 4, 10);
    let t = Instant::now();
    let out = mpirun(2)
        .arg(bin())
        .arg("run")
        .args(&doc_args)
        .args(["--query", "What is the access code for the north gate?", "--method", "infoflow", "--max-tokens", "4"])
        .env("FLOWPREFILL_FAULT", "rank:0,phase:probe,mode:panic")
        .output()
        .expect("mpirun");
    let took = t.elapsed();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(took < Duration::from_secs(30), "took {took:?}: {err}");
    // mpirun's status is the first process to exit: rank 0's (70) or the follower's (4, its peer lost).
    assert!(matches!(out.status.code(), Some(70 | 4)), "{err}");
    assert!(err.contains("rank 0: error: rank 0 panicked"), "{err}");
    assert!(err.contains("rank 1: error: rank 0 was lost") && err.contains("it left the world"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

/// By default OpenMPI's launcher itself ends a job one of whose processes died of a signal,
/// naming it, about a second after the kill: before any deadline of flowprefill's.
#[test]
fn a_killed_mpi_rank_ends_the_job_within_30_seconds_naming_it() {
    killed_rank_is_named_within_30_seconds("kill", &[]);
}

/// With the launcher told not to end the job (`orte_abort_on_non_zero_status` 0, as a
/// scheduler that leaves failure handling to the job does), rank 0 names the lost rank itself
/// at its deadline (`--comm-timeout 10`), with its exit status 4, instead of waiting forever.
#[test]
fn a_killed_mpi_rank_is_named_by_rank_0_when_the_launcher_does_not_end_the_job() {
    killed_rank_is_named_by_rank_0(false);
}

/// The same, with rank 1 killed while it loads its model and rank 0 waits for it at the start's
/// agreement (which waits up to 30 minutes for a slow load): rank 1's process stopped beating,
/// so rank 0 names it within its `--comm-timeout` of silence. Before, it waited the 30 minutes.
#[test]
fn an_mpi_rank_killed_while_the_ranks_load_is_named_within_the_comm_timeout() {
    killed_rank_is_named_by_rank_0(true);
}

/// A rank that loads its model slowly (stalled 14 s, past a `--comm-timeout` of 5 s and the
/// silence limit's floor of 10 s) is alive (its process beats): the others wait for it, and the
/// job runs (`full`: the follower waits on rank 0's ticks, so that the deadline bounds nothing
/// else of a loaded machine).
#[test]
fn a_rank_that_loads_slowly_is_waited_for_past_the_comm_timeout() {
    let (dir, doc_args) = docs("slow-load", 4, 9);
    let mut args = run_args(&doc_args, "full", 14);
    args.extend(["--comm-timeout", "5"].map(String::from));
    let t = Instant::now();
    let out = mpirun(2).arg(bin()).args(&args).env("FLOWPREFILL_FAULT", "rank:1,phase:load,mode:stall:14000").output();
    let out = out.unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(t.elapsed() >= Duration::from_secs(14), "rank 1's load stalled 14 s: {:?}", t.elapsed());
    let v = json(&out);
    assert_eq!(v["ranks"], 2);
    assert!(v["answer"].as_str().is_some_and(|a| a.contains("4729")), "{}", v["answer"]);
    let _ = std::fs::remove_dir_all(dir);
}

fn killed_rank_is_named_by_rank_0(while_loading: bool) {
    let version = Command::new("mpirun").arg("--version").output().map(|o| o.stdout).unwrap_or_default();
    if !String::from_utf8_lossy(&version).contains("Open MPI) 4.") {
        flowprefill_kernels::testing::skipped(
            "not Open MPI 4",
            "its launcher's setting to leave a killed process's job running (orte_abort_on_non_zero_status)",
        );
        return;
    }
    let (dir, doc_args) = docs(if while_loading { "kill-load" } else { "kill-own" }, 6, 25);
    let marker = dir.to_string_lossy().into_owned();
    let mut mpirun = mpirun(2);
    if while_loading {
        // Rank 1 never finishes loading (alive and beating until the kill).
        mpirun.env("FLOWPREFILL_FAULT", "rank:1,phase:load,mode:hang");
    }
    let mut child = mpirun
        .env("OMPI_MCA_orte_abort_on_non_zero_status", "0")
        .arg(bin())
        .arg("run")
        .args(&doc_args)
        .args(["--query", "What is the access code for the north gate?", "--method", "infoflow", "--max-tokens", "400"])
        .args(["--comm-timeout", "10"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pipe = child.stderr.take().unwrap();
    // The launcher waits on after both ranks are gone: it is killed at the end, or on a panic.
    let mut child = KillOnDrop(child);
    let err = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let reader = {
        let err = err.clone();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(pipe).lines().map_while(Result::ok) {
                let mut e = err.lock().unwrap();
                e.push_str(&line);
                e.push('\n');
            }
        })
    };
    let victim = started_rank(&marker, 1);
    // Killed once rank 0 has loaded (it then waits for rank 1 at the start's agreement), or
    // once both ranks have loaded and the job runs.
    let loaded = if while_loading { 1 } else { 2 };
    let t = Instant::now();
    while err.lock().unwrap().lines().filter(|l| l.starts_with("loaded ")).count() < loaded {
        assert!(t.elapsed() < Duration::from_secs(120), "the ranks did not load: {}", err.lock().unwrap());
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_secs(2));
    Command::new("kill").args(["-9", &victim.to_string()]).status().unwrap();
    let killed_at = Instant::now();
    // The launcher itself then waits on: rank 0's own line is what is asked for.
    let named = loop {
        let text = err.lock().unwrap().clone();
        if let Some(line) = text.lines().find(|l| l.starts_with("rank 0: error: rank 1")) {
            break line.to_string();
        }
        assert!(killed_at.elapsed() < Duration::from_secs(40), "rank 0 did not name rank 1 within 40 s: {text}");
        std::thread::sleep(Duration::from_millis(200));
    };
    if while_loading {
        assert!(
            named.contains("rank 1 was lost during `setup.agree`") && named.contains("nothing heard from its process"),
            "{named}"
        );
        assert!(killed_at.elapsed() < Duration::from_secs(30), "named {:?} after the kill", killed_at.elapsed());
    } else {
        assert!(named.contains("rank 1 did not answer within 10 s") || named.contains("rank 1 was lost"), "{named}");
    }
    assert!(rank_pids(&marker, 0).is_empty() || wait_gone(&marker, 0), "rank 0 exited after naming it");
    let _ = child.0.kill();
    let _ = child.0.wait();
    let _ = reader.join();
    let _ = std::fs::remove_dir_all(dir);
}

/// A launcher killed when the test ends, however it ends.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// With `--device cuda` every rank drives its GPU and the ranks move K/V over NCCL; a killed
/// rank is named within 30 s (the control exchange before every NCCL transfer has the
/// deadline, and the NCCL communicator is aborted). Needs two GPUs.
#[cfg(feature = "nccl")]
#[test]
fn a_killed_gpu_rank_is_named_within_30_seconds() {
    let n = flowprefill_kernels::cuda::devices().map_or(0, |d| d.len());
    if n < 2 {
        flowprefill_kernels::testing::skipped(
            "fewer than 2 CUDA devices",
            format!("found {n}: a killed GPU rank under mpirun"),
        );
        return;
    }
    killed_rank_is_named_within_30_seconds("kill-gpu", &["--device", "cuda", "--comm-timeout", "20"]);
}

/// Kills rank 1 of a 2-process job while it works; the job must end within 30 s naming it.
fn killed_rank_is_named_within_30_seconds(tag: &str, extra: &[&str]) {
    let (dir, doc_args) = docs(tag, 6, 25);
    let marker = dir.to_string_lossy().into_owned();
    let mut child = mpirun(2)
        .arg(bin())
        .arg("run")
        .args(&doc_args)
        .args(["--query", "What is the access code for the north gate?", "--method", "infoflow", "--max-tokens", "400"])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until rank 1 exists and has started working, then kill it.
    let victim = started_rank(&marker, 1);
    std::thread::sleep(Duration::from_secs(2));
    assert!(child.try_wait().unwrap().is_none(), "the job should still be running");
    let killed_at = Instant::now();
    Command::new("kill").args(["-9", &victim.to_string()]).status().unwrap();
    let status =
        wait_with_deadline(&mut child, Duration::from_secs(30)).expect("the job must end within 30 s of the kill");
    let took = killed_at.elapsed();
    let out = child.wait_with_output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!status.success(), "{text}");
    // Named by flowprefill (rank 0's deadline) or, first as a rule, by the launcher.
    let ours = text.contains("rank 0: error: rank 1");
    let launcher = text.contains("process rank 1") && text.contains("signal 9");
    assert!(ours || launcher, "the lost rank is named: {text}");
    eprintln!(
        "job ended {:.1} s after the kill: {}",
        took.as_secs_f64(),
        text.lines().filter(|l| l.contains("rank 1")).collect::<Vec<_>>().join(" | ")
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_hung_mpi_rank_is_named_by_the_deadline() {
    let (dir, doc_args) = docs("hang", 4, 12);
    let mut child = mpirun(2)
        .arg(bin())
        .arg("run")
        .args(&doc_args)
        // 30 s: a loaded 2-core machine (the 4-process test beside this one) has kept a healthy
        // rank busier than 5 s, and once (2026-11-25) than 15 s, between two collectives of the
        // probe; this test runs beside longer ones, so the wait costs the suite nothing.
        .args(["--query", "What is the access code for the north gate?", "--method", "infoflow"])
        .args(["--comm-timeout", "30"])
        .env("FLOWPREFILL_FAULT", "rank:1,phase:recompute,mode:hang")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = wait_with_deadline(&mut child, Duration::from_secs(120)).expect("no hang");
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(status.code(), Some(4), "a rank failure: {err}");
    assert!(err.contains("rank 1 did not answer within 30 s during `recompute"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

/// `bench calibrate` then `bench ttft` under `mpirun -np 3`: the rank counts 1, 2 and 3 run on
/// the first processes of the world (the others sit each block out), every count is measured,
/// and each run's projection from the calibrated profile is printed beside it.
#[test]
fn bench_ttft_measures_every_rank_count_of_one_mpirun_with_its_projection() {
    let dir = std::env::temp_dir().join(format!("fp-mpi-ttft-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let profile = dir.join("cpu-local.json");
    let out = mpirun(2)
        .arg(bin())
        .args(["--threads", "1", "bench", "calibrate", "--seconds", "0.02", "--out"])
        .arg(&profile)
        .output()
        .unwrap();
    assert!(out.status.success(), "calibrate: {}", String::from_utf8_lossy(&out.stderr));
    let p: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&profile).unwrap()).unwrap();
    assert!(p["devices"]["cpu-local"]["peak_flops"]["value"].as_f64().unwrap() > 0.0, "{p}");
    for link in ["cpu-threads", "cpu-mpi"] {
        let l = &p["links"][link];
        assert!(
            l["bytes_per_s"]["value"].as_f64().unwrap() > 0.0 && l["latency_s"]["source"].is_string(),
            "{link}: {p}"
        );
    }
    // A link measured alone is added beside the device measured before, which stays.
    let out = mpirun(2)
        .arg(bin())
        .args(["--threads", "1", "bench", "calibrate", "--seconds", "0.02", "--link-name", "hosts-test", "--out"])
        .arg(&profile)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.contains("kept from") && err.contains("device cpu-local"), "{err}");
    let p: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&profile).unwrap()).unwrap();
    assert!(p["devices"]["cpu-local"]["peak_flops"]["value"].as_f64().unwrap() > 0.0, "the device stays: {p}");
    assert!(p["links"]["hosts-test"]["bytes_per_s"]["value"].as_f64().unwrap() > 0.0, "{p}");
    assert!(p["links"]["cpu-mpi"].is_object(), "{p}");
    let t = Instant::now();
    let out = mpirun(3)
        .arg(bin())
        .args(["--threads", "1", "bench", "ttft", "--lengths", "300", "--doc-tokens", "100", "--ranks", "1,2,3"])
        .args(["--runs", "1", "--methods", "full,ring,infoflow", "--project", "cpu-local", "--profiles"])
        .arg(&profile)
        .arg("--out")
        .arg(&dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "ttft: {}\n{stdout}", String::from_utf8_lossy(&out.stderr));
    assert!(t.elapsed() < Duration::from_secs(300), "bench ttft took {:?}", t.elapsed());
    assert!(stdout.contains("MPI ranks (of 3 processes)"), "{stdout}");
    let csv = std::fs::read_to_string(dir.join("ttft.csv")).unwrap();
    let rows: Vec<Vec<&str>> = csv.lines().skip(1).map(|l| l.split(',').collect()).collect();
    let has = |ranks: &str, method: &str| rows.iter().any(|r| r[2] == ranks && r[3] == method);
    assert!(has("1", "full") && has("1", "infoflow"), "{csv}");
    for p in ["2", "3"] {
        assert!(has(p, "ring") && has(p, "infoflow"), "rank count {p} missing: {csv}");
    }
    let phases_col = csv.lines().next().unwrap().split(',').position(|c| c == "projected_phases").expect("a column");
    for r in &rows {
        let (measured, projected): (f64, f64) = (r[6].parse().unwrap(), r[7].parse().unwrap());
        assert!(measured > 0.0 && projected > 0.0, "{r:?}");
        // The projection phase by phase (`phase:total:compute:exposed`): the phases the
        // method runs, whose totals add up to the projected TTFT.
        let phases: Vec<Vec<&str>> = r[phases_col].split(';').map(|p| p.split(':').collect()).collect();
        let names: Vec<&str> = phases.iter().map(|p| p[0]).collect();
        let want: &[&str] =
            if r[3] == "infoflow" { &["chunk_prefill", "probe", "recompute", "final_prompt"] } else { &["prefill"] };
        assert_eq!(names, want, "{r:?}");
        let total: f64 = phases.iter().map(|p| p[1].parse::<f64>().unwrap()).sum();
        assert!((total - projected).abs() <= 0.1 * phases.len() as f64, "{total} against {projected}: {r:?}");
        for p in &phases {
            let [t, c, e] = [1, 2, 3].map(|i| p[i].parse::<f64>().unwrap());
            assert!(c >= 0.0 && e >= 0.0 && c <= t + 0.1 && e <= t + 0.1, "{p:?} in {r:?}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `mpirun -np 2 flowprefill ingest`: the ranks share the documents (every other one each) and
/// the one store folder; rank 0 reports them all; a single-process run then finds every cache.
#[test]
fn mpirun_ingest_spreads_documents_over_the_ranks_into_one_store() {
    let (dir, doc_args) = docs("ingest", 3, 4);
    let store = dir.join("store");
    let out = mpirun(2)
        .arg(bin())
        .args(["ingest", "--json", "--store", store.to_str().unwrap()])
        .args(&doc_args)
        .output()
        .expect("mpirun");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v = json(&out);
    assert_eq!(v["ranks"], 2, "{v}");
    let ranks: Vec<u64> = v["documents"].as_array().unwrap().iter().map(|d| d["rank"].as_u64().unwrap()).collect();
    assert_eq!(ranks, vec![0, 1, 0], "{v}");
    assert!(v["documents"].as_array().unwrap().iter().all(|d| d["prefilled"] == 2), "{v}");
    let out = Command::new(bin())
        .args(["run", "--json", "--max-tokens", "2", "--query", "What is the access code for the north gate?"])
        .args(["--store", store.to_str().unwrap()])
        .args(&doc_args)
        .output()
        .expect("run");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r = json(&out);
    assert_eq!(r["cache_misses"], 0, "every cache was ingested by one rank or the other: {r}");
    // A document rank 1 cannot ingest (far beyond the window): rank 0 says so at once, with
    // rank 1's reason and what was stored, instead of waiting out the comm timeout.
    let huge = dir.join("huge.txt");
    std::fs::write(&huge, "word ".repeat(400_000)).unwrap();
    let t = std::time::Instant::now();
    let out = mpirun(2)
        .arg(bin())
        .args(["ingest", "--store", store.to_str().unwrap(), "--doc"])
        .arg(&doc_args[1])
        .arg("--doc")
        .arg(&huge)
        .output()
        .expect("mpirun");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("rank 0: error: ingestion stopped on 1 rank(s): rank 1:"), "{err}");
    assert!(err.contains("huge.txt") && err.contains("context") && err.contains("stored before that:"), "{err}");
    assert!(t.elapsed() < std::time::Duration::from_secs(50), "{:?}: rank 0 waited for rank 1", t.elapsed());
    let _ = std::fs::remove_dir_all(&dir);
}
