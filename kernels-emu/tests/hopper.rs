//! Hopper's primitives in the CPU emulation (`kernels/cuda/cpu_shim_hopper.h`): the self-check
//! kernel `hopper_probe.cu` (TMA copies through tensor maps into swizzled shared memory, one
//! mbarrier, wgmma.mma_async from shared-memory descriptors and from registers, K-major and
//! transposed B) against a plain product in every swizzle mode, and each deliberate mistake
//! the emulation must catch: a missing wgmma.fence, descriptors of the wrong swizzle, a wait on
//! the wrong mbarrier phase, accumulators read without wgmma.wait_group.

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
    }
}
