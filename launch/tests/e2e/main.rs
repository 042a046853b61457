//! The `flowprefill` binary end to end, in one test binary: each module was a test file of its
//! own, and nine binaries each compiled and linked the program's library (CI time), and each ran
//! alone, so that one that mostly waits (a deadline, an `mpirun` across hosts, a service
//! between jobs) left a core idle that the others now use. `service.rs` (the service
//! in-process, its tests one at a time) stays a binary of its own.
//!
//! One module alone: `cargo test --release -p flowprefill --features mpi --test e2e serve::`
//! (without OpenMPI, drop `--features mpi`: the MPI modules are then left out).

mod common;

mod ci_scripts;
mod cli;
mod errors;
mod eval;
mod readme;
mod serve;
mod store;

// The tests under real `mpirun` processes (built with `--features mpi`; the README's test
// command enables it whenever OpenMPI is installed, and `.ci/run` installs it).
#[cfg(feature = "mpi")]
mod hosts;
#[cfg(feature = "mpi")]
mod mpi;
#[cfg(feature = "mpi")]
mod mpi_support;
