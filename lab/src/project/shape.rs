//! The dimensions of a model, without its weights: what the work accounting needs. A model's
//! shape is its [`ModelConfig`] (one type for the loaded model, the synthetic one, the memory
//! plan and the projection); this module names the built-in ones and what a projection derives
//! from them ([`Cost`]).

use super::ProjectError;
pub use flowprefill_worker::config::ModelConfig;
use flowprefill_worker::synthetic;

/// The shape of a projected model: its hyper-parameters.
pub type Shape = ModelConfig;

/// A built-in shape by name (see [`builtin_names`]): the table of synthetic models
/// (`flowprefill_worker::synthetic::SHAPES`), so a projection and a synthetic model of the same
/// name have the same dimensions.
pub fn builtin(name: &str) -> Result<Shape, ProjectError> {
    synthetic::known(name)
        .map(synthetic::KnownShape::named_config)
        .ok_or_else(|| ProjectError::UnknownShape { name: name.to_string(), known: builtin_names().join(", ") })
}

/// Names of the built-in shapes.
pub fn builtin_names() -> Vec<&'static str> {
    synthetic::known_names()
}

/// Where a built-in shape's numbers come from.
pub fn builtin_source(name: &str) -> Option<&'static str> {
    synthetic::known(name).map(|k| k.source)
}

/// What the work accounting derives from a shape.
pub trait Cost {
    /// Weights of one block, in parameters: fused QKV, output projection, gate+up, down.
    fn layer_params(&self) -> f64;

    /// GEMM FLOPs of one row through one block (2 per multiply-add).
    fn gemm_flops_per_row_layer(&self) -> f64 {
        2.0 * self.layer_params()
    }

    /// GEMM FLOPs of one row of logits.
    fn logits_flops_per_row(&self) -> f64;

    /// Elements one row moves through the non-GEMM ops of one block (two RMSNorms, RoPE on
    /// Q and K, the gated activation, two residual adds; each read and written once).
    fn other_elems_per_row_layer(&self) -> f64;
}

impl Cost for ModelConfig {
    fn layer_params(&self) -> f64 {
        let (d, q, kv, f) = (self.d_model as f64, self.q_dim() as f64, self.kv_dim() as f64, self.ffn_dim as f64);
        d * (q + 2.0 * kv) + q * d + 2.0 * f * d + f * d
    }

    fn logits_flops_per_row(&self) -> f64 {
        2.0 * self.d_model as f64 * self.vocab_size as f64
    }

    fn other_elems_per_row_layer(&self) -> f64 {
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
            let table = builtin(k.name).expect("builtin");
            assert_eq!(ModelConfig { name: table.name.clone(), ..spec.config() }, table, "{}", k.name);
            assert!(builtin_source(k.name).is_some_and(|s| s.ends_with("config.json")));
        }
        // A few numbers checked against the published configs by hand.
        let l = builtin("llama-3.1-8b").unwrap();
        assert_eq!(
            (l.n_layers, l.d_model, l.n_heads, l.n_kv_heads, l.ffn_dim, l.vocab_size),
            (32, 4096, 32, 8, 14336, 128256)
        );
        let q = builtin("qwen3-14b").unwrap();
        assert_eq!((q.n_layers, q.d_model, q.n_heads, q.n_kv_heads, q.ffn_dim), (40, 5120, 40, 8, 17408));
        assert!(builtin("gpt-5").is_err());
    }
}
