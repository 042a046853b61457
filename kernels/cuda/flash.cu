// Tensor-core attention (FlashAttention-2 style) with explicit positions, and the per-key
// attention mass on the same tiles. The contract of attention.cu, on bf16 inputs:
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
#if !defined(FP_FA_ROWS) || !defined(FP_FA_KEYS) || !defined(FP_FA_THREADS)
#error "flash.cu needs the launch-shape header of flowprefill_kernels::gpu::shapes"
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
        u32 valid = key < n ? min(4u, n - key) : 0u;
        fp_cp_async16(kpos_dst + threadIdx.x * 4, kpos + (valid ? key : 0u), valid * 4);
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

template <int D>
__device__ __forceinline__ void fp_flash_attn(const bf16_t* q, const u32* qpos, const bf16_t* k, const bf16_t* v,
                                              const u32* kpos, const u32* ktile_lo, const u32* ktile_hi, float* out,
                                              float* lse, u32 m, u32 n, u32 n_heads, u32 n_kv_heads, float scale_log2,
                                              u32 tiles_per_split) {
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
        float* dst = out_split + row * D + (lane & 3) * 2;
        FP_UNROLL
        for (int c = 0; c < (int)DT; c++) {
            dst[c * 8] = o[c][2 * half] * inv;
            dst[c * 8 + 1] = o[c][2 * half + 1] * inv;
        }
        if ((lane & 3) == 0) {
            lse_split[row] = l > 0.0f ? (mrow + log2f(l)) * FP_LN2 : -FP_INF;
        }
    }
}

extern "C" __global__ void __launch_bounds__(FP_FA_THREADS, 2)
    fp_flash_attn_d64(const bf16_t* q, const u32* qpos, const bf16_t* k, const bf16_t* v, const u32* kpos,
                      const u32* ktile_lo, const u32* ktile_hi, float* out, float* lse, u32 m, u32 n, u32 n_heads,
                      u32 n_kv_heads, float scale_log2, u32 tiles_per_split) {
    fp_flash_attn<64>(q, qpos, k, v, kpos, ktile_lo, ktile_hi, out, lse, m, n, n_heads, n_kv_heads, scale_log2,
                      tiles_per_split);
}

extern "C" __global__ void __launch_bounds__(FP_FA_THREADS, 2)
    fp_flash_attn_d128(const bf16_t* q, const u32* qpos, const bf16_t* k, const bf16_t* v, const u32* kpos,
                       const u32* ktile_lo, const u32* ktile_hi, float* out, float* lse, u32 m, u32 n, u32 n_heads,
                       u32 n_kv_heads, float scale_log2, u32 tiles_per_split) {
    fp_flash_attn<128>(q, qpos, k, v, kpos, ktile_lo, ktile_hi, out, lse, m, n, n_heads, n_kv_heads, scale_log2,
                       tiles_per_split);
}

// Per-key attention mass (InfoFlow's selection signal; the contract of scores.cu on bf16
// q and k): scores[j] += sum over rows i and heads h with kpos[j] <= qpos[i] and a finite
// lse of exp(q_ih . k_j scale - lse_ih). A block per tile of FP_FA_KEYS keys walks every KV
// head and every tile of packed query rows: S by mma.sync, p = 2^(s - lse log2 e), column
// sums per lane, then across the 8 row groups of a warp by shuffles and across the 4 warps
// in shared memory, in a fixed order; one thread adds each key's total (no atomics).
template <int D>
__device__ __forceinline__ void fp_flash_scores(const bf16_t* q, const u32* qpos, const bf16_t* k, const u32* kpos,
                                                const float* lse, float* scores, u32 m, u32 n, u32 n_heads,
                                                u32 n_kv_heads, float scale_log2) {
    constexpr u32 S = D + 8, NT = FP_FA_KEYS / 8;
    FP_DYNAMIC_SMEM(smem);
    bf16_t* q_s = (bf16_t*)smem;
    bf16_t* k_s = q_s + FP_FA_ROWS * S;
    u32* kpos_s = (u32*)(k_s + FP_FA_KEYS * S);
    float* col_s = (float*)(kpos_s + FP_FA_KEYS);  // [4 warps][FP_FA_KEYS]

    const u32 lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const u32 group = n_heads / n_kv_heads;
    const u32 packed = m * group;
    const u32 q_tiles = (packed + FP_FA_ROWS - 1) / FP_FA_ROWS;
    const u32 tile = blockIdx.x;
    const u64 kv_stride = (u64)n_kv_heads * D;
    float acc[NT][2];
    FP_UNROLL
    for (int j = 0; j < (int)NT; j++) {
        acc[j][0] = acc[j][1] = 0.0f;
    }
    for (u32 kh = 0; kh < n_kv_heads; kh++) {
        // K and the positions (no V).
        fp_fa_load_kv<D, false>(k_s, nullptr, kpos_s, k, nullptr, kpos, tile, n, kh, kv_stride);
        for (u32 qt = 0; qt < q_tiles; qt++) {
            const u32 row0 = qt * FP_FA_ROWS;
            fp_fa_load_q<D>(q_s, q, row0, packed, group, n_heads, kh);
            fp_cp_async_commit();
            fp_cp_async_wait<0>();
            __syncthreads();
            u32 qf[D / 16][4];
            fp_fa_q_fragments<D>(qf, q_s, warp, lane);
            float s[NT][4];
            fp_fa_scores_tile<D>(s, qf, k_s, lane);
            const u32 ra = row0 + warp * 16 + lane / 4, rb = ra + 8;
            float lse_a = -FP_INF, lse_b = -FP_INF;
            u32 qp_a = 0, qp_b = 0;
            if (ra < packed) {
                qp_a = qpos[ra / group];
                lse_a = lse[(u64)(ra / group) * n_heads + (u64)kh * group + ra % group];
            }
            if (rb < packed) {
                qp_b = qpos[rb / group];
                lse_b = lse[(u64)(rb / group) * n_heads + (u64)kh * group + rb % group];
            }
            FP_UNROLL
            for (int j = 0; j < (int)NT; j++) {
                FP_UNROLL
                for (int e = 0; e < 4; e++) {
                    u32 col = j * 8 + (lane & 3) * 2 + (e & 1);
                    u32 key = tile * FP_FA_KEYS + col;
                    float l = e < 2 ? lse_a : lse_b;
                    u32 qp = e < 2 ? qp_a : qp_b;
                    if (key < n && l != -FP_INF && kpos_s[col] <= qp) {
                        acc[j][e & 1] += fp_exp2(s[j][e] * scale_log2 - l * FP_LOG2E);
                    }
                }
            }
            __syncthreads();  // q_s (and, after the last tile, k_s) may be refilled
        }
    }
    // Columns 8 j + 2 t + {0, 1} are summed over the 8 row groups g of the warp.
    FP_UNROLL
    for (int j = 0; j < (int)NT; j++) {
        FP_UNROLL
        for (int e = 0; e < 2; e++) {
            float x = acc[j][e];
            x += __shfl_xor_sync(FP_FULL_MASK, x, 4);
            x += __shfl_xor_sync(FP_FULL_MASK, x, 8);
            x += __shfl_xor_sync(FP_FULL_MASK, x, 16);
            if (lane < 4) {
                col_s[warp * FP_FA_KEYS + j * 8 + lane * 2 + e] = x;
            }
        }
    }
    __syncthreads();
    if (threadIdx.x < FP_FA_KEYS) {
        u32 key = tile * FP_FA_KEYS + threadIdx.x;
        if (key < n) {
            float total = col_s[threadIdx.x] + col_s[FP_FA_KEYS + threadIdx.x];
            total += col_s[2 * FP_FA_KEYS + threadIdx.x] + col_s[3 * FP_FA_KEYS + threadIdx.x];
            scores[key] += total;
        }
    }
}

extern "C" __global__ void __launch_bounds__(FP_FA_THREADS, 2)
    fp_flash_scores_d64(const bf16_t* q, const u32* qpos, const bf16_t* k, const u32* kpos, const float* lse,
                        float* scores, u32 m, u32 n, u32 n_heads, u32 n_kv_heads, float scale_log2) {
    fp_flash_scores<64>(q, qpos, k, kpos, lse, scores, m, n, n_heads, n_kv_heads, scale_log2);
}

extern "C" __global__ void __launch_bounds__(FP_FA_THREADS, 2)
    fp_flash_scores_d128(const bf16_t* q, const u32* qpos, const bf16_t* k, const u32* kpos, const float* lse,
                         float* scores, u32 m, u32 n, u32 n_heads, u32 n_kv_heads, float scale_log2) {
    fp_flash_scores<128>(q, qpos, k, kpos, lse, scores, m, n, n_heads, n_kv_heads, scale_log2);
}
