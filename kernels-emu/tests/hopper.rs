//! Hopper's primitives in the CPU emulation (`kernels/cuda/cpu_shim_hopper.h`): the self-check
//! kernel `hopper_probe.cu` (TMA copies through tensor maps into swizzled shared memory, one
//! mbarrier, wgmma.mma_async from shared-memory descriptors and from registers, K-major and
//! transposed B) against a plain product in every swizzle mode, and each deliberate mistake
//! the emulation must catch: a missing wgmma.fence, descriptors of the wrong swizzle, a wait on
//! the wrong mbarrier phase, accumulators read without wgmma.wait_group, and two deadlocks (no
//! arrival on the copies' barrier, a skipped `__syncthreads`), reported rather than hung.

use flowprefill_kernels::gpu::ops::{probe_break, Swizzle};
use flowprefill_kernels_emu as emu;

mod common;
use common::{assert_close, rand_vec, rng, to_bf16};

/// bf16 products are exact in f32; sums of 64 of them in f32, relative to amp^2 * 64.
const PROBE_TOL: f32 = 1e-5;

/// A [64][64] B [64][128] in f64.
fn product(a: &[f32], b: &[f32]) -> Vec<f32> {
    let mut d = vec![0f32; 64 * 128];
    for i in 0..64 {
        for j in 0..128 {
            d[i * 128 + j] = (0..64).map(|k| a[i * 64 + k] as f64 * b[k * 128 + j] as f64).sum::<f64>() as f32;
        }
    }
    d
}

struct Operands {
    a_bits: Vec<u16>,
    b_nk: Vec<u16>,
    b_kn: Vec<u16>,
    want: Vec<f32>,
    scale: f32,
}

fn operands(seed: u64, amp: f32) -> Operands {
    let mut r = rng(seed);
    let (a_bits, a) = to_bf16(&rand_vec(&mut r, 64 * 64, amp));
    let (b_kn, b) = to_bf16(&rand_vec(&mut r, 64 * 128, amp));
    // B as [n][k] (how K is stored) beside [k][n] (how V is).
    let b_nk: Vec<u16> = (0..128 * 64).map(|i| b_kn[(i % 64) * 128 + i / 64]).collect();
    Operands { a_bits, b_nk, b_kn, want: product(&a, &b), scale: amp * amp * 64.0 }
}

fn norm(x: &[f32], scale: f32) -> Vec<f32> {
    x.iter().map(|v| v / scale).collect()
}

fn close(got: &[f32], o: &Operands) -> bool {
    got.iter().zip(&o.want).all(|(g, w)| ((g - w) / o.scale).abs() <= PROBE_TOL)
}

#[test]
fn the_hopper_probe_matches_a_plain_product_in_every_swizzle_mode() {
    for (i, amp) in [1.0f32, 30.0].into_iter().enumerate() {
        let o = operands(60 + i as u64, amp);
        for s in Swizzle::ALL {
            let (d_ss, d_rs) =
                emu::hopper_probe(s, &o.a_bits, &o.b_nk, &o.b_kn, 0).unwrap_or_else(|e| panic!("{s:?}: {e}"));
            let want = norm(&o.want, o.scale);
            assert_close(&format!("{s:?} amp {amp}: wgmma SS, B K-major"), &norm(&d_ss, o.scale), &want, PROBE_TOL);
            assert_close(&format!("{s:?} amp {amp}: wgmma RS, B MN-major"), &norm(&d_rs, o.scale), &want, PROBE_TOL);
        }
    }
}

#[test]
fn the_emulation_catches_each_deliberate_mistake() {
    let o = operands(70, 1.0);
    for s in [Swizzle::B128, Swizzle::B64, Swizzle::None] {
        let run = |breaks| emu::hopper_probe(s, &o.a_bits, &o.b_nk, &o.b_kn, breaks);

        let e = run(probe_break::FENCE).expect_err("a missing fence is reported");
        assert!(e.contains("without a wgmma.fence"), "{s:?}: {e}");

        // The copies land as the maps lay them out; descriptors of another swizzle read them
        // in another order. The register-sourced product (right descriptors) is unaffected.
        let (d_ss, d_rs) = run(probe_break::SWIZZLE).unwrap_or_else(|e| panic!("{s:?}: {e}"));
        assert!(!close(&d_ss, &o), "{s:?}: descriptors of the wrong swizzle gave the right product");
        assert!(close(&d_rs, &o), "{s:?}: the unbroken product");

        // A wait on the other parity returns before the copies land: the operands are the
        // poison written at issue, and the copies are still queued when the block ends.
        let e = run(probe_break::PHASE).expect_err("a wait on the wrong phase is reported");
        assert!(e.contains("no thread waited for"), "{s:?}: {e}");

        // Accumulators read before the wait are NaN; the later wait retires the product.
        let (d_ss, d_rs) = run(probe_break::WAIT).unwrap_or_else(|e| panic!("{s:?}: {e}"));
        assert!(d_ss.iter().all(|x| x.is_nan()), "{s:?}: accumulators read before wgmma.wait_group");
        assert!(close(&d_rs, &o), "{s:?}: the product after the wait");

        // Deadlocks: reported (as soon as no thread can move), never a hang. Without the
        // arrival, every thread waits on a phase that cannot complete.
        let e = run(probe_break::ARRIVE).expect_err("a missing arrive is reported");
        assert!(e.contains("mbarrier.try_wait: the phase of parity 0 never completed (1 arrivals"), "{s:?}: {e}");
        // Thread 0 past a `__syncthreads` the others wait at: it lands the copies, then waits
        // for them at the warpgroup's first product.
        let e = run(probe_break::SYNC).expect_err("a skipped __syncthreads is reported");
        assert!(e.contains("threads can never complete"), "{s:?}: {e}");
    }
}

/// `fp_exp2_poly`'s relative error where its result is a normal float (the comment in
/// common.cuh: 3.6e-6 for the degree-4 polynomial; the log-sum-exp's tolerance is 2e-5).
const EXP2_POLY_REL_TOL: f64 = 4e-6;

/// The polynomial 2^x of the Hopper kernel's configurations 4 and 5 against exp2 in f64 over
/// every input it meets (a score minus its row's running maximum: up to FA2_RESCALE_LOG2 above,
/// down to a masked -inf), at 2^22 points of [-130, 8] and the ends: within
/// EXP2_POLY_REL_TOL where 2^x is a normal float, within a normal float's smallest step below,
/// exactly +0 from -127 down, for -inf and for NaN (a masked score; fmaxf drops the NaN).
#[test]
fn the_polynomial_exp2_is_within_its_tolerance_over_its_whole_range() {
    let top = flowprefill_kernels::gpu::shapes::FA2_RESCALE_LOG2 as f64;
    let (lo, n) = (-130.0f64, 1u32 << 22);
    let mut worst = (0.0f64, 0.0f64);
    for i in 0..=n {
        let x = (lo + (top - lo) * i as f64 / n as f64) as f32;
        let (got, want) = (emu::exp2_poly(x) as f64, (x as f64).exp2());
        assert!(got >= 0.0 && got.is_finite(), "2^{x}: {got}");
        if x <= -127.0 {
            assert_eq!(got.to_bits(), 0, "2^{x} is not +0");
        } else if want >= f32::MIN_POSITIVE as f64 * 2.0 {
            let rel = (got - want).abs() / want;
            if rel > worst.0 {
                worst = (rel, x as f64);
            }
        } else {
            assert!((got - want).abs() <= f32::MIN_POSITIVE as f64, "2^{x}: {got:e} against {want:e}");
        }
    }
    assert!(worst.0 <= EXP2_POLY_REL_TOL, "relative error {:.2e} at x = {}", worst.0, worst.1);
    // Integers are exact (p(0) = 1 is held), and the ends.
    for j in -126..=8 {
        assert_eq!(emu::exp2_poly(j as f32), (j as f32).exp2(), "2^{j}");
    }
    for x in [f32::NEG_INFINITY, f32::NAN, -1e30, -127.0] {
        assert_eq!(emu::exp2_poly(x).to_bits(), 0, "2^{x}");
    }
    eprintln!("fp_exp2_poly: worst relative error {:.2e} at x = {}", worst.0, worst.1);
}
