//! Math kernels of flowprefill, on f32 slices.
//!
//! * [`matmul`]: `x · Wᵀ` through the `gemm` crate's packed micro-kernels, and for one row (a
//!   decode step) a loop of dot products that streams each weight row once;
//! * [`norm`], [`rope`], [`elementwise`]: RMSNorm, rotary embedding at explicit positions,
//!   SiLU-gated product, residual add, embedding lookup;
//! * [`attention`]: blocked online-softmax attention returning `(out, lse)`, with visibility
//!   decided by positions, plus per-key attention mass ([`attention::attention_scores`]);
//! * [`merge`]: `merge_partial`, the one place partial attention results combine;
//! * [`topk`]: deterministic top-k;
//! * [`gpu`]: the CUDA kernels as data (their `.cu` sources, resource budgets, launch shapes);
//! * `cuda` (feature `cuda`): the CUDA backend, NVRTC compilation, device discovery, through
//!   cudarc with dynamic loading (builds and links without any CUDA install);
//! * [`backend`]: the op set the model is written against ([`backend::Backend`]) and the CPU
//!   implementation; [`device`]: the backend chosen at run time (`--device cpu|cuda[:N]`).
//!
//! Every fast kernel has a slow reference (`*_ref`) and an equivalence test with a named
//! tolerance next to it.

pub mod attention;
pub mod backend;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod elementwise;
mod error;
pub mod gpu;
pub mod host_time;
pub mod matmul;
pub mod merge;
pub mod norm;
pub mod rope;
pub mod simd;
pub mod testing;
pub mod topk;

pub use backend::{
    gpu_scratch_bytes, Backend, Cpu, DType, HostBuf, Memory, MemoryUse, Wrapper, GPU_GATHERED_KEYS, GPU_PREFILL_ROWS,
    PREFILL_ROWS,
};
pub use device::{Device, DeviceSpec, WeightType};
pub use error::{either, gib, KernelError, OomAdvice, Result};

/// flowprefill's cache folder: `$FLOWPREFILL_HOME`, else `$XDG_CACHE_HOME/flowprefill`, else
/// `~/.cache/flowprefill` (the temporary folder if there is no home): where compiled kernels,
/// the CUDA wheels and the autotuner's decisions live.
pub fn flowprefill_home() -> std::path::PathBuf {
    use std::path::PathBuf;
    let var = |v| std::env::var_os(v).filter(|s| !s.is_empty()).map(PathBuf::from);
    var("FLOWPREFILL_HOME")
        .or_else(|| var("XDG_CACHE_HOME").map(|c| c.join("flowprefill")))
        .or_else(|| var("HOME").map(|h| h.join(".cache").join("flowprefill")))
        .unwrap_or_else(|| std::env::temp_dir().join("flowprefill"))
}
