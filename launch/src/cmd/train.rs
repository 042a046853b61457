//! `flowprefill train kvpacket`: KV Packet adapters by self-distillation, on the CPU.

use crate::progress::Progress;
use crate::Common;
use anyhow::{Context, Result};
use flowprefill_lab::tasks::PromptStyle;
use flowprefill_lab::train::kvpacket::{self, Event, Settings};
use flowprefill_lab::train::model::TrainModel;
use flowprefill_worker::{Cpu, LoadedModel};
use std::path::PathBuf;

/// What can be trained.
#[derive(clap::Subcommand, Debug)]
pub enum Train {
    /// KV Packet header/trailer adapters for `--model` (paper 001): full prefill is the teacher,
    /// chunk caches made independently with the adapters are the student; only the adapters
    /// learn. Resumable: run the same command again to continue from the last step.
    Kvpacket(KvpacketArgs),
}

/// Arguments of `train kvpacket`.
#[derive(clap::Args, Debug)]
pub struct KvpacketArgs {
    /// Soft rows before every chunk.
    #[arg(long, default_value_t = 8)]
    pub header: usize,
    /// Soft rows after every chunk.
    #[arg(long, default_value_t = 8)]
    pub trailer: usize,
    /// Tasks the samples come from (comma-separated, cycled), or `all`.
    #[arg(long, default_value = "all")]
    pub tasks: String,
    /// Context tokens of a sample.
    #[arg(long, default_value_t = 1024)]
    pub length: usize,
    /// Training samples.
    #[arg(long, default_value_t = 128)]
    pub samples: usize,
    /// Held-out samples scored after every epoch.
    #[arg(long, default_value_t = 8)]
    pub val_samples: usize,
    /// Passes over the samples (0 writes the untrained adapter, a baseline for ablations).
    #[arg(long, default_value_t = 4)]
    pub epochs: usize,
    /// Samples per optimiser step.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Peak learning rate (linear decay to 0).
    #[arg(long, default_value_t = 2e-3)]
    pub lr: f64,
    /// AdamW weight decay.
    #[arg(long, default_value_t = 0.0)]
    pub weight_decay: f64,
    /// Seed of the sample order and of the samples (training seeds start at 7,000,000, far from
    /// every evaluation seed).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Teacher continuation tokens at most.
    #[arg(long, default_value_t = 16)]
    pub continuation: usize,
    /// Prompt style of the samples.
    #[arg(long, value_enum, default_value_t = PromptStyle::Ruler)]
    pub prompts: PromptStyle,
    /// The run's folder (checkpoint, loss curve).
    #[arg(long, default_value = "kvpacket-run")]
    pub out: PathBuf,
    /// Where to write the adapter; default: `OUT/adapter.safetensors`.
    #[arg(long)]
    pub adapter: Option<PathBuf>,
}

impl KvpacketArgs {
    fn settings(&self) -> Settings {
        let tasks = if self.tasks.trim() == "all" {
            flowprefill_lab::tasks::all_tasks().into_iter().map(String::from).collect()
        } else {
            self.tasks.split(',').map(|t| t.trim().to_string()).filter(|t| !t.is_empty()).collect()
        };
        Settings {
            header: self.header,
            trailer: self.trailer,
            tasks,
            length: self.length,
            samples: self.samples,
            val_samples: self.val_samples,
            epochs: self.epochs,
            batch: self.batch,
            lr: self.lr,
            weight_decay: self.weight_decay,
            seed: self.seed,
            continuation: self.continuation,
            prompts: self.prompts,
        }
    }
}

/// Runs the command.
pub fn run(common: &Common, t: Train) -> Result<()> {
    let Train::Kvpacket(a) = t;
    crate::ensure_usage!(
        common.device == flowprefill_kernels::DeviceSpec::Cpu,
        "training runs on the CPU; drop --device {}",
        common.device
    );
    let settings = a.settings();
    settings.check().map_err(|e| anyhow::Error::new(crate::exit::Usage(e.to_string())))?;
    let path = super::model_path(common)?;
    let lm = LoadedModel::load(&path, Cpu).with_context(|| format!("loading {}", path.display()))?;
    let tm = TrainModel::from_gguf(&path).with_context(|| format!("loading {} for training", path.display()))?;
    let out = kvpacket::Outputs {
        dir: a.out.clone(),
        adapter: a.adapter.clone().unwrap_or_else(|| a.out.join("adapter.safetensors")),
    };
    eprintln!(
        "training KV Packet adapters ({} + {} rows) for {}: {} samples of {} tokens ({} tasks), {} epochs, batch {}, lr {}",
        settings.header,
        settings.trailer,
        lm.model.config().name,
        settings.samples,
        settings.length,
        settings.tasks.len(),
        settings.epochs,
        settings.batch,
        settings.lr
    );
    let mut teacher: Option<Progress> = None;
    let mut steps: Option<Progress> = None;
    let mut on = |e: Event| match e {
        Event::Teacher { done, total } => {
            teacher.get_or_insert_with(|| Progress::new(total, "teacher continuations")).inc(&format!("sample {done}"));
        }
        Event::Baseline { none, packet } => {
            teacher = None;
            eprintln!("held-out KL to full prefill: none {none:.4}, packets before training {packet:.4} (nats/token)");
        }
        Event::Step { step, total, loss, lr, seconds } => {
            let p = steps.get_or_insert_with(|| Progress::new(total + 1 - step, "steps"));
            p.inc(&format!("step {step}/{total}: KL {loss:.4}, lr {lr:.2e}, {seconds:.0} s"));
        }
        Event::Validation { epoch, loss } => {
            let line = format!("epoch {epoch}: held-out KL {loss:.4}");
            match &steps {
                Some(p) => p.println(&line),
                None => eprintln!("{line}"),
            }
        }
        Event::Saved { .. } => {}
    };
    let (adapter, history) = kvpacket::train(&lm, &tm, &settings, &out, &mut on)?;
    let trained =
        history.validation.last().map_or_else(|| "not trained (--epochs 0)".into(), |v| format!("trained {:.4}", v.1));
    println!(
        "adapter written to {} ({} rows, hash {}); {} steps in {}; held-out KL: none {:.4}, untrained {:.4}, {trained}",
        out.adapter.display(),
        adapter.n_rows(),
        adapter.hash,
        history.train.len(),
        crate::progress::hms(history.seconds),
        history.none_val,
        history.initial_val,
    );
    let png = out.dir.join("loss.png");
    if png.exists() {
        println!("loss curve: {}", png.display());
    }
    Ok(())
}
