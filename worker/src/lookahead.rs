//! LookaheadKV adapters (paper 004): learned lookahead rows appended after the prompt, and
//! Lookahead LoRA, low-rank adapters on every projection that are active on those rows only.
//! Their attention to the context predicts the attention the model's answer will pay it.
//!
//! ```text
//!   context | prompt | L1 .. L32          the lookahead rows read the cache, nothing reads them
//!   each projection of a lookahead row:   x W^T + (alpha / r) (x A^T) B^T     A: [r, in], B: [out, r]
//!   importance of context row j:          mean over the rows of their attention to j, summed over
//!                                         the query heads of each KV head (GQA)
//! ```
//! The file is safetensors: `lookahead` (`[rows, d_model]`) and, per layer `L` and projection
//! `P` (q, k, v, o, gate, up, down), `blk.L.P.lora_a` (`[r, in]`) and `blk.L.P.lora_b`
//! (`[out, r]`), all f32, with metadata saying what it was trained for. The tensors in that
//! order ([`tensor_specs`]) are also the layout of the training run's one parameter vector.

use crate::config::ModelConfig;
use crate::error::{Result, WorkerError};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Lookahead rows (the paper's `n_lookahead`).
pub const LOOKAHEAD_ROWS: usize = 32;
/// LoRA rank.
pub const LORA_RANK: usize = 8;
/// LoRA scaling numerator (the update is `alpha / rank` times `B A`).
pub const LORA_ALPHA: f32 = 32.0;

/// A projection that carries a Lookahead LoRA.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Proj {
    /// Queries.
    Q,
    /// Keys.
    K,
    /// Values.
    V,
    /// Attention output.
    O,
    /// Feed-forward gate.
    Gate,
    /// Feed-forward up.
    Up,
    /// Feed-forward down.
    Down,
}

impl Proj {
    /// Every projection, in file order.
    pub const ALL: [Proj; 7] = [Proj::Q, Proj::K, Proj::V, Proj::O, Proj::Gate, Proj::Up, Proj::Down];

    /// Its name in tensor names.
    pub fn name(self) -> &'static str {
        match self {
            Proj::Q => "q",
            Proj::K => "k",
            Proj::V => "v",
            Proj::O => "o",
            Proj::Gate => "gate",
            Proj::Up => "up",
            Proj::Down => "down",
        }
    }

    /// `(inputs, outputs)` of the projection in a model of `cfg`.
    pub fn dims(self, cfg: &ModelConfig) -> (usize, usize) {
        let (d, qd, kvd, ffn) = (cfg.d_model, cfg.q_dim(), cfg.kv_dim(), cfg.ffn_dim);
        match self {
            Proj::Q => (d, qd),
            Proj::K | Proj::V => (d, kvd),
            Proj::O => (qd, d),
            Proj::Gate | Proj::Up => (d, ffn),
            Proj::Down => (ffn, d),
        }
    }
}

/// Name and `[rows, cols]` of every tensor of an adapter with `rows` lookahead rows and LoRA
/// rank `rank` for a model of `cfg`: `lookahead` first, then per layer and projection (in
/// [`Proj::ALL`] order) `lora_a` and `lora_b`.
pub fn tensor_specs(cfg: &ModelConfig, rows: usize, rank: usize) -> Vec<(String, [usize; 2])> {
    let mut out = vec![("lookahead".to_string(), [rows, cfg.d_model])];
    for l in 0..cfg.n_layers {
        for p in Proj::ALL {
            let (i, o) = p.dims(cfg);
            out.push((format!("blk.{l}.{}.lora_a", p.name()), [rank, i]));
            out.push((format!("blk.{l}.{}.lora_b", p.name()), [o, rank]));
        }
    }
    out
}

/// What an adapter file says about itself.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LookaheadMeta {
    /// The model it was trained for ([`crate::adapter::model_fingerprint`]).
    pub model: String,
    /// That model's name, for messages.
    pub model_name: String,
    /// Lookahead rows.
    pub rows: usize,
    /// LoRA rank.
    pub rank: usize,
    /// LoRA alpha.
    pub alpha: f32,
    /// The weights it was trained with (see [`crate::adapter::AdapterMeta::weights`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<String>,
    /// How it was trained (written by `flowprefill train lookahead`).
    #[serde(default)]
    pub training: serde_json::Value,
}

/// A loaded LookaheadKV adapter.
#[derive(Clone, Debug)]
pub struct LookaheadAdapter {
    /// Its description.
    pub meta: LookaheadMeta,
    /// Hidden size of the model it is for.
    pub d_model: usize,
    /// Layers of the model it is for.
    pub n_layers: usize,
    /// Every tensor's values, in [`tensor_specs`] order.
    pub tensors: Vec<Vec<f32>>,
    /// SHA-256 of the values (hex, 16 digits).
    pub hash: String,
    /// Where it was read from (none when made in memory).
    pub path: Option<PathBuf>,
}

const META: &str = "flowprefill.lookahead";

fn bad(path: &Path, detail: impl Into<String>) -> WorkerError {
    WorkerError::Adapter { path: path.to_path_buf(), detail: detail.into() }
}

fn values_hash(tensors: &[Vec<f32>]) -> String {
    let mut h = Sha256::new();
    for x in tensors.iter().flatten() {
        h.update(x.to_le_bytes());
    }
    crate::hex(&h.finalize()[..8])
}

impl LookaheadAdapter {
    /// An adapter for a model of `cfg` from its tensors in [`tensor_specs`] order.
    pub fn new(meta: LookaheadMeta, cfg: &ModelConfig, tensors: Vec<Vec<f32>>) -> Result<Self> {
        let specs = tensor_specs(cfg, meta.rows, meta.rank);
        if meta.rows == 0 || meta.rank == 0 {
            return Err(crate::error::internal("a lookahead adapter needs at least one row and rank 1"));
        }
        if tensors.len() != specs.len() {
            return Err(crate::error::internal(format!(
                "a lookahead adapter for {} layers has {} tensors, got {}",
                cfg.n_layers,
                specs.len(),
                tensors.len()
            )));
        }
        for ((name, [r, c]), t) in specs.iter().zip(&tensors) {
            if t.len() != r * c {
                return Err(crate::error::internal(format!("{name}: {} values for [{r}, {c}]", t.len())));
            }
            if t.iter().any(|x| !x.is_finite()) {
                return Err(crate::error::internal(format!("{name}: values must be finite")));
            }
        }
        let hash = values_hash(&tensors);
        Ok(Self { meta, d_model: cfg.d_model, n_layers: cfg.n_layers, tensors, hash, path: None })
    }

    /// The lookahead rows (`[rows, d_model]`).
    pub fn rows(&self) -> &[f32] {
        &self.tensors[0]
    }

    /// `(A, B)` of projection `p` in layer `l` (`[r, in]`, `[out, r]`).
    pub fn lora(&self, l: usize, p: Proj) -> (&[f32], &[f32]) {
        let i = 1 + 2 * (l * Proj::ALL.len() + Proj::ALL.iter().position(|&q| q == p).unwrap_or(0));
        (&self.tensors[i], &self.tensors[i + 1])
    }

    /// `alpha / rank`.
    pub fn scale(&self) -> f32 {
        self.meta.alpha / self.meta.rank as f32
    }

    /// Refuses an adapter trained for another model (`fingerprint`, `weights`: the model's
    /// [`crate::LoadedModel::fingerprint`] and [`crate::LoadedModel::cache_identity`]).
    pub fn check_model(&self, fingerprint: &str, weights: &str, cfg: &ModelConfig) -> Result<()> {
        let at = self.path.clone().unwrap_or_default();
        let again = "pass the adapter trained for this model (flowprefill train lookahead --model ...)";
        if self.d_model != cfg.d_model || self.n_layers != cfg.n_layers {
            return Err(bad(
                &at,
                format!(
                    "it is for {} layers of width {} but {} has {} of width {}: it was trained for {}; {again}",
                    self.n_layers, self.d_model, cfg.name, cfg.n_layers, cfg.d_model, self.meta.model_name
                ),
            ));
        }
        if self.meta.model != fingerprint {
            return Err(bad(
                &at,
                format!(
                    "it was trained for {} (weights {}), not for {} (weights {fingerprint}); {again}",
                    self.meta.model_name, self.meta.model, cfg.name
                ),
            ));
        }
        crate::adapter::check_weights(&at, self.meta.weights.as_deref(), weights, &self.meta.model_name, "lookahead")
    }

    /// Writes the adapter (safetensors with metadata) through a temporary file.
    pub fn save(&self, path: &Path, cfg: &ModelConfig) -> Result<()> {
        let specs = tensor_specs(cfg, self.meta.rows, self.meta.rank);
        let bytes: Vec<Vec<u8>> =
            self.tensors.iter().map(|t| t.iter().flat_map(|x| x.to_le_bytes()).collect()).collect();
        let mut views = Vec::with_capacity(specs.len());
        for ((name, [r, c]), b) in specs.iter().zip(&bytes) {
            let v = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![*r, *c], b)
                .map_err(|e| bad(path, format!("cannot describe {name}: {e}")))?;
            views.push((name.clone(), v));
        }
        let meta = serde_json::to_string(&self.meta).map_err(|e| bad(path, e.to_string()))?;
        let info = HashMap::from([(META.to_string(), meta)]);
        let data =
            safetensors::serialize(views, Some(info)).map_err(|e| bad(path, format!("cannot serialise: {e}")))?;
        let tmp = path.with_extension(format!("partial.{}", std::process::id()));
        let io = |what: &str| {
            let what = format!("{what} {}", path.display());
            move |source| WorkerError::Io { what, source }
        };
        std::fs::write(&tmp, &data).map_err(io("writing"))?;
        std::fs::rename(&tmp, path).map_err(io("moving into place"))?;
        Ok(())
    }

    /// Reads an adapter file for a model of `cfg`; every way it can be wrong says what to do.
    pub fn load(path: &Path, cfg: &ModelConfig) -> Result<Self> {
        let data = std::fs::read(path).map_err(|e| {
            bad(
                path,
                if e.kind() == std::io::ErrorKind::NotFound {
                    "no such file; give the path of an adapter made by `flowprefill train lookahead`".to_string()
                } else {
                    format!("cannot be read: {e}")
                },
            )
        })?;
        let mut a = Self::from_bytes(&data, path, cfg)?;
        a.path = Some(path.to_path_buf());
        Ok(a)
    }

    /// Parses the bytes of an adapter file (`origin` names it in messages).
    pub fn from_bytes(data: &[u8], origin: &Path, cfg: &ModelConfig) -> Result<Self> {
        let corrupt = |d: String| {
            bad(origin, format!("{d}; the file is not a LookaheadKV adapter or is damaged: train or copy it again"))
        };
        let (st, meta): (_, LookaheadMeta) = crate::adapter::read_with_meta(data, META, &corrupt)?;
        let mut tensors = Vec::new();
        for (name, [r, c]) in tensor_specs(cfg, meta.rows, meta.rank) {
            let t = st.tensor(&name).map_err(|_| {
                if meta.model_name != cfg.name {
                    // Another model's adapter of the same width (fewer layers): say so, not
                    // "damaged".
                    bad(
                        origin,
                        format!(
                            "it was trained for {}, not for {} (it has no `{name}` tensor for its {} layers); pass the \
                             adapter trained for this model (flowprefill train lookahead --model ...)",
                            meta.model_name, cfg.name, cfg.n_layers
                        ),
                    )
                } else {
                    corrupt(format!("no `{name}` tensor (is it for another model than {} layers?)", cfg.n_layers))
                }
            })?;
            if t.dtype() != safetensors::Dtype::F32 || t.shape() != [r, c] {
                return Err(bad(
                    origin,
                    format!(
                        "`{name}` is {:?} {:?}, expected F32 [{r}, {c}]: it was trained for {}, not for {}; \
                         pass the adapter trained for this model",
                        t.dtype(),
                        t.shape(),
                        meta.model_name,
                        cfg.name
                    ),
                ));
            }
            tensors.push(t.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect());
        }
        Self::new(meta, cfg, tensors).map_err(|e| corrupt(e.to_string()))
    }
}

/// The LookaheadKV adapters trained by the project (`adapters/`), built into the binary.
const SHIPPED: &[(&str, &[u8], &str)] = &[
    (
        "adapters/smollm2-135m-instruct.lookahead.safetensors",
        include_bytes!("../../adapters/smollm2-135m-instruct.lookahead.safetensors"),
        crate::adapter::SMOLLM2_WEIGHTS,
    ),
    (
        "adapters/qwen2.5-coder-0.5b-instruct.lookahead.safetensors",
        include_bytes!("../../adapters/qwen2.5-coder-0.5b-instruct.lookahead.safetensors"),
        crate::adapter::QWEN_CODER_WEIGHTS,
    ),
];

/// The shipped LookaheadKV adapter trained for the model `fingerprint` with these `weights`
/// (its cache identity), if there is one: a fine-tune sharing the embedding has none.
pub fn shipped(fingerprint: &str, weights: &str, cfg: &ModelConfig) -> Result<Option<LookaheadAdapter>> {
    for (name, bytes, trained_with) in SHIPPED {
        if *trained_with != weights {
            continue;
        }
        // Only the adapter of this model parses with its shapes: look at the metadata first.
        let (_, header) = safetensors::SafeTensors::read_metadata(bytes)
            .map_err(|e| bad(Path::new(name), format!("no header ({e})")))?;
        let for_this = header
            .metadata()
            .as_ref()
            .and_then(|m| m.get(META))
            .and_then(|j| serde_json::from_str::<LookaheadMeta>(j).ok())
            .is_some_and(|m| m.model == fingerprint);
        if for_this {
            return LookaheadAdapter::from_bytes(bytes, Path::new(name), cfg).map(Some);
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Arch;

    fn tiny_config() -> ModelConfig {
        ModelConfig {
            arch: Arch::Qwen2,
            name: "tiny".into(),
            n_layers: 2,
            d_model: 32,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 8,
            ffn_dim: 48,
            vocab_size: 100,
            context_length: 256,
            rope_base: 10000.0,
            rope_dim: 8,
            rope_linear_factor: 1.0,
            rms_eps: 1e-5,
            tied_embeddings: true,
        }
    }

    fn adapter(cfg: &ModelConfig, seed: f32) -> LookaheadAdapter {
        let meta = LookaheadMeta {
            model: "abc".into(),
            model_name: "tiny".into(),
            rows: 4,
            rank: 2,
            alpha: 8.0,
            weights: None,
            training: serde_json::json!({"steps": 1}),
        };
        let tensors = tensor_specs(cfg, 4, 2)
            .iter()
            .enumerate()
            .map(|(i, (_, [r, c]))| (0..r * c).map(|j| seed + (i * 7 + j) as f32 * 1e-3).collect())
            .collect();
        LookaheadAdapter::new(meta, cfg, tensors).unwrap()
    }

    #[test]
    fn saves_loads_and_refuses_what_it_must() {
        let cfg = tiny_config();
        let dir = std::env::temp_dir().join(format!("fp-lookahead-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a.safetensors");
        let a = adapter(&cfg, 0.5);
        a.save(&path, &cfg).unwrap();
        let b = LookaheadAdapter::load(&path, &cfg).unwrap();
        assert_eq!((&b.tensors, &b.meta, &b.hash), (&a.tensors, &a.meta, &a.hash));
        assert_eq!(b.scale(), 4.0);
        let (qa, qb) = b.lora(1, Proj::K);
        assert_eq!((qa.len(), qb.len()), (2 * cfg.d_model, cfg.kv_dim() * 2));
        // No weights recorded (an adapter of before): any weights of the fingerprint pass.
        b.check_model("abc", "abc-w", &cfg).unwrap();
        let e = b.check_model("abd", "abd-w", &cfg).unwrap_err().to_string();
        assert!(e.contains("trained for tiny") && e.contains("train lookahead"), "{e}");
        let mut deeper = cfg.clone();
        deeper.n_layers += 1;
        let e = b.check_model("abc", "abc-w", &deeper).unwrap_err().to_string();
        assert!(e.contains("layers"), "{e}");
        let e = LookaheadAdapter::load(&path, &deeper).unwrap_err().to_string();
        assert!(e.contains("no `blk.") && e.contains("damaged"), "{e}");
        // Another model of the same width and more layers: named, not "damaged".
        deeper.name = "deeper".into();
        let e = LookaheadAdapter::load(&path, &deeper).unwrap_err().to_string();
        assert!(e.contains("trained for tiny, not for deeper") && !e.contains("damaged"), "{e}");
        assert_ne!(adapter(&cfg, 0.25).hash, a.hash, "the hash follows the values");

        let e = LookaheadAdapter::load(&dir.join("missing.safetensors"), &cfg).unwrap_err().to_string();
        assert!(e.contains("no such file") && e.contains("train lookahead"), "{e}");
        std::fs::write(&path, b"not a tensor file").unwrap();
        let e = LookaheadAdapter::load(&path, &cfg).unwrap_err().to_string();
        assert!(e.contains("not safetensors"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn specs_cover_every_projection_of_every_layer() {
        let cfg = tiny_config();
        let s = tensor_specs(&cfg, LOOKAHEAD_ROWS, LORA_RANK);
        assert_eq!(s.len(), 1 + cfg.n_layers * 14);
        assert_eq!(s[0].1, [LOOKAHEAD_ROWS, cfg.d_model]);
        assert_eq!(s[1], ("blk.0.q.lora_a".to_string(), [LORA_RANK, cfg.d_model]));
        assert_eq!(s[2], ("blk.0.q.lora_b".to_string(), [cfg.q_dim(), LORA_RANK]));
        assert_eq!(s[14].1, [cfg.d_model, LORA_RANK], "down's B maps back to the hidden size");
    }
}
