use super::*;
use crate::merge::merge_partial;
use crate::simd;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Max abs error of attention outputs (values of order 1) against the f64 reference.
const ATTN_OUT_TOL: f32 = 3e-5;
/// Max abs error of the log-sum-exp, relative to max(1, |lse|).
const ATTN_LSE_TOL: f32 = 3e-5;
/// Split-keys-and-merge against one pass (both f32): same bound as against the reference.
const MERGE_TOL: f32 = 3e-5;
/// Max abs error of per-key attention mass (sum over rows; values up to ~rows) per row.
const SCORES_TOL_PER_ROW: f32 = 2e-6;

/// An attention implementation under test.
type AttnFn = fn(&AttnShape, &[f32], &[u32], KvRef<'_>, &mut [f32], &mut [f32]) -> crate::Result<()>;

struct Case {
    shape: AttnShape,
    q: Vec<f32>,
    qpos: Vec<u32>,
    k: Vec<f32>,
    v: Vec<f32>,
    kpos: Vec<u32>,
}

impl Case {
    fn kv(&self) -> KvRef<'_> {
        KvRef { k: &self.k, v: &self.v, pos: &self.kpos }
    }
}

#[derive(Clone, Copy)]
enum Layout {
    /// Prefill of the last m of n tokens: qpos = n-m.., kpos = 0..n.
    Causal,
    /// Arbitrary positions with gaps and repeats, some queries before every key.
    Scattered,
}

fn case(rng: &mut StdRng, m: usize, n: usize, heads: usize, kv_heads: usize, d: usize, layout: Layout) -> Case {
    let shape = AttnShape::new(heads, kv_heads, d).unwrap();
    let mut r = |len: usize, amp: f32| -> Vec<f32> { (0..len).map(|_| rng.random_range(-amp..amp)).collect() };
    let q = r(m * heads * d, 2.0);
    let k = r(n * kv_heads * d, 2.0);
    let v = r(n * kv_heads * d, 1.0);
    let (qpos, kpos) = match layout {
        Layout::Causal => {
            ((n - m.min(n)..n).chain(n..n + m.saturating_sub(n)).map(|p| p as u32).collect(), (0..n as u32).collect())
        }
        Layout::Scattered => {
            let kpos: Vec<u32> = (0..n).map(|_| rng.random_range(5..3000)).collect();
            let qpos: Vec<u32> =
                (0..m).map(|i| if i % 7 == 0 { rng.random_range(0..5) } else { rng.random_range(0..3200) }).collect();
            (qpos, kpos)
        }
    };
    Case { shape, q, qpos, k, v, kpos }
}

fn run(c: &Case, f: AttnFn) -> (Vec<f32>, Vec<f32>) {
    let m = c.qpos.len();
    let mut out = vec![f32::NAN; m * c.shape.q_dim()];
    let mut lse = vec![f32::NAN; m * c.shape.n_heads];
    f(&c.shape, &c.q, &c.qpos, c.kv(), &mut out, &mut lse).unwrap();
    (out, lse)
}

fn assert_close(tag: &str, a: &(Vec<f32>, Vec<f32>), b: &(Vec<f32>, Vec<f32>), out_tol: f32, lse_tol: f32) {
    assert_eq!(a.0.len(), b.0.len(), "{tag}: out shapes");
    assert_eq!(a.1.len(), b.1.len(), "{tag}: lse shapes");
    let out_err = crate::testing::max_abs_diff(&a.0, &b.0);
    assert!(out_err <= out_tol, "{tag}: max |out diff| {out_err} > {out_tol}");
    for (x, y) in a.1.iter().zip(&b.1) {
        if x.is_infinite() || y.is_infinite() {
            assert_eq!(x, y, "{tag}: one lse is -inf, the other is not");
        } else {
            assert!((x - y).abs() <= lse_tol * y.abs().max(1.0), "{tag}: lse {x} vs {y}");
        }
    }
}

const SHAPES: &[(usize, usize)] = &[(1, 1), (1, 300), (5, 5), (97, 257), (200, 129), (33, 1000), (300, 300)];
const HEADS: &[(usize, usize)] = &[(4, 4), (9, 3), (8, 2)];

#[test]
fn flash_matches_reference_random_shapes_gqa_1_3_4() {
    let mut rng = StdRng::seed_from_u64(42);
    for &(m, n) in SHAPES {
        for &(h, kvh) in HEADS {
            for d in [64, 17] {
                for layout in [Layout::Causal, Layout::Scattered] {
                    let c = case(&mut rng, m, n, h, kvh, d, layout);
                    let fast = run(&c, attention);
                    let slow = run(&c, attention_ref);
                    assert_close(&format!("m{m} n{n} h{h}/{kvh} d{d}"), &fast, &slow, ATTN_OUT_TOL, ATTN_LSE_TOL);
                }
            }
        }
    }
}

#[test]
fn every_simd_level_matches_reference() {
    let mut rng = StdRng::seed_from_u64(9);
    let c = case(&mut rng, 70, 390, 9, 3, 64, Layout::Causal);
    let slow = run(&c, attention_ref);
    simd::at_every_level(|lvl| {
        let fast = run(&c, attention);
        assert_close(&format!("{lvl:?}"), &fast, &slow, ATTN_OUT_TOL, ATTN_LSE_TOL);
    });
}

#[test]
fn queries_without_visible_keys_are_empty() {
    let shape = AttnShape::new(2, 1, 8).unwrap();
    let q = vec![0.5; 2 * 2 * 8];
    let k = vec![0.1; 3 * 8];
    let v = vec![1.0; 3 * 8];
    let kpos = [10, 11, 12];
    let qpos = [3, 11];
    let mut out = vec![f32::NAN; q.len()];
    let mut lse = vec![f32::NAN; 4];
    attention(&shape, &q, &qpos, KvRef { k: &k, v: &v, pos: &kpos }, &mut out, &mut lse).unwrap();
    assert_eq!(&lse[..2], &[f32::NEG_INFINITY; 2]);
    assert!(out[..16].iter().all(|&x| x == 0.0));
    assert!(lse[2].is_finite() && (out[16] - 1.0).abs() < 1e-6);
    // No keys at all.
    let mut out = vec![f32::NAN; q.len()];
    let mut lse = vec![f32::NAN; 4];
    attention(&shape, &q, &qpos, KvRef { k: &[], v: &[], pos: &[] }, &mut out, &mut lse).unwrap();
    assert!(lse.iter().all(|&l| l == f32::NEG_INFINITY) && out.iter().all(|&x| x == 0.0));
}

fn subset(c: &Case, idx: &[usize]) -> Case {
    let kvd = c.shape.kv_dim();
    let pick = |src: &[f32]| idx.iter().flat_map(|&j| src[j * kvd..(j + 1) * kvd].iter().copied()).collect::<Vec<_>>();
    Case {
        shape: c.shape,
        q: c.q.clone(),
        qpos: c.qpos.clone(),
        k: pick(&c.k),
        v: pick(&c.v),
        kpos: idx.iter().map(|&j| c.kpos[j]).collect(),
    }
}

#[test]
fn split_keys_and_merge_equals_one_pass() {
    let mut rng = StdRng::seed_from_u64(1);
    for &(m, n) in &[(1, 700), (40, 333), (130, 1001)] {
        for &(h, kvh) in HEADS {
            let c = case(&mut rng, m, n, h, kvh, 64, Layout::Scattered);
            let whole = run(&c, attention);
            // Three key sets: a contiguous prefix, and the rest interleaved (not contiguous).
            let cut = n / 3;
            let a: Vec<usize> = (0..cut).collect();
            let b: Vec<usize> = (cut..n).filter(|j| j % 2 == 0).collect();
            let cc: Vec<usize> = (cut..n).filter(|j| j % 2 == 1).collect();
            let (mut out, mut lse) = run(&subset(&c, &a), attention);
            for part in [&b, &cc] {
                let (po, pl) = run(&subset(&c, part), attention);
                merge_partial(&mut out, &mut lse, &po, &pl, 64).unwrap();
            }
            assert_close(&format!("split m{m} n{n}"), &(out, lse), &whole, MERGE_TOL, MERGE_TOL);
        }
    }
}

#[test]
fn merge_order_does_not_matter() {
    let mut rng = StdRng::seed_from_u64(2);
    let c = case(&mut rng, 50, 600, 9, 3, 64, Layout::Scattered);
    let parts: Vec<(Vec<f32>, Vec<f32>)> =
        (0..3).map(|p| run(&subset(&c, &(0..600).filter(|j| j % 3 == p).collect::<Vec<_>>()), attention)).collect();
    let merged = |order: &[usize]| {
        let (mut o, mut l) = parts[order[0]].clone();
        for &i in &order[1..] {
            merge_partial(&mut o, &mut l, &parts[i].0, &parts[i].1, 64).unwrap();
        }
        (o, l)
    };
    // Two operands: exactly symmetric.
    let ab = merged(&[0, 1]);
    let ba = merged(&[1, 0]);
    assert_eq!(ab.0, ba.0);
    assert_eq!(ab.1, ba.1);
    // Three operands in every order: equal within rounding.
    let base = merged(&[0, 1, 2]);
    for order in [[0, 2, 1], [1, 0, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0]] {
        assert_close(&format!("{order:?}"), &merged(&order), &base, MERGE_TOL, MERGE_TOL);
    }
    // And it equals one pass.
    assert_close("vs one pass", &base, &run(&c, attention), MERGE_TOL, MERGE_TOL);
}

#[test]
fn merge_with_empty_side_and_extreme_lse() {
    let mut out = vec![1.0, 2.0, 3.0, 4.0];
    let mut lse = vec![f32::NEG_INFINITY, 80.0];
    merge_partial(&mut out, &mut lse, &[5.0, 6.0, 7.0, 8.0], &[3.0, f32::NEG_INFINITY], 2).unwrap();
    assert_eq!(out, vec![5.0, 6.0, 3.0, 4.0]);
    assert_eq!(lse, vec![3.0, 80.0]);
    // Large log-sum-exps (exp would overflow f32) merge without inf/NaN.
    let mut out = vec![1.0, 1.0];
    let mut lse = vec![100.0];
    merge_partial(&mut out, &mut lse, &[3.0, 3.0], &[100.0], 2).unwrap();
    // lse near 100 carries an absolute rounding of ~1e-5 (f32 ulp), which the weights inherit.
    const LSE_TOL: f32 = 1e-4; // a few f32 ulps at 100
    assert!((out[0] - 2.0).abs() < MERGE_TOL && (lse[0] - (100.0 + 2f32.ln())).abs() < LSE_TOL, "{out:?} {lse:?}");
}

#[test]
fn scores_match_reference() {
    simd::at_every_level(|_| scores_match_reference_at_this_level());
}

fn scores_match_reference_at_this_level() {
    let mut rng = StdRng::seed_from_u64(5);
    for &(m, n) in &[(1, 1), (12, 500), (130, 300)] {
        for &(h, kvh) in HEADS {
            for layout in [Layout::Causal, Layout::Scattered] {
                let c = case(&mut rng, m, n, h, kvh, 64, layout);
                let (_, lse) = run(&c, attention);
                let mut fast = vec![0f32; n];
                let mut slow = vec![0f32; n];
                attention_scores(&c.shape, &c.q, &c.qpos, c.kv(), &lse, &mut fast).unwrap();
                attention_scores_ref(&c.shape, &c.q, &c.qpos, c.kv(), &lse, &mut slow).unwrap();
                let err = crate::testing::max_abs_diff(&fast, &slow);
                let rows = (m * h) as f32;
                assert!(err <= SCORES_TOL_PER_ROW * rows, "m{m} n{n}: {err}");
                // Each visible row distributes probability 1 over the keys.
                let visible_rows = lse.iter().filter(|l| l.is_finite()).count() as f32;
                let total: f32 = fast.iter().sum();
                // f32 sums of probabilities: 1e-4 of each visible row's mass of 1.
                const MASS_TOL_PER_ROW: f32 = 1e-4;
                let bound = MASS_TOL_PER_ROW * visible_rows.max(1.0);
                assert!((total - visible_rows).abs() <= bound, "mass {total} vs {visible_rows}");
            }
        }
    }
}

#[test]
fn rejects_bad_layouts() {
    assert!(AttnShape::new(9, 2, 64).is_err());
    assert!(AttnShape::new(9, 0, 64).is_err());
    let shape = AttnShape::new(2, 1, 4).unwrap();
    let mut out = vec![0.0; 8];
    let mut lse = vec![0.0; 2];
    let err = attention(&shape, &[0.0; 7], &[0], KvRef { k: &[], v: &[], pos: &[] }, &mut out, &mut lse).unwrap_err();
    assert!(err.to_string().contains("q has 7 elements"), "{err}");
}

#[test]
fn layouts_built_without_new_are_checked() {
    // AttnShape's fields are public (the worker builds it from a model's metadata): a zero
    // head count or head size is an error, not a division by zero inside the kernel.
    let q = [0.0f32; 8];
    let kv = KvRef { k: &[0.0; 8], v: &[0.0; 8], pos: &[0] };
    for (n_heads, n_kv_heads, head_dim) in [(0, 1, 4), (0, 0, 4), (2, 1, 0), (1, 2, 4)] {
        let shape = AttnShape { n_heads, n_kv_heads, head_dim, scale: 1.0 };
        let (mut out, mut lse) = (vec![0f32; 8], vec![0f32; 2]);
        let fast = attention(&shape, &q, &[0], kv, &mut out, &mut lse).expect_err("fast");
        let slow = attention_ref(&shape, &q, &[0], kv, &mut out, &mut lse).expect_err("reference");
        let mut scores = vec![0f32; 1];
        let mass = attention_scores(&shape, &q, &[0], kv, &lse, &mut scores).expect_err("scores");
        for e in [fast, slow, mass] {
            let e = e.to_string();
            assert!(e.contains("head"), "{n_heads}/{n_kv_heads}/{head_dim}: {e}");
        }
    }
}

/// The query rows (token, head) that see key `j`: the keys of its KV head, at or before the
/// query's position.
fn rows_seeing(c: &Case, j: usize, kh: usize) -> Vec<usize> {
    let (hq, g) = (c.shape.n_heads, c.shape.group());
    let mut rows = Vec::new();
    for (i, &p) in c.qpos.iter().enumerate() {
        if c.kpos[j] <= p {
            rows.extend((kh * g..(kh + 1) * g).map(|h| i * hq + h));
        }
    }
    rows
}

/// Checks that exactly `nan_rows` are NaN (every value of out, and lse) in `got`, and that the
/// other rows match `want` within the usual tolerances.
fn assert_nan_rows(tag: &str, got: &(Vec<f32>, Vec<f32>), want: &(Vec<f32>, Vec<f32>), nan_rows: &[usize], d: usize) {
    assert!(!nan_rows.is_empty(), "{tag}: the case must have rows that see the key");
    for r in 0..got.1.len() {
        let (o, l) = (&got.0[r * d..(r + 1) * d], got.1[r]);
        if nan_rows.contains(&r) {
            assert!(l.is_nan() && o.iter().all(|x| x.is_nan()), "{tag}: row {r} sees the key: lse {l}, out {o:?}");
        } else {
            assert!(!l.is_nan() && o.iter().all(|x| !x.is_nan()), "{tag}: row {r} does not see it: lse {l}");
            let (wo, wl) = (&want.0[r * d..(r + 1) * d], want.1[r]);
            let err = crate::testing::max_abs_diff(o, wo);
            assert!(err <= ATTN_OUT_TOL, "{tag}: row {r}: out differs by {err}");
            if l.is_infinite() || wl.is_infinite() {
                assert_eq!(l, wl, "{tag}: row {r}");
            } else {
                assert!((l - wl).abs() <= ATTN_LSE_TOL * wl.abs().max(1.0), "{tag}: row {r}: lse {l} vs {wl}");
            }
        }
    }
}

/// A NaN key, a +inf score (an infinite key against positive queries) and a NaN key that is a
/// row's only visible key: the rows that see it are NaN in out and lse, in the f64 reference
/// and in the fast kernel at every SIMD level, through one tile (many queries) and through the
/// split-key path merged by merge_partial (one query over several key blocks). Before, the
/// fast kernel dropped the NaN (exp2 made it 0) and turned a +inf row into "sees no key"
/// (out 0, lse -inf), which a merge then discards.
#[test]
fn non_finite_keys_make_the_rows_that_see_them_nan() {
    let mut rng = StdRng::seed_from_u64(17);
    // (queries, keys, heads, KV heads, key index, what goes in it)
    let cases = [(40, 300, 6, 2, 130), (1, 400, 4, 2, 250), (70, 390, 9, 3, 0)];
    for (m, n, h, kvh, j) in cases {
        for poison in [f32::NAN, f32::INFINITY] {
            let mut c = case(&mut rng, m, n, h, kvh, 16, Layout::Causal);
            // Positive queries: an infinite key scores +inf (not -inf, nor 0 * inf = NaN).
            c.q.iter_mut().for_each(|x| *x = x.abs() + 0.1);
            let clean = run(&c, attention_ref);
            let kh = kvh - 1;
            let d = c.shape.head_dim;
            c.k[(j * kvh + kh) * d..][..d].fill(poison);
            let rows = rows_seeing(&c, j, kh);
            let tag = format!("m{m} n{n} key {j} = {poison}");
            let slow = run(&c, attention_ref);
            assert_nan_rows(&format!("{tag}, reference"), &slow, &clean, &rows, d);
            simd::at_every_level(|lvl| {
                let fast = run(&c, attention);
                assert_nan_rows(&format!("{tag}, {lvl:?}"), &fast, &clean, &rows, d);
            });
        }
    }
    // A row whose only visible key is NaN (the kernel's "nothing visible yet" branch).
    let shape = AttnShape::new(1, 1, 4).unwrap();
    let (k, v) = ([f32::NAN, 1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5], [1.0f32; 8]);
    let kv = KvRef { k: &k, v: &v, pos: &[0, 5] };
    let q = [1.0f32; 8];
    for f in [attention as AttnFn, attention_ref] {
        let (mut out, mut lse) = (vec![0f32; 8], vec![0f32; 2]);
        simd::at_every_level(|lvl| {
            f(&shape, &q, &[0, 5], kv, &mut out, &mut lse).unwrap();
            assert!(lse[0].is_nan() && out[..4].iter().all(|x| x.is_nan()), "{lvl:?}: {out:?} {lse:?}");
            assert!(lse[1].is_nan(), "{lvl:?}: the second query sees the NaN key too");
        });
    }
}

/// The attention mass of a NaN key is NaN in the fast scores and in the reference (the fast
/// one's exp2 made it 0), at every SIMD level; the other keys' are unchanged.
#[test]
fn a_nan_key_has_nan_mass_in_both_scores() {
    let mut rng = StdRng::seed_from_u64(23);
    let mut c = case(&mut rng, 30, 300, 4, 2, 16, Layout::Causal);
    let (_, lse) = run(&c, attention);
    let j = 140;
    c.k[(j * 2 + 1) * 16..][..16].fill(f32::NAN);
    let mut slow = vec![0f32; 300];
    attention_scores_ref(&c.shape, &c.q, &c.qpos, c.kv(), &lse, &mut slow).unwrap();
    simd::at_every_level(|lvl| {
        let mut fast = vec![0f32; 300];
        attention_scores(&c.shape, &c.q, &c.qpos, c.kv(), &lse, &mut fast).unwrap();
        for (i, (a, b)) in fast.iter().zip(&slow).enumerate() {
            assert_eq!(a.is_nan(), i == j, "{lvl:?}: key {i}: fast {a}");
            assert_eq!(b.is_nan(), i == j, "key {i}: reference {b}");
            if i != j {
                assert!((a - b).abs() <= SCORES_TOL_PER_ROW * (30 * 4) as f32, "{lvl:?}: key {i}: {a} vs {b}");
            }
        }
    });
}
