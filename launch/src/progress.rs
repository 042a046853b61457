//! Progress of the long commands (`eval`, `check`): an `indicatif` bar with ETA on a terminal,
//! one plain line per step when stderr is a file (a log keeps every step and its time).

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::time::{Duration, Instant};

/// Steps done of a known total.
pub struct Progress {
    bar: Option<ProgressBar>,
    total: u64,
    done: u64,
    unit: &'static str,
    t0: Instant,
}

impl Progress {
    /// `total` steps called `unit` ("runs", "cases").
    pub fn new(total: usize, unit: &'static str) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let b = ProgressBar::with_draw_target(Some(total as u64), ProgressDrawTarget::stderr());
            let style = ProgressStyle::with_template(
                "[{bar:30}] {pos}/{len} {prefix}  elapsed {elapsed_precise}  ETA {eta_precise}  {wide_msg}",
            )
            .map(|s| s.progress_chars("=> "))
            .unwrap_or_else(|_| ProgressStyle::default_bar());
            b.set_style(style);
            b.set_prefix(unit);
            b.enable_steady_tick(Duration::from_millis(500));
            b
        });
        Self { bar, total: total as u64, done: 0, unit, t0: Instant::now() }
    }

    /// One step finished; `what` names it.
    pub fn inc(&mut self, what: &str) {
        self.done += 1;
        match &self.bar {
            Some(b) => {
                b.set_message(what.to_string());
                b.inc(1);
            }
            None => {
                let el = self.t0.elapsed().as_secs_f64();
                let eta = el / self.done as f64 * self.total.saturating_sub(self.done) as f64;
                crate::say!(
                    "[{}/{} {}] {what}  elapsed {}  ETA {}",
                    self.done,
                    self.total,
                    self.unit,
                    hms(el),
                    hms(eta)
                );
            }
        }
    }

    /// A line of output that must not be drawn over by the bar.
    pub fn println(&self, line: &str) {
        match &self.bar {
            Some(b) => b.suspend(|| crate::say!("{line}")),
            None => crate::say!("{line}"),
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if let Some(b) = &self.bar {
            b.finish();
        }
    }
}

/// Processes a command started (`bench load`'s server) that a second signal ends with it: the
/// process then exits at once, without the drops that would stop them.
static CHILDREN: std::sync::Mutex<Vec<u32>> = std::sync::Mutex::new(Vec::new());

/// Has a second signal after [`stop_on_signal`]'s first send SIGTERM to `pid` before the
/// process exits.
pub fn end_with_me(pid: u32) {
    CHILDREN.lock().unwrap_or_else(|p| p.into_inner()).push(pid);
}

/// `pid` has ended (stopped by the command): a second signal leaves its number alone.
pub fn ended(pid: u32) {
    CHILDREN.lock().unwrap_or_else(|p| p.into_inner()).retain(|&p| p != pid);
}

/// Whether a long command was asked to stop ([`stop_on_signal`]'s first signal).
pub struct Asked(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Asked {
    /// Never asked: a command that cannot stop part way (ranks under mpirun must stop together).
    pub fn never() -> Self {
        Asked(Default::default())
    }

    /// Whether the first signal came.
    pub fn is_set(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The flag itself, for threads that poll it (`bench load`'s clients).
    pub fn flag(&self) -> &std::sync::Arc<std::sync::atomic::AtomicBool> {
        &self.0
    }
}

/// A flag the first Ctrl-C (SIGINT) or SIGTERM sets, for a long command that stops after `step`
/// (the one in progress) and keeps what it did (`check` prints the table of the finished
/// cases); the second ends the process at once (exit code 130 after SIGINT, 143 after SIGTERM),
/// and the processes given to [`end_with_me`] with it. Without signal handling (it could not be
/// set up: said once) the flag stays down and the signals keep their default action.
pub fn stop_on_signal(step: &'static str) -> Asked {
    let asked = Asked::never();
    let set = asked.0.clone();
    let registered = tokio::runtime::Builder::new_current_thread().enable_all().build().and_then(|rt| {
        use tokio::signal::unix::{signal, SignalKind};
        let streams = rt.block_on(async {
            Ok::<_, std::io::Error>((signal(SignalKind::interrupt())?, signal(SignalKind::terminate())?))
        })?;
        Ok((rt, streams))
    });
    match registered {
        Ok((rt, (mut int, mut term))) => {
            std::thread::spawn(move || {
                rt.block_on(async move {
                    tokio::select! { _ = int.recv() => {}, _ = term.recv() => {} }
                    set.store(true, std::sync::atomic::Ordering::Relaxed);
                    crate::say!("stopping after {step} (Ctrl-C again stops at once)");
                    let code = tokio::select! { _ = int.recv() => 130, _ = term.recv() => 143 };
                    for pid in CHILDREN.lock().unwrap_or_else(|p| p.into_inner()).iter() {
                        let _ = std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status();
                    }
                    std::process::exit(code);
                })
            });
        }
        Err(e) => crate::say!("warning: Ctrl-C will stop at once, losing the steps done ({e})"),
    }
    asked
}

/// The error of a command that stopped early (`stop`) after `done` of `planned` steps (`unit`:
/// "cases"), whose table it printed if `shown`: the cancelled class (exit 6) after an
/// interruption, the failure's own after a failure.
pub fn stopped(stop: flowprefill_lab::Stop, done: usize, planned: usize, unit: &str, shown: bool) -> anyhow::Error {
    match stop {
        flowprefill_lab::Stop::Asked => anyhow::Error::new(crate::exit::Interrupted(format!(
            "interrupted after {done} of {planned} {unit}{}",
            if shown { " (their table is above)" } else { "" }
        ))),
        flowprefill_lab::Stop::Failed { at, error } => anyhow::Error::new(*error).context(format!(
            "{at} failed ({done} of {planned} {unit} finished{})",
            if shown { "; their table is above" } else { "" }
        )),
    }
}

/// `h:mm:ss`.
pub fn hms(s: f64) -> String {
    let s = s as u64;
    format!("{}:{:02}:{:02}", s / 3600, (s / 60) % 60, s % 60)
}
