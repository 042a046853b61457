// Shared by every kernel file of flowprefill. It is prepended to each `.cu` source when NVRTC
// compiles it for a GPU, and included after `cpu_shim.h` when the same source runs on the CPU
// in the tests. It needs no CUDA header: bf16 is handled as raw bits.
//
// Conventions of the kernels: element counts as 64-bit integers; every thread of a warp takes
// part in every shuffle and every tensor-core instruction (no early return before one);
// dynamic shared memory only through FP_DYNAMIC_SMEM (the shim gives each launch its own);
// inline PTX only in the wrappers at the end of this file, each with a C++ twin in cpu_shim.h.

// Full unrolling of a loop with a constant trip count (register arrays indexed by the loop
// variable must not fall back to local memory); nothing on the CPU.
#ifndef FP_CPU_SHIM
#define FP_UNROLL _Pragma("unroll")
#else
#define FP_UNROLL
#endif

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

__device__ __forceinline__ u32 fp_warp_min_u32(u32 v) {
    for (int o = 16; o > 0; o >>= 1) {
        v = min(v, __shfl_xor_sync(FP_FULL_MASK, v, o));
    }
    return v;
}

__device__ __forceinline__ u32 fp_warp_max_u32(u32 v) {
    for (int o = 16; o > 0; o >>= 1) {
        v = max(v, __shfl_xor_sync(FP_FULL_MASK, v, o));
    }
    return v;
}

// The smallest and largest query position of the packed rows [row0, row0 + rows) of a
// tensor-core attention block (packed row r is query r / group), into range[0], range[1]; one
// warp calls it (every lane), lane 0 writes.
__device__ __forceinline__ void fp_fa_query_range(u32* range, const u32* qpos, u32 row0, u32 rows, u32 packed,
                                                  u32 group, u32 lane) {
    u32 lo = 0xffffffffu, hi = 0;
    for (u32 r = lane; r < rows; r += 32) {
        if (row0 + r < packed) {
            const u32 p = qpos[(row0 + r) / group];
            lo = min(lo, p);
            hi = max(hi, p);
        }
    }
    lo = fp_warp_min_u32(lo);
    hi = fp_warp_max_u32(hi);
    if (lane == 0) {
        range[0] = lo;
        range[1] = hi;
    }
}

// Loads of f32 or bf16 elements as f32 (kernels templated over a buffer's element type).
__device__ __forceinline__ float fp_ld(const float* p) {
    return *p;
}
__device__ __forceinline__ float fp_ld(const bf16_t* p) {
    return fp_bf16_to_f32(*p);
}
__device__ __forceinline__ void fp_st(float* p, float v) {
    *p = v;
}
__device__ __forceinline__ void fp_st(bf16_t* p, float v) {
    *p = fp_f32_to_bf16(v);
}

// Eight bf16 values as one 16-byte load or store (the address 16-byte aligned; the CPU shim
// copies bytes, so its host buffers need no alignment).
struct fp_bf16x8 {
    u32 w[4];
};
__device__ __forceinline__ void fp_ld8(const bf16_t* p, float f[8]) {
    fp_bf16x8 v;
#ifdef FP_CPU_SHIM
    std::memcpy(&v, p, 16);
#else
    uint4 u = *reinterpret_cast<const uint4*>(p);
    v.w[0] = u.x, v.w[1] = u.y, v.w[2] = u.z, v.w[3] = u.w;
#endif
    for (int i = 0; i < 4; i++) {
        f[2 * i] = fp_bf16_to_f32((bf16_t)(v.w[i] & 0xffffu));
        f[2 * i + 1] = fp_bf16_to_f32((bf16_t)(v.w[i] >> 16));
    }
}
__device__ __forceinline__ void fp_st8(bf16_t* p, const float f[8]) {
    fp_bf16x8 v;
    for (int i = 0; i < 4; i++) {
        v.w[i] = (u32)fp_f32_to_bf16(f[2 * i]) | ((u32)fp_f32_to_bf16(f[2 * i + 1]) << 16);
    }
#ifdef FP_CPU_SHIM
    std::memcpy(p, &v, 16);
#else
    *reinterpret_cast<uint4*>(p) = make_uint4(v.w[0], v.w[1], v.w[2], v.w[3]);
#endif
}

// Row and column (in elements) that lane `lane` addresses for an ldmatrix.x4 over a 16x16 bf16
// tile. Rows first: matrices (rows 0-7, cols 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15), which
// gives the A operand of mma.m16n8k16 from a row-major [m][k] tile, and (with .trans) the B
// operands of two n8 tiles from a [k][n] tile. Columns first: (0-7, 0-7), (0-7, 8-15),
// (8-15, 0-7), (8-15, 8-15), which gives the B operands of two n8 tiles from an [n][k] tile.
__device__ __forceinline__ u32 fp_ldm_row_rows_first(u32 lane) {
    return (lane & 7) + ((lane >> 3) & 1) * 8;
}
__device__ __forceinline__ u32 fp_ldm_col_rows_first(u32 lane) {
    return (lane >> 4) * 8;
}
__device__ __forceinline__ u32 fp_ldm_row_cols_first(u32 lane) {
    return (lane & 7) + (lane >> 4) * 8;
}
__device__ __forceinline__ u32 fp_ldm_col_cols_first(u32 lane) {
    return ((lane >> 3) & 1) * 8;
}

// A compile-time flag as a type, for a generic lambda compiled once per value.
template <bool B>
struct fp_bool {
    static constexpr bool value = B;
};

#ifndef FP_CPU_SHIM
// ---- Tensor-core and asynchronous-copy wrappers (sm_80 and up): the only inline PTX. ----
// PTX ISA, "Warp-level matrix fragments for mma.m16n8k16" and "ldmatrix": lane = 4 g + t,
//   A 16x16 (row): a0 = A[g][2t..2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..]
//   B 16x8  (col): b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]
//   C 16x8  (f32): c0, c1 = C[g][2t, 2t+1]; c2, c3 = C[g+8][2t, 2t+1]
// a b32 register holds two bf16, the lower index in the low half.

// Dynamic shared memory of the launch, 16-byte aligned.
#define FP_DYNAMIC_SMEM(name)                                       \
    extern __shared__ __align__(16) unsigned char fp_dynamic_smem[]; \
    unsigned char* name = fp_dynamic_smem

__device__ __forceinline__ u32 fp_smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// A shared-memory address as the instructions take it: 32 bits, so that a constant byte offset
// added to it folds into the instruction's immediate ([R+imm]). The CPU shim's twin is a byte
// pointer; both take `+ bytes`.
typedef u32 fp_sptr;
__device__ __forceinline__ fp_sptr fp_sptr_of(const void* p) {
    return fp_smem_addr(p);
}

__device__ __forceinline__ void fp_ldsm_x4(u32 r[4], fp_sptr a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

__device__ __forceinline__ void fp_ldsm_x4_trans(u32 r[4], fp_sptr a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

__device__ __forceinline__ void fp_cp_async16_s(fp_sptr dst, const void* src, u32 src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

// 4 bytes global -> shared, asynchronously (src_bytes 0: a zero, nothing read).
__device__ __forceinline__ void fp_cp_async4_s(fp_sptr dst, const void* src, u32 src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

// 16 bytes global -> shared, every byte read (a full tile: no size operand to compute).
__device__ __forceinline__ void fp_cp_async16_full(fp_sptr dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}

// D += A B (bf16 inputs, f32 accumulators).
__device__ __forceinline__ void fp_mma_bf16_16816(float d[4], const u32 a[4], const u32 b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Four 8x8 bf16 matrices from shared memory; lanes 8i..8i+7 give the rows of matrix i.
__device__ __forceinline__ void fp_ldmatrix_x4(u32 r[4], const bf16_t* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(fp_smem_addr(row)));
}

// The same, transposed: r[i] holds (row 2t, column g) and (row 2t+1, column g) of matrix i.
__device__ __forceinline__ void fp_ldmatrix_x4_trans(u32 r[4], const bf16_t* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(fp_smem_addr(row)));
}

// 16 bytes global -> shared, asynchronously; only the first src_bytes are read, the rest of
// the 16 are zero-filled (src_bytes = 0: a zero row, nothing read).
__device__ __forceinline__ void fp_cp_async16(void* dst, const void* src, u32 src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(fp_smem_addr(dst)), "l"(src),
                 "r"(src_bytes));
}

// 4 bytes global -> shared, asynchronously (src_bytes 0: a zero, nothing read).
__device__ __forceinline__ void fp_cp_async4(void* dst, const void* src, u32 src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(fp_smem_addr(dst)), "l"(src),
                 "r"(src_bytes));
}

__device__ __forceinline__ void fp_cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::);
}

// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void fp_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Two floats to a bf16 pair (round to nearest even), lo in the low half.
__device__ __forceinline__ u32 fp_pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// 2^x on the special-function unit (relative error ~2^-22; subnormal results flush to 0).
__device__ __forceinline__ float fp_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
#endif

// 2^x on the FMA and integer pipes instead of the special-function unit, whose 16 results per
// clock and SM bound the softmax of a d = 64 tile on Hopper (as many clocks as its products):
// x = j + f with j = round(x) (adding 1.5 x 2^23 rounds; the sum's low bits are j) and f in
// [-1/2, 1/2]; 2^f by a degree-4 minimax polynomial held to p(0) = 1 (relative error 3.6e-6;
// degree 3 gives 4.3e-4, more than the log-sum-exp's tolerance of 2e-5); j added to the
// result's exponent bits. x is first raised to -127, where the result is exactly +0: a masked
// score (-inf) gives 0, as ex2 does, and no exponent wraps. For x up to FP_FA2_RESCALE (a
// score against its row's running maximum).
__device__ __forceinline__ float fp_exp2_poly(float x) {
    x = fmaxf(x, -127.0f);
    const float magic = 12582912.0f;
    const float t = x + magic;
    const float f = x - (t - magic);
    float p = fmaf(9.782912210e-03f, f, 5.597688258e-02f);
    p = fmaf(p, f, 2.402071059e-01f);
    p = fmaf(p, f, 6.931136250e-01f);
    p = fmaf(p, f, 1.0f);
    return __uint_as_float(__float_as_uint(p) + (__float_as_uint(t) << 23));
}

// Two adjacent values of an attention output row (element i even) where the caller asked for
// them: `out` (f32), or, where `out_b` is given, rounded to bf16 there (the bf16 forward's
// attention output, which its output projection reads as it is; a key split's partial result
// is always f32). Exactly one of the two is set (gpu::ops::out_pair).
__device__ __forceinline__ void fp_st_out2(float* out, bf16_t* out_b, u64 i, float a, float b) {
    if (out_b != nullptr) {
        *(u32*)(out_b + i) = fp_pack_bf16x2(a, b);
    } else {
        *(float2*)(out + i) = make_float2(a, b);
    }
}

// One value of an attention output row, as fp_st_out2.
__device__ __forceinline__ void fp_st_out(float* out, bf16_t* out_b, u64 i, float v) {
    if (out_b != nullptr) {
        out_b[i] = fp_f32_to_bf16(v);
    } else {
        out[i] = v;
    }
}
