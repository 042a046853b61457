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
use flowprefill_lab::eval::plan::{Axes, Key, Plan};
use flowprefill_lab::eval::run::{self as lab_run, Cases, Runs};
use flowprefill_lab::tasks::PromptStyle;
use std::path::PathBuf;

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
    /// Maximum answer tokens (default: per task, 128 for the needle tasks and 32 for the others:
    /// RULER's budgets).
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
    /// Compute again the planned runs in `<out>/results.json` that another build of flowprefill
    /// made (each run records its build, `flowprefill --version`; a resumed eval says how many
    /// there are). Without it they are kept, and results.md names every build.
    #[arg(long, conflicts_with = "report_only")]
    pub redo_other_builds: bool,
}

/// Checks the arguments and builds the plan and its settings key.
fn plan(common: &Common, a: &Args) -> Result<Plan> {
    let axes = Axes::check(&a.tasks, a.lengths.concat(), a.ratios.concat(), a.depths.concat(), &a.methods, a.samples)?;
    // The per-task tables and heat maps show one ratio: one that was run, not empty cells.
    let selective =
        axes.methods.iter().any(|m| m.method.info().recompute == flowprefill_coordinator::method::Recompute::Selected);
    crate::ensure_usage!(
        !selective || axes.ratios.iter().any(|r| (r - a.table_ratio).abs() < 1e-9),
        "--table-ratio {} is not among --ratios ({}): its tables would be empty; give one of them",
        a.table_ratio,
        axes.ratios.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(",")
    );
    let scoring = a.scoring.parse()?;
    let key = Key {
        model: super::model_label(common)?,
        model_digest: super::model_digest(common)?,
        seed: a.seed,
        max_tokens: a.max_tokens,
        ranks: a.ranks,
        prompts: a.prompts,
        numerics: numerics(common),
        verify: a.verify,
        build: crate::BUILD.to_string(),
        redo_other_builds: a.redo_other_builds,
    };
    let evicts = super::evict_grid(&a.evict, &a.kv_budget)?;
    Ok(Plan::new(axes, scoring, key, evicts, a.out.clone()))
}

/// Where and in which formats the model runs, where that is not the CPU's f32 (the numeric
/// path every earlier results folder was made on): a GPU's bf16 cache and forward give other
/// answers and times, so a study resumed there is another study.
fn numerics(common: &Common) -> Option<String> {
    use flowprefill_kernels::{DType, DeviceSpec, WeightType};
    let cpu = common.device == DeviceSpec::Cpu;
    let kv = common.kv_dtype.unwrap_or(if cpu { DType::F32 } else { DType::Bf16 });
    if cpu && kv == DType::F32 {
        return None;
    }
    let weights = match common.weights {
        WeightType::Bf16 => "bf16",
        WeightType::F32 => "f32",
    };
    Some(if cpu { format!("cpu, KV {kv}") } else { format!("cuda, KV {kv}, weights {weights}") })
}

/// Runs the command.
pub fn run(common: &Common, a: Args) -> Result<()> {
    let plan = plan(common, &a)?;
    let mut log = |l: &str| crate::say!("{l}");
    let (mut runs, pending) = lab_run::open(&plan, a.samples, a.report_only, &mut log)?;
    if !a.report_only && pending > 0 {
        compute(common, &a, &plan, pending, &mut runs)?;
    }
    for (s, r) in plan.settings.iter().zip(runs) {
        let md = lab_run::report(&plan, s, r, a.samples, a.table_ratio)?;
        println!("{md}");
        let md_path = s.out.join("results.md");
        println!("wrote {}, {} and plots in {}", s.results_path().display(), md_path.display(), s.out.display());
    }
    Ok(())
}

/// Loads the model and the ranks and runs every planned run not in its setting's results.
fn compute(common: &Common, a: &Args, plan: &Plan, pending: usize, runs: &mut [Runs]) -> Result<()> {
    let lm = std::sync::Arc::new(super::load_model(common)?);
    super::check_thread_world(common, a.ranks)?;
    let mut world = super::thread_world(common, lm.clone(), a.ranks, std::time::Duration::from_secs(600))?;
    // The bar counts the runs to compute (those already in results.json are skipped), so
    // a resumed eval's ETA is not inflated by them.
    let mut progress = crate::progress::Progress::new(pending, "runs");
    let cases =
        Cases { samples: a.samples, seed: a.seed, prompts: a.prompts, max_tokens: a.max_tokens, verify: a.verify };
    lab_run::compute(&mut world, &lm, plan, cases, runs, &mut |k| progress.inc(k))?;
    Ok(())
}
