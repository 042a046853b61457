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

mod block;
mod load;
mod profile;

use block::{Acts, Pass};
pub use load::LoadStats;
pub(crate) use profile::untimed;
use profile::{Laps, Slot};
pub use profile::{OpProfile, OpTimes};

use crate::attend::Attend;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::interrupt::Check;
use flowprefill_kernels::attention::AttnShape;
use flowprefill_kernels::matmul::Matrix;
use flowprefill_kernels::rope::RopeTable;
use flowprefill_kernels::{Backend, DType};

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

impl Logits<'_> {
    /// The rows of a forward of `m` tokens that get logits.
    fn rows(self, m: usize) -> Result<Vec<usize>> {
        Ok(match self {
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
        })
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
    profile: OpProfile<B>,
    load: LoadStats,
    /// KV Packet soft rows (`[rows, d_model]`), their count and the adapter's hash, read for ids
    /// at and past the vocabulary ([`crate::adapter`]).
    adapter: Option<(B::Buf, usize, String)>,
    /// LookaheadKV's rows and Lookahead LoRA on the device ([`crate::lookahead`]).
    lookahead: Option<LookaheadOnDevice<B>>,
}

/// Rows that enter the residual stream (soft-token and lookahead rows), on the device in the
/// activations' type.
fn activations<B: Backend>(be: &B, rows: &[f32]) -> Result<B::Buf> {
    let wide = be.upload(rows)?;
    if be.act_dtype() == DType::F32 || rows.is_empty() {
        return Ok(wide);
    }
    let mut out = be.zeros_as(rows.len(), be.act_dtype())?;
    be.copy_columns(&wide, rows.len(), 0, rows.len(), &mut out)?;
    Ok(out)
}

/// One low-rank update on the device: `A` (`[r, in]`) and `B` scaled by `alpha / r`
/// (`[out, r]`); fused projections stack their `A`s and hold a block-diagonal `B`.
struct Lora<B: Backend> {
    a: B::Mat,
    b: B::Mat,
}

impl<B: Backend> Lora<B> {
    /// `out += (x A^T) B^T` for the `m` rows of `x`, through the scratch `tmp` (the second
    /// product added in its epilogue).
    fn add(&self, be: &B, x: &B::Buf, m: usize, out: &mut B::Buf) -> Result<()> {
        let (r, _) = be.mat_shape(&self.a);
        let (o, _) = be.mat_shape(&self.b);
        debug_assert_eq!(be.len(out), m * o);
        let mut tmp = be.zeros_as(m * r, be.act_dtype())?;
        be.matmul_t(x, m, &self.a, &mut tmp)?;
        be.matmul_t_acc(&tmp, m, &self.b, out)?;
        Ok(())
    }
}

/// A layer's Lookahead LoRA, fused as the layer's weights are.
struct LayerLora<B: Backend> {
    qkv: Lora<B>,
    o: Lora<B>,
    gate_up: Lora<B>,
    down: Lora<B>,
}

/// LookaheadKV on the device: the rows, each layer's LoRA, the adapter's hash.
struct LookaheadOnDevice<B: Backend> {
    rows: B::Buf,
    n_rows: usize,
    layers: Vec<LayerLora<B>>,
    hash: String,
}

/// `A`s stacked (`[k r, in]`) and `B`s placed block-diagonally (`[sum out, k r]`), `B` scaled.
fn fused(parts: &[(&[f32], &[f32], usize)], rank: usize, cols: usize, scale: f32) -> Result<(Matrix, Matrix)> {
    let k = parts.len();
    let mut a = Vec::with_capacity(k * rank * cols);
    let out: usize = parts.iter().map(|p| p.2).sum();
    let mut b = vec![0.0f32; out * k * rank];
    let mut row0 = 0;
    for (i, &(pa, pb, o)) in parts.iter().enumerate() {
        a.extend_from_slice(pa);
        for r in 0..o {
            for j in 0..rank {
                b[(row0 + r) * k * rank + i * rank + j] = scale * pb[r * rank + j];
            }
        }
        row0 += o;
    }
    Ok((Matrix::new(k * rank, cols, a)?, Matrix::new(out, k * rank, b)?))
}

/// What a forward reads as its input rows.
#[derive(Clone, Copy)]
enum Input<'a> {
    /// Token ids (embedding rows; KV Packet's soft rows past the vocabulary).
    Tokens(&'a [u32]),
    /// LookaheadKV's rows, with its LoRA active on every projection.
    Lookahead,
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
    pub fn profile(&self) -> &OpProfile<B> {
        &self.profile
    }

    /// Totals of [`Model::profile`] (every thread) since its last reset.
    pub fn op_times(&self) -> Result<OpTimes> {
        self.profile.snapshot(&self.backend)
    }

    /// This thread's op times since its last call (a rank's share of a job).
    pub fn take_thread_op_times(&self) -> Result<OpTimes> {
        self.profile.take_thread(&self.backend)
    }

    /// How long loading took, by stage (a synthetic model: building it, as `convert`).
    pub fn load_stats(&self) -> LoadStats {
        self.load
    }

    /// Makes ids `vocab..vocab + adapter rows` read the adapter's soft rows (KV Packet); `None`
    /// removes it. The adapter must have been checked against this model.
    pub fn set_adapter(&mut self, adapter: Option<&crate::adapter::Adapter>) -> Result<()> {
        self.adapter = match adapter {
            None => None,
            Some(a) => {
                if a.d_model != self.cfg.d_model {
                    return Err(crate::error::internal(format!(
                        "adapter rows of {} for a model of hidden size {}",
                        a.d_model, self.cfg.d_model
                    )));
                }
                Some((activations(&self.backend, &a.rows)?, a.n_rows(), a.hash.clone()))
            }
        };
        Ok(())
    }

    /// Soft rows the model reads past its vocabulary (0 without an adapter).
    pub fn adapter_rows(&self) -> usize {
        self.adapter.as_ref().map_or(0, |a| a.1)
    }

    /// The hash of the adapter in use, if any (part of the store keys of its packets).
    pub fn adapter_hash(&self) -> Option<&str> {
        self.adapter.as_ref().map(|a| a.2.as_str())
    }

    /// Makes [`Model::forward_lookahead`] run `adapter`'s rows with its LoRA; `None` removes it.
    /// The adapter must have been checked against this model.
    pub fn set_lookahead(&mut self, adapter: Option<&crate::lookahead::LookaheadAdapter>) -> Result<()> {
        use crate::lookahead::Proj;
        let Some(a) = adapter else {
            self.lookahead = None;
            return Ok(());
        };
        let c = &self.cfg;
        if a.d_model != c.d_model || a.n_layers != c.n_layers {
            return Err(crate::error::internal(format!(
                "a lookahead adapter for {} layers of width {} on a model of {} of width {}",
                a.n_layers, a.d_model, c.n_layers, c.d_model
            )));
        }
        let be = &self.backend;
        let (r, s) = (a.meta.rank, a.scale());
        let (d, qd, kvd, ffn) = (c.d_model, c.q_dim(), c.kv_dim(), c.ffn_dim);
        let mut layers = Vec::with_capacity(c.n_layers);
        for l in 0..c.n_layers {
            let part = |p: Proj, out: usize| {
                let (pa, pb) = a.lora(l, p);
                (pa, pb, out)
            };
            let up =
                |(ma, mb): (Matrix, Matrix)| -> Result<Lora<B>> { Ok(Lora { a: be.matrix(ma)?, b: be.matrix(mb)? }) };
            layers.push(LayerLora {
                qkv: up(fused(&[part(Proj::Q, qd), part(Proj::K, kvd), part(Proj::V, kvd)], r, d, s)?)?,
                o: up(fused(&[part(Proj::O, d)], r, qd, s)?)?,
                gate_up: up(fused(&[part(Proj::Gate, ffn), part(Proj::Up, ffn)], r, d, s)?)?,
                down: up(fused(&[part(Proj::Down, d)], r, ffn, s)?)?,
            });
        }
        let rows = activations(be, a.rows())?;
        self.lookahead = Some(LookaheadOnDevice { rows, n_rows: a.meta.rows, layers, hash: a.hash.clone() });
        Ok(())
    }

    /// Lookahead rows of the adapter in use (0 without one).
    pub fn lookahead_rows(&self) -> usize {
        self.lookahead.as_ref().map_or(0, |l| l.n_rows)
    }

    /// The hash of the lookahead adapter in use, if any.
    pub fn lookahead_hash(&self) -> Option<&str> {
        self.lookahead.as_ref().map(|l| l.hash.as_str())
    }

    /// Runs the first `n_layers` blocks over LookaheadKV's rows at `positions` (one per row),
    /// their LoRA active; `attend` decides what they see (their own K/V are whatever `attend`
    /// keeps: nothing reads them later). No logits.
    pub fn forward_lookahead(
        &self,
        positions: &[u32],
        attend: &mut dyn Attend<B>,
        n_layers: usize,
        check: Check<'_>,
    ) -> Result<()> {
        let Some(la) = &self.lookahead else {
            return Err(crate::error::internal("a lookahead forward without a lookahead adapter"));
        };
        if positions.len() != la.n_rows {
            return Err(crate::error::internal(format!(
                "{} positions for {} lookahead rows",
                positions.len(),
                la.n_rows
            )));
        }
        if n_layers > self.layers.len() {
            return Err(crate::error::internal(format!("{n_layers} layers requested of {}", self.layers.len())));
        }
        self.run_blocks(Input::Lookahead, positions, attend, Logits::None, n_layers, check).map(|_| ())
    }

    /// The input rows of `tokens`: embedding rows, and the adapter's rows for ids past the
    /// vocabulary.
    fn embed_into(&self, tokens: &[u32], x: &mut B::Buf) -> Result<()> {
        let be = &self.backend;
        let vocab = self.cfg.vocab_size;
        let soft: Vec<(usize, usize)> = tokens
            .iter()
            .enumerate()
            .filter(|(_, &t)| t as usize >= vocab)
            .map(|(i, &t)| (t as usize - vocab, i))
            .collect();
        if soft.is_empty() {
            return be.embedding(&self.embed, tokens, x).map_err(Into::into);
        }
        let Some((rows, n, _)) = &self.adapter else {
            return Err(crate::error::internal(format!("token id past the vocabulary of {vocab} and no adapter")));
        };
        if let Some(&(bad, _)) = soft.iter().find(|s| s.0 >= *n) {
            return Err(crate::error::internal(format!(
                "token id {} is past the vocabulary of {vocab} and the adapter's {n} soft rows",
                bad + vocab
            )));
        }
        let plain: Vec<u32> = tokens.iter().map(|&t| if t as usize >= vocab { 0 } else { t }).collect();
        be.embedding(&self.embed, &plain, x)?;
        let (src, dst): (Vec<usize>, Vec<usize>) = soft.into_iter().unzip();
        be.copy_rows(rows, &src, x, &dst, self.cfg.d_model)?;
        Ok(())
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
        self.run_blocks(
            Input::Tokens(tokens),
            positions,
            attend,
            logits,
            self.layers.len(),
            &mut crate::interrupt::never,
        )
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
        self.run_blocks(Input::Tokens(tokens), positions, attend, logits, self.layers.len(), check)
    }

    /// As [`Model::forward_checked`] for the last row's logits, written into `out` (f32,
    /// `vocab` long) on the device and not read back: a step that can be recorded
    /// ([`Backend::record`], inside [`untimed`]).
    pub fn forward_to_device(
        &self,
        tokens: &[u32],
        positions: &[u32],
        attend: &mut dyn Attend<B>,
        out: &mut B::Buf,
        check: Check<'_>,
    ) -> Result<()> {
        let rows = Logits::Last.rows(tokens.len())?;
        let x = self.run_blocks_to(Input::Tokens(tokens), positions, attend, self.layers.len(), check)?;
        let mut laps = Laps::start(&self.backend, &self.profile)?;
        self.logits_into(&x, &rows, out)?;
        laps.lap(Slot::Logits)
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
        self.run_blocks(Input::Tokens(tokens), positions, attend, Logits::None, n_layers, check).map(|_| ())
    }

    fn run_blocks(
        &self,
        input: Input<'_>,
        positions: &[u32],
        attend: &mut dyn Attend<B>,
        logits: Logits<'_>,
        n_layers: usize,
        check: Check<'_>,
    ) -> Result<ForwardOutput> {
        let rows = logits.rows(positions.len())?;
        let x = self.run_blocks_to(input, positions, attend, n_layers, check)?;
        if n_layers < self.layers.len() {
            return Ok(ForwardOutput { logits: Vec::new(), rows: Vec::new(), vocab: self.cfg.vocab_size });
        }
        let mut laps = Laps::start(&self.backend, &self.profile)?;
        let out = self.logits_of_rows(&x, &rows)?;
        laps.lap(Slot::Logits)?;
        Ok(out)
    }

    /// The blocks up to `n_layers` over the input rows: the residual stream after them.
    fn run_blocks_to(
        &self,
        input: Input<'_>,
        positions: &[u32],
        attend: &mut dyn Attend<B>,
        n_layers: usize,
        check: Check<'_>,
    ) -> Result<B::Buf> {
        let (m, lora) = match input {
            Input::Tokens(t) => (t.len(), None),
            Input::Lookahead => (positions.len(), self.lookahead.as_ref()),
        };
        if positions.len() != m {
            return Err(crate::error::internal(format!("{m} tokens but {} positions", positions.len())));
        }
        let be = &self.backend;
        let mut laps = Laps::start(be, &self.profile)?;
        let qk_norm = self.layers.iter().any(|l| l.k_norm.is_some());
        let mut acts = Acts::new(be, &self.cfg, m, qk_norm, attend.out_dtype(be))?;
        match (input, lora) {
            (Input::Tokens(tokens), _) => self.embed_into(tokens, &mut acts.x)?,
            (Input::Lookahead, Some(la)) => {
                let rows: Vec<usize> = (0..m).collect();
                be.copy_rows(&la.rows, &rows, &mut acts.x, &rows, self.cfg.d_model)?
            }
            (Input::Lookahead, None) => return Err(crate::error::internal("a lookahead forward without an adapter")),
        }
        laps.lap(Slot::Elementwise)?;
        let pass = Pass { be, cfg: &self.cfg, rope: &self.rope, shape: &self.shape, positions };
        for (l, layer) in self.layers.iter().enumerate().take(n_layers) {
            check()?;
            let _span = tracing::trace_span!("block", layer = l).entered();
            layer.forward(&pass, l, lora.map(|la| &la.layers[l]), &mut acts, attend, &mut laps)?;
        }
        Ok(acts.x)
    }

    fn logits_of_rows(&self, x: &B::Buf, rows: &[usize]) -> Result<ForwardOutput> {
        let vocab = self.cfg.vocab_size;
        if rows.is_empty() {
            return Ok(ForwardOutput { logits: Vec::new(), rows: Vec::new(), vocab });
        }
        let mut lg = self.backend.zeros(rows.len() * vocab)?;
        self.logits_into(x, rows, &mut lg)?;
        Ok(ForwardOutput { logits: self.backend.download(&lg)?, rows: rows.to_vec(), vocab })
    }

    /// The logits of `rows` of the residual stream `x` into `lg` (f32, `rows.len() x vocab`).
    fn logits_into(&self, x: &B::Buf, rows: &[usize], lg: &mut B::Buf) -> Result<()> {
        let be = &self.backend;
        let d = self.cfg.d_model;
        let r = rows.len();
        // The final norm in the activations' type, the logits in f32.
        let mut xr = be.zeros_as(r * d, be.dtype(x))?;
        let dst: Vec<usize> = (0..r).collect();
        be.copy_rows(x, rows, &mut xr, &dst, d)?;
        let mut hr = be.zeros_as(r * d, be.dtype(x))?;
        be.rms_norm(&xr, &self.out_norm, self.cfg.rms_eps, &mut hr)?;
        be.matmul_t(&hr, r, self.output.as_ref().unwrap_or(&self.embed), lg)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attend::SelfOnly;
    use crate::config::Arch;
    use flowprefill_kernels::Cpu;

    fn tiny() -> Model<Cpu> {
        let cfg = ModelConfig {
            arch: Arch::Llama,
            name: "tiny".into(),
            n_layers: 3,
            d_model: 64,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 16,
            ffn_dim: 128,
            vocab_size: 300,
            context_length: 512,
            rope_base: 10000.0,
            rope_dim: 16,
            rope_linear_factor: 1.0,
            rms_eps: 1e-5,
            tied_embeddings: true,
        };
        Model::synthetic(cfg, Cpu, 7).expect("a tiny synthetic model")
    }

    /// The profile splits a forward's time into its op families, per calling thread (a rank
    /// of a thread world sees its own work only), sums them into the totals, and records
    /// nothing while it is off.
    #[test]
    fn the_op_profile_is_per_family_and_per_thread() {
        let m = tiny();
        let tokens: Vec<u32> = (0..96).map(|i| (i * 7 % 300) as u32).collect();
        let positions: Vec<u32> = (0..96).collect();
        let run = || {
            m.forward(&tokens, &positions, &mut SelfOnly, Logits::Last).expect("forward");
        };
        run();
        let mine = m.take_thread_op_times().unwrap();
        for (name, s) in [
            ("matmul", mine.matmul_s),
            ("attention", mine.attention_s),
            ("norm_rope", mine.norm_rope_s),
            ("elementwise", mine.elementwise_s),
            ("logits", mine.logits_s),
        ] {
            assert!(s > 0.0, "{name}: {s} s after a forward");
        }
        assert_eq!(m.take_thread_op_times().unwrap().total_s(), 0.0, "taking restarts this thread's counters");
        // Another thread's forward is its own.
        let other = std::thread::scope(|sc| {
            sc.spawn(|| {
                run();
                run();
                m.take_thread_op_times().unwrap()
            })
            .join()
            .unwrap()
        });
        assert!(other.total_s() > 0.0);
        assert_eq!(m.take_thread_op_times().unwrap().total_s(), 0.0, "this thread ran nothing since");
        let all = m.op_times().unwrap();
        assert!((all.total_s() - mine.total_s() - other.total_s()).abs() < 1e-9, "totals are the threads' sum");
        let fam = all.families_ms();
        assert_eq!(fam.iter().map(|f| f.0.as_str()).collect::<Vec<_>>(), ["matmul", "attention", "norm_rope", "other"]);
        m.profile().reset();
        m.profile().set_enabled(false);
        run();
        assert_eq!(m.op_times().unwrap().total_s(), 0.0, "off: nothing recorded");
        assert_eq!(m.take_thread_op_times().unwrap().total_s(), 0.0);
    }

    /// The pairs of marks wait unread only up to a bound: many forwards without a reader keep
    /// the profile's memory bounded and lose no time.
    #[test]
    fn unread_marks_are_bounded() {
        let m = tiny();
        let (tokens, positions) = (vec![1u32, 2, 3], vec![0u32, 1, 2]);
        // 3 layers: 1 + 8 per layer + 1 laps per forward (the residual adds are in the GEMMs).
        let per_forward = 26;
        let forwards = OpProfile::<Cpu>::PENDING / per_forward + 8;
        for _ in 0..forwards {
            m.forward(&tokens, &positions, &mut SelfOnly, Logits::Last).unwrap();
        }
        let pending = m.profile().lock().pending.len();
        assert!(pending <= OpProfile::<Cpu>::PENDING, "{pending} pairs unread");
        let read: f64 = m.profile().lock().totals.iter().sum();
        assert!(read > 0.0, "the oldest pairs were read when the bound was passed");
        assert!(m.op_times().unwrap().total_s() >= read);
    }
}
