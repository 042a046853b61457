//! The CUDA kernels as data, shared by everything that handles them: their `.cu` sources, the
//! resource budget of each kernel, their parameter lists (read from the sources), and one
//! builder per op that turns the op's arguments into a launch ([`ops`]).
//!
//! ```text
//!   kernels/cuda/*.cu ──include_str!──> FILES ──┬─> CudaBackend (feature `cuda`): NVRTC for the
//!                                               │   device's arch, cached on disk
//!                                               ├─> compile gate (tests, feature `cuda`): NVRTC to
//!                                               │   sm_80 / sm_90a machine code, ptxas report
//!                                               │   checked against the budgets below
//!                                               └─> CPU emulation (crate flowprefill-kernels-emu):
//!                                                   the same sources through `cuda/cpu_shim.h`
//!
//!   ops::<op>(pointers, sizes) -> Call { kernel, launch, args } ──┬─> CudaBackend::run (cuLaunchKernel)
//!                                                                  └─> emulator (one C entry point)
//! ```
//! A kernel's argument list is written twice: in its `.cu` declaration and in its builder in
//! [`ops`]. Every [`Call`] is checked against the declaration ([`Call::check`]: count, and the
//! type of every argument, pointers by element type) before it is launched, on the GPU and in
//! the emulator alike; and since the backend and the emulator launch the very same `Call`, an
//! argument put in the wrong place by a builder is caught by the emulation tests, on any
//! machine. This module needs no CUDA library: it is plain data and arithmetic.

mod host;
pub use host::{check_capability, temporary_suffix, MIN_COMPUTE_CAPABILITY};
pub mod ops;
pub mod sass;
pub mod shapes;
pub mod sources;
pub mod tma;
pub mod tune;

pub use sass::SassBudget;
pub use sources::{device_program, device_program_from, program, program_in, sources_dir, sources_hash, SOURCES_ENV};

use std::collections::HashMap;
use std::sync::OnceLock;

/// Prepended to every kernel file (types, bf16 bits, warp reductions, tensor-core wrappers).
pub const COMMON: &str = include_str!("../../cuda/common.cuh");

/// Prepended after [`COMMON`]: the tile steps of the reference tensor-core kernels (`flash.cu`,
/// `flash_scores.cu`: copies, Q fragments, S = Q K^T), templates the other files never
/// instantiate.
pub const FLASH_TILES: &str = include_str!("../../cuda/flash_tiles.cuh");

/// Prepended after [`FLASH_TILES`] to the Hopper files only ([`KernelFile::only_arch`]):
/// warpgroup products, tensor copies, mbarriers.
pub const HOPPER: &str = include_str!("../../cuda/hopper.cuh");

/// The CPU launch shim (for the emulation; never sent to NVRTC).
pub const CPU_SHIM: &str = include_str!("../../cuda/cpu_shim.h");

/// What one kernel may use on the device; the compile gate fails above it (and on any spill).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Budget {
    /// Kernel (`extern "C"`) name.
    pub kernel: &'static str,
    /// Registers per thread.
    pub max_registers: u32,
    /// Static shared memory per block, bytes (ptxas reports it).
    pub max_shared_bytes: u32,
    /// The most dynamic shared memory a launch asks for, bytes (the builders in [`ops`] never
    /// ask for more: [`Call::check`]). Above 48 KiB the backend raises the kernel's limit at
    /// load; the compile gate checks static + dynamic against each architecture's limit.
    pub dynamic_shared_bytes: u32,
    /// Threads per block of its launches (the compile gate's occupancy column).
    pub threads: u32,
    /// What the static gate asks of its SASS (every kernel: no local memory).
    pub sass: SassBudget,
    /// Blocks per SM its launch shape assumes (`__launch_bounds__`' minimum): the backend
    /// checks it with the occupancy API at load and logs a shortfall; the compile gate marks
    /// an architecture where registers and shared memory do not allow it.
    pub blocks_per_sm: u32,
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
    /// The one architecture it is built for (`sm_90a`: Hopper's instructions), or every one.
    pub only_arch: Option<&'static str>,
}

impl KernelFile {
    /// Whether it is built for `arch` (`sm_XY`, or `sm_90a`).
    pub fn builds_for(&self, arch: &str) -> bool {
        self.only_arch.is_none_or(|a| a == arch)
    }
}

const fn budget(kernel: &'static str, max_registers: u32, max_shared_bytes: u32) -> Budget {
    Budget {
        kernel,
        max_registers,
        max_shared_bytes,
        dynamic_shared_bytes: 0,
        threads: ELEMENTWISE_THREADS,
        sass: SassBudget::Plain,
        blocks_per_sm: 1,
    }
}

/// A tensor-core kernel: 128-thread blocks (or `threads`), dynamic shared memory, a
/// tensor-core loop the static gate must find (and reports).
const fn budget_dyn(kernel: &'static str, max_registers: u32, max_shared_bytes: u32, dynamic: u32) -> Budget {
    Budget {
        kernel,
        max_registers,
        max_shared_bytes,
        dynamic_shared_bytes: dynamic,
        threads: ops::FLASH_THREADS,
        sass: SassBudget::Reported,
        blocks_per_sm: 1,
    }
}

impl Budget {
    const fn threads(mut self, threads: u32) -> Self {
        self.threads = threads;
        self
    }

    const fn sass(mut self, sass: SassBudget) -> Self {
        self.sass = sass;
        self
    }

    const fn blocks(mut self, blocks_per_sm: u32) -> Self {
        self.blocks_per_sm = blocks_per_sm;
        self
    }
}

/// Shared memory a block may use (static + dynamic) on each architecture the compile gate
/// builds for: 163 KiB on sm_80 (A100), 227 KiB on sm_90 (H100, H200).
pub const SHARED_LIMITS: &[(&str, u32)] = &[("sm_80", 163 * 1024), ("sm_90a", 227 * 1024)];

/// The architecture NVRTC compiles for on a device of compute capability `(major, minor)`:
/// `sm_90a` on 9.0 (the architecture-specific target, which Hopper's warpgroup instructions
/// need and the compile gate builds), `sm_XY` elsewhere.
pub fn compile_arch((major, minor): (i32, i32)) -> String {
    if (major, minor) == (9, 0) {
        "sm_90a".to_string()
    } else {
        format!("sm_{major}{minor}")
    }
}

/// Dynamic shared memory a kernel may use without raising its limit.
pub const DEFAULT_DYNAMIC_SHARED_LIMIT: u32 = 48 * 1024;

/// The static gate's budget of the fast attention at d128: the steady-state loop (full key
/// tiles) has at most 4.5 instructions per tensor-core product (FlashAttention-2's loop: 3-4).
/// HMMA per `ldmatrix`: at least 2.6, not 4. Each K and V fragment feeds 4 products (32 rows
/// a warp), but Q is re-read from shared memory per tile (16 of the loop's 48 LDSM), as
/// FlashAttention-2 does at d128: kept in registers it needs 64 more of them, and spills (255
/// registers, 4 bytes; measured 1-5% slower on an H100, docs/gpu.md).
pub const FA2_D128_SASS: SassBudget = SassBudget::Loop { max_per_hmma: 4.5, min_hmma_per_ldsm: 2.6 };
/// The same at d64, where the softmax's share of the loop is twice as large per product; Q in
/// registers there (32 of them), so every LDSM of the loop is a K or V fragment feeding 4.
pub const FA2_D64_SASS: SassBudget = SassBudget::Loop { max_per_hmma: 5.5, min_hmma_per_ldsm: 4.0 };

/// Every kernel file. Budgets: elementwise kernels stay small (32 registers: full occupancy);
/// RMSNorm has a 33-float reduction buffer; the simple attention kernel holds 8 output floats
/// per lane and a 4 x 256 query tile (4 KiB) per block, and may use up to 64 registers. The
/// tensor-core kernels run 128 threads (`flash.cu` with `__launch_bounds__(128, 2)`, `flash2.cu`
/// with one block per SM promised), so ptxas may give them up to 255 registers; their budgets
/// leave room below that, and their shared memory is dynamic ([`ops::FlashKernel::shared_bytes`]).
pub const FILES: &[KernelFile] = &[
    KernelFile {
        name: "elementwise.cu",
        source: include_str!("../../cuda/elementwise.cu"),
        kernels: &[
            budget("fp_embedding_f32", 32, 0),
            budget("fp_embedding_bf16", 32, 0),
            budget("fp_embedding_f32_to_bf16", 32, 0),
            budget("fp_embedding_bf16_to_bf16", 32, 0),
            budget("fp_add_bias", 32, 0),
            budget("fp_add_bias_bf16", 32, 0),
            budget("fp_add_assign", 32, 0),
            budget("fp_add_assign_bf16", 32, 0),
            budget("fp_silu_mul", 32, 0),
            budget("fp_silu_mul_bf16", 32, 0),
            budget("fp_copy_columns", 32, 0),
            budget("fp_copy_columns_to_bf16", 32, 0),
            budget("fp_copy_columns_bf16", 32, 0),
            budget("fp_copy_columns_from_bf16", 32, 0),
            budget("fp_copy_rows", 32, 0),
            budget("fp_copy_rows_bf16", 32, 0),
            budget("fp_fill", 32, 0),
            budget("fp_f32_to_bf16", 32, 0),
            budget("fp_bf16_to_f32", 32, 0),
        ],
        only_arch: None,
    },
    KernelFile {
        name: "norm.cu",
        source: include_str!("../../cuda/norm.cu"),
        kernels: &[budget("fp_rms_norm", 32, 64), budget("fp_rms_norm_bf16", 40, 0).threads(32 * NORM_ROWS_PER_BLOCK)],
        only_arch: None,
    },
    KernelFile {
        name: "rope.cu",
        source: include_str!("../../cuda/rope.cu"),
        kernels: &[
            budget("fp_rope", 40, 0),
            budget("fp_rope_bf16", 40, 0),
            budget("fp_rope_copy", 40, 0),
            budget("fp_rope_copy_bf16", 40, 0),
            budget("fp_split_qkv_rope", 48, 0),
            budget("fp_split_qkv_rope_bf16", 48, 0),
            budget("fp_split_qkv_rope_act_bf16", 48, 0),
            budget("fp_split_qkv_rope_act_bf16_kv_f32", 48, 0),
        ],
        only_arch: None,
    },
    KernelFile {
        name: "attention.cu",
        source: include_str!("../../cuda/attention.cu"),
        kernels: &[
            budget("fp_attention", 64, 4096).threads(32 * ATTENTION_WARPS),
            budget("fp_attention_kvbf16", 64, 4096).threads(32 * ATTENTION_WARPS),
        ],
        only_arch: None,
    },
    KernelFile {
        name: "scores.cu",
        source: include_str!("../../cuda/scores.cu"),
        kernels: &[budget("fp_attention_scores", 40, 0), budget("fp_attention_scores_kbf16", 40, 0)],
        only_arch: None,
    },
    KernelFile {
        name: "merge.cu",
        source: include_str!("../../cuda/merge.cu"),
        kernels: &[budget("fp_merge_partial", 32, 0), budget("fp_attn_combine", 40, 0).threads(128)],
        only_arch: None,
    },
    KernelFile {
        name: "flash.cu",
        source: include_str!("../../cuda/flash.cu"),
        kernels: &[
            budget_dyn("fp_flash_attn_d64", 168, 16, ops::flash_shared_bytes(64)).blocks(2),
            budget_dyn("fp_flash_attn_d128", 240, 16, ops::flash_shared_bytes(128)).blocks(2),
        ],
        only_arch: None,
    },
    KernelFile {
        name: "flash_scores.cu",
        source: include_str!("../../cuda/flash_scores.cu"),
        kernels: &[
            budget_dyn("fp_flash_scores_d64", 168, 16, ops::flash_scores_shared_bytes(64)).blocks(2),
            budget_dyn("fp_flash_scores_d128", 168, 16, ops::flash_scores_shared_bytes(128)).blocks(2),
        ],
        only_arch: None,
    },
    KernelFile {
        name: "flash2.cu",
        source: include_str!("../../cuda/flash2.cu"),
        kernels: &[
            budget_dyn("fp_flash2_attn_d64", 255, 16, shapes::FA2_DEFAULT.d64.shared_bytes(64))
                .threads(shapes::FA2_DEFAULT.d64.threads())
                .blocks(shapes::FA2_DEFAULT.d64.min_blocks)
                .sass(FA2_D64_SASS),
            budget_dyn("fp_flash2_attn_d128", 248, 16, shapes::FA2_DEFAULT.d128.shared_bytes(128))
                .threads(shapes::FA2_DEFAULT.d128.threads())
                .blocks(shapes::FA2_DEFAULT.d128.min_blocks)
                .sass(FA2_D128_SASS),
        ],
        only_arch: None,
    },
    KernelFile {
        name: "probe.cu",
        source: include_str!("../../cuda/probe.cu"),
        kernels: &[budget_dyn("fp_probe_mma", 64, 0, ops::PROBE_SHARED_BYTES).threads(32).sass(SassBudget::Plain)],
        only_arch: None,
    },
    KernelFile {
        name: "hopper_probe.cu",
        source: include_str!("../../cuda/hopper_probe.cu"),
        kernels: &[
            hopper_probe_budget("fp_hopper_probe_w128"),
            hopper_probe_budget("fp_hopper_probe_w64"),
            hopper_probe_budget("fp_hopper_probe_w32"),
            hopper_probe_budget("fp_hopper_probe_w16"),
        ],
        only_arch: Some("sm_90a"),
    },
    KernelFile {
        name: "flash_hopper.cu",
        source: include_str!("../../cuda/flash_hopper.cu"),
        kernels: &[hopper_budget(0, 64), hopper_budget(0, 128)],
        only_arch: Some("sm_90a"),
    },
];

/// The budget of `flash_hopper.cu` at head dimension `d` (64 or 128) in configuration `config`
/// (an index of [`shapes::HOPPER_CONFIGS`]): every product of the loop a warpgroup instruction
/// (D/16 for S, 128/16 for P V), no local memory, and registers within what the `setmaxnreg`
/// plan starts from: the SM's 64K registers over the block's threads (168 at 384 threads), and
/// never above the consumers' 232 (an increase must not lower the count).
const fn hopper_budget(config: usize, d: u32) -> Budget {
    let s = shapes::HOPPER_CONFIGS[config];
    let regs = (65536 / s.threads(d)) & !7;
    let regs = if regs < 232 { regs } else { 232 };
    let name = shapes::HOPPER_KERNELS[config][if d == 64 { 0 } else { 1 }];
    budget_dyn(name, regs, 16, s.shared_bytes(d))
        .threads(s.threads(d))
        .sass(SassBudget::Wgmma { hgmma: d / 16 + shapes::HOPPER_KEYS / 16, in_loop: true })
}

/// The Hopper self-check: one warpgroup, 128 + 64 accumulators a thread, every product a
/// warpgroup instruction (12 HGMMA, no HMMA).
const fn hopper_probe_budget(kernel: &'static str) -> Budget {
    budget_dyn(kernel, 255, 16, ops::HOPPER_PROBE_SHARED_BYTES).sass(SassBudget::Wgmma { hgmma: 12, in_loop: false })
}

/// The budget of `kernel` (a configuration's kernel too, [`config_budgets`]).
pub fn budget_of(kernel: &str) -> Option<&'static Budget> {
    FILES.iter().flat_map(|f| f.kernels.iter()).chain(all_config_budgets()).find(|b| b.kernel == kernel)
}

/// The budgets of `flash2.cu`'s kernels in configuration `config` (an index of
/// [`shapes::FA2_CONFIGS`] other than 0, the default build's budgets being in [`FILES`]): the
/// compile gate builds each without a spill, a stack frame or local memory, within 255
/// registers, and finds its tensor-core loop (reported; the loop budget is the default's).
pub fn config_budgets(config: usize) -> Vec<Budget> {
    let Some(c) = shapes::FA2_CONFIGS.get(config).filter(|_| config > 0) else { return Vec::new() };
    [64u32, 128]
        .iter()
        .filter_map(|&d| {
            let s = c.at(d);
            Some(Budget {
                kernel: shapes::fa2_kernel(config, d)?,
                max_registers: 255,
                max_shared_bytes: 16,
                dynamic_shared_bytes: s.shared_bytes(d),
                threads: s.threads(),
                sass: SassBudget::Reported,
                blocks_per_sm: s.min_blocks,
            })
        })
        .collect()
}

/// The budgets of `flash_hopper.cu`'s kernels in configuration `config` (an index of
/// [`shapes::HOPPER_CONFIGS`] other than 0, whose budgets are in [`FILES`]), the same rules as
/// the default build's.
pub fn hopper_config_budgets(config: usize) -> Vec<Budget> {
    if config == 0 || config >= shapes::HOPPER_CONFIGS.len() {
        return Vec::new();
    }
    vec![hopper_budget(config, 64), hopper_budget(config, 128)]
}

fn all_config_budgets() -> &'static [Budget] {
    static ALL: OnceLock<Vec<Budget>> = OnceLock::new();
    ALL.get_or_init(|| {
        (1..shapes::FA2_CONFIGS.len())
            .flat_map(config_budgets)
            .chain((1..shapes::HOPPER_CONFIGS.len()).flat_map(hopper_config_budgets))
            .collect()
    })
}

/// Element type behind a kernel's pointer parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Elem {
    /// `float*`.
    F32,
    /// `bf16_t*` (raw bits).
    Bf16,
    /// `u32*`.
    U32,
    /// `double*`.
    F64,
    /// `u64*` (the tensor maps of the Hopper kernels, [`tma`]).
    U64,
}

/// One parameter of a kernel, as its `.cu` declaration has it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Param {
    /// A pointer to elements of this type.
    Ptr(Elem),
    /// `u32`.
    U32,
    /// `u64`.
    U64,
    /// `float`.
    F32,
}

impl Param {
    /// The code the emulator's C++ side uses for the same type (see `kernels-emu/src/emu.cpp`).
    pub fn code(self) -> i32 {
        match self {
            Param::Ptr(Elem::F32) => 1,
            Param::Ptr(Elem::Bf16) => 2,
            Param::Ptr(Elem::U32) => 3,
            Param::Ptr(Elem::F64) => 4,
            Param::Ptr(Elem::U64) => 8,
            Param::U32 => 5,
            Param::U64 => 6,
            Param::F32 => 7,
        }
    }
}

fn parse_param(text: &str) -> Result<Param, String> {
    let pointer = text.contains('*');
    let words: Vec<&str> = text
        .split(|c: char| c.is_whitespace() || c == '*')
        .filter(|w| !w.is_empty() && *w != "const" && *w != "__restrict__")
        .collect();
    // The type, then the parameter's name.
    let [ty, _name] = words.as_slice() else {
        return Err(format!("cannot read the parameter `{text}`"));
    };
    Ok(match (*ty, pointer) {
        ("float", true) => Param::Ptr(Elem::F32),
        ("bf16_t", true) => Param::Ptr(Elem::Bf16),
        ("u32", true) => Param::Ptr(Elem::U32),
        ("double", true) => Param::Ptr(Elem::F64),
        ("u64", true) => Param::Ptr(Elem::U64),
        ("u32", false) => Param::U32,
        ("u64", false) => Param::U64,
        ("float", false) => Param::F32,
        _ => return Err(format!("the parameter `{text}` has a type the launchers do not pass")),
    })
}

/// The `extern "C"` kernels of a source and their parameters, in declaration order.
pub fn parse_kernels(source: &str) -> Result<Vec<(String, Vec<Param>)>, String> {
    let mut out = Vec::new();
    let mut rest = source;
    while let Some(at) = rest.find("extern \"C\" __global__ void") {
        let mut s = rest[at + "extern \"C\" __global__ void".len()..].trim_start();
        if let Some(after) = s.strip_prefix("__launch_bounds__") {
            let close = after.find(')').ok_or("unclosed __launch_bounds__")?;
            s = after[close + 1..].trim_start();
        }
        let open = s.find('(').ok_or("a kernel without parameters")?;
        let name = s[..open].trim().to_string();
        let close = s.find(')').ok_or_else(|| format!("{name}: unclosed parameter list"))?;
        let params = s[open + 1..close]
            .split(',')
            .filter(|p| !p.trim().is_empty())
            .map(parse_param)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("{name}: {e}"))?;
        out.push((name, params));
        rest = &s[close..];
    }
    Ok(out)
}

/// Parameter lists of every kernel, read from the sources once.
fn signatures() -> &'static HashMap<String, Vec<Param>> {
    static SIGS: OnceLock<HashMap<String, Vec<Param>>> = OnceLock::new();
    SIGS.get_or_init(|| {
        let mut map = HashMap::new();
        for f in FILES {
            // The sources are part of the crate; a declaration this parser cannot read fails the
            // catalogue test, and its kernel then has no signature (every call of it is refused).
            if let Ok(kernels) = parse_kernels(f.source) {
                map.extend(kernels);
            }
        }
        map
    })
}

/// The parameters of `kernel`, as its `.cu` declares them.
/// A configuration's kernel (`fp_flash2_attn_d128_c2`) has its base kernel's parameters.
pub fn signature(kernel: &str) -> Option<&'static [Param]> {
    signatures().get(shapes::base_kernel(kernel)).map(Vec::as_slice)
}

/// A launch shape: grid and block in three dimensions, and the dynamic shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    /// Blocks along x, y, z.
    pub grid: [u32; 3],
    /// Threads along x, y, z.
    pub block: [u32; 3],
    /// Dynamic shared memory per block, bytes.
    pub shared_bytes: u32,
}

impl Launch {
    /// A grid `(x, y)` of one-dimensional blocks, no dynamic shared memory.
    pub const fn grid2(grid_x: u32, grid_y: u32, block: u32) -> Self {
        Self { grid: [grid_x, grid_y, 1], block: [block, 1, 1], shared_bytes: 0 }
    }

    /// Threads per block.
    pub fn threads(&self) -> u32 {
        self.block.iter().product()
    }
}

/// A device pointer (a CUDA device address; a host address in the emulator) with the type of
/// what it points at.
#[derive(Clone, Copy, Debug)]
pub struct Ptr {
    /// The address.
    pub addr: u64,
    /// What it points at.
    pub elem: Elem,
}

impl Ptr {
    /// `addr`, pointing at `elem`s.
    pub const fn new(addr: u64, elem: Elem) -> Self {
        Self { addr, elem }
    }

    /// The address `n` elements further on.
    pub const fn at(self, n: usize) -> Self {
        Self { addr: self.addr + (n * self.elem.bytes()) as u64, elem: self.elem }
    }
}

impl Elem {
    /// Bytes per element.
    pub const fn bytes(self) -> usize {
        match self {
            Elem::Bf16 => 2,
            Elem::F32 | Elem::U32 => 4,
            Elem::F64 | Elem::U64 => 8,
        }
    }
}

/// One argument of a launch.
#[derive(Clone, Copy, Debug)]
pub enum Arg {
    /// A buffer.
    Ptr(Ptr),
    /// `u32`.
    U32(u32),
    /// `u64`.
    U64(u64),
    /// `float`.
    F32(f32),
}

impl Arg {
    /// The parameter type this argument fills.
    pub fn param(&self) -> Param {
        match self {
            Arg::Ptr(p) => Param::Ptr(p.elem),
            Arg::U32(_) => Param::U32,
            Arg::U64(_) => Param::U64,
            Arg::F32(_) => Param::F32,
        }
    }

    /// The argument's bytes in an 8-byte cell (what `cuLaunchKernel` and the emulator read
    /// through a `void*` per argument; 4-byte values sit in the low half, little-endian).
    pub fn cell(&self) -> u64 {
        match *self {
            Arg::Ptr(p) => p.addr,
            Arg::U32(v) => v as u64,
            Arg::U64(v) => v,
            Arg::F32(v) => v.to_bits() as u64,
        }
    }
}

/// A kernel launch: which kernel, its shape, its arguments in declaration order.
#[derive(Clone, Debug)]
pub struct Call {
    /// Kernel name.
    pub kernel: &'static str,
    /// Grid, block, dynamic shared memory.
    pub launch: Launch,
    /// Arguments.
    pub args: Vec<Arg>,
}

impl Call {
    /// Checks the call against the kernel's declaration and budget: the number and the type of
    /// every argument (pointers by element type), a non-empty grid and block, and the dynamic
    /// shared memory within what the kernel is prepared for.
    pub fn check(&self) -> Result<(), String> {
        let k = self.kernel;
        let Some(params) = signature(k) else {
            return Err(format!("{k}: no such kernel in the sources"));
        };
        if params.len() != self.args.len() {
            return Err(format!("{k}: {} arguments for {} parameters", self.args.len(), params.len()));
        }
        for (i, (want, arg)) in params.iter().zip(&self.args).enumerate() {
            if arg.param() != *want {
                return Err(format!("{k}: argument {i} is {:?} where the kernel declares {want:?}", arg.param()));
            }
        }
        let l = &self.launch;
        if l.grid.contains(&0) || l.block.contains(&0) || l.threads() > 1024 {
            return Err(format!("{k}: grid {:?} x block {:?} is not a launch", l.grid, l.block));
        }
        let dynamic = budget_of(k).map_or(0, |b| b.dynamic_shared_bytes);
        if l.shared_bytes > dynamic {
            return Err(format!(
                "{k}: {} B of dynamic shared memory asked, the kernel is set up for {dynamic}",
                l.shared_bytes
            ));
        }
        Ok(())
    }
}

/// Threads per block of the element-wise and per-row kernels.
pub const ELEMENTWISE_THREADS: u32 = 256;
/// Blocks at most for a grid-stride loop (enough to fill any current GPU several times).
pub const MAX_STRIDE_BLOCKS: u64 = 4096;
pub use shapes::{ATTENTION_MAX_DIM, ATTENTION_WARPS, NORM_ROWS_PER_BLOCK, NORM_THREADS};

/// A grid-stride loop over `n` items.
pub fn stride_launch(n: u64) -> Launch {
    let blocks = n.div_ceil(ELEMENTWISE_THREADS as u64).clamp(1, MAX_STRIDE_BLOCKS) as u32;
    Launch::grid2(blocks, 1, ELEMENTWISE_THREADS)
}

/// RMSNorm of f32 rows: one block per row.
pub fn norm_launch(rows: u32) -> Launch {
    Launch::grid2(rows.max(1), 1, NORM_THREADS)
}

/// RMSNorm of bf16 rows: one warp per row, [`NORM_ROWS_PER_BLOCK`] rows per block.
pub fn norm_warp_launch(rows: u32) -> Launch {
    Launch::grid2(rows.div_ceil(NORM_ROWS_PER_BLOCK).max(1), 1, 32 * NORM_ROWS_PER_BLOCK)
}

/// Simple attention: one warp per query row and head.
pub fn attention_launch(rows: u32, n_heads: u32) -> Launch {
    Launch::grid2(rows.div_ceil(ATTENTION_WARPS).max(1), n_heads, 32 * ATTENTION_WARPS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_has_a_budget_a_signature_and_appears_in_its_source() {
        let mut names = std::collections::BTreeSet::new();
        for f in FILES {
            let declared = parse_kernels(f.source).unwrap_or_else(|e| panic!("{}: {e}", f.name));
            for b in f.kernels {
                assert!(declared.iter().any(|(n, _)| n == b.kernel), "{} not declared in {}", b.kernel, f.name);
                assert!(names.insert(b.kernel), "{} listed twice", b.kernel);
                assert!(signature(b.kernel).is_some(), "{}: no signature", b.kernel);
            }
            // Every extern "C" kernel of the file has a budget.
            for (name, _) in &declared {
                assert!(f.kernels.iter().any(|b| b.kernel == name), "{name} in {} has no budget", f.name);
            }
            // Every `__global__` of the file is one the parser read (none hides behind a form
            // the parser does not know).
            assert_eq!(f.source.matches("__global__").count(), declared.len(), "{}", f.name);
        }
        assert!(sources_hash() != 0);
        assert!(program(&FILES[0]).starts_with(&shapes::header(0)) && program(&FILES[0]).contains(COMMON));
    }

    #[test]
    fn hopper_compiles_for_its_architecture_specific_target() {
        assert_eq!(compile_arch((9, 0)), "sm_90a");
        assert_eq!(compile_arch((8, 0)), "sm_80");
        assert_eq!(compile_arch((8, 9)), "sm_89");
        assert_eq!(compile_arch((10, 0)), "sm_100");
    }

    #[test]
    fn every_cu_file_of_the_folder_is_in_the_catalogue() {
        // The emulator compiles every `.cu` of kernels/cuda (its build script lists the folder);
        // the backend and the compile gate take FILES: the two lists must be the same.
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("cuda");
        let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
            .expect("kernels/cuda")
            .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
            .filter(|n| n.ends_with(".cu"))
            .collect();
        on_disk.sort();
        let mut listed: Vec<String> = FILES.iter().map(|f| f.name.to_string()).collect();
        listed.sort();
        assert_eq!(on_disk, listed);
    }

    #[test]
    fn declarations_are_read_with_their_types() {
        let src = "extern \"C\" __global__ void __launch_bounds__(128, 2) k(const bf16_t* a, u32 n,\n \
                   float* __restrict__ o, u64 len, float s, const double* f, const u32* p) {}";
        let got = parse_kernels(src).unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].0, "k");
        use Param::*;
        assert_eq!(got[0].1, vec![Ptr(Elem::Bf16), U32, Ptr(Elem::F32), U64, F32, Ptr(Elem::F64), Ptr(Elem::U32)]);
        assert!(parse_kernels("extern \"C\" __global__ void k(int x) {}").is_err());
        assert_eq!(
            signature("fp_rms_norm").unwrap(),
            &[Ptr(Elem::F32), Ptr(Elem::F32), F32, Ptr(Elem::F32), U32, U32][..]
        );
    }

    #[test]
    fn calls_are_checked_against_the_declarations() {
        let p = |elem| Arg::Ptr(super::Ptr::new(0, elem));
        let good = Call {
            kernel: "fp_add_assign",
            launch: stride_launch(10),
            args: vec![p(Elem::F32), p(Elem::F32), Arg::U64(10)],
        };
        good.check().unwrap();
        let mut swapped = good.clone();
        swapped.args.swap(1, 2);
        assert!(swapped.check().unwrap_err().contains("argument 1"));
        let mut wrong_elem = good.clone();
        wrong_elem.args[0] = p(Elem::Bf16);
        assert!(wrong_elem.check().unwrap_err().contains("Bf16"));
        let mut short = good.clone();
        short.args.pop();
        assert!(short.check().is_err());
        let mut smem = good.clone();
        smem.launch.shared_bytes = 1024;
        assert!(smem.check().unwrap_err().contains("dynamic shared memory"));
        let mut empty = good;
        empty.launch.grid[1] = 0;
        assert!(empty.check().is_err());
        assert!(Call { kernel: "nope", launch: stride_launch(1), args: vec![] }.check().is_err());
    }

    #[test]
    fn launch_shapes_cover_their_work() {
        assert_eq!(stride_launch(1), Launch::grid2(1, 1, 256));
        assert_eq!(stride_launch(1000).grid[0], 4);
        assert_eq!(stride_launch(u64::MAX).grid[0] as u64, MAX_STRIDE_BLOCKS);
        assert_eq!(attention_launch(9, 14), Launch::grid2(3, 14, 128));
        assert_eq!(norm_launch(0).grid[0], 1);
    }

    #[test]
    fn dynamic_shared_memory_fits_every_architecture_it_is_built_for() {
        for f in FILES {
            for b in f.kernels {
                for &(arch, limit) in SHARED_LIMITS.iter().filter(|(a, _)| f.builds_for(a)) {
                    assert!(
                        b.max_shared_bytes + b.dynamic_shared_bytes <= limit,
                        "{} on {arch}: {} + {} B",
                        b.kernel,
                        b.max_shared_bytes,
                        b.dynamic_shared_bytes
                    );
                }
            }
        }
    }
}
