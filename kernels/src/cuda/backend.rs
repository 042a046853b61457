//! [`CudaBackend`]: the [`Backend`] op set on one NVIDIA GPU, so that the model, the engine
//! and every `Attend` run unchanged on it.
//!
//! ```text
//!   weights   uploaded once at load: bf16 (default; f32 on request), [out, in] row-major
//!   GEMMs     cuBLAS GemmEx, f32 accumulation: bf16 weights x bf16 copy of the activations
//!             -> f32 output; f32 weights x f32 activations -> f32 (FP32 compute, no TF32)
//!   kernels   kernels/cuda/*.cu, compiled by NVRTC for the device (sm_XY), cached on disk
//!   buffers   f32, with a capacity: `append` grows geometrically, `reserve` sets it up front
//!             (the KV cache), so decoding does not reallocate per token
//!   host      token ids, positions and row indices (control data) are uploaded per call
//! ```
//!
//! Memory plan for an 8B-class llama/qwen model (32 layers, d 4096, 8 KV heads of 128, FFN
//! 14336, vocabulary 128K) with a 32K context on one 80 GB GPU:
//!
//! | what | size |
//! | --- | --- |
//! | weights, bf16 (f32: twice) | 16.1 GB (32.1 GB) |
//! | KV cache, f32 keys and values, 32 layers x 32K tokens x 2 x 1024 | 8.6 GB |
//! | activations of one 2048-token forward (x, qkv, q/k/v, attention, FFN gate-up, logits row) | 0.5 GB |
//! | rope table (32K x 64 cos + sin), cuBLAS workspace, kernels | < 0.1 GB |
//! | total | about 25 GB (bf16), 42 GB (f32) |
//!
//! Chunked methods hold the chunk caches (pre-RoPE) and their placed copies at once: twice
//! the KV cache, 17 GB at 32K, still within 80 GB with bf16 weights.
//!
//! Everything runs on one stream in order; a download synchronizes. Errors from the driver,
//! NVRTC and cuBLAS become [`KernelError::Backend`] naming the op.

use super::nvrtc;
use crate::attention::AttnShape;
use crate::backend::Backend;
use crate::error::{check_len, KernelError, Result};
use crate::gpu::{self, Launch};
use crate::matmul::Matrix;
use crate::rope::{RopeStyle, RopeTable};
use cudarc::cublas::{result as cublas, sys as cublas_sys, CudaBlas};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

fn err(op: &str, e: impl std::fmt::Debug) -> KernelError {
    KernelError::Backend { backend: "cuda", detail: format!("{op}: {e:?}") }
}

pub use crate::device::WeightType;

/// A device buffer of f32 values: `len` in use out of the allocation's capacity.
pub struct DeviceBuf {
    data: CudaSlice<f32>,
    len: usize,
}

impl DeviceBuf {
    /// Values in use.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no value is in use.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Values the allocation holds.
    pub fn capacity(&self) -> usize {
        self.data.len()
    }

    /// A buffer of `len` values in `data` (at least that long).
    #[cfg(feature = "nccl")]
    pub(crate) fn from_parts(data: CudaSlice<f32>, len: usize) -> Self {
        Self { data, len }
    }

    /// The allocation.
    #[cfg(feature = "nccl")]
    pub(crate) fn data(&self) -> &CudaSlice<f32> {
        &self.data
    }

    /// The allocation, writable.
    #[cfg(feature = "nccl")]
    pub(crate) fn data_mut(&mut self) -> &mut CudaSlice<f32> {
        &mut self.data
    }
}

enum MatData {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<u16>),
}

/// A weight matrix `[rows, cols]` on the device.
pub struct DeviceMat {
    rows: usize,
    cols: usize,
    data: MatData,
}

impl DeviceMat {
    /// `(rows, cols)`.
    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }
}

struct DeviceRope {
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
    inv_freq: CudaSlice<f64>,
}

/// The CUDA backend of one device.
pub struct CudaBackend {
    ordinal: usize,
    arch: String,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    functions: HashMap<&'static str, CudaFunction>,
    weights: WeightType,
    /// Uploaded RoPE tables, by their content.
    ropes: Mutex<HashMap<u64, Arc<DeviceRope>>>,
    /// bf16 copy of the activations for bf16 GEMMs, grown as needed and reused.
    scratch: Mutex<Option<CudaSlice<u16>>>,
}

/// `bf16` bits of `x`, rounding to nearest even (as the `fp_f32_to_bf16` kernel does).
pub fn to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

impl CudaBackend {
    /// The backend of GPU `ordinal`: creates a context and a stream, compiles (or loads from the
    /// cache) every kernel for its architecture, creates a cuBLAS handle.
    pub fn new(ordinal: usize, weights: WeightType) -> Result<Self> {
        let devices = super::devices()?;
        let d = devices.iter().find(|d| d.ordinal == ordinal).ok_or_else(|| KernelError::Backend {
            backend: "cuda",
            detail: format!("there is no GPU {ordinal} (this machine has {})", devices.len()),
        })?;
        let (major, minor) = d.compute_capability;
        let arch = format!("sm_{major}{minor}");
        let ctx = CudaContext::new(ordinal).map_err(|e| err("context", e))?;
        let stream = ctx.default_stream();
        let mut functions = HashMap::new();
        for file in gpu::FILES {
            let cubin = nvrtc::cached(file.name, &gpu::program(file), &arch)?;
            let module = ctx.load_module(Ptx::from_binary(cubin)).map_err(|e| err(file.name, e))?;
            for k in file.kernels {
                let f = module.load_function(k.kernel).map_err(|e| err(k.kernel, e))?;
                functions.insert(k.kernel, f);
            }
        }
        let blas = CudaBlas::new(stream.clone()).map_err(|e| err("cuBLAS (is libcublas on the library path?)", e))?;
        Ok(Self {
            ordinal,
            arch,
            stream,
            blas,
            functions,
            weights,
            ropes: Mutex::new(HashMap::new()),
            scratch: Mutex::new(None),
        })
    }

    /// Device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// `sm_XY` of the device.
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// The stream every op of this backend runs on (the device plane orders its own stream
    /// against it).
    pub fn compute_stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Waits for everything queued on the stream.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(|e| err("synchronize", e))
    }

    fn function(&self, name: &'static str) -> Result<&CudaFunction> {
        self.functions.get(name).ok_or_else(|| err("kernel", format!("{name} was not loaded")))
    }

    fn config(l: Launch) -> LaunchConfig {
        LaunchConfig { grid_dim: (l.grid_x, l.grid_y, 1), block_dim: (l.block, 1, 1), shared_mem_bytes: 0 }
    }

    fn upload_u32(&self, v: &[u32]) -> Result<CudaSlice<u32>> {
        // An empty device allocation is not allowed: keep one element.
        if v.is_empty() {
            return self.stream.alloc_zeros::<u32>(1).map_err(|e| err("upload", e));
        }
        self.stream.clone_htod(v).map_err(|e| err("upload", e))
    }

    fn alloc(&self, len: usize) -> Result<CudaSlice<f32>> {
        self.stream.alloc_zeros::<f32>(len.max(1)).map_err(|e| err("alloc", e))
    }

    fn rope_table(&self, table: &RopeTable) -> Result<Arc<DeviceRope>> {
        let (cos, sin) = table.tables();
        let mut key = 0xcbf2_9ce4_8422_2325u64;
        let parts = [table.head_dim() as u64, table.rot_dim() as u64, table.table_len() as u64, table.style() as u64];
        for b in parts.into_iter().chain(table.inv_freq().iter().map(|f| f.to_bits())) {
            key = (key ^ b).wrapping_mul(0x0100_0000_01b3);
        }
        let mut ropes = self.ropes.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = ropes.get(&key) {
            return Ok(r.clone());
        }
        let up = |v: &[f32]| -> Result<CudaSlice<f32>> {
            if v.is_empty() {
                self.alloc(1)
            } else {
                self.stream.clone_htod(v).map_err(|e| err("rope table", e))
            }
        };
        let r = Arc::new(DeviceRope {
            cos: up(cos)?,
            sin: up(sin)?,
            inv_freq: self.stream.clone_htod(table.inv_freq()).map_err(|e| err("rope table", e))?,
        });
        ropes.insert(key, r.clone());
        Ok(r)
    }

    /// out[rows, n] = x[rows, k] · Wᵀ (W `[n, k]` row-major): cuBLAS column-major with
    /// C (n x rows) = op(A) B, A = W viewed as k x n (transposed), B = x viewed as k x rows.
    fn gemm(&self, x: &DeviceBuf, rows: usize, w: &DeviceMat, out: &mut DeviceBuf) -> Result<()> {
        let (n, k) = (w.rows, w.cols);
        let (m_, n_, k_) = (n as i32, rows as i32, k as i32);
        let (alpha, beta) = (1.0f32, 0.0f32);
        let op_t = cublas_sys::cublasOperation_t::CUBLAS_OP_T;
        let op_n = cublas_sys::cublasOperation_t::CUBLAS_OP_N;
        let compute = cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F;
        let algo = cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT;
        let f32t = cublas_sys::cudaDataType_t::CUDA_R_32F;
        let (c_ptr, _c_rec) = out.data.device_ptr_mut(&self.stream);
        let handle = *self.blas.handle();
        let run = |a: cudarc::driver::sys::CUdeviceptr, b: cudarc::driver::sys::CUdeviceptr, t, what: &str| {
            // SAFETY: `a`, `b` and `c_ptr` are live device allocations of at least n*k, rows*k
            // and rows*n elements (the caller checked the lengths; the bf16 scratch holds
            // rows*k); alpha and beta outlive the call; the allocations' stream-order guards
            // are held by the caller until it returns.
            unsafe {
                cublas::gemm_ex(
                    handle,
                    op_t,
                    op_n,
                    m_,
                    n_,
                    k_,
                    &alpha as *const f32 as *const _,
                    a as *const _,
                    t,
                    k_,
                    b as *const _,
                    t,
                    k_,
                    &beta as *const f32 as *const _,
                    c_ptr as *mut _,
                    f32t,
                    m_,
                    compute,
                    algo,
                )
            }
            .map_err(|e| err(what, e))
        };
        match &w.data {
            MatData::F32(wd) => {
                let (a_ptr, _a) = wd.device_ptr(&self.stream);
                let (b_ptr, _b) = x.data.device_ptr(&self.stream);
                run(a_ptr, b_ptr, f32t, "gemm (f32)")
            }
            MatData::Bf16(wd) => {
                // The activations go to bf16 in a scratch buffer reused across calls.
                let need = rows * k;
                let mut scratch = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
                if scratch.as_ref().is_none_or(|s| s.len() < need) {
                    *scratch = Some(self.stream.alloc_zeros::<u16>(need.max(1)).map_err(|e| err("alloc", e))?);
                }
                let xb = scratch.as_mut().ok_or_else(|| err("gemm", "no scratch"))?;
                let f = self.function("fp_f32_to_bf16")?;
                let nn = need as u64;
                let mut b = self.stream.launch_builder(f);
                b.arg(&x.data).arg(&mut *xb).arg(&nn);
                // SAFETY: the kernel reads `need` f32 and writes `need` bf16, within both buffers.
                unsafe { b.launch(Self::config(gpu::stride_launch(nn))) }.map_err(|e| err("f32_to_bf16", e))?;
                let (a_ptr, _a) = wd.device_ptr(&self.stream);
                let (b_ptr, _b) = xb.device_ptr(&self.stream);
                run(a_ptr, b_ptr, cublas_sys::cudaDataType_t::CUDA_R_16BF, "gemm (bf16)")
            }
        }
    }
}

fn check_same(op: &'static str, what: &str, a: usize, b: usize) -> Result<()> {
    check_len(op, what, a, b)
}

/// Launches kernel `$name` with `$launch` and the listed arguments (pushed in order).
macro_rules! launch {
    ($self:ident, $name:literal, $launch:expr, [$($arg:expr),* $(,)?]) => {{
        let f = $self.function($name)?;
        let mut b = $self.stream.launch_builder(f);
        $( b.arg($arg); )*
        // SAFETY: every op checks the lengths of its buffers against the sizes it passes
        // before launching; the kernels stay within those sizes (the CPU emulation tests
        // exercise the same sources with the same launch shapes).
        unsafe { b.launch(CudaBackend::config($launch)) }.map_err(|e| err($name, e))?;
    }};
}

impl Backend for CudaBackend {
    type Buf = DeviceBuf;
    type Mat = DeviceMat;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn upload(&self, host: &[f32]) -> Result<DeviceBuf> {
        if host.is_empty() {
            return self.zeros(0);
        }
        let data = self.stream.clone_htod(host).map_err(|e| err("upload", e))?;
        Ok(DeviceBuf { data, len: host.len() })
    }

    fn download(&self, buf: &DeviceBuf) -> Result<Vec<f32>> {
        self.download_range(buf, 0, buf.len)
    }

    fn download_range(&self, buf: &DeviceBuf, start: usize, len: usize) -> Result<Vec<f32>> {
        if start + len > buf.len {
            return Err(KernelError::Shape {
                op: "download_range",
                detail: format!("range {start}..{} of a buffer of {}", start + len, buf.len),
            });
        }
        if len == 0 {
            return Ok(Vec::new());
        }
        self.stream.clone_dtoh(&buf.data.slice(start..start + len)).map_err(|e| err("download", e))
    }

    fn zeros(&self, len: usize) -> Result<DeviceBuf> {
        Ok(DeviceBuf { data: self.alloc(len)?, len })
    }

    fn len(&self, buf: &DeviceBuf) -> usize {
        buf.len
    }

    fn resize(&self, buf: &mut DeviceBuf, len: usize) -> Result<()> {
        if len > buf.capacity() {
            self.reserve(buf, len)?;
        }
        if len > buf.len {
            self.stream.memset_zeros(&mut buf.data.slice_mut(buf.len..len)).map_err(|e| err("resize", e))?;
        }
        buf.len = len;
        Ok(())
    }

    fn reserve(&self, buf: &mut DeviceBuf, capacity: usize) -> Result<()> {
        if capacity <= buf.capacity() {
            return Ok(());
        }
        let mut data = self.alloc(capacity)?;
        if buf.len > 0 {
            self.stream
                .memcpy_dtod(&buf.data.slice(0..buf.len), &mut data.slice_mut(0..buf.len))
                .map_err(|e| err("reserve", e))?;
        }
        buf.data = data;
        Ok(())
    }

    fn matrix(&self, m: Matrix) -> Result<DeviceMat> {
        let (rows, cols) = (m.rows(), m.cols());
        let data = match self.weights {
            WeightType::F32 => MatData::F32(self.stream.clone_htod(m.data()).map_err(|e| err("weights", e))?),
            WeightType::Bf16 => {
                let bits: Vec<u16> = m.data().iter().map(|&x| to_bf16(x)).collect();
                MatData::Bf16(self.stream.clone_htod(&bits).map_err(|e| err("weights", e))?)
            }
        };
        Ok(DeviceMat { rows, cols, data })
    }

    fn mat_shape(&self, m: &DeviceMat) -> (usize, usize) {
        m.shape()
    }

    fn embedding(&self, table: &DeviceMat, ids: &[u32], out: &mut DeviceBuf) -> Result<()> {
        let cols = table.cols;
        check_same("embedding", "out", out.len, ids.len() * cols)?;
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= table.rows) {
            return Err(KernelError::Shape {
                op: "embedding",
                detail: format!("token id {bad} is outside the vocabulary of {}", table.rows),
            });
        }
        if ids.is_empty() {
            return Ok(());
        }
        let dev_ids = self.upload_u32(ids)?;
        let (n, c) = (ids.len() as u32, cols as u32);
        let l = gpu::stride_launch((ids.len() * cols) as u64);
        match &table.data {
            MatData::F32(t) => launch!(self, "fp_embedding_f32", l, [t, &dev_ids, &mut out.data, &n, &c]),
            MatData::Bf16(t) => launch!(self, "fp_embedding_bf16", l, [t, &dev_ids, &mut out.data, &n, &c]),
        }
        Ok(())
    }

    fn matmul_t(&self, x: &DeviceBuf, rows: usize, w: &DeviceMat, out: &mut DeviceBuf) -> Result<()> {
        check_same("matmul_t", "x", x.len, rows * w.cols)?;
        check_same("matmul_t", "out", out.len, rows * w.rows)?;
        if rows == 0 || w.rows == 0 {
            return Ok(());
        }
        self.gemm(x, rows, w, out)
    }

    fn add_bias(&self, x: &mut DeviceBuf, bias: &DeviceBuf) -> Result<()> {
        if bias.len == 0 || x.len % bias.len != 0 {
            return Err(KernelError::Shape {
                op: "add_bias",
                detail: format!("{} values are not rows of the bias length {}", x.len, bias.len),
            });
        }
        let (n, cols) = (x.len as u64, bias.len as u32);
        launch!(self, "fp_add_bias", gpu::stride_launch(n), [&mut x.data, &bias.data, &n, &cols]);
        Ok(())
    }

    fn rms_norm(&self, x: &DeviceBuf, w: &DeviceBuf, eps: f32, out: &mut DeviceBuf) -> Result<()> {
        let cols = w.len;
        if cols == 0 || x.len % cols != 0 {
            return Err(KernelError::Shape {
                op: "rms_norm",
                detail: format!("x has {} elements, not a multiple of the weight length {cols}", x.len),
            });
        }
        check_same("rms_norm", "out", out.len, x.len)?;
        let rows = (x.len / cols) as u32;
        if rows == 0 {
            return Ok(());
        }
        let c = cols as u32;
        launch!(self, "fp_rms_norm", gpu::norm_launch(rows), [&x.data, &w.data, &eps, &mut out.data, &rows, &c]);
        Ok(())
    }

    fn rope(&self, x: &mut DeviceBuf, n_heads: usize, positions: &[u32], table: &RopeTable) -> Result<()> {
        let d = table.head_dim();
        check_same("rope", "x", x.len, positions.len() * n_heads * d)?;
        if positions.is_empty() || table.rot_dim() == 0 {
            return Ok(());
        }
        let t = self.rope_table(table)?;
        let pos = self.upload_u32(positions)?;
        let half = table.rot_dim() / 2;
        let (tokens, heads, hd, rd) = (positions.len() as u32, n_heads as u32, d as u32, table.rot_dim() as u32);
        let inter = u32::from(table.style() == RopeStyle::Interleaved);
        let tl = table.table_len() as u32;
        let l = gpu::stride_launch((positions.len() * n_heads * half) as u64);
        launch!(
            self,
            "fp_rope",
            l,
            [&mut x.data, &tokens, &heads, &hd, &rd, &inter, &pos, &t.cos, &t.sin, &tl, &t.inv_freq]
        );
        Ok(())
    }

    fn attention(
        &self,
        shape: &AttnShape,
        q: &DeviceBuf,
        qpos: &[u32],
        k: &DeviceBuf,
        v: &DeviceBuf,
        kpos: &[u32],
        out: &mut DeviceBuf,
        lse: &mut DeviceBuf,
    ) -> Result<()> {
        let op = "attention";
        if shape.head_dim > gpu::ATTENTION_MAX_DIM {
            return Err(KernelError::Shape {
                op,
                detail: format!("head_dim {} is above the CUDA kernel's {}", shape.head_dim, gpu::ATTENTION_MAX_DIM),
            });
        }
        check_same(op, "q", q.len, qpos.len() * shape.q_dim())?;
        check_same(op, "k", k.len, kpos.len() * shape.kv_dim())?;
        check_same(op, "v", v.len, kpos.len() * shape.kv_dim())?;
        check_same(op, "out", out.len, q.len)?;
        check_same(op, "lse", lse.len, qpos.len() * shape.n_heads)?;
        if qpos.is_empty() {
            return Ok(());
        }
        let (qp, kp) = (self.upload_u32(qpos)?, self.upload_u32(kpos)?);
        let (m, n) = (qpos.len() as u32, kpos.len() as u32);
        let (h, hkv, d) = (shape.n_heads as u32, shape.n_kv_heads as u32, shape.head_dim as u32);
        let l = gpu::attention_launch(m, h);
        launch!(
            self,
            "fp_attention",
            l,
            [&q.data, &qp, &k.data, &v.data, &kp, &mut out.data, &mut lse.data, &m, &n, &h, &hkv, &d, &shape.scale]
        );
        Ok(())
    }

    fn attention_scores(
        &self,
        shape: &AttnShape,
        q: &DeviceBuf,
        qpos: &[u32],
        k: &DeviceBuf,
        kpos: &[u32],
        lse: &DeviceBuf,
        scores: &mut DeviceBuf,
    ) -> Result<()> {
        let op = "attention_scores";
        check_same(op, "q", q.len, qpos.len() * shape.q_dim())?;
        check_same(op, "k", k.len, kpos.len() * shape.kv_dim())?;
        check_same(op, "lse", lse.len, qpos.len() * shape.n_heads)?;
        check_same(op, "scores", scores.len, kpos.len())?;
        if qpos.is_empty() || kpos.is_empty() {
            return Ok(());
        }
        let (qp, kp) = (self.upload_u32(qpos)?, self.upload_u32(kpos)?);
        let (m, n) = (qpos.len() as u32, kpos.len() as u32);
        let (h, hkv, d) = (shape.n_heads as u32, shape.n_kv_heads as u32, shape.head_dim as u32);
        launch!(
            self,
            "fp_attention_scores",
            gpu::stride_launch(n as u64),
            [&q.data, &qp, &k.data, &kp, &lse.data, &mut scores.data, &m, &n, &h, &hkv, &d, &shape.scale]
        );
        Ok(())
    }

    fn merge_partial(
        &self,
        out: &mut DeviceBuf,
        lse: &mut DeviceBuf,
        block_out: &DeviceBuf,
        block_lse: &DeviceBuf,
        head_dim: usize,
    ) -> Result<()> {
        let rows = lse.len;
        check_same("merge_partial", "block_lse", block_lse.len, rows)?;
        check_same("merge_partial", "out", out.len, rows * head_dim)?;
        check_same("merge_partial", "block_out", block_out.len, rows * head_dim)?;
        if rows == 0 {
            return Ok(());
        }
        let (r, d) = (rows as u32, head_dim as u32);
        launch!(
            self,
            "fp_merge_partial",
            gpu::stride_launch(rows as u64),
            [&mut out.data, &mut lse.data, &block_out.data, &block_lse.data, &r, &d]
        );
        Ok(())
    }

    fn silu_mul(&self, gate_up: &DeviceBuf, ffn: usize, out: &mut DeviceBuf) -> Result<()> {
        if ffn == 0 || out.len % ffn != 0 {
            return Err(KernelError::Shape {
                op: "silu_mul",
                detail: format!("{} outputs for rows of {ffn}", out.len),
            });
        }
        let rows = out.len / ffn;
        check_same("silu_mul", "gate_up", gate_up.len, rows * 2 * ffn)?;
        if rows == 0 {
            return Ok(());
        }
        let (r, f) = (rows as u64, ffn as u32);
        launch!(self, "fp_silu_mul", gpu::stride_launch(out.len as u64), [&gate_up.data, &mut out.data, &r, &f]);
        Ok(())
    }

    fn add_assign(&self, x: &mut DeviceBuf, y: &DeviceBuf) -> Result<()> {
        check_same("add_assign", "y", y.len, x.len)?;
        if x.len == 0 {
            return Ok(());
        }
        let n = x.len as u64;
        launch!(self, "fp_add_assign", gpu::stride_launch(n), [&mut x.data, &y.data, &n]);
        Ok(())
    }

    fn copy_columns(
        &self,
        src: &DeviceBuf,
        src_cols: usize,
        col: usize,
        width: usize,
        dst: &mut DeviceBuf,
    ) -> Result<()> {
        if src_cols == 0 || src.len % src_cols != 0 || col + width > src_cols {
            return Err(KernelError::Shape {
                op: "copy_columns",
                detail: format!(
                    "columns {col}..{} of a matrix with {src_cols} columns and {} elements",
                    col + width,
                    src.len
                ),
            });
        }
        let rows = src.len / src_cols;
        check_same("copy_columns", "dst", dst.len, rows * width)?;
        if rows == 0 || width == 0 {
            return Ok(());
        }
        let (sc, c, w, r) = (src_cols as u32, col as u32, width as u32, rows as u64);
        launch!(
            self,
            "fp_copy_columns",
            gpu::stride_launch(dst.len as u64),
            [&src.data, &sc, &c, &w, &mut dst.data, &r]
        );
        Ok(())
    }

    fn copy_rows(
        &self,
        src: &DeviceBuf,
        src_rows: &[usize],
        dst: &mut DeviceBuf,
        dst_rows: &[usize],
        row_len: usize,
    ) -> Result<()> {
        check_same("copy_rows", "dst_rows", dst_rows.len(), src_rows.len())?;
        for (rows, len) in [(src_rows, src.len), (dst_rows, dst.len)] {
            if let Some(&r) = rows.iter().find(|&&r| (r + 1) * row_len > len) {
                return Err(KernelError::Shape {
                    op: "copy_rows",
                    detail: format!("row {r} of {row_len} values is outside a buffer of {len}"),
                });
            }
        }
        if src_rows.is_empty() || row_len == 0 {
            return Ok(());
        }
        let s: Vec<u32> = src_rows.iter().map(|&r| r as u32).collect();
        let d: Vec<u32> = dst_rows.iter().map(|&r| r as u32).collect();
        let (sd, dd) = (self.upload_u32(&s)?, self.upload_u32(&d)?);
        let (n, rl) = (s.len() as u32, row_len as u32);
        launch!(
            self,
            "fp_copy_rows",
            gpu::stride_launch((s.len() * row_len) as u64),
            [&src.data, &sd, &mut dst.data, &dd, &n, &rl]
        );
        Ok(())
    }

    fn append(&self, dst: &mut DeviceBuf, src: &DeviceBuf) -> Result<()> {
        let (old, add) = (dst.len, src.len);
        if add == 0 {
            return Ok(());
        }
        if old + add > dst.capacity() {
            // Geometric growth: appending token by token copies each value O(1) times.
            self.reserve(dst, (old + add).max(2 * dst.capacity()))?;
        }
        self.stream
            .memcpy_dtod(&src.data.slice(0..add), &mut dst.data.slice_mut(old..old + add))
            .map_err(|e| err("append", e))?;
        dst.len = old + add;
        Ok(())
    }
}
