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

/// `h:mm:ss`.
pub fn hms(s: f64) -> String {
    let s = s as u64;
    format!("{}:{:02}:{:02}", s / 3600, (s / 60) % 60, s % 60)
}
