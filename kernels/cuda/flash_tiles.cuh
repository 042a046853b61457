// The tile steps of the reference tensor-core kernels (flash.cu, flash_scores.cu): the
// cp.async copies of a key tile and of packed query rows into padded shared memory, the Q
// fragments of a warp, and S = Q K^T over one key tile by mma.sync. Prepended with common.cuh
// to every kernel program (gpu::program); templates nothing else instantiates cost nothing.
// FP_FA_ROWS, FP_FA_KEYS, FP_FA_THREADS come from the launch-shape header (gpu::shapes).

#ifndef FP_FLASH_TILES_CUH
#define FP_FLASH_TILES_CUH

#if !defined(FP_FA_ROWS) || !defined(FP_FA_KEYS) || !defined(FP_FA_THREADS)
#error "the flash tiles need the launch-shape header of flowprefill_kernels::gpu::shapes"
#endif

// Issues the cp.async copies of key tile `tile` (K and V rows of KV head kh, and positions)
// into one stage; rows at or past n are zero-filled (and masked by their index).
template <int D, bool WITH_V>
__device__ __forceinline__ void fp_fa_load_kv(bf16_t* k_dst, bf16_t* v_dst, u32* kpos_dst, const bf16_t* k,
                                              const bf16_t* v, const u32* kpos, u32 tile, u32 n, u32 kh,
                                              u64 row_stride) {
    constexpr u32 S = D + 8, CH = D / 8;
    for (u32 c = threadIdx.x; c < FP_FA_KEYS * CH; c += FP_FA_THREADS) {
        u32 r = c / CH, ch = c % CH;
        u32 key = tile * FP_FA_KEYS + r;
        bool ok = key < n;
        u64 off = ok ? (u64)key * row_stride + (u64)kh * D + ch * 8 : 0;
        fp_cp_async16(k_dst + r * S + ch * 8, k + off, ok ? 16 : 0);
        if (WITH_V) {
            fp_cp_async16(v_dst + r * S + ch * 8, v + off, ok ? 16 : 0);
        }
    }
    if (threadIdx.x < FP_FA_KEYS / 4) {
        u32 key = tile * FP_FA_KEYS + threadIdx.x * 4;
        if (key + 4 <= n) {
            fp_cp_async16(kpos_dst + threadIdx.x * 4, kpos + key, 16);
        } else {
            // The list's end: no copy reads past it (see fp_cp_async4), zeros after.
            for (u32 i = 0; i < 4; i++) {
                bool ok = key + i < n;
                fp_cp_async4(kpos_dst + threadIdx.x * 4 + i, kpos + (ok ? key + i : 0u), ok ? 4 : 0);
            }
        }
    }
}

// Issues the cp.async copies of the packed query rows [row0, row0 + 64) of KV head kh.
template <int D>
__device__ __forceinline__ void fp_fa_load_q(bf16_t* q_dst, const bf16_t* q, u32 row0, u32 packed, u32 group,
                                             u32 n_heads, u32 kh) {
    constexpr u32 S = D + 8, CH = D / 8;
    for (u32 c = threadIdx.x; c < FP_FA_ROWS * CH; c += FP_FA_THREADS) {
        u32 r = c / CH, ch = c % CH;
        u32 pr = row0 + r;
        bool ok = pr < packed;
        u64 off = ok ? ((u64)(pr / group) * n_heads + (u64)kh * group + pr % group) * D + ch * 8 : 0;
        fp_cp_async16(q_dst + r * S + ch * 8, q + off, ok ? 16 : 0);
    }
}

// S (16 rows of this warp x 64 keys) = Q K^T over D, Q fragments from registers.
template <int D>
__device__ __forceinline__ void fp_fa_scores_tile(float s[FP_FA_KEYS / 8][4], const u32 qf[D / 16][4],
                                                  const bf16_t* ks, u32 lane) {
    constexpr u32 S = D + 8;
    FP_UNROLL
    for (int j = 0; j < FP_FA_KEYS / 8; j++) {
        s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
    }
    FP_UNROLL
    for (int kk = 0; kk < D / 16; kk++) {
        FP_UNROLL
        for (int j2 = 0; j2 < FP_FA_KEYS / 16; j2++) {
            // K is stored [key][dim]: the B operands of keys 16 j2 .. 16 j2 + 15, columns first.
            u32 key = j2 * 16 + fp_ldm_row_cols_first(lane);
            u32 col = kk * 16 + fp_ldm_col_cols_first(lane);
            u32 b[4];
            fp_ldmatrix_x4(b, ks + key * S + col);
            fp_mma_bf16_16816(s[2 * j2], qf[kk], b);
            fp_mma_bf16_16816(s[2 * j2 + 1], qf[kk], b + 2);
        }
    }
}

// The A fragments of this warp's 16 query rows (D / 16 slices of k16) from shared memory.
template <int D>
__device__ __forceinline__ void fp_fa_q_fragments(u32 qf[D / 16][4], const bf16_t* q_s, u32 warp, u32 lane) {
    constexpr u32 S = D + 8;
    FP_UNROLL
    for (int kk = 0; kk < D / 16; kk++) {
        u32 r = warp * 16 + fp_ldm_row_rows_first(lane);
        u32 c = kk * 16 + fp_ldm_col_rows_first(lane);
        fp_ldmatrix_x4(qf[kk], q_s + r * S + c);
    }
}

#endif  // FP_FLASH_TILES_CUH
