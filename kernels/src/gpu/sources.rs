//! The NVRTC program of a kernel file: the launch-shape header, the shared headers and the
//! file ([`program_in`]); as the GPU backend builds it, with replacement sources from the
//! folder [`SOURCES_ENV`] names ([`device_program`]); and the hash of every source that keys
//! the autotuner's decisions ([`sources_hash`]).

use super::{parse_kernels, shapes, KernelFile, COMMON, FILES, FLASH_TILES, HOPPER};
use crate::error::{KernelError, Result};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The full NVRTC program of `file`: the launch-shape header ([`shapes::header`], the default
/// configuration), [`COMMON`], [`FLASH_TILES`], then the file.
pub fn program(file: &KernelFile) -> String {
    program_in(file, 0)
}

/// [`program`] in build `config` ([`shapes::header`]: `flash2.cu` in [`shapes::FA2_CONFIGS`]`[config]`,
/// `flash_hopper.cu` in [`shapes::HOPPER_CONFIGS`]`[config]`; other than 0, their kernels carry
/// the configuration's suffix).
pub fn program_in(file: &KernelFile, config: usize) -> String {
    assemble(file, config, COMMON, FLASH_TILES, HOPPER, file.source)
}

fn assemble(file: &KernelFile, config: usize, common: &str, tiles: &str, hopper: &str, source: &str) -> String {
    let hopper = if file.only_arch.is_some() { hopper } else { "" };
    format!("{}{common}\n{tiles}\n{hopper}\n{source}", shapes::header(config))
}

/// The environment variable that names a folder of replacement kernel sources: any file there
/// named like one of `kernels/cuda/` (`flash_hopper.cu`, `common.cuh`, ...) replaces the built-in
/// one when the GPU backend compiles its kernels ([`device_program`]), so that two versions of a
/// kernel can be timed against each other on a GPU machine that has no Rust toolchain. The
/// self-checks and the autotuner see the replacement as they would the built-in source; its
/// compiled code and its tuning decisions are cached apart ([`sources_hash`]).
pub const SOURCES_ENV: &str = "FLOWPREFILL_CUDA_SOURCES";

/// The folder [`SOURCES_ENV`] names (`value`), or `None` when unset or empty; an error when it
/// is not a folder.
pub fn sources_dir(value: Option<std::ffi::OsString>) -> Result<Option<PathBuf>> {
    let Some(v) = value.filter(|v| !v.is_empty()) else { return Ok(None) };
    let dir = PathBuf::from(v);
    if !dir.is_dir() {
        return Err(sources_error(format!(
            "{SOURCES_ENV}={} is not a folder: name the folder that holds the replacement .cu/.cuh files, or unset it",
            dir.display()
        )));
    }
    Ok(Some(dir))
}

/// `builtin` (the file `name` of `kernels/cuda/`), or the file of that name in `dir` where it
/// has one (then `true`).
fn part(dir: Option<&Path>, name: &str, builtin: &'static str) -> Result<(String, bool)> {
    let Some(path) = dir.map(|d| d.join(name)).filter(|p| p.exists()) else {
        return Ok((builtin.to_string(), false));
    };
    let text = std::fs::read_to_string(&path)
        .map_err(|e| sources_error(format!("{SOURCES_ENV}: reading {}: {e}", path.display())))?;
    Ok((text, true))
}

/// [`program_in`] with any of its parts (`file`, `common.cuh`, `flash_tiles.cuh`, `hopper.cuh`)
/// replaced by the file of the same name in `dir` ([`SOURCES_ENV`]); and the names of the parts
/// replaced (none: the built-in program).
pub fn device_program_from(
    dir: Option<&Path>,
    file: &KernelFile,
    config: usize,
) -> Result<(String, Vec<&'static str>)> {
    let (common, c) = part(dir, "common.cuh", COMMON)?;
    let (tiles, t) = part(dir, "flash_tiles.cuh", FLASH_TILES)?;
    let (hopper, h) = part(dir, "hopper.cuh", HOPPER)?;
    let (source, f) = part(dir, file.name, file.source)?;
    if f {
        // The launches are built and checked against the built-in declarations: a replacement
        // must declare the same kernels with the same parameters.
        let mine = parse_kernels(file.source).map_err(|e| sources_error(format!("{}: {e}", file.name)))?;
        let theirs = parse_kernels(&source).map_err(|e| sources_error(format!("{SOURCES_ENV}: {}: {e}", file.name)))?;
        if mine != theirs {
            return Err(sources_error(format!(
                "{SOURCES_ENV}: {} declares other kernels or parameters than the built-in one; a \
                     replacement must keep every kernel's name and parameter list",
                file.name
            )));
        }
    }
    let replaced =
        [(c, "common.cuh"), (t, "flash_tiles.cuh"), (h && file.only_arch.is_some(), "hopper.cuh"), (f, file.name)]
            .into_iter()
            .filter_map(|(r, n)| r.then_some(n))
            .collect();
    Ok((assemble(file, config, &common, &tiles, &hopper, &source), replaced))
}

/// [`device_program_from`] the folder [`SOURCES_ENV`] names: what the GPU backend compiles.
pub fn device_program(file: &KernelFile, config: usize) -> Result<(String, Vec<&'static str>)> {
    let dir = sources_dir(std::env::var_os(SOURCES_ENV))?;
    device_program_from(dir.as_deref(), file, config)
}

/// FNV-1a of every source and of the launch shapes: part of the key of the autotuner's
/// decisions (with [`SOURCES_ENV`]'s replacements in place of the built-in files they replace;
/// one that cannot be read counts as its name, and the backend reports it when it compiles).
/// Computed once per process: the key is built on attention calls.
pub fn sources_hash() -> u64 {
    static HASH: OnceLock<u64> = OnceLock::new();
    *HASH.get_or_init(|| {
        let dir = sources_dir(std::env::var_os(SOURCES_ENV)).ok().flatten();
        let read = |name: &str, builtin: &'static str| match part(dir.as_deref(), name, builtin) {
            Ok((text, _)) => text,
            Err(_) => name.to_string(),
        };
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        let headers: Vec<String> = (0..shapes::BUILDS).map(shapes::header).collect();
        let parts: Vec<String> = [("common.cuh", COMMON), ("flash_tiles.cuh", FLASH_TILES), ("hopper.cuh", HOPPER)]
            .into_iter()
            .chain(FILES.iter().map(|f| (f.name, f.source)))
            .map(|(n, b)| read(n, b))
            .chain(headers)
            .collect();
        for part in &parts {
            for b in part.bytes() {
                h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
            }
        }
        h
    })
}

fn sources_error(detail: String) -> KernelError {
    KernelError::Backend { backend: "cuda", detail }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A folder of replacement sources: the parts it holds replace the built-in ones in the
    /// program the device compiles, the others stay; no folder, the built-in program; a folder
    /// that is not there, or a part that cannot be read, a clear error.
    #[test]
    fn replacement_sources_take_the_place_of_the_built_in_ones() {
        let hopper = FILES.iter().find(|f| f.name == "flash_hopper.cu").expect("flash_hopper.cu");
        let flash2 = FILES.iter().find(|f| f.name == "flash2.cu").expect("flash2.cu");
        let (same, none) = device_program_from(None, hopper, 3).expect("built-in");
        assert_eq!((same, none.len()), (program_in(hopper, 3), 0));

        let dir = std::env::temp_dir().join(format!("fp-sources-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        std::fs::write(dir.join("flash_hopper.cu"), format!("// the older kernel\n{}", hopper.source)).expect("write");
        std::fs::write(dir.join("hopper.cuh"), "// older helpers\n").expect("write");
        let (p, replaced) = device_program_from(Some(&dir), hopper, 3).expect("replaced");
        assert_eq!(replaced, vec!["hopper.cuh", "flash_hopper.cu"]);
        assert!(p.contains("// the older kernel") && p.contains("// older helpers") && p.contains(COMMON));
        assert!(p.starts_with(&shapes::header(3)));
        // A replacement whose kernels take other parameters is refused.
        let fewer = hopper.source.replace("bf16_t* out_b, float* lse", "float* lse");
        assert_ne!(fewer, hopper.source, "the test's edit must change a declaration");
        std::fs::write(dir.join("flash_hopper.cu"), fewer).expect("write");
        let e = device_program_from(Some(&dir), hopper, 3).expect_err("other parameters").to_string();
        assert!(e.contains("keep every kernel's name and parameter list"), "{e}");
        // flash2.cu takes no Hopper header, and has no replacement there.
        let (p2, r2) = device_program_from(Some(&dir), flash2, 0).expect("flash2");
        assert_eq!((p2, r2.len()), (program_in(flash2, 0), 0));

        std::fs::create_dir_all(dir.join("common.cuh")).expect("a folder where a file should be");
        let e = device_program_from(Some(&dir), flash2, 0).expect_err("unreadable").to_string();
        assert!(e.contains(SOURCES_ENV) && e.contains("common.cuh"), "{e}");
        std::fs::remove_dir_all(&dir).expect("clean up");

        let e = sources_dir(Some(dir.clone().into_os_string())).expect_err("no folder").to_string();
        assert!(e.contains("is not a folder") && e.contains("unset it"), "{e}");
        assert!(sources_dir(Some(std::ffi::OsString::new())).expect("empty is unset").is_none());
        assert!(sources_dir(None).expect("unset").is_none());
    }
}
