//! `bench calibrate`: this machine's op rates, memory bandwidth and links, measured into a
//! device and link profile for `bench project` and `bench ttft --project`.

use crate::Common;
use anyhow::{Context, Result};
use flowprefill_kernels::attention::AttnShape;
use flowprefill_kernels::matmul::Matrix;
use flowprefill_kernels::{Backend, Cpu, DType, HostBuf};
use flowprefill_lab::project::{self, Device, Link, Profiles, Shape};
use std::path::PathBuf;
use std::time::Instant;

/// Arguments of `bench calibrate`.
#[derive(clap::Args, Debug)]
pub struct CalibrateArgs {
    /// Where to write the profile (JSON, for `--profiles`).
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

/// Today's date (UTC) as YYYY-MM-DD, for the sources of measured constants.
fn today() -> String {
    let days =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() / 86400) as i64;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

/// Seconds per call of `f`, repeated for about `secs` (after one warm-up call).
fn time_it(secs: f64, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let t = Instant::now();
    let mut n = 0u32;
    while n < 3 || t.elapsed().as_secs_f64() < secs {
        f()?;
        n += 1;
    }
    Ok(t.elapsed().as_secs_f64() / f64::from(n))
}

fn random(n: usize, seed: u64) -> Vec<f32> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-0.5f32..0.5)).collect()
}

fn c(value: f64, source: &str) -> project::time::Const {
    project::time::Const { value, source: source.to_string() }
}

/// `bench calibrate`: GEMM and attention rates by size, memory bandwidth and the non-GEMM ops
/// on this machine (threads as `--threads`), the thread-rank link, and under `mpirun -np 2`
/// (feature `mpi`) the MPI link between two processes.
pub fn run_calibrate(common: &Common, a: CalibrateArgs) -> Result<()> {
    crate::ensure_usage!(a.seconds.is_finite() && a.seconds > 0.0, "--seconds must be a positive number");
    #[cfg(feature = "mpi")]
    let mut mpi =
        if flowprefill_comm::mpi::launched_by_mpirun() { Some(flowprefill_comm::mpi::MpiComm::init()?) } else { None };
    #[cfg(feature = "mpi")]
    let lead = mpi.as_ref().is_none_or(|m| flowprefill_comm::Communicator::rank(m) == 0);
    #[cfg(not(feature = "mpi"))]
    let lead = true;
    let cfg = super::model_config(common)?;
    let shape = Shape::of_config(&cfg);
    let threads = rayon::current_num_threads();
    let when = today();
    let by =
        format!("measured {when} by `flowprefill --threads {threads} bench calibrate` with the {} shape", shape.name);
    let mut devices = std::collections::BTreeMap::new();
    let mut links = std::collections::BTreeMap::new();
    // Profile names, as `--project`/`--link` will name them.
    let name_ok = |n: &str| !n.is_empty() && n.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
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
            links.insert("cpu-threads".to_string(), thread_link(a.seconds, &by)?);
        }
    }
    #[cfg(feature = "mpi")]
    if let Some(comm) = mpi.as_mut() {
        if let Some(link) = mpi_link(comm, a.seconds, &by)? {
            links.insert(a.link_name.clone().unwrap_or_else(|| "cpu-mpi".to_string()), link);
        }
    }
    if lead {
        let p = Profiles { devices, links };
        std::fs::write(&a.out, serde_json::to_string_pretty(&p)?)
            .with_context(|| format!("writing {}", a.out.display()))?;
        println!("wrote {} (use it with --profiles)", a.out.display());
    }
    Ok(())
}

/// GEMM rates (FLOP/s) by rows over the model's four block matrices.
fn gemm_rates(shape: &Shape, seconds: f64) -> Result<Vec<(f64, f64)>> {
    let (d, q, kv, ffn) = (shape.d_model, shape.q_dim(), shape.kv_dim(), shape.ffn_dim);
    let mats: Vec<Matrix> = [(q + 2 * kv, d), (d, q), (2 * ffn, d), (d, ffn)]
        .iter()
        .enumerate()
        .map(|(i, &(n, k))| Matrix::new(n, k, random(n * k, i as u64)))
        .collect::<std::result::Result<_, _>>()?;
    let mut gemm = Vec::new();
    for rows in [1usize, 4, 16, 32, 64, 128, 256, 512, 1024, 2048] {
        let (mut flops, mut secs) = (0.0, 0.0);
        for (i, w) in mats.iter().enumerate() {
            let x = HostBuf::F32(random(rows * w.cols(), 10 + i as u64));
            let mut out = HostBuf::zeros(rows * w.rows(), DType::F32);
            secs += time_it(seconds / 4.0, || Ok(Cpu.matmul_t(&x, rows, w, &mut out)?))?;
            flops += 2.0 * (rows * w.rows() * w.cols()) as f64;
        }
        eprintln!("  GEMM {rows:>5} rows: {:>7.2} GFLOP/s", flops / secs / 1e9);
        gemm.push((rows as f64, flops / secs));
    }
    Ok(gemm)
}

/// Attention rates (FLOP/s) by query rows: few queries over many keys (the prompt over the
/// context), then causal squares (a chunk or a ring block over itself).
fn attention_rates(shape: &Shape, seconds: f64) -> Result<Vec<(f64, f64)>> {
    let attn_shape = AttnShape::new(shape.n_heads, shape.n_kv_heads, shape.head_dim)?;
    let mut attn = Vec::new();
    for (rows, keys, causal) in [
        (1usize, 4096usize, false),
        (8, 4096, false),
        (32, 4096, false),
        (128, 128, true),
        (512, 512, true),
        (2048, 2048, true),
    ] {
        let q = HostBuf::F32(random(rows * attn_shape.q_dim(), 1));
        let k = HostBuf::F32(random(keys * attn_shape.kv_dim(), 2));
        let v = HostBuf::F32(random(keys * attn_shape.kv_dim(), 3));
        let kpos: Vec<u32> = (0..keys as u32).collect();
        let qpos: Vec<u32> = if causal { kpos.clone() } else { vec![keys as u32; rows] };
        let pairs = project::range_pairs(u64::from(qpos[0])..u64::from(qpos[rows - 1]) + 1, 0..keys as u64) as f64
            * if causal { 1.0 } else { rows as f64 };
        let (mut out, mut lse) =
            (HostBuf::zeros(rows * attn_shape.q_dim(), DType::F32), HostBuf::zeros(rows * shape.n_heads, DType::F32));
        let secs =
            time_it(seconds, || Ok(Cpu.attention(&attn_shape, &q, &qpos, &k, &v, &kpos, &mut out, &mut lse)?))?;
        let rate = 4.0 * pairs * (shape.n_heads * shape.head_dim) as f64 / secs;
        eprintln!(
            "  attention {rows:>5} x {keys:>5}{}: {:>7.2} GFLOP/s",
            if causal { " causal" } else { "" },
            rate / 1e9
        );
        attn.push((rows as f64, rate));
    }
    Ok(attn)
}

/// Memory bandwidth (bytes/s): a 64 MiB copy (read + write).
fn copy_bandwidth(seconds: f64) -> Result<f64> {
    let src = random(16 << 20, 4);
    let mut dst = vec![0f32; src.len()];
    let secs = time_it(seconds, || {
        dst.copy_from_slice(&src);
        Ok(())
    })?;
    let mem = 2.0 * (src.len() * 4) as f64 / secs;
    eprintln!("  memory copy: {:.2} GB/s", mem / 1e9);
    Ok(mem)
}

/// Effective bandwidth of the non-GEMM ops, from the model's own profile of a 2048-token prefill.
fn other_ops_bandwidth(common: &Common, cfg: &flowprefill_worker::config::ModelConfig, shape: &Shape) -> Result<f64> {
    let lm = super::load_model(common)?;
    let model = &lm.model;
    let ids: Vec<u32> = (0..2048u32).map(|i| 100 + (i * 7919) % 20000).collect();
    let form = flowprefill_worker::kv::KeyForm::Rotated;
    let mut cache = flowprefill_worker::kv::KvCache::new(model.backend(), cfg.n_layers, cfg.kv_dim(), form)?;
    model.profile().reset();
    flowprefill_worker::generate::prefill_into(model, &mut cache, &ids, 0, ids.len())?;
    let prof = model.op_times()?;
    let other_bytes = (ids.len() * cfg.n_layers) as f64 * shape.other_elems_per_row_layer() * 4.0;
    let other_bw = other_bytes / (prof.norm_rope_s + prof.elementwise_s).max(1e-9);
    eprintln!("  non-GEMM ops: {:.2} GB/s effective", other_bw / 1e9);
    Ok(other_bw)
}

/// The `cpu-local` device profile of this machine.
fn cpu_device(
    common: &Common,
    cfg: &flowprefill_worker::config::ModelConfig,
    shape: &Shape,
    seconds: f64,
    by: &str,
) -> Result<Device> {
    let gemm = gemm_rates(shape, seconds)?;
    let attn = attention_rates(shape, seconds)?;
    let peak = gemm.iter().chain(&attn).map(|p| p.1).fold(0.0, f64::max);
    let mem = copy_bandwidth(seconds)?;
    let other_bw = other_ops_bandwidth(common, cfg, shape)?;
    let curve = |pts: &[(f64, f64)], what: &str| project::time::Curve {
        points: pts.iter().map(|&(s, r)| (s, (r / peak).clamp(1e-6, 1.0))).collect(),
        source: format!("{what}, {by}"),
    };
    let threads = rayon::current_num_threads();
    let when = today();
    Ok(Device {
        description: format!("this machine's CPU, {threads} threads, f32 (calibrated {when})"),
        peak_flops: c(peak, &format!("the fastest measured GEMM or attention rate, {by}")),
        mem_bytes_per_s: c(mem, &format!("a 64 MiB copy, {by}")),
        gemm_efficiency: curve(&gemm, "GEMM rate by rows over the model's four block matrices"),
        attention_efficiency: curve(&attn, "attention rate by query rows (1-32 over 4096 keys, then causal squares)"),
        other_efficiency: c(
            (other_bw / mem).clamp(0.01, 1.0),
            &format!("RMSNorm, RoPE and elementwise time of a 2048-token prefill, {by}"),
        ),
        layer_overhead_s: c(0.0, "none separately: fixed costs are inside the measured op rates on the CPU"),
        weight_bytes: c(4.0, "f32 weights on the CPU backend"),
        kv_bytes: c(4.0, "f32 K/V and activations on the CPU backend"),
        ring_efficiency: c(1.0, "none: the CPU ring's transfers and staging are modelled explicitly"),
    })
}

/// The `cpu-threads` link: all-gathers between two thread ranks of this process.
fn thread_link(seconds: f64, by: &str) -> Result<Link> {
    let mut group = flowprefill_comm::local::LocalComm::group(2);
    let mut peer = group.pop().ok_or_else(|| anyhow::anyhow!("no peer"))?;
    let mut me = group.pop().ok_or_else(|| anyhow::anyhow!("no communicator"))?;
    let (tx, rx) = std::sync::mpsc::channel::<usize>();
    let echo = std::thread::spawn(move || {
        while let Ok(n) = rx.recv() {
            if flowprefill_comm::all_gather_bytes(&mut peer, "calibrate", vec![0u8; n]).is_err() {
                return;
            }
        }
    });
    let (lat, bw) = link_speed(seconds, &mut |n| {
        tx.send(n).map_err(|_| anyhow::anyhow!("the peer thread stopped"))?;
        flowprefill_comm::all_gather_bytes(&mut me, "calibrate", vec![0u8; n])?;
        Ok(())
    })?;
    drop(tx);
    let _ = echo.join();
    eprintln!("  thread-rank link: latency {:.1} us, {:.2} GB/s", lat * 1e6, bw / 1e9);
    Ok(Link {
        description: "thread ranks in one process (channels)".into(),
        bytes_per_s: c(bw, &format!("all-gather of 1-8 MiB between two thread ranks, {by}")),
        one_way_bytes_per_s: None,
        latency_s: c(lat, &format!("all-gather of an empty message between two thread ranks, {by}")),
    })
}

/// The `cpu-mpi` link between the first two processes of an `mpirun` world (every process
/// calls this; the link on world rank 0, `None` elsewhere or with one process).
#[cfg(feature = "mpi")]
fn mpi_link(comm: &mut flowprefill_comm::mpi::MpiComm, seconds: f64, by: &str) -> Result<Option<Link>> {
    use flowprefill_comm::Communicator;
    if comm.size() < 2 {
        return Ok(None);
    }
    let mut link = None;
    comm.use_group(2, std::time::Duration::from_secs(600))?;
    if comm.world_rank() < 2 {
        // Where the two processes are: one host (shared memory) or two (a network).
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default().trim().to_string();
        let hosts: Vec<String> = flowprefill_comm::all_gather_bytes(&mut *comm, "calibrate.host", host.into_bytes())?
            .into_iter()
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .collect();
        let (lat, bw) = link_speed(seconds, &mut |n| {
            flowprefill_comm::all_gather_bytes(&mut *comm, "calibrate", vec![0u8; n])?;
            Ok(())
        })?;
        // One way: rank 0 sends, rank 1 answers with nothing once it has everything.
        let (_, one_way) = link_speed(seconds, &mut |n| {
            if comm.rank() == 0 {
                flowprefill_comm::exchange(&mut *comm, "calibrate.one", vec![(1, vec![0u8; n])], Vec::new())?;
                flowprefill_comm::exchange(&mut *comm, "calibrate.ack", Vec::new(), vec![1])?;
            } else {
                flowprefill_comm::exchange(&mut *comm, "calibrate.one", Vec::new(), vec![0])?;
                flowprefill_comm::exchange(&mut *comm, "calibrate.ack", vec![(0, Vec::new())], Vec::new())?;
            }
            Ok(())
        })?;
        if comm.world_rank() == 0 {
            let description = match hosts.as_slice() {
                [a, b] if a != b => format!("MPI processes on hosts {a} and {b} (a network between them)"),
                _ => "MPI processes on this machine (shared memory, flowprefill's comm thread)".to_string(),
            };
            eprintln!(
                "  MPI link ({description}): latency {:.1} us, {:.3} GB/s both ways at once, {:.3} GB/s one way",
                lat * 1e6,
                bw / 1e9,
                one_way / 1e9
            );
            link = Some(Link {
                description,
                bytes_per_s: c(bw, &format!("all-gather of 1-8 MiB between two MPI ranks, {by}")),
                one_way_bytes_per_s: Some(c(
                    one_way,
                    &format!("1-8 MiB from one MPI rank to another, answered with nothing, {by}"),
                )),
                latency_s: c(lat, &format!("all-gather of an empty message between two MPI ranks, {by}")),
            });
        }
    }
    comm.use_group(comm.world_size(), std::time::Duration::from_secs(600))?;
    Ok(link)
}

/// Latency and bandwidth of a link: `f(n)` runs one all-gather of `n` bytes between two ranks.
/// Every process of a pair runs the same sequence of sizes.
fn link_speed(secs: f64, f: &mut dyn FnMut(usize) -> Result<()>) -> Result<(f64, f64)> {
    // A fixed number of calls, so that both sides of an MPI pair run the same sequence.
    let reps = ((secs * 2000.0) as usize).clamp(50, 2000);
    let mut timed = |n: usize, reps: usize| -> Result<f64> {
        f(n)?;
        let t = Instant::now();
        for _ in 0..reps {
            f(n)?;
        }
        Ok(t.elapsed().as_secs_f64() / reps as f64)
    };
    let lat = timed(0, reps)?;
    let small = timed(1 << 20, 20)?;
    let big = timed(8 << 20, 10)?;
    let bw = (7 << 20) as f64 / (big - small).max(1e-9);
    Ok((lat, bw))
}
