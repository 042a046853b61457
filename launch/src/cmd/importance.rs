//! `flowprefill importance`: how well SnapKV's observation window, and LookaheadKV's trained
//! rows when the model has an adapter, predict the attention the model's own answer pays the
//! context, per (layer, KV head), at KV budgets (`flowprefill_lab::train::lookahead`).

use crate::progress::Progress;
use crate::Common;
use anyhow::{Context as _, Result};
use flowprefill_lab::tasks::{all_tasks, generate, PromptStyle};
use flowprefill_lab::train::lookahead::{agreement, agreement_of, case_importance, Agreement};
use flowprefill_worker::{Cpu, LoadedModel};
use std::path::PathBuf;

/// Held-back cases start here: away from the evaluation seeds (1 in docs/eval, below 100 in
/// `check` and the tests) and from the training seeds (7,000,000 and up, 7,500,000 held out).
pub const HELD_BACK_SEED: u64 = 7_800_000;

/// Arguments of `importance`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Tasks (comma-separated), or `all`.
    #[arg(long, default_value = "niah_multivalue,niah_multiquery,variable_tracking,qa_twohop")]
    pub tasks: String,
    /// Context lengths in tokens.
    #[arg(long, default_value = "2048", value_parser = super::parse_list::<usize>)]
    pub lengths: Vec<Vec<usize>>,
    /// Cases per task and length.
    #[arg(long, default_value_t = 5)]
    pub samples: usize,
    /// KV budgets: context entries kept per (layer, KV head).
    #[arg(long, default_value = "64,128,512", value_parser = super::parse_list::<usize>)]
    pub budgets: Vec<Vec<usize>>,
    /// Seed of the cases (held back from evaluation and training by default).
    #[arg(long, default_value_t = HELD_BACK_SEED)]
    pub seed: u64,
    /// Greedy answer tokens at most.
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    /// Write `importance.json` and `importance.md` here.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// One case at one budget.
#[derive(serde::Serialize)]
struct Row {
    task: String,
    length: usize,
    sample: usize,
    budget: usize,
    context_rows: usize,
    answer_tokens: usize,
    #[serde(flatten)]
    agreement: Agreement,
    /// LookaheadKV's rows against the same truth (with a lookahead adapter).
    lookahead: Option<Agreement>,
}

/// Runs the command.
pub fn run(common: &Common, a: Args) -> Result<()> {
    crate::ensure_usage!(
        common.device == flowprefill_kernels::DeviceSpec::Cpu,
        "importance runs on the CPU; drop --device {}",
        common.device
    );
    let known = all_tasks();
    let tasks: Vec<String> = if a.tasks.trim() == "all" {
        known.iter().map(|s| s.to_string()).collect()
    } else {
        a.tasks.split(',').map(|t| t.trim().to_string()).filter(|t| !t.is_empty()).collect()
    };
    for t in &tasks {
        crate::ensure_usage!(known.contains(&t.as_str()), "--tasks: unknown task `{t}` (known: {})", known.join(", "));
    }
    let lengths = a.lengths.concat();
    let budgets = a.budgets.concat();
    crate::ensure_usage!(!lengths.is_empty() && !budgets.is_empty(), "give at least one --lengths and one --budgets");
    crate::ensure_usage!(budgets.iter().all(|&b| b > 0), "--budgets: every budget keeps at least one entry");
    crate::ensure_usage!(a.samples > 0 && a.max_tokens > 0, "--samples and --max-tokens must be at least 1");
    let path = super::model_path(common)?;
    let mut lm = LoadedModel::load(&path, Cpu).with_context(|| format!("loading {}", path.display()))?;
    super::attach_lookahead(&mut lm, common)?;
    match lm.model.lookahead_hash() {
        Some(h) => eprintln!("LookaheadKV adapter {h}: its rows are scored beside SnapKV"),
        None => {
            eprintln!("no LookaheadKV adapter for this model: SnapKV alone (train one: flowprefill train lookahead)")
        }
    }
    let depths = flowprefill_lab::tasks::DEPTHS;
    let mut rows = Vec::new();
    let mut progress = Progress::new(tasks.len() * lengths.len() * a.samples, "cases");
    for task in &tasks {
        for &len in &lengths {
            for sample in 0..a.samples {
                let Some(case) = generate(task, &lm.tokenizer, a.seed, len, sample, &depths) else {
                    anyhow::bail!("task `{task}` makes no case of {len} tokens");
                };
                let imp = case_importance(&lm, &case.request(PromptStyle::Ruler), a.max_tokens)?;
                progress.inc(&format!("{task}|{len}|{sample}"));
                let Some(imp) = imp else { continue };
                for &budget in &budgets {
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
            }
        }
    }
    let md = table(&rows, &tasks, &lengths, &budgets, &super::model_label(common)?);
    println!("{md}");
    if let Some(dir) = &a.out {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        flowprefill_lab::eval::write_atomic(&dir.join("importance.md"), md.as_bytes())?;
        let json = serde_json::to_vec_pretty(&rows)?;
        flowprefill_lab::eval::write_atomic(&dir.join("importance.json"), &json)?;
    }
    Ok(())
}

/// Means per task, length and budget, and over all tasks.
fn table(rows: &[Row], tasks: &[String], lengths: &[usize], budgets: &[usize], model: &str) -> String {
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
