//! One training run, whichever method it trains: the settings every method shares, the samples
//! (the task generators cycled over seeds), AdamW steps over shuffled batches with the method's
//! schedule, the held-out loss after every epoch, a checkpoint after every step (a stopped run
//! resumes exactly), the loss curve and the adapter.
//!
//! What differs between KV Packet ([`super::kvpacket::KvPacket`]) and LookaheadKV
//! ([`super::lookahead::fit::LookaheadKv`]) is a [`Method`]: its own parameters (the flattened
//! part of [`Settings`]), how a case becomes a sample, the trained values' initial state, the
//! loss of one sample, the reference loss, the recipe, and the adapter written at the end.
//!
//! ```text
//!   checkpoint (same model, settings and shapes, else refused) -> samples (train + held out)
//!     -> initial values or the checkpoint's -> reference and initial held-out loss
//!   per step:  batch (seeded shuffle per epoch) -> mean loss and gradient -> AdamW at lr_at(step)
//!              epoch end: held-out loss (and the epoch's adapter) -> checkpoint
//!   end:       loss.png, the adapter
//! ```

use super::adamw::{AdamW, AdamWConfig};
use super::checkpoint::{Checkpoint, ModelId};
pub use super::checkpoint::{History, Pooled};
use super::model::TrainModel;
use super::{Result, TrainError};
use crate::tasks::{self, PromptStyle};
use candle_core::{Tensor, Var};
use flowprefill_worker::tokenizer::Tokenizer;
use flowprefill_worker::{Cpu, LoadedModel};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use std::path::Path;
use std::time::Instant;

/// How the learning rate moves from its peak over a run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Schedule {
    /// Linear decay from the peak to 0.
    Linear,
    /// Linear warm-up over this share of the steps (one step at least), then cosine decay to 0.
    WarmupCosine(f64),
}

/// A method's optimisation recipe (its paper's).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Recipe {
    /// AdamW's settings; the run's `lr` and `weight_decay` replace those two.
    pub adamw: AdamWConfig,
    /// The learning rate's schedule.
    pub schedule: Schedule,
    /// A gradient whose norm is above this is scaled down to it.
    pub clip_norm: Option<f64>,
    /// An epoch's last, smaller batch is a step (else it is dropped, and `--samples` must hold
    /// one batch at least).
    pub partial_batches: bool,
    /// Every epoch's adapter is written too (`adapter-epochN.safetensors`, for ablations over
    /// training length).
    pub epoch_adapters: bool,
}

/// What differs between the trained methods; [`train`] does the rest. The implementing type is
/// the method's own parameters, flattened into [`Settings`] (and so into the checkpoint and the
/// adapter's metadata).
pub trait Method: Clone + PartialEq + std::fmt::Debug + serde::Serialize + serde::de::DeserializeOwned {
    /// One training or held-out case with what the method learns from it.
    type Sample;
    /// The trained adapter.
    type Adapter;
    /// The training samples' first seed (plus [`SEED_STRIDE`] × `seed`).
    const TRAIN_SEED_BASE: u64;
    /// The held-out samples' first seed (plus [`SEED_STRIDE`] × `seed`).
    const VAL_SEED: u64;
    /// Default training samples.
    const DEFAULT_SAMPLES: usize;
    /// Default samples per step.
    const DEFAULT_BATCH: usize;
    /// Default peak learning rate.
    const DEFAULT_LR: f64;
    /// The optimisation recipe.
    const RECIPE: Recipe;
    /// What the held-out loss is compared with (KV Packet: `none`; LookaheadKV: SnapKV).
    const REFERENCE: &'static str;
    /// The reference's held-out loss in the adapter's metadata.
    const REFERENCE_KEY: &'static str;
    /// The loss curve's title.
    const CURVE_TITLE: &'static str;
    /// The adapter's file in the run's folder when no other path is given.
    const ADAPTER_FILE: &'static str;

    /// Refuses the method's settings that cannot train, naming the flag to change (the shared
    /// ones are [`Settings::check`]'s).
    fn check(s: &Settings<Self>) -> Result<()>;
    /// The sample of `case`; `None` when the case teaches nothing (the next seed is taken).
    fn sample(&self, lm: &LoadedModel<Cpu>, case: &tasks::QaCase, prompts: PromptStyle)
        -> Result<Option<Self::Sample>>;
    /// The trained values before training (one tensor, the optimiser's variable).
    fn initial(&self, tm: &TrainModel, lm: &LoadedModel<Cpu>, seed: u64) -> Result<Tensor>;
    /// One sample's loss (a scalar, differentiable in `values`).
    fn loss(&self, tm: &TrainModel, values: &Tensor, sample: &Self::Sample) -> Result<Tensor>;
    /// The reference's mean loss over `set`.
    fn reference_loss(&self, tm: &TrainModel, set: &[Self::Sample]) -> Result<f64>;
    /// The reference's and `values`' mean losses over `set` with the scores pooled as the
    /// engine pools them before using them, where it does (LookaheadKV's eviction); `None`
    /// (the default) for a method whose loss is already what the engine uses.
    fn pooled_losses(&self, _: &TrainModel, _: &Tensor, _: &[Self::Sample]) -> Result<Option<(f64, f64)>> {
        Ok(None)
    }
    /// The adapter of `values`, `made` in its metadata.
    fn adapter(&self, tm: &TrainModel, values: &Tensor, made: Provenance) -> Result<Self::Adapter>;
    /// Writes `adapter` to `path`.
    fn save(&self, adapter: &Self::Adapter, tm: &TrainModel, path: &Path) -> Result<()>;
}

/// What an adapter's metadata says of where it comes from.
pub struct Provenance {
    /// The fingerprint of the model it was trained for.
    pub model: String,
    /// That model's name.
    pub model_name: String,
    /// The weights it was trained with (the model's cache identity).
    pub weights: String,
    /// How it was trained: the settings, the samples' seeds, steps, time and losses.
    pub training: serde_json::Value,
}

/// What a training run does: the method's parameters and the run's.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Settings<M> {
    /// The method's own parameters.
    #[serde(flatten)]
    pub method: M,
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
    /// Peak learning rate (the method's [`Schedule`] from it).
    pub lr: f64,
    /// AdamW's decoupled weight decay.
    pub weight_decay: f64,
    /// Seed of the sample order, the initial values and the samples (their seeds start at
    /// [`Method::TRAIN_SEED_BASE`] and [`Method::VAL_SEED`] plus [`SEED_STRIDE`] × this).
    pub seed: u64,
    /// Prompt style of the samples.
    pub prompts: PromptStyle,
}

impl<M: Method + Default> Default for Settings<M> {
    fn default() -> Self {
        Self {
            method: M::default(),
            tasks: tasks::all_tasks().into_iter().map(String::from).collect(),
            length: 1024,
            samples: M::DEFAULT_SAMPLES,
            val_samples: 8,
            epochs: 4,
            batch: M::DEFAULT_BATCH,
            lr: M::DEFAULT_LR,
            weight_decay: 0.0,
            seed: 0,
            prompts: PromptStyle::Ruler,
        }
    }
}

impl<M: Method> Settings<M> {
    /// Refuses settings that cannot train, naming the flag to change: the method's, then the
    /// shared ones.
    pub fn check(&self) -> Result<()> {
        M::check(self)?;
        let bad = |m: String| Err(TrainError::Settings(m));
        let known = tasks::all_tasks();
        if self.tasks.is_empty() {
            return bad("--tasks names no task".into());
        }
        if let Some(t) = self.tasks.iter().find(|t| !known.contains(&t.as_str())) {
            return bad(format!("unknown task `{t}` in --tasks; choose from {}", known.join(", ")));
        }
        // `--epochs 0` writes the untrained adapter (the baseline of a training ablation).
        if self.samples == 0 || self.batch == 0 {
            return bad("--samples and --batch must be at least 1".into());
        }
        if !M::RECIPE.partial_batches && self.samples < self.batch {
            return bad(format!("--batch {} needs at least as many --samples ({})", self.batch, self.samples));
        }
        if !(self.lr > 0.0 && self.lr.is_finite()) {
            return bad(format!("--lr {} must be a positive number", self.lr));
        }
        if !(self.weight_decay >= 0.0 && self.weight_decay.is_finite()) {
            return bad(format!("--weight-decay {} must be a number >= 0", self.weight_decay));
        }
        if self.length == 0 {
            return bad("--length must be at least 1 token".into());
        }
        if self.val_samples == 0 {
            return bad("--val-samples must be at least 1 (the held-out loss is the run's measure)".into());
        }
        for (flag, n) in [("--samples", self.samples), ("--val-samples", self.val_samples)] {
            if seeds_tried(n) > SEED_BLOCK {
                return bad(format!(
                    "{flag} {n} is more than a run's block of {SEED_BLOCK} seeds holds: give {flag} {} at most",
                    MAX_SAMPLES
                ));
            }
        }
        if seed_at(M::TRAIN_SEED_BASE.max(M::VAL_SEED), self.seed).is_none() {
            return bad(format!("--seed {} is too large: give a seed below {}", self.seed, u64::MAX / SEED_STRIDE - 8));
        }
        Ok(())
    }

    /// Optimiser steps per pass over the samples.
    pub fn steps_per_epoch(&self) -> usize {
        if M::RECIPE.partial_batches {
            self.samples.div_ceil(self.batch)
        } else {
            self.samples / self.batch
        }
    }

    /// Optimiser steps in the whole run.
    pub fn total_steps(&self) -> usize {
        self.steps_per_epoch() * self.epochs
    }

    /// Learning rate of step `t` (0-based), by the method's [`Schedule`].
    pub fn lr_at(&self, t: usize) -> f64 {
        match M::RECIPE.schedule {
            Schedule::Linear => self.lr * (1.0 - t as f64 / self.total_steps() as f64),
            Schedule::WarmupCosine(share) => {
                let total = self.total_steps().max(1) as f64;
                let warm = (share * total).ceil().max(1.0);
                let t = t as f64;
                if t < warm {
                    return self.lr * (t + 1.0) / warm;
                }
                let p = ((t - warm) / (total - warm).max(1.0)).min(1.0);
                self.lr * 0.5 * (1.0 + (std::f64::consts::PI * p).cos())
            }
        }
    }

    /// The training samples' first seed (for a seed [`Settings::check`] accepts).
    pub fn train_seed(&self) -> u64 {
        seed_at(M::TRAIN_SEED_BASE, self.seed).unwrap_or(u64::MAX)
    }

    /// The held-out samples' first seed (for a seed [`Settings::check`] accepts).
    pub fn val_seed(&self) -> u64 {
        seed_at(M::VAL_SEED, self.seed).unwrap_or(u64::MAX)
    }
}

/// How far apart the seeds of two `--seed` values start. Each `--seed` owns the seeds
/// `7,000,000 + SEED_STRIDE × seed + [0, 1,000,000)`, split into blocks of [`SEED_BLOCK`]:
///
/// ```text
///   +0        KV Packet training         +500,000  KV Packet held out
///   +200,000  LookaheadKV training       +600,000  LookaheadKV held out
///                                        +800,000  `importance`'s held-back cases (--seed 0 only)
/// ```
/// so that no `--seed` trains on any `--seed`'s held-out or held-back cases (with a stride of
/// 100,000, `train kvpacket --seed 5` trained on `--seed 0`'s held-out seeds and `train
/// lookahead --seed 6` on `importance`'s).
pub const SEED_STRIDE: u64 = 1_000_000;

/// The seeds one run's training or held-out samples may use: [`MAX_SAMPLES`] samples at most.
pub const SEED_BLOCK: u64 = 100_000;

/// The most samples of one kind ([`Settings::samples`], [`Settings::val_samples`]) whose seeds
/// stay in their block.
pub const MAX_SAMPLES: usize = ((SEED_BLOCK - 16) / 4) as usize;

/// Seeds [`samples`] may try for `count` samples (a case that makes no sample takes the next).
fn seeds_tried(count: usize) -> u64 {
    4 * count as u64 + 16
}

/// The first seed of block `base` for `--seed seed`; `None` when it does not fit in a `u64`.
fn seed_at(base: u64, seed: u64) -> Option<u64> {
    seed.checked_mul(SEED_STRIDE).and_then(|o| o.checked_add(base)).filter(|s| s.checked_add(SEED_BLOCK).is_some())
}

/// What a run reports as it goes.
#[derive(Clone, Debug)]
pub enum Event {
    /// Samples made so far (KV Packet: teacher continuations; LookaheadKV: answers and their
    /// attention).
    Teacher { done: usize, total: usize },
    /// The held-out losses before training: the reference's ([`Method::REFERENCE`]) and the
    /// untrained adapter's; the same with pooled scores where the method pools
    /// ([`Method::pooled_losses`]: `(reference, initial)`).
    Baseline { reference: f64, initial: f64, pooled: Option<(f64, f64)> },
    /// One optimiser step.
    Step { step: usize, total: usize, loss: f64, lr: f64, seconds: f64 },
    /// Validation loss after an epoch (and with pooled scores, where the method pools).
    Validation { epoch: usize, loss: f64, pooled: Option<f64> },
    /// A checkpoint was written.
    Saved { step: usize },
}

pub use super::outputs::Outputs;

/// Builds the samples of `count` cases from `first_seed` (tasks cycled; a case that makes no
/// sample is skipped and the next seed taken; the cases: [`case`]).
pub fn samples<M: Method>(
    lm: &LoadedModel<Cpu>,
    s: &Settings<M>,
    first_seed: u64,
    count: usize,
    on: &mut dyn FnMut(usize),
) -> Result<Vec<M::Sample>> {
    let mut out = Vec::with_capacity(count);
    let mut seed = first_seed;
    while out.len() < count {
        if seed >= first_seed + seeds_tried(count) {
            return Err(TrainError::Settings(format!(
                "the model answered nothing in most cases of {} tokens; try other --tasks or --length",
                s.length
            )));
        }
        let c = case(s, &lm.tokenizer, seed, out.len())?;
        seed += 1;
        if let Some(x) = s.method.sample(lm, &c, s.prompts)? {
            out.push(x);
            on(out.len());
        }
    }
    Ok(out)
}

/// The case from `seed` for the sample that follows `made` samples: the task `made` cycles to,
/// as that task's sample `made / tasks` (as in `eval`, a task's `k`-th case is its sample `k`:
/// needle depths cycle through [`tasks::DEPTHS`], niah_single's needles through number, word
/// and UUID; until 2026-11-28 every case was sample 0, every needle at depth 0.1 and every
/// niah_single needle a number).
pub fn case<M: Method>(s: &Settings<M>, tok: &Tokenizer, seed: u64, made: usize) -> Result<tasks::QaCase> {
    let task = &s.tasks[made % s.tasks.len()];
    let sample = made / s.tasks.len();
    tasks::generate(task, tok, seed, s.length, sample, &tasks::DEPTHS)
        .ok_or_else(|| TrainError::Settings(format!("task `{task}` made no case of {} tokens", s.length)))
}

/// The mean of `f` over `set` (0 for an empty set).
pub(crate) fn mean_of<S>(set: &[S], mut f: impl FnMut(&S) -> Result<f64>) -> Result<f64> {
    let mut sum = 0.0;
    for s in set {
        sum += f(s)?;
    }
    Ok(sum / set.len().max(1) as f64)
}

/// The method's mean loss over `set` at `values` (no gradient kept).
fn mean_loss<M: Method>(m: &M, tm: &TrainModel, values: &Tensor, set: &[M::Sample]) -> Result<f64> {
    mean_of(set, |s| Ok(f64::from(m.loss(tm, values, s)?.detach().to_scalar::<f32>()?)))
}

/// Trains the adapter of `settings`' method, resuming from the checkpoint in `out.dir` when
/// there is one made with the same model and settings; writes the loss curve and the adapter.
pub fn train<M: Method>(
    lm: &LoadedModel<Cpu>,
    tm: &TrainModel,
    settings: &Settings<M>,
    out: &Outputs,
    on: &mut dyn FnMut(Event),
) -> Result<(M::Adapter, History)> {
    let run = run_until(lm, tm, settings, out, settings.total_steps(), on)?;
    loss_curve(
        &out.dir.join("loss.png"),
        &run.history,
        settings.steps_per_epoch(),
        M::CURVE_TITLE,
        &format!("{} (validation)", M::REFERENCE),
    )?;
    let adapter = run.adapter()?;
    settings.method.save(&adapter, tm, &out.adapter)?;
    Ok((adapter, run.history))
}

/// Trains as [`train`] does but stops after optimiser step `until` (the run's total at most),
/// its checkpoint written and no adapter: what a run killed after that step leaves, for a later
/// [`train`] to resume (the tests stop runs mid-way with it). Returns the history so far.
pub fn train_until<M: Method>(
    lm: &LoadedModel<Cpu>,
    tm: &TrainModel,
    settings: &Settings<M>,
    out: &Outputs,
    until: usize,
    on: &mut dyn FnMut(Event),
) -> Result<History> {
    Ok(run_until(lm, tm, settings, out, until.min(settings.total_steps()), on)?.history)
}

/// Starts or resumes the run, then steps it to step `until`.
fn run_until<'a, M: Method>(
    lm: &'a LoadedModel<Cpu>,
    tm: &'a TrainModel,
    settings: &'a Settings<M>,
    out: &'a Outputs,
    until: usize,
    on: &mut dyn FnMut(Event),
) -> Result<Run<'a, M>> {
    settings.check()?;
    let lock = out.create()?;
    let mut run = Run::start(lm, tm, settings, out, on)?;
    run._lock = lock;
    let h = &run.history;
    on(Event::Baseline {
        reference: h.none_val,
        initial: h.initial_val,
        pooled: h.pooled.as_ref().map(|p| (p.reference, p.initial)),
    });
    while run.step < until {
        run.step(on)?;
    }
    // A run of no step (--epochs 0: the untrained baseline) leaves its settings too, so that a
    // later run of other settings in this folder is refused, not written over its adapter.
    if run.step == 0 && settings.total_steps() == 0 && !out.checkpoint().exists() {
        run.save(on)?;
    }
    Ok(run)
}

/// A run under way: its samples, the trained values and their optimiser, the step reached, the
/// history.
struct Run<'a, M: Method> {
    lm: &'a LoadedModel<Cpu>,
    tm: &'a TrainModel,
    settings: &'a Settings<M>,
    out: &'a Outputs,
    train_set: Vec<M::Sample>,
    val_set: Vec<M::Sample>,
    model: ModelId,
    var: Var,
    opt: AdamW,
    step: usize,
    history: History,
    /// The run's folder's lock ([`Outputs::create`]).
    _lock: Option<std::fs::File>,
}

impl<'a, M: Method> Run<'a, M> {
    /// The checkpoint, refused when it is not this run's (another model, other settings, other
    /// shapes) before any sample is made; the samples; then the values and their optimiser
    /// from the checkpoint, or fresh (the held-out losses of the reference and of the initial
    /// values measured first).
    fn start(
        lm: &'a LoadedModel<Cpu>,
        tm: &'a TrainModel,
        settings: &'a Settings<M>,
        out: &'a Outputs,
        on: &mut dyn FnMut(Event),
    ) -> Result<Self> {
        let model = ModelId::of(lm);
        let m = &settings.method;
        let resumed = Checkpoint::load(&out.checkpoint(), &model, settings)?;
        let initial = m.initial(tm, lm, settings.seed)?;
        if let Some(c) = &resumed {
            c.check_shapes(&out.checkpoint(), &initial)?;
        }
        let total = settings.samples + settings.val_samples;
        let mut made = |k: usize| on(Event::Teacher { done: k, total });
        let train_set = samples(lm, settings, settings.train_seed(), settings.samples, &mut made)?;
        let mut made = |k: usize| on(Event::Teacher { done: settings.samples + k, total });
        let val_set = samples(lm, settings, settings.val_seed(), settings.val_samples, &mut made)?;
        let values = match &resumed {
            Some(c) => c.rows.clone(),
            None => initial,
        };
        let var = Var::from_tensor(&values)?;
        let cfg = AdamWConfig { lr: settings.lr, weight_decay: settings.weight_decay, ..M::RECIPE.adamw };
        let mut opt = AdamW::new(&var, cfg)?;
        let (step, history) = match resumed {
            Some(c) => {
                opt.m = c.m;
                opt.v = c.v;
                opt.step = c.step as u64;
                (c.step, c.history)
            }
            None => {
                let none_val = m.reference_loss(tm, &val_set)?;
                let initial_val = mean_loss(m, tm, var.as_tensor(), &val_set)?;
                let pooled = m.pooled_losses(tm, var.as_tensor(), &val_set)?.map(|(reference, initial)| Pooled {
                    reference,
                    initial,
                    validation: Vec::new(),
                });
                (0, History { none_val, initial_val, pooled, ..History::default() })
            }
        };
        Ok(Self { lm, tm, settings, out, train_set, val_set, model, var, opt, step, history, _lock: None })
    }

    /// One optimiser step; the held-out loss at an epoch's end; the checkpoint.
    fn step(&mut self, on: &mut dyn FnMut(Event)) -> Result<()> {
        let s = self.settings;
        let spe = s.steps_per_epoch();
        let (epoch, k) = (self.step / spe, self.step % spe);
        let mut order: Vec<usize> = (0..self.train_set.len()).collect();
        order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(s.seed ^ (epoch as u64 + 1)));
        let batch = &order[k * s.batch..((k + 1) * s.batch).min(order.len())];
        let t0 = Instant::now();
        let (grad, loss) = self.batch_gradient(batch)?;
        let lr = s.lr_at(self.step);
        self.opt.step(&self.var, &grad, lr)?;
        self.step += 1;
        let seconds = t0.elapsed().as_secs_f64();
        self.history.train.push(loss);
        self.history.seconds += seconds;
        on(Event::Step { step: self.step, total: s.total_steps(), loss, lr, seconds });
        if self.step.is_multiple_of(spe) {
            let epoch = self.step / spe;
            let v = mean_loss(&s.method, self.tm, self.var.as_tensor(), &self.val_set)?;
            self.history.validation.push((epoch, v));
            let pooled = match s.method.pooled_losses(self.tm, self.var.as_tensor(), &self.val_set)? {
                Some((_, p)) => {
                    let h = self.history.pooled.get_or_insert_with(Pooled::default);
                    h.validation.push((epoch, p));
                    Some(p)
                }
                None => None,
            };
            on(Event::Validation { epoch, loss: v, pooled });
            if M::RECIPE.epoch_adapters {
                let adapter = self.adapter()?;
                s.method.save(&adapter, self.tm, &self.out.dir.join(format!("adapter-epoch{epoch}.safetensors")))?;
            }
        }
        self.save(on)
    }

    /// The checkpoint of the run as it is.
    fn save(&self, on: &mut dyn FnMut(Event)) -> Result<()> {
        let ck = Checkpoint {
            rows: self.var.as_tensor().clone(),
            m: self.opt.m.clone(),
            v: self.opt.v.clone(),
            step: self.step,
            history: self.history.clone(),
        };
        ck.save(&self.out.checkpoint(), &self.model, self.settings)?;
        on(Event::Saved { step: self.step });
        Ok(())
    }

    /// The mean loss of the samples `batch` (indices of the training set) and the mean of
    /// their gradients, clipped by the recipe (one backward pass per sample: one sample's graph
    /// in memory at a time).
    fn batch_gradient(&self, batch: &[usize]) -> Result<(Tensor, f64)> {
        let values = self.var.as_tensor();
        let (mut grad, mut loss_sum, mut n): (Option<Tensor>, f64, usize) = (None, 0.0, 0);
        for &i in batch {
            let loss = self.settings.method.loss(self.tm, values, &self.train_set[i])?;
            loss_sum += f64::from(loss.to_scalar::<f32>()?);
            let g = loss.backward()?.remove(values).ok_or_else(|| {
                TrainError::Model(format!(
                    "training sample {i} (of those from seed {}) gives the trained values no gradient: its loss \
                     does not read them (a KV Packet sample without chunks to wrap, a LookaheadKV sample without \
                     context rows); give a longer --length or other --tasks, and if the sample has chunks or \
                     context, the method's loss detaches the values (a bug in flowprefill)",
                    self.settings.train_seed()
                ))
            })?;
            grad = Some(match grad {
                None => g,
                Some(acc) => (acc + g)?,
            });
            n += 1;
        }
        let grad = (grad.ok_or_else(|| TrainError::Model("an empty batch".into()))? / n as f64)?;
        let grad = match M::RECIPE.clip_norm {
            Some(max) => {
                let norm = f64::from(grad.sqr()?.sum_all()?.to_scalar::<f32>()?).sqrt();
                if norm > max {
                    (grad / (norm / max))?
                } else {
                    grad
                }
            }
            None => grad,
        };
        Ok((grad, loss_sum / n as f64))
    }

    /// The adapter of the current values, its metadata saying how it was trained.
    fn adapter(&self) -> Result<M::Adapter> {
        let (s, h) = (self.settings, &self.history);
        let mut training = serde_json::json!({
            "settings": s,
            "train_seeds": format!("{} + {}", s.train_seed(), s.samples),
            "val_seeds": format!("{} + {}", s.val_seed(), s.val_samples),
            "steps": h.train.len(),
            "seconds": h.seconds,
            "final_train_loss": h.train.last(),
            "val_loss": h.validation.last().map(|v| v.1),
            "initial_val_loss": h.initial_val,
            // Adapters made before this key cycled no depths or needle kinds (every case sample 0).
            "case_samples": "per task: depths and needle kinds cycle",
        });
        training[M::REFERENCE_KEY] = h.none_val.into();
        if let Some(p) = &h.pooled {
            let mut pooled = serde_json::json!({
                "initial_val_loss": p.initial,
                "val_loss": p.validation.last().map(|v| v.1),
            });
            pooled[M::REFERENCE_KEY] = p.reference.into();
            training["pooled"] = pooled;
        }
        let made = Provenance {
            model: self.lm.fingerprint.clone(),
            model_name: self.lm.model.config().name.clone(),
            weights: self.lm.cache_identity.clone(),
            training,
        };
        s.method.adapter(self.tm, self.var.as_tensor(), made)
    }
}

/// The loss curve: training loss per step, validation per epoch, the reference's held-out loss
/// (`reference`: its name) as a line.
fn loss_curve(path: &Path, h: &History, spe: usize, title: &str, reference: &str) -> Result<()> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::kvpacket::KvPacket;
    use crate::train::lookahead::fit::LookaheadKv;

    /// The method's parameters sit beside the run's in one flat object, as the checkpoints and
    /// adapters written before the run type was shared have them, and read back the same.
    #[test]
    fn settings_are_one_flat_object_and_read_back() {
        let kv = Settings::<KvPacket>::default();
        let json = serde_json::to_value(&kv).expect("serialises");
        let keys: Vec<&str> = json.as_object().expect("an object").keys().map(String::as_str).collect();
        let shared = ["batch", "epochs", "length", "lr", "prompts", "samples", "seed", "tasks", "val_samples"];
        for k in shared.iter().chain(&["continuation", "header", "trailer"]) {
            assert!(keys.contains(k), "{k} in {keys:?}");
        }
        assert_eq!(keys.len(), 13, "{keys:?}");
        assert_eq!(serde_json::from_value::<Settings<KvPacket>>(json).expect("parses"), kv);
        let la = Settings::<LookaheadKv> {
            method: LookaheadKv { alpha: 12.5, ..LookaheadKv::default() },
            ..Default::default()
        };
        let back: Settings<LookaheadKv> = serde_json::from_value(serde_json::to_value(&la).unwrap()).expect("parses");
        assert_eq!(back, la);
    }

    /// KV Packet: a last smaller batch is a step, linear decay; LookaheadKV: whole batches only,
    /// warm-up then cosine decay.
    #[test]
    fn each_method_keeps_its_batches_and_schedule() {
        let kv = Settings::<KvPacket> { samples: 5, batch: 2, epochs: 2, lr: 1.0, ..Default::default() };
        assert_eq!((kv.steps_per_epoch(), kv.total_steps()), (3, 6));
        assert_eq!((kv.lr_at(0), kv.lr_at(3)), (1.0, 0.5));
        let la = Settings::<LookaheadKv> { samples: 5, batch: 2, epochs: 50, lr: 1.0, ..Default::default() };
        assert_eq!((la.steps_per_epoch(), la.total_steps()), (2, 100));
        assert_eq!((la.lr_at(0), la.lr_at(1), la.lr_at(2)), (0.5, 1.0, 1.0));
        assert!(la.lr_at(99) < 1e-3 && (la.lr_at(51) - 0.5).abs() < 1e-9);
        assert!(la.check().is_ok() && kv.check().is_ok());
        let e = Settings::<LookaheadKv> { samples: 1, ..la.clone() }.check().unwrap_err().to_string();
        assert!(e.contains("--batch 2 needs at least as many --samples (1)"), "{e}");
        assert!(Settings::<KvPacket> { samples: 1, ..kv.clone() }.check().is_ok(), "one smaller batch a step");
        let e = Settings::<LookaheadKv> { val_samples: 0, ..la }.check().unwrap_err().to_string();
        assert!(e.contains("--val-samples"), "{e}");
        // Shared by both methods: no held-out samples (KV Packet printed a KL of 0 for all), a
        // weight decay that is not a number, an empty context.
        let e = Settings::<KvPacket> { val_samples: 0, ..kv.clone() }.check().unwrap_err().to_string();
        assert!(e.contains("--val-samples"), "{e}");
        for wd in [f64::NAN, f64::INFINITY, -0.1] {
            let e = Settings::<KvPacket> { weight_decay: wd, ..kv.clone() }.check().unwrap_err().to_string();
            assert!(e.contains("--weight-decay"), "{wd}: {e}");
        }
        let e = Settings::<KvPacket> { length: 0, ..kv }.check().unwrap_err().to_string();
        assert!(e.contains("--length"), "{e}");
    }

    /// No `--seed` of either method trains on a seed held out by any `--seed`, held back by
    /// `importance` or used by evaluation (with the earlier stride of 100,000, `train kvpacket
    /// --seed 5` trained on `--seed 0`'s held-out seeds and `train lookahead --seed 6` on
    /// `importance`'s); seeds and sample counts that leave their block are refused.
    #[test]
    fn no_seed_trains_on_held_out_or_held_back_seeds() {
        use std::ops::Range;
        fn ranges<M: Method + Default>(seed: u64) -> (Range<u64>, Range<u64>) {
            let s = Settings::<M> { seed, samples: MAX_SAMPLES, val_samples: MAX_SAMPLES, ..Default::default() };
            s.check().expect("the largest sample counts are accepted");
            let t = s.train_seed()..s.train_seed() + seeds_tried(s.samples);
            (t, s.val_seed()..s.val_seed() + seeds_tried(s.val_samples))
        }
        let back = crate::importance::HELD_BACK_SEED;
        let (mut train, mut held) = (Vec::new(), vec![0..100, back..back + SEED_BLOCK]);
        for seed in 0..64 {
            for (t, v) in [ranges::<KvPacket>(seed), ranges::<LookaheadKv>(seed)] {
                train.push((seed, t));
                held.push(v);
            }
        }
        for (seed, t) in &train {
            for h in &held {
                assert!(t.end <= h.start || h.end <= t.start, "--seed {seed} trains on {t:?}, which meets {h:?}");
            }
        }
        let e = Settings::<KvPacket> { samples: MAX_SAMPLES + 1, ..Default::default() }.check().unwrap_err();
        assert!(e.to_string().contains(&format!("--samples {MAX_SAMPLES} at most")), "{e}");
        let e = Settings::<LookaheadKv> { val_samples: MAX_SAMPLES + 1, ..Default::default() }.check().unwrap_err();
        assert!(e.to_string().contains("--val-samples"), "{e}");
        let e = Settings::<LookaheadKv> { seed: u64::MAX / 1000, ..Default::default() }.check().unwrap_err();
        assert!(e.to_string().contains("--seed"), "{e}");
    }

    /// KV Packet's default batch is the one both shipped adapters were trained with (their
    /// metadata), which docs/kvpacket.md lists among the chosen settings (the default was 8).
    #[test]
    fn kvpacket_default_batch_is_the_shipped_adapters() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../adapters");
        for f in ["smollm2-135m-instruct.kvpacket.safetensors", "qwen2.5-coder-0.5b-instruct.kvpacket.safetensors"] {
            let a = flowprefill_worker::adapter::Adapter::load(&dir.join(f)).expect("a shipped adapter");
            assert_eq!(a.meta.training["settings"]["batch"], Settings::<KvPacket>::default().batch, "{f}");
        }
    }
}
