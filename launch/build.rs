//! The build's identity, `FLOWPREFILL_BUILD` for the binary (`flowprefill --version`, every
//! eval run's record): the git commit the sources were built from, and when they differ from it
//! (an uncommitted change) a hash of the sources after it; without git, the hash alone. So a
//! result says which code made it, and results of two builds are not taken for one study.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The folders the binary is built from (every crate it links; the tests are not in it).
const SOURCES: [&str; 7] =
    ["kernels/src", "kernels/cuda", "comm/src", "worker/src", "coordinator/src", "lab/src", "launch/src"];

/// The files besides them that change what is built.
const FILES: [&str; 7] = [
    "Cargo.lock",
    "kernels/Cargo.toml",
    "comm/Cargo.toml",
    "worker/Cargo.toml",
    "coordinator/Cargo.toml",
    "lab/Cargo.toml",
    "launch/Cargo.toml",
];

/// Every file under `dir`, recursively, sorted.
fn files_under(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    paths.sort();
    for p in paths {
        if p.is_dir() {
            files_under(&p, out);
        } else {
            out.push(p);
        }
    }
}

/// FNV-1a over each file's path (from the root) and bytes: stable across Rust versions.
fn source_hash(root: &Path) -> u64 {
    let mut files = Vec::new();
    for d in SOURCES {
        files_under(&root.join(d), &mut files);
    }
    files.extend(FILES.iter().map(|f| root.join(f)));
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    for f in files {
        let rel = f.strip_prefix(root).unwrap_or(&f).to_string_lossy().into_owned();
        eat(rel.as_bytes());
        eat(&[0]);
        eat(&std::fs::read(&f).unwrap_or_default());
        eat(&[0]);
    }
    h
}

/// `git` in the workspace, its output when it succeeds.
fn git(root: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git").arg("-C").arg(root).args(args).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for p in SOURCES.iter().chain(&FILES) {
        // Folders are scanned by cargo for any change below them.
        println!("cargo:rerun-if-changed={}", root.join(p).display());
    }
    // A commit changes the id without changing a source: watch HEAD and the ref it names. (A
    // path that does not exist would rerun this every build, so only those that do.)
    let git_dir = git(&root, &["rev-parse", "--absolute-git-dir"]).map(PathBuf::from);
    if let Some(dir) = &git_dir {
        let head = dir.join("HEAD");
        let named =
            std::fs::read_to_string(&head).ok().and_then(|h| h.strip_prefix("ref: ").map(|r| dir.join(r.trim())));
        for p in [Some(head), named, Some(dir.join("packed-refs"))].into_iter().flatten() {
            if p.exists() {
                println!("cargo:rerun-if-changed={}", p.display());
            }
        }
    }
    let hash = source_hash(&root);
    let commit = git_dir.and_then(|_| git(&root, &["rev-parse", "--short=12", "HEAD"]));
    let mut paths = vec!["--"];
    paths.extend(SOURCES.iter().chain(&FILES));
    let clean = commit.is_some()
        && git(&root, &[&["diff", "--quiet", "HEAD"][..], &paths].concat()).is_some()
        && git(&root, &[&["ls-files", "--others", "--exclude-standard"][..], &paths].concat())
            .is_some_and(|s| s.is_empty());
    let id = match commit {
        Some(c) if clean => c,
        Some(c) => format!("{c}+modified.{:08x}", hash >> 32),
        None => format!("src.{hash:016x}"),
    };
    println!("cargo:rustc-env=FLOWPREFILL_BUILD={id}");
}
