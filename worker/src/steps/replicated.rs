//! Replicated queries over a sharded context: the probe (phase 2), the final prompt pass and
//! decoding (phase 5, flash-decoding across ranks).
//!
//! ```text
//!   rank 0: [head][chunk 0][chunk 1]   rank 1: [chunk 2][chunk 3]   (segments, global ids 0..4)
//!   every rank: the same query tokens, the same tail (the queries' own K/V + earlier tokens)
//!
//!   per layer: partial (out, lse) of the queries over each local segment
//!              gather the partials at rank 0 (O(M d) per segment), merge them in global
//!              segment order, broadcast the merged (out, lse); merge the tail -> identical
//!              on every rank
//!              scores (probe): attention mass of the local keys under the merged lse
//! ```
//! Merging per segment in a fixed global order makes the result independent of how segments
//! are spread over ranks, bit for bit: one rank and four ranks select the same tokens.

use crate::attend::{Attend, KvSource, LayerInput};
use crate::error::{Result, WorkerError};
use crate::kv::{KeyForm, KvCache};
use crate::steps::transport::exchange_bufs;
use crate::steps::{clone_buf, merge_into};
use flowprefill_comm::Communicator;
use flowprefill_kernels::Backend;

/// A context segment held by this rank.
pub struct LocalSegment<'a, B: Backend> {
    /// Global segment id (merge order).
    pub id: usize,
    /// The cache: rotated (used at its own positions) or pre-RoPE (rotated to `positions` per
    /// layer, e.g. for a scoring geometry).
    pub cache: &'a KvCache<B>,
    /// Positions the segment is attended at.
    pub positions: Vec<u32>,
}

// Manual: `B` itself need not be `Clone` (the segment only borrows its cache).
impl<B: Backend> Clone for LocalSegment<'_, B> {
    fn clone(&self) -> Self {
        Self { id: self.id, cache: self.cache, positions: self.positions.clone() }
    }
}

impl<'a, B: Backend> LocalSegment<'a, B> {
    /// A rotated segment at its own positions.
    pub fn placed(id: usize, cache: &'a KvCache<B>) -> Self {
        Self { id, cache, positions: cache.positions().to_vec() }
    }
}

/// Attend for queries replicated on every rank (see the module docs).
pub struct Replicated<'a, 'c, B: Backend> {
    be: &'a B,
    comm: &'c mut dyn Communicator,
    op: &'static str,
    local: Vec<LocalSegment<'a, B>>,
    tail: &'c mut KvCache<B>,
    tail_positions: Vec<u32>,
    old_tail: usize,
    /// The tail row the queries' K/V go to when the tail has rows for them already
    /// ([`Replicated::at_row`]); `None`: appended.
    at_row: Option<usize>,
    layers_done: usize,
    weights: Vec<f32>,
    /// Weighted attention mass per local segment row (probe), summed on the host from
    /// `pending` once the forward is done.
    scores: Vec<Vec<f32>>,
    /// Per scoring layer and segment: (segment index, weight, the layer's scores on the
    /// device), read after the forward so that it never waits for the device in between.
    pending: Vec<(usize, f32, B::Buf)>,
    /// Query rows (the last ones) whose attention is kept per (layer, KV head) for eviction;
    /// 0: none.
    head_window: usize,
    /// Per layer and segment: (segment index, layer, one score buffer per KV head).
    head_pending: Vec<(usize, usize, Vec<B::Buf>)>,
}

/// Attention mass per local segment, layer and KV head (`[segment][layer][kv_head][row]`).
pub type HeadScores = Vec<Vec<Vec<Vec<f32>>>>;

impl<'a, 'c, B: Backend> Replicated<'a, 'c, B> {
    /// Queries at `positions` over the local segments and `tail` (rotated; the queries' K/V
    /// are appended to it). `weights[l] > 0` accumulates scores at layer l. `op` names the
    /// collectives in the statistics.
    pub fn new(
        be: &'a B,
        comm: &'c mut dyn Communicator,
        op: &'static str,
        local: Vec<LocalSegment<'a, B>>,
        tail: &'c mut KvCache<B>,
        positions: &[u32],
        weights: Vec<f32>,
    ) -> Result<Self> {
        if tail.form() != KeyForm::Rotated {
            return Err(crate::error::internal("the tail cache must hold rotated keys"));
        }
        for s in &local {
            if s.positions.len() != s.cache.len() {
                return Err(crate::error::internal(format!(
                    "segment {}: {} positions for {} rows",
                    s.id,
                    s.positions.len(),
                    s.cache.len()
                )));
            }
            if s.cache.form() == KeyForm::Rotated && s.positions != s.cache.positions() {
                return Err(crate::error::internal(format!(
                    "segment {} is rotated and can only be used at its own positions",
                    s.id
                )));
            }
        }
        let old_tail = tail.len();
        let mut tail_positions = tail.positions().to_vec();
        tail_positions.extend_from_slice(positions);
        let scores = local.iter().map(|s| vec![0.0; s.cache.len()]).collect();
        Ok(Self {
            be,
            comm,
            op,
            local,
            tail,
            tail_positions,
            old_tail,
            at_row: None,
            layers_done: 0,
            weights,
            scores,
            pending: Vec::new(),
            head_window: 0,
            head_pending: Vec::new(),
        })
    }

    /// Made with no positions of its own ([`Replicated::new`] with `&[]`) over a tail that has
    /// rows for the queries at `positions` already, from `row` on ([`KvCache::extend_ahead`]):
    /// their K/V are written there ([`Backend::put_rows`]) and the tail keeps its length and
    /// positions, so that a decode step's ops are the same from one token to the next but for
    /// its token, position and row (what [`Backend::record`] replays).
    pub fn at_row(mut self, positions: &[u32], row: usize) -> Result<Self> {
        if self.tail_positions.len() != self.tail.len() {
            return Err(crate::error::internal("rows written in place, but positions given to append"));
        }
        if self.tail.positions().get(row..row + positions.len()) != Some(positions) {
            return Err(crate::error::internal(format!(
                "tail rows {row}..{} are not at the queries' positions",
                row + positions.len()
            )));
        }
        self.at_row = Some(row);
        Ok(self)
    }

    /// Also keeps, at every layer, the attention mass the last `window` query rows pay each
    /// local row, per KV head ([`crate::evict::kv_head_scores`] under the merged normaliser;
    /// read by [`Replicated::commit_with_heads`]).
    pub fn with_head_scores(mut self, window: usize) -> Self {
        self.head_window = window;
        self
    }

    /// Publishes the appended tail rows and returns the scores; call after a successful
    /// forward. The scores are read from the device here, in layer order (the sums are those
    /// of reading them layer by layer).
    pub fn commit(self) -> Result<Vec<Vec<f32>>> {
        Ok(self.commit_with_heads()?.0)
    }

    /// As [`Replicated::commit`], with the per-head scores of [`Replicated::with_head_scores`]
    /// (empty layers when not asked for).
    pub fn commit_with_heads(mut self) -> Result<(Vec<Vec<f32>>, HeadScores)> {
        let heads = self.read_heads()?;
        for (seg, w, sc) in std::mem::take(&mut self.pending) {
            for (a, v) in self.scores[seg].iter_mut().zip(self.be.download(&sc)?) {
                *a += w * v;
            }
        }
        if self.layers_done != self.tail.n_layers() {
            // A probe that stopped early: drop its rows, keep the tail as it was.
            self.rollback();
        } else {
            let p = std::mem::take(&mut self.tail_positions);
            self.tail.set_positions(p);
            self.layers_done = usize::MAX;
        }
        Ok((std::mem::take(&mut self.scores), heads))
    }

    /// The per-head scores of [`Replicated::with_head_scores`], and the rows this forward
    /// appended to the tail dropped: for rows nothing reads later (LookaheadKV's).
    pub fn discard_with_heads(mut self) -> Result<HeadScores> {
        let heads = self.read_heads()?;
        self.rollback();
        Ok(heads)
    }

    fn read_heads(&mut self) -> Result<HeadScores> {
        let mut heads: HeadScores = self.local.iter().map(|_| vec![Vec::new(); self.tail.n_layers()]).collect();
        for (seg, layer, bufs) in std::mem::take(&mut self.head_pending) {
            heads[seg][layer] = bufs.iter().map(|b| self.be.download(b)).collect::<std::result::Result<_, _>>()?;
        }
        Ok(heads)
    }

    fn rollback(&mut self) {
        if self.at_row.is_some() {
            // Rows written in place stay (the next step at that row writes them again).
            self.layers_done = usize::MAX;
            return;
        }
        let n = self.old_tail * self.tail.kv_dim();
        for l in 0..self.layers_done.min(self.tail.n_layers()) {
            let layer = self.tail.layer_mut(l);
            // Shrinking cannot fail on a backend that could grow the buffer.
            let _ = self.be.resize(&mut layer.k, n);
            let _ = self.be.resize(&mut layer.v, n);
        }
        self.layers_done = usize::MAX;
    }
}

impl<B: Backend> Drop for Replicated<'_, '_, B> {
    fn drop(&mut self) {
        if self.layers_done != usize::MAX {
            self.rollback();
        }
    }
}

/// One segment's partial attention on the device: (segment id, out, lse).
pub(crate) type Partial<B> = (usize, <B as Backend>::Buf, <B as Backend>::Buf);

/// Merges per-segment partials of all ranks in segment order at rank 0 and broadcasts the
/// result: `(out, lse)` on the device, the same bits on every rank; `None` when no rank had
/// a partial (nothing visible anywhere).
fn merge_at_root<B: Backend>(
    be: &B,
    comm: &mut dyn Communicator,
    op: &str,
    parts: Vec<Partial<B>>,
    out_len: usize,
    lse_len: usize,
    head_dim: usize,
) -> Result<Option<(B::Buf, B::Buf)>> {
    let (me, n) = (comm.rank(), comm.size());
    let merge = |mut all: Vec<Partial<B>>| -> Result<Option<(B::Buf, B::Buf)>> {
        all.sort_by_key(|p| p.0);
        let mut acc = None;
        for (_, po, pl) in all {
            merge_into(be, &mut acc, po, pl, head_dim)?;
        }
        Ok(acc)
    };
    if n == 1 {
        return merge(parts);
    }
    let gather = format!("{op}.gather");
    let bcast = format!("{op}.merged");
    // A message is segment ids as rows and (out, lse) per segment.
    let lens = |ids: &[u32]| ids.iter().flat_map(|_| [out_len, lse_len]).collect::<Vec<usize>>();
    if me == 0 {
        let others: Vec<usize> = (1..n).collect();
        let got = exchange_bufs(comm, be, &gather, vec![], others.clone(), &lens)?;
        let mut all = parts;
        for (ids, bufs) in got {
            let mut bufs = bufs.into_iter();
            for id in ids {
                let (Some(o), Some(l)) = (bufs.next(), bufs.next()) else {
                    return Err(crate::error::internal(format!("`{gather}`: a partial without its buffers")));
                };
                all.push((id as usize, o, l));
            }
        }
        let merged = merge(all)?;
        let sends = match &merged {
            Some((o, l)) => others.iter().map(|&r| (r, vec![0], vec![o, l])).collect(),
            None => others.iter().map(|&r| (r, vec![], vec![])).collect(),
        };
        exchange_bufs(comm, be, &bcast, sends, vec![], &lens)?;
        Ok(merged)
    } else {
        let ids: Vec<u32> = parts.iter().map(|p| p.0 as u32).collect();
        let bufs: Vec<&B::Buf> = parts.iter().flat_map(|(_, o, l)| [o, l]).collect();
        exchange_bufs(comm, be, &gather, vec![(0, ids, bufs)], vec![], &lens)?;
        let got = exchange_bufs(comm, be, &bcast, vec![], vec![0], &lens)?;
        let (_, bufs) = got
            .into_iter()
            .next()
            .ok_or_else(|| WorkerError::Protocol { rank: 0, detail: format!("`{bcast}`: no message") })?;
        let mut bufs = bufs.into_iter();
        Ok(match (bufs.next(), bufs.next()) {
            (Some(o), Some(l)) => Some((o, l)),
            _ => None,
        })
    }
}

impl<B: Backend> Replicated<'_, '_, B> {
    /// The queries' partial over each local segment that has keys (an empty one contributes
    /// nothing), with each segment's keys rotated to its positions where the cache keeps them
    /// pre-RoPE (`None`: its own keys serve).
    #[allow(clippy::type_complexity)]
    fn local_partials(&self, x: &LayerInput<'_, B>) -> Result<(Vec<Option<B::Buf>>, Vec<Partial<B>>)> {
        let be = x.backend;
        let m = x.positions.len();
        let (qd, kvd, h) = (x.shape.q_dim(), x.shape.kv_dim(), x.shape.n_heads);
        let mut rotated: Vec<Option<B::Buf>> = Vec::with_capacity(self.local.len());
        let mut parts: Vec<Partial<B>> = Vec::with_capacity(self.local.len());
        for s in &self.local {
            let layer = s.cache.layer(x.layer);
            let rot = match s.cache.form() {
                KeyForm::PreRope if !s.positions.is_empty() => {
                    let mut k = clone_buf(be, &layer.k, kvd)?;
                    be.rope(&mut k, x.shape.n_kv_heads, &s.positions, x.rope)?;
                    Some(k)
                }
                _ => None,
            };
            if !s.positions.is_empty() && m > 0 {
                let mut o = be.zeros(m * qd)?;
                let mut l = be.zeros(m * h)?;
                let k = rot.as_ref().unwrap_or(&layer.k);
                be.attention(x.shape, x.q, x.positions, k, &layer.v, &s.positions, &mut o, &mut l)?;
                parts.push((s.id, o, l));
            }
            rotated.push(rot);
        }
        Ok((rotated, parts))
    }

    /// The local keys' scores under the merged normaliser `lse`: per KV head for the eviction
    /// window, and the layer's weighted attention mass.
    fn score_local(&mut self, x: &LayerInput<'_, B>, rotated: &[Option<B::Buf>], lse: &B::Buf) -> Result<()> {
        let be = x.backend;
        if self.head_window > 0 {
            for (i, (s, rot)) in self.local.iter().zip(rotated).enumerate() {
                if s.positions.is_empty() {
                    continue;
                }
                let k = rot.as_ref().unwrap_or(&s.cache.layer(x.layer).k);
                let w = self.head_window;
                let sc = crate::evict::kv_head_scores(be, x.shape, x.q, x.positions, k, &s.positions, lse, w)?;
                self.head_pending.push((i, x.layer, sc));
            }
        }
        let w = self.weights.get(x.layer).copied().unwrap_or(0.0);
        if w > 0.0 && !x.positions.is_empty() {
            for (i, (s, rot)) in self.local.iter().zip(rotated).enumerate() {
                if s.positions.is_empty() {
                    continue;
                }
                let k = rot.as_ref().unwrap_or(&s.cache.layer(x.layer).k);
                let mut sc = be.zeros(s.positions.len())?;
                be.attention_scores(x.shape, x.q, x.positions, k, &s.positions, lse, &mut sc)?;
                self.pending.push((i, w, sc));
            }
        }
        Ok(())
    }
}

impl<B: Backend> Attend<B> for Replicated<'_, '_, B> {
    fn attend(&mut self, x: &LayerInput<'_, B>, out: &mut B::Buf) -> Result<()> {
        if x.layer != self.layers_done {
            return Err(crate::error::internal(format!(
                "layer {} out of order (expected {})",
                x.layer, self.layers_done
            )));
        }
        let be = x.backend;
        let m = x.positions.len();
        let (qd, h, d) = (x.shape.q_dim(), x.shape.n_heads, x.shape.head_dim);
        let (rotated, parts) = self.local_partials(x)?;
        // Every rank's partials, merged at rank 0 in global segment order, then broadcast:
        // identical on every rank, and (P-1) x (local + merged) bytes instead of an all-gather.
        let mut acc = merge_at_root(be, self.comm, self.op, parts, m * qd, m * h, d)?;
        // The tail (earlier replicated tokens + these queries), identical on every rank.
        {
            let kvd = x.shape.kv_dim();
            let layer = self.tail.layer_mut(x.layer);
            if let Some(row) = self.at_row {
                be.put_rows(&mut layer.k, x.k, row, kvd)?;
                be.put_rows(&mut layer.v, x.v, row, kvd)?;
            } else {
                be.append(&mut layer.k, x.k)?;
                be.append(&mut layer.v, x.v)?;
            }
        }
        self.layers_done += 1;
        let layer = self.tail.layer(x.layer);
        let tail = KvSource::<B> { k: &layer.k, v: &layer.v, pos: &self.tail_positions };
        if m > 0 {
            let mut to = be.zeros(m * qd)?;
            let mut tl = be.zeros(m * h)?;
            be.attention(x.shape, x.q, x.positions, tail.k, tail.v, tail.pos, &mut to, &mut tl)?;
            merge_into(be, &mut acc, to, tl, d)?;
        }
        let Some((acc_o, acc_l)) = acc else {
            *out = be.zeros(m * qd)?;
            return Ok(());
        };
        *out = acc_o;
        self.score_local(x, &rotated, &acc_l)
    }
}
