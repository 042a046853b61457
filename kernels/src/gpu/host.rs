//! Host-side checks and names the GPU path shares: the oldest GPU the kernels run on, and
//! temporary file names no other process or thread uses.

/// The oldest compute capability the kernels are written for: bf16 tensor-core products
/// (`mma.sync` of bf16, 8.0) and more than 64 KiB of shared memory a block (the attention asks
/// for 85 KiB and more).
pub const MIN_COMPUTE_CAPABILITY: (i32, i32) = (8, 0);

/// Whether a GPU of compute capability `cc` (named `name`) can run the kernels; the error
/// says what to do instead (a T4 or V100 failed with NVRTC's log, or a shared-memory limit).
pub fn check_capability(name: &str, cc: (i32, i32)) -> std::result::Result<(), String> {
    if cc >= MIN_COMPUTE_CAPABILITY {
        return Ok(());
    }
    let (major, minor) = MIN_COMPUTE_CAPABILITY;
    Err(format!(
        "{name} has compute capability {}.{}, and flowprefill's GPU kernels need {major}.{minor} or later (bf16 \
         tensor cores, over 64 KiB of shared memory a block: A100, A10, L4, RTX 30 series, H100 and newer); run \
         with --device cpu",
        cc.0, cc.1
    ))
}

/// A temporary file's extension that no other process or thread uses at the same time.
pub fn temporary_suffix() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let thread = format!("{:?}", std::thread::current().id()).chars().filter(char::is_ascii_digit).collect::<String>();
    format!("{}.{thread}.{}.tmp", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpus_older_than_ampere_are_refused_naming_the_capability() {
        assert!(check_capability("NVIDIA H100", (9, 0)).is_ok() && check_capability("A100", (8, 0)).is_ok());
        assert!(check_capability("RTX 4090", (8, 9)).is_ok() && check_capability("B200", (10, 0)).is_ok());
        let e = check_capability("Tesla T4", (7, 5)).expect_err("sm_75");
        assert!(e.contains("Tesla T4 has compute capability 7.5") && e.contains("--device cpu"), "{e}");
    }

    #[test]
    fn temporary_names_are_never_shared() {
        let a = temporary_suffix();
        let b = std::thread::spawn(temporary_suffix).join().expect("thread");
        assert!(a != b && a.starts_with(&std::process::id().to_string()) && a.ends_with(".tmp"), "{a} {b}");
        assert_ne!(a, temporary_suffix());
    }
}
