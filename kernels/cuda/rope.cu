// RoPE at explicit positions, in place: token t of x ([tokens, n_heads, head_dim]) rotated by
// positions[t]. One thread per rotated pair. cos/sin come from the host-built table (the same
// f64-computed values as the CPU kernel) below table_len, else from sincos in double. A bf16
// x is rotated in f32 and rounded once (to nearest even) when stored.

template <typename T>
__device__ __forceinline__ void fp_rope_impl(T* x, u32 tokens, u32 n_heads, u32 head_dim, u32 rot_dim, u32 interleaved,
                                             const u32* positions, const float* cos_t, const float* sin_t,
                                             u32 table_len, const double* inv_freq) {
    u32 half = rot_dim / 2;
    u64 total = (u64)tokens * n_heads * half;
    for (u64 e = fp_gid(); e < total; e += fp_gstride()) {
        u32 i = (u32)(e % half);
        u64 th = e / half;  // token * n_heads + head
        u32 t = (u32)(th / n_heads);
        u32 p = positions[t];
        float c, s;
        if (p < table_len) {
            c = cos_t[(u64)p * half + i];
            s = sin_t[(u64)p * half + i];
        } else {
            double sd, cd;
            sincos((double)p * inv_freq[i], &sd, &cd);
            c = (float)cd;
            s = (float)sd;
        }
        T* head = x + th * head_dim;
        u32 ia = interleaved ? 2 * i : i;
        u32 ib = interleaved ? 2 * i + 1 : i + half;
        float a = fp_ld(head + ia), b = fp_ld(head + ib);
        fp_st(head + ia, a * c - b * s);
        fp_st(head + ib, a * s + b * c);
    }
}

extern "C" __global__ void fp_rope(float* x, u32 tokens, u32 n_heads, u32 head_dim, u32 rot_dim, u32 interleaved,
                                   const u32* positions, const float* cos_t, const float* sin_t, u32 table_len,
                                   const double* inv_freq) {
    fp_rope_impl(x, tokens, n_heads, head_dim, rot_dim, interleaved, positions, cos_t, sin_t, table_len, inv_freq);
}

extern "C" __global__ void fp_rope_bf16(bf16_t* x, u32 tokens, u32 n_heads, u32 head_dim, u32 rot_dim,
                                        u32 interleaved, const u32* positions, const float* cos_t, const float* sin_t,
                                        u32 table_len, const double* inv_freq) {
    fp_rope_impl(x, tokens, n_heads, head_dim, rot_dim, interleaved, positions, cos_t, sin_t, table_len, inv_freq);
}
