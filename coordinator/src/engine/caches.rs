//! Chunk caches: looked up in the rank's store, or prefilled (the missing chunks of one stage
//! in batched forwards) under the request's prefix mode.

use super::Engine;
use crate::error::{internal, Result};
use crate::layout::Layout;
use crate::request::PrefixMode;
use crate::select::AuxCaches;
use flowprefill_kernels::Backend;
use flowprefill_worker::interrupt::Check;
use flowprefill_worker::kv::KvCache;
use flowprefill_worker::steps::{prefill_chunks, ChunkJob, DEFAULT_BATCH_TOKENS};
use flowprefill_worker::store::{ChunkKey, ChunkStore};
use flowprefill_worker::LoadedModel;
use std::sync::Arc;

/// Head cache and the caches of the requested chunks.
pub(super) struct Caches<B: Backend> {
    pub(super) head: Arc<KvCache<B>>,
    pub(super) chunks: Vec<Arc<KvCache<B>>>,
    pub(super) hits: u64,
    pub(super) misses: u64,
    /// Of the hits, those read from the disk tier.
    pub(super) disk_hits: u64,
}

/// Lookups of one job: (hits, misses, hits from disk).
type Counts = (u64, u64, u64);

/// A chunk to look up or prefill.
struct Spec<'a, B: Backend> {
    head_tokens: Vec<u32>,
    head: Vec<&'a KvCache<B>>,
    tokens: &'a [u32],
    start: u32,
}

/// The store key of `tokens` prefilled from `start` behind `head_tokens`; a packet (soft ids
/// past the vocabulary) is keyed by its adapter too.
pub(super) fn chunk_key<B: Backend>(
    model: &flowprefill_worker::Model<B>,
    head_tokens: &[u32],
    start: u32,
    tokens: &[u32],
) -> ChunkKey {
    let key = ChunkKey::new(head_tokens, start, tokens);
    let vocab = model.config().vocab_size as u32;
    match model.adapter_hash() {
        Some(h) if tokens.iter().any(|&t| t >= vocab) => key.with_adapter(h),
        _ => key,
    }
}

/// What chunk `c` is prefilled behind under `mode` (the head's tokens) and from which position:
/// the first chunk, and every chunk in shared mode, behind the template head; later chunks
/// alone from 0 (`none`) or behind the anchor block, head and first chunk (`anchor`).
/// [`Engine::caches`] builds the same forms (a test holds them together).
fn form(layout: &Layout, mode: PrefixMode, c: usize) -> (Vec<u32>, u32) {
    match mode {
        PrefixMode::None if c != 0 => (Vec::new(), 0),
        PrefixMode::Anchor if c != 0 => {
            let mut t = layout.head.clone();
            t.extend_from_slice(&layout.chunks[0]);
            let start = t.len() as u32;
            (t, start)
        }
        _ => (layout.head.clone(), layout.head.len() as u32),
    }
}

/// Looks every spec up in the store and prefills the missing ones together.
fn resolve<B: Backend>(
    model: &flowprefill_worker::Model<B>,
    store: &ChunkStore<B>,
    specs: Vec<Spec<'_, B>>,
    stats: &mut Counts,
    check: Check<'_>,
) -> Result<Vec<Arc<KvCache<B>>>> {
    let keys: Vec<ChunkKey> = specs.iter().map(|s| chunk_key(model, &s.head_tokens, s.start, s.tokens)).collect();
    // RAM, then the disk tier (an entry read from disk is kept in RAM from then on).
    let be = model.backend();
    let mut found: Vec<Option<Arc<KvCache<B>>>> = Vec::with_capacity(keys.len());
    for hit in store.lookup_many(&keys, be) {
        stats.2 += u64::from(hit.as_ref().is_some_and(|(_, disk)| *disk));
        found.push(hit.map(|(kv, _)| kv));
    }
    let missing: Vec<usize> = (0..specs.len()).filter(|&i| found[i].is_none()).collect();
    stats.0 += (specs.len() - missing.len()) as u64;
    stats.1 += missing.len() as u64;
    let jobs: Vec<ChunkJob<'_, B>> = missing
        .iter()
        .map(|&i| ChunkJob { head: specs[i].head.clone(), tokens: specs[i].tokens, start: specs[i].start })
        .collect();
    let made = prefill_chunks(model, &jobs, DEFAULT_BATCH_TOKENS, check)?;
    for (&i, kv) in missing.iter().zip(made) {
        found[i] = Some(store.insert_persist(keys[i], kv));
    }
    found.into_iter().map(|f| f.ok_or_else(|| internal("chunk cache missing after prefill"))).collect()
}

impl<B: Backend> Engine<B> {
    /// How well this rank's store holds each chunk of `layout` in the form `mode` looks up
    /// (see [`ChunkStore::holds`]: 2 RAM, 1 disk, 0 none), without counting a lookup: what
    /// cache-aware sharding places by.
    pub fn held_levels(&self, layout: &Layout, mode: PrefixMode) -> Vec<u8> {
        (0..layout.chunks.len())
            .map(|c| {
                let (head, start) = form(layout, mode, c);
                self.store.holds(&chunk_key(&self.lm.model, &head, start, &layout.chunks[c]))
            })
            .collect()
    }

    /// Head and the caches of `chunks` (ids) under `mode`, from `store` or prefilled (the
    /// missing chunks of one stage in batched forwards; `check` runs before every layer).
    pub(super) fn caches(
        &self,
        lm: &LoadedModel<B>,
        store: &ChunkStore<B>,
        layout: &Layout,
        mode: PrefixMode,
        chunks: &[usize],
        check: Check<'_>,
    ) -> Result<Caches<B>> {
        let model = &lm.model;
        let be = model.backend();
        let n_kv = model.config().n_kv_heads;
        let mut stats: Counts = (0, 0, 0);
        let head = resolve(
            model,
            store,
            vec![Spec { head_tokens: vec![], head: vec![], tokens: &layout.head, start: 0 }],
            &mut stats,
            &mut *check,
        )?
        .pop()
        .ok_or_else(|| internal("head cache missing"))?;
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
                check,
            )?,
            PrefixMode::Shared => {
                resolve(model, store, chunks.iter().map(|&c| behind_head(c)).collect(), &mut stats, check)?
            }
            PrefixMode::Anchor => {
                if chunks.is_empty() {
                    Vec::new()
                } else {
                    // The anchor (head + chunk 0) is needed by every rank holding a later chunk
                    // (Star Attention replicates it); it is prefilled here if not held.
                    let first = resolve(model, store, vec![behind_head(0)], &mut stats, &mut *check)?
                        .pop()
                        .ok_or_else(|| internal("anchor missing"))?;
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
                    let mut rest = resolve(model, store, specs, &mut stats, check)?.into_iter();
                    let mut out = Vec::with_capacity(chunks.len());
                    for &c in chunks {
                        out.push(if c == 0 {
                            first.clone()
                        } else {
                            rest.next().ok_or_else(|| internal("chunk missing"))?
                        });
                    }
                    out
                }
            }
        };
        Ok(Caches { head, chunks: out, hits: stats.0, misses: stats.1, disk_hits: stats.2 })
    }
}

impl<B: Backend> AuxCaches<B> for Engine<B> {
    fn aux_model(&self) -> &LoadedModel<B> {
        self.aux.as_deref().unwrap_or(&self.lm)
    }

    fn aux_caches(
        &self,
        layout: &Layout,
        chunks: &[usize],
        check: Check<'_>,
    ) -> Result<crate::select::HeadAndChunks<B>> {
        // The same model shares the main store (its shared-prefix chunk caches are the same).
        let (lm, store) = match &self.aux {
            Some(a) => (&**a, &self.aux_store),
            None => (&*self.lm, &self.store),
        };
        let c = self.caches(lm, store, layout, PrefixMode::Shared, chunks, check)?;
        Ok((c.head, c.chunks))
    }
}
