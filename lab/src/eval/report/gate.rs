//! The quality gate over verified runs (`eval --verify`): for each method and a range of KL
//! floors, how many of the runs the approximation hurt (a score below its exact answer's) the
//! gate would have caught, how many unhurt runs it would have sent to the exact computation
//! needlessly, and the mean score with the gate in place.

use super::{mean, pct, Record};
use flowprefill_coordinator::MethodSpec;
use std::fmt::Write as _;

/// The KL floors (nats) the table tries.
pub const FLOORS: &[f64] = &[0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5];

/// A run the gate looks at: its score, its exact answer's score and its first token's KL.
struct Seen {
    score: f64,
    exact: f64,
    kl: f64,
    ttft: f64,
    exact_ttft: f64,
}

/// The gate's table per length (nothing without verified runs).
pub(super) fn gate_tables(md: &mut String, records: &[Record], lengths: &[usize], labels: &[MethodSpec]) {
    if records.iter().all(|r| r.verified.is_none()) {
        return;
    }
    md.push_str(
        "## The quality gate (verified runs)\n\nA run is *hurt* when its score is below its exact \
         answer's. At each KL floor the gate answers exactly when the first token's KL is above \
         it: *caught* counts the hurt runs it answered exactly, *needless* the unhurt ones; the \
         score after is the mean with those runs answered exactly; *TTFT verified* adds the exact \
         computation's TTFT to the run's (a verified answer is final once both are done).\n\n",
    );
    for &len in lengths {
        let mut rows = String::new();
        for label in labels {
            let mut ratios: Vec<Option<f64>> = Vec::new();
            for r in records.iter().filter(|r| r.length == len && r.method == *label && r.verified.is_some()) {
                if !ratios.iter().any(|x| x.map(f64::to_bits) == r.ratio.map(f64::to_bits)) {
                    ratios.push(r.ratio);
                }
            }
            ratios.sort_by(|a, b| a.unwrap_or(0.0).total_cmp(&b.unwrap_or(0.0)));
            for ratio in ratios {
                let seen: Vec<Seen> = records
                    .iter()
                    .filter(|r| {
                        r.length == len && r.method == *label && r.ratio.map(f64::to_bits) == ratio.map(f64::to_bits)
                    })
                    .filter_map(|r| {
                        r.verified.as_ref().map(|v| Seen {
                            score: r.score,
                            exact: v.exact_score,
                            kl: v.kl,
                            ttft: r.ttft_ms,
                            exact_ttft: v.exact_ttft_ms,
                        })
                    })
                    .collect();
                let name = match ratio {
                    Some(x) => format!("{label}@{x}"),
                    None => label.to_string(),
                };
                rows += &rows_of(&name, &seen);
            }
        }
        if !rows.is_empty() {
            let _ = write!(
                md,
                "### {len} tokens\n\n| method | runs | hurt | mean KL hurt / unhurt | floor | caught | needless | score before | score after | TTFT | TTFT verified |\n| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n{rows}\n"
            );
        }
    }
}

/// One row per floor for one method's runs.
fn rows_of(name: &str, seen: &[Seen]) -> String {
    let hurt = |s: &&Seen| s.score < s.exact;
    let n_hurt = seen.iter().filter(hurt).count();
    let kl_hurt = mean(seen.iter().filter(hurt).map(|s| s.kl));
    let kl_fine = mean(seen.iter().filter(|s| !hurt(s)).map(|s| s.kl));
    let before = mean(seen.iter().map(|s| s.score));
    let ttft = mean(seen.iter().map(|s| s.ttft));
    let verified = mean(seen.iter().map(|s| s.ttft + s.exact_ttft));
    let kl = |x: Option<f64>| x.map_or("-".into(), |v| format!("{v:.3}"));
    let ms = |x: Option<f64>| x.map_or("-".into(), |v| format!("{v:.0} ms"));
    let mut out = String::new();
    for &floor in FLOORS {
        let caught = seen.iter().filter(|s| hurt(s) && s.kl > floor).count();
        let needless = seen.iter().filter(|s| !hurt(s) && s.kl > floor).count();
        let after = mean(seen.iter().map(|s| if s.kl > floor { s.exact } else { s.score }));
        let _ = writeln!(
            out,
            "| {name} | {} | {n_hurt} | {} / {} | {floor} | {caught}/{n_hurt} | {needless}/{} | {} | {} | {} | {} |",
            seen.len(),
            kl(kl_hurt),
            kl(kl_fine),
            seen.len() - n_hurt,
            pct(before),
            pct(after),
            ms(ttft),
            ms(verified)
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_floor_catches_the_hurt_runs_above_it_and_counts_the_needless_ones() {
        let seen = [
            Seen { score: 0.0, exact: 1.0, kl: 0.3, ttft: 10.0, exact_ttft: 30.0 },
            Seen { score: 1.0, exact: 1.0, kl: 0.02, ttft: 10.0, exact_ttft: 30.0 },
            Seen { score: 1.0, exact: 1.0, kl: 0.001, ttft: 10.0, exact_ttft: 30.0 },
            Seen { score: 0.5, exact: 1.0, kl: 0.004, ttft: 10.0, exact_ttft: 30.0 },
        ];
        let rows = rows_of("none", &seen);
        // Floor 0.01: the first hurt run is caught (0.3), the second is not (0.004); the 0.02
        // unhurt run is a needless fallback; the score goes from 62.5% to 87.5%.
        let at = rows.lines().find(|l| l.contains("| 0.01 |")).expect("a row at 0.01");
        assert!(at.contains("| 1/2 | 1/2 | 62.5 | 87.5 |"), "{at}");
        let low = rows.lines().find(|l| l.contains("| 0.001 |")).expect("a row at 0.001");
        assert!(low.contains("| 2/2 | 1/2 |") && low.contains("| 100.0 |"), "{low}");
        assert!(at.contains("| 10 ms | 40 ms |"), "{at}");
    }
}
