//! The benchmarks of `flowprefill bench`: what each one measures and how it reports it (the
//! binary parses the arguments, loads the model, makes the ranks and prints).
//!
//! * [`prefill`]: full prefill of generated prose, timed per length;
//! * [`ttft`]: TTFT per method, rank count and chunk-cache state, beside its projection;
//! * [`stream`]: a Zipf-popular stream of questions over a corpus (chunk-store hit rate);
//! * [`load`]: concurrent clients against a `serve` process;
//! * [`decode`]: decoding speed with and without KV eviction.

pub mod decode;
pub mod load;
pub mod prefill;
pub mod stream;
pub mod ttft;

use crate::corpus;
use flowprefill_coordinator::RunResult;

/// Documents of about `doc_tokens` tokens each, about `total` tokens in all, with a needle. A
/// tokenizer error is the command's error (it once became empty documents, timed as if real).
pub fn bench_docs(
    tok: &flowprefill_worker::tokenizer::Tokenizer,
    total: usize,
    doc_tokens: usize,
    seed: u64,
) -> flowprefill_worker::Result<Vec<String>> {
    docs_from(|t| tok.encode_text(t), |ids| tok.decode(ids), total, doc_tokens, seed)
}

/// [`bench_docs`] with the tokenizer's two functions given apart (so that a test can fail them).
fn docs_from<E>(
    encode: impl FnOnce(&str) -> std::result::Result<Vec<u32>, E>,
    decode: impl Fn(&[u32]) -> std::result::Result<String, E>,
    total: usize,
    doc_tokens: usize,
    seed: u64,
) -> std::result::Result<Vec<String>, E> {
    let n_docs = total.div_ceil(doc_tokens.max(1)).max(1);
    let text = corpus::prose(seed, total * 6);
    let ids = encode(&text)?;
    let per = total / n_docs;
    (0..n_docs)
        .map(|i| {
            let piece = &ids[(i * per).min(ids.len())..((i + 1) * per).min(ids.len())];
            let mut d = decode(piece)?;
            if i == n_docs / 2 {
                d.push_str(" The access code for the north gate is 4729.");
            }
            Ok(d)
        })
        .collect()
}

/// Milliseconds per decode step: the decode phase over the steps it ran
/// ([`flowprefill_worker::generate::decode_steps`]: one per token after the first, and the one
/// that chose the end token where that stopped it); `None` when no step ran.
pub fn decode_ms_per_token(r: &RunResult) -> Option<f64> {
    let decode = r.phases.entries().iter().find(|(n, _)| *n == flowprefill_coordinator::timings::phase::DECODE)?.1;
    let steps = flowprefill_worker::generate::decode_steps(r.tokens.len(), r.stop);
    (steps > 0).then(|| decode.as_secs_f64() * 1e3 / steps as f64)
}

#[cfg(test)]
mod docs_tests {
    use super::docs_from;

    #[test]
    fn a_tokenizer_error_is_an_error_not_empty_documents() {
        let encode = |t: &str| Ok::<_, String>(t.split_whitespace().map(|w| w.len() as u32).collect());
        let decode = |ids: &[u32]| Ok::<_, String>(ids.iter().map(|i| format!("w{i} ")).collect());
        let docs = docs_from(encode, decode, 400, 100, 3).expect("a working tokenizer");
        assert_eq!(docs.len(), 4);
        assert!(docs.iter().all(|d| !d.is_empty()) && docs[2].contains("north gate is 4729"));
        let e = docs_from(|_: &str| Err("encode failed".to_string()), decode, 400, 100, 3).unwrap_err();
        assert_eq!(e, "encode failed");
        let e = docs_from(encode, |_: &[u32]| Err::<String, _>("decode failed".to_string()), 400, 100, 3).unwrap_err();
        assert_eq!(e, "decode failed");
    }
}
