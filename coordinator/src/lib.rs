//! The coordinator: a request becomes a plan and runs phase by phase.
//!
//! * [`request`]: methods, prefix modes, geometries, options and their validation;
//! * [`layout`]: tokenization through the model's chat template, positions per geometry;
//! * [`select`]: one selection policy per file (InfoFlow, ProphetKV, CacheBlend, EPIC,
//!   CacheClip, random);
//! * [`reorder`]: two-stage chunk reordering;
//! * [`engine`]: the phase pipeline with the chunk store, TTFT and per-phase timings;
//! * [`explain`], [`tasks`]: selected spans in context; built-in question sets.

pub mod engine;
mod error;
pub mod explain;
pub mod layout;
pub mod reorder;
pub mod request;
pub mod select;
pub mod tasks;
pub mod timings;

pub use engine::{Engine, RunResult, DEFAULT_STORE_BYTES};
pub use error::{CoordError, Result};
pub use request::{Context, Geometry, Method, PrefixMode, Request, RunOptions};
