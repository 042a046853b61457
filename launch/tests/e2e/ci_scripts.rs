//! The install checks of `.ci/run` and `scripts/test.sh`, run against fake library folders.
//!
//! Issue 28: `.ci/run` took `libclang-cpp.so.14` (Clang's C++ library) for a libclang, skipped
//! installing `libclang-dev`, and bindgen then found nothing on a fresh machine.
//! `scripts/find-libclang.sh` searches the way bindgen's clang-sys does; these tests build fake
//! trees with `FLOWPREFILL_SYSROOT` and check what it reports, with the host's own `llvm-config`,
//! `LIBCLANG_PATH`, `LD_LIBRARY_PATH` and `LIBRARY_PATH` kept out.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace root").to_path_buf()
}

/// A fresh fake root holding empty files at `files` (paths relative to the root).
fn fake_root(tag: &str, files: &[&str]) -> PathBuf {
    let root = std::env::temp_dir().join(format!("fp-libclang-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    for f in files {
        let path = root.join(f);
        std::fs::create_dir_all(path.parent().expect("a parent folder")).expect("create the fake folder");
        std::fs::write(&path, b"").expect("write the fake library");
    }
    std::fs::create_dir_all(&root).expect("create the fake root");
    root
}

/// Runs find-libclang.sh in `root` (plus `env`); (exit code, stdout lines).
fn find(root: &Path, args: &[&str], env: &[(&str, String)]) -> (i32, Vec<String>) {
    let mut cmd = Command::new("bash");
    cmd.arg(repo().join("scripts/find-libclang.sh"))
        .args(args)
        .env("FLOWPREFILL_SYSROOT", root)
        .env("LLVM_CONFIG_PATH", root.join("no-llvm-config"))
        .env_remove("LIBCLANG_PATH")
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("LIBRARY_PATH");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run bash scripts/find-libclang.sh");
    let stdout = String::from_utf8_lossy(&out.stdout).lines().map(str::to_string).collect();
    (out.status.code().unwrap_or(-1), stdout)
}

#[test]
fn libclang_cpp_alone_is_not_a_libclang() {
    // The machine of issue 28: `libclang-cpp14` installed for another reason, nothing else.
    let root = fake_root(
        "cpp-only",
        &["usr/lib/llvm-14/lib/libclang-cpp.so.14", "usr/lib/x86_64-linux-gnu/libclang-cpp.so.14"],
    );
    let (code, out) = find(&root, &["--all"], &[]);
    assert_eq!(code, 1, "libclang-cpp was taken for a libclang: {out:?}");
    assert!(out.is_empty(), "{out:?}");
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn the_libclang_of_debian_packages_is_found() {
    // libclang1-14 (what libclang-dev pulls in): versioned names only, beside libclang-cpp.
    let root = fake_root(
        "debian",
        &[
            "usr/lib/llvm-14/lib/libclang-cpp.so.14",
            "usr/lib/llvm-14/lib/libclang-14.so.1",
            "usr/lib/x86_64-linux-gnu/libclang-14.so.14.0.6",
        ],
    );
    let (code, out) = find(&root, &["--all"], &[]);
    assert_eq!(code, 0, "{out:?}");
    let names: Vec<&str> = out.iter().filter_map(|p| p.rsplit('/').next()).collect();
    assert!(names.contains(&"libclang-14.so.1") && names.contains(&"libclang-14.so.14.0.6"), "{names:?}");
    assert!(!names.iter().any(|n| n.contains("cpp")), "{names:?}");
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn plain_and_suffix_versioned_names_are_found() {
    for (tag, file) in [("plain", "usr/local/lib/libclang.so"), ("suffix", "usr/lib64/libclang.so.18.1")] {
        let root = fake_root(tag, &[file]);
        let (code, out) = find(&root, &[], &[]);
        assert_eq!(code, 0, "{file}: {out:?}");
        assert_eq!(out, vec![root.join(file).to_string_lossy().into_owned()]);
        let _ = std::fs::remove_dir_all(&root);
    }
}

#[test]
fn libclang_path_is_the_only_place_searched_when_set() {
    // clang-sys looks only at LIBCLANG_PATH when it is set: a libclang elsewhere does not count.
    let root = fake_root("envpath", &["usr/lib/llvm-14/lib/libclang-14.so.1", "opt/clang/lib/libclang.so.1"]);
    let empty = root.join("empty");
    std::fs::create_dir_all(&empty).expect("create the empty folder");
    let (code, out) = find(&root, &[], &[("LIBCLANG_PATH", empty.to_string_lossy().into_owned())]);
    assert_eq!(code, 1, "{out:?}");
    let dir = root.join("opt/clang/lib");
    let (code, out) = find(&root, &[], &[("LIBCLANG_PATH", dir.to_string_lossy().into_owned())]);
    assert_eq!((code, out), (0, vec![dir.join("libclang.so.1").to_string_lossy().into_owned()]));
    // A file path names that file.
    let file = dir.join("libclang.so.1");
    let (code, out) = find(&root, &[], &[("LIBCLANG_PATH", file.to_string_lossy().into_owned())]);
    assert_eq!((code, out), (0, vec![file.to_string_lossy().into_owned()]));
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn ld_library_path_is_searched_first() {
    let root = fake_root("ldpath", &["usr/lib/llvm-14/lib/libclang-14.so.1", "custom/libclang.so"]);
    let custom = root.join("custom");
    let (code, out) = find(&root, &[], &[("LD_LIBRARY_PATH", custom.to_string_lossy().into_owned())]);
    assert_eq!((code, out), (0, vec![custom.join("libclang.so").to_string_lossy().into_owned()]));
    let _ = std::fs::remove_dir_all(&root);
}
