//! The CUDA kernels as data, shared by everything that handles them: their `.cu` sources, the
//! resource budget of each kernel, and the launch shape each op uses.
//!
//! ```text
//!   kernels/cuda/*.cu ──include_str!──> FILES ──┬─> CudaBackend (feature `cuda`): NVRTC for the
//!                                               │   device's arch, cached on disk, launched with
//!                                               │   the shapes below
//!                                               ├─> compile gate (tests, feature `cuda`): NVRTC to
//!                                               │   sm_80 / sm_90a machine code, ptxas report
//!                                               │   checked against the budgets below
//!                                               └─> CPU emulation (crate flowprefill-kernels-emu):
//!                                                   the same sources through `cuda/cpu_shim.h`,
//!                                                   launched with the same shapes, compared with
//!                                                   the Rust references
//! ```
//! This module needs no CUDA library: it is plain data and arithmetic.

/// Prepended to every kernel file (types, bf16 bits, warp reductions).
pub const COMMON: &str = include_str!("../cuda/common.cuh");

/// The CPU launch shim (for the emulation; never sent to NVRTC).
pub const CPU_SHIM: &str = include_str!("../cuda/cpu_shim.h");

/// What one kernel may use on the device; the compile gate fails above it (and on any spill).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budget {
    /// Kernel (`extern "C"`) name.
    pub kernel: &'static str,
    /// Registers per thread.
    pub max_registers: u32,
    /// Static shared memory per block, bytes.
    pub max_shared_bytes: u32,
}

/// One `.cu` file.
#[derive(Clone, Copy, Debug)]
pub struct KernelFile {
    /// File name under `kernels/cuda/`.
    pub name: &'static str,
    /// Its source (without [`COMMON`]).
    pub source: &'static str,
    /// Its kernels and their budgets.
    pub kernels: &'static [Budget],
}

const fn budget(kernel: &'static str, max_registers: u32, max_shared_bytes: u32) -> Budget {
    Budget { kernel, max_registers, max_shared_bytes }
}

/// Every kernel file. Budgets: elementwise kernels stay small (32 registers: full occupancy);
/// RMSNorm has a 33-float reduction buffer; attention holds 8 output floats per lane and a
/// 4 x 256 query tile (4 KiB) per block, and may use up to 64 registers (still 8 blocks of 128
/// threads per SM on sm_80 / sm_90).
pub const FILES: &[KernelFile] = &[
    KernelFile {
        name: "elementwise.cu",
        source: include_str!("../cuda/elementwise.cu"),
        kernels: &[
            budget("fp_embedding_f32", 32, 0),
            budget("fp_embedding_bf16", 32, 0),
            budget("fp_add_bias", 32, 0),
            budget("fp_add_assign", 32, 0),
            budget("fp_silu_mul", 32, 0),
            budget("fp_copy_columns", 32, 0),
            budget("fp_copy_rows", 32, 0),
            budget("fp_fill", 32, 0),
            budget("fp_f32_to_bf16", 32, 0),
            budget("fp_bf16_to_f32", 32, 0),
        ],
    },
    KernelFile { name: "norm.cu", source: include_str!("../cuda/norm.cu"), kernels: &[budget("fp_rms_norm", 32, 64)] },
    KernelFile { name: "rope.cu", source: include_str!("../cuda/rope.cu"), kernels: &[budget("fp_rope", 40, 0)] },
    KernelFile {
        name: "attention.cu",
        source: include_str!("../cuda/attention.cu"),
        kernels: &[budget("fp_attention", 64, 4096)],
    },
    KernelFile {
        name: "scores.cu",
        source: include_str!("../cuda/scores.cu"),
        kernels: &[budget("fp_attention_scores", 40, 0)],
    },
    KernelFile {
        name: "merge.cu",
        source: include_str!("../cuda/merge.cu"),
        kernels: &[budget("fp_merge_partial", 32, 0)],
    },
];

/// The full NVRTC program of `file`: [`COMMON`] then the file.
pub fn program(file: &KernelFile) -> String {
    format!("{COMMON}\n{}", file.source)
}

/// FNV-1a of every source: part of the on-disk cache key of compiled kernels.
pub fn sources_hash() -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for part in std::iter::once(COMMON).chain(FILES.iter().map(|f| f.source)) {
        for b in part.bytes() {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// A launch: grid `(x, y)` of one-dimensional blocks of `block` threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    /// Blocks along x.
    pub grid_x: u32,
    /// Blocks along y.
    pub grid_y: u32,
    /// Threads per block.
    pub block: u32,
}

/// Threads per block of the element-wise and per-row kernels.
pub const ELEMENTWISE_THREADS: u32 = 256;
/// Blocks at most for a grid-stride loop (enough to fill any current GPU several times).
pub const MAX_STRIDE_BLOCKS: u64 = 4096;
/// Threads per block of RMSNorm (`FP_NORM_THREADS` in norm.cu).
pub const NORM_THREADS: u32 = 256;
/// Query rows (warps) per attention block (`FP_ATT_WARPS` in attention.cu).
pub const ATTENTION_WARPS: u32 = 4;
/// Largest head dimension of the attention kernel (`FP_ATT_MAX_DIM`).
pub const ATTENTION_MAX_DIM: usize = 256;

/// A grid-stride loop over `n` items.
pub fn stride_launch(n: u64) -> Launch {
    let blocks = n.div_ceil(ELEMENTWISE_THREADS as u64).clamp(1, MAX_STRIDE_BLOCKS) as u32;
    Launch { grid_x: blocks, grid_y: 1, block: ELEMENTWISE_THREADS }
}

/// RMSNorm: one block per row.
pub fn norm_launch(rows: u32) -> Launch {
    Launch { grid_x: rows.max(1), grid_y: 1, block: NORM_THREADS }
}

/// Attention: one warp per query row and head.
pub fn attention_launch(rows: u32, n_heads: u32) -> Launch {
    Launch { grid_x: rows.div_ceil(ATTENTION_WARPS).max(1), grid_y: n_heads, block: 32 * ATTENTION_WARPS }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_has_a_budget_and_appears_in_its_source() {
        let mut names = std::collections::BTreeSet::new();
        for f in FILES {
            for b in f.kernels {
                assert!(f.source.contains(&format!("void {}(", b.kernel)), "{} not in {}", b.kernel, f.name);
                assert!(names.insert(b.kernel), "{} listed twice", b.kernel);
            }
            // Every extern "C" kernel of the file has a budget.
            for line in f.source.lines().filter(|l| l.contains("__global__")) {
                let name = line.split("void ").nth(1).and_then(|r| r.split('(').next()).unwrap_or("");
                assert!(f.kernels.iter().any(|b| b.kernel == name), "{name} in {} has no budget", f.name);
            }
        }
        assert!(sources_hash() != 0);
        assert!(program(&FILES[0]).starts_with(COMMON));
    }

    #[test]
    fn launch_shapes_cover_their_work() {
        assert_eq!(stride_launch(1), Launch { grid_x: 1, grid_y: 1, block: 256 });
        assert_eq!(stride_launch(1000).grid_x, 4);
        assert_eq!(stride_launch(u64::MAX).grid_x as u64, MAX_STRIDE_BLOCKS);
        assert_eq!(attention_launch(9, 14), Launch { grid_x: 3, grid_y: 14, block: 128 });
        assert_eq!(norm_launch(0).grid_x, 1);
    }
}
