//! Verification against the exact answer and the quality gate (`--verify`, `--quality-floor`,
//! `--on-breach`) on the real model: full prefill verified against itself is exact; `none`
//! (no recomputation) on the gate request is measurably off and, held to a floor, falls back to
//! the exact answer or is flagged; on several ranks the exact twin is ring attention; bad values
//! are field errors naming the field.

use flowprefill_coordinator::{
    Context, CoordError, Job, Method, OnBreach, Quality, Request, RunOptions, RunResult, ThreadRanks,
};
use flowprefill_lab::tasks::{TWO_HOP_ANSWER, TWO_HOP_DOCS, TWO_HOP_QUERY, TWO_HOP_WRONG};
use flowprefill_tests::{engine, gate_request};
use flowprefill_worker::Field;
use std::time::Duration;

fn run(req: &Request, opts: RunOptions) -> RunResult {
    engine().run(req, &RunOptions { max_new_tokens: 14, ..opts }, &mut |_| true).expect("run")
}

/// [`flowprefill_lab::tasks::TWO_HOP_DOCS`]: `none` answers 3817, full prefill 5264.
fn two_hops() -> Request {
    Request {
        conversation: Default::default(),
        context: Context::Documents(TWO_HOP_DOCS.iter().map(|d| d.to_string()).collect()),
        query: TWO_HOP_QUERY.into(),
        system: None,
        answer_prefix: None,
    }
}

fn quality(r: &RunResult) -> &Quality {
    r.quality.as_ref().unwrap_or_else(|| panic!("verified, but no quality: {:?}", r.verify_error))
}

#[test]
fn full_prefill_verified_against_itself_is_exact() {
    let r = run(&gate_request(), RunOptions { method: Method::Full, verify: true, ..Default::default() });
    let q = quality(&r);
    assert_eq!(q.kl, 0.0, "the same computation twice");
    assert!(q.top1);
    assert_eq!(q.agree_tokens, r.tokens.len());
    assert_eq!(q.answer_tokens, r.tokens.len());
    assert_eq!(q.exact_method, Method::Full);
    assert_eq!(q.exact_answer, r.answer);
    assert!(q.exact_ttft_ms > 0.0);
    assert!(!q.breached && !q.fell_back && q.floor.is_none());
}

#[test]
fn jobs_asking_the_same_request_in_turn_share_one_exact_computation() {
    let req = two_hops();
    let e = engine();
    let verified = |method, max_new_tokens| {
        let opts = RunOptions { method, ratio: 0.3, verify: true, max_new_tokens, ..Default::default() };
        e.run(&req, &opts, &mut |_| true).expect("run")
    };
    let first = verified(Method::None, 14);
    let second = verified(Method::Infoflow, 14);
    let (q1, q2) = (quality(&first).clone(), quality(&second).clone());
    assert!(!q1.exact_reused, "the first job computes the exact answer");
    assert!(q2.exact_reused, "the second job with the same request reuses it");
    assert_eq!((q2.exact_answer.as_str(), q2.exact_ttft_ms), (q1.exact_answer.as_str(), q1.exact_ttft_ms));
    // The reused answer judges as one computed for the job alone would.
    let alone = run(&req, RunOptions { method: Method::Infoflow, ratio: 0.3, verify: true, ..Default::default() });
    let qa = quality(&alone);
    assert!(!qa.exact_reused);
    assert_eq!((q2.kl, q2.top1, q2.agree_tokens), (qa.kl, qa.top1, qa.agree_tokens));
    assert_eq!(q2.exact_answer, qa.exact_answer);
    // Another answer length is another exact answer.
    assert!(!quality(&verified(Method::Infoflow, 6)).exact_reused);
}

#[test]
fn a_damaged_selection_breaches_the_floor_and_falls_back_or_is_flagged() {
    let req = two_hops();
    let plain = run(&req, RunOptions { method: Method::None, ..Default::default() });
    let exact = run(&req, RunOptions { method: Method::Full, ..Default::default() });
    let verified = run(&req, RunOptions { method: Method::None, verify: true, ..Default::default() });
    let q = quality(&verified).clone();
    eprintln!(
        "none against full: KL {:.4}, top-1 {}, {} of {} tokens agree; none {:?}, full {:?}",
        q.kl, q.top1, q.agree_tokens, q.answer_tokens, plain.answer, exact.answer
    );
    assert!(q.kl > 0.0, "no recomputation moves the first token's distribution");
    assert!(exact.answer.contains(TWO_HOP_ANSWER) && plain.answer.contains(TWO_HOP_WRONG), "the case damages `none`");
    assert!(q.agree_tokens < q.answer_tokens, "the answers part where the number starts");
    assert_eq!(verified.answer, plain.answer, "without a floor the answer is the one computed");
    assert_eq!(q.exact_answer, exact.answer, "the exact twin is full prefill's answer");
    // Held to a floor below its KL: the exact answer replaces it, or it is marked.
    let floor = q.kl / 2.0;
    let gated = RunOptions { method: Method::None, verify: true, quality_floor: Some(floor), ..Default::default() };
    let fell = run(&req, gated.clone());
    let fq = quality(&fell);
    assert!(fq.breached && fq.fell_back, "{fq:?}");
    assert_eq!(fell.answer, exact.answer, "fallback answers from the exact computation");
    assert!(fell.answer.contains(TWO_HOP_ANSWER));
    assert_eq!(fell.tokens, exact.tokens);
    let flagged = run(&req, RunOptions { on_breach: OnBreach::Flag, ..gated });
    let gq = quality(&flagged);
    assert!(gq.breached && !gq.fell_back, "{gq:?}");
    assert_eq!(flagged.answer, plain.answer, "flag keeps the answer");
    // A floor above the KL passes.
    let passed = run(
        &req,
        RunOptions { method: Method::None, verify: true, quality_floor: Some(q.kl * 2.0), ..Default::default() },
    );
    assert!(!quality(&passed).breached);
}

#[test]
fn on_several_ranks_the_exact_twin_is_ring_attention() {
    let lm = flowprefill_tests::shared_model();
    let mut world = ThreadRanks::new(lm, 3, 1 << 30, Duration::from_secs(60)).expect("ranks");
    let req = gate_request();
    let job = Job {
        request: req.clone(),
        options: RunOptions { method: Method::Infoflow, verify: true, max_new_tokens: 6, ..Default::default() },
    };
    let r = world.run(&job, &mut |_| true).expect("verified on 3 ranks");
    let q = quality(&r);
    assert_eq!(q.exact_method, Method::Ring);
    // The world goes on: the next job (unverified) runs as before.
    let plain = Job { request: req, options: RunOptions { verify: false, ..job.options.clone() } };
    let again = world.run(&plain, &mut |_| true).expect("the next job");
    assert_eq!(again.answer, r.answer, "verification leaves the answer as computed");
    assert!(again.quality.is_none());
}

#[test]
fn bad_gate_values_name_their_field() {
    let req = gate_request();
    let e = engine();
    let field = |opts: RunOptions| match e.run(&req, &opts, &mut |_| true) {
        Err(CoordError::Input(i)) => i.field,
        other => panic!("expected a field error, got {:?}", other.map(|r| r.answer)),
    };
    assert_eq!(
        field(RunOptions { verify: true, quality_floor: Some(-0.1), ..Default::default() }),
        Field::QualityFloor
    );
    assert_eq!(
        field(RunOptions { verify: true, quality_floor: Some(f64::NAN), ..Default::default() }),
        Field::QualityFloor
    );
    assert_eq!(
        field(RunOptions { quality_floor: Some(0.1), ..Default::default() }),
        Field::QualityFloor,
        "a gate without verification"
    );
}
