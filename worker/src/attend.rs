//! What a layer's queries attend to: the [`Attend`] step of the forward.
//!
//! The forward computes Q, K (rotated and pre-RoPE) and V for its tokens and hands them to an
//! `Attend`, which returns the attention output. Context is a list of KV sources (a cache, the
//! placed segments of a chunked layout, the tokens themselves); attention over several sources
//! is one kernel call per source, combined with `merge_partial` ([`attend_over`]), which is
//! exactly what a rank does with its local shards before merging across ranks (a GPU first
//! gathers many small sources into a few, [`Backend::gathered_keys`]).

use crate::error::Result;
use crate::kv::{KeyForm, KvCache};
use flowprefill_kernels::attention::AttnShape;
use flowprefill_kernels::rope::RopeTable;
use flowprefill_kernels::{Backend, DType};

/// The tensors of one layer's tokens, as the forward computed them.
pub struct LayerInput<'a, B: Backend> {
    /// The backend.
    pub backend: &'a B,
    /// Head layout.
    pub shape: &'a AttnShape,
    /// RoPE table (to place stored pre-RoPE keys).
    pub rope: &'a RopeTable,
    /// Layer index.
    pub layer: usize,
    /// Positions of the tokens.
    pub positions: &'a [u32],
    /// Queries `[m, n_heads, head_dim]`, rotated.
    pub q: &'a B::Buf,
    /// Keys `[m, n_kv_heads, head_dim]`, rotated.
    pub k: &'a B::Buf,
    /// Keys before RoPE.
    pub k_pre: &'a B::Buf,
    /// Values.
    pub v: &'a B::Buf,
}

/// Computes the attention output `[m, n_heads, head_dim]` of a layer into `out`.
pub trait Attend<B: Backend> {
    /// Called once per layer, in layer order.
    fn attend(&mut self, input: &LayerInput<'_, B>, out: &mut B::Buf) -> Result<()>;
    /// The element type of the `out` this step writes: f32 (the default: steps that merge
    /// partial results into it), or the backend's activation type where the step writes it by
    /// attention calls and [`attend_over`] alone (bf16 in a GPU's bf16 forward, which the
    /// output projection then reads as it is, without a conversion pass).
    fn out_dtype(&self, _backend: &B) -> DType {
        DType::F32
    }
}

/// Keys (rotated), values and positions of one source of context at one layer.
#[derive(Clone, Copy)]
pub struct KvSource<'a, B: Backend> {
    /// Rotated keys `[n, kv_dim]`.
    pub k: &'a B::Buf,
    /// Values `[n, kv_dim]`.
    pub v: &'a B::Buf,
    /// Positions `[n]`.
    pub pos: &'a [u32],
}

impl<'a, B: Backend> KvSource<'a, B> {
    /// Layer `l` of a rotated cache.
    pub fn layer(cache: &'a KvCache<B>, l: usize) -> Result<Self> {
        if cache.form() != KeyForm::Rotated {
            return Err(crate::error::internal("attention needs rotated keys; place the cache first"));
        }
        let layer = cache.layer(l);
        Ok(Self { k: &layer.k, v: &layer.v, pos: cache.positions() })
    }
}

/// Sources below this many take one attention call each, even where the backend gathers
/// ([`Backend::gathered_keys`]): a chunk's own prefill attends to at most three (the head, the
/// anchor, itself), where a copy would cost about what it saves. (Of the chunked steps, the
/// recomputation and CacheBlend's deviation probe attend to many here; the other probes and the
/// final prompt merge their per-segment partials in global order in `steps/replicated.rs`.)
pub const GATHER_FROM_SOURCES: usize = 4;

/// Attention of `q` (at `qpos`) over several sources, merged into `(out, lse)`. Empty sources
/// are skipped; with no keys at all, `out = 0` and `lse = -inf`. `out` is f32 or bf16: a
/// single source writes a bf16 `out` directly; several merge in f32 and are rounded once at
/// the end. Where the backend gathers ([`Backend::gathered_keys`] > 0) and there are at least
/// [`GATHER_FROM_SOURCES`] sources, runs of consecutive sources of one element type and at
/// most that many keys in all are copied into one K/V buffer each (one run at a time) and
/// attended with one call: the same keys and positions, so the same values up to the order
/// of the softmax's sums.
pub fn attend_over<B: Backend>(
    be: &B,
    shape: &AttnShape,
    q: &B::Buf,
    qpos: &[u32],
    sources: &[KvSource<'_, B>],
    out: &mut B::Buf,
    lse: &mut B::Buf,
) -> Result<()> {
    let m = qpos.len();
    let dtype = be.dtype(out);
    let live: Vec<&KvSource<'_, B>> = sources.iter().filter(|s| !s.pos.is_empty()).collect();
    let runs = runs_of(be, &live);
    if dtype != DType::F32 && runs.len() > 1 {
        let mut wide = be.zeros(m * shape.q_dim())?;
        attend_over(be, shape, q, qpos, sources, &mut wide, lse)?;
        be.copy_columns(&wide, shape.q_dim(), 0, shape.q_dim(), out)?;
        return Ok(());
    }
    let mut first = true;
    let mut tmp: Option<(B::Buf, B::Buf)> = None;
    for run in runs {
        let gathered = if run.len() > 1 { Some(gather(be, shape.kv_dim(), &live[run.clone()])?) } else { None };
        let s: KvSource<'_, B> = match &gathered {
            Some((k, v, pos)) => KvSource { k, v, pos },
            None => KvSource { k: live[run.start].k, v: live[run.start].v, pos: live[run.start].pos },
        };
        if first {
            be.attention(shape, q, qpos, s.k, s.v, s.pos, out, lse)?;
            first = false;
        } else {
            if tmp.is_none() {
                tmp = Some((be.zeros(m * shape.q_dim())?, be.zeros(m * shape.n_heads)?));
            }
            let (to, tl) = tmp.as_mut().ok_or_else(|| crate::error::internal("scratch missing"))?;
            be.attention(shape, q, qpos, s.k, s.v, s.pos, to, tl)?;
            be.merge_partial(out, lse, to, tl, shape.head_dim)?;
        }
    }
    if first {
        *out = be.zeros_as(m * shape.q_dim(), dtype)?;
        *lse = be.upload(&vec![f32::NEG_INFINITY; m * shape.n_heads])?;
    }
    Ok(())
}

/// The calls of [`attend_over`]: ranges of `live` attended together, one source each unless
/// the backend gathers and there are enough sources.
fn runs_of<B: Backend>(be: &B, live: &[&KvSource<'_, B>]) -> Vec<std::ops::Range<usize>> {
    let cap = be.gathered_keys();
    if cap == 0 || live.len() < GATHER_FROM_SOURCES {
        return (0..live.len()).map(|i| i..i + 1).collect();
    }
    let mut runs: Vec<std::ops::Range<usize>> = Vec::new();
    let mut keys = 0;
    for (i, s) in live.iter().enumerate() {
        let n = s.pos.len();
        let kind = (be.dtype(s.k), be.dtype(s.v));
        match runs.last_mut() {
            Some(run) if keys + n <= cap && (be.dtype(live[run.start].k), be.dtype(live[run.start].v)) == kind => {
                run.end = i + 1;
                keys += n;
            }
            _ => {
                runs.push(i..i + 1);
                keys = n;
            }
        }
    }
    runs
}

/// K, V and positions of `run` in one buffer each.
fn gather<B: Backend>(be: &B, kvd: usize, run: &[&KvSource<'_, B>]) -> Result<(B::Buf, B::Buf, Vec<u32>)> {
    let keys: usize = run.iter().map(|s| s.pos.len()).sum();
    let (mut k, mut v) = (be.zeros_as(0, be.dtype(run[0].k))?, be.zeros_as(0, be.dtype(run[0].v))?);
    be.reserve(&mut k, keys * kvd)?;
    be.reserve(&mut v, keys * kvd)?;
    let mut pos = Vec::with_capacity(keys);
    for s in run {
        let n = s.pos.len() * kvd;
        if be.len(s.k) != n || be.len(s.v) != n {
            return Err(crate::error::internal(format!(
                "a source of {} positions holds {} / {} K / V values, not {n}",
                s.pos.len(),
                be.len(s.k),
                be.len(s.v)
            )));
        }
        be.append(&mut k, s.k)?;
        be.append(&mut v, s.v)?;
        pos.extend_from_slice(s.pos);
    }
    Ok((k, v, pos))
}

/// The tokens attend to themselves only (causally by position): plain prefill of a sequence
/// with no cache, e.g. a reference forward in tests.
pub struct SelfOnly;

impl<B: Backend> Attend<B> for SelfOnly {
    fn attend(&mut self, x: &LayerInput<'_, B>, out: &mut B::Buf) -> Result<()> {
        let mut lse = x.backend.zeros(x.positions.len() * x.shape.n_heads)?;
        x.backend.attention(x.shape, x.q, x.positions, x.k, x.v, x.positions, out, &mut lse)?;
        Ok(())
    }
    fn out_dtype(&self, backend: &B) -> DType {
        backend.act_dtype()
    }
}

/// Attends to fixed context segments (optional), everything already in a rotated cache, and
/// the new tokens; appends the new tokens (rotated keys) to the cache. Prefill in
/// micro-batches, decoding, and the final prompt pass over a chunked layout.
///
/// The cache is consistent only after [`AppendAttend::commit`]; dropping it uncommitted (a
/// failed forward) removes the rows appended so far.
pub struct AppendAttend<'a, B: Backend> {
    backend: &'a B,
    context: Vec<&'a KvCache<B>>,
    cache: &'a mut KvCache<B>,
    old_len: usize,
    all_positions: Vec<u32>,
    layers_done: usize,
    committed: bool,
}

impl<'a, B: Backend> AppendAttend<'a, B> {
    /// Prepares to append `positions.len()` tokens to `cache`.
    pub fn new(backend: &'a B, cache: &'a mut KvCache<B>, positions: &[u32]) -> Result<Self> {
        Self::with_context(backend, Vec::new(), cache, positions)
    }

    /// As [`AppendAttend::new`], attending also to `context` (rotated caches, not modified).
    pub fn with_context(
        backend: &'a B,
        context: Vec<&'a KvCache<B>>,
        cache: &'a mut KvCache<B>,
        positions: &[u32],
    ) -> Result<Self> {
        if cache.form() != KeyForm::Rotated || context.iter().any(|c| c.form() != KeyForm::Rotated) {
            return Err(crate::error::internal("decoding needs caches of rotated keys"));
        }
        let old_len = cache.len();
        let mut all_positions = Vec::with_capacity(old_len + positions.len());
        all_positions.extend_from_slice(cache.positions());
        all_positions.extend_from_slice(positions);
        Ok(Self { backend, context, cache, old_len, all_positions, layers_done: 0, committed: false })
    }

    /// Publishes the new rows' positions; call after the forward succeeded.
    pub fn commit(mut self) -> Result<()> {
        if self.layers_done != self.cache.n_layers() {
            return Err(crate::error::internal(format!(
                "commit after {} of {} layers",
                self.layers_done,
                self.cache.n_layers()
            )));
        }
        let positions = std::mem::take(&mut self.all_positions);
        self.cache.set_positions(positions);
        self.committed = true;
        Ok(())
    }
}

impl<B: Backend> Drop for AppendAttend<'_, B> {
    fn drop(&mut self) {
        if !self.committed {
            let n = self.old_len * self.cache.kv_dim();
            for l in 0..self.layers_done.min(self.cache.n_layers()) {
                let layer = self.cache.layer_mut(l);
                // Shrinking cannot fail on any backend that could grow the buffer.
                let _ = self.backend.resize(&mut layer.k, n);
                let _ = self.backend.resize(&mut layer.v, n);
            }
        }
    }
}

impl<B: Backend> Attend<B> for AppendAttend<'_, B> {
    fn attend(&mut self, x: &LayerInput<'_, B>, out: &mut B::Buf) -> Result<()> {
        if x.layer != self.layers_done {
            return Err(crate::error::internal(format!(
                "layer {} out of order (expected {})",
                x.layer, self.layers_done
            )));
        }
        let be = self.backend;
        {
            let layer = self.cache.layer_mut(x.layer);
            be.append(&mut layer.k, x.k)?;
            be.append(&mut layer.v, x.v)?;
        }
        self.layers_done += 1;
        let mut sources = Vec::with_capacity(self.context.len() + 1);
        for c in &self.context {
            sources.push(KvSource::layer(c, x.layer)?);
        }
        let layer = self.cache.layer(x.layer);
        sources.push(KvSource { k: &layer.k, v: &layer.v, pos: &self.all_positions });
        let mut lse = be.zeros(x.positions.len() * x.shape.n_heads)?;
        attend_over(be, x.shape, x.q, x.positions, &sources, out, &mut lse)
    }
    fn out_dtype(&self, backend: &B) -> DType {
        backend.act_dtype()
    }
}
