//! Running out of memory is a resource error (`ErrorClass::Resource`: HTTP 503 with
//! Retry-After, exit code 75), in every phase of a job, on any rank: the message says how much
//! more was needed on which device and what is free, every buffer of the failed job is given
//! back, and the next job on the same ranks succeeds with the same answer. The backend is the
//! CPU behind a ledger told to refuse allocations (`flowprefill_tests::limited`), on the real
//! model.

use flowprefill_coordinator::timings::phase;
use flowprefill_coordinator::{ErrorClass, Job, Method, RunOptions, ThreadRanks};
use flowprefill_tests::counting::needle_request;
use flowprefill_tests::limited::{Ledger, Limited};
use flowprefill_worker::LoadedModel;
use std::sync::Arc;
use std::time::Duration;

/// A job's refusal: how much more on which device, what is free, and what would make room:
/// more ranks only where they would (`more_ranks`: the job spreads over ranks on devices of
/// their own).
fn check_refusal(what: &str, e: &dyn std::fmt::Display, class: ErrorClass, more_ranks: bool) {
    let msg = e.to_string();
    assert_eq!(class, ErrorClass::Resource, "{what}: {msg}");
    assert!(msg.contains("out of memory: needs") && msg.contains("more on limited"), "{what}: {msg}");
    let advice =
        if more_ranks { "fewer tokens, more ranks, or --kv-dtype bf16" } else { "fewer tokens or --kv-dtype bf16" };
    assert!(msg.contains("free") && msg.contains(advice), "{what}: {advice:?} missing from {msg}");
    assert_eq!(msg.contains("more ranks"), more_ranks, "{what}: {msg}");
}

/// Waits (up to 20 s) until the ledger holds at most `held` bytes: the rank that failed answers
/// first, the others drop their buffers as they unwind.
fn settle(ledger: &Ledger, held: usize) {
    let t = std::time::Instant::now();
    while ledger.in_use() > held && t.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn loading_past_the_memory_is_a_resource_error() {
    let be = Limited::default();
    be.ledger().set_limit(8 << 20);
    let ledger = be.ledger().clone();
    let e = LoadedModel::load(&flowprefill_tests::default_model_path(), be).err().expect("the weights do not fit");
    let msg = e.to_string();
    // Refused from the shape before any weight was read: 134.5M values as f32, none allocated.
    assert!(msg.contains("needs 0.50 GiB more on limited (8.0 MiB free)"), "{msg}");
    assert_eq!(ledger.peak(), 0, "nothing was allocated");
    assert_eq!(e.class(), ErrorClass::Resource, "{msg}");
    assert!(msg.contains("out of memory: needs") && msg.contains("more on limited"), "{msg}");
    // Neither fewer tokens, more ranks nor bf16 K/V make room for the weights.
    assert!(msg.ends_with("retry when memory is free, or load a smaller model"), "{msg}");
}

#[test]
fn out_of_memory_in_any_phase_fails_the_job_releases_its_memory_and_the_next_job_runs() {
    let lm = Arc::new(LoadedModel::load(&flowprefill_tests::default_model_path(), Limited::default()).unwrap());
    let ledger = lm.model.backend().ledger().clone();
    let weights = ledger.in_use();
    let cases: [(Method, usize, &[&'static str]); 2] = [
        (Method::Full, 1, &[phase::PREFILL, phase::DECODE]),
        (
            Method::Infoflow,
            2,
            &[
                phase::CHUNK_PREFILL,
                phase::ASSEMBLE,
                phase::PROBE,
                phase::RECOMPUTE,
                phase::FINAL_PROMPT,
                phase::DECODE,
            ],
        ),
    ];
    for (method, ranks, phases) in cases {
        let job = Job {
            request: needle_request(),
            options: RunOptions { method, max_new_tokens: 4, ..RunOptions::default() },
        };
        // A store of no bytes keeps only its newest chunk: every job prefills chunks again.
        let mut world = ThreadRanks::new(lm.clone(), ranks, 0, Duration::from_secs(300)).unwrap();
        let first = world.run(&job, &mut |_| true).unwrap();
        // Every rank has dropped the job's buffers once the bytes stop changing.
        std::thread::sleep(Duration::from_millis(500));
        let held = ledger.in_use();
        eprintln!("{method:?} on {ranks}: weights {weights} B, after a job {held} B");
        for &p in phases {
            let what = format!("{method:?} on {ranks} ranks, refused in {p}");
            let refused = ledger.refused();
            ledger.fail_in(Some(p));
            let e = world.run(&job, &mut |_| true).err().unwrap_or_else(|| panic!("{what}: the job succeeded"));
            ledger.fail_in(None);
            assert!(ledger.refused() > refused, "{what}: nothing was refused");
            // `full` holds the context on rank 0; thread ranks over one model share its
            // memory: more ranks would not make room for either.
            check_refusal(&what, &e, e.class(), false);
            settle(&ledger, held);
            assert!(ledger.in_use() <= held, "{what}: {} B held after the failure, {held} B before", ledger.in_use());
            let again = world.run(&job, &mut |_| true).unwrap_or_else(|e| panic!("{what}: the next job failed: {e}"));
            assert_eq!(again.answer, first.answer, "{what}: the next job's answer");
            settle(&ledger, held);
            assert_eq!(ledger.in_use(), held, "{what}: bytes held after the next job");
        }
        // A byte limit just above what the ranks hold between jobs: admission refuses the job
        // (its memory plan does not fit) before any allocation; lifted, it runs.
        ledger.set_limit(held + (64 << 10));
        let refused = ledger.refused();
        let e = world.run(&job, &mut |_| true).expect_err("a job does not fit in 64 KiB");
        assert_eq!(e.class(), ErrorClass::TooLarge, "{method:?}: limit: {e}");
        assert!(e.to_string().contains("the job needs") && e.to_string().contains("on limited"), "{e}");
        assert_eq!(ledger.refused(), refused, "{method:?}: limit: an allocation was tried");
        ledger.set_limit(usize::MAX);
        settle(&ledger, held);
        assert!(
            ledger.in_use() <= held,
            "{method:?}: limit: {} B held after the failure, {held} B before",
            ledger.in_use()
        );
        assert_eq!(world.run(&job, &mut |_| true).unwrap().answer, first.answer);
        settle(&ledger, held);
        assert_eq!(ledger.in_use(), held);
    }
}

/// Ranks on devices of their own (one model each, its own ledger): running out of memory on one
/// advises more ranks for a method that spreads the context over them, and not for `full`,
/// whose whole context is on rank 0 however many ranks there are. Admission's refusal (the plan
/// does not fit) says the same.
#[test]
fn more_ranks_are_advised_only_where_they_spread_the_job_over_devices_of_their_own() {
    let load = || Arc::new(LoadedModel::load(&flowprefill_tests::default_model_path(), Limited::default()).unwrap());
    let lms = vec![load(), load()];
    let ledgers: Vec<_> = lms.iter().map(|lm| lm.model.backend().ledger().clone()).collect();
    let mut world = ThreadRanks::per_rank(lms, 0, Duration::from_secs(300)).unwrap();
    let cases = [(Method::Infoflow, 1, phase::RECOMPUTE, true), (Method::Full, 0, phase::PREFILL, false)];
    for (method, rank, p, more_ranks) in cases {
        let what = format!("{method:?} on 2 devices, rank {rank} refused in {p}");
        let job = Job {
            request: needle_request(),
            options: RunOptions { method, max_new_tokens: 4, ..RunOptions::default() },
        };
        world.run(&job, &mut |_| true).unwrap_or_else(|e| panic!("{what}: the first job failed: {e}"));
        std::thread::sleep(Duration::from_millis(500));
        let held: Vec<usize> = ledgers.iter().map(|l| l.in_use()).collect();
        let refused = ledgers[rank].refused();
        ledgers[rank].fail_in(Some(p));
        let e = world.run(&job, &mut |_| true).err().unwrap_or_else(|| panic!("{what}: the job succeeded"));
        ledgers[rank].fail_in(None);
        assert!(ledgers[rank].refused() > refused, "{what}: nothing was refused");
        check_refusal(&what, &e, e.class(), more_ranks);
        for (l, &h) in ledgers.iter().zip(&held) {
            settle(l, h);
        }

        // Admission: 64 KiB above what rank 0 holds between jobs.
        ledgers[0].set_limit(held[0] + (64 << 10));
        let e = world.run(&job, &mut |_| true).expect_err("a job does not fit in 64 KiB");
        ledgers[0].set_limit(usize::MAX);
        let msg = e.to_string();
        assert_eq!(e.class(), ErrorClass::TooLarge, "{what}: {msg}");
        assert!(msg.contains("the job needs") && msg.contains("give fewer context tokens"), "{what}: {msg}");
        assert_eq!(msg.contains("run on more ranks"), more_ranks, "{what}: {msg}");
        assert_eq!(msg.contains("`full` holds the whole context on rank 0"), !more_ranks, "{what}: {msg}");
        assert!(!msg.contains("share the memory"), "{what}: devices of their own: {msg}");
    }
}
