// RMSNorm, y = x / sqrt(mean(x^2) + eps) * w (w f32), the sums in f32.
// f32 rows: one block of FP_NORM_THREADS threads per row. Sum of squares: per-thread partial
// sums, warp shuffles, then the warps' sums in shared memory.
//
// A row whose sum of squares overflows f32 (|x| past about 1.8e19, or a row of values near it;
// NaN and inf inputs too) is summed a second time with every value scaled by 2^-80 first, as
// kernels/src/norm.rs redoes such a row in f64. The common path is unchanged: one f32 pass, and
// the test of the total is one compare per row (the same for every thread of the block or warp,
// so it does not diverge); a double sum would need double shuffles and shared memory for a case
// that never happens with normal activations. The scale is a power of two, so x * 2^-80 is
// exact (a value below about 2^-46 becomes subnormal, and its output is far below the
// tolerance anyway). After scaling, a square is at most 2^96 (|x| <= f32::MAX < 2^128) and the
// sum of 2^24 columns at most 2^120: finite. A row only gets here with a sum of squares of at
// least 2^128, so its largest square, scaled, is at least 2^-32 / cols: the squares that
// underflow to zero (|x| below about 2^5.5) are far below its ulp. The norm is then
// rsqrt(mean(xs^2) + eps * s^2) = inv_rms / s, and each output (x * s) * that * w; eps * s^2
// underflows to zero, negligible next to a mean square of at least 2^-32. With s = 1 (the
// common path) this is the plain formula bit for bit. NaN or inf inputs give NaN or inf
// sums on both passes and end as on the CPU: NaN for a NaN or infinite value, 0 or NaN beside
// them.

// The scale of the second pass, 2^-80.
#define FP_NORM_SCALE 0x1p-80f
// Not finite: inf or NaN (the NaN compare is false).
#define FP_NORM_OVERFLOWED(t) (!((t) <= 3.402823466e38f))

// Sum of the squares of xr[0..cols) * scale over the block, returned to every thread. Two
// barriers; a second call may follow at once (warp_sums is read before the second barrier,
// total is written after the next call's first).
__device__ __forceinline__ float fp_norm_block_sum_sq(const float* xr, u32 cols, float scale, float* warp_sums,
                                                      float* total) {
    float ss = 0.0f;
    for (u32 c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = xr[c] * scale;
        ss += v * v;
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
            *total = t;
        }
    }
    __syncthreads();
    return *total;
}

extern "C" __global__ void fp_rms_norm(const float* x, const float* w, float eps, float* out, u32 rows, u32 cols) {
    __shared__ float warp_sums[FP_NORM_THREADS / 32];
    __shared__ float total;
    u32 row = blockIdx.x;
    if (row >= rows) {
        return;  // the whole block leaves together: no barrier is skipped by part of it
    }
    const float* xr = x + (u64)row * cols;
    float scale = 1.0f;
    float t = fp_norm_block_sum_sq(xr, cols, scale, warp_sums, &total);
    if (FP_NORM_OVERFLOWED(t)) {
        // Every thread read the same total: the whole block takes this branch, or none of it.
        scale = FP_NORM_SCALE;
        t = fp_norm_block_sum_sq(xr, cols, scale, warp_sums, &total);
    }
    float s = rsqrtf(t / (float)cols + eps * scale * scale);
    for (u32 c = threadIdx.x; c < cols; c += blockDim.x) {
        out[(u64)row * cols + c] = xr[c] * scale * s * w[c];
    }
}

// Sum of the squares of a bf16 row's values * scale over the warp, returned to every lane.
__device__ __forceinline__ float fp_norm_warp_sum_sq_bf16(const bf16_t* xr, u32 cols, bool wide, u32 lane,
                                                          float scale) {
    float ss = 0.0f;
    if (wide) {
        for (u32 c = lane * 8; c < cols; c += 32 * 8) {
            float f[8];
            fp_ld8(xr + c, f);
            for (int i = 0; i < 8; i++) {
                float v = f[i] * scale;
                ss += v * v;
            }
        }
    } else {
        for (u32 c = lane; c < cols; c += 32) {
            float v = fp_bf16_to_f32(xr[c]) * scale;
            ss += v * v;
        }
    }
    return fp_warp_sum(ss);
}

// bf16 rows (the bf16 forward): one warp per row, FP_NORM_WARP_ROWS rows per block, no shared
// memory and no block barrier. Eight values per 16-byte load and store where a row is a whole
// number of them and both rows are aligned (every model here: d_model and head_dim are
// multiples of 8), one value per lane otherwise. The second pass re-reads the row (from L1).
// Each output is x * inv_rms * w in f32, rounded once. bf16 has f32's range: a row whose sum
// of squares overflows is summed again scaled, as in fp_rms_norm (the comment at the top).
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
    float scale = 1.0f;
    float t = fp_norm_warp_sum_sq_bf16(xr, cols, wide, lane, scale);
    if (FP_NORM_OVERFLOWED(t)) {
        // The warp sum is the same in every lane: the whole warp takes this branch, or none of it.
        scale = FP_NORM_SCALE;
        t = fp_norm_warp_sum_sq_bf16(xr, cols, wide, lane, scale);
    }
    float s = rsqrtf(t / (float)cols + eps * scale * scale);
    if (wide) {
        for (u32 c = lane * 8; c < cols; c += 32 * 8) {
            float f[8];
            fp_ld8(xr + c, f);
            for (int i = 0; i < 8; i++) {
                f[i] = f[i] * scale * s * w[c + i];
            }
            fp_st8(orow + c, f);
        }
    } else {
        for (u32 c = lane; c < cols; c += 32) {
            orow[c] = fp_f32_to_bf16(fp_bf16_to_f32(xr[c]) * scale * s * w[c]);
        }
    }
}
