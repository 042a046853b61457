//! Writing GGUF files of synthetic models (random weights of a known shape, the tokenizer and
//! chat template of another GGUF): files of any size to measure loading with, written one tensor
//! at a time (the host holds one tensor, not the model).
//!
//! Format (GGUF v3, little-endian): magic `GGUF`, version, tensor count, metadata count; the
//! metadata (key string, value type, value); the tensor infos (name, dimensions innermost
//! first, ggml type, offset in the data section); padding to 32 bytes; the tensor data, each
//! tensor padded to 32 bytes.

use crate::config::ModelConfig;
use crate::error::{io_err, Result, WorkerError};
use crate::gguf::GgufFile;
use crate::synthetic::{random_values, SyntheticSpec, WEIGHT_STD};
use candle_core::quantized::gguf_file::Value;
use rayon::prelude::*;
use std::io::{BufWriter, Seek, Write};
use std::path::Path;

/// Alignment of the tensor data (GGUF's default, `general.alignment` absent).
const ALIGN: u64 = 32;

/// Element types a synthetic GGUF's matrices can have (norms are always f32).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightFormat {
    /// 32-bit floats (ggml type 0).
    F32,
    /// IEEE half (ggml type 1).
    F16,
    /// bfloat16 (ggml type 30).
    Bf16,
}

impl WeightFormat {
    fn ggml_type(self) -> u32 {
        match self {
            WeightFormat::F32 => 0,
            WeightFormat::F16 => 1,
            WeightFormat::Bf16 => 30,
        }
    }

    fn bytes(self) -> usize {
        match self {
            WeightFormat::F32 => 4,
            WeightFormat::F16 | WeightFormat::Bf16 => 2,
        }
    }

    /// `f32`, `f16` or `bf16`.
    pub fn name(self) -> &'static str {
        match self {
            WeightFormat::F32 => "f32",
            WeightFormat::F16 => "f16",
            WeightFormat::Bf16 => "bf16",
        }
    }
}

impl std::str::FromStr for WeightFormat {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" => Ok(WeightFormat::F32),
            "f16" => Ok(WeightFormat::F16),
            "bf16" => Ok(WeightFormat::Bf16),
            other => Err(format!("`{other}`: give f16, bf16 or f32")),
        }
    }
}

/// One tensor to write: name, dimensions (outermost first, `[out, in]` for a matrix), format.
struct Planned {
    name: String,
    dims: Vec<usize>,
    format: WeightFormat,
}

impl Planned {
    fn bytes(&self) -> u64 {
        (self.dims.iter().product::<usize>() * self.format.bytes()) as u64
    }
}

fn padding(pos: u64) -> u64 {
    (ALIGN - pos % ALIGN) % ALIGN
}

fn write_str<W: Write>(w: &mut W, s: &str) -> std::io::Result<()> {
    w.write_all(&(s.len() as u64).to_le_bytes())?;
    w.write_all(s.as_bytes())
}

fn value_type(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

fn write_value<W: Write>(w: &mut W, v: &Value) -> std::io::Result<()> {
    match v {
        Value::U8(x) => w.write_all(&[*x]),
        Value::I8(x) => w.write_all(&x.to_le_bytes()),
        Value::U16(x) => w.write_all(&x.to_le_bytes()),
        Value::I16(x) => w.write_all(&x.to_le_bytes()),
        Value::U32(x) => w.write_all(&x.to_le_bytes()),
        Value::I32(x) => w.write_all(&x.to_le_bytes()),
        Value::U64(x) => w.write_all(&x.to_le_bytes()),
        Value::I64(x) => w.write_all(&x.to_le_bytes()),
        Value::F32(x) => w.write_all(&x.to_le_bytes()),
        Value::F64(x) => w.write_all(&x.to_le_bytes()),
        Value::Bool(x) => w.write_all(&[u8::from(*x)]),
        Value::String(s) => write_str(w, s),
        Value::Array(items) => {
            // An empty array's element type does not matter; GGUF arrays hold one type.
            w.write_all(&items.first().map_or(4, value_type).to_le_bytes())?;
            w.write_all(&(items.len() as u64).to_le_bytes())?;
            items.iter().try_for_each(|x| write_value(w, x))
        }
    }
}

/// The tensors of a model of `cfg`'s shape, as flowprefill's loader reads them.
fn plan(cfg: &ModelConfig, format: WeightFormat) -> Vec<Planned> {
    let (d, q, kv, ffn) = (cfg.d_model, cfg.q_dim(), cfg.kv_dim(), cfg.ffn_dim);
    let mat = |name: String, rows: usize, cols: usize| Planned { name, dims: vec![rows, cols], format };
    let vec32 = |name: String, len: usize| Planned { name, dims: vec![len], format: WeightFormat::F32 };
    let mut t = vec![mat("token_embd.weight".into(), cfg.vocab_size, d), vec32("output_norm.weight".into(), d)];
    if !cfg.tied_embeddings {
        t.push(mat("output.weight".into(), cfg.vocab_size, d));
    }
    for l in 0..cfg.n_layers {
        let b = |n: &str| format!("blk.{l}.{n}");
        t.push(vec32(b("attn_norm.weight"), d));
        t.push(mat(b("attn_q.weight"), q, d));
        t.push(mat(b("attn_k.weight"), kv, d));
        t.push(mat(b("attn_v.weight"), kv, d));
        t.push(mat(b("attn_output.weight"), d, q));
        t.push(vec32(b("ffn_norm.weight"), d));
        t.push(mat(b("ffn_gate.weight"), ffn, d));
        t.push(mat(b("ffn_up.weight"), ffn, d));
        t.push(mat(b("ffn_down.weight"), d, ffn));
        if cfg.arch.qkv_bias() {
            t.push(vec32(b("attn_q.bias"), q));
            t.push(vec32(b("attn_k.bias"), kv));
            t.push(vec32(b("attn_v.bias"), kv));
        }
        if cfg.arch.qk_norm() {
            t.push(vec32(b("attn_q_norm.weight"), cfg.head_dim));
            t.push(vec32(b("attn_k_norm.weight"), cfg.head_dim));
        }
    }
    t
}

/// The model's hyper-parameters as GGUF metadata (`ARCH.block_count`, ...).
fn config_metadata(cfg: &ModelConfig) -> Vec<(String, Value)> {
    let a = cfg.arch.name();
    let u = |v: usize| Value::U32(v as u32);
    let mut meta = vec![
        ("general.architecture".into(), Value::String(a.into())),
        ("general.name".into(), Value::String(cfg.name.clone())),
        (format!("{a}.block_count"), u(cfg.n_layers)),
        (format!("{a}.embedding_length"), u(cfg.d_model)),
        (format!("{a}.feed_forward_length"), u(cfg.ffn_dim)),
        (format!("{a}.attention.head_count"), u(cfg.n_heads)),
        (format!("{a}.attention.head_count_kv"), u(cfg.n_kv_heads)),
        (format!("{a}.attention.key_length"), u(cfg.head_dim)),
        (format!("{a}.attention.value_length"), u(cfg.head_dim)),
        (format!("{a}.rope.dimension_count"), u(cfg.rope_dim)),
        (format!("{a}.context_length"), u(cfg.context_length)),
        (format!("{a}.rope.freq_base"), Value::F32(cfg.rope_base as f32)),
        (format!("{a}.attention.layer_norm_rms_epsilon"), Value::F32(cfg.rms_eps)),
    ];
    if cfg.rope_linear_factor != 1.0 {
        meta.push((format!("{a}.rope.scaling.type"), Value::String("linear".into())));
        meta.push((format!("{a}.rope.scaling.factor"), Value::F32(cfg.rope_linear_factor as f32)));
    }
    meta
}

/// What [`write_synthetic`] or [`write_tokenizer`] wrote.
#[derive(Clone, Copy, Debug)]
pub struct Written {
    /// Bytes of the file.
    pub bytes: u64,
    /// Tensors.
    pub tensors: usize,
}

/// Writes a GGUF of `spec`'s shape with random weights (matrices in `format`, norms of ones in
/// f32) and the tokenizer and chat template of `tokenizer_from` (its `tokenizer.*` metadata).
/// The file is written beside `out` under a temporary name, synced, then renamed to `out`: a
/// file already at `out` stays whole until the new one is (a full disk, an interrupted run
/// leave it as it was, and no truncated GGUF under its name).
pub fn write_synthetic(
    spec: &SyntheticSpec,
    format: WeightFormat,
    tokenizer_from: &Path,
    out: &Path,
) -> Result<Written> {
    write_replacing(Some((spec, format)), tokenizer_from, out)
}

/// Writes a GGUF of `tokenizer_from`'s tokenizer and chat template alone (its `tokenizer.*`
/// metadata, no tensors and no model hyper-parameters; about 2 MB for the default model's),
/// which a synthetic model takes instead of a whole model file (`--tokenizer`): what a machine
/// with room for little more than the program needs. Replaces `out` as [`write_synthetic`]
/// does.
pub fn write_tokenizer(tokenizer_from: &Path, out: &Path) -> Result<Written> {
    write_replacing(None, tokenizer_from, out)
}

/// [`write_synthetic`] (`model` given) or [`write_tokenizer`]: written under a temporary name
/// beside `out`, then renamed.
fn write_replacing(
    model: Option<(&SyntheticSpec, WeightFormat)>,
    tokenizer_from: &Path,
    out: &Path,
) -> Result<Written> {
    let name = out.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = out.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    let written = write_to(model, tokenizer_from, &tmp, out).and_then(|w| {
        std::fs::rename(&tmp, out).map_err(io_err(format!("renaming {} to {}", tmp.display(), out.display())))?;
        Ok(w)
    });
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// [`write_replacing`]'s file, written to `path` (synced); `out` names it in errors.
fn write_to(
    model: Option<(&SyntheticSpec, WeightFormat)>,
    tokenizer_from: &Path,
    path: &Path,
    out: &Path,
) -> Result<Written> {
    let tok = GgufFile::open(tokenizer_from)?;
    let mut keys: Vec<&String> = tok.metadata().keys().filter(|k| k.starts_with("tokenizer.")).collect();
    if keys.is_empty() {
        return Err(WorkerError::ModelFile {
            path: tokenizer_from.to_path_buf(),
            detail: "it has no tokenizer (no `tokenizer.*` metadata) to take".into(),
        });
    }
    keys.sort();
    let (mut meta, tensors) = match model {
        Some((spec, format)) => {
            let cfg = spec.config();
            (config_metadata(&cfg), plan(&cfg, format))
        }
        None => (vec![("general.name".to_string(), Value::String(crate::config::TOKENIZER_ONLY.into()))], Vec::new()),
    };
    for k in keys {
        meta.push((k.clone(), tok.metadata()[k].clone()));
    }
    let file =
        std::fs::File::create(path).map_err(io_err(format!("creating {} (for {})", path.display(), out.display())))?;
    let mut w = BufWriter::with_capacity(8 << 20, file);
    let werr = |e: std::io::Error| WorkerError::Io { what: format!("writing {}", out.display()), source: e };
    (|| -> std::io::Result<()> {
        w.write_all(b"GGUF")?;
        w.write_all(&3u32.to_le_bytes())?;
        w.write_all(&(tensors.len() as u64).to_le_bytes())?;
        w.write_all(&(meta.len() as u64).to_le_bytes())?;
        for (k, v) in &meta {
            write_str(&mut w, k)?;
            w.write_all(&value_type(v).to_le_bytes())?;
            write_value(&mut w, v)?;
        }
        let mut offset = 0u64;
        for t in &tensors {
            write_str(&mut w, &t.name)?;
            w.write_all(&(t.dims.len() as u32).to_le_bytes())?;
            for &d in t.dims.iter().rev() {
                w.write_all(&(d as u64).to_le_bytes())?;
            }
            w.write_all(&t.format.ggml_type().to_le_bytes())?;
            w.write_all(&offset.to_le_bytes())?;
            offset += t.bytes() + padding(t.bytes());
        }
        let pos = w.stream_position()?;
        w.write_all(&vec![0u8; padding(pos) as usize])?;
        Ok(())
    })()
    .map_err(werr)?;
    for (i, t) in tensors.iter().enumerate() {
        let n: usize = t.dims.iter().product();
        let values = if t.dims.len() == 1 && t.name.contains("norm") {
            vec![1.0f32; n]
        } else {
            random_values(n, crate::synthetic::SEED ^ (i as u64 + 1), WEIGHT_STD)
        };
        let bytes: Vec<u8> = match t.format {
            WeightFormat::F32 => values.par_iter().flat_map_iter(|x| x.to_le_bytes()).collect(),
            WeightFormat::F16 => values.par_iter().flat_map_iter(|&x| half::f16::from_f32(x).to_le_bytes()).collect(),
            WeightFormat::Bf16 => values.par_iter().flat_map_iter(|&x| half::bf16::from_f32(x).to_le_bytes()).collect(),
        };
        w.write_all(&bytes)
            .and_then(|()| w.write_all(&vec![0u8; padding(bytes.len() as u64) as usize]))
            .map_err(werr)?;
    }
    w.flush().map_err(werr)?;
    let bytes = w.stream_position().map_err(werr)?;
    w.get_ref().sync_all().map_err(werr)?;
    Ok(Written { bytes, tensors: tensors.len() })
}

/// Hand-made GGUF files for the loader's tests, hostile ones included: metadata, tensor infos
/// of any shape, type and offset, and the data bytes, written as given (no check).
#[cfg(test)]
pub(crate) mod testfile {
    use super::{config_metadata, padding, plan, value_type, write_str, write_value, WeightFormat};
    use crate::config::{Arch, ModelConfig};
    use candle_core::quantized::gguf_file::Value;
    use std::path::{Path, PathBuf};

    /// A GGUF under construction.
    pub(crate) struct TestGguf {
        /// Metadata, in file order.
        pub(crate) meta: Vec<(String, Value)>,
        /// Tensor infos: name, dimensions (outermost first), ggml type, offset in the data.
        pub(crate) tensors: Vec<(String, Vec<usize>, u32, u64)>,
        /// The data section.
        pub(crate) data: Vec<u8>,
    }

    /// A file that is removed when dropped.
    pub(crate) struct TempFile(pub(crate) PathBuf);

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    impl TempFile {
        pub(crate) fn path(&self) -> &Path {
            &self.0
        }
    }

    /// A one-layer llama: d 8, 2 heads of 4 over 1 KV head, FFN 16, vocabulary 10.
    pub(crate) fn tiny_config() -> ModelConfig {
        ModelConfig {
            arch: Arch::Llama,
            name: "tiny".into(),
            n_layers: 1,
            d_model: 8,
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 4,
            ffn_dim: 16,
            vocab_size: 10,
            context_length: 64,
            rope_base: 10_000.0,
            rope_dim: 4,
            rope_linear_factor: 1.0,
            rms_eps: 1e-5,
            tied_embeddings: true,
        }
    }

    impl TestGguf {
        /// A whole model of `cfg`'s shape, f32 zeros.
        pub(crate) fn model(cfg: &ModelConfig) -> Self {
            let mut tensors = Vec::new();
            let mut data = Vec::new();
            for t in plan(cfg, WeightFormat::F32) {
                let bytes = t.bytes();
                tensors.push((t.name, t.dims, 0, data.len() as u64));
                data.resize(data.len() + (bytes + padding(bytes)) as usize, 0);
            }
            Self { meta: config_metadata(cfg), tensors, data }
        }

        /// [`tiny_config`]'s model.
        pub(crate) fn tiny() -> Self {
            Self::model(&tiny_config())
        }

        /// Sets metadata `key` (replacing it where present).
        pub(crate) fn set(mut self, key: &str, value: Value) -> Self {
            match self.meta.iter_mut().find(|(k, _)| k == key) {
                Some(kv) => kv.1 = value,
                None => self.meta.push((key.to_string(), value)),
            }
            self
        }

        /// The tensor info of `name`.
        pub(crate) fn tensor(&mut self, name: &str) -> &mut (String, Vec<usize>, u32, u64) {
            self.tensors.iter_mut().find(|t| t.0 == name).expect("a tensor of the test file")
        }

        /// The file's bytes (tensor data aligned to 32 bytes, as `general.alignment` absent).
        pub(crate) fn bytes(&self) -> Vec<u8> {
            let mut w = Vec::new();
            w.extend_from_slice(b"GGUF");
            w.extend_from_slice(&3u32.to_le_bytes());
            w.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
            w.extend_from_slice(&(self.meta.len() as u64).to_le_bytes());
            for (k, v) in &self.meta {
                write_str(&mut w, k).expect("a Vec takes every write");
                w.extend_from_slice(&value_type(v).to_le_bytes());
                write_value(&mut w, v).expect("a Vec takes every write");
            }
            for (name, dims, ty, offset) in &self.tensors {
                write_str(&mut w, name).expect("a Vec takes every write");
                w.extend_from_slice(&(dims.len() as u32).to_le_bytes());
                for &d in dims.iter().rev() {
                    w.extend_from_slice(&(d as u64).to_le_bytes());
                }
                w.extend_from_slice(&ty.to_le_bytes());
                w.extend_from_slice(&offset.to_le_bytes());
            }
            w.resize(w.len() + padding(w.len() as u64) as usize, 0);
            w.extend_from_slice(&self.data);
            w
        }

        /// Writes it to a temporary file named after `tag` (removed when the result drops).
        pub(crate) fn write(&self, tag: &str) -> TempFile {
            let path = std::env::temp_dir().join(format!("fp-test-{}-{tag}.gguf", std::process::id()));
            std::fs::write(&path, self.bytes()).expect("writing a test GGUF");
            TempFile(path)
        }
    }

    #[test]
    fn the_tiny_model_loads() {
        let f = TestGguf::tiny().write("tiny-loads");
        let file = crate::gguf::GgufFile::open(f.path()).unwrap();
        let cfg = ModelConfig::from_gguf(&file).unwrap();
        assert_eq!(ModelConfig { name: "tiny".into(), ..cfg.clone() }, tiny_config());
        let mut file = file;
        crate::Model::from_file(&mut file, cfg, crate::Cpu::default()).unwrap();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_parse_and_pad() {
        assert_eq!("F16".parse::<WeightFormat>(), Ok(WeightFormat::F16));
        assert!("q4".parse::<WeightFormat>().is_err());
        assert_eq!((padding(0), padding(1), padding(31), padding(32), padding(33)), (0, 31, 1, 0, 31));
    }

    #[test]
    fn a_file_without_a_tokenizer_is_refused_and_out_stays_whole() {
        let dir = std::env::temp_dir().join(format!("fp-tokenizer-only-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // A valid GGUF v3 with no tensors and no metadata.
        let src = dir.join("bare.gguf");
        let bare: Vec<u8> = [&b"GGUF"[..], &3u32.to_le_bytes(), &0u64.to_le_bytes(), &0u64.to_le_bytes()].concat();
        std::fs::write(&src, bare).unwrap();
        let out = dir.join("out.gguf");
        std::fs::write(&out, b"a user's file").unwrap();
        let e = write_tokenizer(&src, &out).expect_err("no tokenizer to take");
        assert!(e.to_string().contains("no tokenizer"), "{e}");
        assert_eq!(std::fs::read(&out).unwrap(), b"a user's file");
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().filter_map(|e| e.ok()).map(|e| e.file_name()).collect();
        assert_eq!(left.len(), 2, "no temporary file left: {left:?}");
        let _ = std::fs::remove_dir_all(dir);
    }
}
