//! `flowprefill check`: needle-in-a-haystack accuracy and TTFT of every method.

use crate::Common;
use anyhow::Result;
use flowprefill_lab::check::{self, Report, Tick};
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
    #[arg(long, default_value_t = flowprefill_lab::tasks::CHECK_SEED)]
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

/// Runs the command.
pub fn run(common: &Common, args: Args) -> Result<()> {
    // Parsed once, before the model loads, so a bad flag fails fast.
    let scoring = args.scoring.parse()?;
    let evict = args.evict.parse()?;
    flowprefill_coordinator::request::check_ratio(args.ratio).map_err(|e| crate::exit::usage(e.to_string()))?;
    let mut settings = scoring.non_default();
    if let Some(e) = evict {
        settings.push(("evict", serde_json::json!(e.policy.to_string())));
        settings.push(("kv_budget", serde_json::json!(e.budget)));
    }
    let model = super::model_label(common)?;
    let mut table = super::demo::table(args.methods.as_deref())?;
    let (lengths, depths) = (args.lengths.concat(), args.depths.concat());
    crate::ensure_usage!(
        !lengths.is_empty() && !depths.is_empty() && args.per_cell > 0,
        "no cases: give --lengths, --depths, --per-cell"
    );
    flowprefill_lab::tasks::check_lengths(&lengths)?;
    flowprefill_lab::tasks::check_depths(&depths)?;
    flowprefill_lab::tasks::check_cells(&lengths, &depths)?;
    if let Some(dir) = &args.dump_cases {
        super::out_dir("--dump-cases", dir)?;
    }
    let engine = super::run::cold_engine(common, "check")?;
    if args.methods.is_none() {
        // The default table has KV Packet and lookahead only where the model has their adapters.
        let lm = engine.model();
        table.retain(|t| t.method.info().adapter.is_none_or(|a| a.loaded(lm)));
    }
    let cases = niah_cases(&engine.model().tokenizer, args.seed, &lengths, &depths, args.per_cell);
    if let Some(dir) = &args.dump_cases {
        check::dump(&cases, dir)?;
        crate::say!("wrote {} cases under {}", cases.len(), dir.display());
    }
    crate::say!("{} cases x {} methods", cases.len(), table.len());
    let mut progress = crate::progress::Progress::new(cases.len(), "cases");
    let how = check::Runs { ratio: args.ratio, scoring, evict, warm: args.warm };
    let asked = crate::progress::stop_on_signal("the case in progress");
    let outcome = check::run(
        &engine,
        &table,
        &cases,
        how,
        &mut |t| match t {
            Tick::Answer(line) if args.verbose => progress.println(line),
            Tick::Answer(_) => {}
            Tick::Case(id) => progress.inc(id),
        },
        &|| asked.is_set(),
    );
    drop(progress);
    let (lengths, depths) = (&lengths, &depths);
    let (ratio, per_cell, seed, warm, json) = (args.ratio, args.per_cell, args.seed, args.warm, args.json);
    let (planned, done) = (cases.len(), outcome.done);
    let stopped = outcome.stopped.as_ref();
    let report =
        Report { ratio, lengths, depths, per_cell, seed, warm, json, model: &model, settings, planned, stopped };
    // The cases that finished are printed whatever stopped the rest.
    if done > 0 {
        print!("{}", check::report(&report, &outcome.rows, done)?);
    }
    outcome.stopped.map_or(Ok(()), |s| Err(crate::progress::stopped(s, done, planned, "cases", done > 0)))
}
