//! The fault matrix of the service (`flowprefill bench faults`). Every row starts a fresh
//! `serve` (thread ranks, or processes under `mpirun`), injects one fault with
//! `FLOWPREFILL_FAULT`, sends a job, then a second job, and records what a client sees:
//!
//! ```text
//!   fault  panic | hang | exit           on rank 0 and on rank 1, at every phase
//!          client disconnect              while rank 0 is busy in each phase (a 3 s stall)
//!          deadline (1.5 s)               passing while rank 0 is busy in each phase
//!   ->     status and message, seconds to the answer, the next job, /readyz, how it exited
//! ```
//! The table is written as Markdown (and JSON) for `docs/faults.md`.

use crate::http;
use crate::{LabError, Result};
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A failure of the drill itself (a server that did not start, a connection refused).
fn failed(e: impl std::fmt::Display) -> LabError {
    LabError::Failed(e.to_string())
}

const PHASES: [&str; 5] = ["chunk_prefill", "probe", "recompute", "final_prompt", "decode"];
/// Seconds a rank waits for another (the server's --comm-timeout in every row).
const COMM_TIMEOUT_S: u64 = 5;
/// How long rank 0 is busy in a phase in the disconnect rows (the client leaves 1.5 s after
/// sending; a small job reaches any phase sooner).
const STALL_MS: u64 = 3000;
/// The deadline of the deadline rows, and how long rank 0 is busy in the phase there: the
/// deadline passes during the stall, and the stall ends before the service's own answer
/// (deadline + 2 s), so the row shows where the ranks stopped.
const DEADLINE_S: f64 = 1.5;
const DEADLINE_STALL_MS: u64 = 2000;
/// The deadline of the fault rows (so that a hung rank 0 is answered too).
const FAULT_DEADLINE_S: f64 = 10.0;

/// One row of the matrix: what is injected.
#[derive(Clone, Debug)]
pub enum Case {
    /// A rank panics, hangs or exits in a phase.
    #[allow(missing_docs)]
    Fault { mode: &'static str, rank: usize, phase: &'static str },
    /// The client leaves while rank 0 is busy in a phase.
    #[allow(missing_docs)]
    Disconnect { phase: &'static str },
    /// The deadline passes while rank 0 is busy in a phase.
    #[allow(missing_docs)]
    Deadline { phase: &'static str },
}

impl Case {
    /// The row's label.
    pub fn label(&self) -> String {
        match self {
            Case::Fault { mode, rank, phase } => format!("{mode} on rank {rank} at {phase}"),
            Case::Disconnect { phase } => format!("client disconnect during {phase}"),
            Case::Deadline { phase } => format!("deadline ({DEADLINE_S} s) during {phase}"),
        }
    }

    fn spec(&self) -> String {
        match self {
            Case::Fault { mode, rank, phase } => format!("rank:{rank},phase:{phase},mode:{mode}"),
            Case::Disconnect { phase } => format!("rank:0,phase:{phase},mode:stall:{STALL_MS}"),
            Case::Deadline { phase } => format!("rank:0,phase:{phase},mode:stall:{DEADLINE_STALL_MS}"),
        }
    }
}

/// Every row of the matrix, in order.
pub fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    for mode in ["panic", "hang", "exit"] {
        for rank in [0, 1] {
            for phase in PHASES {
                v.push(Case::Fault { mode, rank, phase });
            }
        }
    }
    v.extend(PHASES.iter().map(|&phase| Case::Disconnect { phase }));
    v.extend(PHASES.iter().map(|&phase| Case::Deadline { phase }));
    v
}

/// What a client saw in one row.
#[derive(Debug, serde::Serialize)]
pub struct Row {
    /// threads or mpi.
    pub world: String,
    /// The case's label.
    pub case: String,
    /// HTTP status of the job (or what happened instead).
    pub status: String,
    /// The error message or the answer.
    pub message: String,
    /// Seconds to the answer.
    pub answer_s: Option<f64>,
    /// What the next job got.
    pub next: String,
    /// Seconds to the next job's answer.
    pub next_s: Option<f64>,
    /// /readyz after.
    pub ready: String,
    /// `flowprefill_jobs_in_flight` on /metrics after the next job (0 once every job is
    /// answered; a job the watchdog gave up on must not stay counted).
    #[serde(default)]
    pub in_flight_after: String,
    /// How the server exited on stop.
    pub exit: String,
}

/// A `serve` child process (or `mpirun` running it) and its address.
pub struct ServerProcess {
    child: Child,
    /// host:port.
    pub addr: String,
}

/// Starts `EXE GLOBAL.. serve --listen 127.0.0.1:0 ARGS` (under `mpirun -np N` when `mpi` is
/// given) with `env`; returns once it listens. `global`: the flags every command takes
/// (`--model`, `--device`, ...), as the caller was given them. A server that exits before it
/// listens is an error with the last lines it wrote to stderr (why it could not start).
pub fn spawn_server(
    exe: &Path,
    global: &[String],
    args: &[&str],
    env: &[(&str, &str)],
    mpi: Option<usize>,
) -> Result<ServerProcess> {
    let mut cmd = match mpi {
        Some(np) => {
            let mut c = Command::new("mpirun");
            c.args(["--oversubscribe", "-np", &np.to_string()]).arg(exe);
            c
        }
        None => Command::new(exe),
    };
    cmd.args(global)
        .args(["serve", "--listen", "127.0.0.1:0"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().map_err(|e| failed(format!("starting the server: {e}")))?;
    let out = child.stdout.take().ok_or_else(|| failed("no server stdout"))?;
    // Its stderr is drained all along (a full pipe would stall it), the last lines kept.
    let tail = std::sync::Arc::new(std::sync::Mutex::new(std::collections::VecDeque::new()));
    if let Some(err) = child.stderr.take() {
        let tail = tail.clone();
        std::thread::spawn(move || {
            for l in BufReader::new(err).lines().map_while(std::io::Result::ok) {
                let mut t = tail.lock().unwrap_or_else(|p| p.into_inner());
                if t.len() == 12 {
                    t.pop_front();
                }
                t.push_back(l);
            }
        });
    }
    let mut lines = BufReader::new(out).lines();
    let addr = loop {
        let Some(l) = lines.next() else {
            // Give the drain a moment to read the last lines of a process that has exited.
            let _ = child.wait();
            std::thread::sleep(Duration::from_millis(100));
            let said: Vec<String> = tail.lock().unwrap_or_else(|p| p.into_inner()).iter().cloned().collect();
            return Err(failed(format!(
                "the server exited before listening; its stderr ended with:\n  {}",
                said.join("\n  ")
            )));
        };
        let l = l.map_err(failed)?;
        if let Some(rest) = l.split("http://").nth(1) {
            break rest.split_whitespace().next().unwrap_or("").to_string();
        }
    };
    std::thread::spawn(move || for _ in lines {});
    Ok(ServerProcess { child, addr })
}

impl ServerProcess {
    /// The process id (of `mpirun` under MPI).
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Sends `signal` (e.g. `-TERM`) and waits up to `limit` for the exit; kills it after.
    pub fn stop(mut self, signal: &str, limit: Duration) -> String {
        if let Ok(Some(s)) = self.child.try_wait() {
            return exit_text(s);
        }
        let _ = Command::new("kill").args([signal, &self.child.id().to_string()]).status();
        let t = Instant::now();
        while t.elapsed() < limit {
            if let Ok(Some(s)) = self.child.try_wait() {
                return format!("{} after {:.1} s", exit_text(s), t.elapsed().as_secs_f64());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        format!("killed: still running {:.0} s after {signal}", limit.as_secs_f64())
    }

    fn gone(&mut self) -> Option<String> {
        self.child.try_wait().ok().flatten().map(exit_text)
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn exit_text(s: std::process::ExitStatus) -> String {
    match s.code() {
        Some(0) => "exit 0".into(),
        Some(c) => format!("exit {c}"),
        None => "killed by a signal".into(),
    }
}

fn job_body(tag: &str, deadline_s: f64) -> Vec<u8> {
    let docs: Vec<String> = (0..3)
        .map(|i| {
            let mut t = String::new();
            for s in 0..6 {
                t.push_str(&format!("The {tag} keeper of tower {i} counted {} lanterns in {}. ", s * 3 + i, 1800 + s));
            }
            if i == 1 {
                t.push_str("The access code for the north gate is 4729. ");
            }
            t
        })
        .collect();
    serde_json::to_vec(&serde_json::json!({
        "documents": docs, "query": "What is the access code for the north gate?", "max_tokens": 12,
        "deadline_s": deadline_s,
    }))
    .unwrap_or_default()
}

fn post(addr: &str, body: &[u8]) -> (String, String, f64) {
    let t = Instant::now();
    match http::request(
        addr,
        "POST",
        "/v1/jobs",
        &[("Content-Type", "application/json")],
        body,
        Duration::from_secs(120),
    ) {
        Ok(r) => {
            let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap_or_default();
            let msg = v["error"]["message"].as_str().map_or_else(
                || v["answer"].as_str().map(|a| format!("answer {a:?}")).unwrap_or_default(),
                str::to_string,
            );
            (r.status.to_string(), msg, t.elapsed().as_secs_f64())
        }
        Err(e) => ("no answer".into(), e.to_string(), t.elapsed().as_secs_f64()),
    }
}

fn ready(addr: &str) -> String {
    match http::request(addr, "GET", "/readyz", &[], b"", Duration::from_secs(10)) {
        Ok(r) => {
            let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap_or_default();
            format!("{} (ranks up {})", r.status, v["ranks_up"])
        }
        Err(_) => "no answer".into(),
    }
}

/// The jobs-in-flight gauge of `/metrics` (what follows its name), or what happened instead.
fn in_flight(addr: &str) -> String {
    match http::request(addr, "GET", "/metrics", &[], b"", Duration::from_secs(10)) {
        Ok(r) => String::from_utf8_lossy(&r.body)
            .lines()
            .find_map(|l| l.strip_prefix("flowprefill_jobs_in_flight ").map(|v| v.trim().to_string()))
            .unwrap_or_else(|| "not on /metrics".into()),
        Err(_) => "no answer".into(),
    }
}

/// Runs one row on a fresh server (`exe`, with `model`) in `world` (threads or mpi).
pub fn run_case(exe: &Path, model: Option<&Path>, world: &str, case: &Case) -> Result<Row> {
    let mpi = (world == "mpi").then_some(2);
    let timeout = COMM_TIMEOUT_S.to_string();
    let mut args = vec!["--comm-timeout", &timeout, "--shutdown-grace", "1"];
    if mpi.is_none() {
        args.extend(["--ranks", "2"]);
    }
    let spec = case.spec();
    let global: Vec<String> =
        model.map(|m| vec!["--model".to_string(), m.to_string_lossy().into_owned()]).unwrap_or_default();
    let mut server = spawn_server(exe, &global, &args, &[("FLOWPREFILL_FAULT", &spec)], mpi)?;
    let addr = server.addr.clone();
    let (status, message, answer_s) = match case {
        Case::Fault { .. } => {
            let (s, m, t) = post(&addr, &job_body("fault", FAULT_DEADLINE_S));
            (s, m, Some(t))
        }
        Case::Deadline { .. } => {
            let (s, m, t) = post(&addr, &job_body("deadline", DEADLINE_S));
            (s, m, Some(t))
        }
        Case::Disconnect { .. } => {
            let body = job_body("gone", FAULT_DEADLINE_S);
            let mut c = TcpStream::connect(&addr).map_err(failed)?;
            write!(c, "POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n", body.len()).map_err(failed)?;
            c.write_all(&body).map_err(failed)?;
            // Rank 0 is busy in the phase for 3 s; the small job reaches any phase within 1.5 s.
            std::thread::sleep(Duration::from_millis(1500));
            drop(c);
            ("(client gone)".into(), String::new(), None)
        }
    };
    let (next, next_msg, next_s) = post(&addr, &job_body("next", 60.0));
    let next = if next == "200" { "200".to_string() } else { format!("{next} {next_msg}") };
    let ready = ready(&addr);
    let in_flight_after = in_flight(&addr);
    let exit = match server.gone() {
        Some(e) => format!("{e} (before the stop)"),
        None => server.stop(if mpi.is_some() { "-USR1" } else { "-TERM" }, Duration::from_secs(60)),
    };
    Ok(Row {
        world: world.to_string(),
        case: case.label(),
        status,
        message: message.chars().take(110).collect(),
        answer_s,
        next,
        next_s: Some(next_s),
        ready,
        in_flight_after,
        exit,
    })
}

/// The matrix as Markdown (for `docs/faults.md`), made with `--worlds WORLDS`.
pub fn markdown(rows: &[Row], worlds: &[String]) -> String {
    let mut s = format!(
        "# Fault matrix\n\n\
         Made on {} by `flowprefill bench faults --worlds {}` (every row a fresh `serve` with 2 ranks, \
         `--comm-timeout {COMM_TIMEOUT_S}`; thread ranks, or 2 processes under `mpirun`). Each row \
         injects one fault with `FLOWPREFILL_FAULT`, sends a small job (3 documents, about 270 \
         context tokens, deadline {FAULT_DEADLINE_S} s; {DEADLINE_S} s in the deadline rows), then a \
         second job, reads `/readyz`, and stops the server (SIGTERM; SIGUSR1 to `mpirun`). Disconnect \
         rows make rank 0 busy for {STALL_MS} ms at the start of the phase and the client leaves \
         1.5 s after sending; deadline rows make it busy for {DEADLINE_STALL_MS} ms: the client \
         leaves, or the deadline passes, while the job is in that phase.\n\n\
         | world | fault | status | message | answered in (s) | next job | next job in (s) | /readyz after | server exit on stop |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
        crate::calibrate::today(),
        worlds.join(",")
    );
    let f = |x: Option<f64>| x.map_or("-".into(), |v| format!("{v:.1}"));
    for r in rows {
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            r.world,
            r.case,
            r.status,
            r.message.replace('|', "/"),
            f(r.answer_s),
            r.next.replace('|', "/"),
            f(r.next_s),
            r.ready,
            r.exit
        ));
    }
    s.push_str(NOTES);
    s
}

/// How to read the table (what the design promises for each kind of row).
const NOTES: &str = "
How to read it:

- **panic**: a panic on rank 0 fails that job with 500 (`internal`, a bug) and the ranks are
  rebuilt before the answer; a follower that panics leaves the world, telling the others, so
  its job fails at once with 503 (`rank_failure`) naming it. Under `mpirun` a rank cannot be
  rebuilt: after answering, the service stops, and `mpirun`'s status is that of the first rank
  to exit with an error: 4 (a rank failure) where rank 0 stops the service (rank 0 panicked, or
  a follower hung), 70 (internal: a bug) where a follower panicked, since its own process exits
  first (at once after telling the others, without waiting for rank 0 in MPI_Finalize: before
  2026-11-27 it waited there, and a loaded machine let rank 0 exit first once, with 4) (the exit column; `launch/tests/e2e/serve.rs` pins 4, 70 and 4 for a panic on rank 0, a
  panic on rank 1 and a hang on rank 1).
- **hang**: a hung follower is named after `--comm-timeout` (503). A hung rank 0 cannot answer
  at all: the handler answers 504 at the job's deadline + 2 s, and the watchdog declares rank 0
  stuck `--comm-timeout` + 5 s after the deadline, abandons its thread and starts new ranks (the
  next job waits until then). Under `mpirun` the follower gives up on a hung rank 0 after
  `--comm-timeout` and `mpirun` ends the job: the connection closes without an answer.
  Waits on rank 0 that are not a fault do not count: while it has no job, and while it
  computes a `full` job alone, rank 0 tells the followers every quarter of `--comm-timeout`
  that it is alive (`request` idle ticks, `lead.progress`); since 2026-11-29 every follower
  answers each idle tick (`idle.ack`), so a follower stuck or gone between jobs turns `/readyz`
  to 503 within a tick and the timeout (thread ranks are rebuilt; under `mpirun` the service
  ends), before a job waits out the deadline. Before 2026-11-26 a service idle
  for longer than `--comm-timeout` lost its followers (the next job got 503 \"the ranks are
  down\" with thread ranks; under `mpirun` the follower had exited), and a `full` job whose
  prefill on rank 0 took longer than the timeout failed the same way; `launch/tests/e2e/serve.rs`
  and `cli.rs` now pin both. Since 2026-11-28 (third session) rank 0 ticks only while its work
  moves: a layer finished within four `--comm-timeout`s (`interrupt::stuck_after`; every check
  between two layers is a beat); a rank 0 hung inside a `full` job stops ticking and the
  followers' deadline ends it (before, it kept ticking, and under `mpirun` nothing ended the
  job). `flowprefill run` (no service watchdog above it) has a watchdog of its own on the same
  bound: a rank 0 stuck in its work, with thread ranks or under `mpirun`, ended the command
  never; it now ends it with exit 4 and \"no layer has finished for 8 s (the last during
  `probe`): a rank is stuck\" (`--comm-timeout 2`; `cli.rs`
  `a_failed_thread_rank_is_named_and_nothing_hangs` pins `full` and InfoFlow).
- **exit**: thread ranks share one process, so a thread rank that exits ends the service
  (no answer, exit status 99 of the injected exit). Under `mpirun` the process of the rank is
  gone; `mpirun` ends the others.
- **client disconnect**: the job stops on every rank before its next layer once the client is
  gone; the next job runs right after rank 0's stall ends.
- **deadline**: 504 naming the phase where the ranks stopped (between two layers, on every
  rank); the next job runs at once.

";
