//! CUDA 12 and 13 library discovery through the program (issue 29): a folder that has NVRTC
//! under a versioned name only (`libnvrtc.so.13`, which cudarc never asks for) on
//! `LD_LIBRARY_PATH` is found, linked and loaded, and `flowprefill devices` says which file; a
//! library found nowhere is named with the folders searched. No GPU needed: NVRTC runs
//! without one. The fake `libnvrtc.so.13` is a link to the NVRTC 12.9 of the PyPI wheel that
//! `scripts/test.sh` installs, or, on a machine without the wheel (a CUDA 13 GPU machine), to
//! the NVRTC the program finds there (so the test cannot pass by finding a system CUDA: the
//! usual places are replaced by an empty folder through `FLOWPREFILL_CUDA_LIB_DIRS`).
#![cfg(feature = "cuda")]

use std::path::{Path, PathBuf};
use std::process::Command;

/// The folder of the NVRTC wheel on `LD_LIBRARY_PATH` (what `scripts/test.sh` sets).
fn nvrtc_wheel() -> Option<PathBuf> {
    let path = std::env::var_os("LD_LIBRARY_PATH")?;
    std::env::split_paths(&path).find(|d| d.join("libnvrtc.so.12").exists())
}

/// The NVRTC library to disguise: the wheel's, else the one `flowprefill devices` reports on
/// this machine (its line reads `NVRTC 13.0: /path/libnvrtc.so.13.0.88 ...`).
fn nvrtc_source() -> Option<PathBuf> {
    if let Some(wheel) = nvrtc_wheel() {
        return Some(wheel.join("libnvrtc.so.12"));
    }
    let out = Command::new(env!("CARGO_BIN_EXE_flowprefill")).arg("devices").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find(|l| l.trim_start().starts_with("NVRTC 1"))?;
    let path = PathBuf::from(line.split_once(": ")?.1.split_whitespace().next()?);
    path.exists().then_some(path)
}

fn temp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("flowprefill-cudalibs-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp folder");
    d
}

fn devices(ld_path: &Path, home: &Path, usual: &Path) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_flowprefill"))
        .arg("devices")
        .env("LD_LIBRARY_PATH", ld_path)
        .env("FLOWPREFILL_HOME", home)
        .env("FLOWPREFILL_CUDA_LIB_DIRS", usual)
        .env_remove("FLOWPREFILL_CUDA_LIBS")
        .output()
        .expect("run flowprefill devices");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

#[test]
fn nvrtc_under_a_cuda_13_name_only_is_found_linked_and_reported() {
    let Some(source) = nvrtc_source() else {
        assert!(
            std::env::var_os("FLOWPREFILL_REQUIRE_NVRTC").is_none(),
            "FLOWPREFILL_REQUIRE_NVRTC is set but no NVRTC was found (no libnvrtc.so.12 on LD_LIBRARY_PATH, \
             none reported by `flowprefill devices`)"
        );
        flowprefill_kernels::testing::skipped(
            "no NVRTC library",
            "no NVRTC wheel on LD_LIBRARY_PATH (scripts/test.sh installs it) and none on this machine",
        );
        return;
    };
    let root = temp("v13");
    let (fake, home, usual) = (root.join("lib"), root.join("home"), root.join("usual"));
    for d in [&fake, &home, &usual] {
        std::fs::create_dir_all(d).unwrap();
    }
    // Without the folder: NVRTC is named as missing, unless this machine's own loader finds one
    // (a CUDA toolkit in /etc/ld.so.conf, as on a GPU machine), which must then be what is
    // reported; the disguised folder cannot be told apart from it there, so that part is skipped.
    let (ok, out) = devices(&usual, &root.join("home2"), &usual);
    assert!(ok, "{out}");
    let nvrtc = out.lines().find(|l| l.trim_start().starts_with("NVRTC")).unwrap_or_else(|| panic!("{out}"));
    if nvrtc.contains("not found") {
        assert!(nvrtc.contains("NVRTC: not found: looked for libnvrtc.so, libnvrtc.so.12, libnvrtc.so.13"), "{out}");
    } else {
        assert!(!nvrtc.contains("found as") && !nvrtc.contains(&root.display().to_string()), "{out}");
        flowprefill_kernels::testing::skipped(
            "the system loader finds NVRTC",
            format!("{}: no folder can disguise it", nvrtc.trim()),
        );
        let _ = std::fs::remove_dir_all(root);
        return;
    }
    // Versioned names only, as a CUDA 13 runtime package installs them; NVRTC's builtins beside.
    std::os::unix::fs::symlink(&source, fake.join("libnvrtc.so.13")).unwrap();
    let dir = source.parent().expect("a library in a folder");
    for e in std::fs::read_dir(dir).expect("the NVRTC folder").filter_map(|e| e.ok()) {
        if e.file_name().to_string_lossy().starts_with("libnvrtc-builtins") {
            std::os::unix::fs::symlink(e.path(), fake.join(e.file_name())).unwrap();
        }
    }

    let (ok, out) = devices(&fake, &home, &usual);
    assert!(ok, "{out}");
    let nvrtc = out.lines().find(|l| l.trim_start().starts_with("NVRTC")).unwrap_or_else(|| panic!("{out}"));
    assert!(
        nvrtc.contains("NVRTC 1")
            && nvrtc.contains(&format!("found as {}", fake.join("libnvrtc.so.13").display()))
            && nvrtc.contains("linked as libnvrtc.so"),
        "{out}"
    );
    let link = std::fs::read_dir(home.join("cuda-libs"))
        .expect("link folder")
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("libnvrtc.so"))
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("no libnvrtc.so link under {}", home.display()));
    assert_eq!(std::fs::canonicalize(link).unwrap(), std::fs::canonicalize(&source).unwrap());
    // cuBLAS is nowhere: named, with what was looked for and where.
    let cublas = out.lines().find(|l| l.trim_start().starts_with("cuBLAS:")).unwrap_or_else(|| panic!("{out}"));
    assert!(
        cublas.contains("not found: looked for libcublas.so, libcublas.so.12, libcublas.so.13 in ")
            && cublas.contains(&fake.display().to_string())
            && cublas.contains("nvidia-cublas-cu12"),
        "{out}"
    );

    let _ = std::fs::remove_dir_all(root);
}
