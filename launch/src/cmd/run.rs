//! `flowprefill run`: one question over documents with a chosen method.

use crate::Common;
use anyhow::{Context as _, Result};
use flowprefill_coordinator::engine::RunResult;
use flowprefill_coordinator::layout::Layout;
use flowprefill_coordinator::{explain, Context, Engine, Geometry, Method, PrefixMode, Request, RunOptions};
use flowprefill_worker::sampling::SamplingConfig;
use flowprefill_worker::{Cpu, LoadedModel};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

/// Arguments of `run`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A document (one chunk each, in order); repeat for several.
    #[arg(long = "doc", required = true)]
    pub docs: Vec<PathBuf>,
    /// The question.
    #[arg(long)]
    pub query: Option<String>,
    #[command(flatten)]
    pub method: MethodArgs,
    /// Show the selected spans in context.
    #[arg(long)]
    pub explain: bool,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Method options shared by `run`, `demo` and `check`.
#[derive(clap::Args, Debug, Clone)]
pub struct MethodArgs {
    /// full, none, infoflow, prophet, cacheblend, epic, cacheclip, random, star.
    #[arg(long, default_value = "infoflow")]
    pub method: String,
    /// Fraction of context tokens to recompute, in [0, 1].
    #[arg(long, default_value_t = 0.15)]
    pub ratio: f64,
    /// Two-stage chunk reordering (documents only).
    #[arg(long)]
    pub reorder: bool,
    /// Scoring geometry: global, hl-hp, hl-tp, tl-tp.
    #[arg(long, default_value = "global")]
    pub geometry: String,
    /// InfoFlow scoring layers, inclusive and 0-based, e.g. 17-19 (default: 55%-65% depth).
    #[arg(long)]
    pub score_layers: Option<String>,
    /// Split the joined documents into chunks of this many tokens instead of one chunk each.
    #[arg(long)]
    pub chunk_tokens: Option<usize>,
    /// Chunk prefix mode: none, shared, anchor (default: the method's).
    #[arg(long)]
    pub prefix: Option<String>,
    /// Auxiliary model for CacheClip (default: the main model).
    #[arg(long)]
    pub aux_model: Option<PathBuf>,
    /// Maximum answer tokens.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// Seed of the random selector.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl MethodArgs {
    /// Options for the coordinator.
    pub fn options(&self) -> Result<RunOptions> {
        let score_layers = match &self.score_layers {
            None => None,
            Some(s) => {
                let (a, b) = s.split_once('-').unwrap_or((s, s));
                let p = |x: &str| {
                    x.trim().parse::<usize>().with_context(|| format!("--score-layers `{s}`: expected A-B, e.g. 17-19"))
                };
                Some((p(a)?, p(b)?))
            }
        };
        Ok(RunOptions {
            method: self.method.parse::<Method>()?,
            ratio: self.ratio,
            reorder: self.reorder,
            geometry: self.geometry.parse::<Geometry>()?,
            score_layers,
            prefix: self.prefix.as_deref().map(str::parse::<PrefixMode>).transpose()?,
            max_new_tokens: self.max_tokens,
            sampling: SamplingConfig::default(),
            seed: self.seed,
            ..RunOptions::default()
        })
    }

    /// The context from document texts.
    pub fn context(&self, docs: Vec<String>) -> Context {
        match self.chunk_tokens {
            Some(n) => Context::Text { text: docs.join("\n\n"), chunk_tokens: n },
            None => Context::Documents(docs),
        }
    }
}

/// Builds the engine (main model, optional auxiliary model).
pub fn engine(common: &Common, aux: Option<&PathBuf>) -> Result<Engine<Cpu>> {
    let lm = Arc::new(super::load_model(common)?);
    let engine = Engine::new(lm, flowprefill_coordinator::DEFAULT_STORE_BYTES);
    match aux {
        None => Ok(engine),
        Some(p) => {
            let aux = LoadedModel::load(p, Cpu).with_context(|| format!("loading --aux-model {}", p.display()))?;
            Ok(engine.with_aux(Arc::new(aux))?)
        }
    }
}

/// Runs the command.
pub fn run(common: &Common, args: Args) -> Result<()> {
    let query = args.query.clone().unwrap_or_default();
    anyhow::ensure!(!query.trim().is_empty(), "the query is missing: pass --query TEXT");
    let docs = args
        .docs
        .iter()
        .map(|p| std::fs::read_to_string(p).with_context(|| format!("reading --doc {}", p.display())))
        .collect::<Result<Vec<_>>>()?;
    for (p, d) in args.docs.iter().zip(&docs) {
        anyhow::ensure!(!d.trim().is_empty(), "--doc {} is empty; remove it or give it some text", p.display());
    }
    let opts = args.method.options()?;
    let req = Request { context: args.method.context(docs), query, system: None };
    let engine = engine(common, args.method.aux_model.as_ref())?;
    let stream = !args.json;
    let mut stdout = std::io::stdout();
    if stream {
        print!("answer: ");
    }
    let r = engine.run(&req, &opts, &mut |s| {
        if stream {
            let _ = write!(stdout, "{s}");
            let _ = stdout.flush();
        }
        true
    })?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&to_json(&r))?);
    } else {
        println!();
        print_summary(&r);
        if args.explain {
            let layout = Layout::build(engine.model(), &req)?;
            println!("{}", explain::render(&engine.model().tokenizer, &layout, &r, 12));
        }
    }
    Ok(())
}

/// Human-readable summary of a run.
pub fn print_summary(r: &RunResult) {
    println!(
        "method {}{}  ratio {:.2}  context {} tokens in {} chunks  selected {} (budget {})  TTFT {:.1} ms",
        r.method,
        if r.opts.reorder { "+reorder" } else { "" },
        r.ratio,
        r.n_context_tokens,
        r.chunk_tokens.len(),
        r.n_selected(),
        r.budget,
        r.ttft.as_secs_f64() * 1e3
    );
    let phases: Vec<String> =
        r.phases.entries().iter().map(|(n, d)| format!("{n} {:.1} ms", d.as_secs_f64() * 1e3)).collect();
    println!("phases: {}", phases.join(" | "));
    println!("selected per chunk: {:?}", r.selected_counts());
    if r.order.iter().enumerate().any(|(i, &c)| i != c) {
        println!("chunk order (nearest the prompt last): {:?}", r.order);
    }
    if r.method != Method::Full {
        println!("chunk store: {} hits, {} misses (prefix mode {})", r.cache_hits, r.cache_misses, r.prefix.name());
    }
}

/// The JSON object of a run.
pub fn to_json(r: &RunResult) -> serde_json::Value {
    let phases: serde_json::Map<String, serde_json::Value> =
        r.phases.entries().iter().map(|(n, d)| (n.to_string(), serde_json::json!(d.as_secs_f64() * 1e3))).collect();
    serde_json::json!({
        "answer": r.answer,
        "ttft_ms": r.ttft.as_secs_f64() * 1e3,
        "total_ms": r.total.as_secs_f64() * 1e3,
        "phases": phases,
        "selected": r.selected_counts(),
        "n_selected": r.n_selected(),
        "budget": r.budget,
        "method": r.method.name(),
        "reorder": r.opts.reorder,
        "geometry": r.opts.geometry.name(),
        "prefix": r.prefix.name(),
        "ratio": r.ratio,
        "n_context_tokens": r.n_context_tokens,
        "n_prompt_tokens": r.n_prompt_tokens,
        "chunk_tokens": r.chunk_tokens,
        "order": r.order,
        "importance": r.importance,
        "cache_hits": r.cache_hits,
        "cache_misses": r.cache_misses,
        "stop": r.stop,
    })
}
