//! Budgets by coverage against fixed ratios (issue 53): every budget a selecting method ran
//! with, a fixed ratio (`infoflow@0.15`) or a coverage (`infoflow~0.8`), as the share of the
//! context it recomputed and what it kept of full prefill's score on the same cases, so that the
//! two kinds of budget compare at equal recomputed tokens (a table and a curve per length).

use super::paired::{ratio_with_interval, scores_by_case};
use super::{mean, Record, FULL};
use crate::plot;
use crate::Result;
use flowprefill_coordinator::MethodSpec;
use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// One budget's runs at one length, on the cases every budget of the comparison ran.
struct Point {
    /// The method as run (its ratio in the spec for a fixed ratio).
    spec: MethodSpec,
    /// Cases.
    cases: usize,
    /// Mean share of the context recomputed.
    recomputed: f64,
    /// Mean score.
    score: f64,
    /// Mean-score retention against full prefill, with its 95% bootstrap interval.
    retention: Option<(f64, f64, f64)>,
    /// Of the cases full prefill answers fully, those this budget answers fully too.
    strict: (usize, usize),
    /// Mean TTFT.
    ttft_ms: f64,
}

/// The budgets to compare at `len`: every (method, ratio) and coverage run of the methods that
/// have coverage runs there, on the cases that all of them and full prefill ran.
fn points(records: &[Record], len: usize) -> Vec<Point> {
    let covered: HashSet<_> =
        records.iter().filter(|r| r.length == len && r.method.coverage.is_some()).map(|r| r.method.method).collect();
    if covered.is_empty() {
        return Vec::new();
    }
    // Each budget as one spec: a fixed ratio is written into it.
    let spec_of = |r: &Record| match (r.method.coverage, r.ratio) {
        (None, Some(x)) => r.method.at(x),
        _ => r.method,
    };
    let mut specs: Vec<MethodSpec> = Vec::new();
    for r in records.iter().filter(|r| r.length == len && covered.contains(&r.method.method) && !r.method.reorder) {
        let s = spec_of(r);
        if !specs.contains(&s) {
            specs.push(s);
        }
    }
    let full = scores_by_case(records, len, &FULL, 0.0);
    let mut cases: HashSet<(&str, usize)> = full.keys().copied().collect();
    for s in &specs {
        let mine: HashSet<(&str, usize)> = records
            .iter()
            .filter(|r| r.length == len && spec_of(r) == *s)
            .map(|r| (r.task.as_str(), r.sample))
            .collect();
        cases.retain(|c| mine.contains(c));
    }
    let mut out: Vec<Point> = specs
        .into_iter()
        .filter_map(|spec| {
            let rs: Vec<&Record> = records
                .iter()
                .filter(|r| r.length == len && spec_of(r) == spec && cases.contains(&(r.task.as_str(), r.sample)))
                .collect();
            if rs.is_empty() {
                return None;
            }
            let pairs: Vec<(f64, f64)> =
                rs.iter().filter_map(|r| full.get(&(r.task.as_str(), r.sample)).map(|&f| (r.score, f))).collect();
            let solved = |x: f64| x >= 1.0 - 1e-9;
            let base = pairs.iter().filter(|p| solved(p.1)).count();
            let kept = pairs.iter().filter(|p| solved(p.1) && solved(p.0)).count();
            Some(Point {
                spec,
                cases: rs.len(),
                recomputed: mean(rs.iter().map(|r| r.selected as f64 / r.context_tokens.max(1) as f64))?,
                score: mean(rs.iter().map(|r| r.score))?,
                retention: ratio_with_interval(&pairs),
                strict: (kept, base),
                ttft_ms: mean(rs.iter().map(|r| r.ttft_ms))?,
            })
        })
        .collect();
    out.sort_by(|a, b| {
        (a.spec.coverage.is_some(), a.recomputed)
            .partial_cmp(&(b.spec.coverage.is_some(), b.recomputed))
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    out
}

/// The comparison's table per length that has coverage runs (nothing otherwise).
pub(super) fn budget_tables(md: &mut String, records: &[Record], lengths: &[usize]) {
    for &len in lengths {
        let pts = points(records, len);
        if pts.is_empty() {
            continue;
        }
        md.push_str(&format!(
            "## Budgets by coverage against fixed ratios ({len} tokens)\n\nEvery budget on the same {} cases: the \
             share of the context it recomputed (mean over cases), the mean score, mean-score retention against full \
             prefill with its 95% bootstrap interval, strict retention (of the cases full prefill answers fully, \
             those the budget answers fully too) and the mean TTFT. A coverage row also shows the fixed ratios' \
             retention at the share it recomputed (linear between the two fixed ratios around it; `-` outside \
             them).\n\n| budget | recomputed % | score % | retention % [95%] | fixed ratio at that share | strict kept | TTFT ms |\n|---|---:|---:|---:|---:|---:|---:|\n",
            pts[0].cases
        ));
        for p in &pts {
            let ret = p
                .retention
                .map_or("-".into(), |(r, lo, hi)| format!("{:.1} [{:.1}, {:.1}]", 100.0 * r, 100.0 * lo, 100.0 * hi));
            let (k, b) = p.strict;
            let matched = match p.spec.coverage {
                Some(_) => {
                    fixed_at(&pts, p.spec.method, p.recomputed).map_or("-".into(), |r| format!("{:.1}", 100.0 * r))
                }
                None => String::new(),
            };
            md.push_str(&format!(
                "| {} | {:.1} | {:.1} | {ret} | {matched} | {k}/{b} | {:.0} |\n",
                p.spec,
                100.0 * p.recomputed,
                100.0 * p.score,
                p.ttft_ms
            ));
        }
        md.push('\n');
    }
}

/// The fixed ratios' retention of `method` at `share` recomputed: linear between the two fixed
/// points around it (`None` outside them).
fn fixed_at(pts: &[Point], method: flowprefill_coordinator::Method, share: f64) -> Option<f64> {
    let mut fixed: Vec<(f64, f64)> = pts
        .iter()
        .filter(|p| p.spec.method == method && p.spec.coverage.is_none())
        .filter_map(|p| p.retention.map(|r| (p.recomputed, r.0)))
        .collect();
    fixed.sort_by(|a, b| a.0.total_cmp(&b.0));
    let i = fixed.iter().position(|&(x, _)| x >= share)?;
    let (x1, y1) = fixed[i];
    if i == 0 {
        return ((x1 - share).abs() < 1e-12).then_some(y1);
    }
    let (x0, y0) = fixed[i - 1];
    Some(y0 + (y1 - y0) * (share - x0) / (x1 - x0).max(1e-12))
}

/// Retention against the share recomputed, fixed ratios and coverage as two lines per method,
/// one chart per length with coverage runs (`budgets_LEN.png`).
pub(super) fn budget_charts(records: &[Record], lengths: &[usize], out: &Path) -> Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    for &len in lengths {
        let pts = points(records, len);
        if pts.is_empty() {
            continue;
        }
        let mut series: Vec<plot::Series> = Vec::new();
        for p in &pts {
            let Some((r, _, _)) = p.retention else { continue };
            let kind = if p.spec.coverage.is_some() { "coverage" } else { "fixed ratio" };
            let name = format!("{} {kind}", p.spec.method);
            let point = (100.0 * p.recomputed, 100.0 * r);
            match series.iter_mut().find(|s| s.name == name) {
                Some(s) => s.points.push(point),
                None => series.push(plot::Series { name, points: vec![point] }),
            }
        }
        for s in &mut series {
            s.points.sort_by(|a, b| a.0.total_cmp(&b.0));
        }
        let path = out.join(format!("budgets_{len}.png"));
        let title = format!("Retention against tokens recomputed ({len} tokens)");
        if plot::line_chart(&path, &title, "context recomputed (%)", "mean-score retention (%)", &series)? {
            written.push(path);
        }
    }
    Ok(written)
}
