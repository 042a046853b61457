//! What the environment sets for a CUDA backend, read once when it starts; a value that does
//! not parse is refused then, naming the variable.

use crate::error::{KernelError, Result};
use crate::gpu::ops::FlashKernel;

/// The backend's settings from the environment.
pub(super) struct Settings {
    /// The attention kernel fixed by `FLOWPREFILL_FLASH_KERNEL` (`None`: the autotuner's).
    pub fixed: Option<FlashKernel>,
    /// Keys gathered for one attention call over many sources (`Backend::gathered_keys`):
    /// `FLOWPREFILL_GATHERED_KEYS`, or [`crate::GPU_GATHERED_KEYS`].
    pub gathered_keys: usize,
    /// `FLOWPREFILL_TUNE=off`: the autotuner never times (`auto`, the default: it does).
    pub tune_off: bool,
    /// Control data copied through a page-locked ring (`FLOWPREFILL_PINNED_CONTROL`: `1`, the
    /// default, or `0` for the pageable copy).
    pub pinned_control: bool,
    /// How long a kernel's first run on this GPU may take before the GPU is taken for hung
    /// (`FLOWPREFILL_GPU_FIRST_RUN_LIMIT`, seconds; default [`super::health::FIRST_RUN_LIMIT`]).
    pub first_run_limit: std::time::Duration,
}

/// `var`'s value `v` as one of `choices` (value, meaning), refused naming the variable and
/// every choice otherwise (`FLOWPREFILL_TUNE=0` meant `auto`, the opposite of what was meant).
fn one_of<T: Copy>(var: &str, v: &str, choices: &[(&str, T)]) -> Result<T> {
    choices.iter().find(|(name, _)| *name == v.trim()).map(|(_, t)| *t).ok_or_else(|| KernelError::Backend {
        backend: "cuda",
        detail: format!("{var}={v:?}: give {}", choices.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(" or ")),
    })
}

/// The variable that bounds a kernel's first run on a GPU ([`Settings::first_run_limit`]).
pub(super) const FIRST_RUN_ENV: &str = "FLOWPREFILL_GPU_FIRST_RUN_LIMIT";

/// `var`'s value `v` as a number of seconds from 0.1 (less would take a GPU for hung at its
/// first poll, for the life of the process), refused naming the variable.
fn seconds(var: &str, v: &str) -> Result<std::time::Duration> {
    match v.trim().parse::<f64>() {
        Ok(s) if (0.1..1e9).contains(&s) => Ok(std::time::Duration::from_secs_f64(s)),
        _ => Err(KernelError::Backend {
            backend: "cuda",
            detail: format!(
                "{var}={v:?}: give a number of seconds, at least 0.1 (default {})",
                super::health::FIRST_RUN_LIMIT.as_secs()
            ),
        }),
    }
}

impl Settings {
    pub(super) fn from_env() -> Result<Self> {
        let refused = |detail: String| KernelError::Backend { backend: "cuda", detail };
        let fixed = match std::env::var("FLOWPREFILL_FLASH_KERNEL") {
            Ok(v) => Some(v.parse().map_err(|e: String| refused(format!("FLOWPREFILL_FLASH_KERNEL: {e}")))?),
            Err(_) => None,
        };
        let gathered_keys = match std::env::var("FLOWPREFILL_GATHERED_KEYS") {
            Ok(v) => v.trim().parse().map_err(|_| {
                refused(format!(
                    "FLOWPREFILL_GATHERED_KEYS={v:?}: give a number of keys (0: one attention call per source; \
                     default {})",
                    crate::backend::GPU_GATHERED_KEYS
                ))
            })?,
            Err(_) => crate::backend::GPU_GATHERED_KEYS,
        };
        let var = |name: &str| std::env::var(name).ok();
        let tune_off = match var("FLOWPREFILL_TUNE") {
            Some(v) => one_of("FLOWPREFILL_TUNE", &v, &[("auto", false), ("off", true)])?,
            None => false,
        };
        let pinned_control = match var("FLOWPREFILL_PINNED_CONTROL") {
            Some(v) => one_of("FLOWPREFILL_PINNED_CONTROL", &v, &[("1", true), ("0", false)])?,
            None => true,
        };
        let first_run_limit = match var(FIRST_RUN_ENV) {
            Some(v) => seconds(FIRST_RUN_ENV, &v)?,
            None => super::health::FIRST_RUN_LIMIT,
        };
        Ok(Self { fixed, gathered_keys, tune_off, pinned_control, first_run_limit })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_limit_is_a_positive_number_of_seconds() {
        let var = super::FIRST_RUN_ENV;
        assert_eq!(super::seconds(var, " 90 ").unwrap(), std::time::Duration::from_secs(90));
        assert_eq!(super::seconds(var, "0.5").unwrap(), std::time::Duration::from_millis(500));
        for bad in ["0", "1e-9", "-5", "inf", "NaN", "1e12", "60s", ""] {
            let e = super::seconds(var, bad).expect_err(bad).to_string();
            assert!(e.contains("FLOWPREFILL_GPU_FIRST_RUN_LIMIT=") && e.contains("at least 0.1 (default 60)"), "{e}");
        }
    }

    #[test]
    fn a_switch_takes_its_documented_values_only() {
        let tune = [("auto", false), ("off", true)];
        assert!(super::one_of("FLOWPREFILL_TUNE", "off", &tune).unwrap());
        assert!(!super::one_of("FLOWPREFILL_TUNE", " auto ", &tune).unwrap());
        for bad in ["0", "OFF", "false", ""] {
            let e = super::one_of("FLOWPREFILL_TUNE", bad, &tune).expect_err(bad).to_string();
            assert!(e.contains("FLOWPREFILL_TUNE=") && e.contains("give auto or off"), "{e}");
        }
    }
}
