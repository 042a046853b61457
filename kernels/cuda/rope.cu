// RoPE at explicit positions: token t of x ([tokens, n_heads, head_dim]) rotated by
// positions[t]. One thread per rotated pair. cos/sin come from the host-built table (the same
// f64-computed values as the CPU kernel), which the host makes long enough for every position
// of the call (RopeTable::rows_for): no angle is computed here (sincos in double precision
// takes a range-reduction slow path with a stack frame). A position past the table (a host
// bug) reads its last row rather than past the end. A bf16
// x is rotated in f32 and rounded once (to nearest even) when stored. `fp_rope` rotates in
// place; `fp_rope_copy` writes the rotation of src into dst and copies the dimensions past
// rot_dim, so that placing a pre-RoPE chunk cache is one pass over it (no zero fill, no copy
// before the rotation).

__device__ __forceinline__ void fp_rope_cos_sin(u32 p, u32 i, u32 half, const float* cos_t, const float* sin_t,
                                                u32 table_len, float* c, float* s) {
    const u64 at = (u64)min(p, table_len - 1) * half + i;
    *c = cos_t[at];
    *s = sin_t[at];
}

template <typename T>
__device__ __forceinline__ void fp_rope_impl(T* x, u32 tokens, u32 n_heads, u32 head_dim, u32 rot_dim, u32 interleaved,
                                             const u32* positions, const float* cos_t, const float* sin_t,
                                             u32 table_len) {
    u32 half = rot_dim / 2;
    u64 total = (u64)tokens * n_heads * half;
    for (u64 e = fp_gid(); e < total; e += fp_gstride()) {
        u32 i = (u32)(e % half);
        u64 th = e / half;  // token * n_heads + head
        u32 t = (u32)(th / n_heads);
        float c, s;
        fp_rope_cos_sin(positions[t], i, half, cos_t, sin_t, table_len, &c, &s);
        T* head = x + th * head_dim;
        u32 ia = interleaved ? 2 * i : i;
        u32 ib = interleaved ? 2 * i + 1 : i + half;
        float a = fp_ld(head + ia), b = fp_ld(head + ib);
        fp_st(head + ia, a * c - b * s);
        fp_st(head + ib, a * s + b * c);
    }
}

extern "C" __global__ void fp_rope(float* x, u32 tokens, u32 n_heads, u32 head_dim, u32 rot_dim, u32 interleaved,
                                   const u32* positions, const float* cos_t, const float* sin_t, u32 table_len) {
    fp_rope_impl(x, tokens, n_heads, head_dim, rot_dim, interleaved, positions, cos_t, sin_t, table_len);
}

extern "C" __global__ void fp_rope_bf16(bf16_t* x, u32 tokens, u32 n_heads, u32 head_dim, u32 rot_dim,
                                        u32 interleaved, const u32* positions, const float* cos_t, const float* sin_t,
                                        u32 table_len) {
    fp_rope_impl(x, tokens, n_heads, head_dim, rot_dim, interleaved, positions, cos_t, sin_t, table_len);
}

// Out of place: per (token, head), rot_dim / 2 rotated pairs and head_dim - rot_dim copied
// values, one thread each.
template <typename T>
__device__ __forceinline__ void fp_rope_copy_impl(const T* src, T* dst, u32 tokens, u32 n_heads, u32 head_dim,
                                                  u32 rot_dim, u32 interleaved, const u32* positions,
                                                  const float* cos_t, const float* sin_t, u32 table_len) {
    u32 half = rot_dim / 2;
    u32 per = half + (head_dim - rot_dim);
    u64 total = (u64)tokens * n_heads * per;
    for (u64 e = fp_gid(); e < total; e += fp_gstride()) {
        u32 i = (u32)(e % per);
        u64 th = e / per;  // token * n_heads + head
        const T* from = src + th * head_dim;
        T* to = dst + th * head_dim;
        if (i >= half) {
            u32 j = rot_dim + (i - half);
            to[j] = from[j];
            continue;
        }
        u32 t = (u32)(th / n_heads);
        float c, s;
        fp_rope_cos_sin(positions[t], i, half, cos_t, sin_t, table_len, &c, &s);
        u32 ia = interleaved ? 2 * i : i;
        u32 ib = interleaved ? 2 * i + 1 : i + half;
        float a = fp_ld(from + ia), b = fp_ld(from + ib);
        fp_st(to + ia, a * c - b * s);
        fp_st(to + ib, a * s + b * c);
    }
}

extern "C" __global__ void fp_rope_copy(const float* src, float* dst, u32 tokens, u32 n_heads, u32 head_dim,
                                        u32 rot_dim, u32 interleaved, const u32* positions, const float* cos_t,
                                        const float* sin_t, u32 table_len) {
    fp_rope_copy_impl(src, dst, tokens, n_heads, head_dim, rot_dim, interleaved, positions, cos_t, sin_t, table_len);
}

extern "C" __global__ void fp_rope_copy_bf16(const bf16_t* src, bf16_t* dst, u32 tokens, u32 n_heads, u32 head_dim,
                                             u32 rot_dim, u32 interleaved, const u32* positions, const float* cos_t,
                                             const float* sin_t, u32 table_len) {
    fp_rope_copy_impl(src, dst, tokens, n_heads, head_dim, rot_dim, interleaved, positions, cos_t, sin_t, table_len);
}

// The QKV projection split for attention, in one pass: from qkv ([rows, q_dim + 2 kv_dim], of
// the activations' type A) it writes q (A, rotated at positions, rounded once), k_pre (the
// cache type T, the keys as projected, rounded once), k (T, the rotation of the stored k_pre
// values, rounded once) and v (T). The same values as the copies and in-place rotations one by
// one (what `Backend::split_qkv_rope` does by default), in one launch instead of seven. Per
// row: a thread per rotated pair or copied value of each query head and each key head, and a
// thread per value.
template <typename A, typename T>
__device__ __forceinline__ void fp_split_qkv_rope_impl(const A* qkv, A* q, T* k_pre, T* k, T* v, u32 rows,
                                                       u32 n_heads, u32 n_kv_heads, u32 head_dim, u32 rot_dim,
                                                       u32 interleaved, const u32* positions, const float* cos_t,
                                                       const float* sin_t, u32 table_len) {
    u32 half = rot_dim / 2;
    u32 per = half + (head_dim - rot_dim);
    u32 q_dim = n_heads * head_dim, kv_dim = n_kv_heads * head_dim;
    u32 q_items = n_heads * per, k_items = n_kv_heads * per;
    u64 per_row = (u64)q_items + k_items + kv_dim;
    u64 total = (u64)rows * per_row;
    u64 stride = (u64)q_dim + 2 * (u64)kv_dim;
    for (u64 e = fp_gid(); e < total; e += fp_gstride()) {
        u64 r = e / per_row;
        u32 i = (u32)(e % per_row);
        const A* row = qkv + r * stride;
        if (i >= q_items + k_items) {
            u32 j = i - q_items - k_items;
            fp_st(v + r * kv_dim + j, fp_ld(row + q_dim + kv_dim + j));
            continue;
        }
        bool is_q = i < q_items;
        u32 w = is_q ? i : i - q_items;
        u32 head = w / per, item = w % per;
        if (item >= half) {
            // A dimension past rot_dim: copied (rounded once for the cache).
            u32 j = head * head_dim + rot_dim + (item - half);
            if (is_q) {
                fp_st(q + r * q_dim + j, fp_ld(row + j));
            } else {
                u64 at = r * kv_dim + j;
                fp_st(k_pre + at, fp_ld(row + q_dim + j));
                k[at] = k_pre[at];
            }
            continue;
        }
        float c, s;
        fp_rope_cos_sin(positions[r], item, half, cos_t, sin_t, table_len, &c, &s);
        u32 ia = head * head_dim + (interleaved ? 2 * item : item);
        u32 ib = head * head_dim + (interleaved ? 2 * item + 1 : item + half);
        if (is_q) {
            float a = fp_ld(row + ia), b = fp_ld(row + ib);
            fp_st(q + r * q_dim + ia, a * c - b * s);
            fp_st(q + r * q_dim + ib, a * s + b * c);
        } else {
            u64 base = r * kv_dim;
            fp_st(k_pre + base + ia, fp_ld(row + q_dim + ia));
            fp_st(k_pre + base + ib, fp_ld(row + q_dim + ib));
            float a = fp_ld(k_pre + base + ia), b = fp_ld(k_pre + base + ib);
            fp_st(k + base + ia, a * c - b * s);
            fp_st(k + base + ib, a * s + b * c);
        }
    }
}

extern "C" __global__ void fp_split_qkv_rope(const float* qkv, float* q, float* k_pre, float* k, float* v, u32 rows,
                                             u32 n_heads, u32 n_kv_heads, u32 head_dim, u32 rot_dim, u32 interleaved,
                                             const u32* positions, const float* cos_t, const float* sin_t,
                                             u32 table_len) {
    fp_split_qkv_rope_impl(qkv, q, k_pre, k, v, rows, n_heads, n_kv_heads, head_dim, rot_dim, interleaved, positions,
                           cos_t, sin_t, table_len);
}

extern "C" __global__ void fp_split_qkv_rope_bf16(const float* qkv, float* q, bf16_t* k_pre, bf16_t* k, bf16_t* v,
                                                  u32 rows, u32 n_heads, u32 n_kv_heads, u32 head_dim, u32 rot_dim,
                                                  u32 interleaved, const u32* positions, const float* cos_t,
                                                  const float* sin_t, u32 table_len) {
    fp_split_qkv_rope_impl(qkv, q, k_pre, k, v, rows, n_heads, n_kv_heads, head_dim, rot_dim, interleaved, positions,
                           cos_t, sin_t, table_len);
}

// bf16 activations (the bf16 forward): qkv and q bf16, the cache bf16 ...
extern "C" __global__ void fp_split_qkv_rope_act_bf16(const bf16_t* qkv, bf16_t* q, bf16_t* k_pre, bf16_t* k,
                                                      bf16_t* v, u32 rows, u32 n_heads, u32 n_kv_heads, u32 head_dim,
                                                      u32 rot_dim, u32 interleaved, const u32* positions,
                                                      const float* cos_t, const float* sin_t, u32 table_len) {
    fp_split_qkv_rope_impl(qkv, q, k_pre, k, v, rows, n_heads, n_kv_heads, head_dim, rot_dim, interleaved, positions,
                           cos_t, sin_t, table_len);
}

// ... or f32 (`--kv-dtype f32` beside bf16 weights).
extern "C" __global__ void fp_split_qkv_rope_act_bf16_kv_f32(const bf16_t* qkv, bf16_t* q, float* k_pre, float* k,
                                                             float* v, u32 rows, u32 n_heads, u32 n_kv_heads,
                                                             u32 head_dim, u32 rot_dim, u32 interleaved,
                                                             const u32* positions, const float* cos_t,
                                                             const float* sin_t, u32 table_len) {
    fp_split_qkv_rope_impl(qkv, q, k_pre, k, v, rows, n_heads, n_kv_heads, head_dim, rot_dim, interleaved, positions,
                           cos_t, sin_t, table_len);
}
