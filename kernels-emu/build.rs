//! Compiles the CUDA kernel sources of `kernels/cuda/` as C++ with the CPU launch shim. The
//! list of files and of `extern "C"` kernels is read from the sources (not written down here):
//! `files.inc` includes every `.cu` file, `kernels.inc` has one `FP_EMU_KERNEL` per kernel.

use std::fmt::Write as _;
use std::path::Path;

/// The launch shapes, the same file the kernels crate compiles (it has no dependency).
#[path = "../kernels/src/gpu/shapes.rs"]
#[allow(dead_code)]
mod shapes;

/// The kernel names declared in a `.cu` source: `extern "C" __global__ void [__launch_bounds__(..)] NAME(`.
fn kernel_names(source: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = source;
    let marker = "extern \"C\" __global__ void";
    while let Some(at) = rest.find(marker) {
        let mut s = rest[at + marker.len()..].trim_start();
        if let Some(after) = s.strip_prefix("__launch_bounds__") {
            s = after.find(')').map_or("", |c| after[c + 1..].trim_start());
        }
        let name: String = s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        names.push(name);
        rest = s;
    }
    names
}

fn main() {
    let cuda = Path::new(env!("CARGO_MANIFEST_DIR")).join("../kernels/cuda");
    println!("cargo:rerun-if-changed={}", cuda.display());
    let mut files: Vec<_> = std::fs::read_dir(&cuda)
        .unwrap_or_else(|e| panic!("reading {}: {e}", cuda.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    files.sort();
    let (mut includes, mut inc) = (String::new(), String::new());
    for path in &files {
        println!("cargo:rerun-if-changed={}", path.display());
        if path.extension().and_then(|e| e.to_str()) != Some("cu") {
            continue;
        }
        let source = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        let _ = writeln!(includes, "#include \"{}\"", path.display());
        for name in kernel_names(&source) {
            let _ = writeln!(inc, "FP_EMU_KERNEL({name})");
        }
    }
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let write = |name: &str, text: &str| {
        let path = out_dir.join(name);
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        path
    };
    // flash2.cu's and flash_hopper.cu's other configurations, each in a translation unit of
    // its own (the header renames their kernels `_c<N>`); emu.cpp declares them with the
    // default kernels' types.
    let shapes_rs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../kernels/src/gpu/shapes.rs");
    println!("cargo:rerun-if-changed={}", shapes_rs.display());
    let mut units = Vec::new();
    let mut decls = String::new();
    // (file, what it includes besides common.cuh, its configurations, its kernel per
    // configuration and head dimension)
    type KernelOf = fn(usize, u32) -> Option<&'static str>;
    let configurable: [(&str, &str, usize, KernelOf); 2] = [
        ("flash2", "", shapes::FA2_CONFIGS.len(), shapes::fa2_kernel),
        (
            "flash_hopper",
            "#include \"flash_tiles.cuh\"\n#include \"hopper.cuh\"\n",
            shapes::HOPPER_CONFIGS.len(),
            shapes::hopper_kernel,
        ),
    ];
    for (file, extra, configs, kernel_of) in configurable {
        let source = cuda.join(format!("{file}.cu"));
        for c in 1..configs {
            let unit = format!(
                "#include \"cpu_shim.h\"\n{}#include \"common.cuh\"\n{extra}#include \"{}\"\n",
                shapes::header(c),
                source.display()
            );
            units.push(write(&format!("{file}_c{c}.cpp"), &unit));
            for d in [64, 128] {
                let base = kernel_of(0, d).expect("a kernel per dimension");
                let name = kernel_of(c, d).expect("a kernel per dimension");
                let _ = writeln!(decls, "extern \"C\" decltype({base}) {name};");
                let _ = writeln!(inc, "FP_EMU_KERNEL({name})");
            }
        }
    }
    write("shapes.inc", &shapes::header(0));
    write("files.inc", &includes);
    write("kernels.inc", &inc);
    write("configs.inc", &decls);
    println!("cargo:rerun-if-changed=src/emu.cpp");
    cc::Build::new()
        .cpp(true)
        .file("src/emu.cpp")
        .files(&units)
        .include(&cuda)
        .include(&out_dir)
        .flag_if_supported("-std=c++20")
        .flag_if_supported("-pthread")
        // The kernels are written for NVRTC: unused parameters and C-style casts are fine there.
        .flag_if_supported("-Wno-unused-parameter")
        .opt_level(2)
        .compile("flowprefill_kernels_emu");
    println!("cargo:rustc-link-lib=pthread");
}
