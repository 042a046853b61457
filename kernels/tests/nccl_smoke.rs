//! NCCL smoke: the library from the PyPI wheel `nvidia-nccl-cu12` (`scripts/test.sh` installs it
//! and sets `FLOWPREFILL_REQUIRE_NCCL=1`, so in CI a missing NCCL is a failure; elsewhere this
//! test says it was skipped) gives its version and unique ids without a GPU; creating a
//! communicator then needs a GPU: here it fails with an error that says so, on a GPU machine a
//! world of one is created.
#![cfg(feature = "nccl")]

use flowprefill_kernels::cuda::{self, nccl};

#[test]
fn nccl_version_and_unique_ids_without_a_gpu_and_a_clear_error_for_a_communicator() {
    if !nccl::present() {
        assert!(
            std::env::var_os("FLOWPREFILL_REQUIRE_NCCL").is_none(),
            "FLOWPREFILL_REQUIRE_NCCL is set but libnccl.so was not found (LD_LIBRARY_PATH={:?})",
            std::env::var("LD_LIBRARY_PATH")
        );
        let e = nccl::unique_id().expect_err("no library, no id").to_string();
        assert!(e.contains("NCCL was not found: looked for libnccl.so, libnccl.so.2"), "{e}");
        flowprefill_kernels::testing::skipped("no NCCL library", "libnccl.so not found (scripts/test.sh installs it)");
        return;
    }
    let (major, minor, patch) = nccl::version().expect("NCCL version");
    println!("NCCL {major}.{minor}.{patch}");
    assert!(major == 2 && minor >= 18, "NCCL {major}.{minor}.{patch}: flowprefill needs 2.18 or later");
    let a = nccl::unique_id().expect("a unique id without a GPU");
    let b = nccl::unique_id().expect("another");
    assert!(a.iter().any(|&x| x != 0), "an all-zero unique id");
    assert_ne!(a, b, "two unique ids are equal");
    println!("unique id: {} bytes, starts {:02x?}", a.len(), &a[..8]);
    let e = nccl::communicator(0, 1, 1, &a, std::time::Duration::from_secs(30)).expect_err("rank 1 of a world of 1");
    assert!(e.to_string().contains("rank 1 outside a world of 1"), "{e}");
    match nccl::communicator(0, 0, 1, &a, std::time::Duration::from_secs(30)) {
        Ok(c) => {
            assert!(cuda::driver_present());
            assert_eq!((c.rank(), c.world_size()), (0, 1));
            println!("NCCL communicator: rank 0 of 1 on cuda:0");
        }
        Err(e) => {
            assert!(!cuda::driver_present(), "a GPU is present but the communicator failed: {e}");
            let e = e.to_string();
            assert!(e.contains("needs a GPU") && e.contains("libcuda"), "{e}");
            println!("communicator without a GPU: {e}");
        }
    }
}
