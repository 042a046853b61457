// Tensor-core per-key attention mass, the scores pass beside flash.cu's attention (same tiles,
// same launch shape: FP_FA_ROWS query rows, FP_FA_KEYS keys, FP_FA_THREADS threads; the tile
// steps are flash_tiles.cuh's).
//
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
