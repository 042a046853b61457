//! LookaheadKV training (paper 004, §3.2): the lookahead rows and their LoRA learn to pay the
//! context the attention the model's own answer pays it.
//!
//! ```text
//!   sample (task generators, training seeds)    context | prompt        (worker: one prefill,
//!                                                                         its K/V kept)
//!   truth: the greedy answer teacher-forced; its attention per (layer, KV head) over the
//!          context rows, normalised to sum 1 ([`super::case_importance`])
//!   lookahead: L1..Lr at the positions after the prompt over that cache, LoRA on every
//!          projection; the rows' mean attention per (layer, KV head), normalised
//!   loss (eq. 5): mean over layers and KV heads of KL(truth || lookahead); AdamW (beta2 0.95),
//!          2% warm-up then cosine decay, gradients clipped to norm 1
//!   reference: the same KL of SnapKV's window scores (unpooled, as the loss takes the rows');
//!          both also pooled over 7 rows as eviction pools them ([`Method::pooled_losses`])
//! ```
//! Every trainable value is one parameter vector laid out as the adapter file's tensors
//! ([`tensor_specs`]); the frozen model gives gradients to it only.

use super::case_importance;
use crate::tasks::{self, PromptStyle};
use crate::train::adamw::AdamWConfig;
use crate::train::model::{Extras, LoraSet, Placed, SegmentKv, TrainModel};
use crate::train::run::{self, Method, Provenance, Recipe, Schedule};
use crate::train::{Result, TrainError};
use candle_core::{Device, Tensor};
use flowprefill_coordinator::layout::Layout;
use flowprefill_coordinator::select::pool_mean;
use flowprefill_worker::evict::SNAPKV_POOL;
use flowprefill_worker::generate::prefill_into;
use flowprefill_worker::kv::{KeyForm, KvCache};
use flowprefill_worker::lookahead::{tensor_specs, LookaheadAdapter, LookaheadMeta, LORA_ALPHA, LORA_RANK};
use flowprefill_worker::{Backend, Cpu, LoadedModel};
use std::path::Path;

/// LookaheadKV's own parameters: the rows, their LoRA, and the answer whose attention is the
/// truth.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LookaheadKv {
    /// Lookahead rows.
    pub rows: usize,
    /// LoRA rank.
    pub rank: usize,
    /// LoRA alpha.
    pub alpha: f32,
    /// Answer tokens at most (the truth's rows).
    pub max_answer: usize,
}

impl Default for LookaheadKv {
    fn default() -> Self {
        Self { rows: flowprefill_worker::lookahead::LOOKAHEAD_ROWS, rank: LORA_RANK, alpha: LORA_ALPHA, max_answer: 32 }
    }
}

/// What a LookaheadKV training run does.
pub type Settings = run::Settings<LookaheadKv>;

/// One case: the cache the lookahead rows read and the truth they learn.
pub struct Sample {
    /// Task and seed.
    pub id: String,
    /// Context and prompt, K (rotated to 0..) and V per layer (from the worker's prefill).
    pub prefix: SegmentKv,
    /// Context rows (the truth's length; the prompt's rows follow them in `prefix`).
    pub context: usize,
    /// The answer's attention per layer, `[kv_heads, context]`, each row summing to 1.
    pub truth: Vec<Tensor>,
    /// `sum t log t` over every (layer, head) (the KL's constant part).
    pub truth_neg_entropy: f64,
    /// KL(truth || SnapKV's window scores), mean over (layer, head): the baseline, on the
    /// transform of the loss (no pooling).
    pub snapkv_kl: f64,
    /// KL(truth || SnapKV's scores pooled as eviction pools them), mean over (layer, head).
    pub snapkv_pooled_kl: f64,
}

/// Normalises `v` to sum 1 (all zeros stay zeros).
fn normalised(v: &[f32]) -> Vec<f32> {
    let s: f64 = v.iter().map(|&x| f64::from(x.max(0.0))).sum();
    v.iter().map(|&x| if s > 0.0 { (f64::from(x.max(0.0)) / s) as f32 } else { 0.0 }).collect()
}

/// `sum t log t` and `sum t log q` of one (layer, head) (`q` floored at 1e-12).
fn kl_parts(t: &[f32], q: &[f32]) -> (f64, f64) {
    let (mut ent, mut cross) = (0.0, 0.0);
    for (&a, &b) in t.iter().zip(q) {
        if a > 0.0 {
            ent += f64::from(a) * f64::from(a).ln();
            cross += f64::from(a) * f64::from(b).max(1e-12).ln();
        }
    }
    (ent, cross)
}

/// Builds the sample of `case`; `None` when the model's answer is empty.
pub fn sample(
    lm: &LoadedModel<Cpu>,
    case: &tasks::QaCase,
    style: PromptStyle,
    max_answer: usize,
) -> Result<Option<Sample>> {
    let req = case.request(style);
    let Some(ci) = case_importance(lm, &req, max_answer)? else {
        return Ok(None);
    };
    let layout = Layout::build(lm, &req)?;
    let order: Vec<usize> = (0..layout.chunks.len()).collect();
    let tokens = layout.full_tokens(&order);
    let model = &lm.model;
    let c = model.config();
    let mut cache = KvCache::new(model.backend(), c.n_layers, c.kv_dim(), KeyForm::Rotated)?;
    prefill_into(model, &mut cache, &tokens, 0, model.backend().prefill_rows())?;
    let n = cache.len();
    let be = model.backend();
    let mut layers = Vec::with_capacity(c.n_layers);
    for l in cache.layers() {
        let k = Tensor::from_vec(
            be.download(&l.k).map_err(flowprefill_worker::WorkerError::from)?,
            (n, c.kv_dim()),
            &Device::Cpu,
        )?;
        let v = Tensor::from_vec(
            be.download(&l.v).map_err(flowprefill_worker::WorkerError::from)?,
            (n, c.kv_dim()),
            &Device::Cpu,
        )?;
        layers.push((k, v));
    }
    let (mut ent, mut snap_cross, mut pooled_cross, mut pairs) = (0.0, 0.0, 0.0, 0usize);
    let mut truth = Vec::with_capacity(c.n_layers);
    let layers_of = ci.truth.values.iter().zip(&ci.snapkv_window.values).zip(&ci.snapkv.values);
    for ((tl, wl), pl) in layers_of {
        let mut rows = Vec::with_capacity(tl.len() * ci.context_rows);
        for ((t, w), p) in tl.iter().zip(wl).zip(pl) {
            let t = normalised(t);
            let (e, x) = kl_parts(&t, &normalised(w));
            ent += e;
            snap_cross += x;
            pooled_cross += kl_parts(&t, &normalised(p)).1;
            pairs += 1;
            rows.extend_from_slice(&t);
        }
        truth.push(Tensor::from_vec(rows, (tl.len(), ci.context_rows), &Device::Cpu)?);
    }
    let pairs = pairs.max(1) as f64;
    Ok(Some(Sample {
        id: case.id.clone(),
        prefix: SegmentKv { layers, rotated: true },
        context: ci.context_rows,
        truth,
        truth_neg_entropy: ent,
        snapkv_kl: (ent - snap_cross) / pairs,
        snapkv_pooled_kl: (ent - pooled_cross) / pairs,
    }))
}

/// The trained values as the model reads them: views of the one parameter vector.
pub struct Params {
    /// `[rows, d_model]`.
    pub rows: Tensor,
    /// The LoRA of every layer.
    pub lora: LoraSet,
}

/// Splits the parameter vector `t` into [`tensor_specs`]'s tensors (views: gradients reach `t`).
pub fn params(t: &Tensor, tm: &TrainModel, s: &LookaheadKv) -> Result<Params> {
    let specs = tensor_specs(tm.config(), s.rows, s.rank);
    let mut views = Vec::with_capacity(specs.len());
    let mut off = 0;
    for (_, [r, c]) in &specs {
        views.push(t.narrow(0, off, r * c)?.reshape((*r, *c))?);
        off += r * c;
    }
    if off != t.dims()[0] {
        return Err(TrainError::Model(format!("{} parameters for an adapter of {off}", t.dims()[0])));
    }
    let mut it = views.into_iter();
    let rows = it.next().ok_or_else(|| TrainError::Model("no lookahead rows".into()))?;
    let rest: Vec<Tensor> = it.collect();
    let per_layer = 2 * flowprefill_worker::lookahead::Proj::ALL.len();
    let layers =
        rest.chunks(per_layer).map(|c| c.chunks(2).map(|ab| (ab[0].clone(), ab[1].clone())).collect()).collect();
    Ok(Params { rows, lora: LoraSet { layers, scale: f64::from(s.alpha) / s.rank as f64 } })
}

/// The lookahead rows' importance per layer (`[kv_heads, context]`, each row summing to 1).
pub fn lookahead_importance(tm: &TrainModel, p: &Params, s: &Sample) -> Result<Vec<Tensor>> {
    let n_prefix = s.prefix.len() as u32;
    let rows = p.rows.dims()[0] as u32;
    let pos: Vec<u32> = (n_prefix..n_prefix + rows).collect();
    let ctx = [Placed { kv: &s.prefix, positions: (0..n_prefix).collect() }];
    let extras = Extras { lora: Some(&p.lora), capture: s.context };
    let (_, _, imps) = tm.forward_ext(&p.rows, &pos, &ctx, extras)?;
    imps.iter().map(|i| Ok(i.broadcast_div(&i.sum_keepdim(1)?)?)).collect()
}

/// Eq. 5: the mean over layers and KV heads of KL(truth || lookahead) (a scalar,
/// differentiable in the parameters).
pub fn loss(tm: &TrainModel, p: &Params, s: &Sample) -> Result<Tensor> {
    let imps = lookahead_importance(tm, p, s)?;
    let mut cross: Option<Tensor> = None;
    for (q, t) in imps.iter().zip(&s.truth) {
        let c = (t * (q + 1e-12)?.log()?)?.sum_all()?;
        cross = Some(match cross {
            None => c,
            Some(a) => (a + c)?,
        });
    }
    let cross = cross.ok_or_else(|| TrainError::Model("a model without layers".into()))?;
    let pairs: usize = s.truth.iter().map(|t| t.dims()[0]).sum();
    Ok(cross.affine(-1.0 / pairs as f64, s.truth_neg_entropy / pairs as f64)?)
}

/// KL(truth || the rows' scores pooled as eviction pools them), mean over (layer, head); no
/// gradient.
pub fn pooled_kl(tm: &TrainModel, p: &Params, s: &Sample) -> Result<f64> {
    let imps = lookahead_importance(tm, p, s)?;
    let (mut ent, mut cross, mut pairs) = (0.0, 0.0, 0usize);
    for (q, t) in imps.iter().zip(&s.truth) {
        for (q, t) in q.detach().to_vec2::<f32>()?.iter().zip(t.to_vec2::<f32>()?) {
            let (e, x) = kl_parts(&t, &normalised(&pool_mean(q, SNAPKV_POOL)));
            ent += e;
            cross += x;
            pairs += 1;
        }
    }
    Ok((ent - cross) / pairs.max(1) as f64)
}

/// The initial values: the rows are the embedding of "The answer is" cycled plus 10% noise (a
/// query that starts like an answer), every `A` uniform with the std of `1/sqrt(in)`, every
/// `B` zero (the LoRA starts as no change).
fn initial(tm: &TrainModel, lm: &LoadedModel<Cpu>, s: &LookaheadKv, seed: u64) -> Result<Tensor> {
    let ids = lm.tokenizer.encode_text(" The answer is")?;
    if ids.is_empty() {
        return Err(TrainError::Model("the tokenizer made no tokens of the initial text".into()));
    }
    let cfg = tm.config();
    let d = cfg.d_model;
    let cycled: Vec<u32> = (0..s.rows).map(|i| ids[i % ids.len()]).collect();
    let base = tm.embed_tokens(&cycled)?;
    let std = base.sqr()?.mean_all()?.to_scalar::<f32>()?.sqrt();
    let noise = flowprefill_worker::synthetic::random_values(s.rows * d, seed ^ 0x100a, 0.1 * std);
    let rows = (base + Tensor::from_vec(noise, (s.rows, d), &Device::Cpu)?)?.flatten_all()?;
    let mut parts = vec![rows];
    for (i, (name, [r, c])) in tensor_specs(cfg, s.rows, s.rank).iter().enumerate().skip(1) {
        let v = if name.ends_with("lora_a") {
            flowprefill_worker::synthetic::random_values(r * c, seed ^ (i as u64 * 0x9e37), 1.0 / (*c as f32).sqrt())
        } else {
            vec![0.0; r * c]
        };
        parts.push(Tensor::from_vec(v, r * c, &Device::Cpu)?);
    }
    Ok(Tensor::cat(&parts, 0)?)
}

impl Method for LookaheadKv {
    type Sample = Sample;
    type Adapter = LookaheadAdapter;
    /// In the layout of [`run::SEED_STRIDE`]: KV Packet's are 7,000,000 + ...; the held-back
    /// seeds of `flowprefill importance` are 7,800,000; evaluation seeds are below 100.
    const TRAIN_SEED_BASE: u64 = 7_200_000;
    const VAL_SEED: u64 = 7_600_000;
    const DEFAULT_SAMPLES: usize = 64;
    const DEFAULT_BATCH: usize = 4;
    const DEFAULT_LR: f64 = 1e-3;
    /// The paper's: AdamW with beta2 0.95, 2% warm-up then cosine decay, gradients clipped to
    /// norm 1; whole batches only.
    const RECIPE: Recipe = Recipe {
        adamw: AdamWConfig { beta2: 0.95, ..AdamWConfig::DEFAULT },
        schedule: Schedule::WarmupCosine(0.02),
        clip_norm: Some(1.0),
        partial_batches: false,
        epoch_adapters: false,
    };
    const REFERENCE: &'static str = "SnapKV";
    const REFERENCE_KEY: &'static str = "snapkv_val_loss";
    const CURVE_TITLE: &'static str =
        "LookaheadKV: KL(answer's attention || lookahead rows'), mean over layers and KV heads";
    const ADAPTER_FILE: &'static str = "lookahead.safetensors";

    fn check(s: &Settings) -> Result<()> {
        let bad = |m: String| Err(TrainError::Settings(m));
        let m = &s.method;
        if m.rows == 0 || m.rank == 0 {
            return bad("--rows and --rank must be at least 1".into());
        }
        if !(m.alpha > 0.0 && m.alpha.is_finite()) {
            return bad(format!("--alpha {} must be a positive number", m.alpha));
        }
        if m.max_answer == 0 {
            return bad("--max-answer must be at least 1".into());
        }
        Ok(())
    }

    fn sample(&self, lm: &LoadedModel<Cpu>, case: &tasks::QaCase, prompts: PromptStyle) -> Result<Option<Sample>> {
        sample(lm, case, prompts, self.max_answer)
    }

    fn initial(&self, tm: &TrainModel, lm: &LoadedModel<Cpu>, seed: u64) -> Result<Tensor> {
        initial(tm, lm, self, seed)
    }

    fn loss(&self, tm: &TrainModel, values: &Tensor, s: &Sample) -> Result<Tensor> {
        loss(tm, &params(values, tm, self)?, s)
    }

    /// SnapKV's KL to the truth, its window scores unpooled as the loss takes the rows' (the
    /// adapters shipped before 2026-11-28 recorded the pooled one here: another transform).
    fn reference_loss(&self, _: &TrainModel, set: &[Sample]) -> Result<f64> {
        run::mean_of(set, |s| Ok(s.snapkv_kl))
    }

    /// SnapKV's and the rows' KL to the truth with both pooled as `--evict` pools them.
    fn pooled_losses(&self, tm: &TrainModel, values: &Tensor, set: &[Sample]) -> Result<Option<(f64, f64)>> {
        let p = params(&values.detach(), tm, self)?;
        let reference = run::mean_of(set, |s| Ok(s.snapkv_pooled_kl))?;
        let rows = run::mean_of(set, |s| pooled_kl(tm, &p, s))?;
        Ok(Some((reference, rows)))
    }

    fn adapter(&self, tm: &TrainModel, values: &Tensor, made: Provenance) -> Result<LookaheadAdapter> {
        let (rows, rank, alpha) = (self.rows, self.rank, self.alpha);
        let meta = LookaheadMeta {
            model: made.model,
            model_name: made.model_name,
            rows,
            rank,
            alpha,
            weights: Some(made.weights),
            training: made.training,
        };
        let flat: Vec<f32> = values.to_vec1()?;
        let mut tensors = Vec::new();
        let mut off = 0;
        for (_, [r, c]) in tensor_specs(tm.config(), self.rows, self.rank) {
            tensors.push(flat[off..off + r * c].to_vec());
            off += r * c;
        }
        Ok(LookaheadAdapter::new(meta, tm.config(), tensors)?)
    }

    fn save(&self, adapter: &LookaheadAdapter, tm: &TrainModel, path: &Path) -> Result<()> {
        Ok(adapter.save(path, tm.config())?)
    }
}
