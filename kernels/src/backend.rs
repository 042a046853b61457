//! The op set the model is written against, and its CPU implementation.
//!
//! The transformer in `flowprefill-worker` calls only these ops on `B::Buf` buffers, so a
//! device backend (CUDA: cuBLAS GEMMs + NVRTC kernels) implements this trait and runs the same
//! model code; there is no second copy of the layer math. Positions and token ids stay on the
//! host (they are small and the scheduler owns them).
//!
//! Buffers have an element type ([`DType`]): the forward's activations are
//! [`Backend::act_dtype`] (f32 on the CPU; bf16 on a GPU with bf16 weights, with f32
//! accumulation inside GEMMs, norms and softmax); attention outputs, log-sum-exps, scores and
//! logits are f32; key/value caches are [`Backend::kv_dtype`] (bf16 halves their memory and
//! the bytes that cross the network). Lengths are always counted in elements. An op computes in
//! f32 and rounds once where it stores bf16 (to nearest even), so a bf16 forward differs from
//! the f32 one only by those roundings; an op refuses an element type it cannot take with
//! [`KernelError::Dtype`].

use crate::attention::AttnShape;
use crate::error::{KernelError, Result};
use crate::matmul::Matrix;
use crate::rope::RopeTable;

/// Element type of a buffer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float.
    #[default]
    F32,
    /// bfloat16 (the upper half of an f32), rounded to nearest even when stored.
    Bf16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 => 2,
        }
    }

    /// `f32` or `bf16`.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
        }
    }

    /// The code that identifies it on the wire.
    pub fn code(self) -> u32 {
        match self {
            DType::F32 => 0,
            DType::Bf16 => 1,
        }
    }

    /// The type of a wire code.
    pub fn from_code(code: u32) -> Option<Self> {
        match code {
            0 => Some(DType::F32),
            1 => Some(DType::Bf16),
            _ => None,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" => Ok(DType::F32),
            "bf16" => Ok(DType::Bf16),
            other => Err(format!("`{other}`: give bf16 or f32")),
        }
    }
}

/// bf16 bits of `x`, rounding to nearest even (NaN stays NaN): what every bf16 store does, on
/// the CPU and in the CUDA kernels (`fp_f32_to_bf16`).
pub fn to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// The f32 value of bf16 bits.
pub fn from_bf16(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// A buffer in host memory: the CPU backend's buffers, and what a transport stages a device
/// buffer into.
#[derive(Clone, Debug, PartialEq)]
pub enum HostBuf {
    /// f32 values.
    F32(Vec<f32>),
    /// bf16 bits.
    Bf16(Vec<u16>),
}

impl Default for HostBuf {
    fn default() -> Self {
        HostBuf::F32(Vec::new())
    }
}

impl From<Vec<f32>> for HostBuf {
    fn from(v: Vec<f32>) -> Self {
        HostBuf::F32(v)
    }
}

impl HostBuf {
    /// `len` zeros of `dtype`.
    pub fn zeros(len: usize, dtype: DType) -> Self {
        match dtype {
            DType::F32 => HostBuf::F32(vec![0.0; len]),
            DType::Bf16 => HostBuf::Bf16(vec![0; len]),
        }
    }

    /// Elements held.
    pub fn len(&self) -> usize {
        match self {
            HostBuf::F32(v) => v.len(),
            HostBuf::Bf16(v) => v.len(),
        }
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        match self {
            HostBuf::F32(_) => DType::F32,
            HostBuf::Bf16(_) => DType::Bf16,
        }
    }

    /// The values as f32 (bf16 widened exactly).
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            HostBuf::F32(v) => v.clone(),
            HostBuf::Bf16(v) => v.iter().map(|&b| from_bf16(b)).collect(),
        }
    }

    /// The f32 values, or a [`KernelError::Dtype`] naming `op` and `what`.
    pub fn f32s(&self, op: &'static str, what: &str) -> Result<&Vec<f32>> {
        match self {
            HostBuf::F32(v) => Ok(v),
            HostBuf::Bf16(_) => Err(f32_only(op, what)),
        }
    }

    /// The f32 values, writable.
    pub fn f32s_mut(&mut self, op: &'static str, what: &str) -> Result<&mut Vec<f32>> {
        match self {
            HostBuf::F32(v) => Ok(v),
            HostBuf::Bf16(_) => Err(f32_only(op, what)),
        }
    }
}

/// The error of an op that takes only f32 buffers.
pub fn f32_only(op: &'static str, what: &str) -> KernelError {
    KernelError::Dtype { op, detail: format!("{what} holds bf16 values; this operation takes f32") }
}

/// Device operations over typed buffers. Every op checks lengths and element types and
/// returns a typed error.
pub trait Backend: Send + Sync + 'static {
    /// A contiguous buffer on the device, of one [`DType`].
    type Buf: Send + Sync + 'static;
    /// A weight matrix `[out, in]` prepared for [`Backend::matmul_t`].
    type Mat: Send + Sync;
    /// A point in the backend's queue of work ([`Backend::mark`]): the instant on the CPU, an
    /// event recorded on the stream on a GPU.
    type Mark: Clone + Send + Sync + 'static;

    /// Short name for logs and errors.
    fn name(&self) -> &'static str;
    /// Copies host data to a new f32 device buffer.
    fn upload(&self, host: &[f32]) -> Result<Self::Buf>;
    /// Copies a device buffer to the host, as f32 (bf16 widened exactly).
    fn download(&self, buf: &Self::Buf) -> Result<Vec<f32>>;
    /// Copies `buf[start..start+len]` to the host, as f32.
    fn download_range(&self, buf: &Self::Buf, start: usize, len: usize) -> Result<Vec<f32>>;
    /// A zeroed f32 buffer.
    fn zeros(&self, len: usize) -> Result<Self::Buf> {
        self.zeros_as(len, DType::F32)
    }
    /// A zeroed buffer of `dtype`.
    fn zeros_as(&self, len: usize, dtype: DType) -> Result<Self::Buf>;
    /// Element type of a buffer.
    fn dtype(&self, buf: &Self::Buf) -> DType;
    /// Element type of the key/value caches on this backend (`--kv-dtype`).
    fn kv_dtype(&self) -> DType;
    /// Element type of the forward's activations between ops (the residual stream, norms,
    /// projections, the SiLU gate): f32 by default; bf16 on a GPU with bf16 weights.
    fn act_dtype(&self) -> DType {
        DType::F32
    }
    /// Length in elements.
    fn len(&self, buf: &Self::Buf) -> usize;
    /// Size in bytes (length times element size).
    fn bytes(&self, buf: &Self::Buf) -> usize {
        self.len(buf) * self.dtype(buf).size()
    }
    /// Resizes `buf` to `len` elements (new elements are zero; contents up to `len` kept).
    fn resize(&self, buf: &mut Self::Buf, len: usize) -> Result<()>;
    /// Makes room for `capacity` elements without changing the contents, so that appends up to
    /// it do not reallocate (a KV cache reserves its final size up front).
    fn reserve(&self, buf: &mut Self::Buf, capacity: usize) -> Result<()>;
    /// Moves a host weight matrix to the device.
    fn matrix(&self, m: Matrix) -> Result<Self::Mat>;
    /// Element type the backend keeps weight matrices in: f32 on the CPU, the `--weights` type
    /// on a GPU. A loader that converts straight to it spares [`Backend::matrix_typed`] a pass.
    fn weight_dtype(&self) -> DType {
        DType::F32
    }
    /// Moves a `rows x cols` host weight matrix of either element type to the device,
    /// converted to [`Backend::weight_dtype`] where it differs (bf16 to f32 is exact).
    fn matrix_typed(&self, rows: usize, cols: usize, data: HostBuf) -> Result<Self::Mat> {
        let values = match data {
            HostBuf::F32(v) => v,
            b @ HostBuf::Bf16(_) => b.to_f32(),
        };
        self.matrix(Matrix::new(rows, cols, values)?)
    }
    /// `(rows, cols)` of a weight matrix.
    fn mat_shape(&self, m: &Self::Mat) -> (usize, usize);

    /// Embedding rows of `ids` into `out` (`ids.len() x cols`).
    fn embedding(&self, table: &Self::Mat, ids: &[u32], out: &mut Self::Buf) -> Result<()>;
    /// `out[rows, n] = x[rows, k] · Wᵀ` (`x` and `out` of either element type; f32 sums).
    fn matmul_t(&self, x: &Self::Buf, rows: usize, w: &Self::Mat, out: &mut Self::Buf) -> Result<()>;
    /// `out[rows, n] += x[rows, k] · Wᵀ`: a residual add in the GEMM's epilogue (the sum in
    /// f32, rounded once into `out`'s type). The default multiplies into a temporary of `out`'s
    /// type and adds it; a device adds in the epilogue.
    fn matmul_t_acc(&self, x: &Self::Buf, rows: usize, w: &Self::Mat, out: &mut Self::Buf) -> Result<()> {
        let mut tmp = self.zeros_as(self.len(out), self.dtype(out))?;
        self.matmul_t(x, rows, w, &mut tmp)?;
        self.add_assign(out, &tmp)
    }
    /// Adds `bias` to every row of `x`.
    fn add_bias(&self, x: &mut Self::Buf, bias: &Self::Buf) -> Result<()>;
    /// RMSNorm of rows of `w.len()` values.
    fn rms_norm(&self, x: &Self::Buf, w: &Self::Buf, eps: f32, out: &mut Self::Buf) -> Result<()>;
    /// RoPE in place, token t at `positions[t]`.
    fn rope(&self, x: &mut Self::Buf, n_heads: usize, positions: &[u32], table: &RopeTable) -> Result<()>;
    /// Attention with lse (see [`crate::attention`]). `out` is f32 or bf16 (the f32 result
    /// rounded once: the bf16 forward's attention output, read as it is by the output
    /// projection); `lse` is f32. [`Backend::merge_partial`] takes f32 outputs only.
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
    /// [`Backend::attention`] of the `qpos.len()` query rows that start at row `q_first` of `q`
    /// over the `kpos.len()` key rows that start at row `k_first` of `k` and `v`, written to the
    /// same rows (from `q_first`) of `out` and `lse`, which may hold other rows. The same values
    /// as gathering those rows and calling [`Backend::attention`] (the default does exactly
    /// that); a backend that can address rows in place overrides it (the CUDA backend: pointer
    /// offsets, no copies), so that several chunks batched into one forward attend with one call
    /// each instead of a gather, a scatter and their buffers.
    #[allow(clippy::too_many_arguments)]
    fn attention_rows(
        &self,
        shape: &AttnShape,
        q: &Self::Buf,
        q_first: usize,
        qpos: &[u32],
        k: &Self::Buf,
        v: &Self::Buf,
        k_first: usize,
        kpos: &[u32],
        out: &mut Self::Buf,
        lse: &mut Self::Buf,
    ) -> Result<()> {
        attention_rows_by_gathering(self, shape, q, q_first, qpos, k, v, k_first, kpos, out, lse)
    }
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
    /// `x += y` (the same element type).
    fn add_assign(&self, x: &mut Self::Buf, y: &Self::Buf) -> Result<()>;
    /// Columns `[col, col+width)` of a `[rows, src_cols]` matrix into `dst`, converting
    /// between f32 and bf16 when their types differ (f32 to bf16 rounds to nearest even).
    fn copy_columns(
        &self,
        src: &Self::Buf,
        src_cols: usize,
        col: usize,
        width: usize,
        dst: &mut Self::Buf,
    ) -> Result<()>;
    /// Copies row `src_rows[i]` of `src` to row `dst_rows[i]` of `dst` (rows of `row_len`; the
    /// same element type).
    fn copy_rows(
        &self,
        src: &Self::Buf,
        src_rows: &[usize],
        dst: &mut Self::Buf,
        dst_rows: &[usize],
        row_len: usize,
    ) -> Result<()>;
    /// Appends all of `src` to the end of `dst` (the same element type).
    fn append(&self, dst: &mut Self::Buf, src: &Self::Buf) -> Result<()>;
    /// Appends rows `first..first + rows` of `src` (rows of `width` values) to the end of `dst`:
    /// [`Backend::append`] of those rows gathered (the default), or one copy of the range where a
    /// backend can address it in place (the CUDA backend).
    fn append_rows(&self, dst: &mut Self::Buf, src: &Self::Buf, first: usize, rows: usize, width: usize) -> Result<()> {
        if first == 0 && rows * width == self.len(src) {
            return self.append(dst, src);
        }
        let part = gather_rows(self, src, first, rows, width)?;
        self.append(dst, &part)
    }

    /// Writes all of `src` (rows of `width` values) into `dst` from row `at` on; `dst` keeps its
    /// length (the rows must be inside it). Under [`Backend::record`] a row equal to the step's
    /// [`StepValues::row`] is read from device memory, so a replay writes the row it is given.
    fn put_rows(&self, dst: &mut Self::Buf, src: &Self::Buf, at: usize, width: usize) -> Result<()> {
        if width == 0 {
            return Ok(());
        }
        let rows = self.len(src) / width;
        let src_rows: Vec<usize> = (0..rows).collect();
        let dst_rows: Vec<usize> = (at..at + rows).collect();
        self.copy_rows(src, &src_rows, dst, &dst_rows, width)
    }

    /// Records the ops `step` queues as one step to replay ([`Recorded::replay`]) with other
    /// [`StepValues`], instead of running them: `Ok(None)` where the backend does not record
    /// (the default, and the CPU, where an op costs far more than its launch). While recording,
    /// an embedding of the one id `values.token`, a one-element position list equal to
    /// `values.position` and [`Backend::put_rows`] at `values.row` read those values from device
    /// memory that a replay sets; every other argument is fixed in the recording, so the caller
    /// records only ops whose other arguments stay the same from step to step (see
    /// [`step`](self::step)). Nothing `step` computes is valid until the recording is replayed;
    /// it must not read results back (a download waits for work that was never queued). An error
    /// leaves nothing recorded and the backend as before; the caller then runs the step as usual.
    fn record(&self, values: StepValues, step: &mut dyn FnMut() -> Result<()>) -> Result<Option<Recorded>> {
        let _ = (values, step);
        Ok(None)
    }

    /// A buffer's exact contents in host memory, in its own element type.
    fn download_typed(&self, buf: &Self::Buf) -> Result<HostBuf>;
    /// A device buffer with exactly these contents and element type.
    fn upload_typed(&self, host: &HostBuf) -> Result<Self::Buf>;
    /// [`Backend::download_typed`] of each of `bufs`, in order. The default takes them one at a
    /// time; a device queues every copy through page-locked memory and waits once.
    fn download_many(&self, bufs: &[&Self::Buf]) -> Result<Vec<HostBuf>> {
        bufs.iter().map(|b| self.download_typed(b)).collect()
    }
    /// [`Backend::upload_typed`] of each of `hosts`, in order (batched like
    /// [`Backend::download_many`]).
    fn upload_many(&self, hosts: &[&HostBuf]) -> Result<Vec<Self::Buf>> {
        hosts.iter().map(|h| self.upload_typed(h)).collect()
    }

    /// Copies a buffer to the host for a transport that moves host memory (the thread and MPI
    /// communicators), in its own element type (a bf16 buffer crosses the network as bf16).
    /// Separate from [`Backend::download_typed`] so that a transport's staging can be told apart
    /// from the copies the steps make themselves (a device transport makes none).
    fn stage_out(&self, buf: &Self::Buf) -> Result<HostBuf> {
        self.download_typed(buf)
    }
    /// The receiving side of [`Backend::stage_out`].
    fn stage_in(&self, host: &HostBuf) -> Result<Self::Buf> {
        self.upload_typed(host)
    }

    /// A copy of `src` (`positions.len()` rows of `n_heads` heads) with RoPE applied at
    /// `positions`, in the same element type: how a pre-RoPE chunk cache is placed at its
    /// global positions. The default copies, then rotates; a device does both in one pass.
    fn rope_copy(&self, src: &Self::Buf, n_heads: usize, positions: &[u32], table: &RopeTable) -> Result<Self::Buf> {
        let mut dst = self.duplicate(src)?;
        self.rope(&mut dst, n_heads, positions, table)?;
        Ok(dst)
    }
    /// Splits a QKV projection for attention: from `qkv` (`[rows, q_dim + 2 kv_dim]`, f32,
    /// `rows = positions.len()`, `heads = (n_heads, n_kv_heads)` of the table's head_dim) it
    /// writes `q` (f32, RoPE at `positions`), `k_pre` (the keys as projected, rounded once to
    /// its type), `k` (the rotation of the stored `k_pre` values) and `v` (rounded once to its
    /// type). The default runs the copies and rotations one by one; a device does it in one
    /// pass with the same values.
    #[allow(clippy::too_many_arguments)]
    fn split_qkv_rope(
        &self,
        qkv: &Self::Buf,
        heads: (usize, usize),
        positions: &[u32],
        table: &RopeTable,
        q: &mut Self::Buf,
        k_pre: &mut Self::Buf,
        k: &mut Self::Buf,
        v: &mut Self::Buf,
    ) -> Result<()> {
        let d = table.head_dim();
        let (qd, kvd) = (heads.0 * d, heads.1 * d);
        let qkvd = qd + 2 * kvd;
        self.copy_columns(qkv, qkvd, 0, qd, q)?;
        self.copy_columns(qkv, qkvd, qd, kvd, k_pre)?;
        self.copy_columns(qkv, qkvd, qd + kvd, kvd, v)?;
        self.copy_columns(k_pre, kvd, 0, kvd, k)?;
        self.rope(q, heads.0, positions, table)?;
        self.rope(k, heads.1, positions, table)
    }
    /// A copy of `src` (all of it, the same element type).
    fn duplicate(&self, src: &Self::Buf) -> Result<Self::Buf> {
        let n = self.len(src);
        let mut dst = self.zeros_as(n, self.dtype(src))?;
        if n > 0 {
            self.copy_columns(src, n, 0, n, &mut dst)?;
        }
        Ok(dst)
    }

    /// Marks the current end of the queued work, without waiting for it: two marks bracket the
    /// work queued between them ([`Backend::seconds_between`]). Timing ops this way adds no
    /// host synchronisation to a device's forward pass.
    fn mark(&self) -> Result<Self::Mark>;
    /// Seconds between two marks as the device ran them (waits until `end` is reached). On the
    /// CPU, where ops finish before they return, this is wall time.
    fn seconds_between(&self, start: &Self::Mark, end: &Self::Mark) -> Result<f64>;
    /// Waits until all queued work is done: a phase boundary, so that host timers around a
    /// phase measure its work (nothing to wait for on the CPU).
    fn settle(&self) -> Result<()> {
        Ok(())
    }
    /// The memory a job can still take on this backend's device, for admission: `None` when
    /// it cannot be known (a job is then never refused for memory before it starts).
    fn memory(&self) -> Option<Memory> {
        None
    }
    /// Bytes this process holds on the device now, and the most it held since
    /// [`Backend::reset_memory_peak`]; `None` where the backend does not count them.
    fn memory_use(&self) -> Option<MemoryUse> {
        None
    }
    /// Restarts the peak of [`Backend::memory_use`] from the bytes held now.
    fn reset_memory_peak(&self) {}
    /// Gives memory the backend keeps for reuse but no buffer holds back to the system
    /// (between jobs, when a service is idle); nothing on the CPU.
    fn release_unused(&self) {}
    /// Bytes of the backend's own scratch for a forward of `rows` rows at most `width` wide
    /// (buffers the model does not see: bf16 copies of GEMM inputs, cuBLAS workspace); none
    /// on the CPU.
    fn scratch_bytes(&self, _rows: usize, _width: usize) -> usize {
        0
    }
    /// Tokens per forward of a long prefill on this backend (the rest follows in further
    /// forwards over the cache so far): [`PREFILL_ROWS`] on the CPU, [`GPU_PREFILL_ROWS`] on a
    /// GPU.
    fn prefill_rows(&self) -> usize {
        PREFILL_ROWS
    }
    /// Keys that attention over many sources (the placed segments of a chunked layout in the
    /// selective recomputation and CacheBlend's deviation probe) may copy into one K/V buffer, to
    /// attend with
    /// one call where it would call once per source and merge each partial. 0, the default
    /// (the CPU: its attention is bound by arithmetic, one call per source costs no more),
    /// never copies; a GPU copies up to [`GPU_GATHERED_KEYS`] (`FLOWPREFILL_GATHERED_KEYS`
    /// sets another number, 0 for one call per source).
    fn gathered_keys(&self) -> usize {
        0
    }
}

/// Tokens per prefill forward on the CPU: big enough for efficient GEMMs, small enough to keep
/// the activations (a few x tokens x the FFN width, f32) far below the KV cache.
pub const PREFILL_ROWS: usize = 2048;

/// Tokens per prefill forward on a GPU. Pieces of 2048 cut a GPU's attention into calls too
/// small to fill it (SmolLM2's 3 KV heads at 2048 queries: 144 blocks of 128 rows for 132 SMs)
/// and add a split merge per layer and piece: on an H200 (2026-11-27) SmolLM2's 8,000-token
/// prefill ran four forwards in 24.1 ms, of which the last alone ran 8.0 ms of kernels, 5.4 of
/// them attention. 8192 is what vLLM batches by default; the activations of such a forward
/// (bf16) are about a GiB at an 8B model's FFN width of 14,336.
pub const GPU_PREFILL_ROWS: usize = 8192;

/// Keys a GPU gathers from several sources for one attention call ([`Backend::gathered_keys`]).
/// Per source, InfoFlow's recomputation of the 8B shape at 32,768 tokens in documents of 512 on
/// an H100 (2026-11-28) was one call per layer, batch of up to 2,048 rows and document, each
/// over 512 keys, with an f32 partial and a merge after each: the recomputation of 15% of the
/// tokens took 1.0 s, about the whole full prefill's 1.24 s, against some 0.2 s of work.
/// One copy of the keys (K and V of 32,768 keys of the 8B shape: 128 MiB at bf16, 40 us of the
/// H100's bandwidth) costs less than one of those merges.
pub const GPU_GATHERED_KEYS: usize = 32768;

/// That rows `first..first + rows` (of `width` values) of `what`, a buffer of `have` values,
/// lie inside it: the check of every op that addresses a range of rows in place.
pub(crate) fn check_rows(
    op: &'static str,
    what: &str,
    have: usize,
    first: usize,
    rows: usize,
    width: usize,
) -> Result<()> {
    if (first + rows) * width > have {
        return Err(crate::KernelError::Shape {
            op,
            detail: format!("{what}: rows {first}..{} of {width} values are outside a buffer of {have}", first + rows),
        });
    }
    Ok(())
}

/// Rows `first..first + rows` of `src` (rows of `width` values) as a buffer of their own.
fn gather_rows<B: Backend + ?Sized>(be: &B, src: &B::Buf, first: usize, rows: usize, width: usize) -> Result<B::Buf> {
    check_rows("rows", "src", be.len(src), first, rows, width)?;
    let mut dst = be.zeros_as(rows * width, be.dtype(src))?;
    let idx: Vec<usize> = (0..rows).collect();
    let from: Vec<usize> = (first..first + rows).collect();
    be.copy_rows(src, &from, &mut dst, &idx, width)?;
    Ok(dst)
}

/// [`Backend::attention_rows`] by gathering the rows, [`Backend::attention`] on them, and
/// copying the output rows back (the default, and the CUDA backend's path where its kernel
/// cannot read the rows in place).
#[allow(clippy::too_many_arguments)]
pub fn attention_rows_by_gathering<B: Backend + ?Sized>(
    be: &B,
    shape: &AttnShape,
    q: &B::Buf,
    q_first: usize,
    qpos: &[u32],
    k: &B::Buf,
    v: &B::Buf,
    k_first: usize,
    kpos: &[u32],
    out: &mut B::Buf,
    lse: &mut B::Buf,
) -> Result<()> {
    let (m, n, qd, kvd, h) = (qpos.len(), kpos.len(), shape.q_dim(), shape.kv_dim(), shape.n_heads);
    let whole = |b: &B::Buf, first: usize, rows: usize, width: usize| first == 0 && be.len(b) == rows * width;
    let in_place = whole(q, q_first, m, qd) && whole(k, k_first, n, kvd) && whole(v, k_first, n, kvd);
    if in_place && whole(out, q_first, m, qd) && whole(lse, q_first, m, h) {
        return be.attention(shape, q, qpos, k, v, kpos, out, lse);
    }
    let (gq, gk, gv) = (
        gather_rows(be, q, q_first, m, qd)?,
        gather_rows(be, k, k_first, n, kvd)?,
        gather_rows(be, v, k_first, n, kvd)?,
    );
    let mut o = be.zeros_as(m * qd, be.dtype(out))?;
    let mut l = be.zeros_as(m * h, be.dtype(lse))?;
    be.attention(shape, &gq, qpos, &gk, &gv, kpos, &mut o, &mut l)?;
    let (local, rows): (Vec<usize>, Vec<usize>) = (0..m).map(|i| (i, q_first + i)).unzip();
    be.copy_rows(&o, &local, out, &rows, qd)?;
    be.copy_rows(&l, &local, lse, &rows, h)
}

/// The CUDA backend's own scratch for a forward of `rows` rows at most `width` wide: bf16
/// copies of a GEMM input and of the queries (grown to the largest forward and kept), plus
/// cuBLAS's workspace and the control-data cache (16 MiB) with room to spare. A function of
/// its own so that a projection for a GPU plans the same bytes without one.
pub fn gpu_scratch_bytes(rows: usize, width: usize) -> usize {
    2 * rows * width * 2 + (48 << 20)
}

/// Bytes a process holds on its device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryUse {
    /// Held now.
    pub now: usize,
    /// The most held at once since the peak was last reset.
    pub peak: usize,
}

/// Free memory of a device, as admission sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Memory {
    /// `cuda:N`, `cpu`.
    pub device: String,
    /// Bytes a job can allocate now: free in the driver plus what the backend's pool holds
    /// unused (a GPU); `MemAvailable` (the CPU).
    pub free: usize,
}

mod cpu;
mod forward;
mod step;
pub use cpu::{host_available_bytes, Cpu};
pub(crate) use forward::forward_backend_with;
pub use forward::Wrapper;
pub use step::{Recorded, Replay, StepValues};

#[cfg(test)]
mod tests {
    use super::*;

    /// The defaults of `attention_rows` and `append_rows` (what the CPU runs, and what the
    /// CUDA backend's in-place forms must equal): the chunk's rows of the output are those of
    /// `attention` on the gathered rows, bit for bit, the other rows untouched; bad ranges are
    /// errors.
    #[test]
    fn rows_in_place_are_the_gathered_rows() {
        let shape = AttnShape::new(4, 2, 8).expect("shape");
        let (qd, kvd, h) = (shape.q_dim(), shape.kv_dim(), shape.n_heads);
        let rows = 11;
        let vals = |n: usize, s: f32| HostBuf::F32((0..n).map(|i| (i as f32 * 0.37 + s).sin()).collect());
        let (q, k, v) = (vals(rows * qd, 0.1), vals(rows * kvd, 0.2), vals(rows * kvd, 0.3));
        let (first, n) = (4, 5);
        let pos: Vec<u32> = (0..n as u32).collect();
        let mut out = HostBuf::F32(vec![9.0; rows * qd]);
        let mut lse = HostBuf::F32(vec![9.0; rows * h]);
        Cpu.attention_rows(&shape, &q, first, &pos, &k, &v, first, &pos, &mut out, &mut lse).expect("rows");
        let part = |b: &HostBuf, w: usize| HostBuf::F32(b.to_f32()[first * w..(first + n) * w].to_vec());
        let (mut o, mut l) = (Cpu.zeros(n * qd).expect("o"), Cpu.zeros(n * h).expect("l"));
        Cpu.attention(&shape, &part(&q, qd), &pos, &part(&k, kvd), &part(&v, kvd), &pos, &mut o, &mut l)
            .expect("attention");
        let (out, lse) = (out.to_f32(), lse.to_f32());
        assert_eq!(&out[first * qd..(first + n) * qd], &o.to_f32()[..]);
        assert_eq!(&lse[first * h..(first + n) * h], &l.to_f32()[..]);
        assert!(out[..first * qd].iter().chain(&out[(first + n) * qd..]).all(|&x| x == 9.0), "other rows untouched");
        let mut a = Cpu.zeros(kvd).expect("a");
        Cpu.append_rows(&mut a, &k, first, n, kvd).expect("append_rows");
        assert_eq!(&a.to_f32()[kvd..], &k.to_f32()[first * kvd..(first + n) * kvd]);
        let e = Cpu.append_rows(&mut a, &k, rows - 1, 2, kvd).expect_err("past the end");
        assert!(e.to_string().contains("outside"), "{e}");
        let mut out = HostBuf::F32(vec![0.0; rows * qd]);
        let mut lse = HostBuf::F32(vec![0.0; rows * h]);
        let e = Cpu
            .attention_rows(&shape, &q, rows - 2, &pos, &k, &v, 0, &pos, &mut out, &mut lse)
            .expect_err("past the end");
        assert!(e.to_string().contains("outside"), "{e}");
    }

    #[test]
    fn an_allocation_the_host_cannot_give_is_a_resource_error() {
        // More than any machine's address space allows: refused by the allocator, not aborted.
        let e = Cpu.zeros(usize::MAX / 8).expect_err("refused");
        let msg = e.to_string();
        assert!(matches!(e, KernelError::OutOfMemory { ref device, .. } if device == "cpu"), "{msg}");
        assert!(msg.contains("needs") && msg.contains("more on cpu") && msg.contains("fewer tokens"), "{msg}");
        let mut b = Cpu.zeros_as(4, DType::Bf16).unwrap();
        assert!(matches!(Cpu.reserve(&mut b, usize::MAX / 4), Err(KernelError::OutOfMemory { .. })));
        assert_eq!(Cpu.len(&b), 4, "a refused reserve leaves the buffer as it was");
        assert!(host_available_bytes().is_some_and(|b| b > 0), "MemAvailable is read on Linux");
    }

    #[test]
    fn bf16_rounds_to_nearest_even_and_widens_exactly() {
        assert_eq!(to_bf16(1.0), 0x3f80);
        // 1 + 2^-8 is halfway between two bf16 values: ties go to the even one (1.0).
        assert_eq!(to_bf16(1.0 + 1.0 / 256.0), 0x3f80);
        assert_eq!(to_bf16(1.0 + 3.0 / 256.0), 0x3f82);
        assert!(from_bf16(to_bf16(f32::NAN)).is_nan());
        assert_eq!(from_bf16(to_bf16(-2.5)), -2.5);
        assert_eq!("BF16".parse::<DType>(), Ok(DType::Bf16));
        assert!("f16".parse::<DType>().is_err());
        assert_eq!(DType::from_code(DType::Bf16.code()), Some(DType::Bf16));
    }

    #[test]
    fn cpu_buffers_keep_their_type_through_the_cache_ops() {
        let be = Cpu::with_kv_dtype(DType::Bf16);
        assert_eq!(be.kv_dtype(), DType::Bf16);
        assert_eq!(Cpu.kv_dtype(), DType::F32);
        let src = be.upload(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        let mut kv = be.zeros_as(4, DType::Bf16).unwrap();
        be.copy_columns(&src, 3, 1, 2, &mut kv).unwrap();
        assert_eq!(be.dtype(&kv), DType::Bf16);
        assert_eq!(be.download(&kv).unwrap(), vec![2.0, 3.0, 5.0, 6.0]);
        assert_eq!(be.bytes(&kv), 8);
        let mut more = be.zeros_as(0, DType::Bf16).unwrap();
        be.append(&mut more, &kv).unwrap();
        assert!(be.append(&mut more, &src).is_err(), "appending f32 to bf16");
        let e = be.add_assign(&mut kv, &src).unwrap_err().to_string();
        assert!(e.contains("bf16") && e.contains("f32"), "{e}");
        // Staging moves the bits as they are.
        assert_eq!(be.stage_in(&be.stage_out(&kv).unwrap()).unwrap(), kv);
    }
}
