//! Phase 2: the prompt runs over the placed context and itself; at the scoring layers the
//! attention mass each context key receives is accumulated (InfoFlow eq. 7, ProphetKV eq. 7).
//!
//! ```text
//!   sources: [prefix][chunk a][chunk b]...   (each at the positions of the scoring geometry)
//!   queries: prompt tokens at their geometry positions, also attending causally to themselves
//!   score_j += w_layer * sum_{prompt i, head h} softmax_ih(j)    (lse merged over all sources)
//! ```
//! A pre-RoPE source is rotated to the geometry's positions one layer at a time, so scoring
//! under HL-HP / HL-TP / TL-TP needs no second copy of the context.

use super::clone_buf;
use crate::attend::{attend_over, Attend, KvSource, LayerInput};
use crate::error::{Result, WorkerError};
use crate::kv::{KeyForm, KvCache};
use crate::model::Model;
use flowprefill_kernels::Backend;

/// A context source and the positions it is scored at.
pub struct ProbeSource<'a, B: Backend> {
    /// The cache (pre-RoPE: rotated to `positions` per layer; rotated: must sit at `positions`).
    pub cache: &'a KvCache<B>,
    /// Positions under the scoring geometry.
    pub positions: Vec<u32>,
}

struct Probe<'a, B: Backend> {
    sources: Vec<ProbeSource<'a, B>>,
    weights: Vec<f32>,
    scores: Vec<Vec<f32>>,
}

impl<B: Backend> Attend<B> for Probe<'_, B> {
    fn attend(&mut self, x: &LayerInput<'_, B>, out: &mut B::Buf) -> Result<()> {
        let be = x.backend;
        let kvd = x.shape.kv_dim();
        // Rotate pre-RoPE sources to their scoring positions for this layer.
        let mut rotated: Vec<Option<B::Buf>> = Vec::with_capacity(self.sources.len());
        for s in &self.sources {
            rotated.push(match s.cache.form() {
                KeyForm::PreRope if !s.positions.is_empty() => {
                    let mut k = clone_buf(be, &s.cache.layer(x.layer).k, kvd)?;
                    be.rope(&mut k, x.shape.n_kv_heads, &s.positions, x.rope)?;
                    Some(k)
                }
                _ => None,
            });
        }
        let mut list = Vec::with_capacity(self.sources.len() + 1);
        for (s, r) in self.sources.iter().zip(&rotated) {
            let layer = s.cache.layer(x.layer);
            list.push(KvSource { k: r.as_ref().unwrap_or(&layer.k), v: &layer.v, pos: &s.positions });
        }
        list.push(KvSource { k: x.k, v: x.v, pos: x.positions });
        let mut lse = be.zeros(x.positions.len() * x.shape.n_heads)?;
        attend_over(be, x.shape, x.q, x.positions, &list, out, &mut lse)?;
        let w = self.weights.get(x.layer).copied().unwrap_or(0.0);
        if w > 0.0 {
            for (i, src) in list[..self.sources.len()].iter().enumerate() {
                if src.pos.is_empty() {
                    continue;
                }
                let mut s = be.zeros(src.pos.len())?;
                be.attention_scores(x.shape, x.q, x.positions, src.k, src.pos, &lse, &mut s)?;
                for (acc, v) in self.scores[i].iter_mut().zip(be.download(&s)?) {
                    *acc += w * v;
                }
            }
        }
        Ok(())
    }
}

/// Runs `prompt` at `prompt_pos` over `sources` and returns, per source, the weighted attention
/// mass of each row: `sum_l weights[l] * mass_l`. Stops after the last layer with a weight.
pub fn probe<B: Backend>(
    model: &Model<B>,
    sources: Vec<ProbeSource<'_, B>>,
    prompt: &[u32],
    prompt_pos: &[u32],
    weights: &[f32],
) -> Result<Vec<Vec<f32>>> {
    for s in &sources {
        if s.positions.len() != s.cache.len() {
            return Err(WorkerError::Input(format!(
                "{} positions for a source of {} rows",
                s.positions.len(),
                s.cache.len()
            )));
        }
        if s.cache.form() == KeyForm::Rotated && s.positions != s.cache.positions() {
            return Err(WorkerError::Input("a rotated source can only be probed at its own positions".into()));
        }
    }
    let Some(last) = weights.iter().rposition(|&w| w > 0.0) else {
        return Ok(sources.iter().map(|s| vec![0.0; s.cache.len()]).collect());
    };
    let scores = sources.iter().map(|s| vec![0.0; s.cache.len()]).collect();
    let mut p = Probe { sources, weights: weights.to_vec(), scores };
    model.forward_layers(prompt, prompt_pos, &mut p, last + 1)?;
    Ok(p.scores)
}
