//! `--method auto` (issue 53, item 4): per request, the fastest method whose expected quality
//! meets the floor. The engine asks a [`Chooser`] on rank 0 before the job starts, with what
//! the request looks like (token counts, the chunks its store already holds, the ranks) and runs
//! the method it picks; the result carries the [`Choice`] (every candidate, its predicted TTFT
//! and expected quality, and why the winner won). The chooser that predicts from the
//! projection's work accounting lives in `flowprefill_lab::auto`; the engine only defines the
//! question, so that the coordinator does not depend on the projection.

use crate::request::{Method, MethodSpec, RunOptions};
use flowprefill_worker::config::ModelConfig;

/// The quality floor `auto` meets when none is given: a KL bound (nats) on the first answer
/// token's distribution against the exact one's.
pub const DEFAULT_AUTO_FLOOR: f64 = 0.15;

/// What a chooser sees of one request (rank 0, before any work).
pub struct Situation<'a> {
    /// The options as asked (`method` is [`Method::Auto`]; the ratio or coverage, scope and the
    /// rest apply to the approximate candidates).
    pub opts: &'a RunOptions,
    /// Ranks of the world.
    pub ranks: usize,
    /// Template tokens before the context.
    pub head: usize,
    /// Tokens per chunk (request order).
    pub chunks: Vec<usize>,
    /// Tokens after the context.
    pub prompt: usize,
    /// Whether rank 0's chunk store (RAM or disk) holds each chunk's cache as the chunked
    /// methods look it up: a held chunk costs no prefill.
    pub cached: Vec<bool>,
    /// The model's shape.
    pub config: &'a ModelConfig,
    /// The model's fingerprint (the quality history is per model).
    pub model: &'a str,
    /// Bytes per K/V element of this backend.
    pub kv_bytes: usize,
}

/// One method `auto` considered.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Candidate {
    /// The method as written everywhere (`infoflow@0.15`).
    pub label: String,
    /// Predicted TTFT, milliseconds.
    pub ttft_ms: f64,
    /// Expected KL of the first answer token against the exact answer, nats.
    pub expected_kl: f64,
    /// Where the expectation comes from: `exact`, `history (N verified)` or `prior`.
    pub quality_from: String,
    /// Whether the expectation is within the floor.
    pub meets: bool,
}

/// What `auto` chose for one request, and why.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Choice {
    /// The floor the candidates were held to (KL, nats).
    pub floor: f64,
    /// Every candidate, in the order considered (exact ones first).
    pub candidates: Vec<Candidate>,
    /// Index of the winner in `candidates`.
    pub winner: usize,
    /// One sentence: why the winner won.
    pub why: String,
}

impl Choice {
    /// The winning candidate.
    pub fn chosen(&self) -> Option<&Candidate> {
        self.candidates.get(self.winner)
    }
}

/// Picks a method for a request; implemented where the prediction lives (`flowprefill_lab`).
pub trait Chooser: Send + Sync {
    /// The choice for `s` and the options to run it with (a concrete method, never `auto`),
    /// or a message saying why nothing can be chosen.
    fn choose(&self, s: &Situation<'_>) -> Result<(Choice, RunOptions), String>;

    /// Learns from a verified answer: `label` ran on `model` and was `kl` nats from the exact
    /// answer, recomputing `recomputed` of its context. Default: nothing is kept.
    fn learn(&self, _model: &str, _label: &str, _kl: f64, _recomputed: f64) {}
}

/// The label of the method `opts` runs, as `auto` and the quality history name it: the method
/// spec with its budget (`infoflow@0.15`, `infoflow~0.9`; `full`, `ring`, `none` bare).
pub fn label(opts: &RunOptions) -> String {
    let spec = MethodSpec { method: opts.method, reorder: opts.reorder, ratio: None, coverage: None };
    let spec = match (opts.method.selects(), opts.coverage) {
        (false, _) => spec,
        (true, Some(c)) => spec.covering(c.share),
        (true, None) => spec.at(opts.ratio),
    };
    spec.to_string()
}

/// Whether `opts` asks for `auto`.
pub fn is_auto(opts: &RunOptions) -> bool {
    opts.method == Method::Auto
}
