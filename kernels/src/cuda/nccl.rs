//! NCCL, loaded at run time like the rest of the CUDA stack: its version, a unique id (made on
//! rank 0 and handed to the other ranks over MPI or to thread ranks), and a communicator per
//! rank. Without the library, or without a GPU, every call is an error that says which, never
//! a panic (cudarc's loader panics when the library is missing, so presence is checked first).
//!
//! The PyPI wheel `nvidia-nccl-cu12` ships `libnccl.so.2`; cudarc looks for `libnccl.so`, so
//! `scripts/cuda-wheels.sh --nccl` links that name to it.

use super::err;
use crate::error::Result;

/// Bytes of an NCCL unique id (`NCCL_UNIQUE_ID_BYTES`).
pub const ID_BYTES: usize = 128;

/// True when the NCCL library can be loaded.
pub fn present() -> bool {
    // SAFETY: only attempts to dlopen the library by its usual names; no symbol is called.
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

fn require() -> Result<()> {
    if present() {
        Ok(())
    } else {
        Err(err("NCCL (libnccl.so) was not found: install it (`bash scripts/cuda-wheels.sh --nccl` fetches the \
             PyPI wheel and prints the folder for LD_LIBRARY_PATH) or use the MPI communicator"))
    }
}

/// NCCL's version as (major, minor, patch).
pub fn version() -> Result<(i32, i32, i32)> {
    require()?;
    let code = cudarc::nccl::result::get_nccl_version().map_err(|e| err(format!("ncclGetVersion: {e:?}")))?;
    // Since NCCL 2.9 the code is major * 10000 + minor * 100 + patch.
    Ok((code / 10000, (code % 10000) / 100, code % 100))
}

/// A fresh unique id for a new communicator (rank 0 makes it; every rank needs the same one).
/// Needs the library, not a GPU.
pub fn unique_id() -> Result<[u8; ID_BYTES]> {
    require()?;
    let id = cudarc::nccl::safe::Id::new().map_err(|e| err(format!("ncclGetUniqueId: {e:?}")))?;
    let mut out = [0u8; ID_BYTES];
    for (o, &c) in out.iter_mut().zip(id.internal().iter()) {
        *o = c as u8;
    }
    Ok(out)
}

/// The NCCL communicator of `rank` in a world of `world`, on GPU `ordinal`, from the unique id
/// rank 0 made. Blocks until every rank has called it (NCCL's rule).
pub fn communicator(
    ordinal: usize,
    rank: usize,
    world: usize,
    id: &[u8; ID_BYTES],
) -> Result<cudarc::nccl::safe::Comm> {
    require()?;
    if rank >= world {
        return Err(err(format!("NCCL rank {rank} outside a world of {world}")));
    }
    if !super::driver_present() {
        return Err(err(format!(
            "an NCCL communicator needs a GPU: the CUDA driver (libcuda) was not found (rank {rank} of {world}, cuda:{ordinal})"
        )));
    }
    let ctx = cudarc::driver::CudaContext::new(ordinal)
        .map_err(|e| err(format!("cuda:{ordinal} for NCCL rank {rank}: {e:?}")))?;
    let mut internal = [0 as std::ffi::c_char; ID_BYTES];
    for (i, &b) in internal.iter_mut().zip(id.iter()) {
        *i = b as std::ffi::c_char;
    }
    cudarc::nccl::safe::Comm::from_rank(ctx.default_stream(), rank, world, cudarc::nccl::safe::Id::uninit(internal))
        .map_err(|e| err(format!("ncclCommInitRank (rank {rank} of {world}, cuda:{ordinal}): {e:?}")))
}
