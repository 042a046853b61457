//! `flowprefill importance`: how well SnapKV's observation window, and LookaheadKV's trained
//! rows when the model has an adapter, predict the attention the model's own answer pays the
//! context, per (layer, KV head), at KV budgets (`flowprefill_lab::train::lookahead`).

use crate::progress::Progress;
use crate::Common;
use anyhow::{Context as _, Result};
use flowprefill_lab::importance::{measure, table, write, Plan};
use flowprefill_lab::tasks::all_tasks;
use flowprefill_lab::PARTIAL;
use flowprefill_worker::{Cpu, LoadedModel};
use std::path::PathBuf;

/// Held-back cases start here (the lab's).
pub use flowprefill_lab::importance::HELD_BACK_SEED;

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
    flowprefill_lab::tasks::check_lengths(&lengths)?;
    crate::ensure_usage!(budgets.iter().all(|&b| b > 0), "--budgets: every budget keeps at least one entry");
    crate::ensure_usage!(a.samples > 0 && a.max_tokens > 0, "--samples and --max-tokens must be at least 1");
    flowprefill_lab::each_once("--tasks", "task", &tasks)?;
    flowprefill_lab::each_once("--lengths", "length", &lengths)?;
    flowprefill_lab::each_once("--budgets", "budget", &budgets)?;
    super::check_case_lengths(common, "--lengths", &lengths)?;
    if let Some(dir) = &a.out {
        super::out_dir("--out", dir)?;
        refuse_partial(dir)?;
    }
    let path = super::model_path(common)?;
    let mut lm = LoadedModel::load(&path, Cpu).with_context(|| format!("loading {}", path.display()))?;
    super::attach_lookahead(&mut lm, common)?;
    match lm.model.lookahead_hash() {
        Some(h) => crate::say!("LookaheadKV adapter {h}: its rows are scored beside SnapKV"),
        None => {
            crate::say!("no LookaheadKV adapter for this model: SnapKV alone (train one: flowprefill train lookahead)")
        }
    }
    let plan = Plan {
        tasks: &tasks,
        lengths: &lengths,
        samples: a.samples,
        budgets: &budgets,
        seed: a.seed,
        max_tokens: a.max_tokens,
    };
    let planned = tasks.len() * lengths.len() * a.samples;
    let mut progress = Progress::new(planned, "cases");
    let asked = crate::progress::stop_on_signal("the case in progress");
    let mut replacing = false;
    // The rows after every case: a long run stopped part way keeps what it measured.
    let outcome = measure(
        &lm,
        &plan,
        &mut |c, rows| {
            progress.inc(c);
            let Some(dir) = &a.out else { return Ok(()) };
            if !replacing {
                // An earlier, finished run's table goes as this run's rows replace its own: a
                // run then killed leaves its rows without a table, which the next run refuses
                // to write over; one that ends before its first rows leaves the earlier files.
                flowprefill_lab::importance::forget_table(dir)?;
                replacing = true;
            }
            flowprefill_lab::importance::write_rows(dir, rows)
        },
        &|| asked.is_set(),
    );
    drop(progress);
    let (rows, done) = (&outcome.rows, outcome.done);
    if done > 0 {
        let mut md = table(rows, &tasks, &lengths, &budgets, &super::model_label(common)?);
        if let Some(stop) = &outcome.stopped {
            md = format!("{}\n\n{md}", stop.headline(done, planned));
        }
        println!("{md}");
        if let Some(dir) = &a.out {
            write(dir, &md, rows)?;
        }
    }
    outcome.stopped.map_or(Ok(()), |s| Err(crate::progress::stopped(s, done, planned, "cases", done > 0)))
}

/// Refuses an `--out` that holds the rows of a run that stopped before its end (its
/// `importance.md` says so, or is missing beside `importance.json`): this run would write over
/// them from its first case. A finished run's files are replaced, as every `--out` is.
fn refuse_partial(dir: &std::path::Path) -> Result<()> {
    let (json, md) = (dir.join("importance.json"), dir.join("importance.md"));
    let stopped = json.is_file() && std::fs::read_to_string(&md).map_or(true, |text| text.starts_with(PARTIAL));
    crate::ensure_usage!(
        !stopped,
        "--out {} holds the rows of a run that stopped before its end ({}): pass another --out, or move them away \
         to measure there again",
        dir.display(),
        if md.is_file() { "importance.md says PARTIAL" } else { "importance.json without importance.md" }
    );
    Ok(())
}
