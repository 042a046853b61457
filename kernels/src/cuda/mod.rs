//! CUDA (feature `cuda`): device discovery, NVRTC ([`nvrtc`]) and the backend
//! ([`CudaBackend`]).
//!
//! cudarc is built with dynamic loading, so this compiles and links on machines without any
//! CUDA install; at run time each library is looked up first and its absence is a typed error,
//! never a panic (cudarc's `CudaContext::new` panics when libcuda is missing).

mod backend;
mod buffers;
mod compute;
mod copies;
mod graph;
mod health;
pub mod hopper;
pub mod libs;
mod loader;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod nvrtc;
mod rotary;
mod settings;
mod staging;
mod tune;
mod tuning;

pub use crate::backend::to_bf16;
pub use backend::{CudaBackend, DeviceBuf, DeviceMat, Mark, WeightType};
pub use loader::Occupancy;

use crate::error::{KernelError, Result};

/// One visible GPU.
#[derive(Clone, Debug)]
pub struct CudaDevice {
    /// Device ordinal.
    pub ordinal: usize,
    /// Marketing name.
    pub name: String,
    /// (major, minor).
    pub compute_capability: (i32, i32),
    /// Device memory in bytes.
    pub total_mem_bytes: usize,
}

/// A CUDA failure described in words.
fn fail(detail: impl Into<String>) -> KernelError {
    KernelError::Backend { backend: "cuda", detail: detail.into() }
}

/// A CUDA call `op` that failed with `e` (every module of the backend reports this way): a
/// driver error that CUDA keeps for the context's life is [`KernelError::DeviceLost`]; so is a
/// library's failure (cuBLAS's, NVRTC's: no driver result in it) when this thread's context,
/// asked afterwards, answers with such an error ([`sticky_error`]).
pub(crate) fn err(op: &str, e: impl std::fmt::Debug + 'static) -> KernelError {
    let driver = (&e as &dyn std::any::Any).downcast_ref::<cudarc::driver::DriverError>();
    classify(format!("{op}: {e:?}"), driver.map(|d| d.0), sticky_error)
}

/// A failure described by `detail`: lost when the driver's own result (`driver`) is one CUDA
/// keeps, or, for a failure that carries none, when `probe` (the context asked afterwards)
/// returns one; a backend error of the call otherwise.
fn classify(
    detail: String,
    driver: Option<cudarc::driver::sys::CUresult>,
    probe: impl FnOnce() -> Option<cudarc::driver::sys::CUresult>,
) -> KernelError {
    let lost = |detail| KernelError::DeviceLost { device: "the GPU".into(), detail, hung: false };
    match driver {
        Some(r) if context_lost(r) => lost(detail),
        Some(_) => fail(detail),
        None => match probe().filter(|&r| context_lost(r)) {
            Some(r) => lost(format!("{detail}; the context then answered {r:?}")),
            None => fail(detail),
        },
    }
}

/// The error CUDA keeps for this thread's current context, if it keeps one: the answer of a
/// call that never waits for the GPU (its free memory). A library (cuBLAS, NCCL) reports a
/// lost context in its own words (`CUBLAS_STATUS_EXECUTION_FAILED`, `ncclUnhandledCudaError`);
/// the driver's answer afterwards says whether the GPU can still be used. `None` without a
/// driver, without a current context, or when the context answers.
pub(crate) fn sticky_error() -> Option<cudarc::driver::sys::CUresult> {
    if !driver_present() {
        return None;
    }
    cudarc::driver::result::mem_get_info().err().map(|e| e.0).filter(|&r| context_lost(r))
}

/// The driver's results that leave the context unusable ("sticky" errors: a kernel fault, an
/// uncorrectable ECC error, a kernel stopped by the display watchdog); every later call of
/// the process on that context returns the same.
fn context_lost(r: cudarc::driver::sys::CUresult) -> bool {
    use cudarc::driver::sys::CUresult as R;
    matches!(
        r,
        R::CUDA_ERROR_ILLEGAL_ADDRESS
            | R::CUDA_ERROR_ILLEGAL_INSTRUCTION
            | R::CUDA_ERROR_MISALIGNED_ADDRESS
            | R::CUDA_ERROR_INVALID_ADDRESS_SPACE
            | R::CUDA_ERROR_INVALID_PC
            | R::CUDA_ERROR_HARDWARE_STACK_ERROR
            | R::CUDA_ERROR_LAUNCH_FAILED
            | R::CUDA_ERROR_LAUNCH_TIMEOUT
            | R::CUDA_ERROR_ECC_UNCORRECTABLE
            | R::CUDA_ERROR_ASSERT
            | R::CUDA_ERROR_CONTEXT_IS_DESTROYED
    )
}

/// True when the CUDA driver library can be loaded.
pub fn driver_present() -> bool {
    // SAFETY: only attempts to dlopen the driver library by its usual names; no symbol of it
    // is called.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Versions of the CUDA pieces this process found, for `flowprefill devices`.
#[derive(Clone, Debug, Default)]
pub struct Versions {
    /// The CUDA version the driver supports (e.g. 12090), if a driver is present.
    pub driver: Option<i32>,
    /// NVRTC (major, minor), if libnvrtc was found.
    pub nvrtc: Option<(i32, i32)>,
    /// cuBLAS (major, minor, patch), if libcublas was found.
    pub cublas: Option<(i32, i32, i32)>,
    /// NCCL (major, minor, patch), if compiled in and libnccl was found.
    pub nccl: Option<(i32, i32, i32)>,
}

/// What this machine has of the CUDA stack (nothing is required to call it).
pub fn versions() -> Versions {
    let driver = driver_present()
        .then(|| {
            let mut v = 0;
            // SAFETY: cuInit is idempotent; `v` is a valid out-pointer.
            unsafe {
                let _ = cudarc::driver::sys::cuInit(0);
                cudarc::driver::sys::cuDriverGetVersion(&mut v)
            }
            .result()
            .ok()
            .map(|()| v)
        })
        .flatten();
    // SAFETY: only tries to dlopen the library by its usual names.
    let cublas = unsafe { cudarc::cublas::sys::is_culib_present() }
        .then(|| {
            use cudarc::cublas::sys::{cublasGetProperty, libraryPropertyType};
            let part = |p| {
                let mut v = 0;
                // SAFETY: a valid out-pointer; cublasGetProperty needs no handle.
                unsafe { cublasGetProperty(p, &mut v) }.result().ok().map(|()| v)
            };
            Some((
                part(libraryPropertyType::MAJOR_VERSION)?,
                part(libraryPropertyType::MINOR_VERSION)?,
                part(libraryPropertyType::PATCH_LEVEL)?,
            ))
        })
        .flatten();
    #[cfg(feature = "nccl")]
    let nccl = nccl::version().ok();
    #[cfg(not(feature = "nccl"))]
    let nccl = None;
    Versions { driver, nvrtc: nvrtc::version().ok(), cublas, nccl }
}

/// Lists the GPUs, or says why there are none. Asks the driver about each device without
/// creating a context on it: a context per GPU per process took device memory and time on every
/// GPU at every start, and fails outright on a GPU in exclusive-process mode that another rank
/// holds (the usual setting of a cluster's nodes, one rank per GPU).
pub fn devices() -> Result<Vec<CudaDevice>> {
    use cudarc::driver::result::{self, device};
    use cudarc::driver::sys::CUdevice_attribute as Attr;
    if !driver_present() {
        return Err(fail("the CUDA driver (libcuda) was not found: no NVIDIA driver on this machine"));
    }
    result::init().map_err(|e| fail(format!("cuInit failed: {e:?}")))?;
    let n = device::get_count().map_err(|e| fail(format!("cuDeviceGetCount failed: {e:?}")))?;
    (0..n.max(0))
        .map(|ordinal| {
            let what = |field: &str, e: cudarc::driver::DriverError| fail(format!("device {ordinal} {field}: {e:?}"));
            let dev = device::get(ordinal).map_err(|e| what("handle", e))?;
            // SAFETY: `dev` was returned by cuDeviceGet just above; the queries need no context.
            let attribute = |a: Attr| unsafe { device::get_attribute(dev, a) }.map_err(|e| what("capability", e));
            Ok(CudaDevice {
                ordinal: ordinal as usize,
                name: device::get_name(dev).map_err(|e| what("name", e))?,
                compute_capability: (
                    attribute(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                    attribute(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
                ),
                // SAFETY: as above.
                total_mem_bytes: unsafe { device::total_mem(dev) }.map_err(|e| what("memory", e))?,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn devices_errors_cleanly_or_lists() {
        match super::devices() {
            // A driver and no GPU: nothing to check the listing against.
            Ok(list) if list.is_empty() => crate::testing::skipped("no CUDA device", "the driver lists no GPU"),
            Ok(list) => assert!(list.iter().all(|d| d.total_mem_bytes > 0)),
            Err(e) => assert!(e.to_string().contains("cuda"), "{e}"),
        }
    }

    /// The driver's "sticky" results are a lost device; any other failure stays a backend
    /// error of its call (an allocation that failed, a bad argument: the GPU still works).
    /// (`err` itself formats the driver's words, which needs the driver: its classification is
    /// tested here, its message below.)
    #[test]
    fn faults_the_driver_keeps_are_a_lost_device_and_other_errors_are_not() {
        use cudarc::driver::sys::CUresult as R;
        for r in [R::CUDA_ERROR_ILLEGAL_ADDRESS, R::CUDA_ERROR_LAUNCH_FAILED, R::CUDA_ERROR_ECC_UNCORRECTABLE] {
            assert!(super::context_lost(r), "{r:?}");
        }
        for r in [R::CUDA_ERROR_OUT_OF_MEMORY, R::CUDA_ERROR_INVALID_VALUE, R::CUDA_ERROR_NOT_READY, R::CUDA_SUCCESS] {
            assert!(!super::context_lost(r), "{r:?}");
        }
        // Text, NVRTC's or cuBLAS's errors are not the driver's results: the context asked
        // afterwards decides (here, a machine without a driver or without a current context).
        assert!(matches!(super::err("load", "no such kernel"), crate::KernelError::Backend { .. }));
        let gemm = || "cuBLAS gemm: CUBLAS_STATUS_EXECUTION_FAILED".to_string();
        let lost = super::classify(gemm(), None, || Some(R::CUDA_ERROR_ILLEGAL_ADDRESS));
        assert!(
            matches!(&lost, crate::KernelError::DeviceLost { detail, hung: false, .. }
                if detail == "cuBLAS gemm: CUBLAS_STATUS_EXECUTION_FAILED; the context then answered CUDA_ERROR_ILLEGAL_ADDRESS"),
            "{lost:?}"
        );
        for answer in [None, Some(R::CUDA_ERROR_INVALID_CONTEXT), Some(R::CUDA_ERROR_OUT_OF_MEMORY)] {
            assert!(
                matches!(super::classify(gemm(), None, || answer), crate::KernelError::Backend { .. }),
                "{answer:?}"
            );
        }
        // The driver's own result decides without asking again.
        let asked = std::cell::Cell::new(false);
        let oom = super::classify("alloc".into(), Some(R::CUDA_ERROR_OUT_OF_MEMORY), || {
            asked.set(true);
            Some(R::CUDA_ERROR_ILLEGAL_ADDRESS)
        });
        assert!(matches!(oom, crate::KernelError::Backend { .. }) && !asked.get());
        let hung = crate::KernelError::DeviceLost {
            device: "cuda:3".into(),
            detail: "the self-check of Hopper(0) at d64 did not finish within 60 s".into(),
            hung: true,
        };
        assert_eq!(
            hung.to_string(),
            "cuda:3 failed: the self-check of Hopper(0) at d64 did not finish within 60 s; its context is lost (every \
             later call on it in this process fails): restart the process (the GPU stays busy with that kernel until \
             this process ends)"
        );
    }
}
