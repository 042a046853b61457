//! `--explain`: the selected spans shown in their context.

use crate::engine::RunResult;
use crate::layout::Layout;
use flowprefill_worker::tokenizer::Tokenizer;

/// Characters of context shown on each side of a selected span.
const CONTEXT_CHARS: usize = 40;

/// One line per run of consecutive selected tokens: `chunk c: …before⟦selected⟧after…`.
/// At most `max_spans` lines per chunk.
pub fn render(tokenizer: &Tokenizer, layout: &Layout, result: &RunResult, max_spans: usize) -> String {
    let mut out = String::new();
    for &c in &result.order {
        let rows = &result.selected_rows[c];
        if rows.is_empty() {
            continue;
        }
        let toks = &layout.chunks[c];
        out.push_str(&format!("chunk {c} ({} of {} tokens selected):\n", rows.len(), toks.len()));
        let mut spans: Vec<(usize, usize)> = Vec::new();
        for &r in rows {
            match spans.last_mut() {
                Some(s) if s.1 == r => s.1 = r + 1,
                _ => spans.push((r, r + 1)),
            }
        }
        for &(a, b) in spans.iter().take(max_spans) {
            let dec = |ids: &[u32]| tokenizer.decode(ids).unwrap_or_default().replace('\n', " ");
            let before = dec(&toks[..a]);
            let after = dec(&toks[b..]);
            let before: String =
                before.chars().rev().take(CONTEXT_CHARS).collect::<Vec<_>>().into_iter().rev().collect();
            let after: String = after.chars().take(CONTEXT_CHARS).collect();
            out.push_str(&format!("  …{before}⟦{}⟧{after}…\n", dec(&toks[a..b])));
        }
        if spans.len() > max_spans {
            out.push_str(&format!("  ({} more spans)\n", spans.len() - max_spans));
        }
    }
    out
}
