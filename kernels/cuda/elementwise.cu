// Element-wise kernels: embedding gather, bias and residual adds, SiLU-gate, column and row
// copies (gather / scatter; f32 and bf16 buffers), f32 <-> bf16. Grid-stride loops: any grid
// size is correct.

// out[r, c] = table[ids[r], c] (f32 table).
extern "C" __global__ void fp_embedding_f32(const float* table, const u32* ids, float* out, u32 n, u32 cols) {
    u64 total = (u64)n * cols;
    for (u64 e = fp_gid(); e < total; e += fp_gstride()) {
        u64 r = e / cols, c = e % cols;
        out[e] = table[(u64)ids[r] * cols + c];
    }
}

// out[r, c] = table[ids[r], c] (bf16 table).
extern "C" __global__ void fp_embedding_bf16(const bf16_t* table, const u32* ids, float* out, u32 n, u32 cols) {
    u64 total = (u64)n * cols;
    for (u64 e = fp_gid(); e < total; e += fp_gstride()) {
        u64 r = e / cols, c = e % cols;
        out[e] = fp_bf16_to_f32(table[(u64)ids[r] * cols + c]);
    }
}

// x[r, c] += bias[c].
extern "C" __global__ void fp_add_bias(float* x, const float* bias, u64 n, u32 cols) {
    for (u64 e = fp_gid(); e < n; e += fp_gstride()) {
        x[e] += bias[e % cols];
    }
}

// x += y.
extern "C" __global__ void fp_add_assign(float* x, const float* y, u64 n) {
    for (u64 e = fp_gid(); e < n; e += fp_gstride()) {
        x[e] += y[e];
    }
}

// out[r, c] = silu(g) * u with g = gate_up[r, c], u = gate_up[r, ffn + c].
extern "C" __global__ void fp_silu_mul(const float* gate_up, float* out, u64 rows, u32 ffn) {
    u64 total = rows * ffn;
    for (u64 e = fp_gid(); e < total; e += fp_gstride()) {
        u64 r = e / ffn, c = e % ffn;
        float g = gate_up[r * 2 * ffn + c];
        float u = gate_up[r * 2 * ffn + ffn + c];
        out[e] = g / (1.0f + expf(-g)) * u;
    }
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
