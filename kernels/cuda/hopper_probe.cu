// A self-check of Hopper's path (sm_90a), as probe.cu is of mma.sync: one warpgroup multiplies
// A [64][64] by B [64][128] with wgmma.mma_async, its operands brought by TMA through three
// tensor maps into shared memory laid out for swizzle width W (hopper.cuh), completion on one
// mbarrier. Twice, the two ways the attention kernel takes its operands:
//   d_ss = A B with A and B from shared memory by descriptor, B K-major ([n][k], like K),
//          accumulated over four k16 steps from zero;
//   d_rs = A B with A from registers (built from global memory in the wgmma A fragment) and B
//          MN-major ([k][n], like V, read transposed), in two n64 halves, the first step of
//          each overwriting (scale-d 0) what the accumulators held.
// Run on a GPU it checks the descriptor, swizzle and fragment layouts the CPU emulation
// assumes against the hardware; in the emulation, against the reference product. `breaks`
// makes one deliberate mistake each (FP_PROBE_BREAK_*), which the emulation tests must catch.
//
// Maps (16 u64 each, built by gpu::tma): [0] A [64 rows][64], [1] B [128 rows (n)][64 (k)],
// [2] B [64 rows (k)][128 (n)]; each with a box of W / 2 elements and the tile's rows.

#define FP_PROBE_BREAK_FENCE 1u    // no wgmma.fence before the first product
#define FP_PROBE_BREAK_SWIZZLE 2u  // descriptors of another swizzle width than the maps'
#define FP_PROBE_BREAK_PHASE 4u    // the wait on the copies' barrier names the other parity
#define FP_PROBE_BREAK_WAIT 8u     // the accumulators of d_ss read without wgmma.wait_group
// The next two deadlock the block (on a GPU it would hang; only the emulation runs them):
#define FP_PROBE_BREAK_ARRIVE 16u  // the copies issued without arrive.expect_tx: no phase completes
#define FP_PROBE_BREAK_SYNC 32u    // thread 0 skips the __syncthreads after the barrier's init

template <int W>
__device__ __forceinline__ void fp_hopper_probe(const u64* maps, const bf16_t* a, float* d_ss, float* d_rs,
                                                u32 breaks) {
    constexpr int WB = W == 128 ? 64 : 128;  // the wrong width of FP_PROBE_BREAK_SWIZZLE
    constexpr u32 E = W / 2;                 // elements in a box's row
    constexpr u32 A_BYTES = 64 * 64 * 2, B_BYTES = 64 * 128 * 2;
    FP_DYNAMIC_SMEM(smem);
    const fp_sptr a_s = fp_sptr_align(fp_sptr_of(smem), 1024);
    const fp_sptr bnk_s = a_s + A_BYTES;
    const fp_sptr bkn_s = bnk_s + B_BYTES;
    const fp_sptr bar = bkn_s + B_BYTES;
    const u32 tid = threadIdx.x, warp = tid / 32, g = (tid % 32) / 4, t = tid % 4;
    if (tid == 0) {
        for (int i = 0; i < 3; i++) {
            fp_tensormap_acquire(maps + 16 * i);
        }
        fp_mbar_init(bar, 1);
        fp_mbar_init_fence();
    }
    if (tid != 0 || !(breaks & FP_PROBE_BREAK_SYNC)) {
        __syncthreads();
    }
    if (tid == 0) {
        if (!(breaks & FP_PROBE_BREAK_ARRIVE)) {
            fp_mbar_arrive_expect_tx(bar, A_BYTES + 2 * B_BYTES);
        }
        for (u32 b = 0; b < 64 / E; b++) {
            fp_tma_load_2d(a_s + b * 64 * W, maps, bar, (int)(b * E), 0);
            fp_tma_load_2d(bnk_s + b * 128 * W, maps + 16, bar, (int)(b * E), 0);
        }
        for (u32 b = 0; b < 128 / E; b++) {
            fp_tma_load_2d(bkn_s + b * 64 * W, maps + 32, bar, (int)(b * E), 0);
        }
    }
    fp_mbar_wait(bar, (breaks & FP_PROBE_BREAK_PHASE) ? 1u : 0u);

    const bool swz = (breaks & FP_PROBE_BREAK_SWIZZLE) != 0;
    float d1[64];
    FP_UNROLL
    for (int i = 0; i < 64; i++) {
        d1[i] = 0.0f;
    }
    fp_acc_fence(d1);
    if (!(breaks & FP_PROBE_BREAK_FENCE)) {
        fp_wgmma_fence();
    }
    FP_UNROLL
    for (u32 kk = 0; kk < 4; kk++) {
        const u64 da = swz ? fp_desc_kmajor<WB>(a_s, 64, 16 * kk) : fp_desc_kmajor<W>(a_s, 64, 16 * kk);
        const u64 db = swz ? fp_desc_kmajor<WB>(bnk_s, 128, 16 * kk) : fp_desc_kmajor<W>(bnk_s, 128, 16 * kk);
        fp_wgmma_ss_n128<0>(d1, da, db, 1);
    }
    fp_wgmma_commit();
    if (!(breaks & FP_PROBE_BREAK_WAIT)) {
        fp_wgmma_wait<0>();
    }
    fp_acc_fence(d1);
    const u32 r0 = 16 * warp + g;
    FP_UNROLL
    for (int i = 0; i < 16; i++) {
        FP_UNROLL
        for (int e = 0; e < 4; e++) {
            d_ss[(r0 + (e >= 2 ? 8 : 0)) * 128 + 8 * i + 2 * t + (e & 1)] = d1[4 * i + e];
        }
    }

    // A's fragments straight from global memory; what the accumulators hold before the first
    // step must not matter (scale-d 0).
    u32 af[4][4];
    FP_UNROLL
    for (int kk = 0; kk < 4; kk++) {
        const bf16_t* lo = a + r0 * 64 + 16 * kk + 2 * t;
        const bf16_t* hi = lo + 8 * 64;
        af[kk][0] = (u32)lo[0] | ((u32)lo[1] << 16);
        af[kk][1] = (u32)hi[0] | ((u32)hi[1] << 16);
        af[kk][2] = (u32)lo[8] | ((u32)lo[9] << 16);
        af[kk][3] = (u32)hi[8] | ((u32)hi[9] << 16);
    }
    float d2[2][32];
    FP_UNROLL
    for (int h = 0; h < 2; h++) {
        FP_UNROLL
        for (int i = 0; i < 32; i++) {
            d2[h][i] = 7.0f;
        }
        fp_acc_fence(d2[h]);
    }
    fp_wgmma_fence();
    FP_UNROLL
    for (u32 h = 0; h < 2; h++) {
        FP_UNROLL
        for (u32 kk = 0; kk < 4; kk++) {
            fp_wgmma_rs_n64<1>(d2[h], af[kk], fp_desc_mnmajor<W>(bkn_s, 64, 64 * h, 16 * kk), kk > 0 ? 1u : 0u);
        }
    }
    fp_wgmma_commit();
    fp_wgmma_wait<0>();
    FP_UNROLL
    for (int h = 0; h < 2; h++) {
        fp_acc_fence(d2[h]);
        FP_UNROLL
        for (int i = 0; i < 8; i++) {
            FP_UNROLL
            for (int e = 0; e < 4; e++) {
                d_rs[(r0 + (e >= 2 ? 8 : 0)) * 128 + 64 * h + 8 * i + 2 * t + (e & 1)] = d2[h][4 * i + e];
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(128, 1)
    fp_hopper_probe_w128(const u64* maps, const bf16_t* a, float* d_ss, float* d_rs, u32 breaks) {
    fp_hopper_probe<128>(maps, a, d_ss, d_rs, breaks);
}

extern "C" __global__ void __launch_bounds__(128, 1)
    fp_hopper_probe_w64(const u64* maps, const bf16_t* a, float* d_ss, float* d_rs, u32 breaks) {
    fp_hopper_probe<64>(maps, a, d_ss, d_rs, breaks);
}

extern "C" __global__ void __launch_bounds__(128, 1)
    fp_hopper_probe_w32(const u64* maps, const bf16_t* a, float* d_ss, float* d_rs, u32 breaks) {
    fp_hopper_probe<32>(maps, a, d_ss, d_rs, breaks);
}

extern "C" __global__ void __launch_bounds__(128, 1)
    fp_hopper_probe_w16(const u64* maps, const bf16_t* a, float* d_ss, float* d_rs, u32 breaks) {
    fp_hopper_probe<16>(maps, a, d_ss, d_rs, breaks);
}
