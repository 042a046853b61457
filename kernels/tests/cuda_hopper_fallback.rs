//! The Hopper attention's fallback, in a process of its own (it sets the variables a backend
//! reads when it is made): `FLOWPREFILL_FLASH_KERNEL=hopper` with the self-check made to fail
//! (`FLOWPREFILL_HOPPER_SELF_CHECK=fail`) gives a backend that said why on stderr and computes
//! attention with flash2, matching the CPU; asking for the kernel afterwards is an error naming
//! the failed check. Needs a GPU (any: without sm_90a the check fails by capability first);
//! without one it says skipped.
#![cfg(feature = "cuda")]

use flowprefill_kernels::attention::AttnShape;
use flowprefill_kernels::cuda::{CudaBackend, WeightType};
use flowprefill_kernels::gpu::ops::FlashKernel;
use flowprefill_kernels::{Backend, Cpu, DType, HostBuf};

/// flash2 against the CPU on the same bf16 values (cuda_ops.rs's FLASH_OUT_TOL, max|V| = 1).
const OUT_TOL: f32 = 4e-3;

#[test]
fn a_failed_hopper_self_check_falls_back_to_flash2() {
    if flowprefill_kernels::cuda::devices().map_or(true, |d| d.is_empty()) {
        flowprefill_kernels::testing::skipped("no CUDA device", "the Hopper fallback".to_string());
        return;
    }
    std::env::set_var("FLOWPREFILL_FLASH_KERNEL", "hopper");
    std::env::set_var("FLOWPREFILL_HOPPER_SELF_CHECK", "fail");
    let mut g = CudaBackend::new(0, WeightType::Bf16, DType::Bf16).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(g.fixed_attention(), None, "flash2 and its autotuner, not the Hopper kernel");

    let (m, n, heads, kv, d) = (200usize, 700usize, 8usize, 2usize, 128usize);
    let shape = AttnShape::new(heads, kv, d).unwrap();
    let val = |i: usize, s: f32| ((i as f32 * 0.618).fract() - 0.5) * s;
    let q: Vec<f32> = (0..m * heads * d)
        .map(|i| flowprefill_kernels::backend::from_bf16(flowprefill_kernels::backend::to_bf16(val(i, 2.0))))
        .collect();
    let k: Vec<f32> = (0..n * kv * d).map(|i| val(i + 7, 2.0)).collect();
    let v: Vec<f32> = (0..n * kv * d).map(|i| val(i + 13, 2.0)).collect();
    let qpos: Vec<u32> = (n - m..n).map(|p| p as u32).collect();
    let kpos: Vec<u32> = (0..n as u32).collect();
    let kvd = kv * d;
    let c = Cpu::with_kv_dtype(DType::Bf16);
    let (mut gk, mut gv) = (g.zeros_as(n * kvd, DType::Bf16).unwrap(), g.zeros_as(n * kvd, DType::Bf16).unwrap());
    g.copy_columns(&g.upload(&k).unwrap(), kvd, 0, kvd, &mut gk).unwrap();
    g.copy_columns(&g.upload(&v).unwrap(), kvd, 0, kvd, &mut gv).unwrap();
    let (mut ck, mut cv) = (HostBuf::zeros(n * kvd, DType::Bf16), HostBuf::zeros(n * kvd, DType::Bf16));
    c.copy_columns(&HostBuf::F32(k), kvd, 0, kvd, &mut ck).unwrap();
    c.copy_columns(&HostBuf::F32(v), kvd, 0, kvd, &mut cv).unwrap();
    let (mut go, mut gl) = (g.zeros(q.len()).unwrap(), g.zeros(m * heads).unwrap());
    g.attention(&shape, &g.upload(&q).unwrap(), &qpos, &gk, &gv, &kpos, &mut go, &mut gl).unwrap();
    let (mut co, mut cl) = (HostBuf::zeros(q.len(), DType::F32), HostBuf::zeros(m * heads, DType::F32));
    c.attention(&shape, &HostBuf::F32(q), &qpos, &ck, &cv, &kpos, &mut co, &mut cl).unwrap();
    let worst = flowprefill_kernels::testing::max_abs_diff(&g.download(&go).unwrap(), &co.to_f32());
    assert!(worst <= OUT_TOL, "flash2 after the fallback: out error {worst:e}");

    let e = g.fix_attention(FlashKernel::Hopper(0)).expect_err("the self-check still fails");
    let e3 = g.fix_attention(FlashKernel::Hopper(3)).expect_err("every configuration's self-check fails");
    assert!(e3.to_string().contains("FLOWPREFILL_HOPPER_SELF_CHECK"), "{e3}");
    assert!(e.to_string().contains("FLOWPREFILL_HOPPER_SELF_CHECK"), "{e}");
    assert_eq!(g.fixed_attention(), None, "a failed fix changes nothing");
}
