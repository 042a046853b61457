//! The autotuner's state in one backend ([`Tuning`]); the tuning itself is [`super::tune`].

use crate::gpu::ops::FlashKernel;
use crate::gpu::shapes::HOPPER_CONFIGS;
use crate::gpu::tune::{ShapeClass, TuneTable};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// How the autotuner decides (`FLOWPREFILL_FLASH_KERNEL`, `FLOWPREFILL_TUNE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mode {
    Fixed(FlashKernel),
    Auto,
    Off,
}

/// The autotuner's state in one backend.
pub(crate) struct Tuning {
    pub(super) mode: Mode,
    /// The decisions file, read on first need.
    pub(super) table: Mutex<Option<TuneTable>>,
    /// What this process settled per (head dimension, class): configuration, blocks per SM.
    pub(super) chosen: Mutex<HashMap<(u32, ShapeClass), (u8, u32)>>,
    /// What calls of (head dimension, class) run until the class has a decision of its own (the
    /// default, or the decision of the class it falls back to): kept so that such calls, too
    /// small to decide on, do not look for a decision on every call.
    pub(super) interim: Mutex<HashMap<(u32, ShapeClass), (u8, u32)>>,
    /// A failure already reported (once per process).
    pub(super) warned: Mutex<bool>,
    /// The Hopper kernel's self-check per configuration, run once when first needed (`Err`:
    /// why it is not used).
    pub(super) hopper: [OnceLock<std::result::Result<(), String>>; HOPPER_CONFIGS.len()],
}

impl Tuning {
    /// Forgets what this process settled and ran meanwhile (the mode changed).
    pub(super) fn forget_choices(&self) {
        self.chosen.lock().unwrap_or_else(|p| p.into_inner()).clear();
        self.interim.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    /// Fixed to `fixed`, else never timing (`off`: `FLOWPREFILL_TUNE=off`), else automatic.
    pub(crate) fn new(fixed: Option<FlashKernel>, off: bool) -> Self {
        let mode = match (fixed, off) {
            (Some(k), _) => Mode::Fixed(k),
            (None, true) => Mode::Off,
            (None, false) => Mode::Auto,
        };
        Self {
            mode,
            table: Mutex::new(None),
            chosen: Mutex::new(HashMap::new()),
            interim: Mutex::new(HashMap::new()),
            warned: Mutex::new(false),
            hopper: std::array::from_fn(|_| OnceLock::new()),
        }
    }
}
