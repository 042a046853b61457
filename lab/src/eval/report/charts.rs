//! The report's PNG charts: accuracy against ratio and TTFT per length, retention with its
//! interval, NIAH heat maps by depth and length.

use super::paired::{retention_rows, Retention};
use super::*;

/// The mean-score retention table at `len` as a chart: per task family (and over every
/// task) each method's retention with its 95% bootstrap interval; `retention_{len}.png`.
pub(super) fn retention_chart(
    records: &[Record],
    len: usize,
    labels: &[MethodSpec],
    tr: f64,
    out: &Path,
) -> Result<()> {
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

/// The accuracy-vs-ratio and Pareto charts of one length (see [`plots`]): the files written.
#[allow(clippy::too_many_arguments)]
pub(super) fn length_charts(
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
            pts.push((crate::median(&mut t) / 1e3, 100.0 * a));
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

/// How near a run's depth must be to a heat map row's to count in it.
const DEPTH_TOL: f64 = 1e-6;

/// The heat maps' row labels of `depths`: the fewest decimals (at least one) that write every
/// depth to within [`DEPTH_TOL`] and tell distinct depths apart (`0.1`..`0.9`; `0.10`, `0.12`;
/// `0.25`, not `0.2`), else each depth's shortest exact form. One decimal made 0.1 and 0.12
/// one label, 0.25 read as 0.2.
fn depth_labels(depths: &[f64]) -> Vec<String> {
    let fits = |labels: &[String]| {
        let exact = labels.iter().zip(depths).all(|(l, d)| l.parse::<f64>().is_ok_and(|v| (v - d).abs() < DEPTH_TOL));
        let apart =
            depths.iter().zip(labels).all(|(a, la)| depths.iter().zip(labels).all(|(b, lb)| a == b || la != lb));
        exact && apart
    };
    (1..=6)
        .map(|places| depths.iter().map(|d| format!("{d:.places$}")).collect::<Vec<_>>())
        .find(|labels| fits(labels))
        .unwrap_or_else(|| depths.iter().map(f64::to_string).collect())
}

/// Needle depth x length heat maps on the NIAH tasks, one per method.
pub(super) fn heatmaps(
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
            let rows = depth_labels(depths);
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
                                    && (x.depth - d).abs() < DEPTH_TOL
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
    // A budget by coverage has no ratio to draw against (budget_charts draws it).
    let ratio_labels: Vec<MethodSpec> = labels.iter().filter(|l| l.coverage.is_none()).copied().collect();
    for &len in &sorted_lengths {
        let (ratio, pareto) = length_charts(records, tasks, len, &ratio_labels, ratios, tr, out)?;
        retention_chart(records, len, labels, tr, out)?;
        ratio_chart = ratio.or(ratio_chart);
        pareto_chart = pareto.or(pareto_chart);
    }
    for (chart, name) in [(ratio_chart, "accuracy_vs_ratio.png"), (pareto_chart, "pareto.png")] {
        if let Some(f) = chart {
            std::fs::copy(&f, out.join(name)).map_err(io(format!("copying to {name} from"), &f))?;
        }
    }
    super::budgets::budget_charts(records, lengths, out)?;
    heatmaps(records, tasks, lengths, labels, depths, tr, out)
}

#[cfg(test)]
mod tests {
    use super::depth_labels;

    #[test]
    fn depth_labels_are_distinct_for_distinct_depths() {
        assert_eq!(depth_labels(&[0.1, 0.3, 0.5, 0.7, 0.9]), ["0.1", "0.3", "0.5", "0.7", "0.9"], "the defaults");
        assert_eq!(depth_labels(&[0.1, 0.12, 0.5]), ["0.10", "0.12", "0.50"], "one decimal made 0.1 twice");
        assert_eq!(depth_labels(&[0.0, 0.25, 0.5, 0.75, 1.0]), ["0.00", "0.25", "0.50", "0.75", "1.00"]);
        assert_eq!(depth_labels(&[0.5, 0.5]), ["0.5", "0.5"], "one depth twice: one label");
        let thirds = depth_labels(&[1.0 / 3.0, 2.0 / 3.0]);
        assert_eq!(thirds, ["0.333333", "0.666667"]);
        // Closer than six decimals tell: every depth exactly.
        let close = [0.5, 0.5 + 1e-9];
        let labels = depth_labels(&close);
        assert_ne!(labels[0], labels[1], "{labels:?}");
        assert_eq!(labels.iter().map(|l| l.parse::<f64>().unwrap()).collect::<Vec<_>>(), close);
        assert!(depth_labels(&[]).is_empty());
    }
}
