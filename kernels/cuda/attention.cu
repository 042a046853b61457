// Attention with log-sum-exp, the same contract as the CPU kernel (kernels/src/attention):
//
//   q   [M, n_heads,    head_dim]   qpos [M]       key j is visible to query i iff
//   k,v [N, n_kv_heads, head_dim]   kpos [N]       kpos[j] <= qpos[i]; query head h reads
//   out [M, n_heads,    head_dim]   lse  [M, n_heads] (natural log)   KV head h / (n_heads / n_kv_heads)
//
// out is f32 (`out`) or bf16 (`out_b`, rounded once): whichever pointer is given (fp_st_out).
// A query with no visible key gets out = 0, lse = -inf.
//
// One warp per (query row, head), FP_ATT_WARPS warps per block (rows of one head). Keys go in
// tiles of 32, one key per lane: the lane computes its key's score (the query, pre-scaled to
// base 2, sits in shared memory), the warp takes the tile's maximum and updates the online
// softmax; then each lane accumulates its own head_dim / 32 output coordinates over the tile's
// keys, their probabilities broadcast by shuffles. head_dim <= FP_ATT_MAX_DIM. Keys and values
// are f32 or bf16 (a bf16 KV cache); the arithmetic is f32 either way. The tensor-core kernel
// (flash.cu) replaces this one for head_dim 64 and 128 with bf16 K/V.

#define FP_ATT_PER_LANE (FP_ATT_MAX_DIM / 32)

template <typename KV>
__device__ __forceinline__ void fp_attention_impl(const float* q, const u32* qpos, const KV* k, const KV* v,
                                                  const u32* kpos, float* out, bf16_t* out_b, float* lse, u32 m, u32 n,
                                                  u32 n_heads, u32 n_kv_heads, u32 head_dim, float scale) {
    __shared__ float q_s[FP_ATT_WARPS][FP_ATT_MAX_DIM];
    u32 lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    u32 h = blockIdx.y;
    u32 row = blockIdx.x * FP_ATT_WARPS + warp;
    bool active = row < m;  // an inactive warp still runs the loops (uniformly) but writes nothing
    u32 kh = h / (n_heads / n_kv_heads);
    u64 kv_stride = (u64)n_kv_heads * head_dim;
    const float* qr = q + ((u64)(active ? row : 0) * n_heads + h) * head_dim;
    for (u32 d = lane; d < head_dim; d += 32) {
        q_s[warp][d] = qr[d] * scale * FP_LOG2E;
    }
    __syncwarp();
    u32 p = active ? qpos[row] : 0;
    float mx = -FP_INF, sum = 0.0f;
    float acc[FP_ATT_PER_LANE];
    for (int t = 0; t < FP_ATT_PER_LANE; t++) {
        acc[t] = 0.0f;
    }
    for (u32 base = 0; base < n; base += 32) {
        u32 j = base + lane;
        float s = -FP_INF;
        if (active && j < n && kpos[j] <= p) {
            const KV* kj = k + (u64)j * kv_stride + (u64)kh * head_dim;
            float dot = 0.0f;
            for (u32 d = 0; d < head_dim; d++) {
                dot += q_s[warp][d] * fp_ld(kj + d);
            }
            s = dot;
        }
        float tile_max = fp_warp_max(s);
        if (tile_max == -FP_INF) {
            continue;  // uniform across the warp: nothing visible in this tile
        }
        float new_max = fmaxf(mx, tile_max);
        float alpha = exp2f(mx - new_max);  // mx = -inf gives 0
        float w = s == -FP_INF ? 0.0f : exp2f(s - new_max);
        sum = sum * alpha + fp_warp_sum(w);
        for (int t = 0; t < FP_ATT_PER_LANE; t++) {
            acc[t] *= alpha;
        }
        u32 tile = min(32u, n - base);
        for (u32 jj = 0; jj < tile; jj++) {
            float wj = __shfl_sync(FP_FULL_MASK, w, jj);
            if (wj != 0.0f) {
                const KV* vj = v + (u64)(base + jj) * kv_stride + (u64)kh * head_dim;
                for (int t = 0; t < FP_ATT_PER_LANE; t++) {
                    u32 d = lane + 32 * t;
                    if (d < head_dim) {
                        acc[t] += wj * fp_ld(vj + d);
                    }
                }
            }
        }
        mx = new_max;
    }
    if (!active) {
        return;
    }
    const u64 o = ((u64)row * n_heads + h) * head_dim;
    float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int t = 0; t < FP_ATT_PER_LANE; t++) {
        u32 d = lane + 32 * t;
        if (d < head_dim) {
            fp_st_out(out, out_b, o + d, acc[t] * inv);
        }
    }
    if (lane == 0) {
        lse[(u64)row * n_heads + h] = sum > 0.0f ? (mx + log2f(sum)) * FP_LN2 : -FP_INF;
    }
}

extern "C" __global__ void fp_attention(const float* q, const u32* qpos, const float* k, const float* v, const u32* kpos,
                                        float* out, bf16_t* out_b, float* lse, u32 m, u32 n, u32 n_heads,
                                        u32 n_kv_heads, u32 head_dim, float scale) {
    fp_attention_impl(q, qpos, k, v, kpos, out, out_b, lse, m, n, n_heads, n_kv_heads, head_dim, scale);
}

extern "C" __global__ void fp_attention_kvbf16(const float* q, const u32* qpos, const bf16_t* k, const bf16_t* v,
                                               const u32* kpos, float* out, bf16_t* out_b, float* lse, u32 m, u32 n,
                                               u32 n_heads, u32 n_kv_heads, u32 head_dim, float scale) {
    fp_attention_impl(q, qpos, k, v, kpos, out, out_b, lse, m, n, n_heads, n_kv_heads, head_dim, scale);
}
