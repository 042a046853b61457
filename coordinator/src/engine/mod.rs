//! The phase pipeline of one request, run by every rank of a world (a single process is a
//! world of one: no special case).
//!
//! ```text
//!  rank 0 broadcasts the job; every rank tokenizes it the same way
//!  chunk caches of the rank's own chunks (store or batched prefill)         [chunk_prefill]  no comm
//!  reorder (optional): HL-TP scores, importances all-gathered               [reorder]        O(K)
//!  place own chunks at global positions (rotation only)                     [assemble]       no comm
//!  score (policy), local top-k candidates -> rank 0 cuts -> broadcast       [probe, selection] O(M d)/layer, O(k)
//!  recompute selected tokens, exact (pass-Q) or sparse (selected K/V only)   [recompute]      O(k d)/layer
//!  prompt over the sharded segments, merged in segment order -> rank 0 picks [final_prompt, first_token]
//!  (--evict) every (layer, KV head) cut to its budget, rank shares agreed   [evict]          O(L H N)
//!  decode: rank 0 broadcasts each token, every rank attends its segments     [decode]         O(d)/layer/token
//! ```
//! Ring attention replaces the first five phases with an exact ring prefill; `full` runs on
//! rank 0 alone. No rank ever gathers the whole cache.
//!
//! # Errors and the ranks staying in step
//!
//! Every rank must issue the same collectives in the same order, so an error seen by one rank
//! must end the job on all of them. The rule:
//!
//! 1. **Admission is agreed.** Every check of the job's input ([`crate::admit`]: validation,
//!    tokens, the context window, the scoring layers, sampling) runs on every rank before any
//!    other collective; the `job.admit` all-gather then carries each rank's verdict, and if any
//!    rank refused the job every rank ends it with that error (rank 0 reports it to the caller,
//!    as a caller's error). Nothing is assumed to fail "alike everywhere".
//! 2. **After admission, any error aborts the job everywhere.** The rank that meets it
//!    (a kernel error, a malformed peer message, a cancellation, a deadline) calls
//!    [`Communicator::abort`]: each peer's next wait, or its poll between chunk-prefill layers,
//!    returns `Aborted` naming the rank, its error class and message.
//! 3. **Every rank ends every job** with [`Communicator::end_job`], success or not; messages
//!    the job left in flight are dropped. Only a lost, stuck or panicked rank breaks the world
//!    ([`CoordError::breaks_world`]); everything else leaves it ready for the next job.
//!
//! Cancellation and deadlines are checked before every layer of every long forward, on every
//! rank: rank 0 knows the client's cancellation flag; the deadline travels with the job as a
//! time budget, so followers stop on it by themselves.
//!
//! This file holds the request lifecycle (lead / follow / stop, `ring`); beside it: `pace`
//! (rank 0's idle and progress ticks, which keep the followers' deadlines for real faults),
//! `full` (rank 0 alone), and the phases: `caches` (store lookups and batched chunk prefill per prefix mode),
//! `chunked` (reorder, placement, selection, recomputation), `decode` (the prompt over the
//! sharded segments and the token loop), `evict` (KV eviction between them).

mod admission;
mod auto;
mod caches;
mod chunked;
mod decode;
mod evict;
mod full;
mod ingest;
mod pace;
mod result;
mod verify;

pub use evict::Eviction;
pub use ingest::Ingested;
pub use pace::tick_period;
pub use result::{CoverageCut, RankStats, RunResult};
pub use verify::{exact_job, Quality};

use crate::auto::Chooser;
use crate::error::{internal, CoordError, Result};
use crate::fault::FaultPlan;
use crate::layout::Layout;
use crate::method::Build;
use crate::pipeline::Pipeline;
use crate::request::{Job, Method, Request, RunOptions};
use crate::timings::{phase, PhaseTimes, Settle};
use flowprefill_comm::local::LocalComm;
use flowprefill_comm::{all_gather_value, broadcast_value, Communicator, ErrorClass};
use flowprefill_kernels::{Backend, DType, OomAdvice};
use flowprefill_worker::generate::StopReason;
use flowprefill_worker::interrupt::Watch;
use flowprefill_worker::kv::KvCache;
use flowprefill_worker::sampling::Sampler;
use flowprefill_worker::steps::{ring_prefill, zigzag_pieces, LocalSegment};
use flowprefill_worker::store::{ChunkKey, ChunkStore};
use flowprefill_worker::{Field, InputError, LoadedModel, WorkerError};
use pace::Next;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Default byte budget of the chunk store.
pub const DEFAULT_STORE_BYTES: usize = 2 << 30;

/// The chunk store's disk tier: its folder and the bytes it may keep there (see
/// `flowprefill_worker::store::disk`: entries keyed by model, KV type and device kind, shared by
/// every process on the machine, crash-safe).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskTier {
    /// The folder.
    pub dir: std::path::PathBuf,
    /// Bytes it may keep (least recently used entries go first).
    pub bytes: u64,
}

/// A model, an optional auxiliary model, and this rank's chunk store.
pub struct Engine<B: Backend> {
    lm: Arc<LoadedModel<B>>,
    aux: Option<Arc<LoadedModel<B>>>,
    store: ChunkStore<B>,
    aux_store: ChunkStore<B>,
    faults: Option<Arc<FaultPlan>>,
    /// Ranks whose jobs share this rank's device memory (thread ranks on one CPU or GPU, or
    /// MPI processes of one node on its CPU or on one GPU).
    memory_peers: usize,
    /// Whether those peers are other processes (each measures its own memory) rather than
    /// threads of this one (one of them measures for all).
    peers_are_processes: bool,
    /// At most this many bytes per job on this rank's device (`--memory-limit`).
    memory_limit: Option<usize>,
    /// What resolves `--method auto` (rank 0).
    chooser: Option<Arc<dyn Chooser>>,
    /// The last exact answer computed to verify a job (rank 0).
    exact_memo: verify::ExactMemo,
    /// Whether decode steps on one rank may be recorded and replayed ([`Backend::record`]).
    decode_graphs: bool,
}

/// How the caller of [`Engine::lead_with`] steers the job: its client's cancellation flag,
/// its deadline, and a signal once every rank has admitted it (its input passed every check,
/// no work done yet: the moment a service can still choose an error status).
#[derive(Default)]
pub struct Control<'a> {
    /// Set when the job's client went away.
    pub cancel: Option<Arc<AtomicBool>>,
    /// When the job must be finished.
    pub deadline: Option<Instant>,
    /// Called once on rank 0 when every rank has admitted the job.
    pub on_admitted: Option<Box<dyn FnMut() + Send + 'a>>,
    /// Where rank 0 makes known what the job's lost result could not say if it fails: the
    /// method `auto` chose and the answer's tokens so far.
    pub progress: Option<Arc<JobProgress>>,
}

/// What rank 0 makes known of a job while it runs ([`Control::progress`]), for a caller whose
/// job may fail after its choice or its first tokens (a service's metrics): the method `auto`
/// chose, once it has, and the answer's tokens as rank 0 takes them
/// ([`Sampler::count_into`]; streamed, but for a character still incomplete when a step fails).
#[derive(Debug, Default)]
pub struct JobProgress {
    chosen: std::sync::Mutex<Option<(Method, bool)>>,
    answer_tokens: Arc<AtomicU64>,
}

impl JobProgress {
    /// The method `auto` chose for the job and whether it reorders; `None` before it chose,
    /// and for a job that named its method.
    pub fn chosen(&self) -> Option<(Method, bool)> {
        *self.chosen.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The answer's tokens rank 0 has taken so far.
    pub fn answer_tokens(&self) -> u64 {
        self.answer_tokens.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn choose(&self, method: Method, reorder: bool) {
        *self.chosen.lock().unwrap_or_else(|p| p.into_inner()) = Some((method, reorder));
    }
}

/// A job as rank 0 broadcasts it, with the time it may still take.
#[derive(serde::Serialize, serde::Deserialize)]
struct Envelope {
    job: Job,
    budget_ms: Option<u64>,
}

/// How this rank's caller steers one job: its cancellation and deadline, the admission
/// signal, where the answer's text goes (rank 0).
struct Steer<'a, 'b> {
    watch: Watch,
    t0: Instant,
    on_admitted: Option<Box<dyn FnMut() + Send + 'a>>,
    progress: Option<Arc<JobProgress>>,
    on_text: &'b mut dyn FnMut(&str) -> bool,
}

/// Per-rank part of the decoding loop: the sampler and the text sink live on rank 0 only.
enum Role<'a> {
    Lead { sampler: Box<Sampler>, on_text: &'a mut dyn FnMut(&str) -> bool },
    Follow,
}

/// What the phases of one job find out for its result (filled on every rank; rank 0's is
/// returned, in the [`RunResult`] assembled when the job is over).
#[derive(Default)]
struct Outcome {
    /// Time to the first answer token.
    ttft: Duration,
    /// Decode steps taken from a replay.
    decode_replayed: usize,
    /// Logits of the first answer token.
    first_logits: Vec<f32>,
    /// Chunk ids in the final layout order.
    order: Vec<usize>,
    /// Chunk importance from reordering.
    importance: Option<Vec<f32>>,
    /// The policy's scores (with `keep_scores`).
    scores: Option<Vec<Vec<f32>>>,
    /// Selected rows per chunk (request order).
    selected_rows: Vec<Vec<usize>>,
    /// What eviction kept.
    eviction: Option<Eviction>,
    /// What a budget by coverage chose (rank 0).
    coverage: Option<CoverageCut>,
}

/// One job's state on this rank, threaded through the phases.
struct Turn<'a> {
    opts: &'a RunOptions,
    /// What was decided before any work (read only).
    plan: Pipeline,
    phases: PhaseTimes,
    /// What the phases found.
    out: Outcome,
    mine: RankStats,
    role: Role<'a>,
    /// Start of the request (TTFT is measured from it).
    t0: Instant,
    /// Cancellation and deadline.
    watch: Watch,
}

impl<B: Backend> Engine<B> {
    /// An engine with a chunk store of `store_bytes`.
    pub fn new(lm: Arc<LoadedModel<B>>, store_bytes: usize) -> Self {
        Self {
            lm,
            aux: None,
            store: ChunkStore::new(store_bytes),
            aux_store: ChunkStore::new(store_bytes / 4),
            faults: FaultPlan::from_env(),
            memory_peers: 1,
            peers_are_processes: false,
            memory_limit: None,
            chooser: None,
            exact_memo: verify::ExactMemo::default(),
            decode_graphs: flowprefill_worker::steps::decode_graphs_allowed(),
        }
    }

    /// Lets decode steps be recorded once and replayed per token (on by default, unless
    /// `FLOWPREFILL_DECODE_GRAPH=off`): only where this engine's thread is the only one driving
    /// the device while it decodes (a service that ingests beside its jobs turns it off).
    pub fn with_decode_graphs(mut self, on: bool) -> Self {
        self.decode_graphs &= on;
        self
    }

    /// Resolves `--method auto` with `chooser` (and tells it what verified answers show).
    pub fn with_chooser(mut self, chooser: Option<Arc<dyn Chooser>>) -> Self {
        self.chooser = chooser;
        self
    }

    /// Puts the disk tier `tier` under this engine's chunk store (`None`: RAM only). A folder
    /// that cannot be opened is a warning and RAM only: the caller checked it before (the
    /// binary refuses a `--store` it cannot create).
    pub fn with_disk(mut self, tier: Option<&DiskTier>) -> Self {
        let Some(t) = tier else { return self };
        let be = self.lm.model.backend();
        // A GPU's bf16 forward and its f32 one make different bits.
        let device = match be.act_dtype() {
            flowprefill_kernels::DType::F32 => be.name().to_string(),
            act => format!("{}+{}", be.name(), act.name()),
        };
        let scope = flowprefill_worker::store::disk::Scope {
            model: self.lm.cache_identity.clone(),
            dtype: be.kv_dtype(),
            device,
        };
        match flowprefill_worker::store::disk::DiskStore::open(&t.dir, scope, t.bytes) {
            Ok(d) => {
                let store = std::mem::replace(&mut self.store, ChunkStore::new(0));
                self.store = store.with_disk(d);
            }
            Err(e) => tracing::warn!("chunk store: the disk tier {} is not used ({e})", t.dir.display()),
        }
        self
    }

    /// Plans every job within `bytes` of this rank's device, whatever it has free (`None`:
    /// what it has free).
    pub fn with_memory_limit(mut self, bytes: Option<usize>) -> Self {
        self.memory_limit = bytes;
        self
    }

    /// Counts the jobs of `ranks` ranks against this rank's free memory at admission: they
    /// share its device (thread ranks over one model).
    pub fn with_memory_peers(mut self, ranks: usize) -> Self {
        self.memory_peers = ranks.max(1);
        self.peers_are_processes = false;
        self
    }

    /// Counts the jobs of `processes` processes of this node (this one included) against this
    /// rank's free memory at admission: MPI ranks on one machine's CPU, or on one GPU. Without
    /// it each process took the whole free memory as its own, and together they overran it.
    pub fn with_sharing_processes(mut self, processes: usize) -> Self {
        self.memory_peers = processes.max(1);
        self.peers_are_processes = true;
        self
    }

    /// Ranks whose jobs share this rank's device memory (1: a device of its own).
    pub fn memory_peers(&self) -> usize {
        self.memory_peers
    }

    /// Uses `aux` as CacheClip's auxiliary model; it must share the main model's vocabulary.
    pub fn with_aux(mut self, aux: Arc<LoadedModel<B>>) -> Result<Self> {
        let (a, b) = (&self.lm.tokenizer, &aux.tokenizer);
        let same = a.vocab_size() == b.vocab_size() && (0..a.vocab_size() as u32).all(|i| a.token(i) == b.token(i));
        if !same {
            return Err(InputError::new(
                Field::AuxModel,
                "must use the same tokenizer vocabulary as the main model (token alignment between \
                 different vocabularies is not implemented)",
            )
            .into());
        }
        self.aux = Some(aux);
        Ok(self)
    }

    /// Injects the faults of `plan` instead of the process's (failure tests).
    pub fn with_faults(mut self, plan: Option<Arc<FaultPlan>>) -> Self {
        self.faults = plan;
        self
    }

    /// The main model.
    pub fn model(&self) -> &LoadedModel<B> {
        &self.lm
    }

    /// This rank's chunk store.
    pub fn store(&self) -> &ChunkStore<B> {
        &self.store
    }

    /// The disk tier's damaged entries dropped and writes skipped since they were last reported
    /// (0 without a disk tier): a job's [`RankStats`] carry them, so a service counts every
    /// process's, once (thread ranks share their process's store: one of them reports), with
    /// those of writes that finished after an earlier job.
    pub fn disk_faults_since_report(&self) -> (u64, u64) {
        self.store.disk().map_or((0, 0), |d| d.faults_since_report())
    }

    /// Empties this rank's chunk stores (the next job prefills every chunk: a cold run).
    pub fn clear_stores(&self) {
        self.store.clear();
        self.aux_store.clear();
    }

    /// A planned fault, if this rank has one at `phase`.
    fn fault_point(&self, rank: usize, phase: &str) -> Result<()> {
        match &self.faults {
            Some(f) => Ok(f.point(rank, phase)?),
            None => Ok(()),
        }
    }

    /// Runs one request in a world of one.
    pub fn run(&self, req: &Request, opts: &RunOptions, on_text: &mut dyn FnMut(&str) -> bool) -> Result<RunResult> {
        let mut solo = LocalComm::group(1).pop().ok_or_else(|| internal("no communicator"))?;
        let job = Job { request: req.clone(), options: opts.clone() };
        self.lead(&mut solo, &job, on_text)
    }

    /// Rank 0: broadcasts `job` and runs it with the other ranks (which are in [`Engine::follow`]).
    pub fn lead(
        &self,
        comm: &mut dyn Communicator,
        job: &Job,
        on_text: &mut dyn FnMut(&str) -> bool,
    ) -> Result<RunResult> {
        self.lead_with(comm, job, Control::default(), on_text)
    }

    /// [`Engine::lead`] under the caller's [`Control`] (cancellation, deadline, admission).
    pub fn lead_with(
        &self,
        comm: &mut dyn Communicator,
        job: &Job,
        ctl: Control<'_>,
        on_text: &mut dyn FnMut(&str) -> bool,
    ) -> Result<RunResult> {
        if comm.rank() != 0 {
            return Err(internal("only rank 0 leads"));
        }
        let Control { cancel, deadline, on_admitted, progress } = ctl;
        let mut r =
            self.lead_one(comm, job, Control { cancel: cancel.clone(), deadline, on_admitted, progress }, on_text)?;
        if job.options.verify {
            // The exact twin, a job of its own for every rank; its answer is not streamed.
            // An exact answer kept from the job before (the same request) is not computed again.
            let exact = verify::exact_job(job, comm.size());
            let key = verify::ExactMemo::key(&exact, comm.size());
            let kept = key.as_deref().and_then(|k| self.exact_memo.get(k));
            let reused = kept.is_some();
            let computed = match kept {
                Some(e) => Ok(e),
                None => self
                    .lead_one(comm, &exact, Control { cancel, deadline, ..Control::default() }, &mut |_| true)
                    .inspect(|e| key.into_iter().for_each(|k| self.exact_memo.put(k, e))),
            };
            match computed {
                Ok(e) => {
                    verify::judge(&mut r, e, reused, &job.options);
                    self.learn(&r);
                }
                // A broken world or a lost GPU ends everything; any other failure of the twin
                // (its memory, its deadline) leaves the answer as computed, saying why it is not
                // verified.
                Err(e) if e.breaks_world() || e.class() == ErrorClass::Device => return Err(e),
                Err(e) => {
                    tracing::warn!("verification: the exact computation failed: {e}");
                    r.verify_error = Some(e.to_string());
                }
            }
        }
        Ok(r)
    }

    /// One job through the world (rank 0): broadcast, run, result.
    fn lead_one(
        &self,
        comm: &mut dyn Communicator,
        job: &Job,
        ctl: Control<'_>,
        on_text: &mut dyn FnMut(&str) -> bool,
    ) -> Result<RunResult> {
        let t0 = Instant::now();
        comm.reset_stats();
        let budget = ctl.deadline.map(|d| d.saturating_duration_since(t0));
        let env = Envelope { job: job.clone(), budget_ms: budget.map(|b| b.as_millis().min(u64::MAX as u128) as u64) };
        let sent = broadcast_value(comm, "request", 0, Some(&Next::Job(Box::new(env))));
        let env = match sent {
            Ok(Next::Job(e)) => *e,
            Ok(_) => return Err(internal("broadcast lost the job")),
            Err(e) => {
                comm.end_job();
                return Err(e.into());
            }
        };
        let watch = Watch::new(ctl.cancel, budget);
        let steer = Steer { watch, t0, on_admitted: ctl.on_admitted, progress: ctl.progress, on_text };
        let r = self.job_on_rank(comm, &env.job, steer)?;
        r.ok_or_else(|| internal("rank 0 produced no result"))
    }

    /// Rank 0: tells the followers there is no more work.
    pub fn stop(comm: &mut dyn Communicator) -> Result<()> {
        broadcast_value(comm, "request", 0, Some(&Next::Stop))?;
        Ok(())
    }

    /// Rank 0, between jobs: tells the followers it is alive, so that a world idle for longer
    /// than the comm timeout stays up (call it every [`tick_period`] of the timeout), and hears
    /// each answer: a follower stuck or gone shows now, while no job waits (a service marks
    /// itself not ready), not at the next job's deadline.
    pub fn idle(comm: &mut dyn Communicator) -> Result<()> {
        if comm.size() > 1 {
            broadcast_value(comm, "request", 0, Some(&Next::Idle))?;
            let followers = (1..comm.size()).collect();
            flowprefill_comm::exchange(comm, "idle.ack", Vec::new(), followers)?;
        }
        Ok(())
    }

    /// Between jobs, when the world is idle: the device memory this rank's backends keep for
    /// reuse goes back to the system ([`Backend::release_unused`]), so that an idle service
    /// does not hold its last job's peak (on a GPU: for every other process on it).
    pub fn release_unused(&self) {
        self.lm.model.backend().release_unused();
        if let Some(aux) = &self.aux {
            aux.model.backend().release_unused();
        }
    }

    /// Ranks other than 0: runs the jobs rank 0 broadcasts until it stops; returns how many.
    /// A job that fails is over on every rank (see the module docs); only an error that breaks
    /// the world ends the rank, and a panic: the rank then leaves the world, telling the others
    /// why, so that they do not wait for it until their deadline.
    pub fn follow(&self, comm: &mut dyn Communicator) -> Result<usize> {
        let rank = comm.rank();
        let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.follow_jobs(comm)))
            .unwrap_or_else(|p| Err(CoordError::Panicked { rank, message: crate::error::panic_message(p) }));
        if let Err(e) = &out {
            comm.leave(&e.to_string());
        }
        out
    }

    fn follow_jobs(&self, comm: &mut dyn Communicator) -> Result<usize> {
        let mut done = 0;
        loop {
            let t0 = Instant::now();
            comm.reset_stats();
            let next: Next = match broadcast_value(comm, "request", 0, None) {
                Ok(e) => e,
                Err(e) => {
                    let e = CoordError::from(e);
                    if e.breaks_world() {
                        return Err(e);
                    }
                    comm.end_job();
                    continue;
                }
            };
            let env = match next {
                Next::Job(env) => *env,
                Next::Idle => {
                    flowprefill_comm::exchange(comm, "idle.ack", vec![(0, Vec::new())], Vec::new())?;
                    self.release_unused();
                    continue;
                }
                Next::Stop => return Ok(done),
            };
            let watch = Watch::new(None, env.budget_ms.map(Duration::from_millis));
            let steer = Steer { watch, t0, on_admitted: None, progress: None, on_text: &mut |_| true };
            match self.job_on_rank(comm, &env.job, steer) {
                Err(e) if e.breaks_world() => return Err(e),
                Err(e) => tracing::debug!(rank = comm.rank(), error = %e, "job failed"),
                Ok(_) => {}
            }
            done += 1;
        }
    }

    /// One job on this rank, from admission to its end: an error is reported to the other
    /// ranks (unless they reported it, or the world is broken) and the job is ended here.
    fn job_on_rank(&self, comm: &mut dyn Communicator, job: &Job, steer: Steer<'_, '_>) -> Result<Option<RunResult>> {
        // Out of memory: more ranks spread every method's context but `full`'s (rank 0 holds it).
        let spreads = job.options.method.info().build != Build::Single;
        let r = self.run_job(comm, job, steer).map_err(|e| e.advised(self.oom_advice(spreads)));
        // The chunk caches this job made go to the disk tier now, after its answer; not from a
        // lost GPU (its last results cannot be trusted, and reading them back would wait on a
        // kernel that may never finish).
        if r.as_ref().is_err_and(|e| e.class() == ErrorClass::Device) {
            self.store.forget_pending();
        } else {
            self.store.persist_pending(self.lm.model.backend());
        }
        if let Err(e) = &r {
            if e.class() == ErrorClass::Resource {
                // The job's buffers are gone; the store gives back what the job lacks now.
                self.room_after_failure(job, comm.rank(), comm.size());
            }
            if !e.breaks_world() && !e.from_peer_abort() {
                comm.abort(e.class(), &e.to_string());
            }
        }
        let plane_was_up = comm.plane().is_some_and(|p| p.down().is_none());
        comm.end_job();
        // A failed job whose exchange could not be drained at its end tore the device plane
        // down: no later job can run on this world, so this one's error breaks it.
        match (r, comm.plane().and_then(|p| p.down()).filter(|_| plane_was_up)) {
            (Err(e), Some(why)) if !e.breaks_world() => {
                Err(CoordError::Worker(WorkerError::Comm(flowprefill_comm::CommError::PlaneDown {
                    op: format!("the end of a job that failed ({e})"),
                    why,
                })))
            }
            (r, _) => r,
        }
    }

    /// What would make room when work that `spreads` over the ranks (or not: `full`, one
    /// document ingested) runs out of memory here: more ranks only where it spreads and this
    /// rank's device is its own (thread ranks over one model share it: more of them add to its
    /// memory rather than split it); K/V in bf16 unless they are.
    pub(super) fn oom_advice(&self, spreads: bool) -> OomAdvice {
        OomAdvice::Job {
            more_ranks: spreads && self.memory_peers == 1,
            kv_bf16: self.lm.model.backend().kv_dtype() == DType::Bf16,
        }
    }

    /// The pipeline of one job on this rank (see the module docs); `Some` on rank 0.
    fn run_job(&self, comm: &mut dyn Communicator, job: &Job, steer: Steer<'_, '_>) -> Result<Option<RunResult>> {
        let Steer { watch, t0, on_admitted, progress, on_text } = steer;
        let (layout, held) = self.agree(comm, job)?;
        // A job already cancelled or late stops before any work (and before a service starts
        // streaming its answer).
        watch.check("admission")?;
        // `auto`: rank 0 chooses the method from what every rank holds; every rank runs it.
        let resolved = self.resolve_auto(comm, job, &layout, &held)?;
        if let Some((chosen, _)) = &resolved {
            if let Some(p) = &progress {
                p.choose(chosen.options.method, chosen.options.reorder);
            }
            self.agree_memory(comm, &chosen.options, &layout)?;
        }
        let (job, choice) = match resolved {
            Some((j, c)) => (std::borrow::Cow::Owned(j), Some(c)),
            None => (std::borrow::Cow::Borrowed(job), None),
        };
        let job = &*job;
        let opts = &job.options;
        if let Some(mut f) = on_admitted {
            f();
        }
        let (rank, size) = (comm.rank(), comm.size());
        let lead = rank == 0;
        // The device's high-water mark from here (one rank per device counts it).
        let be = self.lm.model.backend();
        let own = self.memory_peers == 1 || self.peers_are_processes;
        let held_before = (own || lead).then(|| be.memory_use().map(|u| u.now)).flatten();
        if held_before.is_some() {
            be.reset_memory_peak();
        }
        let mut sampler = Sampler::new(opts.sampling.clone())?;
        if let Some(p) = &progress {
            sampler.count_into(p.answer_tokens.clone());
        }
        let chunk_tokens: Vec<usize> = layout.chunks.iter().map(Vec::len).collect();
        let plan = Pipeline::new(opts, &chunk_tokens, size, self.lm.model.config().n_layers).placed_by(&held);
        // On a GPU each phase ends when its work is done (the phase timers are host clocks).
        let lm = self.lm.clone();
        let settle = Settle::new(move || {
            if let Err(e) = lm.model.backend().settle() {
                tracing::warn!("settling the device at a phase end: {e}");
            }
        });
        // This rank's op profile restarts with the job.
        if let Err(e) = self.lm.model.take_thread_op_times() {
            tracing::warn!("op profile: {e}");
        }
        let out = Outcome {
            order: (0..layout.chunks.len()).collect(),
            selected_rows: vec![Vec::new(); layout.chunks.len()],
            ..Outcome::default()
        };
        let mut turn = Turn {
            opts,
            plan,
            phases: PhaseTimes::settled_by(settle),
            out,
            mine: RankStats { rank, ..Default::default() },
            role: if lead { Role::Lead { sampler: Box::new(sampler), on_text } } else { Role::Follow },
            t0,
            watch,
        };
        let decoded = match opts.method {
            // Rank 0 computes alone; the others wait for it (see `pace`).
            Method::Full if lead && opts.evict.is_some() => {
                pace::lead_alone(comm, || self.full_then_evict(&layout, &mut turn))?
            }
            Method::Full if lead => Some(pace::lead_alone(comm, || self.full(&layout, &mut turn))?),
            Method::Full => {
                pace::wait_for_lead(comm)?;
                None
            }
            Method::Ring => self.ring(comm, &layout, &mut turn)?,
            _ => self.chunked(comm, &layout, &mut turn)?,
        };
        let Turn { plan, phases, out, mut mine, .. } = turn;
        mine.phases = phases.entries().iter().map(|(n, d)| (n.to_string(), d.as_secs_f64() * 1e3)).collect();
        mine.memory_peak = held_before.and_then(|b| be.memory_use().map(|u| u.peak.saturating_sub(b)));
        (mine.disk_corrupt, mine.disk_write_failures) = self.disk_faults_since_report();
        let all = self.gather_stats(comm, mine)?;
        let Some(decoded) = decoded.filter(|_| lead) else {
            return if lead { Err(internal("rank 0 did not decode")) } else { Ok(None) };
        };
        let mut r = self.result(job, &layout, plan, phases, out, all, decoded, t0)?;
        r.auto = choice;
        Ok(Some(r))
    }

    /// Every rank's statistics (phases, communication, op profile), gathered once the answer
    /// is complete.
    fn gather_stats(&self, comm: &mut dyn Communicator, mut mine: RankStats) -> Result<Vec<RankStats>> {
        mine.comm = comm.stats().clone();
        match self.lm.model.take_thread_op_times() {
            Ok(t) if self.lm.model.profile().enabled() => mine.ops = t.families_ms(),
            Ok(_) => {}
            Err(e) => tracing::warn!("op profile: {e}"),
        }
        Ok(all_gather_value(comm, "stats", &mine)?)
    }

    /// The job's result, assembled once it is over (rank 0).
    #[allow(clippy::too_many_arguments)]
    fn result(
        &self,
        job: &Job,
        layout: &Layout,
        plan: Pipeline,
        phases: PhaseTimes,
        out: Outcome,
        rank_stats: Vec<RankStats>,
        (tokens, stop): (Vec<u32>, StopReason),
        t0: Instant,
    ) -> Result<RunResult> {
        Ok(RunResult {
            answer: self.lm.tokenizer.decode(&tokens)?,
            tokens,
            stop,
            ttft: out.ttft,
            total: t0.elapsed(),
            phases,
            method: plan.method,
            ratio: plan.ratio,
            opts: job.options.clone(),
            prefix: plan.prefix,
            ranks: plan.ranks,
            n_head_tokens: layout.head.len(),
            n_context_tokens: plan.n_context,
            n_prompt_tokens: layout.prompt.len(),
            chunk_tokens: layout.chunks.iter().map(Vec::len).collect(),
            owners: plan.owners,
            order: out.order,
            importance: out.importance,
            scores: out.scores,
            selected_rows: out.selected_rows,
            budget: out.coverage.map_or(plan.budget, |c| c.k),
            coverage: out.coverage,
            cache_hits: rank_stats.iter().map(|r| r.cache_hits).sum(),
            cache_misses: rank_stats.iter().map(|r| r.cache_misses).sum(),
            cache_disk_hits: rank_stats.iter().map(|r| r.cache_disk_hits).sum(),
            first_logits: out.first_logits,
            decode_replayed: out.decode_replayed,
            rank_stats,
            kv_bytes: self.lm.model.backend().kv_dtype().size(),
            eviction: out.eviction,
            quality: None,
            auto: None,
            verify_error: None,
        })
    }

    /// The layout's prompt over `segments` at its positions, then decoding (`store_as`: see
    /// [`Engine::prompt_and_decode`]).
    fn prompt_then_decode(
        &self,
        comm: &mut dyn Communicator,
        segments: Vec<(usize, KvCache<B>)>,
        layout: &Layout,
        store_as: Option<ChunkKey>,
        turn: &mut Turn<'_>,
    ) -> Result<Option<(Vec<u32>, StopReason)>> {
        let start = layout.prompt_start();
        let prompt_pos: Vec<u32> = (start..start + layout.prompt.len() as u32).collect();
        self.prompt_and_decode(comm, segments, &layout.prompt, &prompt_pos, store_as, turn)
    }

    /// Method `ring`: exact ring prefill of the whole sequence, then sharded decoding.
    fn ring(
        &self,
        comm: &mut dyn Communicator,
        layout: &Layout,
        turn: &mut Turn<'_>,
    ) -> Result<Option<(Vec<u32>, StopReason)>> {
        let mut tokens = layout.full_tokens(&turn.out.order);
        // With eviction the prompt runs after the context (its forward scores the cache).
        let evicting = turn.opts.evict.is_some();
        if evicting {
            tokens.truncate(layout.prompt_start() as usize);
        }
        self.fault_point(comm.rank(), phase::PREFILL)?;
        let watch = &turn.watch;
        let mut check = || watch.check(phase::PREFILL);
        let out = turn.phases.time(phase::PREFILL, || ring_prefill(&self.lm.model, comm, &tokens, &mut check))?;
        turn.out.selected_rows = layout.chunks.iter().map(|c| (0..c.len()).collect()).collect();
        // Each rank's rows are one segment, merged in rank order.
        let rank = comm.rank();
        if evicting {
            return self.prompt_then_decode(comm, vec![(rank, out.cache)], layout, None, turn);
        }
        let pieces = zigzag_pieces(tokens.len(), comm.size());
        let last = tokens.len() - 1;
        let owner = pieces.iter().position(|p| p.iter().any(|r| r.contains(&last))).unwrap_or(0);
        let logits: Vec<f32> = broadcast_value(comm, "ring.logits", owner, out.last_logits.as_ref())?;
        let segs = vec![LocalSegment::placed(rank, &out.cache)];
        let next_pos = tokens.len() as u32;
        let tail = self.empty_tail()?;
        self.decode_with_tail(comm, segs, tail, logits, next_pos, turn)
    }
}
