//! The memory plan of a job (`coordinator::memory`) against the bytes the engine really takes:
//! the real model on the CPU behind a ledger that counts every buffer and weight matrix
//! (`flowprefill_tests::limited`), contexts of 1K and 3K tokens, every shape of the plan. The
//! plan's peak must be within 5% of the counted peak (the bytes above what the ranks held
//! before the job). Then admission: a job the plan says does not fit is refused before any
//! work (TooLarge: HTTP 413, exit 2) naming what it needs and what is free; the chunk store
//! gives back its entries when that lets a job fit, at admission and after running out of
//! memory during the work.

use flowprefill_coordinator::layout::Layout;
use flowprefill_coordinator::memory::{plan_for, RankMemory};
use flowprefill_coordinator::{Context, ErrorClass, Evict, EvictPolicy, Job, Method, Request, RunOptions, ThreadRanks};
use flowprefill_tests::limited::{Ledger, Limited};
use flowprefill_worker::LoadedModel;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// The tests share one model and its ledger: one at a time (a limit set by one would refuse
/// another's job).
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn model() -> Arc<LoadedModel<Limited>> {
    static LM: OnceLock<Arc<LoadedModel<Limited>>> = OnceLock::new();
    LM.get_or_init(|| {
        Arc::new(LoadedModel::load(&flowprefill_tests::default_model_path(), Limited::default()).expect("model"))
    })
    .clone()
}

/// A text of `tokens` tokens of generated prose, cut into four chunks.
fn request(lm: &LoadedModel<Limited>, tokens: usize, seed: u64) -> Request {
    let prose = flowprefill_lab::corpus::prose(seed, tokens * 6);
    let ids = lm.tokenizer.encode_text(&prose).expect("tokenize");
    let text = lm.tokenizer.decode(&ids[..tokens.min(ids.len())]).expect("decode");
    Request {
        conversation: Default::default(),
        context: Context::Text { text, chunk_tokens: tokens / 4 },
        query: "Which city is named most often in the text?".into(),
        system: None,
        answer_prefix: None,
    }
}

/// Waits (up to 20 s) until the ledger holds at most `held` bytes (other ranks drop their
/// buffers after rank 0 answers).
fn settle(ledger: &Ledger, held: usize) {
    let t = std::time::Instant::now();
    while ledger.in_use() > held && t.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn mib(b: usize) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

/// How far the plan's peak may be from the counted peak (the README quotes this bound).
const PLAN_TOL: f64 = 0.05;

/// Over several ranks the plan bounds a rank's share of the selection as if every selected token
/// of a recompute batch were its own (the query's attention concentrates on the documents it is
/// about); the even share the run may take is up to this much below the plan (6.1% measured for
/// InfoFlow on 2 ranks at 2K and 4K, 2026-11-28; 6.2% and 6.0% at 1K and 3K, 2026-11-30). Below the counted peak the tolerance stays
/// `PLAN_TOL`: a plan that under-counts admits a job that then runs out of memory.
const PLAN_BOUND_TOL: f64 = 0.10;

#[test]
fn the_plan_is_within_five_percent_of_the_counted_peak_at_1k_and_3k() {
    let _serial = one_at_a_time();
    let lm = model();
    let ledger = lm.model.backend().ledger().clone();
    // Every shape of the plan: full prefill, InfoFlow, CacheBlend's probe through every token,
    // InfoFlow on two ranks, ring attention, and full prefill then eviction (whose context cache
    // goes to the store with no second copy). The plan is a sum of terms linear or quadratic in
    // the length; two lengths pin both, and 3K runs the full prefill in two forwards of the
    // backend's size (2K on the CPU) where 1K runs it in one. (8K was also checked until
    // 2026-11-25 and agreed, at a CPU cost of about 100 s per CI run; 2K and 4K until 2026-11-30,
    // 119 s.)
    let snapkv = Some(Evict { policy: EvictPolicy::Snapkv, budget: 64 });
    let cases: &[(Method, usize, Option<Evict>)] = &[
        (Method::Full, 1, None),
        (Method::Infoflow, 1, None),
        (Method::Cacheblend, 1, None),
        (Method::Infoflow, 2, None),
        (Method::Ring, 2, None),
        (Method::Full, 1, snapkv),
    ];
    let mut worst: f64 = 0.0;
    let mut failures = Vec::new();
    eprintln!(
        "{:>7} {:>11} {:>5} {:>10} {:>10} {:>7}  plan's peak",
        "tokens", "method", "ranks", "counted", "planned", "error"
    );
    for tokens in [1024usize, 3072] {
        let req = request(&lm, tokens, 7);
        let layout = Layout::build(&lm, &req).expect("layout");
        for &(method, ranks, evict) in cases {
            let opts = RunOptions { method, evict, max_new_tokens: 4, ..RunOptions::default() };
            // A store of no bytes: the job's chunk caches are its own (held while it runs).
            let mut world = ThreadRanks::new(lm.clone(), ranks, 0, Duration::from_secs(600)).expect("world");
            let job = Job { request: req.clone(), options: opts.clone() };
            let before = ledger.in_use();
            ledger.reset_peak();
            let r = world.run(&job, &mut |_| true).expect("the job runs");
            let counted = ledger.peak() - before;
            let phases: Vec<String> =
                ledger.phase_peaks().iter().map(|(p, b)| format!("{p} {:.1}", mib(b - before.min(*b)))).collect();
            drop(world);
            settle(&ledger, before);
            if ranks == 1 {
                // The engine's own figure (RankStats::memory_peak, what `run --stats` prints
                // beside the plan) is the ledger's.
                assert_eq!(r.rank_stats[0].memory_peak, Some(counted), "{method:?} at {tokens}");
            }
            let plans: Vec<RankMemory> = plan_for(&lm, &opts, ranks, &layout);
            let planned: usize = plans.iter().map(RankMemory::bytes).sum();
            let err = (planned as f64 - counted as f64) / counted as f64;
            worst = worst.max(err.abs());
            eprintln!(
                "{:>7} {:>11} {:>5} {:>8.1}Mi {:>8.1}Mi {:>+6.1}%  {} ({}); counted by phase: {}",
                r.n_context_tokens,
                format!("{}{}", method.name(), if evict.is_some() { "+evict" } else { "" }),
                ranks,
                mib(counted),
                mib(planned),
                100.0 * err,
                plans[0].phase,
                plans[0].describe(),
                phases.join(", ")
            );
            let over = if ranks > 1 && method.selects() { PLAN_BOUND_TOL } else { PLAN_TOL };
            if err < -PLAN_TOL || err > over {
                failures.push(format!("{tokens} tokens, {method:?} ({evict:?}) on {ranks}: {:+.1}%", 100.0 * err));
            }
        }
    }
    eprintln!("largest error {:.1}%", 100.0 * worst);
    assert!(
        failures.is_empty(),
        "the plan is more than {:.0}% below or {:.0}% above (a selection bound: {:.0}%) the counted peak: {failures:?}",
        100.0 * PLAN_TOL,
        100.0 * PLAN_TOL,
        100.0 * PLAN_BOUND_TOL
    );
}

/// The full prefill runs forwards of the backend's size (`Backend::prefill_rows`: 2048 tokens
/// on the CPU, 8192 on a GPU) and the plan follows: 4K tokens in one forward, as a GPU runs
/// them, hold more than in two, and the plan says so within the same bound.
#[test]
fn a_full_prefill_in_forwards_of_the_backends_size_is_planned_as_it_runs() {
    let _serial = one_at_a_time();
    let lm = model();
    let ledger = lm.model.backend().ledger().clone();
    let req = request(&lm, 4096, 7);
    let layout = Layout::build(&lm, &req).expect("layout");
    let opts = RunOptions { method: Method::Full, max_new_tokens: 4, ..RunOptions::default() };
    let mut peaks = Vec::new();
    for rows in [flowprefill_kernels::PREFILL_ROWS, 4096] {
        ledger.set_prefill_rows(rows);
        let mut world = ThreadRanks::new(lm.clone(), 1, 0, Duration::from_secs(600)).expect("world");
        let before = ledger.in_use();
        ledger.reset_peak();
        let run = world.run(&Job { request: req.clone(), options: opts.clone() }, &mut |_| true);
        let counted = ledger.peak() - before;
        drop(world);
        settle(&ledger, before);
        let planned = plan_for(&lm, &opts, 1, &layout)[0].bytes();
        ledger.set_prefill_rows(flowprefill_kernels::PREFILL_ROWS);
        run.expect("the job runs");
        let err = (planned as f64 - counted as f64) / counted as f64;
        eprintln!(
            "forwards of {rows}: counted {:.1} MiB, planned {:.1} MiB ({:+.1}%)",
            mib(counted),
            mib(planned),
            100.0 * err
        );
        assert!(err.abs() <= PLAN_TOL, "forwards of {rows} tokens: the plan is {:+.1}% off", 100.0 * err);
        peaks.push(counted);
    }
    // One forward of 4K rows holds the activations of 4K rows, not 2K: the setting was used.
    assert!(peaks[1] > peaks[0] + peaks[0] / 10, "peaks {peaks:?}: the larger forwards were not run");
}

fn job(req: Request) -> Job {
    Job { request: req, options: RunOptions { method: Method::Infoflow, max_new_tokens: 4, ..RunOptions::default() } }
}

fn need(lm: &LoadedModel<Limited>, job: &Job) -> usize {
    let layout = Layout::build(lm, &job.request).expect("layout");
    plan_for(lm, &job.options, 1, &layout)[0].bytes()
}

#[test]
fn a_job_that_cannot_fit_is_refused_before_any_work_and_says_what_to_change() {
    let _serial = one_at_a_time();
    let lm = model();
    let ledger = lm.model.backend().ledger().clone();
    let job = job(request(&lm, 2048, 11));
    let need = need(&lm, &job);
    let mut world = ThreadRanks::new(lm.clone(), 1, 0, Duration::from_secs(300)).expect("world");
    let held = ledger.in_use();
    ledger.set_limit(held + need / 2);
    ledger.reset_peak();
    let refused = ledger.refused();
    let e = world.run(&job, &mut |_| true).expect_err("half the memory the job needs");
    let msg = e.to_string();
    assert_eq!(e.class(), ErrorClass::TooLarge, "{msg}");
    for want in ["the job needs", "on limited", "is free", "fewer context tokens", "more ranks", "--kv-dtype bf16"] {
        assert!(msg.contains(want), "{want:?} missing from: {msg}");
    }
    assert_eq!(ledger.refused(), refused, "the allocator was asked for memory: {msg}");
    assert_eq!(ledger.peak(), held, "the refused job allocated something");
    // With its plan and 5% to spare it runs.
    ledger.set_limit(held + need + need / 20);
    let r = world.run(&job, &mut |_| true).unwrap_or_else(|e| panic!("the plan's bytes were not enough: {e}"));
    ledger.set_limit(usize::MAX);
    assert!(!r.tokens.is_empty());
    eprintln!("refused with {} free: {msg}", need / 2);
}

/// The refusal advises more ranks only where they would make room: not for `full` (rank 0
/// holds the whole context), not for thread ranks over one model (they share its device: their
/// plans add up on it). Each says why instead.
#[test]
fn a_refusal_advises_more_ranks_only_where_they_would_make_room() {
    let _serial = one_at_a_time();
    let lm = model();
    let ledger = lm.model.backend().ledger().clone();
    let cases = [
        (Method::Infoflow, 1, None),
        (Method::Full, 1, Some("`full` holds the whole context on rank 0")),
        (Method::Infoflow, 2, Some("the job's 2 ranks share the memory of limited")),
    ];
    for (method, ranks, why) in cases {
        let mut job = job(request(&lm, 2048, 13));
        job.options.method = method;
        let mut world = ThreadRanks::new(lm.clone(), ranks, 0, Duration::from_secs(300)).expect("world");
        ledger.set_limit(ledger.in_use() + (64 << 10));
        let e = world.run(&job, &mut |_| true).expect_err("no job fits in 64 KiB");
        ledger.set_limit(usize::MAX);
        let msg = e.to_string();
        assert_eq!(e.class(), ErrorClass::TooLarge, "{msg}");
        assert!(msg.contains("fewer context tokens") && msg.contains("--kv-dtype bf16"), "{msg}");
        assert_eq!(msg.contains("more ranks"), why.is_none(), "{method:?} on {ranks}: {msg}");
        if let Some(why) = why {
            assert!(msg.contains(why), "{why:?} missing from: {msg}");
        }
    }
}

#[test]
fn the_chunk_store_gives_back_its_entries_when_that_lets_a_job_fit() {
    let _serial = one_at_a_time();
    let lm = model();
    let ledger = lm.model.backend().ledger().clone();
    let mut world = ThreadRanks::new(lm.clone(), 1, 1 << 30, Duration::from_secs(300)).expect("world");
    let store = |w: &ThreadRanks<Limited>| w.leader().store().stats();
    world.run(&job(request(&lm, 2048, 21)), &mut |_| true).expect("first job");

    // At admission: free memory alone is short of the job, the store's entries make it fit.
    let b = job(request(&lm, 2048, 22));
    let (held, kept) = (ledger.in_use(), store(&world).bytes);
    assert!(kept > 0, "the store kept nothing");
    ledger.set_limit(held + need(&lm, &b) - kept / 2);
    let evicted = store(&world).evictions;
    world.run(&b, &mut |_| true).unwrap_or_else(|e| panic!("admission did not make room: {e}"));
    ledger.set_limit(usize::MAX);
    assert!(store(&world).evictions > evicted, "nothing was evicted at admission");

    // During the work: another tenant takes memory in the probe; the job fails as a resource
    // error, the store gives back what the same job lacks now, and the retry fits beside the
    // tenant.
    let c = job(request(&lm, 2048, 23));
    let (held, kept) = (ledger.in_use(), store(&world).bytes);
    let margin = 8 << 20;
    ledger.set_limit(held + need(&lm, &c) + margin);
    ledger.tenant_in(flowprefill_coordinator::timings::phase::PROBE, margin + kept / 2);
    let evicted = store(&world).evictions;
    let e = world.run(&c, &mut |_| true).expect_err("the tenant took the memory");
    assert_eq!(e.class(), ErrorClass::Resource, "{e}");
    assert!(store(&world).evictions > evicted, "nothing was evicted after running out of memory: {e}");
    let r = world.run(&c, &mut |_| true).unwrap_or_else(|e| panic!("the retry beside the tenant: {e}"));
    assert!(!r.tokens.is_empty());
    ledger.tenant_leaves();
    ledger.set_limit(usize::MAX);
}

/// Where two results of InfoFlow may differ when a GPU gathers the segments' keys into one
/// attention call instead of one call per segment and a merge each (relative to the largest
/// first-token logit): the same keys and positions, the softmax's sums in another order (f32).
const GATHERED_LOGITS_TOL: f32 = 2e-5;

/// A backend that gathers the segments' keys into fewer attention calls (`Backend::
/// gathered_keys`, as a GPU does) runs InfoFlow to the same selection and answer in fewer calls,
/// and the plan counts the gathered copy: within the same bound of the counted peak.
#[test]
fn gathering_the_segments_keys_gives_the_same_answer_in_fewer_calls_as_planned() {
    let _serial = one_at_a_time();
    let lm = model();
    let ledger = lm.model.backend().ledger().clone();
    let req = request(&lm, 2048, 11);
    let layout = Layout::build(&lm, &req).expect("layout");
    let opts = RunOptions { method: Method::Infoflow, max_new_tokens: 4, ..RunOptions::default() };
    let mut runs = Vec::new();
    // One call per segment; runs of at most 1,100 keys (two chunks of 512 and the head, then
    // the rest); every segment in one call.
    for keys in [0usize, 1100, 1 << 20] {
        ledger.set_gathered_keys(keys);
        let mut world = ThreadRanks::new(lm.clone(), 1, 0, Duration::from_secs(600)).expect("world");
        let before = ledger.in_use();
        ledger.reset_peak();
        let calls = ledger.attention_calls();
        let r = world.run(&Job { request: req.clone(), options: opts.clone() }, &mut |_| true);
        let calls = ledger.attention_calls() - calls;
        let counted = ledger.peak() - before;
        drop(world);
        settle(&ledger, before);
        let planned = plan_for(&lm, &opts, 1, &layout)[0].bytes();
        ledger.set_gathered_keys(0);
        let r = r.expect("the job runs");
        let err = (planned as f64 - counted as f64) / counted as f64;
        eprintln!(
            "gathering up to {keys} keys: {calls} attention calls, counted {:.1} MiB, planned {:.1} MiB ({:+.1}%)",
            mib(counted),
            mib(planned),
            100.0 * err
        );
        assert!(err.abs() <= PLAN_TOL, "gathering up to {keys} keys: the plan is {:+.1}% off", 100.0 * err);
        runs.push((keys, calls, r));
    }
    let (_, calls, base) = &runs[0];
    let scale = base.first_logits.iter().fold(0f32, |m, x| m.max(x.abs()));
    for (keys, c, r) in &runs[1..] {
        assert!(c < calls, "gathering up to {keys} keys made {c} attention calls, one per segment {calls}");
        assert_eq!(r.selected_rows, base.selected_rows, "gathering up to {keys} keys selected other tokens");
        assert_eq!(r.tokens, base.tokens, "gathering up to {keys} keys answered otherwise");
        let diff = flowprefill_kernels::testing::max_abs_diff(&r.first_logits, &base.first_logits);
        eprintln!(
            "gathering up to {keys} keys: first-token logits {diff:.2e} from one call per segment (scale {scale:.1})"
        );
        assert!(
            diff <= GATHERED_LOGITS_TOL * scale,
            "gathering up to {keys} keys: first-token logits {diff} apart (scale {scale})"
        );
    }
}
