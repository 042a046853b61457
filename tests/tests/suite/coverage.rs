//! Budgets by attention coverage (issue 53, item 3) on the real model, release build: the cut
//! keeps exactly the fewest best-scored tokens that reach the share (checked against the
//! scores the run returns), within its ratio bounds; the same tokens and count on 1 and 3 ranks;
//! coverage 1 equals ratio 1 equals full prefill.

use flowprefill_coordinator::select::{chunk_mass, mass};
use flowprefill_coordinator::{Coverage, Job, Method, RunOptions, RunResult, ThreadRanks};
use flowprefill_kernels::topk::{count_for_ratio, rank_order};
use flowprefill_tests::{rel_diff, shared_model, RANKS_LOGIT_TOL};
use std::time::Duration;

fn run(ranks: usize, opts: RunOptions) -> RunResult {
    let mut world = ThreadRanks::new(shared_model(), ranks, 1 << 30, Duration::from_secs(60)).expect("ranks");
    let job = Job { request: flowprefill_tests::gate_request(), options: RunOptions { max_new_tokens: 4, ..opts } };
    world.run(&job, &mut |_| true).unwrap_or_else(|e| panic!("{ranks} ranks: {e}"))
}

fn covering(method: Method, c: Coverage) -> RunOptions {
    RunOptions { method, coverage: Some(c), keep_scores: true, ..RunOptions::default() }
}

/// Global indices (chunks in order, then rows) of a result's selection.
fn selected(r: &RunResult) -> Vec<usize> {
    let mut out = Vec::new();
    let mut start = 0;
    for (rows, n) in r.selected_rows.iter().zip(&r.chunk_tokens) {
        out.extend(rows.iter().map(|&row| start + row));
        start += n;
    }
    out
}

#[test]
fn the_cut_is_the_fewest_best_tokens_reaching_the_share() {
    for method in [Method::Infoflow, Method::Prophet, Method::Cacheblend] {
        let mut last_k = 0;
        for share in [0.5, 0.8, 0.95] {
            let r = run(1, covering(method, Coverage::new(share)));
            let tag = format!("{method} at coverage {share}");
            let scores = r.scores.clone().expect("scores kept");
            let total: f64 = scores.iter().map(|s| chunk_mass(s)).sum();
            let mut ranked: Vec<(f32, usize)> = scores.iter().flatten().copied().zip(0..).collect();
            ranked.sort_by(|a, b| rank_order(*a, *b));
            let cut = r.coverage.expect("the result reports the cut");
            let k = cut.k;
            let mass_of = |k: usize| ranked[..k].iter().map(|&(s, _)| mass(s)).sum::<f64>();
            assert!(k > 0 && k < r.n_context_tokens, "{tag}: k {k} of {}", r.n_context_tokens);
            assert!(mass_of(k) >= share * total, "{tag}: {k} tokens reach the share");
            assert!(mass_of(k - 1) < share * total, "{tag}: {} tokens would not", k - 1);
            assert!((cut.covered - mass_of(k) / total).abs() < 1e-9, "{tag}: covered {}", cut.covered);
            let mut want: Vec<usize> = ranked[..k].iter().map(|&(_, i)| i).collect();
            want.sort_unstable();
            assert_eq!(selected(&r), want, "{tag}: the best k by score");
            assert_eq!((r.budget, r.n_selected()), (k, k), "{tag}: the budget reported is the cut");
            assert!(k >= last_k, "{tag}: a larger share keeps no fewer tokens");
            last_k = k;
        }
    }
}

#[test]
fn the_bounds_hold_the_cut() {
    let n = run(1, RunOptions { method: Method::None, ..RunOptions::default() }).n_context_tokens;
    let r = run(1, covering(Method::Infoflow, Coverage { min_ratio: 0.3, ..Coverage::new(0.05) }));
    assert_eq!(r.coverage.map(|c| c.k), Some(count_for_ratio(0.3, n)), "the least ratio");
    let r = run(1, covering(Method::Infoflow, Coverage { max_ratio: 0.05, ..Coverage::new(0.99) }));
    let cut = r.coverage.expect("cut");
    assert_eq!(cut.k, count_for_ratio(0.05, n), "the largest ratio");
    assert!(cut.covered < 0.99, "short of the share: {}", cut.covered);
}

#[test]
fn one_and_three_ranks_cut_at_the_same_tokens() {
    for (method, share) in [(Method::Infoflow, 0.8), (Method::Cacheblend, 0.9), (Method::Infoflow, 0.6)] {
        let opts = covering(method, Coverage::new(share));
        let one = run(1, opts.clone());
        let three = run(3, opts);
        let tag = format!("{method} at coverage {share}");
        assert!(three.rank_stats.iter().filter(|s| s.chunks > 0).count() > 1, "{tag}: the chunks are spread");
        assert_eq!(three.selected_rows, one.selected_rows, "{tag}: selection");
        assert_eq!(three.coverage.map(|c| c.k), one.coverage.map(|c| c.k), "{tag}: k");
        assert_eq!(three.tokens, one.tokens, "{tag}: answer");
    }
}

#[test]
fn coverage_one_is_ratio_one_is_full_prefill() {
    let full = run(1, RunOptions { method: Method::Full, ..RunOptions::default() });
    let ratio = run(1, RunOptions { method: Method::Infoflow, ratio: 1.0, ..RunOptions::default() });
    let cover = run(1, covering(Method::Infoflow, Coverage::new(1.0)));
    assert_eq!(cover.n_selected(), cover.n_context_tokens, "everything is recomputed");
    assert_eq!(cover.coverage.map(|c| (c.k, c.covered)), Some((cover.n_context_tokens, 1.0)));
    assert_eq!(cover.first_logits, ratio.first_logits, "coverage 1 and ratio 1 run the same steps");
    let d = rel_diff(&cover.first_logits, &full.first_logits);
    assert!(d <= RANKS_LOGIT_TOL, "coverage 1 against full prefill: relative logit difference {d}");
    assert_eq!(cover.tokens, full.tokens);
}
