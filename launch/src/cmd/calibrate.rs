//! `bench calibrate`: this machine's op rates, memory bandwidth and links, measured into a
//! device and link profile for `bench project` and `bench ttft --project`.

use crate::Common;
use anyhow::{Context, Result};
use flowprefill_lab::calibrate::{self, Rates};
use flowprefill_lab::project::{Device, Profiles, Shape};
use std::path::PathBuf;

/// Arguments of `bench calibrate`.
#[derive(clap::Args, Debug)]
pub struct CalibrateArgs {
    /// Where to write the profile (JSON, for `--profiles`); `$FLOWPREFILL_HOME/calibration.json`
    /// is the one `--method auto` and `bench ttft --project cpu-local` read by themselves. A
    /// profile file already there keeps the devices and links this run does not measure (a
    /// `--link-name` run adds its link beside the device measured before).
    #[arg(long, default_value = "cpu-local.json")]
    pub out: PathBuf,
    /// Seconds per measured point.
    #[arg(long, default_value_t = 0.3)]
    pub seconds: f64,
    /// Measure only the MPI link between the first two processes of an `mpirun`, and name it
    /// NAME in the profile (e.g. `hosts-1gbit` for ranks on two hosts of `scripts/hosts.sh`);
    /// the device is not measured.
    #[arg(long, value_name = "NAME")]
    pub link_name: Option<String>,
    /// Name of the measured device in the profile (default `cpu-local`).
    #[arg(long, value_name = "NAME", default_value = "cpu-local")]
    pub device_name: String,
    /// Under `mpirun`: every rank measures the device at the same time (rank 0's figures are
    /// written), so that the profile is what one rank gets while every rank computes (memory
    /// bandwidth, cores shared by more ranks than there are); without it rank 0 measures alone.
    #[arg(long)]
    pub concurrent: bool,
}

/// `bench calibrate`: GEMM and attention rates by size, memory bandwidth and the non-GEMM ops
/// on this machine (threads as `--threads`), the thread-rank link, and under `mpirun -np 2`
/// (feature `mpi`) the MPI link between two processes.
pub fn run_calibrate(common: &Common, a: CalibrateArgs) -> Result<()> {
    crate::ensure_usage!(a.seconds.is_finite() && a.seconds > 0.0, "--seconds must be a positive number");
    super::out_file("--out", &a.out)?;
    // What is there already: kept, but for what this run measures; a file of something else
    // is not replaced.
    let earlier = match std::fs::read_to_string(&a.out) {
        Ok(text) => Some(Profiles::parse(&a.out.display().to_string(), &text).map_err(|e| {
            crate::exit::usage(format!(
                "--out {}: a file that is not a profile file is there ({e}); give another path",
                a.out.display()
            ))
        })?),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(crate::exit::usage(format!("--out {}: cannot be read ({e})", a.out.display()))),
    };
    #[cfg(feature = "mpi")]
    let mut mpi =
        if flowprefill_comm::mpi::launched_by_mpirun() { Some(flowprefill_comm::mpi::MpiComm::init()?) } else { None };
    #[cfg(feature = "mpi")]
    let lead = mpi.as_ref().is_none_or(|m| flowprefill_comm::Communicator::rank(m) == 0);
    #[cfg(not(feature = "mpi"))]
    let lead = true;
    let cfg = super::model_config(common)?;
    let shape = cfg.clone();
    let threads = rayon::current_num_threads();
    let when = calibrate::today();
    let by =
        format!("measured {when} by `flowprefill --threads {threads} bench calibrate` with the {} shape", shape.name);
    let mut log = |l: &str| crate::say!("{l}");
    let mut devices = std::collections::BTreeMap::new();
    let mut links = std::collections::BTreeMap::new();
    // Profile names, as `--project`/`--link` will name them.
    let name_ok = calibrate::name_ok;
    if let Some(name) = &a.link_name {
        crate::ensure_usage!(name_ok(name), "--link-name: letters, digits, '-', '_' and '.' only (got {name:?})");
        #[cfg(not(feature = "mpi"))]
        crate::ensure_usage!(false, "--link-name measures an MPI link: build with --features mpi and run under mpirun");
        #[cfg(feature = "mpi")]
        crate::ensure_usage!(
            mpi.as_ref().is_some_and(|m| m.world_size() >= 2),
            "--link-name measures the MPI link between two processes: run it under `mpirun -np 2` (or more)"
        );
    }
    crate::ensure_usage!(
        name_ok(&a.device_name),
        "--device-name: letters, digits, '-', '_' and '.' only (got {:?})",
        a.device_name
    );
    #[cfg(feature = "mpi")]
    let ranks = mpi.as_ref().map_or(1, |m| m.world_size());
    #[cfg(not(feature = "mpi"))]
    let ranks = 1;
    crate::ensure_usage!(
        !a.concurrent || ranks >= 2,
        "--concurrent measures the device while every rank computes: run it under `mpirun -np N` (N >= 2)"
    );
    if a.link_name.is_none() && (lead || a.concurrent) {
        // Every rank starts measuring at once (an all-gather of nothing as the starting line).
        #[cfg(feature = "mpi")]
        if let (true, Some(comm)) = (a.concurrent, mpi.as_mut()) {
            flowprefill_comm::all_gather_bytes(comm, "calibrate.start", Vec::new())?;
        }
        let by = if a.concurrent { format!("{by}, all {ranks} ranks measuring at once") } else { by.clone() };
        let mut device = cpu_device(common, &cfg, &shape, a.seconds, &by)?;
        if a.concurrent {
            device.description = format!("{}, while {ranks} ranks compute", device.description);
        }
        devices.insert(a.device_name.clone(), device);
        if lead {
            links.insert("cpu-threads".to_string(), calibrate::thread_link(a.seconds, &by, &mut log)?);
        }
    }
    #[cfg(feature = "mpi")]
    if let Some(comm) = mpi.as_mut() {
        if let Some(link) = calibrate::mpi_link(comm, a.seconds, &by, &mut log)? {
            links.insert(a.link_name.clone().unwrap_or_else(|| "cpu-mpi".to_string()), link);
        }
    }
    if lead {
        let measured = Profiles { devices, links };
        let p = match earlier {
            Some(mut p) => {
                let kept: Vec<String> = p
                    .devices
                    .keys()
                    .filter(|n| !measured.devices.contains_key(*n))
                    .map(|n| format!("device {n}"))
                    .chain(p.links.keys().filter(|n| !measured.links.contains_key(*n)).map(|n| format!("link {n}")))
                    .collect();
                if !kept.is_empty() {
                    crate::say!("kept from {}: {} (not measured by this run)", a.out.display(), kept.join(", "));
                }
                p.merge(measured);
                p
            }
            None => measured,
        };
        // Under a temporary name, then renamed: `--method auto` reads this file, and an
        // interrupted write must not leave it half there.
        let tmp = a.out.with_extension(format!("json.{}.tmp", std::process::id()));
        std::fs::write(&tmp, serde_json::to_string_pretty(&p)?)
            .and_then(|()| std::fs::rename(&tmp, &a.out))
            .inspect_err(|_| {
                let _ = std::fs::remove_file(&tmp);
            })
            .with_context(|| format!("writing {}", a.out.display()))?;
        println!("wrote {} (use it with --profiles)", a.out.display());
    }
    Ok(())
}

/// The `cpu-local` device profile of this machine: the op rates, then the model (loaded here)
/// for the non-GEMM ops.
fn cpu_device(
    common: &Common,
    cfg: &flowprefill_worker::config::ModelConfig,
    shape: &Shape,
    seconds: f64,
    by: &str,
) -> Result<Device> {
    let mut log = |l: &str| crate::say!("{l}");
    let gemm = calibrate::gemm_rates(shape, seconds, &mut log)?;
    let attention = calibrate::attention_rates(shape, seconds, &mut log)?;
    let mem = calibrate::copy_bandwidth(seconds, &mut log)?;
    let lm = super::load_model(common)?;
    let other_bw = calibrate::other_ops_bandwidth(&lm, cfg, shape, &mut log)?;
    Ok(calibrate::device_profile(&Rates { gemm, attention, mem, other_bw }, rayon::current_num_threads(), by))
}
