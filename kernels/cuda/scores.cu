// Attention mass each key receives, added to scores[j] (the contract of the CPU
// attention_scores): sum over query rows i and heads h of exp(q_ih . k_j * scale - lse_ih),
// for the rows that see key j (kpos[j] <= qpos[i]) and have a finite lse. `lse` may come from
// another rank's merge: the probabilities are then exact for this rank's keys.
//
// One thread per key; it walks every (row, head) of its KV head group. The prompt is short
// (tens of rows), so this is a read of the queries per key, served by the cache. Keys are f32
// or bf16; flash.cu has the tensor-core version for head_dim 64 and 128.

template <typename K>
__device__ __forceinline__ void fp_attention_scores_impl(const float* q, const u32* qpos, const K* k, const u32* kpos,
                                                         const float* lse, float* scores, u32 m, u32 n, u32 n_heads,
                                                         u32 n_kv_heads, u32 head_dim, float scale) {
    u32 group = n_heads / n_kv_heads;
    for (u64 j = fp_gid(); j < n; j += fp_gstride()) {
        u32 kp = kpos[j];
        float total = 0.0f;
        for (u32 kh = 0; kh < n_kv_heads; kh++) {
            const K* kj = k + (j * n_kv_heads + kh) * head_dim;
            for (u32 i = 0; i < m; i++) {
                if (kp > qpos[i]) {
                    continue;
                }
                for (u32 g = 0; g < group; g++) {
                    u32 h = kh * group + g;
                    float l = lse[(u64)i * n_heads + h];
                    if (l == -FP_INF) {
                        continue;
                    }
                    const float* qi = q + ((u64)i * n_heads + h) * head_dim;
                    float dot = 0.0f;
                    for (u32 d = 0; d < head_dim; d++) {
                        dot += qi[d] * fp_ld(kj + d);
                    }
                    total += exp2f((dot * scale - l) * FP_LOG2E);
                }
            }
        }
        scores[j] += total;
    }
}

extern "C" __global__ void fp_attention_scores(const float* q, const u32* qpos, const float* k, const u32* kpos,
                                               const float* lse, float* scores, u32 m, u32 n, u32 n_heads,
                                               u32 n_kv_heads, u32 head_dim, float scale) {
    fp_attention_scores_impl(q, qpos, k, kpos, lse, scores, m, n, n_heads, n_kv_heads, head_dim, scale);
}

extern "C" __global__ void fp_attention_scores_kbf16(const float* q, const u32* qpos, const bf16_t* k, const u32* kpos,
                                                     const float* lse, float* scores, u32 m, u32 n, u32 n_heads,
                                                     u32 n_kv_heads, u32 head_dim, float scale) {
    fp_attention_scores_impl(q, qpos, k, kpos, lse, scores, m, n, n_heads, n_kv_heads, head_dim, scale);
}
