//! The compile gate: every CUDA kernel compiled by NVRTC to machine code for sm_80 (A100) and
//! sm_90a (H100) with the ptxas report; fails on a compile error, any register spill, a stack
//! frame (a register array that fell back to local memory), registers or static shared memory
//! above the budgets of `flowprefill_kernels::gpu`, or static + dynamic shared memory above
//! what a block may have on the architecture. The table shows the blocks per SM that the
//! registers and the shared memory allow (64K registers, 228 / 164 KiB shared per SM). NVRTC needs no
//! GPU: `scripts/test.sh` installs it from PyPI and sets `FLOWPREFILL_REQUIRE_NVRTC=1`, so in
//! CI a missing NVRTC is a failure; elsewhere this test says it was skipped.
#![cfg(feature = "cuda")]

use flowprefill_kernels::cuda::nvrtc;
use flowprefill_kernels::gpu::{FILES, SHARED_LIMITS};

/// Shared memory per SM (bytes) and registers per SM, by architecture.
fn per_sm(arch: &str) -> (u32, u32) {
    match arch {
        "sm_80" => (164 * 1024, 65536),
        _ => (228 * 1024, 65536),
    }
}

const ARCHS: [&str; 2] = ["sm_80", "sm_90a"];

/// NVRTC is there: true. Not there: a failure where `FLOWPREFILL_REQUIRE_NVRTC` is set (the
/// test command sets it), else false after saying the test was skipped.
fn nvrtc_or_skip(test: &str) -> bool {
    if nvrtc::available() {
        return true;
    }
    assert!(
        std::env::var_os("FLOWPREFILL_REQUIRE_NVRTC").is_none(),
        "FLOWPREFILL_REQUIRE_NVRTC is set but libnvrtc was not found (LD_LIBRARY_PATH={:?})",
        std::env::var("LD_LIBRARY_PATH")
    );
    flowprefill_kernels::testing::skipped(
        "no NVRTC library",
        format!("{test}: libnvrtc not found (scripts/test.sh installs it)"),
    );
    false
}

#[test]
fn every_kernel_compiles_for_sm80_and_sm90a_within_its_budget() {
    if !nvrtc_or_skip("compile gate") {
        return;
    }
    let (major, minor) = nvrtc::version().expect("NVRTC version");
    println!("NVRTC {major}.{minor}");
    println!(
        "{:<7} {:<26} {:>4} {:>5} {:>6} {:>6} {:>6} {:>6} {:>7}   budget",
        "arch", "kernel", "regs", "smem", "dyn", "spillS", "spillL", "stack", "blk/SM"
    );
    let mut failures = Vec::new();
    for arch in ARCHS {
        for file in FILES {
            let c = nvrtc::compile(file.name, &flowprefill_kernels::gpu::program(file), arch)
                .unwrap_or_else(|e| panic!("{e}"));
            assert!(!c.cubin.is_empty(), "{} for {arch}: empty CUBIN", file.name);
            let report =
                nvrtc::parse_report(&c.log).unwrap_or_else(|e| panic!("{} for {arch}: {e}\n{}", file.name, c.log));
            for b in file.kernels {
                let Some(r) = report.iter().find(|r| r.kernel == b.kernel) else {
                    failures.push(format!("{arch} {}: no ptxas report (log:\n{})", b.kernel, c.log));
                    continue;
                };
                // Blocks per SM of the launchers' block size, bounded by registers and by shared
                // memory.
                let threads = b.threads;
                let (smem_sm, regs_sm) = per_sm(arch);
                let by_regs = regs_sm / (r.registers.max(1) * threads);
                let smem = r.shared_bytes + b.dynamic_shared_bytes;
                let by_smem = if smem == 0 { u32::MAX } else { smem_sm / (smem + 1024) };
                println!(
                    "{arch:<7} {:<26} {:>4} {:>5} {:>6} {:>6} {:>6} {:>6} {:>7}   <= {} regs, <= {} B smem",
                    r.kernel,
                    r.registers,
                    r.shared_bytes,
                    b.dynamic_shared_bytes,
                    r.spill_stores,
                    r.spill_loads,
                    r.stack_bytes,
                    by_regs.min(by_smem),
                    b.max_registers,
                    b.max_shared_bytes
                );
                if r.stack_bytes > 0 {
                    failures.push(format!("{arch} {}: a {} B stack frame (local memory)", r.kernel, r.stack_bytes));
                }
                let limit = SHARED_LIMITS.iter().find(|(a, _)| *a == arch).map_or(0, |l| l.1);
                if smem > limit {
                    failures.push(format!("{arch} {}: {smem} B of shared memory > {limit} per block", r.kernel));
                }
                if r.spill_stores > 0 || r.spill_loads > 0 {
                    failures.push(format!(
                        "{arch} {}: spills ({} B stores, {} B loads)",
                        r.kernel, r.spill_stores, r.spill_loads
                    ));
                }
                if r.registers > b.max_registers {
                    failures
                        .push(format!("{arch} {}: {} registers > budget {}", r.kernel, r.registers, b.max_registers));
                }
                if r.shared_bytes > b.max_shared_bytes {
                    failures.push(format!(
                        "{arch} {}: {} B shared > budget {}",
                        r.kernel, r.shared_bytes, b.max_shared_bytes
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "compile gate:\n{}", failures.join("\n"));
}

#[test]
fn a_broken_kernel_is_a_compile_error_with_the_log() {
    if !nvrtc_or_skip("broken kernel") {
        return;
    }
    let e = nvrtc::compile("broken.cu", "extern \"C\" __global__ void k(float* x) { x[0] = undefined_name; }", "sm_80")
        .expect_err("a compile error");
    let m = e.to_string();
    assert!(m.contains("broken.cu") && m.contains("undefined_name"), "{m}");
}
