//! Work accounting: what every rank computes and sends, phase by phase, for one request.
//!
//! The chunked methods walk the engine's own description of the job,
//! [`Pipeline`](flowprefill_coordinator::pipeline::Pipeline): who holds which chunk, the
//! selection budget and whether the probe runs, its scoring layers, the chunk-prefill batches,
//! the recompute batches and the prefix mode in effect; the ring's split is the engine's
//! [`zigzag_pieces`], the full prefill's pieces the CPU's [`PREFILL_ROWS`] (a GPU's larger pieces
//! change the count of forwards, not the rows or the visible pairs). What this module
//! adds is the visibility rule every attention call applies (a key is seen when its position
//! is not after the query's), counted in closed form over position ranges, and the wire size
//! of every message (`comm::wire` sections: a 4-byte count, then the values; the control rows,
//! then per buffer its type tag and its values, 4 bytes per f32, `kv_bytes` per K/V element).
//!
//! A test in `tests/tests/suite/projection_counts.rs` runs the real engine on a backend that counts
//! GEMM rows and visible attention pairs, and the communicator's own byte counters, and
//! demands the same numbers from this module: if the pipeline changes, that test fails until
//! this accounting follows.

use super::{Cost, ProjectError, Shape};
use flowprefill_coordinator::method::Build;
use flowprefill_coordinator::pipeline::{Pipeline, Selection, Step};
use flowprefill_coordinator::request::{Method, PrefixMode, RunOptions, Scope};
use flowprefill_coordinator::timings::phase;
use flowprefill_kernels::PREFILL_ROWS;
use flowprefill_worker::steps::zigzag_pieces;
use std::ops::Range;

/// One model forward: `rows` tokens through `layers` blocks, `logit_rows` of them to logits.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Forward {
    /// Rows (tokens) of the GEMMs.
    pub rows: usize,
    /// Blocks run.
    pub layers: usize,
    /// Rows projected to the vocabulary.
    pub logit_rows: usize,
}

/// Attention calls with the same shape on `layers` blocks: `queries` over `keys`, of which
/// `pairs` (query, key) pairs are visible (per head, per layer).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Attn {
    /// Query rows.
    pub queries: usize,
    /// Keys read.
    pub keys: usize,
    /// Visible (query, key) pairs per head and layer.
    pub pairs: u64,
    /// Blocks this call repeats on.
    pub layers: usize,
    /// Ring step this call belongs to (its transfer may overlap it).
    pub step: Option<usize>,
}

/// One collective as one rank sees it, repeated `calls` times.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Message {
    /// The collective's name (as in the communicator's statistics).
    pub op: String,
    /// Times it runs.
    pub calls: usize,
    /// Payload bytes this rank sends per call (all peers together).
    pub sent: u64,
    /// Payload bytes this rank receives per call.
    pub received: u64,
    /// Ring step (the transfer that overlaps the attention of the same step).
    pub step: Option<usize>,
    /// Whether this rank's sends travel behind its own later work: it posts them and goes on
    /// as soon as what it receives is here, because nothing it computes next waits on a reply
    /// to them (the sparse scope's K/V all-gather). The rank waits for the bytes it receives;
    /// the bytes it sends cost the receivers.
    pub behind: bool,
}

/// The work of one rank in one phase.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct PhaseWork {
    /// Phase name (as in the engine's timings).
    pub phase: &'static str,
    /// Model forwards.
    pub forwards: Vec<Forward>,
    /// Attention calls (softmax attention with its value product).
    pub attn: Vec<Attn>,
    /// Attention-mass passes (the probe's scores: QK and exp, no value product).
    pub scores: Vec<Attn>,
    /// Collectives.
    pub messages: Vec<Message>,
}

/// Counted quantities of a phase (or a sum of phases) for a model shape.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct Counts {
    /// Rows x blocks through the GEMMs.
    pub gemm_row_layers: u64,
    /// Rows projected to logits.
    pub logit_rows: u64,
    /// GEMM FLOPs (blocks and logits).
    pub gemm_flops: f64,
    /// Visible pairs x blocks of the attention calls (per head).
    pub attn_pair_layers: u64,
    /// Attention FLOPs (QK and PV: 4 per pair, head dimension and head).
    pub attn_flops: f64,
    /// Visible pairs x blocks of the score passes (per head).
    pub score_pair_layers: u64,
    /// Score FLOPs (QK: 2 per pair, head dimension and head).
    pub score_flops: f64,
    /// Weights read (bytes at `weight_bytes` each): once per forward and block.
    pub weight_bytes: f64,
    /// K/V read by attention (bytes at `kv_bytes` per element): once per call and block.
    pub kv_bytes: f64,
    /// Payload bytes sent.
    pub sent: u64,
    /// Payload bytes received.
    pub received: u64,
}

impl PhaseWork {
    fn new(phase: &'static str) -> Self {
        Self { phase, ..Default::default() }
    }

    /// Counted quantities for `shape` (`weight_bytes`, `kv_bytes`: bytes per element).
    pub fn counts(&self, shape: &Shape, weight_bytes: f64, kv_bytes: f64) -> Counts {
        let mut c = Counts::default();
        let head_flops = (shape.n_heads * shape.head_dim) as f64;
        for f in &self.forwards {
            c.gemm_row_layers += (f.rows * f.layers) as u64;
            c.logit_rows += f.logit_rows as u64;
            c.gemm_flops += (f.rows * f.layers) as f64 * shape.gemm_flops_per_row_layer()
                + f.logit_rows as f64 * shape.logits_flops_per_row();
            c.weight_bytes += f.layers as f64 * shape.layer_params() * weight_bytes;
            if f.logit_rows > 0 {
                c.weight_bytes += (shape.d_model * shape.vocab_size) as f64 * weight_bytes;
            }
        }
        for a in &self.attn {
            c.attn_pair_layers += a.pairs * a.layers as u64;
            c.attn_flops += 4.0 * (a.pairs * a.layers as u64) as f64 * head_flops;
            c.kv_bytes += (a.keys * a.layers * 2 * shape.kv_dim()) as f64 * kv_bytes;
        }
        for s in &self.scores {
            c.score_pair_layers += s.pairs * s.layers as u64;
            c.score_flops += 2.0 * (s.pairs * s.layers as u64) as f64 * head_flops;
            c.kv_bytes += (s.keys * s.layers * shape.kv_dim()) as f64 * kv_bytes;
        }
        for m in &self.messages {
            c.sent += m.sent * m.calls as u64;
            c.received += m.received * m.calls as u64;
        }
        c
    }
}

impl std::ops::AddAssign for Counts {
    fn add_assign(&mut self, o: Self) {
        self.gemm_row_layers += o.gemm_row_layers;
        self.logit_rows += o.logit_rows;
        self.gemm_flops += o.gemm_flops;
        self.attn_pair_layers += o.attn_pair_layers;
        self.attn_flops += o.attn_flops;
        self.score_pair_layers += o.score_pair_layers;
        self.score_flops += o.score_flops;
        self.weight_bytes += o.weight_bytes;
        self.kv_bytes += o.kv_bytes;
        self.sent += o.sent;
        self.received += o.received;
    }
}

/// The request as the planner sees it: token counts, not tokens.
#[derive(Clone, Debug)]
pub struct Request {
    /// Template tokens before the context.
    pub head: usize,
    /// Tokens per context chunk (request order).
    pub chunks: Vec<usize>,
    /// Tokens after the context (question and template close).
    pub prompt: usize,
    /// Selected context indices (sorted); `None`: the budget spread evenly over the context
    /// (which tokens a real query selects is data-dependent; the spread decides how many keys
    /// each recomputed row sees under causality).
    pub selected: Option<Vec<usize>>,
    /// Chunks whose caches the chunk store already holds (request order; empty: none): they
    /// cost no chunk prefill (`--method auto` counts the store's hits this way).
    pub cached: Vec<bool>,
}

impl Request {
    /// Documents of `doc_tokens` tokens each making `context` tokens, with a head and prompt.
    pub fn documents(context: usize, doc_tokens: usize, head: usize, prompt: usize) -> Self {
        let per = doc_tokens.max(1);
        let mut chunks = vec![per; context / per];
        if !context.is_multiple_of(per) {
            chunks.push(context % per);
        }
        Self { head, chunks, prompt, selected: None, cached: Vec::new() }
    }

    /// The request of a finished run, with the run's own selection; a run whose chunk caches
    /// were all found in the store (`bench ttft --cache ram|disk`) is projected with every
    /// chunk cached (no chunk prefill; a disk read is not modelled), where it was projected
    /// cold before 2026-11-28 (proj/meas 24 on a warm row).
    pub fn of_run(r: &flowprefill_coordinator::RunResult) -> Self {
        let mut selected = Vec::new();
        let mut start = 0;
        for (rows, &len) in r.selected_rows.iter().zip(&r.chunk_tokens) {
            selected.extend(rows.iter().map(|&row| start + row));
            start += len;
        }
        selected.sort_unstable();
        Self {
            head: r.n_head_tokens,
            chunks: r.chunk_tokens.clone(),
            prompt: r.n_prompt_tokens,
            selected: Some(selected),
            cached: if r.cache_misses == 0 && r.cache_hits > 0 { vec![true; r.chunk_tokens.len()] } else { Vec::new() },
        }
    }

    /// Context tokens.
    pub fn n_context(&self) -> usize {
        self.chunks.iter().sum()
    }
}

/// Every rank's phases for one request.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Work {
    /// Method planned.
    pub method: Method,
    /// Ranks.
    pub ranks: usize,
    /// Per rank, phases in pipeline order.
    pub per_rank: Vec<Vec<PhaseWork>>,
}

impl Work {
    /// Counted quantities of `rank`, summed over its phases.
    pub fn rank_counts(&self, rank: usize, shape: &Shape, weight_bytes: f64, kv_bytes: f64) -> Counts {
        let mut c = Counts::default();
        for p in self.per_rank.get(rank).into_iter().flatten() {
            c += p.counts(shape, weight_bytes, kv_bytes);
        }
        c
    }
}

/// Visible (query, key) pairs between a range of query positions and a range of key
/// positions: keys at or before the query's position.
pub fn range_pairs(q: Range<u64>, k: Range<u64>) -> u64 {
    if q.is_empty() || k.is_empty() {
        return 0;
    }
    let klen = k.end - k.start;
    // Queries before k.start see nothing; in [k.start, k.end) query i sees i + 1 - k.start
    // keys; from k.end on, all of them.
    let (a, b) = (q.start.max(k.start), q.end.min(k.end));
    let ramp = if a < b {
        let (lo, hi) = (a + 1 - k.start, b - k.start); // an arithmetic series lo..=hi
        (lo + hi) * (hi - lo + 1) / 2
    } else {
        0
    };
    let full = q.end.saturating_sub(q.start.max(k.end));
    ramp + full * klen
}

/// Keys among sorted positions `keys` at or before `q`.
fn points_before(keys: &[u64], q: u64) -> u64 {
    keys.partition_point(|&k| k <= q) as u64
}

/// Keys of one attention source at or before a query position.
type KeysBefore = Box<dyn Fn(u64) -> u64>;

/// Bytes (sent, received) of an all-gather in which each rank sends `size(its rows)`.
type Gathered<'g> = &'g dyn Fn(&dyn Fn(usize) -> u64) -> (u64, u64);

/// Bytes of a staged message (`comm::wire`, as `worker::steps::transport` writes it): the control
/// rows (a section of `rows` u32 values), then per buffer a type tag (a section of one u32) and
/// its values (a section of `len` elements of `elem` bytes); a section is a 4-byte count, then
/// the values.
fn message(rows: usize, bufs: &[(usize, usize)]) -> u64 {
    4 + 4 * rows as u64 + bufs.iter().map(|&(len, elem)| 8 + 4 + (len * elem) as u64).sum::<u64>()
}

/// Bytes of the partials `Replicated` sends (ids, then out and lse per segment, f32).
fn partials(n_segments: usize, m: usize, shape: &Shape) -> u64 {
    message(n_segments, &[(m * shape.q_dim(), 4), (m * shape.n_heads, 4)].repeat(n_segments))
}

/// Plans one request: every rank's work per phase, for the method and options given, with K/V
/// of `kv_bytes` bytes per element (4: f32 caches, the CPU's default; 2: bf16, a GPU's).
pub fn plan(
    shape: &Shape,
    opts: &RunOptions,
    ranks: usize,
    req: &Request,
    kv_bytes: usize,
) -> Result<Work, ProjectError> {
    let p = ranks.max(1);
    let l = shape.n_layers;
    let info = opts.method.info();
    let per_rank = match info.build {
        _ if !info.projected => return Err(ProjectError::Unsupported { method: opts.method.name().to_string() }),
        Build::Single => {
            if p != 1 {
                return Err(ProjectError::Invalid("full prefill runs on one rank".into()));
            }
            vec![full(req, l)]
        }
        Build::Ring => ring(shape, req, p, kv_bytes),
        Build::Chunked | Build::Chosen => chunked(shape, opts, p, req, kv_bytes)?,
    };
    Ok(Work { method: opts.method, ranks: p, per_rank })
}

/// `full`: the whole sequence in pieces of [`PREFILL_ROWS`], each over the cache so far.
fn full(req: &Request, l: usize) -> Vec<PhaseWork> {
    let t = (req.head + req.n_context() + req.prompt) as u64;
    let mut ph = PhaseWork::new(phase::PREFILL);
    let mut s = 0u64;
    while s < t {
        let e = (s + PREFILL_ROWS as u64).min(t);
        ph.forwards.push(Forward { rows: (e - s) as usize, layers: l, logit_rows: usize::from(e == t) });
        ph.attn.push(Attn {
            queries: (e - s) as usize,
            keys: e as usize,
            pairs: range_pairs(s..e, 0..e),
            layers: l,
            step: None,
        });
        s = e;
    }
    vec![ph]
}

/// `ring`: zigzag pieces, K/V blocks passed P-1 times per layer, overlapped with attention.
fn ring(shape: &Shape, req: &Request, p: usize, kv: usize) -> Vec<Vec<PhaseWork>> {
    let t = req.head + req.n_context() + req.prompt;
    let l = shape.n_layers;
    let pieces = zigzag_pieces(t, p);
    let as_u64 = |r: &Range<usize>| r.start as u64..r.end as u64;
    (0..p)
        .map(|me| {
            let mine = &pieces[me];
            let rows: usize = mine.iter().map(|r| r.len()).sum();
            let owns_last = t > 0 && mine.iter().any(|r| r.contains(&(t - 1)));
            let mut ph = PhaseWork::new(phase::PREFILL);
            ph.forwards.push(Forward { rows, layers: l, logit_rows: usize::from(owns_last) });
            for step in 0..p {
                // At step s this rank holds the block of rank me - s.
                let from = (me + p - step) % p;
                let blk = &pieces[from];
                let blk_rows: usize = blk.iter().map(|r| r.len()).sum();
                if rows > 0 && blk_rows > 0 {
                    let pairs: u64 =
                        mine.iter().flat_map(|q| blk.iter().map(move |k| range_pairs(as_u64(q), as_u64(k)))).sum();
                    ph.attn.push(Attn { queries: rows, keys: blk_rows, pairs, layers: l, step: Some(step) });
                }
                if step + 1 < p {
                    // Send the block held now to the next rank, receive the previous rank's.
                    let prev_blk: usize = pieces[(from + p - 1) % p].iter().map(|r| r.len()).sum();
                    let bytes = |n: usize| message(n, &[(n * shape.kv_dim(), kv), (n * shape.kv_dim(), kv)]);
                    ph.messages.push(Message {
                        op: "ring.kv".into(),
                        calls: l,
                        sent: bytes(blk_rows),
                        received: bytes(prev_blk),
                        step: Some(step),
                        behind: false,
                    });
                }
            }
            vec![ph]
        })
        .collect()
}

/// Chunked methods: the counted work of every step of the engine's [`Pipeline::steps`], per
/// rank (placement and the top-k run no model work and send no accounted message).
fn chunked(
    shape: &Shape,
    opts: &RunOptions,
    p: usize,
    req: &Request,
    kv: usize,
) -> Result<Vec<Vec<PhaseWork>>, ProjectError> {
    let pipe = Pipeline::new(opts, &req.chunks, p, shape.n_layers);
    if pipe.runs(Step::Reorder) {
        return Err(ProjectError::Unsupported { method: format!("{}+reorder", opts.method.name()) });
    }
    if pipe.runs(Step::Evict) {
        return Err(ProjectError::Unsupported { method: "KV eviction (--evict)".into() });
    }
    if pipe.prefix == PrefixMode::Anchor {
        return Err(ProjectError::Unsupported { method: "the anchor prefix mode".into() });
    }
    if req.n_context() == 0 {
        return Err(ProjectError::Invalid("the context has no tokens".into()));
    }
    let job = Job::new(shape, opts, &pipe, req, kv);
    let steps = pipe.steps();
    Ok((0..p)
        .map(|r| {
            let segs = job.segments(r);
            steps
                .iter()
                .filter_map(|&step| match step {
                    Step::ChunkPrefill => Some(job.chunk_prefill(r)),
                    Step::Score { probe: true } => {
                        let (a, b) = pipe.score_layers;
                        Some(job.over_segments(r, &segs, step, b + 1, Some(b + 1 - a)))
                    }
                    Step::Recompute => (!job.sel.is_empty()).then(|| job.recompute(r, &segs)),
                    Step::Prompt => Some(job.over_segments(r, &segs, step, shape.n_layers, None)),
                    Step::Reorder | Step::Place | Step::Score { probe: false } | Step::Select | Step::Evict => None,
                })
                .collect()
        })
        .collect())
}

/// One chunked request as the counting sees it: the pipeline, where every chunk and the prompt
/// lie, and every selected token's global position and owner.
struct Job<'a> {
    shape: &'a Shape,
    scope: Scope,
    pipe: &'a Pipeline,
    req: &'a Request,
    /// Ranks.
    p: usize,
    /// Bytes per K/V element.
    kv: usize,
    /// Global start of each chunk (identity order: no reordering).
    starts: Vec<u64>,
    /// The prompt's positions.
    prompt: Range<u64>,
    /// (global position, owner rank) of every selected token.
    sel: Vec<(u64, usize)>,
}

impl<'a> Job<'a> {
    fn new(shape: &'a Shape, opts: &RunOptions, pipe: &'a Pipeline, req: &'a Request, kv: usize) -> Self {
        let (h, m, n) = (req.head as u64, req.prompt as u64, req.n_context());
        let starts: Vec<u64> = req
            .chunks
            .iter()
            .scan(h, |acc, &c| {
                let s = *acc;
                *acc += c as u64;
                Some(s)
            })
            .collect();
        let k = pipe.budget;
        let selected: Vec<usize> = match pipe.selection {
            Selection::Nothing => Vec::new(),
            Selection::Everything => (0..n).collect(),
            Selection::Scored => match &req.selected {
                Some(s) => s.clone(),
                None => (0..k).map(|i| (2 * i + 1) * n / (2 * k)).collect(),
            },
        };
        let chunk_of = |g: usize| -> usize {
            let mut acc = 0;
            for (c, &len) in req.chunks.iter().enumerate() {
                if g < acc + len {
                    return c;
                }
                acc += len;
            }
            req.chunks.len().saturating_sub(1)
        };
        let sel = selected.iter().map(|&g| (h + g as u64, pipe.owners[chunk_of(g)])).collect();
        let prompt = (h + n as u64)..(h + n as u64 + m);
        Self { shape, scope: opts.scope, pipe, req, p: pipe.ranks, kv, starts, prompt, sel }
    }

    /// Rank `r`'s segments at their global positions: the head on rank 0, then its chunks.
    fn segments(&self, r: usize) -> Vec<Range<u64>> {
        let h = self.req.head as u64;
        (r == 0)
            .then_some(0..h)
            .into_iter()
            .chain(
                self.pipe.local_chunks(r).iter().map(|&c| self.starts[c]..self.starts[c] + self.req.chunks[c] as u64),
            )
            .collect()
    }

    /// Chunk prefill: the head on every rank, then rank `r`'s chunks in batches.
    fn chunk_prefill(&self, r: usize) -> PhaseWork {
        let (req, l, h) = (self.req, self.shape.n_layers, self.req.head as u64);
        let mut cp = PhaseWork::new(Step::ChunkPrefill.phase());
        cp.forwards.push(Forward { rows: req.head, layers: l, logit_rows: 0 });
        cp.attn.push(Attn { queries: req.head, keys: req.head, pairs: range_pairs(0..h, 0..h), layers: l, step: None });
        let cached = |c: usize| req.cached.get(c).copied().unwrap_or(false);
        for batch in self.pipe.chunk_batches(r, &req.chunks) {
            // A held chunk is read, not prefilled (the rest of its batch still runs as one).
            let batch: Vec<usize> = batch.into_iter().filter(|&c| !cached(c)).collect();
            if batch.is_empty() {
                continue;
            }
            let rows = batch.iter().map(|&c| req.chunks[c]).sum();
            cp.forwards.push(Forward { rows, layers: l, logit_rows: 0 });
            for &c in &batch {
                let len = req.chunks[c] as u64;
                let (start, head) = if self.pipe.behind_head(c) { (h, h) } else { (0, 0) };
                let own = start..start + len;
                if head > 0 {
                    let pairs = range_pairs(own.clone(), 0..head);
                    cp.attn.push(Attn { queries: len as usize, keys: head as usize, pairs, layers: l, step: None });
                }
                let pairs = range_pairs(own.clone(), own);
                cp.attn.push(Attn { queries: len as usize, keys: len as usize, pairs, layers: l, step: None });
            }
        }
        cp
    }

    /// The prompt over rank `r`'s segments through `layers` blocks (the probe: up to the last
    /// scoring layer, with score passes on `scores` of them; the final prompt: every block and
    /// the logits), and the gather of the partials to rank 0 and the merged rows back.
    fn over_segments(
        &self,
        r: usize,
        segs: &[Range<u64>],
        step: Step,
        layers: usize,
        scores: Option<usize>,
    ) -> PhaseWork {
        let (m, p, shape, prompt) = (self.req.prompt, self.p, self.shape, &self.prompt);
        let mut ph = PhaseWork::new(step.phase());
        ph.forwards.push(Forward { rows: m, layers, logit_rows: usize::from(scores.is_none() && m > 0) });
        for s in segs {
            if s.is_empty() || m == 0 {
                continue;
            }
            let keys = (s.end - s.start) as usize;
            let pairs = range_pairs(prompt.clone(), s.clone());
            ph.attn.push(Attn { queries: m, keys, pairs, layers, step: None });
            if let Some(sl) = scores {
                ph.scores.push(Attn { queries: m, keys, pairs, layers: sl, step: None });
            }
        }
        if m > 0 {
            let pairs = range_pairs(prompt.clone(), prompt.clone());
            ph.attn.push(Attn { queries: m, keys: m, pairs, layers, step: None });
        }
        if p > 1 {
            let op = if scores.is_some() { "probe" } else { "final" };
            let own = partials(segs.iter().filter(|r| !r.is_empty()).count(), m, shape);
            let merged = partials(1, m, shape);
            let others: u64 = (1..p).map(|o| partials(self.pipe.local_chunks(o).len(), m, shape)).sum();
            let (gs, gr, bs, br) = if r == 0 { (0, others, merged * (p as u64 - 1), 0) } else { (own, 0, 0, merged) };
            let gather = Message {
                op: format!("{op}.gather"),
                calls: layers,
                sent: gs,
                received: gr,
                step: None,
                behind: false,
            };
            ph.messages.push(gather);
            ph.messages.push(Message {
                op: format!("{op}.merged"),
                calls: layers,
                sent: bs,
                received: br,
                step: None,
                behind: false,
            });
        }
        ph
    }

    /// Recomputation of the selected tokens, in batches of global positions, on rank `r`.
    fn recompute(&self, r: usize, segs: &[Range<u64>]) -> PhaseWork {
        let (p, l) = (self.p, self.shape.n_layers);
        let mut rc = PhaseWork::new(Step::Recompute.phase());
        let mut sorted = self.sel.clone();
        sorted.sort_unstable();
        // The sparse scope keeps the other ranks' rows of earlier batches (every layer).
        let mut earlier: Vec<u64> = Vec::new();
        for batch in sorted.chunks(self.pipe.recompute_batch) {
            let count = |o: usize| batch.iter().filter(|x| x.1 == o).count();
            let mine: Vec<u64> = batch.iter().filter(|x| x.1 == r).map(|x| x.0).collect();
            // Bytes of an all-gather of `size(rows)` per rank: this rank's message to each of
            // the others, and the others' messages to it.
            let gathered = |size: &dyn Fn(usize) -> u64| -> (u64, u64) {
                let others: u64 = (0..p).filter(|&o| o != r).map(|o| size(count(o))).sum();
                (size(mine.len()) * (p as u64 - 1), others)
            };
            rc.forwards.push(Forward { rows: mine.len(), layers: l, logit_rows: 0 });
            match self.scope {
                Scope::Exact => self.exact_batch(&mut rc, batch, segs, &gathered),
                Scope::Sparse => {
                    self.sparse_batch(&mut rc, r, batch, &mine, segs, &earlier, &gathered);
                    earlier.extend(batch.iter().filter(|x| x.1 != r).map(|x| x.0));
                }
            }
        }
        rc
    }

    /// Exact scope: every rank's queries of the batch over this rank's segments; every rank
    /// takes part in the collectives, alone too: its queries go to every other rank, and the
    /// partials for each rank's queries come back.
    fn exact_batch(&self, rc: &mut PhaseWork, batch: &[(u64, usize)], segs: &[Range<u64>], gathered: Gathered<'_>) {
        let (l, shape) = (self.shape.n_layers, self.shape);
        for s in segs {
            let pairs: u64 = batch.iter().map(|x| range_pairs(x.0..x.0 + 1, s.clone())).sum();
            if pairs > 0 || !s.is_empty() {
                let keys = (s.end - s.start) as usize;
                rc.attn.push(Attn { queries: batch.len(), keys, pairs, layers: l, step: None });
            }
        }
        let (own, theirs) = gathered(&|c| message(c, &[(c * shape.q_dim(), 4)]));
        rc.messages.push(Message {
            op: "recompute.q".into(),
            calls: l,
            sent: own,
            received: theirs,
            step: None,
            behind: false,
        });
        let (own, theirs) = gathered(&|c| message(c, &[(c * shape.q_dim(), 4), (c * shape.n_heads, 4)]));
        let partials = Message {
            op: "recompute.partials".into(),
            calls: l,
            sent: theirs,
            received: own,
            step: None,
            behind: false,
        };
        rc.messages.push(partials);
    }

    /// Sparse scope: own queries over own segments, the head (replicated off rank 0), the other
    /// ranks' rows of earlier batches (`earlier`, kept as one source) and those of this batch,
    /// whose K/V every rank gathers.
    #[allow(clippy::too_many_arguments)]
    fn sparse_batch(
        &self,
        rc: &mut PhaseWork,
        r: usize,
        batch: &[(u64, usize)],
        mine: &[u64],
        segs: &[Range<u64>],
        earlier: &[u64],
        gathered: Gathered<'_>,
    ) {
        let (l, shape, h) = (self.shape.n_layers, self.shape, self.req.head as u64);
        let mut sources: Vec<(usize, KeysBefore)> = Vec::new();
        if r != 0 {
            sources.push((h as usize, Box::new(move |q| range_pairs(q..q + 1, 0..h))));
        }
        for s in segs.iter().cloned() {
            let keys = (s.end - s.start) as usize;
            sources.push((keys, Box::new(move |q| range_pairs(q..q + 1, s.clone()))));
        }
        let before = earlier.to_vec();
        sources.push((before.len(), Box::new(move |q| points_before(&before, q))));
        for o in (0..self.p).filter(|&o| o != r) {
            let theirs: Vec<u64> = batch.iter().filter(|x| x.1 == o).map(|x| x.0).collect();
            let keys = theirs.len();
            sources.push((keys, Box::new(move |q| points_before(&theirs, q))));
        }
        for (keys, f) in &sources {
            if *keys == 0 || mine.is_empty() {
                continue;
            }
            let pairs: u64 = mine.iter().map(|&q| f(q)).sum();
            rc.attn.push(Attn { queries: mine.len(), keys: *keys, pairs, layers: l, step: None });
        }
        let kv = self.kv;
        let (own, theirs) = gathered(&|c| message(c, &[(c * shape.kv_dim(), kv), (c * shape.kv_dim(), kv)]));
        let kv = Message { op: "recompute.kv".into(), calls: l, sent: own, received: theirs, step: None, behind: true };
        rc.messages.push(kv);
    }
}

#[cfg(test)]
mod tests;
