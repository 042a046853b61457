//! The op set the model is written against, and its CPU implementation.
//!
//! The transformer in `flowprefill-worker` calls only these ops on `B::Buf` buffers, so a
//! device backend (CUDA: cuBLAS GEMMs + NVRTC kernels) implements this trait and runs the same
//! model code; there is no second copy of the layer math. Positions and token ids stay on the
//! host (they are small and the scheduler owns them).

use crate::attention::{self, AttnShape, KvRef};
use crate::error::{check_len, KernelError, Result};
use crate::matmul::{self, Matrix};
use crate::rope::{self, RopeTable};
use crate::{elementwise, merge, norm};

/// Device operations over f32 buffers. Every op checks lengths and returns a typed error.
pub trait Backend: Send + Sync + 'static {
    /// A contiguous f32 buffer on the device.
    type Buf: Send + Sync + 'static;
    /// A weight matrix `[out, in]` prepared for [`Backend::matmul_t`].
    type Mat: Send + Sync;

    /// Short name for logs and errors.
    fn name(&self) -> &'static str;
    /// Copies host data to a new device buffer.
    fn upload(&self, host: &[f32]) -> Result<Self::Buf>;
    /// Copies a device buffer to the host.
    fn download(&self, buf: &Self::Buf) -> Result<Vec<f32>>;
    /// Copies `buf[start..start+len]` to the host.
    fn download_range(&self, buf: &Self::Buf, start: usize, len: usize) -> Result<Vec<f32>>;
    /// A zeroed buffer.
    fn zeros(&self, len: usize) -> Result<Self::Buf>;
    /// Length in f32 elements.
    fn len(&self, buf: &Self::Buf) -> usize;
    /// Resizes `buf` to `len` elements (new elements are zero; contents up to `len` kept).
    fn resize(&self, buf: &mut Self::Buf, len: usize) -> Result<()>;
    /// Makes room for `capacity` elements without changing the contents, so that appends up to
    /// it do not reallocate (a KV cache reserves its final size up front).
    fn reserve(&self, buf: &mut Self::Buf, capacity: usize) -> Result<()>;
    /// Moves a host weight matrix to the device.
    fn matrix(&self, m: Matrix) -> Result<Self::Mat>;
    /// `(rows, cols)` of a weight matrix.
    fn mat_shape(&self, m: &Self::Mat) -> (usize, usize);

    /// Embedding rows of `ids` into `out` (`ids.len() x cols`).
    fn embedding(&self, table: &Self::Mat, ids: &[u32], out: &mut Self::Buf) -> Result<()>;
    /// `out[rows, n] = x[rows, k] · Wᵀ`.
    fn matmul_t(&self, x: &Self::Buf, rows: usize, w: &Self::Mat, out: &mut Self::Buf) -> Result<()>;
    /// Adds `bias` to every row of `x`.
    fn add_bias(&self, x: &mut Self::Buf, bias: &Self::Buf) -> Result<()>;
    /// RMSNorm of rows of `w.len()` values.
    fn rms_norm(&self, x: &Self::Buf, w: &Self::Buf, eps: f32, out: &mut Self::Buf) -> Result<()>;
    /// RoPE in place, token t at `positions[t]`.
    fn rope(&self, x: &mut Self::Buf, n_heads: usize, positions: &[u32], table: &RopeTable) -> Result<()>;
    /// Attention with lse (see [`crate::attention`]).
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        shape: &AttnShape,
        q: &Self::Buf,
        qpos: &[u32],
        k: &Self::Buf,
        v: &Self::Buf,
        kpos: &[u32],
        out: &mut Self::Buf,
        lse: &mut Self::Buf,
    ) -> Result<()>;
    /// Adds per-key attention mass to `scores` (see [`crate::attention::attention_scores`]).
    #[allow(clippy::too_many_arguments)]
    fn attention_scores(
        &self,
        shape: &AttnShape,
        q: &Self::Buf,
        qpos: &[u32],
        k: &Self::Buf,
        kpos: &[u32],
        lse: &Self::Buf,
        scores: &mut Self::Buf,
    ) -> Result<()>;
    /// Merges a partial attention result into another (see [`crate::merge`]).
    fn merge_partial(
        &self,
        out: &mut Self::Buf,
        lse: &mut Self::Buf,
        block_out: &Self::Buf,
        block_lse: &Self::Buf,
        head_dim: usize,
    ) -> Result<()>;
    /// `silu(gate) * up` from a fused `[gate | up]` row layout.
    fn silu_mul(&self, gate_up: &Self::Buf, ffn: usize, out: &mut Self::Buf) -> Result<()>;
    /// `x += y`.
    fn add_assign(&self, x: &mut Self::Buf, y: &Self::Buf) -> Result<()>;
    /// Columns `[col, col+width)` of a `[rows, src_cols]` matrix into `dst`.
    fn copy_columns(
        &self,
        src: &Self::Buf,
        src_cols: usize,
        col: usize,
        width: usize,
        dst: &mut Self::Buf,
    ) -> Result<()>;
    /// Copies row `src_rows[i]` of `src` to row `dst_rows[i]` of `dst` (rows of `row_len`).
    fn copy_rows(
        &self,
        src: &Self::Buf,
        src_rows: &[usize],
        dst: &mut Self::Buf,
        dst_rows: &[usize],
        row_len: usize,
    ) -> Result<()>;
    /// Appends all of `src` to the end of `dst`.
    fn append(&self, dst: &mut Self::Buf, src: &Self::Buf) -> Result<()>;

    /// Copies a buffer to the host for a transport that moves host memory (the thread and MPI
    /// communicators). Separate from [`Backend::download`] so that a transport's staging can be
    /// told apart from the copies the steps make themselves (a device transport makes none).
    fn stage_out(&self, buf: &Self::Buf) -> Result<Vec<f32>> {
        self.download(buf)
    }
    /// The receiving side of [`Backend::stage_out`].
    fn stage_in(&self, host: &[f32]) -> Result<Self::Buf> {
        self.upload(host)
    }
}

/// The CPU backend: rayon threads, runtime-dispatched SIMD, `gemm` micro-kernels.
#[derive(Clone, Copy, Debug, Default)]
pub struct Cpu;

fn check_rows(op: &'static str, len: usize, rows: &[usize], row_len: usize) -> Result<()> {
    if let Some(&r) = rows.iter().find(|&&r| (r + 1) * row_len > len) {
        return Err(KernelError::Shape {
            op,
            detail: format!("row {r} of {row_len} values is outside a buffer of {len}"),
        });
    }
    Ok(())
}

impl Backend for Cpu {
    type Buf = Vec<f32>;
    type Mat = Matrix;

    fn name(&self) -> &'static str {
        "cpu"
    }
    fn upload(&self, host: &[f32]) -> Result<Vec<f32>> {
        Ok(host.to_vec())
    }
    fn download(&self, buf: &Vec<f32>) -> Result<Vec<f32>> {
        Ok(buf.clone())
    }
    fn download_range(&self, buf: &Vec<f32>, start: usize, len: usize) -> Result<Vec<f32>> {
        buf.get(start..start + len).map(<[f32]>::to_vec).ok_or_else(|| KernelError::Shape {
            op: "download_range",
            detail: format!("range {start}..{} of a buffer of {}", start + len, buf.len()),
        })
    }
    fn zeros(&self, len: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; len])
    }
    fn len(&self, buf: &Vec<f32>) -> usize {
        buf.len()
    }
    fn resize(&self, buf: &mut Vec<f32>, len: usize) -> Result<()> {
        buf.resize(len, 0.0);
        Ok(())
    }
    fn reserve(&self, buf: &mut Vec<f32>, capacity: usize) -> Result<()> {
        buf.reserve(capacity.saturating_sub(buf.len()));
        Ok(())
    }
    fn matrix(&self, m: Matrix) -> Result<Matrix> {
        Ok(m)
    }
    fn mat_shape(&self, m: &Matrix) -> (usize, usize) {
        (m.rows(), m.cols())
    }
    fn embedding(&self, table: &Matrix, ids: &[u32], out: &mut Vec<f32>) -> Result<()> {
        elementwise::embedding(table, ids, out)
    }
    fn matmul_t(&self, x: &Vec<f32>, rows: usize, w: &Matrix, out: &mut Vec<f32>) -> Result<()> {
        matmul::matmul_t(x, rows, w, out)
    }
    fn add_bias(&self, x: &mut Vec<f32>, bias: &Vec<f32>) -> Result<()> {
        elementwise::add_bias(x, bias)
    }
    fn rms_norm(&self, x: &Vec<f32>, w: &Vec<f32>, eps: f32, out: &mut Vec<f32>) -> Result<()> {
        norm::rms_norm(x, w, eps, out)
    }
    fn rope(&self, x: &mut Vec<f32>, n_heads: usize, positions: &[u32], table: &RopeTable) -> Result<()> {
        rope::rope(x, n_heads, positions, table)
    }
    fn attention(
        &self,
        shape: &AttnShape,
        q: &Vec<f32>,
        qpos: &[u32],
        k: &Vec<f32>,
        v: &Vec<f32>,
        kpos: &[u32],
        out: &mut Vec<f32>,
        lse: &mut Vec<f32>,
    ) -> Result<()> {
        attention::attention(shape, q, qpos, KvRef { k, v, pos: kpos }, out, lse)
    }
    fn attention_scores(
        &self,
        shape: &AttnShape,
        q: &Vec<f32>,
        qpos: &[u32],
        k: &Vec<f32>,
        kpos: &[u32],
        lse: &Vec<f32>,
        scores: &mut Vec<f32>,
    ) -> Result<()> {
        attention::attention_scores(shape, q, qpos, KvRef { k, v: &[], pos: kpos }, lse, scores)
    }
    fn merge_partial(
        &self,
        out: &mut Vec<f32>,
        lse: &mut Vec<f32>,
        block_out: &Vec<f32>,
        block_lse: &Vec<f32>,
        head_dim: usize,
    ) -> Result<()> {
        merge::merge_partial(out, lse, block_out, block_lse, head_dim)
    }
    fn silu_mul(&self, gate_up: &Vec<f32>, ffn: usize, out: &mut Vec<f32>) -> Result<()> {
        elementwise::silu_mul(gate_up, ffn, out)
    }
    fn add_assign(&self, x: &mut Vec<f32>, y: &Vec<f32>) -> Result<()> {
        elementwise::add_assign(x, y)
    }
    fn copy_columns(
        &self,
        src: &Vec<f32>,
        src_cols: usize,
        col: usize,
        width: usize,
        dst: &mut Vec<f32>,
    ) -> Result<()> {
        elementwise::copy_columns(src, src_cols, col, width, dst)
    }
    fn copy_rows(
        &self,
        src: &Vec<f32>,
        src_rows: &[usize],
        dst: &mut Vec<f32>,
        dst_rows: &[usize],
        row_len: usize,
    ) -> Result<()> {
        check_len("copy_rows", "dst_rows", dst_rows.len(), src_rows.len())?;
        check_rows("copy_rows", src.len(), src_rows, row_len)?;
        check_rows("copy_rows", dst.len(), dst_rows, row_len)?;
        for (&s, &d) in src_rows.iter().zip(dst_rows) {
            dst[d * row_len..(d + 1) * row_len].copy_from_slice(&src[s * row_len..(s + 1) * row_len]);
        }
        Ok(())
    }
    fn append(&self, dst: &mut Vec<f32>, src: &Vec<f32>) -> Result<()> {
        dst.extend_from_slice(src);
        Ok(())
    }
}
