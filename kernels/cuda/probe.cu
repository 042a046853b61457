// A self-check of the tensor-core path: one warp multiplies a 16x16 A by a 16x16 B with
// mma.sync m16n8k16, loading A by ldmatrix from a row-major tile and B twice, as the attention
// kernel loads its operands: from an [n][k] tile (like K) with ldmatrix, and from a [k][n] tile
// (like V) with ldmatrix.trans. d_nk and d_kn must both equal A B (f32 [16][16]). Run on a GPU
// (tests/cuda_ops.rs, `flowprefill devices`) it checks the fragment layouts the CPU emulation
// assumes against the hardware; in the emulation, against the reference product.

extern "C" __global__ void fp_probe_mma(const bf16_t* a, const bf16_t* b_nk, const bf16_t* b_kn, float* d_nk,
                                        float* d_kn) {
    const u32 stride = 24;  // 48-byte rows: 16-byte aligned, 8 rows in 8 bank groups
    FP_DYNAMIC_SMEM(smem);
    bf16_t* a_s = (bf16_t*)smem;
    bf16_t* nk_s = a_s + 16 * stride;
    bf16_t* kn_s = nk_s + 16 * stride;
    const u32 lane = threadIdx.x % 32;
    for (u32 i = lane; i < 256; i += 32) {
        a_s[(i / 16) * stride + i % 16] = a[i];
        nk_s[(i / 16) * stride + i % 16] = b_nk[i];
        kn_s[(i / 16) * stride + i % 16] = b_kn[i];
    }
    __syncwarp();
    u32 af[4], bnk[4], bkn[4];
    fp_ldmatrix_x4(af, a_s + fp_ldm_row_rows_first(lane) * stride + fp_ldm_col_rows_first(lane));
    fp_ldmatrix_x4(bnk, nk_s + fp_ldm_row_cols_first(lane) * stride + fp_ldm_col_cols_first(lane));
    fp_ldmatrix_x4_trans(bkn, kn_s + fp_ldm_row_rows_first(lane) * stride + fp_ldm_col_rows_first(lane));
    float c_nk[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    float c_kn[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    fp_mma_bf16_16816(c_nk[0], af, bnk);
    fp_mma_bf16_16816(c_nk[1], af, bnk + 2);
    fp_mma_bf16_16816(c_kn[0], af, bkn);
    fp_mma_bf16_16816(c_kn[1], af, bkn + 2);
    FP_UNROLL
    for (int nt = 0; nt < 2; nt++) {
        FP_UNROLL
        for (int e = 0; e < 4; e++) {
            u32 row = lane / 4 + (e >= 2 ? 8 : 0), col = nt * 8 + (lane & 3) * 2 + (e & 1);
            d_nk[row * 16 + col] = c_nk[nt][e];
            d_kn[row * 16 + col] = c_kn[nt][e];
        }
    }
}
