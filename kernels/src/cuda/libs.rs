//! Finding the CUDA libraries of CUDA 12 or 13 where they are installed, and saying which
//! files were loaded.
//!
//! cudarc (dynamic loading, bindings for CUDA 12.9) opens each library by a fixed list of
//! names: `libcublas.so`, `libcublas.so.12`, ... and never `libcublas.so.13` or
//! `libnccl.so.2`. A machine with only CUDA 13, a toolkit outside the loader's path
//! (`/usr/local/cuda-13.0/lib64`) or the libraries of pip wheels in a `site-packages` folder would
//! find none of them. [`plan`] looks for every library in `LD_LIBRARY_PATH` and the usual places,
//! under its versioned names too; for one the loader cannot open by cudarc's names it links
//! the name cudarc asks for (`libcublas.so`) to the file found, in a folder of the user's cache.
//! The dynamic loader reads `LD_LIBRARY_PATH` once, when a process starts, so [`reexec`] starts
//! the program again, once, with that folder and the library's own folder in front.
//!
//! Everything here is plain file-system work, so it is tested without CUDA against fake
//! library folders (`launch/tests/cuda_libs.rs`).

use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};

/// Set in the environment of a process started again by [`reexec`]: what was linked, as
/// `NAME=PATH` pairs separated by `;`. Its presence stops a second restart.
pub const READY_ENV: &str = "FLOWPREFILL_CUDA_LIBS";
/// When set (folders separated by `:`), the only folders searched beside `LD_LIBRARY_PATH`,
/// instead of the usual places.
pub const DIRS_ENV: &str = "FLOWPREFILL_CUDA_LIB_DIRS";

pub use crate::flowprefill_home;

/// One library of the CUDA stack.
#[derive(Debug)]
pub struct Lib {
    /// What users call it (`cuBLAS`).
    pub name: &'static str,
    /// File name up to `.so` (`libcublas`).
    pub stem: &'static str,
    /// Major versions (soname suffixes) accepted, preferred first.
    pub majors: &'static [u32],
    /// How to get it.
    pub hint: &'static str,
}

/// The libraries flowprefill loads (the driver, `libcuda.so.1`, comes with the NVIDIA driver
/// and is always on the loader's path).
pub const LIBS: &[Lib] = &[
    Lib {
        name: "NVRTC",
        stem: "libnvrtc",
        majors: &[12, 13],
        hint: "a CUDA 12 or 13 toolkit, or the PyPI wheel nvidia-cuda-nvrtc-cu12 (scripts/cuda-wheels.sh)",
    },
    Lib {
        name: "cuBLAS",
        stem: "libcublas",
        majors: &[12, 13],
        hint: "a CUDA 12 or 13 toolkit, or the PyPI wheel nvidia-cublas-cu12 (scripts/cuda-wheels.sh --runtime)",
    },
    Lib {
        name: "cuBLASLt",
        stem: "libcublasLt",
        majors: &[12, 13],
        hint: "a CUDA 12 or 13 toolkit, or the PyPI wheel nvidia-cublas-cu12 (scripts/cuda-wheels.sh --runtime)",
    },
    Lib {
        name: "NCCL",
        stem: "libnccl",
        majors: &[2],
        hint: "the PyPI wheel nvidia-nccl-cu12 (scripts/cuda-wheels.sh --nccl) or Debian's libnccl2",
    },
];

/// The library called `name` (`"cuBLAS"`).
pub fn lib(name: &str) -> Option<&'static Lib> {
    LIBS.iter().find(|l| l.name == name)
}

/// Where to look, in order.
#[derive(Clone, Debug)]
pub struct Search {
    /// Folders, first match wins.
    pub dirs: Vec<PathBuf>,
}

fn split_paths(v: Option<OsString>) -> Vec<PathBuf> {
    v.map(|v| std::env::split_paths(&v).filter(|p| !p.as_os_str().is_empty()).collect()).unwrap_or_default()
}

/// Sub-folders of `parent` whose names start with `prefix`, newest version first (by name).
fn versioned_children(parent: &Path, prefix: &str) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(parent) else { return Vec::new() };
    let mut v: Vec<(Vec<u64>, PathBuf)> = rd
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let rest = name.strip_prefix(prefix)?.to_owned();
            let key = rest.split(|c: char| !c.is_ascii_digit()).filter_map(|s| s.parse().ok()).collect();
            Some((key, e.path()))
        })
        .collect();
    v.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
    v.into_iter().map(|(_, p)| p).collect()
}

/// `root/nvidia/*/lib`: where NVIDIA's pip wheels put their libraries (`nvidia/cublas/lib`,
/// `nvidia/cu13/lib`, ...).
fn wheel_dirs(site_packages: &Path) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(site_packages.join("nvidia")) else { return Vec::new() };
    let mut v: Vec<PathBuf> = rd.filter_map(|e| e.ok()).map(|e| e.path().join("lib")).filter(|p| p.is_dir()).collect();
    v.sort();
    v
}

/// `lib/python3.*/{site,dist}-packages` under `prefix`.
fn site_packages(prefix: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for py in versioned_children(&prefix.join("lib"), "python3") {
        for sub in ["site-packages", "dist-packages"] {
            let p = py.join(sub);
            if p.is_dir() {
                out.push(p);
            }
        }
    }
    out
}

impl Search {
    /// `LD_LIBRARY_PATH`, then [`DIRS_ENV`] if set, else the usual places: `$CUDA_HOME`,
    /// `$CUDA_PATH`, `/usr/local/cuda*` (newest first), flowprefill's wheel cache, the nvidia
    /// wheels of Python's `site-packages` (system, user, virtualenv, conda, pyenv), and the
    /// system library folders.
    pub fn from_env() -> Self {
        let mut dirs = split_paths(std::env::var_os("LD_LIBRARY_PATH"));
        if let Some(v) = std::env::var_os(DIRS_ENV) {
            dirs.extend(split_paths(Some(v)));
            return Search { dirs }.dedup();
        }
        for var in ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"] {
            if let Some(root) = std::env::var_os(var) {
                let root = PathBuf::from(root);
                dirs.push(root.join("lib64"));
                dirs.push(root.join("lib"));
            }
        }
        let local = Path::new("/usr/local");
        let mut cudas = vec![local.join("cuda")];
        cudas.extend(versioned_children(local, "cuda-"));
        for c in cudas {
            dirs.push(c.join("lib64"));
            dirs.push(c.join("targets/x86_64-linux/lib"));
            dirs.push(c.join("targets/sbsa-linux/lib"));
        }
        let home = std::env::var_os("HOME").map(PathBuf::from);
        for w in versioned_children(&flowprefill_home().join("cuda-wheels"), "") {
            dirs.extend(wheel_dirs(&w));
        }
        let mut prefixes: Vec<PathBuf> =
            ["VIRTUAL_ENV", "CONDA_PREFIX"].iter().filter_map(|v| std::env::var_os(v).map(PathBuf::from)).collect();
        for p in &prefixes {
            dirs.push(p.join("lib"));
        }
        prefixes.extend([PathBuf::from("/usr/local"), PathBuf::from("/usr"), PathBuf::from("/opt/conda")]);
        if let Some(h) = &home {
            prefixes.push(h.join(".local"));
            prefixes.extend(versioned_children(&h.join(".pyenv/versions"), ""));
        }
        for p in prefixes {
            for sp in site_packages(&p) {
                dirs.extend(wheel_dirs(&sp));
            }
        }
        dirs.extend(
            ["/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/lib64", "/lib"]
                .map(PathBuf::from),
        );
        Search { dirs }.dedup()
    }

    fn dedup(mut self) -> Self {
        let mut seen = std::collections::HashSet::new();
        self.dirs.retain(|d| seen.insert(d.clone()));
        self
    }

    /// The file of `lib` in the first folder that has one: `stem.so.MAJOR` (preferred majors
    /// first), then `stem.so`, then `stem.so.MAJOR.x[.y]`.
    pub fn find(&self, lib: &Lib) -> Option<PathBuf> {
        self.dirs.iter().find_map(|d| find_in(d, lib))
    }

    /// The folders, for messages.
    pub fn describe(&self) -> String {
        let shown: Vec<String> = self.dirs.iter().filter(|d| d.is_dir()).map(|d| d.display().to_string()).collect();
        if shown.is_empty() {
            "no folder that exists".into()
        } else {
            shown.join(", ")
        }
    }
}

fn find_in(dir: &Path, lib: &Lib) -> Option<PathBuf> {
    for m in lib.majors {
        let p = dir.join(format!("{}.so.{m}", lib.stem));
        if p.exists() {
            return Some(p);
        }
    }
    let p = dir.join(format!("{}.so", lib.stem));
    if p.exists() {
        return Some(p);
    }
    let rd = std::fs::read_dir(dir).ok()?;
    let mut full: Vec<PathBuf> = rd
        .filter_map(|e| e.ok())
        .filter(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            lib.majors.iter().any(|m| n.starts_with(&format!("{}.so.{m}.", lib.stem)))
        })
        .map(|e| e.path())
        .filter(|p| p.exists())
        .collect();
    full.sort();
    full.pop()
}

/// The major version in a library file's name (`libcublas.so.13` -> 13), following symbolic
/// links from an unversioned name.
pub fn major_of(path: &Path) -> Option<u32> {
    let mut p = path.to_path_buf();
    for _ in 0..8 {
        let name = p.file_name()?.to_string_lossy().into_owned();
        if let Some((_, v)) = name.split_once(".so.") {
            return v.split('.').next()?.parse().ok();
        }
        let t = std::fs::read_link(&p).ok()?;
        p = if t.is_absolute() { t } else { p.parent()?.join(t) };
    }
    None
}

/// What became of one library.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum State {
    /// The loader opens it by one of cudarc's names as things are.
    Loadable,
    /// Found at `found`; `link` (cudarc's name for it) points there.
    Linked {
        /// The library file found.
        found: PathBuf,
        /// The link made to it.
        link: PathBuf,
    },
    /// Not found anywhere.
    Missing,
}

/// The outcome of [`plan`].
#[derive(Clone, Debug)]
pub struct Plan {
    /// Every library of [`LIBS`] with its state, in that order.
    pub libs: Vec<(&'static Lib, State)>,
    /// Folders the loader must search first (the link folder, then the libraries' own
    /// folders, for their dependencies); empty when nothing was linked.
    pub loader_path: Vec<PathBuf>,
}

/// Looks for each library that `loadable` says the loader cannot open as things are, and
/// links cudarc's name for it (`stem.so`) to the file found, in a folder under `link_root`
/// named after the files found (so that processes using different installs do not meet).
/// Safe to run in several processes at once (each link is made under a temporary name and
/// renamed into place).
pub fn plan(search: &Search, link_root: &Path, loadable: impl Fn(&Lib) -> bool) -> io::Result<Plan> {
    use std::hash::{Hash, Hasher};
    let found: Vec<(&'static Lib, bool, Option<PathBuf>)> = LIBS
        .iter()
        .map(|lib| {
            let ok = loadable(lib);
            (lib, ok, if ok { None } else { search.find(lib) })
        })
        .collect();
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for (lib, _, f) in &found {
        (lib.stem, f).hash(&mut h);
    }
    let link_dir = link_root.join(format!("{:016x}", h.finish()));
    let mut libs = Vec::new();
    let mut loader_path = Vec::new();
    for (lib, ok, f) in found {
        let state = match f {
            None if ok => State::Loadable,
            None => State::Missing,
            Some(found) => {
                std::fs::create_dir_all(&link_dir)?;
                let link = link_dir.join(format!("{}.so", lib.stem));
                let tmp = link_dir.join(format!(".{}.so.{}", lib.stem, std::process::id()));
                let _ = std::fs::remove_file(&tmp);
                let target = std::fs::canonicalize(&found).unwrap_or_else(|_| found.clone());
                std::os::unix::fs::symlink(&target, &tmp)?;
                std::fs::rename(&tmp, &link)?;
                if loader_path.is_empty() {
                    loader_path.push(link_dir.clone());
                }
                if let Some(parent) = found.parent() {
                    if !loader_path.iter().any(|p| p == parent) {
                        loader_path.push(parent.to_path_buf());
                    }
                }
                State::Linked { found, link }
            }
        };
        libs.push((lib, state));
    }
    Ok(Plan { libs, loader_path })
}

/// The value of [`READY_ENV`] for a plan: `NAME=PATH;...` of what was linked (`-` if nothing).
pub fn encode(plan: &Plan) -> String {
    let v: Vec<String> = plan
        .libs
        .iter()
        .filter_map(|(l, s)| match s {
            State::Linked { found, .. } => Some(format!("{}={}", l.name, found.display())),
            _ => None,
        })
        .collect();
    if v.is_empty() {
        "-".into()
    } else {
        v.join(";")
    }
}

/// The files a restarted process was told were linked for it (from [`READY_ENV`]).
pub fn linked_from_env() -> Vec<(String, PathBuf)> {
    let Some(v) = std::env::var_os(READY_ENV) else { return Vec::new() };
    v.to_string_lossy()
        .split(';')
        .filter_map(|kv| kv.split_once('=').map(|(k, p)| (k.to_string(), PathBuf::from(p))))
        .collect()
}

/// Starts the running program again with the plan's folders in front of `LD_LIBRARY_PATH`
/// (same arguments, same process id); returns only if that failed. Does nothing when the
/// plan linked nothing or the process already is a restart.
pub fn reexec(plan: &Plan) -> io::Result<()> {
    use std::os::unix::process::CommandExt;
    if plan.loader_path.is_empty() || std::env::var_os(READY_ENV).is_some() {
        return Ok(());
    }
    let mut path = plan.loader_path.clone();
    path.extend(split_paths(std::env::var_os("LD_LIBRARY_PATH")));
    let joined = std::env::join_paths(path).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let exe = std::env::current_exe()?;
    let err = std::process::Command::new(exe)
        .args(std::env::args_os().skip(1))
        .env("LD_LIBRARY_PATH", joined)
        .env(READY_ENV, encode(plan))
        .exec();
    Err(err)
}

/// The file of a library this process has loaded (from `/proc/self/maps`; symbolic links
/// resolved), e.g. for `libcublas`: `/usr/local/cuda-13.0/lib64/libcublas.so.13.0.0.19`.
pub fn loaded_path(stem: &str) -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let prefix = format!("{stem}.so");
    maps.lines().find_map(|l| {
        let path = l.split_whitespace().nth(5)?;
        let name = Path::new(path).file_name()?.to_string_lossy().into_owned();
        (name == prefix || name.starts_with(&format!("{prefix}."))).then(|| PathBuf::from(path))
    })
}

/// The message for a library that is needed and was found nowhere.
pub fn missing(lib: &Lib, search: &Search) -> String {
    let names: Vec<String> = std::iter::once(format!("{}.so", lib.stem))
        .chain(lib.majors.iter().map(|m| format!("{}.so.{m}", lib.stem)))
        .collect();
    format!(
        "{} was not found: looked for {} in {}; install {}, or put the folder that has it on LD_LIBRARY_PATH",
        lib.name,
        names.join(", "),
        search.describe(),
        lib.hint
    )
}

/// [`missing`] for the library called `name`, searched as [`Search::from_env`] does.
pub fn missing_named(name: &str) -> String {
    match lib(name) {
        Some(l) => missing(l, &Search::from_env()),
        None => format!("{name} was not found"),
    }
}

/// True when the loader opens `lib` by one of the names cudarc asks for, as things are (this
/// loads it into the process).
pub fn loadable(lib: &Lib) -> bool {
    // SAFETY: each call only tries to dlopen the library by cudarc's names; no symbol is called.
    unsafe {
        match lib.stem {
            "libnvrtc" => cudarc::nvrtc::sys::is_culib_present(),
            "libcublas" => cudarc::cublas::sys::is_culib_present(),
            "libcublasLt" => cudarc::cublaslt::sys::is_culib_present(),
            #[cfg(feature = "nccl")]
            "libnccl" => cudarc::nccl::sys::is_culib_present(),
            // Not compiled in: nothing to look for.
            _ => true,
        }
    }
}

/// An error naming `name` and where it was looked for, unless the loader can open it.
pub fn require(name: &str) -> crate::error::Result<()> {
    match lib(name) {
        Some(l) if !loadable(l) => Err(super::fail(missing(l, &Search::from_env()))),
        _ => Ok(()),
    }
}

/// Once per program, before any CUDA library is used: finds the libraries the loader cannot
/// open by cudarc's names, links them, and starts the program again with them on its path
/// (returns only when nothing needed linking, the process already is a restart, or the restart
/// failed, which is then a warning and the libraries count as missing).
pub fn prepare_and_reexec() -> Plan {
    let search = Search::from_env();
    let plan = match plan(&search, &flowprefill_home().join("cuda-libs"), loadable) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("warning: could not link the CUDA libraries found into {}: {e}", flowprefill_home().display());
            return Plan {
                libs: LIBS.iter().map(|l| (l, if loadable(l) { State::Loadable } else { State::Missing })).collect(),
                loader_path: Vec::new(),
            };
        }
    };
    if let Err(e) = reexec(&plan) {
        eprintln!("warning: could not start again with the CUDA libraries found on LD_LIBRARY_PATH: {e}");
    }
    plan
}

/// One line per library for `flowprefill devices`: its version where known, and the file the
/// process loaded (or why none).
pub fn report(versions: &super::Versions) -> Vec<String> {
    let linked = linked_from_env();
    let search = Search::from_env();
    LIBS.iter()
        .map(|l| {
            let version = match l.name {
                "NVRTC" => versions.nvrtc.map(|(a, b)| format!("{a}.{b}")),
                "cuBLAS" | "cuBLASLt" => versions.cublas.map(|(a, b, c)| format!("{a}.{b}.{c}")),
                "NCCL" => versions.nccl.map(|(a, b, c)| format!("{a}.{b}.{c}")),
                _ => None,
            };
            let named = version.map_or_else(|| l.name.to_string(), |v| format!("{} {v}", l.name));
            let via = linked.iter().find(|(n, _)| n == l.name).map(|(_, p)| p.clone());
            match (loaded_path(l.stem), via) {
                (Some(path), Some(found)) => {
                    format!("{named}: {} (found as {}, linked as {}.so)", path.display(), found.display(), l.stem)
                }
                (Some(path), None) => format!("{named}: {}", path.display()),
                (None, _) if l.name == "NCCL" && !cfg!(feature = "nccl") => {
                    "NCCL: not compiled in (--features nccl)".to_string()
                }
                (None, _) => {
                    let m = missing(l, &search);
                    format!("{}: {}", l.name, m.strip_prefix(&format!("{} was ", l.name)).unwrap_or(&m))
                }
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh folder under the temporary folder.
    fn temp(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("flowprefill-libs-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("temp folder");
        d
    }

    fn touch(dir: &Path, name: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, b"not really a library").expect("write");
        p
    }

    fn cublas() -> &'static Lib {
        lib("cuBLAS").expect("cuBLAS is listed")
    }

    #[test]
    fn a_cuda_13_install_with_versioned_names_only_is_found_and_linked() {
        let root = temp("cuda13");
        let lib64 = root.join("cuda-13.0/lib64");
        std::fs::create_dir_all(&lib64).unwrap();
        // What a CUDA 13 toolkit without its -dev symlinks has: only versioned names.
        let real = touch(&lib64, "libcublas.so.13.0.0.19");
        std::os::unix::fs::symlink("libcublas.so.13.0.0.19", lib64.join("libcublas.so.13")).unwrap();
        touch(&lib64, "libcublasLt.so.13");
        touch(&lib64, "libnvrtc.so.13");
        let nccl_dir = root.join("site-packages/nvidia/nccl/lib");
        std::fs::create_dir_all(&nccl_dir).unwrap();
        touch(&nccl_dir, "libnccl.so.2");
        let search = Search { dirs: vec![root.join("empty"), lib64.clone(), nccl_dir.clone()] };
        assert_eq!(search.find(cublas()), Some(lib64.join("libcublas.so.13")));
        assert_eq!(major_of(&lib64.join("libcublas.so.13")), Some(13));
        // cuBLASLt is not cuBLAS: `libcublasLt.so.13` must not answer for `libcublas`.
        let lt_only = Search { dirs: vec![root.join("lt")] };
        std::fs::create_dir_all(root.join("lt")).unwrap();
        touch(&root.join("lt"), "libcublasLt.so.13");
        assert_eq!(lt_only.find(cublas()), None);

        let links = root.join("links");
        let plan = plan(&search, &links, |_| false).expect("plan");
        let link_dir = plan.loader_path[0].clone();
        assert!(link_dir.starts_with(&links), "{plan:?}");
        for (l, state) in &plan.libs {
            let State::Linked { found, link } = state else { panic!("{} not linked: {state:?}", l.name) };
            assert_eq!(link, &link_dir.join(format!("{}.so", l.stem)));
            let target = std::fs::read_link(link).unwrap();
            assert_eq!(target, std::fs::canonicalize(found).unwrap());
        }
        // The link of cuBLAS ends at the real file, through the versioned symlink.
        assert_eq!(std::fs::read_link(link_dir.join("libcublas.so")).unwrap(), std::fs::canonicalize(&real).unwrap());
        // The link folder first, then each library's own folder (for its dependencies).
        assert_eq!(plan.loader_path, vec![link_dir.clone(), lib64.clone(), nccl_dir.clone()]);
        assert_eq!(
            encode(&plan),
            format!(
                "NVRTC={0}/libnvrtc.so.13;cuBLAS={0}/libcublas.so.13;cuBLASLt={0}/libcublasLt.so.13;NCCL={1}/libnccl.so.2",
                lib64.display(),
                nccl_dir.display()
            )
        );
        // Linking again (another rank, the restarted process) replaces the links in place.
        let again = super::plan(&search, &links, |_| false).expect("plan again");
        assert_eq!(again.loader_path, plan.loader_path);
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn preferred_majors_and_search_order_decide_and_loadable_libraries_are_left_alone() {
        let root = temp("order");
        let (a, b) = (root.join("a"), root.join("b"));
        std::fs::create_dir_all(&a).unwrap();
        std::fs::create_dir_all(&b).unwrap();
        touch(&a, "libcublas.so.13");
        touch(&a, "libcublas.so.12");
        touch(&b, "libcublas.so");
        // Within a folder, the bindings' own major (12) first; across folders, the first folder.
        assert_eq!(Search { dirs: vec![a.clone(), b.clone()] }.find(cublas()), Some(a.join("libcublas.so.12")));
        assert_eq!(Search { dirs: vec![b.clone(), a.clone()] }.find(cublas()), Some(b.join("libcublas.so")));
        // Only a full version: found too.
        let c = root.join("c");
        std::fs::create_dir_all(&c).unwrap();
        touch(&c, "libcublas.so.13.1.0.3");
        touch(&c, "libcublas.so.12.9.1.4");
        assert_eq!(Search { dirs: vec![c.clone()] }.find(cublas()), Some(c.join("libcublas.so.13.1.0.3")));

        let search = Search { dirs: vec![a.clone()] };
        let plan = plan(&search, &root.join("links"), |l| l.name != "cuBLAS").expect("plan");
        assert!(plan.libs.iter().all(|(l, s)| (l.name == "cuBLAS") == matches!(s, State::Linked { .. })), "{plan:?}");
        let none = super::plan(&Search { dirs: vec![root.join("nothing")] }, &root.join("links"), |_| true).unwrap();
        assert!(none.loader_path.is_empty() && none.libs.iter().all(|(_, s)| *s == State::Loadable));
        assert_eq!(encode(&none), "-");
        let missing =
            super::plan(&Search { dirs: vec![root.join("nothing")] }, &root.join("links"), |_| false).unwrap();
        assert!(missing.libs.iter().all(|(_, s)| *s == State::Missing));
        let msg = super::missing(cublas(), &Search { dirs: vec![a.clone(), root.join("nothing")] });
        assert!(
            msg.contains("cuBLAS was not found: looked for libcublas.so, libcublas.so.12, libcublas.so.13 in ")
                && msg.contains(&a.display().to_string())
                && !msg.contains("nothing")
                && msg.contains("nvidia-cublas-cu12"),
            "{msg}"
        );
        let _ = std::fs::remove_dir_all(root);
    }
}
