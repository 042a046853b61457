//! The token layout of a request and the positions each geometry gives it.
//!
//! ```text
//!   [ head: system turn + user header ][ chunk 0 ][ chunk 1 ] ... [ chunk K-1 ][ prompt ]
//!     template tokens, never selected   context tokens (selection candidates)   question +
//!                                                                               template close
//! ```
//! A chat's earlier turns (`Conversation::before`) are in the head, its turns after the
//! question (`Conversation::after`: answers given, follow-ups) in the prompt.
//! The chat template is rendered from the model's own Jinja template with the context as a
//! slot, so the head and the prompt are exactly what the template produces and the context
//! tokens are exactly the documents' tokens. `order` lists chunk ids in layout order (identity
//! unless reordered); positions are derived from it.

use crate::error::Result;
use crate::request::{Context, Geometry, Method, Request};
use flowprefill_kernels::Backend;
use flowprefill_worker::template::{tokenize_pieces, Message, Part, Piece};
use flowprefill_worker::LoadedModel;

/// Separator appended to each document so that documents read as paragraphs.
pub const DOC_SEPARATOR: &str = "\n\n";

/// Tokenized request.
#[derive(Clone, Debug)]
pub struct Layout {
    /// Template tokens before the context (system turn, earlier turns, user header).
    pub head: Vec<u32>,
    /// Tokens of `head` that are the caller's text (the system prompt and the turns before the
    /// context; the rest is the template's): what admission counts beside the context.
    pub head_text: usize,
    /// Context chunks in request order.
    pub chunks: Vec<Vec<u32>>,
    /// Tokens after the context: the question and the template's closing part.
    pub prompt: Vec<u32>,
}

impl Layout {
    /// Tokenizes a request with the model's tokenizer and chat template.
    pub fn build<B: Backend>(lm: &LoadedModel<B>, req: &Request) -> Result<Self> {
        check_text_fits(lm, req)?;
        let mut msgs = Vec::new();
        if let Some(s) = &req.system {
            msgs.push(Message::text("system", s));
        }
        let turn = |t: &crate::request::Turn| Message::text(t.role.name(), &t.text);
        msgs.extend(req.conversation.before.iter().map(turn));
        msgs.push(Message {
            role: "user".into(),
            parts: vec![Part::Slot(0), Part::Text(format!("Question: {}", req.query.trim()))],
        });
        msgs.extend(req.conversation.after.iter().map(turn));
        let pieces = lm.template.render_pieces(&join_runs(msgs), true)?;
        let slot_at = pieces.iter().position(|p| *p == Piece::Slot(0));
        let Some(slot_at) = slot_at.filter(|_| pieces.iter().filter(|p| **p == Piece::Slot(0)).count() == 1) else {
            return Err(flowprefill_worker::WorkerError::Template(
                "the model's chat template must render the user message exactly once".into(),
            )
            .into());
        };
        let none = |_| Ok(Vec::new());
        let head = tokenize_pieces(&lm.tokenizer, &pieces[..slot_at], none)?;
        let head_text = head.texts.iter().map(ExactSizeIterator::len).sum();
        let head = head.ids;
        let mut prompt = tokenize_pieces(&lm.tokenizer, &pieces[slot_at + 1..], none)?.ids;
        // The answer prefix opens the assistant's turn, after the template's generation prompt.
        if let Some(p) = req.answer_prefix.as_deref().filter(|p| !p.trim().is_empty()) {
            prompt.extend(lm.tokenizer.encode_text(p.trim_end())?);
        }
        let chunks = match &req.context {
            Context::Documents(docs) => tokenize_documents(&lm.tokenizer, docs)?,
            Context::Text { text, chunk_tokens } => {
                let ids = lm.tokenizer.encode_text(&format!("{}{DOC_SEPARATOR}", text.trim()))?;
                ids.chunks(*chunk_tokens).map(<[u32]>::to_vec).collect()
            }
        };
        Ok(Self { head, head_text, chunks, prompt })
    }

    /// The layout `method` computes with: as [`Layout::build`], and for a method whose adapter
    /// wraps chunks (`kvpacket`) every chunk wrapped in the model's adapter rows (soft ids past
    /// the vocabulary; see [`flowprefill_worker::adapter`]).
    pub fn for_method<B: Backend>(lm: &LoadedModel<B>, req: &Request, method: Method) -> Result<Self> {
        let mut layout = Self::build(lm, req)?;
        if let Some(needed) = method.info().adapter.filter(|a| a.wraps_chunks()) {
            let Some(adapter) = &lm.adapter else {
                return Err(needed.missing(method.name(), lm).into());
            };
            let vocab = lm.model.config().vocab_size;
            for c in &mut layout.chunks {
                *c = adapter.wrap(c, vocab);
            }
        }
        Ok(layout)
    }

    /// Context tokens (selection candidates).
    pub fn n_context(&self) -> usize {
        self.chunks.iter().map(Vec::len).sum()
    }

    /// Head + context + prompt.
    pub fn total_len(&self) -> usize {
        self.head.len() + self.n_context() + self.prompt.len()
    }

    /// First position of the prompt in the global layout.
    pub fn prompt_start(&self) -> u32 {
        (self.head.len() + self.n_context()) as u32
    }

    /// All tokens in layout `order` (for full prefill).
    pub fn full_tokens(&self, order: &[usize]) -> Vec<u32> {
        let mut v = Vec::with_capacity(self.total_len());
        v.extend_from_slice(&self.head);
        for &c in order {
            v.extend_from_slice(&self.chunks[c]);
        }
        v.extend_from_slice(&self.prompt);
        v
    }

    /// Global start position of each chunk (indexed by chunk id) under `order`.
    pub fn global_offsets(&self, order: &[usize]) -> Vec<u32> {
        let mut off = vec![0u32; self.chunks.len()];
        let mut p = self.head.len() as u32;
        for &c in order {
            off[c] = p;
            p += self.chunks[c].len() as u32;
        }
        off
    }

    /// Positions of every chunk (in layout `order`) and of the prompt under `geometry`.
    /// `local[c]` are chunk c's positions from its prefill. The head always sits at 0..P.
    pub fn positions(&self, geometry: Geometry, order: &[usize], local: &[&[u32]]) -> (Vec<Vec<u32>>, Vec<u32>) {
        let global_prompt = self.prompt_start();
        let m = self.prompt.len() as u32;
        let offsets = self.global_offsets(order);
        let chunk_pos: Vec<Vec<u32>> = order
            .iter()
            .map(|&c| {
                let n = self.chunks[c].len() as u32;
                match geometry {
                    Geometry::Global => (offsets[c]..offsets[c] + n).collect(),
                    Geometry::HlHp | Geometry::HlTp => local[c].to_vec(),
                    Geometry::TlTp => (global_prompt - n..global_prompt).collect(),
                }
            })
            .collect();
        let prompt_start = match geometry {
            Geometry::HlHp => {
                let end = order.iter().filter_map(|&c| local[c].last().map(|p| p + 1)).max().unwrap_or(0);
                end.max(self.head.len() as u32)
            }
            _ => global_prompt,
        };
        (chunk_pos, (prompt_start..prompt_start + m).collect())
    }
}

/// Adjacent messages of one role joined into one, their texts a blank line apart: a chat whose
/// roles do not alternate (two user messages in a row, a tool exchange left out between them)
/// renders under templates that require alternation (Llama 2's, Mistral's raise an error), and
/// reads the same under those that do not. A single question has nothing to join.
fn join_runs(msgs: Vec<Message>) -> Vec<Message> {
    let mut out: Vec<Message> = Vec::with_capacity(msgs.len());
    for m in msgs {
        let Some(prev) = out.last_mut().filter(|p| p.role == m.role) else {
            out.push(m);
            continue;
        };
        let mut parts = m.parts.into_iter();
        match (prev.parts.last_mut(), parts.next()) {
            (Some(Part::Text(a)), Some(Part::Text(b))) => {
                a.push_str("\n\n");
                a.push_str(&b);
            }
            (Some(Part::Text(a)), Some(first)) => {
                a.push_str("\n\n");
                prev.parts.push(first);
            }
            (_, Some(first)) => {
                prev.parts.push(Part::Text("\n\n".into()));
                prev.parts.push(first);
            }
            (_, None) => {}
        }
        prev.parts.extend(parts);
    }
    out
}

/// Text of documents this long or longer in all is tokenized on several threads.
const PARALLEL_TOKENIZE_BYTES: usize = 32 << 10;

/// Refuses a request whose text cannot fit the model's window whatever it tokenizes to (each
/// token at most the vocabulary's longest), before tokenizing it: the exact check is
/// admission's, on the tokens.
fn check_text_fits<B: Backend>(lm: &LoadedModel<B>, req: &Request) -> flowprefill_worker::Result<()> {
    let context: usize = match &req.context {
        Context::Documents(docs) => docs.iter().map(|d| d.trim().len()).sum(),
        Context::Text { text, .. } => text.trim().len(),
    };
    let others = [Some(req.query.as_str()), req.system.as_deref(), req.answer_prefix.as_deref()];
    let turns: usize = req.conversation.turns().map(|t| t.text.trim().len()).sum();
    lm.check_text_fits(context + turns + others.iter().flatten().map(|t| t.trim().len()).sum::<usize>())
}

/// Each document's tokens (its text and the separator), in order: on up to 8 threads when
/// there are several documents and enough text (tokenizing is host time before any prefill
/// starts, about 5 ms for 7,000 tokens on one thread here; a GPU waits for it).
fn tokenize_documents(
    tok: &flowprefill_worker::tokenizer::Tokenizer,
    docs: &[String],
) -> flowprefill_worker::Result<Vec<Vec<u32>>> {
    let one = |d: &String| tok.encode_text(&format!("{}{DOC_SEPARATOR}", d.trim()));
    let bytes: usize = docs.iter().map(String::len).sum();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(8).min(docs.len());
    if threads < 2 || bytes < PARALLEL_TOKENIZE_BYTES {
        return docs.iter().map(one).collect();
    }
    let per = docs.len().div_ceil(threads);
    std::thread::scope(|s| {
        let parts: Vec<_> =
            docs.chunks(per).map(|part| s.spawn(move || part.iter().map(one).collect::<Vec<_>>())).collect();
        let mut out = Vec::with_capacity(docs.len());
        for p in parts {
            let ids = p
                .join()
                .map_err(|_| flowprefill_worker::WorkerError::Tokenizer("a tokenizing thread panicked".into()))?;
            for d in ids {
                out.push(d?);
            }
        }
        Ok(out)
    })
}
