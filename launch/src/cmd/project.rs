//! `flowprefill bench project` (projected TTFT on hardware we do not have) and
//! `flowprefill bench calibrate` (a measured `cpu-local` profile of this machine).

use crate::Common;
use anyhow::{Context, Result};
use flowprefill_coordinator::{memory, Method, MethodSpec, RunOptions, RunResult, Scope};
use flowprefill_kernels::attention::AttnShape;
use flowprefill_kernels::matmul::Matrix;
use flowprefill_kernels::{Backend, Cpu, DType, HostBuf};
use flowprefill_lab::project::{self, plan, Device, Link, Profiles, Projection, Request, Shape};
use std::path::PathBuf;
use std::time::Instant;

/// Arguments of `bench project`.
#[derive(clap::Args, Debug)]
pub struct ProjectArgs {
    /// Model shape: a built-in name (qwen3-14b, llama-3.1-8b, ... see --list); without it, the
    /// shape of the GGUF of `--model` (the default model if none).
    #[arg(long)]
    pub shape: Option<String>,
    /// Projected device (a profile name; `--list` shows them). `--device` is where flowprefill
    /// itself runs, not this.
    #[arg(long, default_value = "h100-sxm")]
    pub target: String,
    /// Link between ranks (a profile name).
    #[arg(long, default_value = "nvlink4")]
    pub link: String,
    /// Rank counts.
    #[arg(long, default_value = "1,2,4,8", value_parser = super::parse_list::<usize>)]
    pub ranks: Vec<Vec<usize>>,
    /// Context lengths in tokens.
    #[arg(long, default_value = "8192,16384,32768,65536,131072", value_parser = super::parse_list::<usize>)]
    pub lengths: Vec<Vec<usize>>,
    /// Methods: full, ring, infoflow[:ratio], none.
    #[arg(long, default_value = "full,ring,infoflow:0.15")]
    pub methods: String,
    /// Recompute scope of the selective methods.
    #[arg(long, value_enum, default_value_t = Scope::Exact)]
    pub scope: Scope,
    /// Tokens per document (one chunk each).
    #[arg(long, default_value_t = 512)]
    pub doc_tokens: usize,
    /// Template tokens before the context.
    #[arg(long, default_value_t = 24)]
    pub head_tokens: usize,
    /// Question and template tokens after the context.
    #[arg(long, default_value_t = 32)]
    pub prompt_tokens: usize,
    /// More profiles (JSON, as `lab/profiles.json`; e.g. written by `bench calibrate`).
    #[arg(long)]
    pub profiles: Vec<PathBuf>,
    /// Calibrate one global compute efficiency on one published cell:
    /// `METHOD,RANKS,LENGTH,MS` (e.g. `full,1,8192,566.7`).
    #[arg(long)]
    pub calibrate: Option<String>,
    /// Published cells to show beside the projection: `METHOD,RANKS,LENGTH,MS;...`.
    #[arg(long)]
    pub compare: Option<String>,
    /// Output folder for projection.csv and the plots.
    #[arg(long, default_value = "bench-out/project")]
    pub out: PathBuf,
    /// List the shapes, devices and links, and exit.
    #[arg(long)]
    pub list: bool,
}

/// Arguments of `bench calibrate`.
#[derive(clap::Args, Debug)]
pub struct CalibrateArgs {
    /// Where to write the profile (JSON, for `--profiles`).
    #[arg(long, default_value = "cpu-local.json")]
    pub out: PathBuf,
    /// Seconds per measured point.
    #[arg(long, default_value_t = 0.3)]
    pub seconds: f64,
}

/// The built-in profiles plus the files given.
pub fn load_profiles(files: &[PathBuf]) -> Result<Profiles> {
    let mut p = Profiles::builtin()?;
    for f in files {
        let text = std::fs::read_to_string(f).with_context(|| format!("reading --profiles {}", f.display()))?;
        p.merge(Profiles::parse(&f.display().to_string(), &text)?);
    }
    Ok(p)
}

/// A projected method: label, options (`NAME[@RATIO]`; InfoFlow's ratio defaults to 0.15).
fn parse_methods(list: &str, scope: Scope) -> Result<Vec<(String, RunOptions)>> {
    let mut out = Vec::new();
    for spec in MethodSpec::parse_list(list)? {
        crate::ensure_usage!(
            matches!(spec.method, Method::Full | Method::Ring | Method::Infoflow | Method::None) && !spec.reorder,
            "--methods: the projection covers full, ring, infoflow[@ratio] and none, not {spec}"
        );
        let spec = if spec.method == Method::Infoflow { spec.at(spec.ratio.unwrap_or(0.15)) } else { spec };
        out.push((spec.to_string(), RunOptions { scope, max_new_tokens: 1, ..spec.options(0.15) }));
    }
    Ok(out)
}

/// `METHOD,RANKS,LENGTH,MS` cells.
fn parse_cells(s: &str, flag: &str) -> Result<Vec<(String, usize, usize, f64)>> {
    s.split(';')
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .map(|c| {
            let f: Vec<&str> = c.split(',').map(str::trim).collect();
            let bad =
                || crate::exit::Usage(format!("{flag} `{c}`: write METHOD,RANKS,LENGTH,MS (e.g. full,1,8192,566.7)"));
            if f.len() != 4 {
                return Err(bad().into());
            }
            Ok((
                f[0].to_string(),
                f[1].parse().map_err(|_| bad())?,
                f[2].parse().map_err(|_| bad())?,
                f[3].parse().map_err(|_| bad())?,
            ))
        })
        .collect()
}

/// Which method label a published cell's method name means.
fn cell_label<'a>(methods: &'a [(String, RunOptions)], name: &str) -> Option<&'a (String, RunOptions)> {
    let name = name.to_ascii_lowercase();
    methods.iter().find(|(l, o)| *l == name || o.method.name() == name)
}

/// Projection of a finished run (what `bench ttft --project` prints beside the measurement).
pub fn project_run(
    r: &RunResult,
    shape: &Shape,
    dev: &Device,
    link: &Link,
) -> std::result::Result<Projection, project::ProjectError> {
    let req = Request::of_run(r);
    let work = plan(shape, &r.opts, r.ranks, &req, r.kv_bytes)?;
    Ok(project::project(&work, shape, dev, link, 1.0))
}

struct Row {
    label: String,
    ranks: usize,
    length: usize,
    p: Projection,
    /// The job's planned memory on its busiest rank (bytes; weights not included).
    memory: usize,
}

/// What `bench project` projects onto: a shape, a device and a link, documents of a size.
struct Target<'a> {
    shape: Shape,
    dev: &'a project::Device,
    link: &'a project::Link,
    a: &'a ProjectArgs,
    /// One global compute efficiency (1 unless calibrated on a measured cell).
    scale: f64,
}

impl Target<'_> {
    /// The request of `n` context tokens in documents of --doc-tokens.
    fn request(&self, n: usize) -> Request {
        Request::documents(n, self.a.doc_tokens, self.a.head_tokens, self.a.prompt_tokens)
    }

    /// Projected TTFT of `opts` on `p` ranks at `n` tokens under compute efficiency `scale`.
    fn project(&self, opts: &RunOptions, p: usize, n: usize, scale: f64) -> Result<Projection> {
        let work = plan(&self.shape, opts, p, &self.request(n), self.dev.kv_bytes.value.round() as usize)?;
        Ok(project::project(&work, &self.shape, self.dev, self.link, scale))
    }

    /// The K/V type of the target.
    fn kv(&self) -> DType {
        if self.dev.kv_bytes.value.round() as usize == 2 {
            DType::Bf16
        } else {
            DType::F32
        }
    }

    /// The forward's activation type: bf16 with bf16 weights (a GPU's bf16 forward), else f32.
    fn act(&self) -> DType {
        if self.dev.weight_bytes.value.round() as usize == 2 {
            DType::Bf16
        } else {
            DType::F32
        }
    }

    /// The memory plan of the same request on its busiest rank, at the target's K/V and
    /// activation types, with a GPU's scratch.
    fn memory(&self, opts: &RunOptions, p: usize, n: usize) -> usize {
        let req = self.request(n);
        let tokens = memory::Tokens { head: req.head, chunks: req.chunks.clone(), prompt: req.prompt };
        let dims = self.shape.dims();
        let plans =
            memory::plan(&dims, self.kv(), self.act(), &flowprefill_kernels::gpu_scratch_bytes, opts, p, &tokens);
        plans.iter().map(memory::RankMemory::bytes).max().unwrap_or(0)
    }

    /// Weights per rank (every rank holds the whole model), untied embeddings assumed.
    fn weights(&self) -> f64 {
        let s = &self.shape;
        (s.n_layers as f64 * s.layer_params() + 2.0 * (s.vocab_size * s.d_model) as f64) * self.dev.weight_bytes.value
    }

    /// The compute efficiency that makes one measured cell's projection match it (TTFT falls
    /// monotonically with the scale: bisection on a log scale).
    fn calibrate(&self, methods: &[(String, RunOptions)], cell: &str) -> Result<f64> {
        let cells = parse_cells(cell, "--calibrate")?;
        crate::ensure_usage!(cells.len() == 1, "--calibrate takes exactly one cell");
        let (m, p, n, ms) = &cells[0];
        let (_, opts) = cell_label(methods, m)
            .ok_or_else(|| crate::exit::Usage(format!("--calibrate: method {m} is not among --methods")))?;
        let (mut lo, mut hi) = (1e-3f64, 1e3f64);
        for _ in 0..100 {
            let mid = (lo * hi).sqrt();
            if self.project(opts, *p, *n, mid)?.ttft_s * 1e3 > *ms {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        let scale = (lo * hi).sqrt();
        println!(
            "calibrated on {m} P={p} {n} tokens = {ms} ms: compute efficiency x {scale:.3} \
             (GEMM at large M: {:.1}% of peak, attention at long sequences: {:.1}%)",
            100.0 * scale * self.dev.gemm_efficiency.at(4096.0),
            100.0 * scale * self.dev.attention_efficiency.at(8192.0)
        );
        Ok(scale)
    }
}

/// Whether `opts` runs on `p` ranks in a table: full is the single-device baseline; a ring of
/// one is full prefill.
fn shown_at(opts: &RunOptions, p: usize) -> bool {
    !((opts.method == Method::Full && p > 1) || (opts.method == Method::Ring && p == 1))
}

/// `bench project --list`.
fn list(profiles: &Profiles) {
    println!("shapes (built in; or any GGUF with --model):");
    for n in Shape::builtin_names() {
        println!("  {n:<16} {}", Shape::builtin_source(n).unwrap_or(""));
    }
    println!("devices (--target):");
    for (n, d) in &profiles.devices {
        println!("  {n:<16} {}", d.description);
    }
    println!("links (--link):");
    for (n, l) in &profiles.links {
        println!("  {n:<16} {}", l.description);
    }
}

/// `bench project`.
pub fn run_project(common: &Common, a: ProjectArgs) -> Result<()> {
    let profiles = load_profiles(&a.profiles)?;
    if a.list {
        list(&profiles);
        return Ok(());
    }
    let shape = match &a.shape {
        Some(s) => Shape::builtin(s)?,
        None => Shape::of_config(&super::model_config(common)?),
    };
    let (ranks, lengths) = (a.ranks.concat(), a.lengths.concat());
    crate::ensure_usage!(!ranks.is_empty() && ranks.iter().all(|&r| r >= 1), "--ranks values must be at least 1");
    crate::ensure_usage!(!lengths.is_empty() && lengths.iter().all(|&n| n >= 1), "--lengths values must be positive");
    crate::ensure_usage!(a.doc_tokens >= 1, "--doc-tokens must be at least 1");
    let methods = parse_methods(&a.methods, a.scope)?;
    crate::ensure_usage!(!methods.is_empty(), "--methods names no method");
    let mut t = Target { shape, dev: profiles.device(&a.target)?, link: profiles.link(&a.link)?, a: &a, scale: 1.0 };
    if let Some(c) = &a.calibrate {
        t.scale = t.calibrate(&methods, c)?;
    }
    let mut rows = Vec::new();
    for &n in &lengths {
        for &p in &ranks {
            for (label, opts) in methods.iter().filter(|m| shown_at(&m.1, p)) {
                let memory = t.memory(opts, p, n);
                rows.push(Row {
                    label: label.clone(),
                    ranks: p,
                    length: n,
                    p: t.project(opts, p, n, t.scale)?,
                    memory,
                });
            }
        }
    }
    let csv = table(&t, &methods, &rows);
    if let Some(c) = &a.compare {
        compare(&t, &methods, c)?;
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let csv_path = a.out.join("projection.csv");
    std::fs::write(&csv_path, csv)?;
    let written: Vec<String> =
        std::iter::once(csv_path.display().to_string()).chain(charts(&t, &methods, &ranks, &rows)?).collect();
    println!("wrote {}", written.join(", "));
    Ok(())
}

/// Projected TTFT of row `label` on `p` ranks at `n` tokens.
fn find(rows: &[Row], label: &str, p: usize, n: usize) -> Option<f64> {
    rows.iter().find(|r| r.label == label && r.ranks == p && r.length == n).map(|r| r.p.ttft_s)
}

/// The label of the first method of a kind among `methods`.
fn label_of(methods: &[(String, RunOptions)], method: Method) -> Option<String> {
    methods.iter().find(|m| m.1.method == method).map(|m| m.0.clone())
}

/// Prints the table (with its title and the memory line) and returns the CSV.
fn table(t: &Target<'_>, methods: &[(String, RunOptions)], rows: &[Row]) -> String {
    let a = t.a;
    let (ring_label, full_label) = (label_of(methods, Method::Ring), label_of(methods, Method::Full));
    println!(
        "PROJECTED TTFT (not measured): {} on {} x N (N: the ranks column) over {}, {} scope, {}-token documents{}",
        t.shape.name,
        a.target,
        a.link,
        a.scope.name(),
        a.doc_tokens,
        if t.scale != 1.0 { format!(", compute efficiency x {:.3}", t.scale) } else { String::new() }
    );
    println!(
        "memory per rank: weights {:.1} GiB, plus the job's planned peak (GiB/rank: K/V at {} bytes, the \
         largest forward, scratch; coordinator/src/memory.rs)",
        t.weights() / (1u64 << 30) as f64,
        t.kv().size()
    );
    println!(
        "{:>7} {:>5} {:<14} {:>10} {:>9} {:>9} {:>10} {:>9} {:>9} {:>9} {:>9}",
        "length",
        "ranks",
        "method",
        "TTFT ms",
        "vs full1",
        "vs ringP",
        "compute",
        "GEMM",
        "comm",
        "exposed",
        "GiB/rank"
    );
    let mut csv = String::from(
        "shape,target,link,method,ratio,scope,ranks,length,ttft_ms,speedup_vs_full1,speedup_vs_ring,compute_ms,gemm_ms,attention_ms,comm_ms,exposed_comm_ms,job_memory_gib_per_rank,phases\n",
    );
    for r in rows {
        let vs_full = full_label.as_deref().and_then(|f| find(rows, f, 1, r.length)).map(|f| f / r.p.ttft_s);
        let vs_ring = ring_label.as_deref().and_then(|g| find(rows, g, r.ranks, r.length)).map(|g| g / r.p.ttft_s);
        let fmt = |v: Option<f64>| v.map_or("-".to_string(), |x| format!("{x:.2}x"));
        let ms = |f: fn(&project::time::PhaseTime) -> f64| r.p.sum(f) * 1e3;
        let gib = r.memory as f64 / (1u64 << 30) as f64;
        println!(
            "{:>7} {:>5} {:<14} {:>10.1} {:>9} {:>9} {:>10.1} {:>9.1} {:>9.1} {:>9.1} {:>9.2}",
            r.length,
            r.ranks,
            r.label,
            r.p.ttft_s * 1e3,
            fmt(vs_full),
            fmt(vs_ring),
            ms(|p| p.compute_s),
            ms(|p| p.gemm_s),
            ms(|p| p.comm_s),
            ms(|p| p.exposed_comm_s),
            gib
        );
        let opts = &methods.iter().find(|m| m.0 == r.label).map(|m| m.1.clone()).unwrap_or_default();
        let phases: Vec<String> = r.p.phases.iter().map(|p| format!("{}={:.2}", p.phase, p.total_s * 1e3)).collect();
        csv.push_str(&format!(
            "{},{},{},{},{},{},{},{},{:.2},{},{},{:.2},{:.2},{:.2},{:.2},{:.2},{:.3},{}\n",
            t.shape.name,
            a.target,
            a.link,
            opts.method.name(),
            opts.effective_ratio(),
            a.scope.name(),
            r.ranks,
            r.length,
            r.p.ttft_s * 1e3,
            vs_full.map_or(String::new(), |v| format!("{v:.3}")),
            vs_ring.map_or(String::new(), |v| format!("{v:.3}")),
            ms(|p| p.compute_s),
            ms(|p| p.gemm_s),
            ms(|p| p.attention_s),
            ms(|p| p.comm_s),
            ms(|p| p.exposed_comm_s),
            gib,
            phases.join(" ")
        ));
    }
    csv
}

/// `--compare`: published cells beside their projections.
fn compare(t: &Target<'_>, methods: &[(String, RunOptions)], cells: &str) -> Result<()> {
    let cells = parse_cells(cells, "--compare")?;
    println!("\npublished vs projected{}:", if t.scale != 1.0 { " (after the calibration above)" } else { "" });
    println!(
        "{:<14} {:>5} {:>7} {:>12} {:>12} {:>8}",
        "method", "ranks", "length", "published ms", "projected ms", "ratio"
    );
    for (m, p, n, ms) in cells {
        let projected = cell_label(methods, &m)
            .map(|(_, opts)| t.project(opts, p, n, t.scale))
            .transpose()?
            .map(|x| x.ttft_s * 1e3);
        match projected {
            Some(pr) => println!("{m:<14} {p:>5} {n:>7} {ms:>12.1} {pr:>12.1} {:>7.2}x", pr / ms),
            None => println!("{m:<14} {p:>5} {n:>7} {ms:>12.1} {:>12} {:>8}", "(not in --methods)", "-"),
        }
    }
    Ok(())
}

/// The TTFT and speedup charts (against single-rank full prefill), per method and rank count,
/// with the published cells of --compare as their own series; the files drawn.
fn charts(t: &Target<'_>, methods: &[(String, RunOptions)], ranks: &[usize], rows: &[Row]) -> Result<Vec<String>> {
    use flowprefill_lab::plot::{line_chart_log, written, Series};
    let full_label = label_of(methods, Method::Full);
    let (mut ttft, mut speed) = (Vec::new(), Vec::new());
    for (label, opts) in methods {
        for &p in ranks.iter().filter(|&&p| shown_at(opts, p)) {
            let pts: Vec<&Row> = rows.iter().filter(|r| &r.label == label && r.ranks == p).collect();
            let name = format!("{label} P={p}");
            let points = pts.iter().map(|r| (r.length as f64, r.p.ttft_s * 1e3)).collect();
            ttft.push(Series { name: name.clone(), points });
            if let Some(f) = &full_label {
                let s: Vec<(f64, f64)> = pts
                    .iter()
                    .filter_map(|r| find(rows, f, 1, r.length).map(|full| (r.length as f64, full / r.p.ttft_s)))
                    .collect();
                speed.push(Series { name, points: s });
            }
        }
    }
    // Published cells beside the projection (dashed in spirit: their own series).
    if let Some(c) = &t.a.compare {
        let mut published: Vec<Series> = Vec::new();
        for (m, p, n, ms) in parse_cells(c, "--compare")? {
            let name = format!("published {m} P={p}");
            match published.iter_mut().find(|s| s.name == name) {
                Some(s) => s.points.push((n as f64, ms)),
                None => published.push(Series { name, points: vec![(n as f64, ms)] }),
            }
        }
        for s in &mut published {
            s.points.sort_by(|a, b| a.0.total_cmp(&b.0));
        }
        ttft.extend(published);
    }
    let (shape, a) = (&t.shape.name, t.a);
    let title = format!("PROJECTED TTFT, {shape} on {} over {} (not measured)", a.target, a.link);
    let png = a.out.join("projection_ttft.png");
    let drawn = line_chart_log(&png, &title, "context tokens", "TTFT (ms)", &ttft)?;
    let png2 = a.out.join("projection_speedup.png");
    let title2 = format!("PROJECTED speedup over 1-rank full prefill, {shape} on {}", a.target);
    let drawn2 = !speed.is_empty() && line_chart_log(&png2, &title2, "context tokens", "speedup (x)", &speed)?;
    Ok(written(&png, drawn).into_iter().chain(written(&png2, drawn2)).collect())
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
    if lead {
        let device = cpu_device(common, &cfg, &shape, a.seconds, &by)?;
        devices.insert("cpu-local".to_string(), device);
        links.insert("cpu-threads".to_string(), thread_link(a.seconds, &by)?);
    }
    #[cfg(feature = "mpi")]
    if let Some(comm) = mpi.as_mut() {
        if let Some(link) = mpi_link(comm, a.seconds, &by)? {
            links.insert("cpu-mpi".to_string(), link);
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
        let (lat, bw) = link_speed(seconds, &mut |n| {
            flowprefill_comm::all_gather_bytes(&mut *comm, "calibrate", vec![0u8; n])?;
            Ok(())
        })?;
        if comm.world_rank() == 0 {
            eprintln!("  MPI link: latency {:.1} us, {:.2} GB/s", lat * 1e6, bw / 1e9);
            link = Some(Link {
                description: "MPI processes on this machine (shared memory, flowprefill's comm thread)".into(),
                bytes_per_s: c(bw, &format!("all-gather of 1-8 MiB between two MPI ranks, {by}")),
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
