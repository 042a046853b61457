// Tensor-core attention at FlashAttention-2's structure: the contract of flash.cu (same
// arguments, same packed-row layout, same splits and log-sum-exp), with flash.cu kept as the
// slow reference it now is. What differs is the instruction stream around each mma:
//   - shared memory is addressed by 32-bit addresses computed once per lane; every ldmatrix
//     and cp.async of a tile adds a compile-time byte offset (folded into [R+imm]);
//   - the K/V tile copy is fully unrolled from one global pointer per lane, advanced by a
//     precomputed stride; only the last tile (rows past n) computes a size per copy;
//   - the causal mask runs only on tiles that straddle some query's position: the tile step
//     is compiled twice, and full tiles run the unmasked one in a loop of their own (the
//     steady state: no per-element test, no -inf guard);
//   - the scale is folded into the exponent (one FFMA + EX2 per score); row maxima are taken on
//     the raw scores (the scale is positive);
//   - the bounds of the tile after the next are loaded before the tile's mma work and used
//     after it (no dependent global load ahead of a copy);
//   - FP_FA2_D*_WM m16 row tiles per warp (2: FlashAttention-2's 32 rows a warp, each K/V
//     fragment feeding two mma), Q kept in registers or re-read from shared memory per tile
//     (FP_FA2_D*_QREGS);
//   - the running maximum moves only when a row's rises by more than 2^FP_FA2_RESCALE, and the
//     rescale of O and l runs outside the steady-state loop;
//   - the output is written as float2 (the engine's activations are f32).
// Launch shape: per head dimension, compile-time parameters (gpu/shapes.rs writes them).

// Launch shape per head dimension (FP_FA2_D{64,128}_{WARPS,WM,KEYS,QREGS,MINB}), the key
// metadata's tile (FP_FA2_META_KEYS) and the rescale threshold (FP_FA2_RESCALE): defined by
// the header flowprefill_kernels::gpu::shapes writes before this file, for NVRTC and for the
// CPU emulation alike, in one of the configurations the autotuner chooses from. A kernel tile
// of fewer keys than the metadata's reads the bounds of the metadata tile that holds it: they
// are looser (a tile may be loaded or masked that could have been skipped), never wrong.
#if !defined(FP_FA2_D64_WARPS) || !defined(FP_FA2_D128_WARPS) || !defined(FP_FA2_META_KEYS) || !defined(FP_FA2_RESCALE)
#error "flash2.cu needs the launch-shape header of flowprefill_kernels::gpu::shapes"
#endif

// Copies key tile `tile` (K and V rows of one KV head, and their positions) into one stage.
// `kg` / `vg`: the K and V tensors, `lane_elem`: this lane's first element of key 0 in them;
// `dk` / `dv`: its first byte in the stage; `tile_elems`: elements from one tile's first row
// to the next's. PARTIAL: rows at or past n
// are zero-filled (nothing read); else every row of the tile is below n.
template <int D, int KEYS, int THREADS, bool PARTIAL>
__device__ __forceinline__ void fp_fa2_load_kv(fp_sptr dk, fp_sptr dv, fp_sptr dpos, const bf16_t* kg, const bf16_t* vg,
                                               const u32* kpos, u32 tile, u32 n, u64 row_stride, u64 tile_elems,
                                               u64 lane_elem, u32 r0) {
    constexpr u32 S = D + 8, CH = D / 8, RSTEP = THREADS / CH, PASSES = KEYS / RSTEP;
    static_assert(THREADS % CH == 0 && KEYS % RSTEP == 0, "copy shape");
    const u64 first = (u64)tile * tile_elems + lane_elem;
    const u64 step = (u64)RSTEP * row_stride;
    const bf16_t* kp = kg + first;
    const bf16_t* vp = vg + first;
    const u32 lim = PARTIAL ? n - tile * KEYS : KEYS;
    FP_UNROLL
    for (u32 i = 0; i < PASSES; i++) {
        const u32 off = i * RSTEP * S * 2;
        if (PARTIAL) {
            const bool ok = r0 + i * RSTEP < lim;
            fp_cp_async16_s(dk + off, ok ? (const void*)kp : (const void*)kg, ok ? 16u : 0u);
            fp_cp_async16_s(dv + off, ok ? (const void*)vp : (const void*)vg, ok ? 16u : 0u);
        } else {
            fp_cp_async16_full(dk + off, kp);
            fp_cp_async16_full(dv + off, vp);
        }
        kp += step;
        vp += step;
    }
    if (threadIdx.x < KEYS / 4) {
        const u32 key = tile * KEYS + threadIdx.x * 4;
        if (PARTIAL && key + 4 > n) {
            // The list's end: no copy reads past it (see fp_cp_async4), zeros after.
            FP_UNROLL
            for (u32 i = 0; i < 4; i++) {
                const bool ok = key + i < n;
                fp_cp_async4_s(dpos + threadIdx.x * 16 + i * 4, kpos + (ok ? key + i : 0u), ok ? 4u : 0u);
            }
        } else {
            fp_cp_async16_full(dpos + threadIdx.x * 16, kpos + key);
        }
    }
}

// Issues the copies of key tile `tile` into one stage: the sized copy only for the last tile
// (ANY), or the plain copy only (the caller knows the tile is whole).
template <int D, int KEYS, int THREADS, bool ANY>
__device__ __forceinline__ void fp_fa2_issue_tile(fp_sptr dk, fp_sptr dv, fp_sptr dpos, const bf16_t* kg,
                                                  const bf16_t* vg, const u32* kpos, u32 tile, u32 n, u64 row_stride,
                                                  u64 tile_elems, u64 lane_elem, u32 r0) {
    if (!ANY || (tile + 1) * KEYS <= n) {
        fp_fa2_load_kv<D, KEYS, THREADS, false>(dk, dv, dpos, kg, vg, kpos, tile, n, row_stride, tile_elems, lane_elem,
                                                r0);
    } else {
        fp_fa2_load_kv<D, KEYS, THREADS, true>(dk, dv, dpos, kg, vg, kpos, tile, n, row_stride, tile_elems, lane_elem,
                                               r0);
    }
}

// The first key tile in [t, t_end) whose smallest position (that of its metadata tile: mt
// kernel tiles each) some query of the block sees; t_end when none.
__device__ __forceinline__ u32 fp_fa2_visible_from(u32 t, u32 t_end, const u32* ktile_lo, u32 mt, u32 qhi) {
    while (t < t_end && ktile_lo[t / mt] > qhi) {
        t++;
    }
    return t;
}

// acc[mi][j] and acc[mi][j + 1] += a[mi] times the two n8 tiles of one x4 B fragment, for
// every row tile of the warp: one ldmatrix feeds 2 WM mma.
template <int WM, int N>
__device__ __forceinline__ void fp_fa2_mma_x4(float (&acc)[WM][N][4], int j, const u32 (&a)[WM][4], const u32 b[4]) {
    FP_UNROLL
    for (int mi = 0; mi < WM; mi++) {
        fp_mma_bf16_16816(acc[mi][j], a[mi], b);
        fp_mma_bf16_16816(acc[mi][j + 1], a[mi], b + 2);
    }
}

template <int D, int WM, int KEYS, int WARPS, bool Q_IN_REGS>
__device__ __forceinline__ void fp_flash2_attn(const bf16_t* q, const u32* qpos, const bf16_t* k, const bf16_t* v,
                                               const u32* kpos, const u32* ktile_lo, const u32* ktile_hi, float* out,
                                               bf16_t* out_b, float* lse, u32 m, u32 n, u32 n_heads, u32 n_kv_heads,
                                               float scale_log2, u32 tiles_per_split) {
    constexpr u32 THREADS = WARPS * 32, ROWS = WARPS * 16 * WM;
    constexpr u32 S = D + 8, NT = KEYS / 8, DT = D / 8, CH = D / 8;
    constexpr u32 ROWB = S * 2;                     // bytes per shared row
    constexpr u32 STAGE = KEYS * ROWB;              // bytes per K (or V) stage
    // Q's fragments kept in registers for the whole block (Q_REGS), or re-read from shared
    // memory per k16 slice (measured faster at d128 on an H100, where registers are short).
    constexpr bool Q_REGS = Q_IN_REGS;
    constexpr u32 MT = FP_FA2_META_KEYS / KEYS;  // kernel tiles per metadata tile
    static_assert(KEYS <= FP_FA2_META_KEYS && FP_FA2_META_KEYS % KEYS == 0, "key tile");
    FP_DYNAMIC_SMEM(smem);
    bf16_t* q_s = (bf16_t*)smem;
    const fp_sptr q_sa = fp_sptr_of(smem);
    const fp_sptr k_sa = q_sa + ROWS * ROWB;
    const fp_sptr v_sa = k_sa + 2 * STAGE;
    constexpr u32 POS_OFF = ROWS * ROWB + 4 * STAGE;  // key positions, after Q and both K/V stages
    const fp_sptr pos_sa = q_sa + POS_OFF;
    const u32* kpos_s = (const u32*)(smem + POS_OFF);
    __shared__ u32 q_range[2];

    const u32 lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const u32 group = n_heads / n_kv_heads;
    const u32 kh = blockIdx.y;
    const u32 packed = m * group;
    const u32 row0 = (gridDim.x - 1 - blockIdx.x) * ROWS;  // the last query tile first
    const u32 key_tiles = (n + KEYS - 1) / KEYS;
    // Splits are cut in metadata tiles (the host's plan): MT kernel tiles each.
    const u32 t_begin = blockIdx.z * tiles_per_split * MT;
    const u32 t_end = min(key_tiles, t_begin + tiles_per_split * MT);
    const u64 kv_stride = (u64)n_kv_heads * D;
    const u64 tile_elems = (u64)KEYS * kv_stride;
    float* out_split = out + (u64)blockIdx.z * m * n_heads * D;
    float* lse_split = lse + (u64)blockIdx.z * m * n_heads;

    // The query tile (once per block: the plain copy loop).
    for (u32 c = threadIdx.x; c < ROWS * CH; c += THREADS) {
        const u32 r = c / CH, ch = c % CH;
        const u32 pr = row0 + r;
        const bool ok = pr < packed;
        const u64 off = ok ? ((u64)(pr / group) * n_heads + (u64)kh * group + pr % group) * D + ch * 8 : 0;
        fp_cp_async16(q_s + r * S + ch * 8, q + off, ok ? 16 : 0);
    }
    fp_cp_async_commit();
    if (warp == 0) {
        fp_fa_query_range(q_range, qpos, row0, ROWS, packed, group, lane);
    }
    __syncthreads();
    const u32 qlo = q_range[0], qhi = q_range[1];

    // This lane's first row (C fragment element 0 of row tile 0); row tile mi, half h adds
    // 16 mi + 8 h.
    const u32 lane_row = row0 + warp * 16 * WM + lane / 4;
    // This lane's copy slot and its fragment addresses (byte offsets inside a stage).
    const u32 r0 = threadIdx.x / CH, c0 = threadIdx.x % CH;
    const u64 lane_elem = (u64)r0 * kv_stride + (u64)kh * D + c0 * 8;
    const u32 copy_off = r0 * ROWB + c0 * 16;
    const u32 k_lane = (fp_ldm_row_cols_first(lane) * S + fp_ldm_col_cols_first(lane)) * 2;
    const u32 v_lane = (fp_ldm_row_rows_first(lane) * S + fp_ldm_col_rows_first(lane)) * 2;
    const fp_sptr q_lane =
        q_sa + ((warp * 16 * WM + fp_ldm_row_rows_first(lane)) * S + fp_ldm_col_rows_first(lane)) * 2;

    u32 t = fp_fa2_visible_from(t_begin, t_end, ktile_lo, MT, qhi);
    u32 hi_t = t < t_end ? ktile_hi[t / MT] : 0u;
    if (t < t_end) {
        fp_fa2_issue_tile<D, KEYS, THREADS, true>(k_sa + copy_off, v_sa + copy_off, pos_sa, k, v, kpos, t, n,
                                                  kv_stride, tile_elems, lane_elem, r0);
    }
    fp_cp_async_commit();
    u32 next = fp_fa2_visible_from(t + 1, t_end, ktile_lo, MT, qhi);
    u32 hi_next = next < t_end ? ktile_hi[next / MT] : 0u;

    fp_cp_async_wait<1>();  // the query tile (the older group)
    __syncthreads();
    u32 qf[Q_REGS ? WM : 1][Q_REGS ? D / 16 : 1][4];
    if (Q_REGS) {
        FP_UNROLL
        for (int mi = 0; mi < WM; mi++) {
            FP_UNROLL
            for (int kk = 0; kk < (int)(D / 16); kk++) {
                fp_ldsm_x4(qf[Q_REGS ? mi : 0][Q_REGS ? kk : 0], q_lane + mi * 16 * ROWB + kk * 32);
            }
        }
    }

    float o[WM][DT][4];
    float m_r[WM][2], l_r[WM][2];
    FP_UNROLL
    for (int mi = 0; mi < WM; mi++) {
        FP_UNROLL
        for (int c = 0; c < (int)DT; c++) {
            o[mi][c][0] = o[mi][c][1] = o[mi][c][2] = o[mi][c][3] = 0.0f;
        }
        m_r[mi][0] = m_r[mi][1] = -FP_INF;
        l_r[mi][0] = l_r[mi][1] = 0.0f;
    }
    u32 stage = 0;
    // The tile in flight between the two halves of a step: its scores, its rows' maxima, and
    // the bounds of the tile after the next (loaded early, used at the end).
    float s[WM][NT][4];
    float mx[WM][2];
    u32 cand = 0, lo_cand = 0, hi_cand = 0;
    // A key tile in two halves. The first: the copy of the next tile issued, this tile's
    // S = Q K^T, the mask (MASKED only), the rows' maxima; it returns whether the warp must
    // rescale (some row's maximum rose by more than FP_FA2_RESCALE). Then `rescale` (only
    // then), and the second half: P, l, O += P V, the walk to the tile after the next. Each
    // half is compiled per flag: the steady state (full tiles, the next one whole too) is the
    // inner loop below, with neither the mask, the sized copy nor the rescale in it.
    // ANY_COPY: the next tile may be the last, partial one (the sized copy is compiled in).
    auto first_half = [&](auto masked, auto any_copy) -> bool {
        constexpr bool MASKED = decltype(masked)::value;
        constexpr bool ANY_COPY = decltype(any_copy)::value;
        if (next < t_end) {
            const u32 so = (stage ^ 1u) * STAGE;
            const fp_sptr dpos = pos_sa + (stage ^ 1u) * KEYS * 4;
            fp_fa2_issue_tile<D, KEYS, THREADS, ANY_COPY>(k_sa + so + copy_off, v_sa + so + copy_off, dpos, k, v, kpos,
                                                          next, n, kv_stride, tile_elems, lane_elem, r0);
        }
        fp_cp_async_commit();
        // The bounds of the tile after `next`: loaded now, used after this tile's work.
        cand = next + 1;
        lo_cand = cand < t_end ? ktile_lo[cand / MT] : 0u;
        hi_cand = cand < t_end ? ktile_hi[cand / MT] : 0u;
        fp_cp_async_wait<1>();  // tile t
        __syncthreads();
        const fp_sptr ks = k_sa + stage * STAGE + k_lane;

        // S = Q K^T: per k16 slice, each K fragment feeds WM row tiles.
        FP_UNROLL
        for (int mi = 0; mi < WM; mi++) {
            FP_UNROLL
            for (int j = 0; j < (int)NT; j++) {
                s[mi][j][0] = s[mi][j][1] = s[mi][j][2] = s[mi][j][3] = 0.0f;
            }
        }
        FP_UNROLL
        for (int kk = 0; kk < (int)(D / 16); kk++) {
            u32 qa[WM][4];
            FP_UNROLL
            for (int mi = 0; mi < WM; mi++) {
                if (Q_REGS) {
                    FP_UNROLL
                    for (int e = 0; e < 4; e++) {
                        qa[mi][e] = qf[Q_REGS ? mi : 0][Q_REGS ? kk : 0][e];
                    }
                } else {
                    fp_ldsm_x4(qa[mi], q_lane + mi * 16 * ROWB + kk * 32);
                }
            }
            FP_UNROLL
            for (int j2 = 0; j2 < (int)(KEYS / 16); j2++) {
                u32 b[4];
                fp_ldsm_x4(b, ks + j2 * 16 * ROWB + kk * 32);
                fp_fa2_mma_x4<WM>(s, 2 * j2, qa, b);
            }
        }
        if (MASKED) {
            // Keys at or past n, and keys above a row's query position, get -inf.
            const u32* kps = kpos_s + stage * KEYS;
            // This lane's rows' positions (read here: registers are scarce at 32 rows a warp).
            u32 qp[WM][2];
            FP_UNROLL
            for (int mi = 0; mi < WM; mi++) {
                FP_UNROLL
                for (int h = 0; h < 2; h++) {
                    const u32 pr = lane_row + mi * 16 + 8 * h;
                    qp[mi][h] = pr < packed ? qpos[pr / group] : 0u;
                }
            }
            FP_UNROLL
            for (int j = 0; j < (int)NT; j++) {
                FP_UNROLL
                for (int e = 0; e < 4; e++) {
                    const u32 col = j * 8 + (lane & 3) * 2 + (e & 1);
                    const bool out_of_range = t * KEYS + col >= n;
                    const u32 kp = kps[col];
                    FP_UNROLL
                    for (int mi = 0; mi < WM; mi++) {
                        if (out_of_range || kp > qp[mi][e >> 1]) {
                            s[mi][j][e] = -FP_INF;
                        }
                    }
                }
            }
        }
        // Online softmax in base 2 on raw scores: p = 2^(s scale - m scale). The running maximum
        // m moves only when a row's maximum rises by more than FP_FA2_RESCALE (log2 units), and
        // then O and l are rescaled; below that, p may reach 2^FP_FA2_RESCALE (exact enough in
        // f32 and bf16). A warp rescales only when one of its rows needs it: the steady state
        // (the maximum settled) issues no rescale.
        bool rescale = false;
        FP_UNROLL
        for (int mi = 0; mi < WM; mi++) {
            mx[mi][0] = mx[mi][1] = -FP_INF;
            FP_UNROLL
            for (int j = 0; j < (int)NT; j++) {
                mx[mi][0] = fmaxf(mx[mi][0], fmaxf(s[mi][j][0], s[mi][j][1]));
                mx[mi][1] = fmaxf(mx[mi][1], fmaxf(s[mi][j][2], s[mi][j][3]));
            }
            FP_UNROLL
            for (int h = 0; h < 2; h++) {
                mx[mi][h] = fmaxf(mx[mi][h], __shfl_xor_sync(FP_FULL_MASK, mx[mi][h], 1));
                mx[mi][h] = fmaxf(mx[mi][h], __shfl_xor_sync(FP_FULL_MASK, mx[mi][h], 2));
                // -inf (nothing seen yet) against a finite maximum: rises by +inf. A row that
                // sees nothing in this tile either: NaN, no rise.
                rescale = rescale || (mx[mi][h] - m_r[mi][h]) * scale_log2 > FP_FA2_RESCALE;
            }
        }
        return __any_sync(FP_FULL_MASK, rescale) != 0;
    };
    // O, l and m moved to every row's new maximum.
    auto rescale = [&]() {
            FP_UNROLL
            for (int mi = 0; mi < WM; mi++) {
                float alpha[2];
                FP_UNROLL
                for (int h = 0; h < 2; h++) {
                    const float nm = fmaxf(m_r[mi][h], mx[mi][h]);
                    // Every row of the warp moves to its new maximum; a row that has seen
                    // nothing keeps -inf (alpha 1: its O and l are 0).
                    alpha[h] = nm == -FP_INF ? 1.0f : fp_exp2((m_r[mi][h] - nm) * scale_log2);
                    m_r[mi][h] = nm;
                }
                l_r[mi][0] *= alpha[0];
                l_r[mi][1] *= alpha[1];
                FP_UNROLL
                for (int c = 0; c < (int)DT; c++) {
                    o[mi][c][0] *= alpha[0];
                    o[mi][c][1] *= alpha[0];
                    o[mi][c][2] *= alpha[1];
                    o[mi][c][3] *= alpha[1];
                }
            }
    };
    auto second_half = [&](auto masked) {
        constexpr bool MASKED = decltype(masked)::value;
        const fp_sptr vs = v_sa + stage * STAGE + v_lane;
        FP_UNROLL
        for (int mi = 0; mi < WM; mi++) {
            float base[2];
            FP_UNROLL
            for (int h = 0; h < 2; h++) {
                if (MASKED) {
                    // A row that has seen nothing yet subtracts 0 (never -inf - -inf).
                    base[h] = m_r[mi][h] == -FP_INF ? 0.0f : m_r[mi][h] * scale_log2;
                } else {
                    // A full tile's scores are finite, and the first tile of every row sets
                    // its maximum: finite.
                    base[h] = m_r[mi][h] * scale_log2;
                }
            }
            float sum[2] = {0.0f, 0.0f};
            FP_UNROLL
            for (int j = 0; j < (int)NT; j++) {
                FP_UNROLL
                for (int e = 0; e < 4; e++) {
                    s[mi][j][e] = fp_exp2(fmaf(s[mi][j][e], scale_log2, -base[e >> 1]));
                }
                sum[0] += s[mi][j][0] + s[mi][j][1];
                sum[1] += s[mi][j][2] + s[mi][j][3];
            }
            l_r[mi][0] += sum[0];
            l_r[mi][1] += sum[1];
        }
        // O += P V: per k16 slice of keys, each V fragment feeds WM row tiles.
        FP_UNROLL
        for (int kk = 0; kk < (int)(NT / 2); kk++) {
            u32 a[WM][4];
            FP_UNROLL
            for (int mi = 0; mi < WM; mi++) {
                a[mi][0] = fp_pack_bf16x2(s[mi][2 * kk][0], s[mi][2 * kk][1]);
                a[mi][1] = fp_pack_bf16x2(s[mi][2 * kk][2], s[mi][2 * kk][3]);
                a[mi][2] = fp_pack_bf16x2(s[mi][2 * kk + 1][0], s[mi][2 * kk + 1][1]);
                a[mi][3] = fp_pack_bf16x2(s[mi][2 * kk + 1][2], s[mi][2 * kk + 1][3]);
            }
            FP_UNROLL
            for (int c2 = 0; c2 < (int)(DT / 2); c2++) {
                u32 b[4];
                fp_ldsm_x4_trans(b, vs + kk * 16 * ROWB + c2 * 32);
                fp_fa2_mma_x4<WM>(o, 2 * c2, a, b);
            }
        }
        __syncthreads();  // every warp is done with this stage before it is refilled
        while (cand < t_end && lo_cand > qhi) {
            cand++;
            lo_cand = cand < t_end ? ktile_lo[cand / MT] : 0u;
            hi_cand = cand < t_end ? ktile_hi[cand / MT] : 0u;
        }
        stage ^= 1u;
        t = next;
        hi_t = hi_next;
        next = cand;
        hi_next = hi_cand;
    };
    // A tile is full when no key in it is above any query of the block and all its keys are
    // real (below n): no mask. The steady state runs full tiles whose next tile is whole too.
    const u32 whole = n / KEYS;  // tiles below it have every key below n
    auto full = [&]() { return hi_t <= qlo && t < whole; };
    auto next_whole = [&]() { return next < whole || next >= t_end; };
    const fp_bool<false> no;
    const fp_bool<true> yes;
    while (t < t_end) {
        if (full() && next_whole()) {
            bool r = false;
            do {
                r = first_half(no, no);
                if (r) {
                    break;
                }
                second_half(no);
            } while (t < t_end && full() && next_whole());
            if (r) {
                rescale();
                second_half(no);
            }
        } else if (full()) {
            if (first_half(no, yes)) {
                rescale();
            }
            second_half(no);
        } else {
            if (first_half(yes, yes)) {
                rescale();
            }
            second_half(yes);
        }
    }
    fp_cp_async_wait<0>();  // the last group (empty) retires before the block ends

    FP_UNROLL
    for (int mi = 0; mi < WM; mi++) {
        FP_UNROLL
        for (int h = 0; h < 2; h++) {
            float l = l_r[mi][h];
            l += __shfl_xor_sync(FP_FULL_MASK, l, 1);
            l += __shfl_xor_sync(FP_FULL_MASK, l, 2);
            const u32 pr = lane_row + mi * 16 + 8 * h;
            if (pr >= packed) {
                continue;
            }
            const u32 qi = pr / group;
            const u64 row = (u64)qi * n_heads + (u64)kh * group + (pr - qi * group);
            const float inv = l > 0.0f ? 1.0f / l : 0.0f;
            const u64 dst = row * D + (lane & 3) * 2;
            FP_UNROLL
            for (int c = 0; c < (int)DT; c++) {
                fp_st_out2(out_split, out_b, dst + c * 8, o[mi][c][2 * h] * inv, o[mi][c][2 * h + 1] * inv);
            }
            if ((lane & 3) == 0) {
                lse_split[row] = l > 0.0f ? (m_r[mi][h] * scale_log2 + log2f(l)) * FP_LN2 : -FP_INF;
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(FP_FA2_D64_WARPS * 32, FP_FA2_D64_MINB)
    fp_flash2_attn_d64(const bf16_t* q, const u32* qpos, const bf16_t* k, const bf16_t* v, const u32* kpos,
                       const u32* ktile_lo, const u32* ktile_hi, float* out, bf16_t* out_b, float* lse, u32 m, u32 n,
                       u32 n_heads, u32 n_kv_heads, float scale_log2, u32 tiles_per_split) {
    fp_flash2_attn<64, FP_FA2_D64_WM, FP_FA2_D64_KEYS, FP_FA2_D64_WARPS, FP_FA2_D64_QREGS>(
        q, qpos, k, v, kpos, ktile_lo, ktile_hi, out, out_b, lse, m, n, n_heads, n_kv_heads, scale_log2, tiles_per_split);
}

extern "C" __global__ void __launch_bounds__(FP_FA2_D128_WARPS * 32, FP_FA2_D128_MINB)
    fp_flash2_attn_d128(const bf16_t* q, const u32* qpos, const bf16_t* k, const bf16_t* v, const u32* kpos,
                        const u32* ktile_lo, const u32* ktile_hi, float* out, bf16_t* out_b, float* lse, u32 m, u32 n,
                        u32 n_heads, u32 n_kv_heads, float scale_log2, u32 tiles_per_split) {
    fp_flash2_attn<128, FP_FA2_D128_WM, FP_FA2_D128_KEYS, FP_FA2_D128_WARPS, FP_FA2_D128_QREGS>(
        q, qpos, k, v, kpos, ktile_lo, ktile_hi, out, out_b, lse, m, n, n_heads, n_kv_heads, scale_log2, tiles_per_split);
}
