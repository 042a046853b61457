//! [`CudaBackend`]: the [`Backend`] op set on one NVIDIA GPU, so that the model, the engine
//! and every `Attend` run unchanged on it.
//!
//! ```text
//!   weights    uploaded once at load: bf16 (default; f32 on request), [out, in] row-major
//!   GEMMs      cuBLAS GemmEx, f32 accumulation: bf16 weights x bf16 copy of the activations
//!              -> f32 output; f32 weights x f32 activations -> f32 (FP32 compute, no TF32)
//!   KV cache   bf16 by default (`--kv-dtype`), f32 on request; projections are rounded once
//!              when they land in it, RoPE rotates bf16 keys in f32 and rounds once
//!   attention  bf16 K/V and head_dim 64 / 128: tensor cores (flash.cu; FlashAttention-2 style,
//!              key splits when few blocks would fill the GPU); otherwise the simple kernel
//!              (attention.cu, FP32 cores; f32 K/V keep f32 accuracy)
//!   kernels    kernels/cuda/*.cu, compiled by NVRTC for the device (sm_XY), cached on disk,
//!              launched through the `Call`s of `gpu::ops` (the emulator launches the same)
//!   buffers    typed (f32 / bf16), with a capacity: `append` grows geometrically, `reserve`
//!              sets it up front (the KV cache), so decoding does not reallocate per token
//!   host       token ids, positions and row indices (control data) are uploaded per call
//! ```
//!
//! Memory plan for an 8B-class llama/qwen model (32 layers, d 4096, 8 KV heads of 128, FFN
//! 14336, vocabulary 128K) on one 80 GB GPU, bf16 weights:
//!
//! | what | 32K context | 128K context |
//! | --- | ---: | ---: |
//! | weights, bf16 (f32: twice) | 16.1 GB | 16.1 GB |
//! | KV cache, bf16: 32 layers x tokens x 2 x 1024 x 2 B (f32: twice) | 4.3 GB | 17.2 GB |
//! | chunked methods: chunk caches (pre-RoPE) and their placed copies, twice the KV cache | 8.6 GB | 34.4 GB |
//! | activations of one 2048-token forward (x, qkv, q/k/v, attention, FFN gate-up, logits row) | 0.5 GB | 0.5 GB |
//! | rope table, cuBLAS workspace, attention scratch (bf16 Q, key-split partials), kernels | < 0.2 GB | < 0.3 GB |
//! | total, full prefill / chunked method | about 21 / 26 GB | about 34 / 51 GB |
//!
//! With an f32 KV cache a chunked method at 128K needs 16.1 + 68.7 GB: it does not fit one
//! 80 GB GPU; bf16 makes it fit.
//!
//! Everything runs on one stream in order; a download synchronizes. Errors from the driver,
//! NVRTC and cuBLAS become [`KernelError::Backend`] naming the op.

use super::nvrtc;
use crate::attention::AttnShape;
use crate::backend::{from_bf16, to_bf16, Backend, DType, HostBuf};
use crate::error::{check_len, KernelError, Result};
use crate::gpu::ops::{self, AttnDims, RopeArgs};
use crate::gpu::{self, Call, Elem, Ptr};
use crate::matmul::Matrix;
use crate::rope::{RopeStyle, RopeTable};
use cudarc::cublas::{result as cublas, sys as cublas_sys, CudaBlas};
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};
use cudarc::nvrtc::Ptx;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

fn err(op: &str, e: impl std::fmt::Debug) -> KernelError {
    KernelError::Backend { backend: "cuda", detail: format!("{op}: {e:?}") }
}

pub use crate::device::WeightType;

/// The allocation of a device buffer, by element type.
pub(crate) enum DevData {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<u16>),
}

/// A device buffer: `len` elements of one [`DType`] in use, out of the allocation's capacity.
pub struct DeviceBuf {
    data: DevData,
    len: usize,
}

impl DeviceBuf {
    /// Elements in use.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no element is in use.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Elements the allocation holds.
    pub fn capacity(&self) -> usize {
        match &self.data {
            DevData::F32(d) => d.len(),
            DevData::Bf16(d) => d.len(),
        }
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        match &self.data {
            DevData::F32(_) => DType::F32,
            DevData::Bf16(_) => DType::Bf16,
        }
    }

    /// The device address for reading, and the guard that orders other streams after the read.
    pub(crate) fn ptr<'a>(&'a self, stream: &'a CudaStream) -> (Ptr, SyncOnDrop<'a>) {
        match &self.data {
            DevData::F32(d) => {
                let (p, g) = d.device_ptr(stream);
                (Ptr::new(p, Elem::F32), g)
            }
            DevData::Bf16(d) => {
                let (p, g) = d.device_ptr(stream);
                (Ptr::new(p, Elem::Bf16), g)
            }
        }
    }

    /// The device address for writing, and its guard.
    pub(crate) fn ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (Ptr, SyncOnDrop<'a>) {
        match &mut self.data {
            DevData::F32(d) => {
                let (p, g) = d.device_ptr_mut(stream);
                (Ptr::new(p, Elem::F32), g)
            }
            DevData::Bf16(d) => {
                let (p, g) = d.device_ptr_mut(stream);
                (Ptr::new(p, Elem::Bf16), g)
            }
        }
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

/// A device allocation reused across calls, grown (never shrunk) to the largest request.
struct Scratch<T> {
    buf: Mutex<Option<CudaSlice<T>>>,
}

impl<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits> Scratch<T> {
    fn new() -> Self {
        Self { buf: Mutex::new(None) }
    }

    /// The allocation, at least `len` long, locked for the caller.
    fn get(&self, stream: &Arc<CudaStream>, len: usize) -> Result<std::sync::MutexGuard<'_, Option<CudaSlice<T>>>> {
        let mut g = self.buf.lock().unwrap_or_else(|p| p.into_inner());
        if g.as_ref().is_none_or(|s| s.len() < len) {
            *g = None; // free the smaller one first
            *g = Some(stream.alloc_zeros::<T>(len.max(1)).map_err(|e| err("scratch alloc", e))?);
        }
        Ok(g)
    }
}

/// The CUDA backend of one device.
pub struct CudaBackend {
    ordinal: usize,
    arch: String,
    sm_count: u32,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    functions: HashMap<&'static str, CudaFunction>,
    weights: WeightType,
    kv: DType,
    /// Uploaded RoPE tables, by their content.
    ropes: Mutex<HashMap<u64, Arc<DeviceRope>>>,
    /// bf16 copy of the activations for bf16 GEMMs.
    gemm_x: Scratch<u16>,
    /// bf16 copy of the queries for the tensor-core attention and scores.
    attn_q: Scratch<u16>,
    /// Partial outputs and log-sum-exps of key splits.
    part_out: Scratch<f32>,
    part_lse: Scratch<f32>,
}

/// Why a buffer of the wrong element type was refused.
fn want(op: &'static str, what: &str, got: DType, want: DType) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(KernelError::Dtype { op, detail: format!("{what} holds {got} values; this operation takes {want}") })
    }
}

impl CudaBackend {
    /// The backend of GPU `ordinal`: creates a context and a stream, compiles (or loads from the
    /// cache) every kernel for its architecture, creates a cuBLAS handle. Weights are kept as
    /// `weights`, KV caches as `kv`.
    pub fn new(ordinal: usize, weights: WeightType, kv: DType) -> Result<Self> {
        let devices = super::devices()?;
        let d = devices.iter().find(|d| d.ordinal == ordinal).ok_or_else(|| KernelError::Backend {
            backend: "cuda",
            detail: format!("there is no GPU {ordinal} (this machine has {})", devices.len()),
        })?;
        let (major, minor) = d.compute_capability;
        let arch = format!("sm_{major}{minor}");
        // cudarc panics on a library it cannot load: say which is missing and where we looked.
        for lib in ["NVRTC", "cuBLAS", "cuBLASLt"] {
            super::libs::require(lib)?;
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| err("context", e))?;
        let sm_count = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| err("multiprocessor count", e))?
            .max(1) as u32;
        let stream = ctx.default_stream();
        let mut functions = HashMap::new();
        for file in gpu::FILES {
            let cubin = nvrtc::cached(file.name, &gpu::program(file), &arch)?;
            let module = ctx.load_module(Ptx::from_binary(cubin)).map_err(|e| err(file.name, e))?;
            for k in file.kernels {
                let f = module.load_function(k.kernel).map_err(|e| err(k.kernel, e))?;
                if k.dynamic_shared_bytes > gpu::DEFAULT_DYNAMIC_SHARED_LIMIT {
                    use cudarc::driver::sys::CUfunction_attribute_enum as A;
                    f.set_attribute(A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, k.dynamic_shared_bytes as i32)
                        .map_err(|e| {
                            err(k.kernel, format!("{e:?}: {} B of dynamic shared memory", k.dynamic_shared_bytes))
                        })?;
                }
                functions.insert(k.kernel, f);
            }
        }
        let blas = CudaBlas::new(stream.clone()).map_err(|e| err("cuBLAS (is libcublas on the library path?)", e))?;
        Ok(Self {
            ordinal,
            arch,
            sm_count,
            stream,
            blas,
            functions,
            weights,
            kv,
            ropes: Mutex::new(HashMap::new()),
            gemm_x: Scratch::new(),
            attn_q: Scratch::new(),
            part_out: Scratch::new(),
            part_lse: Scratch::new(),
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

    /// Streaming multiprocessors of the device (the attention plans its key splits by it).
    pub fn sm_count(&self) -> u32 {
        self.sm_count
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

    /// Launches `call` on the stream (after checking it against the kernel's declaration).
    /// The caller holds the guards of every buffer the call names until this returns.
    fn run(&self, call: &Call) -> Result<()> {
        call.check().map_err(|e| err("launch", e))?;
        let f =
            self.functions.get(call.kernel).ok_or_else(|| err("kernel", format!("{} was not loaded", call.kernel)))?;
        let mut cells: Vec<u64> = call.args.iter().map(|a| a.cell()).collect();
        let mut params: Vec<*mut c_void> = cells.iter_mut().map(|c| c as *mut u64 as *mut c_void).collect();
        let l = &call.launch;
        self.stream.context().bind_to_thread().map_err(|e| err(call.kernel, e))?;
        // SAFETY: the call matches the kernel's declared parameters in number and type
        // (checked above), each cell holds one argument in the low bytes of 8 (little-endian),
        // and `params` outlives the launch call; every op checks the lengths of its buffers
        // against the sizes it passes, and the kernels stay within those sizes (the CPU
        // emulation runs the same sources with the same calls).
        unsafe {
            cudarc::driver::result::launch_kernel(
                f.cu_function(),
                (l.grid[0], l.grid[1], l.grid[2]),
                (l.block[0], l.block[1], l.block[2]),
                l.shared_bytes,
                self.stream.cu_stream(),
                &mut params,
            )
        }
        .map_err(|e| err(call.kernel, e))
    }

    fn run_built(&self, call: Result<Call>) -> Result<()> {
        self.run(&call?)
    }

    fn upload_u32(&self, v: &[u32]) -> Result<CudaSlice<u32>> {
        // An empty device allocation is not allowed: keep one element.
        if v.is_empty() {
            return self.stream.alloc_zeros::<u32>(1).map_err(|e| err("upload", e));
        }
        self.stream.clone_htod(v).map_err(|e| err("upload", e))
    }

    fn alloc(&self, len: usize, dtype: DType) -> Result<DevData> {
        Ok(match dtype {
            DType::F32 => DevData::F32(self.stream.alloc_zeros::<f32>(len.max(1)).map_err(|e| err("alloc", e))?),
            DType::Bf16 => DevData::Bf16(self.stream.alloc_zeros::<u16>(len.max(1)).map_err(|e| err("alloc", e))?),
        })
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
                self.stream.alloc_zeros::<f32>(1).map_err(|e| err("rope table", e))
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
        let (c, _c) = out.ptr_mut(&self.stream);
        let handle = *self.blas.handle();
        let run = |a: u64, b: u64, t, what: &str| {
            // SAFETY: `a`, `b` and `c` are live device allocations of at least n*k, rows*k
            // and rows*n elements (the caller checked the lengths; the bf16 scratch holds
            // rows*k); alpha and beta outlive the call; the allocations' stream-order guards
            // are held until this returns.
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
                    c.addr as *mut _,
                    f32t,
                    m_,
                    compute,
                    algo,
                )
            }
            .map_err(|e| err(what, e))
        };
        let (xp, _x) = x.ptr(&self.stream);
        match &w.data {
            MatData::F32(wd) => {
                let (a, _a) = wd.device_ptr(&self.stream);
                run(a, xp.addr, f32t, "gemm (f32)")
            }
            MatData::Bf16(wd) => {
                // The activations go to bf16 in a scratch buffer reused across calls.
                let need = rows * k;
                let mut scratch = self.gemm_x.get(&self.stream, need)?;
                let xb = scratch.as_mut().ok_or_else(|| err("gemm", "no scratch"))?;
                let (xbp, _xb) = xb.device_ptr_mut(&self.stream);
                self.run_built(ops::convert(xp, Ptr::new(xbp, Elem::Bf16), need as u64))?;
                let (a, _a) = wd.device_ptr(&self.stream);
                run(a, xbp, cublas_sys::cudaDataType_t::CUDA_R_16BF, "gemm (bf16)")
            }
        }
    }

    /// The bf16 copy of f32 queries `q` in the attention scratch; runs `f` with its address.
    fn with_bf16_queries<R>(&self, q: &DeviceBuf, f: impl FnOnce(Ptr) -> Result<R>) -> Result<R> {
        let mut scratch = self.attn_q.get(&self.stream, q.len)?;
        let qb = scratch.as_mut().ok_or_else(|| err("attention", "no scratch"))?;
        let (qbp, _g) = qb.device_ptr_mut(&self.stream);
        let qb = Ptr::new(qbp, Elem::Bf16);
        let (qp, _q) = q.ptr(&self.stream);
        self.run_built(ops::convert(qp, qb, q.len as u64))?;
        f(qb)
    }

    /// The tensor-core self-check (`probe.cu`) on this GPU: `(d_nk, d_kn)` for bf16 `a`,
    /// `b_nk`, `b_kn` (16 x 16 each, see [`ops::probe_mma`]); both must equal A B. It checks
    /// the fragment layouts that the CPU emulation of the tensor-core kernels assumes.
    pub fn probe_mma(&self, a: &[u16], b_nk: &[u16], b_kn: &[u16]) -> Result<(Vec<f32>, Vec<f32>)> {
        for (what, x) in [("a", a), ("b_nk", b_nk), ("b_kn", b_kn)] {
            check_len("probe_mma", what, x.len(), 256)?;
        }
        let up = |v: &[u16]| self.stream.clone_htod(v).map_err(|e| err("probe upload", e));
        let (da, dnk, dkn) = (up(a)?, up(b_nk)?, up(b_kn)?);
        let mut d1 = self.stream.alloc_zeros::<f32>(256).map_err(|e| err("alloc", e))?;
        let mut d2 = self.stream.alloc_zeros::<f32>(256).map_err(|e| err("alloc", e))?;
        {
            let (pa, _a) = da.device_ptr(&self.stream);
            let (pnk, _b) = dnk.device_ptr(&self.stream);
            let (pkn, _c) = dkn.device_ptr(&self.stream);
            let (p1, _d) = d1.device_ptr_mut(&self.stream);
            let (p2, _e) = d2.device_ptr_mut(&self.stream);
            let b = |p| Ptr::new(p, Elem::Bf16);
            let f = |p| Ptr::new(p, Elem::F32);
            self.run_built(ops::probe_mma(b(pa), b(pnk), b(pkn), f(p1), f(p2)))?;
        }
        let get = |d: &CudaSlice<f32>| self.stream.clone_dtoh(d).map_err(|e| err("probe download", e));
        Ok((get(&d1)?, get(&d2)?))
    }
}

fn check_same(op: &'static str, what: &str, a: usize, b: usize) -> Result<()> {
    check_len(op, what, a, b)
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
        Ok(DeviceBuf { data: DevData::F32(data), len: host.len() })
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
        match &buf.data {
            DevData::F32(d) => self.stream.clone_dtoh(&d.slice(start..start + len)).map_err(|e| err("download", e)),
            DevData::Bf16(d) => {
                let bits = self.stream.clone_dtoh(&d.slice(start..start + len)).map_err(|e| err("download", e))?;
                Ok(bits.into_iter().map(from_bf16).collect())
            }
        }
    }

    fn zeros_as(&self, len: usize, dtype: DType) -> Result<DeviceBuf> {
        Ok(DeviceBuf { data: self.alloc(len, dtype)?, len })
    }

    fn dtype(&self, buf: &DeviceBuf) -> DType {
        buf.dtype()
    }

    fn kv_dtype(&self) -> DType {
        self.kv
    }

    fn len(&self, buf: &DeviceBuf) -> usize {
        buf.len
    }

    fn resize(&self, buf: &mut DeviceBuf, len: usize) -> Result<()> {
        if len > buf.capacity() {
            self.reserve(buf, len)?;
        }
        if len > buf.len {
            let r = match &mut buf.data {
                DevData::F32(d) => self.stream.memset_zeros(&mut d.slice_mut(buf.len..len)),
                DevData::Bf16(d) => self.stream.memset_zeros(&mut d.slice_mut(buf.len..len)),
            };
            r.map_err(|e| err("resize", e))?;
        }
        buf.len = len;
        Ok(())
    }

    fn reserve(&self, buf: &mut DeviceBuf, capacity: usize) -> Result<()> {
        if capacity <= buf.capacity() {
            return Ok(());
        }
        let mut data = self.alloc(capacity, buf.dtype())?;
        if buf.len > 0 {
            let n = buf.len;
            let r = match (&buf.data, &mut data) {
                (DevData::F32(s), DevData::F32(d)) => self.stream.memcpy_dtod(&s.slice(0..n), &mut d.slice_mut(0..n)),
                (DevData::Bf16(s), DevData::Bf16(d)) => self.stream.memcpy_dtod(&s.slice(0..n), &mut d.slice_mut(0..n)),
                _ => return Err(err("reserve", "element types differ")),
            };
            r.map_err(|e| err("reserve", e))?;
        }
        buf.data = data;
        Ok(())
    }

    fn matrix(&self, m: Matrix) -> Result<DeviceMat> {
        let (rows, cols) = (m.rows(), m.cols());
        self.matrix_typed(rows, cols, HostBuf::F32(m.into_data()))
    }

    fn weight_dtype(&self) -> DType {
        match self.weights {
            WeightType::F32 => DType::F32,
            WeightType::Bf16 => DType::Bf16,
        }
    }

    fn matrix_typed(&self, rows: usize, cols: usize, data: HostBuf) -> Result<DeviceMat> {
        use rayon::prelude::*;
        check_len("matrix", "data", data.len(), rows * cols)?;
        let up = |e| err("weights", e);
        let data = match (self.weights, data) {
            (WeightType::F32, HostBuf::F32(v)) => MatData::F32(self.stream.clone_htod(&v).map_err(up)?),
            (WeightType::F32, b @ HostBuf::Bf16(_)) => MatData::F32(self.stream.clone_htod(&b.to_f32()).map_err(up)?),
            (WeightType::Bf16, HostBuf::Bf16(bits)) => MatData::Bf16(self.stream.clone_htod(&bits).map_err(up)?),
            (WeightType::Bf16, HostBuf::F32(v)) => {
                let bits: Vec<u16> = v.par_iter().map(|&x| to_bf16(x)).collect();
                MatData::Bf16(self.stream.clone_htod(&bits).map_err(up)?)
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
        let (ip, _i) = dev_ids.device_ptr(&self.stream);
        let (op, _o) = out.ptr_mut(&self.stream);
        let (tp, _t) = match &table.data {
            MatData::F32(t) => {
                let (p, g) = t.device_ptr(&self.stream);
                (Ptr::new(p, Elem::F32), g)
            }
            MatData::Bf16(t) => {
                let (p, g) = t.device_ptr(&self.stream);
                (Ptr::new(p, Elem::Bf16), g)
            }
        };
        self.run_built(ops::embedding(tp, Ptr::new(ip, Elem::U32), op, ids.len() as u32, cols as u32))
    }

    fn matmul_t(&self, x: &DeviceBuf, rows: usize, w: &DeviceMat, out: &mut DeviceBuf) -> Result<()> {
        want("matmul_t", "x", x.dtype(), DType::F32)?;
        want("matmul_t", "out", out.dtype(), DType::F32)?;
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
        let (bp, _b) = bias.ptr(&self.stream);
        let (xp, _x) = x.ptr_mut(&self.stream);
        self.run_built(ops::add_bias(xp, bp, n, cols))
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
        want("rms_norm", "out", out.dtype(), DType::F32)?;
        let rows = (x.len / cols) as u32;
        if rows == 0 {
            return Ok(());
        }
        let (xp, _x) = x.ptr(&self.stream);
        let (wp, _w) = w.ptr(&self.stream);
        let (op, _o) = out.ptr_mut(&self.stream);
        self.run_built(ops::rms_norm(xp, wp, eps, op, rows, cols as u32))
    }

    fn rope(&self, x: &mut DeviceBuf, n_heads: usize, positions: &[u32], table: &RopeTable) -> Result<()> {
        let d = table.head_dim();
        check_same("rope", "x", x.len, positions.len() * n_heads * d)?;
        if positions.is_empty() || table.rot_dim() == 0 {
            return Ok(());
        }
        let t = self.rope_table(table)?;
        let pos = self.upload_u32(positions)?;
        let (pp, _p) = pos.device_ptr(&self.stream);
        let (cos, _c) = t.cos.device_ptr(&self.stream);
        let (sin, _s) = t.sin.device_ptr(&self.stream);
        let (inv, _i) = t.inv_freq.device_ptr(&self.stream);
        let args = RopeArgs {
            cos: Ptr::new(cos, Elem::F32),
            sin: Ptr::new(sin, Elem::F32),
            table_len: table.table_len() as u32,
            inv_freq: Ptr::new(inv, Elem::F64),
            head_dim: d as u32,
            rot_dim: table.rot_dim() as u32,
            interleaved: table.style() == RopeStyle::Interleaved,
        };
        let (xp, _x) = x.ptr_mut(&self.stream);
        self.run_built(ops::rope(xp, positions.len() as u32, n_heads as u32, Ptr::new(pp, Elem::U32), &args))
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
        want(op, "q", q.dtype(), DType::F32)?;
        want(op, "v", v.dtype(), k.dtype())?;
        if qpos.is_empty() {
            return Ok(());
        }
        let dims = AttnDims::of(shape, qpos.len(), kpos.len());
        let s = &self.stream;
        if k.dtype() == DType::Bf16 && ops::flash_supported(shape.head_dim) {
            let plan = ops::flash_plan(dims, self.sm_count, None);
            let (qp, meta) = (self.upload_u32(qpos)?, self.upload_u32(&ops::key_meta(kpos))?);
            let (qpp, _a) = qp.device_ptr(s);
            let (mp, _b) = meta.device_ptr(s);
            let (kp, _c) = k.ptr(s);
            let (vp, _d) = v.ptr(s);
            let (po, pl) = ops::flash_partial_lens(dims, &plan);
            let mut part_o = self.part_out.get(s, po)?;
            let mut part_l = self.part_lse.get(s, pl)?;
            let (o_slice, l_slice) = (part_o.as_mut(), part_l.as_mut());
            let (o_slice, l_slice) = o_slice.zip(l_slice).ok_or_else(|| err(op, "no scratch"))?;
            let (pop, _e) = o_slice.device_ptr_mut(s);
            let (plp, _f) = l_slice.device_ptr_mut(s);
            let partial = (plan.splits > 1).then_some((Ptr::new(pop, Elem::F32), Ptr::new(plp, Elem::F32)));
            let (outp, _g) = out.ptr_mut(s);
            let (lsep, _h) = lse.ptr_mut(s);
            return self.with_bf16_queries(q, |qb| {
                let u = |p| Ptr::new(p, Elem::U32);
                let calls =
                    ops::flash_attention(dims, &plan, qb, u(qpp), kp, vp, u(mp), outp, lsep, partial, shape.scale)?;
                calls.iter().try_for_each(|c| self.run(c))
            });
        }
        let (qp, kp2) = (self.upload_u32(qpos)?, self.upload_u32(kpos)?);
        let (qpp, _a) = qp.device_ptr(s);
        let (kpp, _b) = kp2.device_ptr(s);
        let (qd, _c) = q.ptr(s);
        let (kd, _d) = k.ptr(s);
        let (vd, _e) = v.ptr(s);
        let (od, _f) = out.ptr_mut(s);
        let (ld, _g) = lse.ptr_mut(s);
        let u = |p| Ptr::new(p, Elem::U32);
        self.run_built(ops::attention(dims, qd, u(qpp), kd, vd, u(kpp), od, ld, shape.scale))
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
        want(op, "q", q.dtype(), DType::F32)?;
        want(op, "scores", scores.dtype(), DType::F32)?;
        if qpos.is_empty() || kpos.is_empty() {
            return Ok(());
        }
        let dims = AttnDims::of(shape, qpos.len(), kpos.len());
        let s = &self.stream;
        let (qp, kp) = (self.upload_u32(qpos)?, self.upload_u32(kpos)?);
        let (qpp, _a) = qp.device_ptr(s);
        let (kpp, _b) = kp.device_ptr(s);
        let u = |p| Ptr::new(p, Elem::U32);
        let (kd, _c) = k.ptr(s);
        let (ld, _d) = lse.ptr(s);
        let (sd, _e) = scores.ptr_mut(s);
        if k.dtype() == DType::Bf16 && ops::flash_supported(shape.head_dim) {
            return self.with_bf16_queries(q, |qb| {
                self.run_built(ops::flash_scores(dims, qb, u(qpp), kd, u(kpp), ld, sd, shape.scale))
            });
        }
        let (qd, _f) = q.ptr(s);
        self.run_built(ops::attention_scores(dims, qd, u(qpp), kd, u(kpp), ld, sd, shape.scale))
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
        let s = &self.stream;
        let (bo, _a) = block_out.ptr(s);
        let (bl, _b) = block_lse.ptr(s);
        let (o, _c) = out.ptr_mut(s);
        let (l, _d) = lse.ptr_mut(s);
        self.run_built(ops::merge_partial(o, l, bo, bl, rows as u32, head_dim as u32))
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
        want("silu_mul", "out", out.dtype(), DType::F32)?;
        if rows == 0 {
            return Ok(());
        }
        let (g, _a) = gate_up.ptr(&self.stream);
        let (o, _b) = out.ptr_mut(&self.stream);
        self.run_built(ops::silu_mul(g, o, rows as u64, ffn as u32))
    }

    fn add_assign(&self, x: &mut DeviceBuf, y: &DeviceBuf) -> Result<()> {
        check_same("add_assign", "y", y.len, x.len)?;
        if x.len == 0 {
            return Ok(());
        }
        let n = x.len as u64;
        let (yp, _a) = y.ptr(&self.stream);
        let (xp, _b) = x.ptr_mut(&self.stream);
        self.run_built(ops::add_assign(xp, yp, n))
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
        let (sp, _a) = src.ptr(&self.stream);
        let (dp, _b) = dst.ptr_mut(&self.stream);
        self.run_built(ops::copy_columns(sp, src_cols as u32, col as u32, width as u32, dp, rows as u64))
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
        want("copy_rows", "dst", dst.dtype(), src.dtype())?;
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
        let (sr, _a) = sd.device_ptr(&self.stream);
        let (dr, _b) = dd.device_ptr(&self.stream);
        let (sp, _c) = src.ptr(&self.stream);
        let (dp, _d) = dst.ptr_mut(&self.stream);
        let u = |p| Ptr::new(p, Elem::U32);
        self.run_built(ops::copy_rows(sp, u(sr), dp, u(dr), s.len() as u32, row_len as u32))
    }

    fn append(&self, dst: &mut DeviceBuf, src: &DeviceBuf) -> Result<()> {
        want("append", "src", src.dtype(), dst.dtype())?;
        let (old, add) = (dst.len, src.len);
        if add == 0 {
            return Ok(());
        }
        if old + add > dst.capacity() {
            // Geometric growth: appending token by token copies each value O(1) times.
            self.reserve(dst, (old + add).max(2 * dst.capacity()))?;
        }
        let r = match (&src.data, &mut dst.data) {
            (DevData::F32(s), DevData::F32(d)) => {
                self.stream.memcpy_dtod(&s.slice(0..add), &mut d.slice_mut(old..old + add))
            }
            (DevData::Bf16(s), DevData::Bf16(d)) => {
                self.stream.memcpy_dtod(&s.slice(0..add), &mut d.slice_mut(old..old + add))
            }
            _ => return Err(err("append", "element types differ")),
        };
        r.map_err(|e| err("append", e))?;
        dst.len = old + add;
        Ok(())
    }

    fn download_typed(&self, buf: &DeviceBuf) -> Result<HostBuf> {
        if buf.len == 0 {
            return Ok(HostBuf::zeros(0, buf.dtype()));
        }
        Ok(match &buf.data {
            DevData::F32(d) => {
                HostBuf::F32(self.stream.clone_dtoh(&d.slice(0..buf.len)).map_err(|e| err("download", e))?)
            }
            DevData::Bf16(d) => {
                HostBuf::Bf16(self.stream.clone_dtoh(&d.slice(0..buf.len)).map_err(|e| err("download", e))?)
            }
        })
    }

    fn upload_typed(&self, host: &HostBuf) -> Result<DeviceBuf> {
        if host.is_empty() {
            return self.zeros_as(0, host.dtype());
        }
        let data = match host {
            HostBuf::F32(v) => DevData::F32(self.stream.clone_htod(v).map_err(|e| err("upload", e))?),
            HostBuf::Bf16(v) => DevData::Bf16(self.stream.clone_htod(v).map_err(|e| err("upload", e))?),
        };
        Ok(DeviceBuf { data, len: host.len() })
    }
}
