//! The launches of the Hopper files (sm_90a): their tensor maps ([`super::super::tma`]) and
//! calls.

use super::{expect, ptr, split_destinations, then_combine, tile_ranges, with_dims, AttnDims, FlashPlan};
use crate::error::{KernelError, Result};
pub use crate::gpu::tma::Swizzle;
use crate::gpu::tma::TensorMap2d;
use crate::gpu::{shapes, Arg, Call, Elem, Launch, Ptr};

pub use crate::gpu::shapes::HOPPER_KEYS;

/// Dynamic shared memory of the Hopper self-check (`hopper_probe.cu`): A [64][64] and two B
/// tiles of 64 x 128 (bf16), the mbarrier, and 1024 bytes to align the tiles to the swizzle
/// atom.
pub const HOPPER_PROBE_SHARED_BYTES: u32 = 64 * 64 * 2 + 2 * 64 * 128 * 2 + 16 + 1024;

/// The self-check's deliberate mistakes (`FP_PROBE_BREAK_*` of `hopper_probe.cu`), for the
/// emulation tests that must catch each.
pub mod probe_break {
    /// No `wgmma.fence` before the first product.
    pub const FENCE: u32 = 1;
    /// Descriptors of another swizzle width than the tensor maps'.
    pub const SWIZZLE: u32 = 2;
    /// The wait on the copies' mbarrier names the other phase parity.
    pub const PHASE: u32 = 4;
    /// Accumulators read without `wgmma.wait_group`.
    pub const WAIT: u32 = 8;
    /// The copies issued without `arrive.expect_tx`: their barrier's phase never completes (a
    /// deadlock: for the emulation only, a GPU would hang).
    pub const ARRIVE: u32 = 16;
    /// Thread 0 skips the `__syncthreads` after the barrier's init: the others can never pass
    /// it (a deadlock: for the emulation only).
    pub const SYNC: u32 = 32;
}

/// The self-check's kernel for a swizzle mode.
pub fn hopper_probe_kernel(swizzle: Swizzle) -> &'static str {
    match swizzle {
        Swizzle::B128 => "fp_hopper_probe_w128",
        Swizzle::B64 => "fp_hopper_probe_w64",
        Swizzle::B32 => "fp_hopper_probe_w32",
        Swizzle::None => "fp_hopper_probe_w16",
    }
}

/// The self-check's three tensor maps, in the order of its map buffer: bf16 `a [64][64]`,
/// `b_nk [128][64]` (B K-major) and `b_kn [64][128]` (B MN-major), boxes of one swizzle row by
/// the tile's rows.
pub fn hopper_probe_maps(a: Ptr, b_nk: Ptr, b_kn: Ptr, swizzle: Swizzle) -> Result<[TensorMap2d; 3]> {
    for (what, p) in [("a", a), ("b_nk", b_nk), ("b_kn", b_kn)] {
        expect("hopper_probe", what, p, Elem::Bf16)?;
    }
    Ok([
        TensorMap2d::bf16(a.addr, 64, 64, 128, 64, swizzle)?,
        TensorMap2d::bf16(b_nk.addr, 64, 128, 128, 128, swizzle)?,
        TensorMap2d::bf16(b_kn.addr, 128, 64, 256, 64, swizzle)?,
    ])
}

/// The self-check: one warpgroup, `maps` (3 x 16 words, [`hopper_probe_maps`] encoded for the
/// device or the emulation), bf16 `a [64][64]` row-major (A's register fragments), f32
/// `d_ss` and `d_rs [64][128]` get A B twice; `breaks`: [`probe_break`] flags (0 in use).
pub fn hopper_probe(swizzle: Swizzle, maps: Ptr, a: Ptr, d_ss: Ptr, d_rs: Ptr, breaks: u32) -> Result<Call> {
    expect("hopper_probe", "maps", maps, Elem::U64)?;
    expect("hopper_probe", "a", a, Elem::Bf16)?;
    expect("hopper_probe", "d_ss", d_ss, Elem::F32)?;
    expect("hopper_probe", "d_rs", d_rs, Elem::F32)?;
    Ok(Call {
        kernel: hopper_probe_kernel(swizzle),
        launch: Launch { grid: [1, 1, 1], block: [128, 1, 1], shared_bytes: HOPPER_PROBE_SHARED_BYTES },
        args: vec![ptr(maps), ptr(a), ptr(d_ss), ptr(d_rs), Arg::U32(breaks)],
    })
}

/// The Hopper attention's two tensor maps, K then V (`[n, n_kv_heads, d]` bf16 at `k`, `v`):
/// rows of `n_kv_heads x d` elements, boxes of 64 elements (one head's 64 dimensions) by
/// [`HOPPER_KEYS`] keys, 128-byte swizzle. `None` without keys (the kernel copies nothing).
pub fn hopper_attention_maps(dims: AttnDims, k: Ptr, v: Ptr) -> Result<Option<[TensorMap2d; 2]>> {
    expect("hopper_attention", "k", k, Elem::Bf16)?;
    expect("hopper_attention", "v", v, Elem::Bf16)?;
    if dims.n == 0 {
        return Ok(None);
    }
    let cols = dims.n_kv_heads as u64 * dims.head_dim as u64;
    let map = |base: u64| TensorMap2d::bf16(base, cols, dims.n as u64, cols * 2, HOPPER_KEYS, Swizzle::B128);
    Ok(Some([map(k.addr)?, map(v.addr)?]))
}

/// [`super::flash_attention`] by `flash_hopper.cu`: `maps` holds [`hopper_attention_maps`]
/// encoded for the device or the emulation (any `u64` pointer without keys); the rest as there.
#[allow(clippy::too_many_arguments)]
pub fn hopper_attention(
    dims: AttnDims,
    plan: &FlashPlan,
    maps: Ptr,
    q: Ptr,
    qpos: Ptr,
    kmeta: Ptr,
    out: Ptr,
    lse: Ptr,
    partial: Option<(Ptr, Ptr)>,
    scale: f32,
) -> Result<Vec<Call>> {
    let op = "hopper_attention";
    expect(op, "maps", maps, Elem::U64)?;
    expect(op, "q", q, Elem::Bf16)?;
    let d = dims;
    let (Some(kernel), true) = (plan.kernel.kernel(d.head_dim), plan.kernel.is_hopper()) else {
        return Err(KernelError::Shape {
            op,
            detail: format!("a plan for {:?} at head_dim {} (the kernel takes 64 or 128)", plan.kernel, d.head_dim),
        });
    };
    if !plan.tiles_per_split.is_multiple_of(HOPPER_KEYS / shapes::META_KEYS) {
        return Err(KernelError::Shape { op, detail: format!("{plan:?}: splits not cut on the kernel's tiles") });
    }
    let (dst_out, dst_out_b, dst_lse) = split_destinations(op, plan, (out, lse), partial)?;
    let (lo, hi) = tile_ranges(kmeta, d.n);
    let call = Call {
        kernel,
        launch: Launch {
            // A persistent configuration's blocks walk the items (the kernel derives them).
            grid: if plan.kernel.is_persistent() {
                [plan.blocks, 1, 1]
            } else {
                [plan.q_tiles, d.n_kv_heads, plan.splits]
            },
            block: [plan.kernel.threads(d.head_dim), 1, 1],
            shared_bytes: plan.kernel.shared_bytes(d.head_dim),
        },
        args: with_dims(
            &[ptr(maps), ptr(q), ptr(qpos), ptr(kmeta), ptr(lo), ptr(hi), ptr(dst_out), ptr(dst_out_b), ptr(dst_lse)],
            d,
            &[Arg::F32(scale * std::f32::consts::LOG2_E), Arg::U32(plan.tiles_per_split)],
        ),
    };
    then_combine(call, d, plan, (dst_out, dst_lse), (out, lse))
}
