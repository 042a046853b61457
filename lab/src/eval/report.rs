//! The report of `flowprefill eval`: markdown tables (per task at the table ratio, and the
//! ratio sweep over the cases that have every ratio) and PNG plots, from the scored runs.

use super::Record;
use crate::error::io;
use crate::plot;
use crate::Result;
use flowprefill_coordinator::{Method, MethodSpec};
use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// Full prefill, the baseline every retention is measured against.
const FULL: MethodSpec = MethodSpec { method: Method::Full, reorder: false, ratio: None };
/// InfoFlow, compared case by case with every other method.
const INFOFLOW: MethodSpec = MethodSpec { method: Method::Infoflow, reorder: false, ratio: None };

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

/// Two-sided exact sign test: the probability of a split at least as uneven as `wins` against
/// `losses` when either side is equally likely (ties are left out before calling).
fn sign_test(wins: usize, losses: usize) -> f64 {
    let n = wins + losses;
    if n == 0 {
        return 1.0;
    }
    let k = wins.min(losses);
    // P(X <= k) for X ~ Binomial(n, 1/2), through log binomial coefficients.
    let ln_fact = |m: usize| (1..=m).map(|i| (i as f64).ln()).sum::<f64>();
    let ln_n = ln_fact(n);
    let tail: f64 = (0..=k).map(|i| (ln_n - ln_fact(i) - ln_fact(n - i) - n as f64 * 2f64.ln()).exp()).sum();
    (2.0 * tail).min(1.0)
}

/// Tasks that are needle-in-a-haystack retrieval (the paper's retention target is on these).
fn is_niah(task: &str) -> bool {
    task.starts_with("niah_")
}

/// One method's score per case (task, sample) at `len` tokens and ratio `tr`: the side of a
/// paired comparison.
fn scores_by_case<'a>(
    records: &'a [Record],
    len: usize,
    method: &MethodSpec,
    tr: f64,
) -> std::collections::HashMap<(&'a str, usize), f64> {
    records
        .iter()
        .filter(|r| r.length == len && at(r, method, tr))
        .map(|r| ((r.task.as_str(), r.sample), r.score))
        .collect()
}

/// Conditional retention against full prefill on the same cases at ratio `tr`: of the cases
/// full prefill answers fully, the share the method answers fully too (NIAH tasks and all
/// tasks), and a paired sign test against full prefill over every case both ran.
fn conditional_retention(md: &mut String, records: &[Record], len: usize, labels: &[MethodSpec], tr: f64) {
    let full = scores_by_case(records, len, &FULL, tr);
    if full.is_empty() {
        return;
    }
    md.push_str(&format!(
        "Strict per-case retention at ratio {tr}, {len} tokens: of the cases full prefill answers fully, the \
         share the method answers fully too (all or nothing: three of four values is a lost case); sign test against \
         full prefill over every case both ran (wins / losses, two-sided p):\n\n| method | NIAH kept | all tasks kept | vs full: wins / losses | p |\n|---|---:|---:|---:|---:|\n"
    ));
    let solved = |x: f64| x >= 1.0 - 1e-9;
    for l in labels.iter().filter(|l| **l != FULL) {
        let (mut kept_niah, mut base_niah, mut kept_all, mut base_all, mut wins, mut losses) = (0, 0, 0, 0, 0, 0);
        for r in records.iter().filter(|r| r.length == len && at(r, l, tr)) {
            let Some(&f) = full.get(&(r.task.as_str(), r.sample)) else { continue };
            if solved(f) {
                base_all += 1;
                kept_all += usize::from(solved(r.score));
                if is_niah(&r.task) {
                    base_niah += 1;
                    kept_niah += usize::from(solved(r.score));
                }
            }
            if r.score > f + 1e-9 {
                wins += 1;
            } else if f > r.score + 1e-9 {
                losses += 1;
            }
        }
        let share = |k: usize, b: usize| {
            if b == 0 {
                "-".to_string()
            } else {
                format!("{:.1} ({k}/{b})", 100.0 * k as f64 / b as f64)
            }
        };
        md.push_str(&format!(
            "| {l} | {} | {} | {wins} / {losses} | {:.3} |\n",
            share(kept_niah, base_niah),
            share(kept_all, base_all),
            sign_test(wins, losses)
        ));
    }
    md.push('\n');
}

/// A task's family for the per-family comparisons: needle retrieval, variable tracking, QA.
fn family(task: &str) -> &'static str {
    if is_niah(task) {
        "NIAH"
    } else if task.starts_with("qa_") {
        "QA"
    } else {
        "variable tracking"
    }
}

/// Draws of the bootstrap intervals, and the seed of their resampling (the report is
/// deterministic).
const BOOTSTRAP_DRAWS: usize = 2000;
const BOOTSTRAP_SEED: u64 = 0x5eed_f10e;

/// The ratio of sums `sum(method) / sum(full)` over paired scores, and its 95% bootstrap
/// interval (percentile method: cases drawn with replacement, pairs kept together); `None`
/// without pairs or when full prefill scores nothing.
fn ratio_with_interval(pairs: &[(f64, f64)]) -> Option<(f64, f64, f64)> {
    let ratio = |it: &mut dyn Iterator<Item = (f64, f64)>| {
        let (m, f) = it.fold((0.0, 0.0), |(a, b), (m, f)| (a + m, b + f));
        (f > 0.0).then(|| m / f)
    };
    let point = ratio(&mut pairs.iter().copied())?;
    // splitmix64: a fixed, dependency-free stream of indices.
    let mut state = BOOTSTRAP_SEED;
    let mut next = move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let n = pairs.len();
    let mut draws: Vec<f64> =
        (0..BOOTSTRAP_DRAWS).filter_map(|_| ratio(&mut (0..n).map(|_| pairs[(next() % n as u64) as usize]))).collect();
    draws.sort_by(f64::total_cmp);
    let q = |p: f64| draws.get(((draws.len() as f64 - 1.0) * p).round() as usize).copied().unwrap_or(point);
    Some((point, q(0.025), q(0.975)))
}

/// Retention as the InfoFlow paper reports it (its Table 3: a method's mean score over full
/// prefill's mean score, on the same cases), per task family and over every task, at ratio
/// `tr`, with a 95% bootstrap interval over cases. Scores carry partial credit (a four-value
/// answer with three values right scores 0.75, as RULER scores it).
fn mean_score_retention(md: &mut String, records: &[Record], len: usize, labels: &[MethodSpec], tr: f64) {
    let Some(Retention { families, rows }) = retention_rows(records, len, labels, tr) else { return };
    md.push_str(&format!(
        "Mean-score retention at ratio {tr}, {len} tokens (the paper's metric: the method's mean score / full \
         prefill's on the same cases, partial credit per value), with a 95% bootstrap interval over cases and the \
         number of cases:\n\n| method |{} all tasks |\n|---|{}---:|\n",
        families.iter().map(|f| format!(" {f} |")).collect::<String>(),
        "---:|".repeat(families.len())
    ));
    for (l, cols) in rows {
        md.push_str(&format!("| {l} |"));
        for c in cols {
            match c {
                Some(((r, lo, hi), n)) => {
                    md.push_str(&format!(" {:.1} [{:.1}, {:.1}] ({n}) |", 100.0 * r, 100.0 * lo, 100.0 * hi))
                }
                None => md.push_str(" - |"),
            }
        }
        md.push('\n');
    }
    md.push('\n');
}

/// Mean-score retention per task family and over every task, for every method but full.
struct Retention<'a> {
    /// The task families that full prefill has cases of.
    families: Vec<&'static str>,
    /// Per method, per family and then over every task: (retention, 95% low, 95% high) and
    /// the number of cases, or `None` where there is no pair or full scores nothing.
    rows: Vec<(&'a MethodSpec, Vec<Option<Interval>>)>,
}

/// A retention, its 95% interval (low, high), and the number of cases.
type Interval = ((f64, f64, f64), usize);

/// [`Retention`] at `len` tokens and ratio `tr`; `None` without full prefill runs.
fn retention_rows<'a>(records: &[Record], len: usize, labels: &'a [MethodSpec], tr: f64) -> Option<Retention<'a>> {
    let full = scores_by_case(records, len, &FULL, tr);
    if full.is_empty() {
        return None;
    }
    let families: Vec<&'static str> =
        ["NIAH", "variable tracking", "QA"].into_iter().filter(|f| full.keys().any(|(t, _)| family(t) == *f)).collect();
    let rows = labels
        .iter()
        .filter(|l| **l != FULL)
        .map(|l| {
            let pairs: Vec<(&str, (f64, f64))> = records
                .iter()
                .filter(|r| r.length == len && at(r, l, tr))
                .filter_map(|r| full.get(&(r.task.as_str(), r.sample)).map(|&f| (family(&r.task), (r.score, f))))
                .collect();
            let cols = families
                .iter()
                .map(|f| Some(*f))
                .chain([None])
                .map(|f| {
                    let sub: Vec<(f64, f64)> =
                        pairs.iter().filter(|(g, _)| f.is_none_or(|f| f == *g)).map(|p| p.1).collect();
                    ratio_with_interval(&sub).map(|v| (v, sub.len()))
                })
                .collect();
            (l, cols)
        })
        .collect();
    Some(Retention { families, rows })
}

/// The mean-score retention table at `len` as a chart: per task family (and over every
/// task) each method's retention with its 95% bootstrap interval; `retention_{len}.png`.
fn retention_chart(records: &[Record], len: usize, labels: &[MethodSpec], tr: f64, out: &Path) -> Result<()> {
    let Some(Retention { families, rows }) = retention_rows(records, len, labels, tr) else { return Ok(()) };
    let groups: Vec<String> = families.iter().map(|f| f.to_string()).chain(["all tasks".to_string()]).collect();
    let series: Vec<plot::IntervalSeries> = rows
        .iter()
        .filter(|(_, cols)| cols.iter().any(Option::is_some))
        .map(|(l, cols)| plot::IntervalSeries {
            name: l.to_string(),
            values: cols.iter().map(|c| c.map(|((r, lo, hi), _)| (100.0 * r, 100.0 * lo, 100.0 * hi))).collect(),
        })
        .collect();
    if series.is_empty() {
        return Ok(());
    }
    let title = format!("Mean-score retention vs full prefill, {len} tokens, ratio {tr} (95% bootstrap intervals)");
    plot::interval_chart(
        &out.join(format!("retention_{len}.png")),
        &title,
        "% of full prefill's mean score",
        &groups,
        &series,
        100.0,
    )?;
    Ok(())
}

/// InfoFlow against every other method (full prefill aside) case by case, per task family at
/// ratio `tr`: cases where InfoFlow scores higher / lower, with the two-sided sign test (the
/// paper's claim is that it is ahead of CacheBlend and EPIC on every family).
fn infoflow_against_others(md: &mut String, records: &[Record], len: usize, labels: &[MethodSpec], tr: f64) {
    let mine = scores_by_case(records, len, &INFOFLOW, tr);
    let others: Vec<&MethodSpec> = labels.iter().filter(|l| **l != FULL && **l != INFOFLOW).collect();
    if mine.is_empty() || others.is_empty() {
        return;
    }
    let families: Vec<&str> =
        ["NIAH", "variable tracking", "QA"].into_iter().filter(|f| mine.keys().any(|(t, _)| family(t) == *f)).collect();
    md.push_str(&format!(
        "InfoFlow against each method at ratio {tr}, {len} tokens, case by case: cases where InfoFlow scores higher / \
         lower, two-sided sign test p.\n\n| method |{}\n|---|{}\n",
        families.iter().map(|f| format!(" {f} |")).collect::<String>(),
        "---:|".repeat(families.len())
    ));
    for l in others {
        md.push_str(&format!("| {l} |"));
        for f in &families {
            let (mut better, mut worse) = (0, 0);
            for r in records.iter().filter(|r| r.length == len && family(&r.task) == *f && at(r, l, tr)) {
                let Some(&m) = mine.get(&(r.task.as_str(), r.sample)) else { continue };
                if m > r.score + 1e-9 {
                    better += 1;
                } else if r.score > m + 1e-9 {
                    worse += 1;
                }
            }
            md.push_str(&format!(" {better} / {worse}, p = {:.3} |", sign_test(better, worse)));
        }
        md.push('\n');
    }
    md.push('\n');
}

/// The markdown report (deterministic: accuracy only, no timings). `settings` lists the
/// non-default selection settings (ablations), if any.
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
        md.push_str(&format!("Selection settings: {}.\n\n", settings.join("; ")));
    }
    for &len in lengths {
        accuracy_tables(&mut md, records, tasks, len, labels, tr);
        mean_score_retention(&mut md, records, len, labels, tr);
        conditional_retention(&mut md, records, len, labels, tr);
        infoflow_against_others(&mut md, records, len, labels, tr);
    }
    for &len in lengths {
        sweep_tables(&mut md, records, tasks, len, labels, ratios);
    }
    qa_table(&mut md, records, lengths, labels, tr);
    diagnostics(&mut md, records, labels, tr);
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

/// Selection diagnostics at the table ratio: needle and answer tokens recomputed, the answer
/// chunk's distance from the prompt, answers cut at the token budget.
fn diagnostics(md: &mut String, records: &[Record], labels: &[MethodSpec], tr: f64) {
    md.push_str(&format!(
        "## Selection diagnostics at ratio {tr} (all lengths)\n\nShare of needle-sentence and answer tokens recomputed; mean distance of the \
         answer-bearing chunk from the prompt (0 = nearest) in the final layout; answers that ran to the token budget (of the runs that \
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

/// The accuracy-vs-ratio and Pareto charts of one length (see [`plots`]): the files written.
#[allow(clippy::too_many_arguments)]
fn length_charts(
    records: &[Record],
    tasks: &[String],
    len: usize,
    labels: &[MethodSpec],
    ratios: &[f64],
    tr: f64,
    out: &Path,
) -> Result<(Option<PathBuf>, Option<PathBuf>)> {
    let (mut ratio_chart, mut pareto_chart) = (None, None);
    let mut cases = complete_cases(records, len, labels, ratios);
    let swept = !cases.is_empty();
    if !swept {
        cases = complete_cases(records, len, labels, &[tr]);
    }
    if cases.is_empty() {
        return Ok((None, None));
    }
    let rs_at = |l: &MethodSpec, x: f64| -> Vec<&Record> {
        records
            .iter()
            .filter(|r| r.length == len && cases.contains(&(r.task.as_str(), r.sample)) && at(r, l, x))
            .collect()
    };
    // Mean over tasks of the task means, as in the tables.
    let acc = |rs: &[&Record]| {
        let ts: Vec<&str> = tasks.iter().map(String::as_str).filter(|t| rs.iter().any(|r| r.task == *t)).collect();
        mean(ts.iter().filter_map(|t| mean(rs.iter().filter(|r| r.task == *t).map(|r| r.score))))
    };
    if swept && ratios.len() > 1 {
        let series: Vec<plot::Series> = labels
            .iter()
            .map(|l| plot::Series {
                name: l.to_string(),
                points: ratios.iter().filter_map(|&x| acc(&rs_at(l, x)).map(|v| (x, 100.0 * v))).collect(),
            })
            .collect();
        let f = out.join(format!("accuracy_vs_ratio_{len}.png"));
        let title = format!("Accuracy vs recompute ratio, {len} tokens ({} cases)", cases.len());
        if plot::line_chart(&f, &title, "recompute ratio", "accuracy (%)", &series)? {
            ratio_chart = Some(f);
        }
    }
    let points: &[f64] = if swept { ratios } else { std::slice::from_ref(&tr) };
    let mut pareto = Vec::new();
    for l in labels {
        let mut pts = Vec::new();
        for &x in points {
            let rs = rs_at(l, x);
            let Some(a) = acc(&rs) else { continue };
            let mut t: Vec<f64> = rs.iter().map(|r| r.ttft_ms).collect();
            t.sort_by(|a, b| a.total_cmp(b));
            pts.push((t[t.len() / 2] / 1e3, 100.0 * a));
            if rs.iter().all(|r| r.ratio.is_none()) {
                break;
            }
        }
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        pareto.push(plot::Series { name: l.to_string(), points: pts });
    }
    let title = format!(
        "Accuracy vs TTFT, {len} tokens, {} cases (warm chunk caches; points: {})",
        cases.len(),
        if swept { "ratios".to_string() } else { format!("ratio {tr}") }
    );
    let f = out.join(format!("pareto_{len}.png"));
    if plot::line_chart(&f, &title, "median TTFT (s)", "accuracy (%)", &pareto)? {
        pareto_chart = Some(f);
    }
    Ok((ratio_chart, pareto_chart))
}

/// Needle depth x length heat maps on the NIAH tasks, one per method.
fn heatmaps(
    records: &[Record],
    tasks: &[String],
    lengths: &[usize],
    labels: &[MethodSpec],
    depths: &[f64],
    tr: f64,
    out: &Path,
) -> Result<()> {
    let niah: HashSet<&str> = tasks.iter().map(String::as_str).filter(|t| t.starts_with("niah")).collect();
    if !niah.is_empty() {
        for l in labels {
            let cols: Vec<String> = lengths.iter().map(|l| l.to_string()).collect();
            let rows: Vec<String> = depths.iter().map(|d| format!("{d:.1}")).collect();
            let mut values = vec![vec![None; cols.len()]; rows.len()];
            let mut any = false;
            for (ri, &d) in depths.iter().enumerate() {
                for (ci, &len) in lengths.iter().enumerate() {
                    let v = mean(
                        records
                            .iter()
                            .filter(|x| {
                                niah.contains(x.task.as_str())
                                    && x.length == len
                                    && (x.depth - d).abs() < 1e-6
                                    && at(x, l, tr)
                            })
                            .map(|x| x.score),
                    );
                    if let Some(v) = v {
                        values[ri][ci] = Some(v);
                        any = true;
                    }
                }
            }
            if any {
                let name = l.to_string().replace('+', "_");
                plot::heatmap(
                    &out.join(format!("heatmap_{name}.png")),
                    &format!("{l}: NIAH accuracy (ratio {tr})"),
                    "context tokens",
                    "needle depth",
                    &cols,
                    &rows,
                    &values,
                )?;
            }
        }
    }
    Ok(())
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

/// The report's PNG charts in `out` (skipped with one warning when no font is found).
#[allow(clippy::too_many_arguments)]
pub fn plots(
    records: &[Record],
    tasks: &[String],
    lengths: &[usize],
    labels: &[MethodSpec],
    ratios: &[f64],
    depths: &[f64],
    tr: f64,
    out: &Path,
) -> Result<()> {
    // Accuracy vs ratio and the Pareto view, one chart each per length (TTFT grows with the
    // length, so lengths are not pooled); the unsuffixed files show the longest length that has
    // a chart. Both use only the cases that have every method at every ratio, so that the points
    // of a line compare the same cases; where no case has them all yet, the Pareto chart falls
    // back to every case at the table ratio and the ratio chart is left out.
    let mut ratio_chart: Option<PathBuf> = None;
    let mut pareto_chart: Option<PathBuf> = None;
    let mut sorted_lengths = lengths.to_vec();
    sorted_lengths.sort_unstable();
    for &len in &sorted_lengths {
        let (ratio, pareto) = length_charts(records, tasks, len, labels, ratios, tr, out)?;
        retention_chart(records, len, labels, tr, out)?;
        ratio_chart = ratio.or(ratio_chart);
        pareto_chart = pareto.or(pareto_chart);
    }
    for (chart, name) in [(ratio_chart, "accuracy_vs_ratio.png"), (pareto_chart, "pareto.png")] {
        if let Some(f) = chart {
            std::fs::copy(&f, out.join(name)).map_err(io(format!("copying to {name} from"), &f))?;
        }
    }
    heatmaps(records, tasks, lengths, labels, depths, tr, out)
}

#[cfg(test)]
mod tests {
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
