//! Request and response bodies of the HTTP API, and their validation.
//!
//! `POST /v1/jobs` takes a [`JobRequest`]; `POST /v1/chat/completions` takes an
//! OpenAI-style [`ChatRequest`] whose user message holds the documents and the question,
//! separated by lines containing only `---` (the last user message with such a line holds
//! them; later turns are follow-ups about the same documents, earlier ones conversation):
//!
//! ```text
//!   <document 1>
//!   ---
//!   <document 2>
//!   ---
//!   <the question>
//! ```
//! Bodies must be JSON objects; unknown fields are rejected (a misspelt `ratoi` is an error,
//! not a silent default), and so are OpenAI options this server does not implement (`n > 1`,
//! `stop`, `tools`, `logprobs`, penalties) instead of being ignored. Every error names the
//! field to fix, by its JSON name.

use flowprefill_coordinator::{
    Context, Conversation, CoordError, Coverage, Geometry, Job, MethodSpec, PrefixMode, Request, Role, RunOptions,
    Scope, Turn,
};
use flowprefill_worker::sampling::SamplingConfig;
use serde::Deserialize;

/// The separator between documents and the question in a chat message.
pub const DOC_SEPARATOR: &str = "---";

/// An error answered to the client: HTTP status, a kind (metrics label) and a message.
#[derive(Clone, Debug)]
pub struct ApiError {
    /// HTTP status.
    pub status: u16,
    /// Bounded kind: bad_request, unauthorized, too_large, queue_full, deadline, cancelled,
    /// rank_failure, device_failure, resource, shutting_down, internal.
    pub kind: &'static str,
    /// What to change.
    pub message: String,
    /// Seconds for a Retry-After header.
    pub retry_after: Option<u64>,
}

impl ApiError {
    /// 400 naming what is wrong.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self { status: 400, kind: "bad_request", message: message.into(), retry_after: None }
    }

    /// Any status.
    pub fn new(status: u16, kind: &'static str, message: impl Into<String>) -> Self {
        Self { status, kind, message: message.into(), retry_after: None }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({ "error": { "kind": self.kind, "message": self.message } })
    }

    /// The answer to a job that failed with `e`: status and kind by whose fault it is
    /// ([`crate::exit::http`]), the message naming JSON fields.
    pub fn from_coord(e: &CoordError) -> Self {
        let (status, kind) = crate::exit::http(e.class());
        Self::new(status, kind, e.api_message())
    }

    /// The `outcome` label of the jobs counter for a job that failed with this error.
    pub fn outcome(&self) -> &'static str {
        match self.kind {
            "cancelled" => "cancelled",
            "deadline" => "deadline",
            // The request's own fault, found by the ranks (the handler admits most before).
            _ if self.status < 500 => "refused",
            _ => "error",
        }
    }
}

/// `POST /v1/documents`: documents to prefill into the chunk store.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DocumentsRequest {
    /// The documents' texts.
    pub documents: Vec<String>,
    /// The system message the questions will be asked with (default: the template's own).
    #[serde(default)]
    pub system: Option<String>,
}

/// `POST /v1/jobs`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobRequest {
    /// Documents, one chunk each (or give `text` and `chunk_tokens`, or `document_ids`).
    #[serde(default)]
    pub documents: Option<Vec<String>>,
    /// Documents ingested before (`POST /v1/documents`, `flowprefill ingest`), by id, instead
    /// of their text; the service reads them from its store (an unknown id is a 400 naming it).
    #[serde(default)]
    pub document_ids: Option<Vec<String>>,
    /// One long text, cut into `chunk_tokens` pieces.
    #[serde(default)]
    pub text: Option<String>,
    /// Tokens per piece of `text`.
    #[serde(default)]
    pub chunk_tokens: Option<usize>,
    /// The question.
    pub query: String,
    /// System message.
    #[serde(default)]
    pub system: Option<String>,
    /// What the answer starts with (the assistant's turn opens with it; the answer continues it).
    #[serde(default)]
    pub answer_prefix: Option<String>,
    /// A chat's other turns: `{"before": [...], "after": [...]}`, each turn
    /// `{"role": "user" | "assistant", "text": ...}`; `after` holds the answers given and the
    /// follow-ups about the same context (default: none).
    #[serde(default)]
    pub conversation: Conversation,
    /// Method (default infoflow), written as on the command line: `infoflow`,
    /// `infoflow+reorder`, `infoflow@0.3`.
    #[serde(default)]
    pub method: Option<MethodSpec>,
    /// Recompute ratio (default 0.15).
    #[serde(default)]
    pub ratio: Option<f64>,
    /// A budget by attention coverage instead of the ratio (share of the score mass, (0, 1]).
    #[serde(default)]
    pub coverage: Option<f64>,
    /// The coverage budget's least ratio (default 0).
    #[serde(default)]
    pub min_ratio: Option<f64>,
    /// The coverage budget's largest ratio (default 1).
    #[serde(default)]
    pub max_ratio: Option<f64>,
    /// Reorder chunks.
    #[serde(default)]
    pub reorder: Option<bool>,
    /// exact or sparse.
    #[serde(default)]
    pub scope: Option<Scope>,
    /// Scoring geometry.
    #[serde(default)]
    pub geometry: Option<Geometry>,
    /// Prefix mode.
    #[serde(default)]
    pub prefix: Option<PrefixMode>,
    /// InfoFlow scoring layers [first, last].
    #[serde(default)]
    pub score_layers: Option<[usize; 2]>,
    /// InfoFlow score pooling window (odd).
    #[serde(default)]
    pub score_pool: Option<usize>,
    /// KV eviction before decoding (`"snapkv"`; needs `kv_budget`).
    #[serde(default)]
    pub evict: Option<flowprefill_coordinator::EvictPolicy>,
    /// Context KV entries kept per (layer, KV head) by `evict`.
    #[serde(default)]
    pub kv_budget: Option<usize>,
    /// Cache-aware sharding's balance slack (default 0.1; 0: positional placement).
    #[serde(default)]
    pub cache_slack: Option<f64>,
    /// Also answer exactly and report the answer's distance from it (`quality` in the
    /// response); the server may verify a share of jobs by itself (`--verify-rate`).
    #[serde(default)]
    pub verify: Option<bool>,
    /// The quality gate: a KL bound (nats) on the first answer token's distribution (needs
    /// `verify`).
    #[serde(default)]
    pub quality_floor: Option<f64>,
    /// What a breach of `quality_floor` does: `"fallback"` (default: the exact answer) or
    /// `"flag"`.
    #[serde(default)]
    pub on_breach: Option<flowprefill_coordinator::OnBreach>,
    /// Answer tokens at most (default 64).
    #[serde(default)]
    pub max_tokens: Option<usize>,
    /// Sampling temperature (0 = greedy).
    #[serde(default)]
    pub temperature: Option<f32>,
    /// Nucleus mass.
    #[serde(default)]
    pub top_p: Option<f32>,
    /// Sampler and random-selector seed.
    #[serde(default)]
    pub seed: Option<u64>,
    /// Server-sent events instead of one JSON body.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Seconds the job may take, queueing included (capped by the server's limit).
    #[serde(default)]
    pub deadline_s: Option<f64>,
}

/// Method knobs shared by both endpoints.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MethodFields {
    /// Method (`NAME[+reorder][@RATIO|~COVERAGE]`).
    #[serde(default)]
    pub method: Option<MethodSpec>,
    /// Ratio.
    #[serde(default)]
    pub ratio: Option<f64>,
    /// A budget by attention coverage instead of the ratio: the share of the score mass the
    /// recomputed tokens reach, in (0, 1].
    #[serde(default)]
    pub coverage: Option<f64>,
    /// The coverage budget's least ratio (default 0).
    #[serde(default)]
    pub min_ratio: Option<f64>,
    /// The coverage budget's largest ratio (default 1).
    #[serde(default)]
    pub max_ratio: Option<f64>,
    /// Reorder.
    #[serde(default)]
    pub reorder: Option<bool>,
    /// Scope.
    #[serde(default)]
    pub scope: Option<Scope>,
    /// Geometry.
    #[serde(default)]
    pub geometry: Option<Geometry>,
    /// Prefix mode.
    #[serde(default)]
    pub prefix: Option<PrefixMode>,
}

/// Options from the method fields.
fn options(
    m: &MethodFields,
    max_tokens: Option<usize>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    seed: Option<u64>,
) -> Result<RunOptions, ApiError> {
    let coverage = Coverage::requested(m.coverage, m.method, m.min_ratio, m.max_ratio)
        .map_err(|e| ApiError::bad_request(e.api_message()))?;
    let mut o = MethodSpec::merge(m.method, m.ratio, coverage, m.reorder, RunOptions::default())
        .map_err(|e| ApiError::bad_request(e.api_message()))?;
    o.scope = m.scope.unwrap_or(o.scope);
    o.geometry = m.geometry.unwrap_or(o.geometry);
    o.prefix = m.prefix;
    if let Some(n) = max_tokens {
        if n == 0 || n > 4096 {
            return Err(ApiError::bad_request(format!("field `max_tokens`: {n} must be between 1 and 4096")));
        }
        o.max_new_tokens = n;
    }
    // Sampling without a seed draws a fresh one (it was 0: the same "random" answer to every
    // request); `seed` repeats a draw. The selection's seed (the `random` method) stays 0.
    o.sampling = SamplingConfig {
        temperature: temperature.unwrap_or(0.0),
        top_p: top_p.unwrap_or(1.0),
        seed: seed.unwrap_or_else(rand::random),
    };
    if !(o.sampling.temperature >= 0.0 && o.sampling.temperature.is_finite()) {
        return Err(ApiError::bad_request("field `temperature`: must be a finite number >= 0"));
    }
    if !(o.sampling.top_p > 0.0 && o.sampling.top_p <= 1.0) {
        return Err(ApiError::bad_request("field `top_p`: must be in (0, 1]"));
    }
    o.seed = seed.unwrap_or(0);
    Ok(o)
}

/// Parses a JSON object with the path of the offending field in the error. Anything but an
/// object (an array would fill the fields by position) is refused.
pub fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    match body.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'{') => {}
        None => return Err(ApiError::bad_request("the request body is empty; send a JSON object")),
        Some(_) => return Err(ApiError::bad_request("the request body must be a JSON object (`{...}`)")),
    }
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let syntax = matches!(inner.classify(), serde_json::error::Category::Syntax | serde_json::error::Category::Eof);
        if syntax || path == "." || path == "?" || path.is_empty() {
            ApiError::bad_request(format!("malformed JSON body: {inner}"))
        } else {
            ApiError::bad_request(format!("field `{path}`: {inner}"))
        }
    })
}

impl JobRequest {
    /// The job, checked. Also returns whether to stream and the requested deadline.
    pub fn into_job(self) -> Result<(Job, bool, Option<f64>), ApiError> {
        if self.document_ids.is_some() {
            return Err(ApiError::bad_request(
                "field `document_ids`: this endpoint has no document store to read them from",
            ));
        }
        let context = match (self.documents, self.text) {
            (Some(_), Some(_)) => return Err(ApiError::bad_request("give either `documents` or `text`, not both")),
            (Some(docs), None) => {
                if self.chunk_tokens.is_some() {
                    return Err(ApiError::bad_request("field `chunk_tokens`: only with `text`"));
                }
                Context::Documents(docs)
            }
            (None, Some(text)) => Context::Text { text, chunk_tokens: self.chunk_tokens.unwrap_or(512) },
            (None, None) => {
                return Err(ApiError::bad_request("field `documents`: missing (or give `text` and `chunk_tokens`)"))
            }
        };
        let m = MethodFields {
            method: self.method,
            ratio: self.ratio,
            coverage: self.coverage,
            min_ratio: self.min_ratio,
            max_ratio: self.max_ratio,
            reorder: self.reorder,
            scope: self.scope,
            geometry: self.geometry,
            prefix: self.prefix,
        };
        let mut options = options(&m, self.max_tokens, self.temperature, self.top_p, self.seed)?;
        options.score_layers = self.score_layers.map(|[a, b]| (a, b));
        if let Some(slack) = self.cache_slack {
            options.cache_slack = slack;
        }
        options.verify = self.verify.unwrap_or(false);
        options.quality_floor = self.quality_floor;
        if let Some(b) = self.on_breach {
            if self.quality_floor.is_none() {
                return Err(ApiError::bad_request(
                    "field `on_breach`: applies to a quality gate; give `quality_floor` (a KL bound, e.g. 0.05)",
                ));
            }
            options.on_breach = b;
        }
        options.score_pool = self.score_pool;
        options.evict = match (self.evict, self.kv_budget) {
            (Some(policy), Some(budget)) => Some(flowprefill_coordinator::Evict { policy, budget }),
            (None, None) => None,
            (Some(_), None) => {
                return Err(ApiError::bad_request(
                    "field `kv_budget`: missing; `evict` needs the entries to keep per (layer, KV head), e.g. 128",
                ))
            }
            (None, Some(_)) => {
                return Err(ApiError::bad_request(
                    "field `evict`: missing; `kv_budget` applies to an eviction policy, e.g. \"snapkv\"",
                ))
            }
        };
        let request = Request {
            context,
            query: self.query,
            system: self.system,
            answer_prefix: self.answer_prefix,
            conversation: self.conversation,
        };
        check(&request, &options)?;
        if let Some(d) = self.deadline_s {
            if !(d > 0.0 && d.is_finite()) {
                return Err(ApiError::bad_request("field `deadline_s`: must be a positive number of seconds"));
            }
        }
        Ok((Job { request, options }, self.stream.unwrap_or(false), self.deadline_s))
    }
}

fn check(request: &Request, options: &RunOptions) -> Result<(), ApiError> {
    flowprefill_coordinator::request::validate(request, options).map_err(|e| ApiError::bad_request(e.api_message()))
}

/// One OpenAI chat message.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatMessage {
    /// system, user or assistant.
    pub role: String,
    /// Text, or a list of parts with `text`.
    pub content: serde_json::Value,
    /// A participant name (accepted, not used).
    #[serde(default)]
    pub name: Option<String>,
    /// The call a `tool` message answers (accepted, not used: tools are not taken, and a tool
    /// turn is left out of the conversation).
    #[serde(default)]
    pub tool_call_id: Option<String>,
    /// An earlier assistant turn's tool calls (accepted, not used).
    #[serde(default)]
    pub tool_calls: Option<serde_json::Value>,
    /// An earlier assistant turn's refusal (accepted, not used).
    #[serde(default)]
    pub refusal: Option<serde_json::Value>,
}

/// `POST /v1/chat/completions` (OpenAI-compatible subset; extra knobs under `flowprefill`).
/// Options of the OpenAI API that this server does not implement are refused when they ask
/// for something (`n: 2`, a `stop` list, `tools`, `logprobs: true`, a penalty), accepted when
/// they ask for the default (`n: 1`, `stop: null`, `logprobs: false`, penalties 0).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatRequest {
    /// Ignored (one model is served); echoed back.
    #[serde(default)]
    pub model: Option<String>,
    /// The conversation; the last user message with a `---` line holds documents and
    /// question, the turns after it are follow-ups.
    pub messages: Vec<ChatMessage>,
    /// Answer tokens at most.
    #[serde(default, alias = "max_completion_tokens")]
    pub max_tokens: Option<usize>,
    /// Temperature.
    #[serde(default)]
    pub temperature: Option<f32>,
    /// Nucleus mass.
    #[serde(default)]
    pub top_p: Option<f32>,
    /// Seed.
    #[serde(default)]
    pub seed: Option<u64>,
    /// Server-sent events.
    #[serde(default)]
    pub stream: Option<bool>,
    /// flowprefill's method knobs.
    #[serde(default)]
    pub flowprefill: Option<MethodFields>,
    /// Choices to generate: only 1.
    #[serde(default)]
    pub n: Option<u32>,
    /// Stop sequences: not supported.
    #[serde(default)]
    pub stop: Option<serde_json::Value>,
    /// Tools: not supported.
    #[serde(default)]
    pub tools: Option<serde_json::Value>,
    /// Tool choice: not supported.
    #[serde(default)]
    pub tool_choice: Option<serde_json::Value>,
    /// Log-probabilities: not supported.
    #[serde(default)]
    pub logprobs: Option<bool>,
    /// Top log-probabilities: not supported.
    #[serde(default)]
    pub top_logprobs: Option<u32>,
    /// Presence penalty: only 0.
    #[serde(default)]
    pub presence_penalty: Option<f64>,
    /// Frequency penalty: only 0.
    #[serde(default)]
    pub frequency_penalty: Option<f64>,
    /// End-user id (accepted, not used).
    #[serde(default)]
    pub user: Option<String>,
    /// Streaming options: `include_usage` (a last chunk with the token counts, as OpenAI's);
    /// other keys are accepted and not used.
    #[serde(default)]
    pub stream_options: Option<serde_json::Value>,
}

impl ChatRequest {
    /// Refuses options that ask for something this server does not do.
    fn refuse_unsupported(&self) -> Result<(), ApiError> {
        let no = |f: &str, why: &str| Err(ApiError::bad_request(format!("field `{f}`: {why}")));
        let empty = |v: &Option<serde_json::Value>| match v {
            None | Some(serde_json::Value::Null) => true,
            Some(serde_json::Value::Array(a)) => a.is_empty(),
            Some(serde_json::Value::String(s)) => s.is_empty(),
            Some(_) => false,
        };
        if self.n.is_some_and(|n| n != 1) {
            return no("n", "only one choice per request is generated (n = 1)");
        }
        if !empty(&self.stop) {
            return no(
                "stop",
                "stop sequences are not supported; the answer ends at the model's end token or max_tokens",
            );
        }
        if !empty(&self.tools) || !empty(&self.tool_choice) {
            return no("tools", "tool calls are not supported");
        }
        if self.logprobs == Some(true) || self.top_logprobs.is_some_and(|k| k > 0) {
            return no("logprobs", "log-probabilities are not returned");
        }
        for (f, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if v.is_some_and(|p| p != 0.0) {
                return no(f, "penalties are not supported (only 0)");
            }
        }
        Ok(())
    }
}

fn text_of(content: &serde_json::Value, i: usize) -> Result<String, ApiError> {
    match content {
        serde_json::Value::String(s) => Ok(s.clone()),
        serde_json::Value::Array(parts) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                let kind = p.get("type").and_then(|t| t.as_str()).unwrap_or("text");
                match (kind, p.get("text").and_then(|t| t.as_str())) {
                    ("text", Some(t)) => text.push_str(t),
                    ("text", None) => {
                        return Err(ApiError::bad_request(format!(
                            "field `messages[{i}].content[{j}]`: a text part without a `text` string"
                        )))
                    }
                    (other, _) => {
                        return Err(ApiError::bad_request(format!(
                            "field `messages[{i}].content[{j}]`: a part of type `{other}`; this server reads text parts only"
                        )))
                    }
                }
            }
            Ok(text)
        }
        _ => Err(ApiError::bad_request(format!(
            "field `messages[{i}].content`: expected a string or a list of text parts"
        ))),
    }
}

/// Whether a line separates documents (it holds the separator alone).
fn is_separator(line: &str) -> bool {
    line.trim() == DOC_SEPARATOR
}

/// Whether a message has a separator line (so it holds documents).
fn has_separator(message: &str) -> bool {
    message.lines().any(is_separator)
}

/// Splits a user message into documents and the question on lines of `---` (each trimmed; an
/// empty one is kept, for the caller to refuse: dropped, it would shift every later document's
/// number in the answer's `selected` and `order`).
pub fn split_documents(message: &str) -> (Vec<String>, String) {
    let mut parts: Vec<String> = Vec::new();
    let mut cur = String::new();
    for line in message.lines() {
        if is_separator(line) {
            parts.push(std::mem::take(&mut cur));
        } else {
            if !cur.is_empty() {
                cur.push('\n');
            }
            cur.push_str(line);
        }
    }
    parts.push(cur);
    let question = parts.pop().unwrap_or_default();
    (parts.into_iter().map(|p| p.trim().to_string()).collect(), question.trim().to_string())
}

impl ChatRequest {
    /// Whether `stream_options.include_usage` asks for the usage chunk (it was accepted and
    /// ignored: clients that count tokens from it recorded nothing).
    pub fn include_usage(&self) -> Result<bool, ApiError> {
        match self.stream_options.as_ref().and_then(|o| o.get("include_usage")) {
            None | Some(serde_json::Value::Null) => Ok(false),
            Some(serde_json::Value::Bool(b)) => Ok(*b),
            Some(v) => {
                Err(ApiError::bad_request(format!("field `stream_options.include_usage`: {v} is not true or false")))
            }
        }
    }

    /// The job, checked; whether to stream; the model name to echo.
    pub fn into_job(self) -> Result<(Job, bool, String), ApiError> {
        self.refuse_unsupported()?;
        if self.messages.is_empty() {
            return Err(ApiError::bad_request("field `messages`: empty"));
        }
        // Every system and developer message, in order (only the last was kept); the user's
        // and the assistant's turns, in order (only the last user message was read).
        let mut system: Option<String> = None;
        let mut turns: Vec<(usize, Role, String)> = Vec::new();
        for (i, m) in self.messages.iter().enumerate() {
            match m.role.as_str() {
                "system" | "developer" => {
                    // A blank one (some clients send `""`) is none: it replaced the template's
                    // own default system prompt with an empty turn.
                    let text = text_of(&m.content, i)?;
                    if !text.trim().is_empty() {
                        system = Some(match system {
                            Some(s) => format!("{s}\n\n{text}"),
                            None => text,
                        });
                    }
                }
                "user" => turns.push((i, Role::User, text_of(&m.content, i)?)),
                // An assistant turn of tool calls alone has no text (`content: null` or `""`);
                // this server takes no tools, so such a turn and the tool's answer to it are left
                // out (and so is any other assistant turn with nothing said).
                "assistant" if m.content.is_null() => {}
                "assistant" => {
                    let text = text_of(&m.content, i)?;
                    if !text.trim().is_empty() {
                        turns.push((i, Role::Assistant, text));
                    }
                }
                "tool" => {}
                other => {
                    return Err(ApiError::bad_request(format!("field `messages[{i}].role`: unknown role `{other}`")))
                }
            }
        }
        // The documents are in the last user message that has a separator line; the turns
        // after it (the answers given, follow-up questions) ask about them without repeating
        // them, and the turns before it are earlier conversation.
        let last_user = turns.iter().rposition(|t| t.1 == Role::User);
        let last_user = last_user.ok_or_else(|| ApiError::bad_request("field `messages`: no user message"))?;
        let held = turns.iter().rposition(|(_, role, text)| *role == Role::User && has_separator(text));
        let Some(at) = held else {
            let i = turns[last_user].0;
            return Err(ApiError::bad_request(format!(
                "field `messages[{i}].content`: put the documents before the question, separated by lines containing only `{DOC_SEPARATOR}` (in this message, or in an earlier user message that a follow-up then asks about)"
            )));
        };
        let i = turns[at].0;
        let (docs, question) = split_documents(&turns[at].2);
        if question.is_empty() {
            return Err(ApiError::bad_request(format!(
                "field `messages[{i}].content`: the question after the last `{DOC_SEPARATOR}` is empty"
            )));
        }
        if let Some(d) = docs.iter().position(|d| d.is_empty()) {
            return Err(ApiError::bad_request(format!(
                "field `messages[{i}].content`: document {} (before `{DOC_SEPARATOR}` number {}) is empty; remove the extra `{DOC_SEPARATOR}` line",
                d + 1,
                d + 1
            )));
        }
        if let Some((j, _, _)) =
            turns[at + 1..].iter().find(|(_, role, text)| *role == Role::User && text.trim().is_empty())
        {
            return Err(ApiError::bad_request(format!(
                "field `messages[{j}].content`: a follow-up question is empty; give the question or leave the message out"
            )));
        }
        let turn = |(_, role, text): &(usize, Role, String)| Turn { role: *role, text: text.clone() };
        let conversation = Conversation {
            before: turns[..at].iter().map(turn).collect(),
            after: turns[at + 1..].iter().map(turn).collect(),
        };
        let m = self.flowprefill.unwrap_or_default();
        let options = options(&m, self.max_tokens, self.temperature, self.top_p, self.seed)?;
        let request =
            Request { context: Context::Documents(docs), query: question, system, answer_prefix: None, conversation };
        check(&request, &options)?;
        Ok((Job { request, options }, self.stream.unwrap_or(false), self.model.unwrap_or_else(|| "flowprefill".into())))
    }
}

/// Constant-time comparison of a presented bearer token with the expected one.
pub fn token_matches(presented: &str, expected: &str) -> bool {
    let (a, b) = (presented.as_bytes(), expected.as_bytes());
    // Compare over the expected length whatever the presented length, so timing does not
    // reveal a prefix; the length check is folded in at the end.
    let mut diff = (a.len() != b.len()) as u8;
    for (i, &y) in b.iter().enumerate() {
        let x = a.get(i).copied().unwrap_or(0);
        diff |= x ^ y;
    }
    diff == 0
}

#[cfg(test)]
#[path = "api_tests.rs"]
mod tests;
