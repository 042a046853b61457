//! NVRTC: CUDA C++ to machine code (CUBIN) for one architecture, with the ptxas report.
//!
//! NVRTC runs without a GPU (only `libnvrtc.so` is needed), so the compile gate runs in CI. The
//! backend compiles for its device's architecture and keeps the CUBIN on disk, keyed by the
//! sources' hash and the architecture, so a process compiles each file once per machine.

use crate::error::{KernelError, Result};
use cudarc::nvrtc::{result, sys};
use std::ffi::{c_char, CStr, CString};
use std::path::PathBuf;

fn err(detail: impl Into<String>) -> KernelError {
    KernelError::Backend { backend: "nvrtc", detail: detail.into() }
}

/// NVRTC 13 keeps the machine code it makes in NVIDIA's compute cache (`~/.nv/ComputeCache`)
/// and, for a program it has compiled before, answers from there without running ptxas, so
/// without ptxas's report (seen on an H200 with NVRTC 13.0, 2026-11-26: a second compile of
/// `elementwise.cu` returned a CUBIN and an empty log). flowprefill keeps its own CUBINs
/// ([`cached`]), so that cache only hides the report: it is turned off for this process
/// (`CUDA_CACHE_DISABLE=1`) before NVRTC is first loaded, unless the user set the variable.
fn without_compute_cache() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("CUDA_CACHE_DISABLE").is_none() {
            std::env::set_var("CUDA_CACHE_DISABLE", "1");
        }
    });
}

/// True when `libnvrtc` can be loaded.
pub fn available() -> bool {
    without_compute_cache();
    // SAFETY: only tries to dlopen the library by its usual names; no symbol is called.
    unsafe { sys::is_culib_present() }
}

/// The NVRTC version (major, minor).
pub fn version() -> Result<(i32, i32)> {
    if !available() {
        return Err(err(missing()));
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }.result().map_err(|e| err(format!("nvrtcVersion: {e:?}")))?;
    Ok((major, minor))
}

fn missing() -> String {
    super::libs::missing_named("NVRTC")
}

/// Machine code of one program for one architecture, and what ptxas said about it.
#[derive(Debug)]
pub struct Compiled {
    /// The CUBIN.
    pub cubin: Vec<u8>,
    /// NVRTC's log, with ptxas's `-v` report.
    pub log: String,
}

fn log_of(prog: sys::nvrtcProgram) -> String {
    // SAFETY: `prog` is a live program; the returned buffer is NUL-terminated by NVRTC.
    match unsafe { result::get_program_log(prog) } {
        Ok(raw) => unsafe { CStr::from_ptr(raw.as_ptr() as *const c_char) }.to_string_lossy().into_owned(),
        Err(_) => String::new(),
    }
}

/// Compiles `source` (named `name` in messages) to machine code for `arch` (`sm_80`,
/// `sm_90a`, ...) with `-O3` and the ptxas report.
pub fn compile(name: &str, source: &str, arch: &str) -> Result<Compiled> {
    if !available() {
        return Err(err(missing()));
    }
    let src = CString::new(source).map_err(|_| err(format!("{name}: the source contains a NUL byte")))?;
    let cname = CString::new(name).map_err(|_| err(format!("{name}: a NUL byte in the name")))?;
    let prog = result::create_program(&src, Some(&cname)).map_err(|e| err(format!("{name}: {e:?}")))?;
    let options = [
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        "--ptxas-options=-v".into(),
        "-default-device".into(),
    ];
    // SAFETY: `prog` was just created; the options outlive the call.
    let compiled = unsafe { result::compile_program(prog, &options) };
    let log = log_of(prog);
    let out = compiled.map_err(|e| err(format!("{name} for {arch} did not compile ({e:?}):\n{log}"))).and_then(|()| {
        let mut size = 0usize;
        // SAFETY: `prog` compiled; `size` is a valid out-pointer.
        unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }.result().map_err(|e| {
            err(format!("{name}: no CUBIN for {arch} ({e:?}); is the architecture a real one (sm_XY)?"))
        })?;
        let mut cubin = vec![0u8; size];
        // SAFETY: the buffer holds `size` bytes, as NVRTC asked.
        unsafe { sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut c_char) }
            .result()
            .map_err(|e| err(format!("{name}: reading the CUBIN: {e:?}")))?;
        Ok(Compiled { cubin, log: log.clone() })
    });
    // SAFETY: `prog` is not used after this.
    let _ = unsafe { result::destroy_program(prog) };
    out
}

/// What ptxas reported for one kernel.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelReport {
    /// The kernel.
    pub kernel: String,
    /// Registers per thread.
    pub registers: u32,
    /// Static shared memory, bytes.
    pub shared_bytes: u32,
    /// Spill stores, bytes.
    pub spill_stores: u32,
    /// Spill loads, bytes.
    pub spill_loads: u32,
    /// Stack frame, bytes.
    pub stack_bytes: u32,
    /// Stack of the kernel and the functions it calls (ptxas prints it only for kernels that
    /// make calls, e.g. the slow path of `sincosf`), bytes.
    pub call_stack_bytes: u32,
    /// ptxas's remarks about this kernel's warpgroup products ([`wgmma_remarks`]): each a
    /// line such as `(C7514) Potential Performance Loss: wgmma.mma_async instructions are
    /// serialized ...`, in the order printed.
    pub wgmma_remarks: Vec<String>,
}

/// ptxas's remarks on warpgroup products, by kernel: the `ptxas info : (Cnnnn) ...` lines that
/// name a function (`... in the function 'fp_x'`, `... in function 'fp_x'`) and speak of
/// `wgmma`, `GMMA` or a `warpgroup` instruction: that the products were serialized (C7514:
/// "non wgmma instructions reading accumulator registers of a wgmma between start and end of
/// the pipeline stage", among other causes), or that ptxas injected a `warpgroup.arrive` or
/// `wait` of its own (C7519, C7515). Each is a product that no longer overlaps what it was
/// written to overlap. The code and text from `(C` on, kernel name first.
pub fn wgmma_remarks(log: &str) -> Vec<(String, String)> {
    log.lines()
        .filter_map(|line| {
            let at = line.find("(C")?;
            let text = line[at..].trim();
            text.get(2..6).filter(|c| c.bytes().all(|b| b.is_ascii_digit()))?;
            if !(text.contains("wgmma") || text.contains("GMMA") || text.contains("warpgroup")) {
                return None;
            }
            let named = text.rsplit_once("function '")?.1;
            let kernel = named.split('\'').next()?.to_string();
            Some((kernel, text.split_whitespace().collect::<Vec<_>>().join(" ")))
        })
        .collect()
}

fn number_before(line: &str, unit: &str) -> Option<u32> {
    let at = line.find(unit)?;
    line[..at].split_whitespace().last()?.parse().ok()
}

/// A kernel's report while it is read: every field the gate checks must be found.
#[derive(Default)]
struct Partial {
    kernel: String,
    frame: Option<(u32, u32, u32)>,
    used: Option<(u32, u32, u32)>,
}

impl Partial {
    fn finish(self) -> Result<KernelReport> {
        let missing = |what: &str| {
            err(format!(
                "ptxas report for `{}`: no {what} line found (has ptxas's wording changed? \
                 the compile gate reads only what it finds, never a default)",
                self.kernel
            ))
        };
        let (stack_bytes, spill_stores, spill_loads) =
            self.frame.ok_or_else(|| missing("`N bytes stack frame, N bytes spill stores, N bytes spill loads`"))?;
        let (registers, shared_bytes, call_stack_bytes) = self.used.ok_or_else(|| missing("`Used N registers`"))?;
        Ok(KernelReport {
            kernel: self.kernel,
            registers,
            shared_bytes,
            spill_stores,
            spill_loads,
            stack_bytes,
            call_stack_bytes,
            wgmma_remarks: Vec::new(),
        })
    }
}

/// Registers, static shared memory and the call stack from the fields of a `Used ...` line:
/// every field must be one ptxas is known to print (`N registers`, `used N barriers`, `N bytes
/// smem`, `N bytes cumulative stack size`, `N bytes cmem[K]`), so that a renamed field fails
/// instead of reading as a zero.
fn used_line(kernel: &str, fields: &str) -> Result<(u32, u32, u32)> {
    let (mut registers, mut shared, mut call_stack) = (None, 0, 0);
    for f in fields.split(',').map(str::trim).filter(|f| !f.is_empty()) {
        let words: Vec<&str> = f.split_whitespace().collect();
        let n = |i: usize| words.get(i).and_then(|w| w.parse::<u32>().ok());
        match words.as_slice() {
            [_, "registers"] if n(0).is_some() => registers = n(0),
            ["used", _, "barriers" | "barrier"] if n(1).is_some() => {}
            [_, "bytes", "smem"] if n(0).is_some() => shared = n(0).unwrap_or(0),
            [_, "bytes", "cumulative", "stack", "size"] if n(0).is_some() => call_stack = n(0).unwrap_or(0),
            [_, "bytes", c] if n(0).is_some() && c.starts_with("cmem[") => {}
            _ => {
                return Err(err(format!(
                    "ptxas report for `{kernel}`: unknown field `{f}` in `Used {fields}` (has ptxas's wording \
                     changed? the compile gate reads only what it knows, never a default)"
                )))
            }
        }
    }
    let registers =
        registers.ok_or_else(|| err(format!("ptxas report for `{kernel}`: no `N registers` in `Used {fields}`")))?;
    Ok((registers, shared, call_stack))
}

/// Parses ptxas's `-v` report (per kernel: `Compiling entry function '...'`, then the stack
/// and spill line, then `Used N registers[, M bytes smem]`). Every kernel must have both lines
/// with every number in them (static shared memory alone may be absent: ptxas leaves out a zero
/// there), and there must be at least one kernel: a report this parser did not fully read is an
/// error, never zeros.
pub fn parse_report(log: &str) -> Result<Vec<KernelReport>> {
    let mut out = Vec::new();
    let mut cur: Option<Partial> = None;
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            if let Some(done) = cur.take() {
                out.push(done.finish()?);
            }
            let kernel = rest.split('\'').next().unwrap_or("").to_string();
            cur = Some(Partial { kernel, ..Default::default() });
            continue;
        }
        let Some(k) = cur.as_mut() else { continue };
        if line.contains("stack frame") || line.contains("spill stores") {
            let field = |unit: &str| {
                number_before(line, unit)
                    .ok_or_else(|| err(format!("ptxas report for `{}`: no `N {unit}` in `{}`", k.kernel, line.trim())))
            };
            k.frame = Some((field("bytes stack frame")?, field("bytes spill stores")?, field("bytes spill loads")?));
        }
        if let Some(fields) = line.split("Used ").nth(1) {
            k.used = Some(used_line(&k.kernel, fields)?);
        }
    }
    if let Some(done) = cur.take() {
        out.push(done.finish()?);
    }
    for (kernel, text) in wgmma_remarks(log) {
        if let Some(r) = out.iter_mut().find(|r| r.kernel == kernel) {
            r.wgmma_remarks.push(text);
        }
    }
    if out.is_empty() {
        return Err(err(format!(
            "no `Compiling entry function` in the ptxas report (was -v passed? or did NVIDIA's compute \
             cache answer without running ptxas: is CUDA_CACHE_DISABLE set to 0?):\n{log}"
        )));
    }
    Ok(out)
}

/// Where compiled kernels are kept: `kernels/` in [`super::libs::flowprefill_home`].
pub fn cache_dir() -> PathBuf {
    super::libs::flowprefill_home().join("kernels")
}

/// The CUBIN of `name` for `arch`: from the cache if this exact source was compiled for it
/// before (with the entry's path, so that one the driver refuses can be dropped and compiled
/// again), else compiled now and kept (a cache that cannot be written is only a slower start).
pub fn cached(name: &str, source: &str, arch: &str) -> Result<(Vec<u8>, Option<PathBuf>)> {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in source.bytes().chain(arch.bytes()) {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    let path = cache_dir().join(format!("{}-{arch}-{h:016x}.cubin", name.trim_end_matches(".cu")));
    if let Ok(bytes) = std::fs::read(&path) {
        if !bytes.is_empty() {
            return Ok((bytes, Some(path)));
        }
    }
    let c = compile(name, source, arch)?;
    if let Some(dir) = path.parent() {
        // The temporary file is this process's and thread's: the ranks of a fresh node compile
        // the same kernels at once, and one shared name let a rank rename another's half-written
        // file into place.
        let tmp = path.with_extension(crate::gpu::temporary_suffix());
        if std::fs::create_dir_all(dir).is_ok()
            && std::fs::write(&tmp, &c.cubin).is_ok()
            && std::fs::rename(&tmp, &path).is_err()
        {
            let _ = std::fs::remove_file(&tmp);
        }
    }
    Ok((c.cubin, None))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_ptxas_report() {
        let log = "ptxas info    : 0 bytes gmem\n\
            ptxas info    : Compiling entry function 'fp_attention' for 'sm_90a'\n\
            ptxas info    : Function properties for fp_attention\n\
                0 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n\
            ptxas info    : Used 56 registers, 4096 bytes smem, 428 bytes cmem[0]\n\
            ptxas info    : Compiling entry function 'fp_fill' for 'sm_90a'\n\
            ptxas info    : Function properties for fp_fill\n\
                0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
            ptxas info    : Used 10 registers, 372 bytes cmem[0]\n";
        let r = parse_report(log).expect("a whole report");
        assert_eq!(r.len(), 2);
        assert_eq!(
            r[0],
            KernelReport {
                kernel: "fp_attention".into(),
                registers: 56,
                shared_bytes: 4096,
                spill_stores: 8,
                spill_loads: 12,
                stack_bytes: 0,
                call_stack_bytes: 0,
                wgmma_remarks: Vec::new(),
            }
        );
        assert_eq!((r[1].kernel.as_str(), r[1].registers, r[1].shared_bytes), ("fp_fill", 10, 0));
        // sm_90's wording: barriers and, for a kernel that calls, its cumulative stack.
        let calls = log.replace(
            "Used 10 registers, 372 bytes cmem[0]",
            "Used 30 registers, used 0 barriers, 40 bytes cumulative stack size, 456 bytes cmem[0], 112 bytes cmem[2]",
        );
        let r = parse_report(&calls).expect("a whole report");
        assert_eq!((r[1].registers, r[1].call_stack_bytes), (30, 40));

        // Every field the gate checks must be found: other wording fails, naming what it lacks.
        let reworded = [
            (log.replace("Used 10 registers", "Allocated 10 regs"), "`Used N registers`"),
            (log.replace("8 bytes spill stores", "8 bytes spilled"), "bytes spill stores"),
            (log.replace("0 bytes stack frame, 8", "8"), "bytes stack frame"),
            (log.replace("4096 bytes smem", "4096 B shared"), "unknown field `4096 B shared`"),
            (log.replace("Compiling entry function", "Compiling kernel"), "no `Compiling entry function`"),
        ];
        for (text, lacking) in reworded {
            let e = parse_report(&text).unwrap_err().to_string();
            assert!(e.contains(lacking), "{lacking}: {e}");
        }
    }

    #[test]
    fn wgmma_remarks_are_read_per_kernel() {
        // NVRTC 12.9's wording (the self-check `hopper_probe.cu`, whose deliberate break reads
        // accumulators before the wait), ahead of the per-kernel report as ptxas prints it.
        let log = "ptxas info    : (C7519) warpgroup.arrive is injected in around line 351 by compiler to allow use \
                   of registers in GMMA in function 'fp_probe_a'\n\
            ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due to \
                   non wgmma instructions reading accumulator registers of  a wgmma between start and end of the \
                   pipeline stage in the function 'fp_probe_a'\n\
            ptxas info    : (C7999) something else in the function 'fp_probe_b'\n\
            ptxas info    : 0 bytes gmem\n\
            ptxas info    : Compiling entry function 'fp_probe_a' for 'sm_90a'\n\
            ptxas info    : Function properties for fp_probe_a\n\
                0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
            ptxas info    : Used 116 registers, used 1 barriers\n\
            ptxas info    : Compiling entry function 'fp_probe_b' for 'sm_90a'\n\
            ptxas info    : Function properties for fp_probe_b\n\
                0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
            ptxas info    : Used 116 registers, used 1 barriers\n";
        let r = parse_report(log).expect("a whole report");
        assert_eq!(r[0].wgmma_remarks.len(), 2, "{:?}", r[0].wgmma_remarks);
        assert!(r[0].wgmma_remarks[0].starts_with("(C7519) warpgroup.arrive is injected"));
        assert!(r[0].wgmma_remarks[1]
            .contains("(C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized"));
        assert!(r[0].wgmma_remarks[1].contains("of a wgmma"), "whitespace folded: {}", r[0].wgmma_remarks[1]);
        // A remark on something other than warpgroup products is not one of these.
        assert!(r[1].wgmma_remarks.is_empty());
    }
}
