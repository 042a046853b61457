//! `--explain`: the selected spans shown in their context.

use crate::engine::RunResult;
use crate::layout::Layout;
use flowprefill_worker::tokenizer::Tokenizer;

/// Characters of context shown on each side of a selected span.
const CONTEXT_CHARS: usize = 40;

/// The selected spans of one chunk (`run --explain`; `explain` in `run --explain --json`).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ChunkSpans {
    /// The chunk (request order).
    pub chunk: usize,
    /// Its tokens, and how many of them were selected.
    pub tokens: usize,
    /// Selected tokens.
    pub selected: usize,
    /// The first runs of consecutive selected tokens, in the chunk's order.
    pub spans: Vec<Span>,
    /// Runs left out past the first `max_spans`.
    pub more: usize,
}

/// A run of consecutive selected tokens with up to [`CONTEXT_CHARS`] characters on each side.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Span {
    /// The selected tokens' rows in the chunk, `[start, end)`.
    pub rows: [usize; 2],
    /// The text before them.
    pub before: String,
    /// Their text.
    pub text: String,
    /// The text after them.
    pub after: String,
}

/// The selected spans of every chunk with any, in the order the chunks were decoded; at most
/// `max_spans` per chunk.
pub fn spans(tokenizer: &Tokenizer, layout: &Layout, result: &RunResult, max_spans: usize) -> Vec<ChunkSpans> {
    let mut out = Vec::new();
    for &c in &result.order {
        let (Some(rows), Some(toks)) = (result.selected_rows.get(c), layout.chunks.get(c)) else { continue };
        if rows.is_empty() {
            continue;
        }
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for &r in rows {
            match runs.last_mut() {
                Some(s) if s.1 == r => s.1 = r + 1,
                _ => runs.push((r, r + 1)),
            }
        }
        let dec = |ids: &[u32]| tokenizer.decode(ids).unwrap_or_default().replace('\n', " ");
        let spans = runs
            .iter()
            .take(max_spans)
            .map(|&(a, b)| {
                let (a, b) = (a.min(toks.len()), b.min(toks.len()));
                let before = dec(&toks[..a]);
                let skip = before.chars().count().saturating_sub(CONTEXT_CHARS);
                Span {
                    rows: [a, b],
                    before: before.chars().skip(skip).collect(),
                    text: dec(&toks[a..b]),
                    after: dec(&toks[b..]).chars().take(CONTEXT_CHARS).collect(),
                }
            })
            .collect();
        out.push(ChunkSpans {
            chunk: c,
            tokens: toks.len(),
            selected: rows.len(),
            spans,
            more: runs.len().saturating_sub(max_spans),
        });
    }
    out
}

/// One line per run of consecutive selected tokens: `chunk c: …before⟦selected⟧after…`.
/// At most `max_spans` lines per chunk.
pub fn render(tokenizer: &Tokenizer, layout: &Layout, result: &RunResult, max_spans: usize) -> String {
    let mut out = String::new();
    for c in spans(tokenizer, layout, result, max_spans) {
        out.push_str(&format!("chunk {} ({} of {} tokens selected):\n", c.chunk, c.selected, c.tokens));
        for s in &c.spans {
            out.push_str(&format!("  …{}⟦{}⟧{}…\n", s.before, s.text, s.after));
        }
        if c.more > 0 {
            out.push_str(&format!("  ({} more spans)\n", c.more));
        }
    }
    out
}
