//! CacheBlend's selection signal: recompute every context token through the first layers at
//! its global position and measure how far its value vector moved from the cached one at the
//! check layer, `||V_new - V_cached||^2` (LMCache blender; ProphetKV Table 3).
//!
//! The recomputed rows go into per-layer copies of the segments, never into the segments
//! themselves: scoring must not change the cache that the recompute phase starts from.

use super::{clone_buf, group_targets, Target};
use crate::attend::{attend_over, Attend, KvSource, LayerInput};
use crate::error::{Result, WorkerError};
use crate::kv::{KeyForm, KvCache};
use crate::model::Model;
use flowprefill_kernels::Backend;

struct Deviation<'a, B: Backend> {
    segments: &'a [KvCache<B>],
    groups: Vec<super::TargetGroup>,
    check_layer: usize,
    dev: Vec<f32>,
}

impl<B: Backend> Attend<B> for Deviation<'_, B> {
    fn attend(&mut self, x: &LayerInput<'_, B>, out: &mut B::Buf) -> Result<()> {
        let be = x.backend;
        let kvd = x.shape.kv_dim();
        let mut copies = Vec::with_capacity(self.segments.len());
        for s in self.segments {
            let l = s.layer(x.layer);
            copies.push((clone_buf(be, &l.k, kvd)?, clone_buf(be, &l.v, kvd)?));
        }
        for (seg, toks, rows) in &self.groups {
            let (k, v) = &mut copies[*seg];
            be.copy_rows(x.k, toks, k, rows, kvd)?;
            be.copy_rows(x.v, toks, v, rows, kvd)?;
        }
        if x.layer == self.check_layer {
            let new_v = be.download(x.v)?;
            for (seg, toks, rows) in &self.groups {
                let old_v = be.download(&self.segments[*seg].layer(x.layer).v)?;
                for (&t, &r) in toks.iter().zip(rows) {
                    let a = &new_v[t * kvd..(t + 1) * kvd];
                    let b = &old_v[r * kvd..(r + 1) * kvd];
                    self.dev[t] = a.iter().zip(b).map(|(p, q)| (p - q) * (p - q)).sum();
                }
            }
        }
        let sources: Vec<KvSource<'_, B>> =
            copies.iter().zip(self.segments).map(|((k, v), s)| KvSource { k, v, pos: s.positions() }).collect();
        let mut lse = be.zeros(x.positions.len() * x.shape.n_heads)?;
        attend_over(be, x.shape, x.q, x.positions, &sources, out, &mut lse)
    }
}

/// `||V_new - V_cached||^2` at `check_layer` for each target (token `tokens[i]` at
/// `targets[i]`), recomputing all targets jointly through layers `0..=check_layer`.
pub fn value_deviation<B: Backend>(
    model: &Model<B>,
    segments: &[KvCache<B>],
    targets: &[Target],
    tokens: &[u32],
    check_layer: usize,
) -> Result<Vec<f32>> {
    if targets.len() != tokens.len() {
        return Err(WorkerError::Input(format!("{} targets but {} tokens", targets.len(), tokens.len())));
    }
    if segments.iter().any(|s| s.form() != KeyForm::Rotated) {
        return Err(WorkerError::Input("deviation scoring needs placed (rotated) segments".into()));
    }
    if targets.is_empty() {
        return Ok(Vec::new());
    }
    let groups = group_targets(targets, segments)?;
    let pos: Vec<u32> = targets.iter().map(|t| segments[t.segment].positions()[t.row]).collect();
    let mut d = Deviation { segments, groups, check_layer, dev: vec![0.0; targets.len()] };
    model.forward_layers(tokens, &pos, &mut d, check_layer + 1)?;
    Ok(d.dev)
}
