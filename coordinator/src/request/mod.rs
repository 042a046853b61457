//! What a user asks for: the context, the question, the method and its knobs.

use crate::error::Result;
use flowprefill_worker::sampling::SamplingConfig;
pub use flowprefill_worker::steps::Scope;
use flowprefill_worker::{Field, InputError};
use std::str::FromStr;

mod spec;
use crate::method::Recompute;
pub use crate::method::{Method, PrefixMode};
pub use spec::{Coverage, MethodSpec};

/// RoPE positions used for scoring (InfoFlow section 4.2). Decoding always uses GLOBAL.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Geometry {
    /// True positions of the final layout.
    #[serde(rename = "global")]
    #[cfg_attr(feature = "clap", value(name = "global"))]
    Global,
    /// Chunks at local positions from 0, prompt right after the longest chunk.
    #[serde(rename = "hl-hp")]
    #[cfg_attr(feature = "clap", value(name = "hl-hp"))]
    HlHp,
    /// Chunks at local positions, prompt at its global position.
    #[serde(rename = "hl-tp")]
    #[cfg_attr(feature = "clap", value(name = "hl-tp"))]
    HlTp,
    /// Each chunk ends right before the prompt, prompt at its global position.
    #[serde(rename = "tl-tp")]
    #[cfg_attr(feature = "clap", value(name = "tl-tp"))]
    TlTp,
}

impl Geometry {
    /// All geometries.
    pub const ALL: [Geometry; 4] = [Geometry::Global, Geometry::HlHp, Geometry::HlTp, Geometry::TlTp];

    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Global => "global",
            Self::HlHp => "hl-hp",
            Self::HlTp => "hl-tp",
            Self::TlTp => "tl-tp",
        }
    }
}

impl FromStr for Geometry {
    type Err = InputError;
    fn from_str(s: &str) -> std::result::Result<Self, InputError> {
        let s = s.trim().to_ascii_lowercase().replace('_', "-");
        Geometry::ALL.into_iter().find(|g| g.name() == s).ok_or_else(|| {
            InputError::new(Field::Geometry, format!("unknown geometry `{s}`; choose global, hl-hp, hl-tp or tl-tp"))
        })
    }
}

/// The context of a request.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub enum Context {
    /// Independent documents, one chunk each, in retrieval order.
    Documents(Vec<String>),
    /// One text cut into pieces of `chunk_tokens` tokens.
    Text {
        /// The text.
        text: String,
        /// Tokens per chunk.
        chunk_tokens: usize,
    },
}

/// A question over a context.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Request {
    /// The context.
    pub context: Context,
    /// The user's question.
    pub query: String,
    /// System message (default: the template's own).
    pub system: Option<String>,
    /// What the answer starts with: the assistant's turn opens with it and the model continues
    /// it (RULER's prompts end this way). The probe scores with it as part of the prompt.
    #[serde(default)]
    pub answer_prefix: Option<String>,
    /// A chat's other turns, around the one that holds the context and the question (default:
    /// none, a single question).
    #[serde(default)]
    pub conversation: Conversation,
}

/// Who speaks a [`Turn`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// The user.
    User,
    /// The model (an earlier answer).
    Assistant,
}

impl Role {
    /// The role's name in the chat template.
    pub fn name(self) -> &'static str {
        match self {
            Self::User => "user",
            Self::Assistant => "assistant",
        }
    }
}

/// One turn of a conversation, as the chat template renders it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Turn {
    /// Who said it.
    pub role: Role,
    /// What was said.
    pub text: String,
}

/// The turns of a chat other than the one that holds the context: the template renders
/// `before`, then the context's turn (documents, then the question), then `after`, then opens
/// the assistant's answer. A follow-up question about the same documents goes in `after`, so the
/// context keeps its place and its chunk caches: only the prompt after it grows.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Conversation {
    /// Turns before the context's turn, in order: in the head, before the context (every chunk
    /// is prefilled behind them, so a change here makes every chunk's cache anew).
    #[serde(default)]
    pub before: Vec<Turn>,
    /// Turns after the question, in order (the answers given and the follow-ups): in the
    /// prompt, after the context; the scoring methods score with them as with the question.
    #[serde(default)]
    pub after: Vec<Turn>,
}

impl Conversation {
    /// Every turn, `before` then `after`.
    pub fn turns(&self) -> impl Iterator<Item = &Turn> {
        self.before.iter().chain(&self.after)
    }
}

/// How to run a request.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct RunOptions {
    /// The method.
    pub method: Method,
    /// Fraction of context tokens recomputed, in [0, 1].
    pub ratio: f64,
    /// A budget by attention coverage instead of the ratio (`--coverage`); the ratio then
    /// serves only the reordering's per-chunk importance.
    #[serde(default)]
    pub coverage: Option<Coverage>,
    /// Two-stage chunk reordering (documents only).
    pub reorder: bool,
    /// Scoring geometry.
    pub geometry: Geometry,
    /// Scoring layers (inclusive, 0-based) for InfoFlow; default: depth 55%..65%.
    pub score_layers: Option<(usize, usize)>,
    /// InfoFlow: each token's score averaged with its neighbours in a window of this many
    /// tokens (odd, centred, within the chunk) before the top-k, as SnapKV pools its scores, so
    /// that the tokens around an important one are recomputed with it; default: no pooling.
    #[serde(default)]
    pub score_pool: Option<usize>,
    /// Prefix mode; default: the method's.
    pub prefix: Option<PrefixMode>,
    /// Generated tokens at most.
    pub max_new_tokens: usize,
    /// Token choice.
    pub sampling: SamplingConfig,
    /// Seed of the random selector.
    pub seed: u64,
    /// Tokens per recompute forward.
    pub recompute_batch: usize,
    /// Cross-rank scope of recomputation.
    pub scope: Scope,
    /// Return every context token's selection score ([`RunResult::scores`](crate::RunResult)):
    /// one more all-gather of the scores to rank 0 (for inspecting the selection signal).
    #[serde(default)]
    pub keep_scores: bool,
    /// KV eviction after the prompt, before decoding (`--evict snapkv --kv-budget N`);
    /// default: the whole cache is kept.
    #[serde(default)]
    pub evict: Option<Evict>,
    /// Cache-aware sharding (several ranks): a chunk goes to a rank whose chunk store holds it
    /// when that keeps every rank's tokens within this share above the positional split's
    /// largest load (`--cache-slack`, default 0.1; 0: positional placement).
    #[serde(default = "default_cache_slack")]
    pub cache_slack: f64,
    /// Verification (`--verify`): the request is also answered exactly (full prefill on one
    /// rank, ring on several) and the answer carries how far it was from that
    /// ([`crate::engine::Quality`]).
    #[serde(default)]
    pub verify: bool,
    /// The quality gate (`--quality-floor`): a verified answer whose first token's
    /// distribution is more than this many nats (KL) from the exact one breached it.
    #[serde(default)]
    pub quality_floor: Option<f64>,
    /// What a breach does (`--on-breach`; default: answer from the exact computation).
    #[serde(default)]
    pub on_breach: OnBreach,
    /// A cold job: no chunk cache is read from, or kept in, the chunk store's tiers, whatever
    /// other processes write there meanwhile (`bench ttft`'s cold rows: under mpirun another
    /// process's late write to an emptied disk folder made a cold run read a cache).
    #[serde(default)]
    pub fresh: bool,
}

/// What the quality gate does with a verified answer that breached its floor.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum OnBreach {
    /// The exact computation's answer replaces it (the response says so).
    #[default]
    Fallback,
    /// It is kept and marked as breached.
    Flag,
}

impl std::fmt::Display for OnBreach {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            OnBreach::Fallback => "fallback",
            OnBreach::Flag => "flag",
        })
    }
}

/// [`RunOptions::cache_slack`]'s default.
pub const DEFAULT_CACHE_SLACK: f64 = 0.1;

fn default_cache_slack() -> f64 {
    DEFAULT_CACHE_SLACK
}

/// How the cache is scored for eviction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum EvictPolicy {
    /// SnapKV: attention of the prompt's last 32 tokens, per (layer, KV head), pooled over 7.
    Snapkv,
    /// LookaheadKV: attention of 32 learned lookahead rows (with their LoRA) run after the
    /// prompt, per (layer, KV head), pooled over 7; needs the model's LookaheadKV adapter.
    Lookahead,
}

impl std::fmt::Display for EvictPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            EvictPolicy::Snapkv => "snapkv",
            EvictPolicy::Lookahead => "lookahead",
        })
    }
}

/// KV eviction before decoding: the context rows of every (layer, KV head) are cut to the
/// `budget` best by `policy` (the prompt's own rows are all kept, as SnapKV keeps its window).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Evict {
    /// The scoring.
    pub policy: EvictPolicy,
    /// Context KV entries kept per (layer, KV head), over all ranks.
    pub budget: usize,
}

/// An eviction budget keeps at least one entry per head.
pub fn check_kv_budget(budget: usize) -> std::result::Result<(), InputError> {
    if budget == 0 {
        return Err(InputError::new(
            Field::KvBudget,
            "0 keeps nothing of the context; give the KV entries to keep per (layer, KV head), e.g. 128",
        ));
    }
    Ok(())
}

impl Default for RunOptions {
    fn default() -> Self {
        Self {
            method: Method::Infoflow,
            ratio: 0.15,
            coverage: None,
            reorder: false,
            geometry: Geometry::Global,
            score_layers: None,
            score_pool: None,
            prefix: None,
            max_new_tokens: 64,
            sampling: SamplingConfig::default(),
            seed: 0,
            recompute_batch: 2048,
            scope: Scope::Exact,
            keep_scores: false,
            evict: None,
            cache_slack: DEFAULT_CACHE_SLACK,
            verify: false,
            quality_floor: None,
            on_breach: OnBreach::Fallback,
            fresh: false,
        }
    }
}

/// Which scoring knobs a job's method reads.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScoringKnobs {
    /// `geometry`: the methods that score by the query's attention (InfoFlow, LookaheadKV,
    /// ProphetKV).
    pub geometry: bool,
    /// `score_layers`: InfoFlow, LookaheadKV, and the reorder of any method.
    pub score_layers: bool,
    /// `score_pool`: InfoFlow and LookaheadKV.
    pub score_pool: bool,
}

impl RunOptions {
    /// The scoring knobs this job's method reads (`auto`: all, for its candidates).
    pub fn scoring_knobs(&self) -> ScoringKnobs {
        let m = self.method;
        let attention = matches!(m, Method::Infoflow | Method::Lookahead | Method::Auto);
        ScoringKnobs {
            geometry: attention || m == Method::Prophet,
            score_layers: attention || self.reorder,
            score_pool: attention,
        }
    }

    /// The prefix mode in effect.
    pub fn prefix_mode(&self) -> PrefixMode {
        self.prefix.unwrap_or(self.method.default_prefix())
    }

    /// The ratio in effect: 0 for the methods that recompute nothing (`none`, `star`,
    /// `kvpacket`), 1 for the exact prefills, else the request's.
    pub fn effective_ratio(&self) -> f64 {
        match self.method.info().recompute {
            Recompute::Nothing => 0.0,
            Recompute::Everything => 1.0,
            Recompute::Selected => self.ratio,
        }
    }
}

/// A request and how to run it: what rank 0 broadcasts to the other ranks.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Job {
    /// The request.
    pub request: Request,
    /// Its options.
    pub options: RunOptions,
}

/// The widest score-pooling window (`--score-pool`) accepted.
pub const MAX_SCORE_POOL: usize = 63;

/// A score-pooling window must be odd (centred on its token) and at most [`MAX_SCORE_POOL`].
pub fn check_score_pool(window: usize) -> std::result::Result<(), InputError> {
    if window.is_multiple_of(2) || window > MAX_SCORE_POOL {
        return Err(InputError::new(
            Field::ScorePool,
            format!("{window}: the window must be odd (centred on the token) and at most {MAX_SCORE_POOL}, e.g. 7"),
        ));
    }
    Ok(())
}

/// A recompute ratio must be a fraction in [0, 1]; checked before any model work starts.
pub fn check_ratio(ratio: f64) -> std::result::Result<(), InputError> {
    if !(0.0..=1.0).contains(&ratio) || !ratio.is_finite() {
        return Err(InputError::new(
            Field::Ratio,
            format!("{ratio} is outside [0, 1]; give the fraction of context tokens to recompute"),
        ));
    }
    Ok(())
}

fn bad(field: Field, problem: impl Into<String>) -> crate::error::CoordError {
    InputError::new(field, problem).into()
}

/// Checks a request and its options before any work (messages say what to change). The
/// checks that need the model (token counts, the context window, scoring layers) are in
/// [`crate::admit`].
pub fn validate(req: &Request, opts: &RunOptions) -> Result<()> {
    check_budget(opts)?;
    check_context(req, opts)?;
    check_knobs(opts)
}

/// The budget: ratio, coverage, cache slack, quality floor.
fn check_budget(opts: &RunOptions) -> Result<()> {
    check_ratio(opts.ratio)?;
    if let Some(c) = opts.coverage {
        c.check()?;
        if !opts.method.scores_mass() && opts.method != Method::Auto {
            let with: Vec<&str> = Method::ALL.iter().filter(|m| m.scores_mass()).map(|m| m.name()).collect();
            return Err(bad(
                Field::Coverage,
                format!(
                    "method {} has no score mass to cover; a coverage budget applies to {} (the others take a ratio)",
                    opts.method,
                    with.join(", ")
                ),
            ));
        }
    }
    if !(0.0..=1.0).contains(&opts.cache_slack) {
        return Err(bad(
            Field::CacheSlack,
            format!("{} is outside [0, 1]; give a share such as 0.1 (0: positional placement)", opts.cache_slack),
        ));
    }
    if let Some(floor) = opts.quality_floor {
        if !(floor >= 0.0 && floor.is_finite()) {
            return Err(bad(
                Field::QualityFloor,
                format!("{floor} is not a KL bound; give a number of nats >= 0, e.g. 0.05"),
            ));
        }
        if !opts.verify && opts.method != Method::Auto {
            return Err(bad(
                Field::QualityFloor,
                "the gate acts only on verified answers (it needs the exact one to compare with); add --verify (\"verify\": true)",
            ));
        }
    }
    Ok(())
}

/// The question and the context (and whether its chunks may be reordered).
fn check_context(req: &Request, opts: &RunOptions) -> Result<()> {
    if req.query.trim().is_empty() {
        return Err(bad(Field::Query, "is missing or empty; give the question to answer"));
    }
    let blank = req.conversation.after.iter().position(|t| t.role == Role::User && t.text.trim().is_empty());
    if let Some(i) = blank {
        return Err(bad(Field::FollowUp(i), "a follow-up question is empty; give the question or leave the turn out"));
    }
    match &req.context {
        Context::Documents(docs) => {
            if docs.is_empty() {
                return Err(bad(Field::Documents, "no documents given; give at least one"));
            }
            if let Some(i) = docs.iter().position(|d| d.trim().is_empty()) {
                return Err(bad(Field::Document(i), "the document is empty; remove it or give it some text"));
            }
        }
        Context::Text { text, chunk_tokens } => {
            if text.trim().is_empty() {
                return Err(bad(Field::Text, "is empty"));
            }
            if *chunk_tokens == 0 {
                return Err(bad(Field::ChunkTokens, "must be at least 1"));
            }
            if opts.reorder {
                return Err(bad(
                    Field::Reorder,
                    "needs independent documents; pieces of one text keep their order (give the documents separately)",
                ));
            }
        }
    }
    if opts.reorder && !opts.method.info().reorders {
        return Err(bad(Field::Reorder, format!("does not apply to method {}", opts.method)));
    }
    Ok(())
}

/// The scoring, eviction, batch and answer-length knobs.
fn check_knobs(opts: &RunOptions) -> Result<()> {
    if let Some((a, b)) = opts.score_layers {
        if a > b {
            return Err(bad(Field::ScoreLayers, format!("{a}-{b}: the first layer must not exceed the last")));
        }
    }
    if let Some(w) = opts.score_pool {
        check_score_pool(w)?;
    }
    // A knob the method does not read is refused, not dropped without a word.
    let used = opts.scoring_knobs();
    let m = opts.method;
    if opts.geometry != Geometry::Global && !used.geometry {
        return Err(bad(
            Field::Geometry,
            format!("does not apply to method {m} (infoflow, lookahead and prophet score by attention); leave it out"),
        ));
    }
    if opts.score_layers.is_some() && !used.score_layers {
        return Err(bad(
            Field::ScoreLayers,
            format!("does not apply to method {m} (infoflow, lookahead and +reorder read it); leave it out"),
        ));
    }
    if opts.score_pool.is_some() && !used.score_pool {
        return Err(bad(
            Field::ScorePool,
            format!("does not apply to method {m} (infoflow and lookahead read it); leave it out"),
        ));
    }
    if let Some(e) = opts.evict {
        check_kv_budget(e.budget)?;
    }
    if opts.recompute_batch == 0 {
        return Err(bad(Field::RecomputeBatch, "must be at least 1"));
    }
    if opts.max_new_tokens == 0 {
        return Err(bad(Field::MaxTokens, "must be at least 1"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cache_slack_outside_0_1_is_refused_and_old_jobs_get_the_default() {
        let req = Request {
            conversation: Default::default(),
            context: Context::Documents(vec!["a document".into()]),
            query: "q".into(),
            system: None,
            answer_prefix: None,
        };
        for bad in [-0.1, 1.5, f64::NAN] {
            let e = validate(&req, &RunOptions { cache_slack: bad, ..RunOptions::default() }).unwrap_err();
            assert!(e.to_string().contains("--cache-slack") && e.api_message().contains("cache_slack"), "{e}");
        }
        validate(&req, &RunOptions { cache_slack: 0.0, ..RunOptions::default() }).unwrap();
        // Options serialized before the field existed read with the default.
        let mut v = serde_json::to_value(RunOptions::default()).unwrap();
        v.as_object_mut().unwrap().remove("cache_slack");
        assert_eq!(serde_json::from_value::<RunOptions>(v).unwrap().cache_slack, DEFAULT_CACHE_SLACK);
    }
}
