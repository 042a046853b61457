//! RULER-style synthetic tasks (Hsieh et al. 2024), generated from a seed.
//!
//! | task | needles | question | scoring |
//! | --- | --- | --- | --- |
//! | `niah_single` | one key -> a number, word or UUID | its value | any-of |
//! | `niah_multikey` | four keys, one asked | the asked key's value | any-of |
//! | `niah_multivalue` | one key, four values | all of its values | recall |
//! | `niah_multiquery` | four keys, all asked | every value | recall |
//! | `variable_tracking` | a chain `VAR A = n; VAR B = VAR A; ...` plus a distractor chain | every name bound to n | recall |

use super::{case_rng, doc_count, haystack, Needle, QaCase, Scoring};
use flowprefill_worker::tokenizer::Tokenizer;
use rand::rngs::StdRng;
use rand::Rng;

/// RULER tasks this module generates.
pub const TASKS: [&str; 5] =
    ["niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "variable_tracking"];

/// What a single needle hides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NeedleKind {
    /// A 7-digit number.
    Number,
    /// A word.
    Word,
    /// A UUID.
    Uuid,
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
    "the amber mill",
    "the quiet ferry",
    "the hollow oak",
    "the salt road",
];
/// The answer words of the needle tasks.
pub const WORDS: &[&str] = &[
    "marigold",
    "thunderbolt",
    "pinecone",
    // Never a word of the haystack's prose (it had "lighthouse", which `the lighthouse` in
    // the corpus's places answered for a method that lost the needle).
    "pomegranate",
    "cinnamon",
    "velvet",
    "harpsichord",
    "tangerine",
    "glacier",
    "porcupine",
    "saffron",
    "windmill",
    "obsidian",
    "lavender",
    "kaleidoscope",
    "parchment",
];

fn number(rng: &mut StdRng) -> String {
    rng.random_range(1_000_000..10_000_000u32).to_string()
}

fn uuid(rng: &mut StdRng) -> String {
    let h = |rng: &mut StdRng, n: usize| (0..n).map(|_| format!("{:x}", rng.random_range(0..16u8))).collect::<String>();
    format!("{}-{}-{}-{}-{}", h(rng, 8), h(rng, 4), h(rng, 4), h(rng, 4), h(rng, 12))
}

/// Distinct keys.
fn keys(rng: &mut StdRng, n: usize) -> Vec<&'static str> {
    let mut out: Vec<&str> = Vec::new();
    while out.len() < n {
        let k = KEYS[rng.random_range(0..KEYS.len())];
        if !out.contains(&k) {
            out.push(k);
        }
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn build(
    task: &str,
    rng: &mut StdRng,
    tok: &Tokenizer,
    len: usize,
    inserts: Vec<(String, f64, Option<String>)>,
    query: String,
    answers: Vec<String>,
    scoring: Scoring,
) -> QaCase {
    let n_docs = doc_count(rng);
    let pairs: Vec<(String, f64)> = inserts.iter().map(|(s, d, _)| (s.clone(), *d)).collect();
    let (documents, docs_of) = haystack(rng, tok, len, n_docs, &pairs);
    let needles: Vec<Needle> = inserts
        .into_iter()
        .zip(docs_of)
        .map(|((text, depth, answer), doc)| Needle { doc, text, answer, depth })
        .collect();
    let depth = needles.iter().find(|n| n.answer.is_some()).map_or(0.0, |n| n.depth);
    QaCase {
        id: String::new(),
        task: task.into(),
        documents,
        query,
        answers,
        scoring,
        needles,
        depth,
        target_tokens: len,
        answer_prefix: None,
    }
}

/// One key, one value at `depth`.
pub fn niah_single(tok: &Tokenizer, seed: u64, len: usize, depth: f64, kind: NeedleKind) -> QaCase {
    let mut rng = case_rng(seed);
    let key = keys(&mut rng, 1)[0];
    let (what, value) = match kind {
        NeedleKind::Number => ("number", number(&mut rng)),
        NeedleKind::Word => ("word", WORDS[rng.random_range(0..WORDS.len())].to_string()),
        NeedleKind::Uuid => ("uuid", uuid(&mut rng)),
    };
    let needle = format!("The special magic {what} for {key} is {value}.");
    let query = format!("What is the special magic {what} for {key}?");
    let mut c = build(
        "niah_single",
        &mut rng,
        tok,
        len,
        vec![(needle, depth, Some(value.clone()))],
        query,
        vec![value],
        Scoring::AnyOf,
    );
    c.answer_prefix = Some(format!("The special magic {what} for {key} mentioned in the provided text is"));
    c
}

/// Four keys with numbers; the one at `depth` is asked.
pub fn niah_multikey(tok: &Tokenizer, seed: u64, len: usize, depth: f64) -> QaCase {
    let mut rng = case_rng(seed);
    let ks = keys(&mut rng, 4);
    let mut inserts = Vec::new();
    let mut answer = String::new();
    for (i, k) in ks.iter().enumerate() {
        let v = number(&mut rng);
        let d = if i == 0 { depth } else { rng.random_range(0.0..1.0) };
        if i == 0 {
            answer = v.clone();
        }
        inserts.push((format!("The special magic number for {k} is {v}."), d, (i == 0).then(|| v.clone())));
    }
    let query = format!("What is the special magic number for {}?", ks[0]);
    let mut c = build("niah_multikey", &mut rng, tok, len, inserts, query, vec![answer], Scoring::AnyOf);
    c.answer_prefix = Some(format!("The special magic number for {} mentioned in the provided text is", ks[0]));
    c
}

/// One key with four numbers spread from `depth`; all are asked.
pub fn niah_multivalue(tok: &Tokenizer, seed: u64, len: usize, depth: f64) -> QaCase {
    let mut rng = case_rng(seed);
    let key = keys(&mut rng, 1)[0];
    let mut inserts = Vec::new();
    let mut answers = Vec::new();
    for i in 0..4 {
        let v = number(&mut rng);
        let d = (depth + 0.2 * i as f64) % 1.0;
        inserts.push((format!("One of the special magic numbers for {key} is {v}."), d, Some(v.clone())));
        answers.push(v);
    }
    let query = format!("What are all the special magic numbers for {key}?");
    let mut c = build("niah_multivalue", &mut rng, tok, len, inserts, query, answers, Scoring::AllOf);
    c.answer_prefix = Some(format!("The special magic numbers for {key} mentioned in the provided text are"));
    c
}

/// Four keys with numbers spread from `depth`; all are asked.
pub fn niah_multiquery(tok: &Tokenizer, seed: u64, len: usize, depth: f64) -> QaCase {
    let mut rng = case_rng(seed);
    let ks = keys(&mut rng, 4);
    let mut inserts = Vec::new();
    let mut answers = Vec::new();
    for (i, k) in ks.iter().enumerate() {
        let v = number(&mut rng);
        let d = (depth + 0.2 * i as f64) % 1.0;
        inserts.push((format!("The special magic number for {k} is {v}."), d, Some(v.clone())));
        answers.push(v);
    }
    let query = format!("What are the special magic numbers for {}, {}, {} and {}?", ks[0], ks[1], ks[2], ks[3]);
    let mut c = build("niah_multiquery", &mut rng, tok, len, inserts, query, answers, Scoring::AllOf);
    c.answer_prefix = Some(format!(
        "The special magic numbers for {}, {}, {} and {} mentioned in the provided text are",
        ks[0], ks[1], ks[2], ks[3]
    ));
    c
}

fn var_name(rng: &mut StdRng) -> String {
    (0..5).map(|_| (b'A' + rng.random_range(0..26u8)) as char).collect()
}

/// A chain of four assignments starting with a number at `depth` (multi-hop), and a
/// distractor chain with another number.
pub fn variable_tracking(tok: &Tokenizer, seed: u64, len: usize, depth: f64) -> QaCase {
    let mut rng = case_rng(seed);
    let value = rng.random_range(10_000..100_000u32).to_string();
    let other = rng.random_range(10_000..100_000u32).to_string();
    let mut names: Vec<String> = Vec::new();
    while names.len() < 8 {
        let n = var_name(&mut rng);
        if !names.contains(&n) {
            names.push(n);
        }
    }
    let mut inserts = Vec::new();
    for (chain, (v, start)) in [(value.clone(), depth), (other, rng.random_range(0.0..1.0))].into_iter().enumerate() {
        let ns = &names[chain * 4..chain * 4 + 4];
        for (i, n) in ns.iter().enumerate() {
            let text = if i == 0 { format!("VAR {n} = {v}.") } else { format!("VAR {n} = VAR {}.", ns[i - 1]) };
            let d = (start + 0.12 * i as f64).min(0.99);
            inserts.push((text, d, (chain == 0).then(|| n.clone())));
        }
    }
    let query = format!("Find all variables that are assigned the value {value} in the text above, directly or through other variables.");
    let answers = names[..4].to_vec();
    let mut c = build("variable_tracking", &mut rng, tok, len, inserts, query, answers, Scoring::AllOf);
    // RULER's variable-tracking answer prefix.
    c.answer_prefix = Some(format!(
        "Answer: According to the chain(s) of variable assignment in the text above, 4 variables are assigned the value {value}, they are:"
    ));
    c
}

/// Case `sample` of `task` at `len` tokens; depths cycle through `depths`.
pub fn generate(task: &str, tok: &Tokenizer, seed: u64, len: usize, sample: usize, depths: &[f64]) -> Option<QaCase> {
    let depth = depths[sample % depths.len().max(1)];
    let s = super::seed_family(seed)
        ^ ((len as u64) << 24)
        ^ ((sample as u64) << 4)
        ^ task.bytes().fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(b as u64));
    let mut c = match task {
        "niah_single" => {
            let kind = [NeedleKind::Number, NeedleKind::Word, NeedleKind::Uuid][sample % 3];
            niah_single(tok, s, len, depth, kind)
        }
        "niah_multikey" => niah_multikey(tok, s, len, depth),
        "niah_multivalue" => niah_multivalue(tok, s, len, depth),
        "niah_multiquery" => niah_multiquery(tok, s, len, depth),
        "variable_tracking" => variable_tracking(tok, s, len, depth),
        _ => return None,
    };
    c.id = format!("{task}-{len}-{sample}");
    Some(c)
}
