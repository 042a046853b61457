// Shared by every kernel file of flowprefill. It is prepended to each `.cu` source when NVRTC
// compiles it for a GPU, and included after `cpu_shim.h` when the same source runs on the CPU
// in the tests. It needs no CUDA header: bf16 is handled as raw bits.
//
// Conventions of the kernels: one-dimensional blocks; element counts as 64-bit integers;
// every thread of a warp takes part in every shuffle (no early return before one); no
// dynamic shared memory.

typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned short bf16_t;

#define FP_LOG2E 1.4426950408889634f
#define FP_LN2 0.6931471805599453f
#define FP_FULL_MASK 0xffffffffu
// +infinity without <math.h> (NVRTC has none).
#define FP_INF __uint_as_float(0x7f800000u)

// bf16 -> f32: the high half of the f32 bits.
__device__ __forceinline__ float fp_bf16_to_f32(bf16_t b) {
    return __uint_as_float(((u32)b) << 16);
}

// f32 -> bf16, rounding to nearest even; NaN stays NaN.
__device__ __forceinline__ bf16_t fp_f32_to_bf16(float f) {
    u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return (bf16_t)((x >> 16) | 0x40u);
    }
    x += 0x7fffu + ((x >> 16) & 1u);
    return (bf16_t)(x >> 16);
}

__device__ __forceinline__ float fp_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) {
        v += __shfl_xor_sync(FP_FULL_MASK, v, o);
    }
    return v;
}

__device__ __forceinline__ float fp_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(FP_FULL_MASK, v, o));
    }
    return v;
}

// First element and stride of a grid-stride loop.
__device__ __forceinline__ u64 fp_gid() {
    return (u64)blockIdx.x * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ u64 fp_gstride() {
    return (u64)gridDim.x * blockDim.x;
}
