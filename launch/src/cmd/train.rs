//! `flowprefill train kvpacket`: KV Packet adapters by self-distillation, on the CPU.

use crate::progress::Progress;
use crate::Common;
use anyhow::{Context, Result};
use flowprefill_lab::tasks::PromptStyle;
use flowprefill_lab::train::kvpacket::{self, Event, History, Settings};
use flowprefill_lab::train::lookahead::fit as lookahead;
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
    /// LookaheadKV for `--model` (paper 004): 32 lookahead rows and LoRA (rank 8, alpha 32) on
    /// every projection of those rows learn to attend to the context as the model's own greedy
    /// answer does (KL per layer and KV head, eq. 5); `--evict lookahead` then keeps what they
    /// attend to. Resumable: run the same command again to continue from the last step.
    Lookahead(LookaheadArgs),
}

/// Arguments of `train lookahead`.
#[derive(clap::Args, Debug)]
pub struct LookaheadArgs {
    /// Lookahead rows.
    #[arg(long, default_value_t = flowprefill_worker::lookahead::LOOKAHEAD_ROWS)]
    pub rows: usize,
    /// LoRA rank.
    #[arg(long, default_value_t = flowprefill_worker::lookahead::LORA_RANK)]
    pub rank: usize,
    /// LoRA alpha (the update is alpha / rank times B A).
    #[arg(long, default_value_t = flowprefill_worker::lookahead::LORA_ALPHA)]
    pub alpha: f32,
    /// Tasks the samples come from (comma-separated, cycled), or `all`.
    #[arg(long, default_value = "all")]
    pub tasks: String,
    /// Context tokens of a sample.
    #[arg(long, default_value_t = 1024)]
    pub length: usize,
    /// Training samples.
    #[arg(long, default_value_t = 64)]
    pub samples: usize,
    /// Held-out samples scored after every epoch.
    #[arg(long, default_value_t = 8)]
    pub val_samples: usize,
    /// Passes over the samples (0 writes the untrained adapter).
    #[arg(long, default_value_t = 4)]
    pub epochs: usize,
    /// Samples per optimiser step.
    #[arg(long, default_value_t = 4)]
    pub batch: usize,
    /// Peak learning rate (2% warm-up, cosine decay to 0).
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    /// AdamW weight decay.
    #[arg(long, default_value_t = 0.0)]
    pub weight_decay: f64,
    /// Seed of the order, the initial values and the samples (training seeds start at
    /// 7,200,000, away from evaluation, KV Packet's and `importance`'s seeds).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Answer tokens at most (the rows whose attention is the truth).
    #[arg(long, default_value_t = 32)]
    pub max_answer: usize,
    /// Prompt style of the samples.
    #[arg(long, value_enum, default_value_t = PromptStyle::Ruler)]
    pub prompts: PromptStyle,
    /// The run's folder (checkpoint, loss curve).
    #[arg(long, default_value = "lookahead-run")]
    pub out: PathBuf,
    /// Where to write the adapter; default: `OUT/lookahead.safetensors`. Its own flag, not the
    /// global `--adapter` (an input, also read from `FLOWPREFILL_ADAPTER`): a training run
    /// writes outside `--out` only where this flag says so.
    #[arg(long)]
    pub adapter_out: Option<PathBuf>,
}

fn task_list(tasks: &str) -> Vec<String> {
    if tasks.trim() == "all" {
        flowprefill_lab::tasks::all_tasks().into_iter().map(String::from).collect()
    } else {
        tasks.split(',').map(|t| t.trim().to_string()).filter(|t| !t.is_empty()).collect()
    }
}

impl LookaheadArgs {
    fn settings(&self) -> lookahead::Settings {
        lookahead::Settings {
            rows: self.rows,
            rank: self.rank,
            alpha: self.alpha,
            tasks: task_list(&self.tasks),
            length: self.length,
            samples: self.samples,
            val_samples: self.val_samples,
            epochs: self.epochs,
            batch: self.batch,
            lr: self.lr,
            weight_decay: self.weight_decay,
            seed: self.seed,
            max_answer: self.max_answer,
            prompts: self.prompts,
        }
    }
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
    /// Where to write the adapter; default: `OUT/adapter.safetensors`. Its own flag, not the
    /// global `--adapter` (an input, also read from `FLOWPREFILL_ADAPTER`): a training run
    /// writes outside `--out` only where this flag says so.
    #[arg(long)]
    pub adapter_out: Option<PathBuf>,
}

impl KvpacketArgs {
    fn settings(&self) -> Settings {
        let tasks = task_list(&self.tasks);
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
    crate::ensure_usage!(
        common.device == flowprefill_kernels::DeviceSpec::Cpu,
        "training runs on the CPU; drop --device {}",
        common.device
    );
    let a = match t {
        Train::Kvpacket(a) => a,
        Train::Lookahead(a) => return run_lookahead(common, &a),
    };
    let settings = a.settings();
    settings.check().map_err(|e| anyhow::Error::new(crate::exit::Usage(e.to_string())))?;
    let path = super::model_path(common)?;
    let lm = LoadedModel::load(&path, Cpu).with_context(|| format!("loading {}", path.display()))?;
    let tm = TrainModel::from_gguf(&path).with_context(|| format!("loading {} for training", path.display()))?;
    let out = kvpacket::Outputs {
        dir: a.out.clone(),
        adapter: a.adapter_out.clone().unwrap_or_else(|| a.out.join("adapter.safetensors")),
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
    let mut on = printer(
        "teacher continuations",
        |none, packet| {
            format!("held-out KL to full prefill: none {none:.4}, packets before training {packet:.4} (nats/token)")
        },
        "held-out KL",
    );
    let (adapter, history) = kvpacket::train(&lm, &tm, &settings, &out, &mut on)?;
    report(&out.adapter, &out.dir, &format!("{} rows, hash {}", adapter.n_rows(), adapter.hash), &history, "none");
    Ok(())
}

/// The run's last lines: the adapter, the steps and time, the held-out losses, the curve.
fn report(adapter: &std::path::Path, dir: &std::path::Path, what: &str, h: &History, reference: &str) {
    let trained =
        h.validation.last().map_or_else(|| "not trained (--epochs 0)".into(), |v| format!("trained {:.4}", v.1));
    println!(
        "adapter written to {} ({what}); {} steps in {}; held-out KL: {reference} {:.4}, untrained {:.4}, {trained}",
        adapter.display(),
        h.train.len(),
        crate::progress::hms(h.seconds),
        h.none_val,
        h.initial_val,
    );
    let png = dir.join("loss.png");
    if png.exists() {
        println!("loss curve: {}", png.display());
    }
}

/// Prints a run's events: sample making, baseline, steps, epochs.
fn printer<'a>(
    teacher_label: &'static str,
    baseline: impl Fn(f64, f64) -> String + 'a,
    val_label: &'static str,
) -> impl FnMut(Event) + 'a {
    let mut teacher: Option<Progress> = None;
    let mut steps: Option<Progress> = None;
    move |e: Event| match e {
        Event::Teacher { done, total } => {
            teacher.get_or_insert_with(|| Progress::new(total, teacher_label)).inc(&format!("sample {done}"));
        }
        Event::Baseline { reference, initial } => {
            teacher = None;
            eprintln!("{}", baseline(reference, initial));
        }
        Event::Step { step, total, loss, lr, seconds } => {
            let p = steps.get_or_insert_with(|| Progress::new(total + 1 - step, "steps"));
            p.inc(&format!("step {step}/{total}: KL {loss:.4}, lr {lr:.2e}, {seconds:.1} s"));
        }
        Event::Validation { epoch, loss } => {
            let line = format!("epoch {epoch}: {val_label} {loss:.4}");
            match &steps {
                Some(p) => p.println(&line),
                None => eprintln!("{line}"),
            }
        }
        Event::Saved { .. } => {}
    }
}

/// `train lookahead`.
fn run_lookahead(common: &Common, a: &LookaheadArgs) -> Result<()> {
    let settings = a.settings();
    settings.check().map_err(|e| anyhow::Error::new(crate::exit::Usage(e.to_string())))?;
    let path = super::model_path(common)?;
    let lm = LoadedModel::load(&path, Cpu).with_context(|| format!("loading {}", path.display()))?;
    let tm = TrainModel::from_gguf(&path).with_context(|| format!("loading {} for training", path.display()))?;
    let out = lookahead::Outputs {
        dir: a.out.clone(),
        adapter: a.adapter_out.clone().unwrap_or_else(|| lookahead::default_adapter(&a.out)),
    };
    eprintln!(
        "training LookaheadKV ({} rows, LoRA rank {} alpha {}) for {}: {} samples of {} tokens ({} tasks), {} epochs, batch {}, lr {}",
        settings.rows,
        settings.rank,
        settings.alpha,
        lm.model.config().name,
        settings.samples,
        settings.length,
        settings.tasks.len(),
        settings.epochs,
        settings.batch,
        settings.lr
    );
    let mut on = printer(
        "answers and their attention",
        |snap, init| {
            format!("held-out KL to the answer's attention: SnapKV {snap:.4}, lookahead rows before training {init:.4}")
        },
        "held-out KL",
    );
    let (adapter, history) = lookahead::train(&lm, &tm, &settings, &out, &mut on)?;
    let what = format!("{} rows, LoRA rank {}, hash {}", adapter.meta.rows, adapter.meta.rank, adapter.hash);
    report(&out.adapter, &out.dir, &what, &history, "SnapKV");
    Ok(())
}
