//! `flowprefill bench project`: projected TTFT on hardware we do not have (the projection:
//! `flowprefill_lab::project::bench`).

use crate::Common;
use anyhow::Result;
use flowprefill_coordinator::Scope;
use flowprefill_lab::project::bench::{self, Settings};
use flowprefill_lab::project::load_profiles;
use std::path::PathBuf;

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
    /// Methods: full, ring, infoflow[@ratio], none.
    #[arg(long, default_value = "full,ring,infoflow@0.15")]
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

/// `bench project`.
pub fn run_project(common: &Common, a: ProjectArgs) -> Result<()> {
    let profiles = load_profiles(&a.profiles)?;
    if a.list {
        print!("{}", bench::list(&profiles));
        return Ok(());
    }
    let shape = match &a.shape {
        Some(s) => flowprefill_lab::project::shape::builtin(s)?,
        None => super::model_config(common)?,
    };
    let settings = Settings {
        target: a.target,
        link: a.link,
        ranks: a.ranks.concat(),
        lengths: a.lengths.concat(),
        methods: a.methods,
        scope: a.scope,
        doc_tokens: a.doc_tokens,
        head_tokens: a.head_tokens,
        prompt_tokens: a.prompt_tokens,
        calibrate: a.calibrate,
        compare: a.compare,
        out: a.out,
    };
    let projected = bench::project_grid(settings, shape, &profiles)?;
    print!("{}", projected.text);
    println!("wrote {}", projected.write()?.join(", "));
    Ok(())
}
