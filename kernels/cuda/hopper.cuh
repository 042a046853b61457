// Hopper's building blocks (sm_90a): warpgroup matrix products (wgmma.mma_async) reading their
// operands from shared memory through matrix descriptors, the bulk tensor copy (TMA) that
// brings tiles in laid out as those descriptors expect, and the mbarrier that says when a
// copy has landed. Prepended after common.cuh to the programs of the Hopper kernel files only
// (gpu::program; they are compiled for compute capability 9.0 alone). Each PTX wrapper has a
// C++ twin in cpu_shim_hopper.h, which models what the emulation tests rely on.
//
// Shared-memory tiles: a tile of R rows whose contiguous dimension holds C bf16 elements is
// stored as C / (W / 2) boxes, each R rows of W bytes (W / 2 elements), one box after the
// other. W is the swizzle width, 128, 64 or 32 bytes: the hardware takes the swizzle from the
// address bits, bits 4-6 (the 16-byte chunk in a 128-byte line) XOR bits 7-9, of which the
// 128-byte mode uses 3, the 64-byte mode 2 and the 32-byte mode 1 (chunk j of row r of a
// 128-byte box sits at chunk j ^ (r % 8)); or W = 16, no swizzle: 8 elements a row, which
// makes each 8 rows one "core matrix" of 128 contiguous bytes. A box is what one TMA copy
// writes (the tensor map's box: W / 2 elements x R rows, its swizzle mode), and every box
// starts on a multiple of 1024 bytes so that the address bits line up with its rows.
// wgmma fragments (PTX ISA, "Matrix fragments for wgmma.mma_async", m64nNk16, bf16): warp w of
// the warpgroup holds rows 16 w .. 16 w + 15; lane = 4 g + t;
//   A from registers (4 b32): a0 = A[g][2t..2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..],
//                             a3 = A[g+8][2t+8..] (rows of the warp's 16): mma.m16n8k16's A
//   D (N / 2 f32): d[4i], d[4i+1] = D[g][8i+2t, +1]; d[4i+2], d[4i+3] = D[g+8][8i+2t, +1]
// which makes the score accumulator of a k16 slice the A operand of the next product, as in
// FlashAttention-2.

#ifndef FP_HOPPER_CUH
#define FP_HOPPER_CUH

#ifndef FP_CPU_SHIM
// The bits of a shared address a descriptor holds.
__device__ __forceinline__ u32 fp_saddr_bits(fp_sptr a) {
    return a;
}

// `a` rounded up to a multiple of `align` (a power of two).
__device__ __forceinline__ fp_sptr fp_sptr_align(fp_sptr a, u32 align) {
    return (a + align - 1) & ~(align - 1);
}
#endif

// Bytes of one swizzle atom (8 rows of W bytes; 128 for W = 16).
template <int W>
__device__ __forceinline__ constexpr u32 fp_swizzle_atom() {
    return W == 16 ? 128u : 8u * W;
}

// The 14-bit fields of a matrix descriptor: a byte count / 16.
__device__ __forceinline__ u64 fp_desc_field(u32 bytes) {
    return (u64)((bytes & 0x3ffffu) >> 4);
}

// A wgmma matrix descriptor (PTX ISA, "Matrix Descriptor Format"): start address, leading
// and stride byte offsets (bits 0-13, 16-29, 32-45, each in 16-byte units), base offset 0
// (bits 49-51: every box is aligned to its swizzle atom), layout (bits 62-63: 1 = 128-byte
// swizzle, 2 = 64, 3 = 32, 0 = none).
template <int W>
__device__ __forceinline__ u64 fp_gmma_desc(fp_sptr start, u32 lbo, u32 sbo) {
    static_assert(W == 16 || W == 32 || W == 64 || W == 128, "swizzle width");
    constexpr u64 mode = W == 128 ? 1 : W == 64 ? 2 : W == 32 ? 3 : 0;
    return fp_desc_field(fp_saddr_bits(start)) | (fp_desc_field(lbo) << 16) | (fp_desc_field(sbo) << 32) |
           (mode << 62);
}

// Bytes from a K-major tile's start (rows of an M or N dimension, k contiguous; `rows` rows,
// boxes of W / 2 elements along k) to its k16 slice at k0: Q and K in attention.
template <int W>
__device__ __forceinline__ constexpr u32 fp_kmajor_offset(u32 rows, u32 k0) {
    // Unswizzled: two 8-element boxes per k16, the slice from its first box. Swizzled: the
    // slice lies inside one box (W >= 32 bytes = 16 elements).
    return W == 16 ? (k0 / 8) * rows * W : (k0 / (W / 2)) * rows * W + (k0 % (W / 2)) * 2;
}

// Bytes from an MN-major tile's start (`k_rows` rows along k, the M or N dimension contiguous;
// boxes of W / 2 elements along it) to the slice of k16 rows from k0, MN columns from mn0: V
// in attention (keys x head dimension), read transposed (trans-b).
template <int W>
__device__ __forceinline__ constexpr u32 fp_mnmajor_offset(u32 k_rows, u32 mn0, u32 k0) {
    return (mn0 / (W / 2)) * k_rows * W + k0 * W;
}

// The descriptor of the k16 slice at k0 of a K-major tile (as fp_kmajor_offset).
template <int W>
__device__ __forceinline__ u64 fp_desc_kmajor(fp_sptr tile, u32 rows, u32 k0) {
    const u32 box_bytes = rows * W;
    const fp_sptr start = tile + fp_kmajor_offset<W>(rows, k0);
    if (W == 16) {
        // The slice's second 8-element box at LBO; 8-row core matrices 128 bytes apart.
        return fp_gmma_desc<W>(start, box_bytes, 128);
    }
    // Swizzled: LBO unused (16); 8-row groups one atom apart.
    return fp_gmma_desc<W>(start, 16, fp_swizzle_atom<W>());
}

// The descriptor of the slice (k16 rows from k0, MN columns from mn0) of an MN-major tile (as
// fp_mnmajor_offset).
template <int W>
__device__ __forceinline__ u64 fp_desc_mnmajor(fp_sptr tile, u32 k_rows, u32 mn0, u32 k0) {
    const u32 box_bytes = k_rows * W;
    const fp_sptr start = tile + fp_mnmajor_offset<W>(k_rows, mn0, k0);
    if (W == 16) {
        // 8 MN elements a box (SBO to the next), 8 k rows a core matrix (LBO to the next).
        return fp_gmma_desc<W>(start, 128, box_bytes);
    }
    // Swizzled: W / 2 MN elements a box (LBO to the next), 8 k rows an atom (SBO).
    return fp_gmma_desc<W>(start, box_bytes, fp_swizzle_atom<W>());
}

// Descriptor `desc` with its start `bytes` (a multiple of 16) further: the start field is the
// address / 16 in bits 0-13 and every shared address is below 2^18, so the sum stays in the
// low word and in the field (the high word is kept as it is, no carry to compute). A loop
// makes its descriptors this way from one computed before it.
__device__ __forceinline__ u64 fp_desc_add(u64 desc, u32 bytes) {
    const u32 lo = (u32)desc + (bytes >> 4);
    return (desc & 0xffffffff00000000ull) | lo;
}

#ifndef FP_CPU_SHIM
// ---- The PTX (sm_90a). ----

__device__ __forceinline__ void fp_mbar_init(fp_sptr bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}

// Makes barrier initialisations visible to the asynchronous proxy (the copy engine) before
// the block's barrier that follows it.
__device__ __forceinline__ void fp_mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival that also announces `bytes` of asynchronous copies for the current phase.
__device__ __forceinline__ void fp_mbar_arrive_expect_tx(fp_sptr bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void fp_mbar_arrive(fp_sptr bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// A 32-bit word of shared memory (a producer's message to the consumers), written before the
// mbarrier arrival that releases it and read after the wait that acquires it.
__device__ __forceinline__ void fp_st_shared_u32(fp_sptr a, u32 v) {
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(a), "r"(v) : "memory");
}

__device__ __forceinline__ u32 fp_ld_shared_u32(fp_sptr a) {
    u32 v;
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(a) : "memory");
    return v;
}

// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void fp_mbar_wait(fp_sptr bar, u32 parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "fp_mbar_wait_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra fp_mbar_wait_%=;\n"
        "}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}

// Orders this thread's earlier generic-proxy accesses of the tensor map at `map` (global
// memory, written by the host before the launch) before the copy engine reads it.
__device__ __forceinline__ void fp_tensormap_acquire(const void* map) {
    asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(map) : "memory");
}

// The box at coordinates (c0 innermost, c1) of the 2-D tensor map at `map` (global memory)
// into shared memory at `dst`, completing `box bytes` of transactions on `bar`.
__device__ __forceinline__ void fp_tma_load_2d(fp_sptr dst, const void* map, fp_sptr bar, int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], "
        "[%2];\n" ::"r"(dst),
        "l"(map), "r"(bar), "r"(c0), "r"(c1)
        : "memory");
}

// Orders this thread's generic-proxy writes of shared memory before later reads of it by the
// asynchronous proxy (wgmma operands written by plain stores).
__device__ __forceinline__ void fp_fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Named barriers (1-15; 0 is __syncthreads): `count` threads, whole warps, take part in each
// phase; sync waits for the phase, arrive only counts (the ping-pong of two warpgroups).
__device__ __forceinline__ void fp_named_sync(u32 id, u32 count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void fp_named_arrive(u32 id, u32 count) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// Gives the warpgroup's threads R registers each (inc) or takes them down to R (dec): the
// producer warpgroup gives its registers to the consumers.
template <int R>
__device__ __forceinline__ void fp_setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}
template <int R>
__device__ __forceinline__ void fp_setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}

// Orders the warpgroup's register accesses before the wgmma.mma_async that follow (needed
// before the first of a batch and whenever accumulators or A registers were touched since).
__device__ __forceinline__ void fp_wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void fp_wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Waits until at most N committed wgmma groups of the warpgroup are pending.
template <int N>
__device__ __forceinline__ void fp_wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// The same for the A fragments of a register-sourced wgmma: the compiler must not give their
// registers to anything else before the wait that retires the product reading them.
template <int N>
__device__ __forceinline__ void fp_frag_fence(u32 (&a)[N][4]) {
    FP_UNROLL
    for (int i = 0; i < N; i++) {
        asm volatile("" : "+r"(a[i][0]), "+r"(a[i][1]), "+r"(a[i][2]), "+r"(a[i][3])::"memory");
    }
}

// Ties accumulators to this point of the instruction stream: after a wgmma wait, so that no
// read of them is scheduled before it; before a fence, so that every write of them is done.
template <int N>
__device__ __forceinline__ void fp_acc_fence(float (&d)[N]) {
    FP_UNROLL
    for (int i = 0; i < N; i++) {
        asm volatile("" : "+f"(d[i])::"memory");
    }
}

#define FP_D8(i) "+f"(d[8 * i]), "+f"(d[8 * i + 1]), "+f"(d[8 * i + 2]), "+f"(d[8 * i + 3]), \
    "+f"(d[8 * i + 4]), "+f"(d[8 * i + 5]), "+f"(d[8 * i + 6]), "+f"(d[8 * i + 7])

// D[64][64] (+)= A B: A and B from shared memory by descriptor (B K-major, or MN-major with
// TRANS_B); the accumulators are added to when scale_d != 0, else overwritten.
template <int TRANS_B>
__device__ __forceinline__ void fp_wgmma_ss_n64(float (&d)[32], u64 da, u64 db, u32 scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,"
        "%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, %35;\n}\n"
        : FP_D8(0), FP_D8(1), FP_D8(2), FP_D8(3)
        : "l"(da), "l"(db), "r"(scale_d), "n"(TRANS_B));
}

template <int TRANS_B>
__device__ __forceinline__ void fp_wgmma_ss_n128(float (&d)[64], u64 da, u64 db, u32 scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,"
        "%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,"
        "%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, %67;\n}\n"
        : FP_D8(0), FP_D8(1), FP_D8(2), FP_D8(3), FP_D8(4), FP_D8(5), FP_D8(6), FP_D8(7)
        : "l"(da), "l"(db), "r"(scale_d), "n"(TRANS_B));
}

// The same with A from registers (the fragment above).
template <int TRANS_B>
__device__ __forceinline__ void fp_wgmma_rs_n64(float (&d)[32], const u32 (&a)[4], u64 db, u32 scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,"
        "%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, %38;\n}\n"
        : FP_D8(0), FP_D8(1), FP_D8(2), FP_D8(3)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(TRANS_B));
}

template <int TRANS_B>
__device__ __forceinline__ void fp_wgmma_rs_n128(float (&d)[64], const u32 (&a)[4], u64 db, u32 scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,"
        "%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,"
        "%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, %70;\n}\n"
        : FP_D8(0), FP_D8(1), FP_D8(2), FP_D8(3), FP_D8(4), FP_D8(5), FP_D8(6), FP_D8(7)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(TRANS_B));
}
#undef FP_D8
#endif  // FP_CPU_SHIM

#endif  // FP_HOPPER_CUH
