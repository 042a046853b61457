//! The `flowprefill` command as a library: its subcommands, the HTTP service (usable
//! in-process: [`serve::Service`] and [`serve::serve`]), plots, and the error classes mapped
//! once to exit codes and HTTP statuses ([`exit`]).

pub mod cmd;
pub mod exit;
pub mod http;
pub mod plot;
pub mod progress;
pub mod rss;
pub mod serve;

use std::path::PathBuf;

/// Options every command takes.
#[derive(clap::Args, Debug, Clone)]
pub struct Common {
    /// GGUF model file (llama, qwen2, qwen3); default: SmolLM2-135M-Instruct, fetched on first use.
    #[arg(long, global = true, env = "FLOWPREFILL_MODEL")]
    pub model: Option<PathBuf>,
    /// Worker threads for the CPU kernels (default: all cores).
    #[arg(long, global = true)]
    pub threads: Option<usize>,
}
