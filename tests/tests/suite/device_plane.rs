//! The device path of every distributed step, without a GPU: thread ranks with a device plane
//! (`comm::plane::threads`, NCCL's contract: control rows through the communicator, buffers
//! as grouped point-to-point transfers of lengths known on both sides) give the same bits as
//! the same ranks staging buffers through the communicator, and equal one rank under the
//! exact scope; ring attention over the plane equals full prefill. Three ranks (chunks 1 + 1 +
//! 2; `sharded_equivalence.rs` runs 2 and 4), staging and plane each once per method (2 ranks
//! as well made this the suite's slowest test, 139 s on 2 cores). The plane's traffic is
//! counted beside the communicator's (`<op>@threads`), and only control rows stay on the
//! communicator.

use flowprefill_comm::plane::{threads, BufPlane, Look, Typed};
use flowprefill_comm::{CommError, Communicator, ErrorClass, Result as CommResult};
use flowprefill_coordinator::{
    CoordError, Job, Method, PlaneSetup, Request, RunOptions, RunResult, Scope, ThreadRanks,
};
use flowprefill_kernels::HostBuf;
use flowprefill_tests::{gate_request, rel_diff, thread_planes, RANKS_LOGIT_TOL};
use flowprefill_worker::{Cpu, LoadedModel, WorkerError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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

/// Rank 1's device plane, which fails the first issue of `ring.kv` as a GPU lost between the
/// exchange's control rows and its transfers would: rank 1 gives the job up before its side.
struct LostBeforeTransfers {
    inner: threads::ThreadPlane<HostBuf>,
    fail: bool,
}

impl BufPlane<HostBuf> for LostBeforeTransfers {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn issue(&mut self, op: &str, sends: &[(usize, &HostBuf)], receives: Vec<(usize, HostBuf)>) -> CommResult<()> {
        if self.fail && op == "ring.kv" {
            self.fail = false;
            return Err(CommError::Device { rank: 1, op: op.into(), detail: "injected: the GPU was lost".into() });
        }
        self.inner.issue(op, sends, receives)
    }
    fn complete(&mut self, look: Look<'_>) -> CommResult<Vec<HostBuf>> {
        self.inner.complete(look)
    }
    fn abort(&mut self, reason: &str) {
        self.inner.abort(reason)
    }
    fn set_timeout(&mut self, timeout: Duration) {
        self.inner.set_timeout(timeout)
    }
    fn end_job(&mut self) {
        self.inner.end_job()
    }
    fn down(&self) -> Option<String> {
        self.inner.down()
    }
}

/// Device planes for a world of two thread ranks, a new group at each build of the world
/// (its rebuilds too); in the first build rank 1's fails its first `ring.kv` issue.
fn rank_1_lost_at_its_first_ring_step<B>() -> PlaneSetup<B>
where
    B: flowprefill_kernels::Backend<Buf = HostBuf>,
{
    type Ends = (usize, Vec<Option<threads::ThreadPlane<HostBuf>>>);
    let ends: Arc<Mutex<Ends>> = Arc::new(Mutex::new((0, Vec::new())));
    Arc::new(move |comm: &mut dyn Communicator, _: &B| {
        let rank = comm.rank();
        let mut held = ends.lock().map_err(|_| "poisoned".to_string())?;
        if held.1.get(rank).is_none_or(Option::is_none) {
            let describe = |b: &HostBuf| format!("a {} buffer of {} values", b.dtype(), b.len());
            *held =
                (held.0 + 1, threads::group::<HostBuf>(2, HostBuf::clone, describe).into_iter().map(Some).collect());
        }
        let end = held.1[rank].take().ok_or("taken")?;
        let fail = rank == 1 && held.0 == 1;
        comm.set_plane(Box::new(Typed::<HostBuf>(Box::new(LostBeforeTransfers { inner: end, fail }))));
        Ok(())
    })
}

#[test]
fn a_rank_lost_before_its_transfers_fails_the_job_in_seconds_with_its_class_and_the_rebuilt_world_runs_the_next() {
    let setup = rank_1_lost_at_its_first_ring_step::<Cpu>();
    let mut world =
        ThreadRanks::new(lm(), 2, 1 << 30, Duration::from_secs(60)).and_then(|w| w.with_plane(setup)).expect("ranks");
    let job = Job {
        request: gate_request(),
        options: RunOptions { method: Method::Ring, max_new_tokens: 4, ..Default::default() },
    };
    let t = Instant::now();
    let e = world.run(&job, &mut |_| true).expect_err("rank 1 never sent its block");
    let waited = t.elapsed();
    // Rank 0's wait for rank 1's block saw rank 1's abort: stranded after the grace, not at the
    // 60 s deadline, with rank 1's class (a lost GPU stops a service) and reason.
    assert!(
        matches!(
            &e,
            CoordError::Worker(WorkerError::Comm(CommError::Stranded { rank: 1, class: ErrorClass::Device, reason, .. }))
                if reason.contains("injected: the GPU was lost")
        ),
        "{e:?}"
    );
    assert_eq!(e.class(), ErrorClass::Device);
    assert!(waited < Duration::from_secs(30), "{waited:?}");
    assert!(world.broken().is_some(), "the plane was torn down: the world must be rebuilt");
    world.rebuild().expect("rebuilt");
    let again = world.run(&job, &mut |_| true).expect("the rebuilt world runs the job");
    let fresh = run(2, true, &job.request, job.options.clone());
    assert_eq!(again.tokens, fresh.tokens, "the same answer as a world that never failed");
}

/// The CPU, except that the first attention call on one thread (rank 0's: the caller of
/// `ThreadRanks::run`) fails for want of memory, once armed.
struct OomOnce {
    cpu: Cpu,
    on: Mutex<Option<std::thread::ThreadId>>,
}

impl flowprefill_kernels::Wrapper for OomOnce {
    type Inner = Cpu;
    fn inner(&self) -> &Cpu {
        &self.cpu
    }
    fn buf(buf: &HostBuf) -> &HostBuf {
        buf
    }
    fn buf_mut(buf: &mut HostBuf) -> &mut HostBuf {
        buf
    }
    fn adopt(&self, buf: HostBuf) -> flowprefill_kernels::Result<HostBuf> {
        Ok(buf)
    }
}

flowprefill_kernels::forward_backend! {
    impl Backend for OomOnce {
        type Buf = HostBuf;
        fn attention(
            &self,
            shape: &flowprefill_kernels::attention::AttnShape,
            q: &HostBuf,
            qpos: &[u32],
            k: &HostBuf,
            v: &HostBuf,
            kpos: &[u32],
            out: &mut HostBuf,
            lse: &mut HostBuf,
        ) -> flowprefill_kernels::Result<()> {
            let mut on = self.on.lock().unwrap_or_else(|p| p.into_inner());
            if *on == Some(std::thread::current().id()) {
                *on = None;
                return Err(flowprefill_kernels::KernelError::OutOfMemory {
                    device: "injected".into(),
                    requested: 1 << 30,
                    free: Some(0),
                    advice: Default::default(),
                });
            }
            drop(on);
            self.cpu.attention(shape, q, qpos, k, v, kpos, out, lse)
        }
    }
}

#[test]
fn a_job_that_fails_with_an_exchange_its_peer_never_joined_breaks_the_world_at_its_end() {
    // Rank 1 gives the job up before its side of the first ring step (its plane fails the
    // issue); rank 0 issued its side and then fails in the step's attention, before its wait:
    // the job ends on rank 0 with the exchange pending, which the drain cannot finish.
    let setup = rank_1_lost_at_its_first_ring_step::<OomOnce>();
    let be = OomOnce { cpu: Cpu, on: Mutex::new(None) };
    let lm = Arc::new(LoadedModel::load(&flowprefill_tests::default_model_path(), be).expect("model"));
    let mut world = ThreadRanks::new(lm.clone(), 2, 1 << 30, Duration::from_secs(60))
        .and_then(|w| w.with_plane(setup))
        .expect("ranks");
    let job = Job {
        request: gate_request(),
        options: RunOptions { method: Method::Ring, max_new_tokens: 4, ..Default::default() },
    };
    *lm.model.backend().on.lock().unwrap() = Some(std::thread::current().id());
    let t = Instant::now();
    let e = world.run(&job, &mut |_| true).expect_err("both ranks failed");
    let waited = t.elapsed();
    assert!(lm.model.backend().on.lock().unwrap().is_none(), "rank 0's attention failed as planned");
    // Without the upgrade the job failed with rank 0's own out-of-memory error, which leaves
    // the world standing over a torn-down plane (the next job failed on it).
    assert!(e.breaks_world(), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("unfinished") && msg.contains("ring.kv"), "{msg}");
    assert!(waited < Duration::from_secs(30), "{waited:?}");
    world.rebuild().expect("rebuilt");
    let again = world.run(&job, &mut |_| true).expect("the rebuilt world runs the job");
    let fresh = run(2, true, &job.request, job.options.clone());
    assert_eq!(again.tokens, fresh.tokens, "the same answer as a world that never failed");
}
