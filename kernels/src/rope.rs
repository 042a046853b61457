//! Rotary position embedding at explicit positions.
//!
//! Every token carries its own position, so the same kernel places a chunk at its local
//! positions, at its global positions, or at any scoring geometry. Keys are stored before RoPE
//! and rotated when placed, which makes any placement an exact rotation (RoPE is never applied
//! twice).
//!
//! Two pairings exist in GGUF files: `Interleaved` rotates (x[2i], x[2i+1]) (llama.cpp permutes
//! Llama's Q/K weights into this order at conversion), `Neox` rotates (x[i], x[i + d/2])
//! (Qwen2/Qwen3).

use crate::error::{check_len, KernelError, Result};
use rayon::prelude::*;
use std::borrow::Cow;

/// Which coordinates form a rotated pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Pairs (2i, 2i+1).
    Interleaved,
    /// Pairs (i, i + rot_dim/2).
    Neox,
}

/// Frequencies and a cos/sin table for positions below `table_len`.
#[derive(Clone, Debug)]
pub struct RopeTable {
    head_dim: usize,
    rot_dim: usize,
    style: RopeStyle,
    /// The parameters the frequencies come from, kept for [`rope_ref`], which recomputes them.
    base: f64,
    freq_factors: Option<Vec<f32>>,
    linear_factor: f64,
    inv_freq: Vec<f64>,
    table_len: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    /// Builds the table. `freq_factors` (Llama 3.1 `rope_freqs.weight`) divide the frequencies.
    pub fn new(
        head_dim: usize,
        rot_dim: usize,
        base: f64,
        style: RopeStyle,
        freq_factors: Option<&[f32]>,
        table_len: usize,
    ) -> Result<Self> {
        Self::new_scaled(head_dim, rot_dim, base, style, freq_factors, 1.0, table_len)
    }

    /// As [`RopeTable::new`], with linear position scaling (GGUF `rope.scaling.type = linear`,
    /// Hugging Face `rope_scaling: {type: linear}`): position p is rotated as p / `linear_factor`,
    /// i.e. every frequency is divided by `linear_factor` (1: none). Frequency i is
    /// `1 / base^(2i / rot_dim) / freq_factors[i] / linear_factor`.
    pub fn new_scaled(
        head_dim: usize,
        rot_dim: usize,
        base: f64,
        style: RopeStyle,
        freq_factors: Option<&[f32]>,
        linear_factor: f64,
        table_len: usize,
    ) -> Result<Self> {
        let bad = |detail: String| KernelError::Shape { op: "RopeTable::new", detail };
        if rot_dim > head_dim || !rot_dim.is_multiple_of(2) {
            return Err(bad(format!("rotary dimension {rot_dim} must be even and at most head_dim {head_dim}")));
        }
        if !(base.is_finite() && base > 0.0) {
            return Err(bad(format!("the base frequency {base} must be a positive number")));
        }
        if !(linear_factor.is_finite() && linear_factor > 0.0) {
            return Err(bad(format!("the linear scaling factor {linear_factor} must be a positive number")));
        }
        let half = rot_dim / 2;
        if let Some(f) = freq_factors {
            check_len("RopeTable::new", "freq_factors", f.len(), half)?;
            if let Some(x) = f.iter().find(|x| !(x.is_finite() && **x > 0.0)) {
                return Err(bad(format!("a frequency factor is {x}; each must be a positive number")));
            }
        }
        let inv_freq: Vec<f64> = (0..half)
            .map(|i| {
                let f = 1.0 / base.powf(2.0 * i as f64 / rot_dim as f64);
                f / freq_factors.map_or(1.0, |ff| ff[i] as f64) / linear_factor
            })
            .collect();
        let mut cos = vec![0f32; table_len * half];
        let mut sin = vec![0f32; table_len * half];
        for p in 0..table_len {
            for (i, &f) in inv_freq.iter().enumerate() {
                let (s, c) = (p as f64 * f).sin_cos();
                cos[p * half + i] = c as f32;
                sin[p * half + i] = s as f32;
            }
        }
        Ok(Self {
            head_dim,
            rot_dim,
            style,
            base,
            freq_factors: freq_factors.map(<[f32]>::to_vec),
            linear_factor,
            inv_freq,
            table_len,
            cos,
            sin,
        })
    }

    /// The linear position scaling factor (1: none).
    pub fn linear_factor(&self) -> f64 {
        self.linear_factor
    }

    /// Head dimension the table was built for.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Pairing style.
    pub fn style(&self) -> RopeStyle {
        self.style
    }

    /// Rotated dimensions per head (even, at most `head_dim`).
    pub fn rot_dim(&self) -> usize {
        self.rot_dim
    }

    /// Positions below this come from the table; above, cos/sin are computed.
    pub fn table_len(&self) -> usize {
        self.table_len
    }

    /// The cos and sin tables, `[table_len, rot_dim / 2]` each (what a device backend uploads).
    pub fn tables(&self) -> (&[f32], &[f32]) {
        (&self.cos, &self.sin)
    }

    /// The frequencies (f64), one per rotated pair.
    pub fn inv_freq(&self) -> &[f64] {
        &self.inv_freq
    }

    /// Rows a device table needs for `positions`: the table's, or, when some position is past
    /// it, the next power of two above the largest (device kernels read every angle from the
    /// table: computing one there takes double-precision range reduction and a stack frame).
    pub fn rows_for(&self, positions: &[u32]) -> usize {
        let need = positions.iter().max().map_or(0, |&p| p as usize + 1);
        if need <= self.table_len {
            self.table_len
        } else {
            need.next_power_of_two()
        }
    }

    /// The cos and sin tables for positions `0..rows` (`rows` at least [`Self::table_len`]):
    /// the table, then the rows [`rope`] computes beyond it (the same f32 values, bit for bit).
    pub fn tables_to(&self, rows: usize) -> (Cow<'_, [f32]>, Cow<'_, [f32]>) {
        if rows <= self.table_len {
            return (Cow::Borrowed(&self.cos), Cow::Borrowed(&self.sin));
        }
        let half = self.rot_dim / 2;
        let (mut cos, mut sin) = (self.cos.clone(), self.sin.clone());
        cos.resize(rows * half, 0.0);
        sin.resize(rows * half, 0.0);
        for p in self.table_len..rows {
            let at = p * half..(p + 1) * half;
            self.cos_sin(p as u32, &mut cos[at.clone()], &mut sin[at]);
        }
        (Cow::Owned(cos), Cow::Owned(sin))
    }

    /// cos/sin of `pos` for every frequency, from the table or computed on the spot.
    fn cos_sin(&self, pos: u32, cos: &mut [f32], sin: &mut [f32]) {
        let half = self.rot_dim / 2;
        let p = pos as usize;
        if p < self.table_len {
            cos.copy_from_slice(&self.cos[p * half..(p + 1) * half]);
            sin.copy_from_slice(&self.sin[p * half..(p + 1) * half]);
        } else {
            for (i, &f) in self.inv_freq.iter().enumerate() {
                let (s, c) = (p as f64 * f).sin_cos();
                cos[i] = c as f32;
                sin[i] = s as f32;
            }
        }
    }
}

crate::multiversion! {
    fn rotate_heads(x: &mut [f32], head_dim: usize, interleaved: bool, cos: &[f32], sin: &[f32]) {
        let half = cos.len();
        for head in x.chunks_exact_mut(head_dim) {
            if interleaved {
                for i in 0..half {
                    let (a, b) = (head[2 * i], head[2 * i + 1]);
                    head[2 * i] = a * cos[i] - b * sin[i];
                    head[2 * i + 1] = a * sin[i] + b * cos[i];
                }
            } else {
                let (lo, hi) = head.split_at_mut(half);
                for i in 0..half {
                    let (a, b) = (lo[i], hi[i]);
                    lo[i] = a * cos[i] - b * sin[i];
                    hi[i] = a * sin[i] + b * cos[i];
                }
            }
        }
    }
}

/// Tokens per parallel task.
const TOKENS_PER_TASK: usize = 32;

/// Rotates `x` (`[positions.len(), n_heads, head_dim]`) in place, token t at `positions[t]`.
pub fn rope(x: &mut [f32], n_heads: usize, positions: &[u32], table: &RopeTable) -> Result<()> {
    let row = n_heads * table.head_dim;
    check_len("rope", "x", x.len(), positions.len() * row)?;
    if row == 0 || table.rot_dim == 0 {
        return Ok(());
    }
    let half = table.rot_dim / 2;
    let interleaved = table.style == RopeStyle::Interleaved;
    let rot = table.rot_dim;
    let hd = table.head_dim;
    x.par_chunks_mut(row * TOKENS_PER_TASK).zip(positions.par_chunks(TOKENS_PER_TASK)).for_each(|(xs, ps)| {
        let mut cos = vec![0f32; half];
        let mut sin = vec![0f32; half];
        for (tok, &p) in xs.chunks_exact_mut(row).zip(ps) {
            table.cos_sin(p, &mut cos, &mut sin);
            if rot == hd {
                rotate_heads(tok, hd, interleaved, &cos, &sin);
            } else {
                for head in tok.chunks_exact_mut(hd) {
                    rotate_heads(&mut head[..rot], rot, interleaved, &cos, &sin);
                }
            }
        }
    });
    Ok(())
}

/// Slow reference of [`rope`]: frequencies recomputed from the table's parameters (base,
/// frequency factors, linear factor; not the fast path's `inv_freq`), angles and rotation in
/// f64, element by element.
pub fn rope_ref(x: &mut [f32], n_heads: usize, positions: &[u32], table: &RopeTable) -> Result<()> {
    let hd = table.head_dim;
    check_len("rope_ref", "x", x.len(), positions.len() * n_heads * hd)?;
    let (rot, half) = (table.rot_dim, table.rot_dim / 2);
    // theta_i = base^(-2i / rot) / ff[i] / factor: the angle of position p is p * theta_i,
    // i.e. the angle of the scaled position p / factor at the factored frequency.
    let freqs: Vec<f64> = (0..half)
        .map(|i| {
            let ff = table.freq_factors.as_ref().map_or(1.0, |f| f[i] as f64);
            table.base.powf(-2.0 * i as f64 / rot as f64) / ff / table.linear_factor
        })
        .collect();
    for (t, &p) in positions.iter().enumerate() {
        for h in 0..n_heads {
            let base = (t * n_heads + h) * hd;
            for (i, &f) in freqs.iter().enumerate() {
                let (ia, ib) = match table.style {
                    RopeStyle::Interleaved => (base + 2 * i, base + 2 * i + 1),
                    RopeStyle::Neox => (base + i, base + i + half),
                };
                let (s, c) = (p as f64 * f).sin_cos();
                let (a, b) = (x[ia] as f64, x[ib] as f64);
                x[ia] = (a * c - b * s) as f32;
                x[ib] = (a * s + b * c) as f32;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Max abs error of the table-driven f32 rotation against f64 (named tolerance).
    const ROPE_TOL: f32 = 2e-6;

    /// Non-unit frequency factors of [`check`]'s tables (Llama 3.1's are 1 for the high
    /// frequencies, up to 8 for the low ones).
    fn factors(half: usize) -> Vec<f32> {
        (0..half).map(|i| 1.0 + 7.0 * i as f32 / half as f32).collect()
    }

    fn check(style: RopeStyle, rot_dim: usize, table_len: usize) {
        check_scaled(style, rot_dim, table_len, false, 1.0);
    }

    fn check_scaled(style: RopeStyle, rot_dim: usize, table_len: usize, with_factors: bool, linear: f64) {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let (hd, heads, n) = (64, 3, 45);
        let ff = factors(rot_dim / 2);
        let ff = with_factors.then_some(&ff[..]);
        let table = RopeTable::new_scaled(hd, rot_dim, 10_000.0, style, ff, linear, table_len).unwrap();
        let positions: Vec<u32> = (0..n).map(|_| rng.random_range(0..9000)).collect();
        let x: Vec<f32> = (0..n * heads * hd).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let mut a = x.clone();
        let mut b = x.clone();
        rope(&mut a, heads, &positions, &table).unwrap();
        rope_ref(&mut b, heads, &positions, &table).unwrap();
        let err = crate::testing::max_abs_diff(&a, &b);
        assert!(err < ROPE_TOL, "{style:?} rot {rot_dim} factors {with_factors} linear {linear}: {err}");
    }

    #[test]
    fn matches_reference_both_styles_inside_and_beyond_table() {
        crate::simd::at_every_level(|_| matches_reference_at_this_level());
    }

    fn matches_reference_at_this_level() {
        for style in [RopeStyle::Interleaved, RopeStyle::Neox] {
            check(style, 64, 10_000);
            check(style, 64, 100);
            check(style, 32, 10_000);
            for (with_factors, linear) in [(true, 1.0), (false, 4.0), (true, 2.5)] {
                check_scaled(style, 64, 10_000, with_factors, linear);
                check_scaled(style, 64, 100, with_factors, linear);
                check_scaled(style, 32, 10_000, with_factors, linear);
            }
        }
    }

    #[test]
    fn the_reference_recomputes_the_frequencies() {
        // rope_ref's angles come from base, factors and the linear factor, not from the fast
        // path's inv_freq: a table whose inv_freq were wrong would fail against it.
        let ff = factors(16);
        let mut table = RopeTable::new_scaled(32, 32, 10_000.0, RopeStyle::Neox, Some(&ff), 2.0, 0).unwrap();
        let x: Vec<f32> = (0..32).map(|i| (i as f32 * 0.37).sin()).collect();
        let (mut a, mut b) = (x.clone(), x.clone());
        rope(&mut a, 1, &[1234], &table).unwrap();
        rope_ref(&mut b, 1, &[1234], &table).unwrap();
        assert!(crate::testing::max_abs_diff(&a, &b) < ROPE_TOL);
        table.inv_freq[3] *= 1.01;
        let (mut a, mut b) = (x.clone(), x.clone());
        rope(&mut a, 1, &[1234], &table).unwrap();
        rope_ref(&mut b, 1, &[1234], &table).unwrap();
        assert!(crate::testing::max_abs_diff(&a, &b) > 1e-3, "a wrong frequency is caught");
    }

    #[test]
    fn linear_scaling_divides_positions() {
        // With factor 4, position 4p rotates as position p does without scaling (the angle
        // is the same f64 product up to one rounding of the frequency).
        for style in [RopeStyle::Interleaved, RopeStyle::Neox] {
            let plain = RopeTable::new(16, 16, 10_000.0, style, None, 64).unwrap();
            let scaled = RopeTable::new_scaled(16, 16, 10_000.0, style, None, 4.0, 64).unwrap();
            assert_eq!(scaled.linear_factor(), 4.0);
            let x: Vec<f32> = (0..16).map(|i| 1.0 - i as f32 / 8.0).collect();
            for p in [0u32, 3, 15, 40, 999] {
                let (mut a, mut b) = (x.clone(), x.clone());
                rope(&mut a, 1, &[4 * p], &scaled).unwrap();
                rope(&mut b, 1, &[p], &plain).unwrap();
                assert!(crate::testing::max_abs_diff(&a, &b) < ROPE_TOL, "{style:?} position {p}");
            }
        }
    }

    #[test]
    fn rotation_composes_like_positions() {
        // Rotating by p then by q equals rotating by p+q: the reason pre-RoPE keys can be
        // placed anywhere (within f32 rounding).
        let table = RopeTable::new(8, 8, 10_000.0, RopeStyle::Interleaved, None, 64).unwrap();
        let x = vec![0.3, -0.2, 0.9, 0.1, -0.5, 0.7, 0.2, -0.8];
        let mut a = x.clone();
        rope(&mut a, 1, &[5], &table).unwrap();
        rope(&mut a, 1, &[7], &table).unwrap();
        let mut b = x.clone();
        rope(&mut b, 1, &[12], &table).unwrap();
        // Two f32 rotations of values near 1: a few ulps apart.
        const COMPOSE_TOL: f32 = 1e-5;
        for (p, q) in a.iter().zip(&b) {
            assert!((p - q).abs() < COMPOSE_TOL, "{p} vs {q}");
        }
    }

    #[test]
    fn a_device_table_extends_the_table_bit_for_bit() {
        let table = RopeTable::new(16, 16, 10_000.0, RopeStyle::Neox, None, 40).unwrap();
        assert_eq!(table.rows_for(&[3, 39]), 40, "inside the table: its rows");
        assert_eq!(table.rows_for(&[]), 40);
        assert_eq!(table.rows_for(&[7, 40]), 64, "past it: a power of two above the largest");
        let (cos, sin) = table.tables_to(table.rows_for(&[1000]));
        assert_eq!(cos.len(), 1024 * 8);
        let (mut c, mut s) = (vec![0f32; 8], vec![0f32; 8]);
        for p in [0u32, 39, 40, 41, 999, 1023] {
            table.cos_sin(p, &mut c, &mut s);
            let at = p as usize * 8..(p as usize + 1) * 8;
            assert_eq!((&cos[at.clone()], &sin[at]), (&c[..], &s[..]), "position {p}");
        }
        assert!(matches!(table.tables_to(40).0, Cow::Borrowed(_)), "no copy when the table covers it");
    }

    #[test]
    fn rejects_bad_dims() {
        assert!(RopeTable::new(64, 65, 1e4, RopeStyle::Neox, None, 1).is_err());
        assert!(RopeTable::new(64, 64, 1e4, RopeStyle::Neox, Some(&[1.0; 3]), 1).is_err());
        for factor in [0.0, -2.0, f64::NAN, f64::INFINITY] {
            assert!(RopeTable::new_scaled(64, 64, 1e4, RopeStyle::Neox, None, factor, 1).is_err(), "{factor}");
        }
        assert!(RopeTable::new(64, 64, 0.0, RopeStyle::Neox, None, 1).is_err());
        assert!(RopeTable::new(4, 4, 1e4, RopeStyle::Neox, Some(&[1.0, 0.0]), 1).is_err());
    }
}
