//! Method `full`: the whole context prefilled on rank 0 alone (with eviction: then the prompt
//! over it, scoring the cache, in a world of rank 0 alone). The other ranks wait for it (see
//! `pace`).

use super::{Engine, Role, Turn};
use crate::error::{internal, Result};
use crate::layout::Layout;
use crate::timings::phase;
use flowprefill_comm::local::LocalComm;
use flowprefill_kernels::Backend;
use flowprefill_worker::generate::{decode, prefill_into_checked, StopReason};
use flowprefill_worker::kv::{KeyForm, KvCache};
use flowprefill_worker::store::ChunkKey;

impl<B: Backend> Engine<B> {
    /// Method `full`: single-pass prefill on rank 0.
    pub(super) fn full(&self, layout: &Layout, turn: &mut Turn<'_>) -> Result<(Vec<u32>, StopReason)> {
        let model = &self.lm.model;
        let cfg = model.config();
        let Role::Lead { sampler, on_text } = &mut turn.role else {
            return Err(internal("full prefill runs on rank 0"));
        };
        let tokens = layout.full_tokens(&turn.out.order);
        let mut cache = KvCache::new(model.backend(), cfg.n_layers, cfg.kv_dim(), KeyForm::Rotated)?;
        cache.reserve(model.backend(), tokens.len() + turn.opts.max_new_tokens)?;
        self.fault_point(0, phase::PREFILL)?;
        let watch = &turn.watch;
        let mut check = || watch.check(phase::PREFILL);
        let logits = turn.phases.time(phase::PREFILL, || {
            prefill_into_checked(model, &mut cache, &tokens, 0, model.backend().prefill_rows(), &mut check)
        })?;
        let first = turn.phases.time(phase::FIRST_TOKEN, || sampler.sample(&logits));
        turn.out.ttft = turn.t0.elapsed();
        turn.out.first_logits = logits;
        turn.out.selected_rows = layout.chunks.iter().map(|c| (0..c.len()).collect()).collect();
        let mut check = || watch.check(phase::DECODE);
        let max = turn.opts.max_new_tokens;
        let tokenizer = &self.lm.tokenizer;
        let record = self.decode_graphs;
        let (tokens, stop, replayed) = turn.phases.time(phase::DECODE, || {
            decode(model, tokenizer, &mut cache, first, sampler, max, *on_text, &mut check, record)
        })?;
        turn.out.decode_replayed = replayed;
        Ok((tokens, stop))
    }

    /// Method `full` with eviction: the context prefilled on rank 0, then the prompt over it
    /// (scoring the cache per head), eviction and decoding, in a world of rank 0 alone.
    pub(super) fn full_then_evict(
        &self,
        layout: &Layout,
        turn: &mut Turn<'_>,
    ) -> Result<Option<(Vec<u32>, StopReason)>> {
        let model = &self.lm.model;
        let cfg = model.config();
        let mut tokens = layout.full_tokens(&turn.out.order);
        tokens.truncate(layout.prompt_start() as usize);
        self.fault_point(0, phase::PREFILL)?;
        // The context's cache is kept in the store (rotated, from position 0): another
        // eviction of the same context (another policy or budget, another question) copies it
        // instead of prefilling again. Eviction packs a copy, never the stored cache. A
        // prefilled cache goes to the store after eviction has read it (no second copy while
        // the job runs: the memory plan's peak holds).
        let key = ChunkKey::context(&tokens);
        let (be, rope, heads) = (model.backend(), model.rope(), cfg.n_kv_heads);
        // A cold job (`fresh`) neither reads nor keeps it.
        let kept = if turn.opts.fresh { None } else { self.store.get(&key) };
        let (cache, store_as) = match kept {
            Some(kept) => {
                turn.mine.cache_hits = 1;
                (turn.phases.time(phase::PREFILL, || kept.placed(be, rope, kept.positions(), heads))?, None)
            }
            None => {
                turn.mine.cache_misses = 1;
                let mut cache = KvCache::new(be, cfg.n_layers, cfg.kv_dim(), KeyForm::Rotated)?;
                cache.reserve(be, tokens.len())?;
                let watch = &turn.watch;
                let mut check = || watch.check(phase::PREFILL);
                turn.phases.time(phase::PREFILL, || {
                    prefill_into_checked(model, &mut cache, &tokens, 0, model.backend().prefill_rows(), &mut check)
                })?;
                (cache, (!turn.opts.fresh).then_some(key))
            }
        };
        turn.out.selected_rows = layout.chunks.iter().map(|c| (0..c.len()).collect()).collect();
        let mut alone = LocalComm::group(1).pop().ok_or_else(|| internal("a world of one rank"))?;
        self.prompt_then_decode(&mut alone, vec![(0, cache)], layout, store_as, turn)
    }
}
