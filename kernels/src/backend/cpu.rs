//! The CPU backend: the op set on host vectors (see the parent module for the contract).

use super::{from_bf16, to_bf16, Backend, DType, HostBuf, Memory};
use crate::attention::{self, AttnShape, KvRef};
use crate::error::{check_len, KernelError, Result};
use crate::matmul::{self, Matrix};
use crate::rope::{self, RopeTable};
use crate::{elementwise, merge, norm};

/// The CPU backend: rayon threads, runtime-dispatched SIMD, `gemm` micro-kernels. Its KV
/// caches are f32 unless made with [`Cpu::with_kv_dtype`] (bf16 halves their memory; the
/// attention widens bf16 keys and values to f32 per call). Its forward is f32; made with
/// [`Cpu::with_activations`]`(Bf16)` it computes with a GPU's bf16 roundings instead.
#[derive(Clone, Copy, Debug, Default)]
pub struct Cpu {
    kv: DType,
    act: DType,
}

/// The CPU backend with f32 KV caches (the default): `Cpu.matmul_t(..)`, `LoadedModel::load(.., Cpu)`.
#[allow(non_upper_case_globals)]
pub const Cpu: Cpu = Cpu { kv: DType::F32, act: DType::F32 };

impl Cpu {
    /// A CPU backend whose KV caches hold `kv` elements.
    pub fn with_kv_dtype(kv: DType) -> Self {
        Self { kv, act: DType::F32 }
    }

    /// This backend with activations of `act`. With bf16 it rounds exactly where the CUDA
    /// backend's bf16 forward rounds: weights kept as bf16, every GEMM input rounded to bf16
    /// (products exact, sums in f32), every activation stored as bf16. The CPU path users run
    /// is f32; this one is the GPU forward's numerics on the CPU, whose kernels the emulation
    /// tests hold to the same references op by op.
    pub fn with_activations(self, act: DType) -> Self {
        Self { act, ..self }
    }

    /// A GEMM's input as the backend multiplies it: bf16 values widened; f32 values as they
    /// are, or rounded to bf16 first when the weights are bf16 (what the GPU's GEMM sees).
    fn gemm_input<'a>(&self, x: &'a HostBuf) -> std::borrow::Cow<'a, [f32]> {
        match (x, self.act) {
            (HostBuf::F32(v), DType::Bf16) => {
                std::borrow::Cow::Owned(v.iter().map(|&f| from_bf16(to_bf16(f))).collect())
            }
            _ => widened(x),
        }
    }
}

/// Stores f32 results into `out`, each rounded once when `out` holds bf16.
fn store(out: &mut HostBuf, wide: &[f32]) {
    match out {
        HostBuf::F32(o) => o.copy_from_slice(wide),
        HostBuf::Bf16(o) => o.iter_mut().zip(wide).for_each(|(b, &w)| *b = to_bf16(w)),
    }
}

/// Runs `f` on an f32 view of `out` (borrowed when f32; a widened copy stored back rounded
/// once when bf16).
fn through_f32<R>(out: &mut HostBuf, f: impl FnOnce(&mut [f32]) -> Result<R>) -> Result<R> {
    match out {
        HostBuf::F32(o) => f(o),
        HostBuf::Bf16(_) => {
            let mut wide = out.to_f32();
            let r = f(&mut wide)?;
            store(out, &wide);
            Ok(r)
        }
    }
}

/// Memory the host can still give (`MemAvailable` of `/proc/meminfo`), when known.
pub fn host_available_bytes() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

fn check_rows(op: &'static str, len: usize, rows: &[usize], row_len: usize) -> Result<()> {
    if let Some(&r) = rows.iter().find(|&&r| (r + 1) * row_len > len) {
        return Err(KernelError::Shape {
            op,
            detail: format!("row {r} of {row_len} values is outside a buffer of {len}"),
        });
    }
    Ok(())
}

/// The f32 view of a key or value buffer: borrowed when f32, widened when bf16.
fn widened(b: &HostBuf) -> std::borrow::Cow<'_, [f32]> {
    match b {
        HostBuf::F32(v) => std::borrow::Cow::Borrowed(v.as_slice()),
        HostBuf::Bf16(_) => std::borrow::Cow::Owned(b.to_f32()),
    }
}

fn same_dtype(op: &'static str, a: &HostBuf, b: &HostBuf) -> Result<()> {
    if a.dtype() == b.dtype() {
        Ok(())
    } else {
        Err(KernelError::Dtype { op, detail: format!("a {} buffer and a {} buffer", a.dtype(), b.dtype()) })
    }
}

impl Backend for Cpu {
    type Buf = HostBuf;
    type Mat = Matrix;
    type Mark = std::time::Instant;

    fn mark(&self) -> Result<std::time::Instant> {
        Ok(std::time::Instant::now())
    }
    fn seconds_between(&self, start: &std::time::Instant, end: &std::time::Instant) -> Result<f64> {
        Ok(end.saturating_duration_since(*start).as_secs_f64())
    }
    fn duplicate(&self, src: &HostBuf) -> Result<HostBuf> {
        Ok(src.clone())
    }

    fn memory(&self) -> Option<Memory> {
        host_available_bytes().map(|free| Memory { device: "cpu".into(), free })
    }
    fn name(&self) -> &'static str {
        "cpu"
    }
    fn upload(&self, host: &[f32]) -> Result<HostBuf> {
        Ok(HostBuf::F32(host.to_vec()))
    }
    fn download(&self, buf: &HostBuf) -> Result<Vec<f32>> {
        Ok(buf.to_f32())
    }
    fn download_range(&self, buf: &HostBuf, start: usize, len: usize) -> Result<Vec<f32>> {
        let range = || KernelError::Shape {
            op: "download_range",
            detail: format!("range {start}..{} of a buffer of {}", start + len, buf.len()),
        };
        match buf {
            HostBuf::F32(v) => v.get(start..start + len).map(<[f32]>::to_vec).ok_or_else(range),
            HostBuf::Bf16(v) => {
                v.get(start..start + len).map(|s| s.iter().map(|&b| from_bf16(b)).collect()).ok_or_else(range)
            }
        }
    }
    fn zeros_as(&self, len: usize, dtype: DType) -> Result<HostBuf> {
        let mut b = HostBuf::zeros(0, dtype);
        self.resize(&mut b, len)?;
        Ok(b)
    }
    fn dtype(&self, buf: &HostBuf) -> DType {
        buf.dtype()
    }
    fn kv_dtype(&self) -> DType {
        self.kv
    }
    fn act_dtype(&self) -> DType {
        self.act
    }
    fn weight_dtype(&self) -> DType {
        self.act
    }
    fn matrix_typed(&self, rows: usize, cols: usize, data: HostBuf) -> Result<Matrix> {
        // With bf16 activations the weights are bf16 as on the GPU (widened exactly to f32).
        let values = match (data, self.act) {
            (HostBuf::F32(v), DType::Bf16) => v.into_iter().map(|f| from_bf16(to_bf16(f))).collect(),
            (HostBuf::F32(v), _) => v,
            (b @ HostBuf::Bf16(_), _) => b.to_f32(),
        };
        Matrix::new(rows, cols, values)
    }
    fn len(&self, buf: &HostBuf) -> usize {
        buf.len()
    }
    fn resize(&self, buf: &mut HostBuf, len: usize) -> Result<()> {
        self.reserve(buf, len)?;
        match buf {
            HostBuf::F32(v) => v.resize(len, 0.0),
            HostBuf::Bf16(v) => v.resize(len, 0),
        }
        Ok(())
    }
    fn reserve(&self, buf: &mut HostBuf, capacity: usize) -> Result<()> {
        // A request the allocator refuses (larger than the memory the OS will give) is a
        // resource error, not an abort of the process.
        let size = buf.dtype().size();
        let refused = |extra: usize| KernelError::OutOfMemory {
            device: "cpu".into(),
            requested: extra.saturating_mul(size),
            free: host_available_bytes(),
            advice: crate::OomAdvice::default(),
        };
        match buf {
            HostBuf::F32(v) => {
                let extra = capacity.saturating_sub(v.len());
                v.try_reserve(extra).map_err(|_| refused(extra))
            }
            HostBuf::Bf16(v) => {
                let extra = capacity.saturating_sub(v.len());
                v.try_reserve(extra).map_err(|_| refused(extra))
            }
        }
    }
    fn matrix(&self, m: Matrix) -> Result<Matrix> {
        match self.act {
            DType::Bf16 => {
                let (rows, cols) = (m.rows(), m.cols());
                self.matrix_typed(rows, cols, HostBuf::F32(m.into_data()))
            }
            DType::F32 => Ok(m),
        }
    }
    fn mat_shape(&self, m: &Matrix) -> (usize, usize) {
        (m.rows(), m.cols())
    }
    fn embedding(&self, table: &Matrix, ids: &[u32], out: &mut HostBuf) -> Result<()> {
        through_f32(out, |o| elementwise::embedding(table, ids, o))
    }
    fn matmul_t(&self, x: &HostBuf, rows: usize, w: &Matrix, out: &mut HostBuf) -> Result<()> {
        let x = self.gemm_input(x);
        through_f32(out, |o| matmul::matmul_t(&x, rows, w, o))
    }
    fn matmul_t_acc(&self, x: &HostBuf, rows: usize, w: &Matrix, out: &mut HostBuf) -> Result<()> {
        let x = self.gemm_input(x);
        let mut product = vec![0f32; out.len()];
        matmul::matmul_t(&x, rows, w, &mut product)?;
        through_f32(out, |o| {
            o.iter_mut().zip(&product).for_each(|(a, p)| *a += p);
            Ok(())
        })
    }
    fn add_bias(&self, x: &mut HostBuf, bias: &HostBuf) -> Result<()> {
        let bias = bias.f32s("add_bias", "bias")?;
        through_f32(x, |x| elementwise::add_bias(x, bias))
    }
    fn rms_norm(&self, x: &HostBuf, w: &HostBuf, eps: f32, out: &mut HostBuf) -> Result<()> {
        let w = w.f32s("rms_norm", "w")?;
        check_len("rms_norm", "out", out.len(), x.len())?;
        let x = widened(x);
        through_f32(out, |o| norm::rms_norm(&x, w, eps, o))
    }
    fn rope(&self, x: &mut HostBuf, n_heads: usize, positions: &[u32], table: &RopeTable) -> Result<()> {
        match x {
            HostBuf::F32(v) => rope::rope(v, n_heads, positions, table),
            HostBuf::Bf16(v) => {
                // Rotated in f32 from the stored values, rounded once: as the CUDA kernel does.
                let mut wide: Vec<f32> = v.iter().map(|&b| from_bf16(b)).collect();
                rope::rope(&mut wide, n_heads, positions, table)?;
                v.iter_mut().zip(&wide).for_each(|(b, &w)| *b = to_bf16(w));
                Ok(())
            }
        }
    }
    fn attention(
        &self,
        shape: &AttnShape,
        q: &HostBuf,
        qpos: &[u32],
        k: &HostBuf,
        v: &HostBuf,
        kpos: &[u32],
        out: &mut HostBuf,
        lse: &mut HostBuf,
    ) -> Result<()> {
        let op = "attention";
        same_dtype(op, k, v)?;
        let (k, v) = (widened(k), widened(v));
        let kv = KvRef { k: &k, v: &v, pos: kpos };
        let lse = lse.f32s_mut(op, "lse")?;
        // A bf16 output is the f32 one rounded once, as on a GPU.
        through_f32(out, |o| attention::attention(shape, &widened(q), qpos, kv, o, lse))
    }
    fn attention_scores(
        &self,
        shape: &AttnShape,
        q: &HostBuf,
        qpos: &[u32],
        k: &HostBuf,
        kpos: &[u32],
        lse: &HostBuf,
        scores: &mut HostBuf,
    ) -> Result<()> {
        let op = "attention_scores";
        let k = widened(k);
        let kv = KvRef { k: &k, v: &[], pos: kpos };
        attention::attention_scores(shape, &widened(q), qpos, kv, lse.f32s(op, "lse")?, scores.f32s_mut(op, "scores")?)
    }
    fn merge_partial(
        &self,
        out: &mut HostBuf,
        lse: &mut HostBuf,
        block_out: &HostBuf,
        block_lse: &HostBuf,
        head_dim: usize,
    ) -> Result<()> {
        let op = "merge_partial";
        merge::merge_partial(
            out.f32s_mut(op, "out")?,
            lse.f32s_mut(op, "lse")?,
            block_out.f32s(op, "block_out")?,
            block_lse.f32s(op, "block_lse")?,
            head_dim,
        )
    }
    fn silu_mul(&self, gate_up: &HostBuf, ffn: usize, out: &mut HostBuf) -> Result<()> {
        let gate_up = widened(gate_up);
        through_f32(out, |o| elementwise::silu_mul(&gate_up, ffn, o))
    }
    fn add_assign(&self, x: &mut HostBuf, y: &HostBuf) -> Result<()> {
        same_dtype("add_assign", x, y)?;
        let y = widened(y);
        through_f32(x, |x| elementwise::add_assign(x, &y))
    }
    fn copy_columns(&self, src: &HostBuf, src_cols: usize, col: usize, width: usize, dst: &mut HostBuf) -> Result<()> {
        match (src, dst) {
            (HostBuf::F32(s), HostBuf::F32(d)) => elementwise::copy_columns(s, src_cols, col, width, d),
            (HostBuf::Bf16(s), HostBuf::Bf16(d)) => elementwise::copy_columns(s, src_cols, col, width, d),
            (src, dst) => {
                // Converting: through f32, each element rounded once when stored in bf16.
                let mut wide = vec![0f32; dst.len()];
                elementwise::copy_columns(&src.to_f32(), src_cols, col, width, &mut wide)?;
                match dst {
                    HostBuf::F32(d) => *d = wide,
                    HostBuf::Bf16(d) => d.iter_mut().zip(&wide).for_each(|(b, &w)| *b = to_bf16(w)),
                }
                Ok(())
            }
        }
    }
    fn copy_rows(
        &self,
        src: &HostBuf,
        src_rows: &[usize],
        dst: &mut HostBuf,
        dst_rows: &[usize],
        row_len: usize,
    ) -> Result<()> {
        check_len("copy_rows", "dst_rows", dst_rows.len(), src_rows.len())?;
        same_dtype("copy_rows", src, dst)?;
        check_rows("copy_rows", src.len(), src_rows, row_len)?;
        check_rows("copy_rows", dst.len(), dst_rows, row_len)?;
        fn rows<T: Copy>(src: &[T], src_rows: &[usize], dst: &mut [T], dst_rows: &[usize], row_len: usize) {
            for (&s, &d) in src_rows.iter().zip(dst_rows) {
                dst[d * row_len..(d + 1) * row_len].copy_from_slice(&src[s * row_len..(s + 1) * row_len]);
            }
        }
        match (src, dst) {
            (HostBuf::F32(s), HostBuf::F32(d)) => rows(s, src_rows, d, dst_rows, row_len),
            (HostBuf::Bf16(s), HostBuf::Bf16(d)) => rows(s, src_rows, d, dst_rows, row_len),
            _ => unreachable!("same_dtype checked above"),
        }
        Ok(())
    }
    fn append(&self, dst: &mut HostBuf, src: &HostBuf) -> Result<()> {
        same_dtype("append", src, dst)?;
        match (dst, src) {
            (HostBuf::F32(d), HostBuf::F32(s)) => d.extend_from_slice(s),
            (HostBuf::Bf16(d), HostBuf::Bf16(s)) => d.extend_from_slice(s),
            _ => unreachable!("same_dtype checked above"),
        }
        Ok(())
    }
    fn download_typed(&self, buf: &HostBuf) -> Result<HostBuf> {
        Ok(buf.clone())
    }
    fn upload_typed(&self, host: &HostBuf) -> Result<HostBuf> {
        Ok(host.clone())
    }
}
