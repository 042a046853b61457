//! Which tensor-core attention kernel runs ([`FlashKernel`]: flash2 in a configuration, the
//! reference, the Hopper kernel in a configuration) and the launch shape each has.

use crate::gpu::shapes;
use shapes::HOPPER_KEYS;

/// Packed query rows per block of the reference tensor-core kernel (`flash.cu`): 4 warps x 16.
pub const FLASH_ROWS: u32 = shapes::REF_ROWS;
/// Keys per tile of `flash.cu`, and of the key metadata every tensor-core kernel reads
/// ([`super::key_meta`]).
pub const FLASH_KEYS: u32 = shapes::META_KEYS;
/// Threads per block of `flash.cu` and of the scores kernel.
pub const FLASH_THREADS: u32 = shapes::REF_THREADS;

/// Which tensor-core attention kernel runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FlashKernel {
    /// `flash2.cu`: FlashAttention-2's structure (32 rows a warp, immediate shared addresses,
    /// unrolled copies, no mask on full tiles), in configuration `.0` (an index of
    /// [`shapes::FA2_CONFIGS`]; 0, the default build, unless the autotuner chose another).
    Fa2(u8),
    /// `flash.cu`: the first tensor-core kernel (16 rows a warp), kept as the reference.
    Reference,
    /// `flash_hopper.cu` (compute capability 9.0 only): warpgroup products, TMA copies, a
    /// producer warpgroup ([`super::hopper_attention`]: it takes tensor maps), in configuration `.0`
    /// (an index of [`shapes::HOPPER_CONFIGS`]; 0 the default build).
    Hopper(u8),
}

impl Default for FlashKernel {
    fn default() -> Self {
        FlashKernel::Fa2(0)
    }
}

impl FlashKernel {
    /// Every kernel (flash2 in its default configuration), the default first.
    pub const ALL: [FlashKernel; 3] = [FlashKernel::Fa2(0), FlashKernel::Reference, FlashKernel::Hopper(0)];

    /// Every configuration of flash2, the reference, then every configuration of the Hopper
    /// kernel (what the emulation tests run).
    pub fn every() -> Vec<FlashKernel> {
        (0..shapes::FA2_CONFIGS.len() as u8)
            .map(FlashKernel::Fa2)
            .chain([FlashKernel::Reference])
            .chain((0..shapes::HOPPER_CONFIGS.len() as u8).map(FlashKernel::Hopper))
            .collect()
    }

    /// The Hopper kernel's shape (`None` for the others).
    pub const fn hopper_shape(self) -> Option<shapes::HopperShape> {
        match self {
            FlashKernel::Hopper(c) => {
                let c = c as usize;
                let c = if c < shapes::HOPPER_CONFIGS.len() { c } else { 0 };
                Some(shapes::HOPPER_CONFIGS[c])
            }
            _ => None,
        }
    }

    /// Whether this is the Hopper kernel (any configuration).
    pub const fn is_hopper(self) -> bool {
        matches!(self, FlashKernel::Hopper(_))
    }

    /// Whether this is a persistent configuration of the Hopper kernel
    /// ([`shapes::HopperShape::persistent`]: a one-dimensional grid of at most a block per SM).
    pub const fn is_persistent(self) -> bool {
        match self.hopper_shape() {
            Some(h) => h.persistent,
            None => false,
        }
    }

    /// flash2's shape at head dimension `d` (`None` for the reference).
    pub const fn fa2_shape(self, d: u32) -> Option<shapes::Fa2Shape> {
        match self {
            FlashKernel::Fa2(c) => {
                let c = c as usize;
                let c = if c < shapes::FA2_CONFIGS.len() { c } else { 0 };
                Some(shapes::FA2_CONFIGS[c].at(d))
            }
            FlashKernel::Reference | FlashKernel::Hopper(_) => None,
        }
    }

    /// Packed query rows per block at head dimension `d`.
    pub const fn rows(self, d: u32) -> u32 {
        match (self.fa2_shape(d), self.hopper_shape()) {
            (Some(s), _) => s.rows(),
            (None, Some(h)) => h.rows(d),
            (None, None) => FLASH_ROWS,
        }
    }

    /// Threads per block at head dimension `d`.
    pub const fn threads(self, d: u32) -> u32 {
        match (self.fa2_shape(d), self.hopper_shape()) {
            (Some(s), _) => s.threads(),
            (None, Some(h)) => h.threads(d),
            (None, None) => FLASH_THREADS,
        }
    }

    /// Keys per tile at head dimension `d`.
    pub const fn keys(self, d: u32) -> u32 {
        match (self.fa2_shape(d), self.hopper_shape()) {
            (Some(s), _) => s.keys,
            (None, Some(_)) => HOPPER_KEYS,
            (None, None) => FLASH_KEYS,
        }
    }

    /// Dynamic shared memory at head dimension `d`: the query tile and two stages of key and
    /// value tiles, rows padded by 16 bytes (the 8 rows an `ldmatrix` reads fall in 8 different
    /// bank groups), and two stages of key positions.
    /// The Hopper kernel: unpadded (swizzled) tiles, 1024 bytes to align them, its mbarriers.
    pub const fn shared_bytes(self, d: u32) -> u32 {
        match self.hopper_shape() {
            Some(h) => h.shared_bytes(d),
            None => (self.rows(d) + 4 * self.keys(d)) * (d + 8) * 2 + 2 * self.keys(d) * 4,
        }
    }

    /// The kernel's name at head dimension `d` (64 or 128).
    pub fn kernel(self, d: u32) -> Option<&'static str> {
        match (self, d) {
            (FlashKernel::Fa2(c), _) => shapes::fa2_kernel(c as usize, d),
            (FlashKernel::Reference, 64) => Some("fp_flash_attn_d64"),
            (FlashKernel::Reference, 128) => Some("fp_flash_attn_d128"),
            (FlashKernel::Hopper(c), _) => shapes::hopper_kernel(c as usize, d),
            _ => None,
        }
    }

    /// The name `FLOWPREFILL_FLASH_KERNEL` and the benches use (`fa2`, `fa2:c2`, `reference`).
    pub fn name(self) -> String {
        match self {
            FlashKernel::Fa2(0) => "fa2".into(),
            FlashKernel::Fa2(c) => format!("fa2:c{c}"),
            FlashKernel::Reference => "reference".into(),
            FlashKernel::Hopper(0) => "hopper".into(),
            FlashKernel::Hopper(c) => format!("hopper:c{c}"),
        }
    }
}

impl std::str::FromStr for FlashKernel {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        FlashKernel::every().into_iter().find(|k| k.name() == s).ok_or_else(|| {
            format!(
                "unknown tensor-core attention kernel {s:?}: use fa2 (flash2's default configuration; unset \
                 the variable for the one `flowprefill tune` chose), fa2:c1 .. fa2:c{} (one configuration), reference, hopper or \
                 hopper:c1 .. hopper:c{} (compute capability 9.0)",
                shapes::FA2_CONFIGS.len() - 1,
                shapes::HOPPER_CONFIGS.len() - 1
            )
        })
    }
}
