//! The backend chosen at run time (`--device cpu|cuda[:N]`): one type for the command line to
//! hold, dispatching each op to the CPU or to a GPU. The model and the engine stay generic
//! over [`Backend`](crate::Backend); this is only how a binary picks one without being generic
//! itself (a match per op call, negligible next to the op). The dispatch is written once per
//! kind of op (`device_op!`) over the list of ops in `backend/forward.rs`.
//!
//! A build without the `cuda` feature has only the CPU; asking it for `cuda` is an error that
//! says how to build with it.

use crate::backend::{Cpu, DType, HostBuf};
use crate::error::{KernelError, Result};
use crate::matmul::Matrix;
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

/// A [`Backend::mark`](crate::Backend::mark) of a [`Device`].
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

/// The processes of this job on this node, as the MPI launchers (and torchrun) set it.
pub fn node_local_size() -> Option<usize> {
    ["OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_LOCAL_SIZE", "LOCAL_WORLD_SIZE"]
        .iter()
        .find_map(|v| std::env::var(v).ok().and_then(|s| s.trim().parse().ok()))
}

impl DeviceSpec {
    /// The processes of this node (this one included) whose jobs use the device `self` names,
    /// when every process of the node was given the same `--device`: all of them on the CPU or
    /// on an explicit `cuda:N`; under `cuda`, those whose node-local rank maps to the same one
    /// of the `gpus` visible GPUs. 1 outside a launcher (no node-local rank or size).
    pub fn sharing_processes(self, local_rank: Option<usize>, local_size: Option<usize>, gpus: usize) -> usize {
        let (Some(rank), Some(size)) = (local_rank, local_size) else { return 1 };
        let size = size.max(rank + 1);
        match self {
            DeviceSpec::Cpu | DeviceSpec::Cuda(_) => size,
            DeviceSpec::CudaLocal => {
                let g = gpus.max(1);
                (0..size).filter(|r| r % g == rank % g).count()
            }
        }
    }

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

/// Every buffer of `bufs` as one device's variant (`on`), or the error of mixed devices.
fn unwrap_all<'a, T>(bufs: &[&'a DevBuf], on: fn(&'a DevBuf) -> Option<T>, op: &'static str) -> Result<Vec<T>> {
    bufs.iter().map(|b| on(b).ok_or_else(|| mixed(op))).collect()
}

/// A buffer, matrix or mark reference unwrapped to one device's variant.
trait Variant: Sized {
    type Cpu;
    #[cfg(feature = "cuda")]
    type Cuda;
    fn on_cpu(self) -> Option<Self::Cpu>;
    #[cfg(feature = "cuda")]
    fn on_cuda(self) -> Option<Self::Cuda>;
}

/// Implements [`Variant`] for a reference to an enum of [`Device`]'s buffers, matrices or marks.
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
variant!(&'a DevMark, DevMark, &'a std::time::Instant, &'a crate::cuda::Mark);

/// Writes one op of the list (`backend/forward.rs`) for [`Device`]: an op that returns a
/// `Result` is timed as its name (`host_time`), unwraps each buffer, matrix and mark argument
/// to the open device's variant (one of another device is an error) and wraps a buffer,
/// matrix or mark it returns in that variant; any other op is the open backend's answer.
macro_rules! device_op {
    (@on $on:ident $name:ident value $x:ident) => {};
    (@on $on:ident $name:ident $kind:ident $x:ident) => {
        let Some($x) = $x.$on() else { return Err(mixed(stringify!($name))) };
    };
    (@wrap buf $dev:ident $call:expr) => {
        Ok(DevBuf::$dev($call?))
    };
    (@wrap mat $dev:ident $call:expr) => {
        Ok(DevMat::$dev($call?))
    };
    (@wrap mark $dev:ident $call:expr) => {
        Ok(DevMark::$dev($call?))
    };
    (@wrap result $dev:ident $call:expr) => {
        $call
    };
    (@plain $name:ident value) => {};
    (@plain $name:ident $kind:ident) => {
        compile_error!(concat!(
            "Device::",
            stringify!($name),
            " takes a buffer, matrix or mark and returns no Result: write it in device.rs"
        ));
    };
    ($name:ident ($($p:tt)*) [value] [$($ret:tt)*] [$(($kind:ident $x:ident))*]) => {
        fn $name(&self, $($p)*) $($ret)* {
            $(device_op!(@plain $name $kind);)*
            match self {
                Device::Cpu(be) => be.$name($($x),*),
                #[cfg(feature = "cuda")]
                Device::Cuda(be) => be.$name($($x),*),
            }
        }
    };
    ($name:ident ($($p:tt)*) [$result:ident] [$($ret:tt)*] [$(($kind:ident $x:ident))*]) => {
        fn $name(&self, $($p)*) $($ret)* {
            let _span = crate::host_time::span(stringify!($name));
            match self {
                Device::Cpu(be) => {
                    $(device_op!(@on on_cpu $name $kind $x);)*
                    device_op!(@wrap $result Cpu be.$name($($x),*))
                }
                #[cfg(feature = "cuda")]
                Device::Cuda(be) => {
                    let be = &**be;
                    $(device_op!(@on on_cuda $name $kind $x);)*
                    device_op!(@wrap $result Cuda be.$name($($x),*))
                }
            }
        }
    };
}

crate::backend::forward_backend_with! {
    impl Backend for Device {
        forward_with(device_op);
        // The trait's defaults, through this enum's `zeros_as`, `len`, `dtype`, `download_typed`
        // and `upload_typed`.
        defaults(zeros, bytes, stage_out, stage_in);
        type Buf = DevBuf;
        type Mat = DevMat;
        type Mark = DevMark;

        fn dtype(&self, buf: &DevBuf) -> DType {
            match buf {
                DevBuf::Cpu(b) => b.dtype(),
                #[cfg(feature = "cuda")]
                DevBuf::Cuda(b) => b.dtype(),
            }
        }
        fn len(&self, buf: &DevBuf) -> usize {
            match buf {
                DevBuf::Cpu(b) => b.len(),
                #[cfg(feature = "cuda")]
                DevBuf::Cuda(b) => b.len(),
            }
        }
        fn download_many(&self, bufs: &[&DevBuf]) -> Result<Vec<HostBuf>> {
            let _span = crate::host_time::span("download_many");
            match self {
                Device::Cpu(be) => be.download_many(&unwrap_all(bufs, Variant::on_cpu, "download_many")?),
                #[cfg(feature = "cuda")]
                Device::Cuda(be) => be.download_many(&unwrap_all(bufs, Variant::on_cuda, "download_many")?),
            }
        }
        fn upload_many(&self, hosts: &[&HostBuf]) -> Result<Vec<DevBuf>> {
            let _span = crate::host_time::span("upload_many");
            Ok(match self {
                Device::Cpu(be) => be.upload_many(hosts)?.into_iter().map(DevBuf::Cpu).collect(),
                #[cfg(feature = "cuda")]
                Device::Cuda(be) => be.upload_many(hosts)?.into_iter().map(DevBuf::Cuda).collect(),
            })
        }
        fn mat_shape(&self, m: &DevMat) -> (usize, usize) {
            match m {
                DevMat::Cpu(m) => (m.rows(), m.cols()),
                #[cfg(feature = "cuda")]
                DevMat::Cuda(m) => m.shape(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Backend;

    #[test]
    fn processes_on_one_node_share_its_cpu_and_the_gpus_they_map_to() {
        use DeviceSpec::*;
        // Outside a launcher: alone.
        assert_eq!(Cpu.sharing_processes(None, None, 0), 1);
        assert_eq!(Cpu.sharing_processes(Some(0), None, 0), 1);
        // Four processes on one node: all share its memory, or one explicit GPU.
        assert_eq!(Cpu.sharing_processes(Some(2), Some(4), 0), 4);
        assert_eq!(Cuda(1).sharing_processes(Some(2), Some(4), 8), 4);
        // `cuda`: node-local rank L on GPU L mod G.
        assert_eq!(CudaLocal.sharing_processes(Some(3), Some(4), 4), 1, "a GPU each");
        assert_eq!(CudaLocal.sharing_processes(Some(3), Some(4), 2), 2, "ranks 1 and 3 on GPU 1");
        assert_eq!(CudaLocal.sharing_processes(Some(0), Some(5), 2), 3, "ranks 0, 2, 4 on GPU 0");
        assert_eq!(CudaLocal.sharing_processes(Some(1), Some(5), 2), 2);
        assert_eq!(CudaLocal.sharing_processes(Some(0), Some(3), 0), 3, "no GPU seen: every rank on cuda:0");
    }

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
