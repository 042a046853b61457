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
//!  decode: rank 0 broadcasts each token, every rank attends its segments     [decode]         O(d)/layer/token
//! ```
//! Ring attention replaces the first five phases with an exact ring prefill; `full` runs on
//! rank 0 alone. No rank ever gathers the whole cache.

use crate::error::{invalid, CoordError, Result};
use crate::layout::Layout;
use crate::reorder::reorder;
use crate::request::{validate, Job, Method, PrefixMode, Request, RunOptions};
use crate::select::{segment_id, selector_for, AuxCaches, ScoreCtx};
use crate::shard;
use crate::timings::{phase, PhaseTimes};
use flowprefill_comm::local::LocalComm;
use flowprefill_comm::{all_gather_value, broadcast_value, CommStats, Communicator};
use flowprefill_kernels::topk::{count_for_ratio, rank_order};
use flowprefill_kernels::Backend;
use flowprefill_worker::generate::{decode, decode_with, prefill_into, StopReason, DEFAULT_PREFILL_CHUNK};
use flowprefill_worker::kv::{KeyForm, KvCache};
use flowprefill_worker::model::Logits;
use flowprefill_worker::sampling::Sampler;
use flowprefill_worker::steps::{
    prefill_chunks, recompute, ring_prefill, zigzag_pieces, ChunkJob, LocalSegment, Replicated, Target,
    DEFAULT_BATCH_TOKENS,
};
use flowprefill_worker::store::{ChunkKey, ChunkStore};
use flowprefill_worker::{LoadedModel, WorkerError};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Default byte budget of the chunk store.
pub const DEFAULT_STORE_BYTES: usize = 2 << 30;

/// What one rank did during a request.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct RankStats {
    /// The rank.
    pub rank: usize,
    /// Milliseconds per phase, in pipeline order.
    pub phases: Vec<(String, f64)>,
    /// Bytes and wait time per collective.
    pub comm: CommStats,
    /// Chunks held.
    pub chunks: usize,
    /// Context tokens held.
    pub tokens: usize,
    /// Selected tokens held.
    pub selected: usize,
    /// Chunk-store hits and misses.
    pub cache_hits: u64,
    /// Chunk-store misses (chunks prefilled).
    pub cache_misses: u64,
}

/// Outcome of one request (on rank 0).
#[derive(Clone, Debug)]
pub struct RunResult {
    /// The answer text.
    pub answer: String,
    /// Answer token ids.
    pub tokens: Vec<u32>,
    /// Why decoding stopped.
    pub stop: StopReason,
    /// Time to first token (from the start of the request, tokenization included).
    pub ttft: Duration,
    /// Total time including decoding.
    pub total: Duration,
    /// Rank 0's time per phase, in pipeline order.
    pub phases: PhaseTimes,
    /// Method run.
    pub method: Method,
    /// Ratio in effect.
    pub ratio: f64,
    /// Options as given.
    pub opts: RunOptions,
    /// Prefix mode in effect.
    pub prefix: PrefixMode,
    /// Ranks.
    pub ranks: usize,
    /// Template head tokens.
    pub n_head_tokens: usize,
    /// Context tokens (candidates).
    pub n_context_tokens: usize,
    /// Prompt tokens after the context.
    pub n_prompt_tokens: usize,
    /// Tokens per chunk (request order).
    pub chunk_tokens: Vec<usize>,
    /// Owner rank of each chunk (request order).
    pub owners: Vec<usize>,
    /// Chunk ids in the final layout order.
    pub order: Vec<usize>,
    /// Chunk importance from reordering (request order), if reordered.
    pub importance: Option<Vec<f32>>,
    /// Selected rows per chunk (request order).
    pub selected_rows: Vec<Vec<usize>>,
    /// Token budget `round(ratio * N)`.
    pub budget: usize,
    /// Chunk-store lookups that hit during this request (all ranks).
    pub cache_hits: u64,
    /// Chunk-store lookups that missed (chunks prefilled, all ranks).
    pub cache_misses: u64,
    /// Logits of the first answer token (for equivalence checks).
    pub first_logits: Vec<f32>,
    /// Per-rank phase times and communication.
    pub rank_stats: Vec<RankStats>,
}

impl RunResult {
    /// Selected tokens per chunk (request order).
    pub fn selected_counts(&self) -> Vec<usize> {
        self.selected_rows.iter().map(Vec::len).collect()
    }

    /// Total selected tokens.
    pub fn n_selected(&self) -> usize {
        self.selected_rows.iter().map(Vec::len).sum()
    }
}

/// A model, an optional auxiliary model, and this rank's chunk store.
pub struct Engine<B: Backend> {
    lm: Arc<LoadedModel<B>>,
    aux: Option<Arc<LoadedModel<B>>>,
    store: ChunkStore<B>,
    aux_store: ChunkStore<B>,
}

/// Head cache and the caches of the requested chunks.
struct Caches<B: Backend> {
    head: Arc<KvCache<B>>,
    chunks: Vec<Arc<KvCache<B>>>,
    hits: u64,
    misses: u64,
}

/// A chunk to look up or prefill.
struct Spec<'a, B: Backend> {
    head_tokens: Vec<u32>,
    head: Vec<&'a KvCache<B>>,
    tokens: &'a [u32],
    start: u32,
}

/// Looks every spec up in the store and prefills the missing ones together.
fn resolve<B: Backend>(
    model: &flowprefill_worker::Model<B>,
    store: &ChunkStore<B>,
    specs: Vec<Spec<'_, B>>,
    stats: &mut (u64, u64),
) -> Result<Vec<Arc<KvCache<B>>>> {
    let keys: Vec<ChunkKey> = specs.iter().map(|s| ChunkKey::new(&s.head_tokens, s.start, s.tokens)).collect();
    let mut found: Vec<Option<Arc<KvCache<B>>>> = keys.iter().map(|k| store.get(k)).collect();
    let missing: Vec<usize> = (0..specs.len()).filter(|&i| found[i].is_none()).collect();
    stats.0 += (specs.len() - missing.len()) as u64;
    stats.1 += missing.len() as u64;
    let jobs: Vec<ChunkJob<'_, B>> = missing
        .iter()
        .map(|&i| ChunkJob { head: specs[i].head.clone(), tokens: specs[i].tokens, start: specs[i].start })
        .collect();
    let made = prefill_chunks(model, &jobs, DEFAULT_BATCH_TOKENS)?;
    for (&i, kv) in missing.iter().zip(made) {
        found[i] = Some(store.insert(keys[i], kv));
    }
    found.into_iter().map(|f| f.ok_or_else(|| invalid("chunk cache missing after prefill"))).collect()
}

/// Per-rank state of the decoding loop: the sampler lives on rank 0 only.
enum Role<'a> {
    Lead { sampler: &'a mut Sampler, on_text: &'a mut dyn FnMut(&str) -> bool },
    Follow,
}

impl<B: Backend> Engine<B> {
    /// An engine with a chunk store of `store_bytes`.
    pub fn new(lm: Arc<LoadedModel<B>>, store_bytes: usize) -> Self {
        Self { lm, aux: None, store: ChunkStore::new(store_bytes), aux_store: ChunkStore::new(store_bytes / 4) }
    }

    /// Uses `aux` as CacheClip's auxiliary model; it must share the main model's vocabulary.
    pub fn with_aux(mut self, aux: Arc<LoadedModel<B>>) -> Result<Self> {
        let (a, b) = (&self.lm.tokenizer, &aux.tokenizer);
        let same = a.vocab_size() == b.vocab_size() && (0..a.vocab_size() as u32).all(|i| a.token(i) == b.token(i));
        if !same {
            return Err(invalid(
                "--aux-model must use the same tokenizer vocabulary as --model (token alignment between \
                 different vocabularies is not implemented)",
            ));
        }
        self.aux = Some(aux);
        Ok(self)
    }

    /// The main model.
    pub fn model(&self) -> &LoadedModel<B> {
        &self.lm
    }

    /// This rank's chunk store.
    pub fn store(&self) -> &ChunkStore<B> {
        &self.store
    }

    /// Runs one request in a world of one.
    pub fn run(&self, req: &Request, opts: &RunOptions, on_text: &mut dyn FnMut(&str) -> bool) -> Result<RunResult> {
        let mut solo = LocalComm::group(1).pop().ok_or_else(|| invalid("no communicator"))?;
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
        if comm.rank() != 0 {
            return Err(invalid("only rank 0 leads"));
        }
        let t0 = Instant::now();
        comm.reset_stats();
        let job: Option<Job> = broadcast_value(comm, "request", 0, Some(&Some(job.clone())))?;
        let job = job.ok_or_else(|| invalid("broadcast lost the job"))?;
        self.run_job(comm, &job, t0, on_text)?.ok_or_else(|| invalid("rank 0 produced no result"))
    }

    /// Rank 0: tells the followers there is no more work.
    pub fn stop(comm: &mut dyn Communicator) -> Result<()> {
        broadcast_value::<Option<Job>>(comm, "request", 0, Some(&None))?;
        Ok(())
    }

    /// Ranks other than 0: runs the jobs rank 0 broadcasts until it stops; returns how many.
    /// Errors every rank sees alike (bad input) are skipped; anything else ends the rank.
    pub fn follow(&self, comm: &mut dyn Communicator) -> Result<usize> {
        let mut done = 0;
        loop {
            let t0 = Instant::now();
            comm.reset_stats();
            let job: Option<Job> = broadcast_value(comm, "request", 0, None)?;
            let Some(job) = job else { return Ok(done) };
            match self.run_job(comm, &job, t0, &mut |_| true) {
                Ok(_) | Err(CoordError::Invalid(_)) => done += 1,
                Err(CoordError::Worker(WorkerError::Input(_)))
                | Err(CoordError::Worker(WorkerError::ContextTooLong { .. })) => done += 1,
                Err(e) => return Err(e),
            }
        }
    }

    /// Head and the caches of `chunks` (ids) under `mode`, from `store` or prefilled (the
    /// missing chunks of one stage in batched forwards).
    fn caches(
        &self,
        lm: &LoadedModel<B>,
        store: &ChunkStore<B>,
        layout: &Layout,
        mode: PrefixMode,
        chunks: &[usize],
    ) -> Result<Caches<B>> {
        let model = &lm.model;
        let be = model.backend();
        let n_kv = model.config().n_kv_heads;
        let mut stats = (0u64, 0u64);
        let head = resolve(
            model,
            store,
            vec![Spec { head_tokens: vec![], head: vec![], tokens: &layout.head, start: 0 }],
            &mut stats,
        )?
        .pop()
        .ok_or_else(|| invalid("head cache missing"))?;
        let head_placed = head.placed(be, model.rope(), head.positions(), n_kv)?;
        let p = layout.head.len() as u32;
        let behind_head = |c: usize| Spec {
            head_tokens: layout.head.clone(),
            head: vec![&head_placed],
            tokens: &layout.chunks[c],
            start: p,
        };
        let alone = |c: usize| Spec { head_tokens: vec![], head: vec![], tokens: &layout.chunks[c], start: 0 };
        let out = match mode {
            PrefixMode::None => resolve(
                model,
                store,
                chunks.iter().map(|&c| if c == 0 { behind_head(c) } else { alone(c) }).collect(),
                &mut stats,
            )?,
            PrefixMode::Shared => resolve(model, store, chunks.iter().map(|&c| behind_head(c)).collect(), &mut stats)?,
            PrefixMode::Anchor => {
                if chunks.is_empty() {
                    Vec::new()
                } else {
                    // The anchor (head + chunk 0) is needed by every rank holding a later chunk
                    // (Star Attention replicates it); it is prefilled here if not held.
                    let first = resolve(model, store, vec![behind_head(0)], &mut stats)?
                        .pop()
                        .ok_or_else(|| invalid("anchor missing"))?;
                    let anchor = first.placed(be, model.rope(), first.positions(), n_kv)?;
                    let mut toks = layout.head.clone();
                    toks.extend_from_slice(&layout.chunks[0]);
                    let start = toks.len() as u32;
                    let later: Vec<usize> = chunks.iter().copied().filter(|&c| c != 0).collect();
                    let specs = later
                        .iter()
                        .map(|&c| Spec {
                            head_tokens: toks.clone(),
                            head: vec![&head_placed, &anchor],
                            tokens: &layout.chunks[c],
                            start,
                        })
                        .collect();
                    let mut rest = resolve(model, store, specs, &mut stats)?.into_iter();
                    let mut out = Vec::with_capacity(chunks.len());
                    for &c in chunks {
                        out.push(if c == 0 {
                            first.clone()
                        } else {
                            rest.next().ok_or_else(|| invalid("chunk missing"))?
                        });
                    }
                    out
                }
            }
        };
        Ok(Caches { head, chunks: out, hits: stats.0, misses: stats.1 })
    }

    /// The pipeline of one job on this rank (see the module docs); `Some` on rank 0.
    fn run_job(
        &self,
        comm: &mut dyn Communicator,
        job: &Job,
        t0: Instant,
        on_text: &mut dyn FnMut(&str) -> bool,
    ) -> Result<Option<RunResult>> {
        let (req, opts) = (&job.request, &job.options);
        validate(req, opts)?;
        let lm = &*self.lm;
        let model = &lm.model;
        let cfg = model.config();
        let layout = Layout::build(lm, req)?;
        let window = cfg.context_length;
        if layout.total_len() + 1 > window {
            return Err(WorkerError::ContextTooLong { tokens: layout.total_len() + 1, window }.into());
        }
        let (rank, size) = (comm.rank(), comm.size());
        let lead = rank == 0;
        let mut sampler = Sampler::new(opts.sampling.clone())?;
        let mut phases = PhaseTimes::default();
        let ratio = opts.effective_ratio();
        let n = layout.n_context();
        let chunk_tokens: Vec<usize> = layout.chunks.iter().map(Vec::len).collect();
        let owners =
            if opts.method == Method::Full { vec![0; chunk_tokens.len()] } else { shard::plan(&chunk_tokens, size) };
        let mut result = RunResult {
            answer: String::new(),
            tokens: Vec::new(),
            stop: StopReason::MaxTokens,
            ttft: Duration::ZERO,
            total: Duration::ZERO,
            phases: PhaseTimes::default(),
            method: opts.method,
            ratio,
            opts: opts.clone(),
            prefix: opts.prefix_mode(),
            ranks: size,
            n_head_tokens: layout.head.len(),
            n_context_tokens: n,
            n_prompt_tokens: layout.prompt.len(),
            chunk_tokens: chunk_tokens.clone(),
            owners: owners.clone(),
            order: (0..layout.chunks.len()).collect(),
            importance: None,
            selected_rows: vec![Vec::new(); layout.chunks.len()],
            budget: count_for_ratio(ratio, n),
            cache_hits: 0,
            cache_misses: 0,
            first_logits: Vec::new(),
            rank_stats: Vec::new(),
        };
        let mut mine = RankStats { rank, ..Default::default() };
        let mut role = if lead { Role::Lead { sampler: &mut sampler, on_text } } else { Role::Follow };

        let decoded = match opts.method {
            Method::Full => {
                if lead {
                    Some(self.full(&layout, opts, &mut phases, &mut result, &mut role, t0)?)
                } else {
                    None
                }
            }
            Method::Ring => self.ring(comm, &layout, opts, &mut phases, &mut result, &mut role, t0)?,
            _ => self.chunked(comm, &layout, opts, &owners, &mut phases, &mut result, &mut mine, &mut role, t0)?,
        };

        // Statistics of every rank, gathered once the answer is complete.
        mine.phases = phases.entries().iter().map(|(n, d)| (n.to_string(), d.as_secs_f64() * 1e3)).collect();
        mine.comm = comm.stats().clone();
        let all: Vec<RankStats> = all_gather_value(comm, "stats", &mine)?;
        if !lead {
            return Ok(None);
        }
        let (tokens, stop) = decoded.ok_or_else(|| invalid("rank 0 did not decode"))?;
        result.cache_hits = all.iter().map(|r| r.cache_hits).sum();
        result.cache_misses = all.iter().map(|r| r.cache_misses).sum();
        result.rank_stats = all;
        result.answer = lm.tokenizer.decode(&tokens)?;
        result.tokens = tokens;
        result.stop = stop;
        result.phases = phases;
        result.total = t0.elapsed();
        Ok(Some(result))
    }

    /// Method `full`: single-pass prefill on rank 0.
    fn full(
        &self,
        layout: &Layout,
        opts: &RunOptions,
        phases: &mut PhaseTimes,
        result: &mut RunResult,
        role: &mut Role<'_>,
        t0: Instant,
    ) -> Result<(Vec<u32>, StopReason)> {
        let model = &self.lm.model;
        let cfg = model.config();
        let Role::Lead { sampler, on_text } = role else { return Err(invalid("full prefill runs on rank 0")) };
        let tokens = layout.full_tokens(&result.order);
        let mut cache = KvCache::new(model.backend(), cfg.n_layers, cfg.kv_dim(), KeyForm::Rotated)?;
        let logits =
            phases.time(phase::PREFILL, || prefill_into(model, &mut cache, &tokens, 0, DEFAULT_PREFILL_CHUNK))?;
        let first = phases.time(phase::FIRST_TOKEN, || sampler.sample(&logits));
        result.ttft = t0.elapsed();
        result.first_logits = logits;
        result.selected_rows = layout.chunks.iter().map(|c| (0..c.len()).collect()).collect();
        let t = Instant::now();
        let out = decode(model, &self.lm.tokenizer, &mut cache, first, sampler, opts.max_new_tokens, *on_text)?;
        phases.add(phase::DECODE, t.elapsed());
        Ok(out)
    }

    /// Method `ring`: exact ring prefill of the whole sequence, then sharded decoding.
    #[allow(clippy::too_many_arguments)]
    fn ring(
        &self,
        comm: &mut dyn Communicator,
        layout: &Layout,
        opts: &RunOptions,
        phases: &mut PhaseTimes,
        result: &mut RunResult,
        role: &mut Role<'_>,
        t0: Instant,
    ) -> Result<Option<(Vec<u32>, StopReason)>> {
        let tokens = layout.full_tokens(&result.order);
        let out = phases.time(phase::PREFILL, || ring_prefill(&self.lm.model, comm, &tokens))?;
        let pieces = zigzag_pieces(tokens.len(), comm.size());
        let last = tokens.len() - 1;
        let owner = pieces.iter().position(|p| p.iter().any(|r| r.contains(&last))).unwrap_or(0);
        let logits: Vec<f32> = broadcast_value(comm, "ring.logits", owner, out.last_logits.as_ref())?;
        result.selected_rows = layout.chunks.iter().map(|c| (0..c.len()).collect()).collect();
        // Each rank's rows are one segment, merged in rank order.
        let rank = comm.rank();
        let segs = vec![LocalSegment::placed(rank, &out.cache)];
        let next_pos = tokens.len() as u32;
        self.decode_sharded(comm, segs, logits, next_pos, opts, phases, result, role, t0)
    }

    /// Chunked methods: the phase pipeline of the module docs.
    #[allow(clippy::too_many_arguments)]
    fn chunked(
        &self,
        comm: &mut dyn Communicator,
        layout: &Layout,
        opts: &RunOptions,
        owners: &[usize],
        phases: &mut PhaseTimes,
        result: &mut RunResult,
        mine: &mut RankStats,
        role: &mut Role<'_>,
        t0: Instant,
    ) -> Result<Option<(Vec<u32>, StopReason)>> {
        let lm = &*self.lm;
        let model = &lm.model;
        let be = model.backend();
        let cfg = model.config();
        let rank = comm.rank();
        let lead = rank == 0;
        let n = layout.n_context();
        if n == 0 {
            return Err(invalid("the context has no tokens"));
        }
        let local_ids = shard::local_chunks(owners, rank);

        // Phase 1: this rank's chunk caches.
        crate::fault::point(rank, phase::CHUNK_PREFILL);
        let caches =
            phases.time(phase::CHUNK_PREFILL, || self.caches(lm, &self.store, layout, result.prefix, &local_ids))?;
        mine.cache_hits = caches.hits;
        mine.cache_misses = caches.misses;
        mine.chunks = local_ids.len();
        mine.tokens = local_ids.iter().map(|&c| layout.chunks[c].len()).sum();
        let head_placed = caches.head.placed(be, model.rope(), caches.head.positions(), cfg.n_kv_heads)?;

        // Optional reordering (positions only; no data moves).
        let mut order: Vec<usize> = (0..layout.chunks.len()).collect();
        if opts.reorder {
            let identity = order.clone();
            let mut ctx = ScoreCtx {
                lm,
                layout,
                order: &identity,
                local: &local_ids,
                chunks: &caches.chunks,
                head: lead.then_some(&head_placed),
                placed: &[],
                opts,
                aux: self,
                comm: &mut *comm,
            };
            let (o, imp) = phases.time(phase::REORDER, || reorder(&mut ctx, result.ratio))?;
            order = o;
            result.importance = Some(imp);
        }
        // Local chunks in layout order, their caches, and their layout indices.
        let local: Vec<usize> = order.iter().copied().filter(|&c| owners[c] == rank).collect();
        let local_caches: Vec<Arc<KvCache<B>>> = local
            .iter()
            .map(|c| {
                local_ids
                    .iter()
                    .position(|l| l == c)
                    .map(|j| caches.chunks[j].clone())
                    .ok_or_else(|| invalid("chunk not held"))
            })
            .collect::<Result<_>>()?;
        let layout_index: Vec<usize> = local.iter().map(|c| order.iter().position(|o| o == c).unwrap_or(0)).collect();

        // Place: segments = [head on rank 0] + own chunks at their global positions.
        let offsets = layout.global_offsets(&order);
        let mut segments: Vec<KvCache<B>> = Vec::with_capacity(local.len() + 1);
        let mut seg_ids: Vec<usize> = Vec::with_capacity(local.len() + 1);
        phases.time(phase::ASSEMBLE, || -> Result<()> {
            if lead {
                segments.push(head_placed.placed(be, model.rope(), head_placed.positions(), cfg.n_kv_heads)?);
                seg_ids.push(0);
            }
            for ((&c, kv), &li) in local.iter().zip(&local_caches).zip(&layout_index) {
                let len = layout.chunks[c].len() as u32;
                let pos: Vec<u32> = (offsets[c]..offsets[c] + len).collect();
                segments.push(kv.placed(be, model.rope(), &pos, cfg.n_kv_heads)?);
                seg_ids.push(segment_id(li));
            }
            Ok(())
        })?;
        let first_chunk_seg = usize::from(lead);

        // Selection: global indices (layout order over all context tokens), identical everywhere.
        let k = result.budget;
        let selected: Vec<u32> = if k == 0 || !opts.method.selects() {
            Vec::new()
        } else if k >= n {
            (0..n as u32).collect()
        } else {
            let selector =
                selector_for::<B>(opts.method).ok_or_else(|| invalid(format!("{} selects nothing", opts.method)))?;
            let (head, placed) = segments.split_at(first_chunk_seg);
            let mut ctx = ScoreCtx {
                lm,
                layout,
                order: &order,
                local: &local,
                chunks: &local_caches,
                head: head.first(),
                placed,
                opts,
                aux: self,
                comm: &mut *comm,
            };
            crate::fault::point(rank, phase::PROBE);
            let scores = phases.time(phase::PROBE, || selector.score(&mut ctx))?;
            let starts = ctx.local_global_starts();
            phases.time(phase::SELECTION, || -> Result<Vec<u32>> {
                // Local candidates: this rank's best k (score, global index).
                let mut cand: Vec<(f32, u32)> = scores
                    .iter()
                    .zip(&starts)
                    .flat_map(|(s, &g)| s.iter().enumerate().map(move |(i, &v)| (v, (g + i) as u32)))
                    .collect();
                cand.sort_by(|a, b| rank_order((a.0, a.1 as usize), (b.0, b.1 as usize)));
                cand.truncate(k);
                let all: Vec<Vec<(f32, u32)>> = all_gather_value(comm, "select.candidates", &cand)?;
                // Rank 0 cuts the global top-k and lets the policy refine it.
                let cut = if lead {
                    let mut merged: Vec<(f32, u32)> = all.into_iter().flatten().collect();
                    merged.sort_by(|a, b| rank_order((a.0, a.1 as usize), (b.0, b.1 as usize)));
                    merged.truncate(k);
                    let mut flags: Vec<Vec<bool>> =
                        order.iter().map(|&c| vec![false; layout.chunks[c].len()]).collect();
                    let bounds = chunk_bounds(layout, &order);
                    for (_, g) in merged {
                        let (i, row) = locate(&bounds, g as usize);
                        flags[i][row] = true;
                    }
                    let flags = selector.refine(&[], flags);
                    let mut sel = Vec::new();
                    for (i, f) in flags.iter().enumerate() {
                        for (row, &on) in f.iter().enumerate() {
                            if on {
                                sel.push((bounds[i] + row) as u32);
                            }
                        }
                    }
                    Some(sel)
                } else {
                    None
                };
                Ok(broadcast_value(comm, "select.broadcast", 0, cut.as_ref())?)
            })?
        };

        // Where the selection lies: per chunk rows (for the result) and this rank's targets.
        let bounds = chunk_bounds(layout, &order);
        let mut all_positions = Vec::with_capacity(selected.len());
        let mut targets = Vec::new();
        let mut tokens = Vec::new();
        for &g in &selected {
            let (i, row) = locate(&bounds, g as usize);
            let c = order[i];
            all_positions.push(offsets[c] + row as u32);
            result.selected_rows[c].push(row);
            if owners[c] == rank {
                let j = local.iter().position(|&l| l == c).ok_or_else(|| invalid("selected chunk not held"))?;
                targets.push(Target { segment: first_chunk_seg + j, row });
                tokens.push(layout.chunks[c][row]);
            }
        }
        mine.selected = targets.len();
        crate::fault::point(rank, phase::RECOMPUTE);
        if !all_positions.is_empty() {
            phases.time(phase::RECOMPUTE, || {
                let replicated = (!lead).then_some(&head_placed);
                recompute(
                    model,
                    comm,
                    &mut segments,
                    replicated,
                    &targets,
                    &tokens,
                    &all_positions,
                    opts.scope,
                    opts.recompute_batch,
                )
            })?;
        }
        result.order = order;

        // The prompt over the sharded segments, then decoding.
        let segs: Vec<LocalSegment<'_, B>> =
            segments.iter().zip(&seg_ids).map(|(s, &id)| LocalSegment::placed(id, s)).collect();
        let prompt_start = layout.prompt_start();
        let prompt_pos: Vec<u32> = (prompt_start..prompt_start + layout.prompt.len() as u32).collect();
        self.prompt_and_decode(comm, segs, &layout.prompt, &prompt_pos, opts, phases, result, role, t0)
    }

    /// Runs the prompt over `segs`, then decodes (see [`Engine::decode_sharded`]).
    #[allow(clippy::too_many_arguments)]
    fn prompt_and_decode(
        &self,
        comm: &mut dyn Communicator,
        segs: Vec<LocalSegment<'_, B>>,
        prompt: &[u32],
        prompt_pos: &[u32],
        opts: &RunOptions,
        phases: &mut PhaseTimes,
        result: &mut RunResult,
        role: &mut Role<'_>,
        t0: Instant,
    ) -> Result<Option<(Vec<u32>, StopReason)>> {
        let model = &self.lm.model;
        let be = model.backend();
        let cfg = model.config();
        let mut tail = KvCache::new(be, cfg.n_layers, cfg.kv_dim(), KeyForm::Rotated)?;
        crate::fault::point(comm.rank(), phase::FINAL_PROMPT);
        let logits = phases.time(phase::FINAL_PROMPT, || -> Result<Vec<f32>> {
            let local: Vec<LocalSegment<'_, B>> = segs
                .iter()
                .map(|s| LocalSegment { id: s.id, cache: s.cache, positions: s.positions.clone() })
                .collect();
            let mut rep = Replicated::new(be, comm, "final", local, &mut tail, prompt_pos, vec![])?;
            let out = model.forward(prompt, prompt_pos, &mut rep, Logits::Last)?;
            rep.commit()?;
            Ok(out.last().to_vec())
        })?;
        let next_pos = prompt_pos.last().map_or(0, |p| p + 1);
        self.decode_with_tail(comm, segs, tail, logits, next_pos, opts, phases, result, role, t0)
    }

    /// Decoding over sharded segments with an empty tail (ring).
    #[allow(clippy::too_many_arguments)]
    fn decode_sharded(
        &self,
        comm: &mut dyn Communicator,
        segs: Vec<LocalSegment<'_, B>>,
        logits: Vec<f32>,
        next_pos: u32,
        opts: &RunOptions,
        phases: &mut PhaseTimes,
        result: &mut RunResult,
        role: &mut Role<'_>,
        t0: Instant,
    ) -> Result<Option<(Vec<u32>, StopReason)>> {
        let cfg = self.lm.model.config();
        let tail = KvCache::new(self.lm.model.backend(), cfg.n_layers, cfg.kv_dim(), KeyForm::Rotated)?;
        self.decode_with_tail(comm, segs, tail, logits, next_pos, opts, phases, result, role, t0)
    }

    /// Rank 0 picks each token and broadcasts it; every rank runs it over its segments and the
    /// replicated tail (flash-decoding across ranks); `None` ends the loop.
    #[allow(clippy::too_many_arguments)]
    fn decode_with_tail(
        &self,
        comm: &mut dyn Communicator,
        segs: Vec<LocalSegment<'_, B>>,
        mut tail: KvCache<B>,
        logits: Vec<f32>,
        next_pos: u32,
        opts: &RunOptions,
        phases: &mut PhaseTimes,
        result: &mut RunResult,
        role: &mut Role<'_>,
        t0: Instant,
    ) -> Result<Option<(Vec<u32>, StopReason)>> {
        let model = &self.lm.model;
        let be = model.backend();
        let window = model.config().context_length;
        let mut step = |comm: &mut dyn Communicator, tok: u32, pos: u32| -> flowprefill_worker::Result<Vec<f32>> {
            let local: Vec<LocalSegment<'_, B>> = segs
                .iter()
                .map(|s| LocalSegment { id: s.id, cache: s.cache, positions: s.positions.clone() })
                .collect();
            let mut rep = Replicated::new(be, comm, "decode", local, &mut tail, &[pos], vec![])?;
            let out = model.forward(&[tok], &[pos], &mut rep, Logits::Last)?;
            rep.commit()?;
            Ok(out.last().to_vec())
        };
        match role {
            Role::Lead { sampler, on_text } => {
                let first = phases.time(phase::FIRST_TOKEN, || sampler.sample(&logits));
                result.ttft = t0.elapsed();
                result.first_logits = logits;
                let t = Instant::now();
                let mut lead_step = |tok: u32, pos: u32| -> flowprefill_worker::Result<Vec<f32>> {
                    broadcast_value(comm, "decode.token", 0, Some(&Some((tok, pos))))?;
                    step(comm, tok, pos)
                };
                let out = decode_with(
                    &self.lm.tokenizer,
                    first,
                    sampler,
                    opts.max_new_tokens,
                    window,
                    next_pos,
                    &mut lead_step,
                    *on_text,
                )?;
                broadcast_value::<Option<(u32, u32)>>(comm, "decode.token", 0, Some(&None))?;
                phases.add(phase::DECODE, t.elapsed());
                Ok(Some(out))
            }
            Role::Follow => {
                let t = Instant::now();
                crate::fault::point(comm.rank(), phase::DECODE);
                while let Some((tok, pos)) = broadcast_value::<Option<(u32, u32)>>(comm, "decode.token", 0, None)? {
                    step(comm, tok, pos)?;
                }
                phases.add(phase::DECODE, t.elapsed());
                Ok(None)
            }
        }
    }
}

/// Start (global context index) of each layout position's chunk, plus the total at the end.
fn chunk_bounds(layout: &Layout, order: &[usize]) -> Vec<usize> {
    let mut b = Vec::with_capacity(order.len() + 1);
    let mut acc = 0;
    for &c in order {
        b.push(acc);
        acc += layout.chunks[c].len();
    }
    b.push(acc);
    b
}

/// (layout index, row) of global context index `g`.
fn locate(bounds: &[usize], g: usize) -> (usize, usize) {
    let i = bounds.partition_point(|&s| s <= g) - 1;
    (i, g - bounds[i])
}

impl<B: Backend> AuxCaches<B> for Engine<B> {
    fn aux_model(&self) -> &LoadedModel<B> {
        self.aux.as_deref().unwrap_or(&self.lm)
    }

    fn aux_caches(&self, layout: &Layout, chunks: &[usize]) -> Result<crate::select::HeadAndChunks<B>> {
        // The same model shares the main store (its shared-prefix chunk caches are the same).
        let (lm, store) = match &self.aux {
            Some(a) => (&**a, &self.aux_store),
            None => (&*self.lm, &self.store),
        };
        let c = self.caches(lm, store, layout, PrefixMode::Shared, chunks)?;
        Ok((c.head, c.chunks))
    }
}
