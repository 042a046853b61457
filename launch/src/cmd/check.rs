//! `flowprefill check`: needle-in-a-haystack accuracy and TTFT of every method.

use super::run::engine;
use crate::Common;
use anyhow::Result;
use flowprefill_coordinator::RunOptions;
use flowprefill_lab::tasks::niah_cases;

/// Arguments of `check`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Context lengths in tokens.
    #[arg(long, default_value = "2048,4096", value_parser = super::parse_list::<usize>)]
    pub lengths: Vec<Vec<usize>>,
    /// Needle depths.
    #[arg(long, default_value = "0.1,0.3,0.5,0.7,0.9", value_parser = super::parse_list::<f64>)]
    pub depths: Vec<Vec<f64>>,
    /// Cases per (length, depth).
    #[arg(long, default_value_t = 3)]
    pub per_cell: usize,
    /// Recompute ratio of the selective methods.
    #[arg(long, default_value_t = 0.15)]
    pub ratio: f64,
    /// Seed of the cases.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Keep chunk caches across methods (faster; TTFT then excludes chunk prefill).
    #[arg(long)]
    pub warm: bool,
    /// Scoring settings of the selective methods.
    #[command(flatten)]
    pub scoring: super::ScoringArgs,
    /// KV eviction before decoding, for every method.
    #[command(flatten)]
    pub evict: super::EvictArgs,
    /// Print every answer.
    #[arg(long)]
    pub verbose: bool,
    /// Only these methods (comma-separated, as `--method` writes them: e.g.
    /// full,infoflow,infoflow+reorder@0.3; full must be one).
    #[arg(long)]
    pub methods: Option<String>,
    /// Write each case (documents, query, answer) under this folder, to rerun it with `run`.
    #[arg(long)]
    pub dump_cases: Option<std::path::PathBuf>,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

struct Row {
    label: String,
    correct: usize,
    ttft_ms: Vec<f64>,
    selected: usize,
    /// Fraction of needle-sentence tokens selected, summed over cases.
    needle_cov: f64,
    /// Fraction of answer tokens selected, summed over cases.
    answer_cov: f64,
}

/// Writes each case's documents, query and answer under `dir`.
fn dump(cases: &[flowprefill_lab::tasks::QaCase], dir: &std::path::Path) -> Result<()> {
    for case in cases {
        let d = dir.join(&case.id);
        std::fs::create_dir_all(&d)?;
        for (i, doc) in case.documents.iter().enumerate() {
            std::fs::write(d.join(format!("doc{i:02}.txt")), doc)?;
        }
        std::fs::write(d.join("query.txt"), &case.query)?;
        std::fs::write(d.join("answer.txt"), case.answers.join("\n"))?;
    }
    eprintln!("wrote {} cases under {}", cases.len(), dir.display());
    Ok(())
}

/// Runs the command.
pub fn run(common: &Common, args: Args) -> Result<()> {
    // Parsed once, before the model loads, so a bad flag fails fast.
    let scoring = args.scoring.parse()?;
    let evict = args.evict.parse()?;
    let mut table = super::demo::table(args.methods.as_deref())?;
    let engine = engine(common, None)?;
    if args.methods.is_none() {
        // The default table has KV Packet and lookahead only where the model has their adapters.
        let lm = engine.model();
        table.retain(|t| t.method.info().adapter.is_none_or(|a| a.loaded(lm)));
    }
    let (lengths, depths) = (args.lengths.concat(), args.depths.concat());
    crate::ensure_usage!(
        !lengths.is_empty() && !depths.is_empty() && args.per_cell > 0,
        "no cases: give --lengths, --depths, --per-cell"
    );
    let cases = niah_cases(&engine.model().tokenizer, args.seed, &lengths, &depths, args.per_cell);
    let mut rows: Vec<Row> = table
        .iter()
        .map(|m| Row {
            label: m.to_string(),
            correct: 0,
            ttft_ms: vec![],
            selected: 0,
            needle_cov: 0.0,
            answer_cov: 0.0,
        })
        .collect();
    if let Some(dir) = &args.dump_cases {
        dump(&cases, dir)?;
    }
    eprintln!("{} cases x {} methods", cases.len(), table.len());
    let mut progress = crate::progress::Progress::new(cases.len(), "cases");
    for case in &cases {
        // `check` keeps its plain prompts (its figures in docs/results.md were made with them).
        let req = case.request(flowprefill_lab::tasks::PromptStyle::Plain);
        let needle_rows = case.needle_rows(&engine.model().tokenizer);
        for (row, spec) in rows.iter_mut().zip(table.iter()) {
            if !args.warm {
                engine.store().clear();
            }
            let opts = scoring.apply(RunOptions { max_new_tokens: 32, evict, ..spec.options(args.ratio) });
            let r = engine.run(&req, &opts, &mut |_| true)?;
            if let Some((doc, needle, Some(answer))) = needle_rows.first() {
                let sel = &r.selected_rows[*doc];
                let cov = |rg: &std::ops::Range<usize>| {
                    sel.iter().filter(|x| rg.contains(x)).count() as f64 / rg.len().max(1) as f64
                };
                row.needle_cov += cov(needle);
                row.answer_cov += cov(answer);
            }
            row.correct += case.is_correct(&r.answer) as usize;
            if args.verbose {
                progress.println(&format!("  {:<18} {:>5} {:?}", row.label, case.is_correct(&r.answer), r.answer));
            }
            row.ttft_ms.push(r.ttft.as_secs_f64() * 1e3);
            row.selected += r.n_selected();
        }
        engine.store().clear();
        progress.inc(&case.id);
    }
    report(&args, &rows, cases.len(), &lengths, &depths)
}

/// The table (or with --json one object) of accuracy, TTFT and selection per method.
fn report(args: &Args, rows: &[Row], cases: usize, lengths: &[usize], depths: &[f64]) -> Result<()> {
    let n = cases as f64;
    let median = |v: &[f64]| {
        let mut s = v.to_vec();
        s.sort_by(|a, b| a.total_cmp(b));
        s[s.len() / 2]
    };
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
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "ratio": args.ratio, "lengths": lengths, "depths": depths, "per_cell": args.per_cell,
                "seed": args.seed, "warm": args.warm, "results": out,
            }))?
        );
        return Ok(());
    }
    println!(
        "needle in a haystack: {} cases (lengths {:?}, depths {:?}, {} per cell, seed {}), ratio {}, {} chunk caches",
        cases,
        lengths,
        depths,
        args.per_cell,
        args.seed,
        args.ratio,
        if args.warm { "warm" } else { "cold" }
    );
    println!(
        "{:<18} {:>9} {:>9} {:>14} {:>8} {:>9} {:>10} {:>10}",
        "method", "accuracy", "vs full", "median TTFT ms", "speedup", "selected", "needle sel", "answer sel"
    );
    for r in rows {
        let acc = r.correct as f64 / n;
        let ttft = median(&r.ttft_ms);
        println!(
            "{:<18} {:>8.1}% {:>8.1}% {:>14.1} {:>7.2}x {:>9.0} {:>9.0}% {:>9.0}%",
            r.label,
            100.0 * acc,
            if full_acc > 0.0 { 100.0 * acc / full_acc } else { f64::NAN },
            ttft,
            full_ttft / ttft,
            r.selected as f64 / n,
            100.0 * r.needle_cov / n,
            100.0 * r.answer_cov / n
        );
    }
    Ok(())
}
