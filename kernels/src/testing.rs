//! Tests that cannot run here say so, visibly: [`skipped`] prints the reason and, where the test
//! command asks for it (`FLOWPREFILL_SKIP_LOG`, set by `scripts/test.sh`), appends it to a file
//! that the command counts by reason at its end. A skipped test still passes (libtest has no
//! other outcome for a test that decides at run time), but it is never silent.

use std::io::Write;

/// The variable naming the file of skips.
pub const SKIP_LOG: &str = "FLOWPREFILL_SKIP_LOG";

/// Records that the running test (named by its thread, as libtest names it) is skipped for
/// `reason` (a short category the summary counts, e.g. "no CUDA device"), with `detail`.
pub fn skipped(reason: &str, detail: impl std::fmt::Display) {
    let test = std::thread::current().name().unwrap_or("?").to_string();
    let binary = std::env::args()
        .next()
        .and_then(|a| std::path::Path::new(&a).file_stem().map(|s| s.to_string_lossy().into_owned()))
        .map(|s| s.split('-').next().unwrap_or("").to_string())
        .unwrap_or_default();
    eprintln!("SKIPPED ({reason}) {binary}::{test}: {detail}");
    let Some(path) = std::env::var_os(SKIP_LOG).filter(|p| !p.is_empty()) else { return };
    // One line per write on a file opened for appending: lines from parallel tests and test
    // processes do not interleave.
    let line = format!("{reason}\t{binary}::{test}\n");
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| f.write_all(line.as_bytes()));
    if let Err(e) = written {
        eprintln!("warning: could not record the skip in {}: {e}", std::path::Path::new(&path).display());
    }
}
