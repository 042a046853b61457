//! The device path of every distributed step, without a GPU: thread ranks with a device plane
//! (`comm::plane::threads`, NCCL's contract: control rows through the communicator, buffers
//! as grouped point-to-point transfers of lengths known on both sides) give the same bits as
//! the same ranks staging buffers through the communicator, and equal one rank under the
//! exact scope; ring attention over the plane equals full prefill. Three ranks (chunks 1 + 1 +
//! 2; `sharded_equivalence.rs` runs 2 and 4), staging and plane each once per method (2 ranks
//! as well made this the suite's slowest test, 139 s on 2 cores). The plane's traffic is
//! counted beside the communicator's (`<op>@threads`), and only control rows stay on the
//! communicator.

use flowprefill_coordinator::{Job, Method, Request, RunOptions, RunResult, Scope, ThreadRanks};
use flowprefill_tests::{gate_request, rel_diff, thread_planes, RANKS_LOGIT_TOL};
use flowprefill_worker::{Cpu, LoadedModel};
use std::sync::Arc;
use std::time::Duration;

fn lm() -> Arc<LoadedModel<Cpu>> {
    flowprefill_tests::shared_model()
}

fn run(ranks: usize, plane: bool, req: &Request, opts: RunOptions) -> RunResult {
    let mut world = ThreadRanks::new(lm(), ranks, 1 << 30, Duration::from_secs(60)).expect("ranks");
    if plane {
        world = world.with_plane(thread_planes::<Cpu>(ranks)).expect("planes");
    }
    let job = Job { request: req.clone(), options: RunOptions { max_new_tokens: 4, ..opts } };
    world.run(&job, &mut |_| true).unwrap_or_else(|e| panic!("{ranks} ranks (plane: {plane}): {e}"))
}

/// (bytes sent over the plane, bytes sent through the communicator) summed over ranks.
fn traffic(r: &RunResult) -> (u64, u64) {
    let mut plane = 0;
    let mut host = 0;
    for s in &r.rank_stats {
        for (op, o) in &s.comm.ops {
            if op.ends_with("@threads") {
                plane += o.bytes_sent;
            } else {
                host += o.bytes_sent;
            }
        }
    }
    (plane, host)
}

#[test]
fn every_method_over_a_device_plane_equals_staging_bit_for_bit_and_one_rank() {
    let req = gate_request();
    let cases: Vec<(Method, bool, Scope)> = vec![
        (Method::None, false, Scope::Exact),
        (Method::Infoflow, false, Scope::Exact),
        (Method::Infoflow, true, Scope::Exact),
        (Method::Infoflow, false, Scope::Sparse),
        (Method::Prophet, false, Scope::Exact),
        (Method::Cacheblend, false, Scope::Exact),
        (Method::Epic, false, Scope::Exact),
        (Method::Star, false, Scope::Exact),
        (Method::Ring, false, Scope::Exact),
    ];
    let full = run(1, false, &req, RunOptions { method: Method::Full, ..Default::default() });
    for (m, reorder, scope) in cases {
        let opts = RunOptions { method: m, reorder, ratio: 0.15, scope, ..Default::default() };
        // One rank's answer under the exact scope: full prefill for ring attention.
        let one = match (m, scope) {
            (Method::Ring, _) => Some(full.clone()),
            (_, Scope::Exact) => Some(run(1, false, &req, opts.clone())),
            _ => None,
        };
        let p = 3;
        let tag = format!("{m}{} {} on {p} ranks", if reorder { "+reorder" } else { "" }, scope.name());
        let staged = run(p, false, &req, opts.clone());
        let dev = run(p, true, &req, opts.clone());
        assert_eq!(dev.tokens, staged.tokens, "{tag}: answer, plane vs staging");
        assert_eq!(dev.selected_rows, staged.selected_rows, "{tag}: selection, plane vs staging");
        assert_eq!(dev.order, staged.order, "{tag}: order, plane vs staging");
        assert!(dev.first_logits == staged.first_logits, "{tag}: the plane changed the logits' bits");
        if let Some(one) = &one {
            assert_eq!(dev.tokens, one.tokens, "{tag}: answer vs one rank");
            let d = rel_diff(&dev.first_logits, &one.first_logits);
            assert!(d <= RANKS_LOGIT_TOL, "{tag}: relative logit difference to one rank {d}");
            if m != Method::Ring {
                assert_eq!(dev.selected_rows, one.selected_rows, "{tag}: selection vs one rank");
            }
        }
        let ((dev_plane, dev_host), (st_plane, st_host)) = (traffic(&dev), traffic(&staged));
        assert_eq!(st_plane, 0, "{tag}: staging uses no plane");
        assert!(dev_plane > 0, "{tag}: buffers travelled over the plane");
        assert!(dev_host < st_host, "{tag}: only control rows stay on the communicator ({dev_host} vs {st_host})");
        eprintln!("{tag}: plane {dev_plane} B + control {dev_host} B, staged {st_host} B");
    }
}
