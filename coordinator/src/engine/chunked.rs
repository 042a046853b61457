//! The chunked pipeline: chunk caches, reorder, placement, selection, recomputation, then
//! the prompt (see the parent module's diagram).

use super::{Engine, Turn};
use crate::error::{internal, Result};
use crate::layout::Layout;
use crate::reorder::reorder;
use crate::select::{segment_id, selector_for, ScoreCtx};
use crate::shard;
use crate::timings::phase;
use flowprefill_comm::{all_gather_value, broadcast_value, Communicator};
use flowprefill_kernels::topk::rank_order;
use flowprefill_kernels::Backend;
use flowprefill_worker::generate::StopReason;
use flowprefill_worker::kv::KvCache;
use flowprefill_worker::steps::{recompute, LocalSegment, RecomputeMode, Selection, Target};
use flowprefill_worker::WorkerError;
use std::sync::Arc;

impl<B: Backend> Engine<B> {
    /// Chunked methods: the phase pipeline of the module docs.
    pub(super) fn chunked(
        &self,
        comm: &mut dyn Communicator,
        layout: &Layout,
        owners: &[usize],
        turn: &mut Turn<'_>,
    ) -> Result<Option<(Vec<u32>, StopReason)>> {
        let opts = turn.opts;
        let lm = &*self.lm;
        let model = &lm.model;
        let be = model.backend();
        let cfg = model.config();
        let rank = comm.rank();
        let lead = rank == 0;
        let n = layout.n_context();
        if n == 0 {
            return Err(internal("a context without tokens passed admission"));
        }
        let local_ids = shard::local_chunks(owners, rank);

        // Phase 1: this rank's chunk caches (no communication: look for aborts between layers).
        self.fault_point(rank, phase::CHUNK_PREFILL)?;
        let watch = &turn.watch;
        let mut check = || {
            watch.check(phase::CHUNK_PREFILL)?;
            comm.poll_abort(phase::CHUNK_PREFILL).map_err(WorkerError::Comm)
        };
        let prefix = turn.result.prefix;
        let caches = turn
            .phases
            .time(phase::CHUNK_PREFILL, || self.caches(lm, &self.store, layout, prefix, &local_ids, &mut check))?;
        turn.mine.cache_hits = caches.hits;
        turn.mine.cache_misses = caches.misses;
        turn.mine.chunks = local_ids.len();
        turn.mine.tokens = local_ids.iter().map(|&c| layout.chunks[c].len()).sum();
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
                watch: &turn.watch,
            };
            let ratio = turn.result.ratio;
            let (o, imp) = turn.phases.time(phase::REORDER, || reorder(&mut ctx, ratio))?;
            order = o;
            turn.result.importance = Some(imp);
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
                    .ok_or_else(|| internal("chunk not held"))
            })
            .collect::<Result<_>>()?;
        let layout_index: Vec<usize> = local.iter().map(|c| order.iter().position(|o| o == c).unwrap_or(0)).collect();

        // Place: segments = [head on rank 0] + own chunks at their global positions.
        let offsets = layout.global_offsets(&order);
        let mut segments: Vec<KvCache<B>> = Vec::with_capacity(local.len() + 1);
        let mut seg_ids: Vec<usize> = Vec::with_capacity(local.len() + 1);
        turn.phases.time(phase::ASSEMBLE, || -> Result<()> {
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
        let k = turn.result.budget;
        let selected: Vec<u32> = if k == 0 || !opts.method.selects() {
            Vec::new()
        } else if k >= n {
            (0..n as u32).collect()
        } else {
            let selector =
                selector_for::<B>(opts.method).ok_or_else(|| internal(format!("{} selects nothing", opts.method)))?;
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
                watch: &turn.watch,
            };
            self.fault_point(rank, phase::PROBE)?;
            let scores = turn.phases.time(phase::PROBE, || selector.score(&mut ctx))?;
            let starts = ctx.local_global_starts();
            if opts.keep_scores {
                // Every rank's scores of its chunks, to rank 0 (request order).
                let all: Vec<(Vec<usize>, Vec<Vec<f32>>)> =
                    all_gather_value(comm, "select.scores", &(local.clone(), scores.clone()))?;
                if lead {
                    let mut by_chunk = vec![Vec::new(); layout.chunks.len()];
                    for (ids, s) in all {
                        for (c, v) in ids.into_iter().zip(s) {
                            *by_chunk.get_mut(c).ok_or_else(|| internal(format!("scores of chunk {c}")))? = v;
                        }
                    }
                    turn.result.scores = Some(by_chunk);
                }
            }
            turn.phases.time(phase::SELECTION, || -> Result<Vec<u32>> {
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
            turn.result.selected_rows[c].push(row);
            if owners[c] == rank {
                let j = local.iter().position(|&l| l == c).ok_or_else(|| internal("selected chunk not held"))?;
                targets.push(Target { segment: first_chunk_seg + j, row });
                tokens.push(layout.chunks[c][row]);
            }
        }
        turn.mine.selected = targets.len();
        self.fault_point(rank, phase::RECOMPUTE)?;
        if !all_positions.is_empty() {
            let watch = &turn.watch;
            let mut check = || watch.check(phase::RECOMPUTE);
            turn.phases.time(phase::RECOMPUTE, || {
                let replicated = (!lead).then_some(&head_placed);
                let sel = Selection { targets: &targets, tokens: &tokens, all_positions: &all_positions };
                let mode = RecomputeMode { scope: opts.scope, batch: opts.recompute_batch };
                recompute(model, comm, &mut segments, replicated, &sel, mode, &mut check)
            })?;
        }
        turn.result.order = order;

        // The prompt over the sharded segments, then decoding.
        let segs: Vec<LocalSegment<'_, B>> =
            segments.iter().zip(&seg_ids).map(|(s, &id)| LocalSegment::placed(id, s)).collect();
        let prompt_start = layout.prompt_start();
        let prompt_pos: Vec<u32> = (prompt_start..prompt_start + layout.prompt.len() as u32).collect();
        self.prompt_and_decode(comm, segs, &layout.prompt, &prompt_pos, turn)
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
