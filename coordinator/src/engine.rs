//! The phase pipeline of one request, in one process.
//!
//! ```text
//!  tokenize ─ chunk caches (store or prefill, local positions, pre-RoPE)          [chunk_prefill]
//!           ─ reorder (optional: HL-TP scores, most important chunk last)         [reorder]
//!           ─ place chunks at global positions (rotation only)                    [assemble]
//!           ─ score (policy) ─ top-k over context tokens                          [probe, selection]
//!           ─ recompute selected tokens at global positions, layer by layer       [recompute]
//!           ─ prompt over the placed segments ─ first token (TTFT) ─ decode       [final_prompt ...]
//! ```
//! Chunk caches stay separate segments throughout (no global tensor is assumed): every
//! attention over the context is one partial per segment merged by log-sum-exp, which is the
//! shape the sharded execution distributes over ranks.

use crate::error::{invalid, Result};
use crate::layout::Layout;
use crate::reorder::reorder;
use crate::request::{validate, Method, PrefixMode, Request, RunOptions};
use crate::select::{rows_of, selector_for, top_k_flags, AuxCaches, ScoreCtx};
use crate::timings::{phase, PhaseTimes};
use flowprefill_kernels::topk::count_for_ratio;
use flowprefill_kernels::Backend;
use flowprefill_worker::attend::AppendAttend;
use flowprefill_worker::generate::{decode, decode_with, prefill_into, StopReason, DEFAULT_PREFILL_CHUNK};
use flowprefill_worker::kv::{KeyForm, KvCache};
use flowprefill_worker::model::Logits;
use flowprefill_worker::sampling::Sampler;
use flowprefill_worker::steps::{prefill_chunks, recompute, ChunkJob, Target, DEFAULT_BATCH_TOKENS};
use flowprefill_worker::store::{ChunkKey, ChunkStore};
use flowprefill_worker::{LoadedModel, WorkerError};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Default byte budget of the chunk store.
pub const DEFAULT_STORE_BYTES: usize = 2 << 30;

/// Outcome of one request.
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
    /// Time per phase, in pipeline order.
    pub phases: PhaseTimes,
    /// Method run.
    pub method: Method,
    /// Ratio in effect.
    pub ratio: f64,
    /// Options as given.
    pub opts: RunOptions,
    /// Prefix mode in effect.
    pub prefix: PrefixMode,
    /// Template head tokens.
    pub n_head_tokens: usize,
    /// Context tokens (candidates).
    pub n_context_tokens: usize,
    /// Prompt tokens after the context.
    pub n_prompt_tokens: usize,
    /// Tokens per chunk (request order).
    pub chunk_tokens: Vec<usize>,
    /// Chunk ids in the final layout order.
    pub order: Vec<usize>,
    /// Chunk importance from reordering (request order), if reordered.
    pub importance: Option<Vec<f32>>,
    /// Selected rows per chunk (request order).
    pub selected_rows: Vec<Vec<usize>>,
    /// Token budget `round(ratio * N)`.
    pub budget: usize,
    /// Chunk-store lookups that hit during this request.
    pub cache_hits: u64,
    /// Chunk-store lookups that missed (chunks prefilled).
    pub cache_misses: u64,
    /// Logits of the first answer token (for equivalence checks).
    pub first_logits: Vec<f32>,
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

/// A model, an optional auxiliary model, and the chunk store.
pub struct Engine<B: Backend> {
    lm: Arc<LoadedModel<B>>,
    aux: Option<Arc<LoadedModel<B>>>,
    store: ChunkStore<B>,
    aux_store: ChunkStore<B>,
}

/// Head and chunk caches of one layout.
struct Caches<B: Backend> {
    head: Arc<KvCache<B>>,
    chunks: Vec<Arc<KvCache<B>>>,
    hits: u64,
    misses: u64,
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

    /// The chunk store.
    pub fn store(&self) -> &ChunkStore<B> {
        &self.store
    }

    /// Head and chunk caches of `layout` under `mode`, from `store` or prefilled (the missing
    /// chunks of one stage in batched forwards).
    fn caches(
        &self,
        lm: &LoadedModel<B>,
        store: &ChunkStore<B>,
        layout: &Layout,
        mode: PrefixMode,
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
        let all = 0..layout.chunks.len();
        let chunks = match mode {
            PrefixMode::None => {
                let specs = all.map(|c| if c == 0 { behind_head(c) } else { alone(c) }).collect();
                resolve(model, store, specs, &mut stats)?
            }
            PrefixMode::Shared => resolve(model, store, all.map(behind_head).collect(), &mut stats)?,
            PrefixMode::Anchor => {
                let Some(first) = layout.chunks.first() else {
                    return Ok(Caches { head, chunks: vec![], hits: stats.0, misses: stats.1 });
                };
                let mut chunks = resolve(model, store, vec![behind_head(0)], &mut stats)?;
                let anchor = chunks[0].placed(be, model.rope(), chunks[0].positions(), n_kv)?;
                let mut toks = layout.head.clone();
                toks.extend_from_slice(first);
                let start = toks.len() as u32;
                let specs = layout.chunks[1..]
                    .iter()
                    .map(|t| Spec { head_tokens: toks.clone(), head: vec![&head_placed, &anchor], tokens: t, start })
                    .collect();
                chunks.extend(resolve(model, store, specs, &mut stats)?);
                chunks
            }
        };
        Ok(Caches { head, chunks, hits: stats.0, misses: stats.1 })
    }

    /// Runs one request. `on_text` receives the answer as it is generated (return false to
    /// stop early).
    pub fn run(&self, req: &Request, opts: &RunOptions, on_text: &mut dyn FnMut(&str) -> bool) -> Result<RunResult> {
        let t0 = Instant::now();
        validate(req, opts)?;
        let lm = &*self.lm;
        let model = &lm.model;
        let be = model.backend();
        let cfg = model.config();
        let layout = Layout::build(lm, req)?;
        let window = cfg.context_length;
        if layout.total_len() + 1 > window {
            return Err(WorkerError::ContextTooLong { tokens: layout.total_len() + 1, window }.into());
        }
        let mut sampler = Sampler::new(opts.sampling.clone())?;
        let mut phases = PhaseTimes::default();
        let ratio = opts.effective_ratio();
        let prefix = opts.prefix_mode();
        let n = layout.n_context();
        let identity: Vec<usize> = (0..layout.chunks.len()).collect();
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
            prefix,
            n_head_tokens: layout.head.len(),
            n_context_tokens: n,
            n_prompt_tokens: layout.prompt.len(),
            chunk_tokens: layout.chunks.iter().map(Vec::len).collect(),
            order: identity.clone(),
            importance: None,
            selected_rows: vec![Vec::new(); layout.chunks.len()],
            budget: count_for_ratio(ratio, n),
            cache_hits: 0,
            cache_misses: 0,
            first_logits: Vec::new(),
        };

        if opts.method == Method::Full {
            let tokens = layout.full_tokens(&identity);
            let mut cache = KvCache::new(be, cfg.n_layers, cfg.kv_dim(), KeyForm::Rotated)?;
            let logits =
                phases.time(phase::PREFILL, || prefill_into(model, &mut cache, &tokens, 0, DEFAULT_PREFILL_CHUNK))?;
            let first = phases.time(phase::FIRST_TOKEN, || sampler.sample(&logits));
            result.ttft = t0.elapsed();
            result.first_logits = logits;
            result.selected_rows = layout.chunks.iter().map(|c| (0..c.len()).collect()).collect();
            let t = Instant::now();
            let (tokens, stop) =
                decode(model, &lm.tokenizer, &mut cache, first, &mut sampler, opts.max_new_tokens, on_text)?;
            phases.add(phase::DECODE, t.elapsed());
            return self.finish(result, tokens, stop, phases, t0);
        }

        // Phase 1: chunk caches.
        let caches = phases.time(phase::CHUNK_PREFILL, || self.caches(lm, &self.store, &layout, prefix))?;
        result.cache_hits = caches.hits;
        result.cache_misses = caches.misses;
        let head_placed = caches.head.placed(be, model.rope(), caches.head.positions(), cfg.n_kv_heads)?;

        // Optional reordering (positions only).
        let mut order = identity;
        if opts.reorder {
            let segs = std::slice::from_ref(&head_placed);
            let ctx = ScoreCtx {
                lm,
                layout: &layout,
                order: &order,
                chunks: &caches.chunks,
                segments: segs,
                opts,
                aux: self,
            };
            let (o, imp) = phases.time(phase::REORDER, || reorder(&ctx, ratio))?;
            order = o;
            result.importance = Some(imp);
        }
        self.run_placed(result, layout, caches, head_placed, order, opts, phases, sampler, on_text, t0)
    }

    #[allow(clippy::too_many_arguments)]
    fn run_placed(
        &self,
        mut result: RunResult,
        layout: Layout,
        caches: Caches<B>,
        head_placed: KvCache<B>,
        order: Vec<usize>,
        opts: &RunOptions,
        mut phases: PhaseTimes,
        mut sampler: Sampler,
        on_text: &mut dyn FnMut(&str) -> bool,
        t0: Instant,
    ) -> Result<RunResult> {
        let lm = &*self.lm;
        let model = &lm.model;
        let be = model.backend();
        let cfg = model.config();
        let n = layout.n_context();
        if n == 0 {
            return Err(invalid("the context has no tokens"));
        }

        // Place every chunk at its global position: segments = [head, order...].
        let offsets = layout.global_offsets(&order);
        let mut segments = Vec::with_capacity(order.len() + 1);
        phases.time(phase::ASSEMBLE, || -> Result<()> {
            segments.push(head_placed);
            for &c in &order {
                let len = layout.chunks[c].len() as u32;
                let pos: Vec<u32> = (offsets[c]..offsets[c] + len).collect();
                segments.push(caches.chunks[c].placed(be, model.rope(), &pos, cfg.n_kv_heads)?);
            }
            Ok(())
        })?;

        // Selection.
        let k = result.budget;
        let flags: Vec<Vec<bool>> = if k == 0 || opts.method == Method::Star {
            order.iter().map(|&c| vec![false; layout.chunks[c].len()]).collect()
        } else if k >= n {
            order.iter().map(|&c| vec![true; layout.chunks[c].len()]).collect()
        } else {
            let selector =
                selector_for::<B>(opts.method).ok_or_else(|| invalid(format!("{} selects nothing", opts.method)))?;
            let ctx = ScoreCtx {
                lm,
                layout: &layout,
                order: &order,
                chunks: &caches.chunks,
                segments: &segments,
                opts,
                aux: self,
            };
            let scores = phases.time(phase::PROBE, || selector.score(&ctx))?;
            phases.time(phase::SELECTION, || selector.refine(&scores, top_k_flags(&scores, k)))
        };
        let rows = rows_of(&flags);

        // Recompute the selected tokens at their global positions.
        let mut targets = Vec::new();
        let mut tokens = Vec::new();
        for (i, (&c, r)) in order.iter().zip(&rows).enumerate() {
            for &row in r {
                targets.push(Target { segment: i + 1, row });
                tokens.push(layout.chunks[c][row]);
            }
        }
        if !targets.is_empty() {
            phases
                .time(phase::RECOMPUTE, || recompute(model, &mut segments, &targets, &tokens, opts.recompute_batch))?;
        }
        for (&c, r) in order.iter().zip(rows) {
            result.selected_rows[c] = r;
        }
        result.order = order;

        // The prompt over the placed segments, then the first token.
        let prompt_start = layout.prompt_start();
        let prompt_pos: Vec<u32> = (prompt_start..prompt_start + layout.prompt.len() as u32).collect();
        let mut tail = KvCache::new(be, cfg.n_layers, cfg.kv_dim(), KeyForm::Rotated)?;
        let seg_refs: Vec<&KvCache<B>> = segments.iter().collect();
        let logits = phases.time(phase::FINAL_PROMPT, || -> Result<Vec<f32>> {
            let mut att = AppendAttend::with_context(be, seg_refs.clone(), &mut tail, &prompt_pos)?;
            let out = model.forward(&layout.prompt, &prompt_pos, &mut att, Logits::Last)?;
            att.commit()?;
            Ok(out.last().to_vec())
        })?;
        let first = phases.time(phase::FIRST_TOKEN, || sampler.sample(&logits));
        result.ttft = t0.elapsed();
        result.first_logits = logits;

        let t = Instant::now();
        let next_pos = prompt_start + layout.prompt.len() as u32;
        let mut step = |tok: u32, pos: u32| -> flowprefill_worker::Result<Vec<f32>> {
            let mut att = AppendAttend::with_context(be, seg_refs.clone(), &mut tail, &[pos])?;
            let out = model.forward(&[tok], &[pos], &mut att, Logits::Last)?;
            att.commit()?;
            Ok(out.last().to_vec())
        };
        let (tokens, stop) = decode_with(
            &lm.tokenizer,
            first,
            &mut sampler,
            opts.max_new_tokens,
            cfg.context_length,
            next_pos,
            &mut step,
            on_text,
        )?;
        phases.add(phase::DECODE, t.elapsed());
        self.finish(result, tokens, stop, phases, t0)
    }

    fn finish(
        &self,
        mut result: RunResult,
        tokens: Vec<u32>,
        stop: StopReason,
        phases: PhaseTimes,
        t0: Instant,
    ) -> Result<RunResult> {
        result.answer = self.lm.tokenizer.decode(&tokens)?;
        result.tokens = tokens;
        result.stop = stop;
        result.phases = phases;
        result.total = t0.elapsed();
        Ok(result)
    }
}

/// A chunk to look up or prefill.
struct Spec<'a, B: Backend> {
    head_tokens: Vec<u32>,
    head: Vec<&'a KvCache<B>>,
    tokens: &'a [u32],
    start: u32,
}

/// Looks every spec up in the store and prefills the missing ones together; counts
/// `(hits, misses)`.
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

impl<B: Backend> AuxCaches<B> for Engine<B> {
    fn aux_model(&self) -> &LoadedModel<B> {
        self.aux.as_deref().unwrap_or(&self.lm)
    }

    fn aux_caches(&self, layout: &Layout) -> Result<crate::select::HeadAndChunks<B>> {
        // The same model shares the main store (its shared-prefix chunk caches are the same).
        let (lm, store) = match &self.aux {
            Some(a) => (&**a, &self.aux_store),
            None => (&*self.lm, &self.store),
        };
        let c = self.caches(lm, store, layout, PrefixMode::Shared)?;
        Ok((c.head, c.chunks))
    }
}
