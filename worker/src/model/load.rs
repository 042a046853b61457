//! Building a [`Model`] from a GGUF file: dequantize, fuse projections, move to the backend.

use super::{Layer, Model, OpProfile};
use crate::config::ModelConfig;
use crate::error::{internal, Result, WorkerError};
use crate::gguf::{GgufFile, RawTensor};
use crate::synthetic::{random_matrix, random_values, WEIGHT_STD};
use flowprefill_kernels::rope::RopeTable;
use flowprefill_kernels::{Backend, DType, HostBuf};
use std::path::Path;
use std::time::{Duration, Instant};

/// Upper bound of the precomputed RoPE table (positions beyond are computed on the fly).
const ROPE_TABLE_MAX: usize = 1 << 17;

/// Time a load took, by stage. The reads run on a thread of their own, one or two tensors
/// ahead of the conversions, so `read + convert + upload` may exceed `total`.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct LoadStats {
    /// Reading tensor bytes from the file (the reader thread's busy time).
    pub read: Duration,
    /// Converting to the backend's weight type (dequantizing, f16 to f32 or bf16), in
    /// parallel, and fusing Q/K/V and gate/up.
    pub convert: Duration,
    /// Handing the weights to the backend (uploads to a GPU).
    pub upload: Duration,
    /// The whole load.
    pub total: Duration,
    /// Bytes read from the file.
    pub bytes: u64,
}

impl std::fmt::Display for LoadStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = |d: Duration| d.as_secs_f64();
        write!(
            f,
            "{:.1} s: read {:.1} s ({:.2} GB), convert {:.1} s, upload {:.1} s",
            s(self.total),
            s(self.read),
            self.bytes as f64 / 1e9,
            s(self.convert),
            s(self.upload)
        )
    }
}

/// One weight the model holds: a matrix made of tensors stacked by rows (Q/K/V, gate/up), or a
/// vector made of tensors concatenated (norms, biases).
struct Job {
    parts: Vec<String>,
    matrix: bool,
}

/// A loaded weight.
enum Piece<B: Backend> {
    Mat(B::Mat),
    Buf(B::Buf),
}

/// The weights of `cfg`, in the order [`Model::from_file`] builds the model from them.
fn jobs(cfg: &ModelConfig) -> Vec<Job> {
    let mat = |parts: Vec<String>| Job { parts, matrix: true };
    let vec = |parts: Vec<String>| Job { parts, matrix: false };
    let mut j = Vec::new();
    for l in 0..cfg.n_layers {
        let b = |n: &str| format!("blk.{l}.{n}");
        j.push(vec(vec![b("attn_norm.weight")]));
        j.push(mat(vec![b("attn_q.weight"), b("attn_k.weight"), b("attn_v.weight")]));
        if cfg.arch.qkv_bias() {
            j.push(vec(vec![b("attn_q.bias"), b("attn_k.bias"), b("attn_v.bias")]));
        }
        if cfg.arch.qk_norm() {
            j.push(vec(vec![b("attn_q_norm.weight")]));
            j.push(vec(vec![b("attn_k_norm.weight")]));
        }
        j.push(mat(vec![b("attn_output.weight")]));
        j.push(vec(vec![b("ffn_norm.weight")]));
        j.push(mat(vec![b("ffn_gate.weight"), b("ffn_up.weight")]));
        j.push(mat(vec![b("ffn_down.weight")]));
    }
    j.push(mat(vec!["token_embd.weight".into()]));
    if !cfg.tied_embeddings {
        j.push(mat(vec!["output.weight".into()]));
    }
    j.push(vec(vec!["output_norm.weight".into()]));
    j
}

/// Converts the parts of one matrix into one buffer of `dtype`, stacked by rows.
fn stack(parts: &[RawTensor], dtype: DType, path: &Path) -> Result<(usize, usize, HostBuf)> {
    let bad = |t: &RawTensor, detail: String| WorkerError::UnsupportedTensor {
        path: path.to_path_buf(),
        name: t.name.clone(),
        detail,
    };
    let cols = match parts.first().map(|t| t.shape.as_slice()) {
        Some([_, c]) => *c,
        _ => return Err(internal("a matrix without a two-dimensional first part")),
    };
    let mut rows = 0;
    for t in parts {
        match t.shape.as_slice() {
            [r, c] if *c == cols => rows += r,
            other => return Err(bad(t, format!("expected a matrix of {cols} columns, found shape {other:?}"))),
        }
    }
    let mut data = HostBuf::zeros(rows * cols, dtype);
    let mut at = 0;
    for t in parts {
        let n = t.len();
        match &mut data {
            HostBuf::F32(v) => t.to_f32(&mut v[at..at + n], path)?,
            HostBuf::Bf16(v) => t.to_bf16(&mut v[at..at + n], path)?,
        }
        at += n;
    }
    Ok((rows, cols, data))
}

/// The loaded weights in [`jobs`]' order, taken one by one.
struct Pieces<B: Backend>(std::vec::IntoIter<Piece<B>>);

impl<B: Backend> Pieces<B> {
    fn mat(&mut self) -> Result<B::Mat> {
        match self.0.next() {
            Some(Piece::Mat(m)) => Ok(m),
            _ => Err(internal("loader: expected a matrix")),
        }
    }

    fn buf(&mut self) -> Result<B::Buf> {
        match self.0.next() {
            Some(Piece::Buf(b)) => Ok(b),
            _ => Err(internal("loader: expected a vector")),
        }
    }

    /// The next block's weights (as [`jobs`] lists them for `cfg`'s architecture).
    fn layer(&mut self, cfg: &ModelConfig) -> Result<Layer<B>> {
        let attn_norm = self.buf()?;
        let wqkv = self.mat()?;
        let bqkv = if cfg.arch.qkv_bias() { Some(self.buf()?) } else { None };
        let (q_norm, k_norm) = if cfg.arch.qk_norm() { (Some(self.buf()?), Some(self.buf()?)) } else { (None, None) };
        Ok(Layer {
            attn_norm,
            wqkv,
            bqkv,
            q_norm,
            k_norm,
            wo: self.mat()?,
            ffn_norm: self.buf()?,
            w_gate_up: self.mat()?,
            w_down: self.mat()?,
        })
    }
}

/// Every weight of `jobs`, read by a reader thread one or two tensors ahead, converted here to
/// the backend's weight type and handed to it; the time of each step and the bytes read go to
/// `stats`.
fn read_and_convert<B: Backend>(
    file: &GgufFile,
    jobs: &[Job],
    backend: &B,
    stats: &mut LoadStats,
) -> Result<Vec<Piece<B>>> {
    let path = file.path().to_path_buf();
    std::thread::scope(|s| -> Result<Vec<Piece<B>>> {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Result<RawTensor>>(2);
        let reader = s.spawn(move || {
            let (mut busy, mut bytes) = (Duration::ZERO, 0u64);
            for name in jobs.iter().flat_map(|j| j.parts.iter()) {
                let t = Instant::now();
                let r = file.raw_tensor(name);
                busy += t.elapsed();
                bytes += r.as_ref().map_or(0, |r| r.bytes.len() as u64);
                let failed = r.is_err();
                // A closed channel: the loader stopped (an error of its own).
                if tx.send(r).is_err() || failed {
                    break;
                }
            }
            (busy, bytes)
        });
        let mut out = Vec::with_capacity(jobs.len());
        for job in jobs {
            let mut parts = Vec::with_capacity(job.parts.len());
            for _ in &job.parts {
                parts.push(rx.recv().map_err(|_| internal("the model reader stopped early"))??);
            }
            out.push(convert(job, parts, backend, &path, stats)?);
        }
        drop(rx);
        let (busy, bytes) = reader.join().map_err(|_| internal("the model reader panicked"))?;
        stats.read = busy;
        stats.bytes = bytes;
        Ok(out)
    })
}

/// One weight from its tensors: Q/K/V and gate/up stacked in the weight type, vectors in f32.
fn convert<B: Backend>(
    job: &Job,
    parts: Vec<RawTensor>,
    backend: &B,
    path: &Path,
    stats: &mut LoadStats,
) -> Result<Piece<B>> {
    let t = Instant::now();
    if job.matrix {
        let (rows, cols, data) = stack(&parts, backend.weight_dtype(), path)?;
        drop(parts);
        stats.convert += t.elapsed();
        let t = Instant::now();
        let m = backend.matrix_typed(rows, cols, data)?;
        stats.upload += t.elapsed();
        return Ok(Piece::Mat(m));
    }
    let mut v = Vec::new();
    for p in &parts {
        let at = v.len();
        v.resize(at + p.len(), 0f32);
        p.to_f32(&mut v[at..], path)?;
    }
    stats.convert += t.elapsed();
    let t = Instant::now();
    let b = backend.upload(&v)?;
    stats.upload += t.elapsed();
    Ok(Piece::Buf(b))
}

impl<B: Backend> Model<B> {
    /// A model of `cfg`'s shape with random weights from `seed` ([`crate::synthetic`]): norms
    /// of ones, matrices and biases uniform with standard deviation [`WEIGHT_STD`]. Each matrix
    /// is made on the host and handed to the backend before the next is made, so the host holds
    /// one matrix at a time beyond what the backend keeps.
    pub fn synthetic(cfg: ModelConfig, backend: B, seed: u64) -> Result<Self> {
        let t0 = Instant::now();
        let rope = RopeTable::new_scaled(
            cfg.head_dim,
            cfg.rope_dim,
            cfg.rope_base,
            cfg.arch.rope_style(),
            None,
            cfg.rope_linear_factor,
            cfg.context_length.clamp(1, ROPE_TABLE_MAX),
        )?;
        let (d, q, kv, ffn) = (cfg.d_model, cfg.q_dim(), cfg.kv_dim(), cfg.ffn_dim);
        let mut next = seed;
        let mut seeds = move || {
            next = next.wrapping_add(1);
            next
        };
        let be = &backend;
        let mut mat =
            |rows: usize, cols: usize| -> Result<B::Mat> { Ok(be.matrix(random_matrix(rows, cols, seeds())?)?) };
        let ones = |n: usize| -> Result<B::Buf> { Ok(be.upload(&vec![1.0; n])?) };
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for _ in 0..cfg.n_layers {
            let wqkv = mat(q + 2 * kv, d)?;
            let bqkv = if cfg.arch.qkv_bias() {
                Some(be.upload(&random_values(q + 2 * kv, seed ^ layers.len() as u64, WEIGHT_STD))?)
            } else {
                None
            };
            let norms = cfg.arch.qk_norm();
            layers.push(Layer {
                attn_norm: ones(d)?,
                wqkv,
                bqkv,
                q_norm: if norms { Some(ones(cfg.head_dim)?) } else { None },
                k_norm: if norms { Some(ones(cfg.head_dim)?) } else { None },
                wo: mat(d, q)?,
                ffn_norm: ones(d)?,
                w_gate_up: mat(2 * ffn, d)?,
                w_down: mat(d, ffn)?,
            });
        }
        let embed = mat(cfg.vocab_size, d)?;
        let output = if cfg.tied_embeddings { None } else { Some(mat(cfg.vocab_size, d)?) };
        let out_norm = ones(d)?;
        let shape = cfg.attn_shape();
        let load = LoadStats { total: t0.elapsed(), convert: t0.elapsed(), ..LoadStats::default() };
        Ok(Self {
            cfg,
            backend,
            embed,
            output,
            out_norm,
            layers,
            rope,
            shape,
            profile: OpProfile::default(),
            load,
            adapter: None,
            lookahead: None,
        })
    }

    /// Loads a GGUF model onto `backend`.
    pub fn load(path: &Path, backend: B) -> Result<Self> {
        let mut file = GgufFile::open(path)?;
        let cfg = ModelConfig::from_gguf(&file)?;
        Self::from_file(&mut file, cfg, backend)
    }

    /// Loads the weights of an already opened and validated file. A reader thread reads each
    /// tensor's bytes one or two tensors ahead; here they are converted (in parallel) straight
    /// to the backend's weight type ([`Backend::weight_dtype`]: no f32 stop for a bf16 GPU),
    /// Q/K/V and gate/up stacked in place, and handed to the backend. The host holds at most
    /// the weight being built and two tensors read ahead (plus, on the CPU, the model itself).
    pub fn from_file(file: &mut GgufFile, cfg: ModelConfig, backend: B) -> Result<Self> {
        let t0 = Instant::now();
        let file: &GgufFile = file;
        let freq_factors =
            if file.has_tensor("rope_freqs.weight") { Some(file.tensor_f32("rope_freqs.weight")?.1) } else { None };
        let rope = RopeTable::new_scaled(
            cfg.head_dim,
            cfg.rope_dim,
            cfg.rope_base,
            cfg.arch.rope_style(),
            freq_factors.as_deref(),
            cfg.rope_linear_factor,
            cfg.context_length.clamp(1, ROPE_TABLE_MAX),
        )?;
        let mut stats = LoadStats::default();
        let pieces = read_and_convert(file, &jobs(&cfg), &backend, &mut stats)?;
        let mut pieces = Pieces(pieces.into_iter());
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for _ in 0..cfg.n_layers {
            layers.push(pieces.layer(&cfg)?);
        }
        let embed = pieces.mat()?;
        let output = if cfg.tied_embeddings { None } else { Some(pieces.mat()?) };
        let out_norm = pieces.buf()?;
        let shape = cfg.attn_shape();
        stats.total = t0.elapsed();
        Ok(Self {
            cfg,
            backend,
            embed,
            output,
            out_norm,
            layers,
            rope,
            shape,
            profile: OpProfile::default(),
            load: stats,
            adapter: None,
            lookahead: None,
        })
    }
}
