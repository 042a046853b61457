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
//!              sets it up front (the KV cache), so decoding does not reallocate per token;
//!              consecutive rows move as one copy (`copies.rs`)
//!   host       token ids, positions and row indices (control data) are uploaded once per
//!              distinct content and kept (a forward's positions: once, not per layer and op)
//!   memory     the stream-ordered pool, told to keep what is freed: no op allocates from the
//!              driver after the first forward of a size, and nothing waits for the stream
//!   timing     `mark` records an event on the stream; `seconds_between` reads two of them
//!              later, so the model's per-op profile adds no host synchronisation
//!   decode     a step recorded once as a CUDA graph and replayed per token (`graph.rs`)
//! ```
//!
//! Memory plan for an 8B-class llama/qwen model (32 layers, d 4096, 8 KV heads of 128, FFN
//! 14336, vocabulary 128K) on one 80 GB GPU, bf16 weights (computed from the shapes, not
//! measured; the memory plan of `flowprefill_worker::memory` was measured against a GPU's
//! high-water mark for SmolLM2 only, docs/gpu.md):
//!
//! | what | 32K context | 128K context |
//! | --- | ---: | ---: |
//! | weights, bf16 (f32: twice) | 16.1 GB | 16.1 GB |
//! | KV cache, bf16: 32 layers x tokens x 2 x 1024 x 2 B (f32: twice) | 4.3 GB | 17.2 GB |
//! | chunked methods: chunk caches (pre-RoPE) and their placed copies, twice the KV cache | 8.6 GB | 34.4 GB |
//! | activations of one 8192-token forward, the GPU's (x and its norm, qkv, q/k/v, attention, FFN gate-up 470 MB and its product 235 MB, logits row) | 1.2 GB | 1.2 GB |
//! | rope table, cuBLAS workspace, attention scratch (bf16 Q, key-split partials), kernels | < 0.2 GB | < 0.3 GB |
//! | total, full prefill / chunked method | about 22 / 26 GB | about 35 / 52 GB |
//!
//! With an f32 KV cache a chunked method at 128K needs 16.1 + 68.7 GB: it does not fit one
//! 80 GB GPU; bf16 makes it fit.
//!
//! Everything runs on one stream in order (the backend's own, non-blocking, not the legacy
//! default stream); a download synchronizes, and nothing else inside a forward does (the engine
//! settles the stream at phase boundaries, for its phase timers). Errors from the driver, NVRTC
//! and cuBLAS become [`KernelError::Backend`] naming the op ([`KernelError::DeviceLost`] where
//! the GPU can run nothing more in this process: `super::health`).

use super::buffers::{self, want, ControlCache, DevData, DeviceRope, MatData, Scratch};
pub use super::buffers::{DeviceBuf, DeviceMat, Mark};
use super::err;
use super::loader::{load_file, Occupancy};
use crate::attention::AttnShape;
use crate::backend::{from_bf16, to_bf16, Backend, DType, HostBuf, Recorded, StepValues};
use crate::error::{check_len, KernelError, Result};
use crate::gpu::ops;
use crate::gpu::{self, Call, Elem, Ptr};
use crate::matmul::Matrix;
use crate::rope::RopeTable;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

pub use crate::device::WeightType;

/// The CUDA backend of one device.
pub struct CudaBackend {
    ordinal: usize,
    arch: String,
    pub(super) sm_count: u32,
    pub(super) stream: Arc<CudaStream>,
    pub(super) blas: CudaBlas,
    functions: HashMap<&'static str, CudaFunction>,
    /// Kernels of flash2's other configurations, loaded when the autotuner times them or a
    /// decision names them.
    pub(super) extra: Mutex<HashMap<&'static str, CudaFunction>>,
    /// Blocks per SM of every loaded kernel: what its launch shape assumes, and what the
    /// occupancy API says fits.
    pub(super) occupancy: Mutex<Vec<Occupancy>>,
    /// The GPU's name and the driver's CUDA version (the autotuner's key).
    pub(super) gpu_name: String,
    pub(super) driver: i32,
    /// The attention autotuner's decisions and mode.
    pub(super) tuning: super::tuning::Tuning,
    weights: WeightType,
    kv: DType,
    /// Keys gathered for one attention call over many sources ([`Backend::gathered_keys`],
    /// `super::settings`).
    gathered_keys: usize,
    /// Uploaded RoPE tables, by their content.
    pub(super) ropes: Mutex<HashMap<u64, Arc<DeviceRope>>>,
    /// bf16 copy of the activations for bf16 GEMMs.
    pub(super) gemm_x: Scratch<u16>,
    /// bf16 copy of the queries for the tensor-core attention and scores.
    pub(super) attn_q: Scratch<u16>,
    /// Partial outputs and log-sum-exps of key splits.
    pub(super) part_out: Scratch<f32>,
    pub(super) part_lse: Scratch<f32>,
    /// Uploaded control data, by content.
    pub(super) control: ControlCache,
    /// How long a kernel's first run may take ([`CudaBackend::finish_within`]).
    pub(super) first_run_limit: std::time::Duration,
    /// The step being recorded, if any (`record`).
    pub(super) recorder: super::graph::Recorder,
    /// Page-locked memory for batched copies (`download_many`, `upload_many`).
    pub(super) staging: super::staging::Staging,
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
        gpu::check_capability(&format!("GPU {ordinal} ({})", d.name), d.compute_capability)
            .map_err(|detail| KernelError::Backend { backend: "cuda", detail })?;
        let arch = gpu::compile_arch(d.compute_capability);
        // cudarc panics on a library it cannot load: say which is missing and where we looked.
        for lib in ["NVRTC", "cuBLAS", "cuBLASLt"] {
            super::libs::require(lib)?;
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| err("context", e))?;
        let sm_count = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| err("multiprocessor count", e))?
            .max(1) as u32;
        let super::settings::Settings { fixed, gathered_keys, tune_off, pinned_control, first_run_limit } =
            super::settings::Settings::from_env()?;
        let driver = super::versions().driver.unwrap_or(0);
        // SAFETY: every op of this backend runs on `stream`, one stream, so cudarc's per-buffer
        // events order nothing (two made with every allocation and destroyed with it, recorded
        // and waited on at every use once a second stream exists): a few microseconds of host
        // time per allocation, and the chunked methods make thousands per request (H200,
        // 2026-11-26). The NCCL exchange, which adds a stream, turns them back on before making
        // it (`NcclPlane::new`), for every buffer made from then on.
        unsafe { ctx.disable_event_tracking() };
        // A stream of the backend's own, non-blocking (issue 51, item 5): not the legacy default
        // stream, which synchronises with every other blocking stream of the context and cannot
        // be captured into a CUDA graph. Nothing here relied on that implicit ordering: every op,
        // copy, allocation, cuBLAS call and event of the backend names this stream, and the NCCL
        // plane's stream (non-blocking too) is ordered against it by events.
        let stream = ctx.new_stream().map_err(|e| err("stream", e))?;
        // Not fatal: without it the pool returns freed memory at each synchronisation and
        // allocations go back to the driver (slower, still correct).
        if let Err(e) = buffers::keep_freed_memory(&ctx) {
            eprintln!("flowprefill: cuda:{ordinal}: the memory pool keeps nothing between calls ({e})");
        }
        let mut functions = HashMap::new();
        let mut occupancy = Vec::new();
        for file in gpu::FILES.iter().filter(|f| f.builds_for(&arch)) {
            let loaded = match load_file(&ctx, &arch, file, 0, file.kernels) {
                Ok(loaded) => loaded,
                // The architecture-specific files (Hopper's) are an addition: without them every
                // op runs on the kernels every GPU has.
                Err(e) if file.only_arch.is_some() => {
                    eprintln!("flowprefill: cuda:{ordinal}: {} not loaded, its kernels unused ({e})", file.name);
                    continue;
                }
                Err(e) => return Err(e),
            };
            for (name, f, occ) in loaded {
                functions.insert(name, f);
                occupancy.push(occ);
            }
        }
        let blas = CudaBlas::new(stream.clone()).map_err(|e| err("cuBLAS (is libcublas on the library path?)", e))?;
        let epoch = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let mut backend = Self {
            ordinal,
            arch,
            sm_count,
            stream,
            blas,
            functions,
            extra: Mutex::new(HashMap::new()),
            occupancy: Mutex::new(occupancy),
            gpu_name: d.name.clone(),
            driver,
            tuning: super::tuning::Tuning::new(fixed, tune_off),
            weights,
            kv,
            gathered_keys,
            ropes: Mutex::new(HashMap::new()),
            gemm_x: Scratch::new(epoch.clone()),
            attn_q: Scratch::new(epoch.clone()),
            part_out: Scratch::new(epoch.clone()),
            part_lse: Scratch::new(epoch.clone()),
            control: ControlCache::new(pinned_control),
            first_run_limit,
            recorder: super::graph::Recorder::new(epoch),
            staging: Default::default(),
        };
        // The Hopper attention runs only after it computed a known problem as flash2 does on
        // this very GPU; otherwise flash2 (and its autotuner) with one line saying why.
        backend.settle_fixed(fixed, tune_off)?;
        Ok(backend)
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
        super::health::check_hung(self.ordinal)?;
        self.stream.synchronize().map_err(|e| err("synchronize", e))
    }

    /// Whether `kernel` was loaded (the Hopper files load on compute capability 9.0 only).
    pub(super) fn has_kernel(&self, kernel: &str) -> bool {
        self.functions.contains_key(kernel)
    }

    /// Launches `call` on the stream (after checking it against the kernel's declaration).
    /// The caller holds the guards of every buffer the call names until this returns.
    pub(super) fn run(&self, call: &Call) -> Result<()> {
        call.check().map_err(|e| err("launch", e))?;
        super::health::check_hung(self.ordinal)?;
        self.refuse_while_recorded_elsewhere(call.kernel)?;
        let loaded = self.functions.get(call.kernel).cloned().or_else(|| self.extra_function(call.kernel));
        let f = loaded.ok_or_else(|| err("kernel", format!("{} was not loaded", call.kernel)))?;
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

    pub(super) fn run_built(&self, call: Result<Call>) -> Result<()> {
        self.run(&call?)
    }

    /// `len` elements of `dtype` whose contents the caller overwrites entirely before any
    /// read (no zero fill).
    pub(super) fn alloc_for_overwrite(&self, len: usize, dtype: DType) -> Result<DevData> {
        // SAFETY: uninitialised device memory is only handed to ops that write every element
        // of it first (`rope_copy`, `duplicate`), which check the lengths they write, or kept
        // past a buffer's length (`reserve`, an empty `zeros_as`), where nothing reads it.
        unsafe {
            Ok(match dtype {
                DType::F32 => {
                    DevData::F32(self.stream.alloc::<f32>(len.max(1)).map_err(|e| self.oom("alloc", len, 4, e))?)
                }
                DType::Bf16 => {
                    DevData::Bf16(self.stream.alloc::<u16>(len.max(1)).map_err(|e| self.oom("alloc", len, 2, e))?)
                }
            })
        }
    }

    /// [`buffers::alloc_err`] for `len` elements of `size` bytes on this backend's stream.
    pub(super) fn oom(&self, op: &str, len: usize, size: usize, e: cudarc::driver::DriverError) -> KernelError {
        buffers::alloc_err(&self.stream, op, len.max(1) * size, e)
    }

    fn alloc(&self, len: usize, dtype: DType) -> Result<DevData> {
        Ok(match dtype {
            DType::F32 => {
                DevData::F32(self.stream.alloc_zeros::<f32>(len.max(1)).map_err(|e| self.oom("alloc", len, 4, e))?)
            }
            DType::Bf16 => {
                DevData::Bf16(self.stream.alloc_zeros::<u16>(len.max(1)).map_err(|e| self.oom("alloc", len, 2, e))?)
            }
        })
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

pub(super) fn check_same(op: &'static str, what: &str, a: usize, b: usize) -> Result<()> {
    check_len(op, what, a, b)
}

impl Backend for CudaBackend {
    type Buf = DeviceBuf;
    type Mat = DeviceMat;
    type Mark = Mark;

    fn mark(&self) -> Result<Mark> {
        buffers::mark(self.stream.context(), &self.stream)
    }

    fn seconds_between(&self, start: &Mark, end: &Mark) -> Result<f64> {
        let ms = start.0.elapsed_ms(&end.0).map_err(|e| err("seconds_between", e))?;
        Ok(f64::from(ms.max(0.0)) * 1e-3)
    }

    fn settle(&self) -> Result<()> {
        self.synchronize()
    }

    fn memory(&self) -> Option<crate::Memory> {
        // Unknown (a driver error) is not a refusal: the job runs and an allocation that
        // fails is classified then.
        let free = buffers::device_free(self.stream.context()).ok()?;
        Some(crate::Memory { device: format!("cuda:{}", self.ordinal), free })
    }

    fn memory_use(&self) -> Option<crate::MemoryUse> {
        let (now, peak) = buffers::pool_use(self.stream.context()).ok()?;
        Some(crate::MemoryUse { now, peak })
    }

    fn reset_memory_peak(&self) {
        // Not fatal: the next peak then includes earlier ones.
        let _ = buffers::reset_pool_peak(self.stream.context());
    }

    fn release_unused(&self) {
        if let Err(e) = buffers::trim_pool(self.stream.context()) {
            eprintln!("flowprefill: cuda:{}: the memory pool was not trimmed: {e}", self.ordinal);
        }
    }

    fn scratch_bytes(&self, rows: usize, width: usize) -> usize {
        crate::backend::gpu_scratch_bytes(rows, width)
    }

    fn prefill_rows(&self) -> usize {
        crate::backend::GPU_PREFILL_ROWS
    }

    fn gathered_keys(&self) -> usize {
        self.gathered_keys
    }

    fn rope_copy(&self, src: &DeviceBuf, n_heads: usize, positions: &[u32], table: &RopeTable) -> Result<DeviceBuf> {
        self.rope_copy_on_device(src, n_heads, positions, table)
    }

    fn split_qkv_rope(
        &self,
        qkv: &DeviceBuf,
        heads: (usize, usize),
        positions: &[u32],
        table: &RopeTable,
        q: &mut DeviceBuf,
        k_pre: &mut DeviceBuf,
        k: &mut DeviceBuf,
        v: &mut DeviceBuf,
    ) -> Result<()> {
        self.split_qkv_rope_on_device(qkv, heads, positions, table, q, k_pre, k, v)
    }

    fn duplicate(&self, src: &DeviceBuf) -> Result<DeviceBuf> {
        let n = src.len;
        let mut data = self.alloc_for_overwrite(n, src.dtype())?;
        if n > 0 {
            let r = match (&src.data, &mut data) {
                (DevData::F32(s), DevData::F32(d)) => self.stream.memcpy_dtod(&s.slice(0..n), &mut d.slice_mut(0..n)),
                (DevData::Bf16(s), DevData::Bf16(d)) => self.stream.memcpy_dtod(&s.slice(0..n), &mut d.slice_mut(0..n)),
                _ => return Err(err("duplicate", "element types differ")),
            };
            r.map_err(|e| err("duplicate", e))?;
        }
        Ok(DeviceBuf { data, len: n })
    }

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn upload(&self, host: &[f32]) -> Result<DeviceBuf> {
        if host.is_empty() {
            return self.zeros(0);
        }
        let data = self.stream.clone_htod(host).map_err(|e| self.oom("upload", host.len(), 4, e))?;
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
        if len == 0 {
            // An empty buffer to append to (every chunk cache's layers start so): no zero fill.
            return Ok(DeviceBuf { data: self.alloc_for_overwrite(0, dtype)?, len });
        }
        Ok(DeviceBuf { data: self.alloc(len, dtype)?, len })
    }

    fn dtype(&self, buf: &DeviceBuf) -> DType {
        buf.dtype()
    }

    fn kv_dtype(&self) -> DType {
        self.kv
    }

    fn act_dtype(&self) -> DType {
        // Activations follow the weights: bf16 weights, a bf16 forward; f32 weights, the f32
        // forward the CPU runs.
        self.weight_dtype()
    }

    fn len(&self, buf: &DeviceBuf) -> usize {
        buf.len
    }

    fn resize(&self, buf: &mut DeviceBuf, len: usize) -> Result<()> {
        self.resize_buf(buf, len)
    }

    fn reserve(&self, buf: &mut DeviceBuf, capacity: usize) -> Result<()> {
        self.reserve_buf(buf, capacity)
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
        let size = match self.weights {
            WeightType::F32 => 4,
            WeightType::Bf16 => 2,
        };
        let up = |e| self.oom("weights", rows * cols, size, e);
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
        let dev_ids = self.upload_as(ids, super::graph::Role::Token)?;
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
        self.gemm(x, rows, w, out, false)
    }

    fn matmul_t_acc(&self, x: &DeviceBuf, rows: usize, w: &DeviceMat, out: &mut DeviceBuf) -> Result<()> {
        self.gemm(x, rows, w, out, true)
    }

    fn add_bias(&self, x: &mut DeviceBuf, bias: &DeviceBuf) -> Result<()> {
        if bias.len == 0 || !x.len.is_multiple_of(bias.len) {
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
        if cols == 0 || !x.len.is_multiple_of(cols) {
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
        let (xp, _x) = x.ptr(&self.stream);
        let (wp, _w) = w.ptr(&self.stream);
        let (op, _o) = out.ptr_mut(&self.stream);
        self.run_built(ops::rms_norm(xp, wp, eps, op, rows, cols as u32))
    }

    fn rope(&self, x: &mut DeviceBuf, n_heads: usize, positions: &[u32], table: &RopeTable) -> Result<()> {
        self.rope_on_device(x, n_heads, positions, table)
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
        self.attention_on_device(shape, q, qpos, k, v, kpos, out, lse)
    }

    fn attention_rows(
        &self,
        shape: &AttnShape,
        q: &DeviceBuf,
        q_first: usize,
        qpos: &[u32],
        k: &DeviceBuf,
        v: &DeviceBuf,
        k_first: usize,
        kpos: &[u32],
        out: &mut DeviceBuf,
        lse: &mut DeviceBuf,
    ) -> Result<()> {
        self.attention_rows_on_device(shape, q, q_first, qpos, k, v, k_first, kpos, out, lse)
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
        self.attention_scores_on_device(shape, q, qpos, k, kpos, lse, scores)
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
        if ffn == 0 || !out.len.is_multiple_of(ffn) {
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
        let (g, _a) = gate_up.ptr(&self.stream);
        let (o, _b) = out.ptr_mut(&self.stream);
        self.run_built(ops::silu_mul(g, o, rows as u64, ffn as u32))
    }

    fn add_assign(&self, x: &mut DeviceBuf, y: &DeviceBuf) -> Result<()> {
        check_same("add_assign", "y", y.len, x.len)?;
        want("add_assign", "y", y.dtype(), x.dtype())?;
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
        if src_cols == 0 || !src.len.is_multiple_of(src_cols) || col + width > src_cols {
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
        self.copy_rows_on_device(src, src_rows, dst, dst_rows, row_len)
    }

    fn append(&self, dst: &mut DeviceBuf, src: &DeviceBuf) -> Result<()> {
        self.append_range(dst, src, 0, src.len)
    }

    fn put_rows(&self, dst: &mut DeviceBuf, src: &DeviceBuf, at: usize, width: usize) -> Result<()> {
        self.put_rows_on_device(dst, src, at, width)
    }

    fn record(&self, values: StepValues, step: &mut dyn FnMut() -> Result<()>) -> Result<Option<Recorded>> {
        self.record_step(values, step)
    }

    fn append_rows(&self, dst: &mut DeviceBuf, src: &DeviceBuf, first: usize, rows: usize, width: usize) -> Result<()> {
        crate::backend::check_rows("append_rows", "src", src.len, first, rows, width)?;
        self.append_range(dst, src, first * width, rows * width)
    }

    fn download_typed(&self, buf: &DeviceBuf) -> Result<HostBuf> {
        self.download_one(buf)
    }

    fn upload_typed(&self, host: &HostBuf) -> Result<DeviceBuf> {
        self.upload_one(host)
    }

    fn download_many(&self, bufs: &[&DeviceBuf]) -> Result<Vec<HostBuf>> {
        self.download_batch(bufs)
    }

    fn upload_many(&self, hosts: &[&HostBuf]) -> Result<Vec<DeviceBuf>> {
        self.upload_batch(hosts)
    }
}

impl CudaBackend {
    pub(super) fn extra_function(&self, kernel: &str) -> Option<CudaFunction> {
        self.extra.lock().unwrap_or_else(|p| p.into_inner()).get(kernel).cloned()
    }

    /// Loads configuration `config` of `file` (`flash2.cu` or `flash_hopper.cu`; compiled by
    /// NVRTC on first use, cached on disk like every kernel) unless it is loaded.
    pub(super) fn load_config(&self, file: &str, config: usize) -> Result<()> {
        let budgets =
            if file == "flash_hopper.cu" { gpu::hopper_config_budgets(config) } else { gpu::config_budgets(config) };
        if budgets.iter().all(|b| self.extra_function(b.kernel).is_some()) {
            return Ok(());
        }
        let file = gpu::FILES.iter().find(|f| f.name == file).ok_or_else(|| err(file, "not in FILES"))?;
        let loaded = load_file(self.stream.context(), self.arch(), file, config, &budgets)?;
        let mut extra = self.extra.lock().unwrap_or_else(|p| p.into_inner());
        let mut occ = self.occupancy.lock().unwrap_or_else(|p| p.into_inner());
        for (name, f, o) in loaded {
            extra.insert(name, f);
            occ.push(o);
        }
        Ok(())
    }

    /// Blocks per SM of every kernel loaded so far (assumed by its launch shape, and what the
    /// occupancy API says fits on this GPU).
    pub fn occupancy(&self) -> Vec<Occupancy> {
        self.occupancy.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}
