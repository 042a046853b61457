//! Host time spent inside each backend op, for finding where a GPU run waits on the host.
//!
//! A GPU's device time per op comes from CUDA events (`--stats`'s op split); what it cannot show
//! is a run whose GPU sits idle while the host prepares, uploads or waits. With
//! `FLOWPREFILL_HOST_PROFILE=1` every op called through [`crate::Device`] is timed on the host
//! (its wall time in the calling thread: for an asynchronous launch the cost of issuing it; for a
//! copy to or from the host, or a synchronisation, the wait too), summed per op and process, and
//! the binary prints the table at exit ([`report`]). Off (the default) it costs one relaxed load
//! per op.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The variable that turns the profile on (any value but empty or `0`).
pub const ENV: &str = "FLOWPREFILL_HOST_PROFILE";

/// 0: not read yet, 1: off, 2: on.
static STATE: AtomicU8 = AtomicU8::new(0);
static TABLE: Mutex<Option<HashMap<&'static str, (u64, Duration)>>> = Mutex::new(None);

/// Whether ops are being timed.
pub fn enabled() -> bool {
    match STATE.load(Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => {
            let on = std::env::var(ENV).is_ok_and(|v| !v.is_empty() && v != "0");
            STATE.store(if on { 2 } else { 1 }, Ordering::Relaxed);
            on
        }
    }
}

/// Turns the profile on or off in this process (the unit test; the variable decides otherwise).
#[cfg(test)]
fn set_enabled(on: bool) {
    STATE.store(if on { 2 } else { 1 }, Ordering::Relaxed);
}

/// Times one op until dropped (nothing when the profile is off).
pub struct Span {
    op: &'static str,
    start: Option<Instant>,
}

/// Starts timing `op`.
pub fn span(op: &'static str) -> Span {
    Span { op, start: enabled().then(Instant::now) }
}

impl Drop for Span {
    fn drop(&mut self) {
        if let Some(start) = self.start {
            let took = start.elapsed();
            let mut t = TABLE.lock().unwrap_or_else(|e| e.into_inner());
            let e = t.get_or_insert_with(HashMap::new).entry(self.op).or_insert((0, Duration::ZERO));
            e.0 += 1;
            e.1 += took;
        }
    }
}

/// Per op: calls and host time, the largest total first.
pub fn snapshot() -> Vec<(&'static str, u64, Duration)> {
    let t = TABLE.lock().unwrap_or_else(|e| e.into_inner());
    let mut rows: Vec<_> = t.iter().flat_map(|m| m.iter().map(|(op, (n, d))| (*op, *n, *d))).collect();
    rows.sort_by(|a, b| b.2.cmp(&a.2).then(a.0.cmp(b.0)));
    rows
}

/// Clears what was counted.
#[cfg(test)]
fn reset() {
    *TABLE.lock().unwrap_or_else(|e| e.into_inner()) = None;
}

/// The table to print, or `None` when the profile is off or nothing was timed.
pub fn report() -> Option<String> {
    if !enabled() {
        return None;
    }
    let rows = snapshot();
    if rows.is_empty() {
        return None;
    }
    let total: Duration = rows.iter().map(|r| r.2).sum();
    let mut s = format!(
        "host time inside backend ops ({ENV}): {:.1} ms in all\n{:<22} {:>8} {:>10} {:>9} {:>6}\n",
        total.as_secs_f64() * 1e3,
        "op",
        "calls",
        "total ms",
        "mean us",
        "share"
    );
    for (op, n, d) in rows {
        s += &format!(
            "{op:<22} {n:>8} {:>10.2} {:>9.1} {:>5.1}%\n",
            d.as_secs_f64() * 1e3,
            d.as_secs_f64() * 1e6 / n.max(1) as f64,
            100.0 * d.as_secs_f64() / total.as_secs_f64().max(1e-12)
        );
    }
    Some(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_add_up_per_op_only_when_on() {
        // The table is the process's: other tests of this binary run ops through `Device`
        // (timed while this test has the profile on), so this one counts ops of its own names
        // and reads only those rows.
        let mine = |rows: Vec<(&'static str, u64, Duration)>| -> Vec<_> {
            rows.into_iter().filter(|r| r.0.starts_with("test-span-")).collect()
        };
        set_enabled(false);
        reset();
        drop(span("test-span-off"));
        assert!(mine(snapshot()).is_empty(), "nothing is counted while off");
        set_enabled(true);
        for _ in 0..3 {
            let _s = span("test-span-upload");
            std::thread::sleep(Duration::from_millis(2));
        }
        drop(span("test-span-attention"));
        let rows = mine(snapshot());
        assert_eq!(rows[0].0, "test-span-upload", "the largest total first: {rows:?}");
        assert_eq!(rows[0].1, 3);
        assert!(rows[0].2 >= Duration::from_millis(6), "{rows:?}");
        assert_eq!((rows[1].0, rows[1].1), ("test-span-attention", 1));
        let text = report().expect("a table");
        assert!(text.contains("test-span-upload") && text.contains("test-span-attention"), "{text}");
        set_enabled(false);
        reset();
        assert!(report().is_none(), "no table once reset and off");
    }
}
