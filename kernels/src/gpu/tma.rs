//! Tensor maps: what Hopper's bulk tensor copy (TMA) needs to know of a tensor in global memory
//! to copy one box of it into shared memory. One description, [`TensorMap2d`], made by the op
//! builders and turned into 128 bytes two ways: by the CUDA driver (`cuTensorMapEncodeTiled`,
//! the backend, feature `cuda`) and by [`TensorMap2d::emulated`] for the CPU emulation, whose
//! launch shim reads the same fields back (`kernels/cuda/cpu_shim_hopper.h`). The kernels take
//! their maps from a buffer in global memory (`const u64*`, 16 words a map).

use crate::{KernelError, Result};

/// Words of one map in the kernels' map buffer (128 bytes, the driver's `CUtensorMap`).
pub const MAP_WORDS: usize = 16;

/// The emulation's marker in word 0 ("FPTM"): a map the shim can read.
pub const EMULATED_MAGIC: u32 = 0x4d54_5046;

/// How TMA lays a box's rows out in shared memory, and how wgmma's descriptors read them back
/// (`kernels/cuda/hopper.cuh`): the width in bytes of a row of the swizzle pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Swizzle {
    /// Rows as they are (16 bytes, 8 bf16: the interleaved core-matrix layout).
    None,
    /// 32-byte rows, chunk bit 4 XOR address bit 7.
    B32,
    /// 64-byte rows, chunk bits 4-5 XOR address bits 7-8.
    B64,
    /// 128-byte rows, chunk bits 4-6 XOR address bits 7-9.
    B128,
}

impl Swizzle {
    /// Every mode, widest first.
    pub const ALL: [Swizzle; 4] = [Swizzle::B128, Swizzle::B64, Swizzle::B32, Swizzle::None];

    /// The width W of a box's row in bytes (16 without swizzle): the kernels' template argument.
    pub const fn width(self) -> u32 {
        match self {
            Swizzle::None => 16,
            Swizzle::B32 => 32,
            Swizzle::B64 => 64,
            Swizzle::B128 => 128,
        }
    }

    /// The driver's `CUtensorMapSwizzle` value (0 none, 1 32B, 2 64B, 3 128B).
    pub const fn driver_code(self) -> u32 {
        match self {
            Swizzle::None => 0,
            Swizzle::B32 => 1,
            Swizzle::B64 => 2,
            Swizzle::B128 => 3,
        }
    }
}

/// A 2-D tensor of bf16 in global memory and the box one copy brings: dimension 0 is the
/// contiguous one (elements of a row), dimension 1 the rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorMap2d {
    /// Device address of element (0, 0) (a host address in the emulation); 16-byte aligned.
    pub base: u64,
    /// Elements per row (dimension 0) and rows (dimension 1).
    pub dims: [u64; 2],
    /// Bytes from one row to the next: a multiple of 16.
    pub row_bytes: u64,
    /// The box: elements of a row (its width must be the swizzle's row, [`Swizzle::width`]) and
    /// rows (1 to 256).
    pub boxed: [u32; 2],
    /// The shared-memory layout of the box.
    pub swizzle: Swizzle,
}

/// Bytes of one element (bf16).
const ELEM_BYTES: u32 = 2;

impl TensorMap2d {
    /// A map of the bf16 tensor at `base` (`rows` rows of `cols` elements, `row_bytes` apart)
    /// whose boxes are `box_rows` rows of one swizzle row each; checked against the driver's
    /// rules (which `cuTensorMapEncodeTiled` would refuse with a bare error code).
    pub fn bf16(base: u64, cols: u64, rows: u64, row_bytes: u64, box_rows: u32, swizzle: Swizzle) -> Result<Self> {
        let map =
            Self { base, dims: [cols, rows], row_bytes, boxed: [swizzle.width() / ELEM_BYTES, box_rows], swizzle };
        map.check()?;
        Ok(map)
    }

    fn check(&self) -> Result<()> {
        let bad = |detail: String| Err(KernelError::Shape { op: "tensor map", detail });
        if !self.base.is_multiple_of(16) {
            return bad(format!("base {:#x} is not 16-byte aligned", self.base));
        }
        if self.dims.iter().any(|&d| d == 0 || d > 1 << 32) {
            return bad(format!("dimensions {:?}: each must be 1 to 2^32", self.dims));
        }
        if !self.row_bytes.is_multiple_of(16)
            || self.row_bytes < self.dims[0] * ELEM_BYTES as u64
            || self.row_bytes >= 1 << 40
        {
            return bad(format!(
                "row stride {} B: a multiple of 16, at least a row ({} B), below 2^40",
                self.row_bytes,
                self.dims[0] * ELEM_BYTES as u64
            ));
        }
        if self.boxed[0] * ELEM_BYTES != self.swizzle.width() || !(1..=256).contains(&self.boxed[1]) {
            return bad(format!(
                "box {:?}: a row of the swizzle ({} B) by 1 to 256 rows",
                self.boxed,
                self.swizzle.width()
            ));
        }
        Ok(())
    }

    /// Bytes one copy of the box brings (what its mbarrier's expect_tx must announce).
    pub fn box_bytes(&self) -> u32 {
        self.boxed[0] * self.boxed[1] * ELEM_BYTES
    }

    /// The 128 bytes the CPU emulation reads (`cpu_shim_hopper.h`, `fp_tma_load_2d`): word 0
    /// the marker and the element size, 1 the swizzle width (0 none) and the box's row, 2 its
    /// rows, 3 the base, 4-5 the dimensions, 6 the row stride in bytes.
    pub fn emulated(&self) -> [u64; MAP_WORDS] {
        let mut w = [0u64; MAP_WORDS];
        let swizzle = if self.swizzle == Swizzle::None { 0 } else { self.swizzle.width() };
        w[0] = EMULATED_MAGIC as u64 | (ELEM_BYTES as u64) << 32;
        w[1] = swizzle as u64 | (self.boxed[0] as u64) << 32;
        w[2] = self.boxed[1] as u64;
        w[3] = self.base;
        w[4] = self.dims[0];
        w[5] = self.dims[1];
        w[6] = self.row_bytes;
        w
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_follow_the_drivers_rules_and_say_what_to_change() {
        let ok = TensorMap2d::bf16(0x1000, 64, 128, 128, 128, Swizzle::B128).unwrap();
        assert_eq!(ok.boxed, [64, 128]);
        assert_eq!(ok.box_bytes(), 16384);
        let w = ok.emulated();
        assert_eq!((w[0] as u32, (w[0] >> 32) as u32, w[1] as u32, (w[1] >> 32) as u32), (EMULATED_MAGIC, 2, 128, 64));
        assert_eq!((w[2], w[3], w[4], w[5], w[6]), (128, 0x1000, 64, 128, 128));
        assert_eq!(TensorMap2d::bf16(0, 64, 8, 128, 8, Swizzle::None).unwrap().boxed, [8, 8]);
        for (bad, what) in [
            (TensorMap2d::bf16(0x1008, 64, 128, 128, 64, Swizzle::B128), "aligned"),
            (TensorMap2d::bf16(0x1000, 64, 128, 120, 64, Swizzle::B128), "row stride"),
            (TensorMap2d::bf16(0x1000, 64, 128, 128, 257, Swizzle::B64), "box"),
            (TensorMap2d::bf16(0x1000, 0, 128, 128, 64, Swizzle::B32), "dimensions"),
        ] {
            let e = bad.expect_err(what).to_string();
            assert!(e.contains(what), "{e}");
        }
    }
}
