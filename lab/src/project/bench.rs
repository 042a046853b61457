//! `bench project`: projected TTFT per method, rank count and length on a device and link
//! profile (table, CSV and charts), and the profile files the projection reads.

use super::{plan, Cost, Device, Link, Profiles, Projection, Request, Shape};
use crate::error::{ensure_usage, io_plain, io_said};
use crate::Result;
use flowprefill_coordinator::{memory, Method, MethodSpec, RunOptions, RunResult, Scope};
use flowprefill_kernels::DType;
use std::path::PathBuf;

/// The built-in profiles plus the files given.
pub fn load_profiles(files: &[PathBuf]) -> Result<Profiles> {
    let mut p = Profiles::builtin()?;
    for f in files {
        let text = std::fs::read_to_string(f).map_err(io_said("reading --profiles", f))?;
        p.merge(Profiles::parse(&f.display().to_string(), &text)?);
    }
    Ok(p)
}

/// The device `target` and link `link` of the built-in profiles and `files` (the link by
/// default: `cpu-mpi` with MPI ranks, else `cpu-threads`).
pub fn target(files: &[PathBuf], target: &str, link: Option<&str>, mpi: bool) -> Result<(Device, Link)> {
    let profiles = load_profiles(files)?;
    let link = link.unwrap_or(if mpi { "cpu-mpi" } else { "cpu-threads" });
    Ok((profiles.device(target)?.clone(), profiles.link(link)?.clone()))
}

/// Projection of a finished run (what `bench ttft --project` prints beside the measurement).
pub fn project_run(
    r: &RunResult,
    shape: &Shape,
    dev: &Device,
    link: &Link,
) -> std::result::Result<Projection, super::ProjectError> {
    let req = Request::of_run(r);
    let work = plan(shape, &r.opts, r.ranks, &req, r.kv_bytes)?;
    Ok(super::project(&work, shape, dev, link, 1.0))
}

/// What `bench project` is asked for.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Device profile name.
    pub target: String,
    /// Link profile name.
    pub link: String,
    /// Rank counts.
    pub ranks: Vec<usize>,
    /// Context lengths.
    pub lengths: Vec<usize>,
    /// Methods (`NAME[@RATIO]`, comma-separated).
    pub methods: String,
    /// Recompute scope.
    pub scope: Scope,
    /// Tokens per document.
    pub doc_tokens: usize,
    /// Template tokens before the context.
    pub head_tokens: usize,
    /// Question and template tokens after the context.
    pub prompt_tokens: usize,
    /// One published cell to calibrate the compute efficiency on.
    pub calibrate: Option<String>,
    /// Published cells to show beside the projection.
    pub compare: Option<String>,
    /// Output folder.
    pub out: PathBuf,
}

/// A projected method: label, options (`NAME[@RATIO]`; a selecting method's ratio defaults to 0.15).
fn parse_methods(list: &str, scope: Scope) -> Result<Vec<(String, RunOptions)>> {
    let mut out = Vec::new();
    for spec in MethodSpec::parse_list(list)? {
        ensure_usage!(
            spec.method.info().projected && !spec.reorder,
            "--methods: the projection covers {}, not {spec}",
            {
                let covered = Method::ALL.iter().filter(|m| m.info().projected);
                covered
                    .map(|m| if m.selects() { format!("{m}[@ratio]") } else { m.to_string() })
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        );
        let spec = if spec.method.selects() { spec.at(spec.ratio.unwrap_or(0.15)) } else { spec };
        out.push((spec.to_string(), RunOptions { scope, max_new_tokens: 1, ..spec.options(0.15) }));
    }
    Ok(out)
}

/// A published cell: method, ranks, length, milliseconds.
type Cell = (String, usize, usize, f64);

/// `METHOD,RANKS,LENGTH,MS` cells.
fn parse_cells(s: &str, flag: &str) -> Result<Vec<Cell>> {
    s.split(';')
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .map(|c| {
            let f: Vec<&str> = c.split(',').map(str::trim).collect();
            let bad = || {
                crate::LabError::Usage(format!("{flag} `{c}`: write METHOD,RANKS,LENGTH,MS (e.g. full,1,8192,566.7)"))
            };
            if f.len() != 4 {
                return Err(bad());
            }
            let (ranks, length, ms): (usize, usize, f64) =
                (f[1].parse().map_err(|_| bad())?, f[2].parse().map_err(|_| bad())?, f[3].parse().map_err(|_| bad())?);
            // A cell of no ranks, no tokens or no time would scale the projection to nonsense.
            if ranks == 0 || length == 0 || !(ms > 0.0 && ms.is_finite()) {
                return Err(crate::LabError::Usage(format!(
                    "{flag} `{c}`: RANKS and LENGTH must be at least 1 and MS a positive number of milliseconds"
                )));
            }
            Ok((f[0].to_string(), ranks, length, ms))
        })
        .collect()
}

/// Which method label a published cell's method name means.
fn cell_label<'a>(methods: &'a [(String, RunOptions)], name: &str) -> Option<&'a (String, RunOptions)> {
    let name = name.to_ascii_lowercase();
    methods.iter().find(|(l, o)| *l == name || o.method.name() == name)
}

/// One projected cell.
struct Row {
    label: String,
    ranks: usize,
    length: usize,
    p: Projection,
    /// The job's planned memory on its busiest rank (bytes; weights not included).
    memory: usize,
}

/// What `bench project` projects onto: a shape, a device and a link, documents of a size.
struct Target {
    shape: Shape,
    dev: Device,
    link: Link,
    a: Settings,
    /// One global compute efficiency (1 unless calibrated on a measured cell).
    scale: f64,
}

impl Target {
    /// The request of `n` context tokens in documents of --doc-tokens.
    fn request(&self, n: usize) -> Request {
        Request::documents(n, self.a.doc_tokens, self.a.head_tokens, self.a.prompt_tokens)
    }

    /// Projected TTFT of `opts` on `p` ranks at `n` tokens under compute efficiency `scale`.
    fn project(&self, opts: &RunOptions, p: usize, n: usize, scale: f64) -> Result<Projection> {
        let work = plan(&self.shape, opts, p, &self.request(n), self.dev.kv_bytes.value.round() as usize)?;
        Ok(super::project(&work, &self.shape, &self.dev, &self.link, scale))
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
        let target = memory::Target {
            kv: self.kv(),
            act: self.act(),
            scratch: Box::new(flowprefill_kernels::gpu_scratch_bytes),
            prefill_rows: flowprefill_kernels::GPU_PREFILL_ROWS,
            gathered_keys: flowprefill_kernels::GPU_GATHERED_KEYS,
        };
        let plans = memory::plan(&self.shape, &target, opts, p, &tokens);
        plans.iter().map(memory::RankMemory::bytes).max().unwrap_or(0)
    }

    /// Weights per rank (every rank holds the whole model), untied embeddings assumed.
    fn weights(&self) -> f64 {
        let s = &self.shape;
        (s.n_layers as f64 * s.layer_params() + 2.0 * (s.vocab_size * s.d_model) as f64) * self.dev.weight_bytes.value
    }

    /// The compute efficiency that makes one measured cell's projection match it (TTFT falls
    /// monotonically with the scale: bisection on a log scale), and the line that says so.
    fn calibrate(&self, methods: &[(String, RunOptions)], cell: &str) -> Result<(f64, String)> {
        let cells = parse_cells(cell, "--calibrate")?;
        ensure_usage!(cells.len() == 1, "--calibrate takes exactly one cell");
        let (m, p, n, ms) = &cells[0];
        let (_, opts) = cell_label(methods, m)
            .ok_or_else(|| crate::LabError::Usage(format!("--calibrate: method {m} is not among --methods")))?;
        let (mut lo, mut hi) = (1e-3f64, 1e3f64);
        // A cell the projection cannot reach at any scale in range (its communication alone
        // above it, or slower than even a thousandth of the efficiency) would leave the scale at
        // a bound and every figure of the table scaled by it.
        let (fastest, slowest) =
            (self.project(opts, *p, *n, hi)?.ttft_s * 1e3, self.project(opts, *p, *n, lo)?.ttft_s * 1e3);
        ensure_usage!(
            (fastest..=slowest).contains(ms),
            "--calibrate {m},{p},{n},{ms}: the projection cannot reach {ms} ms at any compute efficiency from 1/1000 \
             to 1000 times the profile's ({fastest:.1} to {slowest:.1} ms: below that is communication and memory \
             traffic); check the cell, --target and --link"
        );
        for _ in 0..100 {
            let mid = (lo * hi).sqrt();
            if self.project(opts, *p, *n, mid)?.ttft_s * 1e3 > *ms {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        let scale = (lo * hi).sqrt();
        let line = format!(
            "calibrated on {m} P={p} {n} tokens = {ms} ms: compute efficiency x {scale:.3} \
             (GEMM at large M: {:.1}% of peak, attention at long sequences: {:.1}%)",
            100.0 * scale * self.dev.gemm_efficiency.at(4096.0),
            100.0 * scale * self.dev.attention_efficiency.at(8192.0)
        );
        Ok((scale, line))
    }
}

/// Whether `opts` runs on `p` ranks in a table: full is the single-device baseline; a ring of
/// one is full prefill.
fn shown_at(opts: &RunOptions, p: usize) -> bool {
    !((opts.method == Method::Full && p > 1) || (opts.method == Method::Ring && p == 1))
}

/// `bench project --list`: the shapes, devices and links (newline-terminated lines).
pub fn list(profiles: &Profiles) -> String {
    let mut s = String::from("shapes (built in; or any GGUF with --model):\n");
    for n in super::shape::builtin_names() {
        s.push_str(&format!("  {n:<16} {}\n", super::shape::builtin_source(n).unwrap_or("")));
    }
    s.push_str("devices (--target):\n");
    for (n, d) in &profiles.devices {
        s.push_str(&format!("  {n:<16} {}\n", d.description));
    }
    s.push_str("links (--link):\n");
    for (n, l) in &profiles.links {
        s.push_str(&format!("  {n:<16} {}\n", l.description));
    }
    s
}

/// The projection of every cell: what to print, and what to write.
pub struct Projected {
    /// The calibration line (with --calibrate), the table, and the comparison (with --compare):
    /// newline-terminated lines.
    pub text: String,
    target: Target,
    methods: Vec<(String, RunOptions)>,
    rows: Vec<Row>,
    csv: String,
}

/// Projects every method, rank count and length of `a` for `shape` on `profiles`.
pub fn project_grid(a: Settings, shape: Shape, profiles: &Profiles) -> Result<Projected> {
    ensure_usage!(!a.ranks.is_empty() && a.ranks.iter().all(|&r| r >= 1), "--ranks values must be at least 1");
    ensure_usage!(!a.lengths.is_empty() && a.lengths.iter().all(|&n| n >= 1), "--lengths values must be positive");
    ensure_usage!(a.doc_tokens >= 1, "--doc-tokens must be at least 1");
    crate::each_once("--ranks", "rank count", &a.ranks)?;
    crate::each_once("--lengths", "length", &a.lengths)?;
    let methods = parse_methods(&a.methods, a.scope)?;
    ensure_usage!(!methods.is_empty(), "--methods names no method");
    let (dev, link) = (profiles.device(&a.target)?.clone(), profiles.link(&a.link)?.clone());
    let mut t = Target { shape, dev, link, a, scale: 1.0 };
    let mut text = String::new();
    if let Some(c) = t.a.calibrate.clone() {
        let (scale, line) = t.calibrate(&methods, &c)?;
        t.scale = scale;
        text.push_str(&line);
        text.push('\n');
    }
    ensure_usage!(
        t.a.ranks.iter().any(|&p| methods.iter().any(|m| shown_at(&m.1, p))),
        "nothing to project: full runs on 1 rank and ring on 2 or more; give --ranks with such a count for --methods"
    );
    let mut rows = Vec::new();
    for &n in &t.a.lengths {
        for &p in &t.a.ranks {
            for (label, opts) in methods.iter().filter(|m| shown_at(&m.1, p)) {
                let memory = t.memory(opts, p, n);
                let projected = t.project(opts, p, n, t.scale)?;
                rows.push(Row { label: label.clone(), ranks: p, length: n, p: projected, memory });
            }
        }
    }
    let csv = table(&t, &methods, &rows, &mut text);
    if let Some(c) = &t.a.compare {
        compare(&t, &methods, c, &mut text)?;
    }
    Ok(Projected { text, target: t, methods, rows, csv })
}

impl Projected {
    /// Writes projection.csv and the charts into the output folder; the files written.
    pub fn write(&self) -> Result<Vec<String>> {
        let out = &self.target.a.out;
        std::fs::create_dir_all(out).map_err(io_said("creating", out))?;
        let csv_path = out.join("projection.csv");
        std::fs::write(&csv_path, &self.csv).map_err(io_plain)?;
        let charts = charts(&self.target, &self.methods, &self.rows)?;
        Ok(std::iter::once(csv_path.display().to_string()).chain(charts).collect())
    }
}

/// Projected TTFT of row `label` on `p` ranks at `n` tokens.
fn find(rows: &[Row], label: &str, p: usize, n: usize) -> Option<f64> {
    rows.iter().find(|r| r.label == label && r.ranks == p && r.length == n).map(|r| r.p.ttft_s)
}

/// The label of the first method of a kind among `methods`.
fn label_of(methods: &[(String, RunOptions)], method: Method) -> Option<String> {
    methods.iter().find(|m| m.1.method == method).map(|m| m.0.clone())
}

/// Writes the table (with its title and the memory line) to `text` and returns the CSV.
fn table(t: &Target, methods: &[(String, RunOptions)], rows: &[Row], text: &mut String) -> String {
    let a = &t.a;
    let (ring_label, full_label) = (label_of(methods, Method::Ring), label_of(methods, Method::Full));
    text.push_str(&format!(
        "PROJECTED TTFT (not measured): {} on {} x N (N: the ranks column) over {}, {} scope, {}-token documents{}\n",
        t.shape.name,
        a.target,
        a.link,
        a.scope.name(),
        a.doc_tokens,
        if t.scale != 1.0 { format!(", compute efficiency x {:.3}", t.scale) } else { String::new() }
    ));
    text.push_str(&format!(
        "memory per rank: weights {:.1} GiB, plus the job's planned peak (GiB/rank: K/V at {} bytes, the \
         largest forward, scratch; coordinator/src/memory.rs)\n",
        t.weights() / (1u64 << 30) as f64,
        t.kv().size()
    ));
    text.push_str(&format!(
        "{:>7} {:>5} {:<14} {:>10} {:>9} {:>9} {:>10} {:>9} {:>9} {:>9} {:>9}\n",
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
    ));
    let mut csv = String::from(
        "shape,target,link,method,ratio,scope,ranks,length,ttft_ms,speedup_vs_full1,speedup_vs_ring,compute_ms,gemm_ms,attention_ms,comm_ms,exposed_comm_ms,job_memory_gib_per_rank,phases\n",
    );
    for r in rows {
        let vs_full = full_label.as_deref().and_then(|f| find(rows, f, 1, r.length)).map(|f| f / r.p.ttft_s);
        let vs_ring = ring_label.as_deref().and_then(|g| find(rows, g, r.ranks, r.length)).map(|g| g / r.p.ttft_s);
        let fmt = |v: Option<f64>| v.map_or("-".to_string(), |x| format!("{x:.2}x"));
        let ms = |f: fn(&super::time::PhaseTime) -> f64| r.p.sum(f) * 1e3;
        text.push_str(&format!(
            "{:>7} {:>5} {:<14} {:>10.1} {:>9} {:>9} {:>10.1} {:>9.1} {:>9.1} {:>9.1} {:>9.2}\n",
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
            r.memory as f64 / (1u64 << 30) as f64
        ));
        csv.push_str(&csv_line(t, methods, r, vs_full, vs_ring));
    }
    csv
}

/// A row's CSV line.
fn csv_line(
    t: &Target,
    methods: &[(String, RunOptions)],
    r: &Row,
    vs_full: Option<f64>,
    vs_ring: Option<f64>,
) -> String {
    let a = &t.a;
    let ms = |f: fn(&super::time::PhaseTime) -> f64| r.p.sum(f) * 1e3;
    let opts = &methods.iter().find(|m| m.0 == r.label).map(|m| m.1.clone()).unwrap_or_default();
    let phases: Vec<String> = r.p.phases.iter().map(|p| format!("{}={:.2}", p.phase, p.total_s * 1e3)).collect();
    format!(
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
        r.memory as f64 / (1u64 << 30) as f64,
        phases.join(" ")
    )
}

/// `--compare`: published cells beside their projections, written to `text`.
fn compare(t: &Target, methods: &[(String, RunOptions)], cells: &str, text: &mut String) -> Result<()> {
    let cells = parse_cells(cells, "--compare")?;
    text.push_str(&format!(
        "\npublished vs projected{}:\n",
        if t.scale != 1.0 { " (after the calibration above)" } else { "" }
    ));
    text.push_str(&format!(
        "{:<14} {:>5} {:>7} {:>12} {:>12} {:>8}\n",
        "method", "ranks", "length", "published ms", "projected ms", "ratio"
    ));
    for (m, p, n, ms) in cells {
        let projected = cell_label(methods, &m)
            .map(|(_, opts)| t.project(opts, p, n, t.scale))
            .transpose()?
            .map(|x| x.ttft_s * 1e3);
        text.push_str(&match projected {
            Some(pr) => format!("{m:<14} {p:>5} {n:>7} {ms:>12.1} {pr:>12.1} {:>7.2}x\n", pr / ms),
            None => format!("{m:<14} {p:>5} {n:>7} {ms:>12.1} {:>12} {:>8}\n", "(not in --methods)", "-"),
        });
    }
    Ok(())
}

/// The published cells of --compare as chart series (one per method and rank count).
fn published(cells: &str) -> Result<Vec<crate::plot::Series>> {
    let mut published: Vec<crate::plot::Series> = Vec::new();
    for (m, p, n, ms) in parse_cells(cells, "--compare")? {
        let name = format!("published {m} P={p}");
        match published.iter_mut().find(|s| s.name == name) {
            Some(s) => s.points.push((n as f64, ms)),
            None => published.push(crate::plot::Series { name, points: vec![(n as f64, ms)] }),
        }
    }
    for s in &mut published {
        s.points.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    Ok(published)
}

/// The TTFT and speedup charts (against single-rank full prefill), per method and rank count,
/// with the published cells of --compare as their own series; the files drawn.
fn charts(t: &Target, methods: &[(String, RunOptions)], rows: &[Row]) -> Result<Vec<String>> {
    use crate::plot::{line_chart_log, written, Series};
    let full_label = label_of(methods, Method::Full);
    let (mut ttft, mut speed) = (Vec::new(), Vec::new());
    for (label, opts) in methods {
        for &p in t.a.ranks.iter().filter(|&&p| shown_at(opts, p)) {
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
        ttft.extend(published(c)?);
    }
    let (shape, a) = (&t.shape.name, &t.a);
    let title = format!("PROJECTED TTFT, {shape} on {} over {} (not measured)", a.target, a.link);
    let png = a.out.join("projection_ttft.png");
    let drawn = line_chart_log(&png, &title, "context tokens", "TTFT (ms)", &ttft)?;
    let png2 = a.out.join("projection_speedup.png");
    let title2 = format!("PROJECTED speedup over 1-rank full prefill, {shape} on {}", a.target);
    let drawn2 = !speed.is_empty() && line_chart_log(&png2, &title2, "context tokens", "speedup (x)", &speed)?;
    Ok(written(&png, drawn).into_iter().chain(written(&png2, drawn2)).collect())
}
