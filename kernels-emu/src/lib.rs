//! flowprefill's CUDA kernels run on the CPU: the same `.cu` files the CUDA backend compiles
//! with NVRTC, compiled here as C++ with `kernels/cuda/cpu_shim.h` (a thread per CUDA thread of
//! a block, barriers for `__syncthreads` and warp shuffles), launched with the same shapes as
//! the backend ([`flowprefill_kernels::gpu`]). The tests compare every kernel with the Rust
//! references. Host slices stand for device buffers; lengths are checked here before any
//! pointer reaches C++.

use flowprefill_kernels::attention::AttnShape;
use flowprefill_kernels::gpu::{attention_launch, norm_launch, stride_launch, Launch, ATTENTION_MAX_DIM};
use flowprefill_kernels::rope::{RopeStyle, RopeTable};

mod ffi {
    extern "C" {
        pub fn emu_embedding_f32(
            gx: u32,
            gy: u32,
            b: u32,
            table: *const f32,
            ids: *const u32,
            out: *mut f32,
            n: u32,
            cols: u32,
        );
        pub fn emu_embedding_bf16(
            gx: u32,
            gy: u32,
            b: u32,
            table: *const u16,
            ids: *const u32,
            out: *mut f32,
            n: u32,
            cols: u32,
        );
        pub fn emu_add_bias(gx: u32, gy: u32, b: u32, x: *mut f32, bias: *const f32, n: u64, cols: u32);
        pub fn emu_add_assign(gx: u32, gy: u32, b: u32, x: *mut f32, y: *const f32, n: u64);
        pub fn emu_silu_mul(gx: u32, gy: u32, b: u32, gate_up: *const f32, out: *mut f32, rows: u64, ffn: u32);
        pub fn emu_copy_columns(
            gx: u32,
            gy: u32,
            b: u32,
            src: *const f32,
            src_cols: u32,
            col: u32,
            width: u32,
            dst: *mut f32,
            rows: u64,
        );
        pub fn emu_copy_rows(
            gx: u32,
            gy: u32,
            b: u32,
            src: *const f32,
            src_rows: *const u32,
            dst: *mut f32,
            dst_rows: *const u32,
            n: u32,
            row_len: u32,
        );
        pub fn emu_fill(gx: u32, gy: u32, b: u32, x: *mut f32, v: f32, n: u64);
        pub fn emu_f32_to_bf16(gx: u32, gy: u32, b: u32, x: *const f32, y: *mut u16, n: u64);
        pub fn emu_bf16_to_f32(gx: u32, gy: u32, b: u32, x: *const u16, y: *mut f32, n: u64);
        pub fn emu_rms_norm(
            gx: u32,
            gy: u32,
            b: u32,
            x: *const f32,
            w: *const f32,
            eps: f32,
            out: *mut f32,
            rows: u32,
            cols: u32,
        );
        pub fn emu_rope(
            gx: u32,
            gy: u32,
            b: u32,
            x: *mut f32,
            tokens: u32,
            n_heads: u32,
            head_dim: u32,
            rot_dim: u32,
            interleaved: u32,
            positions: *const u32,
            cos_t: *const f32,
            sin_t: *const f32,
            table_len: u32,
            inv_freq: *const f64,
        );
        pub fn emu_attention(
            gx: u32,
            gy: u32,
            b: u32,
            q: *const f32,
            qpos: *const u32,
            k: *const f32,
            v: *const f32,
            kpos: *const u32,
            out: *mut f32,
            lse: *mut f32,
            m: u32,
            n: u32,
            n_heads: u32,
            n_kv_heads: u32,
            head_dim: u32,
            scale: f32,
        );
        pub fn emu_attention_scores(
            gx: u32,
            gy: u32,
            b: u32,
            q: *const f32,
            qpos: *const u32,
            k: *const f32,
            kpos: *const u32,
            lse: *const f32,
            scores: *mut f32,
            m: u32,
            n: u32,
            n_heads: u32,
            n_kv_heads: u32,
            head_dim: u32,
            scale: f32,
        );
        pub fn emu_merge_partial(
            gx: u32,
            gy: u32,
            b: u32,
            out: *mut f32,
            lse: *mut f32,
            block_out: *const f32,
            block_lse: *const f32,
            rows: u32,
            head_dim: u32,
        );
    }
}

/// Panics unless `len == want`: these wrappers are test helpers, and a wrong length here is a
/// bug of the test, caught before a pointer reaches C++.
fn check(what: &str, len: usize, want: usize) {
    assert_eq!(len, want, "{what}: {len} elements, expected {want}");
}

fn u32_of(n: usize) -> u32 {
    u32::try_from(n).unwrap_or_else(|_| panic!("{n} does not fit the kernels' 32-bit sizes"))
}

macro_rules! run {
    ($launch:expr, $f:ident($($arg:expr),* $(,)?)) => {{
        let Launch { grid_x, grid_y, block } = $launch;
        // SAFETY: every pointer comes from a slice whose length was checked against the sizes
        // passed with it; the shim joins every thread before returning.
        unsafe { ffi::$f(grid_x, grid_y, block, $($arg),*) }
    }};
}

/// `out[r] = table[ids[r]]` (f32 table of `cols` columns).
pub fn embedding_f32(table: &[f32], cols: usize, ids: &[u32], out: &mut [f32]) {
    check("out", out.len(), ids.len() * cols);
    assert!(ids.iter().all(|&i| (i as usize + 1) * cols <= table.len()), "an id outside the table");
    run!(
        stride_launch((ids.len() * cols) as u64),
        emu_embedding_f32(table.as_ptr(), ids.as_ptr(), out.as_mut_ptr(), u32_of(ids.len()), u32_of(cols))
    );
}

/// `out[r] = table[ids[r]]` (bf16 table, raw bits).
pub fn embedding_bf16(table: &[u16], cols: usize, ids: &[u32], out: &mut [f32]) {
    check("out", out.len(), ids.len() * cols);
    assert!(ids.iter().all(|&i| (i as usize + 1) * cols <= table.len()), "an id outside the table");
    run!(
        stride_launch((ids.len() * cols) as u64),
        emu_embedding_bf16(table.as_ptr(), ids.as_ptr(), out.as_mut_ptr(), u32_of(ids.len()), u32_of(cols))
    );
}

/// `x[r, c] += bias[c]`.
pub fn add_bias(x: &mut [f32], bias: &[f32]) {
    assert!(!bias.is_empty() && x.len() % bias.len() == 0);
    run!(
        stride_launch(x.len() as u64),
        emu_add_bias(x.as_mut_ptr(), bias.as_ptr(), x.len() as u64, u32_of(bias.len()))
    );
}

/// `x += y`.
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    check("y", y.len(), x.len());
    run!(stride_launch(x.len() as u64), emu_add_assign(x.as_mut_ptr(), y.as_ptr(), x.len() as u64));
}

/// `silu(gate) * up` of `[gate | up]` rows.
pub fn silu_mul(gate_up: &[f32], ffn: usize, out: &mut [f32]) {
    let rows = out.len() / ffn.max(1);
    check("out", out.len(), rows * ffn);
    check("gate_up", gate_up.len(), rows * 2 * ffn);
    run!(stride_launch(out.len() as u64), emu_silu_mul(gate_up.as_ptr(), out.as_mut_ptr(), rows as u64, u32_of(ffn)));
}

/// Columns `[col, col + width)` of `[rows, src_cols]`.
pub fn copy_columns(src: &[f32], src_cols: usize, col: usize, width: usize, dst: &mut [f32]) {
    let rows = src.len() / src_cols.max(1);
    assert!(col + width <= src_cols);
    check("dst", dst.len(), rows * width);
    run!(
        stride_launch(dst.len() as u64),
        emu_copy_columns(src.as_ptr(), u32_of(src_cols), u32_of(col), u32_of(width), dst.as_mut_ptr(), rows as u64)
    );
}

/// Row `src_rows[i]` of `src` to row `dst_rows[i]` of `dst`.
pub fn copy_rows(src: &[f32], src_rows: &[u32], dst: &mut [f32], dst_rows: &[u32], row_len: usize) {
    check("dst_rows", dst_rows.len(), src_rows.len());
    assert!(src_rows.iter().all(|&r| (r as usize + 1) * row_len <= src.len()));
    assert!(dst_rows.iter().all(|&r| (r as usize + 1) * row_len <= dst.len()));
    run!(
        stride_launch((src_rows.len() * row_len) as u64),
        emu_copy_rows(
            src.as_ptr(),
            src_rows.as_ptr(),
            dst.as_mut_ptr(),
            dst_rows.as_ptr(),
            u32_of(src_rows.len()),
            u32_of(row_len)
        )
    );
}

/// Every element set to `v`.
pub fn fill(x: &mut [f32], v: f32) {
    run!(stride_launch(x.len() as u64), emu_fill(x.as_mut_ptr(), v, x.len() as u64));
}

/// f32 to bf16 bits.
pub fn f32_to_bf16(x: &[f32]) -> Vec<u16> {
    let mut y = vec![0u16; x.len()];
    run!(stride_launch(x.len() as u64), emu_f32_to_bf16(x.as_ptr(), y.as_mut_ptr(), x.len() as u64));
    y
}

/// bf16 bits to f32.
pub fn bf16_to_f32(x: &[u16]) -> Vec<f32> {
    let mut y = vec![0f32; x.len()];
    run!(stride_launch(x.len() as u64), emu_bf16_to_f32(x.as_ptr(), y.as_mut_ptr(), x.len() as u64));
    y
}

/// RMSNorm of rows of `w.len()`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let cols = w.len();
    assert!(cols > 0 && x.len() % cols == 0);
    check("out", out.len(), x.len());
    let rows = u32_of(x.len() / cols);
    run!(norm_launch(rows), emu_rms_norm(x.as_ptr(), w.as_ptr(), eps, out.as_mut_ptr(), rows, u32_of(cols)));
}

/// RoPE in place at `positions`, with the cos/sin table the CPU kernel uses.
pub fn rope(x: &mut [f32], n_heads: usize, positions: &[u32], table: &RopeTable) {
    let d = table.head_dim();
    check("x", x.len(), positions.len() * n_heads * d);
    let (cos, sin) = table.tables();
    let half = table.rot_dim() / 2;
    run!(
        stride_launch((positions.len() * n_heads * half) as u64),
        emu_rope(
            x.as_mut_ptr(),
            u32_of(positions.len()),
            u32_of(n_heads),
            u32_of(d),
            u32_of(table.rot_dim()),
            u32::from(table.style() == RopeStyle::Interleaved),
            positions.as_ptr(),
            cos.as_ptr(),
            sin.as_ptr(),
            u32_of(table.table_len()),
            table.inv_freq().as_ptr(),
        )
    );
}

/// Attention with log-sum-exp (the CPU kernel's contract).
#[allow(clippy::too_many_arguments)]
pub fn attention(
    shape: &AttnShape,
    q: &[f32],
    qpos: &[u32],
    k: &[f32],
    v: &[f32],
    kpos: &[u32],
    out: &mut [f32],
    lse: &mut [f32],
) {
    assert!(shape.head_dim <= ATTENTION_MAX_DIM);
    check("q", q.len(), qpos.len() * shape.q_dim());
    check("k", k.len(), kpos.len() * shape.kv_dim());
    check("v", v.len(), kpos.len() * shape.kv_dim());
    check("out", out.len(), q.len());
    check("lse", lse.len(), qpos.len() * shape.n_heads);
    if qpos.is_empty() {
        return;
    }
    run!(
        attention_launch(u32_of(qpos.len()), u32_of(shape.n_heads)),
        emu_attention(
            q.as_ptr(),
            qpos.as_ptr(),
            k.as_ptr(),
            v.as_ptr(),
            kpos.as_ptr(),
            out.as_mut_ptr(),
            lse.as_mut_ptr(),
            u32_of(qpos.len()),
            u32_of(kpos.len()),
            u32_of(shape.n_heads),
            u32_of(shape.n_kv_heads),
            u32_of(shape.head_dim),
            shape.scale,
        )
    );
}

/// Adds each key's attention mass to `scores`.
#[allow(clippy::too_many_arguments)]
pub fn attention_scores(
    shape: &AttnShape,
    q: &[f32],
    qpos: &[u32],
    k: &[f32],
    kpos: &[u32],
    lse: &[f32],
    scores: &mut [f32],
) {
    check("q", q.len(), qpos.len() * shape.q_dim());
    check("k", k.len(), kpos.len() * shape.kv_dim());
    check("lse", lse.len(), qpos.len() * shape.n_heads);
    check("scores", scores.len(), kpos.len());
    run!(
        stride_launch(kpos.len() as u64),
        emu_attention_scores(
            q.as_ptr(),
            qpos.as_ptr(),
            k.as_ptr(),
            kpos.as_ptr(),
            lse.as_ptr(),
            scores.as_mut_ptr(),
            u32_of(qpos.len()),
            u32_of(kpos.len()),
            u32_of(shape.n_heads),
            u32_of(shape.n_kv_heads),
            u32_of(shape.head_dim),
            shape.scale,
        )
    );
}

/// Merges `(block_out, block_lse)` into `(out, lse)`.
pub fn merge_partial(out: &mut [f32], lse: &mut [f32], block_out: &[f32], block_lse: &[f32], head_dim: usize) {
    check("block_lse", block_lse.len(), lse.len());
    check("out", out.len(), lse.len() * head_dim);
    check("block_out", block_out.len(), lse.len() * head_dim);
    run!(
        stride_launch(lse.len() as u64),
        emu_merge_partial(
            out.as_mut_ptr(),
            lse.as_mut_ptr(),
            block_out.as_ptr(),
            block_lse.as_ptr(),
            u32_of(lse.len()),
            u32_of(head_dim)
        )
    );
}
