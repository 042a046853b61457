//! What the README says that the sources can check: every `FLOWPREFILL_*` variable the code
//! reads is in its environment table, and the test command's prerequisites are checked with
//! what to install (`scripts/preflight.sh`).

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace root").to_path_buf()
}

/// Every `"FLOWPREFILL_NAME"` string in the Rust sources under `dir`.
fn variables_in(dir: &Path, found: &mut std::collections::BTreeSet<String>) {
    for entry in std::fs::read_dir(dir).expect("read a source folder").flatten() {
        let path = entry.path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n != "target") {
                variables_in(&path, found);
            }
        } else if path.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&path).expect("read a source file");
            for piece in text.split("\"FLOWPREFILL_").skip(1) {
                let name: String = piece.chars().take_while(|c| c.is_ascii_uppercase() || *c == '_').collect();
                if piece[name.len()..].starts_with('"') && !name.is_empty() {
                    found.insert(format!("FLOWPREFILL_{name}"));
                }
            }
        }
    }
}

#[test]
fn every_variable_the_code_reads_is_in_the_readme_table() {
    let root = repo();
    let mut vars = std::collections::BTreeSet::new();
    for krate in ["kernels", "kernels-emu", "comm", "worker", "coordinator", "lab", "launch"] {
        variables_in(&root.join(krate).join("src"), &mut vars);
    }
    assert!(vars.contains("FLOWPREFILL_MODEL") && vars.contains("FLOWPREFILL_FAULT"), "{vars:?}");
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    let table = readme.split("## Environment variables").nth(1).expect("an environment table");
    let missing: Vec<&String> = vars.iter().filter(|v| !table.contains(&format!("| `{v}` |"))).collect();
    assert!(missing.is_empty(), "in the code, not in the README's environment table: {missing:?}");
}

#[test]
fn the_test_command_names_what_it_lacks() {
    let run = |env: &[(&str, &str)]| {
        let mut cmd = Command::new("bash");
        cmd.arg(repo().join("scripts/preflight.sh"));
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.output().expect("run preflight.sh")
    };
    let out = run(&[
        ("CXX", "/nonexistent/c++"),
        ("FLOWPREFILL_PYTHON", "/nonexistent/python3"),
        ("FLOWPREFILL_FONT", "/nonexistent.ttf"),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    for what in ["a C++20 compiler", "g++", "pip (/nonexistent/python3 -m pip)", "python3-pip", "/nonexistent.ttf"] {
        assert!(err.contains(what), "{what}: {err}");
    }
    // A pip older than 22.1 (`--root-user-action`) is named with its version.
    let dir = std::env::temp_dir().join(format!("fp-preflight-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("mkdir");
    let old_pip = dir.join("python3");
    std::fs::write(&old_pip, "#!/bin/sh\necho 'pip 21.0 from /somewhere (python 3.9)'\n").expect("write");
    std::fs::set_permissions(&old_pip, <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o755))
        .expect("chmod");
    let out = run(&[("FLOWPREFILL_PYTHON", old_pip.to_str().unwrap())]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("pip 22.1 or later (found 21.0)"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}
