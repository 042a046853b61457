//! KV caches in bf16 (`--kv-dtype bf16`, the default on a GPU) through the whole engine on the
//! CPU backend, so that what the GPU runs is checked on every machine: the same answers as
//! f32 caches for every method, first-token logits within bf16's rounding, the same invariants
//! (N ranks == one rank under the exact scope; a device plane == staging, bit for bit), and
//! every K/V buffer that crosses ranks crosses in bf16 (half the bytes of ring attention's
//! blocks).

use flowprefill_coordinator::{Job, Method, RunOptions, RunResult, Scope, ThreadRanks};
use flowprefill_kernels::DType;
use flowprefill_tests::{default_model_path, gate_request, rel_diff, thread_planes};
use flowprefill_worker::{Cpu, LoadedModel};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// First-token logits with bf16 caches against f32 caches, relative to the logit range: K and
/// V rounded to 8 significant bits (2^-9 relative) through 30 layers. Measured on this request:
/// 1.8e-3 to 2.4e-3 over the six methods.
const BF16_LOGIT_TOL: f32 = 1e-2;
/// P ranks vs one rank with bf16 caches: the merges of partial results associate differently
/// (f32 differences of order 1e-7, as in `sharded_equivalence`, whose f32 tolerance is 2e-4), and
/// a difference that small flips the bf16 rounding of a key or value now and then, which moves
/// that element by 2^-9 of itself: 5.6e-4 measured on 3 ranks (infoflow, exact scope).
const RANKS_LOGIT_TOL: f32 = 2e-3;

fn lm(kv: DType) -> Arc<LoadedModel<Cpu>> {
    static F32: OnceLock<Arc<LoadedModel<Cpu>>> = OnceLock::new();
    static BF16: OnceLock<Arc<LoadedModel<Cpu>>> = OnceLock::new();
    let cell = if kv == DType::Bf16 { &BF16 } else { &F32 };
    cell.get_or_init(|| Arc::new(LoadedModel::load(&default_model_path(), Cpu::with_kv_dtype(kv)).expect("load")))
        .clone()
}

fn run(kv: DType, ranks: usize, plane: bool, opts: RunOptions) -> RunResult {
    let mut world = ThreadRanks::new(lm(kv), ranks, 1 << 30, Duration::from_secs(120)).expect("ranks");
    if plane {
        world = world.with_plane(thread_planes::<Cpu>(ranks)).expect("planes");
    }
    let job = Job { request: gate_request(), options: RunOptions { max_new_tokens: 6, ..opts } };
    world.run(&job, &mut |_| true).unwrap_or_else(|e| panic!("{kv} caches, {ranks} ranks (plane {plane}): {e}"))
}

/// Bytes every rank sent, summed (communicator and plane).
fn bytes_sent(r: &RunResult) -> u64 {
    r.rank_stats.iter().flat_map(|s| s.comm.ops.values()).map(|o| o.bytes_sent).sum()
}

#[test]
fn bf16_caches_answer_like_f32_caches_for_every_method() {
    for m in [Method::Full, Method::None, Method::Infoflow, Method::Cacheblend, Method::Epic, Method::Ring] {
        let opts = RunOptions { method: m, ratio: 0.15, ..Default::default() };
        let ranks = if m == Method::Ring { 2 } else { 1 };
        let (f, b) = (run(DType::F32, ranks, false, opts.clone()), run(DType::Bf16, ranks, false, opts));
        let d = rel_diff(&b.first_logits, &f.first_logits);
        eprintln!("{m}: bf16 vs f32 caches, first-token logits differ by {d:.2e} of their range; {:?}", b.answer);
        assert_eq!(b.tokens, f.tokens, "{m}: the answer changed with bf16 caches");
        assert!(d <= BF16_LOGIT_TOL, "{m}: relative logit difference {d}");
        // The bf16 caches were used: their rounding shows in the logits.
        assert!(d > 0.0, "{m}: bf16 caches gave the f32 caches' logits bit for bit: were they used?");
    }
}

#[test]
fn bf16_caches_keep_the_rank_invariants_and_cross_ranks_in_bf16() {
    let kv = DType::Bf16;
    for (m, scope) in
        [(Method::Infoflow, Scope::Exact), (Method::Infoflow, Scope::Sparse), (Method::Ring, Scope::Exact)]
    {
        let opts = RunOptions { method: m, ratio: 0.15, scope, ..Default::default() };
        let one = if m == Method::Ring {
            run(kv, 1, false, RunOptions { method: Method::Full, ..Default::default() })
        } else {
            run(kv, 1, false, opts.clone())
        };
        let staged = run(kv, 3, false, opts.clone());
        let dev = run(kv, 3, true, opts.clone());
        let tag = format!("{m} {} on 3 ranks, bf16 caches", scope.name());
        assert_eq!(dev.tokens, staged.tokens, "{tag}: answer, plane vs staging");
        assert!(dev.first_logits == staged.first_logits, "{tag}: the plane changed the logits' bits");
        if scope == Scope::Exact {
            assert_eq!(dev.tokens, one.tokens, "{tag}: answer vs one rank");
            let d = rel_diff(&dev.first_logits, &one.first_logits);
            assert!(d <= RANKS_LOGIT_TOL, "{tag}: relative logit difference to one rank {d}");
        }
    }
    // Ring attention moves K/V blocks and little else: in bf16 they are half the bytes.
    let ring = RunOptions { method: Method::Ring, ..Default::default() };
    let (f, b) = (bytes_sent(&run(DType::F32, 3, false, ring.clone())), bytes_sent(&run(DType::Bf16, 3, false, ring)));
    eprintln!("ring on 3 ranks: {f} B sent with f32 caches, {b} B with bf16");
    assert!((b as f64) < 0.6 * f as f64, "ring traffic with bf16 caches: {b} B vs {f} B with f32");
}
