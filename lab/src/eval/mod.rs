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
    /// Distance from the prompt in the final layout (0 = the last chunk) of the farthest chunk
    /// holding an answer-bearing needle ([`answer_chunk_distance`]: both hops of `qa_twohop`,
    /// every value of the multi-value tasks; older results files hold the first such needle's
    /// chunk in document order).
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
    /// The hash of the method's adapter (KV Packet's, LookaheadKV's for `lookahead`), for
    /// methods with one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapter: Option<String>,
    /// The LookaheadKV adapter's hash, for runs under `--evict lookahead` (absent in results
    /// made before it was recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evict_adapter: Option<String>,
    /// Against the exact answer (`eval --verify`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verified: Option<Verified>,
    /// What `auto` ran (its winning candidate's label, `auto` runs only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ran: Option<String>,
    /// The build that made the run (`flowprefill --version`'s id; absent in results made
    /// before 2026-11-29).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub build: Option<String>,
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

/// Writes `bytes` to a temporary file next to `path`, then renames it over `path`. The
/// temporary name is this file's and this process's (`results.json.PID.tmp`): two files of one
/// folder (results.json, results.md), or two processes writing one, never share one.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let name = path.file_name().map_or_else(|| "out".into(), |n| n.to_string_lossy().into_owned());
    let tmp = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
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

/// How far from the prompt the answer lies in the final chunk `order` (first = farthest): the
/// distance (0 = the last chunk, right before the prompt) of the farthest chunk holding an
/// answer-bearing needle. An answer needs every one of them (the person's company and the
/// company's city of `qa_twohop`, each value of the multi-value tasks), so it is as near as its
/// farthest part; with one such needle, its chunk's distance. `None` without one, or when a
/// needle's chunk is not in the order.
pub fn answer_chunk_distance(needles: &[NeedleRows], order: &[usize]) -> Option<usize> {
    let distance = |doc: usize| order.iter().position(|&c| c == doc).map(|p| order.len() - 1 - p);
    let distances: Option<Vec<usize>> =
        needles.iter().filter(|n| n.2.is_some()).map(|&(doc, _, _)| distance(doc)).collect();
    distances?.into_iter().max()
}

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
    let needle_chunk_rank = answer_chunk_distance(needles, &r.order);
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
        evict_adapter: None,
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
        build: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `(doc, needle rows, answer rows)` of a needle; `answer`: whether it bears the answer.
    fn needle(doc: usize, answer: bool) -> NeedleRows {
        (doc, 3..9, answer.then_some(5..7))
    }

    /// Both hops count: the answer is as near as its farthest answer-bearing chunk, whichever
    /// comes first in document order; needles that bear no answer (distractors) do not count.
    #[test]
    fn the_answer_is_as_near_as_its_farthest_needle() {
        // Documents 2 (the person: hop 1) and 5 (the company: hop 2); order first = farthest.
        let twohop = [needle(2, true), needle(5, true)];
        assert_eq!(answer_chunk_distance(&twohop, &[0, 1, 3, 4, 5, 2]), Some(1), "hop 2 at 1, hop 1 at 0");
        assert_eq!(answer_chunk_distance(&twohop, &[5, 0, 1, 3, 4, 2]), Some(5), "hop 2 farthest");
        assert_eq!(answer_chunk_distance(&twohop, &[2, 0, 1, 3, 4, 5]), Some(5), "hop 1 farthest");
        assert_eq!(answer_chunk_distance(&[needle(5, true), needle(2, true)], &[5, 0, 1, 3, 4, 2]), Some(5));
        // One answer-bearing needle among distractors: its chunk.
        let multikey = [needle(0, false), needle(3, true), needle(1, false)];
        assert_eq!(answer_chunk_distance(&multikey, &[3, 2, 1, 0]), Some(3));
        assert_eq!(answer_chunk_distance(&multikey, &[0, 1, 2, 3]), Some(0));
        assert_eq!(answer_chunk_distance(&[needle(0, false)], &[0]), None, "no answer-bearing needle");
        assert_eq!(answer_chunk_distance(&twohop, &[0, 1, 2]), None, "a needle's chunk not in the order");
    }
}
