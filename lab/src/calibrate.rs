//! `bench calibrate`: this machine's op rates, memory bandwidth and links, measured into a
//! device and link profile for `bench project` and `bench ttft --project`. Every measure
//! reports its figure to a log (the binary's standard error) as it is made.

use crate::project::{self, Cost, Device, Link, Shape};
use crate::{LabError, Result};
use flowprefill_comm::ProcessGroup;
use flowprefill_kernels::attention::AttnShape;
use flowprefill_kernels::matmul::Matrix;
use flowprefill_kernels::{Backend, Cpu, DType, HostBuf};
use std::time::Instant;

/// Whether `n` can name a profile (as `--project`/`--link` will name it).
pub fn name_ok(n: &str) -> bool {
    !n.is_empty() && n.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
}

/// Today's date (UTC) as YYYY-MM-DD, for the sources of measured constants.
pub fn today() -> String {
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

/// The measured rates of this machine's device.
pub struct Rates {
    /// GEMM rates (FLOP/s) by rows.
    pub gemm: Vec<(f64, f64)>,
    /// Attention rates (FLOP/s) by query rows.
    pub attention: Vec<(f64, f64)>,
    /// Memory bandwidth (bytes/s).
    pub mem: f64,
    /// Effective bandwidth of the non-GEMM ops (bytes/s).
    pub other_bw: f64,
}

/// Effective bandwidth of the non-GEMM ops, from the model's own profile of a 2048-token prefill.
pub fn other_ops_bandwidth<B: Backend>(
    lm: &flowprefill_worker::LoadedModel<B>,
    cfg: &flowprefill_worker::config::ModelConfig,
    shape: &Shape,
    log: &mut dyn FnMut(&str),
) -> Result<f64> {
    let model = &lm.model;
    let ids: Vec<u32> = (0..2048u32).map(|i| 100 + (i * 7919) % 20000).collect();
    let form = flowprefill_worker::kv::KeyForm::Rotated;
    let mut cache = flowprefill_worker::kv::KvCache::new(model.backend(), cfg.n_layers, cfg.kv_dim(), form)?;
    model.profile().reset();
    flowprefill_worker::generate::prefill_into(model, &mut cache, &ids, 0, ids.len())?;
    let prof = model.op_times()?;
    let other_bytes = (ids.len() * cfg.n_layers) as f64 * shape.other_elems_per_row_layer() * 4.0;
    let other_bw = other_bytes / (prof.norm_rope_s + prof.elementwise_s).max(1e-9);
    log(&format!("  non-GEMM ops: {:.2} GB/s effective", other_bw / 1e9));
    Ok(other_bw)
}

/// GEMM rates (FLOP/s) by rows over the model's four block matrices.
pub fn gemm_rates(shape: &Shape, seconds: f64, log: &mut dyn FnMut(&str)) -> Result<Vec<(f64, f64)>> {
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
        log(&format!("  GEMM {rows:>5} rows: {:>7.2} GFLOP/s", flops / secs / 1e9));
        gemm.push((rows as f64, flops / secs));
    }
    Ok(gemm)
}

/// Attention rates (FLOP/s) by query rows: few queries over many keys (the prompt over the
/// context), then causal squares (a chunk or a ring block over itself).
pub fn attention_rates(shape: &Shape, seconds: f64, log: &mut dyn FnMut(&str)) -> Result<Vec<(f64, f64)>> {
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
        log(&format!(
            "  attention {rows:>5} x {keys:>5}{}: {:>7.2} GFLOP/s",
            if causal { " causal" } else { "" },
            rate / 1e9
        ));
        attn.push((rows as f64, rate));
    }
    Ok(attn)
}

/// Memory bandwidth (bytes/s): a 64 MiB copy (read + write).
pub fn copy_bandwidth(seconds: f64, log: &mut dyn FnMut(&str)) -> Result<f64> {
    let src = random(16 << 20, 4);
    let mut dst = vec![0f32; src.len()];
    let secs = time_it(seconds, || {
        dst.copy_from_slice(&src);
        Ok(())
    })?;
    let mem = 2.0 * (src.len() * 4) as f64 / secs;
    log(&format!("  memory copy: {:.2} GB/s", mem / 1e9));
    Ok(mem)
}

/// The `cpu-local` device profile of this machine from its measured rates.
pub fn device_profile(rates: &Rates, threads: usize, by: &str) -> Device {
    let Rates { gemm, attention: attn, mem, other_bw } = rates;
    let (mem, other_bw) = (*mem, *other_bw);
    let peak = gemm.iter().chain(attn).map(|p| p.1).fold(0.0, f64::max);
    let curve = |pts: &[(f64, f64)], what: &str| project::time::Curve {
        points: pts.iter().map(|&(s, r)| (s, (r / peak).clamp(1e-6, 1.0))).collect(),
        source: format!("{what}, {by}"),
    };
    let when = today();
    Device {
        description: format!("this machine's CPU, {threads} threads, f32 (calibrated {when})"),
        peak_flops: c(peak, &format!("the fastest measured GEMM or attention rate, {by}")),
        mem_bytes_per_s: c(mem, &format!("a 64 MiB copy, {by}")),
        gemm_efficiency: curve(gemm, "GEMM rate by rows over the model's four block matrices"),
        attention_efficiency: curve(attn, "attention rate by query rows (1-32 over 4096 keys, then causal squares)"),
        other_efficiency: c(
            (other_bw / mem).clamp(0.01, 1.0),
            &format!("RMSNorm, RoPE and elementwise time of a 2048-token prefill, {by}"),
        ),
        layer_overhead_s: c(0.0, "none separately: fixed costs are inside the measured op rates on the CPU"),
        weight_bytes: c(4.0, "f32 weights on the CPU backend"),
        kv_bytes: c(4.0, "f32 K/V and activations on the CPU backend"),
        ring_efficiency: c(1.0, "none: the CPU ring's transfers and staging are modelled explicitly"),
    }
}

/// The `cpu-threads` link: all-gathers between two thread ranks of this process.
pub fn thread_link(seconds: f64, by: &str, log: &mut dyn FnMut(&str)) -> Result<Link> {
    let mut group = flowprefill_comm::local::LocalComm::group(2);
    let mut peer = group.pop().ok_or_else(|| LabError::Failed("no peer".into()))?;
    let mut me = group.pop().ok_or_else(|| LabError::Failed("no communicator".into()))?;
    let (tx, rx) = std::sync::mpsc::channel::<usize>();
    let echo = std::thread::spawn(move || {
        while let Ok(n) = rx.recv() {
            if flowprefill_comm::all_gather_bytes(&mut peer, "calibrate", vec![0u8; n]).is_err() {
                return;
            }
        }
    });
    let (lat, bw) = link_speed(seconds, &mut |n| {
        tx.send(n).map_err(|_| LabError::Failed("the peer thread stopped".into()))?;
        flowprefill_comm::all_gather_bytes(&mut me, "calibrate", vec![0u8; n])?;
        Ok(())
    })?;
    drop(tx);
    let _ = echo.join();
    log(&format!("  thread-rank link: latency {:.1} us, {:.2} GB/s", lat * 1e6, bw / 1e9));
    Ok(Link {
        description: "thread ranks in one process (channels)".into(),
        bytes_per_s: c(bw, &format!("all-gather of 1-8 MiB between two thread ranks, {by}")),
        one_way_bytes_per_s: None,
        latency_s: c(lat, &format!("all-gather of an empty message between two thread ranks, {by}")),
    })
}

/// The `cpu-mpi` link between the first two processes of an `mpirun` world (every process
/// calls this; the link on world rank 0, `None` elsewhere or with one process).
pub fn mpi_link<C: ProcessGroup>(
    comm: &mut C,
    seconds: f64,
    by: &str,
    log: &mut dyn FnMut(&str),
) -> Result<Option<Link>> {
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
            log(&format!(
                "  MPI link ({description}): latency {:.1} us, {:.3} GB/s both ways at once, {:.3} GB/s one way",
                lat * 1e6,
                bw / 1e9,
                one_way / 1e9
            ));
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
pub fn link_speed(secs: f64, f: &mut dyn FnMut(usize) -> Result<()>) -> Result<(f64, f64)> {
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
