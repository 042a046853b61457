//! How well SnapKV's observation window, and LookaheadKV's trained rows when the model has an
//! adapter, predict the attention the model's own answer pays the context, per (layer, KV
//! head), at KV budgets (`flowprefill importance`; the measure: [`crate::train::lookahead`]).

use crate::error::io_said;
use crate::tasks::{generate, PromptStyle};
use crate::train::lookahead::{agreement, agreement_of, case_importance, Agreement};
use crate::{LabError, Result, Stop};
use flowprefill_worker::{Cpu, LoadedModel};
use std::path::Path;

/// Held-back cases start here: away from the evaluation seeds (1 in docs/eval, below 100 in
/// `check` and the tests) and from the training seeds (7,000,000 and up, 7,500,000 held out).
pub const HELD_BACK_SEED: u64 = 7_800_000;

/// What to measure: the cases (tasks x lengths x samples from a seed), the budgets, the answer.
pub struct Plan<'a> {
    /// Tasks.
    pub tasks: &'a [String],
    /// Context lengths.
    pub lengths: &'a [usize],
    /// Cases per task and length.
    pub samples: usize,
    /// KV budgets.
    pub budgets: &'a [usize],
    /// Seed of the cases.
    pub seed: u64,
    /// Greedy answer tokens at most.
    pub max_tokens: usize,
}

/// One case at one budget.
#[derive(serde::Serialize)]
pub struct Row {
    /// Task.
    pub task: String,
    /// Context length asked for.
    pub length: usize,
    /// Sample index.
    pub sample: usize,
    /// KV budget.
    pub budget: usize,
    /// Context rows of the case.
    pub context_rows: usize,
    /// Tokens of the greedy answer.
    pub answer_tokens: usize,
    /// SnapKV's rows against the answer's attention.
    #[serde(flatten)]
    pub agreement: Agreement,
    /// LookaheadKV's rows against the same truth (with a lookahead adapter).
    pub lookahead: Option<Agreement>,
}

/// One row per finished case and budget ([`crate::Outcome`]).
pub type Outcome = crate::Outcome<Row>;

/// Every case of `plan` at every budget (`done` is told each case's `task|length|sample` and
/// the rows so far, which a caller may write: a long run stopped part way keeps them). Before
/// each case `stop` is asked whether to go on; a failure ends the run with the cases before it.
pub fn measure(
    lm: &LoadedModel<Cpu>,
    plan: &Plan<'_>,
    done: &mut dyn FnMut(&str, &[Row]) -> Result<()>,
    stop: &dyn Fn() -> bool,
) -> Outcome {
    let depths = crate::tasks::DEPTHS;
    let mut rows = Vec::new();
    let mut finished = 0;
    for task in plan.tasks {
        for &len in plan.lengths {
            for sample in 0..plan.samples {
                let at = format!("{task}|{len}|{sample}");
                let failed = |e: LabError| Stop::Failed { at: format!("case {at}"), error: Box::new(e) };
                if stop() {
                    return Outcome { rows, done: finished, stopped: Some(Stop::Asked) };
                }
                let Some(case) = generate(task, &lm.tokenizer, plan.seed, len, sample, &depths) else {
                    let e = LabError::Failed(format!("task `{task}` makes no case of {len} tokens"));
                    return Outcome { rows, done: finished, stopped: Some(failed(e)) };
                };
                let imp = match case_importance(lm, &case.request(PromptStyle::Ruler), plan.max_tokens) {
                    Ok(imp) => imp,
                    Err(e) => return Outcome { rows, done: finished, stopped: Some(failed(e.into())) },
                };
                finished += 1;
                let Some(imp) = imp else {
                    if let Err(e) = done(&at, &rows) {
                        return Outcome { rows, done: finished, stopped: Some(failed(e)) };
                    }
                    continue;
                };
                for &budget in plan.budgets {
                    rows.push(Row {
                        task: task.clone(),
                        length: len,
                        sample,
                        budget,
                        context_rows: imp.context_rows,
                        answer_tokens: imp.answer.len(),
                        agreement: agreement(&imp, budget),
                        lookahead: imp.lookahead.as_ref().map(|p| agreement_of(p, &imp.truth, budget)),
                    });
                }
                if let Err(e) = done(&at, &rows) {
                    return Outcome { rows, done: finished, stopped: Some(failed(e)) };
                }
            }
        }
    }
    Outcome { rows, done: finished, stopped: None }
}

/// Writes `importance.md` (the table `md`) and `importance.json` (the rows) into `dir`.
pub fn write(dir: &Path, md: &str, rows: &[Row]) -> Result<()> {
    crate::eval::write_atomic(&dir.join("importance.md"), md.as_bytes())?;
    write_rows(dir, rows)
}

/// Removes `importance.md` from `dir` if it is there (an earlier run's table, before this run's
/// rows replace that run's).
pub fn forget_table(dir: &Path) -> Result<()> {
    let md = dir.join("importance.md");
    match std::fs::remove_file(&md) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io_said("removing", &md)(e)),
        _ => Ok(()),
    }
}

/// Writes `importance.json` (the rows so far) into `dir`.
pub fn write_rows(dir: &Path, rows: &[Row]) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(io_said("creating", dir))?;
    let path = dir.join("importance.json");
    let json = serde_json::to_vec_pretty(rows).map_err(|source| LabError::Json { path: path.clone(), source })?;
    crate::eval::write_atomic(&path, &json)
}

/// Means per task, length and budget, and over all tasks.
pub fn table(rows: &[Row], tasks: &[String], lengths: &[usize], budgets: &[usize], model: &str) -> String {
    let mut md = format!(
        "SnapKV's prediction (the prompt's last 32 rows, pooled over 7) of the attention {model}'s greedy \
         answer pays the context, per (layer, KV head), averaged over layers, heads and cases. overlap: \
         share of the answer's top N rows among SnapKV's top N; recall: share of the answer's attention \
         on the context that SnapKV's top N rows carry; recent: the last N rows; oracle: the answer's own \
         top N; lookahead: the same two for LookaheadKV's trained rows (pooled over 7 as SnapKV).\n\n\
         | task | length | budget N | cases | context rows | overlap | recall | recent | oracle | lookahead overlap | lookahead recall |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    );
    let all = "all".to_string();
    for &len in lengths {
        for &b in budgets {
            for t in tasks.iter().chain([&all]) {
                let sel: Vec<&Row> =
                    rows.iter().filter(|r| r.length == len && r.budget == b && (t == &all || &r.task == t)).collect();
                if sel.is_empty() {
                    continue;
                }
                let n = sel.len() as f64;
                let mean = |f: &dyn Fn(&Agreement) -> f64| sel.iter().map(|r| f(&r.agreement)).sum::<f64>() / n;
                let ctx = sel.iter().map(|r| r.context_rows).sum::<usize>() / sel.len();
                let la: Vec<&Agreement> = sel.iter().filter_map(|r| r.lookahead.as_ref()).collect();
                let la_mean = |f: &dyn Fn(&Agreement) -> f64| match la.len() {
                    0 => "-".to_string(),
                    k => format!("{:.3}", la.iter().map(|a| f(a)).sum::<f64>() / k as f64),
                };
                md += &format!(
                    "| {t} | {len} | {b} | {} | {ctx} | {:.3} | {:.3} | {:.3} | {:.3} | {} | {} |\n",
                    sel.len(),
                    mean(&|a| a.overlap),
                    mean(&|a| a.recall),
                    mean(&|a| a.recent_recall),
                    mean(&|a| a.oracle_recall),
                    la_mean(&|a| a.overlap),
                    la_mean(&|a| a.recall)
                );
            }
        }
    }
    md
}
