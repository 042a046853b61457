// Element-wise kernels: embedding gather, bias and residual adds, SiLU-gate, column and row
// copies (gather / scatter), f32 <-> bf16; f32 and bf16 buffers (bf16 computed in f32, rounded
// once to nearest even when stored). Grid-stride loops: any grid size is correct.

// out[r, c] = table[ids[r], c]: an f32 or bf16 table into f32 or bf16 activations (rounded once
// when an f32 table meets bf16 activations; bf16 into bf16 is a copy).
template <typename T, typename O>
__device__ __forceinline__ void fp_embedding_impl(const T* table, const u32* ids, O* out, u32 n, u32 cols) {
    u64 total = (u64)n * cols;
    for (u64 e = fp_gid(); e < total; e += fp_gstride()) {
        u64 r = e / cols, c = e % cols;
        fp_st(out + e, fp_ld(table + (u64)ids[r] * cols + c));
    }
}

extern "C" __global__ void fp_embedding_f32(const float* table, const u32* ids, float* out, u32 n, u32 cols) {
    fp_embedding_impl(table, ids, out, n, cols);
}

extern "C" __global__ void fp_embedding_bf16(const bf16_t* table, const u32* ids, float* out, u32 n, u32 cols) {
    fp_embedding_impl(table, ids, out, n, cols);
}

extern "C" __global__ void fp_embedding_f32_to_bf16(const float* table, const u32* ids, bf16_t* out, u32 n,
                                                    u32 cols) {
    fp_embedding_impl(table, ids, out, n, cols);
}

extern "C" __global__ void fp_embedding_bf16_to_bf16(const bf16_t* table, const u32* ids, bf16_t* out, u32 n,
                                                     u32 cols) {
    fp_embedding_impl(table, ids, out, n, cols);
}

// x[r, c] += bias[c] (an f32 bias; bf16 x: the sum in f32, rounded once).
template <typename T>
__device__ __forceinline__ void fp_add_bias_impl(T* x, const float* bias, u64 n, u32 cols) {
    for (u64 e = fp_gid(); e < n; e += fp_gstride()) {
        fp_st(x + e, fp_ld(x + e) + bias[e % cols]);
    }
}

extern "C" __global__ void fp_add_bias(float* x, const float* bias, u64 n, u32 cols) {
    fp_add_bias_impl(x, bias, n, cols);
}

extern "C" __global__ void fp_add_bias_bf16(bf16_t* x, const float* bias, u64 n, u32 cols) {
    fp_add_bias_impl(x, bias, n, cols);
}

// x += y (the same type; bf16: the sum in f32, rounded once).
template <typename T>
__device__ __forceinline__ void fp_add_assign_impl(T* x, const T* y, u64 n) {
    for (u64 e = fp_gid(); e < n; e += fp_gstride()) {
        fp_st(x + e, fp_ld(x + e) + fp_ld(y + e));
    }
}

extern "C" __global__ void fp_add_assign(float* x, const float* y, u64 n) {
    fp_add_assign_impl(x, y, n);
}

extern "C" __global__ void fp_add_assign_bf16(bf16_t* x, const bf16_t* y, u64 n) {
    fp_add_assign_impl(x, y, n);
}

// out[r, c] = silu(g) * u with g = gate_up[r, c], u = gate_up[r, ffn + c]: one pass, in f32,
// stored in out's type (bf16 rounded once).
template <typename T>
__device__ __forceinline__ void fp_silu_mul_impl(const T* gate_up, T* out, u64 rows, u32 ffn) {
    u64 total = rows * ffn;
    for (u64 e = fp_gid(); e < total; e += fp_gstride()) {
        u64 r = e / ffn, c = e % ffn;
        float g = fp_ld(gate_up + r * 2 * ffn + c);
        float u = fp_ld(gate_up + r * 2 * ffn + ffn + c);
        fp_st(out + e, g / (1.0f + expf(-g)) * u);
    }
}

extern "C" __global__ void fp_silu_mul(const float* gate_up, float* out, u64 rows, u32 ffn) {
    fp_silu_mul_impl(gate_up, out, rows, ffn);
}

extern "C" __global__ void fp_silu_mul_bf16(const bf16_t* gate_up, bf16_t* out, u64 rows, u32 ffn) {
    fp_silu_mul_impl(gate_up, out, rows, ffn);
}

// dst[r, 0..width] = src[r, col..col+width] for a [rows, src_cols] source; f32 -> bf16 rounds
// to nearest even (projections into a bf16 KV cache).
template <typename S, typename D>
__device__ __forceinline__ void fp_copy_columns_impl(const S* src, u32 src_cols, u32 col, u32 width, D* dst,
                                                     u64 rows) {
    u64 total = rows * width;
    for (u64 e = fp_gid(); e < total; e += fp_gstride()) {
        u64 r = e / width, c = e % width;
        fp_st(dst + e, fp_ld(src + r * src_cols + col + c));
    }
}

extern "C" __global__ void fp_copy_columns(const float* src, u32 src_cols, u32 col, u32 width, float* dst, u64 rows) {
    fp_copy_columns_impl(src, src_cols, col, width, dst, rows);
}

extern "C" __global__ void fp_copy_columns_to_bf16(const float* src, u32 src_cols, u32 col, u32 width, bf16_t* dst,
                                                   u64 rows) {
    fp_copy_columns_impl(src, src_cols, col, width, dst, rows);
}

extern "C" __global__ void fp_copy_columns_bf16(const bf16_t* src, u32 src_cols, u32 col, u32 width, bf16_t* dst,
                                                u64 rows) {
    fp_copy_columns_impl(src, src_cols, col, width, dst, rows);
}

extern "C" __global__ void fp_copy_columns_from_bf16(const bf16_t* src, u32 src_cols, u32 col, u32 width, float* dst,
                                                     u64 rows) {
    fp_copy_columns_impl(src, src_cols, col, width, dst, rows);
}

// dst row dst_rows[i] = src row src_rows[i], rows of row_len values (gather and scatter).
template <typename T>
__device__ __forceinline__ void fp_copy_rows_impl(const T* src, const u32* src_rows, T* dst, const u32* dst_rows, u32 n,
                                                  u32 row_len) {
    u64 total = (u64)n * row_len;
    for (u64 e = fp_gid(); e < total; e += fp_gstride()) {
        u64 i = e / row_len, c = e % row_len;
        dst[(u64)dst_rows[i] * row_len + c] = src[(u64)src_rows[i] * row_len + c];
    }
}

extern "C" __global__ void fp_copy_rows(const float* src, const u32* src_rows, float* dst, const u32* dst_rows, u32 n,
                                        u32 row_len) {
    fp_copy_rows_impl(src, src_rows, dst, dst_rows, n, row_len);
}

extern "C" __global__ void fp_copy_rows_bf16(const bf16_t* src, const u32* src_rows, bf16_t* dst, const u32* dst_rows,
                                             u32 n, u32 row_len) {
    fp_copy_rows_impl(src, src_rows, dst, dst_rows, n, row_len);
}

// Every element set to v (e.g. -inf log-sum-exps of an empty attention).
extern "C" __global__ void fp_fill(float* x, float v, u64 n) {
    for (u64 e = fp_gid(); e < n; e += fp_gstride()) {
        x[e] = v;
    }
}

extern "C" __global__ void fp_f32_to_bf16(const float* x, bf16_t* y, u64 n) {
    for (u64 e = fp_gid(); e < n; e += fp_gstride()) {
        y[e] = fp_f32_to_bf16(x[e]);
    }
}

extern "C" __global__ void fp_bf16_to_f32(const bf16_t* x, float* y, u64 n) {
    for (u64 e = fp_gid(); e < n; e += fp_gstride()) {
        y[e] = fp_bf16_to_f32(x[e]);
    }
}
