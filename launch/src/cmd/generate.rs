//! `flowprefill generate`: one answer with full prefill.

use crate::Common;
use anyhow::Result;
use flowprefill_worker::generate::{generate, GenerateConfig};
use flowprefill_worker::sampling::SamplingConfig;
use std::io::Write;
use std::path::PathBuf;

/// Arguments of `generate`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The question or instruction.
    #[arg(long)]
    pub prompt: String,
    /// A text file placed before the prompt in the user turn.
    #[arg(long)]
    pub context_file: Option<PathBuf>,
    /// System message (default: the template's own).
    #[arg(long)]
    pub system: Option<String>,
    /// Maximum tokens to generate.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling mass.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Sampler seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Tokens per prefill forward (default: the device's, 2048 on the CPU and 8192 on a GPU).
    #[arg(long, value_parser = super::parse_prefill_chunk)]
    pub prefill_chunk: Option<usize>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Runs the command.
pub fn run(common: &Common, args: Args) -> Result<()> {
    crate::ensure_usage!(!args.prompt.trim().is_empty(), "--prompt is empty: give the question to answer");
    crate::ensure_usage!(args.max_tokens >= 1, "--max-tokens must be at least 1 (the answer's length in tokens)");
    let user = match &args.context_file {
        Some(p) => {
            let ctx = super::read_text("--context-file", p)?;
            crate::ensure_usage!(!ctx.trim().is_empty(), "--context-file {} is empty; give it some text", p.display());
            format!("{ctx}\n\n{}", args.prompt)
        }
        None => args.prompt.clone(),
    };
    let lm = super::load_model(common)?;
    let prompt = lm.chat_prompt(args.system.as_deref(), &user)?;
    let cfg = GenerateConfig {
        max_new_tokens: args.max_tokens,
        sampling: SamplingConfig { temperature: args.temperature, top_p: args.top_p, seed: args.seed },
        prefill_chunk: args.prefill_chunk,
    };
    let stream = !args.json;
    let mut stdout = std::io::stdout();
    let g = generate(&lm.model, &lm.tokenizer, &prompt, &cfg, &mut |s| {
        if stream {
            let _ = write!(stdout, "{s}");
            let _ = stdout.flush();
        }
        true
    })?;
    if args.json {
        let obj = serde_json::json!({
            "answer": g.text,
            "prompt_tokens": g.prompt_tokens,
            "generated_tokens": g.tokens.len(),
            "ttft_ms": g.ttft.as_secs_f64() * 1e3,
            "prefill_ms": g.prefill.as_secs_f64() * 1e3,
            "decode_ms": g.decode.as_secs_f64() * 1e3,
            "decode_replayed": g.replayed,
            "stop": g.stop,
            "device": common.device.to_string(),
            "first_top_logits": super::run::top_logits(&g.first_logits, 10),
            "note": lm.synthetic.map(|s| s.notice()),
        });
        println!("{}", serde_json::to_string_pretty(&obj)?);
    } else {
        println!();
        // The steps decoding timed (one more than the ids after the first when the end token
        // stopped it), as `run` counts them.
        let steps = flowprefill_worker::generate::decode_steps(g.tokens.len(), g.stop);
        let decode_tps = if steps > 0 { steps as f64 / g.decode.as_secs_f64().max(1e-9) } else { 0.0 };
        crate::say!(
            "prompt {} tokens | TTFT {:.1} ms (prefill {:.0} tok/s) | {} tokens generated, {:.1} tok/s | stop: {:?}",
            g.prompt_tokens,
            g.ttft.as_secs_f64() * 1e3,
            g.prompt_tokens as f64 / g.prefill.as_secs_f64().max(1e-9),
            g.tokens.len(),
            decode_tps,
            g.stop
        );
    }
    Ok(())
}
