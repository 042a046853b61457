//! What `eval` was asked for, checked: the plan's axes, the scoring settings, one results
//! folder per eviction setting, and the settings key of each `results.json`.

use super::key;
use crate::error::ensure_usage;
use crate::tasks::{all_tasks, PromptStyle};
use crate::Result;
use flowprefill_coordinator::{Evict, Geometry, Method, MethodSpec, PrefixMode, RunOptions};
use std::path::PathBuf;

/// How the selective methods score tokens (the ablations of InfoFlow §4.2).
#[derive(Clone, Copy, Debug)]
pub struct Scoring {
    /// Scoring geometry.
    pub geometry: Geometry,
    /// InfoFlow's scoring layers (inclusive), if not the default.
    pub score_layers: Option<(usize, usize)>,
    /// InfoFlow's score pooling window, if any.
    pub score_pool: Option<usize>,
    /// Chunk prefix mode, if not the method's.
    pub prefix: Option<PrefixMode>,
}

impl Scoring {
    /// These settings in `opts`.
    pub fn apply(&self, opts: RunOptions) -> RunOptions {
        RunOptions {
            geometry: self.geometry,
            score_layers: self.score_layers,
            score_pool: self.score_pool,
            prefix: self.prefix,
            ..opts
        }
    }

    /// These settings in `opts` where its method reads them (a sweep over methods: the others
    /// run as they are).
    pub fn apply_where_used(&self, opts: RunOptions) -> RunOptions {
        let used = opts.scoring_knobs();
        let geometry = if used.geometry { self.geometry } else { opts.geometry };
        let score_layers = if used.score_layers { self.score_layers } else { opts.score_layers };
        let score_pool = if used.score_pool { self.score_pool } else { opts.score_pool };
        RunOptions { geometry, score_layers, score_pool, prefix: self.prefix, ..opts }
    }

    /// The settings that are not the defaults, named as results keys write them.
    pub fn non_default(&self) -> Vec<(&'static str, serde_json::Value)> {
        let mut out = Vec::new();
        if self.geometry != Geometry::Global {
            out.push(("geometry", serde_json::json!(self.geometry.name())));
        }
        if let Some((lo, hi)) = self.score_layers {
            out.push(("score_layers", serde_json::json!([lo, hi])));
        }
        if let Some(w) = self.score_pool {
            out.push(("score_pool", serde_json::json!(w)));
        }
        if let Some(p) = self.prefix {
            out.push(("prefix", serde_json::json!(p.name())));
        }
        out
    }
}

/// The axes of a plan, checked: tasks, lengths, ratios, depths, methods.
pub struct Axes {
    /// Tasks.
    pub tasks: Vec<String>,
    /// Context lengths.
    pub lengths: Vec<usize>,
    /// Recompute ratios of the selective methods.
    pub ratios: Vec<f64>,
    /// Needle depths.
    pub depths: Vec<f64>,
    /// Methods without ratios (the ratios are `ratios`).
    pub methods: Vec<MethodSpec>,
}

impl Axes {
    /// Checks the axes of `eval` (`tasks` and `methods` comma-separated, as the flags write
    /// them; `samples` per task and length).
    pub fn check(
        tasks: &str,
        lengths: Vec<usize>,
        ratios: Vec<f64>,
        depths: Vec<f64>,
        methods: &str,
        samples: usize,
    ) -> Result<Self> {
        let tasks: Vec<String> = tasks.split(',').map(|t| t.trim().to_string()).filter(|t| !t.is_empty()).collect();
        let known = all_tasks();
        for t in &tasks {
            ensure_usage!(known.contains(&t.as_str()), "unknown task `{t}`; choose from {}", known.join(", "));
        }
        ensure_usage!(
            !tasks.is_empty() && !lengths.is_empty() && samples > 0 && !depths.is_empty(),
            "nothing to evaluate"
        );
        crate::tasks::check_lengths(&lengths)?;
        crate::tasks::check_depths(&depths)?;
        // A value given twice would run twice and count twice in the paired tables (two wins
        // of one case against full's one).
        crate::tasks::check_cells(&lengths, &depths)?;
        crate::each_once("--tasks", "task", &tasks)?;
        crate::each_once("--ratios", "ratio", &ratios)?;
        for &r in &ratios {
            flowprefill_coordinator::request::check_ratio(r)?;
        }
        let methods = MethodSpec::parse_list(methods)?;
        crate::each_once("--methods", "method", &methods)?;
        ensure_usage!(
            methods.iter().all(|m| m.ratio.is_none()),
            "--methods names methods without ratios; give the ratios with --ratios"
        );
        ensure_usage!(
            methods.iter().any(|m| m.method == Method::Full),
            "--methods must include full (the baseline for retention)"
        );
        Ok(Axes { tasks, lengths, ratios, depths, methods })
    }
}

/// What keys a results file besides the scoring: the model and the cases.
pub struct Key {
    /// The model's label.
    pub model: String,
    /// The model's content (`GgufFile::content_digest`, or a synthetic model's name): two
    /// files of one name are two models.
    pub model_digest: String,
    /// Seed of the cases.
    pub seed: u64,
    /// Answer tokens at most, if not per task.
    pub max_tokens: Option<usize>,
    /// Thread ranks.
    pub ranks: usize,
    /// Prompt style.
    pub prompts: PromptStyle,
    /// Where and in which number formats the model runs, where it is not the CPU's f32 (e.g.
    /// `cuda, KV bf16, weights bf16`): answers and times of another numeric path are other runs.
    pub numerics: Option<String>,
    /// Whether every answer is verified against the exact one (`--verify`).
    pub verify: bool,
    /// The build that computes runs now (`flowprefill --version`'s id): recorded in each run,
    /// not in the key, so that a study resumes across builds and says which made what.
    pub build: String,
    /// Compute again the planned runs that another build made (`--redo-other-builds`).
    pub redo_other_builds: bool,
}

/// What `eval` was asked for, checked: the plan's axes and the settings that key results.json.
pub struct Plan {
    /// Tasks, lengths, ratios, depths and methods.
    pub axes: Axes,
    /// Scoring settings (the ablations).
    pub scoring: Scoring,
    /// One per eviction setting (one without eviction).
    pub settings: Vec<Setting>,
    /// The build that computes runs now ([`Key::build`]).
    pub build: String,
    /// Compute again the planned runs another build made ([`Key::redo_other_builds`]).
    pub redo_other_builds: bool,
}

/// One eviction setting of a plan: its own results folder and settings key.
pub struct Setting {
    /// KV eviction before decoding, if any.
    pub evict: Option<Evict>,
    /// The settings results.json is keyed by.
    pub config: serde_json::Value,
    /// Its folder (results.json, results.md, plots).
    pub out: PathBuf,
}

impl Setting {
    /// Its results file.
    pub fn results_path(&self) -> PathBuf {
        self.out.join("results.json")
    }

    /// Its name in progress lines (empty without a sweep).
    pub fn label(&self, several: bool) -> String {
        match self.evict {
            Some(e) if several => format!(" {}-{}", e.policy, e.budget),
            _ => String::new(),
        }
    }
}

impl Plan {
    /// The plan of `axes` under `scoring`, keyed by `key`, one setting per eviction of `evicts`
    /// (folders under `out` when there are several).
    pub fn new(axes: Axes, scoring: Scoring, key: Key, evicts: Vec<Evict>, out: PathBuf) -> Self {
        let mut config = serde_json::json!({
            "model": key.model,
            "seed": key.seed,
            "model_digest": key.model_digest,
            "max_tokens": key.max_tokens,
            "depths": axes.depths,
            "ranks": key.ranks,
        });
        if key.max_tokens.is_none() {
            // The per-task budgets join the key: results made under other defaults (32 for the
            // needle tasks before) are other runs.
            config["answer_budgets"] = serde_json::json!(super::ANSWER_BUDGETS);
        }
        if !crate::tasks::seed_kept(key.seed) {
            // Seeds from 16 up make other cases since seeds are mixed.
            config["cases"] = serde_json::json!("mixed seeds");
        }
        // Ablation settings join the key only when set, so results made with the defaults resume.
        for (k, v) in scoring.non_default() {
            config[k] = v;
        }
        if key.prompts != PromptStyle::Plain {
            config["prompts"] = serde_json::json!(key.prompts.name());
        }
        // Written only where they differ from what every earlier folder was made with (the CPU
        // in f32, unverified), so that those resume.
        if let Some(n) = &key.numerics {
            config["numerics"] = serde_json::json!(n);
        }
        if key.verify {
            config["verify"] = serde_json::json!(true);
        }
        let settings = if evicts.is_empty() {
            vec![Setting { evict: None, config, out }]
        } else {
            let several = evicts.len() > 1;
            evicts
                .into_iter()
                .map(|e| {
                    let mut config = config.clone();
                    config["evict"] = serde_json::json!(e.policy.to_string());
                    config["kv_budget"] = serde_json::json!(e.budget);
                    let out = if several { out.join(format!("{}-{}", e.policy, e.budget)) } else { out.clone() };
                    Setting { evict: Some(e), config, out }
                })
                .collect()
        };
        Plan { axes, scoring, settings, build: key.build, redo_other_builds: key.redo_other_builds }
    }

    /// The ratios a method runs at (one run without a ratio for the methods that select nothing).
    pub fn ratios_of(&self, spec: &MethodSpec) -> Vec<Option<f64>> {
        // A budget by coverage (`infoflow~0.9`) takes the place of the ratios.
        if spec.method.selects() && spec.coverage.is_none() {
            self.axes.ratios.iter().map(|&r| Some(r)).collect()
        } else {
            vec![None]
        }
    }

    /// Keys of every planned run, in the order they run.
    pub fn keys(&self, samples: usize) -> Vec<String> {
        let mut plan = Vec::new();
        let a = &self.axes;
        for task in &a.tasks {
            for &len in &a.lengths {
                for sample in 0..samples {
                    for spec in &a.methods {
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
    pub fn primers(&self) -> Vec<(Method, PrefixMode)> {
        let mut primers: Vec<(Method, PrefixMode)> = Vec::new();
        for spec in &self.axes.methods {
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
