//! The cross-crate integration tests in one binary: each module was a test file of its own,
//! and fifteen binaries compiled the engine's generic code and linked everything fifteen times
//! (CI time). `model_vs_candle` stays apart: it sets an environment variable that candle reads
//! while loading. One module alone: `cargo test --release -p flowprefill-tests --test suite
//! memory_plan::`.

mod auto;
mod bf16_forward;
mod cache_aware;
mod coverage;
mod device_plane;
mod engine_invariants;
mod errors;
mod eviction;
mod forward_equivalence;
mod host_copies;
mod idle;
mod kv_bf16;
mod kvpacket;
mod lookahead;
mod memory_plan;
mod out_of_memory;
mod projection_counts;
mod selection_signal;
mod sharded_equivalence;
mod tokenizer_template;
mod verify;
