//! Elementwise kernels: SiLU-gated product, residual add, bias add, embedding lookup.

use crate::error::{check_len, KernelError, Result};
use crate::matmul::Matrix;
use crate::simd;
use rayon::prelude::*;

/// Elements per parallel task for elementwise loops.
const ELEMS_PER_TASK: usize = 1 << 16;

crate::multiversion! {
    fn silu_mul_rows(gate_up: &[f32], ffn: usize, out: &mut [f32]) {
        let rows = gate_up.len() / (2 * ffn);
        for r in 0..rows {
            let (g, u) = gate_up[r * 2 * ffn..(r + 1) * 2 * ffn].split_at(ffn);
            let o = &mut out[r * ffn..(r + 1) * ffn];
            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                *o = g / (1.0 + simd::exp(-g)) * u;
            }
        }
    }
}

/// `out[r, j] = silu(gate[r, j]) * up[r, j]` where each row of `gate_up` is `[gate | up]`
/// (`2 * ffn` values, the layout of a fused gate/up projection).
pub fn silu_mul(gate_up: &[f32], ffn: usize, out: &mut [f32]) -> Result<()> {
    if ffn == 0 || !gate_up.len().is_multiple_of(2 * ffn) {
        return Err(KernelError::Shape {
            op: "silu_mul",
            detail: format!("gate_up has {} elements, not rows of 2*{ffn}", gate_up.len()),
        });
    }
    let rows = gate_up.len() / (2 * ffn);
    check_len("silu_mul", "out", out.len(), rows * ffn)?;
    let rows_per_task = (ELEMS_PER_TASK / ffn).max(1);
    gate_up
        .par_chunks(2 * ffn * rows_per_task)
        .zip(out.par_chunks_mut(ffn * rows_per_task))
        .for_each(|(gu, o)| silu_mul_rows(gu, ffn, o));
    Ok(())
}

/// Slow reference of [`silu_mul`] with libm `exp` in f64.
pub fn silu_mul_ref(gate_up: &[f32], ffn: usize, out: &mut [f32]) -> Result<()> {
    let rows = gate_up.len() / (2 * ffn);
    check_len("silu_mul_ref", "out", out.len(), rows * ffn)?;
    for r in 0..rows {
        for j in 0..ffn {
            let g = gate_up[r * 2 * ffn + j] as f64;
            let u = gate_up[r * 2 * ffn + ffn + j] as f64;
            out[r * ffn + j] = (g / (1.0 + (-g).exp()) * u) as f32;
        }
    }
    Ok(())
}

crate::multiversion! {
    fn add_slices(x: &mut [f32], y: &[f32]) {
        for (a, b) in x.iter_mut().zip(y) {
            *a += b;
        }
    }
}

/// `x += y` (the residual connection).
pub fn add_assign(x: &mut [f32], y: &[f32]) -> Result<()> {
    check_len("add_assign", "y", y.len(), x.len())?;
    x.par_chunks_mut(ELEMS_PER_TASK).zip(y.par_chunks(ELEMS_PER_TASK)).for_each(|(a, b)| add_slices(a, b));
    Ok(())
}

/// Adds `bias` to every row of `x` (rows of `bias.len()` values).
pub fn add_bias(x: &mut [f32], bias: &[f32]) -> Result<()> {
    let n = bias.len();
    if n == 0 || !x.len().is_multiple_of(n) {
        return Err(KernelError::Shape {
            op: "add_bias",
            detail: format!("x has {} elements, not rows of {n}", x.len()),
        });
    }
    for row in x.chunks_exact_mut(n) {
        add_slices(row, bias);
    }
    Ok(())
}

/// Copies the embedding rows of `ids` into `out` (`ids.len()` rows of `table.cols()`).
pub fn embedding(table: &Matrix, ids: &[u32], out: &mut [f32]) -> Result<()> {
    let d = table.cols();
    check_len("embedding", "out", out.len(), ids.len() * d)?;
    for (row, &id) in out.chunks_exact_mut(d.max(1)).zip(ids) {
        if id as usize >= table.rows() {
            return Err(KernelError::Shape {
                op: "embedding",
                detail: format!("token id {id} is outside the vocabulary of {}", table.rows()),
            });
        }
        row.copy_from_slice(table.row(id as usize));
    }
    Ok(())
}

/// Copies columns `[col, col + width)` of a row-major `[rows, src_cols]` matrix into `dst`
/// (`[rows, width]`), e.g. to split a fused QKV projection.
pub fn copy_columns<T: Copy>(src: &[T], src_cols: usize, col: usize, width: usize, dst: &mut [T]) -> Result<()> {
    if src_cols == 0 || !src.len().is_multiple_of(src_cols) || col + width > src_cols {
        return Err(KernelError::Shape {
            op: "copy_columns",
            detail: format!(
                "columns {col}..{} of a matrix with {src_cols} columns and {} elements",
                col + width,
                src.len()
            ),
        });
    }
    let rows = src.len() / src_cols;
    check_len("copy_columns", "dst", dst.len(), rows * width)?;
    if width == 0 {
        return Ok(());
    }
    for (s, d) in src.chunks_exact(src_cols).zip(dst.chunks_exact_mut(width)) {
        d.copy_from_slice(&s[col..col + width]);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Max abs error of SiLU·up with the polynomial exp against libm f64 (named tolerance).
    const SILU_TOL: f32 = 2e-6;

    #[test]
    fn silu_mul_matches_reference() {
        crate::simd::at_every_level(|_| silu_mul_matches_reference_at_this_level());
    }

    fn silu_mul_matches_reference_at_this_level() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for &(rows, ffn) in &[(1, 3), (5, 37), (70, 1536)] {
            let gu: Vec<f32> = (0..rows * 2 * ffn).map(|_| rng.random_range(-12.0f32..12.0)).collect();
            let mut a = vec![0.0; rows * ffn];
            let mut b = vec![0.0; rows * ffn];
            silu_mul(&gu, ffn, &mut a).unwrap();
            silu_mul_ref(&gu, ffn, &mut b).unwrap();
            for (p, q) in a.iter().zip(&b) {
                assert!((p - q).abs() <= SILU_TOL * q.abs().max(1.0), "{p} vs {q}");
            }
        }
    }

    #[test]
    fn embedding_rejects_out_of_vocab() {
        let t = Matrix::new(2, 2, vec![1.0, 2.0, 3.0, 4.0]).unwrap();
        let mut out = vec![0.0; 2];
        embedding(&t, &[1], &mut out).unwrap();
        assert_eq!(out, vec![3.0, 4.0]);
        let err = embedding(&t, &[2], &mut out).unwrap_err();
        assert!(err.to_string().contains("token id 2"), "{err}");
    }

    #[test]
    fn copy_columns_splits() {
        let src = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let mut d = vec![0.0; 2];
        copy_columns(&src, 3, 1, 1, &mut d).unwrap();
        assert_eq!(d, vec![2.0, 5.0]);
        assert!(copy_columns(&src, 3, 2, 2, &mut d).is_err());
    }

    #[test]
    fn adds() {
        crate::simd::at_every_level(|_| adds_at_this_level());
    }

    fn adds_at_this_level() {
        // Longer than a vector register, so that the wide loop and its tail both run.
        let (n, y): (usize, Vec<f32>) = (37, (0..37).map(|i| i as f32 * 0.5).collect());
        let mut x = vec![1.0; n];
        add_assign(&mut x, &y).unwrap();
        assert!(x.iter().zip(&y).all(|(a, b)| *a == 1.0 + b), "{x:?}");
        let mut x = vec![1.0; 4];
        add_assign(&mut x, &[1.0, 2.0, 3.0, 4.0]).unwrap();
        assert_eq!(x, vec![2.0, 3.0, 4.0, 5.0]);
        add_bias(&mut x, &[1.0, 0.0]).unwrap();
        assert_eq!(x, vec![3.0, 3.0, 5.0, 5.0]);
    }
}
