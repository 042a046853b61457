//! `flowprefill bench faults`: the fault matrix of the service (`flowprefill_lab::faults`:
//! every injected fault against what a client sees), written as Markdown and JSON.

use crate::Common;
use anyhow::Result;
use flowprefill_lab::faults::{self, cases, markdown, ServerProcess};
use std::path::PathBuf;
use std::time::Instant;

/// Arguments of `bench faults`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Where the table goes (Markdown; a `.json` beside it).
    #[arg(long, default_value = "docs/faults.md")]
    pub out: PathBuf,
    /// Worlds to test: threads, mpi (needs a build with the `mpi` feature and `mpirun`).
    #[arg(long, value_delimiter = ',', default_value = "threads")]
    pub worlds: Vec<String>,
    /// Only rows whose label contains this.
    #[arg(long)]
    pub only: Option<String>,
}

/// Starts `flowprefill serve --listen 127.0.0.1:0 ARGS` (this executable, the model of
/// `--model`; under `mpirun -np N` when `mpi` is given) with `env`; returns once it listens.
pub fn spawn_server(common: &Common, args: &[&str], env: &[(&str, &str)], mpi: Option<usize>) -> Result<ServerProcess> {
    let exe = std::env::current_exe()?;
    Ok(faults::spawn_server(&exe, common.model.as_deref(), args, env, mpi)?)
}

/// Runs the command.
pub fn run(common: &Common, a: Args) -> Result<()> {
    for w in &a.worlds {
        crate::ensure_usage!(w == "threads" || w == "mpi", "--worlds: unknown `{w}`; choose threads, mpi");
    }
    let exe = std::env::current_exe()?;
    let mut rows = Vec::new();
    for world in &a.worlds {
        for case in cases() {
            let label = format!("{world}: {}", case.label());
            if a.only.as_deref().is_some_and(|o| !label.contains(o)) {
                continue;
            }
            eprint!("{label:<50} ");
            let t = Instant::now();
            let row = faults::run_case(&exe, common.model.as_deref(), world, &case)?;
            eprintln!("{} / next {} ({:.0} s)", row.status, row.next, t.elapsed().as_secs_f64());
            rows.push(row);
        }
    }
    if let Some(dir) = a.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&a.out, markdown(&rows, &a.worlds))?;
    std::fs::write(a.out.with_extension("json"), serde_json::to_vec_pretty(&rows)?)?;
    eprintln!("wrote {} rows to {}", rows.len(), a.out.display());
    Ok(())
}
