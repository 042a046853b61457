// RMSNorm, y = x / sqrt(mean(x^2) + eps) * w (w f32), the sums in f32.
// f32 rows: one block of FP_NORM_THREADS threads per row. Sum of squares: per-thread partial
// sums, warp shuffles, then the warps' sums in shared memory.

extern "C" __global__ void fp_rms_norm(const float* x, const float* w, float eps, float* out, u32 rows, u32 cols) {
    __shared__ float warp_sums[FP_NORM_THREADS / 32];
    __shared__ float inv_rms;
    u32 row = blockIdx.x;
    if (row >= rows) {
        return;  // the whole block leaves together: no barrier is skipped by part of it
    }
    const float* xr = x + (u64)row * cols;
    float ss = 0.0f;
    for (u32 c = threadIdx.x; c < cols; c += blockDim.x) {
        ss += xr[c] * xr[c];
    }
    ss = fp_warp_sum(ss);
    u32 lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) {
        warp_sums[warp] = ss;
    }
    __syncthreads();
    if (warp == 0) {
        float t = lane < blockDim.x / 32 ? warp_sums[lane] : 0.0f;
        t = fp_warp_sum(t);
        if (lane == 0) {
            inv_rms = rsqrtf(t / (float)cols + eps);
        }
    }
    __syncthreads();
    float s = inv_rms;
    for (u32 c = threadIdx.x; c < cols; c += blockDim.x) {
        out[(u64)row * cols + c] = xr[c] * s * w[c];
    }
}

// bf16 rows (the bf16 forward): one warp per row, FP_NORM_WARP_ROWS rows per block, no shared
// memory and no block barrier. Eight values per 16-byte load and store where a row is a whole
// number of them and both rows are aligned (every model here: d_model and head_dim are
// multiples of 8), one value per lane otherwise. The second pass re-reads the row (from L1).
// Each output is x * inv_rms * w in f32, rounded once.
extern "C" __global__ void fp_rms_norm_bf16(const bf16_t* x, const float* w, float eps, bf16_t* out, u32 rows,
                                            u32 cols) {
    u32 lane = threadIdx.x % 32;
    u32 row = blockIdx.x * FP_NORM_WARP_ROWS + threadIdx.x / 32;
    if (row >= rows) {
        return;  // the whole warp leaves together
    }
    const bf16_t* xr = x + (u64)row * cols;
    bf16_t* orow = out + (u64)row * cols;
    bool wide = cols % 8 == 0 && ((u64)xr % 16) == 0 && ((u64)orow % 16) == 0;
    float ss = 0.0f;
    if (wide) {
        for (u32 c = lane * 8; c < cols; c += 32 * 8) {
            float f[8];
            fp_ld8(xr + c, f);
            for (int i = 0; i < 8; i++) {
                ss += f[i] * f[i];
            }
        }
    } else {
        for (u32 c = lane; c < cols; c += 32) {
            float f = fp_bf16_to_f32(xr[c]);
            ss += f * f;
        }
    }
    float s = rsqrtf(fp_warp_sum(ss) / (float)cols + eps);
    if (wide) {
        for (u32 c = lane * 8; c < cols; c += 32 * 8) {
            float f[8];
            fp_ld8(xr + c, f);
            for (int i = 0; i < 8; i++) {
                f[i] = f[i] * s * w[c + i];
            }
            fp_st8(orow + c, f);
        }
    } else {
        for (u32 c = lane; c < cols; c += 32) {
            orow[c] = fp_f32_to_bf16(fp_bf16_to_f32(xr[c]) * s * w[c]);
        }
    }
}
