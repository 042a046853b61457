//! The chunked pipeline: chunk caches, reorder, placement, selection, recomputation, then
//! the prompt (see the parent module's diagram). One method per phase, each running one of the
//! job's [`crate::pipeline::Pipeline::steps`] (or nothing where that step is not in the list);
//! what they decide from token counts alone is the job's [`crate::pipeline::Pipeline`].

use super::caches::Caches;
use super::{CoverageCut, Engine, Turn};
use crate::error::{internal, Result};
use crate::layout::Layout;
use crate::pipeline::{Selection as Plan, Step};
use crate::reorder::reorder;
use crate::select::{chunk_mass, coverage_count, layout_index, segment_id, selector_for, ScoreCtx, Selector};
use crate::timings::phase;
use flowprefill_comm::{all_gather_value, broadcast_value, Communicator};
use flowprefill_kernels::topk::rank_order;
use flowprefill_kernels::Backend;
use flowprefill_worker::generate::StopReason;
use flowprefill_worker::kv::KvCache;
use flowprefill_worker::steps::{recompute, RecomputeMode, Selection, Target};
use flowprefill_worker::store::ChunkStore;
use flowprefill_worker::WorkerError;
use std::sync::Arc;

/// This rank's chunks in layout order, with their caches.
struct Held<B: Backend> {
    /// Chunk ids (layout order).
    ids: Vec<usize>,
    /// Their pre-RoPE caches.
    caches: Vec<Arc<KvCache<B>>>,
}

/// This rank's segments at their global positions: the head (rank 0), then its chunks.
struct Placed<B: Backend> {
    segments: Vec<KvCache<B>>,
    /// Global segment id of each.
    ids: Vec<usize>,
    /// Index of the first chunk segment (1 on rank 0, behind the head).
    first_chunk: usize,
    /// Global start position of every chunk (request order) in this layout order.
    offsets: Vec<u32>,
}

/// Where the selection lies on this rank: its targets and their tokens, and every selected
/// token's global position (all ranks).
struct Located {
    targets: Vec<Target>,
    tokens: Vec<u32>,
    all_positions: Vec<u32>,
}

impl<B: Backend> Engine<B> {
    /// Chunked methods: the phase pipeline of the module docs.
    pub(super) fn chunked(
        &self,
        comm: &mut dyn Communicator,
        layout: &Layout,
        turn: &mut Turn<'_>,
    ) -> Result<Option<(Vec<u32>, StopReason)>> {
        if layout.n_context() == 0 {
            return Err(internal("a context without tokens passed admission"));
        }
        let model = &self.lm.model;
        let local_ids = turn.plan.local_chunks(comm.rank());
        let caches = self.chunk_prefill(comm, layout, &local_ids, turn)?;
        let head_placed =
            caches.head.placed(model.backend(), model.rope(), caches.head.positions(), model.config().n_kv_heads)?;
        let order = self.reorder_chunks(comm, layout, &local_ids, &caches, &head_placed, turn)?;
        let held = held(&order, &turn.plan.owners, comm.rank(), &local_ids, &caches)?;
        let mut placed = self.place(layout, &order, &held, &head_placed, comm.rank() == 0, turn)?;
        let selected = self.select(comm, layout, &order, &held, &mut placed, turn)?;
        let located = self.locate(layout, &order, &held, &placed, &selected, comm.rank(), turn)?;
        turn.mine.selected = located.targets.len();
        self.fault_point(comm.rank(), phase::RECOMPUTE)?;
        if !located.all_positions.is_empty() {
            let watch = &turn.watch;
            let mut check = || watch.check(phase::RECOMPUTE);
            let (opts, lead, batch) = (turn.opts, comm.rank() == 0, turn.plan.recompute_batch);
            turn.phases.time(phase::RECOMPUTE, || {
                let replicated = (!lead).then_some(&head_placed);
                let sel = Selection {
                    targets: &located.targets,
                    tokens: &located.tokens,
                    all_positions: &located.all_positions,
                };
                let mode = RecomputeMode { scope: opts.scope, batch };
                recompute(model, comm, &mut placed.segments, replicated, &sel, mode, &mut check)
            })?;
        }
        turn.out.order = order;
        // The prompt over the sharded segments, then decoding.
        let segments: Vec<(usize, KvCache<B>)> = placed.ids.iter().copied().zip(placed.segments).collect();
        self.prompt_then_decode(comm, segments, layout, None, turn)
    }

    /// Phase 1: this rank's chunk caches, from the store or prefilled (no communication: look
    /// for aborts between layers).
    fn chunk_prefill(
        &self,
        comm: &mut dyn Communicator,
        layout: &Layout,
        local_ids: &[usize],
        turn: &mut Turn<'_>,
    ) -> Result<Caches<B>> {
        self.fault_point(comm.rank(), phase::CHUNK_PREFILL)?;
        let watch = &turn.watch;
        let mut check = || {
            watch.check(phase::CHUNK_PREFILL)?;
            comm.poll_abort(phase::CHUNK_PREFILL).map_err(WorkerError::Comm)
        };
        let prefix = turn.plan.prefix;
        let lm = &*self.lm;
        // A cold job's caches live in a store of its own, dropped with it.
        let own = turn.opts.fresh.then(|| ChunkStore::new(usize::MAX));
        let store = own.as_ref().unwrap_or(&self.store);
        let caches =
            turn.phases.time(phase::CHUNK_PREFILL, || self.caches(lm, store, layout, prefix, local_ids, &mut check))?;
        turn.mine.cache_hits = caches.hits;
        turn.mine.cache_misses = caches.misses;
        turn.mine.cache_disk_hits = caches.disk_hits;
        turn.mine.chunks = local_ids.len();
        turn.mine.tokens = local_ids.iter().map(|&c| layout.chunks[c].len()).sum();
        Ok(caches)
    }

    /// Optional reordering (positions only; no data moves): the chunks in layout order.
    fn reorder_chunks(
        &self,
        comm: &mut dyn Communicator,
        layout: &Layout,
        local_ids: &[usize],
        caches: &Caches<B>,
        head_placed: &KvCache<B>,
        turn: &mut Turn<'_>,
    ) -> Result<Vec<usize>> {
        let identity: Vec<usize> = (0..layout.chunks.len()).collect();
        if !turn.plan.runs(Step::Reorder) {
            return Ok(identity);
        }
        let mut ctx = ScoreCtx {
            lm: &self.lm,
            layout,
            order: &identity,
            local: local_ids,
            chunks: &caches.chunks,
            head: (comm.rank() == 0).then_some(head_placed),
            placed: &mut [],
            opts: turn.opts,
            aux: self,
            comm,
            watch: &turn.watch,
        };
        let ratio = turn.plan.ratio;
        let (order, importance) = turn.phases.time(phase::REORDER, || reorder(&mut ctx, ratio))?;
        turn.out.importance = Some(importance);
        Ok(order)
    }

    /// Placement: the head (rank 0) and this rank's chunks at their global positions.
    fn place(
        &self,
        layout: &Layout,
        order: &[usize],
        held: &Held<B>,
        head_placed: &KvCache<B>,
        lead: bool,
        turn: &mut Turn<'_>,
    ) -> Result<Placed<B>> {
        let model = &self.lm.model;
        let (be, n_kv) = (model.backend(), model.config().n_kv_heads);
        let offsets = layout.global_offsets(order);
        let mut p =
            Placed { segments: Vec::new(), ids: Vec::new(), first_chunk: usize::from(lead), offsets: Vec::new() };
        turn.phases.time(phase::ASSEMBLE, || -> Result<()> {
            if lead {
                p.segments.push(head_placed.placed(be, model.rope(), head_placed.positions(), n_kv)?);
                p.ids.push(0);
            }
            for (&c, kv) in held.ids.iter().zip(&held.caches) {
                let len = layout.chunks[c].len() as u32;
                let pos: Vec<u32> = (offsets[c]..offsets[c] + len).collect();
                p.segments.push(kv.placed(be, model.rope(), &pos, n_kv)?);
                p.ids.push(segment_id(layout_index(order, c)?));
            }
            Ok(())
        })?;
        p.offsets = offsets;
        Ok(p)
    }

    /// Selection: global indices (layout order over all context tokens), identical everywhere.
    fn select(
        &self,
        comm: &mut dyn Communicator,
        layout: &Layout,
        order: &[usize],
        held: &Held<B>,
        placed: &mut Placed<B>,
        turn: &mut Turn<'_>,
    ) -> Result<Vec<u32>> {
        let n = layout.n_context();
        // A coverage budget whose bounds decide alone (nothing, or the whole context).
        let whole = |k: usize, covered: f64| turn.plan.coverage.map(|(share, _)| CoverageCut { share, k, covered });
        match turn.plan.selection {
            Plan::Nothing => {
                turn.out.coverage = whole(0, 0.0);
                return Ok(Vec::new());
            }
            Plan::Everything => {
                turn.out.coverage = whole(n, 1.0);
                return Ok((0..n as u32).collect());
            }
            Plan::Scored => {}
        }
        let (opts, rank) = (turn.opts, comm.rank());
        let selector =
            selector_for::<B>(opts.method).ok_or_else(|| internal(format!("{} selects nothing", opts.method)))?;
        let (head, chunks) = placed.segments.split_at_mut(placed.first_chunk);
        let mut ctx = ScoreCtx {
            lm: &self.lm,
            layout,
            order,
            local: &held.ids,
            chunks: &held.caches,
            head: head.first(),
            placed: chunks,
            opts,
            aux: self,
            comm: &mut *comm,
            watch: &turn.watch,
        };
        self.fault_point(rank, phase::PROBE)?;
        let scores = turn.phases.time(phase::PROBE, || selector.score(&mut ctx))?;
        let starts = ctx.local_global_starts();
        if opts.keep_scores {
            turn.out.scores = gather_scores(comm, layout, &held.ids, &scores)?;
        }
        let budget = Budget { most: turn.plan.budget, coverage: turn.plan.coverage };
        let (selected, cut) =
            turn.phases.time(phase::SELECTION, || top_k(comm, layout, order, &*selector, &scores, &starts, budget))?;
        turn.out.coverage = cut;
        Ok(selected)
    }

    /// Where the selection lies: per chunk rows (for the result) and this rank's targets.
    #[allow(clippy::too_many_arguments)]
    fn locate(
        &self,
        layout: &Layout,
        order: &[usize],
        held: &Held<B>,
        placed: &Placed<B>,
        selected: &[u32],
        rank: usize,
        turn: &mut Turn<'_>,
    ) -> Result<Located> {
        let bounds = chunk_bounds(layout, order);
        let offsets = layout.global_offsets(order);
        let mut l =
            Located { targets: Vec::new(), tokens: Vec::new(), all_positions: Vec::with_capacity(selected.len()) };
        for &g in selected {
            let (i, row) = locate(&bounds, g as usize);
            let c = order[i];
            l.all_positions.push(offsets[c] + row as u32);
            turn.out.selected_rows[c].push(row);
            if turn.plan.owners[c] == rank {
                let j = held.ids.iter().position(|&h| h == c).ok_or_else(|| internal("selected chunk not held"))?;
                l.targets.push(Target { segment: placed.first_chunk + j, row });
                l.tokens.push(layout.chunks[c][row]);
            }
        }
        Ok(l)
    }
}

/// This rank's chunks in layout order, with their caches.
fn held<B: Backend>(
    order: &[usize],
    owners: &[usize],
    rank: usize,
    local_ids: &[usize],
    caches: &Caches<B>,
) -> Result<Held<B>> {
    let ids: Vec<usize> = order.iter().copied().filter(|&c| owners[c] == rank).collect();
    let caches = ids
        .iter()
        .map(|c| {
            local_ids
                .iter()
                .position(|l| l == c)
                .map(|j| caches.chunks[j].clone())
                .ok_or_else(|| internal("chunk not held"))
        })
        .collect::<Result<_>>()?;
    Ok(Held { ids, caches })
}

/// Every rank's scores of its chunks, to rank 0 (request order; `None` elsewhere).
fn gather_scores(
    comm: &mut dyn Communicator,
    layout: &Layout,
    local: &[usize],
    scores: &[Vec<f32>],
) -> Result<Option<Vec<Vec<f32>>>> {
    let all: Vec<(Vec<usize>, Vec<Vec<f32>>)> =
        all_gather_value(comm, "select.scores", &(local.to_vec(), scores.to_vec()))?;
    if comm.rank() != 0 {
        return Ok(None);
    }
    let mut by_chunk = vec![Vec::new(); layout.chunks.len()];
    for (ids, s) in all {
        for (c, v) in ids.into_iter().zip(s) {
            *by_chunk.get_mut(c).ok_or_else(|| internal(format!("scores of chunk {c}")))? = v;
        }
    }
    Ok(Some(by_chunk))
}

/// How many tokens the selection keeps: the best `most`, or with a budget by coverage
/// `(share, least)` the fewest of them reaching the share of the score mass.
#[derive(Clone, Copy)]
struct Budget {
    most: usize,
    coverage: Option<(f64, usize)>,
}

/// The global top `k`: each rank's best `k` candidates gathered (and, with a budget by
/// coverage, each chunk's score mass), rank 0 cuts and lets the policy refine, then broadcasts
/// the global indices. Rank 0 also returns what a coverage budget chose.
fn top_k<B: Backend>(
    comm: &mut dyn Communicator,
    layout: &Layout,
    order: &[usize],
    selector: &dyn Selector<B>,
    scores: &[Vec<f32>],
    starts: &[usize],
    budget: Budget,
) -> Result<(Vec<u32>, Option<CoverageCut>)> {
    let k = budget.most;
    // Every chunk's mass keyed by its global start, summed in layout order on rank 0: the same
    // total whichever rank held which chunk.
    let masses = match budget.coverage {
        Some(_) => {
            let mine: Vec<(u32, f64)> = scores.iter().zip(starts).map(|(s, &g)| (g as u32, chunk_mass(s))).collect();
            all_gather_value(comm, "select.mass", &mine)?
        }
        None => Vec::new(),
    };
    // Local candidates: this rank's best k (score, global index).
    let mut cand: Vec<(f32, u32)> = scores
        .iter()
        .zip(starts)
        .flat_map(|(s, &g)| s.iter().enumerate().map(move |(i, &v)| (v, (g + i) as u32)))
        .collect();
    cand.sort_by(|a, b| rank_order((a.0, a.1 as usize), (b.0, b.1 as usize)));
    cand.truncate(k);
    let all: Vec<Vec<(f32, u32)>> = all_gather_value(comm, "select.candidates", &cand)?;
    let cut = (comm.rank() == 0).then(|| {
        let mut merged: Vec<(f32, u32)> = all.into_iter().flatten().collect();
        merged.sort_by(|a, b| rank_order((a.0, a.1 as usize), (b.0, b.1 as usize)));
        merged.truncate(k);
        let coverage = budget.coverage.map(|(share, least)| {
            let mut masses: Vec<(u32, f64)> = masses.into_iter().flatten().collect();
            masses.sort_by_key(|&(g, _)| g);
            let total: f64 = masses.iter().map(|&(_, m)| m).sum();
            let best: Vec<f32> = merged.iter().map(|&(s, _)| s).collect();
            let (k, covered) = coverage_count(&best, total, share, least);
            merged.truncate(k);
            CoverageCut { share, k, covered }
        });
        let mut flags: Vec<Vec<bool>> = order.iter().map(|&c| vec![false; layout.chunks[c].len()]).collect();
        let bounds = chunk_bounds(layout, order);
        for (_, g) in merged {
            let (i, row) = locate(&bounds, g as usize);
            flags[i][row] = true;
        }
        let flags = selector.refine(&[], flags);
        let mut sel = Vec::new();
        for (i, f) in flags.iter().enumerate() {
            sel.extend(f.iter().enumerate().filter(|(_, &on)| on).map(|(row, _)| (bounds[i] + row) as u32));
        }
        (sel, coverage)
    });
    let selected = broadcast_value(comm, "select.broadcast", 0, cut.as_ref().map(|c| &c.0))?;
    Ok((selected, cut.and_then(|c| c.1)))
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
