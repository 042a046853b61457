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
