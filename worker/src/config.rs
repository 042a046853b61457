//! Model hyper-parameters, read from GGUF metadata, and the tensor names each architecture has.

use crate::error::{Result, WorkerError};
use crate::gguf::GgufFile;
use flowprefill_kernels::attention::AttnShape;
use flowprefill_kernels::rope::RopeStyle;
use std::collections::HashMap;

/// `general.name` of a tokenizer-only file ([`crate::gguf_write::write_tokenizer`]'s): no
/// model's configuration, a tokenizer for synthetic models.
pub const TOKENIZER_ONLY: &str = "flowprefill tokenizer only (no weights: for synthetic models' --tokenizer)";

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

/// The linear RoPE scaling factor of a GGUF's metadata (`ARCH.rope.scaling.type`, `.factor`,
/// or the older `ARCH.rope.scale_linear`), as llama.cpp reads them: no type means linear, a
/// factor of 0 or none means 1, type `none` means 1. YaRN, LongRoPE or any other type with a
/// factor other than 1 is refused (flowprefill computes plain RoPE at scaled positions only):
/// running it as plain RoPE would place every token at a wrong angle, silently.
fn rope_scaling(f: &GgufFile, arch: &str) -> Result<f64> {
    let type_key = format!("{arch}.rope.scaling.type");
    let kind = match f.get(&type_key) {
        None => None,
        Some(_) => Some(f.get_str(&type_key)?.trim().to_ascii_lowercase()),
    };
    let mut factor_key = format!("{arch}.rope.scaling.factor");
    let mut factor = f.get_f64_opt(&factor_key)?;
    if factor.is_none() {
        factor_key = format!("{arch}.rope.scale_linear");
        factor = f.get_f64_opt(&factor_key)?;
    }
    let factor = match factor {
        None => 1.0,
        Some(0.0) => 1.0,
        Some(x) if x.is_finite() && x > 0.0 => x,
        Some(x) => {
            return Err(WorkerError::Metadata {
                path: f.path().to_path_buf(),
                key: factor_key,
                detail: format!("{x} must be a positive number (1 or absent: no scaling)"),
            })
        }
    };
    match kind.as_deref() {
        None | Some("linear") => Ok(factor),
        Some("none") => Ok(1.0),
        Some(_) if factor == 1.0 => Ok(1.0),
        Some(other) => {
            let trained = f
                .get_usize_opt(&format!("{arch}.rope.scaling.original_context_length"))
                .ok()
                .flatten()
                .map_or(String::new(), |n| format!(", over a native context of {n} positions"));
            Err(WorkerError::ModelFile {
                path: f.path().to_path_buf(),
                detail: format!(
                    "RoPE scaling `{other}` (factor {factor}{trained}) is not implemented: flowprefill \
                     computes plain RoPE and linear scaling only, and would place every token at a wrong \
                     angle; give a GGUF converted without `rope_scaling` (the model at its native context), \
                     or with linear scaling"
                ),
            })
        }
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
    /// Linear RoPE position scaling (GGUF `ARCH.rope.scaling.type = linear` with
    /// `ARCH.rope.scaling.factor`): positions are divided by it. 1 when the file has none.
    pub rope_linear_factor: f64,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// The output projection is the embedding matrix.
    pub tied_embeddings: bool,
}

impl ModelConfig {
    /// Reads the hyper-parameters of a GGUF file and checks they are consistent.
    pub fn from_gguf(f: &GgufFile) -> Result<Self> {
        if f.get_str("general.name").ok() == Some(TOKENIZER_ONLY) {
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
        let rope_linear_factor = rope_scaling(f, p)?;
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
            rope_linear_factor,
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
        if self.n_layers == 0 || self.d_model == 0 || self.ffn_dim == 0 {
            return Err(err("block_count", "layer count, hidden size and FFN size must be positive".into()));
        }
        if self.n_heads == 0 {
            return Err(err("attention.head_count", "0 query heads: the model must have at least one".into()));
        }
        if self.n_kv_heads == 0 || !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(err(
                "attention.head_count_kv",
                format!(
                    "{} query heads are not a multiple of {} KV heads (KV heads must be positive and divide \
                     the query heads)",
                    self.n_heads, self.n_kv_heads
                ),
            ));
        }
        if self.head_dim == 0 {
            return Err(err("attention.key_length", "the head size is 0: it must be positive".into()));
        }
        if self.n_heads.checked_mul(self.head_dim).is_none() {
            return Err(err(
                "attention.key_length",
                format!("{} heads of {} values overflow a count", self.n_heads, self.head_dim),
            ));
        }
        if !(self.rms_eps.is_finite() && self.rms_eps > 0.0) {
            return Err(err(
                "attention.layer_norm_rms_epsilon",
                format!("{} must be a positive number (as f32; about 1e-5 or 1e-6)", self.rms_eps),
            ));
        }
        if !(self.rope_base.is_finite() && self.rope_base > 0.0) {
            return Err(err("rope.freq_base", format!("{} must be a positive number", self.rope_base)));
        }
        if self.rope_dim > self.head_dim || !self.rope_dim.is_multiple_of(2) {
            return Err(err(
                "rope.dimension_count",
                format!("{} must be even and at most the head size {}", self.rope_dim, self.head_dim),
            ));
        }
        // Bound the layer count by the tensors the file has before listing the names it implies
        // (a 3 KB file claiming 400,000,000 layers would otherwise list 3.6 billion names).
        let per_layer = 9 + 3 * usize::from(self.arch.qkv_bias()) + 2 * usize::from(self.arch.qk_norm());
        let have = f.tensor_count();
        let need = self.n_layers.checked_mul(per_layer).and_then(|n| n.checked_add(2));
        if need.is_none_or(|need| need > have) {
            return Err(err(
                "block_count",
                format!(
                    "{} layers need {} tensors ({per_layer} per layer, the embedding and the output norm) but the \
                     file has {have}: the metadata does not describe this file's tensors (corrupt; download \
                     or write it again)",
                    self.n_layers,
                    need.map_or("more than can be counted".to_string(), |n| format!("at least {n}")),
                ),
            ));
        }
        // Every tensor must be one this implementation reads, with the expected shape.
        let expected = self.expected_tensors();
        let shapes: HashMap<&str, &Vec<usize>> = expected.iter().map(|(n, s)| (n.as_str(), s)).collect();
        for name in f.tensor_names() {
            let Some(&want) = shapes.get(name.as_str()) else {
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
        // And its bytes must be in the file (before anything is allocated for them).
        for name in f.tensor_names() {
            f.tensor_extent(&name)?;
        }
        Ok(())
    }

    /// Values of the weights the model holds once loaded (the output matrix where it is not the
    /// embedding's): times the backend's bytes per weight, the least that loading it takes.
    pub fn weight_elements(&self) -> usize {
        let held = |n: &str| n != "rope_freqs.weight" && !(self.tied_embeddings && n == "output.weight");
        self.expected_tensors()
            .iter()
            .filter(|(n, _)| held(n))
            .map(|(_, s)| s.iter().product::<usize>())
            .fold(0, usize::saturating_add)
    }

    /// Every tensor name this architecture may have, with its shape (`[out, in]` for linears).
    fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf_write::testfile::TestGguf;
    use candle_core::quantized::gguf_file::Value;

    fn load(g: TestGguf, tag: &str) -> Result<ModelConfig> {
        let f = g.write(tag);
        ModelConfig::from_gguf(&GgufFile::open(f.path())?)
    }

    fn metadata_error(r: Result<ModelConfig>, key: &str) -> String {
        match r {
            Err(e @ WorkerError::Metadata { .. }) if e.to_string().contains(key) => e.to_string(),
            other => panic!("expected a metadata error about {key}, got {other:?}"),
        }
    }

    #[test]
    fn a_huge_block_count_is_refused_before_listing_tensor_names() {
        // 3,000,000 layers in a file of 11 tensors took 15 s and 3.4 GB to list the names it
        // implies; 400,000,000 aborted on allocation. Now: refused at once, by the tensor count.
        for n in [3_000_000u64, 400_000_000, u64::MAX / 2] {
            let t = std::time::Instant::now();
            let e =
                metadata_error(load(TestGguf::tiny().set("llama.block_count", Value::U64(n)), "layers"), "block_count");
            assert!(e.contains("the file has 11"), "{e}");
            assert!(t.elapsed().as_secs_f64() < 5.0, "{n} layers took {:?}", t.elapsed());
        }
        // Two layers in a file of one: also by the count (not 9 "missing" tensors one by one).
        let e =
            metadata_error(load(TestGguf::tiny().set("llama.block_count", Value::U32(2)), "layers2"), "block_count");
        assert!(e.contains("20 tensors"), "{e}");
    }

    #[test]
    fn head_layouts_that_would_divide_by_zero_are_refused() {
        // head_count = 0 passed (0 % 1 == 0) and panicked in the attention kernel.
        let cases: [(&str, Value, &str); 5] = [
            ("llama.attention.head_count", Value::U32(0), "head_count"),
            ("llama.attention.head_count_kv", Value::U32(0), "head_count_kv"),
            ("llama.attention.head_count_kv", Value::U32(4), "head_count_kv"),
            ("llama.attention.key_length", Value::U32(0), "key_length"),
            ("llama.attention.layer_norm_rms_epsilon", Value::F32(0.0), "rms_epsilon"),
        ];
        for (key, v, named) in cases {
            metadata_error(load(TestGguf::tiny().set(key, v), "heads"), named);
        }
        for eps in [f32::NAN, -1e-5, f32::INFINITY] {
            let g = TestGguf::tiny().set("llama.attention.layer_norm_rms_epsilon", Value::F32(eps));
            metadata_error(load(g, "eps"), "rms_epsilon");
        }
        let g = TestGguf::tiny().set("llama.rope.freq_base", Value::F32(0.0));
        metadata_error(load(g, "base"), "freq_base");
    }

    #[test]
    fn rope_scaling_is_read_linear_applied_others_refused() {
        let s = |v: &str| Value::String(v.into());
        let with = |kvs: &[(&str, Value)]| {
            kvs.iter().fold(TestGguf::tiny(), |g, (k, v)| g.set(&format!("llama.rope.{k}"), v.clone()))
        };
        let factor = |kvs: &[(&str, Value)]| load(with(kvs), "rope").map(|c| c.rope_linear_factor);
        assert_eq!(factor(&[]).unwrap(), 1.0);
        assert_eq!(factor(&[("scaling.type", s("linear")), ("scaling.factor", Value::F32(4.0))]).unwrap(), 4.0);
        // As llama.cpp: no type is linear, the old key counts, 0 is none, `none` ignores the factor.
        assert_eq!(factor(&[("scaling.factor", Value::F32(2.0))]).unwrap(), 2.0);
        assert_eq!(factor(&[("scale_linear", Value::F32(8.0))]).unwrap(), 8.0);
        assert_eq!(factor(&[("scaling.type", s("linear")), ("scaling.factor", Value::F32(0.0))]).unwrap(), 1.0);
        assert_eq!(factor(&[("scaling.type", s("none")), ("scaling.factor", Value::F32(4.0))]).unwrap(), 1.0);
        // YaRN with factor 1 computes plain RoPE.
        assert_eq!(factor(&[("scaling.type", s("yarn")), ("scaling.factor", Value::F32(1.0))]).unwrap(), 1.0);
        for kind in ["yarn", "longrope", "su"] {
            let e = factor(&[
                ("scaling.type", s(kind)),
                ("scaling.factor", Value::F32(4.0)),
                ("scaling.original_context_length", Value::U32(32768)),
            ])
            .unwrap_err();
            let msg = e.to_string();
            assert!(matches!(e, WorkerError::ModelFile { .. }), "{msg}");
            assert!(msg.contains(&format!("`{kind}`")) && msg.contains("32768"), "{msg}");
        }
        let e = factor(&[("scaling.type", s("linear")), ("scaling.factor", Value::F32(-2.0))]).unwrap_err();
        assert!(e.to_string().contains("scaling.factor"), "{e}");
        // The model's RoPE table takes the factor.
        let f = with(&[("scaling.type", s("linear")), ("scaling.factor", Value::F32(4.0))]).write("rope-model");
        let model = crate::Model::load(f.path(), crate::Cpu::default()).unwrap();
        assert_eq!(model.rope().linear_factor(), 4.0);
    }
}
