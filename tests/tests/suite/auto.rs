//! `--method auto` (issue 53, item 4) on the real model with the projection's chooser (no
//! history file): full prefill for a context of one chunk and on a cold store under a tight
//! floor; a cached approximate method once the chunks are in the store; the verified answers
//! it learns from replace the prior; `auto` without a chooser is a field error.

use flowprefill_coordinator::auto::Chooser;
use flowprefill_coordinator::{Engine, Method, Request, RunOptions};
use flowprefill_lab::auto::ProjectedChooser;
use flowprefill_lab::project::Profiles;
use flowprefill_tests::{shared_model, small_docs};
use flowprefill_worker::{Cpu, Field};
use std::sync::Arc;

fn chooser() -> Arc<ProjectedChooser> {
    Arc::new(ProjectedChooser::new(Profiles::builtin().expect("profiles"), "cpu-local", "cpu-threads", None).unwrap())
}

fn engine(c: &Arc<ProjectedChooser>) -> Engine<Cpu> {
    let c: Arc<dyn Chooser> = c.clone();
    Engine::new(shared_model(), 1 << 30).with_chooser(Some(c))
}

fn request(docs: Vec<String>) -> Request {
    flowprefill_tests::gate_question(docs)
}

fn auto(floor: Option<f64>) -> RunOptions {
    RunOptions { method: Method::Auto, quality_floor: floor, max_new_tokens: 4, ..RunOptions::default() }
}

#[test]
fn one_chunk_and_a_cold_store_go_to_full_prefill_and_held_chunks_to_an_approximate_method() {
    let c = chooser();
    let e = engine(&c);
    let one = request(vec![small_docs().join(" ")]);
    let r = e.run(&one, &auto(None), &mut |_| true).expect("one chunk");
    let a = r.auto.as_ref().expect("the choice is reported");
    assert_eq!((r.method, a.chosen().map(|c| c.label.as_str())), (Method::Full, Some("full")), "{}", a.why);
    assert!(a.why.contains("one chunk"), "{}", a.why);
    // Several chunks, nothing in the store, a floor only exact methods meet: full.
    let req = request(small_docs());
    let r = e.run(&req, &auto(Some(0.01)), &mut |_| true).expect("cold");
    let a = r.auto.as_ref().expect("choice");
    assert_eq!(r.method, Method::Full, "{}", a.why);
    assert!(a.candidates.iter().any(|c| c.label != "full"), "approximate candidates were weighed: {a:?}");
    assert!(a.candidates.iter().filter(|c| c.label != "full").all(|c| !c.meets), "{a:?}");
    // The chunks in the store (an InfoFlow job made them): an approximate method is faster,
    // and at the default floor InfoFlow's prior meets it.
    e.run(&req, &RunOptions { method: Method::Infoflow, max_new_tokens: 1, ..RunOptions::default() }, &mut |_| true)
        .expect("fills the store");
    let r = e.run(&req, &auto(None), &mut |_| true).expect("warm");
    let a = r.auto.as_ref().expect("choice");
    assert_eq!(r.method, Method::Infoflow, "{}", a.why);
    assert_eq!(r.cache_misses, 0, "it reads the held chunks");
    let (full, chosen) = (&a.candidates[0], a.chosen().expect("winner"));
    assert!(chosen.ttft_ms < full.ttft_ms && chosen.meets && a.why.contains("chunks in the store"), "{a:?}");
    // What verified answers show replaces the prior: `none` verified close to exact wins.
    let none = |r: &flowprefill_coordinator::RunResult| r.method == Method::None;
    for _ in 0..flowprefill_lab::auto::HISTORY_MIN {
        c.learn(&shared_model().fingerprint, "none", 0.001, 0.0);
    }
    let r = e.run(&req, &auto(None), &mut |_| true).expect("after learning");
    let a = r.auto.as_ref().expect("choice");
    assert!(none(&r) && a.chosen().is_some_and(|c| c.quality_from.starts_with("history")), "{a:?}");
}

/// A job that fails after `auto` chose still makes its choice known (a service labels its
/// metrics by the method that ran), and the tally of the answer's tokens follows the answer.
#[test]
fn a_job_that_fails_after_the_choice_still_says_what_was_chosen() {
    use flowprefill_coordinator::fault::{FaultMode, FaultPlan};
    use flowprefill_coordinator::{Control, Job, JobProgress};
    let c: Arc<dyn Chooser> = chooser();
    // Full prefill's phase fails once (injected): one chunk makes `auto` choose full.
    let e = Engine::new(shared_model(), 1 << 30).with_chooser(Some(c)).with_faults(Some(FaultPlan::new(
        0,
        "prefill",
        FaultMode::OutOfMemory,
    )));
    let mut solo = flowprefill_comm::local::LocalComm::group(1).pop().expect("a world of one");
    let job = |options| Job { request: request(vec![small_docs().join(" ")]), options };
    let run = |solo: &mut flowprefill_comm::local::LocalComm, options| {
        let progress = Arc::new(JobProgress::default());
        let ctl = Control { progress: Some(progress.clone()), ..Control::default() };
        (e.lead_with(solo, &job(options), ctl, &mut |_| true), progress)
    };
    let (out, progress) = run(&mut solo, auto(None));
    let err = out.expect_err("the injected fault");
    assert!(err.to_string().contains("injected"), "{err}");
    assert_eq!(progress.chosen(), Some((Method::Full, false)), "chosen before the fault");
    assert_eq!(progress.answer_tokens(), 0, "it failed before its first token");
    // A job that names its method has no choice to tell; its tally is its answer's length.
    let (out, progress) = run(&mut solo, RunOptions { method: Method::Full, ..auto(None) });
    let r = out.expect("the fault fired once");
    assert_eq!(progress.chosen(), None);
    assert!(!r.tokens.is_empty() && progress.answer_tokens() == r.tokens.len() as u64, "{}", r.tokens.len());
}

#[test]
fn auto_without_a_chooser_names_the_method_field() {
    let e = Engine::new(shared_model(), 1 << 30);
    let err = e.run(&request(small_docs()), &auto(None), &mut |_| true).unwrap_err();
    let input = match &err {
        flowprefill_coordinator::CoordError::Input(i) => i,
        other => panic!("{other:?}"),
    };
    assert_eq!(input.field, Field::Method, "{err}");
}

#[test]
fn on_two_ranks_the_chunks_every_rank_holds_count() {
    use flowprefill_coordinator::{Job, ThreadRanks};
    let c: Arc<dyn Chooser> = chooser();
    let mut world = ThreadRanks::new(shared_model(), 2, 1 << 30, std::time::Duration::from_secs(60))
        .and_then(|w| w.with_chooser(Some(c)))
        .expect("ranks");
    let req = flowprefill_tests::gate_request();
    let job = |options: RunOptions| Job { request: req.clone(), options };
    let fill = RunOptions { method: Method::Infoflow, max_new_tokens: 1, ..RunOptions::default() };
    world.run(&job(fill), &mut |_| true).expect("fills both ranks' stores");
    let r = world.run(&job(auto(None)), &mut |_| true).expect("auto");
    let a = r.auto.as_ref().expect("choice");
    assert!(a.candidates.iter().any(|c| c.label == "ring"), "several ranks: ring is a candidate: {a:?}");
    assert_eq!(r.method, Method::Infoflow, "{}", a.why);
    assert!(
        a.why.contains("4 of 4 chunks in the store") && r.cache_misses == 0,
        "{} ({} misses)",
        a.why,
        r.cache_misses
    );
}

/// A chooser that always runs full prefill (what `auto` chooses for one chunk or a cold store).
struct AlwaysFull;

impl Chooser for AlwaysFull {
    fn choose(
        &self,
        s: &flowprefill_coordinator::auto::Situation<'_>,
    ) -> Result<(flowprefill_coordinator::auto::Choice, RunOptions), String> {
        let full = flowprefill_coordinator::auto::Candidate {
            label: "full".into(),
            ttft_ms: 1.0,
            expected_kl: 0.0,
            quality_from: "exact".into(),
            meets: true,
        };
        let choice =
            flowprefill_coordinator::auto::Choice { floor: 0.1, candidates: vec![full], winner: 0, why: "test".into() };
        Ok((choice, RunOptions { method: Method::Full, ratio: 1.0, ..s.opts.clone() }))
    }
}

/// Admission plans `auto` as a chunked method (the context spread over the ranks); once it has
/// chosen full prefill (the whole context's K/V on rank 0), every rank checks that plan too: a
/// memory limit on each rank's device between the two refuses the job before any work (it ran
/// past the limit).
#[test]
fn what_auto_chose_is_checked_against_the_memory_limit() {
    use flowprefill_coordinator::layout::Layout;
    use flowprefill_coordinator::memory::plan_for;
    use flowprefill_coordinator::{Job, ThreadRanks};
    let lm = shared_model();
    let req = request(small_docs());
    let layout = Layout::build(&lm, &req).expect("layout");
    // Each rank its own device (as under mpirun): rank 0's plan is what its device must hold.
    let rank0 = |o: &RunOptions| plan_for(&lm, o, 3, &layout)[0].bytes();
    let full = RunOptions { method: Method::Full, ratio: 1.0, ..auto(None) };
    let (planned_auto, planned_full) = (rank0(&auto(None)), rank0(&full));
    assert!(planned_full > planned_auto, "full {planned_full} against auto's {planned_auto}");
    let limit = (planned_auto + planned_full) / 2;
    let c: Arc<dyn Chooser> = Arc::new(AlwaysFull);
    let ranks = || ThreadRanks::per_rank(vec![lm.clone(); 3], 0, std::time::Duration::from_secs(60));
    let mut world =
        ranks().and_then(|w| w.with_memory_limit(Some(limit))).and_then(|w| w.with_chooser(Some(c))).expect("ranks");
    let e = world.run(&Job { request: req.clone(), options: auto(None) }, &mut |_| true).expect_err("refused");
    assert_eq!(e.class(), flowprefill_worker::ErrorClass::TooLarge, "{e}");
    // Full prefill named outright is refused the same way, and auto under a limit it fits runs.
    let e = world.run(&Job { request: req.clone(), options: full }, &mut |_| true).expect_err("refused");
    assert_eq!(e.class(), flowprefill_worker::ErrorClass::TooLarge, "{e}");
    let mut roomy = ranks()
        .and_then(|w| w.with_memory_limit(Some(planned_full * 2)))
        .and_then(|w| w.with_chooser(Some(Arc::new(AlwaysFull) as Arc<dyn Chooser>)))
        .expect("ranks");
    let r = roomy.run(&Job { request: req, options: auto(None) }, &mut |_| true).expect("fits");
    assert_eq!(r.method, Method::Full);
}
