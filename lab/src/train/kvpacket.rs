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

use super::model::{Placed, SegmentKv, TrainModel};
use super::run::{self, Method, Provenance, Recipe, Schedule};
use super::{Result, TrainError};
use crate::tasks::{self, PromptStyle};
use candle_core::{Device, Tensor, D};
use flowprefill_coordinator::layout::Layout;
use flowprefill_kernels::Backend as _;
use flowprefill_worker::adapter::{Adapter, AdapterMeta};
use flowprefill_worker::attend::AppendAttend;
use flowprefill_worker::generate::prefill_into;
use flowprefill_worker::kv::{KeyForm, KvCache};
use flowprefill_worker::model::Logits;
use flowprefill_worker::sampling::{Sampler, SamplingConfig};
use flowprefill_worker::{Cpu, LoadedModel};
use std::path::Path;

/// KV Packet's own parameters: the packet's shape and the teacher's continuation.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct KvPacket {
    /// Header rows.
    pub header: usize,
    /// Trailer rows.
    pub trailer: usize,
    /// Teacher continuation length at most (tokens).
    pub continuation: usize,
}

impl Default for KvPacket {
    fn default() -> Self {
        Self { header: 8, trailer: 8, continuation: 16 }
    }
}

/// What a KV Packet training run does.
pub type Settings = run::Settings<KvPacket>;

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
    let mut logits = prefill_into(model, &mut cache, &full, 0, model.backend().prefill_rows())?;
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

impl Method for KvPacket {
    type Sample = Sample;
    type Adapter = Adapter;
    /// Far from every evaluation seed (`eval --seed` is 1 in every report of docs/eval; `check`
    /// and the tests use seeds below 100); the layout of every `--seed`: [`run::SEED_STRIDE`].
    const TRAIN_SEED_BASE: u64 = 7_000_000;
    /// Never trained on, never evaluated.
    const VAL_SEED: u64 = 7_500_000;
    const DEFAULT_SAMPLES: usize = 128;
    /// What both shipped adapters were trained with (their metadata; docs/kvpacket.md).
    const DEFAULT_BATCH: usize = 4;
    const DEFAULT_LR: f64 = 2e-3;
    /// AdamW as usual, linear decay, no clipping; an epoch's last batch may be smaller; every
    /// epoch's adapter written.
    const RECIPE: Recipe = Recipe {
        adamw: super::adamw::AdamWConfig::DEFAULT,
        schedule: Schedule::Linear,
        clip_norm: None,
        partial_batches: true,
        epoch_adapters: true,
    };
    const REFERENCE: &'static str = "none";
    const REFERENCE_KEY: &'static str = "none_val_loss";
    const CURVE_TITLE: &'static str = "KV Packet self-distillation: KL(teacher || student)";
    const ADAPTER_FILE: &'static str = "adapter.safetensors";

    fn check(s: &Settings) -> Result<()> {
        if s.method.header + s.method.trailer == 0 {
            return Err(TrainError::Settings(
                "--header and --trailer are both 0: give the packet at least one soft row".into(),
            ));
        }
        if s.method.continuation == 0 {
            return Err(TrainError::Settings("--continuation must be at least 1 token".into()));
        }
        Ok(())
    }

    fn sample(&self, lm: &LoadedModel<Cpu>, case: &tasks::QaCase, prompts: PromptStyle) -> Result<Option<Sample>> {
        sample(lm, case, prompts, self.continuation).map(Some)
    }

    /// The embedding of the document separator's first token (what a chunk already ends with)
    /// plus small seeded noise, so that the untrained packet is close to a plain chunk and the
    /// rows differ.
    fn initial(&self, tm: &TrainModel, lm: &LoadedModel<Cpu>, seed: u64) -> Result<Tensor> {
        let sep = lm.tokenizer.encode_text(flowprefill_coordinator::layout::DOC_SEPARATOR)?;
        let id = *sep.first().ok_or_else(|| TrainError::Model("the separator has no tokens".into()))?;
        let n = self.header + self.trailer;
        let d = tm.config().d_model;
        let base = tm.embed_tokens(&vec![id; n])?;
        let std = base.sqr()?.mean_all()?.to_scalar::<f32>()?.sqrt() as f64;
        let noise = flowprefill_worker::synthetic::random_values(n * d, seed ^ 0xada, 0.1 * std as f32);
        Ok((base + Tensor::from_vec(noise, (n, d), &Device::Cpu)?)?)
    }

    fn loss(&self, tm: &TrainModel, values: &Tensor, s: &Sample) -> Result<Tensor> {
        student_loss(tm, Some(&Packets { rows: values, header: self.header }), s)
    }

    /// `none`: the chunk caches made plain.
    fn reference_loss(&self, tm: &TrainModel, set: &[Sample]) -> Result<f64> {
        run::mean_of(set, |s| Ok(f64::from(student_loss(tm, None, s)?.detach().to_scalar::<f32>()?)))
    }

    fn adapter(&self, tm: &TrainModel, values: &Tensor, made: Provenance) -> Result<Adapter> {
        let (header, trailer) = (self.header, self.trailer);
        let meta = AdapterMeta {
            model: made.model,
            model_name: made.model_name,
            header,
            trailer,
            weights: Some(made.weights),
            training: made.training,
        };
        let rows: Vec<f32> = values.flatten_all()?.to_vec1()?;
        Ok(Adapter::new(meta, tm.config().d_model, rows)?)
    }

    fn save(&self, adapter: &Adapter, _: &TrainModel, path: &Path) -> Result<()> {
        Ok(adapter.save(path)?)
    }
}
