//! What a job gives back: the result of a request and what each rank did.

use super::{Eviction, Quality};
use crate::request::{Method, PrefixMode, RunOptions};
use crate::timings::PhaseTimes;
use flowprefill_comm::CommStats;
use flowprefill_worker::generate::StopReason;
use std::time::Duration;

/// What one rank did during a request.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct RankStats {
    /// The rank.
    pub rank: usize,
    /// Milliseconds per phase, in pipeline order.
    pub phases: Vec<(String, f64)>,
    /// Bytes and wait time per collective.
    pub comm: CommStats,
    /// Chunks held.
    pub chunks: usize,
    /// Context tokens held.
    pub tokens: usize,
    /// Selected tokens held.
    pub selected: usize,
    /// Chunk-store hits and misses.
    pub cache_hits: u64,
    /// Chunk-store misses (chunks prefilled).
    pub cache_misses: u64,
    /// Of the hits, those read from the store's disk tier.
    #[serde(default)]
    pub cache_disk_hits: u64,
    /// Milliseconds of model work per op family (matmul, attention, norm_rope, other): device
    /// time on a GPU (CUDA events), wall time on the CPU.
    #[serde(default)]
    pub ops: Vec<(String, f64)>,
    /// The most bytes the job held at once on this rank's device above what the rank held
    /// before it (where the backend counts them: a GPU's memory pool); on thread ranks sharing
    /// a device, rank 0's figure is the device's.
    #[serde(default)]
    pub memory_peak: Option<usize>,
    /// Damaged files this rank's process's disk tier dropped since they were last reported (reads
    /// of any job, or of none; thread ranks share one tier, and one of them reports: counted once).
    #[serde(default)]
    pub disk_corrupt: u64,
    /// Disk writes this rank skipped after an error (a full disk) since its previous report.
    #[serde(default)]
    pub disk_write_failures: u64,
}

/// Outcome of one request (on rank 0).
#[derive(Clone, Debug)]
pub struct RunResult {
    /// The answer text.
    pub answer: String,
    /// Answer token ids.
    pub tokens: Vec<u32>,
    /// Why decoding stopped.
    pub stop: StopReason,
    /// Decode steps rank 0 took from a replay of a recorded step (a CUDA graph).
    pub decode_replayed: usize,
    /// Time to first token (from the start of the request, tokenization included).
    pub ttft: Duration,
    /// Total time including decoding.
    pub total: Duration,
    /// Rank 0's time per phase, in pipeline order.
    pub phases: PhaseTimes,
    /// Method run.
    pub method: Method,
    /// Ratio in effect.
    pub ratio: f64,
    /// Options as given.
    pub opts: RunOptions,
    /// Prefix mode in effect.
    pub prefix: PrefixMode,
    /// Ranks.
    pub ranks: usize,
    /// Template head tokens.
    pub n_head_tokens: usize,
    /// Context tokens (candidates).
    pub n_context_tokens: usize,
    /// Prompt tokens after the context.
    pub n_prompt_tokens: usize,
    /// Tokens per chunk (request order).
    pub chunk_tokens: Vec<usize>,
    /// Owner rank of each chunk (request order).
    pub owners: Vec<usize>,
    /// Chunk ids in the final layout order.
    pub order: Vec<usize>,
    /// Chunk importance from reordering (request order), if reordered.
    pub importance: Option<Vec<f32>>,
    /// The selection policy's score of every context token (request order of chunks, then
    /// rows), when asked for with `keep_scores` and the policy scored.
    pub scores: Option<Vec<Vec<f32>>>,
    /// Selected rows per chunk (request order).
    pub selected_rows: Vec<Vec<usize>>,
    /// Token budget `round(ratio * N)`; with a budget by coverage, the tokens its cut kept.
    pub budget: usize,
    /// What a budget by coverage (`--coverage`) chose.
    pub coverage: Option<CoverageCut>,
    /// Chunk-store lookups that hit during this request (all ranks).
    pub cache_hits: u64,
    /// Chunk-store lookups that missed (chunks prefilled, all ranks).
    pub cache_misses: u64,
    /// Of the hits, those read from the disk tier (all ranks).
    pub cache_disk_hits: u64,
    /// Logits of the first answer token (for equivalence checks).
    pub first_logits: Vec<f32>,
    /// Per-rank phase times and communication.
    pub rank_stats: Vec<RankStats>,
    /// Bytes per element of the KV caches (4: f32, 2: bf16).
    pub kv_bytes: usize,
    /// What KV eviction kept before decoding (`--evict`).
    pub eviction: Option<Eviction>,
    /// How the answer compares with the exact one (`--verify`).
    pub quality: Option<Quality>,
    /// What `--method auto` chose, and why.
    pub auto: Option<crate::auto::Choice>,
    /// Why a verified answer has no `quality`: the exact computation failed (the answer as
    /// computed is kept).
    pub verify_error: Option<String>,
}

/// What a budget by coverage chose for one request.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CoverageCut {
    /// The share of the score mass asked for.
    pub share: f64,
    /// Tokens the cut kept (before a policy's refinement, CacheClip's windows).
    pub k: usize,
    /// The share of the context's score mass they cover.
    pub covered: f64,
}

impl RunResult {
    /// Selected tokens per chunk (request order).
    pub fn selected_counts(&self) -> Vec<usize> {
        self.selected_rows.iter().map(Vec::len).collect()
    }

    /// Total selected tokens.
    pub fn n_selected(&self) -> usize {
        self.selected_rows.iter().map(Vec::len).sum()
    }
}
