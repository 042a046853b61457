//! Evaluation records: one scored run ([`Record`]), the resumable results file, and the
//! report made from them ([`report`]: tables, both retention metrics, plots); the plan of an
//! eval ([`plan`]) and its running ([`run`]).

pub mod plan;
pub mod report;
pub mod run;

use crate::error::io;
use crate::tasks::{PromptStyle, QaCase};
use crate::{LabError, Result};
use flowprefill_coordinator::{MethodSpec, RunResult};
use serde::{Deserialize, Serialize};
use std::path::Path;

pub use plan::Scoring;
pub use report::{plots, summarize};

/// One scored run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Record {
    /// Task.
    pub task: String,
    /// Target context length.
    pub length: usize,
    /// Sample index.
    pub sample: usize,
    /// Needle depth of the case.
    pub depth: f64,
    /// The method (its label: the ratio is the next field).
    pub method: MethodSpec,
    /// Ratio (selective methods only).
    pub ratio: Option<f64>,
    /// Score in [0, 1].
    pub score: f64,
    /// Exact match (QA).
    pub em: Option<bool>,
    /// Token F1 (QA).
    pub f1: Option<f64>,
    /// Warm TTFT.
    pub ttft_ms: f64,
    /// Tokens recomputed.
    pub selected: usize,
    /// Context tokens.
    pub context_tokens: usize,
    /// Fraction of needle-sentence tokens selected.
    pub needle_selected: f64,
    /// Fraction of answer tokens selected.
    pub answer_selected: f64,
    /// Distance of the answer-bearing chunk from the prompt in the final layout (0 = last).
    pub needle_chunk_rank: Option<usize>,
    /// The model's output.
    pub answer: String,
    /// Answer budget (new tokens) the run decoded under; absent in results made before it
    /// was recorded.
    #[serde(default)]
    pub max_new_tokens: Option<usize>,
    /// Whether decoding stopped at the budget rather than at an end-of-turn token.
    #[serde(default)]
    pub hit_budget: Option<bool>,
    /// The KV Packet adapter's hash (`kvpacket` runs only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapter: Option<String>,
    /// Against the exact answer (`eval --verify`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verified: Option<Verified>,
    /// What `auto` ran (its winning candidate's label, `auto` runs only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ran: Option<String>,
}

/// A run measured against the exact answer of its case (`eval --verify`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Verified {
    /// KL(exact || answered) of the first answer token's distribution, nats.
    pub kl: f64,
    /// Whether both put the same token first.
    pub top1: bool,
    /// Leading answer tokens both share.
    pub agree_tokens: usize,
    /// Tokens of the answer.
    pub answer_tokens: usize,
    /// The exact answer's score.
    pub exact_score: f64,
    /// The exact computation's time to first token.
    pub exact_ttft_ms: f64,
    /// Whether the exact answer was kept from the case's run before (not computed again).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub exact_reused: bool,
}

impl Record {
    /// The run's identity in a results file: task, length, sample, method label, ratio.
    pub fn key(&self) -> String {
        key(&self.task, self.length, self.sample, &self.method, self.ratio)
    }
}

/// [`Record::key`] of a planned run.
pub fn key(task: &str, length: usize, sample: usize, method: &MethodSpec, ratio: Option<f64>) -> String {
    format!("{task}|{length}|{sample}|{method}|{}", ratio.map_or("-".into(), |r| format!("{r:.4}")))
}

/// `results.json`: the settings that make runs comparable, and every run so far.
#[derive(Serialize, Deserialize)]
pub struct ResultsFile {
    /// Model, seed, answer budget, depths, ranks and the non-default ablation settings.
    pub config: serde_json::Value,
    /// The runs.
    pub records: Vec<Record>,
}

impl ResultsFile {
    /// Reads a results file.
    pub fn read(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(io("reading", path))?;
        serde_json::from_slice(&bytes).map_err(|source| LabError::NotResults { path: path.to_path_buf(), source })
    }

    /// Writes it whole (a temporary file renamed over the old one).
    pub fn write(&self, path: &Path) -> Result<()> {
        let bytes =
            serde_json::to_vec_pretty(self).map_err(|source| LabError::Json { path: path.to_path_buf(), source })?;
        write_atomic(path, &bytes)
    }
}

/// Writes `bytes` to a temporary file next to `path`, then renames it over `path`.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).map_err(io("writing", &tmp))?;
    std::fs::rename(&tmp, path).map_err(io("writing", path))?;
    Ok(())
}

/// [`answer_budget`]'s rule, as results.json's key records it.
pub const ANSWER_BUDGETS: &str = "niah* 128, others 32";

/// New tokens a task's answer may take: RULER's budgets (128 for the needle tasks, whose
/// values may be UUIDs: 36 characters, over 32 tokens where digits are single tokens, as in
/// Qwen2's tokenizer; 30 for variable tracking, 32 for QA), rounded up to 32.
pub fn answer_budget(task: &str) -> usize {
    // Change ANSWER_BUDGETS with this.
    if task.starts_with("niah") {
        128
    } else {
        32
    }
}

/// A needle's document, its rows, and its answer's rows.
pub type NeedleRows = (usize, std::ops::Range<usize>, Option<std::ops::Range<usize>>);

/// The record of run `r` of `case`, sample `sample` of its task and length (`needles`:
/// [`QaCase::needle_rows`]). The sample is the planner's, never read back from the case's id.
pub fn record(
    case: &QaCase,
    sample: usize,
    prompts: PromptStyle,
    method: MethodSpec,
    ratio: Option<f64>,
    r: &RunResult,
    needles: &[NeedleRows],
) -> Record {
    let s = case.score_with(&r.answer, prompts);
    let (mut n_tot, mut n_sel, mut a_tot, mut a_sel) = (0usize, 0usize, 0usize, 0usize);
    for (doc, rows, ans) in needles {
        let sel = &r.selected_rows[*doc];
        n_tot += rows.len();
        n_sel += sel.iter().filter(|x| rows.contains(x)).count();
        if let Some(a) = ans {
            a_tot += a.len();
            a_sel += sel.iter().filter(|x| a.contains(x)).count();
        }
    }
    // The answer-bearing needle's chunk, counted from the prompt in the final order.
    let needle_chunk_rank = needles
        .iter()
        .find(|n| n.2.is_some())
        .and_then(|(doc, _, _)| r.order.iter().position(|c| c == doc).map(|p| r.order.len() - 1 - p));
    Record {
        task: case.task.clone(),
        length: case.target_tokens,
        sample,
        depth: case.depth,
        method,
        ratio,
        score: s.value,
        em: s.em,
        f1: s.f1,
        ttft_ms: r.ttft.as_secs_f64() * 1e3,
        selected: r.n_selected(),
        context_tokens: r.n_context_tokens,
        needle_selected: n_sel as f64 / n_tot.max(1) as f64,
        answer_selected: a_sel as f64 / a_tot.max(1) as f64,
        needle_chunk_rank,
        answer: r.answer.clone(),
        max_new_tokens: Some(r.opts.max_new_tokens),
        hit_budget: Some(r.stop == flowprefill_worker::generate::StopReason::MaxTokens),
        adapter: None,
        verified: r.quality.as_ref().map(|q| Verified {
            kl: q.kl,
            top1: q.top1,
            agree_tokens: q.agree_tokens,
            answer_tokens: q.answer_tokens,
            exact_score: case.score_with(&q.exact_answer, prompts).value,
            exact_ttft_ms: q.exact_ttft_ms,
            exact_reused: q.exact_reused,
        }),
        ran: r.auto.as_ref().and_then(|c| c.chosen()).map(|c| c.label.clone()),
    }
}
