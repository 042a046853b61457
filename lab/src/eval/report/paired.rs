//! Paired statistics of the report: each method against full prefill (and InfoFlow against
//! the others) on the same cases: strict conditional retention with the sign test, the paper's
//! mean-score retention with its bootstrap interval.

use super::*;

/// Two-sided exact sign test: the probability of a split at least as uneven as `wins` against
/// `losses` when either side is equally likely (ties are left out before calling).
pub(super) fn sign_test(wins: usize, losses: usize) -> f64 {
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

/// One method's score per case (task, sample) at `len` tokens and ratio `tr`: the side of a
/// paired comparison.
pub(super) fn scores_by_case<'a>(
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
pub(super) fn conditional_retention(md: &mut String, records: &[Record], len: usize, labels: &[MethodSpec], tr: f64) {
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
pub(super) fn family(task: &str) -> &'static str {
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
pub(super) const BOOTSTRAP_DRAWS: usize = 2000;
pub(super) const BOOTSTRAP_SEED: u64 = 0x5eed_f10e;

/// The ratio of sums `sum(method) / sum(full)` over paired scores, and its 95% bootstrap
/// interval (percentile method: cases drawn with replacement, pairs kept together); `None`
/// without pairs or when full prefill scores nothing.
pub(super) fn ratio_with_interval(pairs: &[(f64, f64)]) -> Option<(f64, f64, f64)> {
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
pub(super) fn mean_score_retention(md: &mut String, records: &[Record], len: usize, labels: &[MethodSpec], tr: f64) {
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
pub(super) struct Retention<'a> {
    /// The task families that full prefill has cases of.
    pub(super) families: Vec<&'static str>,
    /// Per method, per family and then over every task: (retention, 95% low, 95% high) and
    /// the number of cases, or `None` where there is no pair or full scores nothing.
    pub(super) rows: Vec<(&'a MethodSpec, Vec<Option<Interval>>)>,
}

/// A retention, its 95% interval (low, high), and the number of cases.
pub(super) type Interval = ((f64, f64, f64), usize);

/// [`Retention`] at `len` tokens and ratio `tr`; `None` without full prefill runs.
pub(super) fn retention_rows<'a>(
    records: &[Record],
    len: usize,
    labels: &'a [MethodSpec],
    tr: f64,
) -> Option<Retention<'a>> {
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

/// InfoFlow against every other method (full prefill aside) case by case, per task family at
/// ratio `tr`: cases where InfoFlow scores higher / lower, with the two-sided sign test (the
/// paper's claim is that it is ahead of CacheBlend and EPIC on every family).
pub(super) fn infoflow_against_others(md: &mut String, records: &[Record], len: usize, labels: &[MethodSpec], tr: f64) {
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
