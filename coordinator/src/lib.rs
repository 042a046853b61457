//! The coordinator: a request becomes a plan and runs phase by phase.
//!
//! * [`request`]: methods, prefix modes, geometries, options and their validation;
//! * [`admit`]: the checks that need the model, and per-request cost bounds;
//! * [`layout`]: tokenization through the model's chat template, positions per geometry;
//! * [`method`]: every method's facts in one table (below the request and the selection);
//! * [`select`]: one selection policy per file (InfoFlow, ProphetKV, CacheBlend, EPIC,
//!   CacheClip, random, LookaheadKV) and what they share (the probe, top-k, coverage);
//! * [`reorder`]: two-stage chunk reordering;
//! * [`shard`]: which rank holds which chunk;
//! * [`engine`]: the phase pipeline on every rank, with the chunk store, TTFT and per-phase
//!   timings and communication statistics;
//! * [`explain`]: selected spans in context;
//! * [`pipeline`]: what a job's phases do, decided from token counts before any work (the
//!   engine runs it; the memory plan and the projection walk it);
//! * [`memory`]: the memory plan of a job, checked at admission against free memory.
//!
//! Measurement (benchmarks, evaluation tasks, projection) lives in `flowprefill-lab`.

pub mod admit;
pub mod auto;
pub mod engine;
mod error;
pub mod explain;
pub mod fault;
pub mod layout;
pub mod memory;
pub mod method;
pub mod pipeline;
pub mod reorder;
pub mod request;
pub mod select;
pub mod shard;
pub mod timings;
pub mod world;

pub use admit::{admit, Admitted, Limits};
pub use engine::{
    Control, CoverageCut, DiskTier, Engine, Ingested, JobProgress, Quality, RankStats, RunResult, DEFAULT_STORE_BYTES,
};
pub use error::{CoordError, Result};
pub use flowprefill_comm::ErrorClass;
pub use request::{
    Context, Conversation, Coverage, Evict, EvictPolicy, Geometry, Job, Method, MethodSpec, OnBreach, PrefixMode,
    Request, Role, RunOptions, Scope, Turn,
};
pub use world::{run_rank, PlaneSetup, ThreadRanks, World};
