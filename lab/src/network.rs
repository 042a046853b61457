//! The network study's report (`flowprefill bench network DIR`, after
//! `scripts/network-study.sh DIR`): `bench ttft` measured across hosts at several link rates,
//! each cell beside the projection for the same link, as one table, one CSV and one chart of
//! TTFT against link rate per method.
//!
//! The folder, as the study script writes it:
//! ```text
//! DIR/links/hosts-RATE.json                  the link profile measured across two hosts
//! DIR/full/LEN/ttft.csv                      full prefill on one host
//! DIR/N-hosts/RATE/LEN/{exact,sparse}/ttft.csv   ring and InfoFlow on N hosts
//! ```
//!
//! Where the cells carry the projection phase by phase (`projected_phases`), the report also
//! writes `network-phases.csv` and a second table in `network.md`: each phase measured against
//! projected, to show where a cell's projection error comes from.

use crate::error::{io, LabError, Result};
use crate::plot::{line_chart_log, Series};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// One cell of the study: a method on some hosts over one link at one length (medians).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Cell {
    /// Hosts (one rank each); 1 for full prefill.
    pub hosts: usize,
    /// The link's name (`unshaped`, `1gbit`, ...; `-` for one host).
    pub rate: String,
    /// The link's bandwidth as `bench calibrate` measured it both ways at once, bytes/s
    /// (`None`: one host).
    pub link_bytes_per_s: Option<f64>,
    /// The same one way (a single flow), bytes/s.
    pub link_one_way_bytes_per_s: Option<f64>,
    /// Requested context length.
    pub length: usize,
    /// `full`, `ring`, `infoflow exact`, `infoflow sparse`.
    pub method: String,
    /// Runs behind the medians.
    pub runs: usize,
    /// Median TTFT, ms.
    pub ttft_ms: f64,
    /// Median bytes the busiest rank sent.
    pub bytes_max: f64,
    /// Median of the longest time a rank waited in collectives, ms.
    pub comm_wait_ms: f64,
    /// Median projected TTFT for the same link, ms.
    pub projected_ms: Option<f64>,
    /// Median projected communication (overlapped or not), ms.
    pub projected_comm_ms: Option<f64>,
    /// The projection phase by phase against the measured phases (from `projected_phases`;
    /// empty for a `ttft.csv` written before it).
    pub phases: Vec<PhaseCheck>,
}

/// One phase of a cell, measured against projected: medians over the cell's runs, ms.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct PhaseCheck {
    /// `chunk_prefill`, `probe`, `recompute`, `final_prompt`, or `prefill` (ring, full).
    pub phase: String,
    /// Measured (the phase's wall time, the `{phase}_ms` column).
    pub measured_ms: f64,
    /// Projected, the slowest rank's.
    pub projected_ms: f64,
    /// Of which compute.
    pub projected_compute_ms: f64,
    /// Of which communication not hidden behind compute.
    pub projected_exposed_comm_ms: f64,
}

impl PhaseCheck {
    /// (projected - measured) / measured (`None` for a phase measured at 0).
    pub fn error(&self) -> Option<f64> {
        (self.measured_ms > 0.0).then(|| (self.projected_ms - self.measured_ms) / self.measured_ms)
    }
}

/// The phases of a cell's runs: each `projected_phases` entry (`phase:total:compute:exposed`)
/// beside the run's measured `{phase}_ms`, as medians per phase in the projection's order.
fn phase_checks(path: &Path, rows: &[BTreeMap<String, String>]) -> Result<Vec<PhaseCheck>> {
    let mut order: Vec<String> = Vec::new();
    let mut values: BTreeMap<String, [Vec<f64>; 4]> = BTreeMap::new();
    for row in rows {
        let Some(text) = row.get("projected_phases").filter(|t| !t.is_empty()) else { continue };
        for entry in text.split(';') {
            let parts: Vec<&str> = entry.split(':').collect();
            let nums: Option<Vec<f64>> = parts.get(1..).map(|p| p.iter().filter_map(|v| v.parse().ok()).collect());
            let (Some(name), Some(nums)) = (parts.first(), nums.filter(|n| n.len() == 3 && parts.len() == 4)) else {
                return Err(bad(
                    path,
                    format!("`projected_phases` entry {entry:?} is not phase:total:compute:exposed"),
                ));
            };
            let measured = match row.get(&format!("{name}_ms")).map(|v| v.parse::<f64>()) {
                Some(Ok(m)) => m,
                _ => return Err(bad(path, format!("no measured `{name}_ms` beside its projection"))),
            };
            if !order.iter().any(|o| o == name) {
                order.push(name.to_string());
            }
            let v = values.entry(name.to_string()).or_default();
            for (i, x) in [measured, nums[0], nums[1], nums[2]].into_iter().enumerate() {
                v[i].push(x);
            }
        }
    }
    Ok(order
        .into_iter()
        .filter_map(|name| {
            let mut v = values.remove(&name)?;
            let mut med = |i: usize| crate::median(&mut v[i]);
            Some(PhaseCheck {
                measured_ms: med(0),
                projected_ms: med(1),
                projected_compute_ms: med(2),
                projected_exposed_comm_ms: med(3),
                phase: name,
            })
        })
        .collect())
}

impl Cell {
    /// (projected - measured) / measured.
    pub fn projection_error(&self) -> Option<f64> {
        self.projected_ms.map(|p| (p - self.ttft_ms) / self.ttft_ms)
    }
}

fn bad(path: &Path, detail: impl Into<String>) -> LabError {
    LabError::Study { path: path.to_path_buf(), detail: detail.into() }
}

/// The rows of one `ttft.csv`, grouped by method label (with the scope for InfoFlow), each a
/// list of (column -> value) maps.
type Runs = BTreeMap<String, Vec<BTreeMap<String, String>>>;

fn read_ttft(path: &Path) -> Result<Runs> {
    let text = std::fs::read_to_string(path).map_err(io("reading", path))?;
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().ok_or_else(|| bad(path, "empty file"))?.split(',').collect();
    for need in ["method", "scope", "ttft_ms", "bytes_sent_max", "comm_wait_ms", "projected_ms"] {
        if !header.contains(&need) {
            return Err(bad(
                path,
                format!("no column `{need}` (a ttft.csv from an older flowprefill? run the study again)"),
            ));
        }
    }
    let mut out = Runs::new();
    for (i, line) in lines.enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let vals: Vec<&str> = line.split(',').collect();
        if vals.len() != header.len() {
            return Err(bad(path, format!("line {} has {} fields, the header {}", i + 2, vals.len(), header.len())));
        }
        let row: BTreeMap<String, String> =
            header.iter().zip(&vals).map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let label = match row["method"].as_str() {
            m @ ("full" | "ring") => m.to_string(),
            m => format!("{m} {}", row["scope"]),
        };
        out.entry(label).or_default().push(row);
    }
    one_cell(path, &out)?;
    Ok(out)
}

/// A study's `ttft.csv` is one cell: one length, one rank count, cold chunk caches. Rows of
/// another length, rank count or cache state would be pooled into the cell's medians (a RAM
/// hit's TTFT beside a cold prefill's), so such a file is refused, saying what to do.
fn one_cell(path: &Path, runs: &Runs) -> Result<()> {
    let rows = || runs.values().flatten();
    for (col, what) in [("length", "context length"), ("ranks", "rank count")] {
        let mut seen: Vec<&str> = rows().filter_map(|r| r.get(col).map(String::as_str)).collect();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() > 1 {
            return Err(bad(
                path,
                format!(
                    "rows of more than one {what} ({col} {}): a study cell is one `bench ttft` run with one \
                     --lengths and one --ranks; split the file or run the study again into a fresh folder",
                    seen.join(", ")
                ),
            ));
        }
    }
    if let Some(c) = rows().filter_map(|r| r.get("cache")).find(|c| !c.is_empty() && c.as_str() != "cold") {
        return Err(bad(
            path,
            format!(
                "rows with chunk caches `{c}`: the study measures cold prefill only; run its cells with \
                 --cache cold (the default) or drop the other rows"
            ),
        ));
    }
    Ok(())
}

fn cell(
    path: &Path,
    hosts: usize,
    rate: &str,
    link: Rates,
    length: usize,
    method: &str,
    rows: &[BTreeMap<String, String>],
) -> Result<Cell> {
    let num = |row: &BTreeMap<String, String>, k: &str| -> Result<Option<f64>> {
        match row.get(k).map(String::as_str) {
            None | Some("") => Ok(None),
            Some(v) => v.parse().map(Some).map_err(|_| bad(path, format!("`{k}` is not a number: {v:?}"))),
        }
    };
    let col = |k: &str| -> Result<Vec<f64>> {
        Ok(rows.iter().map(|r| num(r, k)).collect::<Result<Vec<_>>>()?.into_iter().flatten().collect())
    };
    let opt = |mut v: Vec<f64>| (!v.is_empty()).then(|| crate::median(&mut v));
    let mut ttft = col("ttft_ms")?;
    if ttft.is_empty() {
        return Err(bad(path, format!("no TTFT for {method}")));
    }
    Ok(Cell {
        hosts,
        rate: rate.to_string(),
        link_bytes_per_s: link.both,
        link_one_way_bytes_per_s: link.one_way,
        length,
        method: method.to_string(),
        runs: ttft.len(),
        ttft_ms: crate::median(&mut ttft),
        bytes_max: crate::median(&mut col("bytes_sent_max")?),
        comm_wait_ms: crate::median(&mut col("comm_wait_ms")?),
        projected_ms: opt(col("projected_ms")?),
        projected_comm_ms: opt(col("projected_comm_ms")?),
        phases: phase_checks(path, rows)?,
    })
}

fn subdirs(dir: &Path) -> Result<Vec<(String, PathBuf)>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).map_err(io("reading", dir))? {
        let e = e.map_err(io("reading", dir))?;
        if e.path().is_dir() {
            out.push((e.file_name().to_string_lossy().into_owned(), e.path()));
        }
    }
    out.sort();
    Ok(out)
}

/// A link's measured bandwidths, bytes/s.
#[derive(Clone, Copy, Default)]
struct Rates {
    both: Option<f64>,
    one_way: Option<f64>,
}

/// The link bandwidths measured for `rate`, from `DIR/links/hosts-RATE.json`.
fn link_rate(dir: &Path, rate: &str) -> Result<Rates> {
    let path = dir.join("links").join(format!("hosts-{rate}.json"));
    if !path.exists() {
        return Ok(Rates::default());
    }
    let text = std::fs::read_to_string(&path).map_err(io("reading", &path))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|source| LabError::Json { path: path.clone(), source })?;
    let l = &v["links"][format!("hosts-{rate}")];
    Ok(Rates { both: l["bytes_per_s"]["value"].as_f64(), one_way: l["one_way_bytes_per_s"]["value"].as_f64() })
}

/// The rate a link was shaped to, bits/s, from its name (`unshaped` and names without a rate:
/// infinite): the study's rows go from the fastest link to the slowest.
fn nominal_bits(rate: &str) -> f64 {
    let digits = rate.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(rate.len());
    let (n, unit) = rate.split_at(digits);
    let scale = match unit {
        "gbit" => 1e9,
        "mbit" => 1e6,
        "kbit" => 1e3,
        "bit" => 1.0,
        _ => return f64::INFINITY,
    };
    n.parse::<f64>().map_or(f64::INFINITY, |n| n * scale)
}

/// Every cell of a study folder, ordered by length, hosts, link rate (fastest first), method.
pub fn cells(dir: &Path) -> Result<Vec<Cell>> {
    let mut cells = Vec::new();
    let full = dir.join("full");
    if full.is_dir() {
        for (len, d) in subdirs(&full)? {
            let Ok(length) = len.parse() else { continue };
            let path = d.join("ttft.csv");
            for (method, rows) in read_ttft(&path)? {
                cells.push(cell(&path, 1, "-", Rates::default(), length, &method, &rows)?);
            }
        }
    }
    for (name, hd) in subdirs(dir)? {
        let Some(hosts) = name.strip_suffix("-hosts").and_then(|n| n.parse().ok()) else { continue };
        for (rate, rd) in subdirs(&hd)? {
            let link = link_rate(dir, &rate)?;
            for (len, ld) in subdirs(&rd)? {
                let Ok(length) = len.parse() else { continue };
                for (_, sd) in subdirs(&ld)? {
                    let path = sd.join("ttft.csv");
                    if !path.exists() {
                        continue;
                    }
                    for (method, rows) in read_ttft(&path)? {
                        cells.push(cell(&path, hosts, &rate, link, length, &method, &rows)?);
                    }
                }
            }
        }
    }
    if cells.is_empty() {
        return Err(bad(dir, "no ttft.csv in the study's layout (run scripts/network-study.sh into it first)"));
    }
    cells.sort_by(|a, b| {
        (a.length, a.hosts)
            .cmp(&(b.length, b.hosts))
            .then(nominal_bits(&b.rate).total_cmp(&nominal_bits(&a.rate)))
            .then(a.method.cmp(&b.method))
    });
    Ok(cells)
}

/// What the report wrote.
#[derive(Debug)]
pub struct Written {
    /// The cells.
    pub cells: Vec<Cell>,
    /// The Markdown table (also in `network.md`).
    pub table: String,
    /// Files written.
    pub files: Vec<String>,
}

/// Writes `network.csv`, `network.md` and `network.png` into `dir`.
pub fn report(dir: &Path) -> Result<Written> {
    let cells = cells(dir)?;
    let full =
        |len: usize| cells.iter().find(|c| c.hosts == 1 && c.length == len && c.method == "full").map(|c| c.ttft_ms);
    let ring = |c: &Cell| {
        cells
            .iter()
            .find(|r| (r.hosts, &r.rate, r.length, r.method.as_str()) == (c.hosts, &c.rate, c.length, "ring"))
            .map(|r| r.ttft_ms)
    };
    let mut csv = String::from(
        "hosts,rate,link_mb_per_s,link_one_way_mb_per_s,length,method,runs,ttft_ms,speedup_vs_full_one_host,speedup_vs_ring,mb_sent_busiest_rank,comm_wait_ms,projected_ms,projection_error,projected_comm_ms\n",
    );
    let mut table = String::from(
        "| hosts | link (measured: one way / both ways at once) | tokens | method | TTFT ms | vs full, 1 host | vs ring | MB sent (busiest rank) | comm wait ms | projected ms | projection error |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    let f2 = |x: Option<f64>, unit: &str| x.map_or("-".to_string(), |x| format!("{x:.2}{unit}"));
    for c in &cells {
        let vs_full = full(c.length).map(|f| f / c.ttft_ms);
        let vs_ring = ring(c).map(|r| r / c.ttft_ms);
        let mbps = c.link_bytes_per_s.map(|b| b / 1e6);
        let err = c.projection_error();
        csv.push_str(&format!(
            "{},{},{},{},{},{},{},{:.1},{},{},{:.3},{:.1},{},{},{}\n",
            c.hosts,
            c.rate,
            mbps.map_or(String::new(), |m| format!("{m:.1}")),
            c.link_one_way_bytes_per_s.map_or(String::new(), |b| format!("{:.1}", b / 1e6)),
            c.length,
            c.method,
            c.runs,
            c.ttft_ms,
            vs_full.map_or(String::new(), |x| format!("{x:.3}")),
            vs_ring.map_or(String::new(), |x| format!("{x:.3}")),
            c.bytes_max / 1e6,
            c.comm_wait_ms,
            c.projected_ms.map_or(String::new(), |x| format!("{x:.1}")),
            err.map_or(String::new(), |x| format!("{x:.3}")),
            c.projected_comm_ms.map_or(String::new(), |x| format!("{x:.1}")),
        ));
        let link = match (mbps, c.link_one_way_bytes_per_s) {
            (Some(m), Some(o)) => format!("{} ({:.0} / {m:.0} MB/s)", c.rate, o / 1e6),
            (Some(m), None) => format!("{} ({m:.0} MB/s)", c.rate),
            _ => "none (one host)".to_string(),
        };
        table.push_str(&format!(
            "| {} | {link} | {} | {} | {:.0} | {} | {} | {:.1} | {:.0} | {} | {} |\n",
            c.hosts,
            c.length,
            c.method,
            c.ttft_ms,
            f2(vs_full, "x"),
            f2(vs_ring, "x"),
            c.bytes_max / 1e6,
            c.comm_wait_ms,
            c.projected_ms.map_or("-".to_string(), |x| format!("{x:.0}")),
            err.map_or("-".to_string(), |x| format!("{:+.0}%", x * 100.0)),
        ));
    }
    let mut files = Vec::new();
    let csv_path = dir.join("network.csv");
    std::fs::write(&csv_path, &csv).map_err(io("writing", &csv_path))?;
    files.push(csv_path.display().to_string());
    // The projection phase by phase, where the cells have it: where an error comes from.
    let mut phases_csv = String::from(
        "hosts,rate,length,method,phase,measured_ms,projected_ms,projected_compute_ms,projected_exposed_comm_ms,error\n",
    );
    let mut phases_md = String::from(
        "\n| hosts | link | tokens | method | phase | measured ms | projected ms (compute / exposed comm) | error |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for c in &cells {
        for p in &c.phases {
            let err = p.error();
            let what = [c.hosts.to_string(), c.rate.clone(), c.length.to_string(), c.method.clone(), p.phase.clone()];
            let (m, pr, pc, pe) = (p.measured_ms, p.projected_ms, p.projected_compute_ms, p.projected_exposed_comm_ms);
            let e_csv = err.map_or(String::new(), |x| format!("{x:.3}"));
            phases_csv.push_str(&format!("{},{m:.1},{pr:.1},{pc:.1},{pe:.1},{e_csv}\n", what.join(",")));
            let e_md = err.map_or("-".to_string(), |x| format!("{:+.0}%", x * 100.0));
            phases_md.push_str(&format!("| {} | {m:.0} | {pr:.0} ({pc:.0} / {pe:.0}) | {e_md} |\n", what.join(" | ")));
        }
    }
    let with_phases = cells.iter().any(|c| !c.phases.is_empty());
    if with_phases {
        let path = dir.join("network-phases.csv");
        std::fs::write(&path, &phases_csv).map_err(io("writing", &path))?;
        files.push(path.display().to_string());
    }
    let md_path = dir.join("network.md");
    let md = if with_phases { format!("{table}\nBy phase (medians):\n{phases_md}") } else { table.clone() };
    std::fs::write(&md_path, md).map_err(io("writing", &md_path))?;
    files.push(md_path.display().to_string());
    // TTFT against the measured link rate, one line per method, host count and length; full
    // prefill on one host (no link) as a flat line across the rates measured.
    let lengths: Vec<usize> =
        cells.iter().map(|c| c.length).collect::<std::collections::BTreeSet<_>>().into_iter().collect();
    let x = |c: &Cell| c.link_one_way_bytes_per_s.or(c.link_bytes_per_s).map(|b| b * 8.0 / 1e6);
    let rates: Vec<f64> = cells.iter().filter_map(x).collect();
    let mut series: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for c in &cells {
        let tag = if lengths.len() > 1 { format!(", {} tokens", c.length) } else { String::new() };
        match x(c) {
            Some(r) => series.entry(format!("{} x{}{tag}", c.method, c.hosts)).or_default().push((r, c.ttft_ms / 1e3)),
            None => {
                for &r in &rates {
                    series.entry(format!("full, 1 host{tag}")).or_default().push((r, c.ttft_ms / 1e3));
                }
            }
        }
    }
    let series: Vec<Series> = series
        .into_iter()
        .map(|(name, mut points)| {
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            points.dedup_by(|a, b| a.0 == b.0);
            Series { name, points }
        })
        .collect();
    let png = dir.join("network.png");
    let drawn = line_chart_log(
        &png,
        "TTFT against link rate (hosts on one machine, measured)",
        "link rate, Mbit/s (one flow, measured)",
        "TTFT, s",
        &series,
    )?;
    files.extend(crate::plot::written(&png, drawn));
    Ok(Written { cells, table, files })
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEADER: &str = "length,context_tokens,ranks,method,scope,run,ttft_ms,projected_ms,chunk_prefill_ms,probe_ms,recompute_ms,final_prompt_ms,prefill_ms,bytes_sent,bytes_sent_max,comm_wait_ms,projected_comm_ms,projected_exposed_comm_ms,cache,disk_hits,auto_predicted,ran";

    fn write(path: &Path, rows: &[&str]) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, format!("{HEADER}\n{}\n", rows.join("\n"))).unwrap();
    }

    #[test]
    fn reads_a_study_folder_into_medians_speedups_and_projection_errors() {
        let dir = std::env::temp_dir().join(format!("fp-network-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        write(
            &dir.join("full/4096/ttft.csv"),
            &[
                "4096,4120,1,full,exact,0,4000.0,3900.0,0,0,0,0,0,0,0,0.0,0.0,0.0,cold,0,,full",
                "4096,4120,1,full,exact,1,4200.0,3900.0,0,0,0,0,0,0,0,0.0,0.0,0.0,cold,0,,full",
                "4096,4120,1,full,exact,2,4100.0,3900.0,0,0,0,0,0,0,0,0.0,0.0,0.0,cold,0,,full",
            ],
        );
        write(&dir.join("2-hosts/100mbit/4096/exact/ttft.csv"), &[
            "4096,4120,2,ring,exact,0,3000.0,3300.0,0,0,0,0,0,9000000,5000000,900.0,800.0,500.0,cold,0,,ring",
            "4096,4120,2,infoflow,exact,0,2000.0,1800.0,0,0,0,0,0,3000000,2000000,300.0,250.0,100.0,cold,0,,infoflow",
        ]);
        write(
            &dir.join("2-hosts/100mbit/4096/sparse/ttft.csv"),
            &["4096,4120,2,infoflow,sparse,0,1500.0,,0,0,0,0,0,1000000,600000,100.0,,,cold,0,,infoflow"],
        );
        std::fs::create_dir_all(dir.join("links")).unwrap();
        std::fs::write(
            dir.join("links/hosts-100mbit.json"),
            r#"{"devices":{},"links":{"hosts-100mbit":{"description":"x","bytes_per_s":{"value":12000000.0,"source":"s"},"one_way_bytes_per_s":{"value":24000000.0,"source":"s"},"latency_s":{"value":0.0001,"source":"s"}}}}"#,
        )
        .unwrap();
        let w = report(&dir).unwrap();
        let names: Vec<(usize, &str)> = w.cells.iter().map(|c| (c.hosts, c.method.as_str())).collect();
        assert_eq!(names, [(1, "full"), (2, "infoflow exact"), (2, "infoflow sparse"), (2, "ring")]);
        assert_eq!(w.cells[0].ttft_ms, 4100.0, "median of three");
        assert_eq!(w.cells[0].runs, 3);
        let ring = &w.cells[3];
        assert_eq!((ring.bytes_max, ring.comm_wait_ms, ring.link_bytes_per_s), (5e6, 900.0, Some(12e6)));
        assert!((ring.projection_error().unwrap() - 0.1).abs() < 1e-12);
        assert_eq!(w.cells[2].projected_ms, None, "an empty projection stays empty");
        // Speedups against full on one host and against ring on the same hosts and link.
        assert!(
            w.table.contains(
                "| 2 | 100mbit (24 / 12 MB/s) | 4096 | infoflow exact | 2000 | 2.05x | 1.50x | 2.0 | 300 | 1800 | -10% |"
            ),
            "{}",
            w.table
        );
        let csv = std::fs::read_to_string(dir.join("network.csv")).unwrap();
        assert_eq!(csv.lines().count(), 5, "{csv}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_projection_is_held_against_each_measured_phase() {
        let dir = std::env::temp_dir().join(format!("fp-network-phases-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let header = HEADER.replace("auto_predicted,ran", "auto_predicted,projected_phases,ran");
        let write_new = |path: &Path, rows: &[&str]| {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, format!("{header}\n{}\n", rows.join("\n"))).unwrap();
        };
        write_new(
            &dir.join("full/4096/ttft.csv"),
            &["4096,4120,1,full,exact,0,4000.0,3900.0,0,0,0,0,3990.0,0,0,0.0,0.0,0.0,cold,0,,prefill:3900.0:3900.0:0.0,full"],
        );
        let phases =
            "chunk_prefill:1200.0:1200.0:0.0;probe:20.0:18.0:2.0;recompute:900.0:850.0:50.0;final_prompt:30.0:30.0:0.0";
        write_new(&dir.join("4-hosts/unshaped/4096/sparse/ttft.csv"), &[
            &format!("4096,4120,4,infoflow,sparse,0,1900.0,2150.0,1000.0,25.0,500.0,30.0,0,1,1,10.0,1.0,1.0,cold,0,,{phases},infoflow"),
            &format!("4096,4120,4,infoflow,sparse,1,2100.0,2150.0,1100.0,25.0,600.0,30.0,0,1,1,10.0,1.0,1.0,cold,0,,{phases},infoflow"),
        ]);
        let w = report(&dir).unwrap();
        let sparse = w.cells.iter().find(|c| c.method == "infoflow sparse").unwrap();
        let names: Vec<&str> = sparse.phases.iter().map(|p| p.phase.as_str()).collect();
        assert_eq!(names, ["chunk_prefill", "probe", "recompute", "final_prompt"]);
        let r = &sparse.phases[2];
        assert_eq!(
            (r.measured_ms, r.projected_ms, r.projected_compute_ms, r.projected_exposed_comm_ms),
            (550.0, 900.0, 850.0, 50.0)
        );
        assert!((r.error().unwrap() - 350.0 / 550.0).abs() < 1e-12);
        assert_eq!(w.cells[0].phases[0].measured_ms, 3990.0, "full's one phase is `prefill`");
        let csv = std::fs::read_to_string(dir.join("network-phases.csv")).unwrap();
        assert_eq!(csv.lines().count(), 1 + 1 + 4, "{csv}");
        assert!(csv.contains("4,unshaped,4096,infoflow sparse,recompute,550.0,900.0,850.0,50.0,0.636"), "{csv}");
        let md = std::fs::read_to_string(dir.join("network.md")).unwrap();
        assert!(
            md.contains("| 4 | unshaped | 4096 | infoflow sparse | recompute | 550 | 900 (850 / 50) | +64% |"),
            "{md}"
        );
        // A malformed entry is an error that names it.
        write_new(
            &dir.join("full/4096/ttft.csv"),
            &["4096,4120,1,full,exact,0,4000.0,3900.0,0,0,0,0,3990.0,0,0,0.0,0.0,0.0,cold,0,,prefill:x,full"],
        );
        let e = report(&dir).unwrap_err().to_string();
        assert!(e.contains("\"prefill:x\" is not phase:total:compute:exposed"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_file_of_several_lengths_rank_counts_or_warm_caches_is_refused() {
        let dir = std::env::temp_dir().join(format!("fp-network-mixed-{}", std::process::id()));
        let row = |len: usize, ranks: usize, cache: &str| {
            format!("{len},4120,{ranks},infoflow,exact,0,2000.0,,0,0,0,0,0,1,1,1.0,,,{cache},0,,infoflow")
        };
        let path = dir.join("2-hosts/unshaped/4096/exact/ttft.csv");
        let cases = [
            (vec![row(4096, 2, "cold"), row(4096, 2, "ram")], "chunk caches `ram`"),
            (vec![row(4096, 2, "cold"), row(4096, 1, "cold")], "more than one rank count (ranks 1, 2)"),
            (vec![row(4096, 2, "cold"), row(8192, 2, "cold")], "more than one context length"),
        ];
        for (rows, want) in cases {
            let _ = std::fs::remove_dir_all(&dir);
            let rows: Vec<&str> = rows.iter().map(String::as_str).collect();
            write(&path, &rows);
            let e = report(&dir).unwrap_err().to_string();
            assert!(e.contains(want), "{want}: {e}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn links_are_ordered_by_the_rate_they_were_shaped_to() {
        let mut r = vec!["100mbit", "unshaped", "1gbit", "10gbit", "250kbit"];
        r.sort_by(|a, b| nominal_bits(b).total_cmp(&nominal_bits(a)));
        assert_eq!(r, ["unshaped", "10gbit", "1gbit", "100mbit", "250kbit"]);
    }

    #[test]
    fn an_empty_or_old_folder_is_an_error_that_says_what_to_do() {
        let dir = std::env::temp_dir().join(format!("fp-network-empty-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let e = report(&dir).unwrap_err().to_string();
        assert!(e.contains("run scripts/network-study.sh"), "{e}");
        let old = dir.join("full/4096/ttft.csv");
        std::fs::create_dir_all(old.parent().unwrap()).unwrap();
        std::fs::write(&old, "length,method,scope,ttft_ms\n4096,full,exact,1.0\n").unwrap();
        let e = report(&dir).unwrap_err().to_string();
        assert!(e.contains("no column `bytes_sent_max`"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
