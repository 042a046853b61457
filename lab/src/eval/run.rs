//! Running an eval's plan: the runs already in each setting's `results.json`, the cases still
//! to compute (chunk caches primed, so every recorded TTFT is warm), and the report.

use super::plan::{Plan, Setting};
use super::{answer_budget, key, plots, record, summarize, write_atomic, Record, ResultsFile};
use crate::error::{ensure_usage, io_said};
use crate::tasks::{generate, PromptStyle};
use crate::{LabError, Result};
use flowprefill_coordinator::method::Adapter;
use flowprefill_coordinator::{EvictPolicy, Job, Method, PrefixMode, Request, RunOptions, ThreadRanks};
use flowprefill_kernels::Device;
use flowprefill_worker::LoadedModel;
use std::collections::HashSet;
use std::path::Path;

/// One setting's runs: those in its results.json, and the new ones.
pub struct Runs {
    /// Every run.
    pub records: Vec<Record>,
    /// Keys of the runs read from results.json.
    pub have: HashSet<String>,
    /// The settings the report is labelled with: results.json's key where it exists (what its
    /// runs were made with: under --report-only a setting recorded on one side only is let
    /// through), else this command's.
    pub config: serde_json::Value,
}

/// The runs already in `results.json` (made with the same settings) and its key, or none.
fn earlier_runs(
    path: &Path,
    config: &serde_json::Value,
    report_only: bool,
    log: &mut dyn FnMut(&str),
) -> Result<Option<ResultsFile>> {
    if !path.exists() {
        ensure_usage!(
            !report_only,
            "--report-only needs the runs of an earlier eval, but {} does not exist; pass that eval's --out",
            path.display()
        );
        return Ok(None);
    }
    let prev = ResultsFile::read(path)?;
    // A report reads what is there: settings this binary records and the file does not (made
    // by an earlier flowprefill) do not stop it.
    let differ = differences(&prev.config, config, report_only);
    ensure_usage!(
        differ.is_empty(),
        "{} was made with other settings ({}); pass another --out or delete it",
        path.display(),
        differ.join("; ")
    );
    if report_only {
        // Settings recorded on one side only: the report says what the file records.
        let unmatched = differences(&prev.config, config, false);
        if !unmatched.is_empty() {
            log(&format!(
                "report only: {} and this command differ in settings one side does not record ({}); the report is \
                 labelled with the file's",
                path.display(),
                unmatched.join("; ")
            ));
        }
    } else {
        log(&format!("resuming: {} runs already in {}", prev.records.len(), path.display()));
    }
    Ok(Some(prev))
}

/// The settings in which `before` (a results file's key) and `now` differ, each as `name: was
/// X, now Y` (`report_only`: only settings both record).
fn differences(before: &serde_json::Value, now: &serde_json::Value, report_only: bool) -> Vec<String> {
    let none = serde_json::Map::new();
    let (b, n) = (before.as_object().unwrap_or(&none), now.as_object().unwrap_or(&none));
    let mut names: Vec<&String> = b.keys().chain(n.keys()).collect();
    names.sort();
    names.dedup();
    names
        .into_iter()
        .filter_map(|k| match (b.get(k), n.get(k)) {
            (Some(x), Some(y)) if x == y => None,
            (None, Some(_)) | (Some(_), None) if report_only => None,
            (x, y) => {
                let said = |v: Option<&serde_json::Value>| v.map_or("not recorded".to_string(), |v| v.to_string());
                Some(format!("{k}: was {}, now {}", said(x), said(y)))
            }
        })
        .collect()
}

/// Says how many planned runs are done and how many are left (or left out, with --report-only).
fn say_pending(plan: usize, pending: usize, resumed: bool, report_only: bool, path: &Path, log: &mut dyn FnMut(&str)) {
    if report_only && pending == 0 {
        log(&format!("report only: all {plan} planned runs are in {}", path.display()));
    } else if report_only {
        log(&format!(
            "report only: {} of {plan} planned runs are in {}; the {pending} missing ones are left out",
            plan - pending,
            path.display()
        ));
    } else if resumed {
        log(&format!("{} of {plan} planned runs are already done; {pending} to compute", plan - pending));
    }
}

/// Says which of the planned runs in a results file another build made (their answers and
/// times are that build's), and with `--redo-other-builds` takes them out to be computed again
/// (runs outside the plan are kept as they are).
fn other_builds(records: &mut Vec<Record>, planned: &[String], plan: &Plan, path: &Path, log: &mut dyn FnMut(&str)) {
    let planned: HashSet<&str> = planned.iter().map(String::as_str).collect();
    let other = |r: &Record| r.build.as_deref() != Some(plan.build.as_str()) && planned.contains(r.key().as_str());
    let by_build = count_builds(records.iter().filter(|r| other(r)));
    if by_build.is_empty() {
        return;
    }
    let n: usize = by_build.values().sum();
    let builds: Vec<String> = by_build.iter().map(|(b, k)| format!("{b}: {k}")).collect();
    if plan.redo_other_builds {
        log(&format!(
            "--redo-other-builds: {n} planned runs in {} were made by other builds ({}); computing them again with {}",
            path.display(),
            builds.join(", "),
            plan.build
        ));
        records.retain(|r| !other(r));
    } else {
        log(&format!(
            "{n} of the runs already in {} were made by other builds ({}), not this one ({}): their answers and \
             times are those builds'; add --redo-other-builds to compute them again",
            path.display(),
            builds.join(", "),
            plan.build
        ));
    }
}

/// Every setting's runs so far (its folder made), and how many planned runs are missing in all.
pub fn open(plan: &Plan, samples: usize, report_only: bool, log: &mut dyn FnMut(&str)) -> Result<(Vec<Runs>, usize)> {
    let keys = plan.keys(samples);
    let mut runs = Vec::with_capacity(plan.settings.len());
    let mut pending = 0;
    for s in &plan.settings {
        ensure_usage!(
            !s.out.exists() || s.out.is_dir(),
            "--out {}: a file is there; eval writes a folder (results.json, results.md, plots): give a folder's path",
            s.out.display()
        );
        let path = s.results_path();
        let (mut records, config) = match earlier_runs(&path, &s.config, report_only, log)? {
            Some(f) => (f.records, f.config),
            None => (Vec::new(), s.config.clone()),
        };
        other_builds(&mut records, &keys, plan, &path, log);
        std::fs::create_dir_all(&s.out).map_err(io_said("creating", &s.out))?;
        let have: HashSet<String> = records.iter().map(Record::key).collect();
        let left = keys.iter().filter(|k| !have.contains(*k)).count();
        say_pending(keys.len(), left, !have.is_empty(), report_only, &path, log);
        pending += left;
        runs.push(Runs { records, have, config });
    }
    Ok((runs, pending))
}

/// How each case runs: its seed, samples, prompts and answer budget, and verification.
#[derive(Clone, Copy, Debug)]
pub struct Cases {
    /// Samples per task and length.
    pub samples: usize,
    /// Seed of the cases.
    pub seed: u64,
    /// Prompt style.
    pub prompts: PromptStyle,
    /// Answer tokens at most (default: per task).
    pub max_tokens: Option<usize>,
    /// Verify every run against the exact answer.
    pub verify: bool,
}

/// Runs every planned run not in its setting's results, writing every setting's
/// `results.json` after every case; `done` is told each run's key as it finishes.
pub fn compute(
    world: &mut ThreadRanks<Device>,
    lm: &LoadedModel<Device>,
    plan: &Plan,
    c: Cases,
    runs: &mut [Runs],
    done: &mut dyn FnMut(&str),
) -> Result<()> {
    let tok = &lm.tokenizer;
    let primers = plan.primers();
    for (s, r) in plan.settings.iter().zip(runs.iter()) {
        check_adapter(&r.records, lm, &s.results_path())?;
        check_evict_adapter(&r.records, s, lm)?;
        check_budgets(&r.records, c.max_tokens, &s.results_path())?;
    }
    let several = plan.settings.len() > 1;
    let axes = &plan.axes;
    for task in &axes.tasks {
        for &len in &axes.lengths {
            for sample in 0..c.samples {
                let case = generate(task, tok, c.seed, len, sample, &axes.depths).ok_or_else(|| {
                    LabError::Failed(format!("task `{task}` made no case (a bug: the plan checked its name)"))
                })?;
                let req = case.request(c.prompts);
                let needles = case.needle_rows(tok);
                let mut primed = false;
                for spec in &axes.methods {
                    for ratio in plan.ratios_of(spec) {
                        let k = key(task, len, sample, spec, ratio);
                        for (i, s) in plan.settings.iter().enumerate() {
                            if runs[i].have.contains(&k) {
                                continue;
                            }
                            if !primed {
                                prime(world, &req, &primers)?;
                                primed = true;
                            }
                            let opts = plan.scoring.apply_where_used(RunOptions {
                                max_new_tokens: c.max_tokens.unwrap_or_else(|| answer_budget(task)),
                                evict: s.evict,
                                verify: c.verify,
                                ..spec.options(ratio.unwrap_or(0.0))
                            });
                            let r = match world.run(&Job { request: req.clone(), options: opts }, &mut |_| true) {
                                Ok(r) => r,
                                Err(e) => {
                                    // The case's runs done so far are kept; the study stops
                                    // here, and a rerun of the command resumes at this run.
                                    save(plan, runs)?;
                                    return Err(LabError::StudyRun {
                                        run: format!("{k}{}", s.label(several)),
                                        error: e,
                                    });
                                }
                            };
                            let mut rec = record(&case, sample, c.prompts, *spec, ratio, &r, &needles);
                            rec.adapter = spec.method.info().adapter.and_then(|a| a.hash(lm));
                            rec.evict_adapter = evict_adapter(s, lm);
                            rec.build = Some(plan.build.clone());
                            runs[i].records.push(rec);
                            done(&format!("{k}{}", s.label(several)));
                        }
                    }
                }
                save(plan, runs)?;
            }
        }
    }
    Ok(())
}

/// Writes every setting's `results.json`.
fn save(plan: &Plan, runs: &[Runs]) -> Result<()> {
    for (s, r) in plan.settings.iter().zip(runs) {
        ResultsFile { config: s.config.clone(), records: r.records.clone() }.write(&s.results_path())?;
    }
    Ok(())
}

/// Writes results.md and the plots of `setting` from the runs of the tasks and lengths asked
/// for (the tables at `table_ratio`); returns results.md's text.
pub fn report(plan: &Plan, setting: &Setting, runs: Runs, samples: usize, table_ratio: f64) -> Result<String> {
    const LABELS: [&str; 9] =
        ["geometry", "score_layers", "score_pool", "prefix", "evict", "kv_budget", "prompts", "numerics", "verify"];
    let settings: Vec<String> = LABELS.iter().filter_map(|k| runs.config.get(*k).map(|v| format!("{k} {v}"))).collect();
    let records = runs.records;
    let out = &setting.out;
    // Tables and plots cover the tasks, lengths, samples and methods asked for; results.json
    // keeps every run (an earlier, wider run in the same folder would otherwise leak into the
    // means: one method's mean over 12 cases beside another's over 3).
    let a = &plan.axes;
    let shown: Vec<Record> = records
        .into_iter()
        .filter(|r| a.tasks.contains(&r.task) && a.lengths.contains(&r.length) && r.sample < samples)
        .filter(|r| a.methods.contains(&r.method))
        .collect();
    let mut settings = settings;
    settings.push(builds_of(&shown));
    let md = summarize(&shown, &a.tasks, &a.lengths, &a.methods, &a.ratios, table_ratio, &settings);
    write_atomic(&out.join("results.md"), md.as_bytes())?;
    plots(&shown, &a.tasks, &a.lengths, &a.methods, &a.ratios, &a.depths, table_ratio, out)?;
    Ok(md)
}

/// Runs per build that made them (`not recorded` for runs made before builds were recorded).
fn count_builds<'a>(records: impl Iterator<Item = &'a Record>) -> std::collections::BTreeMap<&'a str, usize> {
    let mut by_build = std::collections::BTreeMap::new();
    for r in records {
        *by_build.entry(r.build.as_deref().unwrap_or("not recorded")).or_default() += 1;
    }
    by_build
}

/// Which builds made the runs shown: `built by X` (one), or each with its run count.
fn builds_of(records: &[Record]) -> String {
    let by_build = count_builds(records.iter());
    match by_build.len() {
        0 => "built by (no runs)".into(),
        1 => format!("built by {}", by_build.keys().next().copied().unwrap_or_default()),
        _ => format!(
            "built by several builds: {}",
            by_build.iter().map(|(b, n)| format!("{b} ({n} runs)")).collect::<Vec<_>>().join(", ")
        ),
    }
}

/// The runs already in the results must have decoded under the budgets this eval gives
/// (a run of another budget is another run).
fn check_budgets(records: &[Record], max_tokens: Option<usize>, path: &Path) -> Result<()> {
    let budget = |task: &str| max_tokens.unwrap_or_else(|| answer_budget(task));
    if let Some(r) = records.iter().find(|r| r.max_new_tokens != Some(budget(&r.task))) {
        return Err(LabError::Usage(format!(
            "{} holds a {} run that decoded under {} new tokens, but this eval gives {} {}; pass another --out, or \
             the --max-tokens it was made with",
            path.display(),
            r.task,
            r.max_new_tokens.map_or("an unrecorded number of".to_string(), |n| n.to_string()),
            budget(&r.task),
            if max_tokens.is_some() { "(--max-tokens)" } else { "(the task's default)" }
        )));
    }
    Ok(())
}

/// The runs of a method with an adapter already in the results must come from the adapter in
/// use (another adapter's rows are another method).
fn check_adapter<B: flowprefill_kernels::Backend>(records: &[Record], lm: &LoadedModel<B>, path: &Path) -> Result<()> {
    for method in Method::ALL {
        let Some(needed) = method.info().adapter else { continue };
        let adapter = needed.hash(lm);
        if let Some(r) = records.iter().find(|r| r.method.method == method && r.adapter != adapter) {
            ensure_usage!(
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

/// The LookaheadKV adapter's hash where `setting` evicts by it.
fn evict_adapter<B: flowprefill_kernels::Backend>(setting: &Setting, lm: &LoadedModel<B>) -> Option<String> {
    let lookahead = setting.evict.is_some_and(|e| e.policy == EvictPolicy::Lookahead);
    lookahead.then(|| Adapter::Lookahead.hash(lm)).flatten()
}

/// The runs already in the results of a setting that evicts by LookaheadKV must come from the
/// adapter in use (its scores chose what was kept); runs that did not record it are let through.
fn check_evict_adapter<B: flowprefill_kernels::Backend>(
    records: &[Record],
    setting: &Setting,
    lm: &LoadedModel<B>,
) -> Result<()> {
    let now = evict_adapter(setting, lm);
    if let Some(r) = records.iter().find(|r| r.evict_adapter.is_some() && r.evict_adapter != now) {
        ensure_usage!(
            false,
            "{} holds runs evicted by LookaheadKV adapter {} but this eval uses {}; pass another --out or the same {}",
            setting.results_path().display(),
            r.evict_adapter.as_deref().unwrap_or("(none)"),
            now.as_deref().unwrap_or("none"),
            Adapter::Lookahead.flag()
        );
    }
    Ok(())
}

/// Fills the chunk stores the methods read, so that every recorded TTFT is warm (caches no
/// method reads are not made: at 8K tokens each costs a chunked prefill).
fn prime(world: &mut ThreadRanks<Device>, req: &Request, primers: &[(Method, PrefixMode)]) -> Result<()> {
    for &(method, prefix) in primers {
        let opts = RunOptions { method, prefix: Some(prefix), max_new_tokens: 1, ..RunOptions::default() };
        world.run(&Job { request: req.clone(), options: opts }, &mut |_| true)?;
    }
    Ok(())
}
