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

/// How far `x` is from `y` for the tests' error measures: 0 where they are equal (equal
/// infinities too), infinite where either is NaN or only one is infinite, else `|x - y|`.
/// `f32::max` ignores a NaN (`1.0f32.max(NAN)` is 1), so a fold of plain differences with it
/// passes an output the kernel never wrote or wrote as NaN; this one does not.
pub fn diff(x: f32, y: f32) -> f32 {
    if x == y {
        0.0
    } else if x.is_nan() || y.is_nan() || x.is_infinite() || y.is_infinite() {
        f32::INFINITY
    } else {
        (x - y).abs()
    }
}

/// The largest [`diff`] of two slices of one length (panics on different lengths); infinite
/// where a value is NaN on either side.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "max_abs_diff of slices of {} and {} values", a.len(), b.len());
    a.iter().zip(b).map(|(&x, &y)| diff(x, y)).fold(0.0, f32::max)
}

/// The largest [`diff`] relative to `max(|y|, floor)` (absolute below `floor`); infinite where a
/// value is NaN on either side or only one is infinite.
pub fn max_rel_diff(a: &[f32], b: &[f32], floor: f32) -> f32 {
    assert_eq!(a.len(), b.len(), "max_rel_diff of slices of {} and {} values", a.len(), b.len());
    a.iter().zip(b).map(|(&x, &y)| diff(x, y) / y.abs().max(floor)).fold(0.0, f32::max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nan_or_a_lone_infinity_is_an_infinite_difference() {
        assert_eq!(max_abs_diff(&[1.0, 2.0], &[1.0, 2.5]), 0.5);
        assert_eq!(max_abs_diff(&[1.0, f32::NAN], &[1.0, 2.0]), f32::INFINITY);
        assert_eq!(max_abs_diff(&[f32::NAN], &[f32::NAN]), f32::INFINITY);
        assert_eq!(max_abs_diff(&[f32::NEG_INFINITY], &[f32::NEG_INFINITY]), 0.0);
        assert_eq!(max_abs_diff(&[f32::NEG_INFINITY], &[-3.0]), f32::INFINITY);
        assert_eq!(max_rel_diff(&[4.0, 0.5], &[2.0, 0.25], 1.0), 1.0);
        assert_eq!(max_rel_diff(&[0.0, f32::NAN], &[0.0, 1.0], 1.0), f32::INFINITY);
        // What the plain fold gave: the NaN dropped.
        let plain = [1.0f32, f32::NAN].iter().zip(&[1.0f32, 2.0]).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max);
        assert_eq!(plain, 0.0);
    }
}
