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
        Ok(Self { fixed, gathered_keys })
    }
}
