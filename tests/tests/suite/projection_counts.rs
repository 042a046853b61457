//! The projection's work accounting against the real engine: a backend that counts what the
//! model actually runs (GEMM FLOPs, visible attention pairs, score pairs) per rank thread, and
//! the communicator's own byte counters per collective, must equal what
//! `flowprefill_lab::project::plan` derives for the same request. If the pipeline changes (a new
//! forward, another attention pattern, another message), this test fails until the projection
//! follows. A second test pins the engine to the pipeline's step list: on every rank it times
//! exactly the phases of `Pipeline::steps`, in that order, for every kind of selection.

use flowprefill_coordinator::pipeline::Pipeline;
use flowprefill_coordinator::{Method, PrefixMode, RunOptions, Scope};
use flowprefill_lab::project::{plan, Request};
use flowprefill_tests::counting::{needle_request, per_thread, run_counted, Counting, Ran};
use flowprefill_worker::LoadedModel;
use std::sync::Arc;

/// The collectives the projection accounts for byte by byte.
const COUNTED_OPS: &[&str] = &[
    "ring.kv",
    "probe.gather",
    "probe.merged",
    "final.gather",
    "final.merged",
    "recompute.q",
    "recompute.partials",
    "recompute.kv",
];

fn key(r: &Ran) -> (u64, u64, u64) {
    (r.gemm_flops as u64, r.attn_pairs, r.score_pairs)
}

#[test]
fn projected_work_equals_what_the_engine_runs() {
    let path = flowprefill_tests::default_model_path();
    let lm = Arc::new(LoadedModel::load(&path, Counting::default()).expect("model loads"));
    let shape = lm.model.config().clone();
    let request = needle_request();
    let cases: Vec<(&str, usize, RunOptions)> = vec![
        ("full", 1, RunOptions { method: Method::Full, ..RunOptions::default() }),
        ("ring P=2", 2, RunOptions { method: Method::Ring, ..RunOptions::default() }),
        ("ring P=3", 3, RunOptions { method: Method::Ring, ..RunOptions::default() }),
        ("infoflow P=1", 1, RunOptions::default()),
        ("infoflow exact P=2", 2, RunOptions::default()),
        ("infoflow exact P=3, batches of 7", 3, RunOptions { ratio: 0.2, recompute_batch: 7, ..RunOptions::default() }),
        ("infoflow sparse P=2", 2, RunOptions { scope: Scope::Sparse, recompute_batch: 5, ..RunOptions::default() }),
        (
            "infoflow shared prefix P=2",
            2,
            RunOptions { prefix: Some(PrefixMode::Shared), ratio: 0.3, ..RunOptions::default() },
        ),
        ("none P=2", 2, RunOptions { method: Method::None, ..RunOptions::default() }),
    ];
    for (name, ranks, opts) in cases {
        let (r, ran) = run_counted(&lm, name, ranks, &request, &opts);
        let ran = per_thread(&ran);
        let work =
            plan(&shape, &opts, ranks, &Request::of_run(&r), r.kv_bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
        let projected: Vec<Ran> = (0..ranks)
            .map(|rank| {
                let c = work.rank_counts(rank, &shape, 4.0, 4.0);
                Ran {
                    gemm_flops: c.gemm_flops,
                    attn_pairs: c.attn_pair_layers,
                    score_pairs: c.score_pair_layers,
                    ..Ran::default()
                }
            })
            .collect();
        // Ranks with no work at all never call the backend.
        let mut got: Vec<(u64, u64, u64)> = ran.iter().map(key).collect();
        let mut want: Vec<(u64, u64, u64)> = projected.iter().map(key).filter(|k| *k != (0, 0, 0)).collect();
        got.sort_unstable();
        want.sort_unstable();
        assert_eq!(got, want, "{name}: (GEMM FLOPs, attention pairs x layers, score pairs x layers) per rank");
        // Bytes of every accounted collective, per rank.
        for (rank, stats) in r.rank_stats.iter().enumerate() {
            for op in COUNTED_OPS {
                let real = stats.comm.ops.get(*op).map_or((0, 0, 0), |o| (o.calls, o.bytes_sent, o.bytes_received));
                let mut calls = 0u64;
                let (mut sent, mut received) = (0u64, 0u64);
                for m in work.per_rank[rank].iter().flat_map(|p| &p.messages).filter(|m| m.op == *op) {
                    calls += m.calls as u64;
                    sent += m.sent * m.calls as u64;
                    received += m.received * m.calls as u64;
                }
                assert_eq!(real, (calls, sent, received), "{name}: rank {rank} `{op}` (calls, sent, received)");
            }
        }
        eprintln!(
            "{name}: {} ranks agree (GEMM {:.3} GFLOP, {} attention pairs x layers on the busiest rank)",
            ranks,
            projected.iter().map(|p| p.gemm_flops).fold(0.0, f64::max) / 1e9,
            projected.iter().map(|p| p.attn_pairs).max().unwrap_or(0)
        );
    }
}

#[test]
fn the_engine_runs_the_steps_of_its_pipeline() {
    let path = flowprefill_tests::default_model_path();
    let lm = Arc::new(LoadedModel::load(&path, Counting::default()).expect("model loads"));
    let n_layers = lm.model.config().n_layers;
    let request = needle_request();
    let opts = |method, ratio| RunOptions { method, ratio, ..RunOptions::default() };
    let snapkv = flowprefill_coordinator::Evict { policy: flowprefill_coordinator::EvictPolicy::Snapkv, budget: 32 };
    let cases: Vec<(&str, usize, RunOptions)> = vec![
        ("infoflow P=2", 2, opts(Method::Infoflow, 0.15)),
        ("infoflow ratio 0 P=2", 2, opts(Method::Infoflow, 0.0)),
        ("infoflow ratio 1 P=2", 2, opts(Method::Infoflow, 1.0)),
        ("epic P=3", 3, opts(Method::Epic, 0.2)),
        ("cacheblend P=1", 1, opts(Method::Cacheblend, 0.15)),
        ("none P=2", 2, opts(Method::None, 0.15)),
        ("infoflow+reorder P=2", 2, RunOptions { reorder: true, ..opts(Method::Infoflow, 0.15) }),
        ("none+reorder P=1", 1, RunOptions { reorder: true, ..opts(Method::None, 0.15) }),
        ("infoflow evicting P=2", 2, RunOptions { evict: Some(snapkv), ..opts(Method::Infoflow, 0.15) }),
    ];
    for (name, ranks, o) in cases {
        let (r, _) = run_counted(&lm, name, ranks, &request, &o);
        let pipe = Pipeline::new(&o, &r.chunk_tokens, ranks, n_layers);
        let want: Vec<&str> = pipe.steps().iter().map(|s| s.phase()).collect();
        assert_eq!(r.rank_stats.len(), ranks, "{name}");
        for (rank, stats) in r.rank_stats.iter().enumerate() {
            let got: Vec<&str> = stats
                .phases
                .iter()
                .map(|(p, _)| p.as_str())
                .filter(|p| !matches!(*p, "first_token" | "decode"))
                .collect();
            assert_eq!(got, want, "{name}: rank {rank} timed other phases than its pipeline's steps");
        }
        eprintln!("{name}: every rank ran {want:?}");
    }
}
