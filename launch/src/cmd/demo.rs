//! `flowprefill demo`: a fact hidden in one of eight documents, answered by every method.

use super::run::engine;
use crate::Common;
use anyhow::Result;
use flowprefill_coordinator::{Method, MethodSpec, RunOptions};
use flowprefill_lab::tasks::demo_case;

/// Arguments of `demo`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Recompute ratio of the selective methods.
    #[arg(long, default_value_t = 0.15)]
    pub ratio: f64,
}

/// The methods of the demo and check tables.
pub const TABLE: [MethodSpec; 12] = [
    spec(Method::Full, false),
    spec(Method::None, false),
    spec(Method::Infoflow, false),
    spec(Method::Infoflow, true),
    spec(Method::Prophet, false),
    spec(Method::Cacheblend, false),
    spec(Method::Epic, false),
    spec(Method::Cacheclip, false),
    spec(Method::Random, false),
    spec(Method::Star, false),
    spec(Method::Kvpacket, false),
    spec(Method::Lookahead, false),
];

const fn spec(method: Method, reorder: bool) -> MethodSpec {
    MethodSpec { method, reorder, ratio: None }
}

/// Runs the command.
pub fn run(common: &Common, args: Args) -> Result<()> {
    let engine = engine(common, None)?;
    let case = demo_case(&engine.model().tokenizer);
    let req = case.request(flowprefill_lab::tasks::PromptStyle::Plain);
    println!(
        "Question: {}  (the answer, {}, is in document {} of {})",
        case.query,
        case.answers[0],
        case.needles.first().map_or(0, |n| n.doc) + 1,
        case.documents.len()
    );
    println!(
        "cold: empty chunk store, TTFT includes chunk prefill; warm: the same question again, chunk caches reused.\n"
    );
    println!(
        "{:<17} {:<58} {:>7} {:>9} {:>7} {:>9} {:>7} {:>8}",
        "method", "answer", "correct", "cold ms", "speedup", "warm ms", "speedup", "selected"
    );
    let mut full_ttft = None;
    for spec in TABLE {
        if spec.method == Method::Kvpacket && engine.model().adapter.is_none() {
            println!("{:<17} (no KV Packet adapter for this model: give --adapter PATH)", spec.to_string());
            continue;
        }
        if spec.method == Method::Lookahead && engine.model().model.lookahead_rows() == 0 {
            println!("{:<17} (no LookaheadKV adapter for this model: give --lookahead-adapter PATH)", spec.to_string());
            continue;
        }
        engine.store().clear();
        let opts = RunOptions { max_new_tokens: 24, ..spec.options(args.ratio) };
        let cold = engine.run(&req, &opts, &mut |_| true)?;
        let cold_ms = cold.ttft.as_secs_f64() * 1e3;
        let base = *full_ttft.get_or_insert(cold_ms);
        let warm = if spec.method == Method::Full {
            None
        } else {
            Some(engine.run(&req, &opts, &mut |_| true)?.ttft.as_secs_f64() * 1e3)
        };
        let answer: String = cold.answer.trim().replace('\n', " ").chars().take(58).collect();
        let (warm_ms, warm_x) = match warm {
            Some(w) => (format!("{w:.1}"), format!("{:.2}x", base / w)),
            None => ("-".into(), "-".into()),
        };
        println!(
            "{:<17} {:<58} {:>7} {:>9.1} {:>6.2}x {:>9} {:>7} {:>8}",
            spec.to_string(),
            answer,
            if case.is_correct(&cold.answer) { "yes" } else { "no" },
            cold_ms,
            base / cold_ms,
            warm_ms,
            warm_x,
            cold.n_selected()
        );
    }
    Ok(())
}
