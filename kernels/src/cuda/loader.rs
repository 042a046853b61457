//! Loading kernels into a [`super::CudaBackend`]: a `.cu` file compiled by NVRTC (or read from the
//! disk cache) in one of flash2's configurations, each kernel prepared (dynamic shared memory,
//! carveout) and its occupancy read and checked against its launch shape; flash2's other
//! configurations loaded on demand (the autotuner, a decision that names one).

use super::err;
use super::nvrtc;
use crate::error::Result;
use crate::gpu;
use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::Ptx;
use std::sync::Arc;

/// Blocks per SM of one kernel on this GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Occupancy {
    /// The kernel.
    pub kernel: &'static str,
    /// What its launch shape assumes (`__launch_bounds__`' minimum blocks per SM).
    pub assumed: u32,
    /// What fits (`cuOccupancyMaxActiveBlocksPerMultiprocessor` with its block size and dynamic
    /// shared memory).
    pub fits: u32,
}

impl std::fmt::Display for Occupancy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {} block(s) per SM fit", self.kernel, self.fits)?;
        if self.fits < self.assumed {
            write!(f, ", fewer than the {} its launch shape assumes (registers or shared memory)", self.assumed)?;
        }
        Ok(())
    }
}

/// Compiles (or reads from the disk cache) `file` in flash2 configuration `config` for `arch`,
/// loads the kernels of `budgets`, and prepares each: the dynamic shared memory it asks for
/// (above 48 KiB), the largest shared-memory carveout for kernels that use shared memory
/// beyond that (the L1 split is a hint the driver may round), and its occupancy.
pub(super) fn load_file(
    ctx: &Arc<CudaContext>,
    arch: &str,
    file: &gpu::KernelFile,
    config: usize,
    budgets: &[gpu::Budget],
) -> Result<Vec<(&'static str, CudaFunction, Occupancy)>> {
    use cudarc::driver::sys::CUfunction_attribute_enum as A;
    let (program, replaced) = gpu::device_program(file, config)?;
    if !replaced.is_empty() {
        eprintln!(
            "flowprefill: cuda:{}: {} (configuration {config}) built with {} from {}={} instead of the built-in source",
            ctx.ordinal(),
            file.name,
            replaced.join(", "),
            gpu::SOURCES_ENV,
            std::env::var(gpu::SOURCES_ENV).unwrap_or_default()
        );
    }
    let (cubin, entry) = nvrtc::cached(file.name, &program, arch)?;
    let module = match (ctx.load_module(Ptx::from_binary(cubin)), entry) {
        (Ok(m), _) => m,
        // A damaged entry of the cache (a write cut short) failed every later start: it is
        // dropped and compiled again, once.
        (Err(e), Some(path)) => {
            eprintln!(
                "flowprefill: cuda:{}: {} from the kernel cache did not load ({e}); compiling it again",
                ctx.ordinal(),
                path.display()
            );
            let _ = std::fs::remove_file(&path);
            let (cubin, _) = nvrtc::cached(file.name, &program, arch)?;
            ctx.load_module(Ptx::from_binary(cubin)).map_err(|e| err(file.name, e))?
        }
        (Err(e), None) => return Err(err(file.name, e)),
    };
    let mut out = Vec::with_capacity(budgets.len());
    for k in budgets {
        let f = module.load_function(k.kernel).map_err(|e| err(k.kernel, e))?;
        if k.dynamic_shared_bytes > gpu::DEFAULT_DYNAMIC_SHARED_LIMIT {
            f.set_attribute(A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, k.dynamic_shared_bytes as i32)
                .map_err(|e| err(k.kernel, format!("{e:?}: {} B of dynamic shared memory", k.dynamic_shared_bytes)))?;
            // 100: cudaSharedmemCarveoutMaxShared. Not fatal: the default carveout may be enough.
            if let Err(e) = f.set_attribute(A::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100) {
                eprintln!("flowprefill: {}: the shared-memory carveout was not set ({e:?})", k.kernel);
            }
        }
        let fits = f
            .occupancy_max_active_blocks_per_multiprocessor(k.threads, k.dynamic_shared_bytes as usize, None)
            .map_err(|e| err(k.kernel, format!("occupancy: {e:?}")))?;
        let occ = Occupancy { kernel: k.kernel, assumed: k.blocks_per_sm, fits };
        if occ.fits < occ.assumed {
            eprintln!("flowprefill: cuda:{}: {occ}", ctx.ordinal());
        }
        out.push((k.kernel, f, occ));
    }
    Ok(out)
}
