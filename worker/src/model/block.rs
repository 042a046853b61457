//! One transformer block's forward ([`Layer::forward`]) and the activation buffers every block
//! of a forward reuses ([`Acts`]). The time of each op class is lapped around it ([`Laps`]).

use super::profile::{Laps, Slot};
use super::{Layer, LayerLora};
use crate::attend::{Attend, LayerInput};
use crate::config::ModelConfig;
use crate::error::Result;
use flowprefill_kernels::attention::AttnShape;
use flowprefill_kernels::rope::RopeTable;
use flowprefill_kernels::{Backend, DType};

/// What every block of one forward shares.
pub(super) struct Pass<'a, B: Backend> {
    /// The backend.
    pub be: &'a B,
    /// The model's hyper-parameters.
    pub cfg: &'a ModelConfig,
    /// RoPE angles.
    pub rope: &'a RopeTable,
    /// Attention dimensions.
    pub shape: &'a AttnShape,
    /// The rows' positions.
    pub positions: &'a [u32],
}

/// One forward's activations, reused by every block. Activations are in the backend's type
/// (bf16 on a GPU with bf16 weights): the residual stream, norms, projections, the SiLU gate.
/// The attention output is in the type its [`Attend`] writes ([`Attend::out_dtype`]): the
/// backend's where attention calls write it (the output projection reads a bf16 one as it
/// is), f32 where partial results merge into it; K and V are in the cache's type (a bf16
/// cache: rounded once, here).
pub(super) struct Acts<B: Backend> {
    /// The residual stream.
    pub x: B::Buf,
    h: B::Buf,
    qkv: B::Buf,
    q: B::Buf,
    q_normed: B::Buf,
    k_proj: B::Buf,
    k_normed: B::Buf,
    k: B::Buf,
    k_pre: B::Buf,
    v: B::Buf,
    att: B::Buf,
    gu: B::Buf,
    gated: B::Buf,
}

impl<B: Backend> Acts<B> {
    /// Buffers for `m` rows (the per-head norm scratch only when the model has those norms), the
    /// attention output of `att` elements.
    pub fn new(be: &B, c: &ModelConfig, m: usize, qk_norm: bool, att: DType) -> Result<Self> {
        let (act, kv) = (be.act_dtype(), be.kv_dtype());
        let (d, qd, kvd, ffn) = (c.d_model, c.q_dim(), c.kv_dim(), c.ffn_dim);
        let norm_rows = if qk_norm { m } else { 0 };
        Ok(Self {
            x: be.zeros_as(m * d, act)?,
            h: be.zeros_as(m * d, act)?,
            qkv: be.zeros_as(m * (qd + 2 * kvd), act)?,
            q: be.zeros_as(m * qd, act)?,
            q_normed: be.zeros_as(norm_rows * qd, act)?,
            k_proj: be.zeros_as(norm_rows * kvd, act)?,
            k_normed: be.zeros_as(norm_rows * kvd, act)?,
            k: be.zeros_as(m * kvd, kv)?,
            k_pre: be.zeros_as(m * kvd, kv)?,
            v: be.zeros_as(m * kvd, kv)?,
            att: be.zeros_as(m * qd, att)?,
            gu: be.zeros_as(m * 2 * ffn, act)?,
            gated: be.zeros_as(m * ffn, act)?,
        })
    }
}

impl<B: Backend> Layer<B> {
    /// Block `l` over the rows of `a.x` (in place), with `lora` added to its projections; what
    /// the rows attend to is `attend`'s.
    pub(super) fn forward(
        &self,
        p: &Pass<'_, B>,
        l: usize,
        lora: Option<&LayerLora<B>>,
        a: &mut Acts<B>,
        attend: &mut dyn Attend<B>,
        laps: &mut Laps<'_, B>,
    ) -> Result<()> {
        let (be, c) = (p.be, p.cfg);
        let m = p.positions.len();
        be.rms_norm(&a.x, &self.attn_norm, c.rms_eps, &mut a.h)?;
        laps.lap(Slot::NormRope)?;
        be.matmul_t(&a.h, m, &self.wqkv, &mut a.qkv)?;
        if let Some(ll) = lora {
            ll.qkv.add(be, &a.h, m, &mut a.qkv)?;
        }
        laps.lap(Slot::Matmul)?;
        self.split_qkv(p, a, laps)?;
        laps.lap(Slot::NormRope)?;
        let input = LayerInput {
            backend: be,
            shape: p.shape,
            rope: p.rope,
            layer: l,
            positions: p.positions,
            q: &a.q,
            k: &a.k,
            k_pre: &a.k_pre,
            v: &a.v,
        };
        attend.attend(&input, &mut a.att)?;
        laps.lap(Slot::Attention)?;
        // The residual adds happen in the GEMMs' epilogues: x += att Wo, x += gated Wdown.
        be.matmul_t_acc(&a.att, m, &self.wo, &mut a.x)?;
        if let Some(ll) = lora {
            ll.o.add(be, &a.att, m, &mut a.x)?;
        }
        laps.lap(Slot::Matmul)?;
        be.rms_norm(&a.x, &self.ffn_norm, c.rms_eps, &mut a.h)?;
        laps.lap(Slot::NormRope)?;
        be.matmul_t(&a.h, m, &self.w_gate_up, &mut a.gu)?;
        if let Some(ll) = lora {
            ll.gate_up.add(be, &a.h, m, &mut a.gu)?;
        }
        laps.lap(Slot::Matmul)?;
        be.silu_mul(&a.gu, c.ffn_dim, &mut a.gated)?;
        laps.lap(Slot::Elementwise)?;
        be.matmul_t_acc(&a.gated, m, &self.w_down, &mut a.x)?;
        if let Some(ll) = lora {
            ll.down.add(be, &a.gated, m, &mut a.x)?;
        }
        laps.lap(Slot::Matmul)
    }

    /// Q, pre-RoPE K, rotated K and V from the projections (the bias added, qwen2; per-head
    /// norms, qwen3).
    fn split_qkv(&self, p: &Pass<'_, B>, a: &mut Acts<B>, laps: &mut Laps<'_, B>) -> Result<()> {
        let (be, c) = (p.be, p.cfg);
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        let qkvd = qd + 2 * kvd;
        if let Some(bias) = &self.bqkv {
            be.add_bias(&mut a.qkv, bias)?;
        }
        let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) else {
            // The same split and rotations (one pass on a device).
            let heads = (c.n_heads, c.n_kv_heads);
            be.split_qkv_rope(&a.qkv, heads, p.positions, p.rope, &mut a.q, &mut a.k_pre, &mut a.k, &mut a.v)?;
            return Ok(());
        };
        be.copy_columns(&a.qkv, qkvd, 0, qd, &mut a.q)?;
        be.copy_columns(&a.qkv, qkvd, qd, kvd, &mut a.k_proj)?;
        be.copy_columns(&a.qkv, qkvd, qd + kvd, kvd, &mut a.v)?;
        laps.lap(Slot::Elementwise)?;
        // Per-head RMSNorm (rows of head_dim), through the scratch buffers.
        be.rms_norm(&a.q, qn, c.rms_eps, &mut a.q_normed)?;
        std::mem::swap(&mut a.q, &mut a.q_normed);
        be.rms_norm(&a.k_proj, kn, c.rms_eps, &mut a.k_normed)?;
        std::mem::swap(&mut a.k_proj, &mut a.k_normed);
        // Pre-RoPE keys as the cache keeps them; the rotated keys from those, exactly as a
        // chunk cache is placed later (one rotation of the stored values).
        be.copy_columns(&a.k_proj, kvd, 0, kvd, &mut a.k_pre)?;
        be.copy_columns(&a.k_pre, kvd, 0, kvd, &mut a.k)?;
        be.rope(&mut a.q, c.n_heads, p.positions, p.rope)?;
        be.rope(&mut a.k, c.n_kv_heads, p.positions, p.rope)?;
        Ok(())
    }
}
