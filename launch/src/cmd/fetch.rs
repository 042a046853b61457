//! `flowprefill fetch-model`.

use crate::Common;
use anyhow::Result;
use flowprefill_worker::fetch;

/// Arguments of `fetch-model`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Download again even if the file is present.
    #[arg(long)]
    pub force: bool,
}

/// Runs the command.
pub fn run(_common: &Common, args: Args) -> Result<()> {
    let mut log = |l: &str| eprintln!("{l}");
    let path = if args.force { fetch::fetch_default_model(&mut log)? } else { fetch::ensure_default_model(&mut log)? };
    let digest = fetch::sha256_file(&path)?;
    anyhow::ensure!(
        digest == fetch::DEFAULT_MODEL.sha256,
        "{} has SHA-256 {digest}, expected {}; run `flowprefill fetch-model --force`",
        path.display(),
        fetch::DEFAULT_MODEL.sha256
    );
    println!("{}", path.display());
    Ok(())
}
