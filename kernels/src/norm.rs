//! RMSNorm: `y = x / sqrt(mean(x²) + eps) * w`, row by row. The sum of squares is in f32
//! (eight lanes); a row where it overflows (|x| past about 1.8e19) is done again in f64, so
//! its result is finite where the exact one is.

use crate::error::{check_len, KernelError, Result};
use rayon::prelude::*;

/// Rows per parallel task.
const ROWS_PER_TASK: usize = 64;

crate::multiversion! {
    fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
        let dim = w.len();
        for (xr, yr) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
            // Eight partial sums vectorize and are summed in a fixed order (deterministic).
            let mut acc = [0f32; 8];
            let mut chunks = xr.chunks_exact(8);
            for c in &mut chunks {
                for l in 0..8 {
                    acc[l] += c[l] * c[l];
                }
            }
            let mut ss = 0f32;
            for v in chunks.remainder() {
                ss += v * v;
            }
            ss += acc.iter().sum::<f32>();
            if !ss.is_finite() {
                // The squares overflowed f32 (|x| past about 1.8e19, or a row of them): in f64
                // (the squares of f32 values cannot overflow it). A NaN or infinite input goes
                // here too and stays NaN, as on the fast path.
                rms_norm_row_f64(xr, w, eps, yr);
                continue;
            }
            let inv = 1.0 / (ss / dim as f32 + eps).sqrt();
            for ((y, &v), &g) in yr.iter_mut().zip(xr).zip(w) {
                *y = v * inv * g;
            }
        }
    }
}

/// `n` elements are a whole number of rows of a nonzero width `dim` (zero rows are allowed).
fn check_rows(op: &'static str, n: usize, dim: usize) -> Result<()> {
    if dim == 0 || !n.is_multiple_of(dim) {
        return Err(KernelError::Shape {
            op,
            detail: format!("x has {n} elements, not a multiple of the weight length {dim}"),
        });
    }
    Ok(())
}

/// RMSNorm of each `dim`-sized row of `x` (`dim = w.len()`) into `out`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) -> Result<()> {
    let dim = w.len();
    check_rows("rms_norm", x.len(), dim)?;
    check_len("rms_norm", "out", out.len(), x.len())?;
    let rows = x.len() / dim;
    if rows <= ROWS_PER_TASK {
        rms_norm_rows(x, w, eps, out);
    } else {
        x.par_chunks(dim * ROWS_PER_TASK)
            .zip(out.par_chunks_mut(dim * ROWS_PER_TASK))
            .for_each(|(xs, ys)| rms_norm_rows(xs, w, eps, ys));
    }
    Ok(())
}

/// One row of RMSNorm in f64, rounded once to f32: the reference, and [`rms_norm`]'s way for
/// a row whose sum of squares overflows f32.
fn rms_norm_row_f64(xr: &[f32], w: &[f32], eps: f32, yr: &mut [f32]) {
    let ms = xr.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / w.len() as f64;
    let inv = 1.0 / (ms + eps as f64).sqrt();
    for ((y, &v), &g) in yr.iter_mut().zip(xr).zip(w) {
        *y = (v as f64 * inv * g as f64) as f32;
    }
}

/// Slow reference of [`rms_norm`] in f64.
/// Errors as [`rms_norm`]'s: an empty weight, `x` not a whole number of rows, or `out` not
/// the length of `x` is [`KernelError::Shape`] (not a panic).
pub fn rms_norm_ref(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) -> Result<()> {
    let dim = w.len();
    check_rows("rms_norm_ref", x.len(), dim)?;
    check_len("rms_norm_ref", "out", out.len(), x.len())?;
    for (xr, yr) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        rms_norm_row_f64(xr, w, eps, yr);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Max relative error of the f32 RMSNorm against f64 (named tolerance).
    const RMS_NORM_TOL: f32 = 1e-5;

    #[test]
    fn matches_reference() {
        crate::simd::at_every_level(|_| matches_reference_at_this_level());
    }

    fn matches_reference_at_this_level() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for &(rows, dim) in &[(1, 7), (3, 64), (200, 576), (65, 13)] {
            let x: Vec<f32> = (0..rows * dim).map(|_| rng.random_range(-3.0f32..3.0)).collect();
            let w: Vec<f32> = (0..dim).map(|_| rng.random_range(0.5f32..1.5)).collect();
            let mut a = vec![0.0; rows * dim];
            let mut b = vec![0.0; rows * dim];
            rms_norm(&x, &w, 1e-5, &mut a).unwrap();
            rms_norm_ref(&x, &w, 1e-5, &mut b).unwrap();
            for (p, q) in a.iter().zip(&b) {
                assert!((p - q).abs() <= RMS_NORM_TOL * q.abs().max(1.0), "{p} vs {q}");
            }
        }
    }

    /// Rows whose sum of squares overflows f32 (|x| ~ 1e20: x² = 1e40; a row of 1e19s: 1e38
    /// each, past f32::MAX after four) have a finite RMSNorm: it matches the f64 reference at
    /// every SIMD level, the other rows of the same call keep the fast path's values.
    #[test]
    fn huge_rows_match_the_f64_reference() {
        crate::simd::at_every_level(|_| huge_rows_match_the_f64_reference_at_this_level());
    }

    fn huge_rows_match_the_f64_reference_at_this_level() {
        let dim = 64;
        let mut x = Vec::new();
        x.extend((0..dim).map(|i| if i == 5 { 1e20 } else { 0.5 }));
        x.extend((0..dim).map(|i| if i % 2 == 0 { 1e19 } else { -1e19 }));
        x.extend((0..dim).map(|i| (i as f32 - 30.0) * 1e18));
        x.extend((0..dim).map(|i| f32::MAX / (i as f32 + 1.0)));
        x.extend((0..dim).map(|i| i as f32 * 0.1 - 3.0));
        let w: Vec<f32> = (0..dim).map(|i| 0.5 + i as f32 / dim as f32).collect();
        let (mut got, mut want) = (vec![0.0; x.len()], vec![0.0; x.len()]);
        rms_norm(&x, &w, 1e-5, &mut got).unwrap();
        rms_norm_ref(&x, &w, 1e-5, &mut want).unwrap();
        for (i, (p, q)) in got.iter().zip(&want).enumerate() {
            assert!(q.is_finite(), "row {}: the reference {q}", i / dim);
            assert!((p - q).abs() <= RMS_NORM_TOL * q.abs().max(1.0), "row {}, col {}: {p} vs {q}", i / dim, i % dim);
        }
        // The one huge value of row 0 is its whole mean square: it normalizes to about sqrt(dim).
        assert!((got[5] / w[5] - (dim as f32).sqrt()).abs() < 1e-3, "{}", got[5]);
        // The ordinary row is the fast path's, bit for bit.
        let mut alone = vec![0.0; dim];
        rms_norm(&x[4 * dim..], &w, 1e-5, &mut alone).unwrap();
        assert_eq!(alone, got[4 * dim..]);
    }

    #[test]
    fn rejects_ragged_rows() {
        let mut out = vec![0.0; 5];
        assert!(rms_norm(&[0.0; 5], &[1.0; 2], 1e-5, &mut out).is_err());
    }

    /// The reference refuses what `rms_norm` refuses, with the same typed error and no panic:
    /// width 0 (even with an empty x), ragged rows, an out of another length.
    #[test]
    fn reference_rejects_the_shapes_rms_norm_rejects() {
        let shape = |r: Result<()>| matches!(r, Err(KernelError::Shape { .. }));
        let cases: [(&[f32], &[f32], usize); 5] = [
            (&[], &[], 0),
            (&[1.0; 4], &[], 4),
            (&[0.0; 5], &[1.0; 2], 5),
            (&[0.0; 4], &[1.0; 2], 3),
            (&[0.0; 4], &[1.0; 2], 5),
        ];
        for (x, w, n) in cases {
            let mut out = vec![0.0; n];
            assert!(shape(rms_norm(x, w, 1e-5, &mut out)), "rms_norm {} {} {n}", x.len(), w.len());
            assert!(shape(rms_norm_ref(x, w, 1e-5, &mut out)), "rms_norm_ref {} {} {n}", x.len(), w.len());
        }
        // Zero rows of a real width are fine for both.
        assert!(rms_norm(&[], &[1.0; 3], 1e-5, &mut []).is_ok());
        assert!(rms_norm_ref(&[], &[1.0; 3], 1e-5, &mut []).is_ok());
    }
}
