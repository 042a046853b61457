//! `flowprefill demo`: a fact hidden in one of eight documents, answered by every method.

use crate::Common;
use anyhow::Result;
use flowprefill_coordinator::{Method, MethodSpec, RunOptions};
use flowprefill_lab::tasks::{demo_case, demo_cross_case, demo_cross_what, PromptStyle};

/// Arguments of `demo`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Recompute ratio of the selective methods (a method written `NAME@RATIO` keeps its own).
    #[arg(long, default_value_t = 0.15)]
    pub ratio: f64,
    /// Only these methods (comma-separated, as `--method` writes them: e.g.
    /// full,none,infoflow@0.3; full must be one, the baseline of the speedups).
    #[arg(long)]
    pub methods: Option<String>,
}

/// The methods of the demo and check tables (each method's row says whether it is shown, and
/// with which reorder settings).
pub fn all_rows() -> Vec<MethodSpec> {
    Method::demo_table()
        .into_iter()
        .map(|(method, reorder)| MethodSpec { method, reorder, ratio: None, coverage: None })
        .collect()
}

/// The rows `--methods` asks for (default: [`all_rows`]), in the table's order, full first. A
/// method is written as everywhere else (`NAME[+reorder][@RATIO]`); the one method the table
/// lacks, ring, needs several ranks.
pub fn table(list: Option<&str>) -> Result<Vec<MethodSpec>> {
    let all = all_rows();
    let Some(list) = list else { return Ok(all) };
    let wanted = MethodSpec::parse_list(list)?;
    let row = |w: &MethodSpec| all.iter().position(|t| t.method == w.method && t.reorder == w.reorder);
    for w in &wanted {
        crate::ensure_usage!(
            row(w).is_some(),
            "--methods: `{w}` is not one of this table's: {} (each may take @RATIO)",
            all.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
        );
    }
    let mut rows = wanted.clone();
    rows.sort_by_key(|w| row(w));
    rows.dedup();
    crate::ensure_usage!(
        rows.first().is_some_and(|t| t.method == Method::Full),
        "--methods must include full (the baseline)"
    );
    Ok(rows)
}

/// One row of a question's table.
struct Row {
    spec: MethodSpec,
    correct: bool,
    cold_ms: f64,
    warm_ms: Option<f64>,
}

/// Runs the command.
pub fn run(common: &Common, args: Args) -> Result<()> {
    // Parsed before the model loads, so a bad list or ratio fails fast.
    flowprefill_coordinator::request::check_ratio(args.ratio).map_err(|e| crate::exit::usage(e.to_string()))?;
    let table = table(args.methods.as_deref())?;
    let engine = super::run::cold_engine(common, "demo")?;
    let tok = &engine.model().tokenizer;
    let questions = [
        (demo_case(tok), PromptStyle::Plain, "one fact, stated in one document"),
        (demo_cross_case(tok), PromptStyle::Ruler, demo_cross_what()),
    ];
    // One untimed run first: the process's first job pays once for what every later one finds
    // ready (pages of the weights, thread pools, buffers; on a GPU, kernels loaded and the
    // attention autotuned), and it was full's, the baseline of every speedup.
    let warm_up = RunOptions { max_new_tokens: 1, ..table[0].options(args.ratio) };
    engine.run(&questions[0].0.request(questions[0].1), &warm_up, &mut |_| true)?;
    engine.store().clear();
    println!(
        "cold: empty chunk store, TTFT includes chunk prefill; warm: the same question again, chunk caches reused \
         (after one untimed run of full, which pays the process's one-time costs).\n"
    );
    let mut tables = Vec::new();
    for (i, (case, style, what)) in questions.iter().enumerate() {
        println!(
            "Question {} of {} ({what}): {}  (the answer, {}, is in document {} of {})",
            i + 1,
            questions.len(),
            case.query,
            case.answers.join(", "),
            case.needles.iter().find(|n| n.answer.is_some()).map_or(0, |n| n.doc) + 1,
            case.documents.len()
        );
        tables.push(question(&engine, case, *style, &table, args.ratio)?);
        println!();
    }
    println!("{}", reading(&tables[0], &tables[1], args.ratio));
    Ok(())
}

/// Every method of `table` on `case`: one printed row each, and the rows.
fn question(
    engine: &flowprefill_coordinator::Engine<flowprefill_kernels::Device>,
    case: &flowprefill_lab::tasks::QaCase,
    style: PromptStyle,
    table: &[MethodSpec],
    ratio: f64,
) -> Result<Vec<Row>> {
    let req = case.request(style);
    println!(
        "{:<17} {:<58} {:>7} {:>9} {:>7} {:>9} {:>7} {:>8}",
        "method", "answer", "correct", "cold ms", "speedup", "warm ms", "speedup", "selected"
    );
    let mut full_ttft = None;
    let mut rows = Vec::new();
    for &spec in table {
        if let Some(adapter) = spec.method.info().adapter.filter(|a| !a.loaded(engine.model())) {
            let (label, flag) = (adapter.label(), adapter.flag());
            println!("{:<17} (no {label} adapter for this model: give {flag} PATH)", spec.to_string());
            continue;
        }
        engine.store().clear();
        let opts = RunOptions { max_new_tokens: 24, ..spec.options(ratio) };
        let cold = engine.run(&req, &opts, &mut |_| true)?;
        let cold_ms = cold.ttft.as_secs_f64() * 1e3;
        let base = *full_ttft.get_or_insert(cold_ms);
        let warm_ms = if spec.method == Method::Full {
            None
        } else {
            Some(engine.run(&req, &opts, &mut |_| true)?.ttft.as_secs_f64() * 1e3)
        };
        let answer: String = cold.answer.trim().replace('\n', " ").chars().take(58).collect();
        let (warm_text, warm_x) = match warm_ms {
            Some(w) => (format!("{w:.1}"), format!("{:.2}x", base / w)),
            None => ("-".into(), "-".into()),
        };
        let correct = case.is_correct_with(&cold.answer, style);
        println!(
            "{:<17} {:<58} {:>7} {:>9.1} {:>6.2}x {:>9} {:>7} {:>8}",
            spec.to_string(),
            answer,
            if correct { "yes" } else { "no" },
            cold_ms,
            base / cold_ms,
            warm_text,
            warm_x,
            cold.n_selected()
        );
        rows.push(Row { spec, correct, cold_ms, warm_ms });
    }
    Ok(rows)
}

/// One paragraph that says what the two tables show, from what they measured.
fn reading(first: &[Row], second: &[Row], ratio: f64) -> String {
    let names = |rows: &[Row], correct: bool| -> Vec<String> {
        rows.iter()
            .filter(|r| r.correct == correct && r.spec.method != Method::Full)
            .map(|r| format!("`{}`", r.spec))
            .collect()
    };
    let full_ms = first.iter().find(|r| r.spec.method == Method::Full).map(|r| r.cold_ms);
    fn infoflow(rows: &[Row]) -> Option<&Row> {
        rows.iter().find(|r| r.spec.method == Method::Infoflow && !r.spec.reorder)
    }
    let mut out = String::from("What the tables show: ");
    let right1 = first.iter().filter(|r| r.correct).count();
    out.push_str(&format!("question 1 is answered by {right1} of {} methods", first.len()));
    if let (Some(f), Some(w)) = (full_ms, infoflow(first).and_then(|r| r.warm_ms)) {
        out.push_str(&format!(", and reusing chunk caches makes InfoFlow {:.1}x faster than full prefill", f / w));
    }
    out.push_str(": one document holds the whole answer, so caches made apart lose little. ");
    let (wrong2, right2) = (names(second, false), names(second, true));
    let full_right = second.iter().any(|r| r.spec.method == Method::Full && r.correct);
    if !full_right {
        out.push_str("On question 2 full prefill itself is wrong here, so it shows nothing about the methods.");
        return out;
    }
    out.push_str("Question 2 needs what the documents say about each other: ");
    if wrong2.is_empty() {
        out.push_str("every method answered it on this machine.");
    } else {
        out.push_str(&format!("{} fail{} it", wrong2.join(", "), if wrong2.len() == 1 { "s" } else { "" }));
        match infoflow(second) {
            Some(r) if r.correct => out.push_str(&format!(
                ", while `infoflow` answers by recomputing the {:.0}% of context tokens the question attends to most \
                 (at their global positions): which tokens are recomputed is what keeps it right",
                100.0 * r.spec.ratio.unwrap_or(ratio)
            )),
            Some(_) => out.push_str(", and `infoflow` fails it too on this machine"),
            None => {}
        }
        if !right2.is_empty() {
            out.push_str(&format!(" (answered by {})", right2.join(", ")));
        }
        out.push('.');
    }
    out
}
