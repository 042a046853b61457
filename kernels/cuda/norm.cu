// RMSNorm, y = x / sqrt(mean(x^2) + eps) * w: one block of FP_NORM_THREADS threads per row.
// Sum of squares: per-thread partial sums, warp shuffles, then the warps' sums in shared memory.

#define FP_NORM_THREADS 256

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
