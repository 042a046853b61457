//! The tokenizer, built from the GGUF file itself (no tokenizer.json, no hub).
//!
//! GGUF `gpt2`-model vocabularies are byte-level BPE: `tokenizer.ggml.tokens` + `merges`. The
//! pre-tokenizer follows `tokenizer.ggml.pre` as llama.cpp does: `smollm` (and the other
//! StarCoder-family names) splits every digit on its own before the GPT-2 regex, `qwen2` and
//! `llama-bpe` use their own split regexes. Control tokens (`token_type` 3) are special tokens.
//!
//! Two encoders exist on purpose: template text is encoded with special tokens recognised,
//! user text (documents, questions) is encoded with them treated as plain text, so a document
//! containing `<|im_end|>` cannot end a turn.

use crate::error::{Result, WorkerError};
use crate::gguf::GgufFile;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

/// `token_type` of control tokens in GGUF.
const TOKEN_TYPE_CONTROL: i64 = 3;

/// Split regex of `qwen2` vocabularies (Qwen2/2.5/3).
const QWEN2_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Split regex of `llama-bpe` vocabularies (Llama 3).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A byte-level BPE tokenizer with the model's special tokens.
pub struct Tokenizer {
    /// Special tokens recognised (template text).
    with_specials: tokenizers::Tokenizer,
    /// Special tokens treated as text (user text).
    plain: tokenizers::Tokenizer,
    tokens: Vec<String>,
    special: Vec<bool>,
    eos: Option<u32>,
    bos: Option<u32>,
    end_ids: Vec<u32>,
    /// Bytes of the longest token (a byte-level token's characters are its bytes).
    max_token_bytes: usize,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer").field("vocab", &self.tokens.len()).field("eos", &self.eos).finish()
    }
}

fn tok_err(e: impl std::fmt::Display) -> WorkerError {
    WorkerError::Tokenizer(e.to_string())
}

impl Tokenizer {
    /// Builds the tokenizer from `tokenizer.ggml.*` metadata.
    pub fn from_gguf(f: &GgufFile) -> Result<Self> {
        let model = f.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(WorkerError::Tokenizer(format!(
                "{}: tokenizer model `{model}` is not supported (flowprefill reads byte-level BPE, `gpt2`)",
                f.path().display()
            )));
        }
        let tokens: Vec<String> = f.get_str_array("tokenizer.ggml.tokens")?.into_iter().map(String::from).collect();
        let merges: Vec<(String, String)> = f
            .get_str_array("tokenizer.ggml.merges")?
            .into_iter()
            .map(|m| {
                m.split_once(' ').map(|(a, b)| (a.to_string(), b.to_string())).ok_or_else(|| {
                    WorkerError::Tokenizer(format!("merge `{m}` is not two tokens separated by a space"))
                })
            })
            .collect::<Result<_>>()?;
        let types = f.get_int_array_opt("tokenizer.ggml.token_type")?.unwrap_or_default();
        let special: Vec<bool> = (0..tokens.len()).map(|i| types.get(i) == Some(&TOKEN_TYPE_CONTROL)).collect();
        let pre = f.get_str("tokenizer.ggml.pre").unwrap_or("default");
        let pre_tok = pre_tokenizer(pre)?;
        // Llama 3's tokenizer takes a piece that is a whole vocabulary entry as it is, before any
        // merge (Hugging Face's `ignore_merges`, set by llama.cpp for Llama 3's names, not for
        // Smaug's, which shares the split): merges alone split some such words into several
        // tokens, ids the model never saw.
        let ignore_merges = matches!(pre, "llama-bpe" | "llama3" | "llama-v3");

        let build = || -> Result<tokenizers::Tokenizer> {
            let vocab: tokenizers::models::bpe::Vocab =
                tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
            let bpe = BPE::builder()
                .vocab_and_merges(vocab, merges.clone())
                .ignore_merges(ignore_merges)
                .build()
                .map_err(tok_err)?;
            let mut t = tokenizers::Tokenizer::new(bpe);
            t.with_pre_tokenizer(Some(pre_tok.clone()));
            t.with_decoder(Some(tokenizers::decoders::byte_level::ByteLevel::default()));
            Ok(t)
        };
        let plain = build()?;
        let mut with_specials = build()?;
        let specials: Vec<AddedToken> =
            tokens.iter().zip(&special).filter(|(_, &s)| s).map(|(t, _)| AddedToken::from(t.clone(), true)).collect();
        with_specials.add_special_tokens(specials).map_err(tok_err)?;

        let id_of =
            |key: &str| f.get_usize_opt(key).ok().flatten().map(|v| v as u32).filter(|&v| (v as usize) < tokens.len());
        let eos = id_of("tokenizer.ggml.eos_token_id");
        let bos = id_of("tokenizer.ggml.bos_token_id");
        // The end-of-turn tokens the file names (llama.cpp's keys) and those of common chat
        // templates also stop generation.
        let mut end_ids: Vec<u32> = eos.into_iter().collect();
        for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
            end_ids.extend(id_of(key).filter(|i| !end_ids.contains(i)));
        }
        for name in
            ["<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|endoftext|>", "<|end|>", "<end_of_turn>"]
        {
            if let Some(i) = tokens.iter().position(|t| t == name) {
                if special[i] && !end_ids.contains(&(i as u32)) {
                    end_ids.push(i as u32);
                }
            }
        }
        let max_token_bytes = tokens.iter().map(|t| t.chars().count()).max().unwrap_or(1).max(1);
        Ok(Self { with_specials, plain, tokens, special, eos, bos, end_ids, max_token_bytes })
    }

    /// Encodes user text: special-token strings are ordinary text here.
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.plain.encode(text, false).map_err(tok_err)?.get_ids().to_vec())
    }

    /// The byte range of `text` each token of [`Tokenizer::encode_text`] covers (a byte-level
    /// token's leading space included where the vocabulary joins it to the word).
    pub fn encode_spans(&self, text: &str) -> Result<Vec<std::ops::Range<usize>>> {
        let enc = self.plain.encode(text, false).map_err(tok_err)?;
        Ok(enc.get_offsets().iter().map(|&(a, b)| a..b).collect())
    }

    /// Encodes template text: special-token strings become their ids.
    pub fn encode_template(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.with_specials.encode(text, false).map_err(tok_err)?.get_ids().to_vec())
    }

    /// Decodes ids to text, dropping special tokens.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.with_specials.decode(ids, true).map_err(tok_err)
    }

    /// The raw vocabulary string of a token (byte-level encoded).
    pub fn token(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// The fewest tokens `bytes` bytes of text can encode to: no token is longer than the
    /// vocabulary's longest (so a text far too long for a window is refused before it is
    /// tokenized, which takes seconds and gigabytes for tens of megabytes).
    pub fn min_tokens(&self, bytes: usize) -> usize {
        bytes.div_ceil(self.max_token_bytes)
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// True for control tokens.
    pub fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    /// True for tokens that end a turn (eos and the template's end token).
    pub fn is_end(&self, id: u32) -> bool {
        self.end_ids.contains(&id)
    }

    /// End-of-sequence id.
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// Beginning-of-sequence id.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// The string of a token id if it exists.
    pub fn token_str(&self, id: Option<u32>) -> String {
        id.and_then(|i| self.token(i)).unwrap_or("").to_string()
    }
}

fn pre_tokenizer(pre: &str) -> Result<PreTokenizerWrapper> {
    let byte_level = |use_regex| PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, use_regex));
    let split = |re: &str| -> Result<PreTokenizerWrapper> {
        Ok(PreTokenizerWrapper::Split(
            Split::new(SplitPattern::Regex(re.to_string()), SplitDelimiterBehavior::Isolated, false)
                .map_err(tok_err)?,
        ))
    };
    Ok(match pre {
        // GPT-2 regex.
        "default" | "gpt2" | "gpt-2" | "mpt" | "olmo" | "jais" => byte_level(true),
        // Each digit alone, then the GPT-2 regex (llama.cpp: SMOLLM, STARCODER, REFACT, ...).
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva" => {
            PreTokenizerWrapper::Sequence(Sequence::new(vec![
                PreTokenizerWrapper::Digits(Digits::new(true)),
                byte_level(true),
            ]))
        }
        "qwen2" | "stablelm2" => {
            PreTokenizerWrapper::Sequence(Sequence::new(vec![split(QWEN2_SPLIT)?, byte_level(false)]))
        }
        "llama-bpe" | "llama3" | "llama-v3" | "smaug-bpe" => {
            PreTokenizerWrapper::Sequence(Sequence::new(vec![split(LLAMA3_SPLIT)?, byte_level(false)]))
        }
        other => {
            return Err(WorkerError::Tokenizer(format!(
                "pre-tokenizer `{other}` is not supported (supported: gpt2, smollm and other digit-splitting \
                 StarCoder variants, qwen2, llama-bpe)"
            )))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf_write::testfile::TestGguf;
    use candle_core::quantized::gguf_file::Value;

    /// A tokenizer of tokens a, b, c, ab, abc with the one merge `a b`, and pre-tokenizer `pre`.
    fn tokenizer(pre: &str) -> Tokenizer {
        let strings = |v: &[&str]| Value::Array(v.iter().map(|s| Value::String(s.to_string())).collect());
        let g = TestGguf::tiny()
            .set("tokenizer.ggml.model", Value::String("gpt2".into()))
            .set("tokenizer.ggml.pre", Value::String(pre.into()))
            .set("tokenizer.ggml.tokens", strings(&["a", "b", "c", "ab", "abc"]))
            .set("tokenizer.ggml.merges", strings(&["a b"]));
        let f = g.write(&format!("tok-{pre}"));
        Tokenizer::from_gguf(&crate::gguf::GgufFile::open(f.path()).unwrap()).unwrap()
    }

    /// Llama 3's pre-tokenizer names take a piece that is a vocabulary entry whole (`abc`, no
    /// merge makes it); the others merge (`ab`, `c`), as Hugging Face and llama.cpp do.
    #[test]
    fn llama3_takes_whole_vocabulary_entries_before_merging() {
        for pre in ["llama-bpe", "llama3", "llama-v3"] {
            assert_eq!(tokenizer(pre).encode_text("abc").unwrap(), [4], "{pre}");
        }
        for pre in ["qwen2", "gpt2", "smaug-bpe"] {
            assert_eq!(tokenizer(pre).encode_text("abc").unwrap(), [3, 2], "{pre}");
        }
    }
}
