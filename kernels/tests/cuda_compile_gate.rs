//! The compile gate: every CUDA kernel compiled by NVRTC to machine code for sm_80 (A100) and
//! sm_90a (H100) with the ptxas report (the Hopper files, for sm_90a only); fails on a compile error, any register spill, a stack
//! frame (a register array that fell back to local memory), registers or static shared memory
//! above the budgets of `flowprefill_kernels::gpu`, or static + dynamic shared memory above
//! what a block may have on the architecture, on a compiler warning, or on ptxas's remark that an attention kernel's
//! warpgroup products were serialized or needed a wait or arrive it added. The table shows the blocks per SM that the
//! registers and the shared memory allow (64K registers, 228 / 164 KiB shared per SM). NVRTC needs no
//! GPU: `scripts/test.sh` installs it from PyPI and sets `FLOWPREFILL_REQUIRE_NVRTC=1`, so in
//! CI a missing NVRTC is a failure; elsewhere this test says it was skipped.
#![cfg(feature = "cuda")]

use flowprefill_kernels::cuda::nvrtc;
use flowprefill_kernels::gpu::sass::{self, Row, SassBudget};
use flowprefill_kernels::gpu::{shapes, Budget, KernelFile, FILES, SHARED_LIMITS};
use std::path::PathBuf;

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

/// nvdisasm is there: its path. Not there: a failure where `FLOWPREFILL_NVDISASM` or
/// `FLOWPREFILL_REQUIRE_NVRTC` is set (the test command sets both), else `None` after saying
/// the static gate was skipped.
fn nvdisasm_or_skip(test: &str) -> Option<PathBuf> {
    match sass::nvdisasm() {
        Ok(Some(p)) => Some(p),
        Ok(None) => {
            assert!(
                std::env::var_os("FLOWPREFILL_REQUIRE_NVRTC").is_none(),
                "FLOWPREFILL_REQUIRE_NVRTC is set but nvdisasm was not found (bash scripts/cuda-wheels.sh nvdisasm \
                 installs it; FLOWPREFILL_NVDISASM names it)"
            );
            flowprefill_kernels::testing::skipped(
                "no nvdisasm",
                format!("{test}: nvdisasm not found (scripts/test.sh installs it)"),
            );
            None
        }
        Err(e) => panic!("{e}"),
    }
}

/// The static gate's table header, and one row.
fn sass_header() -> String {
    format!(
        "{:<7} {:<26} {:>6} {:>4} | {:>5} {:>5} {:>4} {:>6} {:>3} {:>4} {:>5} {:>6} {:>5}   budget",
        "arch", "kernel", "instr", "L/S", "loop", "HMMA", "LDSM", "LDGSTS", "BAR", "BRA", "loops", "i/HMMA", "H/LD"
    )
}

fn sass_line(arch: &str, row: &Row, budget: SassBudget) -> String {
    let head = format!("{arch:<7} {:<26} {:>6} {:>4} |", row.kernel, row.total.instrs, row.total.local);
    if let SassBudget::Wgmma { hgmma, .. } = budget {
        let lp = row.wgmma_loop.map_or(String::new(), |(l, n)| {
            let m = l.mix;
            format!(
                "; loop {} instr, {} HGMMA, {} MUFU, {} BAR, {} BRA ({n} HGMMA loops), {:.1} instr/HGMMA",
                m.instrs,
                m.hgmma,
                m.mufu,
                m.bar,
                m.branches,
                m.per_hgmma()
            )
        });
        return format!("{head} HGMMA {} (>= {hgmma}), HMMA {} (none allowed){lp}", row.total.hgmma, row.total.hmma);
    }
    let Some((l, n)) = &row.steady else {
        return head;
    };
    let m = l.mix;
    let b = match budget {
        SassBudget::Loop { max_per_hmma, min_hmma_per_ldsm } => format!("<= {max_per_hmma}, >= {min_hmma_per_ldsm}"),
        _ => "reported".to_string(),
    };
    format!(
        "{head} {:>5} {:>5} {:>4} {:>6} {:>3} {:>4} {:>5} {:>6.2} {:>5.2}   {b}",
        m.instrs,
        m.hmma,
        m.ldsm,
        m.ldgsts,
        m.bar,
        m.branches,
        n,
        m.per_hmma(),
        m.hmma_per_ldsm()
    )
}

/// Every build the gate compiles: each file in the default configuration with its budgets,
/// then flash2.cu in each other configuration of `gpu::shapes` (the autotuner's candidates),
/// whose kernels must compile without a spill, a stack frame or local memory, within 255
/// registers, with their tensor-core loop found (reported, no loop budget), and flash_hopper.cu
/// in each of its other configurations with the default build's budgets (HGMMA in the loop,
/// none of HMMA, registers within the setmaxnreg plan).
fn builds() -> Vec<(&'static KernelFile, usize, Vec<Budget>)> {
    let mut out: Vec<_> = FILES.iter().map(|f| (f, 0, f.kernels.to_vec())).collect();
    let flash2 = FILES.iter().find(|f| f.name == "flash2.cu").expect("flash2.cu");
    for c in 1..shapes::FA2_CONFIGS.len() {
        let kernels = flowprefill_kernels::gpu::config_budgets(c);
        out.push((flash2, c, kernels));
    }
    let hopper = FILES.iter().find(|f| f.name == "flash_hopper.cu").expect("flash_hopper.cu");
    for c in 1..shapes::HOPPER_CONFIGS.len() {
        out.push((hopper, c, flowprefill_kernels::gpu::hopper_config_budgets(c)));
    }
    out
}

#[test]
fn every_kernel_compiles_for_sm80_and_sm90a_within_its_budget() {
    if !nvrtc_or_skip("compile gate") {
        return;
    }
    let tool = nvdisasm_or_skip("static SASS gate");
    let (major, minor) = nvrtc::version().expect("NVRTC version");
    println!("NVRTC {major}.{minor}");
    let mut sass_table = vec![sass_header()];
    println!(
        "{:<7} {:<26} {:>4} {:>5} {:>6} {:>6} {:>6} {:>6} {:>7}   budget",
        "arch", "kernel", "regs", "smem", "dyn", "spillS", "spillL", "stack", "blk/SM/assumed"
    );
    let mut failures = Vec::new();
    let (mut probe_remarks, mut remarks_table) = (0, Vec::new());
    for arch in ARCHS {
        for (file, config, kernels) in builds() {
            if !file.builds_for(arch) {
                continue;
            }
            let c = nvrtc::compile(file.name, &flowprefill_kernels::gpu::program_in(file, config), arch)
                .unwrap_or_else(|e| panic!("{e}"));
            assert!(!c.cubin.is_empty(), "{} for {arch}: empty CUBIN", file.name);
            // A warning of the compiler's front end is a defect like any other (one once hid
            // a comparison that was always false).
            let warnings: Vec<_> = c.log.lines().filter(|l| l.contains(": warning #")).collect();
            if !warnings.is_empty() {
                failures.push(format!("{} for {arch} (configuration {config}): {}", file.name, warnings.join("\n  ")));
            }
            let report =
                nvrtc::parse_report(&c.log).unwrap_or_else(|e| panic!("{} for {arch}: {e}\n{}", file.name, c.log));
            let functions = tool.as_ref().map(|t| {
                let text = sass::disassemble(t, &c.cubin).unwrap_or_else(|e| panic!("{} for {arch}: {e}", file.name));
                if let Some(dir) = std::env::var_os("FLOWPREFILL_SASS_DIR") {
                    let path = PathBuf::from(dir).join(format!("{}-c{config}-{arch}.sass", file.name));
                    std::fs::write(&path, &text).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
                }
                sass::parse(&text).unwrap_or_else(|e| panic!("{} for {arch}: {e}", file.name))
            });
            for b in &kernels {
                if let Some(functions) = &functions {
                    match Row::of(functions, b.kernel, b.sass) {
                        Ok(row) => {
                            sass_table.push(sass_line(arch, &row, b.sass));
                            failures.extend(row.check(b.sass).into_iter().map(|f| format!("{arch} {f}")));
                        }
                        Err(e) => failures.push(format!("{arch} {}: {e}", b.kernel)),
                    }
                }
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
                // The launch shape's assumption (`__launch_bounds__`' minimum): marked `!` where
                // this architecture does not allow it (the backend logs it at load, from the
                // occupancy API).
                let fits = by_regs.min(by_smem);
                let mark = if fits < b.blocks_per_sm { "!" } else { "" };
                println!(
                    "{arch:<7} {:<26} {:>4} {:>5} {:>6} {:>6} {:>6} {:>6} {:>5}/{}{mark:<1}   <= {} regs, <= {} B smem",
                    r.kernel,
                    r.registers,
                    r.shared_bytes,
                    b.dynamic_shared_bytes,
                    r.spill_stores,
                    r.spill_loads,
                    r.stack_bytes,
                    fits,
                    b.blocks_per_sm,
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
                // ptxas's own word on the warpgroup products: an attention kernel's must stay
                // asynchronous (no serialization, no wait or arrive ptxas had to add); the
                // self-check's deliberate break (accumulators read before the wait) must show
                // one, or the remarks are no longer read and the first rule could pass anything.
                match b.sass {
                    SassBudget::Wgmma { in_loop: true, .. } if !r.wgmma_remarks.is_empty() => {
                        failures.push(format!(
                            "{arch} {}: ptxas serialized or fenced its warpgroup products:\n  {}",
                            r.kernel,
                            r.wgmma_remarks.join("\n  ")
                        ));
                    }
                    SassBudget::Wgmma { in_loop: false, .. } => probe_remarks += r.wgmma_remarks.len(),
                    _ => {}
                }
                if matches!(b.sass, SassBudget::Wgmma { .. }) {
                    remarks_table.push(format!("{arch:<7} {:<26} {}", r.kernel, r.wgmma_remarks.len()));
                }
            }
        }
    }
    if probe_remarks == 0 {
        failures.push(
            "no ptxas remark on the warpgroup products of hopper_probe.cu, whose deliberate break reads the \
             accumulators before the wait (ptxas 12.9 says C7514, serialized): has ptxas's wording changed? \
             (nvrtc::wgmma_remarks)"
                .to_string(),
        );
    }
    println!("\nptxas remarks on warpgroup products (serialized products, an arrive or wait ptxas added), per kernel:");
    println!("{}", remarks_table.join("\n"));
    if tool.is_some() {
        println!("\nstatic SASS gate (nvdisasm): instructions and local-memory instructions (L/S) per kernel; for");
        println!("tensor-core kernels the steady-state loop's static body (loop: its instructions), its mix,");
        println!("how many innermost tensor-core loops the kernel has, instructions per HMMA and HMMA per LDSM");
        println!("{}", sass_table.join("\n"));
    }
    assert!(failures.is_empty(), "compile gate:\n{}", failures.join("\n"));
}

/// The static gate fails when a budget is broken: a kernel with a stack array indexed at run
/// time (local memory), and the reference attention (flash.cu, 16 rows a warp, a per-element
/// mask) held to the fast kernel's loop budget.
#[test]
fn the_static_gate_fails_a_kernel_that_breaks_its_budget() {
    if !nvrtc_or_skip("static gate breaks") {
        return;
    }
    let Some(tool) = nvdisasm_or_skip("static gate breaks") else { return };
    let local = "extern \"C\" __global__ void k_local(float* x, unsigned i) {
        float a[64];
        for (int j = 0; j < 64; j++) a[(j * i) & 63] = x[j];
        x[0] = a[i & 63];
    }";
    let c = nvrtc::compile("local.cu", local, "sm_90a").expect("compiles");
    let f = sass::parse(&sass::disassemble(&tool, &c.cubin).expect("nvdisasm")).expect("parses");
    let row = Row::of(&f, "k_local", SassBudget::Plain).expect("a row");
    let broken = row.check(SassBudget::Plain);
    println!("a stack array: {broken:?}");
    assert!(broken.len() == 1 && broken[0].contains("local-memory instructions"), "{broken:?}");

    let file = FILES.iter().find(|f| f.name == "flash.cu").expect("flash.cu");
    let c = nvrtc::compile(file.name, &flowprefill_kernels::gpu::program(file), "sm_90a").expect("compiles");
    let f = sass::parse(&sass::disassemble(&tool, &c.cubin).expect("nvdisasm")).expect("parses");
    let row = Row::of(&f, "fp_flash_attn_d128", SassBudget::Reported).expect("the reference has its loop");
    assert!(row.check(SassBudget::Reported).is_empty(), "reported only");
    let broken = row.check(flowprefill_kernels::gpu::FA2_D128_SASS);
    println!("the reference attention held to the fast kernel's budget: {broken:?}");
    assert!(broken.iter().any(|b| b.contains("instructions per HMMA")), "{broken:?}");
    assert!(broken.iter().any(|b| b.contains("HMMA per LDSM")), "{broken:?}");
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
