//! Needle-in-a-haystack accuracy and TTFT of every method (`flowprefill check`): the cases,
//! the runs on one engine, and the table.

use crate::error::io_plain;
use crate::tasks::{PromptStyle, QaCase};
use crate::{Result, Stop};
use flowprefill_coordinator::{Engine, MethodSpec, RunOptions};
use flowprefill_kernels::Device;
use std::path::Path;

/// What the table says it was made with.
pub struct Report<'a> {
    /// Recompute ratio.
    pub ratio: f64,
    /// Context lengths.
    pub lengths: &'a [usize],
    /// Needle depths.
    pub depths: &'a [f64],
    /// Cases per (length, depth).
    pub per_cell: usize,
    /// Seed of the cases.
    pub seed: u64,
    /// Chunk caches kept across methods.
    pub warm: bool,
    /// One JSON object instead of the table.
    pub json: bool,
    /// The model's label.
    pub model: &'a str,
    /// Settings that are not the defaults (scoring ablations, KV eviction), by name.
    pub settings: Vec<(&'static str, serde_json::Value)>,
    /// The cases asked for (more than the table's when the run stopped early).
    pub planned: usize,
    /// Why the run stopped before its last case, if it did.
    pub stopped: Option<&'a Stop>,
}

/// What a run of [`run`] tells its caller.
pub enum Tick<'a> {
    /// A method's answer to a case (for `--verbose`).
    Answer(&'a str),
    /// A case done (its id).
    Case(&'a str),
}

/// How the methods run: the ratio, the scoring, the eviction, the chunk caches.
#[derive(Clone, Copy)]
pub struct Runs {
    /// Recompute ratio of the selective methods.
    pub ratio: f64,
    /// Scoring settings.
    pub scoring: crate::eval::Scoring,
    /// KV eviction before decoding.
    pub evict: Option<flowprefill_coordinator::Evict>,
    /// Keep chunk caches across methods.
    pub warm: bool,
}

/// One method's results over the cases.
#[derive(Default)]
pub struct Row {
    /// The method.
    pub label: String,
    /// Cases answered correctly.
    pub correct: usize,
    /// TTFT of each case.
    pub ttft_ms: Vec<f64>,
    /// Tokens recomputed, summed over cases.
    pub selected: usize,
    /// Fraction of needle-sentence tokens selected, summed over cases.
    pub needle_cov: f64,
    /// Fraction of answer tokens selected, summed over cases.
    pub answer_cov: f64,
}

/// Writes each case's documents, query and answer under `dir`.
pub fn dump(cases: &[QaCase], dir: &Path) -> Result<()> {
    let write = |p: std::path::PathBuf, text: &str| std::fs::write(p, text).map_err(io_plain);
    for case in cases {
        let d = dir.join(&case.id);
        std::fs::create_dir_all(&d).map_err(io_plain)?;
        for (i, doc) in case.documents.iter().enumerate() {
            write(d.join(format!("doc{i:02}.txt")), doc)?;
        }
        write(d.join("query.txt"), &case.query)?;
        write(d.join("answer.txt"), &case.answers.join("\n"))?;
    }
    Ok(())
}

/// One row per method over the cases every method answered ([`crate::Outcome`]): a failure or
/// an interruption at case 20 of 30 keeps the first 19 cases' figures.
pub type Outcome = crate::Outcome<Row>;

/// Runs every method of `table` on every case on `engine`; one row per method. Before each
/// case `stop` is asked whether to go on; a case counts only once every method answered it.
pub fn run(
    engine: &Engine<Device>,
    table: &[MethodSpec],
    cases: &[QaCase],
    how: Runs,
    tick: &mut dyn FnMut(Tick<'_>),
    stop: &dyn Fn() -> bool,
) -> Outcome {
    let mut rows: Vec<Row> = table.iter().map(|m| Row { label: m.to_string(), ..Row::default() }).collect();
    let mut done = 0;
    for case in cases {
        if stop() {
            return Outcome { rows, done, stopped: Some(Stop::Asked) };
        }
        let mut answered: Vec<Row> = rows.iter().map(|r| Row { label: r.label.clone(), ..Row::default() }).collect();
        if let Err(failed) = run_case(engine, table, case, how, &mut answered, tick) {
            engine.store().clear();
            return Outcome { rows, done, stopped: Some(failed) };
        }
        for (row, a) in rows.iter_mut().zip(answered) {
            row.correct += a.correct;
            row.ttft_ms.extend(a.ttft_ms);
            row.selected += a.selected;
            row.needle_cov += a.needle_cov;
            row.answer_cov += a.answer_cov;
        }
        done += 1;
        engine.store().clear();
        tick(Tick::Case(&case.id));
    }
    Outcome { rows, done, stopped: None }
}

/// Every method of `table` on one case, into `rows` (one per method); or the method that
/// failed, and why ([`Stop::Failed`]).
fn run_case(
    engine: &Engine<Device>,
    table: &[MethodSpec],
    case: &QaCase,
    how: Runs,
    rows: &mut [Row],
    tick: &mut dyn FnMut(Tick<'_>),
) -> std::result::Result<(), Stop> {
    // `check` keeps its plain prompts (its figures in docs/results.md were made with them).
    let req = case.request(PromptStyle::Plain);
    let needle_rows = case.needle_rows(&engine.model().tokenizer);
    for (row, spec) in rows.iter_mut().zip(table.iter()) {
        let failed = |e: flowprefill_coordinator::CoordError| Stop::Failed {
            at: format!("{} on case {}", row.label, case.id),
            error: Box::new(e.into()),
        };
        if !how.warm {
            engine.store().clear();
        }
        // An exact prefill (full, ring) has no chunk caches to warm; with eviction, full keeps
        // its context's cache for the next job, which would then copy it instead of
        // prefilling: its runs are fresh, so its TTFT (every speedup's baseline) is a prefill.
        let exact = spec.method.info().recompute == flowprefill_coordinator::method::Recompute::Everything;
        let opts = how.scoring.apply_where_used(RunOptions {
            max_new_tokens: 32,
            evict: how.evict,
            fresh: exact && how.evict.is_some(),
            ..spec.options(how.ratio)
        });
        if how.warm && !exact {
            // Warm means this method's own chunk caches are in the store before the timed
            // run (each prefix mode has its own): one untimed run makes them. Without it
            // the first method to read caches (and `star`, whose anchor mode no other
            // shares) was timed cold in a table labelled warm.
            engine.run(&req, &opts, &mut |_| true).map_err(failed)?;
        }
        let r = engine.run(&req, &opts, &mut |_| true).map_err(failed)?;
        if let Some((doc, needle, Some(answer))) = needle_rows.first() {
            let sel = &r.selected_rows[*doc];
            let cov = |rg: &std::ops::Range<usize>| {
                sel.iter().filter(|x| rg.contains(x)).count() as f64 / rg.len().max(1) as f64
            };
            row.needle_cov += cov(needle);
            row.answer_cov += cov(answer);
        }
        row.correct += case.is_correct(&r.answer) as usize;
        tick(Tick::Answer(&format!("  {:<18} {:>5} {:?}", row.label, case.is_correct(&r.answer), r.answer)));
        row.ttft_ms.push(r.ttft.as_secs_f64() * 1e3);
        row.selected += r.n_selected();
    }
    Ok(())
}

/// The table (or with --json one object) of accuracy, TTFT and selection per method, over the
/// `cases` that finished (at least one; fewer than [`Report::planned`] when the run stopped
/// early, which the table's first line and the object's `stopped` say).
pub fn report(args: &Report<'_>, rows: &[Row], cases: usize) -> Result<String> {
    let (lengths, depths) = (args.lengths, args.depths);
    let n = cases as f64;
    // The middle two averaged when the count is even (30 cases: the 16th alone was taken).
    let median = |v: &[f64]| crate::median(&mut v.to_vec());
    let full_acc = rows[0].correct as f64 / n;
    let full_ttft = median(&rows[0].ttft_ms);
    if args.json {
        let out: Vec<_> = rows
            .iter()
            .map(|r| {
                serde_json::json!({
                    "method": r.label, "accuracy": r.correct as f64 / n, "correct": r.correct, "cases": cases,
                    "median_ttft_ms": median(&r.ttft_ms), "mean_selected": r.selected as f64 / n,
                    "needle_tokens_selected": r.needle_cov / n, "answer_tokens_selected": r.answer_cov / n,
                })
            })
            .collect();
        let mut all = serde_json::json!({
            "model": args.model, "ratio": args.ratio, "lengths": lengths, "depths": depths,
            "per_cell": args.per_cell, "seed": args.seed, "warm": args.warm, "results": out,
            "cases": cases, "cases_planned": args.planned, "stopped": args.stopped.map(Stop::to_string),
        });
        for (k, v) in &args.settings {
            all[*k] = v.clone();
        }
        return serde_json::to_string_pretty(&all)
            .map(|s| s + "\n")
            .map_err(|source| crate::LabError::Json { path: "(check results)".into(), source });
    }
    let settings: String = args.settings.iter().map(|(k, v)| format!(", {k} {v}")).collect();
    let mut text = match &args.stopped {
        Some(stop) => format!("{}\n", stop.headline(cases, args.planned)),
        None => String::new(),
    };
    text += &format!(
        "needle in a haystack on {}: {} cases (lengths {:?}, depths {:?}, {} per cell, seed {}), ratio {}, {} chunk \
         caches{settings}\n",
        args.model,
        cases,
        lengths,
        depths,
        args.per_cell,
        args.seed,
        args.ratio,
        if args.warm { "warm" } else { "cold" }
    );
    text.push_str(&format!(
        "{:<18} {:>9} {:>9} {:>14} {:>8} {:>9} {:>10} {:>10}\n",
        "method", "accuracy", "vs full", "median TTFT ms", "speedup", "selected", "needle sel", "answer sel"
    ));
    for r in rows {
        let acc = r.correct as f64 / n;
        let ttft = median(&r.ttft_ms);
        text.push_str(&format!(
            "{:<18} {:>8.1}% {:>8.1}% {:>14.1} {:>7.2}x {:>9.0} {:>9.0}% {:>9.0}%\n",
            r.label,
            100.0 * acc,
            if full_acc > 0.0 { 100.0 * acc / full_acc } else { f64::NAN },
            ttft,
            full_ttft / ttft,
            r.selected as f64 / n,
            100.0 * r.needle_cov / n,
            100.0 * r.answer_cov / n
        ));
    }
    Ok(text)
}
