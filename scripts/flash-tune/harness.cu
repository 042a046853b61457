// Times one build of kernels/cuda/flash.cu or flash2.cu (its launch shapes from the header
// `flowprefill tune --header N` prints, given to nvcc with -include by scripts/flash-tune/run.sh)
// on the GPU at the shapes of kernels/examples/cuda_attention_bench.rs, and checks its output
// against a plain f32 attention on the same bf16 inputs (relative L2 error; every output
// written: the buffer is NaN-filled before the checked run). For a GPU machine with nvcc and
// no cargo: it measures which launch shape wins before the autotuner exists (issue 51).
// Prints one line per shape: variant, n, heads, d, median ms, TFLOP/s, rel err.
#include <cuda_runtime.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common.cuh"
#include "flash_tiles.cuh"
#include FLASH_SRC

// The kernel pair and launch shape of the build: flash2.cu (FLASH2 defined) or flash.cu.
#ifdef FLASH2
#define H_ROWS(d) ((d) == 64 ? FP_FA2_D64_WARPS * 16 * FP_FA2_D64_WM : FP_FA2_D128_WARPS * 16 * FP_FA2_D128_WM)
#define H_KEYS(d) ((d) == 64 ? FP_FA2_D64_KEYS : FP_FA2_D128_KEYS)
#define H_THREADS(d) ((d) == 64 ? FP_FA2_D64_WARPS * 32 : FP_FA2_D128_WARPS * 32)
#define H_META FP_FA2_META_KEYS
#define H_D64 fp_flash2_attn_d64
#define H_D128 fp_flash2_attn_d128
#else
#define H_ROWS(d) FP_FA_ROWS
#define H_KEYS(d) FP_FA_KEYS
#define H_THREADS(d) FP_FA_THREADS
#define H_META FP_FA_KEYS
#define H_D64 fp_flash_attn_d64
#define H_D128 fp_flash_attn_d128
#endif

#define CK(x)                                                                                  \
    do {                                                                                       \
        cudaError_t e_ = (x);                                                                  \
        if (e_ != cudaSuccess) {                                                               \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

// Plain attention, one thread per (query, head), f32 over the bf16 inputs, causal by position.
__global__ void ref_attn(const bf16_t* q, const bf16_t* k, const bf16_t* v, float* out, u32 m, u32 n,
                         u32 heads, u32 kv, u32 d, float scale) {
    u64 id = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (id >= (u64)m * heads) return;
    u32 i = id / heads, h = id % heads, kh = h / (heads / kv);
    float acc[128];
    for (u32 c = 0; c < d; c++) acc[c] = 0.0f;
    float mx = -INFINITY, l = 0.0f;
    const bf16_t* qr = q + id * d;
    for (u32 j = 0; j <= i && j < n; j++) {
        const bf16_t* kr = k + ((u64)j * kv + kh) * d;
        float s = 0.0f;
        for (u32 c = 0; c < d; c++) s += fp_bf16_to_f32(qr[c]) * fp_bf16_to_f32(kr[c]);
        s *= scale;
        float nm = fmaxf(mx, s), a = expf(mx - nm), p = expf(s - nm);
        const bf16_t* vr = v + ((u64)j * kv + kh) * d;
        for (u32 c = 0; c < d; c++) acc[c] = acc[c] * a + p * fp_bf16_to_f32(vr[c]);
        l = l * a + p;
        mx = nm;
    }
    for (u32 c = 0; c < d; c++) out[id * d + c] = acc[c] / l;
}

static u32 lcg(u64& s) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return (u32)(s >> 33);
}

static std::vector<bf16_t> randn_bf16(size_t len, u64 seed) {
    std::vector<bf16_t> x(len);
    u64 s = seed;
    for (size_t i = 0; i < len; i++) {
        float u = ((lcg(s) & 0xffffff) / 16777216.0f) * 2.0f - 1.0f;  // uniform [-1, 1): std 0.58
        float f = u * 1.7f;
        u32 b;
        memcpy(&b, &f, 4);
        x[i] = (bf16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
    }
    return x;
}

int main(int argc, char** argv) {
    const int runs = argc > 1 ? atoi(argv[1]) : 21;
    struct Shape {
        u32 n, h, kv, d;
        bool check;
    };
    // Only n = argv[2] and d = argv[3] when given (for a profiler run of one shape).
    const u32 only_n = argc > 2 ? atoi(argv[2]) : 0, only_d = argc > 3 ? atoi(argv[3]) : 0;
    const Shape shapes[] = {{777, 9, 3, 64, true},       {1000, 32, 8, 128, true},  {2048, 9, 3, 64, true},
                            {4096, 14, 2, 64, false},    {8192, 14, 2, 64, false},  {2048, 32, 8, 128, true},
                            {8192, 32, 8, 128, false},   {16384, 32, 8, 128, false}, {32768, 32, 8, 128, false},
                            {32768, 14, 2, 64, false}};
    for (const Shape& sh : shapes) {
        if ((only_n && sh.n != only_n) || (only_d && sh.d != only_d)) continue;
        const u32 n = sh.n, m = n, d = sh.d, group = sh.h / sh.kv;
        const int sets = 3;
        std::vector<bf16_t*> q(sets), k(sets), v(sets);
        for (int s = 0; s < sets; s++) {
            size_t qn = (size_t)m * sh.h * d, kn = (size_t)n * sh.kv * d;
            CK(cudaMalloc(&q[s], qn * 2));
            CK(cudaMalloc(&k[s], kn * 2));
            CK(cudaMalloc(&v[s], kn * 2));
            auto hq = randn_bf16(qn, 11 + s), hk = randn_bf16(kn, 101 + s), hv = randn_bf16(kn, 1001 + s);
            CK(cudaMemcpy(q[s], hq.data(), qn * 2, cudaMemcpyHostToDevice));
            CK(cudaMemcpy(k[s], hk.data(), kn * 2, cudaMemcpyHostToDevice));
            CK(cudaMemcpy(v[s], hv.data(), kn * 2, cudaMemcpyHostToDevice));
        }
        const u32 tiles = (n + H_META - 1) / H_META;  // the key metadata's tiles (the host's)
        std::vector<u32> meta(n + 2 * tiles);
        for (u32 j = 0; j < n; j++) meta[j] = j;
        for (u32 t = 0; t < tiles; t++) {
            meta[n + t] = t * H_META;
            meta[n + tiles + t] = std::min(n, (t + 1) * H_META) - 1;
        }
        u32 *kmeta, *qpos;
        CK(cudaMalloc(&kmeta, meta.size() * 4));
        CK(cudaMemcpy(kmeta, meta.data(), meta.size() * 4, cudaMemcpyHostToDevice));
        CK(cudaMalloc(&qpos, m * 4));
        CK(cudaMemcpy(qpos, meta.data(), m * 4, cudaMemcpyHostToDevice));
        float *out, *lse;
        size_t on = (size_t)m * sh.h * d;
        CK(cudaMalloc(&out, on * 4));
        CK(cudaMalloc(&lse, (size_t)m * sh.h * 4));
        const u32 smem = (H_ROWS(d) + 4 * H_KEYS(d)) * (d + 8) * 2 + 2 * H_KEYS(d) * 4;
        auto kern = d == 64 ? H_D64 : H_D128;
        CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        int per_sm = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, H_THREADS(d), smem));
        dim3 grid((m * group + H_ROWS(d) - 1) / H_ROWS(d), sh.kv, 1);
        const float scale_log2 = 1.0f / sqrtf((float)d) * 1.4426950408889634f;
        auto launch = [&](int s) {
            kern<<<grid, H_THREADS(d), smem>>>(q[s], qpos, k[s], v[s], kmeta, kmeta + n, kmeta + n + tiles, out, lse,
                                                m, n, sh.h, sh.kv, scale_log2, tiles);
        };
        double err = -1.0;
        if (sh.check) {
            CK(cudaMemset(out, 0xff, on * 4));  // NaN everywhere: an unwritten output fails
            launch(0);
            CK(cudaGetLastError());
            CK(cudaDeviceSynchronize());
            float* ref;
            CK(cudaMalloc(&ref, on * 4));
            u64 threads = (u64)m * sh.h;
            ref_attn<<<(threads + 127) / 128, 128>>>(q[0], k[0], v[0], ref, m, n, sh.h, sh.kv, d,
                                                     1.0f / sqrtf((float)d));
            CK(cudaGetLastError());
            CK(cudaDeviceSynchronize());
            std::vector<float> a(on), b(on);
            CK(cudaMemcpy(a.data(), out, on * 4, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(b.data(), ref, on * 4, cudaMemcpyDeviceToHost));
            double num = 0, den = 0;
            for (size_t i = 0; i < on; i++) {
                double df = (double)a[i] - b[i];
                num += df * df;
                den += (double)b[i] * b[i];
            }
            err = std::isfinite(num) ? sqrt(num / den) : NAN;
            CK(cudaFree(ref));
        }
        for (int w = 0; w < 3; w++) launch(w % sets);
        CK(cudaGetLastError());
        std::vector<float> ts;
        cudaEvent_t e0, e1;
        CK(cudaEventCreate(&e0));
        CK(cudaEventCreate(&e1));
        for (int r = 0; r < runs; r++) {
            CK(cudaEventRecord(e0));
            launch(r % sets);
            CK(cudaEventRecord(e1));
            CK(cudaEventSynchronize(e1));
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            ts.push_back(ms);
        }
        CK(cudaGetLastError());
        std::sort(ts.begin(), ts.end());
        double med = ts[ts.size() / 2];
        double flops = 4.0 * d * sh.h * ((double)n * (n + 1) / 2);
        printf("%-14s %6u %6u/%u %4u %9.3f %8.1f %9.2e  blk/SM %d smem %u\n", VARIANT, n, sh.h, sh.kv, d, med,
               flops / (med * 1e-3) / 1e12, err, per_sm, smem);
        fflush(stdout);
        for (int s = 0; s < sets; s++) {
            CK(cudaFree(q[s]));
            CK(cudaFree(k[s]));
            CK(cudaFree(v[s]));
        }
        CK(cudaFree(kmeta));
        CK(cudaFree(qpos));
        CK(cudaFree(out));
        CK(cudaFree(lse));
    }
    return 0;
}
