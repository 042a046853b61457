//! KV Packet adapters (paper 001): `p` header and `q` trailer rows of soft-token embeddings
//! wrapped around every chunk before its prefill, trained so that chunk caches concatenate
//! without recomputation.
//!
//! ```text
//!   chunk tokens t1..tn      ->  [ H1..Hp | t1..tn | T1..Tq ]   one chunk cache, made alone
//!   as ids:                      [ V..V+p | t1..tn | V+p..V+p+q ]   V = vocabulary size
//! ```
//! The soft rows travel as ids past the vocabulary: the model's embedding reads them from the
//! adapter ([`crate::Model::set_adapter`]), so chunking, the chunk store, placement and decoding
//! handle a packet like any chunk. The file is safetensors: one f32 tensor `adapter`
//! (`[p + q, d_model]`, header rows first) and metadata saying what it was trained for.

use crate::error::{Result, WorkerError};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// What an adapter file says about itself.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AdapterMeta {
    /// The model it was trained for ([`model_fingerprint`]).
    pub model: String,
    /// That model's name, for messages.
    pub model_name: String,
    /// Header rows.
    pub header: usize,
    /// Trailer rows.
    pub trailer: usize,
    /// The weights it was trained with (the model's cache identity: the fingerprint and a
    /// digest of every weight tensor), so that a fine-tune sharing the embedding is refused;
    /// absent in adapters made before it was recorded (the built-in ones carry it in
    /// [`SHIPPED`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<String>,
    /// How it was trained (the command's settings, samples, epochs, final loss), as written by
    /// `flowprefill train kvpacket`.
    #[serde(default)]
    pub training: serde_json::Value,
}

/// A loaded adapter.
#[derive(Clone, Debug)]
pub struct Adapter {
    /// Its description.
    pub meta: AdapterMeta,
    /// Row width (the model's hidden size).
    pub d_model: usize,
    /// `[header + trailer, d_model]`, header rows first.
    pub rows: Vec<f32>,
    /// SHA-256 of the rows (hex, 16 digits): part of every chunk-store key of its packets.
    pub hash: String,
    /// Where it was read from (none when made in memory).
    pub path: Option<PathBuf>,
}

const TENSOR: &str = "adapter";
const META: &str = "flowprefill.kvpacket";

fn bad(path: &Path, detail: impl Into<String>) -> WorkerError {
    WorkerError::Adapter { path: path.to_path_buf(), detail: detail.into() }
}

/// SHA-256 (hex, 16 digits) of f32 rows.
fn rows_hash(rows: &[f32]) -> String {
    let mut h = Sha256::new();
    for x in rows {
        h.update(x.to_le_bytes());
    }
    crate::hex(&h.finalize()[..8])
}

/// What identifies a model's weights for an adapter: the architecture's shape and a hash of
/// the token embedding as stored (`embedding_bytes`).
pub fn model_fingerprint(cfg: &crate::config::ModelConfig, embedding_bytes: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update(
        format!("{}:{}:{}:{}:{}", cfg.arch.name(), cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.vocab_size).as_bytes(),
    );
    h.update(embedding_bytes);
    crate::hex(&h.finalize()[..8])
}

/// A safetensors file's tensors and its JSON metadata under `key`; every failure goes through
/// `corrupt` (which says what the file should have been).
pub(crate) fn read_with_meta<'d, T: serde::de::DeserializeOwned>(
    data: &'d [u8],
    key: &str,
    corrupt: &dyn Fn(String) -> WorkerError,
) -> Result<(safetensors::SafeTensors<'d>, T)> {
    let st = safetensors::SafeTensors::deserialize(data).map_err(|e| corrupt(format!("not safetensors ({e})")))?;
    let (_, header) = safetensors::SafeTensors::read_metadata(data).map_err(|e| corrupt(format!("no header ({e})")))?;
    let json =
        header.metadata().as_ref().and_then(|m| m.get(key)).ok_or_else(|| corrupt(format!("no `{key}` metadata")))?;
    let meta = serde_json::from_str(json).map_err(|e| corrupt(format!("its metadata does not parse ({e})")))?;
    Ok((st, meta))
}

impl Adapter {
    /// An adapter of `rows` (`[meta.header + meta.trailer, d_model]`).
    pub fn new(meta: AdapterMeta, d_model: usize, rows: Vec<f32>) -> Result<Self> {
        let n = meta.header + meta.trailer;
        if n == 0 || rows.len() != n * d_model {
            return Err(crate::error::internal(format!(
                "an adapter of {} + {} rows of {d_model} needs {} values, got {}",
                meta.header,
                meta.trailer,
                n * d_model,
                rows.len()
            )));
        }
        if rows.iter().any(|x| !x.is_finite()) {
            return Err(crate::error::internal("adapter rows must be finite"));
        }
        let hash = rows_hash(&rows);
        Ok(Self { meta, d_model, rows, hash, path: None })
    }

    /// Soft rows in all (header + trailer).
    pub fn n_rows(&self) -> usize {
        self.meta.header + self.meta.trailer
    }

    /// `tokens` wrapped as a packet: the header's ids (`vocab..`), the tokens, the trailer's.
    pub fn wrap(&self, tokens: &[u32], vocab: usize) -> Vec<u32> {
        let (p, q) = (self.meta.header as u32, self.meta.trailer as u32);
        let v = vocab as u32;
        let mut out = Vec::with_capacity(tokens.len() + (p + q) as usize);
        out.extend(v..v + p);
        out.extend_from_slice(tokens);
        out.extend(v + p..v + p + q);
        out
    }

    /// Refuses an adapter trained for another model (`fingerprint`, `weights`: the model's
    /// [`crate::LoadedModel::fingerprint`] and [`crate::LoadedModel::cache_identity`]).
    pub fn check_model(&self, fingerprint: &str, weights: &str, name: &str, d_model: usize) -> Result<()> {
        let at = self.path.clone().unwrap_or_default();
        if self.d_model != d_model {
            return Err(bad(
                &at,
                format!(
                    "its rows have {} values but {name} has a hidden size of {d_model}: it was trained for {}; \
                     pass the adapter trained for this model (flowprefill train kvpacket --model ...)",
                    self.d_model, self.meta.model_name
                ),
            ));
        }
        if self.meta.model != fingerprint {
            return Err(bad(
                &at,
                format!(
                    "it was trained for {} (weights {}), not for {name} (weights {fingerprint}); \
                     pass the adapter trained for this model (flowprefill train kvpacket --model ...)",
                    self.meta.model_name, self.meta.model
                ),
            ));
        }
        check_weights(&at, self.meta.weights.as_deref(), weights, &self.meta.model_name, "kvpacket")
    }

    /// Writes the adapter (safetensors, metadata included), through a temporary file so that a
    /// crash never leaves half a file.
    pub fn save(&self, path: &Path) -> Result<()> {
        let bytes: Vec<u8> = self.rows.iter().flat_map(|x| x.to_le_bytes()).collect();
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![self.n_rows(), self.d_model], &bytes)
                .map_err(|e| bad(path, format!("cannot describe the tensor: {e}")))?;
        let meta = serde_json::to_string(&self.meta).map_err(|e| bad(path, e.to_string()))?;
        let info = HashMap::from([(META.to_string(), meta)]);
        let data = safetensors::serialize([(TENSOR, view)], Some(info))
            .map_err(|e| bad(path, format!("cannot serialise: {e}")))?;
        let tmp = path.with_extension(format!("partial.{}", std::process::id()));
        let io = |what: &str| {
            let what = format!("{what} {}", path.display());
            move |source| WorkerError::Io { what, source }
        };
        std::fs::write(&tmp, &data).map_err(io("writing"))?;
        std::fs::rename(&tmp, path).map_err(io("moving into place"))?;
        Ok(())
    }

    /// Reads an adapter file; every way it can be wrong says what to do.
    pub fn load(path: &Path) -> Result<Self> {
        let data = std::fs::read(path).map_err(|e| {
            bad(
                path,
                if e.kind() == std::io::ErrorKind::NotFound {
                    "no such file; give the path of an adapter made by `flowprefill train kvpacket`".to_string()
                } else {
                    format!("cannot be read: {e}")
                },
            )
        })?;
        let mut a = Self::from_bytes(&data, path)?;
        a.path = Some(path.to_path_buf());
        Ok(a)
    }

    /// Parses the bytes of an adapter file (`origin` names it in messages).
    pub fn from_bytes(data: &[u8], origin: &Path) -> Result<Self> {
        let corrupt = |d: String| {
            bad(origin, format!("{d}; the file is not a KV Packet adapter or is damaged: train or copy it again"))
        };
        let (st, meta): (_, AdapterMeta) = read_with_meta(data, META, &corrupt)?;
        let t = st.tensor(TENSOR).map_err(|_| corrupt(format!("no `{TENSOR}` tensor")))?;
        let [rows, d_model] = t.shape() else {
            return Err(corrupt(format!("`{TENSOR}` has shape {:?}, expected [rows, d_model]", t.shape())));
        };
        if t.dtype() != safetensors::Dtype::F32 || *rows != meta.header + meta.trailer || *rows == 0 {
            return Err(corrupt(format!(
                "`{TENSOR}` is {:?} {:?}, expected F32 [{} + {}, d_model]",
                t.dtype(),
                t.shape(),
                meta.header,
                meta.trailer
            )));
        }
        let values: Vec<f32> = t.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        if values.iter().any(|x| !x.is_finite()) {
            return Err(corrupt("its rows hold NaN or infinite values".into()));
        }
        Self::new(meta, *d_model, values).map_err(|e| corrupt(e.to_string()))
    }
}

/// The adapters trained by the project (`adapters/` in the repository; how each was trained is
/// in its metadata and in docs/kvpacket.md), built into the binary: `--method kvpacket` works
/// with the models flowprefill fetches without an `--adapter`.
const SHIPPED: &[(&str, &[u8], &str)] = &[
    (
        "adapters/smollm2-135m-instruct.kvpacket.safetensors",
        include_bytes!("../../adapters/smollm2-135m-instruct.kvpacket.safetensors"),
        SMOLLM2_WEIGHTS,
    ),
    (
        "adapters/qwen2.5-coder-0.5b-instruct.kvpacket.safetensors",
        include_bytes!("../../adapters/qwen2.5-coder-0.5b-instruct.kvpacket.safetensors"),
        QWEN_CODER_WEIGHTS,
    ),
];

/// The shipped adapter trained for the model `fingerprint` with these `weights` (its cache
/// identity), if there is one: a fine-tune sharing the embedding has no built-in adapter.
pub fn shipped(fingerprint: &str, weights: &str) -> Result<Option<Adapter>> {
    for (name, bytes, trained_with) in SHIPPED {
        let a = Adapter::from_bytes(bytes, Path::new(name))?;
        if a.meta.model == fingerprint && *trained_with == weights {
            return Ok(Some(a));
        }
    }
    Ok(None)
}

/// The weights (cache identities) of the models flowprefill fetches, which the built-in
/// adapters were trained with (their files predate the `weights` field).
pub(crate) const SMOLLM2_WEIGHTS: &str = "55cc427940c0941e-92533cb7a4c9ff1af88415d17b009fd5";
/// Qwen2.5-Coder-0.5B-Instruct Q4_K_M's.
pub(crate) const QWEN_CODER_WEIGHTS: &str = "d1a85f95b4c86514-2dd5640dd8a215b18125d0708de9a19b";

/// Refuses an adapter whose recorded `trained` weights are not `weights` (the same embedding
/// and shape, other layers: a fine-tune); one that recorded none is let through.
pub(crate) fn check_weights(
    at: &Path,
    trained: Option<&str>,
    weights: &str,
    model_name: &str,
    method: &str,
) -> Result<()> {
    match trained {
        Some(w) if w != weights => Err(bad(
            at,
            format!(
                "it was trained for {model_name} with other weights ({w}) than this model's ({weights}): the same \
                 embedding and shape with other layers, a fine-tune of it; pass an adapter trained for this model \
                 (flowprefill train {method} --model ...)"
            ),
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta() -> AdapterMeta {
        AdapterMeta {
            model: "abc".into(),
            model_name: "tiny".into(),
            header: 2,
            trailer: 1,
            weights: Some("abc-w1".into()),
            training: serde_json::json!({"steps": 3}),
        }
    }

    /// Every shipped adapter parses and names the model it is for: one for each model
    /// flowprefill fetches, each found by its own fingerprint.
    #[test]
    fn shipped_adapters_parse() {
        let mut names = Vec::new();
        for (name, bytes, weights) in SHIPPED {
            let a = Adapter::from_bytes(bytes, Path::new(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!((a.meta.header, a.meta.trailer), (8, 8), "{name}");
            assert!(weights.starts_with(&format!("{}-", a.meta.model)), "{name}: weights of another model");
            let found =
                shipped(&a.meta.model, weights).unwrap().unwrap_or_else(|| panic!("{name}: not found by its model"));
            // A fine-tune sharing the embedding (the same fingerprint, other weights) has none.
            assert!(shipped(&a.meta.model, &format!("{}-0000", a.meta.model)).unwrap().is_none(), "{name}");
            assert_eq!(found.hash, a.hash, "{name}: two shipped adapters claim one model");
            names.push(a.meta.model_name.clone());
        }
        // The names the GGUF files give themselves.
        for model in ["smollm2 135m", "qwen2.5 coder 0.5b"] {
            assert!(
                names.iter().any(|n| n.to_lowercase().starts_with(model)),
                "no adapter for {model} among {names:?}"
            );
        }
        assert!(shipped("no such model", "no such weights").unwrap().is_none());
    }

    #[test]
    fn saves_loads_wraps_and_refuses_what_it_must() {
        let dir = std::env::temp_dir().join(format!("fp-adapter-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a.safetensors");
        let a = Adapter::new(meta(), 4, (0..12).map(|i| i as f32 * 0.5).collect()).unwrap();
        a.save(&path).unwrap();
        let b = Adapter::load(&path).unwrap();
        assert_eq!((b.rows.clone(), b.meta.clone(), b.hash.clone()), (a.rows.clone(), a.meta.clone(), a.hash.clone()));
        assert_eq!(b.wrap(&[7, 8], 100), vec![100, 101, 7, 8, 102]);
        b.check_model("abc", "abc-w1", "tiny", 4).unwrap();
        let e = b.check_model("abd", "abd-w1", "other", 4).unwrap_err().to_string();
        assert!(e.contains("trained for tiny") && e.contains("not for other"), "{e}");
        let e = b.check_model("abc", "abc-w2", "tiny", 4).unwrap_err().to_string();
        assert!(e.contains("other weights (abc-w1) than this model's (abc-w2)"), "a fine-tune: {e}");
        let e = b.check_model("abc", "abc-w1", "wide", 8).unwrap_err().to_string();
        assert!(e.contains("hidden size of 8"), "{e}");
        let other = Adapter::new(meta(), 4, (0..12).map(|i| i as f32).collect()).unwrap();
        assert_ne!(other.hash, a.hash, "the hash follows the rows");

        let e = Adapter::load(&dir.join("missing.safetensors")).unwrap_err().to_string();
        assert!(e.contains("no such file") && e.contains("train kvpacket"), "{e}");
        std::fs::write(&path, b"not a tensor file at all").unwrap();
        let e = Adapter::load(&path).unwrap_err().to_string();
        assert!(e.contains("not safetensors") && e.contains("damaged"), "{e}");
        a.save(&path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 5]).unwrap();
        assert!(Adapter::load(&path).is_err(), "a truncated file is refused");
        std::fs::remove_dir_all(&dir).ok();
    }
}
