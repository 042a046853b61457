//! The tensor-core kernels (flash.cu, probe.cu) and the bf16 variants of the simple kernels, run
//! on the CPU through the launch shim's emulations of `mma.sync` m16n8k16, `ldmatrix` (.trans)
//! and `cp.async`, against f64 references on bf16-rounded inputs: head_dim 64 and 128, query
//! heads per KV head 1, 3, 4, 7, lengths that are not multiples of the 64-row / 64-key tiles,
//! rows that see no key, unsorted and repeated positions, scores up to about +-80, key splits
//! (flash-decoding) merged by the combine kernel. flash2.cu runs in every configuration of
//! `gpu::shapes` (the autotuner's candidates) on the odd shapes and the rescale case. The shapes stay small: every emulated mma
//! costs two barriers of 32 threads.

use flowprefill_kernels::attention::{attention_ref, attention_scores_ref, KvRef};
use flowprefill_kernels::rope::{rope_ref, RopeStyle, RopeTable};
use flowprefill_kernels_emu as emu;

mod common;
use common::{assert_close, bf16_ref, bf16_val, case, max_err, rand_vec, rng, to_bf16, Case};

/// The tensor-core product of bf16 inputs: exact products, f32 sums of 16 terms.
const PROBE_TOL: f32 = 1e-5;
/// FlashAttention-2's rule for the output (its `tests/test_flash_attn.py`): the error against
/// an f64 reference is at most this factor times the error of the naive bf16 computation
/// (probabilities rounded to bf16 before multiplying V) ...
const FLASH_NAIVE_FACTOR: f32 = 2.0;
/// ... plus this.
const FLASH_NAIVE_SLACK: f32 = 1e-5;
/// And never more than this times max|V|: the bf16 rounding of P moves each weight by at most
/// 2^-9 of itself.
const FLASH_CEILING: f32 = 4e-3;
/// Log-sum-exp, relative to max(1, |lse|): f32 row sums, exp2 in f32.
const FLASH_LSE_TOL: f32 = 2e-5;
/// Per-key attention mass, relative to max(1e-3, the reference's mass): exact bf16 products,
/// f32 dot products and sums.
const FLASH_SCORES_TOL: f32 = 1e-4;
/// The simple kernels with bf16 keys and values against the reference on the same (widened)
/// values: the f32 kernel's tolerances.
const ATTN_OUT_TOL: f32 = 5e-5;
const ATTN_LSE_TOL: f32 = 5e-5;
const SCORES_TOL_PER_ROW: f32 = 2e-6;

/// A plain product of bf16 A [16][16] and B [16][16] in f64.
fn product(a: &[f32], b: &[f32]) -> Vec<f32> {
    let mut d = vec![0f32; 256];
    for i in 0..16 {
        for j in 0..16 {
            d[i * 16 + j] = (0..16).map(|k| a[i * 16 + k] as f64 * b[k * 16 + j] as f64).sum::<f64>() as f32;
        }
    }
    d
}

#[test]
fn the_mma_probe_matches_a_plain_product_through_both_operand_layouts() {
    let mut r = rng(40);
    for amp in [1.0, 30.0] {
        let (a_bits, a) = to_bf16(&rand_vec(&mut r, 256, amp));
        let (b_bits, b) = to_bf16(&rand_vec(&mut r, 256, amp));
        // B as [n][k] (how K is stored) and as [k][n] (how V is stored).
        let b_nk: Vec<u16> = (0..256).map(|i| b_bits[(i % 16) * 16 + i / 16]).collect();
        let (d_nk, d_kn) = emu::probe_mma(&a_bits, &b_nk, &b_bits);
        let want = product(&a, &b);
        let scale = amp * amp * 16.0;
        let norm = |x: &[f32]| x.iter().map(|v| v / scale).collect::<Vec<f32>>();
        assert_close("mma via ldmatrix ([n][k] B)", &norm(&d_nk), &norm(&want), PROBE_TOL);
        assert_close("mma via ldmatrix.trans ([k][n] B)", &norm(&d_kn), &norm(&want), PROBE_TOL);
    }
}

/// Attention in f64 over the given (bf16-valued) inputs. With `round_p`, each probability is
/// rounded to bf16 before it multiplies V, and the row is normalised by the unrounded sum: the
/// naive bf16 computation of FlashAttention-2's test rule.
fn attention_f64(c: &Case, q: &[f32], k: &[f32], v: &[f32], round_p: bool) -> (Vec<f32>, Vec<f32>) {
    let s = &c.shape;
    let (d, g) = (s.head_dim, s.group());
    let (m, n) = (c.qpos.len(), c.kpos.len());
    let mut out = vec![0f32; m * s.q_dim()];
    let mut lse = vec![f32::NEG_INFINITY; m * s.n_heads];
    for i in 0..m {
        for h in 0..s.n_heads {
            let kh = h / g;
            let qi = &q[(i * s.n_heads + h) * d..][..d];
            let vis: Vec<usize> = (0..n).filter(|&j| c.kpos[j] <= c.qpos[i]).collect();
            if vis.is_empty() {
                continue;
            }
            let sc: Vec<f64> = vis
                .iter()
                .map(|&j| {
                    let kj = &k[(j * s.n_kv_heads + kh) * d..][..d];
                    qi.iter().zip(kj).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() * s.scale as f64
                })
                .collect();
            let mx = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let p: Vec<f64> = sc.iter().map(|x| (x - mx).exp()).collect();
            let l: f64 = p.iter().sum();
            let o = &mut out[(i * s.n_heads + h) * d..][..d];
            for (&j, &pj) in vis.iter().zip(&p) {
                let w = if round_p { bf16_val(bf16_ref(pj as f32)) as f64 } else { pj };
                let vj = &v[(j * s.n_kv_heads + kh) * d..][..d];
                for (oo, &vv) in o.iter_mut().zip(vj) {
                    *oo += (w * vv as f64 / l) as f32;
                }
            }
            lse[i * s.n_heads + h] = (mx + l.ln()) as f32;
        }
    }
    (out, lse)
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    flowprefill_kernels::testing::max_abs_diff(a, b)
}

/// Runs the flash kernel on `c` (its inputs rounded to bf16) and checks it by the rules above;
/// returns the plan it ran.
fn check_flash(kernel: emu::FlashKernel, c: &Case, splits: Option<u32>, label: &str) -> emu::FlashPlan {
    let (qb, q) = to_bf16(&c.q);
    let (kb, k) = to_bf16(&c.k);
    let (vb, v) = to_bf16(&c.v);
    let (m, heads) = (c.qpos.len(), c.shape.n_heads);
    let (mut out, mut lse) = (vec![7f32; c.q.len()], vec![7f32; m * heads]);
    let plan = emu::flash_attention(kernel, &c.shape, &qb, &c.qpos, &kb, &vb, &c.kpos, &mut out, &mut lse, 132, splits);
    let (want, want_lse) = attention_f64(c, &q, &k, &v, false);
    let (naive, _) = attention_f64(c, &q, &k, &v, true);
    assert!(out.iter().all(|x| x.is_finite()), "{label}: a non-finite output");
    let err = max_abs_diff(&out, &want);
    let naive_err = max_abs_diff(&naive, &want);
    let vmax = v.iter().fold(0f32, |a, b| a.max(b.abs()));
    assert!(
        err <= FLASH_NAIVE_FACTOR * naive_err + FLASH_NAIVE_SLACK,
        "{label}: out error {err:e}, naive bf16 error {naive_err:e}"
    );
    assert!(err <= FLASH_CEILING * vmax.max(f32::MIN_POSITIVE), "{label}: out error {err:e} above the ceiling");
    assert_close(&format!("{label} lse"), &lse, &want_lse, FLASH_LSE_TOL);
    plan
}

/// Every configuration of flash2 and the reference kernel on [`odd_shapes`].
#[test]
fn flash2_matches_the_reference_on_odd_shapes() {
    odd_shapes(|k| !k.is_hopper());
}

/// Every configuration of the Hopper kernel on [`odd_shapes`] (a test of its own: the two
/// halves run side by side, CI time).
#[test]
fn the_hopper_kernel_matches_the_reference_on_odd_shapes() {
    odd_shapes(emu::FlashKernel::is_hopper);
}

/// Keys from which a shape of [`odd_shapes`] is the Hopper kernel's only: its stages over many
/// 128-key tiles. flash2's walk over many 64-key tiles in one block is the 700-key shape's (one
/// forced split: eleven tiles; elsewhere the plan spreads keys over 132 SMs, a tile or two a
/// block); its configurations over 1000 keys as well cost CI time and showed nothing more.
const HOPPER_STAGE_KEYS: usize = 1000;

/// The kernels of [`emu::FlashKernel::every`] that `which` picks, on odd shapes against the
/// f64 reference.
fn odd_shapes(which: impl Fn(emu::FlashKernel) -> bool) {
    let mut r = rng(41);
    // (m, n, heads, kv heads, head_dim, scattered positions, forced key splits)
    for &(m, n, heads, kv, d, scattered, splits) in &[
        (1, 1, 1, 1, 64, false, None),
        (17, 129, 9, 3, 64, false, None), // SmolLM2's heads: a prompt after 112 cached tokens
        (65, 65, 4, 1, 64, false, None),  // prefill, 4 heads per KV head: 260 packed rows
        (129, 129, 1, 1, 64, false, None), // 3 x 3 tiles, causal: whole tiles skipped
        (15, 100, 7, 1, 128, true, None), // unsorted, repeated positions; rows that see nothing
        (63, 63, 2, 2, 128, false, Some(1)),
        (1, 257, 9, 3, 64, false, Some(5)), // a decode step split over 5 key tiles
        (3, 200, 8, 2, 128, true, Some(3)),
        (16, 0, 2, 1, 64, false, None),       // no keys: out 0, lse -inf
        (130, 300, 4, 1, 64, false, None),    // 520 packed rows: 5 blocks of 128, the last partial
        (70, 150, 8, 2, 128, false, Some(2)), // 32-key tiles under 64-key metadata, split in two
        (40, 97, 4, 4, 128, true, None),      // scattered: every 32-key tile masked, one partial
        // One split over many tiles: each of the Hopper kernel's 3 stages holds 2 or 3 of its
        // 128-key tiles, full ones then masked ones (without the forced split the plan spreads
        // the keys over 132 SMs, a tile or two a block, and a stage read for another passes).
        // The Hopper kernel's only ([`HOPPER_STAGE_KEYS`]).
        (40, 1000, 4, 1, 128, false, Some(1)),
        (33, 700, 9, 3, 64, false, Some(1)),
    ] {
        let c = case(&mut r, m, n, heads, kv, d, scattered);
        let picked = |k: emu::FlashKernel| which(k) && (n < HOPPER_STAGE_KEYS || k.is_hopper());
        for kernel in emu::FlashKernel::every().into_iter().filter(|&k| picked(k)) {
            let label = format!("flash {kernel:?} m={m} n={n} heads={heads}/{kv} d={d} splits={splits:?}");
            let plan = check_flash(kernel, &c, splits, &label);
            if let Some(s) = splits {
                assert!(plan.splits <= s && plan.splits >= 1, "{label}: {plan:?}");
            }
        }
    }
}

/// A bf16 output (the bf16 forward's, which its output projection reads as it is) is the f32
/// output rounded once to nearest even, value for value: from each kernel's own epilogue
/// without key splits, from the combine kernel with them; the log-sum-exp is the same either
/// way. The kernels' own tests cover every configuration; the epilogue is one per kernel, so
/// here the default ones, and the Hopper kernel with one and with three consumer warpgroups
/// (other rows per thread and block).
#[test]
fn a_bf16_output_is_the_f32_output_rounded_once() {
    let mut r = rng(47);
    // (m, n, heads, kv heads, head_dim, scattered positions, forced key splits)
    for &(m, n, heads, kv, d, scattered, splits) in &[
        (17, 129, 9, 3, 64, false, Some(1)), // full and masked tiles, a partial query tile
        (3, 200, 8, 2, 128, true, Some(3)),  // key splits: the combine writes the output
        (15, 100, 7, 1, 128, true, Some(1)), // unsorted positions, rows that see no key
    ] {
        let kernels =
            emu::FlashKernel::ALL.into_iter().chain([emu::FlashKernel::Hopper(3), emu::FlashKernel::Hopper(6)]);
        let c = case(&mut r, m, n, heads, kv, d, scattered);
        let ((qb, _), (kb, _), (vb, _)) = (to_bf16(&c.q), to_bf16(&c.k), to_bf16(&c.v));
        let lse_len = m * heads;
        for kernel in kernels {
            let label = format!("{kernel:?} m={m} n={n} heads={heads}/{kv} d={d} splits={splits:?}");
            let (mut o32, mut l32) = (vec![7f32; c.q.len()], vec![7f32; lse_len]);
            let (mut o16, mut l16) = (vec![0x7fc1u16; c.q.len()], vec![7f32; lse_len]);
            let p32 = emu::flash_attention(
                kernel, &c.shape, &qb, &c.qpos, &kb, &vb, &c.kpos, &mut o32, &mut l32, 132, splits,
            );
            let p16 = emu::flash_attention(
                kernel, &c.shape, &qb, &c.qpos, &kb, &vb, &c.kpos, &mut o16, &mut l16, 132, splits,
            );
            assert_eq!(p16, p32, "{label}: one plan for both outputs");
            let rounded: Vec<u16> = o32.iter().map(|&x| bf16_ref(x)).collect();
            let first = o16.iter().zip(&rounded).position(|(a, b)| a != b);
            assert!(first.is_none(), "{label}: bf16 output {first:?} is not the f32 output rounded");
            assert_eq!(l16, l32, "{label}: the log-sum-exp");
        }
        // The simple kernel (f32 queries, bf16 keys and values) too.
        let (mut o32, mut l32) = (vec![7f32; c.q.len()], vec![7f32; lse_len]);
        let (mut o16, mut l16) = (vec![0x7fc1u16; c.q.len()], vec![7f32; lse_len]);
        emu::attention(&c.shape, &c.q, &c.qpos, &kb, &vb, &c.kpos, &mut o32, &mut l32);
        emu::attention(&c.shape, &c.q, &c.qpos, &kb, &vb, &c.kpos, &mut o16, &mut l16);
        assert_eq!(o16, o32.iter().map(|&x| bf16_ref(x)).collect::<Vec<u16>>(), "simple kernel: bf16 output");
        assert_eq!(l16, l32, "simple kernel: the log-sum-exp");
    }
}

/// The persistent configuration (7: configuration 0's kernel walking work items, at most a block
/// per SM) gives configuration 0's answers bit for bit when each block walks several items: the
/// stages, their phases and the ping-pong's turns carry over from one item to the next, each
/// consumer warpgroup reloads its query rows, items without a visible tile (a causal query tile
/// against a later key split) send only their stage without a tile. The other tests run it
/// with 132 SMs, where a block mostly has one item.
#[test]
fn the_persistent_kernel_walks_several_items_a_block() {
    let mut r = rng(48);
    // (m, n, heads, kv heads, head_dim, scattered positions, forced key splits)
    for &(m, n, heads, kv, d, scattered, splits) in &[
        (130, 300, 4, 1, 64, false, None),    // 5 query tiles of one head
        (129, 129, 1, 1, 64, false, Some(3)), // causal: late splits of early tiles see nothing
        (70, 150, 8, 2, 128, true, Some(2)),  // two heads, scattered positions, two splits
    ] {
        let c = case(&mut r, m, n, heads, kv, d, scattered);
        let ((qb, _), (kb, _), (vb, _)) = (to_bf16(&c.q), to_bf16(&c.k), to_bf16(&c.v));
        for sms in [1, 2, 3] {
            let run = |kernel| {
                let (mut o, mut l) = (vec![7f32; c.q.len()], vec![7f32; m * heads]);
                let plan = emu::flash_attention(
                    kernel, &c.shape, &qb, &c.qpos, &kb, &vb, &c.kpos, &mut o, &mut l, sms, splits,
                );
                (plan, o, l)
            };
            let (p0, o0, l0) = run(emu::FlashKernel::Hopper(0));
            let (p7, o7, l7) = run(emu::FlashKernel::Hopper(7));
            let label = format!("m={m} n={n} heads={heads}/{kv} d={d} {sms} SMs: {p7:?}");
            assert_eq!((p7.q_tiles, p7.splits), (p0.q_tiles, p0.splits), "{label}");
            let items = p7.q_tiles * kv as u32 * p7.splits;
            assert_eq!(p7.blocks, items.min(sms), "{label}: at most a block per SM");
            assert!(items > p7.blocks, "{label}: blocks with several items");
            assert!(o7 == o0 && l7 == l0, "{label}: not configuration 0's answers");
        }
    }
}

#[test]
fn flash_attention_keeps_large_scores_finite_and_exact() {
    // |q . k| * scale up to about 80: the online softmax must rescale, not overflow.
    let mut r = rng(42);
    for &(m, n, heads, kv, d) in &[(20, 90, 3, 1, 64), (9, 70, 4, 2, 128)] {
        let mut c = case(&mut r, m, n, heads, kv, d, false);
        c.q = rand_vec(&mut r, c.q.len(), 15.0);
        c.k = rand_vec(&mut r, c.k.len(), 15.0);
        // Every configuration the autotuner may pick: the polynomial exp2 (Hopper 4 and 5)
        // meets its clamp and underflow (arguments at or below -126) only at scores this large.
        for kernel in emu::FlashKernel::every() {
            check_flash(kernel, &c, None, &format!("flash {kernel:?} large scores d={d}"));
        }
    }
}

/// The fast kernel moves its running maximum only when a row's maximum rises by more than 2^8
/// (then O and l are rescaled, outside its steady-state loop): a key far past the first tiles
/// with a much larger score makes every row rescale in the middle of a run of full tiles, and
/// keys a little larger (below the threshold) leave probabilities above 1 in flight.
#[test]
fn flash_attention_rescales_when_a_late_key_dominates() {
    let mut r = rng(44);
    for &(m, n, heads, kv, d, late) in &[(8, 520, 4, 1, 128, 300), (8, 520, 2, 1, 64, 330)] {
        let mut c = case(&mut r, m, n, heads, kv, d, false);
        // Every query sees every key (positions past the keys').
        let top = c.kpos.iter().copied().max().unwrap_or(0);
        for p in c.qpos.iter_mut() {
            *p = top + 1 + *p % 3;
        }
        let kvd = c.shape.kv_dim();
        // A late key aligned with the queries (a score about +40 above the rest), and a
        // middle key raised a little (+3, under the threshold).
        let q0: Vec<f32> = c.q[..d].to_vec();
        for h in 0..kv {
            for (i, &x) in q0.iter().enumerate() {
                c.k[late * kvd + h * d + i] = x * 4.0;
                c.k[200 * kvd + h * d + i] += x * 0.3;
            }
        }
        for kernel in emu::FlashKernel::every() {
            check_flash(kernel, &c, None, &format!("flash {kernel:?} late dominant key d={d}"));
        }
    }
}

#[test]
fn flash_partials_over_disjoint_keys_merge_into_one_call() {
    let mut r = rng(43);
    let c = case(&mut r, 12, 150, 6, 2, 64, true);
    for kernel in emu::FlashKernel::every() {
        partials_merge(kernel, &c);
    }
}

fn partials_merge(kernel: emu::FlashKernel, c: &Case) {
    let (qb, _) = to_bf16(&c.q);
    let (kb, _) = to_bf16(&c.k);
    let (vb, _) = to_bf16(&c.v);
    let kvd = c.shape.kv_dim();
    let lse_len = 12 * 6;
    let (mut whole_o, mut whole_l) = (vec![0f32; c.q.len()], vec![0f32; lse_len]);
    emu::flash_attention(kernel, &c.shape, &qb, &c.qpos, &kb, &vb, &c.kpos, &mut whole_o, &mut whole_l, 132, Some(1));
    let cut = 70;
    let (mut o1, mut l1) = (vec![0f32; c.q.len()], vec![0f32; lse_len]);
    let (mut o2, mut l2) = (vec![0f32; c.q.len()], vec![0f32; lse_len]);
    let (k1, k2) = kb.split_at(cut * kvd);
    let (v1, v2) = vb.split_at(cut * kvd);
    let (p1, p2) = c.kpos.split_at(cut);
    emu::flash_attention(kernel, &c.shape, &qb, &c.qpos, k1, v1, p1, &mut o1, &mut l1, 132, Some(1));
    emu::flash_attention(kernel, &c.shape, &qb, &c.qpos, k2, v2, p2, &mut o2, &mut l2, 132, Some(1));
    emu::merge_partial(&mut o1, &mut l1, &o2, &l2, c.shape.head_dim);
    // Two calls round P at other running maxima than one call: within the bf16 ceiling.
    let vmax = c.v.iter().fold(0f32, |a, b| a.max(b.abs()));
    assert!(max_abs_diff(&o1, &whole_o) <= FLASH_CEILING * vmax, "{kernel:?} split + merge out");
    assert_close(&format!("{kernel:?} split + merge lse"), &l1, &whole_l, FLASH_LSE_TOL);
}

#[test]
fn flash_scores_match_the_reference() {
    let mut r = rng(44);
    for &(m, n, heads, kv, d, scattered) in &[
        (4, 130, 9, 3, 64, false),
        (11, 70, 14, 2, 64, true),
        (30, 65, 4, 1, 128, false), // 120 packed rows: two query tiles
        (1, 1, 1, 1, 128, false),
    ] {
        let c = case(&mut r, m, n, heads, kv, d, scattered);
        let (qb, q) = to_bf16(&c.q);
        let (kb, k) = to_bf16(&c.k);
        let (_, v) = to_bf16(&c.v);
        let (_, lse) = attention_f64(&c, &q, &k, &v, false);
        let mut got = vec![0.25f32; n];
        emu::flash_scores(&c.shape, &qb, &c.qpos, &kb, &c.kpos, &lse, &mut got);
        let mut want = vec![0.25f32; n];
        attention_scores_ref(&c.shape, &q, &c.qpos, KvRef { k: &k, v: &[], pos: &c.kpos }, &lse, &mut want).unwrap();
        for (j, (&g, &w)) in got.iter().zip(&want).enumerate() {
            // Relative, with a floor for the keys that take almost no mass.
            const SCORE_FLOOR: f32 = 1e-3;
            let tol = FLASH_SCORES_TOL * w.abs().max(SCORE_FLOOR);
            assert!((g - w).abs() <= tol, "flash scores m={m} n={n} d={d}: key {j} got {g}, want {w}");
        }
    }
}

#[test]
fn simple_kernels_take_bf16_keys_and_values() {
    let mut r = rng(45);
    for &(m, n, heads, kv, d, scattered) in &[(5, 70, 9, 3, 64, false), (3, 40, 7, 1, 80, true)] {
        let c = case(&mut r, m, n, heads, kv, d, scattered);
        let (kb, k) = to_bf16(&c.k);
        let (vb, v) = to_bf16(&c.v);
        let (mut out, mut lse) = (vec![0f32; c.q.len()], vec![0f32; m * heads]);
        emu::attention(&c.shape, &c.q, &c.qpos, &kb, &vb, &c.kpos, &mut out, &mut lse);
        let (mut want, mut want_lse) = (vec![0f32; c.q.len()], vec![0f32; m * heads]);
        let kvr = KvRef { k: &k, v: &v, pos: &c.kpos };
        attention_ref(&c.shape, &c.q, &c.qpos, kvr, &mut want, &mut want_lse).unwrap();
        assert_close("attention kv bf16 out", &out, &want, ATTN_OUT_TOL);
        assert_close("attention kv bf16 lse", &lse, &want_lse, ATTN_LSE_TOL);
        let mut got = vec![0f32; n];
        emu::attention_scores(&c.shape, &c.q, &c.qpos, &kb, &c.kpos, &want_lse, &mut got);
        let mut want_s = vec![0f32; n];
        attention_scores_ref(&c.shape, &c.q, &c.qpos, kvr, &want_lse, &mut want_s).unwrap();
        assert_close("scores k bf16", &got, &want_s, SCORES_TOL_PER_ROW * (m * heads) as f32);
    }
}

#[test]
fn bf16_copies_and_rope_round_once() {
    let mut r = rng(46);
    let (rows, src_cols, col, width) = (9, 40, 8, 24);
    let src = rand_vec(&mut r, rows * src_cols, 3.0);
    let mut got = vec![0u16; rows * width];
    emu::copy_columns(&src, src_cols, col, width, &mut got);
    let want: Vec<u16> = (0..rows * width).map(|e| bf16_ref(src[(e / width) * src_cols + col + e % width])).collect();
    assert_eq!(got, want, "copy_columns f32 -> bf16");
    let mut again = vec![0u16; rows * 16];
    emu::copy_columns(&got, width, 4, 16, &mut again);
    let want2: Vec<u16> = (0..rows * 16).map(|e| got[(e / 16) * width + 4 + e % 16]).collect();
    assert_eq!(again, want2, "copy_columns bf16 -> bf16");
    let mut scattered = vec![0u16; 5 * width];
    emu::copy_rows(&got, &[8, 0, 3], &mut scattered, &[4, 1, 0], width);
    assert_eq!(&scattered[4 * width..], &got[8 * width..9 * width]);
    assert_eq!(&scattered[..width], &got[3 * width..4 * width]);

    // RoPE on bf16: rotated in f32 from the stored values, rounded once.
    let table = RopeTable::new(64, 64, 10000.0, RopeStyle::Neox, None, 100).unwrap();
    let positions: Vec<u32> = vec![0, 5, 99, 100, 3000];
    let (bits, vals) = to_bf16(&rand_vec(&mut r, positions.len() * 2 * 64, 2.0));
    let mut got = bits.clone();
    emu::rope(&mut got, 2, &positions, &table);
    let mut wide = vals.clone();
    emu::rope(&mut wide, 2, &positions, &table);
    let want: Vec<u16> = wide.iter().map(|&x| bf16_ref(x)).collect();
    assert_eq!(got, want, "rope bf16 = round(rope f32)");
    // Placed in one pass: the same bits as the in-place rotation.
    let mut placed = vec![0xffffu16; bits.len()];
    emu::rope_copy(&bits, &mut placed, 2, &positions, &table);
    assert_eq!(placed, got, "rope_copy bf16 = rope bf16 in place");
    let mut reference = vals;
    rope_ref(&mut reference, 2, &positions, &table).unwrap();
    let widened: Vec<f32> = got.iter().map(|&b| bf16_val(b)).collect();
    // One bf16 rounding of the rotated value: half an ulp of its 8-bit mantissa, 2^-8 relative.
    const ROPE_BF16_TOL: f32 = 1.0 / 128.0;
    assert!(max_err(&widened, &reference) <= ROPE_BF16_TOL, "rope bf16 against the reference");
}

/// The QKV split in one launch writes what the seven launches it replaces write (copies,
/// conversions to the cache type, in-place rotations), bit for bit, for f32 and bf16 caches,
/// grouped-query heads, and a rotation over part of the head; every output value is written.
#[test]
fn split_qkv_rope_is_the_seven_ops_it_replaces() {
    let mut r = rng(47);
    for (style, head_dim, rot_dim, heads) in
        [(RopeStyle::Interleaved, 64, 64, (6, 2)), (RopeStyle::Neox, 64, 64, (4, 4)), (RopeStyle::Neox, 48, 16, (3, 1))]
    {
        let table = RopeTable::new(head_dim, rot_dim, 10000.0, style, None, 100).unwrap();
        let positions: Vec<u32> = vec![0, 7, 99, 100, 2500];
        let rows = positions.len();
        let (qd, kvd) = (heads.0 * head_dim, heads.1 * head_dim);
        let qkvd = qd + 2 * kvd;
        let qkv = rand_vec(&mut r, rows * qkvd, 2.0);
        let what = format!("{style:?} {head_dim}/{rot_dim} heads {heads:?}");

        // The reference: the ops one by one (as the CPU backend and the model always did).
        let mut q_want = vec![0f32; rows * qd];
        emu::copy_columns(&qkv, qkvd, 0, qd, &mut q_want);
        emu::rope(&mut q_want, heads.0, &positions, &table);
        let mut q = vec![f32::NAN; rows * qd];

        // bf16 cache.
        let mut kp_want = vec![0u16; rows * kvd];
        emu::copy_columns(&qkv, qkvd, qd, kvd, &mut kp_want);
        let mut v_want = vec![0u16; rows * kvd];
        emu::copy_columns(&qkv, qkvd, qd + kvd, kvd, &mut v_want);
        let mut k_want = kp_want.clone();
        emu::rope(&mut k_want, heads.1, &positions, &table);
        let (mut kp, mut k, mut v) =
            (vec![0xffffu16; rows * kvd], vec![0xffffu16; rows * kvd], vec![0xffffu16; rows * kvd]);
        emu::split_qkv_rope(&qkv, heads, &positions, &table, &mut q, &mut kp, &mut k, &mut v);
        let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&q), bits(&q_want), "{what}: q");
        assert_eq!((kp, k, v), (kp_want, k_want, v_want), "{what}: bf16 k_pre, k, v");

        // f32 cache.
        let mut kp_want = vec![0f32; rows * kvd];
        emu::copy_columns(&qkv, qkvd, qd, kvd, &mut kp_want);
        let mut v_want = vec![0f32; rows * kvd];
        emu::copy_columns(&qkv, qkvd, qd + kvd, kvd, &mut v_want);
        let mut k_want = kp_want.clone();
        emu::rope(&mut k_want, heads.1, &positions, &table);
        let (mut kp, mut k, mut v) =
            (vec![f32::NAN; rows * kvd], vec![f32::NAN; rows * kvd], vec![f32::NAN; rows * kvd]);
        let mut q = vec![f32::NAN; rows * qd];
        emu::split_qkv_rope(&qkv, heads, &positions, &table, &mut q, &mut kp, &mut k, &mut v);
        assert_eq!(bits(&q), bits(&q_want), "{what}: q (f32 cache)");
        assert_eq!(
            (bits(&kp), bits(&k), bits(&v)),
            (bits(&kp_want), bits(&k_want), bits(&v_want)),
            "{what}: f32 k_pre, k, v"
        );
        // And the Rust reference of the rotation.
        let mut reference = kp_want.clone();
        rope_ref(&mut reference, heads.1, &positions, &table).unwrap();
        // f32 rotations of the same values by the same table: a few ulps.
        const ROPE_F32_TOL: f32 = 1e-5;
        assert!(max_err(&k, &reference) <= ROPE_F32_TOL, "{what}: k against rope_ref");
    }
}
