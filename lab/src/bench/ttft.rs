//! `bench ttft`: TTFT against context length per method, rank count and chunk-cache state
//! (cold, in RAM, on disk), each run beside its projection when a device profile is given.

use crate::error::ensure_usage;
use crate::project::{Device as ProjDevice, Link, Shape};
use crate::Result;
use flowprefill_coordinator::{Job, Method, MethodSpec, Request, RunOptions, Scope, World};
use flowprefill_kernels::Device;
use flowprefill_worker::LoadedModel;
use std::path::PathBuf;

/// The CSV's header line.
pub const CSV_HEADER: &str = "length,context_tokens,ranks,method,scope,run,ttft_ms,projected_ms,chunk_prefill_ms,probe_ms,recompute_ms,final_prompt_ms,prefill_ms,bytes_sent,bytes_sent_max,comm_wait_ms,projected_comm_ms,projected_exposed_comm_ms,cache,cache_hits,disk_hits,auto_predicted,projected_phases,ran\n";

/// Where `bench ttft` takes its chunk caches from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Cache {
    /// None held: every chunk prefilled.
    Cold,
    /// Held in RAM from an untimed run.
    Ram,
    /// On disk from an untimed run, RAM emptied.
    Disk,
}

impl Cache {
    /// Its name (as `--cache` writes it).
    pub fn name(self) -> &'static str {
        match self {
            Cache::Cold => "cold",
            Cache::Ram => "ram",
            Cache::Disk => "disk",
        }
    }
}

/// One measured point of `bench ttft`: medians over the runs.
pub struct Point {
    /// Context length asked for.
    pub len: usize,
    /// Ranks.
    pub ranks: usize,
    /// The method (and cache state, unless cold).
    pub label: String,
    /// Median TTFT (ms).
    pub ms: f64,
    /// Context tokens.
    pub n_ctx: usize,
    /// Median projected TTFT (ms), with a projection.
    pub projected: Option<f64>,
}

/// Whether `method` runs on `p` ranks: full is the single-device baseline; a ring of one is full
/// prefill (measured only when ring is the only rank count).
pub fn measured_at(method: Method, p: usize, rank_counts: usize) -> bool {
    !((method == Method::Full && p > 1) || (method == Method::Ring && p == 1 && rank_counts > 1))
}

/// The request of `bench ttft` at `len` tokens, and its context tokens.
pub fn request(lm: &LoadedModel<Device>, len: usize, doc_tokens: usize) -> Result<(Request, usize)> {
    let docs = super::bench_docs(&lm.tokenizer, len, doc_tokens, 11)?;
    let req = Request {
        conversation: Default::default(),
        context: flowprefill_coordinator::Context::Documents(docs),
        query: "What is the access code for the north gate?".into(),
        system: None,
        answer_prefix: None,
    };
    let n_ctx = flowprefill_coordinator::layout::Layout::build(lm, &req)?.n_context();
    let window = lm.model.config().context_length;
    ensure_usage!(n_ctx + 64 < window, "--lengths {len} does not fit the model's window of {window}");
    Ok((req, n_ctx))
}

/// The device and link profiles a projection uses, each with the file it came from.
pub struct Target {
    /// The device profile.
    pub device: ProjDevice,
    /// The link profile.
    pub link: Link,
    /// What the header says: `device NAME (FROM), link NAME (FROM)`, FROM a file or `built in`.
    pub said: String,
}

/// The device `device` and link `link` of the built-in profiles and `files` in order (a later
/// file's profile of a name replaces an earlier one's), and where each came from.
pub fn target(files: &[PathBuf], device: &str, link: &str) -> Result<Target> {
    let mut all = crate::project::Profiles::builtin()?;
    let (mut device_from, mut link_from) = ("built in".to_string(), "built in".to_string());
    for f in files {
        let text = std::fs::read_to_string(f).map_err(crate::error::io_said("reading the profiles", f))?;
        let p = crate::project::Profiles::parse(&f.display().to_string(), &text)?;
        if p.devices.contains_key(device) {
            device_from = f.display().to_string();
        }
        if p.links.contains_key(link) {
            link_from = f.display().to_string();
        }
        all.merge(p);
    }
    Ok(Target {
        device: all.device(device)?.clone(),
        link: all.link(link)?.clone(),
        said: format!("device {device} ({device_from}), link {link} ({link_from})"),
    })
}

/// A cold run reads no chunk cache (its job is `fresh`, and the stores were emptied before
/// it): one that did measured a cache, not a cold prefill, and is an error rather than a row.
pub fn check_cold(cache: Cache, label: &str, r: &flowprefill_coordinator::RunResult) -> Result<()> {
    if cache == Cache::Cold && r.cache_hits > 0 {
        return Err(crate::LabError::Failed(format!(
            "a cold run of {label} read {} chunk caches ({} from the disk tier): the measurement is not cold",
            r.cache_hits, r.cache_disk_hits
        )));
    }
    Ok(())
}

/// The measurement of `bench ttft`: its settings, the projection beside it, the CSV so far.
pub struct Measure {
    /// Timed runs per point (after one untimed warm-up run).
    pub runs: usize,
    /// Recompute ratio of the selective methods.
    pub ratio: f64,
    /// Recompute scope.
    pub scope: Scope,
    /// The shape the projection uses.
    pub shape: Shape,
    /// The device and link projected onto, if any.
    pub projection: Option<(ProjDevice, Link)>,
    /// The disk tier's folder (with `--cache disk`).
    pub disk: Option<PathBuf>,
    /// The CSV so far.
    pub csv: String,
}

impl Measure {
    /// Empties every rank's RAM store, and with `disk` the disk tier's folder too (rank 0
    /// empties it before it starts the next job, which the other ranks wait for).
    fn forget(&self, world: &mut World<Device>, disk: bool) -> Result<()> {
        world.forget_caches()?;
        if let (true, Some(dir), true) = (disk, &self.disk, world.lead()) {
            flowprefill_worker::store::disk::clear(dir).map_err(crate::error::io_plain)?;
        }
        Ok(())
    }

    /// One untimed run from nothing that fills RAM and the disk tier (for `auto`, a job of
    /// `none`: the chunk caches its approximate candidates read, whatever it chooses).
    fn fill(&self, world: &mut World<Device>, job: &Job, method: Method) -> Result<()> {
        self.forget(world, true)?;
        let fill = match method {
            Method::Auto => Job { options: RunOptions { method: Method::None, ..job.options.clone() }, ..job.clone() },
            _ => job.clone(),
        };
        world.run(&fill, &mut |_| true)?;
        Ok(())
    }

    /// Runs `spec` once untimed, then `runs` timed times on the block's `p` ranks with chunk
    /// caches from `cache`; the medians on the leader (and its line for the log).
    #[allow(clippy::too_many_arguments)]
    pub fn point(
        &mut self,
        world: &mut World<Device>,
        req: &Request,
        spec: &MethodSpec,
        cache: Cache,
        len: usize,
        n_ctx: usize,
        p: usize,
        log: &mut dyn FnMut(&str),
    ) -> Result<Option<Point>> {
        let label = match cache {
            Cache::Cold => spec.to_string(),
            c => format!("{spec} {}", c.name()),
        };
        // A cold run reads no cache whatever another process writes (`fresh`), besides the
        // emptied stores.
        let fresh = cache == Cache::Cold;
        let opts = RunOptions { scope: self.scope, max_new_tokens: 1, fresh, ..spec.options(self.ratio) };
        let job = Job { request: req.clone(), options: opts };
        // One untimed run first, which pays the point's one-off costs (buffers sized, pages
        // touched): for `ram` and `disk` the run that fills the caches, else a cold one.
        if cache == Cache::Cold {
            self.forget(world, true)?;
            world.run(&job, &mut |_| true)?;
        } else {
            self.fill(world, &job, spec.method)?;
        }
        let mut ran = String::new();
        let (mut times, mut projected) = (Vec::new(), Vec::new());
        for run in 0..self.runs {
            match cache {
                Cache::Cold => self.forget(world, true)?,
                Cache::Ram => {}
                // RAM empty, the folder kept: what a new process finds.
                Cache::Disk => self.forget(world, false)?,
            }
            let Some(r) = world.run(&job, &mut |_| true)? else { continue };
            check_cold(cache, &label, &r)?;
            let ms = r.ttft.as_secs_f64() * 1e3;
            let proj = self.row(&r, &label, [len, n_ctx, p, run], spec, cache);
            // What ran: the method itself, or what `auto` chose.
            ran = flowprefill_coordinator::auto::label(&r.opts);
            self.csv.push_str(&format!(",{ran}\n"));
            times.push(ms);
            projected.extend(proj);
        }
        if !world.lead() {
            return Ok(None);
        }
        let ms = crate::median(&mut times);
        let pm = (!projected.is_empty()).then(|| crate::median(&mut projected));
        let chose = if spec.method == Method::Auto { format!("  (ran {ran})") } else { String::new() };
        log(&match pm {
            Some(x) => format!("  {len:>5} tokens  P={p}  {label:<18} {ms:>9.1} ms  (projected {x:.1} ms){chose}"),
            None => format!("  {len:>5} tokens  P={p}  {label:<18} {ms:>9.1} ms{chose}"),
        });
        Ok(Some(Point { len, ranks: p, label, ms, n_ctx, projected: pm }))
    }

    /// Writes a run's CSV row (all but its last column, what ran) and returns its projected
    /// TTFT (ms), if projected.
    fn row(
        &mut self,
        r: &flowprefill_coordinator::RunResult,
        label: &str,
        [len, n_ctx, p, run]: [usize; 4],
        spec: &MethodSpec,
        cache: Cache,
    ) -> Option<f64> {
        let ms = r.ttft.as_secs_f64() * 1e3;
        let proj = match &self.projection {
            Some((dev, link)) => crate::project::project_run(r, &self.shape, dev, link)
                .map_err(|e| tracing::warn!(target: "flowprefill::cmd::bench::ttft", %e, "no projection for {label}"))
                .ok(),
            None => None,
        };
        let ph = |n: &str| r.phases.get(n).as_secs_f64() * 1e3;
        // Bytes every rank sent, the busiest rank's, and the longest time a rank waited in
        // collectives (communication not hidden behind its compute, and waiting for others).
        let bytes: u64 = r.rank_stats.iter().map(|s| s.comm.bytes_sent()).sum();
        let bytes_max = r.rank_stats.iter().map(|s| s.comm.bytes_sent()).max().unwrap_or(0);
        let wait_ms = r.rank_stats.iter().map(|s| s.comm.wait_s()).fold(0.0, f64::max) * 1e3;
        let opt = |x: Option<f64>| x.map_or(String::new(), |x| format!("{x:.1}"));
        // `auto`: every candidate's predicted TTFT (`label=ms;...`), to hold against what
        // each method measured in the same cell.
        let predicted = r.auto.as_ref().map_or(String::new(), |c| {
            c.candidates.iter().map(|k| format!("{}={:.1}", k.label, k.ttft_ms)).collect::<Vec<_>>().join(";")
        });
        // The projection phase by phase, to hold against the measured phases beside it:
        // `phase:total:compute:exposed_comm` in ms (the slowest rank's), `;`-separated.
        let phases = proj.as_ref().map_or(String::new(), |p| {
            let ms = |s: f64| format!("{:.1}", s * 1e3);
            p.phases
                .iter()
                .map(|t| format!("{}:{}:{}:{}", t.phase, ms(t.total_s), ms(t.compute_s), ms(t.exposed_comm_s)))
                .collect::<Vec<_>>()
                .join(";")
        });
        self.csv.push_str(&format!(
            "{len},{n_ctx},{p},{spec},{},{run},{ms:.1},{},{:.1},{:.1},{:.1},{:.1},{:.1},{bytes},{bytes_max},{wait_ms:.1},{},{},{},{},{},{predicted},{phases}",
            self.scope.name(),
            opt(proj.as_ref().map(|p| p.ttft_s * 1e3)),
            ph("chunk_prefill"),
            ph("probe"),
            ph("recompute"),
            ph("final_prompt"),
            ph("prefill"),
            opt(proj.as_ref().map(|p| p.sum(|t| t.comm_s) * 1e3)),
            opt(proj.as_ref().map(|p| p.sum(|t| t.exposed_comm_s) * 1e3)),
            cache.name(),
            r.cache_hits,
            r.cache_disk_hits
        ));
        proj.map(|p| p.ttft_s * 1e3)
    }
}

/// The table of `bench ttft`, with speedups against single-rank full prefill and ring at the
/// same rank count (one line each, newline-terminated).
pub fn table(points: &[Point]) -> String {
    // Full and ring read no chunk cache: their rows under `--cache ram` or `disk` (labelled
    // `full ram`, ...) are baselines too, the cold one first where there is one.
    let base = |l: &str| l.split(' ').next().unwrap_or(l).to_string();
    let find = |len: usize, p: usize, label: &str| {
        let at = |m: &&Point| m.len == len && m.ranks == p;
        let cold = points.iter().filter(at).find(|m| m.label == label);
        cold.or_else(|| points.iter().filter(at).find(|m| base(&m.label) == label)).map(|m| m.ms)
    };
    let mut out = format!(
        "{:>7} {:>6} {:>5} {:<18} {:>11} {:>10} {:>10} {:>13} {:>8}\n",
        "length", "tokens", "ranks", "method", "TTFT ms", "vs full@1", "vs ring@P", "projected ms", "proj/meas"
    );
    for Point { len, ranks: p, label, ms, n_ctx, projected: pm } in points {
        let vs_full = find(*len, 1, "full").map_or("-".to_string(), |f| format!("{:.2}x", f / ms));
        let vs_ring = find(*len, *p, "ring").map_or("-".to_string(), |r| format!("{:.2}x", r / ms));
        let (proj, ratio) =
            pm.map_or(("-".to_string(), "-".to_string()), |x| (format!("{x:.1}"), format!("{:.2}", x / ms)));
        out.push_str(&format!(
            "{len:>7} {n_ctx:>6} {p:>5} {label:<18} {ms:>11.1} {vs_full:>10} {vs_ring:>10} {proj:>13} {ratio:>8}\n"
        ));
    }
    out
}

/// One chart line per method (and cache) and rank count: TTFT (s) against context tokens.
pub fn series(points: &[Point], ranks: &[usize]) -> Vec<crate::plot::Series> {
    let mut series = Vec::new();
    for &p in ranks {
        let mut labels: Vec<&str> = Vec::new();
        for m in points.iter().filter(|m| m.ranks == p) {
            if !labels.contains(&m.label.as_str()) {
                labels.push(&m.label);
            }
        }
        for label in labels {
            let pts: Vec<(f64, f64)> = points
                .iter()
                .filter(|m| m.ranks == p && m.label == label)
                .map(|m| (m.n_ctx as f64, m.ms / 1e3))
                .collect();
            if !pts.is_empty() {
                series.push(crate::plot::Series { name: format!("{label} P={p}"), points: pts });
            }
        }
    }
    series
}

/// The chart of the points (`ttft.png` in `out`, titled for `world`) and the files written
/// with the CSV at `csv_path`.
pub fn chart(
    points: &[Point],
    ranks: &[usize],
    out: &std::path::Path,
    world: &str,
    csv_path: &std::path::Path,
) -> Result<Vec<String>> {
    let png = out.join("ttft.png");
    // Drawn beside it, then renamed over it: a failed drawing leaves the last chart.
    let tmp = out.join(".ttft.tmp.png");
    let title = format!("TTFT vs context length ({world})");
    let drawn = crate::plot::line_chart(&tmp, &title, "context tokens", "TTFT (s)", &series(points, ranks))?;
    if drawn {
        std::fs::rename(&tmp, &png).map_err(crate::error::io("renaming the chart to", &png))?;
    }
    Ok(std::iter::once(csv_path.display().to_string()).chain(crate::plot::written(&png, drawn)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn speedups_find_full_and_ring_under_a_warm_cache_too() {
        let pt = |ranks: usize, label: &str, ms: f64| Point {
            len: 1024,
            ranks,
            label: label.into(),
            ms,
            n_ctx: 1000,
            projected: None,
        };
        let points = [pt(1, "full ram", 400.0), pt(2, "ring ram", 300.0), pt(2, "infoflow ram", 100.0)];
        let t = table(&points);
        let line = t.lines().find(|l| l.contains("infoflow ram")).unwrap();
        assert!(line.contains("4.00x") && line.contains("3.00x"), "{t}");
    }
}
