//! `bench decode`: decoding speed and the context's KV bytes, with and without KV eviction
//! before decoding (`--evict snapkv|lookahead --kv-budget N`).
//!
//! One context and one question with a long answer; every setting (the whole cache, then each
//! policy at each budget) runs `--runs` times, in rounds (all settings once, then again), so a
//! machine's drift spreads over every setting alike. Full prefill with eviction keeps the
//! context's cache in the chunk store, so after the first eviction run the others copy it
//! instead of prefilling again: the bench costs one prefill per run of the whole cache and one
//! in all for the evicting settings. Decoding is what is timed: milliseconds per decode step (one
//! per token after the first, and the one that chose the end token), the median of the runs. TTFT is reported apart for the runs that prefilled the context
//! (no chunk-store hit: cold) and those that copied it from the store, never as one median.

use crate::error::ensure_usage;
use crate::{LabError, Result};
use flowprefill_coordinator::{Context, Job, MethodSpec, Request, RunOptions, RunResult, World};
use flowprefill_kernels::Device;
use flowprefill_worker::LoadedModel;
use std::path::PathBuf;

/// One setting: the eviction, if any.
pub type Setting = Option<flowprefill_coordinator::Evict>;

/// The CSV's header line.
pub const CSV_HEADER: &str =
    "setting,run,decode_ms_per_token,tokens,ttft_ms,evict_ms,kept_per_head,context_kv_bytes,cache_hits\n";

/// A setting's name (`none`, or `POLICY-BUDGET`).
pub fn label(s: &Setting) -> String {
    s.map_or_else(|| "none".to_string(), |e| format!("{}-{}", e.policy, e.budget))
}

/// Where the context comes from: the files given, or generated prose.
pub enum Source<'a> {
    /// Generated prose of about `tokens` tokens in documents of `doc_tokens`.
    Prose {
        /// Context tokens.
        tokens: usize,
        /// Tokens per document.
        doc_tokens: usize,
    },
    /// These text files, one document each.
    Files(&'a [PathBuf]),
}

/// The request: the documents of `source` and the question `query`.
pub fn request(source: Source<'_>, query: &str, lm: &LoadedModel<Device>) -> Result<Request> {
    ensure_usage!(!query.trim().is_empty(), "--query is empty; give the question to answer");
    let docs = match source {
        Source::Prose { tokens, doc_tokens } => {
            ensure_usage!(tokens >= 1 && doc_tokens >= 1, "--tokens and --doc-tokens must be at least 1");
            super::bench_docs(&lm.tokenizer, tokens, doc_tokens, 11)?
        }
        Source::Files(files) => {
            let mut docs = Vec::new();
            for p in files {
                let text = std::fs::read_to_string(p).map_err(|e| {
                    LabError::Failed(format!("reading --doc {}: {e}; give a readable text file", p.display()))
                })?;
                ensure_usage!(
                    !text.trim().is_empty(),
                    "--doc {} is empty; remove it or give it some text",
                    p.display()
                );
                docs.push(text);
            }
            docs
        }
    };
    Ok(Request {
        conversation: Default::default(),
        context: Context::Documents(docs),
        query: query.to_string(),
        system: None,
        answer_prefix: None,
    })
}

/// One run's measures.
pub struct Sample {
    decode_ms: f64,
    tokens: usize,
    ttft_ms: f64,
    evict_ms: f64,
    kept: usize,
    kv_bytes: usize,
    cache_hits: u64,
}

/// The measures of a finished run: `full_kv` is the whole context cache's bytes (what a run
/// without eviction keeps).
fn sample(r: &RunResult, full_kv: usize) -> Option<Sample> {
    let decode_ms = super::decode_ms_per_token(r)?;
    let ph = |n: &str| r.phases.get(n).as_secs_f64() * 1e3;
    let (kept, kv_bytes) =
        r.eviction.as_ref().map_or((r.n_head_tokens + r.n_context_tokens, full_kv), |e| (e.kept(), e.bytes_after));
    Some(Sample {
        decode_ms,
        tokens: r.tokens.len(),
        ttft_ms: r.ttft.as_secs_f64() * 1e3,
        evict_ms: ph(flowprefill_coordinator::timings::phase::EVICT),
        kept,
        kv_bytes,
        cache_hits: r.cache_hits,
    })
}

/// What the rounds measured: every setting's samples, the context tokens, the CSV.
pub struct Measured {
    /// Per setting, its runs that took a decode step or more.
    pub runs: Vec<Vec<Sample>>,
    /// Context tokens of the request.
    pub n_ctx: usize,
    /// The CSV (header and one line per run).
    pub csv: String,
}

/// Every setting's job (`spec`'s prefill, `max_tokens` answer tokens), each admitted before any
/// work: a refusal (no LookaheadKV adapter for the model, a context over its window) comes
/// before the first prefill.
pub fn jobs(
    lm: &LoadedModel<Device>,
    req: &Request,
    settings: &[Setting],
    spec: MethodSpec,
    max_tokens: usize,
) -> Result<Vec<Job>> {
    let jobs: Vec<Job> = settings
        .iter()
        .map(|s| Job {
            request: req.clone(),
            options: RunOptions { max_new_tokens: max_tokens, evict: *s, ..spec.options(0.15) },
        })
        .collect();
    for job in &jobs {
        flowprefill_coordinator::admit(lm, job, &flowprefill_coordinator::Limits::NONE)?;
    }
    Ok(jobs)
}

/// Runs every setting's job once per round, `rounds` rounds; a line per run goes to `log`, and
/// the CSV so far to `csv` (replaced whole) after every run.
pub fn measure(
    world: &mut World<Device>,
    lm: &LoadedModel<Device>,
    settings: &[Setting],
    jobs: &[Job],
    rounds: usize,
    csv: Option<&std::path::Path>,
    log: &mut dyn FnMut(&str),
) -> Result<Measured> {
    let cfg = lm.model.config();
    let mut m = Measured { runs: settings.iter().map(|_| Vec::new()).collect(), n_ctx: 0, csv: CSV_HEADER.into() };
    for round in 0..rounds {
        for (i, (s, job)) in settings.iter().zip(jobs).enumerate() {
            let Some(r) = world.run(job, &mut |_| true)? else { continue };
            m.n_ctx = r.n_context_tokens;
            let full_kv = (r.n_head_tokens + r.n_context_tokens) * cfg.n_layers * cfg.kv_dim() * 2 * r.kv_bytes;
            let Some(x) = sample(&r, full_kv) else {
                log(&format!(
                    "  {} run {round}: the answer stopped after {} token(s) without a decode step; nothing to time",
                    label(s),
                    r.tokens.len()
                ));
                continue;
            };
            log(&format!(
                "  {:<16} run {round}: {:>8.2} ms/token over {} tokens, evict {:.0} ms, TTFT {:.0} ms",
                label(s),
                x.decode_ms,
                x.tokens,
                x.evict_ms,
                x.ttft_ms
            ));
            m.csv.push_str(&format!(
                "{},{round},{:.3},{},{:.1},{:.1},{},{},{}\n",
                label(s),
                x.decode_ms,
                x.tokens,
                x.ttft_ms,
                x.evict_ms,
                x.kept,
                x.kv_bytes,
                x.cache_hits
            ));
            m.runs[i].push(x);
            // After every run: an interrupted or failed measurement keeps what it measured.
            if let Some(path) = csv {
                crate::eval::write_atomic(path, m.csv.as_bytes())?;
            }
        }
    }
    Ok(m)
}

/// The table: medians per setting, and decoding against the whole cache's (newline-terminated
/// lines).
pub fn table(settings: &[Setting], runs: &[Vec<Sample>]) -> String {
    let med = |v: &mut Vec<f64>| if v.is_empty() { f64::NAN } else { crate::median(v) };
    // TTFT of the runs that prefilled the context (cold) apart from those whose context came
    // from the chunk store (one prefill serves every evicting run): "-" where there is none.
    let ttft = |r: &[Sample], from_store: bool| {
        let mut v: Vec<f64> = r.iter().filter(|m| (m.cache_hits > 0) == from_store).map(|m| m.ttft_ms).collect();
        if v.is_empty() {
            "-".to_string()
        } else {
            format!("{:.0}", crate::median(&mut v))
        }
    };
    let mut out = format!(
        "{:<16} {:>10} {:>14} {:>14} {:>16} {:>10} {:>8} {:>10} {:>13} {:>15}\n",
        "setting",
        "kept/head",
        "context KV MiB",
        "decode ms/tok",
        "(min..max)",
        "vs none",
        "tokens",
        "evict ms",
        "cold TTFT ms",
        "stored TTFT ms"
    );
    let mut none_ms = None;
    for (s, r) in settings.iter().zip(runs) {
        let Some(last) = r.last() else {
            out.push_str(&format!("{:<16} (no run took a decode step)\n", label(s)));
            continue;
        };
        let mut d: Vec<f64> = r.iter().map(|m| m.decode_ms).collect();
        let (lo, hi) = d.iter().fold((f64::MAX, 0f64), |(lo, hi), &x| (lo.min(x), hi.max(x)));
        let dm = med(&mut d);
        if s.is_none() {
            none_ms = Some(dm);
        }
        let vs = none_ms.filter(|_| s.is_some()).map_or("-".to_string(), |n| format!("{:.2}x", n / dm));
        out.push_str(&format!(
            "{:<16} {:>10} {:>14.1} {:>14.2} {:>16} {:>10} {:>8.0} {:>10.0} {:>13} {:>15}\n",
            label(s),
            last.kept,
            last.kv_bytes as f64 / (1u64 << 20) as f64,
            dm,
            format!("{lo:.1}..{hi:.1}"),
            vs,
            med(&mut r.iter().map(|m| m.tokens as f64).collect()),
            med(&mut r.iter().map(|m| m.evict_ms).collect()),
            ttft(r, false),
            ttft(r, true)
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(ttft_ms: f64, cache_hits: u64) -> Sample {
        Sample { decode_ms: 5.0, tokens: 8, ttft_ms, evict_ms: 0.0, kept: 64, kv_bytes: 1 << 20, cache_hits }
    }

    #[test]
    fn ttft_from_the_store_is_not_a_cold_ttft() {
        let evict = flowprefill_coordinator::Evict { policy: flowprefill_coordinator::EvictPolicy::Snapkv, budget: 64 };
        let settings = [None, Some(evict)];
        // The whole cache prefilled every run; the evicting setting prefilled once, then copied.
        let runs =
            vec![vec![sample(900.0, 0), sample(1000.0, 0)], vec![sample(950.0, 0), sample(20.0, 1), sample(30.0, 1)]];
        let t = table(&settings, &runs);
        let cols = |name: &str| -> Vec<String> {
            let line = t.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("no {name}: {t}"));
            line.split_whitespace().rev().take(2).map(str::to_string).collect()
        };
        // The last two columns, last first: TTFT from the store, then cold.
        assert_eq!(cols("none"), ["-", "950"], "{t}");
        assert_eq!(cols(&label(&settings[1])), ["25", "950"], "{t}");
        assert!(t.lines().next().is_some_and(|h| h.contains("cold TTFT ms") && h.contains("stored TTFT ms")), "{t}");
    }
}
