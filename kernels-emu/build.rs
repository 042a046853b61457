//! Compiles the CUDA kernel sources of `kernels/cuda/` as C++ with the CPU launch shim.

fn main() {
    let cuda = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../kernels/cuda");
    for f in
        ["cpu_shim.h", "common.cuh", "elementwise.cu", "norm.cu", "rope.cu", "attention.cu", "scores.cu", "merge.cu"]
    {
        println!("cargo:rerun-if-changed={}", cuda.join(f).display());
    }
    println!("cargo:rerun-if-changed=src/emu.cpp");
    cc::Build::new()
        .cpp(true)
        .file("src/emu.cpp")
        .include(&cuda)
        .flag_if_supported("-std=c++20")
        .flag_if_supported("-pthread")
        // The kernels are written for NVRTC: unused parameters and C-style casts are fine there.
        .flag_if_supported("-Wno-unused-parameter")
        .opt_level(2)
        .compile("flowprefill_kernels_emu");
    println!("cargo:rustc-link-lib=pthread");
}
