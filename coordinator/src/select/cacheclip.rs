//! CacheClip (paper 002, section 3.3): an auxiliary model (by default the same GGUF) scores each
//! chunk against the query on its own: the chunk is prefilled behind the shared prefix, the
//! prompt is placed right after it, and the auxiliary model's last-layer attention from the
//! prompt tokens to the chunk tokens, averaged over prompt tokens and heads, is the score.
//!
//! Grouping (8/5 windows): after the global top-k, each chunk is cut into windows of 8 tokens
//! from its start; a window keeps its selected tokens only if at least 5 of its 8 are selected,
//! otherwise they are dropped. The paper leaves two points open; the choices here: (1) the
//! threshold of a shorter tail window of w tokens is ceil(5w/8), so that ratio 1.0 still
//! selects everything; (2) dropped tokens are not replaced, so CacheClip recomputes at most
//! the budget (the run reports how many tokens were actually selected).

use super::probe_local;
use super::{ScoreCtx, Selector};
use crate::error::{internal, Result};
use crate::timings::phase;
use flowprefill_comm::local::LocalComm;
use flowprefill_kernels::Backend;
use flowprefill_worker::steps::LocalSegment;
use flowprefill_worker::WorkerError;

/// The CacheClip policy.
pub struct CacheClip {
    /// Window size.
    pub window: usize,
    /// Selected tokens a full window needs to be kept.
    pub threshold: usize,
}

impl Default for CacheClip {
    fn default() -> Self {
        Self { window: 8, threshold: 5 }
    }
}

impl<B: Backend> Selector<B> for CacheClip {
    fn score(&self, ctx: &mut ScoreCtx<'_, '_, B>) -> Result<Vec<Vec<f32>>> {
        let aux = ctx.aux.aux_model();
        // The auxiliary caches are prefilled without communicating: look for aborts too.
        let (watch, comm) = (ctx.watch, &mut *ctx.comm);
        let mut check = || {
            watch.check(phase::PROBE)?;
            comm.poll_abort(phase::PROBE).map_err(WorkerError::Comm)
        };
        let (head, chunks) = ctx.aux.aux_caches(ctx.layout, ctx.local, &mut check)?;
        let be = aux.model.backend();
        let cfg = aux.model.config();
        let head_placed = head.placed(be, aux.model.rope(), head.positions(), cfg.n_kv_heads)?;
        let mut weights = vec![0.0f32; cfg.n_layers];
        *weights.last_mut().ok_or_else(|| internal("the auxiliary model has no layers"))? = 1.0;
        let m = ctx.layout.prompt.len();
        let norm = 1.0 / (m * cfg.n_heads).max(1) as f32;
        // Each chunk is scored on its own (no communication): a world of one.
        let mut solo = LocalComm::group(1).pop().ok_or_else(|| internal("no local communicator"))?;
        let mut out = Vec::with_capacity(ctx.local.len());
        for chunk in &chunks {
            let end = chunk.positions().last().map_or(head.len() as u32, |p| p + 1);
            let prompt_pos: Vec<u32> = (end..end + m as u32).collect();
            let segs = vec![
                LocalSegment::placed(0, &head_placed),
                LocalSegment { id: 1, cache: chunk, positions: chunk.positions().to_vec() },
            ];
            let mut check = || ctx.watch.check(phase::PROBE);
            let prompt = &ctx.layout.prompt;
            let scores =
                probe_local(&aux.model, &mut solo, "cacheclip.probe", segs, prompt, &prompt_pos, &weights, &mut check)?;
            out.push(scores[1].iter().map(|s| s * norm).collect());
        }
        Ok(out)
    }

    fn refine(&self, _scores: &[Vec<f32>], mut selected: Vec<Vec<bool>>) -> Vec<Vec<bool>> {
        for flags in &mut selected {
            for w in flags.chunks_mut(self.window) {
                let need = (self.threshold * w.len()).div_ceil(self.window);
                if w.iter().filter(|&&s| s).count() < need {
                    w.fill(false);
                }
            }
        }
        selected
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flowprefill_kernels::Cpu;

    #[test]
    fn windows_keep_only_dense_selections() {
        let cc = CacheClip::default();
        let row = |s: &str| s.chars().map(|c| c == '1').collect::<Vec<bool>>();
        let sel = vec![row("11111000" /* 5 of 8: kept */), row("1111000011")];
        let out = <CacheClip as Selector<Cpu>>::refine(&cc, &[], sel);
        assert_eq!(out[0], row("11111000"));
        // 4 of 8 dropped; tail window of 2 needs ceil(10/8) = 2: kept.
        assert_eq!(out[1], row("0000000011"));
        let all = vec![vec![true; 13]];
        assert_eq!(<CacheClip as Selector<Cpu>>::refine(&cc, &[], all.clone()), all);
    }
}
