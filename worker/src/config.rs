//! Model hyper-parameters, read from GGUF metadata, and the tensor names each architecture has.

use crate::error::{Result, WorkerError};
use crate::gguf::GgufFile;
use flowprefill_kernels::attention::AttnShape;
use flowprefill_kernels::rope::RopeStyle;

/// Supported decoder architectures (`general.architecture`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// Llama 2/3, SmolLM2: pre-norm, SwiGLU, RoPE with interleaved pairs in GGUF.
    Llama,
    /// Qwen2/2.5: as llama plus Q/K/V biases; NeoX RoPE.
    Qwen2,
    /// Qwen3: as llama plus a per-head RMSNorm on Q and K before RoPE; NeoX RoPE.
    Qwen3,
}

impl Arch {
    /// Parses `general.architecture`.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "llama" => Some(Self::Llama),
            "qwen2" => Some(Self::Qwen2),
            "qwen3" => Some(Self::Qwen3),
            _ => None,
        }
    }

    /// The metadata prefix.
    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
        }
    }

    /// Pairing used by RoPE for this architecture's GGUF layout.
    pub fn rope_style(self) -> RopeStyle {
        match self {
            // llama.cpp's converter permutes Llama's Q/K rows into interleaved pairs.
            Self::Llama => RopeStyle::Interleaved,
            Self::Qwen2 | Self::Qwen3 => RopeStyle::Neox,
        }
    }

    /// Q/K/V projections carry biases.
    pub fn qkv_bias(self) -> bool {
        matches!(self, Self::Qwen2)
    }

    /// Q and K get a per-head RMSNorm before RoPE.
    pub fn qk_norm(self) -> bool {
        matches!(self, Self::Qwen3)
    }
}

/// Hyper-parameters of a loaded model.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ModelConfig {
    /// Architecture.
    pub arch: Arch,
    /// `general.name`, if any.
    pub name: String,
    /// Transformer blocks.
    pub n_layers: usize,
    /// Hidden size.
    pub d_model: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// Feed-forward inner size.
    pub ffn_dim: usize,
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: usize,
    /// Context window the model was trained for.
    pub context_length: usize,
    /// RoPE base frequency.
    pub rope_base: f64,
    /// Rotated dimensions per head.
    pub rope_dim: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// The output projection is the embedding matrix.
    pub tied_embeddings: bool,
}

impl ModelConfig {
    /// Reads the hyper-parameters of a GGUF file and checks they are consistent.
    pub fn from_gguf(f: &GgufFile) -> Result<Self> {
        if f.get_str("general.name").ok() == Some(crate::gguf_write::TOKENIZER_ONLY) {
            return Err(WorkerError::ModelFile {
                path: f.path().to_path_buf(),
                detail: "it holds a tokenizer and no model (`flowprefill write-gguf --tokenizer-only` writes \
                         these): give it as `--tokenizer` beside `--model synthetic:SHAPE`, or give a model's GGUF"
                    .into(),
            });
        }
        let arch_name = f.get_str("general.architecture")?;
        let arch = Arch::from_name(arch_name).ok_or_else(|| WorkerError::UnsupportedArch {
            path: f.path().to_path_buf(),
            arch: arch_name.to_string(),
        })?;
        let p = arch.name();
        let key = |k: &str| format!("{p}.{k}");
        let n_layers = f.get_usize(&key("block_count"))?;
        let d_model = f.get_usize(&key("embedding_length"))?;
        let n_heads = f.get_usize(&key("attention.head_count"))?;
        let n_kv_heads = f.get_usize_opt(&key("attention.head_count_kv"))?.unwrap_or(n_heads);
        let head_dim = match f.get_usize_opt(&key("attention.key_length"))? {
            Some(h) => h,
            None if n_heads > 0 => d_model / n_heads,
            None => 0,
        };
        let ffn_dim = f.get_usize(&key("feed_forward_length"))?;
        let context_length = f.get_usize(&key("context_length"))?;
        let rope_base = f.get_f64_opt(&key("rope.freq_base"))?.unwrap_or(10_000.0);
        let rope_dim = f.get_usize_opt(&key("rope.dimension_count"))?.unwrap_or(head_dim);
        let rms_eps = f.get_f64(&key("attention.layer_norm_rms_epsilon"))? as f32;
        let vocab_size = f.tensor_shape("token_embd.weight").and_then(|s| s.first().copied()).ok_or_else(|| {
            WorkerError::UnsupportedTensor {
                path: f.path().to_path_buf(),
                name: "token_embd.weight".into(),
                detail: "missing from the file".into(),
            }
        })?;
        let cfg = Self {
            arch,
            name: f.get_str("general.name").unwrap_or("").to_string(),
            n_layers,
            d_model,
            n_heads,
            n_kv_heads,
            head_dim,
            ffn_dim,
            vocab_size,
            context_length,
            rope_base,
            rope_dim,
            rms_eps,
            tied_embeddings: !f.has_tensor("output.weight"),
        };
        cfg.validate(f)?;
        Ok(cfg)
    }

    fn validate(&self, f: &GgufFile) -> Result<()> {
        let err = |key: &str, detail: String| WorkerError::Metadata {
            path: f.path().to_path_buf(),
            key: format!("{}.{key}", self.arch.name()),
            detail,
        };
        if self.n_layers == 0 || self.d_model == 0 || self.ffn_dim == 0 || self.head_dim == 0 {
            return Err(err("block_count", "layer count, hidden size, FFN size and head size must be positive".into()));
        }
        if self.n_kv_heads == 0 || !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(err(
                "attention.head_count_kv",
                format!("{} query heads are not a multiple of {} KV heads", self.n_heads, self.n_kv_heads),
            ));
        }
        if self.rope_dim > self.head_dim || !self.rope_dim.is_multiple_of(2) {
            return Err(err(
                "rope.dimension_count",
                format!("{} must be even and at most the head size {}", self.rope_dim, self.head_dim),
            ));
        }
        // Every tensor must be one this implementation reads, with the expected shape.
        let expected = self.expected_tensors(f);
        for name in f.tensor_names() {
            let Some(want) = expected.iter().find(|(n, _)| *n == name).map(|(_, s)| s) else {
                return Err(WorkerError::UnsupportedTensor {
                    path: f.path().to_path_buf(),
                    detail: format!(
                        "not part of a dense {} model as flowprefill implements it (is this a MoE or \
                         multimodal model?)",
                        self.arch.name()
                    ),
                    name,
                });
            };
            let got = f.tensor_shape(&name).unwrap_or_default();
            if &got != want {
                return Err(WorkerError::UnsupportedTensor {
                    path: f.path().to_path_buf(),
                    detail: format!("shape {got:?} does not match the metadata, which implies {want:?}"),
                    name,
                });
            }
        }
        for (name, _) in &expected {
            let optional = name == "output.weight" || name == "rope_freqs.weight";
            if !optional && !f.has_tensor(name) {
                return Err(WorkerError::UnsupportedTensor {
                    path: f.path().to_path_buf(),
                    name: name.clone(),
                    detail: "missing from the file".into(),
                });
            }
        }
        Ok(())
    }

    /// Every tensor name this architecture may have, with its shape (`[out, in]` for linears).
    fn expected_tensors(&self, _f: &GgufFile) -> Vec<(String, Vec<usize>)> {
        let (d, q, kv, ffn) = (self.d_model, self.q_dim(), self.kv_dim(), self.ffn_dim);
        let mut v = vec![
            ("token_embd.weight".to_string(), vec![self.vocab_size, d]),
            ("output_norm.weight".to_string(), vec![d]),
            ("output.weight".to_string(), vec![self.vocab_size, d]),
        ];
        if self.arch == Arch::Llama {
            v.push(("rope_freqs.weight".to_string(), vec![self.rope_dim / 2]));
        }
        for l in 0..self.n_layers {
            let b = |n: &str| format!("blk.{l}.{n}");
            v.push((b("attn_norm.weight"), vec![d]));
            v.push((b("attn_q.weight"), vec![q, d]));
            v.push((b("attn_k.weight"), vec![kv, d]));
            v.push((b("attn_v.weight"), vec![kv, d]));
            v.push((b("attn_output.weight"), vec![d, q]));
            v.push((b("ffn_norm.weight"), vec![d]));
            v.push((b("ffn_gate.weight"), vec![ffn, d]));
            v.push((b("ffn_up.weight"), vec![ffn, d]));
            v.push((b("ffn_down.weight"), vec![d, ffn]));
            if self.arch.qkv_bias() {
                v.push((b("attn_q.bias"), vec![q]));
                v.push((b("attn_k.bias"), vec![kv]));
                v.push((b("attn_v.bias"), vec![kv]));
            }
            if self.arch.qk_norm() {
                v.push((b("attn_q_norm.weight"), vec![self.head_dim]));
                v.push((b("attn_k_norm.weight"), vec![self.head_dim]));
            }
        }
        v
    }

    /// Head layout for attention.
    pub fn attn_shape(&self) -> AttnShape {
        AttnShape {
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            scale: 1.0 / (self.head_dim as f32).sqrt(),
        }
    }

    /// Values per token of Q.
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// Values per token of K (and of V).
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// f32 bytes of K and V per token over all layers.
    pub fn kv_bytes_per_token(&self) -> usize {
        2 * self.kv_dim() * self.n_layers * std::mem::size_of::<f32>()
    }
}
