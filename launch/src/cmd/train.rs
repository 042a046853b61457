//! `flowprefill train kvpacket` and `train lookahead`: the trained methods' adapters, on the
//! CPU. The arguments both take are one struct ([`RunArgs`]; the defaults and help lines that
//! differ are set per subcommand by [`Differs`]) and one runner trains either method
//! (`flowprefill_lab::train::run`).

use crate::progress::Progress;
use crate::Common;
use anyhow::{Context, Result};
use flowprefill_lab::tasks::PromptStyle;
use flowprefill_lab::train::kvpacket::KvPacket;
use flowprefill_lab::train::lookahead::fit::LookaheadKv;
use flowprefill_lab::train::model::TrainModel;
use flowprefill_lab::train::run::{self, Event, History, Method, Outputs, Settings};
use flowprefill_worker::evict::SNAPKV_POOL;
use flowprefill_worker::{Cpu, LoadedModel};
use std::path::{Path, PathBuf};

/// What can be trained.
#[derive(clap::Subcommand, Debug)]
pub enum Train {
    /// KV Packet header/trailer adapters for `--model` (paper 001): full prefill is the teacher,
    /// chunk caches made independently with the adapters are the student; only the adapters
    /// learn. Resumable: run the same command (same --model) again to continue from the last step.
    #[command(mut_args(|a| KVPACKET.apply(a)))]
    Kvpacket(KvpacketArgs),
    /// LookaheadKV for `--model` (paper 004): 32 lookahead rows and LoRA (rank 8, alpha 32) on
    /// every projection of those rows learn to attend to the context as the model's own greedy
    /// answer does (KL per layer and KV head, eq. 5); `--evict lookahead` then keeps what they
    /// attend to. Resumable: run the same command (same --model) again to continue from the last step.
    #[command(mut_args(|a| LOOKAHEAD.apply(a)))]
    Lookahead(LookaheadArgs),
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
    /// Teacher continuation tokens at most.
    #[arg(long, default_value_t = 16)]
    pub continuation: usize,
    /// The run's arguments.
    #[command(flatten)]
    pub run: RunArgs,
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
    /// Answer tokens at most (the rows whose attention is the truth).
    #[arg(long, default_value_t = 32)]
    pub max_answer: usize,
    /// The run's arguments.
    #[command(flatten)]
    pub run: RunArgs,
}

/// The arguments `train kvpacket` and `train lookahead` share. Those without a default here
/// take the subcommand's ([`Differs`]).
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// Tasks the samples come from (comma-separated, cycled), or `all`.
    #[arg(long, default_value = "all")]
    pub tasks: String,
    /// Context tokens of a sample.
    #[arg(long, default_value_t = 1024)]
    pub length: usize,
    /// Training samples.
    #[arg(long, required = false)]
    pub samples: usize,
    /// Held-out samples scored after every epoch.
    #[arg(long, default_value_t = 8)]
    pub val_samples: usize,
    /// Passes over the samples (0 writes the untrained adapter, a baseline for ablations).
    #[arg(long, default_value_t = 4)]
    pub epochs: usize,
    /// Samples per optimiser step.
    #[arg(long, required = false)]
    pub batch: usize,
    /// Peak learning rate (the method's schedule from it).
    #[arg(long, required = false)]
    pub lr: f64,
    /// AdamW weight decay.
    #[arg(long, default_value_t = 0.0)]
    pub weight_decay: f64,
    /// Seed of the sample order, the initial values and the samples.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Prompt style of the samples.
    #[arg(long, value_enum, default_value_t = PromptStyle::Ruler)]
    pub prompts: PromptStyle,
    /// The run's folder (checkpoint, loss curve).
    #[arg(long, required = false)]
    pub out: PathBuf,
    /// Where to write the adapter (default: in `--out`).
    #[arg(long)]
    pub adapter_out: Option<PathBuf>,
}

impl KvpacketArgs {
    fn method(&self) -> KvPacket {
        KvPacket { header: self.header, trailer: self.trailer, continuation: self.continuation }
    }
}

impl LookaheadArgs {
    fn method(&self) -> LookaheadKv {
        LookaheadKv { rows: self.rows, rank: self.rank, alpha: self.alpha, max_answer: self.max_answer }
    }
}

impl RunArgs {
    fn settings<M: Method>(&self, method: M) -> Settings<M> {
        let tasks = if self.tasks.trim() == "all" {
            flowprefill_lab::tasks::all_tasks().into_iter().map(String::from).collect()
        } else {
            self.tasks.split(',').map(|t| t.trim().to_string()).filter(|t| !t.is_empty()).collect()
        };
        Settings {
            method,
            tasks,
            length: self.length,
            samples: self.samples,
            val_samples: self.val_samples,
            epochs: self.epochs,
            batch: self.batch,
            lr: self.lr,
            weight_decay: self.weight_decay,
            seed: self.seed,
            prompts: self.prompts,
        }
    }
}

/// What one subcommand sets in [`RunArgs`]: its defaults (the lab's `Settings::default()`, a
/// test holds them to it) and the help lines that name its schedule, seeds and adapter file.
struct Differs {
    samples: &'static str,
    batch: &'static str,
    lr: &'static str,
    lr_help: &'static str,
    seed_help: &'static str,
    out: &'static str,
    adapter_file: &'static str,
}

const KVPACKET: Differs = Differs {
    samples: "128",
    batch: "4",
    lr: "0.002",
    lr_help: "Peak learning rate (linear decay to 0)",
    seed_help: "Seed of the sample order, of the rows' initial noise and of the samples (training seeds start at \
                7,000,000 + 1,000,000 x seed, held-out ones at 7,500,000 + 1,000,000 x seed: apart from every \
                evaluation seed and from every --seed's held-out and held-back seeds)",
    out: "kvpacket-run",
    adapter_file: KvPacket::ADAPTER_FILE,
};

const LOOKAHEAD: Differs = Differs {
    samples: "64",
    batch: "4",
    lr: "0.001",
    lr_help: "Peak learning rate (2% warm-up, cosine decay to 0)",
    seed_help: "Seed of the sample order, of the initial values (rows' noise, LoRA A) and of the samples \
                (training seeds start at 7,200,000 + 1,000,000 x seed, held-out ones at 7,600,000 + 1,000,000 x \
                seed: apart from evaluation, KV Packet's and `importance`'s seeds for every --seed)",
    out: "lookahead-run",
    adapter_file: LookaheadKv::ADAPTER_FILE,
};

impl Differs {
    fn apply(&self, a: clap::Arg) -> clap::Arg {
        match a.get_id().as_str() {
            "samples" => a.default_value(self.samples),
            "batch" => a.default_value(self.batch),
            "lr" => a.default_value(self.lr).help(self.lr_help),
            "seed" => a.help(self.seed_help),
            "out" => a.default_value(self.out),
            "adapter_out" => a.help(format!(
                "Where to write the adapter; default: `OUT/{}`. Its own flag, not the global `--adapter` (an input, \
                 also read from `FLOWPREFILL_ADAPTER`): a training run writes outside `--out` only where this flag \
                 says so",
                self.adapter_file
            )),
            _ => a,
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
    match t {
        Train::Kvpacket(a) => train(common, &a.run, a.method()),
        Train::Lookahead(a) => train(common, &a.run, a.method()),
    }
}

/// How a method's run is told on the terminal.
trait Shown: Method {
    /// The progress label of making the samples.
    const SAMPLES: &'static str;
    /// What is trained (the first line).
    fn what(&self) -> String;
    /// The held-out losses before training: the reference's and the untrained adapter's (and
    /// the same pooled, where the method pools).
    fn baseline(reference: f64, initial: f64, pooled: Option<(f64, f64)>) -> String;
    /// The adapter written, in a few words.
    fn summary(adapter: &Self::Adapter) -> String;
}

impl Shown for KvPacket {
    const SAMPLES: &'static str = "teacher continuations";
    fn what(&self) -> String {
        format!("KV Packet adapters ({} + {} rows)", self.header, self.trailer)
    }
    fn baseline(none: f64, packet: f64, _: Option<(f64, f64)>) -> String {
        format!("held-out KL to full prefill: none {none:.4}, packets before training {packet:.4} (nats/token)")
    }
    fn summary(a: &Self::Adapter) -> String {
        format!("{} rows, hash {}", a.n_rows(), a.hash)
    }
}

impl Shown for LookaheadKv {
    const SAMPLES: &'static str = "answers and their attention";
    fn what(&self) -> String {
        format!("LookaheadKV ({} rows, LoRA rank {} alpha {})", self.rows, self.rank, self.alpha)
    }
    fn baseline(snap: f64, init: f64, pooled: Option<(f64, f64)>) -> String {
        let mut s = format!(
            "held-out KL to the answer's attention (scores unpooled, as the loss): SnapKV {snap:.4}, lookahead rows \
             before training {init:.4}"
        );
        if let Some((ps, pi)) = pooled {
            s += &format!("; pooled over {} rows as eviction: SnapKV {ps:.4}, rows {pi:.4}", SNAPKV_POOL);
        }
        s
    }
    fn summary(a: &Self::Adapter) -> String {
        format!("{} rows, LoRA rank {}, hash {}", a.meta.rows, a.meta.rank, a.hash)
    }
}

/// Trains `method` with the run's arguments `a`: loads the model, prints the progress, writes
/// and reports the adapter.
fn train<M: Shown>(common: &Common, a: &RunArgs, method: M) -> Result<()> {
    let settings = a.settings(method);
    settings.check().map_err(|e| crate::exit::usage(e.to_string()))?;
    super::check_case_lengths(common, "--length", &[settings.length])?;
    let path = super::model_path(common)?;
    let lm = LoadedModel::load(&path, Cpu).with_context(|| format!("loading {}", path.display()))?;
    let tm = TrainModel::from_gguf(&path).with_context(|| format!("loading {} for training", path.display()))?;
    let out = Outputs::new::<M>(a.out.clone(), a.adapter_out.clone());
    crate::say!(
        "training {} for {}: {} samples of {} tokens ({} tasks), {} epochs, batch {}, lr {}",
        settings.method.what(),
        lm.model.config().name,
        settings.samples,
        settings.length,
        settings.tasks.len(),
        settings.epochs,
        settings.batch,
        settings.lr
    );
    let mut on = printer(M::SAMPLES, M::baseline);
    let (adapter, history) = run::train(&lm, &tm, &settings, &out, &mut on)?;
    report(&out.adapter, &out.dir, &M::summary(&adapter), &history, M::REFERENCE);
    Ok(())
}

/// The run's last lines: the adapter, the steps and time, the held-out losses, the curve.
fn report(adapter: &Path, dir: &Path, what: &str, h: &History, reference: &str) {
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
    if let Some(p) = &h.pooled {
        let trained = p.validation.last().map_or_else(|| "not trained".into(), |v| format!("trained {:.4}", v.1));
        println!(
            "held-out KL with scores pooled over {SNAPKV_POOL} rows (as eviction): {reference} {:.4}, untrained {:.4}, \
             {trained}",
            p.reference, p.initial
        );
    }
    let png = dir.join("loss.png");
    if png.exists() {
        println!("loss curve: {}", png.display());
    }
}

/// Prints a run's events: sample making, baseline, steps, epochs.
fn printer(samples_label: &'static str, baseline: fn(f64, f64, Option<(f64, f64)>) -> String) -> impl FnMut(Event) {
    let mut teacher: Option<Progress> = None;
    let mut steps: Option<Progress> = None;
    move |e: Event| match e {
        Event::Teacher { done, total } => {
            teacher.get_or_insert_with(|| Progress::new(total, samples_label)).inc(&format!("sample {done}"));
        }
        Event::Baseline { reference, initial, pooled } => {
            teacher = None;
            crate::say!("{}", baseline(reference, initial, pooled));
        }
        Event::Step { step, total, loss, lr, seconds } => {
            let p = steps.get_or_insert_with(|| Progress::new(total + 1 - step, "steps"));
            p.inc(&format!("step {step}/{total}: KL {loss:.4}, lr {lr:.2e}, {seconds:.1} s"));
        }
        Event::Validation { epoch, loss, pooled } => {
            let mut line = format!("epoch {epoch}: held-out KL {loss:.4}");
            if let Some(p) = pooled {
                line += &format!(" (pooled {p:.4})");
            }
            match &steps {
                Some(p) => p.println(&line),
                None => crate::say!("{line}"),
            }
        }
        Event::Saved { .. } => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(subcommand)]
        train: Train,
    }

    /// With no flags, each subcommand's settings are the lab's defaults for its method.
    #[test]
    fn the_defaults_are_the_labs() {
        let parse = |sub: &str| Cli::try_parse_from(["train", sub]).expect("parses").train;
        let Train::Kvpacket(a) = parse("kvpacket") else { panic!("kvpacket") };
        assert_eq!(a.run.settings(a.method()), Settings::<KvPacket>::default());
        assert_eq!(a.run.out, PathBuf::from("kvpacket-run"));
        let Train::Lookahead(a) = parse("lookahead") else { panic!("lookahead") };
        assert_eq!(a.run.settings(a.method()), Settings::<LookaheadKv>::default());
        assert_eq!(a.run.out, PathBuf::from("lookahead-run"));
    }
}
