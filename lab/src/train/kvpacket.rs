//! KV Packet's self-distillation (paper 001, §3.2): the model with full attention is the
//! teacher, the model reading independently made packet caches is the student, and only the
//! header and trailer rows learn.
//!
//! ```text
//!   sample (task generators, training seeds)   head | c1 | c2 | ... | ck | prompt
//!   teacher: full prefill + greedy decoding y1..yn (the worker's inference forward), the
//!            decoding steps' p_t(y_i | ...) kept for the whole run
//!   student: head at 0..P; [H c1 T] behind the head at P..; [H cj T] alone at 0.. (as `none`
//!            prefills chunks); placed at their global offsets by one rotation; prompt and
//!            y1..y(n-1) read the placed caches: q_s(y_i | ...)
//!   loss:    mean_i KL(p_t || q_s), gradients only for H and T; AdamW, linear decay
//! ```

use super::adamw::{AdamW, AdamWConfig};
use super::model::{Placed, SegmentKv, TrainModel};
use super::{Result, TrainError};
use crate::tasks::{self, PromptStyle};
use candle_core::{Device, Tensor, Var, D};
use flowprefill_coordinator::layout::Layout;
use flowprefill_worker::adapter::{Adapter, AdapterMeta};
use flowprefill_worker::attend::AppendAttend;
use flowprefill_worker::generate::{prefill_into, DEFAULT_PREFILL_CHUNK};
use flowprefill_worker::kv::{KeyForm, KvCache};
use flowprefill_worker::model::Logits;
use flowprefill_worker::sampling::{Sampler, SamplingConfig};
use flowprefill_worker::{Cpu, LoadedModel};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Training seeds start here: far from every evaluation seed (`eval --seed` is 1 in every
/// report of docs/eval; `check` and the tests use seeds below 100).
pub const TRAIN_SEED_BASE: u64 = 7_000_000;
/// Validation cases use this seed (never trained on, never evaluated).
pub const VAL_SEED: u64 = 7_500_000;

/// What a training run does.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Settings {
    /// Header rows.
    pub header: usize,
    /// Trailer rows.
    pub trailer: usize,
    /// Task generators the samples come from (cycled).
    pub tasks: Vec<String>,
    /// Context length of a sample (tokens, as `eval --lengths`).
    pub length: usize,
    /// Training samples.
    pub samples: usize,
    /// Held-out samples scored after every epoch.
    pub val_samples: usize,
    /// Passes over the samples (0: the untrained adapter).
    pub epochs: usize,
    /// Samples per optimiser step (gradients averaged).
    pub batch: usize,
    /// Peak learning rate (linear decay to 0 over the run).
    pub lr: f64,
    /// AdamW's decoupled weight decay.
    pub weight_decay: f64,
    /// Seed of the sample order and the adapters' initial noise; the samples' own seeds are
    /// [`TRAIN_SEED_BASE`] + this.
    pub seed: u64,
    /// Teacher continuation length at most (tokens).
    pub continuation: usize,
    /// Prompt style of the samples.
    pub prompts: PromptStyle,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            header: 8,
            trailer: 8,
            tasks: tasks::all_tasks().into_iter().map(String::from).collect(),
            length: 1024,
            samples: 128,
            val_samples: 8,
            epochs: 4,
            batch: 8,
            lr: 2e-3,
            weight_decay: 0.0,
            seed: 0,
            continuation: 16,
            prompts: PromptStyle::Ruler,
        }
    }
}

impl Settings {
    /// Refuses settings that cannot train, naming the flag to change.
    pub fn check(&self) -> Result<()> {
        let bad = |m: String| Err(TrainError::Settings(m));
        if self.header + self.trailer == 0 {
            return bad("--header and --trailer are both 0: give the packet at least one soft row".into());
        }
        // `--epochs 0` writes the untrained adapter (the baseline of a training ablation).
        if self.samples == 0 || self.batch == 0 {
            return bad("--samples and --batch must be at least 1".into());
        }
        if !(self.lr > 0.0 && self.lr.is_finite()) {
            return bad(format!("--lr {} must be a positive number", self.lr));
        }
        if self.continuation == 0 {
            return bad("--continuation must be at least 1 token".into());
        }
        let known = tasks::all_tasks();
        if let Some(t) = self.tasks.iter().find(|t| !known.contains(&t.as_str())) {
            return bad(format!("unknown task `{t}` in --tasks; choose from {}", known.join(", ")));
        }
        if self.tasks.is_empty() {
            return bad("--tasks is empty".into());
        }
        Ok(())
    }

    /// Optimiser steps in the whole run.
    pub fn total_steps(&self) -> usize {
        self.steps_per_epoch() * self.epochs
    }

    /// Optimiser steps per pass over the samples.
    pub fn steps_per_epoch(&self) -> usize {
        self.samples.div_ceil(self.batch)
    }

    /// Learning rate of step `t` (0-based): linear decay from `lr` to 0.
    pub fn lr_at(&self, t: usize) -> f64 {
        self.lr * (1.0 - t as f64 / self.total_steps() as f64)
    }
}

/// One training or validation case, with its teacher.
pub struct Sample {
    /// Its id (task and seed).
    pub id: String,
    /// Head, chunks, prompt.
    pub layout: Layout,
    /// The teacher's continuation (its end token included when it stopped there).
    pub continuation: Vec<u32>,
    /// The teacher's next-token distribution for each continuation token, `[n, vocab]`.
    pub teacher: Tensor,
    /// `sum p log p` of the teacher rows (the KL's constant part), per row `[n]`.
    pub teacher_neg_entropy: Tensor,
}

/// The case of `task` made from `seed` (one sample per seed).
fn case(task: &str, lm: &LoadedModel<Cpu>, seed: u64, length: usize) -> Result<tasks::QaCase> {
    tasks::generate(task, &lm.tokenizer, seed, length, 0, &tasks::DEPTHS)
        .ok_or_else(|| TrainError::Settings(format!("task `{task}` made no case of {length} tokens")))
}

/// Builds the sample of `case`: its layout, the teacher's greedy continuation and distributions.
pub fn sample(lm: &LoadedModel<Cpu>, case: &tasks::QaCase, style: PromptStyle, continuation: usize) -> Result<Sample> {
    let layout = Layout::build(lm, &case.request(style))?;
    let order: Vec<usize> = (0..layout.chunks.len()).collect();
    let full = layout.full_tokens(&order);
    // One prefill and greedy decoding; the logits of every step are the teacher's
    // distributions (no second pass over the context).
    let model = &lm.model;
    let c = model.config();
    let mut cache = KvCache::new(model.backend(), c.n_layers, c.kv_dim(), KeyForm::Rotated)?;
    let mut logits = prefill_into(model, &mut cache, &full, 0, DEFAULT_PREFILL_CHUNK)?;
    let mut sampler = Sampler::new(SamplingConfig::default())?;
    let (mut cont, mut rows) = (Vec::new(), Vec::new());
    loop {
        let next = sampler.sample(&logits);
        cont.push(next);
        rows.extend_from_slice(&logits);
        if lm.tokenizer.is_end(next) || cont.len() >= continuation {
            break;
        }
        let pos = (full.len() + cont.len() - 1) as u32;
        let mut attend = AppendAttend::new(model.backend(), &mut cache, &[pos])?;
        logits = model.forward(&[next], &[pos], &mut attend, Logits::Last)?.last().to_vec();
        attend.commit()?;
    }
    let n = cont.len();
    let logits = Tensor::from_vec(rows, (n, c.vocab_size), &Device::Cpu)?;
    let logp = log_softmax(&logits)?;
    let p = logp.exp()?;
    let neg_entropy = (&p * &logp)?.sum(D::Minus1)?;
    Ok(Sample { id: case.id.clone(), layout, continuation: cont, teacher: p, teacher_neg_entropy: neg_entropy })
}

fn log_softmax(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let shifted = x.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    Ok(shifted.broadcast_sub(&lse)?)
}

/// The adapter's rows as the student reads them: header then trailer, `[p + q, d]`.
pub struct Packets<'a> {
    /// The rows.
    pub rows: &'a Tensor,
    /// Header rows (the rest are the trailer's).
    pub header: usize,
}

/// The student's logits for the continuation (`[n, vocab]`: the prompt's last row, then each
/// continuation token but the last), the chunk caches made as the engine makes them for
/// `kvpacket` (`packets`) or `none` (`packets: None`).
pub fn student_logits(
    tm: &TrainModel,
    packets: Option<&Packets<'_>>,
    l: &Layout,
    continuation: &[u32],
) -> Result<Tensor> {
    let n = continuation.len();
    if n == 0 || l.prompt.is_empty() {
        return Err(TrainError::Model("a student pass needs a prompt and at least one continuation token".into()));
    }
    let p_len = l.head.len() as u32;
    let head_kv = if l.head.is_empty() {
        None
    } else {
        let pos: Vec<u32> = (0..p_len).collect();
        Some((tm.forward(&tm.embed_tokens(&l.head)?, &pos, &[])?.1, pos))
    };
    let mut placed: Vec<(SegmentKv, u32)> = Vec::with_capacity(l.chunks.len());
    let mut at = p_len;
    for (c, chunk) in l.chunks.iter().enumerate() {
        let x = match packets {
            None => tm.embed_tokens(chunk)?,
            Some(pk) => {
                let rows = pk.rows.dims()[0];
                let h = pk.rows.narrow(0, 0, pk.header)?;
                let t = pk.rows.narrow(0, pk.header, rows - pk.header)?;
                Tensor::cat(&[&h, &tm.embed_tokens(chunk)?, &t], 0)?
            }
        };
        let len = x.dims()[0] as u32;
        // As `none` prefills: the first chunk behind the head, the others alone from 0.
        let (start, ctx): (u32, Vec<Placed<'_>>) = match (&head_kv, c) {
            (Some((kv, pos)), 0) => (p_len, vec![Placed { kv, positions: pos.clone() }]),
            _ => (0, Vec::new()),
        };
        let pos: Vec<u32> = (start..start + len).collect();
        let (_, kv) = tm.forward(&x, &pos, &ctx)?;
        placed.push((kv, at));
        at += len;
    }
    let mut tokens = l.prompt.clone();
    tokens.extend_from_slice(&continuation[..n - 1]);
    let pos: Vec<u32> = (at..at + tokens.len() as u32).collect();
    let mut ctx = Vec::with_capacity(placed.len() + 1);
    if let Some((kv, p)) = &head_kv {
        ctx.push(Placed { kv, positions: p.clone() });
    }
    for (kv, off) in &placed {
        ctx.push(Placed { kv, positions: (*off..*off + kv.len() as u32).collect() });
    }
    let (hidden, _) = tm.forward(&tm.embed_tokens(&tokens)?, &pos, &ctx)?;
    let rows: Vec<usize> = (l.prompt.len() - 1..l.prompt.len() - 1 + n).collect();
    tm.logits(&hidden, &rows)
}

/// The student's mean KL to the teacher over the continuation (a scalar; differentiable in
/// `packets`). `packets: None` reads plain chunk caches: the loss of method `none`.
pub fn student_loss(tm: &TrainModel, packets: Option<&Packets<'_>>, s: &Sample) -> Result<Tensor> {
    let logq = log_softmax(&student_logits(tm, packets, &s.layout, &s.continuation)?)?;
    // KL(p || q) = sum p log p - sum p log q, averaged over the rows.
    let cross = (&s.teacher * &logq)?.sum(D::Minus1)?;
    Ok((&s.teacher_neg_entropy - cross)?.mean_all()?)
}

/// What a run reports as it goes.
#[derive(Clone, Debug)]
pub enum Event {
    /// Teacher continuations made so far.
    Teacher { done: usize, total: usize },
    /// The held-out losses before training: the reference's (KV Packet: `none`; LookaheadKV:
    /// SnapKV) and the untrained adapter's.
    Baseline { reference: f64, initial: f64 },
    /// One optimiser step.
    Step { step: usize, total: usize, loss: f64, lr: f64, seconds: f64 },
    /// Validation loss after an epoch.
    Validation { epoch: usize, loss: f64 },
    /// A checkpoint was written.
    Saved { step: usize },
}

/// A run's history, kept in the checkpoint and the adapter's metadata.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct History {
    /// Mean training loss of each step.
    pub train: Vec<f64>,
    /// Validation loss after each epoch `(epoch, loss)`.
    pub validation: Vec<(usize, f64)>,
    /// Validation loss of the reference: KV Packet's `none` (no packets), LookaheadKV's SnapKV.
    pub none_val: f64,
    /// Validation loss of the adapter before training.
    pub initial_val: f64,
    /// Training seconds so far (all sessions of a resumed run).
    pub seconds: f64,
}

/// The checkpoint: the trained values (KV Packet's rows, LookaheadKV's parameter vector),
/// AdamW's moments, the step reached, the history.
pub(crate) struct Checkpoint {
    pub(crate) rows: Tensor,
    pub(crate) m: Tensor,
    pub(crate) v: Tensor,
    pub(crate) step: usize,
    pub(crate) history: History,
}

fn ckpt_err(path: &Path, detail: impl Into<String>) -> TrainError {
    TrainError::Checkpoint { path: path.to_path_buf(), detail: detail.into() }
}

impl Checkpoint {
    pub(crate) fn save<S: serde::Serialize>(&self, path: &Path, settings: &S) -> Result<()> {
        let meta = serde_json::json!({ "settings": settings, "step": self.step, "history": self.history });
        let tensors: HashMap<String, Tensor> = [("rows", &self.rows), ("m", &self.m), ("v", &self.v)]
            .into_iter()
            .map(|(k, t)| (k.to_string(), t.clone()))
            .collect();
        let tmp = path.with_extension("partial");
        candle_core::safetensors::save(&tensors, &tmp)?;
        // candle writes no metadata: the step and the history go in a JSON file beside it.
        let json = path.with_extension("json");
        let text = serde_json::to_string_pretty(&meta).map_err(|e| ckpt_err(path, e.to_string()))?;
        std::fs::write(json.with_extension("json.partial"), text).map_err(|e| ckpt_err(path, e.to_string()))?;
        std::fs::rename(&tmp, path).map_err(|e| ckpt_err(path, e.to_string()))?;
        std::fs::rename(json.with_extension("json.partial"), &json).map_err(|e| ckpt_err(path, e.to_string()))?;
        Ok(())
    }

    pub(crate) fn load<S>(path: &Path, settings: &S) -> Result<Option<Self>>
    where
        S: serde::Serialize + serde::de::DeserializeOwned + PartialEq,
    {
        if !path.exists() {
            return Ok(None);
        }
        let json = path.with_extension("json");
        let text = std::fs::read_to_string(&json).map_err(|e| {
            ckpt_err(path, format!("{} cannot be read ({e}); delete the checkpoint to start over", json.display()))
        })?;
        let meta: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
            ckpt_err(path, format!("{} does not parse ({e}); delete the checkpoint to start over", json.display()))
        })?;
        let saved: S = serde_json::from_value(meta["settings"].clone())
            .map_err(|e| ckpt_err(path, format!("its settings do not parse ({e})")))?;
        if &saved != settings {
            return Err(ckpt_err(
                path,
                format!(
                    "it was made with other settings ({}); train with those, or give another --out to start over",
                    serde_json::to_string(&saved).unwrap_or_default()
                ),
            ));
        }
        let mut t = candle_core::safetensors::load(path, &Device::Cpu)
            .map_err(|e| ckpt_err(path, format!("unreadable ({e}); delete it to start over")))?;
        let mut take =
            |k: &str| t.remove(k).ok_or_else(|| ckpt_err(path, format!("no `{k}` tensor; delete it to start over")));
        let (rows, m, v) = (take("rows")?, take("m")?, take("v")?);
        let step = meta["step"].as_u64().ok_or_else(|| ckpt_err(path, "no step"))? as usize;
        let history: History = serde_json::from_value(meta["history"].clone())
            .map_err(|e| ckpt_err(path, format!("its history does not parse ({e})")))?;
        Ok(Some(Self { rows, m, v, step, history }))
    }
}

/// Where a run writes: `checkpoint.safetensors` (+ `.json`), `loss.png`, and the adapter.
pub struct Outputs {
    /// The run's folder.
    pub dir: PathBuf,
    /// The adapter file to write at the end.
    pub adapter: PathBuf,
}

/// The initial adapter rows: the embedding of the document separator's first token (what a
/// chunk already ends with) plus small seeded noise, so that the untrained packet is close to a
/// plain chunk and the rows differ.
fn initial_rows(tm: &TrainModel, lm: &LoadedModel<Cpu>, s: &Settings) -> Result<Tensor> {
    let sep = lm.tokenizer.encode_text(flowprefill_coordinator::layout::DOC_SEPARATOR)?;
    let id = *sep.first().ok_or_else(|| TrainError::Model("the separator has no tokens".into()))?;
    let n = s.header + s.trailer;
    let base = tm.embed_tokens(&vec![id; n])?;
    let std = base.sqr()?.mean_all()?.to_scalar::<f32>()?.sqrt() as f64;
    let noise = flowprefill_worker::synthetic::random_values(n * tm.config().d_model, s.seed ^ 0xada, 0.1 * std as f32);
    Ok((base + Tensor::from_vec(noise, (n, tm.config().d_model), &Device::Cpu)?)?)
}

/// Mean loss over `samples` (no gradient kept).
fn mean_loss(tm: &TrainModel, packets: Option<&Packets<'_>>, samples: &[Sample]) -> Result<f64> {
    let mut sum = 0.0;
    for s in samples {
        sum += student_loss(tm, packets, s)?.detach().to_scalar::<f32>()? as f64;
    }
    Ok(sum / samples.len().max(1) as f64)
}

/// Builds the samples of `count` seeds from `first_seed`, tasks cycled.
pub fn samples(
    lm: &LoadedModel<Cpu>,
    s: &Settings,
    first_seed: u64,
    count: usize,
    on: &mut dyn FnMut(usize),
) -> Result<Vec<Sample>> {
    let mut out = Vec::with_capacity(count);
    for i in 0..count {
        let task = &s.tasks[i % s.tasks.len()];
        let c = case(task, lm, first_seed + i as u64, s.length)?;
        out.push(sample(lm, &c, s.prompts, s.continuation)?);
        on(i + 1);
    }
    Ok(out)
}

/// The adapter rows, their optimiser, the step reached and the history: from the checkpoint, or
/// fresh (the held-out losses of `none` and of the initial rows measured first).
fn start(
    tm: &TrainModel,
    lm: &LoadedModel<Cpu>,
    settings: &Settings,
    resumed: Option<Checkpoint>,
    val_set: &[Sample],
) -> Result<(Var, AdamW, usize, History)> {
    let rows = match &resumed {
        Some(c) => c.rows.clone(),
        None => initial_rows(tm, lm, settings)?,
    };
    let var = Var::from_tensor(&rows)?;
    let cfg = AdamWConfig { lr: settings.lr, weight_decay: settings.weight_decay, ..AdamWConfig::default() };
    let mut opt = AdamW::new(&var, cfg)?;
    Ok(match resumed {
        Some(c) => {
            opt.m = c.m;
            opt.v = c.v;
            opt.step = c.step as u64;
            (var, opt, c.step, c.history)
        }
        None => {
            let pk = Packets { rows: var.as_tensor(), header: settings.header };
            let none_val = mean_loss(tm, None, val_set)?;
            let initial_val = mean_loss(tm, Some(&pk), val_set)?;
            (var, opt, 0, History { none_val, initial_val, ..History::default() })
        }
    })
}

/// The mean loss of `batch` and the mean of its gradients with respect to the adapter rows
/// (one backward pass per sample: one sample's graph in memory at a time).
fn batch_gradient<'a>(
    tm: &TrainModel,
    var: &Var,
    header: usize,
    batch: impl Iterator<Item = &'a Sample>,
) -> Result<(Tensor, f64)> {
    let (mut grad, mut loss_sum, mut n): (Option<Tensor>, f64, usize) = (None, 0.0, 0);
    for s in batch {
        let pk = Packets { rows: var.as_tensor(), header };
        let loss = student_loss(tm, Some(&pk), s)?;
        loss_sum += loss.to_scalar::<f32>()? as f64;
        let g = loss
            .backward()?
            .remove(var.as_tensor())
            .ok_or_else(|| TrainError::Model("no gradient reached the adapter".into()))?;
        grad = Some(match grad {
            None => g,
            Some(acc) => (acc + g)?,
        });
        n += 1;
    }
    let grad = grad.ok_or_else(|| TrainError::Model("an empty batch".into()))?;
    Ok(((grad / n as f64)?, loss_sum / n as f64))
}

/// Trains an adapter with `settings`, resuming from the checkpoint in `out.dir` when there is
/// one made with the same settings; writes the loss curve and the adapter.
pub fn train(
    lm: &LoadedModel<Cpu>,
    tm: &TrainModel,
    settings: &Settings,
    out: &Outputs,
    on: &mut dyn FnMut(Event),
) -> Result<(Adapter, History)> {
    settings.check()?;
    std::fs::create_dir_all(&out.dir).map_err(|e| ckpt_err(&out.dir, format!("cannot create the folder: {e}")))?;
    // The adapter's folder too, before any work (an adapter path elsewhere fails now, not
    // after the training).
    if let Some(dir) = out.adapter.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| ckpt_err(dir, format!("cannot create the adapter's folder: {e}")))?;
    }
    let ckpt_path = out.dir.join("checkpoint.safetensors");
    let resumed = Checkpoint::load(&ckpt_path, settings)?;
    let total = settings.samples + settings.val_samples;
    let mut made = |k: usize| on(Event::Teacher { done: k, total });
    let train_set = samples(lm, settings, TRAIN_SEED_BASE + settings.seed * 100_000, settings.samples, &mut made)?;
    let mut made = |k: usize| on(Event::Teacher { done: settings.samples + k, total });
    let val_set = samples(lm, settings, VAL_SEED + settings.seed * 100_000, settings.val_samples, &mut made)?;

    let (var, mut opt, mut step, mut history) = start(tm, lm, settings, resumed, &val_set)?;
    on(Event::Baseline { reference: history.none_val, initial: history.initial_val });
    let spe = settings.steps_per_epoch();
    while step < settings.total_steps() {
        let (epoch, k) = (step / spe, step % spe);
        let mut order: Vec<usize> = (0..train_set.len()).collect();
        order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(settings.seed ^ (epoch as u64 + 1)));
        let batch = &order[k * settings.batch..((k + 1) * settings.batch).min(order.len())];
        let t0 = Instant::now();
        let (grad, loss) = batch_gradient(tm, &var, settings.header, batch.iter().map(|&i| &train_set[i]))?;
        let lr = settings.lr_at(step);
        opt.step(&var, &grad, lr)?;
        step += 1;
        let seconds = t0.elapsed().as_secs_f64();
        history.train.push(loss);
        history.seconds += seconds;
        on(Event::Step { step, total: settings.total_steps(), loss, lr, seconds });
        if step % spe == 0 {
            let pk = Packets { rows: var.as_tensor(), header: settings.header };
            let v = mean_loss(tm, Some(&pk), &val_set)?;
            history.validation.push((step / spe, v));
            on(Event::Validation { epoch: step / spe, loss: v });
            // Every epoch's adapter, for ablations over training length.
            adapter_of(lm, tm, settings, &var, &history)?
                .save(&out.dir.join(format!("adapter-epoch{}.safetensors", step / spe)))?;
        }
        let ck = Checkpoint {
            rows: var.as_tensor().clone(),
            m: opt.m.clone(),
            v: opt.v.clone(),
            step,
            history: history.clone(),
        };
        ck.save(&ckpt_path, settings)?;
        on(Event::Saved { step });
    }
    loss_curve(
        &out.dir.join("loss.png"),
        &history,
        settings.steps_per_epoch(),
        "KV Packet self-distillation: KL(teacher || student)",
        "none (validation)",
    )?;
    let adapter = adapter_of(lm, tm, settings, &var, &history)?;
    adapter.save(&out.adapter)?;
    Ok((adapter, history))
}

/// The adapter of the rows in `var`, its metadata saying how it was trained.
fn adapter_of(lm: &LoadedModel<Cpu>, tm: &TrainModel, settings: &Settings, var: &Var, h: &History) -> Result<Adapter> {
    let meta = AdapterMeta {
        model: lm.fingerprint.clone(),
        model_name: lm.model.config().name.clone(),
        header: settings.header,
        trailer: settings.trailer,
        training: serde_json::json!({
            "settings": settings,
            "train_seeds": format!("{} + {}", TRAIN_SEED_BASE + settings.seed * 100_000, settings.samples),
            "val_seeds": format!("{} + {}", VAL_SEED + settings.seed * 100_000, settings.val_samples),
            "steps": h.train.len(),
            "seconds": h.seconds,
            "final_train_loss": h.train.last(),
            "val_loss": h.validation.last().map(|v| v.1),
            "none_val_loss": h.none_val,
            "initial_val_loss": h.initial_val,
        }),
    };
    let rows: Vec<f32> = var.as_tensor().flatten_all()?.to_vec1()?;
    Ok(Adapter::new(meta, tm.config().d_model, rows)?)
}

/// The loss curve: training loss per step, validation per epoch, the reference's held-out loss
/// (`reference`: its name) as a line.
pub(crate) fn loss_curve(path: &Path, h: &History, spe: usize, title: &str, reference: &str) -> Result<()> {
    use crate::plot::{line_chart, Series};
    let spe = spe as f64;
    let last = h.train.len() as f64;
    let series = vec![
        Series {
            name: "train (per step)".into(),
            points: h.train.iter().enumerate().map(|(i, &l)| (i as f64 + 1.0, l)).collect(),
        },
        Series {
            name: "validation".into(),
            points: std::iter::once((0.0, h.initial_val))
                .chain(h.validation.iter().map(|&(e, l)| (e as f64 * spe, l)))
                .collect(),
        },
        Series { name: reference.into(), points: vec![(0.0, h.none_val), (last, h.none_val)] },
    ];
    line_chart(path, title, "optimiser step", "KL (nats)", &series)?;
    Ok(())
}
