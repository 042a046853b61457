//! Prefill and decoding over a rotated KV cache.

use crate::attend::AppendAttend;
use crate::error::{Field, InputError, Result, WorkerError};
use crate::interrupt::Check;
use crate::kv::{KeyForm, KvCache};
use crate::model::{Logits, Model};
use crate::sampling::{Sampler, SamplingConfig};
use crate::steps::DecodeSteps;
use crate::tokenizer::Tokenizer;
use flowprefill_kernels::Backend;
use std::time::{Duration, Instant};

/// Options of [`generate`].
#[derive(Clone, Debug)]
pub struct GenerateConfig {
    /// Upper bound of generated tokens.
    pub max_new_tokens: usize,
    /// Token choice.
    pub sampling: SamplingConfig,
    /// Tokens per prefill forward; `None`: the backend's ([`Backend::prefill_rows`]).
    pub prefill_chunk: Option<usize>,
}

impl Default for GenerateConfig {
    fn default() -> Self {
        Self { max_new_tokens: 128, sampling: SamplingConfig::default(), prefill_chunk: None }
    }
}

/// Why decoding stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// The model emitted an end-of-turn token.
    EndToken,
    /// `max_new_tokens` reached.
    MaxTokens,
    /// The context window is full.
    ContextFull,
    /// The caller's callback asked to stop.
    Cancelled,
}

/// Result of [`generate`].
#[derive(Clone, Debug)]
pub struct Generation {
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Generated ids (without the end token).
    pub tokens: Vec<u32>,
    /// Generated text.
    pub text: String,
    /// Time from the start of prefill to the first token chosen.
    pub ttft: Duration,
    /// Prefill time.
    pub prefill: Duration,
    /// Time after the first token.
    pub decode: Duration,
    /// Why it stopped.
    pub stop: StopReason,
    /// Logits the first token was chosen from.
    pub first_logits: Vec<f32>,
    /// Decode steps taken from a replay of a recorded step (a CUDA graph).
    pub replayed: usize,
}

/// Runs `tokens` at positions `start..` over `cache` (rotated keys), appending them, in
/// forwards of at most `chunk` tokens. Returns the last token's logits.
pub fn prefill_into<B: Backend>(
    model: &Model<B>,
    cache: &mut KvCache<B>,
    tokens: &[u32],
    start: u32,
    chunk: usize,
) -> Result<Vec<f32>> {
    prefill_into_checked(model, cache, tokens, start, chunk, &mut crate::interrupt::never)
}

/// As [`prefill_into`], calling `check` before every layer of every forward.
pub fn prefill_into_checked<B: Backend>(
    model: &Model<B>,
    cache: &mut KvCache<B>,
    tokens: &[u32],
    start: u32,
    chunk: usize,
    check: Check<'_>,
) -> Result<Vec<f32>> {
    if tokens.is_empty() {
        return Err(InputError::new(Field::Prompt, "is empty; there is nothing to prefill").into());
    }
    let chunk = chunk.max(1);
    let mut last = Vec::new();
    for (i, piece) in tokens.chunks(chunk).enumerate() {
        let first = start + (i * chunk) as u32;
        let positions: Vec<u32> = (first..first + piece.len() as u32).collect();
        let is_last = (i + 1) * chunk >= tokens.len();
        let mut attend = AppendAttend::new(model.backend(), cache, &positions)?;
        let rows = if is_last { Logits::Last } else { Logits::None };
        let out = model.forward_checked(piece, &positions, &mut attend, rows, &mut *check)?;
        attend.commit()?;
        if is_last {
            last = out.last().to_vec();
        }
    }
    Ok(last)
}

/// The decoding loop, independent of where the KV lives: `step(token, pos)` runs one token at
/// `pos` over whatever cache the caller keeps and returns its logits. Starts with `first`
/// (already chosen), placed at `next_pos`. `on_text` receives each new piece of text and
/// returns false to stop. Returns the ids (without the end token) and why it stopped.
#[allow(clippy::too_many_arguments)]
pub fn decode_with(
    tokenizer: &Tokenizer,
    first: u32,
    sampler: &mut Sampler,
    max_new_tokens: usize,
    window: usize,
    mut next_pos: u32,
    step: &mut dyn FnMut(u32, u32) -> Result<Vec<f32>>,
    on_text: &mut dyn FnMut(&str) -> bool,
) -> Result<(Vec<u32>, StopReason)> {
    let mut ids = Vec::new();
    let mut shown = 0usize;
    let mut next = first;
    let stop = loop {
        if ids.len() >= max_new_tokens {
            break StopReason::MaxTokens;
        }
        if tokenizer.is_end(next) {
            break StopReason::EndToken;
        }
        ids.push(next);
        sampler.took_one();
        let text = tokenizer.decode(&ids)?;
        // Emit only complete characters (a multi-byte character may span tokens).
        if text.len() > shown && !text.ends_with('\u{FFFD}') {
            let keep_going = on_text(text.get(shown..).unwrap_or_default());
            shown = text.len();
            if !keep_going {
                return Ok((ids, StopReason::Cancelled));
            }
        }
        if ids.len() >= max_new_tokens {
            break StopReason::MaxTokens;
        }
        if next_pos as usize >= window {
            break StopReason::ContextFull;
        }
        let logits = step(next, next_pos)?;
        next_pos += 1;
        next = sampler.sample(&logits);
    };
    // What was held back for a character still incomplete when decoding stopped: the answer
    // (the decode of every id) holds it, so the stream gets it too, and the two are equal.
    let text = tokenizer.decode(&ids)?;
    if text.len() > shown {
        on_text(text.get(shown..).unwrap_or_default());
    }
    Ok((ids, stop))
}

/// The decode steps (calls of `step`, each a timed forward of one token) that [`decode_with`]
/// took to give `tokens` ids stopping for `stop`: one per id after the first, and one more when
/// the end token stopped it (the step that chose it ran too). What milliseconds per token divide
/// by.
pub fn decode_steps(tokens: usize, stop: StopReason) -> usize {
    match stop {
        StopReason::EndToken => tokens,
        StopReason::MaxTokens | StopReason::ContextFull | StopReason::Cancelled => tokens.saturating_sub(1),
    }
}

/// Decodes over `cache` (rotated keys) starting with `first`, each token's K/V into the cache
/// ([`DecodeSteps`]: recorded once and replayed where the backend can, when `record`); `check`
/// runs before every layer of a step run op by op and once before a replayed one
/// ([`crate::interrupt::never`] for none). Returns the ids, why it stopped, and how many steps
/// were replays.
#[allow(clippy::too_many_arguments)]
pub fn decode<B: Backend>(
    model: &Model<B>,
    tokenizer: &Tokenizer,
    cache: &mut KvCache<B>,
    first: u32,
    sampler: &mut Sampler,
    max_new_tokens: usize,
    on_text: &mut dyn FnMut(&str) -> bool,
    check: Check<'_>,
    record: bool,
) -> Result<(Vec<u32>, StopReason, usize)> {
    let window = model.config().context_length;
    let next_pos = cache.positions().last().map_or(0, |p| p + 1);
    let mut alone = flowprefill_comm::local::LocalComm::group(1)
        .pop()
        .ok_or_else(|| crate::error::internal("a world of one rank"))?;
    let mut steps = DecodeSteps::new(model, vec![], cache, max_new_tokens, record)?;
    let mut step = |tok: u32, pos: u32| steps.run(&mut alone, tok, pos, &mut *check);
    let (ids, stop) = decode_with(tokenizer, first, sampler, max_new_tokens, window, next_pos, &mut step, on_text)?;
    Ok((ids, stop, steps.replayed()))
}

/// Prefills `prompt` from position 0 and decodes. TTFT is measured from the start of prefill
/// to the moment the first token is chosen.
pub fn generate<B: Backend>(
    model: &Model<B>,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    cfg: &GenerateConfig,
    on_text: &mut dyn FnMut(&str) -> bool,
) -> Result<Generation> {
    let window = model.config().context_length;
    if prompt.len() >= window {
        return Err(WorkerError::ContextTooLong { tokens: prompt.len() + 1, window });
    }
    let mut sampler = Sampler::new(cfg.sampling.clone())?;
    let c = model.config();
    let mut cache = KvCache::new(model.backend(), c.n_layers, c.kv_dim(), KeyForm::Rotated)?;
    cache.reserve(model.backend(), prompt.len() + cfg.max_new_tokens)?;
    let t0 = Instant::now();
    let chunk = cfg.prefill_chunk.unwrap_or_else(|| model.backend().prefill_rows());
    let logits = prefill_into(model, &mut cache, prompt, 0, chunk)?;
    let prefill = t0.elapsed();
    let first = sampler.sample(&logits);
    let ttft = t0.elapsed();
    let first_logits = logits;
    let max = cfg.max_new_tokens;
    let never = &mut crate::interrupt::never;
    let record = crate::steps::decode_graphs_allowed();
    let (tokens, stop, replayed) =
        decode(model, tokenizer, &mut cache, first, &mut sampler, max, on_text, never, record)?;
    let text = tokenizer.decode(&tokens)?;
    Ok(Generation {
        prompt_tokens: prompt.len(),
        tokens,
        text,
        ttft,
        prefill,
        decode: t0.elapsed().saturating_sub(ttft),
        stop,
        first_logits,
        replayed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf_write::testfile::TestGguf;
    use candle_core::quantized::gguf_file::Value;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    /// Decodes with a step that chooses `script[i]` at its i-th call (then token 0) and an
    /// `on_text` that stops after `texts` pieces: the ids, why it stopped, the steps taken, the
    /// pieces streamed.
    fn decode_script(
        tok: &Tokenizer,
        script: &[u32],
        max: usize,
        window: usize,
        texts: usize,
    ) -> (Vec<u32>, StopReason, usize, Vec<String>) {
        let tally = Arc::new(AtomicU64::new(0));
        let (out, calls, pieces) = decode_failing(tok, script, max, window, texts, usize::MAX, &tally);
        let (ids, stop) = out.expect("decodes");
        assert_eq!(tally.load(Ordering::Relaxed), ids.len() as u64, "the tally counts the answer's ids");
        (ids, stop, calls, pieces)
    }

    /// What [`decode_with`] returned, the steps it called, the pieces it streamed.
    type Decoded = (Result<(Vec<u32>, StopReason)>, usize, Vec<String>);

    /// [`decode_script`] whose step number `fails` (from 0) fails, counting into `tally`.
    fn decode_failing(
        tok: &Tokenizer,
        script: &[u32],
        max: usize,
        window: usize,
        texts: usize,
        fails: usize,
        tally: &Arc<AtomicU64>,
    ) -> Decoded {
        let cfg = SamplingConfig { temperature: 0.0, top_p: 1.0, seed: 1 };
        let mut sampler = Sampler::new(cfg).expect("a greedy sampler");
        sampler.count_into(tally.clone());
        let mut calls = 0usize;
        let mut step = |_tok: u32, _pos: u32| -> Result<Vec<f32>> {
            if calls == fails {
                calls += 1;
                return Err(crate::error::internal("an injected step failure"));
            }
            let mut logits = vec![0.0f32; tok.vocab_size()];
            logits[script.get(calls).copied().unwrap_or(0) as usize] = 1.0;
            calls += 1;
            Ok(logits)
        };
        let mut pieces = Vec::new();
        let mut on_text = |s: &str| {
            pieces.push(s.to_string());
            pieces.len() < texts
        };
        let out = decode_with(tok, 1, &mut sampler, max, window, 5, &mut step, &mut on_text);
        (out, calls, pieces)
    }

    /// A byte-level tokenizer of the letters a..j (`j`, id 9, the end of sequence) and `extra`.
    fn letters(tag: &str, extra: &[&str]) -> Tokenizer {
        let mut vocab: Vec<Value> = ('a'..='j').map(|c| Value::String(c.to_string())).collect();
        vocab.extend(extra.iter().map(|t| Value::String(t.to_string())));
        let g = TestGguf::tiny()
            .set("tokenizer.ggml.model", Value::String("gpt2".into()))
            .set("tokenizer.ggml.tokens", Value::Array(vocab))
            .set("tokenizer.ggml.merges", Value::Array(vec![]))
            .set("tokenizer.ggml.eos_token_id", Value::U32(9));
        let f = g.write(tag);
        Tokenizer::from_gguf(&crate::gguf::GgufFile::open(f.path()).expect("the test file")).expect("a tokenizer")
    }

    /// The pieces streamed join up to the answer (the decode of every id), also when decoding
    /// stops inside a character that spans two tokens (its first byte held back until then).
    #[test]
    fn the_stream_joins_up_to_the_answer_when_a_character_is_cut() {
        // Byte-level tokens: `Ã` and `©` (ids 10, 11) are the bytes 0xC3 and 0xA9, together "é".
        let tok = letters("decode-split", &["\u{C3}", "\u{A9}"]);
        assert_eq!(tok.decode(&[1, 10, 11]).expect("decodes"), "bé");
        for (script, max, want) in [(&[10u32, 11][..], 3, vec!["b", "é"]), (&[10u32][..], 2, vec!["b", "\u{FFFD}"])] {
            let (ids, _, _, pieces) = decode_script(&tok, script, max, 64, usize::MAX);
            assert_eq!(pieces, want, "{script:?}");
            assert_eq!(pieces.concat(), tok.decode(&ids).expect("decodes"), "the stream is the answer");
        }
    }

    #[test]
    fn decode_steps_are_the_steps_decode_with_took_for_every_stop() {
        let tok = letters("decode-steps", &[]);
        assert!(tok.is_end(9) && !tok.is_end(2));
        let cases = [
            // The end token chosen by the third step: three ids, and three steps timed (not two).
            ((&[2, 3, 9][..], 10, 64, usize::MAX), 3, StopReason::EndToken, 3),
            // The end token chosen by the first step: one id, one step.
            ((&[9][..], 10, 64, usize::MAX), 1, StopReason::EndToken, 1),
            ((&[2, 3, 4, 5, 6][..], 4, 64, usize::MAX), 4, StopReason::MaxTokens, 3),
            // Positions 5 and 6 fit a window of 7: two steps, three ids.
            ((&[2, 3, 4, 5][..], 10, 7, usize::MAX), 3, StopReason::ContextFull, 2),
            ((&[2, 3, 4, 5][..], 10, 64, 2), 2, StopReason::Cancelled, 1),
        ];
        for ((script, max, window, texts), n_ids, stop, steps) in cases {
            let (ids, got, calls, _) = decode_script(&tok, script, max, window, texts);
            assert_eq!((ids.len(), got, calls), (n_ids, stop, steps), "script {script:?}");
            assert_eq!(decode_steps(ids.len(), got), calls, "script {script:?}");
        }
        assert_eq!(decode_steps(0, StopReason::EndToken), 0);
        assert_eq!(decode_steps(0, StopReason::MaxTokens), 0);
    }

    /// A step that fails ends decoding with its error; the tally then holds every token taken
    /// before it, each of which was streamed: the first, and one per step that succeeded.
    #[test]
    fn the_tally_counts_the_tokens_taken_before_a_step_fails() {
        let tok = letters("decode-tally", &[]);
        for fails in [0usize, 1, 3] {
            let tally = Arc::new(AtomicU64::new(0));
            let (out, calls, pieces) = decode_failing(&tok, &[2, 3, 4, 5, 6], 10, 64, usize::MAX, fails, &tally);
            let e = out.expect_err("the step's error");
            assert!(e.to_string().contains("an injected step failure"), "{e}");
            assert_eq!(calls, fails + 1, "steps run");
            assert_eq!(tally.load(Ordering::Relaxed), fails as u64 + 1, "tokens taken before step {fails} failed");
            assert_eq!(pieces.len(), fails + 1, "each was streamed");
        }
    }
}
