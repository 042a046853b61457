//! `flowprefill bench faults`: the fault matrix of the service (`flowprefill_lab::faults`:
//! every injected fault against what a client sees), written as Markdown and JSON.

use crate::Common;
use anyhow::{Context, Result};
use flowprefill_lab::faults::{self, cases, markdown, ServerProcess};
use std::path::PathBuf;
use std::time::Instant;

/// Arguments of `bench faults`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Where the table goes (Markdown; a `.json` of the same name beside it). The project's own
    /// table is `--out docs/faults.md`.
    #[arg(long, default_value = "bench-out/faults.md")]
    pub out: PathBuf,
    /// Worlds to test: threads, mpi (needs a build with the `mpi` feature and `mpirun`).
    #[arg(long, value_delimiter = ',', default_value = "threads")]
    pub worlds: Vec<String>,
    /// Only rows whose label contains this.
    #[arg(long)]
    pub only: Option<String>,
}

/// Starts `flowprefill serve --listen 127.0.0.1:0 ARGS` (this executable, with this command's
/// global flags: the same model, device, types, memory limit and store; under `mpirun -np N`
/// when `mpi` is given) with `env`; returns once it listens.
pub fn spawn_server(common: &Common, args: &[&str], env: &[(&str, &str)], mpi: Option<usize>) -> Result<ServerProcess> {
    let exe = std::env::current_exe()?;
    Ok(faults::spawn_server(&exe, &common.global_args(), args, env, mpi)?)
}

/// Runs the command.
pub fn run(common: &Common, a: Args) -> Result<()> {
    for w in &a.worlds {
        crate::ensure_usage!(w == "threads" || w == "mpi", "--worlds: unknown `{w}`; choose threads, mpi");
    }
    // The JSON goes beside the Markdown under the same name: a `.json` --out would be written
    // twice, the table lost under the JSON.
    crate::ensure_usage!(
        a.out.extension().is_none_or(|e| !e.eq_ignore_ascii_case("json")),
        "--out {}: give the Markdown table's path (e.g. faults.md); the JSON is written beside it",
        a.out.display()
    );
    super::out_file("--out", &a.out)?;
    let exe = std::env::current_exe()?;
    let json = a.out.with_extension("json");
    // Both files are rewritten after every row (temporary file, rename): a matrix stopped part
    // way (a world that cannot start, an interrupt) keeps the rows it measured.
    let save = |rows: &[faults::Row]| -> Result<()> {
        flowprefill_lab::eval::write_atomic(&a.out, markdown(rows, &a.worlds).as_bytes())?;
        flowprefill_lab::eval::write_atomic(&json, &serde_json::to_vec_pretty(rows)?)?;
        Ok(())
    };
    let mut rows = Vec::new();
    for world in &a.worlds {
        for case in cases() {
            let label = format!("{world}: {}", case.label());
            if a.only.as_deref().is_some_and(|o| !label.contains(o)) {
                continue;
            }
            eprint!("{label:<50} ");
            let t = Instant::now();
            let row = faults::run_case(&exe, common.model.as_deref(), world, &case)
                .with_context(|| format!("{label}: the {} rows before it are in {}", rows.len(), a.out.display()))?;
            crate::say!("{} / next {} ({:.0} s)", row.status, row.next, t.elapsed().as_secs_f64());
            rows.push(row);
            save(&rows)?;
        }
    }
    save(&rows)?;
    crate::say!("wrote {} rows to {}", rows.len(), a.out.display());
    Ok(())
}
