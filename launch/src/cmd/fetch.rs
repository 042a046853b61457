//! `flowprefill fetch-model [NAME]`; `flowprefill write-gguf`.

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
    let mut log = |l: &str| crate::say!("{l}");
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

/// Arguments of `write-gguf`.
#[derive(clap::Args, Debug)]
#[command(group(clap::ArgGroup::new("what").required(true).args(["shape", "tokenizer_only"])))]
pub struct WriteArgs {
    /// The shape: `synthetic:SHAPE[:LAYERS]` (`bench project --list` names the shapes).
    #[arg(long)]
    pub shape: Option<String>,
    /// Write the tokenizer and chat template alone (no weights; about 1.8 MB for the default
    /// model's), for `--tokenizer` beside `--model synthetic:SHAPE` where the whole model file
    /// would not fit (a GPU machine whose calls carry little).
    #[arg(long)]
    pub tokenizer_only: bool,
    /// Element type of the matrices: f16, bf16 or f32 (norms are f32).
    #[arg(long, default_value = "f16")]
    pub dtype: flowprefill_worker::gguf_write::WeightFormat,
    /// The file to write. A file already there is refused (it may be a model of yours) unless
    /// `--force` is given; the new file is written beside it and renamed over it when complete.
    #[arg(long)]
    pub out: std::path::PathBuf,
    /// Replace a file already at `--out`.
    #[arg(long)]
    pub force: bool,
}

/// Writes a synthetic model's GGUF, or with `--tokenizer-only` the tokenizer alone (the
/// tokenizer and chat template of `--tokenizer`, else of the default model).
pub fn write_gguf(common: &Common, args: WriteArgs) -> Result<()> {
    use flowprefill_worker::gguf_write;
    use flowprefill_worker::synthetic::SyntheticSpec;
    super::out_file("--out", &args.out)?;
    if !args.force {
        if let Ok(meta) = std::fs::symlink_metadata(&args.out) {
            return Err(crate::exit::usage(format!(
                "--out {}: a file is already there ({:.2} MB); give another path, or --force to replace it",
                args.out.display(),
                meta.len() as f64 / 1e6
            )));
        }
    }
    let Some(shape) = args.shape.as_deref() else {
        let tok = super::synthetic_tokenizer(common)?;
        let w = gguf_write::write_tokenizer(&tok, &args.out)?;
        println!(
            "wrote {} (the tokenizer and chat template of {}, {:.2} MB; give it as --tokenizer)",
            args.out.display(),
            tok.display(),
            w.bytes as f64 / 1e6
        );
        return Ok(());
    };
    // The shape's errors name --shape, the flag given here (the parser's are about --model).
    let on_shape = |e: flowprefill_worker::WorkerError| match e {
        flowprefill_worker::WorkerError::Input(i) => crate::exit::Usage(format!("--shape: {}", i.problem)),
        other => crate::exit::Usage(format!("--shape {shape}: {other}")),
    };
    let spec = match SyntheticSpec::parse(shape) {
        Some(s) => s.map_err(on_shape)?,
        None => SyntheticSpec::parse(&format!("synthetic:{shape}"))
            .ok_or_else(|| crate::exit::Usage(format!("--shape {shape}: give synthetic:SHAPE[:LAYERS]")))?
            .map_err(on_shape)?,
    };
    let tok = super::synthetic_tokenizer(common)?;
    let t = std::time::Instant::now();
    let w = gguf_write::write_synthetic(&spec, args.dtype, &tok, &args.out)?;
    println!(
        "wrote {} ({}, {} weights, {} tensors, {:.2} GB) in {:.1} s",
        args.out.display(),
        spec.name(),
        args.dtype.name(),
        w.tensors,
        w.bytes as f64 / 1e9,
        t.elapsed().as_secs_f64()
    );
    Ok(())
}
