//! Helpers shared by the tests that run `flowprefill` under `mpirun` (`mpi.rs`, `hosts.rs`).

use std::path::PathBuf;
use std::time::{Duration, Instant};

/// `n_docs` documents of `sentences` sentences about towers and lanterns, one of them (the
/// middle one, half way in) holding the access code 4729: the folder and the `--doc` arguments.
pub fn docs(tag: &str, n_docs: usize, sentences: usize) -> (PathBuf, Vec<String>) {
    let dir = std::env::temp_dir().join(format!("fp-mpi-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut args = Vec::new();
    for i in 0..n_docs {
        let mut text = String::new();
        for s in 0..sentences {
            text.push_str(&format!(
                "The keeper of tower {i} counted {} lanterns near the river in year {}. ",
                s * 7 + i,
                1800 + s
            ));
            if i == n_docs / 2 && s == sentences / 2 {
                text.push_str("The access code for the north gate is 4729. ");
            }
        }
        let p = dir.join(format!("d{i}.txt"));
        std::fs::write(&p, text).unwrap();
        args.push("--doc".into());
        args.push(p.to_string_lossy().into_owned());
    }
    (dir, args)
}

/// The JSON a successful command printed (panics with its stderr otherwise).
pub fn json(out: &std::process::Output) -> serde_json::Value {
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

/// `run` of the access-code question over `doc_args` by `method`, printing JSON.
pub fn run_args(doc_args: &[String], method: &str, max_tokens: usize) -> Vec<String> {
    let mut args: Vec<String> = vec!["run".into()];
    args.extend(doc_args.iter().cloned());
    args.extend(["--query", "What is the access code for the north gate?", "--method", method].map(String::from));
    args.extend(["--max-tokens".to_string(), max_tokens.to_string(), "--json".to_string()]);
    args
}

/// A run on `ranks` ranks answered as one rank did: the answer, the selection and the first
/// token's top logits (ids equal, values within `tol`).
pub fn assert_same_answer(tag: &str, many: &serde_json::Value, one: &serde_json::Value, ranks: usize, tol: f64) {
    assert_eq!(many["ranks"], ranks, "{tag}");
    assert_eq!(many["answer"], one["answer"], "{tag}");
    assert_eq!(many["selected"], one["selected"], "{tag}");
    assert_eq!(many["order"], one["order"], "{tag}");
    let (a, b) = (many["first_top_logits"].as_array().unwrap(), one["first_top_logits"].as_array().unwrap());
    assert_eq!(a.len(), b.len(), "{tag}: top logits");
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x[0], y[0], "{tag}: top token ids");
        let d = (x[1].as_f64().unwrap() - y[1].as_f64().unwrap()).abs();
        assert!(d <= tol, "{tag}: logit differs by {d}");
    }
}

/// PIDs of processes whose environment says they are MPI rank `rank` of a job started with
/// `marker` in their command line.
pub fn rank_pids(marker: &str, rank: usize) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if !String::from_utf8_lossy(&cmd).contains(marker) {
            continue;
        }
        let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        if env.split(|&b| b == 0).any(|kv| kv == format!("OMPI_COMM_WORLD_RANK={rank}").as_bytes()) {
            out.push(pid);
        }
    }
    out
}

/// The pid of rank `rank` of the job whose command line holds `marker`, once it exists.
pub fn started_rank(marker: &str, rank: usize) -> u32 {
    let t = Instant::now();
    loop {
        if let Some(&p) = rank_pids(marker, rank).first() {
            return p;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "rank {rank} never started");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Whether rank `rank`'s process is gone within 10 s.
pub fn wait_gone(marker: &str, rank: usize) -> bool {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(10) {
        if rank_pids(marker, rank).is_empty() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    false
}
