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
//! ```
//! Every trainable value is one parameter vector laid out as the adapter file's tensors
//! ([`tensor_specs`]); the frozen model gives gradients to it only.

use super::case_importance;
use crate::tasks::{self, PromptStyle};
use crate::train::adamw::{AdamW, AdamWConfig};
use crate::train::kvpacket::{Checkpoint, Event, History};
use crate::train::model::{Extras, LoraSet, Placed, SegmentKv, TrainModel};
use crate::train::{Result, TrainError};
use candle_core::{Device, Tensor, Var};
use flowprefill_coordinator::layout::Layout;
use flowprefill_worker::generate::{prefill_into, DEFAULT_PREFILL_CHUNK};
use flowprefill_worker::kv::{KeyForm, KvCache};
use flowprefill_worker::lookahead::{tensor_specs, LookaheadAdapter, LookaheadMeta, LORA_ALPHA, LORA_RANK};
use flowprefill_worker::{Backend, Cpu, LoadedModel};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Training seeds of LookaheadKV start here (KV Packet's are 7,000,000 + ...; the held-back
/// seeds of `flowprefill importance` are 7,800,000 + ...; evaluation seeds are below 100).
pub const TRAIN_SEED_BASE: u64 = 7_200_000;
/// Validation seeds.
pub const VAL_SEED: u64 = 7_600_000;

/// What a training run does.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Settings {
    /// Lookahead rows.
    pub rows: usize,
    /// LoRA rank.
    pub rank: usize,
    /// LoRA alpha.
    pub alpha: f32,
    /// Task generators the samples come from (cycled).
    pub tasks: Vec<String>,
    /// Context length of a sample (tokens).
    pub length: usize,
    /// Training samples.
    pub samples: usize,
    /// Held-out samples scored after every epoch.
    pub val_samples: usize,
    /// Passes over the samples (0: the untrained adapter).
    pub epochs: usize,
    /// Samples per optimiser step.
    pub batch: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// AdamW's decoupled weight decay.
    pub weight_decay: f64,
    /// Seed of the order, the initial values and the samples.
    pub seed: u64,
    /// Answer tokens at most (the truth's rows).
    pub max_answer: usize,
    /// Prompt style of the samples.
    pub prompts: PromptStyle,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            rows: flowprefill_worker::lookahead::LOOKAHEAD_ROWS,
            rank: LORA_RANK,
            alpha: LORA_ALPHA,
            tasks: tasks::all_tasks().into_iter().map(String::from).collect(),
            length: 1024,
            samples: 64,
            val_samples: 8,
            epochs: 4,
            batch: 4,
            lr: 1e-3,
            weight_decay: 0.0,
            seed: 0,
            max_answer: 32,
            prompts: PromptStyle::Ruler,
        }
    }
}

impl Settings {
    /// Refuses settings that cannot train, naming the flag.
    pub fn check(&self) -> Result<()> {
        let bad = |m: String| Err(TrainError::Settings(m));
        if self.rows == 0 || self.rank == 0 {
            return bad("--rows and --rank must be at least 1".into());
        }
        if self.tasks.is_empty() {
            return bad("--tasks names no task".into());
        }
        if let Some(t) = self.tasks.iter().find(|t| !tasks::all_tasks().contains(&t.as_str())) {
            return bad(format!("--tasks: unknown task `{t}` (known: {})", tasks::all_tasks().join(", ")));
        }
        if self.batch == 0 || self.samples < self.batch {
            return bad(format!("--batch {} needs at least as many --samples ({})", self.batch, self.samples));
        }
        if self.val_samples == 0 {
            return bad("--val-samples must be at least 1 (the held-out loss is the run's measure)".into());
        }
        if !(self.lr > 0.0 && self.lr.is_finite()) {
            return bad(format!("--lr {} must be a positive number", self.lr));
        }
        if !(self.alpha > 0.0 && self.alpha.is_finite()) {
            return bad(format!("--alpha {} must be a positive number", self.alpha));
        }
        if self.max_answer == 0 {
            return bad("--max-answer must be at least 1".into());
        }
        Ok(())
    }

    /// Optimiser steps per epoch.
    pub fn steps_per_epoch(&self) -> usize {
        self.samples / self.batch
    }

    /// Optimiser steps of the whole run.
    pub fn total_steps(&self) -> usize {
        self.steps_per_epoch() * self.epochs
    }

    /// The learning rate at step `t`: linear warm-up over the first 2% of the steps (at least
    /// one), then cosine decay to 0.
    pub fn lr_at(&self, t: usize) -> f64 {
        let total = self.total_steps().max(1) as f64;
        let warm = (0.02 * total).ceil().max(1.0);
        let t = t as f64;
        if t < warm {
            return self.lr * (t + 1.0) / warm;
        }
        let p = ((t - warm) / (total - warm).max(1.0)).min(1.0);
        self.lr * 0.5 * (1.0 + (std::f64::consts::PI * p).cos())
    }
}

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
    /// KL(truth || SnapKV's pooled scores), mean over (layer, head): the baseline.
    pub snapkv_kl: f64,
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
    prefill_into(model, &mut cache, &tokens, 0, DEFAULT_PREFILL_CHUNK)?;
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
    let (mut ent, mut snap_cross, mut pairs) = (0.0, 0.0, 0usize);
    let mut truth = Vec::with_capacity(c.n_layers);
    for (tl, sl) in ci.truth.values.iter().zip(&ci.snapkv.values) {
        let mut rows = Vec::with_capacity(tl.len() * ci.context_rows);
        for (t, s) in tl.iter().zip(sl) {
            let (t, s) = (normalised(t), normalised(s));
            let (e, x) = kl_parts(&t, &s);
            ent += e;
            snap_cross += x;
            pairs += 1;
            rows.extend_from_slice(&t);
        }
        truth.push(Tensor::from_vec(rows, (tl.len(), ci.context_rows), &Device::Cpu)?);
    }
    Ok(Some(Sample {
        id: case.id.clone(),
        prefix: SegmentKv { layers, rotated: true },
        context: ci.context_rows,
        truth,
        truth_neg_entropy: ent,
        snapkv_kl: (ent - snap_cross) / pairs.max(1) as f64,
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
pub fn params(t: &Tensor, tm: &TrainModel, s: &Settings) -> Result<Params> {
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

/// Builds the samples of `count` seeds from `first_seed` (tasks cycled; a case whose answer is
/// empty is skipped and the next seed taken).
pub fn samples(
    lm: &LoadedModel<Cpu>,
    s: &Settings,
    first_seed: u64,
    count: usize,
    on: &mut dyn FnMut(usize),
) -> Result<Vec<Sample>> {
    let mut out = Vec::with_capacity(count);
    let mut seed = first_seed;
    while out.len() < count {
        if seed >= first_seed + 4 * count as u64 + 16 {
            return Err(TrainError::Settings(format!(
                "the model answered nothing in most cases of {} tokens; try other --tasks or --length",
                s.length
            )));
        }
        let task = &s.tasks[out.len() % s.tasks.len()];
        let c = tasks::generate(task, &lm.tokenizer, seed, s.length, 0, &tasks::DEPTHS)
            .ok_or_else(|| TrainError::Settings(format!("task `{task}` made no case of {} tokens", s.length)))?;
        seed += 1;
        if let Some(x) = sample(lm, &c, s.prompts, s.max_answer)? {
            out.push(x);
            on(out.len());
        }
    }
    Ok(out)
}

/// Mean loss and mean SnapKV KL over `set` (no gradient kept).
fn mean_loss(tm: &TrainModel, p: &Params, set: &[Sample]) -> Result<f64> {
    let mut sum = 0.0;
    for s in set {
        sum += f64::from(loss(tm, p, s)?.detach().to_scalar::<f32>()?);
    }
    Ok(sum / set.len().max(1) as f64)
}

/// The initial values: the rows are the embedding of "The answer is" cycled plus 10% noise (a
/// query that starts like an answer), every `A` uniform with the std of `1/sqrt(in)`, every
/// `B` zero (the LoRA starts as no change).
fn initial(tm: &TrainModel, lm: &LoadedModel<Cpu>, s: &Settings) -> Result<Tensor> {
    let ids = lm.tokenizer.encode_text(" The answer is")?;
    if ids.is_empty() {
        return Err(TrainError::Model("the tokenizer made no tokens of the initial text".into()));
    }
    let cfg = tm.config();
    let d = cfg.d_model;
    let cycled: Vec<u32> = (0..s.rows).map(|i| ids[i % ids.len()]).collect();
    let base = tm.embed_tokens(&cycled)?;
    let std = base.sqr()?.mean_all()?.to_scalar::<f32>()?.sqrt();
    let noise = flowprefill_worker::synthetic::random_values(s.rows * d, s.seed ^ 0x100a, 0.1 * std);
    let rows = (base + Tensor::from_vec(noise, (s.rows, d), &Device::Cpu)?)?.flatten_all()?;
    let mut parts = vec![rows];
    for (i, (name, [r, c])) in tensor_specs(cfg, s.rows, s.rank).iter().enumerate().skip(1) {
        let v = if name.ends_with("lora_a") {
            flowprefill_worker::synthetic::random_values(r * c, s.seed ^ (i as u64 * 0x9e37), 1.0 / (*c as f32).sqrt())
        } else {
            vec![0.0; r * c]
        };
        parts.push(Tensor::from_vec(v, r * c, &Device::Cpu)?);
    }
    Ok(Tensor::cat(&parts, 0)?)
}

/// The mean gradient and loss of `batch`, the gradient's norm clipped to 1.
fn batch_gradient<'a>(
    tm: &TrainModel,
    var: &Var,
    s: &Settings,
    batch: impl Iterator<Item = &'a Sample>,
) -> Result<(Tensor, f64)> {
    let (mut grad, mut loss_sum, mut n): (Option<Tensor>, f64, usize) = (None, 0.0, 0);
    for sample in batch {
        let p = params(var.as_tensor(), tm, s)?;
        let l = loss(tm, &p, sample)?;
        loss_sum += f64::from(l.to_scalar::<f32>()?);
        let g = l
            .backward()?
            .remove(var.as_tensor())
            .ok_or_else(|| TrainError::Model("no gradient reached the lookahead parameters".into()))?;
        grad = Some(match grad {
            None => g,
            Some(acc) => (acc + g)?,
        });
        n += 1;
    }
    let grad = (grad.ok_or_else(|| TrainError::Model("an empty batch".into()))? / n as f64)?;
    let norm = f64::from(grad.sqr()?.sum_all()?.to_scalar::<f32>()?).sqrt();
    let grad = if norm > 1.0 { (grad / norm)? } else { grad };
    Ok((grad, loss_sum / n as f64))
}

/// Where a run writes: checkpoint, `loss.png`, and the adapter.
pub struct Outputs {
    /// The run's folder.
    pub dir: PathBuf,
    /// The adapter file to write at the end.
    pub adapter: PathBuf,
}

/// Trains a LookaheadKV adapter with `settings`, resuming from the checkpoint in `out.dir`
/// made with the same settings; writes the loss curve and the adapter. The history's
/// reference loss (`none_val`) is SnapKV's held-out KL to the truth.
pub fn train(
    lm: &LoadedModel<Cpu>,
    tm: &TrainModel,
    settings: &Settings,
    out: &Outputs,
    on: &mut dyn FnMut(Event),
) -> Result<(LookaheadAdapter, History)> {
    settings.check()?;
    let ckpt_err = |d: String| TrainError::Checkpoint { path: out.dir.clone(), detail: d };
    std::fs::create_dir_all(&out.dir).map_err(|e| ckpt_err(format!("cannot create the folder: {e}")))?;
    // The adapter's folder too, before any work (an adapter path elsewhere fails now, not
    // after the training).
    if let Some(dir) = out.adapter.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| TrainError::Checkpoint {
            path: dir.to_path_buf(),
            detail: format!("cannot create the adapter's folder: {e}"),
        })?;
    }
    let ckpt_path = out.dir.join("checkpoint.safetensors");
    let resumed = Checkpoint::load(&ckpt_path, settings)?;
    let total = settings.samples + settings.val_samples;
    let mut made = |k: usize| on(Event::Teacher { done: k, total });
    let base = TRAIN_SEED_BASE + settings.seed * 100_000;
    let train_set = samples(lm, settings, base, settings.samples, &mut made)?;
    let mut made = |k: usize| on(Event::Teacher { done: settings.samples + k, total });
    let val_set = samples(lm, settings, VAL_SEED + settings.seed * 100_000, settings.val_samples, &mut made)?;

    let start = match &resumed {
        Some(c) => c.rows.clone(),
        None => initial(tm, lm, settings)?,
    };
    let var = Var::from_tensor(&start)?;
    let cfg =
        AdamWConfig { lr: settings.lr, weight_decay: settings.weight_decay, beta2: 0.95, ..AdamWConfig::default() };
    let mut opt = AdamW::new(&var, cfg)?;
    let (mut step, mut history) = match resumed {
        Some(c) => {
            opt.m = c.m;
            opt.v = c.v;
            opt.step = c.step as u64;
            (c.step, c.history)
        }
        None => {
            let snap = val_set.iter().map(|s| s.snapkv_kl).sum::<f64>() / val_set.len() as f64;
            let initial_val = mean_loss(tm, &params(var.as_tensor(), tm, settings)?, &val_set)?;
            (0, History { none_val: snap, initial_val, ..History::default() })
        }
    };
    on(Event::Baseline { reference: history.none_val, initial: history.initial_val });
    let spe = settings.steps_per_epoch();
    while step < settings.total_steps() {
        let (epoch, k) = (step / spe, step % spe);
        let mut order: Vec<usize> = (0..train_set.len()).collect();
        order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(settings.seed ^ (epoch as u64 + 1)));
        let batch = &order[k * settings.batch..((k + 1) * settings.batch).min(order.len())];
        let t0 = Instant::now();
        let (grad, loss) = batch_gradient(tm, &var, settings, batch.iter().map(|&i| &train_set[i]))?;
        let lr = settings.lr_at(step);
        opt.step(&var, &grad, lr)?;
        step += 1;
        let seconds = t0.elapsed().as_secs_f64();
        history.train.push(loss);
        history.seconds += seconds;
        on(Event::Step { step, total: settings.total_steps(), loss, lr, seconds });
        if step % spe == 0 {
            let v = mean_loss(tm, &params(var.as_tensor(), tm, settings)?, &val_set)?;
            history.validation.push((step / spe, v));
            on(Event::Validation { epoch: step / spe, loss: v });
        }
        let ck = Checkpoint { rows: var.as_tensor().clone(), m: opt.m.clone(), v: opt.v.clone(), step, history };
        ck.save(&ckpt_path, settings)?;
        history = ck.history;
        on(Event::Saved { step });
    }
    crate::train::kvpacket::loss_curve(
        &out.dir.join("loss.png"),
        &history,
        spe,
        "LookaheadKV: KL(answer's attention || lookahead rows'), mean over layers and KV heads",
        "SnapKV (validation)",
    )?;
    let adapter = adapter_of(lm, tm, settings, var.as_tensor(), &history)?;
    adapter.save(&out.adapter, tm.config())?;
    Ok((adapter, history))
}

/// The adapter of the parameter vector `t`, its metadata saying how it was trained.
pub fn adapter_of(
    lm: &LoadedModel<Cpu>,
    tm: &TrainModel,
    s: &Settings,
    t: &Tensor,
    h: &History,
) -> Result<LookaheadAdapter> {
    let meta = LookaheadMeta {
        model: lm.fingerprint.clone(),
        model_name: lm.model.config().name.clone(),
        rows: s.rows,
        rank: s.rank,
        alpha: s.alpha,
        training: serde_json::json!({
            "settings": s,
            "train_seeds": format!("{} + {}", TRAIN_SEED_BASE + s.seed * 100_000, s.samples),
            "val_seeds": format!("{} + {}", VAL_SEED + s.seed * 100_000, s.val_samples),
            "steps": h.train.len(),
            "seconds": h.seconds,
            "final_train_loss": h.train.last(),
            "val_loss": h.validation.last().map(|v| v.1),
            "snapkv_val_loss": h.none_val,
            "initial_val_loss": h.initial_val,
        }),
    };
    let flat: Vec<f32> = t.to_vec1()?;
    let mut tensors = Vec::new();
    let mut off = 0;
    for (_, [r, c]) in tensor_specs(tm.config(), s.rows, s.rank) {
        tensors.push(flat[off..off + r * c].to_vec());
        off += r * c;
    }
    Ok(LookaheadAdapter::new(meta, tm.config(), tensors)?)
}

/// Writes nothing; says where a run's adapter goes by default.
pub fn default_adapter(dir: &Path) -> PathBuf {
    dir.join("lookahead.safetensors")
}
