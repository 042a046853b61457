// Tensor-core attention for Hopper (sm_90a): the contract of flash2.cu (packed query rows of
// one KV head, explicit positions, whole key tiles skipped, key splits with a log-sum-exp
// output that merge_partial and attn_combine take unchanged), built on hopper.cuh:
//   - warp specialisation: consumer warpgroups of 64 packed rows each (FP_FH_CONSUMERS_D64 or
//     _D128), and one
//     producer warpgroup whose first thread issues the copies (its registers given to the
//     consumers by setmaxnreg);
//   - K and V tiles of FP_FH_KEYS keys brought by TMA through two tensor maps (128-byte
//     swizzle, boxes of 64 elements of one KV head) into FP_FH_STAGES stages; a full barrier
//     per stage (the producer's arrival with the tiles' bytes) and an empty one (one arrival
//     per consumer warp when it is done with the stage);
//   - the producer alone walks the key metadata: with each stage it writes which tile it holds
//     and whether the tile is full (a word in shared memory, released by its arrival), and a
//     last stage without a tile ends the consumers' loop, so no global load sits between one
//     tile's softmax and the next tile's products;
//   - S = Q K^T by wgmma from shared memory (Q and K K-major), the online softmax on the
//     accumulators, then O += P V by wgmma with P from registers (the score accumulators are
//     the A fragments) and V read transposed;
//   - the mask only on tiles that straddle some query's position or n (no per-element test on
//     full tiles); a row's maximum moves only when it rises by more than 2^FP_FA2_RESCALE
//     (flash2's rule), so full tiles in the steady state do not rescale O.
//   - with FP_FH_PINGPONG, the two consumer warpgroups take turns at the tensor pipe (named
//     barriers): in its turn a warpgroup issues tile t's S = Q K^T and tile t-1's O += P V back
//     to back, hands the turn over, and runs tile t's softmax while the other warpgroup's
//     products run (FlashAttention-3's ping-pong); without it (and with one consumer) each
//     warpgroup still issues S before the previous P V and overlaps its softmax with that P V.
//     A stage is released when the P V that read it is retired.
//   - with FP_FH_PERSISTENT, a block per SM at most (the host's grid) walks work items (a query
//     tile of a KV head and key split), the longest first (the last query tiles of every head,
//     then the earlier ones), every gridDim.x-th item; the producer goes on to the next item's
//     tiles while the consumers finish this one's and write its output, and each consumer
//     warpgroup loads its own query rows for the next item when it is done with them;
//   - with FP_FH_POLY > 0, that many of each row's 16 score columns of 8 (spread over the tile)
//     take their exp2 from fp_exp2_poly on the FMA and integer pipes, the rest from the
//     special-function unit, whose 16 results a clock and SM are as many clocks as a d = 64
//     tile's products (FlashAttention-4's split, here for Hopper's d = 64).
// The output is f32, or bf16 where the caller gives `out_b` (the bf16 forward; never a key
// split's partial result, which the combine merges in f32).
// What it does not do yet (docs/gpu.md): two score buffers; key tiles other than 128.
//
// Maps (16 u64 each, gpu::ops::hopper_attention_maps): [0] K, [1] V, each the 2-D tensor
// (n_kv_heads * D elements a row, n rows) with boxes of 64 elements by FP_FH_KEYS rows.

// The producer's word per stage: the tile's index, with FP_FH_FULL_TILE when no key of it is
// above any query of the block and all its keys are below n; FP_FH_NO_TILE (not full) ends the
// loop.
#define FP_FH_FULL_TILE 0x80000000u
#define FP_FH_NO_TILE 0x7fffffffu

// The configuration (flowprefill_kernels::gpu::shapes::HOPPER_CONFIGS, written into the
// launch-shape header): FP_FH_CONSUMERS_D64 (1 to 3) and FP_FH_CONSUMERS_D128 (1 or 2),
// FP_FH_STAGES, FP_FH_PINGPONG (two consumers only), FP_FH_POLY (0 .. 16), FP_FH_PERSISTENT,
// FP_FH_KEYS, FP_FH_THREADS_D64 and _D128 ((consumers + 1) x 128).
static_assert(FP_FH_THREADS_D64 == (FP_FH_CONSUMERS_D64 + 1) * 128, "the consumers' and the producer's warpgroups");
static_assert(FP_FH_THREADS_D128 == (FP_FH_CONSUMERS_D128 + 1) * 128, "the consumers' and the producer's warpgroups");

// The smallest (LO) or largest position of kernel tile t: the metadata tiles it covers.
template <bool LO>
__device__ __forceinline__ u32 fp_fh_bound(const u32* meta, u32 t, u32 meta_tiles) {
    constexpr u32 MT = FP_FH_KEYS / FP_FA2_META_KEYS;
    u32 b = LO ? 0xffffffffu : 0u;
    FP_UNROLL
    for (u32 i = 0; i < MT; i++) {
        const u32 mt = t * MT + i;
        if (mt < meta_tiles) {
            b = LO ? min(b, meta[mt]) : max(b, meta[mt]);
        }
    }
    return b;
}

// The first key tile in [t, t_end) that some query of the block sees; t_end when none.
__device__ __forceinline__ u32 fp_fh_visible_from(u32 t, u32 t_end, const u32* ktile_lo, u32 meta_tiles, u32 qhi) {
    while (t < t_end && fp_fh_bound<true>(ktile_lo, t, meta_tiles) > qhi) {
        t++;
    }
    return t;
}

// O += P V for one k16 slice of keys: n = D (the accumulators' count says which).
__device__ __forceinline__ void fp_fh_pv(float (&o)[64], const u32 (&p)[4], u64 dv) {
    fp_wgmma_rs_n128<1>(o, p, dv, 1u);
}
__device__ __forceinline__ void fp_fh_pv(float (&o)[32], const u32 (&p)[4], u64 dv) {
    fp_wgmma_rs_n64<1>(o, p, dv, 1u);
}

// Whether score column tile i (of n8 tiles, 16 a row) takes the polynomial exp2: POLY of every
// 16, spread evenly (i x POLY mod 16 below POLY), so both pipes have work all along the row.
template <u32 POLY>
__device__ __forceinline__ bool fp_fh_poly_tile(u32 i) {
    // (POLY = 0: none, without the comparison of an unsigned with zero NVRTC warns about.)
    if constexpr (POLY == 0) {
        return false;
    } else {
        return (i * POLY) % 16 < POLY;
    }
}

// The configuration is in the template's arguments (not read from the macros inside), so that
// each configuration is its own instantiation wherever several are built into one program.
template <int D, u32 CONSUMERS, u32 STAGES, bool PINGPONG, u32 POLY, bool PERSISTENT>
__device__ __forceinline__ void fp_flash_hopper(const u64* maps, const bf16_t* q, const u32* qpos, const u32* kpos,
                                                const u32* ktile_lo, const u32* ktile_hi, float* out, bf16_t* out_b,
                                                float* lse, u32 m, u32 n, u32 n_heads, u32 n_kv_heads,
                                                float scale_log2, u32 tiles_per_split) {
    constexpr u32 ROWS = 64 * CONSUMERS, KEYS = FP_FH_KEYS, THREADS = (CONSUMERS + 1) * 128;
    constexpr u32 BOXES = D / 64;                // 64-element boxes along the head dimension
    constexpr u32 Q_BYTES = ROWS * D * 2;
    constexpr u32 KV_BYTES = KEYS * D * 2;       // one K (or V) tile
    constexpr u32 MT = KEYS / FP_FA2_META_KEYS;  // metadata tiles per kernel tile
    constexpr u32 NT = KEYS / 8, DT = D / 8;     // n8 tiles of S, of O
    static_assert(D == 64 || D == 128, "head dimension");
    static_assert(KEYS == 128 && KEYS % FP_FA2_META_KEYS == 0, "key tile");
    static_assert(CONSUMERS >= 1 && CONSUMERS <= 3 && (D == 64 || CONSUMERS <= 2), "1-3 consumer warpgroups, 1-2 at d128");
    // setmaxnreg: the producer's registers to the consumers, within the SM's 64K
    // (40 x 128 + 232 x 256 = 64,512 with two consumers; 24 x 128 + 160 x 384 with three).
    constexpr u32 PRODUCER_REGS = CONSUMERS == 3 ? 24 : 40, CONSUMER_REGS = CONSUMERS == 3 ? 160 : 232;
    static_assert(PRODUCER_REGS * 128 + CONSUMER_REGS * 128 * CONSUMERS <= 65536, "the register plan");
    static_assert(!PINGPONG || CONSUMERS == 2, "the ping-pong takes two consumer warpgroups");
    static_assert(POLY <= 16 && NT == 16, "polynomial exp2 on POLY of a row's 16 column tiles");
    constexpr u32 TURN_THREADS = 128 * CONSUMERS;
    FP_DYNAMIC_SMEM(smem);
    const fp_sptr q_s = fp_sptr_align(fp_sptr_of(smem), 1024);
    const fp_sptr k_s = q_s + Q_BYTES;
    const fp_sptr v_s = k_s + STAGES * KV_BYTES;
    const fp_sptr full_bar = v_s + STAGES * KV_BYTES;
    const fp_sptr empty_bar = full_bar + 8 * STAGES;
    const fp_sptr tile_word = empty_bar + 8 * STAGES;  // the producer's word per stage
    __shared__ u32 q_range[2];

    const u32 tid = threadIdx.x, lane = tid % 32;
    // The warp's index broadcast from its lane 0: the same value, which ptxas then knows to be
    // the same in every lane, so what derives from it (the warpgroup's Q descriptors) lives in
    // uniform registers instead of being moved into them before every product.
    const u32 warp = __shfl_sync(FP_FULL_MASK, tid / 32, 0);
    const u32 wg = warp / 4;  // warpgroup: 0 .. CONSUMERS - 1 consume, CONSUMERS produces
    const u32 group = n_heads / n_kv_heads;
    const u32 packed = m * group;
    const u32 key_tiles = (n + KEYS - 1) / KEYS;
    const u32 meta_tiles = (n + FP_FA2_META_KEYS - 1) / FP_FA2_META_KEYS;
    // The work items: one (the block's own) without PERSISTENT; with it, every query tile of
    // every KV head and key split (the host's plan: ops::flash_plan), the block taking items
    // blockIdx.x, + gridDim.x, ...
    const u32 q_tiles = PERSISTENT ? max(1u, (packed + ROWS - 1) / ROWS) : gridDim.x;
    const u32 splits = PERSISTENT ? max(1u, (meta_tiles + tiles_per_split - 1) / tiles_per_split) : gridDim.z;
    const u32 items = PERSISTENT ? q_tiles * n_kv_heads * splits : 1;
    const u32 first_item = PERSISTENT ? blockIdx.x : 0;
    const u32 item_step = PERSISTENT ? gridDim.x : 1;
    // Item i: query tile x (the last first: the longest under a causal mask), KV head kh, key
    // split z; its first packed row and its key tiles [t_begin, t_end) (splits are cut in
    // metadata tiles, a multiple of MT each: the host's plan).
    struct Item {
        u32 row0, kh, z, t_begin, t_end;
    };
    // A stage of the ring and its phase, advanced one stage at a time without a division by
    // STAGES (the stage and the phase of the n-th use are n % STAGES and (n / STAGES) & 1).
    struct Ring {
        u32 stage = 0, phase = 0;
        __device__ __forceinline__ void advance() {
            if (++stage == STAGES) {
                stage = 0;
                phase ^= 1u;
            }
        }
    };
    auto item_at = [&](u32 i) {
        Item w;
        const u32 x = PERSISTENT ? i / (n_kv_heads * splits) : blockIdx.x;
        w.kh = PERSISTENT ? (i / splits) % n_kv_heads : blockIdx.y;
        w.z = PERSISTENT ? i % splits : blockIdx.z;
        w.row0 = (q_tiles - 1 - x) * ROWS;
        w.t_begin = w.z * (tiles_per_split / MT);
        w.t_end = min(key_tiles, w.t_begin + tiles_per_split / MT);
        return w;
    };
    // Packed row pr of KV head kh: its element offset in q (and in out, per split).
    auto row_offset = [&](u32 pr, u32 kh) { return ((u64)(pr / group) * n_heads + (u64)kh * group + pr % group) * D; };
    // Rows [r0, r0 + rows) of the query tile of the item at row0, by cp.async into the
    // swizzled layout of the maps' boxes (chunk j of row r of a box at chunk j ^ (r % 8)), by
    // `threads` threads from thread t.
    auto load_queries = [&](u32 row0, u32 kh, u32 r0, u32 rows, u32 t, u32 threads) {
        for (u32 c = t; c < rows * (D / 8); c += threads) {
            const u32 r = r0 + c / (D / 8), ch = c % (D / 8);
            const u32 pr = row0 + r;
            const bool ok = pr < packed;
            const u32 dst = (ch / 8) * ROWS * 128 + r * 128 + (((ch % 8) ^ (r % 8)) * 16);
            fp_cp_async16_s(q_s + dst, q + (ok ? row_offset(pr, kh) + ch * 8 : 0), ok ? 16u : 0u);
        }
        fp_cp_async_commit();
    };

    if (!PERSISTENT) {
        // The block's query tile, every thread.
        const Item w = item_at(0);
        load_queries(w.row0, w.kh, 0, ROWS, tid, THREADS);
        if (warp == 0) {
            fp_fa_query_range(q_range, qpos, w.row0, ROWS, packed, group, lane);
        }
    }
    if (tid == 0) {
        fp_tensormap_acquire(maps);
        fp_tensormap_acquire(maps + 16);
        for (u32 s = 0; s < STAGES; s++) {
            fp_mbar_init(full_bar + 8 * s, 1);
            fp_mbar_init(empty_bar + 8 * s, 4 * CONSUMERS);
        }
        fp_mbar_init_fence();
    }
    if (!PERSISTENT) {
        fp_cp_async_wait<0>();
        fp_fence_proxy_async();  // the query tile, written by this proxy, is read by wgmma's
    }
    __syncthreads();

    if (wg == CONSUMERS) {
        // The producer: one thread walks each item's visible tiles and copies each into the
        // next stage once the consumers have released it, with the stage's word; then a stage
        // without a tile. With PERSISTENT its warp first finds the item's query range.
        fp_setmaxnreg_dec<PRODUCER_REGS>();
        if (warp != 4 * CONSUMERS) {
            return;
        }
        const u32 whole = n / KEYS;  // tiles below it have every key below n
        Ring ring;  // the next stage to fill
        for (u32 i = first_item; i < items; i += item_step) {
            const Item w = item_at(i);
            if (PERSISTENT) {
                fp_fa_query_range(q_range, qpos, w.row0, ROWS, packed, group, lane);
            }
            if (lane == 0) {
                const u32 qlo = q_range[0], qhi = q_range[1];
                for (u32 t = fp_fh_visible_from(w.t_begin, w.t_end, ktile_lo, meta_tiles, qhi); t < w.t_end;
                     t = fp_fh_visible_from(t + 1, w.t_end, ktile_lo, meta_tiles, qhi), ring.advance()) {
                    const u32 s = ring.stage;
                    fp_mbar_wait(empty_bar + 8 * s, ring.phase ^ 1u);  // the stage's previous use released
                    const bool full = fp_fh_bound<false>(ktile_hi, t, meta_tiles) <= qlo && t < whole;
                    fp_st_shared_u32(tile_word + 4 * s, full ? t | FP_FH_FULL_TILE : t);
                    fp_mbar_arrive_expect_tx(full_bar + 8 * s, 2 * KV_BYTES);
                    FP_UNROLL
                    for (u32 b = 0; b < BOXES; b++) {
                        const int c0 = (int)(w.kh * D + 64 * b), c1 = (int)(t * KEYS);
                        fp_tma_load_2d(k_s + s * KV_BYTES + b * KEYS * 128, maps, full_bar + 8 * s, c0, c1);
                        fp_tma_load_2d(v_s + s * KV_BYTES + b * KEYS * 128, maps + 16, full_bar + 8 * s, c0, c1);
                    }
                }
                const u32 s = ring.stage;
                fp_mbar_wait(empty_bar + 8 * s, ring.phase ^ 1u);
                fp_st_shared_u32(tile_word + 4 * s, FP_FH_NO_TILE);
                fp_mbar_arrive(full_bar + 8 * s);
                ring.advance();
            }
        }
        return;
    }

    // A consumer warpgroup: 64 packed rows of each item; this thread's rows lane_row and
    // lane_row + 8.
    fp_setmaxnreg_inc<CONSUMER_REGS>();
    const u32 w4 = warp % 4, g = lane / 4, tq = lane % 4;
    u32 qp[2];  // the positions of this thread's rows in the item
    const fp_sptr q_wg = q_s + wg * 64 * 128;  // this warpgroup's rows inside each Q box
    // The descriptors at the tiles' starts (stage 0); each product's is one add from these.
    const u64 dq0 = fp_desc_kmajor<128>(q_wg, ROWS, 0);
    const u64 dk0 = fp_desc_kmajor<128>(k_s, KEYS, 0);
    const u64 dv0 = fp_desc_mnmajor<128>(v_s, KEYS, 0, 0);
    float o[D / 2];
    float m_r[2], l_r[2];
    u32 pf[KEYS / 16][4];  // P of the previous tile, for its O += P V
    FP_UNROLL
    for (u32 i = 0; i < KEYS / 16; i++) {
        pf[i][0] = pf[i][1] = pf[i][2] = pf[i][3] = 0u;
    }
    bool have_prev;  // a tile's P V is still to issue (its P in pf, its stage prev_stage)
    u32 prev_stage = 0;
    // O += P V of the previous tile (its stage): P from registers, V [keys][d] transposed.
    auto issue_pv = [&]() {
        const u64 dv = fp_desc_add(dv0, prev_stage * KV_BYTES);  // the stage's, then one add each
        FP_UNROLL
        for (u32 kk = 0; kk < KEYS / 16; kk++) {
            fp_fh_pv(o, pf[kk], fp_desc_add(dv, fp_mnmajor_offset<128>(KEYS, 0, 16 * kk)));
        }
    };
    // The two consumer warpgroups take turns at the tensor pipe (named barriers 1 and 2): in
    // its turn a warpgroup issues this tile's S = Q K^T and the previous tile's O += P V, then
    // hands the turn over and runs this tile's softmax while the other's products run.
    // Without the ping-pong each warpgroup overlaps its own softmax with its own P V only.
    const u32 my_turn = 1 + wg, their_turn = 2 - wg;
    if (PINGPONG && wg == 1) {
        fp_named_arrive(1, TURN_THREADS);  // the first turn is warpgroup 0's
    }
    // Key tile t, in stage s (its copies waited for). MASKED (tiles that straddle a query's
    // position or n) is compiled apart from the full tiles' step, which has no per-element test.
    // PREV (a previous tile's P V to issue: every tile of an item but its first) is a compile-
    // time flag too: with the P V issued under a run-time test, ptxas closed the second group
    // with an empty product on both paths (`HGMMA.64x8x16 RZ` after the P V's chain), a third
    // group, so the wait for S below (at most one group pending) also waited for the P V, and a
    // warpgroup's softmax no longer ran under its own P V.
    auto step = [&](auto masked, auto prev, u32 t, u32 s) {
        constexpr bool MASKED = decltype(masked)::value;
        constexpr bool PREV = decltype(prev)::value;
        float sc[KEYS / 2];
        if (PINGPONG) {
            fp_named_sync(my_turn, TURN_THREADS);
        }
        fp_acc_fence(o);
        fp_frag_fence(pf);
        fp_wgmma_fence();
        const u64 dk = fp_desc_add(dk0, s * KV_BYTES);
        FP_UNROLL
        for (u32 kk = 0; kk < D / 16; kk++) {
            fp_wgmma_ss_n128<0>(sc, fp_desc_add(dq0, fp_kmajor_offset<128>(ROWS, 16 * kk)),
                                fp_desc_add(dk, fp_kmajor_offset<128>(KEYS, 16 * kk)), kk > 0 ? 1u : 0u);
        }
        fp_wgmma_commit();
        if (PREV) {
            issue_pv();
            fp_wgmma_commit();
        }
        if (PINGPONG) {
            fp_named_arrive(their_turn, TURN_THREADS);
        }
        fp_wgmma_wait<PREV ? 1 : 0>();  // S (the older group); the previous P V may still run
        fp_acc_fence(sc);

        if (MASKED) {
            // Keys at or past n, and keys above a row's query position, get -inf.
            FP_UNROLL
            for (u32 i = 0; i < NT; i++) {
                FP_UNROLL
                for (u32 e = 0; e < 4; e++) {
                    const u32 key = t * KEYS + 8 * i + 2 * tq + (e & 1);
                    if (key >= n || kpos[key] > qp[e >> 1]) {
                        sc[4 * i + e] = -FP_INF;
                    }
                }
            }
        }
        // Online softmax in base 2 on raw scores (flash2's rule for moving the maximum); O is
        // rescaled once the previous P V is done.
        float mx[2] = {-FP_INF, -FP_INF};
        FP_UNROLL
        for (u32 i = 0; i < NT; i++) {
            mx[0] = fmaxf(mx[0], fmaxf(sc[4 * i], sc[4 * i + 1]));
            mx[1] = fmaxf(mx[1], fmaxf(sc[4 * i + 2], sc[4 * i + 3]));
        }
        bool rise = false;
        FP_UNROLL
        for (int h = 0; h < 2; h++) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(FP_FULL_MASK, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(FP_FULL_MASK, mx[h], 2));
            rise = rise || (mx[h] - m_r[h]) * scale_log2 > FP_FA2_RESCALE;
        }
        const bool rescale = __any_sync(FP_FULL_MASK, rise) != 0;
        float alpha[2] = {1.0f, 1.0f};
        if (rescale) {
            FP_UNROLL
            for (int h = 0; h < 2; h++) {
                const float nm = fmaxf(m_r[h], mx[h]);
                alpha[h] = nm == -FP_INF ? 1.0f : fp_exp2((m_r[h] - nm) * scale_log2);
                m_r[h] = nm;
                l_r[h] *= alpha[h];
            }
        }
        float base[2];
        FP_UNROLL
        for (int h = 0; h < 2; h++) {
            // A row that has seen nothing yet subtracts 0 (never -inf - -inf); a full tile's
            // rows all have a finite maximum.
            base[h] = (MASKED && m_r[h] == -FP_INF) ? 0.0f : m_r[h] * scale_log2;
        }
        FP_UNROLL
        for (u32 i = 0; i < NT; i++) {
            FP_UNROLL
            for (u32 e = 0; e < 4; e++) {
                const float x = fmaf(sc[4 * i + e], scale_log2, -base[e >> 1]);
                sc[4 * i + e] = fp_fh_poly_tile<POLY>(i) ? fp_exp2_poly(x) : fp_exp2(x);
            }
            l_r[0] += sc[4 * i] + sc[4 * i + 1];
            l_r[1] += sc[4 * i + 2] + sc[4 * i + 3];
        }
        if (PREV) {
            fp_wgmma_wait<0>();  // the previous P V: its stage is free, O and P may change
            fp_acc_fence(o);
            fp_frag_fence(pf);
            // Every lane read the stage's word (next()); the arrival releases it to the
            // producer's next write, so the warp's reads come first (racecheck, 2026-11-28).
            __syncwarp();
            if (lane == 0) {
                fp_mbar_arrive(empty_bar + 8 * prev_stage);  // this warp is done with that stage
            }
        }
        // (An item's first tile finds O at zero: nothing to rescale.)
        if (PREV && rescale) {
            FP_UNROLL
            for (u32 i = 0; i < DT; i++) {
                o[4 * i] *= alpha[0];
                o[4 * i + 1] *= alpha[0];
                o[4 * i + 2] *= alpha[1];
                o[4 * i + 3] *= alpha[1];
            }
        }
        FP_UNROLL
        for (u32 i = 0; i < NT; i++) {
            pf[i / 2][(i % 2) * 2] = fp_pack_bf16x2(sc[4 * i], sc[4 * i + 1]);
            pf[i / 2][(i % 2) * 2 + 1] = fp_pack_bf16x2(sc[4 * i + 2], sc[4 * i + 3]);
        }
        have_prev = true;
        prev_stage = s;
    };
    // The tiles the producer delivers, in order, until its stage without a tile; the steady
    // state is the inner loop over full tiles.
    Ring ring;  // the next stage to consume (every item's tiles and its stage without one)
    auto next = [&]() {
        fp_mbar_wait(full_bar + 8 * ring.stage, ring.phase);
        return fp_ld_shared_u32(tile_word + 4 * ring.stage);
    };
    const fp_bool<false> no;
    const fp_bool<true> yes;
    for (u32 i = first_item; i < items; i += item_step) {
        const Item w = item_at(i);
        const u32 lane_row = w.row0 + wg * 64 + w4 * 16 + g;
        if (PERSISTENT) {
            // This warpgroup's rows of the item's query tile: the block's first item loads them
            // here; every later one's were started under the last item's final P V and output
            // (below). All four warps wait for their copies, then see each other's.
            if (i == first_item) {
                load_queries(w.row0, w.kh, wg * 64, 64, tid % 128, 128);
            }
            fp_cp_async_wait<0>();
            fp_fence_proxy_async();
            fp_named_sync(3 + wg, 128);
        }
        FP_UNROLL
        for (int h = 0; h < 2; h++) {
            const u32 pr = lane_row + 8 * h;
            qp[h] = pr < packed ? qpos[pr / group] : 0u;
            m_r[h] = -FP_INF;
            l_r[h] = 0.0f;
        }
        FP_UNROLL
        for (int k = 0; k < (int)(D / 2); k++) {
            o[k] = 0.0f;
        }
        have_prev = false;
        // The producer sends at most this many tiles; the bound only matters where a stage
        // without a tile never comes (a broken producer: the emulation reports its stalled
        // wait and the loop ends here instead of stepping on forever).
        const u32 most = w.t_end > w.t_begin ? w.t_end - w.t_begin : 0u;
        u32 took = 0;  // the item's tiles stepped through
        u32 word = next();
        if (word != FP_FH_NO_TILE && most > 0) {
            // The item's first tile: no P V before it.
            if (word & FP_FH_FULL_TILE) {
                step(no, no, word & ~FP_FH_FULL_TILE, ring.stage);
            } else {
                step(yes, no, word, ring.stage);
            }
            took++;
            ring.advance();
            word = next();
        }
        while (word != FP_FH_NO_TILE && took < most) {
            if (word & FP_FH_FULL_TILE) {
                do {
                    step(no, yes, word & ~FP_FH_FULL_TILE, ring.stage);
                    took++;
                    ring.advance();
                    word = next();
                } while ((word & FP_FH_FULL_TILE) && took < most);
            } else {
                step(yes, yes, word, ring.stage);
                took++;
                ring.advance();
                word = next();
            }
        }
        if (PERSISTENT) {
            // The stage without a tile goes back to the producer for the next item's tiles.
            __syncwarp();  // every lane's read of the word before the release, as above
            if (word == FP_FH_NO_TILE && lane == 0) {
                fp_mbar_arrive(empty_bar + 8 * ring.stage);
            }
            ring.advance();
            // The next item's query rows, copied while this item's last P V and output run: the
            // products that read the rows (S) are retired by each warp in its last step, so once
            // all four warps are past their loops nothing reads them any more.
            if (i + item_step < items) {
                fp_named_sync(3 + wg, 128);
                const Item nw = item_at(i + item_step);
                load_queries(nw.row0, nw.kh, wg * 64, 64, tid % 128, 128);
            }
        }
        if (have_prev) {
            // The last tile's P V (no turn: the other warpgroup is done with the pipe or close).
            fp_acc_fence(o);
            fp_frag_fence(pf);
            fp_wgmma_fence();
            issue_pv();
            fp_wgmma_commit();
            fp_wgmma_wait<0>();
            fp_acc_fence(o);
            fp_frag_fence(pf);
            if (PERSISTENT) {
                __syncwarp();
            }
            if (PERSISTENT && lane == 0) {
                fp_mbar_arrive(empty_bar + 8 * prev_stage);  // its stage too
            }
        }

        float* out_split = out + (u64)w.z * m * n_heads * D;
        float* lse_split = lse + (u64)w.z * m * n_heads;
        FP_UNROLL
        for (int h = 0; h < 2; h++) {
            float l = l_r[h];
            l += __shfl_xor_sync(FP_FULL_MASK, l, 1);
            l += __shfl_xor_sync(FP_FULL_MASK, l, 2);
            const u32 pr = lane_row + 8 * h;
            if (pr >= packed) {
                continue;
            }
            const u32 qi = pr / group;
            const u64 row = (u64)qi * n_heads + (u64)w.kh * group + (pr - qi * group);
            const float inv = l > 0.0f ? 1.0f / l : 0.0f;
            const u64 dst = row * D + tq * 2;
            FP_UNROLL
            for (u32 k = 0; k < DT; k++) {
                fp_st_out2(out_split, out_b, dst + 8 * k, o[4 * k + 2 * h] * inv, o[4 * k + 2 * h + 1] * inv);
            }
            if (tq == 0) {
                lse_split[row] = l > 0.0f ? (m_r[h] * scale_log2 + log2f(l)) * FP_LN2 : -FP_INF;
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(FP_FH_THREADS_D64, 1)
    fp_flash_hopper_d64(const u64* maps, const bf16_t* q, const u32* qpos, const u32* kpos, const u32* ktile_lo,
                        const u32* ktile_hi, float* out, bf16_t* out_b, float* lse, u32 m, u32 n, u32 n_heads,
                        u32 n_kv_heads, float scale_log2, u32 tiles_per_split) {
    fp_flash_hopper<64, FP_FH_CONSUMERS_D64, FP_FH_STAGES, FP_FH_PINGPONG != 0, FP_FH_POLY, FP_FH_PERSISTENT != 0>(
        maps, q, qpos, kpos, ktile_lo, ktile_hi, out, out_b, lse, m, n, n_heads, n_kv_heads, scale_log2, tiles_per_split);
}

extern "C" __global__ void __launch_bounds__(FP_FH_THREADS_D128, 1)
    fp_flash_hopper_d128(const u64* maps, const bf16_t* q, const u32* qpos, const u32* kpos, const u32* ktile_lo,
                         const u32* ktile_hi, float* out, bf16_t* out_b, float* lse, u32 m, u32 n, u32 n_heads,
                         u32 n_kv_heads, float scale_log2, u32 tiles_per_split) {
    fp_flash_hopper<128, FP_FH_CONSUMERS_D128, FP_FH_STAGES, FP_FH_PINGPONG != 0, FP_FH_POLY, FP_FH_PERSISTENT != 0>(
        maps, q, qpos, kpos, ktile_lo, ktile_hi, out, out_b, lse, m, n, n_heads, n_kv_heads, scale_log2, tiles_per_split);
}
