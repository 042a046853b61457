//! Built-in question sets, generated here from a seed (no downloaded data): the demo's
//! multi-document question and needle-in-a-haystack cases for `flowprefill check`.
//!
//! Haystacks are the project's own seeded prose ([`flowprefill_worker::corpus`]); a needle
//! sentence carrying a random number is inserted at a sentence boundary at the requested depth
//! (fraction of the context's tokens before it).

use flowprefill_worker::corpus;
use flowprefill_worker::tokenizer::Tokenizer;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A question over documents with acceptable answers.
#[derive(Clone, Debug)]
pub struct QaCase {
    /// Identifier (length, depth, seed).
    pub id: String,
    /// The documents, in order.
    pub documents: Vec<String>,
    /// The question.
    pub query: String,
    /// The answer is correct if it contains any of these.
    pub answers: Vec<String>,
    /// Document holding the needle.
    pub needle_doc: usize,
    /// Needle depth in [0, 1].
    pub depth: f64,
    /// Context length the case was built for (tokens).
    pub target_tokens: usize,
    /// The inserted needle sentence.
    pub needle: String,
}

impl QaCase {
    /// Substring match of any acceptable answer.
    pub fn is_correct(&self, answer: &str) -> bool {
        self.answers.iter().any(|a| answer.contains(a.as_str()))
    }

    /// Token rows of the needle sentence and of its answer inside the needle document's chunk
    /// (documents mode; the chunk tokens are those of the document plus its separator).
    pub fn needle_rows(&self, tok: &Tokenizer) -> Option<(std::ops::Range<usize>, std::ops::Range<usize>)> {
        let doc = self.documents.get(self.needle_doc)?.trim();
        let at = doc.find(&self.needle)?;
        let before = tok.encode_text(&doc[..at]).ok()?.len();
        let with = tok.encode_text(&doc[..at + self.needle.len()]).ok()?.len();
        let answer = self.answers.first()?;
        let a_at = at + self.needle.find(answer.as_str())?;
        let a_before = tok.encode_text(&doc[..a_at]).ok()?.len();
        let a_with = tok.encode_text(&doc[..a_at + answer.len()]).ok()?.len();
        Some((before..with, a_before..a_with))
    }
}

const KEYS: &[&str] = &[
    "the blue heron",
    "the copper kettle",
    "the silver fox",
    "the old granary",
    "the north gate",
    "the east tower",
    "the red lantern",
    "the stone well",
    "the iron anchor",
    "the glass house",
    "the cedar bridge",
    "the wool market",
];

/// Sentences of generated prose adding up to about `tokens` tokens.
fn sentences(rng: &mut StdRng, tok: &Tokenizer, tokens: usize) -> Vec<(String, usize)> {
    let mut out = Vec::new();
    let mut total = 0;
    while total < tokens {
        let s = corpus::sentence(rng);
        let n = tok.encode_text(&format!(" {s}")).map(|v| v.len()).unwrap_or(s.len() / 4);
        total += n;
        out.push((s, n));
    }
    out
}

/// A haystack of `n_docs` documents totalling about `tokens` tokens with `needle` inserted at
/// `depth`; returns the documents and the needle's document.
fn haystack(
    rng: &mut StdRng,
    tok: &Tokenizer,
    tokens: usize,
    n_docs: usize,
    needle: &str,
    depth: f64,
) -> (Vec<String>, usize) {
    let per_doc = tokens / n_docs.max(1);
    let docs: Vec<Vec<(String, usize)>> = (0..n_docs).map(|_| sentences(rng, tok, per_doc)).collect();
    let total: usize = docs.iter().flatten().map(|s| s.1).sum();
    let target = (depth.clamp(0.0, 1.0) * total as f64) as usize;
    let mut acc = 0;
    let mut at = (n_docs - 1, docs[n_docs - 1].len());
    'find: for (d, doc) in docs.iter().enumerate() {
        for (i, s) in doc.iter().enumerate() {
            if acc + s.1 > target {
                at = (d, i);
                break 'find;
            }
            acc += s.1;
        }
    }
    let texts = docs
        .into_iter()
        .enumerate()
        .map(|(d, doc)| {
            let mut parts: Vec<String> = doc.into_iter().map(|s| s.0).collect();
            if d == at.0 {
                parts.insert(at.1.min(parts.len()), needle.to_string());
            }
            parts.join(" ")
        })
        .collect();
    (texts, at.0)
}

/// The demo's question: a fact hidden in one of eight documents (~2K tokens).
pub fn demo_case(tok: &Tokenizer) -> QaCase {
    let mut rng = StdRng::seed_from_u64(2026);
    let needle = "The access code for the north gate of Brackenford is 4729.";
    let (documents, needle_doc) = haystack(&mut rng, tok, 1900, 8, needle, 0.62);
    QaCase {
        id: "demo".into(),
        documents,
        query: "What is the access code for the north gate of Brackenford?".into(),
        answers: vec!["4729".into()],
        needle_doc,
        depth: 0.62,
        target_tokens: 1900,
        needle: needle.into(),
    }
}

/// Needle-in-a-haystack cases: for each length and depth, `per_cell` cases (seeded), each
/// with 6 to 10 documents and a 7-digit number to retrieve.
pub fn niah_cases(tok: &Tokenizer, seed: u64, lengths: &[usize], depths: &[f64], per_cell: usize) -> Vec<QaCase> {
    let mut cases = Vec::new();
    for &len in lengths {
        for &depth in depths {
            for rep in 0..per_cell {
                let case_seed = seed ^ (len as u64) << 20 ^ ((depth * 1000.0) as u64) << 8 ^ rep as u64;
                let mut rng = StdRng::seed_from_u64(case_seed);
                let key = KEYS[rng.random_range(0..KEYS.len())];
                let number = rng.random_range(1_000_000..10_000_000u32).to_string();
                let n_docs = rng.random_range(6..=10);
                let needle = format!("The special magic number for {key} is {number}.");
                let (documents, needle_doc) = haystack(&mut rng, tok, len, n_docs, &needle, depth);
                let needle = needle.clone();
                cases.push(QaCase {
                    id: format!("niah-{len}-d{depth:.2}-{rep}"),
                    documents,
                    query: format!("What is the special magic number for {key}?"),
                    answers: vec![number],
                    needle_doc,
                    depth,
                    target_tokens: len,
                    needle,
                });
            }
        }
    }
    cases
}
