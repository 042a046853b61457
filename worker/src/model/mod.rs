//! The transformer: one position-explicit forward pass for every use.
//!
//! `forward(tokens, positions, attend)` runs the blocks over any set of tokens at any
//! positions. What the tokens attend to is decided by the [`Attend`] passed in, at every
//! layer: plain prefill (the tokens themselves), chunk-local prefill, decoding over a cache,
//! probing a prompt over an assembled cache, selective recomputation at global positions and
//! sharded attention across ranks are all this one forward with different `Attend`s.
//!
//! ```text
//!  x = embed(tokens)
//!  per block:  h = rms_norm(x)              q,k,v = h·Wqkv (+bias) (qwen2)
//!              q,k = rms_norm per head (qwen3);   k_pre = k;   q,k = rope(q,k @ positions)
//!              a = attend(layer, q, k, k_pre, v)            x += a·Wo
//!              h = rms_norm(x)              x += (silu(h·Wg) * h·Wu)·Wd
//!  logits = rms_norm(x[rows])·Wout
//! ```
//! The layer math calls only [`Backend`] ops, so a device backend reuses this code.

mod load;

pub use load::LoadStats;

use crate::attend::{Attend, LayerInput};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::interrupt::Check;
use flowprefill_kernels::attention::AttnShape;
use flowprefill_kernels::rope::RopeTable;
use flowprefill_kernels::Backend;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Weights of one transformer block.
pub(crate) struct Layer<B: Backend> {
    attn_norm: B::Buf,
    /// `[q_dim + 2 kv_dim, d_model]`: Q, K, V stacked.
    wqkv: B::Mat,
    bqkv: Option<B::Buf>,
    q_norm: Option<B::Buf>,
    k_norm: Option<B::Buf>,
    wo: B::Mat,
    ffn_norm: B::Buf,
    /// `[2 ffn, d_model]`: gate and up stacked.
    w_gate_up: B::Mat,
    w_down: B::Mat,
}

/// Which rows get logits.
#[derive(Clone, Copy, Debug)]
pub enum Logits<'a> {
    /// No logits (e.g. a chunk prefill that only fills a cache).
    None,
    /// The last token only.
    Last,
    /// Every token.
    All,
    /// The listed rows.
    Rows(&'a [usize]),
}

/// Logits of the requested rows.
#[derive(Clone, Debug, Default)]
pub struct ForwardOutput {
    /// Row-major `[rows.len(), vocab]`.
    pub logits: Vec<f32>,
    /// Which input rows the logits belong to.
    pub rows: Vec<usize>,
    /// Vocabulary size.
    pub vocab: usize,
}

impl ForwardOutput {
    /// Logits of the i-th returned row.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.logits[i * self.vocab..(i + 1) * self.vocab]
    }

    /// Logits of the last returned row (empty when none).
    pub fn last(&self) -> &[f32] {
        match self.rows.len() {
            0 => &[],
            n => self.row(n - 1),
        }
    }
}

/// Where forward time goes, accumulated over calls (nanoseconds).
#[derive(Debug, Default)]
pub struct OpProfile {
    matmul: AtomicU64,
    attention: AtomicU64,
    norm_rope: AtomicU64,
    elementwise: AtomicU64,
    logits: AtomicU64,
}

/// A snapshot of [`OpProfile`] in seconds.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct OpTimes {
    /// Projections and FFN GEMMs.
    pub matmul_s: f64,
    /// The `Attend` step (attention kernels, merges, cache appends, communication).
    pub attention_s: f64,
    /// RMSNorm and RoPE.
    pub norm_rope_s: f64,
    /// Embedding, SiLU, residual adds, splits.
    pub elementwise_s: f64,
    /// Final norm and output projection.
    pub logits_s: f64,
}

impl OpTimes {
    /// Sum of all parts.
    pub fn total_s(&self) -> f64 {
        self.matmul_s + self.attention_s + self.norm_rope_s + self.elementwise_s + self.logits_s
    }
}

impl OpProfile {
    fn add(slot: &AtomicU64, since: Instant) {
        slot.fetch_add(since.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }

    /// Current totals.
    pub fn snapshot(&self) -> OpTimes {
        let s = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64 * 1e-9;
        OpTimes {
            matmul_s: s(&self.matmul),
            attention_s: s(&self.attention),
            norm_rope_s: s(&self.norm_rope),
            elementwise_s: s(&self.elementwise),
            logits_s: s(&self.logits),
        }
    }

    /// Resets all totals to zero.
    pub fn reset(&self) {
        for a in [&self.matmul, &self.attention, &self.norm_rope, &self.elementwise, &self.logits] {
            a.store(0, Ordering::Relaxed);
        }
    }
}

/// A loaded model on a backend.
pub struct Model<B: Backend> {
    cfg: ModelConfig,
    backend: B,
    embed: B::Mat,
    /// `None` when the output projection is tied to the embedding.
    output: Option<B::Mat>,
    out_norm: B::Buf,
    layers: Vec<Layer<B>>,
    rope: RopeTable,
    shape: AttnShape,
    profile: OpProfile,
    load: LoadStats,
}

impl<B: Backend> std::fmt::Debug for Model<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model").field("cfg", &self.cfg).field("backend", &self.backend.name()).finish()
    }
}

impl<B: Backend> Model<B> {
    /// Hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The backend the weights live on.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Attention head layout.
    pub fn attn_shape(&self) -> &AttnShape {
        &self.shape
    }

    /// The RoPE table (for placing pre-RoPE keys).
    pub fn rope(&self) -> &RopeTable {
        &self.rope
    }

    /// Accumulated time per op family.
    pub fn profile(&self) -> &OpProfile {
        &self.profile
    }

    /// How long loading took, by stage (a synthetic model: building it, as `convert`).
    pub fn load_stats(&self) -> LoadStats {
        self.load
    }

    /// Runs the blocks over `tokens` at `positions`; `attend` decides what each layer's
    /// queries see. Returns logits for the rows `logits` asks for.
    pub fn forward(
        &self,
        tokens: &[u32],
        positions: &[u32],
        attend: &mut dyn Attend<B>,
        logits: Logits<'_>,
    ) -> Result<ForwardOutput> {
        self.run_blocks(tokens, positions, attend, logits, self.layers.len(), &mut crate::interrupt::never)
    }

    /// As [`Model::forward`], calling `check` before every layer: an error (a cancelled job,
    /// a deadline, an abort by another rank) stops the forward there.
    pub fn forward_checked(
        &self,
        tokens: &[u32],
        positions: &[u32],
        attend: &mut dyn Attend<B>,
        logits: Logits<'_>,
        check: Check<'_>,
    ) -> Result<ForwardOutput> {
        self.run_blocks(tokens, positions, attend, logits, self.layers.len(), check)
    }

    /// Runs only the first `n_layers` blocks (a probe that needs no deeper layer); no logits.
    pub fn forward_layers(
        &self,
        tokens: &[u32],
        positions: &[u32],
        attend: &mut dyn Attend<B>,
        n_layers: usize,
        check: Check<'_>,
    ) -> Result<()> {
        if n_layers > self.layers.len() {
            return Err(crate::error::internal(format!("{n_layers} layers requested of {}", self.layers.len())));
        }
        self.run_blocks(tokens, positions, attend, Logits::None, n_layers, check).map(|_| ())
    }

    fn run_blocks(
        &self,
        tokens: &[u32],
        positions: &[u32],
        attend: &mut dyn Attend<B>,
        logits: Logits<'_>,
        n_layers: usize,
        check: Check<'_>,
    ) -> Result<ForwardOutput> {
        let m = tokens.len();
        if positions.len() != m {
            return Err(crate::error::internal(format!("{m} tokens but {} positions", positions.len())));
        }
        let be = &self.backend;
        let c = &self.cfg;
        let (d, qd, kvd, ffn) = (c.d_model, c.q_dim(), c.kv_dim(), c.ffn_dim);
        let qkvd = qd + 2 * kvd;
        let prof = &self.profile;

        let t = Instant::now();
        let mut x = be.zeros(m * d)?;
        be.embedding(&self.embed, tokens, &mut x)?;
        let mut h = be.zeros(m * d)?;
        let mut qkv = be.zeros(m * qkvd)?;
        let mut q = be.zeros(m * qd)?;
        // K and V in the cache's element type (a bf16 cache: rounded once, here); the keys'
        // projection and per-head norm stay f32 until then.
        let kv_type = be.kv_dtype();
        let mut k_proj = be.zeros(m * kvd)?;
        let qk_norm = self.layers.iter().any(|l| l.k_norm.is_some());
        let mut k_normed = be.zeros(if qk_norm { m * kvd } else { 0 })?;
        let mut k = be.zeros_as(m * kvd, kv_type)?;
        let mut k_pre = be.zeros_as(m * kvd, kv_type)?;
        let mut v = be.zeros_as(m * kvd, kv_type)?;
        let mut att = be.zeros(m * qd)?;
        let mut o = be.zeros(m * d)?;
        let mut gu = be.zeros(m * 2 * ffn)?;
        let mut act = be.zeros(m * ffn)?;
        OpProfile::add(&prof.elementwise, t);

        for (l, layer) in self.layers.iter().enumerate().take(n_layers) {
            check()?;
            let _span = tracing::trace_span!("block", layer = l).entered();
            let t = Instant::now();
            be.rms_norm(&x, &layer.attn_norm, c.rms_eps, &mut h)?;
            OpProfile::add(&prof.norm_rope, t);

            let t = Instant::now();
            be.matmul_t(&h, m, &layer.wqkv, &mut qkv)?;
            OpProfile::add(&prof.matmul, t);

            let t = Instant::now();
            if let Some(bias) = &layer.bqkv {
                be.add_bias(&mut qkv, bias)?;
            }
            be.copy_columns(&qkv, qkvd, 0, qd, &mut q)?;
            be.copy_columns(&qkv, qkvd, qd, kvd, &mut k_proj)?;
            be.copy_columns(&qkv, qkvd, qd + kvd, kvd, &mut v)?;
            OpProfile::add(&prof.elementwise, t);

            let t = Instant::now();
            if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
                // Per-head RMSNorm (rows of head_dim), through the scratch buffers.
                be.rms_norm(&q, qn, c.rms_eps, &mut att)?;
                std::mem::swap(&mut q, &mut att);
                be.rms_norm(&k_proj, kn, c.rms_eps, &mut k_normed)?;
                std::mem::swap(&mut k_proj, &mut k_normed);
            }
            // Pre-RoPE keys as the cache keeps them; the rotated keys from those, exactly as a
            // chunk cache is placed later (one rotation of the stored values).
            be.copy_columns(&k_proj, kvd, 0, kvd, &mut k_pre)?;
            be.copy_columns(&k_pre, kvd, 0, kvd, &mut k)?;
            be.rope(&mut q, c.n_heads, positions, &self.rope)?;
            be.rope(&mut k, c.n_kv_heads, positions, &self.rope)?;
            OpProfile::add(&prof.norm_rope, t);

            let t = Instant::now();
            let input = LayerInput {
                backend: be,
                shape: &self.shape,
                rope: &self.rope,
                layer: l,
                positions,
                q: &q,
                k: &k,
                k_pre: &k_pre,
                v: &v,
            };
            attend.attend(&input, &mut att)?;
            OpProfile::add(&prof.attention, t);

            let t = Instant::now();
            be.matmul_t(&att, m, &layer.wo, &mut o)?;
            OpProfile::add(&prof.matmul, t);
            let t = Instant::now();
            be.add_assign(&mut x, &o)?;
            OpProfile::add(&prof.elementwise, t);

            let t = Instant::now();
            be.rms_norm(&x, &layer.ffn_norm, c.rms_eps, &mut h)?;
            OpProfile::add(&prof.norm_rope, t);
            let t = Instant::now();
            be.matmul_t(&h, m, &layer.w_gate_up, &mut gu)?;
            OpProfile::add(&prof.matmul, t);
            let t = Instant::now();
            be.silu_mul(&gu, ffn, &mut act)?;
            OpProfile::add(&prof.elementwise, t);
            let t = Instant::now();
            be.matmul_t(&act, m, &layer.w_down, &mut o)?;
            OpProfile::add(&prof.matmul, t);
            let t = Instant::now();
            be.add_assign(&mut x, &o)?;
            OpProfile::add(&prof.elementwise, t);
        }

        let t = Instant::now();
        if n_layers < self.layers.len() {
            return Ok(ForwardOutput { logits: Vec::new(), rows: Vec::new(), vocab: c.vocab_size });
        }
        let rows: Vec<usize> = match logits {
            Logits::None => Vec::new(),
            Logits::Last => (m > 0).then(|| m - 1).into_iter().collect(),
            Logits::All => (0..m).collect(),
            Logits::Rows(r) => {
                if let Some(&bad) = r.iter().find(|&&i| i >= m) {
                    return Err(crate::error::internal(format!(
                        "logit row {bad} requested from a forward of {m} tokens"
                    )));
                }
                r.to_vec()
            }
        };
        let out = self.logits_of_rows(&x, &rows)?;
        OpProfile::add(&prof.logits, t);
        Ok(out)
    }

    fn logits_of_rows(&self, x: &B::Buf, rows: &[usize]) -> Result<ForwardOutput> {
        let be = &self.backend;
        let (d, vocab) = (self.cfg.d_model, self.cfg.vocab_size);
        if rows.is_empty() {
            return Ok(ForwardOutput { logits: Vec::new(), rows: Vec::new(), vocab });
        }
        let r = rows.len();
        let mut xr = be.zeros(r * d)?;
        let dst: Vec<usize> = (0..r).collect();
        be.copy_rows(x, rows, &mut xr, &dst, d)?;
        let mut hr = be.zeros(r * d)?;
        be.rms_norm(&xr, &self.out_norm, self.cfg.rms_eps, &mut hr)?;
        let mut lg = be.zeros(r * vocab)?;
        be.matmul_t(&hr, r, self.output.as_ref().unwrap_or(&self.embed), &mut lg)?;
        Ok(ForwardOutput { logits: be.download(&lg)?, rows: rows.to_vec(), vocab })
    }
}
