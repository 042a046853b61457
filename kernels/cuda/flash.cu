// Tensor-core attention (FlashAttention-2 style) with explicit positions (the per-key
// attention mass on the same tiles is flash_scores.cu). The contract of attention.cu, on bf16 inputs:
//
//   q   [M, n_heads,    D] bf16   qpos [M]     key j is visible to query i iff
//   k,v [N, n_kv_heads, D] bf16   kpos [N]     kpos[j] <= qpos[i]; query head h reads
//   out [M, n_heads,    D] f32    lse  [M, n_heads] (natural log)   KV head h / (n_heads / n_kv_heads)
//
// D = 64 or 128. A query with no visible key gets out = 0, lse = -inf, so partial results
// merge exactly (merge.cu).
//
// Block = one KV head x FP_FA_ROWS packed rows: packed row r of KV head kh is query r / g,
// head kh g + r % g (g = n_heads / n_kv_heads), so one K/V tile in shared memory serves the
// g heads of the group, and a decode step (M = 1) fills g rows of the MMA instead of one.
// 4 warps x 16 rows. Grid (q tiles, n_kv_heads, splits): split z takes the key tiles
// [z tiles_per_split, (z + 1) tiles_per_split) and writes its partial (out, lse) at offset
// z (M n_heads) of `out` / `lse` (flash-decoding; fp_attn_combine merges them).
//
// Per key tile of FP_FA_KEYS keys (double-buffered with cp.async: tile t+1 loads while t is
// used): S = Q K^T by mma.sync m16n8k16 (Q fragments stay in registers, K read by ldmatrix);
// scale to base 2; mask (only tiles where some key is above some query's position); online
// softmax per row (max over the 4 lanes of a row by shuffles; the row sums stay per lane
// until the end); P packed to bf16 in place (the C fragments of two n8 tiles of S are the A
// fragment of one k16 slice); O += P V with V read by ldmatrix.trans. A key tile whose
// smallest position is above every query of the block is skipped without being loaded
// (ktile_lo / ktile_hi: the host's min / max position per tile), so causal prefill does half
// the work and a sorted chunk layout skips whole chunks.
//
// Shared memory (dynamic, gpu/ops.rs: flash_shared_bytes): Q [64][D+8], K and V [2][64][D+8],
// kpos [2][64]; rows padded by 16 bytes so that the 8 rows of an ldmatrix hit 8 different
// 16-byte bank groups.

// FP_FA_ROWS (64), FP_FA_KEYS (64), FP_FA_THREADS (128): defined by the launch-shape header of
// flowprefill_kernels::gpu::shapes, written before this file.
// The tile steps (copies, Q fragments, S = Q K^T) are flash_tiles.cuh's.

template <int D>
__device__ __forceinline__ void fp_flash_attn(const bf16_t* q, const u32* qpos, const bf16_t* k, const bf16_t* v,
                                              const u32* kpos, const u32* ktile_lo, const u32* ktile_hi, float* out,
                                              bf16_t* out_b, float* lse, u32 m, u32 n, u32 n_heads, u32 n_kv_heads,
                                              float scale_log2, u32 tiles_per_split) {
    constexpr u32 S = D + 8, NT = FP_FA_KEYS / 8, DT = D / 8;
    FP_DYNAMIC_SMEM(smem);
    bf16_t* q_s = (bf16_t*)smem;
    bf16_t* k_s = q_s + FP_FA_ROWS * S;
    bf16_t* v_s = k_s + 2 * FP_FA_KEYS * S;
    u32* kpos_s = (u32*)(v_s + 2 * FP_FA_KEYS * S);
    __shared__ u32 q_range[2];

    const u32 lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const u32 group = n_heads / n_kv_heads;
    const u32 kh = blockIdx.y;
    const u32 packed = m * group;
    // The last query tile first: with sorted positions it sees the most keys.
    const u32 row0 = (gridDim.x - 1 - blockIdx.x) * FP_FA_ROWS;
    const u32 key_tiles = (n + FP_FA_KEYS - 1) / FP_FA_KEYS;
    const u32 t_begin = blockIdx.z * tiles_per_split;
    const u32 t_end = min(key_tiles, t_begin + tiles_per_split);
    const u64 kv_stride = (u64)n_kv_heads * D;
    float* out_split = out + (u64)blockIdx.z * m * n_heads * D;
    float* lse_split = lse + (u64)blockIdx.z * m * n_heads;

    fp_fa_load_q<D>(q_s, q, row0, packed, group, n_heads, kh);
    fp_cp_async_commit();
    if (warp == 0) {
        fp_fa_query_range(q_range, qpos, row0, FP_FA_ROWS, packed, group, lane);
    }
    // This lane's two rows of the tile: ra (C fragment elements 0, 1) and ra + 8 (2, 3).
    const u32 ra = row0 + warp * 16 + lane / 4, rb = ra + 8;
    const u32 qp_a = ra < packed ? qpos[ra / group] : 0u;
    const u32 qp_b = rb < packed ? qpos[rb / group] : 0u;
    __syncthreads();
    const u32 qlo = q_range[0], qhi = q_range[1];

    u32 t = t_begin;
    while (t < t_end && ktile_lo[t] > qhi) {
        t++;
    }
    if (t < t_end) {
        fp_fa_load_kv<D, true>(k_s, v_s, kpos_s, k, v, kpos, t, n, kh, kv_stride);
    }
    fp_cp_async_commit();
    fp_cp_async_wait<1>();  // the query tile (the older group)
    __syncthreads();
    u32 qf[D / 16][4];
    fp_fa_q_fragments<D>(qf, q_s, warp, lane);

    float o[DT][4];
    FP_UNROLL
    for (int c = 0; c < (int)DT; c++) {
        o[c][0] = o[c][1] = o[c][2] = o[c][3] = 0.0f;
    }
    float m_a = -FP_INF, m_b = -FP_INF, l_a = 0.0f, l_b = 0.0f;
    u32 stage = 0;
    while (t < t_end) {
        u32 next = t + 1;
        while (next < t_end && ktile_lo[next] > qhi) {
            next++;
        }
        if (next < t_end) {
            u32 o2 = (stage ^ 1u) * FP_FA_KEYS;
            fp_fa_load_kv<D, true>(k_s + o2 * S, v_s + o2 * S, kpos_s + o2, k, v, kpos, next, n, kh, kv_stride);
        }
        fp_cp_async_commit();
        fp_cp_async_wait<1>();  // tile t
        __syncthreads();
        const bf16_t* ks = k_s + stage * FP_FA_KEYS * S;
        const bf16_t* vs = v_s + stage * FP_FA_KEYS * S;
        const u32* kps = kpos_s + stage * FP_FA_KEYS;

        float s[NT][4];
        fp_fa_scores_tile<D>(s, qf, ks, lane);
        const bool full = ktile_hi[t] <= qlo && (t + 1) * FP_FA_KEYS <= n;
        float mx_a = -FP_INF, mx_b = -FP_INF;
        FP_UNROLL
        for (int j = 0; j < (int)NT; j++) {
            FP_UNROLL
            for (int e = 0; e < 4; e++) {
                float x = s[j][e] * scale_log2;
                if (!full) {
                    u32 col = j * 8 + (lane & 3) * 2 + (e & 1);
                    u32 key = t * FP_FA_KEYS + col;
                    if (key >= n || kps[col] > (e < 2 ? qp_a : qp_b)) {
                        x = -FP_INF;
                    }
                }
                s[j][e] = x;
            }
            mx_a = fmaxf(mx_a, fmaxf(s[j][0], s[j][1]));
            mx_b = fmaxf(mx_b, fmaxf(s[j][2], s[j][3]));
        }
        mx_a = fmaxf(mx_a, __shfl_xor_sync(FP_FULL_MASK, mx_a, 1));
        mx_a = fmaxf(mx_a, __shfl_xor_sync(FP_FULL_MASK, mx_a, 2));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(FP_FULL_MASK, mx_b, 1));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(FP_FULL_MASK, mx_b, 2));
        const float new_a = fmaxf(m_a, mx_a), new_b = fmaxf(m_b, mx_b);
        // A row that has seen nothing yet subtracts 0 (never -inf - -inf).
        const float base_a = new_a == -FP_INF ? 0.0f : new_a, base_b = new_b == -FP_INF ? 0.0f : new_b;
        const float alpha_a = fp_exp2(m_a - base_a), alpha_b = fp_exp2(m_b - base_b);
        m_a = new_a;
        m_b = new_b;
        float sum_a = 0.0f, sum_b = 0.0f;
        FP_UNROLL
        for (int j = 0; j < (int)NT; j++) {
            s[j][0] = fp_exp2(s[j][0] - base_a);
            s[j][1] = fp_exp2(s[j][1] - base_a);
            s[j][2] = fp_exp2(s[j][2] - base_b);
            s[j][3] = fp_exp2(s[j][3] - base_b);
            sum_a += s[j][0] + s[j][1];
            sum_b += s[j][2] + s[j][3];
        }
        l_a = l_a * alpha_a + sum_a;
        l_b = l_b * alpha_b + sum_b;
        FP_UNROLL
        for (int c = 0; c < (int)DT; c++) {
            o[c][0] *= alpha_a;
            o[c][1] *= alpha_a;
            o[c][2] *= alpha_b;
            o[c][3] *= alpha_b;
        }
        FP_UNROLL
        for (int kk = 0; kk < (int)NT / 2; kk++) {
            u32 a[4] = {fp_pack_bf16x2(s[2 * kk][0], s[2 * kk][1]), fp_pack_bf16x2(s[2 * kk][2], s[2 * kk][3]),
                        fp_pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                        fp_pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
            FP_UNROLL
            for (int c2 = 0; c2 < (int)DT / 2; c2++) {
                // V is stored [key][dim] = [k][n]: rows first, transposed.
                u32 key = kk * 16 + fp_ldm_row_rows_first(lane);
                u32 col = c2 * 16 + fp_ldm_col_rows_first(lane);
                u32 b[4];
                fp_ldmatrix_x4_trans(b, vs + key * S + col);
                fp_mma_bf16_16816(o[2 * c2], a, b);
                fp_mma_bf16_16816(o[2 * c2 + 1], a, b + 2);
            }
        }
        __syncthreads();  // every warp is done with this stage before it is refilled
        stage ^= 1u;
        t = next;
    }
    fp_cp_async_wait<0>();  // the last group (empty) retires before the block ends

    l_a += __shfl_xor_sync(FP_FULL_MASK, l_a, 1);
    l_a += __shfl_xor_sync(FP_FULL_MASK, l_a, 2);
    l_b += __shfl_xor_sync(FP_FULL_MASK, l_b, 1);
    l_b += __shfl_xor_sync(FP_FULL_MASK, l_b, 2);
    FP_UNROLL
    for (int half = 0; half < 2; half++) {
        const u32 pr = half ? rb : ra;
        if (pr >= packed) {
            continue;
        }
        const float l = half ? l_b : l_a, mrow = half ? m_b : m_a;
        const u64 row = (u64)(pr / group) * n_heads + (u64)kh * group + pr % group;
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        const u64 dst = row * D + (lane & 3) * 2;
        FP_UNROLL
        for (int c = 0; c < (int)DT; c++) {
            fp_st_out2(out_split, out_b, dst + c * 8, o[c][2 * half] * inv, o[c][2 * half + 1] * inv);
        }
        if ((lane & 3) == 0) {
            lse_split[row] = l > 0.0f ? (mrow + log2f(l)) * FP_LN2 : -FP_INF;
        }
    }
}

extern "C" __global__ void __launch_bounds__(FP_FA_THREADS, 2)
    fp_flash_attn_d64(const bf16_t* q, const u32* qpos, const bf16_t* k, const bf16_t* v, const u32* kpos,
                      const u32* ktile_lo, const u32* ktile_hi, float* out, bf16_t* out_b, float* lse, u32 m, u32 n,
                      u32 n_heads, u32 n_kv_heads, float scale_log2, u32 tiles_per_split) {
    fp_flash_attn<64>(q, qpos, k, v, kpos, ktile_lo, ktile_hi, out, out_b, lse, m, n, n_heads, n_kv_heads, scale_log2,
                      tiles_per_split);
}

extern "C" __global__ void __launch_bounds__(FP_FA_THREADS, 2)
    fp_flash_attn_d128(const bf16_t* q, const u32* qpos, const bf16_t* k, const bf16_t* v, const u32* kpos,
                       const u32* ktile_lo, const u32* ktile_hi, float* out, bf16_t* out_b, float* lse, u32 m, u32 n,
                       u32 n_heads, u32 n_kv_heads, float scale_log2, u32 tiles_per_split) {
    fp_flash_attn<128>(q, qpos, k, v, kpos, ktile_lo, ktile_hi, out, out_b, lse, m, n, n_heads, n_kv_heads, scale_log2,
                       tiles_per_split);
}
