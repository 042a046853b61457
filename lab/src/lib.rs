//! Measurement of flowprefill, kept out of the system's crates: what the binary's `eval`,
//! `bench` and `check` commands compute and report.
//!
//! * [`bench`]: the benchmarks (prefill, TTFT, the request stream, load, decoding);
//! * [`calibrate`]: this machine's op rates and links, measured into profiles;
//! * [`check`]: needle-in-a-haystack accuracy and TTFT of every method;
//! * [`corpus`]: seeded English prose for benchmarks and haystacks;
//! * [`tasks`]: RULER-style needle tasks and multi-document QA, with their scoring;
//! * [`eval`]: one scored run ([`eval::Record`]), the results file, the report (tables,
//!   retention with intervals, sign tests, plots);
//! * [`project`]: the engine's work accounting turned into projected TTFT on other hardware
//!   (and `bench project`'s grid of it);
//! * [`faults`]: the service's fault matrix (every injected fault against what a client sees);
//! * [`importance`]: how well SnapKV and LookaheadKV predict the answer's attention;
//! * [`plot`]: PNG charts that never fail a command for want of a font;
//! * [`train`]: training the trained seeds on the CPU (KV Packet's self-distillation);
//! * [`http`]: the small HTTP/1.1 client the benchmarks and fault drills use against `serve`;
//! * [`network`]: the report of the network study across hosts (`bench network`).
//!
//! ```text
//!   launch (CLI, service, MPI launch) -> lab -> coordinator -> worker -> kernels
//!                                                                    \-> comm
//! ```
//!
//! (kernels and comm are the two leaves; neither depends on the other.)

pub mod auto;
pub mod bench;
pub mod calibrate;
pub mod check;
pub mod corpus;
mod error;
pub mod eval;
pub mod faults;
pub mod http;
pub mod importance;
pub mod network;
pub mod plot;
pub mod project;
pub mod tasks;
pub mod train;

pub use error::{each_once, LabError, Outcome, Result, Stop, PARTIAL};

/// The median of `v` (sorted in place; NaN when `v` is empty).
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}
