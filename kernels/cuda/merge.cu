// merge_partial: (out, lse) <- merge with (block_out, block_lse), row by row, in the stable
// form of the CPU kernel (kernels/src/merge.rs): lse = hi + log1p(exp(lo - hi)). A row with
// lse = -inf is empty. One thread per row.

extern "C" __global__ void fp_merge_partial(float* out, float* lse, const float* block_out, const float* block_lse,
                                            u32 rows, u32 head_dim) {
    for (u64 r = fp_gid(); r < rows; r += fp_gstride()) {
        float a = lse[r], b = block_lse[r];
        float* o = out + r * head_dim;
        const float* bo = block_out + r * head_dim;
        if (b == -FP_INF) {
            continue;
        }
        if (a == -FP_INF) {
            for (u32 d = 0; d < head_dim; d++) {
                o[d] = bo[d];
            }
            lse[r] = b;
            continue;
        }
        float hi = fmaxf(a, b), lo = fminf(a, b);
        float l = hi + log1pf(expf(lo - hi));
        float wa = expf(a - l), wb = expf(b - l);
        for (u32 d = 0; d < head_dim; d++) {
            o[d] = wa * o[d] + wb * bo[d];
        }
        lse[r] = l;
    }
}

// The partial results of key splits (flash.cu with splits > 1: part_out [splits, rows,
// head_dim], part_lse [splits, rows]) merged into (out, lse) by log-sum-exp, the rule of
// fp_merge_partial over all splits at once. A split that saw no key (lse = -inf) adds nothing;
// a row no split saw gets out = 0, lse = -inf. One warp per row. out is f32 (`out`) or bf16
// (`out_b`, rounded once from the f32 sum): whichever pointer is given.
extern "C" __global__ void fp_attn_combine(const float* part_out, const float* part_lse, float* out, bf16_t* out_b,
                                           float* lse, u32 rows, u32 head_dim, u32 splits) {
    u32 lane = threadIdx.x % 32;
    u64 row = (u64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= rows) {
        return;  // the whole warp leaves together
    }
    float mx = -FP_INF;
    for (u32 s = lane; s < splits; s += 32) {
        mx = fmaxf(mx, part_lse[(u64)s * rows + row]);
    }
    mx = fp_warp_max(mx);
    const u64 o = row * head_dim;
    if (mx == -FP_INF) {
        for (u32 d = lane; d < head_dim; d += 32) {
            fp_st_out(out, out_b, o + d, 0.0f);
        }
        if (lane == 0) {
            lse[row] = -FP_INF;
        }
        return;
    }
    float sum = 0.0f;
    for (u32 s = lane; s < splits; s += 32) {
        sum += expf(part_lse[(u64)s * rows + row] - mx);
    }
    sum = fp_warp_sum(sum);
    float l = mx + logf(sum);
    for (u32 d = lane; d < head_dim; d += 32) {
        float acc = 0.0f;
        for (u32 s = 0; s < splits; s++) {
            float ls = part_lse[(u64)s * rows + row];
            if (ls != -FP_INF) {
                acc += expf(ls - l) * part_out[((u64)s * rows + row) * head_dim + d];
            }
        }
        fp_st_out(out, out_b, o + d, acc);
    }
    if (lane == 0) {
        lse[row] = l;
    }
}
