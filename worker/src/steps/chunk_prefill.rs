//! Phase 1: prefill chunks on their own at local positions, each optionally behind a head (the
//! shared prefix, or the anchor block of Star Attention), keeping K before RoPE.
//!
//! ```text
//!   one forward, several chunks (GEMMs run on all rows at once):
//!   rows:   [ chunk a: pos 0..na ][ chunk b: pos P..P+nb ][ chunk c: pos 0..nc ]
//!   attend: a -> a only            b -> head + b            c -> c only
//! ```
//! Chunks are independent (block-diagonal attention, chosen per chunk, not by positions, since
//! local positions overlap), so batching them changes nothing but the GEMM sizes. The result of
//! a chunk depends only on its head and its tokens, never on the query: it is cached by content
//! and placed anywhere later by one rotation.

use crate::attend::{attend_over, Attend, KvSource, LayerInput};
use crate::error::Result;
use crate::interrupt::Check;
use crate::kv::{KeyForm, KvCache, LayerKv};
use crate::model::{Logits, Model};
use flowprefill_kernels::{Backend, DType};

/// Default rows per batched chunk-prefill forward.
pub const DEFAULT_BATCH_TOKENS: usize = 4096;

/// One chunk to prefill.
pub struct ChunkJob<'a, B: Backend> {
    /// Rotated caches the chunk attends to (not stored with it).
    pub head: Vec<&'a KvCache<B>>,
    /// The chunk's tokens.
    pub tokens: &'a [u32],
    /// Position of its first token.
    pub start: u32,
}

struct Batched<'a, 'j, B: Backend> {
    jobs: &'j [ChunkJob<'a, B>],
    /// Row range of each job in the forward.
    ranges: Vec<std::ops::Range<usize>>,
    /// Recorded layers per job.
    layers: Vec<Vec<LayerKv<B>>>,
}

impl<B: Backend> Attend<B> for Batched<'_, '_, B> {
    fn attend(&mut self, x: &LayerInput<'_, B>, out: &mut B::Buf) -> Result<()> {
        let be = x.backend;
        let (qd, kvd, h) = (x.shape.q_dim(), x.shape.kv_dim(), x.shape.n_heads);
        let single = self.jobs.len() == 1;
        // The log-sum-exp of every row, for the chunks attended in place (below).
        let mut lse_rows: Option<B::Buf> = None;
        for (j, (job, r)) in self.jobs.iter().zip(&self.ranges).enumerate() {
            let n = r.len();
            if !single && job.head.is_empty() {
                // A chunk with nothing before it attends to its own rows only: its rows are read
                // and written where the batch holds them (`attention_rows`, `append_rows`: on a
                // GPU three calls instead of a gather of four tensors, the attention and a
                // scatter of its output, each with buffers of its own).
                let pos = &x.positions[r.clone()];
                let rec = &mut self.layers[j][x.layer];
                be.append_rows(&mut rec.k, x.k_pre, r.start, n, kvd)?;
                be.append_rows(&mut rec.v, x.v, r.start, n, kvd)?;
                if lse_rows.is_none() {
                    lse_rows = Some(be.zeros(x.positions.len() * h)?);
                }
                let lse = lse_rows.as_mut().ok_or_else(|| crate::error::internal("lse rows missing"))?;
                be.attention_rows(x.shape, x.q, r.start, pos, x.k, x.v, r.start, pos, out, lse)?;
                continue;
            }
            let rows: Vec<usize> = r.clone().collect();
            let local: Vec<usize> = (0..n).collect();
            let pos = &x.positions[r.clone()];
            // Gather this chunk's rows; a forward of one chunk uses the buffers as they are.
            let gather = |src: &B::Buf, width: usize| -> Result<Option<B::Buf>> {
                if single {
                    return Ok(None);
                }
                let mut dst = be.zeros_as(n * width, be.dtype(src))?;
                be.copy_rows(src, &rows, &mut dst, &local, width)?;
                Ok(Some(dst))
            };
            let (gq, gk, gv, gp) = (gather(x.q, qd)?, gather(x.k, kvd)?, gather(x.v, kvd)?, gather(x.k_pre, kvd)?);
            let (q, k, v, k_pre) = (
                gq.as_ref().unwrap_or(x.q),
                gk.as_ref().unwrap_or(x.k),
                gv.as_ref().unwrap_or(x.v),
                gp.as_ref().unwrap_or(x.k_pre),
            );
            let rec = &mut self.layers[j][x.layer];
            be.append(&mut rec.k, k_pre)?;
            be.append(&mut rec.v, v)?;
            let mut sources = Vec::with_capacity(job.head.len() + 1);
            for hd in &job.head {
                sources.push(KvSource::layer(hd, x.layer)?);
            }
            sources.push(KvSource { k, v, pos });
            let mut lse = be.zeros(n * h)?;
            if single {
                attend_over(be, x.shape, q, pos, &sources, out, &mut lse)?;
            } else {
                let mut o = be.zeros_as(n * qd, be.dtype(out))?;
                attend_over(be, x.shape, q, pos, &sources, &mut o, &mut lse)?;
                be.copy_rows(&o, &local, out, &rows, qd)?;
            }
        }
        Ok(())
    }
    fn out_dtype(&self, backend: &B) -> DType {
        backend.act_dtype()
    }
}

/// The batches [`prefill_chunks`] makes of chunks of `lens` tokens (in order): greedy, at least
/// one chunk, then more while the rows stay within `batch_tokens` (a longer chunk runs alone).
/// The planners (work and memory) use the same batches.
pub fn batches(lens: &[usize], batch_tokens: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < lens.len() {
        let mut end = i + 1;
        let mut rows = lens[i];
        while end < lens.len() && rows + lens[end] <= batch_tokens {
            rows += lens[end];
            end += 1;
        }
        out.push(i..end);
        i = end;
    }
    out
}

/// Prefills several chunks, batching them into forwards of at most `batch_tokens` rows (a
/// longer chunk runs alone). Returns one pre-RoPE cache per job, in order. `check` runs
/// before every layer of every forward; its error stops the prefill.
pub fn prefill_chunks<B: Backend>(
    model: &Model<B>,
    jobs: &[ChunkJob<'_, B>],
    batch_tokens: usize,
    check: Check<'_>,
) -> Result<Vec<KvCache<B>>> {
    let be = model.backend();
    let c = model.config();
    let mut out = Vec::with_capacity(jobs.len());
    let lens: Vec<usize> = jobs.iter().map(|j| j.tokens.len()).collect();
    for range in batches(&lens, batch_tokens) {
        let rows: usize = lens[range.clone()].iter().sum();
        let batch = &jobs[range];
        let mut tokens = Vec::with_capacity(rows);
        let mut positions = Vec::with_capacity(rows);
        let mut ranges = Vec::with_capacity(batch.len());
        for job in batch {
            let s = tokens.len();
            tokens.extend_from_slice(job.tokens);
            positions.extend(job.start..job.start + job.tokens.len() as u32);
            ranges.push(s..tokens.len());
        }
        let layers = batch
            .iter()
            .map(|_| {
                let kv = be.kv_dtype();
                (0..c.n_layers)
                    .map(|_| Ok(LayerKv { k: be.zeros_as(0, kv)?, v: be.zeros_as(0, kv)? }))
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        let mut att = Batched { jobs: batch, ranges, layers };
        if !tokens.is_empty() {
            model.forward_checked(&tokens, &positions, &mut att, Logits::None, &mut *check)?;
        }
        for (job, layers) in batch.iter().zip(att.layers) {
            let pos: Vec<u32> = (job.start..job.start + job.tokens.len() as u32).collect();
            out.push(KvCache::from_parts(be, layers, pos, KeyForm::PreRope, c.kv_dim())?);
        }
    }
    if out.len() != jobs.len() {
        return Err(crate::error::internal("chunk prefill lost a job"));
    }
    Ok(out)
}

/// Prefills one chunk `tokens` at positions `start..` behind `head`; returns its pre-RoPE cache.
pub fn prefill_chunk<B: Backend>(
    model: &Model<B>,
    head: &[&KvCache<B>],
    tokens: &[u32],
    start: u32,
) -> Result<KvCache<B>> {
    let job = ChunkJob { head: head.to_vec(), tokens, start };
    let mut v = prefill_chunks(model, std::slice::from_ref(&job), usize::MAX, &mut crate::interrupt::never)?;
    v.pop().ok_or_else(|| crate::error::internal("chunk prefill returned nothing"))
}
