//! Building a [`Model`] from a GGUF file: dequantize, fuse projections, move to the backend.

use super::{Layer, Model, OpProfile};
use crate::config::ModelConfig;
use crate::error::{Result, WorkerError};
use crate::gguf::GgufFile;
use flowprefill_kernels::matmul::Matrix;
use flowprefill_kernels::rope::RopeTable;
use flowprefill_kernels::Backend;
use std::path::Path;

/// Upper bound of the precomputed RoPE table (positions beyond are computed on the fly).
const ROPE_TABLE_MAX: usize = 1 << 17;

struct Loader<'a, B: Backend> {
    file: &'a mut GgufFile,
    backend: &'a B,
}

impl<B: Backend> Loader<'_, B> {
    fn matrix(&mut self, name: &str) -> Result<Matrix> {
        let (shape, data) = self.file.tensor_f32(name)?;
        let (rows, cols) = match shape.as_slice() {
            [r, c] => (*r, *c),
            other => {
                return Err(WorkerError::UnsupportedTensor {
                    path: self.file.path().to_path_buf(),
                    name: name.to_string(),
                    detail: format!("expected a matrix, found shape {other:?}"),
                })
            }
        };
        Ok(Matrix::new(rows, cols, data)?)
    }

    fn vector(&mut self, name: &str) -> Result<B::Buf> {
        let (_, data) = self.file.tensor_f32(name)?;
        Ok(self.backend.upload(&data)?)
    }

    fn vector_opt(&mut self, name: &str, present: bool) -> Result<Option<B::Buf>> {
        if present {
            self.vector(name).map(Some)
        } else {
            Ok(None)
        }
    }
}

impl<B: Backend> Model<B> {
    /// Loads a GGUF model onto `backend`.
    pub fn load(path: &Path, backend: B) -> Result<Self> {
        let mut file = GgufFile::open(path)?;
        let cfg = ModelConfig::from_gguf(&file)?;
        Self::from_file(&mut file, cfg, backend)
    }

    /// Loads the weights of an already opened and validated file.
    pub fn from_file(file: &mut GgufFile, cfg: ModelConfig, backend: B) -> Result<Self> {
        let freq_factors =
            if file.has_tensor("rope_freqs.weight") { Some(file.tensor_f32("rope_freqs.weight")?.1) } else { None };
        let rope = RopeTable::new(
            cfg.head_dim,
            cfg.rope_dim,
            cfg.rope_base,
            cfg.arch.rope_style(),
            freq_factors.as_deref(),
            cfg.context_length.clamp(1, ROPE_TABLE_MAX),
        )?;
        let mut ld = Loader { file, backend: &backend };
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for l in 0..cfg.n_layers {
            let b = |n: &str| format!("blk.{l}.{n}");
            // Q, K and V share one GEMM; gate and up share another.
            let wq = ld.matrix(&b("attn_q.weight"))?;
            let wk = ld.matrix(&b("attn_k.weight"))?;
            let wv = ld.matrix(&b("attn_v.weight"))?;
            let wqkv = Matrix::vstack(&[&wq, &wk, &wv])?;
            drop((wq, wk, wv));
            let bqkv = if cfg.arch.qkv_bias() {
                let mut bias = ld.file.tensor_f32(&b("attn_q.bias"))?.1;
                bias.extend(ld.file.tensor_f32(&b("attn_k.bias"))?.1);
                bias.extend(ld.file.tensor_f32(&b("attn_v.bias"))?.1);
                Some(backend.upload(&bias)?)
            } else {
                None
            };
            let wg = ld.matrix(&b("ffn_gate.weight"))?;
            let wu = ld.matrix(&b("ffn_up.weight"))?;
            let w_gate_up = Matrix::vstack(&[&wg, &wu])?;
            drop((wg, wu));
            layers.push(Layer {
                attn_norm: ld.vector(&b("attn_norm.weight"))?,
                wqkv: backend.matrix(wqkv)?,
                bqkv,
                q_norm: ld.vector_opt(&b("attn_q_norm.weight"), cfg.arch.qk_norm())?,
                k_norm: ld.vector_opt(&b("attn_k_norm.weight"), cfg.arch.qk_norm())?,
                wo: backend.matrix(ld.matrix(&b("attn_output.weight"))?)?,
                ffn_norm: ld.vector(&b("ffn_norm.weight"))?,
                w_gate_up: backend.matrix(w_gate_up)?,
                w_down: backend.matrix(ld.matrix(&b("ffn_down.weight"))?)?,
            });
        }
        let embed = backend.matrix(ld.matrix("token_embd.weight")?)?;
        let output = if cfg.tied_embeddings { None } else { Some(backend.matrix(ld.matrix("output.weight")?)?) };
        let out_norm = ld.vector("output_norm.weight")?;
        let shape = cfg.attn_shape();
        Ok(Self { cfg, backend, embed, output, out_norm, layers, rope, shape, profile: OpProfile::default() })
    }
}
