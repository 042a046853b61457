//! The model again, as a differentiable function: the same llama / qwen2 / qwen3 blocks as the
//! worker's inference forward, written with candle tensors so that gradients reach soft tokens.
//!
//! ```text
//!   forward(x, positions, context)       x: [m, d] input embeddings (token rows or soft rows)
//!     per block: rms_norm -> Wqkv (+bias) -> (qwen3: per-head norm) -> keys kept before RoPE
//!                -> RoPE(q, k @ positions) -> attention over [context placed at its positions;
//!                own rows causally] -> Wo -> +x -> rms_norm -> SwiGLU -> +x
//!   returns the hidden rows and the segment's (K before RoPE, V) per layer, which a later
//!   segment attends to at whatever positions it places them (one rotation, as the chunk
//!   caches of the engine are placed)
//! ```
//! The weights are frozen (plain tensors, never `Var`s): every projection goes through
//! [`Frozen`], whose backward gives the gradient of the input only, so a backward pass costs
//! one matmul per projection and no weight gradient is ever formed. Gradients flow to whatever
//! `Var` the input embeddings were made from (the adapters).

use super::{Result, TrainError};
use candle_core::{CpuStorage, CustomOp1, Device, Layout, Shape, Tensor, D};
use flowprefill_kernels::rope::RopeStyle;
use flowprefill_worker::config::ModelConfig;
use flowprefill_worker::gguf::GgufFile;
use flowprefill_worker::lookahead::Proj;
use std::path::Path;

/// Where the weights come from: a name in the GGUF convention (`blk.0.attn_q.weight`) to its
/// shape (`[rows, cols]` for matrices, rows = outputs) and f32 values.
pub trait Weights {
    /// The tensor `name`.
    fn tensor(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)>;
}

impl Weights for GgufFile {
    fn tensor(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        Ok(self.tensor_f32(name)?)
    }
}

/// `x · Wᵀ` for a frozen `W` (`[out, in]`): forward in candle's GEMM, backward `grad · W`
/// (the input's gradient only). Holds its own handle to the weight (the op stays in the graph).
struct Frozen(Tensor);

impl CustomOp1 for Frozen {
    fn name(&self) -> &'static str {
        "frozen-linear"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = match (storage, layout.contiguous_offsets()) {
            (CpuStorage::F32(v), Some((a, b))) => Tensor::from_slice(&v[a..b], layout.shape(), &Device::Cpu)?,
            _ => return Err(candle_core::Error::Msg("frozen-linear: a contiguous f32 input expected".into())),
        };
        let y = x.matmul(&self.0.t()?)?;
        let shape = y.shape().clone();
        Ok((CpuStorage::F32(y.flatten_all()?.to_vec1::<f32>()?), shape))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(grad.contiguous()?.matmul(&self.0)?))
    }
}

/// `x · Wᵀ` with `W` frozen (`x`: `[m, in]`).
fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    Ok(x.contiguous()?.apply_op1(Frozen(w.clone()))?)
}

/// RMSNorm over the last dimension, then the weight.
fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    Ok(x.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(w)?)
}

/// One block's frozen weights.
struct Block {
    attn_norm: Tensor,
    /// `[q_dim + 2 kv_dim, d]`.
    wqkv: Tensor,
    bqkv: Option<Tensor>,
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    wo: Tensor,
    ffn_norm: Tensor,
    /// `[2 ffn, d]`: gate, then up.
    w_gate_up: Tensor,
    w_down: Tensor,
}

/// One segment's keys (before RoPE, unless `rotated`) and values, `[n, kv_dim]` per layer.
pub struct SegmentKv {
    /// `(k, v)` per layer.
    pub layers: Vec<(Tensor, Tensor)>,
    /// The keys are rotated already, to the positions it is placed at (a cache made by the
    /// worker's prefill); otherwise they are rotated when placed.
    pub rotated: bool,
}

impl SegmentKv {
    /// Rows held.
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, |(k, _)| k.dims()[0])
    }

    /// Whether it holds no rows.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A segment placed at positions for a later segment to attend to.
pub struct Placed<'a> {
    /// The segment.
    pub kv: &'a SegmentKv,
    /// One position per row.
    pub positions: Vec<u32>,
}

/// Lookahead LoRA as candle tensors (views of the trained parameters): per layer, per
/// projection in [`Proj::ALL`] order, `(A [r, in], B [out, r])`; the update is `scale` times
/// `x A^T B^T`, added to the frozen projection of the same rows.
pub struct LoraSet {
    /// `[layer][projection]`.
    pub layers: Vec<Vec<(Tensor, Tensor)>>,
    /// `alpha / r`.
    pub scale: f64,
}

impl LoraSet {
    fn delta(&self, x: &Tensor, l: usize, p: Proj) -> Result<Tensor> {
        let i = Proj::ALL.iter().position(|&q| q == p).unwrap_or(0);
        let (a, b) = &self.layers[l][i];
        Ok((x.contiguous()?.matmul(&a.t()?)?.matmul(&b.t()?)? * self.scale)?)
    }
}

/// What a forward computes beyond its hidden rows and K/V.
#[derive(Clone, Copy, Default)]
pub struct Extras<'a> {
    /// Lookahead LoRA, active on every row of this forward.
    pub lora: Option<&'a LoraSet>,
    /// Keep, per layer, the attention the rows pay the first `capture` context rows: the mean
    /// over the rows, summed over the query heads of each KV head (`[kv_heads, capture]`).
    pub capture: usize,
}

/// The model's frozen weights as candle tensors (f32, CPU).
pub struct TrainModel {
    cfg: ModelConfig,
    embed: Tensor,
    output: Option<Tensor>,
    out_norm: Tensor,
    blocks: Vec<Block>,
    inv_freq: Vec<f64>,
    style: RopeStyle,
}

impl TrainModel {
    /// Loads the weights of `path` (any GGUF the worker loads), dequantized to f32.
    pub fn from_gguf(path: &Path) -> Result<Self> {
        let file = GgufFile::open(path)?;
        let cfg = ModelConfig::from_gguf(&file)?;
        let freqs =
            if file.has_tensor("rope_freqs.weight") { Some(file.tensor_f32("rope_freqs.weight")?.1) } else { None };
        Self::from_weights(cfg, &file, freqs.as_deref())
    }

    /// Builds the model of `cfg` from `w` (`freq_factors`: Llama 3.1's RoPE frequency factors).
    pub fn from_weights(cfg: ModelConfig, w: &dyn Weights, freq_factors: Option<&[f32]>) -> Result<Self> {
        let get = |name: &str, expect: &[usize]| -> Result<Tensor> {
            let (shape, v) = w.tensor(name)?;
            if shape != expect {
                return Err(TrainError::Model(format!("{name} has shape {shape:?}, expected {expect:?}")));
            }
            Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
        };
        let stack = |names: &[String], rows: &[usize], cols: usize| -> Result<Tensor> {
            let parts = names.iter().zip(rows).map(|(n, &r)| get(n, &[r, cols])).collect::<Result<Vec<_>>>()?;
            Ok(Tensor::cat(&parts, 0)?)
        };
        let vector = |names: &[String], lens: &[usize]| -> Result<Tensor> {
            let parts = names.iter().zip(lens).map(|(n, &l)| get(n, &[l])).collect::<Result<Vec<_>>>()?;
            Ok(Tensor::cat(&parts, 0)?)
        };
        let (d, qd, kvd, ffn, hd) = (cfg.d_model, cfg.q_dim(), cfg.kv_dim(), cfg.ffn_dim, cfg.head_dim);
        let mut blocks = Vec::with_capacity(cfg.n_layers);
        for l in 0..cfg.n_layers {
            let b = |n: &str| format!("blk.{l}.{n}");
            let qkv = [b("attn_q.weight"), b("attn_k.weight"), b("attn_v.weight")];
            let bias = [b("attn_q.bias"), b("attn_k.bias"), b("attn_v.bias")];
            blocks.push(Block {
                attn_norm: get(&b("attn_norm.weight"), &[d])?,
                wqkv: stack(&qkv, &[qd, kvd, kvd], d)?,
                bqkv: if cfg.arch.qkv_bias() { Some(vector(&bias, &[qd, kvd, kvd])?) } else { None },
                q_norm: if cfg.arch.qk_norm() { Some(get(&b("attn_q_norm.weight"), &[hd])?) } else { None },
                k_norm: if cfg.arch.qk_norm() { Some(get(&b("attn_k_norm.weight"), &[hd])?) } else { None },
                wo: get(&b("attn_output.weight"), &[d, qd])?,
                ffn_norm: get(&b("ffn_norm.weight"), &[d])?,
                w_gate_up: stack(&[b("ffn_gate.weight"), b("ffn_up.weight")], &[ffn, ffn], d)?,
                w_down: get(&b("ffn_down.weight"), &[d, ffn])?,
            });
        }
        let embed = get("token_embd.weight", &[cfg.vocab_size, d])?;
        let output = if cfg.tied_embeddings { None } else { Some(get("output.weight", &[cfg.vocab_size, d])?) };
        let out_norm = get("output_norm.weight", &[d])?;
        let half = cfg.rope_dim / 2;
        if let Some(f) = freq_factors.filter(|f| f.len() != half) {
            return Err(TrainError::Model(format!("{} RoPE frequency factors for {half} pairs", f.len())));
        }
        let inv_freq = (0..half)
            .map(|i| {
                let f = 1.0 / cfg.rope_base.powf(2.0 * i as f64 / cfg.rope_dim as f64);
                f / freq_factors.map_or(1.0, |ff| ff[i] as f64) / cfg.rope_linear_factor
            })
            .collect();
        let style = cfg.arch.rope_style();
        Ok(Self { cfg, embed, output, out_norm, blocks, inv_freq, style })
    }

    /// Hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The embedding rows of `tokens` (`[n, d]`, no gradient).
    pub fn embed_tokens(&self, tokens: &[u32]) -> Result<Tensor> {
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            return Err(TrainError::Model(format!("token {bad} is outside the vocabulary of {}", self.cfg.vocab_size)));
        }
        let ids = Tensor::from_slice(tokens, tokens.len(), &Device::Cpu)?;
        Ok(self.embed.index_select(&ids, 0)?)
    }

    /// cos and sin of every rotated pair at `positions`: `[n, 1, rot_dim / 2]` each (the same
    /// f64 angles as the worker's RoPE table).
    fn angles(&self, positions: &[u32]) -> Result<(Tensor, Tensor)> {
        let half = self.inv_freq.len();
        let (mut c, mut s) = (Vec::with_capacity(positions.len() * half), Vec::with_capacity(positions.len() * half));
        for &p in positions {
            for &f in &self.inv_freq {
                let (sn, cs) = (p as f64 * f).sin_cos();
                c.push(cs as f32);
                s.push(sn as f32);
            }
        }
        let shape = (positions.len(), 1, half);
        Ok((Tensor::from_vec(c, shape, &Device::Cpu)?, Tensor::from_vec(s, shape, &Device::Cpu)?))
    }

    /// RoPE of `x` (`[n, heads * head_dim]`) at `positions`, in this architecture's pairing.
    fn rope(&self, x: &Tensor, heads: usize, positions: &[u32]) -> Result<Tensor> {
        let (n, hd, rot) = (positions.len(), self.cfg.head_dim, self.cfg.rope_dim);
        let half = rot / 2;
        if half == 0 || n == 0 {
            return Ok(x.clone());
        }
        let x = x.reshape((n, heads, hd))?;
        let (cos, sin) = self.angles(positions)?;
        let r = x.narrow(2, 0, rot)?;
        let (a, b) = match self.style {
            RopeStyle::Neox => (r.narrow(2, 0, half)?, r.narrow(2, half, half)?),
            RopeStyle::Interleaved => {
                let r = r.reshape((n, heads, half, 2))?;
                (r.narrow(3, 0, 1)?.squeeze(3)?, r.narrow(3, 1, 1)?.squeeze(3)?)
            }
        };
        let ra = (a.broadcast_mul(&cos)? - b.broadcast_mul(&sin)?)?;
        let rb = (a.broadcast_mul(&sin)? + b.broadcast_mul(&cos)?)?;
        let rotated = match self.style {
            RopeStyle::Neox => Tensor::cat(&[ra, rb], 2)?,
            RopeStyle::Interleaved => Tensor::stack(&[ra, rb], 3)?.reshape((n, heads, rot))?,
        };
        let out = if rot < hd { Tensor::cat(&[rotated, x.narrow(2, rot, hd - rot)?], 2)? } else { rotated };
        Ok(out.reshape((n, heads * hd))?)
    }

    /// Attention of `q` (`[m, q_dim]`, rotated) over `keys`/`values` (`[n, kv_dim]`, keys
    /// rotated); the last `m` key rows are the queries' own, seen causally, the rows before
    /// them are the context, seen whole.
    fn attention(
        &self,
        q: &Tensor,
        keys: &Tensor,
        values: &Tensor,
        capture: usize,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let c = &self.cfg;
        let (m, n, hd) = (q.dims()[0], keys.dims()[0], c.head_dim);
        let (h, kvh) = (c.n_heads, c.n_kv_heads);
        let group = h / kvh;
        let q = q.reshape((m, h, hd))?.transpose(0, 1)?.contiguous()?;
        let expand = |t: &Tensor| -> Result<Tensor> {
            let t = t.reshape((n, kvh, hd))?.transpose(0, 1)?;
            Ok(t.unsqueeze(1)?.broadcast_as((kvh, group, n, hd))?.reshape((h, n, hd))?)
        };
        let (k, v) = (expand(keys)?, expand(values)?);
        let scale = 1.0 / (hd as f64).sqrt();
        let scores = (q.matmul(&k.transpose(1, 2)?.contiguous()?)? * scale)?;
        let ctx = n - m;
        let mask: Vec<f32> = (0..m)
            .flat_map(|i| (0..n).map(move |j| if j < ctx || j - ctx <= i { 0.0 } else { f32::NEG_INFINITY }))
            .collect();
        let scores = scores.broadcast_add(&Tensor::from_vec(mask, (m, n), &Device::Cpu)?)?;
        let max = scores.max_keepdim(D::Minus1)?.detach();
        let e = scores.broadcast_sub(&max)?.exp()?;
        let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
        let kept = if capture > 0 {
            // [h, m, capture] -> mean over the rows -> [kvh, group, capture] summed over the group.
            let a = p.narrow(2, 0, capture.min(ctx))?.mean(1)?;
            Some(a.reshape((kvh, group, capture.min(ctx)))?.sum(1)?)
        } else {
            None
        };
        Ok((p.matmul(&v)?.transpose(0, 1)?.reshape((m, h * hd))?, kept))
    }

    /// Runs the blocks over the input rows `x` (`[m, d]`) at `positions`; each layer's queries
    /// see `context` (whole) and their own rows (causally). Returns the last hidden rows
    /// (`[m, d]`, before the output norm) and the segment's keys and values.
    pub fn forward(&self, x: &Tensor, positions: &[u32], context: &[Placed<'_>]) -> Result<(Tensor, SegmentKv)> {
        let (h, kv, _) = self.forward_ext(x, positions, context, Extras::default())?;
        Ok((h, kv))
    }

    /// As [`TrainModel::forward`], with Lookahead LoRA on every row and the attention paid to
    /// the first context rows kept per layer (see [`Extras`]; empty when `capture` is 0).
    pub fn forward_ext(
        &self,
        x: &Tensor,
        positions: &[u32],
        context: &[Placed<'_>],
        extras: Extras<'_>,
    ) -> Result<(Tensor, SegmentKv, Vec<Tensor>)> {
        let c = &self.cfg;
        let m = positions.len();
        if x.dims() != [m, c.d_model] {
            return Err(TrainError::Model(format!("input of shape {:?} for {m} positions", x.dims())));
        }
        if let Some(p) = context.iter().find(|p| p.positions.len() != p.kv.len()) {
            return Err(TrainError::Model(format!("{} positions for {} context rows", p.positions.len(), p.kv.len())));
        }
        let (qd, kvd, ffn, eps) = (c.q_dim(), c.kv_dim(), c.ffn_dim, c.rms_eps as f64);
        let mut x = x.clone();
        let mut layers = Vec::with_capacity(self.blocks.len());
        let mut captured = Vec::new();
        let lora = extras.lora;
        for (l, b) in self.blocks.iter().enumerate() {
            let h = rms_norm(&x, &b.attn_norm, eps)?;
            let mut qkv = linear(&h, &b.wqkv)?;
            if let Some(lo) = lora {
                let d = [lo.delta(&h, l, Proj::Q)?, lo.delta(&h, l, Proj::K)?, lo.delta(&h, l, Proj::V)?];
                qkv = (qkv + Tensor::cat(&d, 1)?)?;
            }
            if let Some(bias) = &b.bqkv {
                qkv = qkv.broadcast_add(bias)?;
            }
            let mut q = qkv.narrow(1, 0, qd)?;
            let mut k = qkv.narrow(1, qd, kvd)?;
            let v = qkv.narrow(1, qd + kvd, kvd)?.contiguous()?;
            if let (Some(qn), Some(kn)) = (&b.q_norm, &b.k_norm) {
                let hd = c.head_dim;
                q = rms_norm(&q.reshape((m * c.n_heads, hd))?, qn, eps)?.reshape((m, qd))?;
                k = rms_norm(&k.reshape((m * c.n_kv_heads, hd))?, kn, eps)?.reshape((m, kvd))?;
            }
            let k_pre = k.contiguous()?;
            let q = self.rope(&q.contiguous()?, c.n_heads, positions)?;
            let mut keys = Vec::with_capacity(context.len() + 1);
            let mut values = Vec::with_capacity(context.len() + 1);
            for p in context {
                let (pk, pv) = &p.kv.layers[l];
                keys.push(if p.kv.rotated { pk.clone() } else { self.rope(pk, c.n_kv_heads, &p.positions)? });
                values.push(pv.clone());
            }
            keys.push(self.rope(&k_pre, c.n_kv_heads, positions)?);
            values.push(v.clone());
            let (att, kept) = self.attention(&q, &Tensor::cat(&keys, 0)?, &Tensor::cat(&values, 0)?, extras.capture)?;
            captured.extend(kept);
            let mut o = linear(&att, &b.wo)?;
            if let Some(lo) = lora {
                o = (o + lo.delta(&att, l, Proj::O)?)?;
            }
            x = (x + o)?;
            let h = rms_norm(&x, &b.ffn_norm, eps)?;
            let mut gu = linear(&h, &b.w_gate_up)?;
            if let Some(lo) = lora {
                gu = (gu + Tensor::cat(&[lo.delta(&h, l, Proj::Gate)?, lo.delta(&h, l, Proj::Up)?], 1)?)?;
            }
            let act = (gu.narrow(1, 0, ffn)?.silu()? * gu.narrow(1, ffn, ffn)?)?;
            let mut down = linear(&act, &b.w_down)?;
            if let Some(lo) = lora {
                down = (down + lo.delta(&act, l, Proj::Down)?)?;
            }
            x = (x + down)?;
            layers.push((k_pre, v));
        }
        Ok((x, SegmentKv { layers, rotated: false }, captured))
    }

    /// Logits (`[rows.len(), vocab]`) of the hidden rows `rows` of a [`TrainModel::forward`].
    pub fn logits(&self, hidden: &Tensor, rows: &[usize]) -> Result<Tensor> {
        let m = hidden.dims()[0];
        if let Some(&bad) = rows.iter().find(|&&r| r >= m) {
            return Err(TrainError::Model(format!("logit row {bad} of a segment of {m} rows")));
        }
        let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let picked = hidden.index_select(&Tensor::from_slice(&idx, idx.len(), &Device::Cpu)?, 0)?;
        let h = rms_norm(&picked, &self.out_norm, self.cfg.rms_eps as f64)?;
        linear(&h, self.output.as_ref().unwrap_or(&self.embed))
    }
}
