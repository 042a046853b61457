//! Ranks on two hosts: network namespaces made by `scripts/hosts.sh`, one `mpirun` across them
//! whose launch agent enters each host's namespace, TCP between the hosts and never shared
//! memory. The answers equal one rank's; a host whose link goes down is named within the comm
//! timeout and the job ends. Needs root (or the capabilities for network namespaces) and
//! iproute2; elsewhere the tests say "skipped" with the reason.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Top first-token logits across hosts vs one rank, absolute (logit range is ~40).
const HOSTS_TOP_LOGIT_TOL: f64 = 1e-2;
/// The comm timeout of the fault test, and how long the launch agent lets a link stay down
/// before it drops the host (as ssh's keepalive would): the job must end within both plus the
/// time MPI takes to tear down.
const FAULT_COMM_TIMEOUT_S: u64 = 5;
const KEEPALIVE_S: u64 = 8;
const FAULT_END_LIMIT: Duration = Duration::from_secs(45);

use crate::mpi_support::{assert_same_answer, docs, json, run_args};

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_flowprefill")
}

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/hosts.sh")
}

/// `scripts/hosts.sh` with this test binary's own hosts (prefix and network apart from a
/// user's, and from other test binaries').
fn hosts_sh() -> Command {
    let mut c = Command::new("bash");
    c.arg(script())
        .env("FLOWPREFILL_HOSTS_PREFIX", "fpt")
        .env("FLOWPREFILL_HOSTS_NET", "10.78.0")
        .env("FLOWPREFILL_HOSTS_KEEPALIVE", KEEPALIVE_S.to_string())
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    c
}

/// Two hosts for the life of the value (taken down on drop, also when a test fails).
struct Hosts;

impl Hosts {
    /// Two hosts, or `None` (said "skipped") where this machine cannot make them.
    fn up() -> Option<Self> {
        if Command::new("mpirun").arg("--version").output().map_or(true, |o| !o.status.success()) {
            flowprefill_kernels::testing::skipped("no mpirun", "ranks on two hosts");
            return None;
        }
        let check = hosts_sh().arg("check").output().expect("bash runs");
        if !check.status.success() {
            flowprefill_kernels::testing::skipped(
                "no network namespaces",
                String::from_utf8_lossy(&check.stderr).replace('\n', " "),
            );
            return None;
        }
        let _ = hosts_sh().arg("down").status();
        let up = hosts_sh().args(["up", "2"]).output().expect("bash runs");
        assert!(up.status.success(), "hosts.sh up 2: {}", String::from_utf8_lossy(&up.stderr));
        Some(Hosts)
    }

    /// `mpirun -np 2` across the hosts, one rank on each.
    fn mpirun(&self) -> Command {
        let mut c = hosts_sh();
        c.args(["mpirun", "-np", "2"]);
        c
    }

    /// `flowprefill ARGS` on both hosts with `fault` injected (`FLOWPREFILL_FAULT`): the
    /// launcher, its stderr's lines as they come, and the thread that reads them.
    fn run_with_fault(
        &self,
        args: &[String],
        fault: &str,
    ) -> (std::process::Child, mpsc::Receiver<String>, std::thread::JoinHandle<()>) {
        let mut child = self
            .mpirun()
            .arg(bin())
            .args(args)
            .env("FLOWPREFILL_STORE", "off")
            .env("FLOWPREFILL_FAULT", fault)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, rx) = mpsc::channel::<String>();
        let err = child.stderr.take().unwrap();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        (child, rx, reader)
    }

    /// Bytes host 1 has sent over its link.
    fn host1_sent(&self) -> u64 {
        std::fs::read_to_string("/sys/class/net/fpt-v1/statistics/rx_bytes")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .expect("host 1's link exists")
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        let _ = hosts_sh().arg("down").status();
    }
}

/// One test function: the hosts are one set per test binary, so the two checks run in turn.
#[test]
fn two_hosts_answer_as_one_rank_and_a_lost_link_is_named() {
    let Some(hosts) = Hosts::up() else { return };
    let (dir, doc_args) = docs("hosts", 5, 10);
    for method in ["full", "ring", "infoflow"] {
        let mut args = vec!["--threads".to_string(), "1".to_string()];
        args.extend(run_args(&doc_args, method, 16));
        let one = json(&Command::new(bin()).args(&args).env("FLOWPREFILL_STORE", "off").output().unwrap());
        assert!(one["answer"].as_str().is_some_and(|a| a.contains("4729")), "{method}: {}", one["answer"]);
        let before = hosts.host1_sent();
        let t = Instant::now();
        let two = json(&hosts.mpirun().arg(bin()).args(&args).env("FLOWPREFILL_STORE", "off").output().unwrap());
        let over_link = hosts.host1_sent() - before;
        assert_same_answer(method, &two, &one, 2, HOSTS_TOP_LOGIT_TOL);
        // What the ranks sent each other crossed host 1's link (TCP between the hosts), not
        // shared memory: at least the payload rank 1 counted.
        let sent1: u64 = two["rank_stats"][1]["comm"]["ops"]
            .as_object()
            .unwrap()
            .values()
            .map(|o| o["bytes_sent"].as_u64().unwrap())
            .sum();
        assert!(sent1 > 0 && over_link >= sent1, "{method}: rank 1 sent {sent1} B, its link carried {over_link} B");
        eprintln!(
            "{method} across 2 hosts: {:.1} s, rank 1 sent {sent1} B, its link carried {over_link} B",
            t.elapsed().as_secs_f64()
        );
    }

    // Host 1's link goes down while rank 1 is in the recompute (it stalls there 4 s, so that
    // the cut lands in that phase on a loaded machine too; under the 5 s comm timeout, so that
    // the cut link is what ends the job): rank 0 names it within the comm timeout.
    let mut args: Vec<String> = vec!["--threads".into(), "1".into(), "run".into()];
    args.extend(doc_args.iter().cloned());
    args.extend(
        ["--query", "What is the access code for the north gate?", "--method", "infoflow", "--max-tokens", "12"]
            .map(String::from),
    );
    args.extend(["--comm-timeout".to_string(), FAULT_COMM_TIMEOUT_S.to_string()]);
    let (mut child, rx, reader) = hosts.run_with_fault(&args, "rank:1,phase:recompute,mode:stall:4000");
    let mut text = String::new();
    let t = Instant::now();
    loop {
        let line = rx.recv_timeout(Duration::from_secs(120)).expect("rank 1 reaches the recompute");
        text.push_str(&line);
        text.push('\n');
        if line.contains("injected fault") {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(120), "rank 1 never reached the recompute: {text}");
    }
    let cut = Instant::now();
    let down = hosts_sh().args(["link", "fpt-h1", "down"]).status().unwrap();
    assert!(down.success());
    let mut named = None;
    let status = ends_within_the_limit(&mut child, cut, "the cut", &mut || {
        while let Ok(line) = rx.try_recv() {
            if named.is_none() && line.contains("rank 1 did not answer") {
                named = Some(cut.elapsed());
            }
            text.push_str(&line);
            text.push('\n');
        }
        text.clone()
    });
    let ended = cut.elapsed();
    let _ = reader.join();
    while let Ok(line) = rx.try_recv() {
        if named.is_none() && line.contains("rank 1 did not answer") {
            named = Some(cut.elapsed());
        }
        text.push_str(&line);
        text.push('\n');
    }
    assert!(!status.success(), "{text}");
    let named = named.unwrap_or_else(|| panic!("rank 0 names rank 1: {text}"));
    // Rank 0 waits at most the comm timeout from the start of its wait, which began before the
    // cut; a margin for a loaded machine.
    assert!(named <= Duration::from_secs(FAULT_COMM_TIMEOUT_S + 5), "named after {named:?}: {text}");
    eprintln!(
        "link down during recompute: rank 1 named {:.1} s after the cut, the job ended after {:.1} s",
        named.as_secs_f64(),
        ended.as_secs_f64()
    );
    let _ = hosts_sh().args(["link", "fpt-h1", "up"]).status();
    let _ = std::fs::remove_dir_all(dir);
    a_rank_killed_while_it_loads_ends_the_job(&hosts);
}

/// Waits for the job (`child`) to end, calling `tick` at every look (it reads what the job
/// printed, and returns it); [`FAULT_END_LIMIT`] after `from` (`what` happened then), the job
/// is killed and the test fails with that text.
fn ends_within_the_limit(
    child: &mut std::process::Child,
    from: Instant,
    what: &str,
    tick: &mut dyn FnMut() -> String,
) -> std::process::ExitStatus {
    loop {
        let text = tick();
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if from.elapsed() > FAULT_END_LIMIT {
            let _ = child.kill();
            panic!("the job did not end within {FAULT_END_LIMIT:?} of {what}: {text}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Rank 1's process (host 1) is killed while it loads its model (it never finishes: the fault
/// hangs it there), rank 0 having loaded and waiting for it at the start's agreement, which
/// waits up to 30 minutes for a slow load: the job ends within [`FAULT_END_LIMIT`], rank 1
/// named, by rank 0 (its process went silent) or by Open MPI's launcher, whichever comes first.
fn a_rank_killed_while_it_loads_ends_the_job(hosts: &Hosts) {
    let (dir, doc_args) = docs("hosts-kill-load", 3, 5);
    let marker = dir.to_string_lossy().into_owned();
    let mut args: Vec<String> = vec!["--threads".into(), "1".into(), "run".into()];
    args.extend(doc_args.iter().cloned());
    args.extend(
        ["--query", "What is the north gate code?", "--max-tokens", "4", "--comm-timeout", "10"].map(String::from),
    );
    let (mut child, rx, reader) = hosts.run_with_fault(&args, "rank:1,phase:load,mode:hang");
    let victim = crate::mpi_support::started_rank(&marker, 1);
    let mut text = String::new();
    let t = Instant::now();
    while !text.lines().any(|l| l.starts_with("loaded ")) {
        let line =
            rx.recv_timeout(Duration::from_secs(120)).unwrap_or_else(|e| panic!("rank 0 did not load ({e}): {text}"));
        text.push_str(&line);
        text.push('\n');
        assert!(t.elapsed() < Duration::from_secs(120), "rank 0 did not load: {text}");
    }
    std::thread::sleep(Duration::from_secs(2));
    assert!(Command::new("kill").args(["-9", &victim.to_string()]).status().unwrap().success());
    let killed = Instant::now();
    let status = ends_within_the_limit(&mut child, killed, "the kill", &mut || text.clone());
    let ended = killed.elapsed();
    let _ = reader.join();
    text.extend(rx.try_iter().map(|l| l + "\n"));
    assert!(!status.success(), "{text}");
    let by_rank_0 = text.contains("rank 1 was lost during `setup.agree`");
    let naming = |l: &&str| {
        l.contains("rank 1 was lost during `setup.agree`")
            || (l.contains("rank 1") && (l.contains("signal 9") || l.contains("Killed")))
    };
    let named = text.lines().find(naming).unwrap_or_else(|| panic!("rank 1 is named: {text}"));
    assert!(crate::mpi_support::wait_gone(&marker, 0), "rank 0 ended: {text}");
    eprintln!(
        "rank 1 killed while loading on host 1: the job ended {:.1} s after the kill, rank 1 named by {}: {}",
        ended.as_secs_f64(),
        if by_rank_0 { "rank 0" } else { "Open MPI's launcher" },
        named.trim()
    );
    let _ = std::fs::remove_dir_all(dir);
}
