//! Resident memory of this process, from /proc (Linux).

/// Peak resident set size in MiB since start or the last [`reset_peak`] (`VmHWM`).
pub fn peak_mb() -> Option<f64> {
    status_kb("VmHWM:").map(|kb| kb as f64 / 1024.0)
}

/// Resets the peak to the current RSS (writes 5 to /proc/self/clear_refs). Returns false when
/// the kernel does not allow it, in which case peaks are since process start.
pub fn reset_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

fn status_kb(key: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with(key))?;
    line[key.len()..].trim().trim_end_matches("kB").trim().parse().ok()
}
