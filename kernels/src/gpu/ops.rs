//! One builder per op: the op's device pointers and sizes in, a checked-shape [`Call`] out.
//! The CUDA backend and the CPU emulator both launch what these return, so the order of a
//! kernel's arguments is decided here once (and checked against the `.cu` declaration by
//! [`Call::check`]). Lengths of buffers are the callers' business: these builders see only
//! addresses.

mod hopper;
mod kernel;

pub use hopper::{
    hopper_attention, hopper_attention_maps, hopper_probe, hopper_probe_kernel, hopper_probe_maps, probe_break,
    Swizzle, HOPPER_KEYS, HOPPER_PROBE_SHARED_BYTES,
};

pub use kernel::{FlashKernel, FLASH_KEYS, FLASH_ROWS, FLASH_THREADS};

use super::{stride_launch, Arg, Call, Elem, Launch, Ptr};
use crate::error::{KernelError, Result};

pub(crate) fn ptr(p: Ptr) -> Arg {
    Arg::Ptr(p)
}

fn dtype_err(op: &'static str, detail: String) -> KernelError {
    KernelError::Dtype { op, detail }
}

/// `p` must point at `elem`s.
pub(crate) fn expect(op: &'static str, what: &str, p: Ptr, elem: Elem) -> Result<()> {
    if p.elem == elem {
        Ok(())
    } else {
        Err(dtype_err(op, format!("{what} holds {:?} values, this operation takes {elem:?}", p.elem)))
    }
}

/// An attention output as the attention kernels take it, `(out, out_b)`: an f32 output as the
/// first with a null bf16 pointer, a bf16 output (the bf16 forward's, rounded once by the
/// kernel) as the second with a null f32 pointer (`fp_st_out2` in `common.cuh`).
pub(crate) fn out_pair(op: &'static str, out: Ptr) -> Result<(Ptr, Ptr)> {
    match out.elem {
        Elem::F32 => Ok((out, Ptr::new(0, Elem::Bf16))),
        Elem::Bf16 => Ok((Ptr::new(0, Elem::F32), out)),
        e => Err(dtype_err(op, format!("out holds {e:?} values; the attention writes f32 or bf16"))),
    }
}

/// `out[r] = table[ids[r]]` for an f32 or bf16 table into f32 or bf16 activations.
pub fn embedding(table: Ptr, ids: Ptr, out: Ptr, n: u32, cols: u32) -> Result<Call> {
    let op = "embedding";
    let kernel = match (table.elem, out.elem) {
        (Elem::F32, Elem::F32) => "fp_embedding_f32",
        (Elem::Bf16, Elem::F32) => "fp_embedding_bf16",
        (Elem::F32, Elem::Bf16) => "fp_embedding_f32_to_bf16",
        (Elem::Bf16, Elem::Bf16) => "fp_embedding_bf16_to_bf16",
        (t, o) => return Err(dtype_err(op, format!("a table of {t:?} into {o:?}"))),
    };
    let launch = stride_launch(n as u64 * cols as u64);
    Ok(Call { kernel, launch, args: vec![ptr(table), ptr(ids), ptr(out), Arg::U32(n), Arg::U32(cols)] })
}

/// The kernel of an op that takes f32 or bf16 activations (`f32_kernel`, `bf16_kernel`).
fn by_act(
    op: &'static str,
    what: &str,
    p: Ptr,
    f32_kernel: &'static str,
    bf16_kernel: &'static str,
) -> Result<&'static str> {
    match p.elem {
        Elem::F32 => Ok(f32_kernel),
        Elem::Bf16 => Ok(bf16_kernel),
        e => Err(dtype_err(op, format!("{what} holds {e:?} values, this operation takes f32 or bf16"))),
    }
}

/// `x[r, c] += bias[c]` over `n` values (x f32 or bf16, the bias f32).
pub fn add_bias(x: Ptr, bias: Ptr, n: u64, cols: u32) -> Result<Call> {
    expect("add_bias", "bias", bias, Elem::F32)?;
    Ok(Call {
        kernel: by_act("add_bias", "x", x, "fp_add_bias", "fp_add_bias_bf16")?,
        launch: stride_launch(n),
        args: vec![ptr(x), ptr(bias), Arg::U64(n), Arg::U32(cols)],
    })
}

/// `x += y` over `n` values (the same type, f32 or bf16).
pub fn add_assign(x: Ptr, y: Ptr, n: u64) -> Result<Call> {
    expect("add_assign", "y", y, x.elem)?;
    let kernel = by_act("add_assign", "x", x, "fp_add_assign", "fp_add_assign_bf16")?;
    Ok(Call { kernel, launch: stride_launch(n), args: vec![ptr(x), ptr(y), Arg::U64(n)] })
}

/// `out = silu(gate) * up` of `[gate | up]` rows (both f32 or both bf16).
pub fn silu_mul(gate_up: Ptr, out: Ptr, rows: u64, ffn: u32) -> Result<Call> {
    expect("silu_mul", "out", out, gate_up.elem)?;
    Ok(Call {
        kernel: by_act("silu_mul", "gate_up", gate_up, "fp_silu_mul", "fp_silu_mul_bf16")?,
        launch: stride_launch(rows * ffn as u64),
        args: vec![ptr(gate_up), ptr(out), Arg::U64(rows), Arg::U32(ffn)],
    })
}

/// Columns `[col, col + width)` of `[rows, src_cols]` into `dst`, converting between f32 and
/// bf16 when their types differ (how projections land in a KV cache of another type); the
/// same type is a copy.
pub fn copy_columns(src: Ptr, src_cols: u32, col: u32, width: u32, dst: Ptr, rows: u64) -> Result<Call> {
    let kernel = match (src.elem, dst.elem) {
        (Elem::F32, Elem::F32) => "fp_copy_columns",
        (Elem::F32, Elem::Bf16) => "fp_copy_columns_to_bf16",
        (Elem::Bf16, Elem::Bf16) => "fp_copy_columns_bf16",
        (Elem::Bf16, Elem::F32) => "fp_copy_columns_from_bf16",
        (s, d) => return Err(dtype_err("copy_columns", format!("from {s:?} into {d:?}"))),
    };
    Ok(Call {
        kernel,
        launch: stride_launch(rows * width as u64),
        args: vec![ptr(src), Arg::U32(src_cols), Arg::U32(col), Arg::U32(width), ptr(dst), Arg::U64(rows)],
    })
}

/// Row `src_rows[i]` of `src` to row `dst_rows[i]` of `dst` (the same element type).
pub fn copy_rows(src: Ptr, src_rows: Ptr, dst: Ptr, dst_rows: Ptr, n: u32, row_len: u32) -> Result<Call> {
    let kernel = match (src.elem, dst.elem) {
        (Elem::F32, Elem::F32) => "fp_copy_rows",
        (Elem::Bf16, Elem::Bf16) => "fp_copy_rows_bf16",
        (s, d) => return Err(dtype_err("copy_rows", format!("from {s:?} into {d:?}"))),
    };
    Ok(Call {
        kernel,
        launch: stride_launch(n as u64 * row_len as u64),
        args: vec![ptr(src), ptr(src_rows), ptr(dst), ptr(dst_rows), Arg::U32(n), Arg::U32(row_len)],
    })
}

/// Every element of an f32 buffer set to `v`.
pub fn fill(x: Ptr, v: f32, n: u64) -> Result<Call> {
    expect("fill", "x", x, Elem::F32)?;
    Ok(Call { kernel: "fp_fill", launch: stride_launch(n), args: vec![ptr(x), Arg::F32(v), Arg::U64(n)] })
}

/// f32 to bf16 (round to nearest even), or bf16 to f32, by the types of `x` and `y`.
pub fn convert(x: Ptr, y: Ptr, n: u64) -> Result<Call> {
    let kernel = match (x.elem, y.elem) {
        (Elem::F32, Elem::Bf16) => "fp_f32_to_bf16",
        (Elem::Bf16, Elem::F32) => "fp_bf16_to_f32",
        (s, d) => return Err(dtype_err("convert", format!("from {s:?} to {d:?}"))),
    };
    Ok(Call { kernel, launch: stride_launch(n), args: vec![ptr(x), ptr(y), Arg::U64(n)] })
}

/// RMSNorm of `rows` rows of `cols` (x and out both f32, or both bf16; the weight f32).
pub fn rms_norm(x: Ptr, w: Ptr, eps: f32, out: Ptr, rows: u32, cols: u32) -> Result<Call> {
    expect("rms_norm", "w", w, Elem::F32)?;
    expect("rms_norm", "out", out, x.elem)?;
    let (kernel, launch) = match x.elem {
        Elem::F32 => ("fp_rms_norm", super::norm_launch(rows)),
        Elem::Bf16 => ("fp_rms_norm_bf16", super::norm_warp_launch(rows)),
        e => return Err(dtype_err("rms_norm", format!("x holds {e:?} values"))),
    };
    Ok(Call { kernel, launch, args: vec![ptr(x), ptr(w), Arg::F32(eps), ptr(out), Arg::U32(rows), Arg::U32(cols)] })
}

/// The device side of a RoPE table.
#[derive(Clone, Copy, Debug)]
pub struct RopeArgs {
    /// Cosines, `[table_len, rot_dim / 2]`.
    pub cos: Ptr,
    /// Sines, likewise.
    pub sin: Ptr,
    /// Rows of the tables: past every position of the call (`RopeTable::rows_for`); the
    /// kernels compute no angle.
    pub table_len: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// Rotated dimensions.
    pub rot_dim: u32,
    /// Interleaved pairs (GPT-J style) rather than halves (NeoX).
    pub interleaved: bool,
}

/// The arguments every RoPE kernel ends with: sizes, positions and the table.
fn rope_tail(positions: Ptr, t: &RopeArgs) -> [Arg; 7] {
    [
        Arg::U32(t.head_dim),
        Arg::U32(t.rot_dim),
        Arg::U32(u32::from(t.interleaved)),
        ptr(positions),
        ptr(t.cos),
        ptr(t.sin),
        Arg::U32(t.table_len),
    ]
}

/// RoPE in place over `[tokens, n_heads, head_dim]` (f32, or bf16 rounded once after the
/// rotation), token t at `positions[t]`.
pub fn rope(x: Ptr, tokens: u32, n_heads: u32, positions: Ptr, t: &RopeArgs) -> Result<Call> {
    let kernel = match x.elem {
        Elem::F32 => "fp_rope",
        Elem::Bf16 => "fp_rope_bf16",
        e => return Err(dtype_err("rope", format!("x holds {e:?}"))),
    };
    let pairs = tokens as u64 * n_heads as u64 * (t.rot_dim / 2) as u64;
    Ok(Call {
        kernel,
        launch: stride_launch(pairs),
        args: [ptr(x), Arg::U32(tokens), Arg::U32(n_heads)].into_iter().chain(rope_tail(positions, t)).collect(),
    })
}

/// `dst = rope(src)` at `positions` (out of place, the same element type; dimensions past
/// `rot_dim` copied): one pass that places a pre-RoPE cache.
pub fn rope_copy(src: Ptr, dst: Ptr, tokens: u32, n_heads: u32, positions: Ptr, t: &RopeArgs) -> Result<Call> {
    let kernel = match (src.elem, dst.elem) {
        (Elem::F32, Elem::F32) => "fp_rope_copy",
        (Elem::Bf16, Elem::Bf16) => "fp_rope_copy_bf16",
        (s, d) => return Err(dtype_err("rope_copy", format!("from {s:?} into {d:?}"))),
    };
    let per = (t.rot_dim / 2 + (t.head_dim - t.rot_dim.min(t.head_dim))) as u64;
    Ok(Call {
        kernel,
        launch: stride_launch(tokens as u64 * n_heads as u64 * per),
        args: [ptr(src), ptr(dst), Arg::U32(tokens), Arg::U32(n_heads)]
            .into_iter()
            .chain(rope_tail(positions, t))
            .collect(),
    })
}

/// The buffers of [`split_qkv_rope`]: the projection in, the four parts out.
#[derive(Clone, Copy, Debug)]
pub struct QkvParts {
    /// `[rows, q_dim + 2 kv_dim]`, the activations' type (f32 or bf16).
    pub qkv: Ptr,
    /// `[rows, q_dim]`, the activations' type, rotated.
    pub q: Ptr,
    /// `[rows, kv_dim]`, the cache type, as projected.
    pub k_pre: Ptr,
    /// `[rows, kv_dim]`, the cache type, rotated.
    pub k: Ptr,
    /// `[rows, kv_dim]`, the cache type.
    pub v: Ptr,
}

/// Splits a QKV projection into rotated queries, pre-RoPE and rotated keys and values in one
/// launch (see `rope.cu`). Q shares the projection's element type; K, pre-RoPE K and V share
/// the cache's.
pub fn split_qkv_rope(
    b: QkvParts,
    rows: u32,
    n_heads: u32,
    n_kv_heads: u32,
    positions: Ptr,
    t: &RopeArgs,
) -> Result<Call> {
    let op = "split_qkv_rope";
    expect(op, "q", b.q, b.qkv.elem)?;
    expect(op, "k", b.k, b.k_pre.elem)?;
    expect(op, "v", b.v, b.k_pre.elem)?;
    let kernel = match (b.qkv.elem, b.k_pre.elem) {
        (Elem::F32, Elem::F32) => "fp_split_qkv_rope",
        (Elem::F32, Elem::Bf16) => "fp_split_qkv_rope_bf16",
        (Elem::Bf16, Elem::Bf16) => "fp_split_qkv_rope_act_bf16",
        (Elem::Bf16, Elem::F32) => "fp_split_qkv_rope_act_bf16_kv_f32",
        (a, kv) => return Err(dtype_err(op, format!("activations of {a:?} and keys of {kv:?}"))),
    };
    let per = (t.rot_dim / 2 + (t.head_dim - t.rot_dim.min(t.head_dim))) as u64;
    let per_row = (n_heads as u64 + n_kv_heads as u64) * per + n_kv_heads as u64 * t.head_dim as u64;
    Ok(Call {
        kernel,
        launch: stride_launch(rows as u64 * per_row),
        args: [
            ptr(b.qkv),
            ptr(b.q),
            ptr(b.k_pre),
            ptr(b.k),
            ptr(b.v),
            Arg::U32(rows),
            Arg::U32(n_heads),
            Arg::U32(n_kv_heads),
        ]
        .into_iter()
        .chain(rope_tail(positions, t))
        .collect(),
    })
}

/// `before`, then the sizes `m, n, n_heads, n_kv_heads`, then `after`: the arguments of every
/// attention kernel.
pub(crate) fn with_dims(before: &[Arg], d: AttnDims, after: &[Arg]) -> Vec<Arg> {
    before.iter().copied().chain(d.args()).chain(after.iter().copied()).collect()
}

/// Sizes of one attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnDims {
    /// Query rows.
    pub m: u32,
    /// Keys.
    pub n: u32,
    /// Query heads.
    pub n_heads: u32,
    /// KV heads.
    pub n_kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
}

impl AttnDims {
    /// The sizes of `m` queries over `n` keys with `shape`'s heads.
    pub fn of(shape: &crate::attention::AttnShape, m: usize, n: usize) -> Self {
        AttnDims {
            m: m as u32,
            n: n as u32,
            n_heads: shape.n_heads as u32,
            n_kv_heads: shape.n_kv_heads as u32,
            head_dim: shape.head_dim as u32,
        }
    }

    /// The arguments `m, n, n_heads, n_kv_heads` every attention kernel takes in this order.
    fn args(&self) -> [Arg; 4] {
        [Arg::U32(self.m), Arg::U32(self.n), Arg::U32(self.n_heads), Arg::U32(self.n_kv_heads)]
    }

    /// Query heads per KV head.
    pub fn group(&self) -> u32 {
        self.n_heads / self.n_kv_heads.max(1)
    }
}

/// The simple attention kernel (FP32 cores, a warp per query row and head): f32 queries,
/// f32 or bf16 keys and values, any head dimension up to [`super::ATTENTION_MAX_DIM`]; an f32
/// or bf16 `out` ([`out_pair`]).
#[allow(clippy::too_many_arguments)]
pub fn attention(
    dims: AttnDims,
    q: Ptr,
    qpos: Ptr,
    k: Ptr,
    v: Ptr,
    kpos: Ptr,
    out: Ptr,
    lse: Ptr,
    scale: f32,
) -> Result<Call> {
    let op = "attention";
    expect(op, "q", q, Elem::F32)?;
    expect(op, "v", v, k.elem)?;
    let kernel = match k.elem {
        Elem::F32 => "fp_attention",
        Elem::Bf16 => "fp_attention_kvbf16",
        e => return Err(dtype_err(op, format!("keys of {e:?}"))),
    };
    let (out, out_b) = out_pair(op, out)?;
    let d = dims;
    Ok(Call {
        kernel,
        launch: super::attention_launch(d.m, d.n_heads),
        args: with_dims(
            &[ptr(q), ptr(qpos), ptr(k), ptr(v), ptr(kpos), ptr(out), ptr(out_b), ptr(lse)],
            d,
            &[Arg::U32(d.head_dim), Arg::F32(scale)],
        ),
    })
}

/// The simple per-key attention mass kernel (a thread per key): f32 queries, f32 or bf16 keys.
#[allow(clippy::too_many_arguments)]
pub fn attention_scores(
    dims: AttnDims,
    q: Ptr,
    qpos: Ptr,
    k: Ptr,
    kpos: Ptr,
    lse: Ptr,
    scores: Ptr,
    scale: f32,
) -> Result<Call> {
    let op = "attention_scores";
    expect(op, "q", q, Elem::F32)?;
    let kernel = match k.elem {
        Elem::F32 => "fp_attention_scores",
        Elem::Bf16 => "fp_attention_scores_kbf16",
        e => return Err(dtype_err(op, format!("keys of {e:?}"))),
    };
    let d = dims;
    Ok(Call {
        kernel,
        launch: stride_launch(d.n as u64),
        args: with_dims(
            &[ptr(q), ptr(qpos), ptr(k), ptr(kpos), ptr(lse), ptr(scores)],
            d,
            &[Arg::U32(d.head_dim), Arg::F32(scale)],
        ),
    })
}

/// `(out, lse) <- merge((out, lse), (block_out, block_lse))`, `rows` rows of `head_dim`.
pub fn merge_partial(out: Ptr, lse: Ptr, block_out: Ptr, block_lse: Ptr, rows: u32, head_dim: u32) -> Result<Call> {
    expect("merge_partial", "out", out, Elem::F32)?;
    Ok(Call {
        kernel: "fp_merge_partial",
        launch: stride_launch(rows as u64),
        args: vec![ptr(out), ptr(lse), ptr(block_out), ptr(block_lse), Arg::U32(rows), Arg::U32(head_dim)],
    })
}

// ---------------------------------------------------------------------------------------
// Tensor-core attention (flash.cu)
// ---------------------------------------------------------------------------------------

/// Whether the tensor-core kernels take this head dimension.
pub fn flash_supported(head_dim: usize) -> bool {
    head_dim == 64 || head_dim == 128
}

/// Dynamic shared memory of the reference attention kernel (`flash.cu`) at head dimension `d`.
pub const fn flash_shared_bytes(d: u32) -> u32 {
    FlashKernel::Reference.shared_bytes(d)
}

/// Dynamic shared memory of the scores kernel: a query tile, a key tile, key positions and
/// the warps' column sums.
pub const fn flash_scores_shared_bytes(d: u32) -> u32 {
    (FLASH_ROWS + FLASH_KEYS) * (d + 8) * 2 + FLASH_KEYS * 4 + 4 * FLASH_KEYS * 4
}

/// How a tensor-core attention call is cut into blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlashPlan {
    /// The kernel the plan is cut for.
    pub kernel: FlashKernel,
    /// Tiles of the kernel's packed rows (query x head of a KV group) per KV head.
    pub q_tiles: u32,
    /// Tiles of [`FLASH_KEYS`] keys.
    pub key_tiles: u32,
    /// Key splits (flash-decoding): > 1 when too few blocks would fill the GPU; each split
    /// writes a partial output and log-sum-exp, merged by [`attn_combine`].
    pub splits: u32,
    /// Key tiles (of [`FLASH_KEYS`], the metadata's tiles) per split.
    pub tiles_per_split: u32,
    /// Blocks of the launch: a block per query tile, KV head and split (`q_tiles x n_kv_heads x
    /// splits`), or for a persistent kernel ([`super::shapes::HopperShape::persistent`]) as many work
    /// items but at most one block per SM, each walking every `blocks`-th item.
    pub blocks: u32,
}

/// Splits keys over more blocks when `q_tiles x n_kv_heads` blocks would leave SMs idle:
/// aims at two blocks per SM (`sm_count`), at least one key tile per split. `force_splits`
/// (tests) sets the number of splits instead.
pub fn flash_plan(dims: AttnDims, kernel: FlashKernel, sm_count: u32, force_splits: Option<u32>) -> FlashPlan {
    flash_plan_aiming(dims, kernel, sm_count, super::shapes::DEFAULT_BLOCKS_PER_SM, force_splits)
}

/// [`flash_plan`] aiming at `blocks_per_sm` blocks per SM (the autotuner's choice for
/// decode-like calls; 2 without one).
pub fn flash_plan_aiming(
    dims: AttnDims,
    kernel: FlashKernel,
    sm_count: u32,
    blocks_per_sm: u32,
    force_splits: Option<u32>,
) -> FlashPlan {
    let packed = dims.m as u64 * dims.group() as u64;
    let q_tiles = packed.div_ceil(kernel.rows(dims.head_dim) as u64).max(1) as u32;
    let key_tiles = dims.n.div_ceil(FLASH_KEYS);
    let blocks = q_tiles as u64 * dims.n_kv_heads.max(1) as u64;
    let target = blocks_per_sm.max(1) as u64 * sm_count.max(1) as u64;
    let wanted = match force_splits {
        Some(s) => s.max(1),
        None if blocks >= target => 1,
        None => target.div_ceil(blocks) as u32,
    };
    let wanted = wanted.clamp(1, key_tiles.max(1));
    // The Hopper kernel's tiles hold several metadata tiles: splits are cut on its tiles.
    let unit = if kernel.is_hopper() { HOPPER_KEYS / FLASH_KEYS } else { 1 };
    let tiles_per_split = key_tiles.div_ceil(wanted).max(1).next_multiple_of(unit);
    let splits = key_tiles.div_ceil(tiles_per_split).max(1);
    let items = q_tiles as u64 * dims.n_kv_heads.max(1) as u64 * splits as u64;
    let blocks = if kernel.is_persistent() { items.min(sm_count.max(1) as u64) } else { items };
    FlashPlan { kernel, q_tiles, key_tiles, splits, tiles_per_split, blocks: blocks.min(u32::MAX as u64) as u32 }
}

/// The key metadata the tensor-core kernels read, in one buffer: positions `[n]`, then the
/// smallest and the largest position of each tile of [`FLASH_KEYS`] keys. A block skips a key
/// tile whose smallest position is above all of its queries' positions, and masks only the
/// tiles where some key is above some query's position.
pub fn key_meta(kpos: &[u32]) -> Vec<u32> {
    let tiles = kpos.len().div_ceil(FLASH_KEYS as usize);
    let mut meta = Vec::with_capacity(kpos.len() + 2 * tiles);
    meta.extend_from_slice(kpos);
    let chunks = || kpos.chunks(FLASH_KEYS as usize);
    meta.extend(chunks().map(|c| c.iter().copied().min().unwrap_or(u32::MAX)));
    meta.extend(chunks().map(|c| c.iter().copied().max().unwrap_or(0)));
    meta
}

/// Lengths (f32 values) of the partial output and log-sum-exp buffers a plan with key splits
/// needs: `splits x m x n_heads x head_dim` and `splits x m x n_heads`; `(0, 0)` without splits.
pub fn flash_partial_lens(dims: AttnDims, plan: &FlashPlan) -> (usize, usize) {
    if plan.splits <= 1 {
        return (0, 0);
    }
    let rows = plan.splits as usize * dims.m as usize * dims.n_heads as usize;
    (rows * dims.head_dim as usize, rows)
}

/// The tensor-core attention: bf16 `q [m, n_heads, d]`, `k`, `v [n, n_kv_heads, d]`, positions
/// `qpos` and key metadata `kmeta` ([`key_meta`]); f32 or bf16 `out [m, n_heads, d]`
/// ([`out_pair`]) and natural-log f32 `lse [m, n_heads]`. One launch, or with `plan.splits > 1`
/// two: the splits into `partial` (buffers of [`flash_partial_lens`]), then [`attn_combine`]
/// into `(out, lse)`.
#[allow(clippy::too_many_arguments)]
pub fn flash_attention(
    dims: AttnDims,
    plan: &FlashPlan,
    q: Ptr,
    qpos: Ptr,
    k: Ptr,
    v: Ptr,
    kmeta: Ptr,
    out: Ptr,
    lse: Ptr,
    partial: Option<(Ptr, Ptr)>,
    scale: f32,
) -> Result<Vec<Call>> {
    let op = "flash_attention";
    for (what, p, e) in [("q", q, Elem::Bf16), ("k", k, Elem::Bf16), ("v", v, Elem::Bf16)] {
        expect(op, what, p, e)?;
    }
    if plan.kernel.is_hopper() {
        return Err(KernelError::Shape {
            op,
            detail: "the Hopper kernel takes tensor maps: ops::hopper_attention".into(),
        });
    }
    let Some(kernel) = plan.kernel.kernel(dims.head_dim) else {
        let d = dims.head_dim;
        return Err(KernelError::Shape { op, detail: format!("head_dim {d}: the kernel takes 64 or 128") });
    };
    let (dst_out, dst_out_b, dst_lse) = split_destinations(op, plan, (out, lse), partial)?;
    let (lo, hi) = tile_ranges(kmeta, dims.n);
    let d = dims;
    let call = Call {
        kernel,
        launch: Launch {
            grid: [plan.q_tiles, d.n_kv_heads, plan.splits],
            block: [plan.kernel.threads(d.head_dim), 1, 1],
            shared_bytes: plan.kernel.shared_bytes(d.head_dim),
        },
        args: with_dims(
            &[
                ptr(q),
                ptr(qpos),
                ptr(k),
                ptr(v),
                ptr(kmeta),
                ptr(lo),
                ptr(hi),
                ptr(dst_out),
                ptr(dst_out_b),
                ptr(dst_lse),
            ],
            d,
            &[Arg::F32(scale * std::f32::consts::LOG2_E), Arg::U32(plan.tiles_per_split)],
        ),
    };
    then_combine(call, d, plan, (dst_out, dst_lse), (out, lse))
}

/// Where an attention launch by `plan` writes: `(out, out_b, lse)` ([`out_pair`]), or with key
/// splits the partial buffers (f32; an error without them).
pub(crate) fn split_destinations(
    op: &'static str,
    plan: &FlashPlan,
    (out, lse): (Ptr, Ptr),
    partial: Option<(Ptr, Ptr)>,
) -> Result<(Ptr, Ptr, Ptr)> {
    let (out, out_b) = out_pair(op, out)?;
    match (plan.splits > 1, partial) {
        (false, _) => Ok((out, out_b, lse)),
        (true, Some((po, pl))) => {
            expect(op, "the partial output", po, Elem::F32)?;
            Ok((po, Ptr::new(0, Elem::Bf16), pl))
        }
        (true, None) => {
            Err(KernelError::Shape { op, detail: format!("{} key splits need partial buffers", plan.splits) })
        }
    }
}

/// `call`, then with key splits the combine of its partial results (`dst`: the partial output
/// and log-sum-exp) into `(out, lse)`.
pub(crate) fn then_combine(
    call: Call,
    d: AttnDims,
    plan: &FlashPlan,
    dst: (Ptr, Ptr),
    (out, lse): (Ptr, Ptr),
) -> Result<Vec<Call>> {
    let mut calls = vec![call];
    if plan.splits > 1 {
        calls.push(attn_combine(dst.0, dst.1, out, lse, d.m * d.n_heads, d.head_dim, plan.splits)?);
    }
    Ok(calls)
}

/// Pointers to the tile minima and maxima inside a [`key_meta`] buffer of `n` keys.
pub(crate) fn tile_ranges(kmeta: Ptr, n: u32) -> (Ptr, Ptr) {
    let tiles = n.div_ceil(FLASH_KEYS) as u64;
    let lo = Ptr::new(kmeta.addr + 4 * n as u64, Elem::U32);
    (lo, Ptr::new(lo.addr + 4 * tiles, Elem::U32))
}

/// Merges `splits` partial results `[splits, rows, head_dim]` / `[splits, rows]` (f32) into
/// `(out, lse)` by log-sum-exp (a split that saw no key has lse = -inf and adds nothing); `out`
/// f32 or bf16 ([`out_pair`]).
pub fn attn_combine(
    part_out: Ptr,
    part_lse: Ptr,
    out: Ptr,
    lse: Ptr,
    rows: u32,
    head_dim: u32,
    splits: u32,
) -> Result<Call> {
    expect("attn_combine", "part_out", part_out, Elem::F32)?;
    let (out, out_b) = out_pair("attn_combine", out)?;
    // A warp per row, 4 per block.
    Ok(Call {
        kernel: "fp_attn_combine",
        launch: Launch::grid2(rows.div_ceil(4).max(1), 1, 128),
        args: vec![
            ptr(part_out),
            ptr(part_lse),
            ptr(out),
            ptr(out_b),
            ptr(lse),
            Arg::U32(rows),
            Arg::U32(head_dim),
            Arg::U32(splits),
        ],
    })
}

/// Per-key attention mass on tensor cores: for every key j, `scores[j] += sum over rows i and
/// heads h that see j of exp(q_ih . k_j * scale - lse_ih)`. bf16 `q`, `k`; f32 `lse`, `scores`.
/// A block per tile of [`FLASH_KEYS`] keys walks every KV head and query tile, so each key is
/// written once, by one thread (no atomics: the sums do not depend on scheduling).
#[allow(clippy::too_many_arguments)]
pub fn flash_scores(
    dims: AttnDims,
    q: Ptr,
    qpos: Ptr,
    k: Ptr,
    kpos: Ptr,
    lse: Ptr,
    scores: Ptr,
    scale: f32,
) -> Result<Call> {
    let op = "flash_scores";
    for (what, p, e) in
        [("q", q, Elem::Bf16), ("k", k, Elem::Bf16), ("lse", lse, Elem::F32), ("scores", scores, Elem::F32)]
    {
        expect(op, what, p, e)?;
    }
    let kernel = match dims.head_dim {
        64 => "fp_flash_scores_d64",
        128 => "fp_flash_scores_d128",
        d => return Err(KernelError::Shape { op, detail: format!("head_dim {d}: the kernel takes 64 or 128") }),
    };
    let d = dims;
    Ok(Call {
        kernel,
        launch: Launch {
            grid: [d.n.div_ceil(FLASH_KEYS).max(1), 1, 1],
            block: [FLASH_THREADS, 1, 1],
            shared_bytes: flash_scores_shared_bytes(d.head_dim),
        },
        args: with_dims(
            &[ptr(q), ptr(qpos), ptr(k), ptr(kpos), ptr(lse), ptr(scores)],
            d,
            &[Arg::F32(scale * std::f32::consts::LOG2_E)],
        ),
    })
}

/// Dynamic shared memory of the tensor-core self-check: three 16 x 24 bf16 tiles.
pub const PROBE_SHARED_BYTES: u32 = 3 * 16 * 24 * 2;

/// The tensor-core self-check (`probe.cu`): bf16 `a [16][16]` (row-major), the same B as
/// `b_nk [n][k]` and `b_kn [k][n]` (16 x 16 each); f32 `d_nk`, `d_kn [16][16]` get A B twice,
/// through the two ways the attention kernel loads its operands.
pub fn probe_mma(a: Ptr, b_nk: Ptr, b_kn: Ptr, d_nk: Ptr, d_kn: Ptr) -> Result<Call> {
    for (what, p, e) in [("a", a, Elem::Bf16), ("b_nk", b_nk, Elem::Bf16), ("b_kn", b_kn, Elem::Bf16)] {
        expect("probe_mma", what, p, e)?;
    }
    Ok(Call {
        kernel: "fp_probe_mma",
        launch: Launch { grid: [1, 1, 1], block: [32, 1, 1], shared_bytes: PROBE_SHARED_BYTES },
        args: vec![ptr(a), ptr(b_nk), ptr(b_kn), ptr(d_nk), ptr(d_kn)],
    })
}

#[cfg(test)]
mod tests;
