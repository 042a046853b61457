//! The backend chosen at run time (`--device cpu|cuda[:N]`): one type for the command line to
//! hold, dispatching each op to the CPU or to a GPU. The model and the engine stay generic
//! over [`Backend`]; this is only how a binary picks one without being generic itself (a
//! match per op call, negligible next to the op).
//!
//! A build without the `cuda` feature has only the CPU; asking it for `cuda` is an error that
//! says how to build with it.

use crate::attention::AttnShape;
use crate::backend::{Backend, Cpu, DType, HostBuf};
use crate::error::{KernelError, Result};
use crate::matmul::Matrix;
use crate::rope::RopeTable;
#[cfg(feature = "cuda")]
use std::sync::Arc;

/// Where the model runs.
#[derive(Clone)]
pub enum Device {
    /// The CPU backend.
    Cpu(Cpu),
    /// A GPU (feature `cuda`).
    #[cfg(feature = "cuda")]
    Cuda(Arc<crate::cuda::CudaBackend>),
}

/// A buffer of a [`Device`].
pub enum DevBuf {
    /// On the CPU.
    Cpu(HostBuf),
    /// On a GPU.
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::DeviceBuf),
}

/// A weight matrix of a [`Device`].
pub enum DevMat {
    /// On the CPU.
    Cpu(Matrix),
    /// On a GPU.
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::DeviceMat),
}

/// A [`Backend::mark`] of a [`Device`].
#[derive(Clone)]
pub enum DevMark {
    /// On the CPU.
    Cpu(std::time::Instant),
    /// On a GPU.
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::Mark),
}

/// How a GPU keeps the weights, and with them the forward's activations (the CPU always
/// keeps f32).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum WeightType {
    /// bf16: half the memory; a bf16 forward (GEMMs bf16 in and out with f32 accumulation,
    /// activations bf16 between ops).
    #[default]
    Bf16,
    /// f32: exact weights, FP32 GEMMs and an f32 forward (for comparing with the CPU).
    F32,
}

impl std::str::FromStr for WeightType {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "bf16" => Ok(WeightType::Bf16),
            "f32" => Ok(WeightType::F32),
            other => Err(format!("`{other}`: give bf16 or f32")),
        }
    }
}

/// A parsed `--device` value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceSpec {
    /// `cpu`.
    Cpu,
    /// `cuda:N`.
    Cuda(usize),
    /// `cuda`: this process's GPU, the node-local rank's under a launcher (see
    /// [`DeviceSpec::resolve`]), else GPU 0.
    CudaLocal,
}

/// This process's rank among the processes of its node, as the MPI launchers and Slurm set it.
pub fn node_local_rank() -> Option<usize> {
    ["OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "LOCAL_RANK"]
        .iter()
        .find_map(|v| std::env::var(v).ok().and_then(|s| s.trim().parse().ok()))
}

impl DeviceSpec {
    /// The concrete device: `cuda` becomes `cuda:L mod G` for node-local rank `L` and `G`
    /// visible GPUs (`cuda:0` outside a launcher or when no GPU is visible), so that `mpirun -np
    /// N ... --device cuda` gives each rank of a node its own GPU.
    pub fn resolve(self, gpus: usize) -> DeviceSpec {
        self.resolve_for(node_local_rank(), gpus)
    }

    /// [`DeviceSpec::resolve`] for a given node-local rank.
    pub fn resolve_for(self, local_rank: Option<usize>, gpus: usize) -> DeviceSpec {
        match self {
            DeviceSpec::CudaLocal => DeviceSpec::Cuda(local_rank.unwrap_or(0) % gpus.max(1)),
            other => other,
        }
    }
}

impl std::str::FromStr for DeviceSpec {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let s = s.trim().to_ascii_lowercase();
        match s.as_str() {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" | "gpu" => Ok(DeviceSpec::CudaLocal),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceSpec::Cuda)
                .ok_or_else(|| format!("`{s}` is not a device; give cpu, cuda or cuda:N")),
        }
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Cuda(n) => write!(f, "cuda:{n}"),
            DeviceSpec::CudaLocal => f.write_str("cuda"),
        }
    }
}

impl Device {
    /// Opens the device `spec` names (for a GPU: context, kernels, cuBLAS; weights kept as
    /// `weights`). KV caches hold `kv` elements, by default bf16 on a GPU and f32 on the CPU.
    pub fn open(spec: DeviceSpec, weights: WeightType, kv: Option<DType>) -> Result<Self> {
        match spec {
            DeviceSpec::Cpu => Ok(Device::Cpu(Cpu::with_kv_dtype(kv.unwrap_or(DType::F32)))),
            #[cfg(feature = "cuda")]
            DeviceSpec::Cuda(n) => {
                let kv = kv.unwrap_or(DType::Bf16);
                Ok(Device::Cuda(Arc::new(crate::cuda::CudaBackend::new(n, weights, kv)?)))
            }
            #[cfg(feature = "cuda")]
            DeviceSpec::CudaLocal => {
                let gpus = crate::cuda::devices().map_or(0, |d| d.len());
                Self::open(spec.resolve(gpus), weights, kv)
            }
            #[cfg(not(feature = "cuda"))]
            DeviceSpec::Cuda(_) | DeviceSpec::CudaLocal => {
                let _ = (weights, kv);
                Err(KernelError::Backend {
                    backend: "cuda",
                    detail: "this build has no CUDA support: rebuild with `cargo build --release --features cuda`"
                        .into(),
                })
            }
        }
    }
}

fn mixed(op: &'static str) -> KernelError {
    KernelError::Backend { backend: "device", detail: format!("{op}: buffers of different devices") }
}

/// Dispatches an op to the device's backend, unwrapping each listed buffer or matrix to that
/// device's variant (one on another device is an error).
macro_rules! dispatch {
    ($self:ident, $op:literal, |$be:ident| $body:expr, $($buf:ident),*) => {
        match $self {
            Device::Cpu($be) => {
                let _span = crate::host_time::span($op);
                $( let Some($buf) = $buf.on_cpu() else { return Err(mixed($op)) }; )*
                $body
            }
            #[cfg(feature = "cuda")]
            Device::Cuda($be) => {
                let _span = crate::host_time::span($op);
                let $be = &**$be;
                $( let Some($buf) = $buf.on_cuda() else { return Err(mixed($op)) }; )*
                $body
            }
        }
    };
}

/// A buffer or matrix reference unwrapped to one device's variant.
trait Variant: Sized {
    type Cpu;
    #[cfg(feature = "cuda")]
    type Cuda;
    fn on_cpu(self) -> Option<Self::Cpu>;
    #[cfg(feature = "cuda")]
    fn on_cuda(self) -> Option<Self::Cuda>;
}

/// Implements [`Variant`] for a reference to an enum of [`Device`]'s buffers or matrices.
macro_rules! variant {
    ($ty:ty, $enum:ident, $cpu:ty, $cuda:ty) => {
        impl<'a> Variant for $ty {
            type Cpu = $cpu;
            #[cfg(feature = "cuda")]
            type Cuda = $cuda;
            fn on_cpu(self) -> Option<$cpu> {
                match self {
                    $enum::Cpu(x) => Some(x),
                    #[cfg(feature = "cuda")]
                    _ => None,
                }
            }
            #[cfg(feature = "cuda")]
            fn on_cuda(self) -> Option<$cuda> {
                match self {
                    $enum::Cuda(x) => Some(x),
                    _ => None,
                }
            }
        }
    };
}

variant!(&'a DevBuf, DevBuf, &'a HostBuf, &'a crate::cuda::DeviceBuf);
variant!(&'a mut DevBuf, DevBuf, &'a mut HostBuf, &'a mut crate::cuda::DeviceBuf);
variant!(&'a DevMat, DevMat, &'a Matrix, &'a crate::cuda::DeviceMat);

/// Wraps a backend's result buffer in its variant (timed as `$op`).
macro_rules! wrap {
    ($self:ident, $op:literal, |$be:ident| $body:expr, $variant:ident) => {{
        let _span = crate::host_time::span($op);
        match $self {
            Device::Cpu($be) => Ok($variant::Cpu($body?)),
            #[cfg(feature = "cuda")]
            Device::Cuda($be) => {
                let $be = &**$be;
                Ok($variant::Cuda($body?))
            }
        }
    }};
}

impl Backend for Device {
    type Buf = DevBuf;
    type Mat = DevMat;
    type Mark = DevMark;

    fn mark(&self) -> Result<DevMark> {
        wrap!(self, "mark", |be| be.mark(), DevMark)
    }
    fn seconds_between(&self, start: &DevMark, end: &DevMark) -> Result<f64> {
        let _span = crate::host_time::span("seconds_between");
        match (self, start, end) {
            (Device::Cpu(be), DevMark::Cpu(a), DevMark::Cpu(b)) => be.seconds_between(a, b),
            #[cfg(feature = "cuda")]
            (Device::Cuda(be), DevMark::Cuda(a), DevMark::Cuda(b)) => be.seconds_between(a, b),
            #[cfg(feature = "cuda")]
            _ => Err(mixed("seconds_between")),
        }
    }
    fn settle(&self) -> Result<()> {
        let _span = crate::host_time::span("settle");
        match self {
            Device::Cpu(be) => be.settle(),
            #[cfg(feature = "cuda")]
            Device::Cuda(be) => be.settle(),
        }
    }
    fn memory(&self) -> Option<crate::Memory> {
        match self {
            Device::Cpu(be) => be.memory(),
            #[cfg(feature = "cuda")]
            Device::Cuda(be) => be.memory(),
        }
    }
    fn memory_use(&self) -> Option<crate::MemoryUse> {
        match self {
            Device::Cpu(be) => be.memory_use(),
            #[cfg(feature = "cuda")]
            Device::Cuda(be) => be.memory_use(),
        }
    }
    fn reset_memory_peak(&self) {
        match self {
            Device::Cpu(be) => be.reset_memory_peak(),
            #[cfg(feature = "cuda")]
            Device::Cuda(be) => be.reset_memory_peak(),
        }
    }
    fn scratch_bytes(&self, rows: usize, width: usize) -> usize {
        match self {
            Device::Cpu(be) => be.scratch_bytes(rows, width),
            #[cfg(feature = "cuda")]
            Device::Cuda(be) => be.scratch_bytes(rows, width),
        }
    }
    fn rope_copy(&self, src: &DevBuf, n_heads: usize, positions: &[u32], table: &RopeTable) -> Result<DevBuf> {
        let _span = crate::host_time::span("rope_copy");
        match self {
            Device::Cpu(be) => {
                let Some(src) = src.on_cpu() else { return Err(mixed("rope_copy")) };
                Ok(DevBuf::Cpu(be.rope_copy(src, n_heads, positions, table)?))
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(be) => {
                let Some(src) = src.on_cuda() else { return Err(mixed("rope_copy")) };
                Ok(DevBuf::Cuda(be.rope_copy(src, n_heads, positions, table)?))
            }
        }
    }
    fn split_qkv_rope(
        &self,
        qkv: &DevBuf,
        heads: (usize, usize),
        positions: &[u32],
        table: &RopeTable,
        q: &mut DevBuf,
        k_pre: &mut DevBuf,
        k: &mut DevBuf,
        v: &mut DevBuf,
    ) -> Result<()> {
        dispatch!(
            self,
            "split_qkv_rope",
            |be| be.split_qkv_rope(qkv, heads, positions, table, q, k_pre, k, v),
            qkv,
            q,
            k_pre,
            k,
            v
        )
    }
    fn duplicate(&self, src: &DevBuf) -> Result<DevBuf> {
        let _span = crate::host_time::span("duplicate");
        match self {
            Device::Cpu(be) => {
                let Some(src) = src.on_cpu() else { return Err(mixed("duplicate")) };
                Ok(DevBuf::Cpu(be.duplicate(src)?))
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(be) => {
                let Some(src) = src.on_cuda() else { return Err(mixed("duplicate")) };
                Ok(DevBuf::Cuda(be.duplicate(src)?))
            }
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Device::Cpu(b) => b.name(),
            #[cfg(feature = "cuda")]
            Device::Cuda(b) => b.name(),
        }
    }
    fn upload(&self, host: &[f32]) -> Result<DevBuf> {
        wrap!(self, "upload", |be| be.upload(host), DevBuf)
    }
    fn download(&self, buf: &DevBuf) -> Result<Vec<f32>> {
        dispatch!(self, "download", |be| be.download(buf), buf)
    }
    fn download_range(&self, buf: &DevBuf, start: usize, len: usize) -> Result<Vec<f32>> {
        dispatch!(self, "download_range", |be| be.download_range(buf, start, len), buf)
    }
    fn zeros_as(&self, len: usize, dtype: DType) -> Result<DevBuf> {
        wrap!(self, "zeros_as", |be| be.zeros_as(len, dtype), DevBuf)
    }
    fn dtype(&self, buf: &DevBuf) -> DType {
        match buf {
            DevBuf::Cpu(b) => b.dtype(),
            #[cfg(feature = "cuda")]
            DevBuf::Cuda(b) => b.dtype(),
        }
    }
    fn kv_dtype(&self) -> DType {
        match self {
            Device::Cpu(b) => b.kv_dtype(),
            #[cfg(feature = "cuda")]
            Device::Cuda(b) => b.kv_dtype(),
        }
    }
    fn act_dtype(&self) -> DType {
        match self {
            Device::Cpu(b) => b.act_dtype(),
            #[cfg(feature = "cuda")]
            Device::Cuda(b) => b.act_dtype(),
        }
    }
    fn len(&self, buf: &DevBuf) -> usize {
        match buf {
            DevBuf::Cpu(b) => b.len(),
            #[cfg(feature = "cuda")]
            DevBuf::Cuda(b) => b.len(),
        }
    }
    fn resize(&self, buf: &mut DevBuf, len: usize) -> Result<()> {
        dispatch!(self, "resize", |be| be.resize(buf, len), buf)
    }
    fn reserve(&self, buf: &mut DevBuf, capacity: usize) -> Result<()> {
        dispatch!(self, "reserve", |be| be.reserve(buf, capacity), buf)
    }
    fn matrix(&self, m: Matrix) -> Result<DevMat> {
        wrap!(self, "matrix", |be| be.matrix(m), DevMat)
    }
    fn weight_dtype(&self) -> DType {
        match self {
            Device::Cpu(b) => b.weight_dtype(),
            #[cfg(feature = "cuda")]
            Device::Cuda(b) => b.weight_dtype(),
        }
    }
    fn matrix_typed(&self, rows: usize, cols: usize, data: HostBuf) -> Result<DevMat> {
        wrap!(self, "matrix_typed", |be| be.matrix_typed(rows, cols, data), DevMat)
    }
    fn mat_shape(&self, m: &DevMat) -> (usize, usize) {
        match m {
            DevMat::Cpu(m) => (m.rows(), m.cols()),
            #[cfg(feature = "cuda")]
            DevMat::Cuda(m) => m.shape(),
        }
    }
    fn embedding(&self, table: &DevMat, ids: &[u32], out: &mut DevBuf) -> Result<()> {
        dispatch!(self, "embedding", |be| be.embedding(table, ids, out), table, out)
    }
    fn matmul_t(&self, x: &DevBuf, rows: usize, w: &DevMat, out: &mut DevBuf) -> Result<()> {
        dispatch!(self, "matmul_t", |be| be.matmul_t(x, rows, w, out), x, w, out)
    }
    fn matmul_t_acc(&self, x: &DevBuf, rows: usize, w: &DevMat, out: &mut DevBuf) -> Result<()> {
        dispatch!(self, "matmul_t_acc", |be| be.matmul_t_acc(x, rows, w, out), x, w, out)
    }
    fn add_bias(&self, x: &mut DevBuf, bias: &DevBuf) -> Result<()> {
        dispatch!(self, "add_bias", |be| be.add_bias(x, bias), x, bias)
    }
    fn rms_norm(&self, x: &DevBuf, w: &DevBuf, eps: f32, out: &mut DevBuf) -> Result<()> {
        dispatch!(self, "rms_norm", |be| be.rms_norm(x, w, eps, out), x, w, out)
    }
    fn rope(&self, x: &mut DevBuf, n_heads: usize, positions: &[u32], table: &RopeTable) -> Result<()> {
        dispatch!(self, "rope", |be| be.rope(x, n_heads, positions, table), x)
    }
    fn attention(
        &self,
        shape: &AttnShape,
        q: &DevBuf,
        qpos: &[u32],
        k: &DevBuf,
        v: &DevBuf,
        kpos: &[u32],
        out: &mut DevBuf,
        lse: &mut DevBuf,
    ) -> Result<()> {
        dispatch!(self, "attention", |be| be.attention(shape, q, qpos, k, v, kpos, out, lse), q, k, v, out, lse)
    }
    fn attention_rows(
        &self,
        shape: &AttnShape,
        q: &DevBuf,
        q_first: usize,
        qpos: &[u32],
        k: &DevBuf,
        v: &DevBuf,
        k_first: usize,
        kpos: &[u32],
        out: &mut DevBuf,
        lse: &mut DevBuf,
    ) -> Result<()> {
        dispatch!(
            self,
            "attention_rows",
            |be| be.attention_rows(shape, q, q_first, qpos, k, v, k_first, kpos, out, lse),
            q,
            k,
            v,
            out,
            lse
        )
    }
    fn append_rows(&self, dst: &mut DevBuf, src: &DevBuf, first: usize, rows: usize, width: usize) -> Result<()> {
        dispatch!(self, "append_rows", |be| be.append_rows(dst, src, first, rows, width), dst, src)
    }
    fn attention_scores(
        &self,
        shape: &AttnShape,
        q: &DevBuf,
        qpos: &[u32],
        k: &DevBuf,
        kpos: &[u32],
        lse: &DevBuf,
        scores: &mut DevBuf,
    ) -> Result<()> {
        dispatch!(
            self,
            "attention_scores",
            |be| be.attention_scores(shape, q, qpos, k, kpos, lse, scores),
            q,
            k,
            lse,
            scores
        )
    }
    fn merge_partial(
        &self,
        out: &mut DevBuf,
        lse: &mut DevBuf,
        block_out: &DevBuf,
        block_lse: &DevBuf,
        head_dim: usize,
    ) -> Result<()> {
        dispatch!(
            self,
            "merge_partial",
            |be| be.merge_partial(out, lse, block_out, block_lse, head_dim),
            out,
            lse,
            block_out,
            block_lse
        )
    }
    fn silu_mul(&self, gate_up: &DevBuf, ffn: usize, out: &mut DevBuf) -> Result<()> {
        dispatch!(self, "silu_mul", |be| be.silu_mul(gate_up, ffn, out), gate_up, out)
    }
    fn add_assign(&self, x: &mut DevBuf, y: &DevBuf) -> Result<()> {
        dispatch!(self, "add_assign", |be| be.add_assign(x, y), x, y)
    }
    fn copy_columns(&self, src: &DevBuf, src_cols: usize, col: usize, width: usize, dst: &mut DevBuf) -> Result<()> {
        dispatch!(self, "copy_columns", |be| be.copy_columns(src, src_cols, col, width, dst), src, dst)
    }
    fn copy_rows(
        &self,
        src: &DevBuf,
        src_rows: &[usize],
        dst: &mut DevBuf,
        dst_rows: &[usize],
        row_len: usize,
    ) -> Result<()> {
        dispatch!(self, "copy_rows", |be| be.copy_rows(src, src_rows, dst, dst_rows, row_len), src, dst)
    }
    fn append(&self, dst: &mut DevBuf, src: &DevBuf) -> Result<()> {
        dispatch!(self, "append", |be| be.append(dst, src), dst, src)
    }
    fn download_typed(&self, buf: &DevBuf) -> Result<HostBuf> {
        dispatch!(self, "download_typed", |be| be.download_typed(buf), buf)
    }
    fn upload_typed(&self, host: &HostBuf) -> Result<DevBuf> {
        wrap!(self, "upload_typed", |be| be.upload_typed(host), DevBuf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_cpu_runs_through_the_enum() {
        assert_eq!("cpu".parse::<DeviceSpec>(), Ok(DeviceSpec::Cpu));
        assert_eq!("CUDA".parse::<DeviceSpec>(), Ok(DeviceSpec::CudaLocal));
        assert_eq!(DeviceSpec::CudaLocal.to_string(), "cuda");
        assert_eq!(DeviceSpec::Cuda(2).resolve(4), DeviceSpec::Cuda(2), "an explicit GPU stays");
        assert_eq!(DeviceSpec::Cpu.resolve(4), DeviceSpec::Cpu);
        // Under a launcher, rank L of a node takes GPU L (wrapping when ranks outnumber GPUs).
        assert_eq!(DeviceSpec::CudaLocal.resolve_for(Some(3), 8), DeviceSpec::Cuda(3));
        assert_eq!(DeviceSpec::CudaLocal.resolve_for(Some(9), 8), DeviceSpec::Cuda(1));
        assert_eq!(DeviceSpec::CudaLocal.resolve_for(None, 8), DeviceSpec::Cuda(0));
        assert_eq!(
            DeviceSpec::CudaLocal.resolve_for(Some(2), 0),
            DeviceSpec::Cuda(0),
            "no GPU visible: cuda:0's error"
        );
        assert_eq!("cuda:3".parse::<DeviceSpec>(), Ok(DeviceSpec::Cuda(3)));
        assert!("tpu".parse::<DeviceSpec>().unwrap_err().contains("cpu, cuda or cuda:N"));
        let d = Device::open(DeviceSpec::Cpu, WeightType::F32, None).unwrap();
        assert_eq!(d.kv_dtype(), DType::F32, "f32 KV caches on the CPU by default");
        assert_eq!(Device::open(DeviceSpec::Cpu, WeightType::F32, Some(DType::Bf16)).unwrap().kv_dtype(), DType::Bf16);
        let mut x = d.upload(&[1.0, 2.0, 3.0]).unwrap();
        let y = d.upload(&[0.5, 0.5, 0.5]).unwrap();
        d.add_assign(&mut x, &y).unwrap();
        assert_eq!(d.download(&x).unwrap(), vec![1.5, 2.5, 3.5]);
        assert_eq!(d.len(&x), 3);
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn a_build_without_cuda_says_how_to_get_it() {
        let e =
            Device::open(DeviceSpec::Cuda(0), WeightType::Bf16, None).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("--features cuda"), "{e}");
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn a_machine_without_a_gpu_says_so() {
        if crate::cuda::devices().is_ok_and(|d| !d.is_empty()) {
            crate::testing::skipped("a GPU is present", "this test checks the error without one");
            return;
        }
        let e =
            Device::open(DeviceSpec::Cuda(0), WeightType::Bf16, None).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("cuda"), "{e}");
    }
}
