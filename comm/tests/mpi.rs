//! The collectives, aborts and farewells over real MPI processes: `mpirun` runs the
//! `mpi_collectives` example (it checks every result itself and exits non-zero on a mismatch).
#![cfg(feature = "mpi")]

use std::process::Command;

#[test]
fn collectives_aborts_and_leaves_under_mpirun() {
    // cargo builds the examples before running tests: target/<profile>/examples/.
    let exe = std::env::current_exe().expect("test binary path");
    let example = exe
        .parent()
        .and_then(|deps| deps.parent())
        .map(|dir| dir.join("examples").join("mpi_collectives"))
        .expect("target directory");
    assert!(example.exists(), "{} was not built", example.display());
    for np in [2, 3] {
        let out = Command::new("mpirun")
            .args(["--oversubscribe", "-np", &np.to_string()])
            .arg(&example)
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .output()
            .expect("mpirun");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "np={np}: {text}\n{}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(text.matches(": ok, sent").count(), np, "every rank reports: {text}");
    }
}
