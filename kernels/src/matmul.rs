//! Dense matrix products against weight matrices: `out[m, n] = x[m, k] · W[n, k]ᵀ`.
//!
//! Weights are stored the way GGUF and PyTorch store linear layers, one row per output feature.
//! The fast path is the `gemm` crate (packed AVX-512/AVX2 micro-kernels, threaded over rayon),
//! and for one input row (a decode step) a loop of dot products that streams each weight row
//! once; [`matmul_t_ref`] is the slow reference the tests compare both with.

use crate::error::{check_len, KernelError, Result};

/// A row-major weight matrix `[rows = out features, cols = in features]` in f32.
#[derive(Clone, Debug)]
pub struct Matrix {
    rows: usize,
    cols: usize,
    data: Vec<f32>,
}

impl Matrix {
    /// Wraps `data` (`rows * cols` values, row-major).
    pub fn new(rows: usize, cols: usize, data: Vec<f32>) -> Result<Self> {
        check_len("Matrix::new", "data", data.len(), rows * cols)?;
        Ok(Self { rows, cols, data })
    }

    /// Stacks matrices with the same column count on top of each other (fused projections).
    pub fn vstack(parts: &[&Matrix]) -> Result<Self> {
        let cols = parts.first().map_or(0, |p| p.cols);
        let mut data = Vec::with_capacity(parts.iter().map(|p| p.data.len()).sum());
        let mut rows = 0;
        for p in parts {
            if p.cols != cols {
                return Err(KernelError::Shape {
                    op: "Matrix::vstack",
                    detail: format!("column counts differ: {} vs {}", p.cols, cols),
                });
            }
            data.extend_from_slice(&p.data);
            rows += p.rows;
        }
        Ok(Self { rows, cols, data })
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Row-major values.
    pub fn data(&self) -> &[f32] {
        &self.data
    }

    /// The values, row-major, taking the matrix apart.
    pub fn into_data(self) -> Vec<f32> {
        self.data
    }

    /// One row (the weights of one output feature, or one embedding).
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.cols..(i + 1) * self.cols]
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.data.len() * std::mem::size_of::<f32>()
    }
}

/// Below this many multiply-adds a product runs on the calling thread only.
const PARALLEL_MIN_MACS: usize = 1 << 18;

/// A row's dot product from its 16 lane sums and the values past the last full group of 16
/// (`x` and `w` from there): one order of additions for every path of [`dots`].
#[inline(always)]
fn lanes_and_tail(acc: &[f32; 16], x: &[f32], w: &[f32]) -> f32 {
    acc.iter().sum::<f32>() + x.iter().zip(w).map(|(a, b)| a * b).sum::<f32>()
}

crate::multiversion! {
    /// `out[j] = x · rows[j]` for each row of `rows` (`out.len()` rows of `x.len()` values):
    /// each weight row streamed once, four rows side by side (four streams from memory, one
    /// load of `x` for all four), each summed in 16 lanes.
    fn dots(x: &[f32], rows: &[f32], out: &mut [f32]) {
        let k = x.len();
        let full = k / 16 * 16;
        let mut quads = out.chunks_exact_mut(4);
        let mut ws = rows.chunks_exact(4 * k);
        for (o, w) in (&mut quads).zip(&mut ws) {
            let (w0, rest) = w.split_at(k);
            let (w1, rest) = rest.split_at(k);
            let (w2, w3) = rest.split_at(k);
            let mut acc = [[0f32; 16]; 4];
            for l in (0..full).step_by(16) {
                let xv = &x[l..l + 16];
                let (a, b, c, d) = (&w0[l..l + 16], &w1[l..l + 16], &w2[l..l + 16], &w3[l..l + 16]);
                for t in 0..16 {
                    acc[0][t] += xv[t] * a[t];
                    acc[1][t] += xv[t] * b[t];
                    acc[2][t] += xv[t] * c[t];
                    acc[3][t] += xv[t] * d[t];
                }
            }
            for (r, wr) in [w0, w1, w2, w3].into_iter().enumerate() {
                o[r] = lanes_and_tail(&acc[r], &x[full..], &wr[full..]);
            }
        }
        for (o, w) in quads.into_remainder().iter_mut().zip(ws.remainder().chunks_exact(k)) {
            let mut acc = [0f32; 16];
            for l in (0..full).step_by(16) {
                let (xv, wv) = (&x[l..l + 16], &w[l..l + 16]);
                for t in 0..16 {
                    acc[t] += xv[t] * wv[t];
                }
            }
            *o = lanes_and_tail(&acc, &x[full..], &w[full..]);
        }
    }
}

/// `out[n] = x[k] · Wᵀ` for one input row (a decode step): bound by reading `W` once. The
/// packed GEMM's one-row path reads it on the calling thread only; this loop splits the rows of
/// `W` over the threads and reads four side by side (2026-11-30, SmolLM2's 537 MB of f32
/// weights on a 2-core Xeon: 69.2 -> 38.5 ms per token on two threads, 63.6 -> 66.4 on one,
/// the same with two processes at once; medians of paired runs, docs/results.md).
fn one_row(x: &[f32], w: &Matrix, out: &mut [f32]) {
    use rayon::prelude::*;
    let (n, k) = (w.rows, w.cols);
    let threads = crate::simd::threads();
    if n * k < PARALLEL_MIN_MACS || threads == 1 {
        return dots(x, &w.data, out);
    }
    // A few blocks per thread, so that a thread slowed by another process does not hold up
    // the product.
    let block = n.div_ceil(threads * 4).max(8);
    out.par_chunks_mut(block).zip(w.data.par_chunks(block * k)).for_each(|(o, rows)| dots(x, rows, o));
}

/// `out[m, n] = x[m, k] · Wᵀ` where `W` is `[n, k]`.
pub fn matmul_t(x: &[f32], m: usize, w: &Matrix, out: &mut [f32]) -> Result<()> {
    let (n, k) = (w.rows, w.cols);
    check_len("matmul_t", "x", x.len(), m * k)?;
    check_len("matmul_t", "out", out.len(), m * n)?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        out.fill(0.0);
        return Ok(());
    }
    if m == 1 {
        one_row(x, w, out);
        return Ok(());
    }
    let macs = m * n * k;
    let par = if macs >= PARALLEL_MIN_MACS && crate::simd::threads() > 1 {
        gemm::Parallelism::Rayon(crate::simd::threads())
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the lengths were checked above: out holds m*n values addressed as
    // out[i*n + j]; x holds m*k values addressed as x[i*k + l]; w holds n*k values addressed
    // as w[j*k + l] (column j of Wᵀ has stride k, rows of Wᵀ stride 1). `read_dst` is false,
    // so out is only written.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w.data.as_ptr(),
            k as isize,
            1,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            par,
        );
    }
    Ok(())
}

/// Slow reference of [`matmul_t`]: a triple loop accumulating in f64.
pub fn matmul_t_ref(x: &[f32], m: usize, w: &Matrix, out: &mut [f32]) -> Result<()> {
    let (n, k) = (w.rows, w.cols);
    check_len("matmul_t_ref", "x", x.len(), m * k)?;
    check_len("matmul_t_ref", "out", out.len(), m * n)?;
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0f64;
            for l in 0..k {
                acc += x[i * k + l] as f64 * w.data[j * k + l] as f64;
            }
            out[i * n + j] = acc as f32;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Max abs error of the f32 GEMM against the f64 reference, relative to sqrt(k) (named).
    const MATMUL_TOL_PER_SQRT_K: f32 = 2e-6;

    fn rand_vec(rng: &mut rand::rngs::StdRng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    #[test]
    fn matches_reference_on_odd_shapes() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for &(m, k, n) in &[(1, 5, 3), (7, 33, 17), (130, 77, 65), (300, 576, 200)] {
            let x = rand_vec(&mut rng, m * k);
            let w = Matrix::new(n, k, rand_vec(&mut rng, n * k)).unwrap();
            let mut a = vec![0.0; m * n];
            let mut b = vec![0.0; m * n];
            matmul_t(&x, m, &w, &mut a).unwrap();
            matmul_t_ref(&x, m, &w, &mut b).unwrap();
            let err = crate::testing::max_abs_diff(&a, &b);
            assert!(err <= MATMUL_TOL_PER_SQRT_K * (k as f32).sqrt(), "{m}x{k}x{n}: {err}");
        }
    }

    /// The one-row product (a decode step's) at every SIMD level its loop is compiled for, on
    /// row lengths off the 16 lanes and row counts off the threads' blocks, one thread and many.
    #[test]
    fn one_row_matches_reference_at_every_level() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        crate::simd::at_every_level(|level| {
            for &(k, n) in &[(1, 1), (5, 3), (16, 9), (33, 17), (576, 1536), (577, 455), (64, 4099)] {
                let x = rand_vec(&mut rng, k);
                let w = Matrix::new(n, k, rand_vec(&mut rng, n * k)).unwrap();
                let (mut a, mut b) = (vec![f32::NAN; n], vec![0.0; n]);
                matmul_t(&x, 1, &w, &mut a).unwrap();
                matmul_t_ref(&x, 1, &w, &mut b).unwrap();
                let err = crate::testing::max_abs_diff(&a, &b);
                assert!(err <= MATMUL_TOL_PER_SQRT_K * (k as f32).sqrt(), "{level:?} 1x{k}x{n}: {err}");
                // On a pool of one thread: the same values, bit for bit (each row's sum is one
                // thread's whatever the split).
                let mut c = vec![f32::NAN; n];
                rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap().install(|| {
                    matmul_t(&x, 1, &w, &mut c).unwrap();
                });
                assert_eq!(a, c, "{level:?} 1x{k}x{n}: one thread and many differ");
            }
        });
    }

    #[test]
    fn rejects_bad_lengths() {
        let w = Matrix::new(2, 3, vec![0.0; 6]).unwrap();
        let mut out = vec![0.0; 4];
        let err = matmul_t(&[0.0; 5], 2, &w, &mut out).unwrap_err();
        assert!(err.to_string().contains("x has 5 elements, expected 6"), "{err}");
        assert!(Matrix::new(2, 2, vec![0.0; 3]).is_err());
    }

    #[test]
    fn vstack_concatenates_rows() {
        let a = Matrix::new(1, 2, vec![1.0, 2.0]).unwrap();
        let b = Matrix::new(2, 2, vec![3.0, 4.0, 5.0, 6.0]).unwrap();
        let s = Matrix::vstack(&[&a, &b]).unwrap();
        assert_eq!((s.rows(), s.cols()), (3, 2));
        assert_eq!(s.row(2), &[5.0, 6.0]);
        let c = Matrix::new(1, 3, vec![0.0; 3]).unwrap();
        assert!(Matrix::vstack(&[&a, &c]).is_err());
    }
}
