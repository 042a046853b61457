//! Hopper's launches on the device (compute capability 9.0, `sm_90a`): tensor maps encoded by
//! the driver from the same [`TensorMap2d`] the emulation encodes, and the self-check
//! (`hopper_probe.cu`) that compares the hardware's layouts with the emulation's.

use super::backend::CudaBackend;
use super::err;
use crate::error::{KernelError, Result};
use crate::gpu::ops::{self, AttnDims, FlashKernel, FlashPlan, Swizzle};
use crate::gpu::tma::{TensorMap2d, MAP_WORDS};
use crate::gpu::{Elem, Ptr};
use cudarc::driver::sys::{
    self, CUtensorMapDataType_enum as DataType, CUtensorMapFloatOOBfill_enum as OobFill,
    CUtensorMapInterleave_enum as Interleave, CUtensorMapL2promotion_enum as L2, CUtensorMapSwizzle_enum as Sw,
};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

/// The driver's 128 bytes for `m` (`cuTensorMapEncodeTiled`: bf16, rank 2, element strides 1,
/// no interleave, `m`'s swizzle, L2 promotion by 128 bytes, zeros outside the tensor).
pub fn encode(m: &TensorMap2d) -> Result<[u64; MAP_WORDS]> {
    let swizzle = match m.swizzle {
        Swizzle::None => Sw::CU_TENSOR_MAP_SWIZZLE_NONE,
        Swizzle::B32 => Sw::CU_TENSOR_MAP_SWIZZLE_32B,
        Swizzle::B64 => Sw::CU_TENSOR_MAP_SWIZZLE_64B,
        Swizzle::B128 => Sw::CU_TENSOR_MAP_SWIZZLE_128B,
    };
    let strides = [m.row_bytes];
    let elem_strides = [1u32, 1];
    let mut map = sys::CUtensorMap { opaque: [0; MAP_WORDS] };
    // SAFETY: every array has the rank's length (2, and 1 for the strides of the dimensions
    // above the first); `map` is a valid CUtensorMap to write; the driver only reads the base
    // address as a number (nothing is accessed until a kernel copies through the map).
    let rc = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            DataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            2,
            m.base as *mut std::ffi::c_void,
            m.dims.as_ptr(),
            strides.as_ptr(),
            m.boxed.as_ptr(),
            elem_strides.as_ptr(),
            Interleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            L2::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            OobFill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    rc.result().map_err(|e| err(&format!("cuTensorMapEncodeTiled {m:?}"), e))?;
    Ok(map.opaque)
}

impl CudaBackend {
    /// Whether this GPU runs the Hopper kernels (compute capability 9.0, their file loaded).
    pub fn has_hopper(&self) -> bool {
        self.has_kernel(ops::hopper_probe_kernel(Swizzle::B128))
    }

    /// Hopper's self-check on this GPU, for one swizzle mode: `(d_ss, d_rs)` for bf16 `a
    /// [64][64]`, `b_nk [128][64]`, `b_kn [64][128]` (see [`ops::hopper_probe`]); both must
    /// equal A B. It checks the descriptor, swizzle and fragment layouts the CPU emulation of
    /// the Hopper kernels assumes.
    pub fn hopper_probe(
        &self,
        swizzle: Swizzle,
        a: &[u16],
        b_nk: &[u16],
        b_kn: &[u16],
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        if !self.has_hopper() {
            return Err(KernelError::Backend {
                backend: "cuda",
                detail: format!("{}: the Hopper kernels need compute capability 9.0 (sm_90a)", self.arch()),
            });
        }
        for (what, x, n) in [("a", a, 64 * 64), ("b_nk", b_nk, 128 * 64), ("b_kn", b_kn, 64 * 128)] {
            super::backend::check_same("hopper_probe", what, x.len(), n)?;
        }
        let s = &self.stream;
        let up = |v: &[u16]| s.clone_htod(v).map_err(|e| err("hopper probe upload", e));
        let (da, dnk, dkn) = (up(a)?, up(b_nk)?, up(b_kn)?);
        let mut d1 = s.alloc_zeros::<f32>(64 * 128).map_err(|e| err("alloc", e))?;
        let mut d2 = s.alloc_zeros::<f32>(64 * 128).map_err(|e| err("alloc", e))?;
        {
            let (pa, _a) = da.device_ptr(s);
            let (pnk, _b) = dnk.device_ptr(s);
            let (pkn, _c) = dkn.device_ptr(s);
            let b = |p| Ptr::new(p, Elem::Bf16);
            let maps = ops::hopper_probe_maps(b(pa), b(pnk), b(pkn), swizzle)?;
            let mut words = Vec::with_capacity(3 * MAP_WORDS);
            for m in &maps {
                words.extend(encode(m)?);
            }
            let dmaps: CudaSlice<u64> = s.clone_htod(&words).map_err(|e| err("tensor map upload", e))?;
            let (pm, _m) = dmaps.device_ptr(s);
            let (p1, _d) = d1.device_ptr_mut(s);
            let (p2, _e) = d2.device_ptr_mut(s);
            let f = |p| Ptr::new(p, Elem::F32);
            self.run_built(ops::hopper_probe(swizzle, Ptr::new(pm, Elem::U64), b(pa), f(p1), f(p2), 0))?;
        }
        self.finish_within("the Hopper probe (its first run on this GPU)")?;
        let get = |d: &CudaSlice<f32>| s.clone_dtoh(d).map_err(|e| err("hopper probe download", e));
        Ok((get(&d1)?, get(&d2)?))
    }
}

/// The device buffers of one tensor-core attention call.
#[derive(Clone, Copy, Debug)]
pub(super) struct FlashIo {
    pub q: Ptr,
    pub qpos: Ptr,
    pub k: Ptr,
    pub v: Ptr,
    pub meta: Ptr,
    pub out: Ptr,
    pub lse: Ptr,
}

/// A small deterministic generator for the self-check's inputs (no dependency at run time).
struct Lcg(u64);

impl Lcg {
    /// Uniform in (-amp, amp), rounded to bf16 bits.
    fn bf16(&mut self, amp: f32) -> u16 {
        self.0 = self.0.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        let unit = (self.0 >> 40) as f32 / (1u64 << 24) as f32;
        crate::backend::to_bf16((2.0 * unit - 1.0) * amp)
    }
}

impl CudaBackend {
    /// Runs one tensor-core attention by `plan`: flash2 or the reference from their builder,
    /// the Hopper kernel with tensor maps over `io.k` and `io.v` encoded by the driver.
    pub(super) fn run_flash(
        &self,
        dims: AttnDims,
        plan: &FlashPlan,
        io: FlashIo,
        partial: Option<(Ptr, Ptr)>,
        scale: f32,
    ) -> Result<()> {
        if !plan.kernel.is_hopper() {
            let calls =
                ops::flash_attention(dims, plan, io.q, io.qpos, io.k, io.v, io.meta, io.out, io.lse, partial, scale)?;
            return calls.iter().try_for_each(|c| self.run(c));
        }
        // The maps as control data (uploaded once per distinct content: every repeat of a call
        // over the same K and V finds them on the device), as 32-bit words, little-endian; each
        // entry is an allocation of its own, 256-byte aligned (TMA asks 64 of a map).
        let mut words = Vec::with_capacity(4 * MAP_WORDS);
        for m in ops::hopper_attention_maps(dims, io.k, io.v)?.iter().flatten() {
            words.extend(encode(m)?.iter().flat_map(|w| [*w as u32, (*w >> 32) as u32]));
        }
        let maps = self.upload_u32(&words)?;
        let (mp, _m) = maps.device_ptr(&self.stream);
        let maps = Ptr::new(mp, Elem::U64);
        let calls = ops::hopper_attention(dims, plan, maps, io.q, io.qpos, io.meta, io.out, io.lse, partial, scale)?;
        calls.iter().try_for_each(|c| self.run(c))
    }

    /// [`Self::hopper_self_check`] of configuration `config`, run once per backend: a
    /// configuration of the Hopper kernel is used (fixed, or timed by the autotuner) only after
    /// it passed.
    /// A GPU lost during the check (a fault, a kernel that never finished) is that error, not a
    /// verdict: nothing, flash2 included, runs on it any more.
    pub(super) fn hopper_verified(&self, config: u8) -> Result<()> {
        let Some(slot) = self.tuning.hopper.get(config as usize) else {
            return Err(err("hopper", format!("there is no configuration {config} of the Hopper kernel")));
        };
        let mut lost = None;
        let verdict = slot.get_or_init(|| {
            self.hopper_self_check(config).map_err(|e| match e {
                KernelError::Backend { detail, .. } => detail,
                e @ KernelError::DeviceLost { .. } => lost.insert(e).to_string(),
                other => other.to_string(),
            })
        });
        if let Some(e) = lost {
            return Err(e);
        }
        super::health::check_hung(self.ordinal())?;
        verdict.clone().map_err(|detail| KernelError::Backend { backend: "cuda", detail })
    }

    /// Hopper's self-check of configuration `config`: the probe (128-byte swizzle) against a
    /// plain product, the configuration loaded (the default is), then the attention on two
    /// small problems (grouped heads, causal positions, rows that see nothing, a partial last
    /// tile, key splits; 333 and 2048 keys) at head dimensions 64 and 128 against flash2 on
    /// this GPU (a persistent configuration also planned for 3 SMs, its blocks walking several
    /// work items). `FLOWPREFILL_HOPPER_SELF_CHECK=fail` fails it on purpose (to see the fallback).
    pub(super) fn hopper_self_check(&self, config: u8) -> Result<()> {
        let fail = |detail: String| Err(KernelError::Backend { backend: "cuda", detail });
        if std::env::var("FLOWPREFILL_HOPPER_SELF_CHECK").as_deref() == Ok("fail") {
            return fail("its self-check was made to fail (FLOWPREFILL_HOPPER_SELF_CHECK=fail)".into());
        }
        if !self.has_hopper() {
            return fail(format!("{} has no sm_90a kernels (compute capability 9.0 only)", self.arch()));
        }
        let mut r = Lcg(9);
        let a: Vec<u16> = (0..64 * 64).map(|_| r.bf16(2.0)).collect();
        let b_kn: Vec<u16> = (0..64 * 128).map(|_| r.bf16(2.0)).collect();
        let b_nk: Vec<u16> = (0..128 * 64).map(|i| b_kn[(i % 64) * 128 + i / 64]).collect();
        let (d_ss, d_rs) = self.hopper_probe(Swizzle::B128, &a, &b_nk, &b_kn)?;
        let f = |x: u16| crate::backend::from_bf16(x);
        for (e, (&x, &y)) in d_ss.iter().zip(&d_rs).enumerate() {
            let want: f32 = (0..64).map(|k| f(a[(e / 128) * 64 + k]) * f(b_kn[k * 128 + e % 128])).sum();
            if (x - want).abs() > 1e-3 * 256.0 || (y - want).abs() > 1e-3 * 256.0 {
                return fail(format!("the probe's element {e}: {x} and {y}, a plain product {want}"));
            }
        }
        if config > 0 {
            self.load_config("flash_hopper.cu", config as usize)?;
        }
        // A few tiles (each stage used once), and 16 tiles (each stage used 5 to 8 times).
        for (m, n) in [(150usize, 333usize), (512, 2048)] {
            for d in [64usize, 128] {
                self.hopper_attention_check(FlashKernel::Hopper(config), m, n, d, &mut r)?;
            }
        }
        Ok(())
    }

    fn hopper_attention_check(&self, hopper: FlashKernel, m: usize, n: usize, d: usize, r: &mut Lcg) -> Result<()> {
        let (heads, kv) = (8usize, 2usize);
        let q: Vec<u16> = (0..m * heads * d).map(|_| r.bf16(1.0)).collect();
        let k: Vec<u16> = (0..n * kv * d).map(|_| r.bf16(1.0)).collect();
        let v: Vec<u16> = (0..n * kv * d).map(|_| r.bf16(1.0)).collect();
        // Queries at the end of the keys, the first few before every key (they see nothing).
        let qpos: Vec<u32> = (0..m as u32).map(|i| if i < 3 { 0 } else { i + (n - m) as u32 }).collect();
        let kpos: Vec<u32> = (1..=n as u32).collect();
        let dims =
            AttnDims { m: m as u32, n: n as u32, n_heads: heads as u32, n_kv_heads: kv as u32, head_dim: d as u32 };
        let s = &self.stream;
        let up16 = |x: &[u16]| s.clone_htod(x).map_err(|e| err("self-check upload", e));
        let up32 = |x: &[u32]| s.clone_htod(x).map_err(|e| err("self-check upload", e));
        let (dq, dk, dv) = (up16(&q)?, up16(&k)?, up16(&v)?);
        let (dqp, dmeta) = (up32(&qpos)?, up32(&ops::key_meta(&kpos))?);
        let mut got = Vec::new();
        // The persistent configuration also as if this GPU had 3 SMs: blocks of 3 to 11 items.
        let few = hopper.is_persistent().then_some((hopper, None, 3));
        let runs = [
            (FlashKernel::Fa2(0), None, self.sm_count),
            (hopper, None, self.sm_count),
            (hopper, Some(2), self.sm_count),
        ];
        for (kernel, splits, sms) in runs.into_iter().chain(few) {
            let mut out = s.alloc_zeros::<f32>(m * heads * d).map_err(|e| err("alloc", e))?;
            let mut lse = s.alloc_zeros::<f32>(m * heads).map_err(|e| err("alloc", e))?;
            {
                let plan = ops::flash_plan(dims, kernel, sms, splits);
                let (pq, _a) = dq.device_ptr(s);
                let (pk, _b) = dk.device_ptr(s);
                let (pv, _c) = dv.device_ptr(s);
                let (pqp, _d) = dqp.device_ptr(s);
                let (pm, _e) = dmeta.device_ptr(s);
                let (po, _f) = out.device_ptr_mut(s);
                let (pl, _g) = lse.device_ptr_mut(s);
                let (b, u, f) = (|p| Ptr::new(p, Elem::Bf16), |p| Ptr::new(p, Elem::U32), |p| Ptr::new(p, Elem::F32));
                let io = FlashIo { q: b(pq), qpos: u(pqp), k: b(pk), v: b(pv), meta: u(pm), out: f(po), lse: f(pl) };
                self.with_partials(dims, &plan, |partial| self.run_flash(dims, &plan, io, partial, 0.125))?;
            }
            self.finish_within(&format!("the self-check of {kernel:?} at d{d}"))?;
            let o = s.clone_dtoh(&out).map_err(|e| err("self-check download", e))?;
            let l = s.clone_dtoh(&lse).map_err(|e| err("self-check download", e))?;
            got.push((kernel, splits, sms, o, l));
        }
        let (_, _, _, want_o, want_l) = &got[0];
        for (kernel, splits, sms, o, l) in &got[1..] {
            // flash2's bf16 rounding of P against another order of the same sums: within the
            // tensor-core kernels' ceiling (4e-3 x max|V|, max|V| <= 1) twice over.
            // NaN is never within.
            let within = |diff: f32, tol: f32| diff.abs() <= tol;
            let bad_o = o.iter().zip(want_o).position(|(x, y)| !within(x - y, 8e-3));
            let bad_l = l.iter().zip(want_l).position(|(x, y)| x != y && !within(x - y, 1e-4 * y.abs().max(1.0)));
            let bad = |what: &str, i: usize, got: f32, want: f32| {
                Err(KernelError::Backend {
                    backend: "cuda",
                    detail: format!(
                        "{kernel:?} (splits {splits:?}, planned for {sms} SMs) at d{d}: {what} {i} is {got}, flash2's {want}"
                    ),
                })
            };
            if let Some(i) = bad_o {
                return bad("output", i, o[i], want_o[i]);
            }
            if let Some(i) = bad_l {
                return bad("lse", i, l[i], want_l[i]);
            }
        }
        Ok(())
    }
}
