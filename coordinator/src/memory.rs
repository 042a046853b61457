//! The memory plan of a job: the bytes each rank holds at its peak, from the token counts
//! alone, before any work. Admission compares it with what the device has free.
//!
//! ```text
//!   full (rank 0):  KV cache reserved for prompt + answer   + one prefill piece's buffers
//!                   (with eviction: the context's cache, the prompt's and answer's tail; the
//!                   cache goes to the store after eviction, never copied while the job runs)
//!   ring (rank r):  K/V of its zigzag share                 + its share's forward + blocks in flight
//!   chunked:        chunk caches (the store's) and the head, then the largest of
//!                     chunk prefill   one batch's forward
//!                     after it        placed copies + (probe | recompute batch | prompt and answer)
//! ```
//! Every term is the size of buffers the pipeline allocates: the forward's (`Model::run_blocks`:
//! residual, norm, QKV, queries, gate-up and gated activation per row at the activations' type
//! ([`Backend::act_dtype`]: f32 on the CPU, bf16 on a GPU); the attention output in f32 (the
//! larger of its two types: a full prefill's is in the activations' type); K,
//! pre-RoPE K and V at the KV type), K/V of the caches at the KV type, attention partials
//! (output and log-sum-exp per query row), logits, and the backend's own scratch
//! ([`Backend::scratch_bytes`]). `tests/tests/suite/memory_plan.rs` runs the engine on a backend that
//! counts every byte it hands out and demands the plan's peak within 5% of the counted one (`PLAN_TOL`;
//! up to 10% above it on several ranks, where the selection is bounded: `PLAN_BOUND_TOL`).
//!
//! What the plan cannot know it bounds: which tokens a query selects (a rank's share of a
//! recompute batch as if every selected token were its own, up to its tokens and the batch;
//! the sparse scope's kept rows as the whole selection), and whether a chunk is already in
//! the store (counted as new; the store's bytes count as reclaimable at admission). CacheClip's
//! auxiliary model, when it is another model, is not counted. Chunks are planned where the
//! positional split puts them; cache-aware placement may give a rank up to `cache_slack` more
//! chunk tokens (a share of the largest load), chunks its store already holds.

pub use crate::error::DoesNotFit;
use crate::error::{CoordError, Result};
use crate::layout::Layout;
use crate::method::{Build, Depth, Probe};
use crate::pipeline::Pipeline;
use crate::request::{Geometry, Method, PrefixMode, RunOptions, Scope};
use crate::timings::phase;
use flowprefill_kernels::{gib, Backend, DType, Memory};
use flowprefill_worker::attend::GATHER_FROM_SOURCES;
use flowprefill_worker::config::ModelConfig;
use flowprefill_worker::steps::{batches, zigzag_pieces, DEFAULT_BATCH_TOKENS};
use flowprefill_worker::LoadedModel;

/// One thing a rank holds, and its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Part {
    /// What it is ("chunk caches", "activations", ...).
    pub what: &'static str,
    /// Bytes.
    pub bytes: usize,
}

/// What one rank holds at its peak.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct RankMemory {
    /// The rank.
    pub rank: usize,
    /// The phase the peak falls in.
    pub phase: &'static str,
    /// What is held then (zero parts left out).
    pub parts: Vec<Part>,
}

impl RankMemory {
    /// Bytes at the peak.
    pub fn bytes(&self) -> usize {
        self.parts.iter().map(|p| p.bytes).sum()
    }

    /// "chunk caches 0.37 GiB, placed copies 0.37 GiB, ..."
    pub fn describe(&self) -> String {
        self.parts.iter().map(|p| format!("{} {}", p.what, gib(p.bytes))).collect::<Vec<_>>().join(", ")
    }
}

/// The request as the plan sees it: token counts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tokens {
    /// Template tokens before the context.
    pub head: usize,
    /// Tokens per chunk (request order).
    pub chunks: Vec<usize>,
    /// Tokens after the context.
    pub prompt: usize,
}

impl Tokens {
    /// The counts of a tokenized request.
    pub fn of(layout: &Layout) -> Self {
        Self {
            head: layout.head.len(),
            chunks: layout.chunks.iter().map(Vec::len).collect(),
            prompt: layout.prompt.len(),
        }
    }

    fn context(&self) -> usize {
        self.chunks.iter().sum()
    }
}

/// Sizes of one model at one KV type, in bytes where they are bytes.
#[derive(Clone, Copy, Debug)]
struct Sizes {
    d: usize,
    qd: usize,
    kvd: usize,
    heads: usize,
    ffn: usize,
    layers: usize,
    vocab: usize,
    qk_norm: bool,
    /// Bytes per K/V element.
    kv: usize,
    /// Bytes per activation element.
    act: usize,
}

impl Sizes {
    fn new(m: &ModelConfig, kv: DType, act: DType) -> Self {
        Self {
            d: m.d_model,
            qd: m.q_dim(),
            kvd: m.kv_dim(),
            heads: m.n_heads,
            ffn: m.ffn_dim,
            layers: m.n_layers,
            vocab: m.vocab_size,
            qk_norm: m.arch.qk_norm(),
            kv: kv.size(),
            act: act.size(),
        }
    }

    /// K and V of one token in every layer.
    fn kv_token(&self) -> usize {
        self.layers * self.kv_row()
    }

    /// K and V of one token in one layer.
    fn kv_row(&self) -> usize {
        2 * self.kvd * self.kv
    }

    /// The forward's buffers per row (`Model::run_blocks`).
    fn forward_row(&self) -> usize {
        // Residual and norm, QKV, queries, gate-up, gated; the per-head norms' scratch.
        let acts = 2 * self.d + (self.qd + 2 * self.kvd) + self.qd + 3 * self.ffn;
        let norms = if self.qk_norm { self.qd + 2 * self.kvd } else { 0 };
        self.act * (acts + norms) + 4 * self.qd + 3 * self.kvd * self.kv
    }

    /// An attention partial (output and log-sum-exp) per query row.
    fn partial_row(&self) -> usize {
        4 * (self.qd + self.heads)
    }

    /// A log-sum-exp per query row.
    fn lse_row(&self) -> usize {
        4 * self.heads
    }

    /// Logits of `rows` rows: the final norm's input and output, and the vocabulary.
    fn logits(&self, rows: usize) -> usize {
        rows * (2 * self.d * self.act + 4 * self.vocab)
    }

    /// The widest GEMM input.
    fn widest(&self) -> usize {
        self.d.max(self.qd).max(self.ffn)
    }
}

/// One phase's holdings; the plan keeps the largest.
struct Phase {
    name: &'static str,
    parts: Vec<Part>,
}

impl Phase {
    fn new(name: &'static str, parts: &[(&'static str, usize)]) -> Self {
        Self { name, parts: parts.iter().map(|&(what, bytes)| Part { what, bytes }).collect() }
    }

    fn bytes(&self) -> usize {
        self.parts.iter().map(|p| p.bytes).sum()
    }
}

fn peak(rank: usize, phases: Vec<Phase>) -> RankMemory {
    let top = phases.into_iter().max_by_key(Phase::bytes);
    let (phase, parts) = top.map_or(("-", Vec::new()), |p| (p.name, p.parts));
    RankMemory { rank, phase, parts: parts.into_iter().filter(|p| p.bytes > 0).collect() }
}

/// What a plan needs to know of the device it plans for.
pub struct Target<'a> {
    /// The type K/V are kept as ([`Backend::kv_dtype`]).
    pub kv: DType,
    /// The activations' type ([`Backend::act_dtype`]).
    pub act: DType,
    /// The backend's own scratch for a forward of `rows` rows at most `width` wide
    /// ([`Backend::scratch_bytes`]).
    pub scratch: Box<dyn Fn(usize, usize) -> usize + 'a>,
    /// Tokens per forward of a full prefill ([`Backend::prefill_rows`]).
    pub prefill_rows: usize,
    /// Keys gathered for one attention call over many sources ([`Backend::gathered_keys`]).
    pub gathered_keys: usize,
}

/// Every rank's peak for a job of `tokens` run with `opts` on `ranks` ranks of a model of
/// dimensions `dims` on `target`.
pub fn plan(dims: &ModelConfig, target: &Target, opts: &RunOptions, ranks: usize, tokens: &Tokens) -> Vec<RankMemory> {
    let s = Sizes::new(dims, target.kv, target.act);
    let ranks = ranks.max(1);
    let scratch = |rows: usize| (target.scratch)(rows, s.widest());
    match opts.method.info().build {
        Build::Single => {
            let mut out = vec![full(&s, &scratch, opts, tokens, target.prefill_rows)];
            out.extend((1..ranks).map(|rank| RankMemory { rank, phase: "-", parts: Vec::new() }));
            out
        }
        Build::Ring => (0..ranks).map(|r| ring(&s, &scratch, opts, tokens, ranks, r)).collect(),
        Build::Chunked | Build::Chosen => {
            (0..ranks).map(|r| chunked(&s, &scratch, target.gathered_keys, opts, tokens, ranks, r)).collect()
        }
    }
}

/// [`plan`] for a loaded model and a tokenized request.
pub fn plan_for<B: Backend>(lm: &LoadedModel<B>, opts: &RunOptions, ranks: usize, layout: &Layout) -> Vec<RankMemory> {
    plan(lm.model.config(), &Target::of(lm.model.backend()), opts, ranks, &Tokens::of(layout))
}

impl<'a> Target<'a> {
    /// The device of backend `be`.
    pub fn of<B: Backend>(be: &'a B) -> Self {
        let scratch = Box::new(move |rows, width| be.scratch_bytes(rows, width));
        Self {
            kv: be.kv_dtype(),
            act: be.act_dtype(),
            scratch,
            prefill_rows: be.prefill_rows(),
            gathered_keys: be.gathered_keys(),
        }
    }
}

/// `full`: the cache reserved for the whole sequence and the answer, one piece's forward (of
/// at most `rows` tokens).
fn full(s: &Sizes, scratch: &dyn Fn(usize) -> usize, opts: &RunOptions, t: &Tokens, rows: usize) -> RankMemory {
    let total = t.head + t.context() + t.prompt;
    let piece = total.min(rows.max(1));
    let act = piece * (s.forward_row() + s.lse_row()) + s.logits(1);
    let phases = vec![Phase::new(
        phase::PREFILL,
        &[
            ("KV cache", s.kv_token() * (total + opts.max_new_tokens)),
            ("activations", act),
            ("scratch", scratch(piece)),
        ],
    )];
    peak(0, phases)
}

/// `ring`: this rank's zigzag share, its K/V, the blocks of one step in flight; then decoding.
fn ring(s: &Sizes, scratch: &dyn Fn(usize) -> usize, opts: &RunOptions, t: &Tokens, p: usize, me: usize) -> RankMemory {
    let total = t.head + t.context() + t.prompt;
    let pieces = zigzag_pieces(total, p);
    let rows_of = |r: usize| pieces[r].iter().map(|x| x.len()).sum::<usize>();
    let rows = rows_of(me);
    let owns_last = total > 0 && pieces[me].iter().any(|x| x.contains(&(total - 1)));
    let widest_block = (0..p).map(rows_of).max().unwrap_or(0);
    // Per layer: its own block, a received one, a partial and the running merge.
    let in_flight = (rows + widest_block) * s.kv_row() + 2 * rows * s.partial_row();
    let act = rows * s.forward_row() + s.logits(usize::from(owns_last));
    let prefill = Phase::new(
        phase::PREFILL,
        &[("KV cache", s.kv_token() * rows), ("activations", act + in_flight), ("scratch", scratch(rows))],
    );
    let decode = Phase::new(
        phase::DECODE,
        &[
            ("KV cache", s.kv_token() * rows),
            ("answer tail", s.kv_token() * opts.max_new_tokens),
            ("activations", s.forward_row() + 4 * s.partial_row() + s.logits(1)),
            ("scratch", scratch(1)),
        ],
    );
    peak(me, vec![prefill, decode])
}

/// Chunked methods (see the module docs).
#[allow(clippy::too_many_arguments)]
fn chunked(
    s: &Sizes,
    scratch: &dyn Fn(usize) -> usize,
    gathered_keys: usize,
    opts: &RunOptions,
    t: &Tokens,
    p: usize,
    me: usize,
) -> RankMemory {
    let plan = Pipeline::new(opts, &t.chunks, p, s.layers);
    let share = Share::new(s, scratch, gathered_keys, t, &plan, me);
    let mut phases = vec![share.chunk_prefill()];
    // The prompt over the segments: one partial per segment, the tail's and the merge.
    // LookaheadKV's rows follow the prompt in its probe (the prompt's K/V kept meanwhile).
    let probe = opts.method.info().probe;
    let m = t.prompt + if let Probe::Attention { rows_after_prompt, .. } = probe { rows_after_prompt } else { 0 };
    if plan.probes {
        phases.push(share.probe(opts, &plan, probe, m));
    }
    if plan.recomputed() > 0 {
        phases.push(share.recompute(opts, &plan));
    }
    phases.push(share.phase(
        phase::FINAL_PROMPT,
        vec![
            ("prompt and answer tail", s.kv_token() * (m + opts.max_new_tokens)),
            ("activations", share.replicated(m) + s.logits(1)),
            ("scratch", scratch(m)),
        ],
    ));
    peak(me, phases)
}

/// One rank's part of a chunked job: what it holds through every phase, and each phase's terms.
struct Share<'a> {
    s: &'a Sizes,
    scratch: &'a dyn Fn(usize) -> usize,
    t: &'a Tokens,
    prefix: PrefixMode,
    /// The chunks this rank holds, and their tokens.
    local: Vec<usize>,
    local_tokens: usize,
    /// Rank 0 also holds the head as a segment.
    lead: bool,
    /// Star's anchor: chunk 0's cache (and a placed copy) on a rank holding a later chunk.
    anchored: bool,
    /// The chunk caches and the head, held from the chunk prefill on.
    held: [(&'static str, usize); 2],
    /// Keys gathered for one attention call over the segments ([`Backend::gathered_keys`]).
    gathered_keys: usize,
    /// Ranks of the job ([`Pipeline::ranks`]).
    ranks: usize,
}

impl<'a> Share<'a> {
    fn new(
        s: &'a Sizes,
        scratch: &'a dyn Fn(usize) -> usize,
        gathered_keys: usize,
        t: &'a Tokens,
        plan: &Pipeline,
        me: usize,
    ) -> Self {
        let local = plan.local_chunks(me);
        let local_tokens: usize = local.iter().map(|&c| t.chunks[c]).sum();
        let anchored = plan.prefix == PrefixMode::Anchor && local.iter().any(|&c| c != 0);
        let anchor = if anchored && !local.contains(&0) { t.chunks.first().copied().unwrap_or(0) } else { 0 };
        // The head in the store and placed once (the chunk prefill's copy and the pipeline's
        // are not alive together).
        let held = [("chunk caches", s.kv_token() * (local_tokens + anchor)), ("head", 2 * s.kv_token() * t.head)];
        Self {
            s,
            scratch,
            t,
            prefix: plan.prefix,
            local,
            local_tokens,
            lead: me == 0,
            anchored,
            held,
            gathered_keys,
            ranks: plan.ranks,
        }
    }

    /// K and V (one layer) of the sources that `attend_over` copies into one buffer where the
    /// backend gathers them: at most its key budget, and only with enough sources. `other_rows`
    /// of other ranks' selected rows travel in the sparse scope (one source per rank, beside
    /// this rank's segments and the head, which ranks other than 0 hold as a copy); in the exact
    /// scope (the recomputation's, CacheBlend's deviation) the sources are this rank's segments.
    fn gathered(&self, scope: Scope, other_rows: usize) -> usize {
        let head = if self.lead { self.t.head } else { 0 };
        let (sources, keys) = match scope {
            Scope::Exact => (self.local.len() + usize::from(self.lead), self.local_tokens + head),
            Scope::Sparse => {
                let others = if other_rows > 0 { self.ranks.saturating_sub(1) } else { 0 };
                (self.local.len() + 1 + others, self.local_tokens + self.t.head + other_rows)
            }
        };
        if self.gathered_keys == 0 || sources < GATHER_FROM_SOURCES {
            return 0;
        }
        keys.min(self.gathered_keys) * self.s.kv_row()
    }

    /// A phase after the chunk prefill: every local chunk placed at its global position (the
    /// head too on rank 0) beside what is held, and `parts`.
    fn phase(&self, name: &'static str, parts: Vec<(&'static str, usize)>) -> Phase {
        let placed =
            ("placed copies", self.s.kv_token() * (self.local_tokens + if self.lead { self.t.head } else { 0 }));
        let mut all = vec![self.held[0], self.held[1], placed];
        all.extend(parts);
        Phase::new(name, &all)
    }

    /// `rows` of queries over the segments: their forward, one partial per segment, the tail's
    /// and the merge.
    fn replicated(&self, rows: usize) -> usize {
        let segments = self.local.len() + usize::from(self.lead);
        rows * self.s.forward_row() + (segments + 2) * rows * self.s.partial_row()
    }

    /// Phase 1: batches of missing chunks; a chunk attends to the head (and the anchor) when
    /// its prefix mode puts it behind them.
    fn chunk_prefill(&self) -> Phase {
        let (s, t) = (self.s, self.t);
        let behind = |c: usize| match self.prefix {
            PrefixMode::None => c == 0,
            PrefixMode::Shared | PrefixMode::Anchor => true,
        };
        let sources = |c: usize| usize::from(behind(c)) + usize::from(self.anchored && c != 0) + 1;
        // The anchor is prefilled alone first, the later chunks after it in batches.
        let rest: Vec<usize> = self.local.iter().copied().filter(|&c| !self.anchored || c != 0).collect();
        let lens: Vec<usize> = rest.iter().map(|&c| t.chunks[c]).collect();
        let mut groups: Vec<&[usize]> = if self.anchored { vec![&[0]] } else { Vec::new() };
        groups.extend(batches(&lens, DEFAULT_BATCH_TOKENS).into_iter().map(|r| &rest[r]));
        let mut batch_bytes = 0;
        for batch in groups {
            let rows: usize = batch.iter().map(|&c| t.chunks[c]).sum();
            let single = batch.len() == 1;
            let per_chunk = batch
                .iter()
                .map(|&c| {
                    let m = t.chunks[c];
                    let merged = if sources(c) > 1 { m * s.partial_row() } else { 0 };
                    let gathered = if single { 0 } else { m * (4 * s.qd + 3 * s.kvd * s.kv + 4 * s.qd) };
                    m * s.lse_row() + merged + gathered
                })
                .max()
                .unwrap_or(0);
            batch_bytes = batch_bytes.max(rows * s.forward_row() + per_chunk + (self.scratch)(rows));
        }
        let anchor_placed = if self.anchored { t.chunks.first().copied().unwrap_or(0) } else { 0 };
        Phase::new(
            phase::CHUNK_PREFILL,
            &[self.held[0], self.held[1], ("anchor", s.kv_token() * anchor_placed), ("activations", batch_bytes)],
        )
    }

    /// The method's `probe` (its depth, CacheBlend's deviation) of `m` query rows.
    fn probe(&self, opts: &RunOptions, plan: &Pipeline, probe: Probe, m: usize) -> Phase {
        let (s, local_tokens) = (self.s, self.local_tokens);
        // CacheBlend's value deviation: every local token through the first layers, its rows
        // written into the placed segments (no copies), the queries of every rank visiting
        // them (exact scope).
        let deviation = || {
            let exact = self.t.context() * (4 * s.qd + 3 * s.partial_row()) + local_tokens * s.partial_row();
            vec![
                ("activations", local_tokens * s.forward_row() + exact),
                ("gathered keys", self.gathered(Scope::Exact, 0)),
                ("scratch", (self.scratch)(local_tokens)),
            ]
        };
        // The query's attention to the segments, weighted over the scoring layers (the method's
        // probe, or the reorder's first stage).
        let attention = || {
            let weighted = match probe {
                Probe::Attention { depth: Depth::AllLayers, .. } => s.layers,
                Probe::Attention { depth: Depth::AuxLastLayer, .. } => 1,
                _ => plan.score_layers.1.saturating_sub(plan.score_layers.0) + 1,
            };
            // Pre-RoPE segments are rotated per layer in the other geometries, and by the
            // reorder's first stage (it probes under HL-TP) in every one.
            let rotated =
                if opts.geometry == Geometry::Global && !opts.reorder { 0 } else { local_tokens * s.kvd * s.kv };
            vec![
                ("activations", self.replicated(m) + rotated + weighted * local_tokens * 4),
                ("prompt tail", s.kv_token() * m),
                ("scratch", (self.scratch)(m)),
            ]
        };
        let total = |parts: &[(&'static str, usize)]| parts.iter().map(|p| p.1).sum::<usize>();
        // With `+reorder` CacheBlend runs both, one after the other: the larger is the peak.
        let parts = match (probe == Probe::Deviation, opts.reorder) {
            (true, false) => deviation(),
            (true, true) => {
                let (d, a) = (deviation(), attention());
                if total(&d) >= total(&a) {
                    d
                } else {
                    a
                }
            }
            (false, _) => attention(),
        };
        self.phase(phase::PROBE, parts)
    }

    /// This rank's share of the selection, at most one batch of it per forward.
    fn recompute(&self, opts: &RunOptions, plan: &Pipeline) -> Phase {
        let s = self.s;
        let (k, batch) = (plan.recomputed(), plan.recompute_batch);
        // This rank's rows of one batch and the other ranks' rows it sees, each at its bound,
        // not the even share: the query's attention concentrates on the documents it is about,
        // so one rank may hold the whole selection, or none of it ([2, 11, 6] of an even
        // [7, 7, 7] measured at ratio 0.1 on 3 ranks).
        let total = k.min(batch);
        let (mine, others) = (total.min(self.local_tokens), if self.ranks > 1 { total } else { 0 });
        let attend = match opts.scope {
            Scope::Exact => total * (4 * s.qd + 3 * s.partial_row()) + mine * s.partial_row(),
            Scope::Sparse => others * s.kv_row() + mine * (s.lse_row() + s.partial_row()),
        };
        // The sparse scope keeps the other ranks' rows of earlier batches, every layer's, for
        // the later batches (none with one batch or one rank): at most the whole selection.
        let kept = if opts.scope == Scope::Sparse && k > batch && self.ranks > 1 { k * s.kv_token() } else { 0 };
        self.phase(
            phase::RECOMPUTE,
            vec![
                ("activations", mine * s.forward_row() + attend),
                ("gathered keys", self.gathered(opts.scope, others)),
                ("other ranks' rows", kept),
                ("scratch", (self.scratch)(mine)),
            ],
        )
    }
}

/// Checks `need` (the bytes of every rank sharing this device, `mine` among them) against
/// `memory` and `reclaimable` bytes of the chunk store. `Ok(0)`: it fits; `Ok(n)`: it fits once
/// the store gives back `n` bytes.
pub fn fits(mine: &RankMemory, need: usize, memory: &Memory, reclaimable: usize) -> Result<usize> {
    if need <= memory.free {
        return Ok(0);
    }
    let short = need - memory.free;
    if short <= reclaimable {
        return Ok(short);
    }
    Err(CoordError::DoesNotFit(Box::new(DoesNotFit {
        rank: mine.rank,
        device: memory.device.clone(),
        need,
        free: memory.free + reclaimable,
        store: reclaimable,
        phase: mine.phase,
        parts: mine.describe(),
        capped: false,
        kv_bf16: false,
        whole_on_rank_0: false,
        peers: 1,
    })))
}

/// Where a job's memory is checked: which rank, how many ranks share its device, what the
/// chunk stores could give back, and the operator's cap.
#[derive(Clone, Copy, Debug, Default)]
pub struct Room {
    /// The rank checking.
    pub rank: usize,
    /// Ranks of the job.
    pub ranks: usize,
    /// Ranks whose jobs share this rank's device (1: its own device).
    pub peers: usize,
    /// Bytes the chunk stores could give back.
    pub reclaimable: usize,
    /// At most this many bytes for a job (`--memory-limit`), whatever the device has free.
    pub limit: Option<usize>,
}

/// The memory a job may plan for on `be`: what its device has free, capped by `limit` (with no
/// free memory known, the cap alone; neither: `None`).
pub fn available<B: Backend>(be: &B, limit: Option<usize>) -> Option<Memory> {
    match (be.memory(), limit) {
        (Some(m), Some(l)) => Some(Memory { free: m.free.min(l), ..m }),
        (Some(m), None) => Some(m),
        (None, Some(l)) => Some(Memory { device: be.name().to_string(), free: l }),
        (None, None) => None,
    }
}

/// Admission by memory: the plan of `room.rank` for `opts` over `layout` (the sum of every
/// rank's when ranks share the device) against [`available`] memory and what the stores could
/// give back. `Ok(0)`: fits, or nothing is known; `Ok(n)`: fits once the stores give back `n`
/// bytes; a [`DoesNotFit`] error otherwise.
pub fn admit_memory<B: Backend>(lm: &LoadedModel<B>, opts: &RunOptions, layout: &Layout, room: Room) -> Result<usize> {
    let Some(mem) = available(lm.model.backend(), room.limit) else { return Ok(0) };
    let plans = plan_for(lm, opts, room.ranks, layout);
    let Some(mine) = plans.get(room.rank) else {
        return Err(crate::error::internal(format!("no memory plan for rank {} of {}", room.rank, room.ranks)));
    };
    let need = shared_need(&plans, room.rank, room.peers);
    // A cap is a bound on the job, not on what is free: the store cannot raise it.
    let capped = room.limit.is_some_and(|l| l <= mem.free);
    let reclaimable = if capped { 0 } else { room.reclaimable };
    fits(mine, need, &mem, reclaimable).map_err(|e| match e {
        CoordError::DoesNotFit(mut d) => {
            d.capped = capped;
            d.kv_bf16 = lm.model.backend().kv_dtype() == DType::Bf16;
            d.whole_on_rank_0 = opts.method.info().build == Build::Single;
            d.peers = room.peers.max(1);
            CoordError::DoesNotFit(d)
        }
        e => e,
    })
}

/// What rank `rank`'s device must hold when `peers` ranks of the job (it included) use it:
/// its own plan and the largest `peers - 1` of the others' (every rank's for thread ranks,
/// whose peers are all of the job's; which MPI ranks share a node is not known here, so the
/// largest stand for them).
fn shared_need(plans: &[RankMemory], rank: usize, peers: usize) -> usize {
    let mine = plans.get(rank).map_or(0, RankMemory::bytes);
    let mut others: Vec<usize> = plans.iter().filter(|p| p.rank != rank).map(RankMemory::bytes).collect();
    others.sort_unstable_by(|a, b| b.cmp(a));
    mine + others.iter().take(peers.saturating_sub(1)).sum::<usize>()
}

/// Bytes the smallest job needs (one context token, a short prompt, one answer token, `full`):
/// below this much free memory a server cannot run anything.
pub fn smallest_job<B: Backend>(lm: &LoadedModel<B>) -> usize {
    let be = lm.model.backend();
    let opts = RunOptions { method: Method::Full, max_new_tokens: 1, ..RunOptions::default() };
    let tokens = Tokens { head: 16, chunks: vec![1], prompt: 16 };
    plan(lm.model.config(), &Target::of(be), &opts, 1, &tokens)[0].bytes()
}

#[cfg(test)]
mod tests;
