//! KV eviction before decoding (`--evict snapkv --kv-budget N`) on the real model, thread
//! ranks, release build: a budget above the context changes no answer after any method, every
//! (layer, KV head) keeps exactly the budget over 1-3 ranks, and a needle survives a small
//! budget.

use flowprefill_coordinator::timings::phase;
use flowprefill_coordinator::{Evict, EvictPolicy, Job, Method, Request, RunOptions, RunResult, ThreadRanks};
use flowprefill_tests::{gate_request, rel_diff};
use flowprefill_worker::{Cpu, LoadedModel};
use std::sync::Arc;
use std::time::Duration;

/// First-token logits of a prefill split at the prompt (context, then prompt over it) against
/// one pass, relative to the logit range: the same sums, in another association.
const SPLIT_LOGIT_TOL: f32 = 2e-4;

fn lm() -> Arc<LoadedModel<Cpu>> {
    flowprefill_tests::shared_model()
}

fn run(ranks: usize, req: &Request, opts: RunOptions) -> RunResult {
    let mut world = ThreadRanks::new(lm(), ranks, 1 << 30, Duration::from_secs(60)).expect("ranks");
    let job = Job { request: req.clone(), options: RunOptions { max_new_tokens: 16, ..opts } };
    world.run(&job, &mut |_| true).unwrap_or_else(|e| panic!("{ranks} ranks: {e}"))
}

fn snapkv(budget: usize) -> Option<Evict> {
    Some(Evict { policy: EvictPolicy::Snapkv, budget })
}

fn phases(r: &RunResult) -> Vec<&str> {
    r.phases.entries().iter().map(|(n, _)| *n).collect()
}

#[test]
fn a_budget_above_the_context_changes_no_answer() {
    let req = gate_request();
    for (method, ranks) in
        [(Method::Full, 1), (Method::Infoflow, 1), (Method::Infoflow, 3), (Method::None, 2), (Method::Ring, 2)]
    {
        let tag = format!("{method} on {ranks} ranks");
        let opts = RunOptions { method, ratio: 0.15, ..RunOptions::default() };
        let kept = run(ranks, &req, opts.clone());
        let ev = run(ranks, &req, RunOptions { evict: snapkv(100_000), ..opts });
        let e = ev.eviction.as_ref().unwrap_or_else(|| panic!("{tag}: no eviction reported"));
        let rows = ev.n_head_tokens + ev.n_context_tokens;
        assert_eq!((e.rows_before, e.kept()), (rows, rows), "{tag}: every context row is kept");
        assert_eq!(e.kept_per_rank.len(), ranks, "{tag}");
        assert_eq!(e.bytes_after, e.bytes_before, "{tag}");
        assert!(phases(&ev).contains(&phase::EVICT), "{tag}: {:?}", phases(&ev));
        assert!(kept.eviction.is_none() && !phases(&kept).contains(&phase::EVICT), "{tag}");
        assert_eq!(ev.tokens, kept.tokens, "{tag}: answer tokens ({:?} vs {:?})", ev.answer, kept.answer);
        let d = rel_diff(&ev.first_logits, &kept.first_logits);
        if matches!(method, Method::Full | Method::Ring) {
            assert!(d <= SPLIT_LOGIT_TOL, "{tag}: first-token logits differ by {d}");
        } else {
            assert_eq!(d, 0.0, "{tag}: the prompt runs as before; eviction comes after it");
        }
    }
}

#[test]
fn every_head_keeps_exactly_the_budget_on_one_rank_or_many() {
    let req = gate_request();
    let lm = lm();
    let cfg = lm.model.config();
    let row_bytes = 2 * cfg.n_layers * cfg.kv_dim() * 4;
    for (method, ranks) in [(Method::Infoflow, 1), (Method::Infoflow, 2), (Method::Epic, 3), (Method::Full, 1)] {
        let tag = format!("{method} on {ranks} ranks");
        let r = run(ranks, &req, RunOptions { method, evict: snapkv(40), ..RunOptions::default() });
        let e = r.eviction.as_ref().expect("eviction reported");
        assert_eq!(e.kept(), 40, "{tag}: {:?}", e.kept_per_rank);
        assert_eq!(e.kept_per_rank.len(), ranks, "{tag}");
        assert_eq!((e.bytes_before, e.bytes_after), (e.rows_before * row_bytes, 40 * row_bytes), "{tag}");
        assert_eq!(e.window, 32);
        assert!(!r.tokens.is_empty(), "{tag}: an answer");
        eprintln!("{tag}: kept {:?} of {} rows: {:?}", e.kept_per_rank, e.rows_before, r.answer);
    }
}

#[test]
fn the_needle_survives_a_small_budget() {
    // 433 context rows. One rank keeps each head's own top N: 96 keep the code the question
    // asks for. Two ranks keep one share per rank for every head (module docs of the engine's
    // eviction), which costs some heads part of their top N: 256 keep it, and 96 does not (ring
    // and InfoFlow on 2 ranks answer "472" at 96-192, measured 2026-11-24; both sides asserted).
    let req = gate_request();
    for (method, ranks, budget) in [(Method::Full, 1, 96), (Method::Ring, 2, 256), (Method::Infoflow, 2, 256)] {
        let tag = format!("{method} on {ranks} ranks, budget {budget}");
        let kept = run(ranks, &req, RunOptions { method, ..RunOptions::default() });
        assert!(kept.answer.contains("4729"), "{tag}: without eviction: {:?}", kept.answer);
        let r = run(ranks, &req, RunOptions { method, evict: snapkv(budget), ..RunOptions::default() });
        let e = r.eviction.as_ref().expect("eviction reported");
        assert!(e.kept() * 5 / 3 < e.rows_before, "{tag}: the budget is small: {} of {}", e.kept(), e.rows_before);
        assert!(r.answer.contains("4729"), "{tag}: {:?}", r.answer);
        if ranks > 1 {
            // The other side of the claim: one rank's budget is not enough on two.
            let short = run(ranks, &req, RunOptions { method, evict: snapkv(96), ..RunOptions::default() });
            assert!(!short.answer.contains("4729"), "{method} on {ranks} ranks, budget 96: {:?}", short.answer);
        }
    }
}

#[test]
fn a_second_eviction_of_the_same_context_reuses_its_prefill() {
    // Full prefill with eviction keeps the context's cache in the store: another policy or
    // budget over the same context copies it, and answers as a fresh prefill does.
    let req = gate_request();
    let mut world = ThreadRanks::new(lm(), 1, 1 << 30, Duration::from_secs(60)).expect("ranks");
    let mut go = |req: &Request, budget: usize| {
        let opts =
            RunOptions { method: Method::Full, evict: snapkv(budget), max_new_tokens: 16, ..RunOptions::default() };
        world.run(&Job { request: req.clone(), options: opts }, &mut |_| true).expect("run")
    };
    let first = go(&req, 96);
    let again = go(&req, 96);
    let other = go(&req, 40);
    assert_eq!((first.cache_hits, first.cache_misses), (0, 1), "the first run prefills the context");
    assert_eq!((again.cache_hits, again.cache_misses), (1, 0), "the second copies it");
    assert_eq!((other.cache_hits, other.cache_misses), (1, 0), "another budget copies it too");
    assert_eq!(again.tokens, first.tokens, "answer {:?} vs {:?}", again.answer, first.answer);
    assert_eq!(again.first_logits, first.first_logits, "the copy is the prefilled cache, bit for bit");
    assert_eq!(again.eviction, first.eviction);
    // The stored cache is never packed in place: the budget of 96 again after 40 keeps 96.
    let third = go(&req, 96);
    assert_eq!((third.tokens, third.eviction), (first.tokens.clone(), first.eviction.clone()));
    assert_eq!(other.eviction.as_ref().map(|e| e.kept()), Some(40));
    // Another context misses.
    let mut req2 = req.clone();
    req2.query = "Which harbour does the ferry leave from?".into();
    let changed = go(&req2, 96);
    assert_eq!((changed.cache_hits, changed.cache_misses), (1, 0), "the question is not part of the context's key");
    if let flowprefill_coordinator::Context::Documents(d) = &mut req2.context {
        d.push("The bridge closes at noon.".into());
    }
    let longer = go(&req2, 96);
    assert_eq!((longer.cache_hits, longer.cache_misses), (0, 1), "another context is prefilled");
}
