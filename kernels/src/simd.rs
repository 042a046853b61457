//! Runtime SIMD dispatch and vectorizable math helpers.
//!
//! The hot loops of this crate are written once as plain Rust over slices and compiled three
//! times by [`multiversion!`]: for AVX-512, for AVX2+FMA and for the baseline target. The running
//! CPU picks one at run time, so one binary is fast on new machines and still correct on old ones
//! (no `-C target-cpu=native` needed, which would make the binary crash elsewhere).
//!
//! [`exp2`] is a polynomial that LLVM can vectorize; `f32::exp` is a libm call that stays scalar
//! and would make softmax and SiLU the bottleneck (billions of calls at 8K tokens).

use std::sync::atomic::{AtomicU8, Ordering};

/// Instruction-set level a kernel runs at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum SimdLevel {
    /// The compilation target's baseline (SSE2 on x86_64).
    Scalar = 1,
    /// AVX2 + FMA.
    Avx2 = 2,
    /// AVX-512F/VL (+ AVX2, FMA).
    Avx512 = 3,
}

static DETECTED: AtomicU8 = AtomicU8::new(0);
static OVERRIDE: AtomicU8 = AtomicU8::new(0);

fn from_u8(v: u8) -> SimdLevel {
    match v {
        3 => SimdLevel::Avx512,
        2 => SimdLevel::Avx2,
        _ => SimdLevel::Scalar,
    }
}

/// The best level this CPU supports, optionally capped by `FLOWPREFILL_SIMD=scalar|avx2|avx512`
/// (`none` is taken as `scalar`). The cap applies to this crate's [`multiversion!`] loops
/// (softmax, norms, RoPE, SiLU, the attention's softmax, one-row matrix products); the matrix
/// products of the `gemm` crate pick their own instructions and ignore it. Any other value is
/// ignored, with one line on stderr naming the accepted ones (this function cannot return an
/// error).
pub fn detected() -> SimdLevel {
    let v = DETECTED.load(Ordering::Relaxed);
    if v != 0 {
        return from_u8(v);
    }
    let mut level = cpu_level();
    if let Ok(cap) = std::env::var("FLOWPREFILL_SIMD") {
        match parse_cap(&cap) {
            Ok(cap) => level = level.min(cap),
            Err(e) => {
                static WARNED: std::sync::Once = std::sync::Once::new();
                WARNED.call_once(|| eprintln!("flowprefill: {e}; using this CPU's best, {level:?}"));
            }
        }
    }
    DETECTED.store(level as u8, Ordering::Relaxed);
    level
}

/// A value of `FLOWPREFILL_SIMD`: `scalar` (or `none`), `avx2` or `avx512`, in any case;
/// anything else is an error that names the accepted values.
pub fn parse_cap(value: &str) -> Result<SimdLevel, String> {
    match value.trim().to_ascii_lowercase().as_str() {
        "scalar" | "none" => Ok(SimdLevel::Scalar),
        "avx2" => Ok(SimdLevel::Avx2),
        "avx512" => Ok(SimdLevel::Avx512),
        _ => Err(format!(
            "FLOWPREFILL_SIMD={value:?} is not a SIMD level: give scalar, avx2 or avx512 (it caps the \
             kernels' multiversioned loops, not the gemm crate's matrix products); ignored"
        )),
    }
}

#[cfg(target_arch = "x86_64")]
fn cpu_level() -> SimdLevel {
    if is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
    {
        SimdLevel::Avx512
    } else if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        SimdLevel::Avx2
    } else {
        SimdLevel::Scalar
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn cpu_level() -> SimdLevel {
    SimdLevel::Scalar
}

/// The level kernels use now: the detected one, or a lower one forced by [`set_override`].
#[inline]
pub fn level() -> SimdLevel {
    let o = OVERRIDE.load(Ordering::Relaxed);
    let d = detected();
    if o == 0 {
        d
    } else {
        from_u8(o).min(d)
    }
}

/// Forces kernels down to `level` (never above what the CPU has); `None` restores detection.
/// Process-wide: meant for tests that compare the code paths against each other.
pub fn set_override(level: Option<SimdLevel>) {
    OVERRIDE.store(level.map_or(0, |l| l as u8), Ordering::Relaxed);
}

/// Held by the tests that set [`set_override`] (one process, tests in parallel): one test's
/// override must not end another's while it runs.
#[cfg(test)]
pub(crate) fn override_lock() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs `f` at every SIMD level this CPU has (the baseline, AVX2+FMA, AVX-512), the override
/// held, so that an equivalence test checks each compiled body of a kernel and not only the one
/// this CPU picks; a level above the CPU is said skipped.
#[cfg(test)]
pub(crate) fn at_every_level(mut f: impl FnMut(SimdLevel)) {
    /// Detection back even if `f` panics.
    struct Restore;
    impl Drop for Restore {
        fn drop(&mut self) {
            set_override(None);
        }
    }
    let _held = override_lock();
    let _restore = Restore;
    for lvl in [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512] {
        if lvl > detected() {
            crate::testing::skipped(
                "SIMD level not on this CPU",
                format!("{lvl:?} is above this CPU's {:?}", detected()),
            );
            continue;
        }
        set_override(Some(lvl));
        assert_eq!(level(), lvl, "the override took effect");
        f(lvl);
    }
}

/// Defines a function whose body is compiled for AVX-512, AVX2+FMA and the baseline, and
/// dispatched on [`level`] at run time. The body must not use `unsafe` intrinsics: it is
/// plain Rust that LLVM vectorizes with the enabled features.
#[macro_export]
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn body($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
                unsafe fn v4($($arg: $ty),*) $(-> $ret)? { body($($arg),*) }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn v3($($arg: $ty),*) $(-> $ret)? { body($($arg),*) }
                match $crate::simd::level() {
                    // SAFETY: level() never reports a level above what is_x86_feature_detected!
                    // found on this CPU, so the enabled target features are present.
                    $crate::simd::SimdLevel::Avx512 => return unsafe { v4($($arg),*) },
                    // SAFETY: as above.
                    $crate::simd::SimdLevel::Avx2 => return unsafe { v3($($arg),*) },
                    $crate::simd::SimdLevel::Scalar => {}
                }
            }
            body($($arg),*)
        }
    };
}

const LN2: f32 = std::f32::consts::LN_2;
/// 1.5 * 2^23: adding it rounds an f32 of magnitude < 2^22 to the nearest integer.
const ROUND_MAGIC: f32 = 12_582_912.0;

/// 2^x with a relative error below 2e-7 on [-126, 127]; exactly 0 for x <= -127 (and -inf),
/// 2^127 for x >= 127 (and +inf), NaN for NaN (a softmax over a NaN score is NaN, as in f64,
/// not a silent 0). Pure arithmetic on f32/u32 so that loops calling it vectorize.
#[inline(always)]
pub fn exp2(x: f32) -> f32 {
    // Written as compares (not f32::max/min) so they lower to plain vmaxps/vminps, in the
    // operand order that returns x when x is NaN (both compares are false for NaN): NaN then
    // stays NaN through the polynomial.
    let x = if x < -127.0 { -127.0 } else { x };
    let x = if x > 127.0 { 127.0 } else { x };
    let t = x + ROUND_MAGIC;
    let n = (t.to_bits() as i32).wrapping_sub(ROUND_MAGIC.to_bits() as i32);
    let f = x - (t - ROUND_MAGIC); // in [-0.5, 0.5]
    let y = f * LN2; // |y| <= 0.347: Taylor series of e^y to degree 7 is exact to ~5e-9
    let p = 1.0 / 5040.0;
    let p = p * y + 1.0 / 720.0;
    let p = p * y + 1.0 / 120.0;
    let p = p * y + 1.0 / 24.0;
    let p = p * y + 1.0 / 6.0;
    let p = p * y + 0.5;
    let p = p * y + 1.0;
    let p = p * y + 1.0;
    // n in [-127, 127]; n = -127 gives the bit pattern 0, i.e. exactly 0.0. (For NaN, n is
    // whatever the NaN's bits make it, hence the wrapping add; p is NaN and so is the result.)
    let scale = f32::from_bits((n.wrapping_add(127) as u32) << 23);
    p * scale
}

/// Largest value of a slice (-inf when empty), with lane-parallel accumulators that vectorize.
#[inline(always)]
pub fn max_of(xs: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 16];
    let mut chunks = xs.chunks_exact(16);
    for c in &mut chunks {
        for i in 0..16 {
            acc[i] = if c[i] > acc[i] { c[i] } else { acc[i] };
        }
    }
    let mut m = f32::NEG_INFINITY;
    for &x in chunks.remainder().iter().chain(acc.iter()) {
        m = if x > m { x } else { m };
    }
    m
}

/// e^x through [`exp2`].
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    exp2(x * std::f32::consts::LOG2_E)
}

/// Number of worker threads kernels may use (the rayon pool's size).
pub fn threads() -> usize {
    rayon::current_num_threads().max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Relative error bound of [`exp2`] against f64 (named tolerance).
    const EXP2_REL_TOL: f64 = 3e-7;

    #[test]
    fn exp2_matches_f64_over_range() {
        let mut worst = 0f64;
        let mut x = -125.9f32;
        while x < 126.0 {
            let want = (x as f64).exp2();
            let got = exp2(x) as f64;
            let rel = ((got - want) / want).abs();
            worst = worst.max(rel);
            x += 0.0137;
        }
        assert!(worst < EXP2_REL_TOL, "worst relative error {worst}");
    }

    #[test]
    fn exp2_edges() {
        assert_eq!(exp2(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp2(-200.0), 0.0);
        assert_eq!(exp2(0.0), 1.0);
        assert!((exp2(1.0) - 2.0).abs() < 1e-6);
        assert!(exp2(127.0).is_finite());
        assert!((exp(1.0) - std::f32::consts::E).abs() < 1e-6);
    }

    #[test]
    fn exp2_passes_nan_through() {
        assert!(exp2(f32::NAN).is_nan());
        assert!(exp2(-f32::NAN).is_nan());
        assert!(exp(f32::NAN).is_nan());
        // +inf - +inf, what a softmax computes for a +inf score: NaN, not 0.
        assert!(exp2(f32::INFINITY - f32::INFINITY).is_nan());
        assert_eq!(exp2(f32::INFINITY), exp2(127.0));
        // In a vectorized loop too, at every level.
        at_every_level(|lvl| {
            let xs: Vec<f32> = (0..40).map(|i| if i % 7 == 3 { f32::NAN } else { -(i as f32) }).collect();
            let ys = exp2_all(&xs);
            for (x, y) in xs.iter().zip(&ys) {
                assert_eq!(x.is_nan(), y.is_nan(), "{lvl:?}: exp2({x}) = {y}");
            }
        });
    }

    crate::multiversion! {
        fn exp2_all(xs: &[f32]) -> Vec<f32> {
            xs.iter().map(|&x| exp2(x)).collect()
        }
    }

    #[test]
    fn simd_caps_parse_and_unknown_values_are_refused() {
        assert_eq!(parse_cap("scalar"), Ok(SimdLevel::Scalar));
        assert_eq!(parse_cap("none"), Ok(SimdLevel::Scalar));
        assert_eq!(parse_cap(" AVX2 "), Ok(SimdLevel::Avx2));
        assert_eq!(parse_cap("avx512"), Ok(SimdLevel::Avx512));
        for bad in ["sse", "off", "avx-2", ""] {
            let e = parse_cap(bad).expect_err(bad);
            assert!(e.contains("scalar, avx2 or avx512") && e.contains("gemm"), "{e}");
        }
    }

    #[test]
    fn override_never_exceeds_detected() {
        let _held = override_lock();
        set_override(Some(SimdLevel::Avx512));
        assert!(level() <= detected());
        set_override(None);
        assert_eq!(level(), detected());
    }
}
