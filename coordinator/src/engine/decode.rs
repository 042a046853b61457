//! The prompt over sharded segments and the decoding loop (rank 0 samples and broadcasts
//! each token; every rank attends its own segments).

use super::{Engine, Role, Turn};
use crate::error::Result;
use crate::request::EvictPolicy;
use crate::timings::phase;
use flowprefill_comm::{broadcast_value, Communicator};
use flowprefill_kernels::Backend;
use flowprefill_worker::generate::{decode_with, StopReason};
use flowprefill_worker::kv::{KeyForm, KvCache};
use flowprefill_worker::model::Logits;
use flowprefill_worker::steps::{DecodeSteps, HeadScores, LocalSegment, Replicated};
use flowprefill_worker::store::ChunkKey;

impl<B: Backend> Engine<B> {
    /// Runs the prompt over this rank's `segments` (global id, placed cache), evicts them to
    /// the job's KV budget if it has one (the segments are dropped, the packed cache kept;
    /// with `store_as`, the first segment goes to the chunk store under that key instead: the
    /// prompt and the scoring read it, never write it, so the store gets the cache without a
    /// copy), then decodes (see [`Engine::decode_with_tail`]).
    pub(super) fn prompt_and_decode(
        &self,
        comm: &mut dyn Communicator,
        segments: Vec<(usize, KvCache<B>)>,
        prompt: &[u32],
        prompt_pos: &[u32],
        store_as: Option<ChunkKey>,
        turn: &mut Turn<'_>,
    ) -> Result<Option<(Vec<u32>, StopReason)>> {
        let model = &self.lm.model;
        let be = model.backend();
        let mut tail = self.empty_tail()?;
        let evict = turn.opts.evict;
        self.fault_point(comm.rank(), phase::FINAL_PROMPT)?;
        let watch = &turn.watch;
        let (logits, heads) = turn.phases.time(phase::FINAL_PROMPT, || -> Result<_> {
            let local = segments.iter().map(|(id, c)| LocalSegment::placed(*id, c)).collect();
            let mut rep = Replicated::new(be, comm, "final", local, &mut tail, prompt_pos, vec![])?;
            if let Some(ev) = evict.filter(|e| e.policy == EvictPolicy::Snapkv) {
                rep = rep.with_head_scores(super::evict::window(ev.policy, 0));
            }
            let mut check = || watch.check(phase::FINAL_PROMPT);
            let out = model.forward_checked(prompt, prompt_pos, &mut rep, Logits::Last, &mut check)?;
            let (_, heads) = rep.commit_with_heads()?;
            Ok((out.last().to_vec(), heads))
        })?;
        let segments = match evict {
            None => segments,
            Some(ev) => {
                self.fault_point(comm.rank(), phase::EVICT)?;
                let out = &mut turn.out;
                let next_pos = prompt_pos.last().map_or(0, |p| p + 1);
                let kept = turn.phases.time(phase::EVICT, || -> Result<_> {
                    let heads = match ev.policy {
                        EvictPolicy::Snapkv => heads,
                        EvictPolicy::Lookahead => self.lookahead_scores(comm, &segments, &mut tail, next_pos, watch)?,
                    };
                    self.evict(comm, &segments, &heads, ev, out)
                })?;
                // The full segments go here (or to the store); decoding holds only what was
                // kept.
                if let (Some(key), Some((_, full))) = (store_as, segments.into_iter().next()) {
                    self.store.insert(key, full);
                }
                kept.into_iter().collect()
            }
        };
        let segs = segments.iter().map(|(id, c)| LocalSegment::placed(*id, c)).collect();
        let next_pos = prompt_pos.last().map_or(0, |p| p + 1);
        self.decode_with_tail(comm, segs, tail, logits, next_pos, turn)
    }

    /// LookaheadKV's scores of this rank's `segments`: its rows run after the prompt (at
    /// `next_pos..`) over the segments and the prompt's rows in `tail`, their LoRA active; their
    /// own K/V are dropped again (decoding starts at `next_pos` as without them).
    fn lookahead_scores(
        &self,
        comm: &mut dyn Communicator,
        segments: &[(usize, KvCache<B>)],
        tail: &mut KvCache<B>,
        next_pos: u32,
        watch: &flowprefill_worker::interrupt::Watch,
    ) -> Result<HeadScores> {
        let model = &self.lm.model;
        let n = model.lookahead_rows() as u32;
        let positions: Vec<u32> = (next_pos..next_pos + n).collect();
        let local = segments.iter().map(|(id, c)| LocalSegment::placed(*id, c)).collect();
        let mut rep = Replicated::new(model.backend(), comm, "lookahead", local, tail, &positions, vec![])?
            .with_head_scores(n as usize);
        let mut check = || watch.check(phase::EVICT);
        model.forward_lookahead(&positions, &mut rep, model.config().n_layers, &mut check)?;
        Ok(rep.discard_with_heads()?)
    }

    /// An empty replicated tail (the prompt's and the answer's K/V go there).
    pub(super) fn empty_tail(&self) -> Result<KvCache<B>> {
        let cfg = self.lm.model.config();
        Ok(KvCache::new(self.lm.model.backend(), cfg.n_layers, cfg.kv_dim(), KeyForm::Rotated)?)
    }

    /// Rank 0 picks each token and broadcasts it; every rank runs it over its segments and the
    /// replicated tail (flash-decoding across ranks); `None` ends the loop.
    pub(super) fn decode_with_tail(
        &self,
        comm: &mut dyn Communicator,
        segs: Vec<LocalSegment<'_, B>>,
        mut tail: KvCache<B>,
        logits: Vec<f32>,
        next_pos: u32,
        turn: &mut Turn<'_>,
    ) -> Result<Option<(Vec<u32>, StopReason)>> {
        let model = &self.lm.model;
        let window = model.config().context_length;
        let watch = turn.watch.clone();
        let max = turn.opts.max_new_tokens;
        let mut steps = DecodeSteps::new(model, segs, &mut tail, max, self.decode_graphs)?;
        let mut step = |comm: &mut dyn Communicator, tok: u32, pos: u32| -> flowprefill_worker::Result<Vec<f32>> {
            steps.run(comm, tok, pos, &mut || watch.check(phase::DECODE))
        };
        match &mut turn.role {
            Role::Lead { sampler, on_text } => {
                let first = turn.phases.time(phase::FIRST_TOKEN, || sampler.sample(&logits));
                turn.out.ttft = turn.t0.elapsed();
                turn.out.first_logits = logits;
                self.fault_point(0, phase::DECODE)?;
                let out = turn.phases.time(phase::DECODE, || -> Result<_> {
                    let mut lead_step = |tok: u32, pos: u32| -> flowprefill_worker::Result<Vec<f32>> {
                        broadcast_value(comm, "decode.token", 0, Some(&Some((tok, pos))))?;
                        step(comm, tok, pos)
                    };
                    let out = decode_with(
                        &self.lm.tokenizer,
                        first,
                        sampler,
                        max,
                        window,
                        next_pos,
                        &mut lead_step,
                        *on_text,
                    )?;
                    broadcast_value::<Option<(u32, u32)>>(comm, "decode.token", 0, Some(&None))?;
                    Ok(out)
                })?;
                turn.out.decode_replayed = steps.replayed();
                Ok(Some(out))
            }
            Role::Follow => {
                self.fault_point(comm.rank(), phase::DECODE)?;
                turn.phases.time(phase::DECODE, || -> Result<()> {
                    while let Some((tok, pos)) = broadcast_value::<Option<(u32, u32)>>(comm, "decode.token", 0, None)? {
                        step(comm, tok, pos)?;
                    }
                    Ok(())
                })?;
                Ok(None)
            }
        }
    }
}
