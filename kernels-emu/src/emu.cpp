// The CUDA kernels of kernels/cuda/, compiled for the CPU with the launch shim, and one
// C entry point per kernel taking the launch shape and the kernel's arguments.

#include "cpu_shim.h"
// clang-format off
#include "common.cuh"
#include "elementwise.cu"
#include "norm.cu"
#include "rope.cu"
#include "attention.cu"
#include "scores.cu"
#include "merge.cu"
// clang-format on

using fp_shim::launch;

#define FP_EMU(name, ...) extern "C" void emu_##name(unsigned gx, unsigned gy, unsigned block, __VA_ARGS__)

FP_EMU(embedding_f32, const float* table, const u32* ids, float* out, u32 n, u32 cols) {
    launch(dim3(gx, gy), dim3(block), fp_embedding_f32, table, ids, out, n, cols);
}
FP_EMU(embedding_bf16, const bf16_t* table, const u32* ids, float* out, u32 n, u32 cols) {
    launch(dim3(gx, gy), dim3(block), fp_embedding_bf16, table, ids, out, n, cols);
}
FP_EMU(add_bias, float* x, const float* bias, u64 n, u32 cols) {
    launch(dim3(gx, gy), dim3(block), fp_add_bias, x, bias, n, cols);
}
FP_EMU(add_assign, float* x, const float* y, u64 n) { launch(dim3(gx, gy), dim3(block), fp_add_assign, x, y, n); }
FP_EMU(silu_mul, const float* gate_up, float* out, u64 rows, u32 ffn) {
    launch(dim3(gx, gy), dim3(block), fp_silu_mul, gate_up, out, rows, ffn);
}
FP_EMU(copy_columns, const float* src, u32 src_cols, u32 col, u32 width, float* dst, u64 rows) {
    launch(dim3(gx, gy), dim3(block), fp_copy_columns, src, src_cols, col, width, dst, rows);
}
FP_EMU(copy_rows, const float* src, const u32* src_rows, float* dst, const u32* dst_rows, u32 n, u32 row_len) {
    launch(dim3(gx, gy), dim3(block), fp_copy_rows, src, src_rows, dst, dst_rows, n, row_len);
}
FP_EMU(fill, float* x, float v, u64 n) { launch(dim3(gx, gy), dim3(block), fp_fill, x, v, n); }
FP_EMU(f32_to_bf16, const float* x, bf16_t* y, u64 n) { launch(dim3(gx, gy), dim3(block), fp_f32_to_bf16, x, y, n); }
FP_EMU(bf16_to_f32, const bf16_t* x, float* y, u64 n) { launch(dim3(gx, gy), dim3(block), fp_bf16_to_f32, x, y, n); }
FP_EMU(rms_norm, const float* x, const float* w, float eps, float* out, u32 rows, u32 cols) {
    launch(dim3(gx, gy), dim3(block), fp_rms_norm, x, w, eps, out, rows, cols);
}
FP_EMU(rope, float* x, u32 tokens, u32 n_heads, u32 head_dim, u32 rot_dim, u32 interleaved, const u32* positions,
       const float* cos_t, const float* sin_t, u32 table_len, const double* inv_freq) {
    launch(dim3(gx, gy), dim3(block), fp_rope, x, tokens, n_heads, head_dim, rot_dim, interleaved, positions, cos_t,
           sin_t, table_len, inv_freq);
}
FP_EMU(attention, const float* q, const u32* qpos, const float* k, const float* v, const u32* kpos, float* out,
       float* lse, u32 m, u32 n, u32 n_heads, u32 n_kv_heads, u32 head_dim, float scale) {
    launch(dim3(gx, gy), dim3(block), fp_attention, q, qpos, k, v, kpos, out, lse, m, n, n_heads, n_kv_heads, head_dim,
           scale);
}
FP_EMU(attention_scores, const float* q, const u32* qpos, const float* k, const u32* kpos, const float* lse,
       float* scores, u32 m, u32 n, u32 n_heads, u32 n_kv_heads, u32 head_dim, float scale) {
    launch(dim3(gx, gy), dim3(block), fp_attention_scores, q, qpos, k, kpos, lse, scores, m, n, n_heads, n_kv_heads,
           head_dim, scale);
}
FP_EMU(merge_partial, float* out, float* lse, const float* block_out, const float* block_lse, u32 rows, u32 head_dim) {
    launch(dim3(gx, gy), dim3(block), fp_merge_partial, out, lse, block_out, block_lse, rows, head_dim);
}
