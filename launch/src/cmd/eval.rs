//! `flowprefill eval`: accuracy of every method and ratio on RULER-style tasks and multi-
//! document QA, with tables, plots and selection diagnostics.
//!
//! Every (task, length, sample) case runs full prefill once, `none` and `star` once, and each
//! selective method at each ratio. Chunk caches are primed for every prefix mode before a
//! case's runs, so every recorded TTFT is warm (the multi-query RAG setting: chunk caches
//! reused) and comparable across methods. `results.json` is rewritten after every case;
//! an interrupted run resumes from it.

use crate::Common;
use anyhow::{Context as _, Result};
use flowprefill_coordinator::tasks::{all_tasks, generate, QaCase};
use flowprefill_coordinator::{Geometry, Job, Method, PrefixMode, Request, RunOptions, ThreadRanks};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::path::{Path, PathBuf};

mod report;
use report::{plots, summarize};

/// Arguments of `eval`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Tasks (comma-separated): niah_single, niah_multikey, niah_multivalue, niah_multiquery,
    /// variable_tracking, qa_onehop, qa_twohop.
    #[arg(
        long,
        default_value = "niah_single,niah_multikey,niah_multivalue,niah_multiquery,variable_tracking,qa_onehop,qa_twohop"
    )]
    pub tasks: String,
    /// Context lengths in tokens.
    #[arg(long, default_value = "2048,4096", value_parser = super::parse_list::<usize>)]
    pub lengths: Vec<Vec<usize>>,
    /// Methods (labels; `infoflow+reorder` reorders).
    #[arg(long, default_value = "full,none,infoflow,infoflow+reorder,prophet,cacheblend,epic,cacheclip,star")]
    pub methods: String,
    /// Recompute ratios of the selective methods.
    #[arg(long, default_value = "0.05,0.1,0.15,0.2,0.3", value_parser = super::parse_list::<f64>)]
    pub ratios: Vec<Vec<f64>>,
    /// Samples per task and length.
    #[arg(long, default_value_t = 20)]
    pub samples: usize,
    /// Needle depths the samples cycle through.
    #[arg(long, default_value = "0.1,0.3,0.5,0.7,0.9", value_parser = super::parse_list::<f64>)]
    pub depths: Vec<Vec<f64>>,
    /// Ratio shown in the per-task tables and heat maps.
    #[arg(long, default_value_t = 0.15)]
    pub table_ratio: f64,
    /// Thread ranks (the sharded pipeline).
    #[arg(long, default_value_t = 1)]
    pub ranks: usize,
    /// Seed of the cases.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Scoring settings (ablations; non-default ones need their own --out).
    #[command(flatten)]
    pub scoring: super::ScoringArgs,
    /// Prompts: `ruler` (the question, then the assistant's turn opened with RULER's answer
    /// prefix; case-insensitive matching) or `plain` (the question alone, exact substrings: how
    /// the evaluations before 2026-11-22 were made, so their results.json files resume).
    #[arg(long, value_enum, default_value_t = flowprefill_coordinator::tasks::PromptStyle::Ruler)]
    pub prompts: flowprefill_coordinator::tasks::PromptStyle,
    /// Maximum answer tokens (default: per task, 32, or 64 for the four-value tasks).
    #[arg(long)]
    pub max_tokens: Option<usize>,
    /// Output folder (results.json, results.md, PNG plots).
    #[arg(long, default_value = "eval-out")]
    pub out: PathBuf,
    /// Compute nothing: rewrite the tables and plots from the runs already in
    /// `<out>/results.json` (the planned runs still missing are counted and left out).
    #[arg(long)]
    pub report_only: bool,
}

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
    /// Method label.
    pub method: String,
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
}

impl Record {
    fn key(&self) -> String {
        key(&self.task, self.length, self.sample, &self.method, self.ratio)
    }
}

fn key(task: &str, length: usize, sample: usize, method: &str, ratio: Option<f64>) -> String {
    format!("{task}|{length}|{sample}|{method}|{}", ratio.map_or("-".into(), |r| format!("{r:.4}")))
}

#[derive(Serialize, Deserialize)]
struct ResultsFile {
    config: serde_json::Value,
    records: Vec<Record>,
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// Runs the command.
pub fn run(common: &Common, a: Args) -> Result<()> {
    let tasks: Vec<String> = a.tasks.split(',').map(|t| t.trim().to_string()).filter(|t| !t.is_empty()).collect();
    let known = all_tasks();
    for t in &tasks {
        crate::ensure_usage!(known.contains(&t.as_str()), "unknown task `{t}`; choose from {}", known.join(", "));
    }
    let lengths = a.lengths.concat();
    let ratios = a.ratios.concat();
    let depths = a.depths.concat();
    crate::ensure_usage!(
        !tasks.is_empty() && !lengths.is_empty() && a.samples > 0 && !depths.is_empty(),
        "nothing to evaluate"
    );
    for &r in &ratios {
        flowprefill_coordinator::request::check_ratio(r)?;
    }
    let methods = super::method_labels(&a.methods)?;
    crate::ensure_usage!(
        methods.iter().any(|m| m.1 == Method::Full),
        "--methods must include full (the baseline for retention)"
    );
    let (geometry, score_layers, prefix) = a.scoring.parse()?;
    let mut config = serde_json::json!({
        "model": super::model_label(common)?,
        "seed": a.seed,
        "max_tokens": a.max_tokens,
        "depths": depths,
        "ranks": a.ranks,
    });
    // Ablation settings join the key only when set, so results made with the defaults resume.
    if geometry != Geometry::Global {
        config["geometry"] = serde_json::json!(geometry.name());
    }
    if let Some((lo, hi)) = score_layers {
        config["score_layers"] = serde_json::json!([lo, hi]);
    }
    if let Some(p) = prefix {
        config["prefix"] = serde_json::json!(p.name());
    }
    if a.prompts != flowprefill_coordinator::tasks::PromptStyle::Plain {
        config["prompts"] = serde_json::json!(a.prompts.name());
    }
    let results_path = a.out.join("results.json");
    let mut records: Vec<Record> = Vec::new();
    if results_path.exists() {
        let prev: ResultsFile = serde_json::from_slice(&std::fs::read(&results_path)?)
            .with_context(|| format!("{} is not a results file; pass another --out", results_path.display()))?;
        crate::ensure_usage!(
            prev.config == config,
            "{} was made with other settings ({}); pass another --out or delete it",
            results_path.display(),
            prev.config
        );
        records = prev.records;
        eprintln!("resuming: {} runs already in {}", records.len(), results_path.display());
    } else {
        crate::ensure_usage!(
            !a.report_only,
            "--report-only needs the runs of an earlier eval, but {} does not exist; pass that eval's --out",
            results_path.display()
        );
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let have: HashSet<String> = records.iter().map(Record::key).collect();
    // The chunk stores the methods read (full and ring read none): only these are primed.
    let mut modes: Vec<PrefixMode> = Vec::new();
    for (_, method, _) in &methods {
        let mode = prefix.unwrap_or(method.default_prefix());
        if !matches!(method, Method::Full | Method::Ring) && !modes.contains(&mode) {
            modes.push(mode);
        }
    }

    let method_ratios = |method: &Method| -> Vec<Option<f64>> {
        if method.selects() {
            ratios.iter().map(|&r| Some(r)).collect()
        } else {
            vec![None]
        }
    };
    let mut plan: Vec<String> = Vec::new();
    for task in &tasks {
        for &len in &lengths {
            for sample in 0..a.samples {
                for (label_s, method, _) in &methods {
                    plan.extend(method_ratios(method).into_iter().map(|r| key(task, len, sample, label_s, r)));
                }
            }
        }
    }
    let pending = plan.iter().filter(|k| !have.contains(*k)).count();
    if a.report_only && pending == 0 {
        eprintln!("report only: all {} planned runs are in {}", plan.len(), results_path.display());
    } else if a.report_only {
        eprintln!(
            "report only: {} of {} planned runs are in {}; the {pending} missing ones are left out",
            plan.len() - pending,
            plan.len(),
            results_path.display()
        );
    } else if !have.is_empty() {
        eprintln!("{} of {} planned runs are already done; {pending} to compute", plan.len() - pending, plan.len());
    }
    if !a.report_only && pending > 0 {
        let lm = std::sync::Arc::new(super::load_model(common)?);
        let tok = &lm.tokenizer;
        super::check_thread_world(common, a.ranks)?;
        let mut world = super::thread_world(common, lm.clone(), a.ranks, std::time::Duration::from_secs(600))?;
        // The bar counts the runs to compute (those already in results.json are skipped), so
        // a resumed eval's ETA is not inflated by them.
        let mut progress = crate::progress::Progress::new(pending, "runs");
        for task in &tasks {
            for &len in &lengths {
                for sample in 0..a.samples {
                    let case = generate(task, tok, a.seed, len, sample, &depths)
                        .ok_or_else(|| anyhow::anyhow!("task {task}"))?;
                    let req = case.request(a.prompts);
                    let needles = case.needle_rows(tok);
                    let mut primed = false;
                    for (label_s, method, reorder) in &methods {
                        for ratio in method_ratios(method) {
                            let k = key(task, len, sample, label_s, ratio);
                            if have.contains(&k) {
                                continue;
                            }
                            if !primed {
                                prime(&mut world, &req, &modes)?;
                                primed = true;
                            }
                            let opts = RunOptions {
                                method: *method,
                                reorder: *reorder,
                                ratio: ratio.unwrap_or(0.0),
                                max_new_tokens: a.max_tokens.unwrap_or_else(|| answer_budget(task)),
                                geometry,
                                score_layers,
                                prefix,
                                ..RunOptions::default()
                            };
                            let r = world.run(&Job { request: req.clone(), options: opts }, &mut |_| true)?;
                            records.push(record(&case, a.prompts, label_s, ratio, &r, &needles));
                            progress.inc(&k);
                        }
                    }
                    let file = ResultsFile { config: config.clone(), records: records.clone() };
                    write_atomic(&results_path, &serde_json::to_vec_pretty(&file)?)?;
                }
            }
        }
    }
    let labels: Vec<String> = methods.iter().map(|m| m.0.clone()).collect();
    let settings: Vec<String> = ["geometry", "score_layers", "prefix", "prompts"]
        .iter()
        .filter_map(|k| config.get(*k).map(|v| format!("{k} {v}")))
        .collect();
    // Tables and plots cover the tasks and lengths asked for; results.json keeps every run (an
    // earlier, wider run in the same folder would otherwise leak into the means).
    let shown: Vec<Record> =
        records.into_iter().filter(|r| tasks.contains(&r.task) && lengths.contains(&r.length)).collect();
    let md = summarize(&shown, &tasks, &lengths, &labels, &ratios, a.table_ratio, &settings);
    let md_path = a.out.join("results.md");
    write_atomic(&md_path, md.as_bytes())?;
    println!("{md}");
    plots(&shown, &tasks, &lengths, &labels, &ratios, &depths, a.table_ratio, &a.out)?;
    println!("wrote {}, {} and plots in {}", results_path.display(), md_path.display(), a.out.display());
    Ok(())
}

/// New tokens a task's answer may take: RULER's budgets (128 for the needle tasks, whose
/// values may be UUIDs: 36 characters, over 32 tokens where digits are single tokens, as in
/// Qwen2's tokenizer; 30 for variable tracking, 32 for QA), rounded up to 32.
fn answer_budget(task: &str) -> usize {
    if task.starts_with("niah") {
        128
    } else {
        32
    }
}

/// Fills the chunk stores of the prefix modes the methods use, so that every recorded TTFT
/// is warm (a mode no method reads is not computed: at 8K tokens each costs a chunked prefill).
fn prime(world: &mut ThreadRanks<flowprefill_kernels::Device>, req: &Request, modes: &[PrefixMode]) -> Result<()> {
    for &prefix in modes {
        let opts =
            RunOptions { method: Method::None, prefix: Some(prefix), max_new_tokens: 1, ..RunOptions::default() };
        world.run(&Job { request: req.clone(), options: opts }, &mut |_| true)?;
    }
    Ok(())
}

/// A needle's document, its rows, and its answer's rows.
type NeedleRows = (usize, std::ops::Range<usize>, Option<std::ops::Range<usize>>);

fn record(
    case: &QaCase,
    prompts: flowprefill_coordinator::tasks::PromptStyle,
    method: &str,
    ratio: Option<f64>,
    r: &flowprefill_coordinator::RunResult,
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
        sample: case.id.rsplit('-').next().and_then(|s| s.parse().ok()).unwrap_or(0),
        depth: case.depth,
        method: method.to_string(),
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
    }
}
