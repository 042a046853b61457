//! The dimensions of a model, without its weights: what the work accounting needs.

use super::ProjectError;
use flowprefill_worker::config::ModelConfig;
use flowprefill_worker::synthetic;

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

    /// The dimensions the memory plan needs (per-head query/key norms not counted: a few bytes
    /// per row).
    pub fn dims(&self) -> flowprefill_coordinator::memory::Dims {
        flowprefill_coordinator::memory::Dims {
            d_model: self.d_model,
            q_dim: self.q_dim(),
            kv_dim: self.kv_dim(),
            n_heads: self.n_heads,
            ffn_dim: self.ffn_dim,
            n_layers: self.n_layers,
            vocab_size: self.vocab_size,
            qk_norm: false,
        }
    }

    /// A built-in shape by name (see [`Shape::builtin_names`]): the table of synthetic models
    /// (`flowprefill_worker::synthetic::SHAPES`), so a projection and a synthetic model of the
    /// same name have the same dimensions.
    pub fn builtin(name: &str) -> Result<Self, ProjectError> {
        synthetic::known(name)
            .map(|k| Self {
                name: k.name.to_string(),
                n_layers: k.n_layers,
                d_model: k.d_model,
                n_heads: k.n_heads,
                n_kv_heads: k.n_kv_heads,
                head_dim: k.head_dim,
                ffn_dim: k.ffn_dim,
                vocab_size: k.vocab_size,
            })
            .ok_or_else(|| ProjectError::UnknownShape {
                name: name.to_string(),
                known: Self::builtin_names().join(", "),
            })
    }

    /// Names of the built-in shapes.
    pub fn builtin_names() -> Vec<&'static str> {
        synthetic::known_names()
    }

    /// Where a built-in shape's numbers come from.
    pub fn builtin_source(name: &str) -> Option<&'static str> {
        synthetic::known(name).map(|k| k.source)
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

#[cfg(test)]
mod tests {
    use super::*;
    use flowprefill_worker::synthetic::{SyntheticSpec, SHAPES};

    #[test]
    fn synthetic_models_have_the_dimensions_of_the_projection_table() {
        for k in SHAPES {
            let spec = SyntheticSpec::parse(&format!("synthetic:{}", k.name)).expect("synthetic").expect("known");
            let from_model = Shape::of_config(&spec.config());
            let table = Shape::builtin(k.name).expect("builtin");
            assert_eq!(Shape { name: table.name.clone(), ..from_model }, table, "{}", k.name);
            assert!(Shape::builtin_source(k.name).is_some_and(|s| s.ends_with("config.json")));
        }
        // A few numbers checked against the published configs by hand.
        let l = Shape::builtin("llama-3.1-8b").unwrap();
        assert_eq!(
            (l.n_layers, l.d_model, l.n_heads, l.n_kv_heads, l.ffn_dim, l.vocab_size),
            (32, 4096, 32, 8, 14336, 128256)
        );
        let q = Shape::builtin("qwen3-14b").unwrap();
        assert_eq!((q.n_layers, q.d_model, q.n_heads, q.n_kv_heads, q.ffn_dim), (40, 5120, 40, 8, 17408));
        assert!(Shape::builtin("gpt-5").is_err());
    }
}
