//! The kernels' launch shapes, written once. The `.cu` files define none of them:
//! [`header`] writes them as `#define`s, which [`super::program`] puts before every source
//! NVRTC compiles and the emulator's build script (`kernels-emu/build.rs`, which includes this
//! very file) puts before the sources it compiles as C++; the launch builders in
//! [`super::ops`] read the same constants. A second copy of a number in a `.cu` file or in
//! `ops.rs` is therefore not possible.
//!
//! `flash2.cu` comes in configurations ([`FA2_CONFIGS`]): the default build is configuration
//! 0; the others are built on demand under suffixed kernel names (`fp_flash2_attn_d128_c2`) for
//! the autotuner, which times them on the GPU it finds. Every configuration is compiled by the
//! compile gate (no spill, no local memory) and run by the emulation tests.
//!
//! This file has no dependency, not even on the rest of the crate.

/// Packed query rows per block of the reference tensor-core kernel (`flash.cu`): 4 warps x 16.
pub const REF_ROWS: u32 = 64;
/// Keys per tile of `flash.cu`, and of the key metadata every tensor-core kernel reads (the
/// smallest and largest position per tile of this many keys).
pub const META_KEYS: u32 = 64;
/// Threads per block of `flash.cu` and of the tensor-core scores kernel.
pub const REF_THREADS: u32 = 128;
/// Threads per block of RMSNorm over f32 rows (`norm.cu`, one block per row).
pub const NORM_THREADS: u32 = 256;
/// Rows (one warp each) per block of RMSNorm over bf16 rows.
pub const NORM_ROWS_PER_BLOCK: u32 = 4;
/// Query rows (warps) per block of the simple attention kernel (`attention.cu`).
pub const ATTENTION_WARPS: u32 = 4;
/// Largest head dimension of the simple attention kernel.
pub const ATTENTION_MAX_DIM: usize = 256;
/// How far (log2 units) `flash2.cu` lets a row's maximum rise before it rescales O and l.
pub const FA2_RESCALE_LOG2: u32 = 8;
/// Blocks per SM the key splits aim at without the autotuner's decision.
pub const DEFAULT_BLOCKS_PER_SM: u32 = 2;

/// One configuration of `flash2.cu` at one head dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Fa2Shape {
    /// Warps per block.
    pub warps: u32,
    /// m16 row tiles per warp (2: FlashAttention-2's 32 rows a warp).
    pub wm: u32,
    /// Keys per tile (at most [`META_KEYS`], a divisor of it).
    pub keys: u32,
    /// Q's fragments kept in registers (else re-read from shared memory per tile).
    pub q_in_regs: bool,
    /// Blocks per SM promised to ptxas (`__launch_bounds__`), which the backend checks with
    /// the occupancy API at load.
    pub min_blocks: u32,
}

impl Fa2Shape {
    /// Packed query rows per block.
    pub const fn rows(self) -> u32 {
        self.warps * 16 * self.wm
    }

    /// Threads per block.
    pub const fn threads(self) -> u32 {
        self.warps * 32
    }

    /// Dynamic shared memory at head dimension `d`: the query tile and two stages of key and
    /// value tiles (rows padded by 16 bytes: the 8 rows an `ldmatrix` reads fall in 8 bank
    /// groups), and two stages of key positions.
    pub const fn shared_bytes(self, d: u32) -> u32 {
        (self.rows() + 4 * self.keys) * (d + 8) * 2 + 2 * self.keys * 4
    }
}

/// One build of `flash2.cu`: a shape per head dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Fa2Config {
    /// At head dimension 64.
    pub d64: Fa2Shape,
    /// At head dimension 128.
    pub d128: Fa2Shape,
}

impl Fa2Config {
    /// The shape at head dimension `d` (64 or 128; anything else reads as 128).
    pub const fn at(self, d: u32) -> Fa2Shape {
        if d == 64 {
            self.d64
        } else {
            self.d128
        }
    }
}

const fn shape(warps: u32, wm: u32, keys: u32, q_in_regs: bool) -> Fa2Shape {
    Fa2Shape { warps, wm, keys, q_in_regs, min_blocks: 1 }
}

/// The configurations of `flash2.cu`; 0 is the default build. Measured on an H100
/// (2026-11-25, docs/gpu.md): 4 warps x 32 rows at both dimensions; 64 keys at d64, 32 at d128
/// (64 spill there). The others, each within 255 registers without a spill: 8 warps (256-row
/// blocks), Q re-read at d64, and 16 rows a warp with Q in registers (64 or 128 rows: more
/// blocks per SM, each K/V fragment feeding two products instead of four).
pub const FA2_CONFIGS: [Fa2Config; 4] = [
    Fa2Config { d64: shape(4, 2, 64, true), d128: shape(4, 2, 32, false) },
    Fa2Config { d64: shape(4, 2, 64, false), d128: shape(8, 2, 32, false) },
    Fa2Config { d64: shape(8, 2, 64, true), d128: shape(4, 1, 64, true) },
    Fa2Config { d64: shape(4, 1, 64, true), d128: shape(8, 1, 64, true) },
];

/// The default configuration.
pub const FA2_DEFAULT: Fa2Config = FA2_CONFIGS[0];

/// `flash2.cu`'s kernel names per configuration and head dimension: the default build's plain
/// names, the others suffixed `_c<index>` ([`header`] renames them).
pub const FA2_KERNELS: [[&str; 2]; 4] = [
    ["fp_flash2_attn_d64", "fp_flash2_attn_d128"],
    ["fp_flash2_attn_d64_c1", "fp_flash2_attn_d128_c1"],
    ["fp_flash2_attn_d64_c2", "fp_flash2_attn_d128_c2"],
    ["fp_flash2_attn_d64_c3", "fp_flash2_attn_d128_c3"],
];

/// The kernel of configuration `config` at head dimension `d` (64 or 128).
pub fn fa2_kernel(config: usize, d: u32) -> Option<&'static str> {
    name_at(&FA2_KERNELS, config, d)
}

/// The name in a table of kernel names per configuration and head dimension (64, 128).
fn name_at(table: &[[&'static str; 2]], config: usize, d: u32) -> Option<&'static str> {
    let names = table.get(config)?;
    match d {
        64 => Some(names[0]),
        128 => Some(names[1]),
        _ => None,
    }
}

/// Keys per tile of `flash_hopper.cu` (two metadata tiles): one wgmma of n128 for S.
pub const HOPPER_KEYS: u32 = 128;

/// One configuration of `flash_hopper.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HopperShape {
    /// Consumer warpgroups of 64 packed rows each (1 to 3) at head dimension 64; one producer
    /// warpgroup beside them.
    pub consumers_d64: u32,
    /// The same at head dimension 128 (1 or 2: three would leave a consumer 160 registers,
    /// fewer than d128's accumulators, scores and P need).
    pub consumers_d128: u32,
    /// K and V tiles in flight.
    pub stages: u32,
    /// The two consumer warpgroups take turns at the tensor pipe (FlashAttention-3's
    /// ping-pong; two consumers only).
    pub pingpong: bool,
    /// Of every 16 score columns of 8 keys, how many take their exp2 from a polynomial on the
    /// FMA pipe instead of the special-function unit (0 .. 16; `fp_exp2_poly`).
    pub poly: u32,
    /// At most a block per SM, each walking work items (a query tile of a KV head and key
    /// split, the longest first): the next item's copies overlap this one's last products and
    /// its output, and no block waits to start behind another's epilogue.
    pub persistent: bool,
}

impl HopperShape {
    /// Consumer warpgroups at head dimension `d` (64 or 128).
    pub const fn consumers_at(self, d: u32) -> u32 {
        if d == 64 {
            self.consumers_d64
        } else {
            self.consumers_d128
        }
    }

    /// Packed query rows per block at head dimension `d`.
    pub const fn rows(self, d: u32) -> u32 {
        64 * self.consumers_at(d)
    }

    /// Threads per block at head dimension `d`: the consumers' warpgroups and the producer's.
    pub const fn threads(self, d: u32) -> u32 {
        128 * (self.consumers_at(d) + 1)
    }

    /// Dynamic shared memory at head dimension `d`: the query tile, the K and V stages
    /// (swizzled, unpadded), 1024 bytes to align them to the swizzle atom, per stage its two
    /// barriers and the producer's word (which tile it holds).
    pub const fn shared_bytes(self, d: u32) -> u32 {
        self.rows(d) * d * 2 + 2 * self.stages * HOPPER_KEYS * d * 2 + 1024 + 20 * self.stages
    }
}

/// The configurations of `flash_hopper.cu`; 0 is the default build (the one the self-check
/// and `FLOWPREFILL_FLASH_KERNEL=hopper` run). The others are the autotuner's: ping-pong off
/// (each warpgroup overlaps its own softmax with its P V only), two stages, one consumer
/// warpgroup (64-row blocks: half the idle rows of calls with few packed rows, such as the
/// probe's and the final prompt's over a long context, with key splits; three stages at d128
/// fit beside its smaller query tile), the default with a quarter or an eighth of the
/// exponentials on the FMA pipe (per 32 scores a warp's special-function unit needs 8 clocks
/// and its issue about 4.5 instructions; a polynomial exp2 costs about 8 more instructions, so
/// the two balance near a fifth), and at d64 three consumer warpgroups (192-row blocks,
/// FlashAttention-3's shape for d64: three consumer warps per SM sub-partition to hide each
/// other's softmax, where two did 1.5x one on an H200; at d128 it is configuration 1's shape),
/// and the default as a persistent kernel (a block per SM at most, walking the work items).
/// Which wins is the autotuner's to say; the last four were not yet on a GPU.
pub const HOPPER_CONFIGS: [HopperShape; 8] = [
    HopperShape { consumers_d64: 2, consumers_d128: 2, stages: 3, pingpong: true, poly: 0, persistent: false },
    HopperShape { consumers_d64: 2, consumers_d128: 2, stages: 3, pingpong: false, poly: 0, persistent: false },
    HopperShape { consumers_d64: 2, consumers_d128: 2, stages: 2, pingpong: true, poly: 0, persistent: false },
    HopperShape { consumers_d64: 1, consumers_d128: 1, stages: 3, pingpong: false, poly: 0, persistent: false },
    HopperShape { consumers_d64: 2, consumers_d128: 2, stages: 3, pingpong: true, poly: 4, persistent: false },
    HopperShape { consumers_d64: 2, consumers_d128: 2, stages: 3, pingpong: true, poly: 2, persistent: false },
    HopperShape { consumers_d64: 3, consumers_d128: 2, stages: 3, pingpong: false, poly: 0, persistent: false },
    HopperShape { consumers_d64: 2, consumers_d128: 2, stages: 3, pingpong: true, poly: 0, persistent: true },
];

/// `flash_hopper.cu`'s kernel names per configuration and head dimension (as [`FA2_KERNELS`]).
pub const HOPPER_KERNELS: [[&str; 2]; 8] = [
    ["fp_flash_hopper_d64", "fp_flash_hopper_d128"],
    ["fp_flash_hopper_d64_c1", "fp_flash_hopper_d128_c1"],
    ["fp_flash_hopper_d64_c2", "fp_flash_hopper_d128_c2"],
    ["fp_flash_hopper_d64_c3", "fp_flash_hopper_d128_c3"],
    ["fp_flash_hopper_d64_c4", "fp_flash_hopper_d128_c4"],
    ["fp_flash_hopper_d64_c5", "fp_flash_hopper_d128_c5"],
    ["fp_flash_hopper_d64_c6", "fp_flash_hopper_d128_c6"],
    ["fp_flash_hopper_d64_c7", "fp_flash_hopper_d128_c7"],
];

/// The Hopper kernel of configuration `config` at head dimension `d` (64 or 128).
pub fn hopper_kernel(config: usize, d: u32) -> Option<&'static str> {
    name_at(&HOPPER_KERNELS, config, d)
}

/// Builds of the configurable files: build `c` is `flash2.cu` in [`FA2_CONFIGS`]`[c]` and
/// `flash_hopper.cu` in [`HOPPER_CONFIGS`]`[c]` ([`header`]).
pub const BUILDS: usize =
    if FA2_CONFIGS.len() > HOPPER_CONFIGS.len() { FA2_CONFIGS.len() } else { HOPPER_CONFIGS.len() };

/// The base name of a kernel (a configuration's suffix removed).
pub fn base_kernel(name: &str) -> &str {
    match name.rsplit_once("_c") {
        Some((base, n))
            if (base.starts_with("fp_flash2_attn_d") || base.starts_with("fp_flash_hopper_d"))
                && n.parse::<usize>().is_ok() =>
        {
            base
        }
        _ => name,
    }
}

/// The `#define`s of every launch shape, with `flash2.cu` in configuration `config` (an index
/// of [`FA2_CONFIGS`]) and `flash_hopper.cu` in its configuration `config` ([`HOPPER_CONFIGS`]);
/// other than 0, their kernels renamed `_c<config>`.
pub fn header(config: usize) -> String {
    let c = FA2_CONFIGS[config.min(FA2_CONFIGS.len() - 1)];
    let hc = config.min(HOPPER_CONFIGS.len() - 1);
    let hs = HOPPER_CONFIGS[hc];
    let mut h = String::from("// Launch shapes: written by flowprefill_kernels::gpu::shapes::header.\n");
    let mut def = |name: &str, value: String| {
        h.push_str(&format!("#define {name} {value}\n"));
    };
    def("FP_NORM_THREADS", NORM_THREADS.to_string());
    def("FP_NORM_WARP_ROWS", NORM_ROWS_PER_BLOCK.to_string());
    def("FP_ATT_WARPS", ATTENTION_WARPS.to_string());
    def("FP_ATT_MAX_DIM", ATTENTION_MAX_DIM.to_string());
    def("FP_FA_ROWS", REF_ROWS.to_string());
    def("FP_FA_KEYS", META_KEYS.to_string());
    def("FP_FA_THREADS", REF_THREADS.to_string());
    def("FP_FA2_META_KEYS", META_KEYS.to_string());
    def("FP_FA2_RESCALE", format!("{}.0f", FA2_RESCALE_LOG2));
    for (d, s) in [(64, c.d64), (128, c.d128)] {
        def(&format!("FP_FA2_D{d}_WARPS"), s.warps.to_string());
        def(&format!("FP_FA2_D{d}_WM"), s.wm.to_string());
        def(&format!("FP_FA2_D{d}_KEYS"), s.keys.to_string());
        def(&format!("FP_FA2_D{d}_QREGS"), u32::from(s.q_in_regs).to_string());
        def(&format!("FP_FA2_D{d}_MINB"), s.min_blocks.to_string());
    }
    def("FP_FH_CONSUMERS_D64", hs.consumers_at(64).to_string());
    def("FP_FH_CONSUMERS_D128", hs.consumers_at(128).to_string());
    def("FP_FH_STAGES", hs.stages.to_string());
    def("FP_FH_PINGPONG", u32::from(hs.pingpong).to_string());
    def("FP_FH_POLY", hs.poly.to_string());
    def("FP_FH_PERSISTENT", u32::from(hs.persistent).to_string());
    def("FP_FH_KEYS", HOPPER_KEYS.to_string());
    def("FP_FH_THREADS_D64", hs.threads(64).to_string());
    def("FP_FH_THREADS_D128", hs.threads(128).to_string());
    if config != 0 {
        for (d, name) in [(64, 0), (128, 1)] {
            def(&format!("fp_flash2_attn_d{d}"), FA2_KERNELS[config.min(FA2_KERNELS.len() - 1)][name].to_string());
            def(&format!("fp_flash_hopper_d{d}"), HOPPER_KERNELS[hc][name].to_string());
        }
    }
    h
}
