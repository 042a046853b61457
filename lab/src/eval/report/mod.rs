//! The report of `flowprefill eval`: markdown tables (per task at the table ratio, and the
//! ratio sweep over the cases that have every ratio) and PNG plots, from the scored runs.

use super::Record;
use crate::error::io;
use crate::plot;
use crate::Result;
use flowprefill_coordinator::{Method, MethodSpec};
use std::collections::HashSet;
use std::path::{Path, PathBuf};

mod budgets;
mod charts;
mod gate;
mod paired;

pub use charts::plots;
use paired::{conditional_retention, infoflow_against_others, mean_score_retention};

/// Full prefill, the baseline every retention is measured against.
const FULL: MethodSpec = MethodSpec::new(Method::Full);
/// InfoFlow, compared case by case with every other method.
const INFOFLOW: MethodSpec = MethodSpec::new(Method::Infoflow);

fn mean(v: impl Iterator<Item = f64>) -> Option<f64> {
    let (s, n) = v.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    (n > 0).then(|| s / n as f64)
}

/// Whether a record belongs to `method` at `ratio` (ratio-free methods match any ratio).
fn at(r: &Record, method: &MethodSpec, ratio: f64) -> bool {
    r.method == *method && r.ratio.is_none_or(|x| (x - ratio).abs() < 1e-9)
}

fn pct(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{:.1}", 100.0 * v))
}

/// A percentage without decimals (the ratio-sweep cells list five of them).
fn pct0(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{:.0}", 100.0 * v))
}

/// A markdown table's header row (`first`, then one right-aligned column per entry) and its
/// separator row.
fn table_head(md: &mut String, first: &str, cols: &[impl std::fmt::Display]) {
    md.push_str(&format!("| {first} |"));
    for c in cols {
        md.push_str(&format!(" {c} |"));
    }
    md.push_str("\n|---|");
    md.push_str(&"---:|".repeat(cols.len()));
    md.push('\n');
}

/// Full-prefill accuracy below which a task is left out of the mean retention.
const RETENTION_FLOOR: f64 = 0.2;

/// A method's accuracy over full prefill's on the same cases (`None` where either is missing or
/// full prefill scores 0), and whether it enters the mean retention: a task full prefill rarely
/// solves says nothing about retention, so it is shown but left out of the mean.
fn retention(v: Option<f64>, full: Option<f64>) -> (Option<f64>, bool) {
    match (v, full) {
        (Some(v), Some(f)) if f > 0.0 => (Some(v / f), f >= RETENTION_FLOOR),
        _ => (None, false),
    }
}

/// Tasks that are needle-in-a-haystack retrieval (the paper's retention target is on these).
fn is_niah(task: &str) -> bool {
    task.starts_with("niah_")
}

/// The markdown report (deterministic: accuracy only, no timings). `settings` lists the
/// non-default settings (ablations, prompts, numerics, verification), if any.
#[allow(clippy::too_many_arguments)]
pub fn summarize(
    records: &[Record],
    tasks: &[String],
    lengths: &[usize],
    labels: &[MethodSpec],
    ratios: &[f64],
    tr: f64,
    settings: &[String],
) -> String {
    let mut md = String::new();
    let n_cases = records.iter().map(|r| (&r.task, r.length, r.sample)).collect::<HashSet<_>>().len();
    md.push_str(&format!(
        "# flowprefill eval\n\n{n_cases} cases; lengths {lengths:?}; ratios {ratios:?}; scores in %.\n\n"
    ));
    if !settings.is_empty() {
        md.push_str(&format!("Settings: {}.\n\n", settings.join("; ")));
    }
    for &len in lengths {
        accuracy_tables(&mut md, records, tasks, len, labels, tr);
        mean_score_retention(&mut md, records, len, labels, tr);
        conditional_retention(&mut md, records, len, labels, tr);
        infoflow_against_others(&mut md, records, len, labels, tr);
    }
    // A budget by coverage has no ratio: it is compared in its own table below.
    let ratio_labels: Vec<MethodSpec> = labels.iter().filter(|l| l.coverage.is_none()).copied().collect();
    for &len in lengths {
        sweep_tables(&mut md, records, tasks, len, &ratio_labels, ratios);
    }
    qa_table(&mut md, records, lengths, labels, tr);
    diagnostics(&mut md, records, labels, tr);
    gate::gate_tables(&mut md, records, lengths, labels);
    budgets::budget_tables(&mut md, records, lengths);
    md
}

/// The accuracy table at the table ratio for one length, and retention per task.
fn accuracy_tables(md: &mut String, records: &[Record], tasks: &[String], len: usize, labels: &[MethodSpec], tr: f64) {
    // Per task and method: the mean score at the table ratio (both tables below use it).
    let acc: Vec<Vec<Option<f64>>> = tasks
        .iter()
        .map(|t| {
            labels
                .iter()
                .map(|l| {
                    mean(records.iter().filter(|r| &r.task == t && r.length == len && at(r, l, tr)).map(|r| r.score))
                })
                .collect()
        })
        .collect();
    md.push_str(&format!("## Accuracy at ratio {tr} ({len} tokens)\n\n"));
    table_head(md, "task", labels);
    let mut col_means: Vec<Vec<f64>> = vec![Vec::new(); labels.len()];
    for (t, row) in tasks.iter().zip(&acc) {
        md.push_str(&format!("| {t} |"));
        for (i, &v) in row.iter().enumerate() {
            if let Some(v) = v {
                col_means[i].push(v);
            }
            md.push_str(&format!(" {} |", pct(v)));
        }
        md.push('\n');
    }
    md.push_str("| **mean** |");
    for c in &col_means {
        md.push_str(&format!(" **{}** |", pct(mean(c.iter().copied()))));
    }
    md.push_str("\n\n");
    // Retention: method / full, per task, then the mean of the per-task retentions.
    md.push_str(&format!(
        "Retention per task (the method's mean score / full prefill's, per task; the mean over tasks) at ratio \
         {tr}, {len} tokens:\n\n"
    ));
    table_head(md, "task", labels);
    let mut ret_cols: Vec<Vec<f64>> = vec![Vec::new(); labels.len()];
    for (t, row) in tasks.iter().zip(&acc) {
        let full =
            mean(records.iter().filter(|r| &r.task == t && r.length == len && r.method == FULL).map(|r| r.score));
        md.push_str(&format!("| {t} |"));
        for (i, &v) in row.iter().enumerate() {
            let (ret, in_mean) = retention(v, full);
            if let (Some(x), true) = (ret, in_mean) {
                ret_cols[i].push(x);
            }
            md.push_str(&format!(" {} |", pct(ret)));
        }
        md.push('\n');
    }
    md.push_str("| **mean** |");
    for c in &ret_cols {
        md.push_str(&format!(" **{}** |", pct(mean(c.iter().copied()))));
    }
    md.push_str(&format!(
        "\n\nThe mean leaves out tasks where full prefill scores below {:.0}%.\n\n",
        100.0 * RETENTION_FLOOR
    ));
}

/// QA (token F1 / exact match) per length; left out when no QA task ran.
fn qa_table(md: &mut String, records: &[Record], lengths: &[usize], labels: &[MethodSpec], tr: f64) {
    if records.iter().any(|r| r.f1.is_some()) {
        md.push_str(&format!("## Multi-document QA at ratio {tr}: token F1 / exact match\n\n| method |"));
        for &len in lengths {
            md.push_str(&format!(" F1 {len} | EM {len} |"));
        }
        md.push_str(&format!("\n|---|{}\n", "---:|".repeat(2 * lengths.len())));
        for l in labels {
            md.push_str(&format!("| {l} |"));
            for &len in lengths {
                let qa: Vec<&Record> =
                    records.iter().filter(|r| r.f1.is_some() && r.length == len && at(r, l, tr)).collect();
                let f1 = mean(qa.iter().filter_map(|r| r.f1));
                let em = mean(qa.iter().filter_map(|r| r.em.map(|e| e as u8 as f64)));
                md.push_str(&format!(" {} | {} |", pct(f1), pct(em)));
            }
            md.push('\n');
        }
        md.push('\n');
    }
}

/// Selection diagnostics at the table ratio: needle and answer tokens recomputed, the distance
/// of the farthest answer-bearing chunk from the prompt, answers cut at the token budget.
fn diagnostics(md: &mut String, records: &[Record], labels: &[MethodSpec], tr: f64) {
    md.push_str(&format!(
        "## Selection diagnostics at ratio {tr} (all lengths)\n\nShare of needle-sentence and answer tokens recomputed; mean distance of the \
         farthest answer-bearing chunk from the prompt (0 = nearest) in the final layout (the answer needs every one: both \
         hops of a two-hop question, each value of a multi-value task); answers that ran to the token budget (of the runs that \
         recorded it).\n\n| method | needle tokens | answer tokens | chunk distance | at budget |\n|---|---:|---:|---:|---:|\n"
    ));
    for l in labels {
        let rs: Vec<&Record> = records.iter().filter(|r| at(r, l, tr)).collect();
        let dist = mean(rs.iter().filter_map(|r| r.needle_chunk_rank.map(|x| x as f64)));
        let known: Vec<bool> = rs.iter().filter_map(|r| r.hit_budget).collect();
        let cut = if known.is_empty() {
            "-".to_string()
        } else {
            format!("{}/{}", known.iter().filter(|&&b| b).count(), known.len())
        };
        md.push_str(&format!(
            "| {l} | {} | {} | {} | {cut} |\n",
            pct(mean(rs.iter().map(|r| r.needle_selected))),
            pct(mean(rs.iter().map(|r| r.answer_selected))),
            dist.map_or("-".into(), |d| format!("{d:.2}"))
        ));
    }
    // What `auto` ran, per length: its runs are the chosen methods' runs.
    let mut ran: std::collections::BTreeMap<(usize, &str), usize> = std::collections::BTreeMap::new();
    for r in records {
        if let Some(label) = &r.ran {
            *ran.entry((r.length, label.as_str())).or_default() += 1;
        }
    }
    if !ran.is_empty() {
        md.push_str("\nWhat `auto` ran: ");
        let parts: Vec<String> = ran.iter().map(|((len, label), n)| format!("{label} {n}x at {len}")).collect();
        md.push_str(&parts.join(", "));
        md.push_str(".\n");
    }
}

/// A case: task and sample at one length.
type Case<'a> = (&'a str, usize);

/// The cases at `len` that have a run of every label at every ratio in `rs` (a ratio-free label:
/// its one run), so that means at different ratios compare the same cases. A sweep that is
/// still running (or was stopped) has more cases at some ratios than at others.
fn complete_cases<'a>(records: &'a [Record], len: usize, labels: &[MethodSpec], rs: &[f64]) -> HashSet<Case<'a>> {
    let mut runs: std::collections::HashMap<Case<'a>, Vec<&Record>> = std::collections::HashMap::new();
    for r in records.iter().filter(|r| r.length == len) {
        runs.entry((r.task.as_str(), r.sample)).or_default().push(r);
    }
    runs.into_iter()
        .filter(|(_, rs_)| labels.iter().all(|l| rs.iter().all(|&x| rs_.iter().any(|r| at(r, l, x)))))
        .map(|(c, _)| c)
        .collect()
}

/// Whether a label's runs at `len` carry no ratio (full, none, star).
fn ratio_free(records: &[Record], len: usize, label: &MethodSpec) -> bool {
    records.iter().filter(|r| r.length == len && r.method == *label).all(|r| r.ratio.is_none())
}

/// The ratio sweep at one length: accuracy by ratio, and retention by ratio per task, over the
/// cases that have every method at every ratio.
fn sweep_tables(
    md: &mut String,
    records: &[Record],
    tasks: &[String],
    len: usize,
    labels: &[MethodSpec],
    ratios: &[f64],
) {
    if ratios.len() < 2 {
        return;
    }
    let cases = complete_cases(records, len, labels, ratios);
    if cases.is_empty() {
        md.push_str(&format!("No case at {len} tokens has every method at every ratio yet: no ratio sweep table.\n\n"));
        return;
    }
    let in_sweep = |r: &&Record| r.length == len && cases.contains(&(r.task.as_str(), r.sample));
    let present: Vec<&String> = tasks.iter().filter(|t| cases.iter().any(|c| c.0 == t.as_str())).collect();
    // Per task, label and ratio: the mean score over the sweep's cases (both tables below use it).
    let acc: Vec<Vec<Vec<Option<f64>>>> = present
        .iter()
        .map(|t| {
            labels
                .iter()
                .map(|l| {
                    ratios
                        .iter()
                        .map(|&x| {
                            mean(
                                records
                                    .iter()
                                    .filter(in_sweep)
                                    .filter(|r| &r.task == *t && at(r, l, x))
                                    .map(|r| r.score),
                            )
                        })
                        .collect()
                })
                .collect()
        })
        .collect();
    let counts: Vec<String> =
        present.iter().map(|t| format!("{t} {}", cases.iter().filter(|c| c.0 == t.as_str()).count())).collect();
    md.push_str(&format!(
        "## Accuracy by ratio ({len} tokens)\n\nOver the {} cases that have every method at every ratio ({}); \
         mean over tasks of the task means.\n\n",
        cases.len(),
        counts.join(", ")
    ));
    table_head(md, "method", ratios);
    for (li, l) in labels.iter().enumerate() {
        md.push_str(&format!("| {l} |"));
        for xi in 0..ratios.len() {
            md.push_str(&format!(" {} |", pct(mean(acc.iter().filter_map(|task| task[li][xi])))));
        }
        md.push('\n');
    }
    sweep_retention(md, records, &present, &acc, len, labels, ratios);
}

/// The sweep's retention table: per task, each method's mean over full prefill's at every
/// ratio (one cell for a ratio-free method), over the same cases as the accuracy table.
/// `acc[task][label][ratio]` is the mean score of `present[task]`.
fn sweep_retention(
    md: &mut String,
    records: &[Record],
    present: &[&String],
    acc: &[Vec<Vec<Option<f64>>>],
    len: usize,
    labels: &[MethodSpec],
    ratios: &[f64],
) {
    // The labels of the retention table (all but full), by index into `labels`, and how many
    // ratio cells each shows (one for a ratio-free label).
    let shown: Vec<usize> = (0..labels.len()).filter(|&li| labels[li] != FULL).collect();
    let n_cells: Vec<usize> =
        shown.iter().map(|&li| if ratio_free(records, len, &labels[li]) { 1 } else { ratios.len() }).collect();
    let ratio_list: Vec<String> = ratios.iter().map(|r| r.to_string()).collect();
    md.push_str(&format!(
        "\nRetention (method / full, %) by ratio, {len} tokens, same cases; each cell lists ratios {}:\n\n",
        ratio_list.join(" / ")
    ));
    let shown_names: Vec<&MethodSpec> = shown.iter().map(|&li| &labels[li]).collect();
    table_head(md, "task", &shown_names);
    let mut ret_means: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); ratios.len()]; shown.len()];
    // Full prefill is ratio-free: its mean is the same in every ratio column of `acc`.
    let full_li = labels.iter().position(|l| *l == FULL);
    for (t, task) in present.iter().zip(acc) {
        let full = full_li.and_then(|fi| task[fi][0]);
        md.push_str(&format!("| {t} |"));
        for (i, &li) in shown.iter().enumerate() {
            let cells: Vec<String> = (0..n_cells[i])
                .map(|j| {
                    let (ret, in_mean) = retention(task[li][j], full);
                    if let (Some(v), true) = (ret, in_mean) {
                        ret_means[i][j].push(v);
                    }
                    pct0(ret)
                })
                .collect();
            md.push_str(&format!(" {} |", cells.join(" / ")));
        }
        md.push('\n');
    }
    md.push_str("| **mean** |");
    for (i, means) in ret_means.iter().enumerate() {
        let cells: Vec<String> = means.iter().take(n_cells[i]).map(|v| pct0(mean(v.iter().copied()))).collect();
        md.push_str(&format!(" **{}** |", cells.join(" / ")));
    }
    md.push_str(&format!(
        "\n\nThe mean leaves out tasks where full prefill scores below {:.0}% on these cases.\n\n",
        100.0 * RETENTION_FLOOR
    ));
}

#[cfg(test)]
mod tests {
    use super::paired::*;
    use super::*;

    fn rec(task: &str, sample: usize, method: &str, ratio: Option<f64>, score: f64) -> Record {
        Record {
            task: task.into(),
            length: 100,
            sample,
            depth: 0.5,
            method: method.parse().unwrap(),
            ratio,
            score,
            em: None,
            f1: None,
            ttft_ms: 1.0,
            selected: 0,
            context_tokens: 100,
            needle_selected: 0.0,
            answer_selected: 0.0,
            needle_chunk_rank: None,
            answer: String::new(),
            max_new_tokens: None,
            hit_budget: None,
            adapter: None,
            evict_adapter: None,
            verified: None,
            ran: None,
            build: None,
        }
    }

    #[test]
    fn the_sign_test_matches_the_binomial() {
        assert_eq!(sign_test(0, 0), 1.0);
        assert!((sign_test(0, 2) - 0.5).abs() < 1e-12);
        assert!((sign_test(3, 3) - 1.0).abs() < 1e-12);
        // 10 against 2: 2 x (1 + 12 + 66) / 4096.
        assert!((sign_test(10, 2) - 2.0 * 79.0 / 4096.0).abs() < 1e-12);
        assert!((sign_test(2, 10) - sign_test(10, 2)).abs() < 1e-15);
        // 0 against 6: 2 / 64.
        assert!((sign_test(0, 6) - 2.0 / 64.0).abs() < 1e-12);
    }

    /// Coverage rows beside the fixed ratios on the cases every budget ran (sample 1 lacks the
    /// coverage run and is left out), with the fixed ratios' retention interpolated at the share
    /// the coverage recomputed.
    #[test]
    fn coverage_budgets_compare_with_fixed_ratios_at_the_same_share() {
        let t = "niah_single";
        let with_sel = |mut r: Record, selected: usize| {
            r.selected = selected;
            r
        };
        let mut records = Vec::new();
        for sample in 0..2 {
            records.push(rec(t, sample, "full", None, 1.0));
            records.push(with_sel(rec(t, sample, "infoflow", Some(0.1), 0.5), 10));
            records.push(with_sel(rec(t, sample, "infoflow", Some(0.3), 1.0), 30));
        }
        records.push(with_sel(rec(t, 0, "infoflow~0.8", None, 1.0), 20));
        let mut md = String::new();
        budgets::budget_tables(&mut md, &records, &[100]);
        assert!(md.contains("same 1 cases"), "{md}");
        // Fixed: 50% at 10% recomputed, 100% at 30%: 75% at the coverage's 20%.
        assert!(md.contains("| infoflow~0.8 | 20.0 | 100.0 | 100.0 [100.0, 100.0] | 75.0 | 1/1 |"), "{md}");
        assert!(md.contains("| infoflow@0.1 | 10.0 | 50.0 |"), "{md}");
        let mut none = String::new();
        budgets::budget_tables(&mut none, &records[..6], &[100]);
        assert!(none.is_empty(), "no coverage runs, no table: {none}");
    }

    /// A sweep stopped half-way: sample 0 has both ratios, sample 1 only the table ratio. The
    /// table at 0.15 uses both samples; the by-ratio tables use sample 0 only, so that the two
    /// ratios compare the same cases.
    #[test]
    fn ratio_tables_compare_the_same_cases() {
        let t = "niah_single";
        let records = vec![
            rec(t, 0, "full", None, 1.0),
            rec(t, 0, "infoflow", Some(0.15), 0.5),
            rec(t, 0, "infoflow", Some(0.3), 1.0),
            rec(t, 1, "full", None, 1.0),
            rec(t, 1, "infoflow", Some(0.15), 0.0),
        ];
        let labels = vec![FULL, INFOFLOW];
        let tasks = vec![t.to_string()];
        let complete = complete_cases(&records, 100, &labels, &[0.15, 0.3]);
        assert_eq!(complete, HashSet::from([(t, 0)]));
        assert_eq!(complete_cases(&records, 100, &labels, &[0.15]).len(), 2);
        let md = summarize(&records, &tasks, &[100], &labels, &[0.15, 0.3], 0.15, &[]);
        // Per-task table at 0.15: both samples, (0.5 + 0.0) / 2.
        assert!(md.contains("| niah_single | 100.0 | 25.0 |"), "{md}");
        // By ratio: sample 0 only.
        assert!(md.contains("Over the 1 cases that have every method at every ratio (niah_single 1)"), "{md}");
        assert!(md.contains("| infoflow | 50.0 | 100.0 |"), "{md}");
        assert!(md.contains("| niah_single | 50 / 100 |"), "{md}");
        // Conditional retention: full solves both samples; infoflow solves neither fully.
        assert!(md.contains("| infoflow | 0.0 (0/2) | 0.0 (0/2) | 0 / 2 | 0.500 |"), "{md}");
        // Without any complete case the sweep table says so instead of mixing cases.
        let md = summarize(&records[3..], &tasks, &[100], &labels, &[0.15, 0.3], 0.15, &[]);
        assert!(md.contains("No case at 100 tokens has every method at every ratio yet"), "{md}");
    }

    #[test]
    fn the_report_says_what_auto_ran() {
        let t = "niah_single";
        let auto = |sample, ran: &str| Record { ran: Some(ran.into()), ..rec(t, sample, "auto", None, 1.0) };
        let records = vec![rec(t, 0, "full", None, 1.0), auto(0, "full"), auto(1, "infoflow@0.15"), auto(2, "full")];
        let labels: Vec<MethodSpec> = vec![FULL, "auto".parse().unwrap()];
        let md = summarize(&records, &[t.to_string()], &[100], &labels, &[0.15], 0.15, &[]);
        assert!(md.contains("What `auto` ran: full 2x at 100, infoflow@0.15 1x at 100."), "{md}");
        let plain = summarize(&records[..1], &[t.to_string()], &[100], &labels, &[0.15], 0.15, &[]);
        assert!(!plain.contains("What `auto` ran"), "{plain}");
    }

    /// The paper's retention: sums of paired scores, an interval that holds the point estimate,
    /// none for identical pairs, the same numbers on every call.
    #[test]
    fn mean_score_retention_is_a_ratio_of_sums_with_a_bootstrap_interval() {
        assert_eq!(ratio_with_interval(&[]), None);
        assert_eq!(ratio_with_interval(&[(1.0, 0.0)]), None);
        let same = ratio_with_interval(&[(0.5, 1.0); 8]).unwrap();
        assert_eq!(same, (0.5, 0.5, 0.5));
        let pairs: Vec<(f64, f64)> = (0..20).map(|i| (if i % 4 == 0 { 0.75 } else { 1.0 }, 1.0)).collect();
        let (r, lo, hi) = ratio_with_interval(&pairs).unwrap();
        assert!((r - 0.9375).abs() < 1e-12, "{r}");
        assert!(lo < r && r < hi && hi <= 1.0 && lo > 0.75, "{lo} {r} {hi}");
        assert_eq!(ratio_with_interval(&pairs), Some((r, lo, hi)));
        // In the report: per family and over all tasks, partial credit counted.
        let mut records = Vec::new();
        for s in 0..4 {
            records.push(rec("niah_multivalue", s, "full", None, 1.0));
            records.push(rec("niah_multivalue", s, "infoflow", Some(0.15), 0.75));
        }
        records.push(rec("variable_tracking", 0, "full", None, 0.5));
        records.push(rec("variable_tracking", 0, "infoflow", Some(0.15), 0.5));
        let labels = [FULL, INFOFLOW];
        let tasks = vec!["niah_multivalue".to_string(), "variable_tracking".to_string()];
        let md = summarize(&records, &tasks, &[100], &labels, &[0.15], 0.15, &[]);
        assert!(md.contains("| method | NIAH | variable tracking | all tasks |"), "{md}");
        // NIAH 3 / 4; all tasks (3 + 0.5) / (4 + 0.5).
        assert!(md.contains("| infoflow | 75.0 [75.0, 75.0] (4) | 100.0 [100.0, 100.0] (1) | 77.8 ["), "{md}");
        // The strict metric beside it: no case kept.
        assert!(md.contains("Strict per-case retention"), "{md}");
    }

    /// InfoFlow against the other methods per task family: wins and losses come from the
    /// paired cases of each family only, and a family no task of which ran has no column.
    #[test]
    fn infoflow_is_compared_per_task_family() {
        let mut records = Vec::new();
        for s in 0..3 {
            records.push(rec("niah_multikey", s, "full", None, 1.0));
            records.push(rec("niah_multikey", s, "infoflow", Some(0.15), 1.0));
            records.push(rec("niah_multikey", s, "epic", Some(0.15), 0.0));
        }
        records.push(rec("variable_tracking", 0, "full", None, 1.0));
        records.push(rec("variable_tracking", 0, "infoflow", Some(0.15), 0.25));
        records.push(rec("variable_tracking", 0, "epic", Some(0.15), 0.75));
        // An epic run without its infoflow pair is not counted.
        records.push(rec("variable_tracking", 1, "epic", Some(0.15), 1.0));
        let labels: Vec<MethodSpec> = ["full", "infoflow", "epic"].iter().map(|s| s.parse().unwrap()).collect();
        let tasks = vec!["niah_multikey".to_string(), "variable_tracking".to_string()];
        let md = summarize(&records, &tasks, &[100], &labels, &[0.15], 0.15, &[]);
        assert!(md.contains("| method | NIAH | variable tracking |\n"), "{md}");
        assert!(md.contains("| epic | 3 / 0, p = 0.250 | 0 / 1, p = 1.000 |"), "{md}");
        assert!(!md.contains("| QA |"), "{md}");
    }
}
