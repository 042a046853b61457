//! flowprefill's CUDA kernels run on the CPU: the same `.cu` files the CUDA backend compiles
//! with NVRTC, compiled here as C++ with `kernels/cuda/cpu_shim.h` (a thread per CUDA thread of
//! a block, barriers for `__syncthreads`, warp shuffles, and emulations of `mma.sync`,
//! `ldmatrix` and `cp.async`), launched through the very [`Call`]s the backend launches (built
//! by [`flowprefill_kernels::gpu::ops`]). The tests compare every kernel with the Rust
//! references. Host slices stand for device buffers; lengths are checked here before any
//! pointer reaches C++.

use flowprefill_kernels::attention::AttnShape;
use flowprefill_kernels::gpu::ops::{self, AttnDims, RopeArgs};
pub use flowprefill_kernels::gpu::ops::{FlashKernel, FlashPlan};
use flowprefill_kernels::gpu::{Call, Elem, Ptr, ATTENTION_MAX_DIM};
use flowprefill_kernels::rope::{RopeStyle, RopeTable};
use std::borrow::Cow;
use std::ffi::{c_char, CStr, CString};

mod ffi {
    use std::ffi::c_char;
    extern "C" {
        pub fn emu_launch(
            kernel: *const c_char,
            grid: *const u32,
            block: *const u32,
            shared_bytes: u32,
            cells: *const u64,
            codes: *const i32,
            nargs: i32,
            err: *mut c_char,
            err_len: u32,
        ) -> i32;
        pub fn emu_exp2_poly(x: f32) -> f32;
    }
}

/// `fp_exp2_poly` of `kernels/cuda/common.cuh` (2^x by a polynomial on the FMA pipe, what the
/// Hopper kernel's polynomial configurations use for part of each tile's softmax), run here.
pub fn exp2_poly(x: f32) -> f32 {
    // SAFETY: a pure function of one float.
    unsafe { ffi::emu_exp2_poly(x) }
}

/// Launches `call` on the CPU and waits for it. Panics (these are test helpers) if the call does
/// not match the kernel's declaration, or a primitive reported misuse (a `cp.async` group left
/// in flight, a misaligned `ldmatrix` row).
pub fn run(call: &Call) {
    if let Err(e) = try_run(call) {
        panic!("{e}");
    }
}

/// [`run`], returning what went wrong instead of panicking: a call that does not match the
/// kernel's declaration, or the first misuse a primitive reported (`emulated launch failed: ...`).
pub fn try_run(call: &Call) -> Result<(), String> {
    call.check()?;
    let cells: Vec<u64> = call.args.iter().map(|a| a.cell()).collect();
    let codes: Vec<i32> = call.args.iter().map(|a| a.param().code()).collect();
    let name = CString::new(call.kernel).expect("a kernel name without NUL");
    let mut err = vec![0 as c_char; 512];
    // SAFETY: the call matches the kernel's declaration (checked above, and again by type on
    // the C++ side); every pointer in it comes from a slice whose length the wrapper checked
    // against the sizes passed with it; the shim joins every thread before returning.
    let rc = unsafe {
        ffi::emu_launch(
            name.as_ptr(),
            call.launch.grid.as_ptr(),
            call.launch.block.as_ptr(),
            call.launch.shared_bytes,
            cells.as_ptr(),
            codes.as_ptr(),
            cells.len() as i32,
            err.as_mut_ptr(),
            err.len() as u32,
        )
    };
    if rc != 0 {
        // SAFETY: the C++ side wrote a NUL-terminated message of at most err.len() bytes.
        let msg = unsafe { CStr::from_ptr(err.as_ptr()) }.to_string_lossy().into_owned();
        return Err(format!("emulated launch failed: {msg}"));
    }
    Ok(())
}

fn run_all(calls: &[Call]) {
    calls.iter().for_each(run);
}

/// Element types a host slice can stand for.
pub trait EmuElem {
    /// The kernel-side type.
    const ELEM: Elem;
}
impl EmuElem for f32 {
    const ELEM: Elem = Elem::F32;
}
impl EmuElem for u16 {
    const ELEM: Elem = Elem::Bf16;
}
impl EmuElem for u32 {
    const ELEM: Elem = Elem::U32;
}
impl EmuElem for f64 {
    const ELEM: Elem = Elem::F64;
}
impl EmuElem for u64 {
    const ELEM: Elem = Elem::U64;
}

fn p<T: EmuElem>(s: &[T]) -> Ptr {
    Ptr::new(s.as_ptr() as u64, T::ELEM)
}

fn pm<T: EmuElem>(s: &mut [T]) -> Ptr {
    Ptr::new(s.as_mut_ptr() as u64, T::ELEM)
}

/// Panics unless `len == want`: these wrappers are test helpers, and a wrong length here is a
/// bug of the test, caught before a pointer reaches C++.
fn check(what: &str, len: usize, want: usize) {
    assert_eq!(len, want, "{what}: {len} elements, expected {want}");
}

fn u32_of(n: usize) -> u32 {
    u32::try_from(n).unwrap_or_else(|_| panic!("{n} does not fit the kernels' 32-bit sizes"))
}

fn built(call: flowprefill_kernels::Result<Call>) -> Call {
    call.unwrap_or_else(|e| panic!("{e}"))
}

/// `out[r] = table[ids[r]]` (f32 or bf16 table of `cols` columns, f32 or bf16 out).
pub fn embedding<T: EmuElem, O: EmuElem>(table: &[T], cols: usize, ids: &[u32], out: &mut [O]) {
    check("out", out.len(), ids.len() * cols);
    assert!(ids.iter().all(|&i| (i as usize + 1) * cols <= table.len()), "an id outside the table");
    run(&built(ops::embedding(p(table), p(ids), pm(out), u32_of(ids.len()), u32_of(cols))));
}

/// `x[r, c] += bias[c]` (x f32 or bf16).
pub fn add_bias<T: EmuElem>(x: &mut [T], bias: &[f32]) {
    assert!(!bias.is_empty() && x.len().is_multiple_of(bias.len()));
    let n = x.len() as u64;
    run(&built(ops::add_bias(pm(x), p(bias), n, u32_of(bias.len()))));
}

/// `x += y` (both f32 or both bf16).
pub fn add_assign<T: EmuElem>(x: &mut [T], y: &[T]) {
    check("y", y.len(), x.len());
    let n = x.len() as u64;
    run(&built(ops::add_assign(pm(x), p(y), n)));
}

/// `silu(gate) * up` of `[gate | up]` rows (both f32 or both bf16).
pub fn silu_mul<T: EmuElem>(gate_up: &[T], ffn: usize, out: &mut [T]) {
    let rows = out.len() / ffn.max(1);
    check("out", out.len(), rows * ffn);
    check("gate_up", gate_up.len(), rows * 2 * ffn);
    run(&built(ops::silu_mul(p(gate_up), pm(out), rows as u64, u32_of(ffn))));
}

/// Columns `[col, col + width)` of `[rows, src_cols]` (f32 or bf16 source, f32 or bf16
/// destination: the kernels convert f32 to bf16 and copy bf16).
pub fn copy_columns<S: EmuElem, D: EmuElem>(src: &[S], src_cols: usize, col: usize, width: usize, dst: &mut [D]) {
    let rows = src.len() / src_cols.max(1);
    assert!(col + width <= src_cols);
    check("dst", dst.len(), rows * width);
    let c = ops::copy_columns(p(src), u32_of(src_cols), u32_of(col), u32_of(width), pm(dst), rows as u64);
    run(&built(c));
}

/// Row `src_rows[i]` of `src` to row `dst_rows[i]` of `dst`.
pub fn copy_rows<T: EmuElem>(src: &[T], src_rows: &[u32], dst: &mut [T], dst_rows: &[u32], row_len: usize) {
    check("dst_rows", dst_rows.len(), src_rows.len());
    assert!(src_rows.iter().all(|&r| (r as usize + 1) * row_len <= src.len()));
    assert!(dst_rows.iter().all(|&r| (r as usize + 1) * row_len <= dst.len()));
    let n = u32_of(src_rows.len());
    run(&built(ops::copy_rows(p(src), p(src_rows), pm(dst), p(dst_rows), n, u32_of(row_len))));
}

/// Every element set to `v`.
pub fn fill(x: &mut [f32], v: f32) {
    let n = x.len() as u64;
    run(&built(ops::fill(pm(x), v, n)));
}

/// f32 to bf16 bits.
pub fn f32_to_bf16(x: &[f32]) -> Vec<u16> {
    let mut y = vec![0u16; x.len()];
    run(&built(ops::convert(p(x), pm(&mut y), x.len() as u64)));
    y
}

/// bf16 bits to f32.
pub fn bf16_to_f32(x: &[u16]) -> Vec<f32> {
    let mut y = vec![0f32; x.len()];
    run(&built(ops::convert(p(x), pm(&mut y), x.len() as u64)));
    y
}

/// RMSNorm of rows of `w.len()` (x and out both f32, or both bf16: one warp per row).
pub fn rms_norm<T: EmuElem>(x: &[T], w: &[f32], eps: f32, out: &mut [T]) {
    let cols = w.len();
    assert!(cols > 0 && x.len().is_multiple_of(cols));
    check("out", out.len(), x.len());
    let rows = u32_of(x.len() / cols);
    run(&built(ops::rms_norm(p(x), p(w), eps, pm(out), rows, u32_of(cols))));
}

/// The host side of a RoPE table as a kernel's arguments: the table's rows for `positions`
/// (extended past it as the CUDA backend extends its device copy), and the arguments pointing
/// at them (valid while the first two live).
fn rope_args<'a>(table: &'a RopeTable, positions: &[u32]) -> (Cow<'a, [f32]>, Cow<'a, [f32]>, RopeArgs) {
    let rows = table.rows_for(positions);
    let (cos, sin) = table.tables_to(rows);
    let args = RopeArgs {
        cos: p(&cos[..]),
        sin: p(&sin[..]),
        table_len: u32_of(rows),
        head_dim: u32_of(table.head_dim()),
        rot_dim: u32_of(table.rot_dim()),
        interleaved: table.style() == RopeStyle::Interleaved,
    };
    (cos, sin, args)
}

/// RoPE in place at `positions` (f32, or bf16 rounded once after the rotation), with the
/// cos/sin table the CPU kernel uses.
pub fn rope<T: EmuElem>(x: &mut [T], n_heads: usize, positions: &[u32], table: &RopeTable) {
    let d = table.head_dim();
    check("x", x.len(), positions.len() * n_heads * d);
    let (_cos, _sin, t) = rope_args(table, positions);
    run(&built(ops::rope(pm(x), u32_of(positions.len()), u32_of(n_heads), p(positions), &t)));
}

/// `dst = rope(src)` at `positions` in one pass (`fp_rope_copy`): how a pre-RoPE chunk cache
/// is placed; `dst` is overwritten entirely (dimensions past `rot_dim` copied).
pub fn rope_copy<T: EmuElem>(src: &[T], dst: &mut [T], n_heads: usize, positions: &[u32], table: &RopeTable) {
    let d = table.head_dim();
    check("src", src.len(), positions.len() * n_heads * d);
    check("dst", dst.len(), src.len());
    let (_cos, _sin, t) = rope_args(table, positions);
    run(&built(ops::rope_copy(p(src), pm(dst), u32_of(positions.len()), u32_of(n_heads), p(positions), &t)));
}

/// `fp_split_qkv_rope`: `qkv` (`[rows, q_dim + 2 kv_dim]`) split into rotated `q` (of the
/// projection's type `A`), pre-RoPE `k_pre`, rotated `k` and `v` (the last three of the cache
/// type `T`) in one launch.
#[allow(clippy::too_many_arguments)]
pub fn split_qkv_rope<A: EmuElem, T: EmuElem>(
    qkv: &[A],
    heads: (usize, usize),
    positions: &[u32],
    table: &RopeTable,
    q: &mut [A],
    k_pre: &mut [T],
    k: &mut [T],
    v: &mut [T],
) {
    let d = table.head_dim();
    let rows = positions.len();
    let (qd, kvd) = (heads.0 * d, heads.1 * d);
    check("qkv", qkv.len(), rows * (qd + 2 * kvd));
    check("q", q.len(), rows * qd);
    for (what, n) in [("k_pre", k_pre.len()), ("k", k.len()), ("v", v.len())] {
        check(what, n, rows * kvd);
    }
    let (_cos, _sin, t) = rope_args(table, positions);
    let parts = ops::QkvParts { qkv: p(qkv), q: pm(q), k_pre: pm(k_pre), k: pm(k), v: pm(v) };
    run(&built(ops::split_qkv_rope(parts, u32_of(rows), u32_of(heads.0), u32_of(heads.1), p(positions), &t)));
}

/// Checks the lengths of an attention call (`v`: `None` for the scores, which read no values;
/// `out_len`: the output's, or `None`) and returns its sizes.
#[allow(clippy::too_many_arguments)]
fn attn_dims(
    shape: &AttnShape,
    q_len: usize,
    qpos: &[u32],
    k_len: usize,
    v_len: Option<usize>,
    kpos: &[u32],
    out_len: Option<usize>,
    lse_len: usize,
) -> AttnDims {
    check("q", q_len, qpos.len() * shape.q_dim());
    check("k", k_len, kpos.len() * shape.kv_dim());
    if let Some(v) = v_len {
        check("v", v, kpos.len() * shape.kv_dim());
    }
    if let Some(o) = out_len {
        check("out", o, q_len);
    }
    check("lse", lse_len, qpos.len() * shape.n_heads);
    let _ = u32_of(qpos.len().max(kpos.len()));
    AttnDims::of(shape, qpos.len(), kpos.len())
}

/// The simple attention kernel (f32 queries; f32 or bf16 keys and values; f32 or bf16 out).
#[allow(clippy::too_many_arguments)]
pub fn attention<T: EmuElem, O: EmuElem>(
    shape: &AttnShape,
    q: &[f32],
    qpos: &[u32],
    k: &[T],
    v: &[T],
    kpos: &[u32],
    out: &mut [O],
    lse: &mut [f32],
) {
    assert!(shape.head_dim <= ATTENTION_MAX_DIM);
    let d = attn_dims(shape, q.len(), qpos, k.len(), Some(v.len()), kpos, Some(out.len()), lse.len());
    if qpos.is_empty() {
        return;
    }
    run(&built(ops::attention(d, p(q), p(qpos), p(k), p(v), p(kpos), pm(out), pm(lse), shape.scale)));
}

/// The simple per-key attention mass kernel (f32 queries; f32 or bf16 keys).
#[allow(clippy::too_many_arguments)]
pub fn attention_scores<T: EmuElem>(
    shape: &AttnShape,
    q: &[f32],
    qpos: &[u32],
    k: &[T],
    kpos: &[u32],
    lse: &[f32],
    scores: &mut [f32],
) {
    let d = attn_dims(shape, q.len(), qpos, k.len(), None, kpos, None, lse.len());
    check("scores", scores.len(), kpos.len());
    run(&built(ops::attention_scores(d, p(q), p(qpos), p(k), p(kpos), p(lse), pm(scores), shape.scale)));
}

/// Merges `(block_out, block_lse)` into `(out, lse)`.
pub fn merge_partial(out: &mut [f32], lse: &mut [f32], block_out: &[f32], block_lse: &[f32], head_dim: usize) {
    check("block_lse", block_lse.len(), lse.len());
    check("out", out.len(), lse.len() * head_dim);
    check("block_out", block_out.len(), lse.len() * head_dim);
    let rows = u32_of(lse.len());
    run(&built(ops::merge_partial(pm(out), pm(lse), p(block_out), p(block_lse), rows, u32_of(head_dim))));
}

/// The tensor-core attention (bf16 `q`, `k`, `v`; f32 or bf16 `out`) by `kernel`, planned as
/// the backend plans it for a GPU of `sm_count` SMs, or with `splits` key splits forced;
/// returns the plan it ran.
#[allow(clippy::too_many_arguments)]
pub fn flash_attention<O: EmuElem>(
    kernel: FlashKernel,
    shape: &AttnShape,
    q: &[u16],
    qpos: &[u32],
    k: &[u16],
    v: &[u16],
    kpos: &[u32],
    out: &mut [O],
    lse: &mut [f32],
    sm_count: u32,
    splits: Option<u32>,
) -> FlashPlan {
    let d = attn_dims(shape, q.len(), qpos, k.len(), Some(v.len()), kpos, Some(out.len()), lse.len());
    let plan = ops::flash_plan(d, kernel, sm_count, splits);
    if qpos.is_empty() {
        return plan;
    }
    let meta = ops::key_meta(kpos);
    let (po, pl) = ops::flash_partial_lens(d, &plan);
    let (mut part_out, mut part_lse) = (vec![0f32; po], vec![0f32; pl]);
    let partial = (plan.splits > 1).then(|| (pm(&mut part_out), pm(&mut part_lse)));
    if kernel.is_hopper() {
        // TMA reads from 16-byte aligned tensors (device buffers are; host vectors of u16 need
        // not be). The copies and the maps live until the launch is done.
        let (ka, va) = (Aligned16::of(k), Aligned16::of(v));
        let maps = ops::hopper_attention_maps(d, ka.ptr(), va.ptr()).unwrap_or_else(|e| panic!("{e}"));
        let mut words: Vec<u64> = maps.iter().flatten().flat_map(|m| m.emulated()).collect();
        words.resize(words.len().max(1), 0);
        let calls =
            ops::hopper_attention(d, &plan, p(&words), p(q), p(qpos), p(&meta), pm(out), pm(lse), partial, shape.scale);
        run_all(&calls.unwrap_or_else(|e| panic!("{e}")));
    } else {
        let calls =
            ops::flash_attention(d, &plan, p(q), p(qpos), p(k), p(v), p(&meta), pm(out), pm(lse), partial, shape.scale);
        run_all(&calls.unwrap_or_else(|e| panic!("{e}")));
    }
    plan
}

/// A copy of bf16 values at a 16-byte aligned address (what a device allocation gives).
struct Aligned16(Vec<Chunk16>);

#[repr(C, align(16))]
#[derive(Clone, Copy)]
struct Chunk16([u16; 8]);

impl Aligned16 {
    fn of(x: &[u16]) -> Self {
        let mut chunks = vec![Chunk16([0; 8]); x.len().div_ceil(8).max(1)];
        for (c, src) in chunks.iter_mut().zip(x.chunks(8)) {
            c.0[..src.len()].copy_from_slice(src);
        }
        Self(chunks)
    }

    fn ptr(&self) -> Ptr {
        Ptr::new(self.0.as_ptr() as u64, Elem::Bf16)
    }
}

/// Per-key attention mass on tensor cores (bf16 `q`, `k`), added to `scores`.
#[allow(clippy::too_many_arguments)]
pub fn flash_scores(
    shape: &AttnShape,
    q: &[u16],
    qpos: &[u32],
    k: &[u16],
    kpos: &[u32],
    lse: &[f32],
    scores: &mut [f32],
) {
    let d = attn_dims(shape, q.len(), qpos, k.len(), None, kpos, None, lse.len());
    check("scores", scores.len(), kpos.len());
    if qpos.is_empty() || kpos.is_empty() {
        return;
    }
    run(&built(ops::flash_scores(d, p(q), p(qpos), p(k), p(kpos), p(lse), pm(scores), shape.scale)));
}

/// The tensor-core self-check (`probe.cu`, one warp): `(A B through an [n][k] B, A B through
/// a [k][n] B)` for bf16 `a [16][16]`, `b_nk [n][k]`, `b_kn [k][n]`.
pub fn probe_mma(a: &[u16], b_nk: &[u16], b_kn: &[u16]) -> (Vec<f32>, Vec<f32>) {
    for (what, x) in [("a", a), ("b_nk", b_nk), ("b_kn", b_kn)] {
        check(what, x.len(), 256);
    }
    let (mut d_nk, mut d_kn) = (vec![0f32; 256], vec![0f32; 256]);
    run(&built(ops::probe_mma(p(a), p(b_nk), p(b_kn), pm(&mut d_nk), pm(&mut d_kn))));
    (d_nk, d_kn)
}

/// Hopper's self-check (`hopper_probe.cu`, one warpgroup) for a swizzle mode, with the
/// deliberate mistakes `breaks` ([`ops::probe_break`]): `(A B with both operands from shared
/// memory and B K-major, A B with A from registers and B MN-major)` for bf16 `a [64][64]`,
/// `b_nk [128][64]` (B as [n][k]) and `b_kn [64][128]` (B as [k][n]); or what the emulation
/// reported.
pub fn hopper_probe(
    swizzle: ops::Swizzle,
    a: &[u16],
    b_nk: &[u16],
    b_kn: &[u16],
    breaks: u32,
) -> Result<(Vec<f32>, Vec<f32>), String> {
    check("a", a.len(), 64 * 64);
    check("b_nk", b_nk.len(), 128 * 64);
    check("b_kn", b_kn.len(), 64 * 128);
    let maps = ops::hopper_probe_maps(p(a), p(b_nk), p(b_kn), swizzle).unwrap_or_else(|e| panic!("{e}"));
    let words: Vec<u64> = maps.iter().flat_map(|m| m.emulated()).collect();
    let (mut d_ss, mut d_rs) = (vec![0f32; 64 * 128], vec![0f32; 64 * 128]);
    try_run(&built(ops::hopper_probe(swizzle, p(&words), p(a), pm(&mut d_ss), pm(&mut d_rs), breaks)))?;
    Ok((d_ss, d_rs))
}
