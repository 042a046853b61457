//! Multi-document QA over generated biographies and companies, with one-hop and two-hop
//! questions whose facts sit in different documents, among distractor documents.
//!
//! ```text
//!   bio of Clara Vint:      "... Clara Vint was born in Valmora in 1961. Clara Vint works as a
//!                            surveyor at Orrin Mills. ..."
//!   company Orrin Mills:    "... Orrin Mills is headquartered in Kestrel Bay. ..."
//!   one-hop:  In which city was Clara Vint born?                          -> Valmora
//!   two-hop:  In which city is the headquarters of the company where
//!             Clara Vint works?                                           -> Kestrel Bay
//! ```
//! Six biographies and four company profiles, shuffled; each is one document padded with the
//! project's prose to the target length. The other people and companies are distractors.

use super::{case_rng, sentences, Needle, QaCase, Scoring};
use flowprefill_worker::tokenizer::Tokenizer;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::Rng;

const FIRST: &[&str] =
    &["Clara", "Bruno", "Ines", "Farid", "Greta", "Jonas", "Mira", "Pavel", "Rosa", "Umar", "Vera", "Tomas"];
const LAST: &[&str] =
    &["Vint", "Harrow", "Okafor", "Lindqvist", "Moreau", "Castell", "Petrova", "Achebe", "Nakamura", "Delacroix"];
const CITIES: &[&str] = &[
    "Valmora",
    "Kestrel Bay",
    "Port Ellery",
    "Dunharrow",
    "Silvercreek",
    "Amberly",
    "Northwick",
    "Ravenmoor",
    "Calderon",
    "Westmarch",
    "Fairhollow",
    "Oakridge",
];
const COMPANIES: &[&str] = &[
    "Orrin Mills",
    "Brightwater Foundry",
    "Halcyon Textiles",
    "Meridian Shipping",
    "Copperfield Press",
    "Lantern Works",
    "Bluestone Quarries",
    "Juniper Instruments",
];
const JOBS: &[&str] =
    &["surveyor", "bookbinder", "engineer", "cartographer", "chemist", "accountant", "pilot", "archivist"];

/// The QA task names.
pub const TASKS: [&str; 2] = ["qa_onehop", "qa_twohop"];

fn pick<'a>(rng: &mut StdRng, xs: &[&'a str], used: &mut Vec<&'a str>) -> &'a str {
    loop {
        let x = xs[rng.random_range(0..xs.len())];
        if !used.contains(&x) {
            used.push(x);
            return x;
        }
    }
}

/// A document of about `tokens` tokens with `facts` placed at random sentence boundaries.
fn document(rng: &mut StdRng, tok: &Tokenizer, tokens: usize, facts: &[String]) -> String {
    let fact_tokens: usize = facts.iter().map(|f| tok.encode_text(f).map_or(0, |v| v.len())).sum();
    let mut parts: Vec<String> =
        sentences(rng, tok, tokens.saturating_sub(fact_tokens)).into_iter().map(|s| s.0).collect();
    for f in facts {
        let at = rng.random_range(0..=parts.len());
        parts.insert(at, f.clone());
    }
    parts.join(" ")
}

/// Case `sample` of a QA task at `len` tokens (`qa_onehop` or `qa_twohop`).
pub fn generate(task: &str, tok: &Tokenizer, seed: u64, len: usize, sample: usize) -> Option<QaCase> {
    let two_hop = match task {
        "qa_onehop" => false,
        "qa_twohop" => true,
        _ => return None,
    };
    let s =
        super::seed_family(seed) ^ ((len as u64) << 24) ^ ((sample as u64) << 4) ^ if two_hop { 0x2a } else { 0x15 };
    let mut rng = case_rng(s);
    let (mut used_first, mut used_last, mut used_city, mut used_co) = (vec![], vec![], vec![], vec![]);
    let companies: Vec<(&str, &str)> =
        (0..4).map(|_| (pick(&mut rng, COMPANIES, &mut used_co), pick(&mut rng, CITIES, &mut used_city))).collect();
    let people: Vec<(String, &str, usize, &str, u32)> = (0..6)
        .map(|_| {
            let name = format!("{} {}", pick(&mut rng, FIRST, &mut used_first), pick(&mut rng, LAST, &mut used_last));
            let born = CITIES[rng.random_range(0..CITIES.len())];
            let co = rng.random_range(0..companies.len());
            let job = JOBS[rng.random_range(0..JOBS.len())];
            (name, born, co, job, rng.random_range(1940..2000))
        })
        .collect();
    // Facts per document: biographies first, then company profiles; then shuffled.
    let mut docs_facts: Vec<(Vec<String>, Option<usize>, Option<usize>)> = Vec::new();
    for (i, (name, born, co, job, year)) in people.iter().enumerate() {
        docs_facts.push((
            vec![
                format!("{name} was born in {born} in {year}."),
                format!("{name} works as a {job} at {}.", companies[*co].0),
            ],
            Some(i),
            None,
        ));
    }
    for (j, (co, city)) in companies.iter().enumerate() {
        docs_facts.push((vec![format!("{co} is headquartered in {city}.")], None, Some(j)));
    }
    docs_facts.shuffle(&mut rng);
    let target = rng.random_range(0..people.len());
    let (name, born, co, _, _) = &people[target];
    let (co_name, hq) = companies[*co];
    let per_doc = len / docs_facts.len();
    let mut documents = Vec::with_capacity(docs_facts.len());
    let mut needles = Vec::new();
    for (d, (facts, person, company)) in docs_facts.iter().enumerate() {
        documents.push(document(&mut rng, tok, per_doc, facts));
        let depth = (d as f64 + 0.5) / docs_facts.len() as f64;
        if *person == Some(target) {
            if two_hop {
                needles.push(Needle { doc: d, text: facts[1].clone(), answer: Some(co_name.to_string()), depth });
            } else {
                needles.push(Needle { doc: d, text: facts[0].clone(), answer: Some(born.to_string()), depth });
            }
        }
        if two_hop && *company == Some(*co) {
            needles.push(Needle { doc: d, text: facts[0].clone(), answer: Some(hq.to_string()), depth });
        }
    }
    let (query, answer) = if two_hop {
        (format!("In which city is the headquarters of the company where {name} works?"), hq.to_string())
    } else {
        (format!("In which city was {name} born?"), born.to_string())
    };
    let depth = needles.last().map_or(0.0, |n| n.depth);
    Some(QaCase {
        id: format!("{task}-{len}-{sample}"),
        task: task.into(),
        documents,
        query,
        answers: vec![answer],
        scoring: Scoring::Qa,
        needles,
        depth,
        target_tokens: len,
        // RULER's QA template ends with "Answer:".
        answer_prefix: Some("Answer:".into()),
    })
}
