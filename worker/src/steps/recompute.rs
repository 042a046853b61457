//! Phase 4: selective recomputation (InfoFlow "KV Recomputation", ProphetKV stage II), on one
//! rank or many.
//!
//! The selected tokens run through every layer at their global positions. At each layer their
//! new K/V are written into the placed segments (their own rows) before attention, and they
//! attend causally (by position) to every segment: to recomputed rows of this layer and to the
//! cached rows of everything else. Non-selected rows keep their cached values.
//!
//! ```text
//!  rank 0: [head][chunk a: . X . X]     rank 1: [chunk b: X . . .][chunk c: . . X .]
//!  exact (pass-Q), per layer:                 sparse (the paper's), per layer:
//!   write own X rows                           write own X rows
//!   all-gather Q of every X                    all-gather K/V of every X
//!   partial of all Q over local segments      own X attend to local segments
//!   partials back to their owners, merged        + other ranks' X rows (not their caches)
//!   == one rank                                == one rank when everything is selected
//! ```
//! In the sparse scope the other ranks' rows of earlier batches stay (per layer) for the later
//! batches: without them a token of a later batch saw no other rank's context at all once more
//! than one batch was selected (2,048 tokens), and ratio 1 on two ranks was not one rank.
//!
//! Targets are processed in global position batches: a target never sees a later target's
//! stale row (causality) and every earlier target has written all its layers, so batching is
//! exact; every rank runs the same number of batches (possibly empty) so collectives match.

use super::transport::{all_gather_bufs, exchange_bufs, per_row};
use super::{group_targets, merge_into, TargetGroup};
use crate::attend::{attend_over, Attend, KvSource, LayerInput};
use crate::error::{Field, InputError, Result, WorkerError};
use crate::interrupt::Check;
use crate::kv::{KeyForm, KvCache};
use crate::model::{Logits, Model};
use flowprefill_comm::Communicator;
use flowprefill_kernels::Backend;

/// One selected row of this rank: `segments[segment]` row `row`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Target {
    /// Local segment index.
    pub segment: usize,
    /// Row within the segment.
    pub row: usize,
}

/// How far a recomputed token looks across ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Scope {
    /// Pass-Q: every rank's cache, exactly as on one rank.
    Exact,
    /// Only the selected tokens of other ranks travel (InfoFlow section 7).
    Sparse,
}

impl Scope {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Scope::Exact => "exact",
            Scope::Sparse => "sparse",
        }
    }
}

impl std::str::FromStr for Scope {
    type Err = WorkerError;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "exact" => Ok(Scope::Exact),
            "sparse" => Ok(Scope::Sparse),
            other => {
                Err(InputError::new(Field::Scope, format!("unknown scope `{other}`; choose exact or sparse")).into())
            }
        }
    }
}

enum Rows<'a, B: Backend> {
    /// Rows are written into the segments (the recompute phase).
    InPlace(&'a mut [KvCache<B>]),
    /// CacheBlend's probe: every context row of the first layers is written into the chunk
    /// segments (in place, and kept: those layers end fully recomputed, as in CacheBlend),
    /// and the value deviation from the cached row is measured at `check` before the write.
    /// `head` (rank 0's template head) is attended to, never written; target segment `s` is
    /// `chunks[s - first]`.
    Blend { head: Option<&'a KvCache<B>>, chunks: &'a mut [KvCache<B>], first: usize, check: usize, dev: Vec<f32> },
}

/// Other ranks' recomputed rows of one layer from earlier batches (the sparse scope): positions,
/// K and V.
type Earlier<B> = (Vec<u32>, <B as Backend>::Buf, <B as Backend>::Buf);

struct Step<'a, 'c, B: Backend> {
    comm: &'c mut dyn Communicator,
    scope: Scope,
    /// The sparse scope's other-rank rows of earlier batches, per layer: a later batch's
    /// tokens attend to them as a one-rank run attends to those tokens' recomputed rows.
    earlier: Option<&'c mut Vec<Option<Earlier<B>>>>,
    /// Read-only context every rank holds a copy of (the template head), attended to in the
    /// sparse scope by ranks that do not hold it as a segment.
    replicated: Option<&'a KvCache<B>>,
    op: &'static str,
    rows: Rows<'a, B>,
    groups: Vec<TargetGroup>,
}

impl<B: Backend> Attend<B> for Step<'_, '_, B> {
    fn attend(&mut self, x: &LayerInput<'_, B>, out: &mut B::Buf) -> Result<()> {
        // The segments of this layer with this rank's new rows written in.
        self.write_rows(x)?;
        let local: Vec<KvSource<'_, B>> = match &self.rows {
            Rows::InPlace(segs) => segs.iter().map(|s| KvSource::layer(s, x.layer)).collect::<Result<_>>()?,
            Rows::Blend { head, chunks, .. } => {
                head.iter().copied().chain(chunks.iter()).map(|s| KvSource::layer(s, x.layer)).collect::<Result<_>>()?
            }
        };
        match self.scope {
            Scope::Sparse => {
                let earlier = self.earlier.as_deref_mut().and_then(|e| e.get_mut(x.layer));
                sparse(&mut *self.comm, self.op, self.replicated, earlier, x, local, out)
            }
            Scope::Exact => exact(&mut *self.comm, self.op, x, &local, out),
        }
    }
}

impl<B: Backend> Step<'_, '_, B> {
    /// Writes this rank's new K/V rows of layer `x.layer` into its segments (in place); in
    /// CacheBlend's probe, first measures the value deviation at its check layer.
    fn write_rows(&mut self, x: &LayerInput<'_, B>) -> Result<()> {
        let be = x.backend;
        let kvd = x.shape.kv_dim();
        match &mut self.rows {
            Rows::InPlace(segs) => {
                for (seg, toks, rows) in &self.groups {
                    let layer = segs[*seg].layer_mut(x.layer);
                    be.copy_rows(x.k, toks, &mut layer.k, rows, kvd)?;
                    be.copy_rows(x.v, toks, &mut layer.v, rows, kvd)?;
                }
            }
            Rows::Blend { chunks, first, check, dev, .. } => {
                let chunk = |seg: usize| {
                    seg.checked_sub(*first)
                        .ok_or_else(|| crate::error::internal(format!("CacheBlend's probe writes into segment {seg}")))
                };
                if x.layer == *check {
                    let new_v = be.download(x.v)?;
                    for (seg, toks, rows) in &self.groups {
                        let old_v = be.download(&chunks[chunk(*seg)?].layer(x.layer).v)?;
                        for (&t, &r) in toks.iter().zip(rows) {
                            let a = &new_v[t * kvd..(t + 1) * kvd];
                            let b = &old_v[r * kvd..(r + 1) * kvd];
                            dev[t] = a.iter().zip(b).map(|(p, q)| (p - q) * (p - q)).sum();
                        }
                    }
                }
                for (seg, toks, rows) in &self.groups {
                    let layer = chunks[chunk(*seg)?].layer_mut(x.layer);
                    be.copy_rows(x.k, toks, &mut layer.k, rows, kvd)?;
                    be.copy_rows(x.v, toks, &mut layer.v, rows, kvd)?;
                }
            }
        }
        Ok(())
    }
}

/// The sparse scope: other ranks' selected rows travel (own rows are already in the segments),
/// and this rank's rows attend to its segments, the replicated head, those rows and the other
/// ranks' rows of earlier batches (`earlier`, this layer's; this batch's are added to it).
fn sparse<B: Backend>(
    comm: &mut dyn Communicator,
    op: &str,
    replicated: Option<&KvCache<B>>,
    earlier: Option<&mut Option<Earlier<B>>>,
    x: &LayerInput<'_, B>,
    local: Vec<KvSource<'_, B>>,
    out: &mut B::Buf,
) -> Result<()> {
    let be = x.backend;
    let kvd = x.shape.kv_dim();
    let op = format!("{op}.kv");
    // A world of one has nobody to send to: nothing is staged.
    let got = all_gather_bufs(comm, be, &op, x.positions, &[x.k, x.v], &per_row([kvd, kvd]))?;
    let mut remote = Vec::new();
    for (_, (pos, bufs)) in got {
        let [k, v]: [B::Buf; 2] =
            bufs.try_into().map_err(|_| crate::error::internal(format!("`{op}`: rows without K and V")))?;
        remote.push((pos, k, v));
    }
    let mut sources = Vec::with_capacity(local.len() + remote.len() + 2);
    if let Some(r) = replicated {
        sources.push(KvSource::layer(r, x.layer)?);
    }
    sources.extend(local);
    if let Some(Some((pos, k, v))) = earlier.as_deref() {
        sources.push(KvSource { k, v, pos });
    }
    sources.extend(remote.iter().map(|(pos, k, v)| KvSource { k, v, pos }));
    let mut lse = be.zeros(x.positions.len() * x.shape.n_heads)?;
    attend_over(be, x.shape, x.q, x.positions, &sources, out, &mut lse)?;
    drop(sources);
    if let Some(slot) = earlier {
        for (pos, k, v) in remote {
            match slot {
                Some((p, ek, ev)) => {
                    p.extend_from_slice(&pos);
                    be.append(ek, &k)?;
                    be.append(ev, &v)?;
                }
                None => *slot = Some((pos, k, v)),
            }
        }
    }
    Ok(())
}

/// The exact scope (pass-Q): every rank's queries visit this rank's segments, the partials go
/// back to their owners, and this rank merges the partials of its own queries in rank order.
fn exact<B: Backend>(
    comm: &mut dyn Communicator,
    op: &str,
    x: &LayerInput<'_, B>,
    local: &[KvSource<'_, B>],
    out: &mut B::Buf,
) -> Result<()> {
    let be = x.backend;
    let (qd, h, m) = (x.shape.q_dim(), x.shape.n_heads, x.positions.len());
    let (me, n) = (comm.rank(), comm.size());
    let (all_q, all_pos, counts) = gather_queries(comm, &format!("{op}.q"), x)?;
    let total = all_pos.len();
    let mut po = be.zeros(total * qd)?;
    let mut pl = be.zeros(total * h)?;
    if total > 0 {
        attend_over(be, x.shape, &all_q, &all_pos, local, &mut po, &mut pl)?;
    }
    // Rows of rank r's queries start at offsets[r]; cut them out on the device.
    let offsets: Vec<usize> = counts.iter().scan(0, |acc, &c| Some(std::mem::replace(acc, *acc + c))).collect();
    let rows_of = |r: usize| -> Result<(B::Buf, B::Buf)> {
        let (s, c) = (offsets[r], counts[r]);
        let (mut o, mut l) = (be.zeros(c * qd)?, be.zeros(c * h)?);
        if c > 0 {
            let src: Vec<usize> = (s..s + c).collect();
            let dst: Vec<usize> = (0..c).collect();
            be.copy_rows(&po, &src, &mut o, &dst, qd)?;
            be.copy_rows(&pl, &src, &mut l, &dst, h)?;
        }
        Ok((o, l))
    };
    let others: Vec<usize> = (0..n).filter(|&r| r != me).collect();
    let mine: Vec<(B::Buf, B::Buf)> = others.iter().map(|&r| rows_of(r)).collect::<Result<_>>()?;
    let sends = others.iter().zip(&mine).map(|(&r, (o, l))| (r, (0..counts[r] as u32).collect(), vec![o, l])).collect();
    let op = format!("{op}.partials");
    let back = exchange_bufs(comm, be, &op, sends, others, &per_row([qd, h]))?;
    // Merge the partials for this rank's queries in rank order, on the device.
    let mut acc: Option<(B::Buf, B::Buf)> = None;
    let mut back = back.into_iter();
    for r in 0..n {
        let (o, l) = if r == me {
            rows_of(r)?
        } else {
            let (rows, bufs) =
                back.next().ok_or_else(|| WorkerError::Protocol { rank: r, detail: format!("`{op}`: no partials") })?;
            if rows.len() != m {
                return Err(WorkerError::Protocol {
                    rank: r,
                    detail: format!("`{op}`: partials for {} rows, expected {m}", rows.len()),
                });
            }
            let [o, l]: [B::Buf; 2] =
                bufs.try_into().map_err(|_| crate::error::internal(format!("`{op}`: partials without out and lse")))?;
            (o, l)
        };
        merge_into(be, &mut acc, o, l, x.shape.head_dim)?;
    }
    *out = match acc {
        Some((o, _)) => o,
        None => be.zeros(m * qd)?,
    };
    Ok(())
}

/// Every rank's queries of this layer in rank order (this rank's own in its place), with their
/// positions and each rank's row count.
fn gather_queries<B: Backend>(
    comm: &mut dyn Communicator,
    op: &str,
    x: &LayerInput<'_, B>,
) -> Result<(B::Buf, Vec<u32>, Vec<usize>)> {
    let be = x.backend;
    let (me, n) = (comm.rank(), comm.size());
    let mut got = all_gather_bufs(comm, be, op, x.positions, &[x.q], &per_row([x.shape.q_dim()]))?.into_iter();
    let mut all_pos = Vec::new();
    let mut all_q = be.zeros_as(0, be.dtype(x.q))?;
    let mut counts = Vec::with_capacity(n);
    for r in 0..n {
        if r == me {
            counts.push(x.positions.len());
            all_pos.extend_from_slice(x.positions);
            be.append(&mut all_q, x.q)?;
        } else {
            let (_, (pos, bufs)) =
                got.next().ok_or_else(|| WorkerError::Protocol { rank: r, detail: format!("`{op}`: no queries") })?;
            let q = bufs.first().ok_or_else(|| crate::error::internal(format!("`{op}`: rows without Q")))?;
            counts.push(pos.len());
            all_pos.extend(pos);
            be.append(&mut all_q, q)?;
        }
    }
    Ok((all_q, all_pos, counts))
}

/// Global position batches of at most `batch` targets, from every rank's target positions
/// (sorted, unique); returns the inclusive position range of each batch.
fn global_batches(all_positions: &[u32], batch: usize) -> Vec<(u32, u32)> {
    let mut sorted = all_positions.to_vec();
    sorted.sort_unstable();
    sorted.chunks(batch.max(1)).map(|c| (c[0], c[c.len() - 1])).collect()
}

/// A local target: (global position, target, token id, index in the caller's list).
type Planned = (u32, Target, u32, usize);
/// An inclusive range of positions.
type PositionRange = (u32, u32);

/// This rank's targets sorted by position; the batch ranges.
fn plan<S: std::ops::Deref<Target = KvCache<B>>, B: Backend>(
    segments: &[S],
    targets: &[Target],
    tokens: &[u32],
    all_positions: &[u32],
    batch: usize,
) -> Result<(Vec<Planned>, Vec<PositionRange>)> {
    if targets.len() != tokens.len() {
        return Err(crate::error::internal(format!("{} targets but {} tokens", targets.len(), tokens.len())));
    }
    group_targets(targets, segments)?;
    let mut mine: Vec<Planned> = targets
        .iter()
        .zip(tokens)
        .enumerate()
        .map(|(i, (t, &tok))| (segments[t.segment].positions()[t.row], *t, tok, i))
        .collect();
    mine.sort_unstable();
    let mut global = all_positions.to_vec();
    global.sort_unstable();
    if let Some(p) = mine.iter().find(|x| global.binary_search(&x.0).is_err()) {
        return Err(crate::error::internal(format!(
            "local target at position {} is missing from the global selection",
            p.0
        )));
    }
    Ok((mine, global_batches(&global, batch)))
}

/// The selected tokens as one rank sees them.
#[derive(Clone, Copy, Debug)]
pub struct Selection<'a> {
    /// This rank's targets.
    pub targets: &'a [Target],
    /// The token id of each target.
    pub tokens: &'a [u32],
    /// The positions of every rank's targets (the global selection).
    pub all_positions: &'a [u32],
}

/// How recomputation crosses ranks and batches its tokens.
#[derive(Clone, Copy, Debug)]
pub struct RecomputeMode {
    /// Exact (pass-Q) or sparse.
    pub scope: Scope,
    /// Selected tokens per forward (every rank's, by global position).
    pub batch: usize,
}

/// Recomputes this rank's targets of `sel` in its `segments` (rotated, at global positions).
/// Every rank calls this with the same `sel.all_positions` and `mode`, also with no targets of
/// its own. `replicated` is context this rank attends to in the sparse scope without holding
/// it as a segment (the template head on ranks other than 0).
pub fn recompute<B: Backend>(
    model: &Model<B>,
    comm: &mut dyn Communicator,
    segments: &mut [KvCache<B>],
    replicated: Option<&KvCache<B>>,
    sel: &Selection<'_>,
    mode: RecomputeMode,
    check: Check<'_>,
) -> Result<()> {
    if segments.iter().any(|s| s.form() != KeyForm::Rotated) {
        return Err(crate::error::internal("recomputation needs placed (rotated) segments"));
    }
    let RecomputeMode { scope, batch } = mode;
    let (mine, batches) = {
        let refs: Vec<&KvCache<B>> = segments.iter().collect();
        plan(&refs, sel.targets, sel.tokens, sel.all_positions, batch)?
    };
    // Kept only between batches of the sparse scope (one batch needs none).
    let keep = scope == Scope::Sparse && batches.len() > 1 && comm.size() > 1;
    let mut earlier: Vec<Option<Earlier<B>>> = Vec::new();
    if keep {
        earlier.resize_with(model.config().n_layers, || None);
    }
    for (lo, hi) in batches {
        let part: Vec<&Planned> = mine.iter().filter(|x| (lo..=hi).contains(&x.0)).collect();
        let t: Vec<Target> = part.iter().map(|x| x.1).collect();
        let ids: Vec<u32> = part.iter().map(|x| x.2).collect();
        let pos: Vec<u32> = part.iter().map(|x| x.0).collect();
        let groups = group_targets(&t, &segments.iter().collect::<Vec<_>>())?;
        let mut step = Step {
            comm: &mut *comm,
            scope,
            earlier: keep.then_some(&mut earlier),
            replicated,
            op: "recompute",
            rows: Rows::InPlace(&mut *segments),
            groups,
        };
        model.forward_checked(&ids, &pos, &mut step, Logits::None, &mut *check)?;
    }
    Ok(())
}

/// CacheBlend's signal: `||V_new - V_cached||^2` at `check_layer` for each of this rank's
/// targets (in the order given; every context token of the rank), recomputing every rank's
/// targets jointly through layers `0..=check_layer` (exact scope). Those layers of `chunks`
/// keep the recomputed rows: CacheBlend recomputes every token there and only the selected
/// ones after. `head` (rank 0's placed template head, segment 0 of the targets' numbering) is
/// attended to and not written; the chunks are segments `first..` with `first` 1 beside a
/// head and 0 without.
pub fn value_deviation<B: Backend>(
    model: &Model<B>,
    comm: &mut dyn Communicator,
    head: Option<&KvCache<B>>,
    chunks: &mut [KvCache<B>],
    sel: &Selection<'_>,
    check_layer: usize,
    check: Check<'_>,
) -> Result<Vec<f32>> {
    let first = usize::from(head.is_some());
    let (mine, groups) = {
        let segments: Vec<&KvCache<B>> = head.into_iter().chain(chunks.iter()).collect();
        if segments.iter().any(|s| s.form() != KeyForm::Rotated) {
            return Err(crate::error::internal("deviation scoring needs placed (rotated) segments"));
        }
        let (mine, _) = plan(&segments, sel.targets, sel.tokens, sel.all_positions, usize::MAX)?;
        let t: Vec<Target> = mine.iter().map(|x| x.1).collect();
        if let Some(h) = t.iter().find(|t| t.segment < first) {
            return Err(crate::error::internal(format!("CacheBlend's probe targets the head (row {})", h.row)));
        }
        (mine, group_targets(&t, &segments)?)
    };
    let ids: Vec<u32> = mine.iter().map(|x| x.2).collect();
    let pos: Vec<u32> = mine.iter().map(|x| x.0).collect();
    let mut step = Step {
        comm,
        scope: Scope::Exact,
        earlier: None,
        replicated: None,
        op: "blend",
        rows: Rows::Blend { head, chunks, first, check: check_layer, dev: vec![0.0; mine.len()] },
        groups,
    };
    model.forward_layers(&ids, &pos, &mut step, check_layer + 1, check)?;
    let Rows::Blend { dev, .. } = step.rows else { return Err(crate::error::internal("deviation lost")) };
    // Back to the caller's target order.
    let mut out = vec![0f32; sel.targets.len()];
    for (d, x) in dev.into_iter().zip(&mine) {
        out[x.3] = d;
    }
    Ok(out)
}
