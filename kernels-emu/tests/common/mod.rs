//! Helpers shared by the emulation tests: seeded inputs, error measures, bf16 rounding, and
//! attention cases.

#![allow(dead_code)]

use flowprefill_kernels::attention::AttnShape;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A seeded generator.
pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// `n` values uniform in (-amp, amp).
pub fn rand_vec(r: &mut StdRng, n: usize, amp: f32) -> Vec<f32> {
    (0..n).map(|_| r.random_range(-amp..amp)).collect()
}

/// Max of |a - b| / max(1, |b|) (absolute below 1), with infinities required to match.
pub fn max_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths");
    a.iter()
        .zip(b)
        .map(|(&x, &y)| {
            if x.is_infinite() || y.is_infinite() {
                assert_eq!(x, y, "infinities differ");
                0.0
            } else {
                flowprefill_kernels::testing::diff(x, y) / y.abs().max(1.0)
            }
        })
        .fold(0.0, f32::max)
}

/// Panics when [`max_err`] is above `tol`.
pub fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    let e = max_err(got, want);
    assert!(e <= tol, "{what}: max error {e:e} above the tolerance {tol:e}");
}

/// bf16 rounding of the reference: nearest, ties to even (the f32 bits' high half).
pub fn bf16_ref(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    let round = 0x7fff + ((b >> 16) & 1);
    (b.wrapping_add(round) >> 16) as u16
}

/// The f32 value of bf16 bits.
pub fn bf16_val(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// `x` rounded to bf16: (bits, their f32 values).
pub fn to_bf16(x: &[f32]) -> (Vec<u16>, Vec<f32>) {
    let bits: Vec<u16> = x.iter().map(|&v| bf16_ref(v)).collect();
    let vals = bits.iter().map(|&b| bf16_val(b)).collect();
    (bits, vals)
}

/// Inputs of one attention call.
pub struct Case {
    pub shape: AttnShape,
    pub q: Vec<f32>,
    pub qpos: Vec<u32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub kpos: Vec<u32>,
}

/// `m` queries over `n` keys; `scattered`: positions with gaps and repeats, every seventh query
/// before all keys (it sees nothing: out 0, lse -inf).
pub fn case(r: &mut StdRng, m: usize, n: usize, heads: usize, kv_heads: usize, d: usize, scattered: bool) -> Case {
    let shape = AttnShape::new(heads, kv_heads, d).unwrap();
    let (q, k, v) =
        (rand_vec(r, m * heads * d, 2.0), rand_vec(r, n * kv_heads * d, 2.0), rand_vec(r, n * kv_heads * d, 1.0));
    let (qpos, kpos) = if scattered {
        let kpos = (0..n).map(|_| r.random_range(5..3000)).collect();
        let qpos = (0..m).map(|i| if i % 7 == 0 { r.random_range(0..5) } else { r.random_range(0..3200) }).collect();
        (qpos, kpos)
    } else {
        (
            (n - m.min(n)..n).map(|p| p as u32).chain((n..).take(m.saturating_sub(n)).map(|p| p as u32)).collect(),
            (0..n as u32).collect(),
        )
    };
    Case { shape, q, qpos, k, v, kpos }
}
