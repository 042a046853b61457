//! Built-in question sets, generated here from a seed (no downloaded data): the demo's
//! question, needle-in-a-haystack cases for `flowprefill check`, and the RULER-style and
//! multi-document QA tasks of `flowprefill eval`.
//!
//! Haystacks are the project's own seeded prose ([`crate::corpus`]); needle
//! sentences are inserted at sentence boundaries at the requested depths (fraction of the
//! context's tokens before them). Every case is a pure function of its seed.

pub mod qa;
pub mod ruler;

use crate::corpus;
use flowprefill_worker::tokenizer::Tokenizer;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::ops::Range;

/// A fixed question in two hops across documents: the gate's code is the number a word
/// defined in another document stands for. Without recomputation (`none`) SmolLM2-135M answers
/// [`TWO_HOP_WRONG`] (the other word's number), full prefill [`TWO_HOP_ANSWER`]; the tests of
/// verification and the quality gate (suite, CLI, service) ask it.
pub const TWO_HOP_DOCS: [&str; 3] = [
    "Note for the guards: the word FALCON stands for the number 3817, and the word HERON stands for 5264.",
    "The market opens at nine. The baker sells bread and the weaver sells cloth. Boats rest in the harbour at night.",
    "The access code for the north gate is the number that HERON stands for.",
];
/// The question of [`TWO_HOP_DOCS`].
pub const TWO_HOP_QUERY: &str = "What is the access code for the north gate? Answer with the number.";
/// The right answer of [`TWO_HOP_DOCS`].
pub const TWO_HOP_ANSWER: &str = "5264";
/// The wrong answer a method without cross-document recomputation gives.
pub const TWO_HOP_WRONG: &str = "3817";

/// How an answer is scored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scoring {
    /// 1 if the output contains any expected string.
    AnyOf,
    /// Fraction of the expected strings the output contains (RULER multi-value tasks).
    AllOf,
    /// Multi-document QA: the score is containment of the normalized answer (models restate
    /// the question before answering); token F1 and exact match of the first sentence are
    /// reported beside it.
    Qa,
}

/// Which prompts the built-in tasks use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum PromptStyle {
    /// RULER's: the question, then the assistant's turn opened with the task's answer prefix
    /// ("The special magic number for X mentioned in the provided text is"); an expected answer
    /// matches case-insensitively with whitespace collapsed.
    #[default]
    Ruler,
    /// The question alone and exact substring matching (the evaluations before 2026-11-22).
    Plain,
}

impl PromptStyle {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            PromptStyle::Ruler => "ruler",
            PromptStyle::Plain => "plain",
        }
    }
}

/// Lower case, whitespace runs collapsed to one space (RULER's matching).
fn fold(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ").to_lowercase()
}

/// A needle inserted into a document.
#[derive(Clone, Debug)]
pub struct Needle {
    /// Document holding it.
    pub doc: usize,
    /// The inserted sentence.
    pub text: String,
    /// The part of the sentence that answers the question, if any.
    pub answer: Option<String>,
    /// Depth in [0, 1] it was placed at.
    pub depth: f64,
}

/// A question over documents with its expected answers.
#[derive(Clone, Debug)]
pub struct QaCase {
    /// Identifier (task, length, sample).
    pub id: String,
    /// Task name.
    pub task: String,
    /// The documents, in order (one chunk each).
    pub documents: Vec<String>,
    /// The question.
    pub query: String,
    /// Expected answers.
    pub answers: Vec<String>,
    /// Scoring rule.
    pub scoring: Scoring,
    /// The inserted sentences.
    pub needles: Vec<Needle>,
    /// Depth of the (first) answer-bearing needle.
    pub depth: f64,
    /// Context length the case was built for (tokens).
    pub target_tokens: usize,
    /// RULER's answer prefix for this question (used with [`PromptStyle::Ruler`]).
    pub answer_prefix: Option<String>,
}

/// Score of one answer.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Score {
    /// In [0, 1] (substring match, recall, or F1).
    pub value: f64,
    /// Exact match (QA only).
    pub em: Option<bool>,
    /// Token F1 (QA only).
    pub f1: Option<f64>,
}

/// Lower-case, punctuation and articles removed, whitespace collapsed (SQuAD-style).
pub fn normalize(s: &str) -> String {
    let lower: String =
        s.to_lowercase().chars().map(|c| if c.is_alphanumeric() || c.is_whitespace() { c } else { ' ' }).collect();
    lower.split_whitespace().filter(|w| !matches!(*w, "a" | "an" | "the")).collect::<Vec<_>>().join(" ")
}

/// Token F1 between a prediction and a reference after [`normalize`].
pub fn token_f1(pred: &str, reference: &str) -> f64 {
    let p: Vec<String> = normalize(pred).split_whitespace().map(String::from).collect();
    let r: Vec<String> = normalize(reference).split_whitespace().map(String::from).collect();
    if p.is_empty() || r.is_empty() {
        return (p.is_empty() && r.is_empty()) as u8 as f64;
    }
    let mut remaining = r.clone();
    let mut common = 0usize;
    for t in &p {
        if let Some(i) = remaining.iter().position(|x| x == t) {
            remaining.swap_remove(i);
            common += 1;
        }
    }
    if common == 0 {
        return 0.0;
    }
    let prec = common as f64 / p.len() as f64;
    let rec = common as f64 / r.len() as f64;
    2.0 * prec * rec / (prec + rec)
}

impl QaCase {
    /// The request of this case with `style`'s prompt.
    pub fn request(&self, style: PromptStyle) -> flowprefill_coordinator::Request {
        flowprefill_coordinator::Request {
            conversation: Default::default(),
            context: flowprefill_coordinator::Context::Documents(self.documents.clone()),
            query: self.query.clone(),
            system: None,
            answer_prefix: match style {
                PromptStyle::Ruler => self.answer_prefix.clone(),
                PromptStyle::Plain => None,
            },
        }
    }

    /// Scores an output under `style`'s matching (the QA tasks score alike under both).
    pub fn score_with(&self, output: &str, style: PromptStyle) -> Score {
        if style == PromptStyle::Plain || self.scoring == Scoring::Qa {
            return self.score(output);
        }
        let out = fold(output);
        let hits = self.answers.iter().filter(|a| out.contains(&fold(a))).count();
        let value = match self.scoring {
            Scoring::AnyOf => (hits > 0) as u8 as f64,
            _ => hits as f64 / self.answers.len().max(1) as f64,
        };
        Score { value, ..Default::default() }
    }

    /// Full-credit correctness under `style`'s matching.
    pub fn is_correct_with(&self, output: &str, style: PromptStyle) -> bool {
        self.score_with(output, style).value >= 1.0 - 1e-9
    }

    /// Scores an output (plain matching: exact substrings).
    pub fn score(&self, output: &str) -> Score {
        match self.scoring {
            Scoring::AnyOf => Score {
                value: self.answers.iter().any(|a| output.contains(a.as_str())) as u8 as f64,
                ..Default::default()
            },
            Scoring::AllOf => {
                let hit = self.answers.iter().filter(|a| output.contains(a.as_str())).count();
                Score { value: hit as f64 / self.answers.len().max(1) as f64, ..Default::default() }
            }
            Scoring::Qa => {
                let f1 = self.answers.iter().map(|a| token_f1(first_sentence(output), a)).fold(0.0, f64::max);
                let em = self.answers.iter().any(|a| normalize(first_sentence(output)) == normalize(a));
                let norm = format!(" {} ", normalize(output));
                let contains = self.answers.iter().any(|a| norm.contains(&format!(" {} ", normalize(a))));
                Score { value: contains as u8 as f64, em: Some(em), f1: Some(f1) }
            }
        }
    }

    /// Substring / full-credit correctness (score 1).
    pub fn is_correct(&self, output: &str) -> bool {
        self.score(output).value >= 1.0 - 1e-9
    }

    /// Rows of each needle (and of its answer span) in its document's chunk: `(doc, needle
    /// rows, answer rows)`. The chunk's tokens are those of the trimmed document (plus the
    /// separator), so prefix tokenization locates them.
    ///
    /// A row belongs to a span when its token covers any of the span's bytes: a token that
    /// joins the space before the needle's first word to it (`ĠThe`) is the needle's, as in
    /// the chunk itself. (Counting the tokens of the text before the span put a lone space
    /// token there instead: every range one row late, and a one-token answer an empty range.)
    pub fn needle_rows(&self, tok: &Tokenizer) -> Vec<(usize, Range<usize>, Option<Range<usize>>)> {
        let mut out = Vec::new();
        // Each document tokenized once, however many needles it holds.
        let mut spans_of: std::collections::HashMap<usize, Vec<Range<usize>>> = Default::default();
        for n in &self.needles {
            let Some(doc) = self.documents.get(n.doc).map(|d| d.trim()) else { continue };
            let Some(at) = doc.find(&n.text) else { continue };
            let spans = match spans_of.entry(n.doc) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => match tok.encode_spans(doc) {
                    Ok(s) => e.insert(s),
                    Err(_) => continue,
                },
            };
            let rows_of = |bytes: Range<usize>| {
                let first = spans.iter().position(|s| s.end > bytes.start).unwrap_or(spans.len());
                let end = spans.iter().rposition(|s| s.start < bytes.end).map_or(first, |i| (i + 1).max(first));
                first..end
            };
            let rows = rows_of(at..at + n.text.len());
            let ans =
                n.answer.as_ref().and_then(|a| n.text.find(a.as_str()).map(|o| rows_of(at + o..at + o + a.len())));
            out.push((n.doc, rows, ans));
        }
        out
    }
}

fn first_sentence(s: &str) -> &str {
    let s = s.trim();
    match s.find(['.', '\n']) {
        Some(i) if i > 0 => &s[..i],
        _ => s,
    }
}

/// Sentences of generated prose adding up to about `tokens` tokens, with their token counts.
pub(crate) fn sentences(rng: &mut StdRng, tok: &Tokenizer, tokens: usize) -> Vec<(String, usize)> {
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

/// A haystack of `n_docs` documents totalling about `tokens` tokens, with each `(sentence,
/// depth)` inserted at a sentence boundary at its depth. Returns the documents and the
/// document of each inserted sentence.
pub fn haystack(
    rng: &mut StdRng,
    tok: &Tokenizer,
    tokens: usize,
    n_docs: usize,
    inserts: &[(String, f64)],
) -> (Vec<String>, Vec<usize>) {
    let n_docs = n_docs.max(1);
    let insert_tokens: usize = inserts.iter().map(|(s, _)| tok.encode_text(s).map_or(0, |v| v.len() + 1)).sum();
    // At least a sentence each: a length too short for its documents makes them a sentence
    // long (more tokens than asked), never empty (an empty document is a request's error).
    let per_doc = (tokens.saturating_sub(insert_tokens) / n_docs).max(1);
    let mut docs: Vec<Vec<(String, usize)>> = (0..n_docs).map(|_| sentences(rng, tok, per_doc)).collect();
    let total: usize = docs.iter().flatten().map(|s| s.1).sum();
    let mut where_: Vec<usize> = Vec::with_capacity(inserts.len());
    // Insert deepest first so that earlier positions stay valid.
    let mut order: Vec<usize> = (0..inserts.len()).collect();
    order.sort_by(|&a, &b| inserts[b].1.total_cmp(&inserts[a].1));
    let mut placed = vec![(0usize, 0usize); inserts.len()];
    for &i in &order {
        let target = (inserts[i].1.clamp(0.0, 1.0) * total as f64) as usize;
        let mut acc = 0;
        let mut at = (n_docs - 1, docs[n_docs - 1].len());
        'find: for (d, doc) in docs.iter().enumerate() {
            for (j, s) in doc.iter().enumerate() {
                if acc + s.1 > target {
                    at = (d, j);
                    break 'find;
                }
                acc += s.1;
            }
        }
        let at_row = at.1.min(docs[at.0].len());
        docs[at.0].insert(at_row, (inserts[i].0.clone(), 0));
        placed[i] = at;
    }
    where_.extend(placed.iter().map(|p| p.0));
    let texts = docs.into_iter().map(|doc| doc.into_iter().map(|s| s.0).collect::<Vec<_>>().join(" ")).collect();
    (texts, where_)
}

/// The demo's question: a fact hidden in one of eight documents (~2K tokens).
pub fn demo_case(tok: &Tokenizer) -> QaCase {
    let mut rng = StdRng::seed_from_u64(2026);
    let needle = "The access code for the north gate of Brackenford is 4729.".to_string();
    let (documents, docs_of) = haystack(&mut rng, tok, 1900, 8, &[(needle.clone(), 0.62)]);
    QaCase {
        id: "demo".into(),
        task: "demo".into(),
        documents,
        query: "What is the access code for the north gate of Brackenford?".into(),
        answers: vec!["4729".into()],
        scoring: Scoring::AnyOf,
        needles: vec![Needle { doc: docs_of[0], text: needle, answer: Some("4729".into()), depth: 0.62 }],
        depth: 0.62,
        target_tokens: 1900,
        answer_prefix: None,
    }
}

/// The demo's second question: a case of the evaluation (task, length, seed, sample and depths
/// as `eval` makes it) chosen from measured runs of SmolLM2-135M at ratio 0.15 because the
/// methods that recompute nothing or random tokens get it wrong while InfoFlow answers it (see
/// [`DEMO_CROSS`]; `eval --tasks T --lengths L --seed S --samples N` reproduces the row).
pub fn demo_cross_case(tok: &Tokenizer) -> QaCase {
    let (task, len, seed, sample) = DEMO_CROSS;
    generate(task, tok, seed, len, sample, &DEPTHS).unwrap_or_else(|| unreachable!("{task} is a known task"))
}

/// What the demo's second question asks of the context.
pub fn demo_cross_what() -> &'static str {
    "several keys look alike; the question names one"
}

/// Task, length, seed and sample of the demo's second question.
pub const DEMO_CROSS: (&str, usize, u64, usize) = ("niah_multikey", 2048, 1, 11);

/// The default needle depths of `eval`, `check`, `importance` and training samples (the depth
/// of sample `i` is entry `i % 5`).
pub const DEPTHS: [f64; 5] = [0.1, 0.3, 0.5, 0.7, 0.9];

/// Refuses case lengths of no tokens (`--lengths`), naming the flag.
pub fn check_lengths(lengths: &[usize]) -> crate::Result<()> {
    crate::error::ensure_usage!(lengths.iter().all(|&n| n >= 1), "--lengths values must be at least 1 token");
    Ok(())
}

/// Refuses needle depths outside [0, 1] or not numbers (`--depths`: fractions of the context).
pub fn check_depths(depths: &[f64]) -> crate::Result<()> {
    crate::error::ensure_usage!(
        depths.iter().all(|d| (0.0..=1.0).contains(d)),
        "--depths values are fractions of the context: give numbers in [0, 1]"
    );
    Ok(())
}

/// Refuses a length or a depth given twice (`check`'s cells: the same cases twice, under one
/// id, where `--dump-cases` would write one file over the other), naming the flag.
pub fn check_cells(lengths: &[usize], depths: &[f64]) -> crate::Result<()> {
    crate::each_once("--lengths", "length", lengths)?;
    crate::each_once("--depths", "depth", depths)
}

/// A depth as case ids write it: two decimals where that is exact (0.1 is `0.10`, as ids
/// always were), every digit it needs otherwise (0.101 and 0.104 were both `0.10`).
fn depth_label(depth: f64) -> String {
    let two = format!("{depth:.2}");
    if two.parse::<f64>().ok() == Some(depth) {
        two
    } else {
        depth.to_string()
    }
}

/// What a case seed mixes in beyond a depth's thousandths: nothing where they are the depth
/// (every seed stays what it was), the depth's bits otherwise (0.1001 and 0.1004 had one seed,
/// so the same cases).
fn fine_depth(depth: f64) -> u64 {
    if ((depth * 1000.0) as u64) as f64 / 1000.0 == depth {
        0
    } else {
        fmix64(depth.to_bits()) << 8
    }
}

/// Needle-in-a-haystack cases for `check`: for each length and depth, `per_cell` cases, each
/// with 6 to 10 documents and a 7-digit number to retrieve; distinct ids and seeds for
/// distinct depths.
pub fn niah_cases(tok: &Tokenizer, seed: u64, lengths: &[usize], depths: &[f64], per_cell: usize) -> Vec<QaCase> {
    let mut cases = Vec::new();
    for &len in lengths {
        for &depth in depths {
            let fine = fine_depth(depth);
            for rep in 0..per_cell {
                let case_seed =
                    check_family(seed) ^ ((len as u64) << 20) ^ (((depth * 1000.0) as u64) << 8) ^ fine ^ rep as u64;
                let mut c = ruler::niah_single(tok, case_seed, len, depth, ruler::NeedleKind::Number);
                c.id = format!("niah-{len}-d{}-{rep}", depth_label(depth));
                cases.push(c);
            }
        }
    }
    cases
}

/// `check`'s default `--seed`: its cases are what they were before seeds were mixed.
pub const CHECK_SEED: u64 = 7;

/// splitmix64's finalizer: a bijection of the 64-bit numbers that maps 0 to 0.
fn fmix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The part of an `eval` case's seed that comes from `--seed`, XORed with the sample (bits 4
/// and up), the length (bits 24 and up) and the task. Seeds 0 to 15 are themselves (their
/// cases are those made before this mixing, and no two share a case: they differ in bits
/// 0-3, which nothing else touches); the higher bits are mixed, so that two seeds no longer
/// give the same cases one sample apart (`--seed 16` sample 0 was `--seed 0` sample 1).
pub(crate) fn seed_family(seed: u64) -> u64 {
    (seed & 0xf) ^ fmix64(seed >> 4)
}

/// The same for `check`, whose repetitions take the low bits: [`CHECK_SEED`] is itself,
/// every other seed mixed (`--seed 6` repetition 1 was `--seed 7` repetition 0).
fn check_family(seed: u64) -> u64 {
    CHECK_SEED ^ fmix64(seed ^ CHECK_SEED)
}

/// Whether `eval --seed seed` makes the cases it made before seeds were mixed (results made
/// with other seeds are of other cases).
pub fn seed_kept(seed: u64) -> bool {
    seed < 16
}

/// A seeded RNG for one case.
pub(crate) fn case_rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// Between 6 and 10 documents.
pub(crate) fn doc_count(rng: &mut StdRng) -> usize {
    rng.random_range(6..=10)
}

/// Every task `flowprefill eval` knows.
pub fn all_tasks() -> Vec<&'static str> {
    ruler::TASKS.iter().chain(qa::TASKS.iter()).copied().collect()
}

/// Case `sample` of any task (RULER depths cycle through `depths`).
pub fn generate(task: &str, tok: &Tokenizer, seed: u64, len: usize, sample: usize, depths: &[f64]) -> Option<QaCase> {
    ruler::generate(task, tok, seed, len, sample, depths).or_else(|| qa::generate(task, tok, seed, len, sample))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_below_16_keep_their_cases_and_no_two_seeds_share_one() {
        for s in 0..16 {
            assert_eq!(seed_family(s), s);
        }
        assert_eq!(check_family(CHECK_SEED), CHECK_SEED);
        // Each (seed, sample) of eval, and each (seed, repetition) of check, its own case seed.
        let mut eval = std::collections::HashSet::new();
        let mut check = std::collections::HashSet::new();
        for seed in 0..200u64 {
            for i in 0..64u64 {
                assert!(eval.insert(seed_family(seed) ^ (i << 4)), "eval --seed {seed} sample {i}");
                assert!(check.insert(check_family(seed) ^ i), "check --seed {seed} repetition {i}");
            }
        }
    }

    /// `check`'s cases: the default depths keep their ids and seeds; distinct depths get
    /// distinct ids and seeds however close; a length or depth given twice is refused.
    #[test]
    fn distinct_depths_make_distinct_cases_and_repeats_are_refused() {
        for d in DEPTHS {
            assert_eq!(fine_depth(d), 0, "{d}: its seed changed");
        }
        assert_eq!(depth_label(0.1), "0.10");
        assert_eq!(depth_label(0.5), "0.50");
        assert_eq!(depth_label(1.0), "1.00");
        assert_eq!(depth_label(0.25), "0.25");
        assert_ne!(depth_label(0.101), depth_label(0.104));
        assert_eq!(depth_label(0.101), "0.101");
        // Seeds: thousandths, then finer depths by their bits.
        let seed = |d: f64| (((d * 1000.0) as u64) << 8) ^ fine_depth(d);
        let depths = [0.1, 0.101, 0.104, 0.1001, 0.1004, 0.57, 0.569, 0.0, 1.0, 0.33333];
        let seeds: std::collections::HashSet<u64> = depths.iter().map(|&d| seed(d)).collect();
        assert_eq!(seeds.len(), depths.len(), "two depths share a seed");
        assert!(check_cells(&[1024, 2048], &[0.1, 0.5]).is_ok());
        let e = check_cells(&[1024, 2048, 1024], &[0.5]).expect_err("a length twice").to_string();
        assert!(e.contains("--lengths gives 1024 twice"), "{e}");
        let e = check_cells(&[1024], &[0.5, 0.3, 0.5]).expect_err("a depth twice").to_string();
        assert!(e.contains("--depths gives 0.5 twice"), "{e}");
    }

    #[test]
    fn scoring_rules() {
        assert_eq!(normalize("The  Quick, brown fox!"), "quick brown fox");
        assert!((token_f1("Valmora city", "Valmora") - 2.0 / 3.0).abs() < 1e-9);
        assert_eq!(token_f1("", "x"), 0.0);
        let mut c = QaCase {
            id: "t".into(),
            task: "t".into(),
            documents: vec![],
            query: "q".into(),
            answers: vec!["12".into(), "34".into()],
            scoring: Scoring::AllOf,
            needles: vec![],
            depth: 0.0,
            target_tokens: 0,
            answer_prefix: None,
        };
        assert_eq!(c.score("12 and 99").value, 0.5);
        c.scoring = Scoring::AnyOf;
        assert_eq!(c.score("12 and 99").value, 1.0);
        c.scoring = Scoring::Qa;
        c.answers = vec!["Valmora".into()];
        let s = c.score("Valmora.");
        assert_eq!((s.em, s.f1), (Some(true), Some(1.0)));
        let s = c.score("He was born in Valmora.");
        assert_eq!((s.value, s.em), (1.0, Some(false)));
        assert!((s.f1.unwrap() - 1.0 / 3.0).abs() < 1e-9);
        assert_eq!(c.score("Valmoran").value, 0.0, "whole words only");
    }

    #[test]
    fn ruler_prompts_carry_the_answer_prefix_and_match_like_ruler() {
        let c = QaCase {
            id: "t".into(),
            task: "niah_multivalue".into(),
            documents: vec!["d".into()],
            query: "What are all the special magic words for the blue heron?".into(),
            answers: vec!["Marigold".into(), "glacier".into()],
            scoring: Scoring::AllOf,
            needles: vec![],
            depth: 0.0,
            target_tokens: 0,
            answer_prefix: Some("The special magic words for the blue heron mentioned in the provided text are".into()),
        };
        assert_eq!(c.request(PromptStyle::Ruler).answer_prefix, c.answer_prefix);
        assert_eq!(c.request(PromptStyle::Plain).answer_prefix, None, "plain prompts reproduce the old runs");
        assert_eq!(c.request(PromptStyle::Ruler).query, c.query);
        // RULER: case-insensitive, whitespace collapsed; plain: exact substrings.
        let out = " marigold and\n  GLACIER.";
        assert_eq!(c.score_with(out, PromptStyle::Ruler).value, 1.0);
        assert_eq!(c.score_with(out, PromptStyle::Plain).value, 0.0);
        assert_eq!(c.score_with("Marigold", PromptStyle::Plain).value, 0.5);
        let spaced = QaCase { answers: vec!["a b".into()], scoring: Scoring::AnyOf, ..c.clone() };
        assert!(spaced.is_correct_with("x A\tB y", PromptStyle::Ruler));
        assert!(!spaced.is_correct_with("x A\tB y", PromptStyle::Plain));
    }
}
