//! The dimensions of a model, without its weights: what the work accounting needs.

use super::ProjectError;
use flowprefill_worker::config::ModelConfig;

/// Dimensions of a decoder-only transformer (grouped-query attention, gated MLP).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Shape {
    /// Name for tables.
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
    /// Vocabulary size.
    pub vocab_size: usize,
}

/// `(name, layers, d_model, heads, kv heads, head dim, ffn, vocab, source)`.
type BuiltinShape = (&'static str, usize, usize, usize, usize, usize, usize, usize, &'static str);

/// Built-in shapes. Every number is the model's published `config.json`.
const BUILTIN: &[BuiltinShape] = &[
    ("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, "HuggingFaceTB/SmolLM2-135M-Instruct config.json"),
    ("qwen2.5-0.5b", 24, 896, 14, 2, 64, 4864, 151936, "Qwen/Qwen2.5-Coder-0.5B-Instruct config.json"),
    ("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256, "meta-llama/Llama-3.1-8B config.json"),
    ("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064, "Qwen/Qwen2.5-7B-Instruct config.json"),
    ("qwen3-8b", 36, 4096, 32, 8, 128, 12288, 151936, "Qwen/Qwen3-8B config.json"),
    ("qwen3-14b", 40, 5120, 40, 8, 128, 17408, 151936, "Qwen/Qwen3-14B config.json"),
    ("qwen3-32b", 64, 5120, 64, 8, 128, 25600, 151936, "Qwen/Qwen3-32B config.json"),
    ("llama-3.1-70b", 80, 8192, 64, 8, 128, 28672, 128256, "meta-llama/Llama-3.1-70B config.json"),
];

impl Shape {
    /// The shape of a loaded model.
    pub fn of_config(c: &ModelConfig) -> Self {
        Self {
            name: c.name.clone(),
            n_layers: c.n_layers,
            d_model: c.d_model,
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
            ffn_dim: c.ffn_dim,
            vocab_size: c.vocab_size,
        }
    }

    /// A built-in shape by name (see [`Shape::builtin_names`]).
    pub fn builtin(name: &str) -> Result<Self, ProjectError> {
        let key = name.trim().to_ascii_lowercase();
        BUILTIN
            .iter()
            .find(|b| b.0 == key)
            .map(|&(name, n_layers, d_model, n_heads, n_kv_heads, head_dim, ffn_dim, vocab_size, _)| Self {
                name: name.to_string(),
                n_layers,
                d_model,
                n_heads,
                n_kv_heads,
                head_dim,
                ffn_dim,
                vocab_size,
            })
            .ok_or_else(|| ProjectError::UnknownShape {
                name: name.to_string(),
                known: Self::builtin_names().join(", "),
            })
    }

    /// Names of the built-in shapes with the source of their numbers.
    pub fn builtin_names() -> Vec<&'static str> {
        BUILTIN.iter().map(|b| b.0).collect()
    }

    /// Where a built-in shape's numbers come from.
    pub fn builtin_source(name: &str) -> Option<&'static str> {
        BUILTIN.iter().find(|b| b.0 == name).map(|b| b.8)
    }

    /// Width of all query heads.
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// Width of all key (or value) heads.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Weights of one block, in parameters: fused QKV, output projection, gate+up, down.
    pub fn layer_params(&self) -> f64 {
        let (d, q, kv, f) = (self.d_model as f64, self.q_dim() as f64, self.kv_dim() as f64, self.ffn_dim as f64);
        d * (q + 2.0 * kv) + q * d + 2.0 * f * d + f * d
    }

    /// GEMM FLOPs of one row through one block (2 per multiply-add).
    pub fn gemm_flops_per_row_layer(&self) -> f64 {
        2.0 * self.layer_params()
    }

    /// GEMM FLOPs of one row of logits.
    pub fn logits_flops_per_row(&self) -> f64 {
        2.0 * self.d_model as f64 * self.vocab_size as f64
    }

    /// Elements one row moves through the non-GEMM ops of one block (two RMSNorms, RoPE on
    /// Q and K, the gated activation, two residual adds; each read and written once).
    pub fn other_elems_per_row_layer(&self) -> f64 {
        let (d, q, kv, f) = (self.d_model as f64, self.q_dim() as f64, self.kv_dim() as f64, self.ffn_dim as f64);
        2.0 * (2.0 * d) + 2.0 * (q + kv) + 3.0 * f + 2.0 * (3.0 * d)
    }
}
