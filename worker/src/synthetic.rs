//! Synthetic models: the shape of a known model (`llama-3.1-8b`, `qwen3-14b`, ...) with random
//! weights built in memory, no file and no download, so that TTFT studies of large shapes run
//! anywhere (`--model synthetic:SHAPE[:LAYERS]`; `:LAYERS` keeps that many blocks, so that an 8B
//! shape fits a small machine). The tokenizer and chat template are the default model's.
//! Answers are meaningless; times are real.
//!
//! [`SHAPES`] is also the table of `bench project` (`flowprefill_lab::project::Shape::builtin`).

use crate::config::{Arch, ModelConfig};
use crate::error::{Result, WorkerError};
use flowprefill_kernels::matmul::Matrix;
use rayon::prelude::*;

/// A known model's shape: what its published `config.json` says, as the [`ModelConfig`] a GGUF
/// of it would give (its `name` empty: the shape's own is [`KnownShape::name`]).
#[derive(Clone, Debug, PartialEq)]
pub struct KnownShape {
    /// Name (`--model synthetic:NAME`, `bench project --shape NAME`).
    pub name: &'static str,
    /// The hyper-parameters.
    pub config: ModelConfig,
    /// Where the numbers come from.
    pub source: &'static str,
}

const fn shape(
    name: &'static str,
    arch: Arch,
    dims: [usize; 8],
    rope_base: f64,
    tied_embeddings: bool,
    source: &'static str,
) -> KnownShape {
    let [n_layers, d_model, n_heads, n_kv_heads, head_dim, ffn_dim, vocab_size, context_length] = dims;
    let config = ModelConfig {
        arch,
        name: String::new(),
        n_layers,
        d_model,
        n_heads,
        n_kv_heads,
        head_dim,
        ffn_dim,
        vocab_size,
        context_length,
        rope_base,
        rope_dim: head_dim,
        rope_linear_factor: 1.0,
        rms_eps: 1e-5,
        tied_embeddings,
    };
    KnownShape { name, config, source }
}

impl KnownShape {
    /// Its hyper-parameters under its own name.
    pub fn named_config(&self) -> ModelConfig {
        ModelConfig { name: self.name.to_string(), ..self.config.clone() }
    }
}

/// Every known shape: `[layers, d_model, heads, KV heads, head_dim, FFN, vocabulary, context]`,
/// each from the model's published `config.json`.
pub const SHAPES: &[KnownShape] = &[
    shape(
        "smollm2-135m",
        Arch::Llama,
        [30, 576, 9, 3, 64, 1536, 49152, 8192],
        100_000.0,
        true,
        "HuggingFaceTB/SmolLM2-135M-Instruct config.json",
    ),
    shape(
        "qwen2.5-0.5b",
        Arch::Qwen2,
        [24, 896, 14, 2, 64, 4864, 151936, 32768],
        1_000_000.0,
        true,
        "Qwen/Qwen2.5-Coder-0.5B-Instruct config.json",
    ),
    shape(
        "llama-3.1-8b",
        Arch::Llama,
        [32, 4096, 32, 8, 128, 14336, 128256, 131072],
        500_000.0,
        false,
        "meta-llama/Llama-3.1-8B config.json",
    ),
    shape(
        "qwen2.5-7b",
        Arch::Qwen2,
        [28, 3584, 28, 4, 128, 18944, 152064, 32768],
        1_000_000.0,
        false,
        "Qwen/Qwen2.5-7B-Instruct config.json",
    ),
    shape(
        "qwen3-8b",
        Arch::Qwen3,
        [36, 4096, 32, 8, 128, 12288, 151936, 40960],
        1_000_000.0,
        false,
        "Qwen/Qwen3-8B config.json",
    ),
    shape(
        "qwen3-14b",
        Arch::Qwen3,
        [40, 5120, 40, 8, 128, 17408, 151936, 40960],
        1_000_000.0,
        false,
        "Qwen/Qwen3-14B config.json",
    ),
    shape(
        "qwen3-32b",
        Arch::Qwen3,
        [64, 5120, 64, 8, 128, 25600, 151936, 40960],
        1_000_000.0,
        false,
        "Qwen/Qwen3-32B config.json",
    ),
    shape(
        "llama-3.1-70b",
        Arch::Llama,
        [80, 8192, 64, 8, 128, 28672, 128256, 131072],
        500_000.0,
        false,
        "meta-llama/Llama-3.1-70B config.json",
    ),
];

/// A known shape by name (case-insensitive).
pub fn known(name: &str) -> Option<&'static KnownShape> {
    let key = name.trim().to_ascii_lowercase();
    SHAPES.iter().find(|s| s.name == key)
}

/// Names of the known shapes.
pub fn known_names() -> Vec<&'static str> {
    SHAPES.iter().map(|s| s.name).collect()
}

/// What a `--model synthetic:...` value names.
pub const PREFIX: &str = "synthetic:";

/// A synthetic model: a known shape, and how many of its blocks to build.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SyntheticSpec {
    /// The shape.
    pub shape: &'static KnownShape,
    /// Blocks built (at most the shape's).
    pub layers: usize,
}

impl SyntheticSpec {
    /// Parses `synthetic:SHAPE[:LAYERS]`; `None` when `spec` does not start with `synthetic:`.
    pub fn parse(spec: &str) -> Option<Result<Self>> {
        let rest = spec.strip_prefix(PREFIX)?;
        let bad = |detail: String| WorkerError::Input(crate::error::InputError::new(crate::Field::Model, detail));
        let (name, layers) = match rest.split_once(':') {
            Some((n, l)) => (n, Some(l)),
            None => (rest, None),
        };
        let Some(shape) = known(name) else {
            return Some(Err(bad(format!(
                "`{spec}`: no shape `{name}`; known: {} (as synthetic:SHAPE or synthetic:SHAPE:LAYERS)",
                known_names().join(", ")
            ))));
        };
        let layers = match layers {
            None => shape.config.n_layers,
            Some(l) => match l.trim().parse::<usize>() {
                Ok(n) if (1..=shape.config.n_layers).contains(&n) => n,
                _ => {
                    return Some(Err(bad(format!(
                        "`{spec}`: the layer count must be a whole number from 1 to {} ({} has {} layers)",
                        shape.config.n_layers, shape.name, shape.config.n_layers
                    ))))
                }
            },
        };
        Some(Ok(Self { shape, layers }))
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> ModelConfig {
        ModelConfig { name: self.name(), n_layers: self.layers, ..self.shape.config.clone() }
    }

    /// `synthetic:llama-3.1-8b:2`.
    pub fn name(&self) -> String {
        if self.layers == self.shape.config.n_layers {
            format!("{PREFIX}{}", self.shape.name)
        } else {
            format!("{PREFIX}{}:{}", self.shape.name, self.layers)
        }
    }

    /// The line every output that loads it prints.
    pub fn notice(&self) -> String {
        format!(
            "{}: random weights of the {} shape ({} of {} layers): answers are meaningless, times are real",
            self.name(),
            self.shape.name,
            self.layers,
            self.shape.config.n_layers
        )
    }
}

/// The seed of every synthetic model's weights (the same model in every process and rank).
pub const SEED: u64 = 0x5eed_f10e;

/// Standard deviation of the random weights (the usual initialisation): activations stay finite
/// through any number of pre-norm blocks.
pub const WEIGHT_STD: f32 = 0.02;

/// `rows x cols` values uniform in (-a, a) with standard deviation `std`, from `seed`: the same
/// values for the same seed on any number of threads (each block of 64K values has its own
/// generator, split from the seed).
pub fn random_values(len: usize, seed: u64, std: f32) -> Vec<f32> {
    const BLOCK: usize = 1 << 16;
    let a = std * 3f32.sqrt();
    let mut v = vec![0f32; len];
    v.par_chunks_mut(BLOCK).enumerate().for_each(|(b, chunk)| {
        let mut s = splitmix(seed ^ splitmix(b as u64 + 1));
        for x in chunk {
            s = splitmix(s);
            // The top 24 bits as a fraction in [0, 1).
            let u = (s >> 40) as f32 / (1u64 << 24) as f32;
            *x = (2.0 * u - 1.0) * a;
        }
    });
    v
}

/// A random `rows x cols` weight matrix (see [`random_values`]).
pub fn random_matrix(rows: usize, cols: usize, seed: u64) -> Result<Matrix> {
    Ok(Matrix::new(rows, cols, random_values(rows * cols, seed, WEIGHT_STD))?)
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_with_clear_errors() {
        let s = SyntheticSpec::parse("synthetic:llama-3.1-8b:2").unwrap().unwrap();
        assert_eq!((s.shape.name, s.layers), ("llama-3.1-8b", 2));
        assert_eq!(s.name(), "synthetic:llama-3.1-8b:2");
        let full = SyntheticSpec::parse("synthetic:Qwen3-14B").unwrap().unwrap();
        assert_eq!(full.layers, 40);
        assert!(SyntheticSpec::parse("model.gguf").is_none());
        let e = SyntheticSpec::parse("synthetic:gpt-5").unwrap().unwrap_err().to_string();
        assert!(e.contains("no shape `gpt-5`") && e.contains("llama-3.1-8b"), "{e}");
        let e = SyntheticSpec::parse("synthetic:llama-3.1-8b:40").unwrap().unwrap_err().to_string();
        assert!(e.contains("from 1 to 32"), "{e}");
        assert!(SyntheticSpec::parse("synthetic:llama-3.1-8b:0").unwrap().is_err());
        let c = s.config();
        assert_eq!((c.n_layers, c.d_model, c.vocab_size, c.arch), (2, 4096, 128256, Arch::Llama));
        assert!(s.notice().contains("answers are meaningless"));
    }

    #[test]
    fn random_values_are_seeded_centred_and_scaled() {
        let a = random_values(300_000, 7, WEIGHT_STD);
        assert_eq!(a, random_values(300_000, 7, WEIGHT_STD), "the same seed, the same values");
        assert_ne!(a[..100], random_values(300_000, 8, WEIGHT_STD)[..100]);
        let n = a.len() as f64;
        let mean = a.iter().map(|&x| x as f64).sum::<f64>() / n;
        let std = (a.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
        assert!(mean.abs() < 1e-3, "{mean}");
        assert!((std - WEIGHT_STD as f64).abs() < 1e-3, "{std}");
    }
}
