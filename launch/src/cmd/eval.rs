//! `flowprefill eval`: accuracy of every method and ratio on RULER-style tasks and multi-
//! document QA, with tables, plots and selection diagnostics.
//!
//! Every (task, length, sample) case runs full prefill once, `none` and `star` once, and each
//! selective method at each ratio. Chunk caches are primed for every prefix mode before a
//! case's runs, so every recorded TTFT is warm (the multi-query RAG setting: chunk caches
//! reused) and comparable across methods. `results.json` is rewritten after every case;
//! an interrupted run resumes from it.
//!
//! With eviction (`--evict`, `--kv-budget`), every policy runs at every budget; several
//! settings write one folder each (`<out>/<policy>-<budget>`, keyed and resumed as one eval
//! each) and a case's runs of one method follow each other, so that full prefill's context
//! cache, kept in the engine's store, serves every setting after the first: their TTFT then
//! counts a copy of the cache, not the prefill.

use crate::Common;
use anyhow::Result;
use flowprefill_coordinator::{Geometry, Job, Method, MethodSpec, PrefixMode, Request, RunOptions, ThreadRanks};
use flowprefill_lab::eval::{answer_budget, key, plots, record, summarize, write_atomic, Record, ResultsFile};
use flowprefill_lab::tasks::{all_tasks, generate, PromptStyle};
use std::collections::HashSet;
use std::path::{Path, PathBuf};

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
    /// Evict the KV cache after the prompt, before decoding, for every method (full included):
    /// policies, comma-separated (snapkv, lookahead), each at every --kv-budget. One setting
    /// needs its own --out; several write `<out>/<policy>-<budget>` each.
    #[arg(long, value_enum, value_delimiter = ',', requires = "kv_budget")]
    pub evict: Vec<flowprefill_coordinator::EvictPolicy>,
    /// Context KV entries kept per (layer, KV head) by --evict, over all ranks; comma-separated
    /// for a sweep (e.g. 64,128,512).
    #[arg(long, value_delimiter = ',', requires = "evict")]
    pub kv_budget: Vec<usize>,
    /// Prompts: `ruler` (the question, then the assistant's turn opened with RULER's answer
    /// prefix; case-insensitive matching) or `plain` (the question alone, exact substrings: how
    /// the evaluations before 2026-11-22 were made, so their results.json files resume).
    #[arg(long, value_enum, default_value_t = PromptStyle::Ruler)]
    pub prompts: PromptStyle,
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
    /// Verify every run against its case's exact answer (full prefill on one rank, ring on
    /// several): each record gets the first token's KL, the agreement and the exact answer's
    /// score, and results.md the quality gate's table (what each KL floor would catch). Costs
    /// the exact computation per run; use its own --out.
    #[arg(long)]
    pub verify: bool,
}

/// What `eval` was asked for, checked: the plan's axes and the settings that key results.json.
struct Plan {
    tasks: Vec<String>,
    lengths: Vec<usize>,
    ratios: Vec<f64>,
    depths: Vec<f64>,
    /// Methods without ratios (the ratios are `ratios`).
    methods: Vec<MethodSpec>,
    /// Scoring settings (the ablations).
    scoring: super::Scoring,
    /// One per eviction setting (one without eviction).
    settings: Vec<Setting>,
}

/// One eviction setting of a plan: its own results folder and settings key.
struct Setting {
    /// KV eviction before decoding, if any.
    evict: Option<flowprefill_coordinator::Evict>,
    /// The settings results.json is keyed by.
    config: serde_json::Value,
    /// Its folder (results.json, results.md, plots).
    out: PathBuf,
}

impl Setting {
    fn results_path(&self) -> PathBuf {
        self.out.join("results.json")
    }

    /// Its name in progress lines (empty without a sweep).
    fn label(&self, several: bool) -> String {
        match self.evict {
            Some(e) if several => format!(" {}-{}", e.policy, e.budget),
            _ => String::new(),
        }
    }
}

impl Plan {
    /// The ratios a method runs at (one run without a ratio for the methods that select nothing).
    fn ratios_of(&self, spec: &MethodSpec) -> Vec<Option<f64>> {
        // A budget by coverage (`infoflow~0.9`) takes the place of the ratios.
        if spec.method.selects() && spec.coverage.is_none() {
            self.ratios.iter().map(|&r| Some(r)).collect()
        } else {
            vec![None]
        }
    }

    /// Keys of every planned run, in the order they run.
    fn keys(&self, samples: usize) -> Vec<String> {
        let mut plan = Vec::new();
        for task in &self.tasks {
            for &len in &self.lengths {
                for sample in 0..samples {
                    for spec in &self.methods {
                        plan.extend(self.ratios_of(spec).into_iter().map(|r| key(task, len, sample, spec, r)));
                    }
                }
            }
        }
        plan
    }

    /// The chunk caches the methods read (full and ring read none): only these are primed,
    /// each by a job of the method that makes them (`none` for plain chunks in a prefix mode,
    /// `kvpacket` for packets).
    fn primers(&self) -> Vec<(Method, PrefixMode)> {
        let mut primers: Vec<(Method, PrefixMode)> = Vec::new();
        for spec in &self.methods {
            let mode = self.scoring.prefix.unwrap_or(spec.method.default_prefix());
            let wraps = spec.method.info().adapter.is_some_and(|a| a.wraps_chunks());
            let maker = if wraps { spec.method } else { Method::None };
            if !spec.method.is_exact_prefill() && !primers.contains(&(maker, mode)) {
                primers.push((maker, mode));
            }
        }
        primers
    }
}

/// Checks the arguments and builds the plan and its settings key.
fn plan(common: &Common, a: &Args) -> Result<Plan> {
    let tasks: Vec<String> = a.tasks.split(',').map(|t| t.trim().to_string()).filter(|t| !t.is_empty()).collect();
    let known = all_tasks();
    for t in &tasks {
        crate::ensure_usage!(known.contains(&t.as_str()), "unknown task `{t}`; choose from {}", known.join(", "));
    }
    let (lengths, ratios, depths) = (a.lengths.concat(), a.ratios.concat(), a.depths.concat());
    crate::ensure_usage!(
        !tasks.is_empty() && !lengths.is_empty() && a.samples > 0 && !depths.is_empty(),
        "nothing to evaluate"
    );
    for &r in &ratios {
        flowprefill_coordinator::request::check_ratio(r)?;
    }
    let methods = MethodSpec::parse_list(&a.methods)?;
    crate::ensure_usage!(
        methods.iter().all(|m| m.ratio.is_none()),
        "--methods names methods without ratios; give the ratios with --ratios"
    );
    crate::ensure_usage!(
        methods.iter().any(|m| m.method == Method::Full),
        "--methods must include full (the baseline for retention)"
    );
    let scoring = a.scoring.parse()?;
    let mut config = serde_json::json!({
        "model": super::model_label(common)?,
        "seed": a.seed,
        "max_tokens": a.max_tokens,
        "depths": depths,
        "ranks": a.ranks,
    });
    // Ablation settings join the key only when set, so results made with the defaults resume.
    if scoring.geometry != Geometry::Global {
        config["geometry"] = serde_json::json!(scoring.geometry.name());
    }
    if let Some((lo, hi)) = scoring.score_layers {
        config["score_layers"] = serde_json::json!([lo, hi]);
    }
    if let Some(w) = scoring.score_pool {
        config["score_pool"] = serde_json::json!(w);
    }
    if let Some(p) = scoring.prefix {
        config["prefix"] = serde_json::json!(p.name());
    }
    if a.prompts != PromptStyle::Plain {
        config["prompts"] = serde_json::json!(a.prompts.name());
    }
    let evicts = super::evict_grid(&a.evict, &a.kv_budget)?;
    let settings = if evicts.is_empty() {
        vec![Setting { evict: None, config, out: a.out.clone() }]
    } else {
        let several = evicts.len() > 1;
        evicts
            .into_iter()
            .map(|e| {
                let mut config = config.clone();
                config["evict"] = serde_json::json!(e.policy.to_string());
                config["kv_budget"] = serde_json::json!(e.budget);
                let out = if several { a.out.join(format!("{}-{}", e.policy, e.budget)) } else { a.out.clone() };
                Setting { evict: Some(e), config, out }
            })
            .collect()
    };
    Ok(Plan { tasks, lengths, ratios, depths, methods, scoring, settings })
}

/// One setting's runs: those in its results.json, and the new ones.
struct Runs {
    records: Vec<Record>,
    have: HashSet<String>,
}

/// The runs already in `results.json` (made with the same settings), or none.
fn earlier_runs(path: &Path, config: &serde_json::Value, report_only: bool) -> Result<Vec<Record>> {
    if !path.exists() {
        crate::ensure_usage!(
            !report_only,
            "--report-only needs the runs of an earlier eval, but {} does not exist; pass that eval's --out",
            path.display()
        );
        return Ok(Vec::new());
    }
    let prev = ResultsFile::read(path)?;
    crate::ensure_usage!(
        prev.config == *config,
        "{} was made with other settings ({}); pass another --out or delete it",
        path.display(),
        prev.config
    );
    eprintln!("resuming: {} runs already in {}", prev.records.len(), path.display());
    Ok(prev.records)
}

/// Says how many planned runs are done and how many are left (or left out, with --report-only).
fn say_pending(plan: usize, pending: usize, resumed: bool, report_only: bool, path: &Path) {
    if report_only && pending == 0 {
        eprintln!("report only: all {plan} planned runs are in {}", path.display());
    } else if report_only {
        eprintln!(
            "report only: {} of {plan} planned runs are in {}; the {pending} missing ones are left out",
            plan - pending,
            path.display()
        );
    } else if resumed {
        eprintln!("{} of {plan} planned runs are already done; {pending} to compute", plan - pending);
    }
}

/// Runs the command.
pub fn run(common: &Common, a: Args) -> Result<()> {
    let plan = plan(common, &a)?;
    let keys = plan.keys(a.samples);
    let mut runs = Vec::with_capacity(plan.settings.len());
    let mut pending = 0;
    for s in &plan.settings {
        let path = s.results_path();
        let records = earlier_runs(&path, &s.config, a.report_only)?;
        std::fs::create_dir_all(&s.out).map_err(|e| anyhow::anyhow!("creating {}: {e}", s.out.display()))?;
        let have: HashSet<String> = records.iter().map(Record::key).collect();
        let left = keys.iter().filter(|k| !have.contains(*k)).count();
        say_pending(keys.len(), left, !have.is_empty(), a.report_only, &path);
        pending += left;
        runs.push(Runs { records, have });
    }
    if !a.report_only && pending > 0 {
        compute(common, &a, &plan, pending, &mut runs)?;
    }
    for (s, r) in plan.settings.iter().zip(runs) {
        report(&a, &plan, s, r.records)?;
    }
    Ok(())
}

/// Runs every planned run not in its setting's results, writing every setting's
/// `results.json` after every case.
fn compute(common: &Common, a: &Args, plan: &Plan, pending: usize, runs: &mut [Runs]) -> Result<()> {
    let lm = std::sync::Arc::new(super::load_model(common)?);
    let tok = &lm.tokenizer;
    super::check_thread_world(common, a.ranks)?;
    let mut world = super::thread_world(common, lm.clone(), a.ranks, std::time::Duration::from_secs(600))?;
    let primers = plan.primers();
    for (s, r) in plan.settings.iter().zip(runs.iter()) {
        check_adapter(&r.records, &lm, &s.results_path())?;
    }
    let several = plan.settings.len() > 1;
    // The bar counts the runs to compute (those already in results.json are skipped), so
    // a resumed eval's ETA is not inflated by them.
    let mut progress = crate::progress::Progress::new(pending, "runs");
    for task in &plan.tasks {
        for &len in &plan.lengths {
            for sample in 0..a.samples {
                let case = generate(task, tok, a.seed, len, sample, &plan.depths)
                    .ok_or_else(|| anyhow::anyhow!("task `{task}` made no case (a bug: the plan checked its name)"))?;
                let req = case.request(a.prompts);
                let needles = case.needle_rows(tok);
                let mut primed = false;
                for spec in &plan.methods {
                    for ratio in plan.ratios_of(spec) {
                        let k = key(task, len, sample, spec, ratio);
                        for (s, runs) in plan.settings.iter().zip(runs.iter_mut()) {
                            if runs.have.contains(&k) {
                                continue;
                            }
                            if !primed {
                                prime(&mut world, &req, &primers)?;
                                primed = true;
                            }
                            let opts = plan.scoring.apply(RunOptions {
                                max_new_tokens: a.max_tokens.unwrap_or_else(|| answer_budget(task)),
                                evict: s.evict,
                                verify: a.verify,
                                ..spec.options(ratio.unwrap_or(0.0))
                            });
                            let r = world.run(&Job { request: req.clone(), options: opts }, &mut |_| true)?;
                            let mut rec = record(&case, sample, a.prompts, *spec, ratio, &r, &needles);
                            rec.adapter = spec.method.info().adapter.and_then(|a| a.hash(&lm));
                            runs.records.push(rec);
                            progress.inc(&format!("{k}{}", s.label(several)));
                        }
                    }
                }
                for (s, runs) in plan.settings.iter().zip(runs.iter()) {
                    ResultsFile { config: s.config.clone(), records: runs.records.clone() }.write(&s.results_path())?;
                }
            }
        }
    }
    Ok(())
}

/// Writes results.md and the plots from the runs of the tasks and lengths asked for.
fn report(a: &Args, plan: &Plan, setting: &Setting, records: Vec<Record>) -> Result<()> {
    let settings: Vec<String> = ["geometry", "score_layers", "score_pool", "prefix", "evict", "kv_budget", "prompts"]
        .iter()
        .filter_map(|k| setting.config.get(*k).map(|v| format!("{k} {v}")))
        .collect();
    let out = &setting.out;
    // Tables and plots cover the tasks and lengths asked for; results.json keeps every run (an
    // earlier, wider run in the same folder would otherwise leak into the means).
    let shown: Vec<Record> =
        records.into_iter().filter(|r| plan.tasks.contains(&r.task) && plan.lengths.contains(&r.length)).collect();
    let md = summarize(&shown, &plan.tasks, &plan.lengths, &plan.methods, &plan.ratios, a.table_ratio, &settings);
    let md_path = out.join("results.md");
    write_atomic(&md_path, md.as_bytes())?;
    println!("{md}");
    plots(&shown, &plan.tasks, &plan.lengths, &plan.methods, &plan.ratios, &plan.depths, a.table_ratio, out)?;
    println!("wrote {}, {} and plots in {}", setting.results_path().display(), md_path.display(), out.display());
    Ok(())
}

/// The runs of a method with an adapter already in the results must come from the adapter in
/// use (another adapter's rows are another method).
fn check_adapter<B: flowprefill_kernels::Backend>(
    records: &[Record],
    lm: &flowprefill_worker::LoadedModel<B>,
    path: &Path,
) -> Result<()> {
    for method in Method::ALL {
        let Some(needed) = method.info().adapter else { continue };
        let adapter = needed.hash(lm);
        if let Some(r) = records.iter().find(|r| r.method.method == method && r.adapter != adapter) {
            crate::ensure_usage!(
                false,
                "{} holds {method} runs of adapter {} but this eval uses {}; pass another --out or the same {}",
                path.display(),
                r.adapter.as_deref().unwrap_or("(none)"),
                adapter.as_deref().unwrap_or("none"),
                needed.flag()
            );
        }
    }
    Ok(())
}

/// Fills the chunk stores the methods read, so that every recorded TTFT is warm (caches no
/// method reads are not made: at 8K tokens each costs a chunked prefill).
fn prime(
    world: &mut ThreadRanks<flowprefill_kernels::Device>,
    req: &Request,
    primers: &[(Method, PrefixMode)],
) -> Result<()> {
    for &(method, prefix) in primers {
        let opts = RunOptions { method, prefix: Some(prefix), max_new_tokens: 1, ..RunOptions::default() };
        world.run(&Job { request: req.clone(), options: opts }, &mut |_| true)?;
    }
    Ok(())
}
