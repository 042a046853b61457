//! The build's identity. `FP_BUILD_ID` is a hash of the sources the binary is built
//! from and of how they were built (its cargo features and the profile's optimisation, in
//! `FP_BUILD_CONFIG`): 12 hex digits. Two builds of the same sources with the same features and
//! profile have the same id, on any host and after any commit that changes no source (a docs
//! commit leaves it alone); a debug build, or one with CUDA, of the same sources has another
//! (its timings differ). Every eval run records it, and the MPI ranks compare it at start.
//! `FP_BUILD_COMMIT` says where the sources came from for people: the git commit, `, modified`
//! when they differ from it (`none` without git).
//! (Compile-time names, not `FLOWPREFILL_*`: nothing reads them at run time, and the README's
//! table of environment variables lists what a user can set.)

use std::path::{Path, PathBuf};
use std::process::Command;

/// The folders the binary is built from (every crate it links, and the files they include;
/// the tests are not in it).
const SOURCES: [&str; 8] =
    ["kernels/src", "kernels/cuda", "comm/src", "worker/src", "coordinator/src", "lab/src", "launch/src", "adapters"];

/// The files besides them that change what is built.
const FILES: [&str; 10] = [
    "Cargo.toml",
    "Cargo.lock",
    "kernels/Cargo.toml",
    "comm/Cargo.toml",
    "worker/Cargo.toml",
    "coordinator/Cargo.toml",
    "lab/Cargo.toml",
    "lab/profiles.json",
    "launch/Cargo.toml",
    "launch/build.rs",
];

/// Every file under `dir`, recursively, as paths from `root`.
fn files_under(root: &Path, dir: &Path, out: &mut Vec<String>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for p in entries.filter_map(|e| e.ok().map(|e| e.path())) {
        if p.is_dir() {
            files_under(root, &p, out);
        } else if let Ok(rel) = p.strip_prefix(root) {
            out.push(rel.to_string_lossy().replace('\\', "/"));
        }
    }
}

/// `git` in the workspace: its output when it succeeds.
fn git(root: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git").arg("-C").arg(root).args(args).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// `git ls-files` of the source folders and files with `what` (`-c` tracked, `-o` untracked),
/// one path per line; files the repository's `.gitignore` files ignore (an editor's swap file)
/// are not listed, and the user's own global ignores are not read, so that two hosts list alike.
fn listed(root: &Path, what: &str) -> Option<String> {
    let mut args = vec!["ls-files", what, "--exclude-per-directory=.gitignore", "--"];
    args.extend(SOURCES.iter().chain(&FILES));
    git(root, &args)
}

/// The source files, as paths from `root`, sorted: with git, those it tracks and those it
/// would track (`tracked`, `untracked`: [`listed`]); without git, every file under the folders.
fn sources(root: &Path, git_lists: Option<(&str, &str)>) -> Vec<String> {
    let mut files: Vec<String> = match git_lists {
        Some((tracked, untracked)) => tracked.lines().chain(untracked.lines()).map(str::to_string).collect(),
        None => {
            let mut all = Vec::new();
            for d in SOURCES {
                files_under(root, &root.join(d), &mut all);
            }
            all.extend(FILES.iter().map(|f| f.to_string()));
            all
        }
    };
    files.sort();
    files.dedup();
    files
}

/// FNV-1a over the build's configuration ([`configuration`]) and each source's path and bytes
/// (stable across Rust versions and hosts).
fn build_hash(config: &str, root: &Path, files: &[String]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    eat(config.as_bytes());
    eat(&[0]);
    for f in files {
        eat(f.as_bytes());
        eat(&[0]);
        match std::fs::read(root.join(f)) {
            Ok(bytes) => eat(&bytes),
            Err(_) => eat(b"\x01(missing)"),
        }
        eat(&[0]);
    }
    h
}

/// How this build was made beyond its sources: the profile (`release`, `debug`), its
/// optimisation level and this crate's cargo features, e.g. `release, opt-level 3, features
/// cuda,mpi`. Cargo runs the build script again when any of them changes.
fn configuration() -> String {
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| "unknown".to_string());
    // `vars_os`: a variable of the environment that is not UTF-8 is not cargo's, and must not
    // stop the build.
    let mut features: Vec<String> = std::env::vars_os()
        .filter_map(|(k, _)| k.to_str()?.strip_prefix("CARGO_FEATURE_").map(|f| f.to_lowercase().replace('_', "-")))
        .filter(|f| f != "default")
        .collect();
    features.sort();
    let features =
        if features.is_empty() { "no features".to_string() } else { format!("features {}", features.join(",")) };
    format!("{}, opt-level {}, {features}", var("PROFILE"), var("OPT_LEVEL"))
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let root = root.canonicalize().unwrap_or(root);
    for p in SOURCES.iter().chain(&FILES) {
        // Folders are scanned by cargo for any change below them.
        println!("cargo:rerun-if-changed={}", root.join(p).display());
    }
    // Git only where this workspace is the repository's top (not a folder of another one).
    let top = git(&root, &["rev-parse", "--show-toplevel"]).map(PathBuf::from);
    let with_git = top.and_then(|t| t.canonicalize().ok()).is_some_and(|t| t == root);
    if !with_git && root.join(".git").exists() {
        println!(
            "cargo:warning=git could not read {} (not installed, or it refuses the folder's owner): the build id \
             hashes every file under the source folders, ignored ones too",
            root.display()
        );
    }
    let lists = with_git.then(|| listed(&root, "-c").zip(listed(&root, "-o"))).flatten();
    let files = sources(&root, lists.as_ref().map(|(t, u)| (t.as_str(), u.as_str())));
    let config = configuration();
    let hash = build_hash(&config, &root, &files);
    let mut commit = "none".to_string();
    if with_git {
        // A commit changes the commit shown (not the id): HEAD and its log move with every
        // commit, checkout and reset (paths from git: a worktree keeps them elsewhere).
        for p in ["HEAD", "logs/HEAD"] {
            let path = git(&root, &["rev-parse", "--git-path", p]).map(|q| root.join(q));
            if let Some(path) = path.filter(|q| q.exists()) {
                println!("cargo:rerun-if-changed={}", path.display());
            }
        }
        if let Some(full) = git(&root, &["rev-parse", "HEAD"]) {
            let mut diff = vec!["diff", "--quiet", "HEAD", "--"];
            diff.extend(SOURCES.iter().chain(&FILES));
            let no_new_files = lists.as_ref().is_some_and(|(_, untracked)| untracked.is_empty());
            let clean = no_new_files && git(&root, &diff).is_some();
            commit = format!("{}{}", &full[..full.len().min(12)], if clean { "" } else { ", modified" });
        }
    }
    println!("cargo:rustc-env=FP_BUILD_ID={:012x}", hash >> 16);
    println!("cargo:rustc-env=FP_BUILD_COMMIT={commit}");
    println!("cargo:rustc-env=FP_BUILD_CONFIG={config}");
}
