//! Typed errors of the worker crate. Messages say what to change, and every error knows
//! whose fault it is ([`WorkerError::class`]): the caller's input, the model or configuration,
//! another rank, a bug, or a job that was stopped (cancelled, past its deadline).

pub use flowprefill_comm::ErrorClass;
use std::path::PathBuf;

/// The input a caller's error concerns. Rendered as a command-line flag by the CLI
/// ([`Field::flag`]) and as a JSON field by the HTTP API ([`Field::api`]), so that each
/// interface names what its user typed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Field {
    /// The question.
    Query,
    /// A plain prompt (`generate`).
    Prompt,
    /// The list of documents.
    Documents,
    /// One document (0-based).
    Document(usize),
    /// One long text.
    Text,
    /// Tokens per piece of a long text.
    ChunkTokens,
    /// The method.
    Method,
    /// The recompute ratio.
    Ratio,
    /// Chunk reordering.
    Reorder,
    /// The scoring geometry.
    Geometry,
    /// InfoFlow's scoring layers.
    ScoreLayers,
    /// InfoFlow's score pooling window.
    ScorePool,
    /// The eviction policy before decoding.
    Evict,
    /// The KV entries kept per (layer, KV head) by eviction before decoding.
    KvBudget,
    /// The chunk prefix mode.
    Prefix,
    /// The recompute scope.
    Scope,
    /// The answer length.
    MaxTokens,
    /// The sampling temperature.
    Temperature,
    /// The nucleus mass.
    TopP,
    /// Tokens per recompute forward.
    RecomputeBatch,
    /// Thread ranks.
    Ranks,
    /// CacheClip's auxiliary model.
    AuxModel,
    /// The job's deadline.
    Deadline,
    /// The model.
    Model,
    /// Cache-aware sharding's balance slack.
    CacheSlack,
    /// The quality gate's KL bound.
    QualityFloor,
    /// A budget by attention coverage (share of the score mass).
    Coverage,
    /// A coverage budget's least ratio.
    MinRatio,
    /// A coverage budget's largest ratio.
    MaxRatio,
    /// A chat turn after the question (0-based), of a request's conversation.
    FollowUp(usize),
}

impl Field {
    /// The command-line flag (`--ratio`).
    pub fn flag(self) -> String {
        match self {
            Field::Query => "--query".into(),
            Field::Prompt => "--prompt".into(),
            Field::Documents => "--doc".into(),
            Field::Document(i) => format!("--doc #{}", i + 1),
            Field::Text => "the context text".into(),
            Field::ChunkTokens => "--chunk-tokens".into(),
            Field::Method => "--method".into(),
            Field::Ratio => "--ratio".into(),
            Field::Reorder => "--reorder".into(),
            Field::Geometry => "--geometry".into(),
            Field::ScoreLayers => "--score-layers".into(),
            Field::ScorePool => "--score-pool".into(),
            Field::Evict => "--evict".into(),
            Field::KvBudget => "--kv-budget".into(),
            Field::Prefix => "--prefix".into(),
            Field::Scope => "--scope".into(),
            Field::MaxTokens => "--max-tokens".into(),
            Field::Temperature => "--temperature".into(),
            Field::TopP => "--top-p".into(),
            Field::RecomputeBatch => "--recompute-batch".into(),
            Field::Ranks => "--ranks".into(),
            Field::AuxModel => "--aux-model".into(),
            Field::Deadline => "--deadline".into(),
            Field::Model => "--model".into(),
            Field::CacheSlack => "--cache-slack".into(),
            Field::QualityFloor => "--quality-floor".into(),
            Field::Coverage => "--coverage".into(),
            Field::MinRatio => "--min-ratio".into(),
            Field::MaxRatio => "--max-ratio".into(),
            Field::FollowUp(i) => format!("the conversation's turn #{} after the question", i + 1),
        }
    }

    /// The JSON field of the HTTP API (`ratio`, `documents[2]`).
    pub fn api(self) -> String {
        match self {
            Field::Query => "query".into(),
            Field::Prompt => "prompt".into(),
            Field::Documents => "documents".into(),
            Field::Document(i) => format!("documents[{i}]"),
            Field::Text => "text".into(),
            Field::ChunkTokens => "chunk_tokens".into(),
            Field::Method => "method".into(),
            Field::Ratio => "ratio".into(),
            Field::Reorder => "reorder".into(),
            Field::Geometry => "geometry".into(),
            Field::ScoreLayers => "score_layers".into(),
            Field::ScorePool => "score_pool".into(),
            Field::Evict => "evict".into(),
            Field::KvBudget => "kv_budget".into(),
            Field::Prefix => "prefix".into(),
            Field::Scope => "scope".into(),
            Field::MaxTokens => "max_tokens".into(),
            Field::Temperature => "temperature".into(),
            Field::TopP => "top_p".into(),
            Field::RecomputeBatch => "recompute_batch".into(),
            Field::Ranks => "ranks".into(),
            Field::AuxModel => "aux_model".into(),
            Field::Deadline => "deadline_s".into(),
            Field::Model => "model".into(),
            Field::CacheSlack => "cache_slack".into(),
            Field::QualityFloor => "quality_floor".into(),
            Field::Coverage => "coverage".into(),
            Field::MinRatio => "min_ratio".into(),
            Field::MaxRatio => "max_ratio".into(),
            Field::FollowUp(i) => format!("conversation.after[{i}]"),
        }
    }
}

/// A caller's mistake: which input, and what is wrong with it (worded to follow either the
/// flag or the field name).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{}: {problem}", field.flag())]
pub struct InputError {
    /// The input to change.
    pub field: Field,
    /// What is wrong and what to do.
    pub problem: String,
}

impl InputError {
    /// An error about `field`.
    pub fn new(field: Field, problem: impl Into<String>) -> Self {
        Self { field, problem: problem.into() }
    }

    /// The message for the HTTP API: names the JSON field instead of the flag.
    pub fn api_message(&self) -> String {
        format!("field `{}`: {}", self.field.api(), self.problem)
    }
}

/// Why a job stopped before its end.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum StopCause {
    /// Whoever asked for it went away.
    Cancelled,
    /// It ran past its deadline (seconds allowed).
    Deadline(f64),
}

/// What can go wrong loading a model, tokenizing, templating, running the model or fetching.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The model file is missing, unreadable or not a valid GGUF.
    #[error("model file {path}: {detail}")]
    ModelFile {
        /// The file.
        path: PathBuf,
        /// What is wrong and what to do.
        detail: String,
    },
    /// The GGUF declares an architecture flowprefill does not implement.
    #[error(
        "model file {path}: architecture `{arch}` is not supported \
         (supported: llama, qwen2, qwen3); pass --model with a GGUF of one of these"
    )]
    UnsupportedArch {
        /// The file.
        path: PathBuf,
        /// `general.architecture` of the file.
        arch: String,
    },
    /// A tensor the implementation does not know (e.g. MoE experts) or with an unusable type.
    #[error("model file {path}: tensor `{name}`: {detail}")]
    UnsupportedTensor {
        /// The file.
        path: PathBuf,
        /// Tensor name.
        name: String,
        /// Why it cannot be used.
        detail: String,
    },
    /// Missing or malformed metadata.
    #[error("model file {path}: metadata `{key}`: {detail}")]
    Metadata {
        /// The file.
        path: PathBuf,
        /// Metadata key.
        key: String,
        /// What is wrong.
        detail: String,
    },
    /// Building the tokenizer or tokenizing failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// Rendering the chat template failed.
    #[error("chat template: {0}")]
    Template(String),
    /// The caller's input is invalid.
    #[error(transparent)]
    Input(#[from] InputError),
    /// More tokens than the model's context window.
    #[error(
        "the input needs {tokens} token positions but the model's context window is {window}; \
         shorten the documents or the prompt, or ask for fewer answer tokens"
    )]
    ContextTooLong {
        /// Positions needed.
        tokens: usize,
        /// The model's window (`<arch>.context_length`).
        window: usize,
    },
    /// A document to ingest that does not fit the context window behind the template's head
    /// (ingestion has no question or answer to shorten: the document is what must change).
    #[error(
        "the document is {tokens} tokens and needs {needed} token positions with the chat template's \
         head, but the model's context window is {window}; split it into smaller documents"
    )]
    DocumentTooLong {
        /// The document's tokens.
        tokens: usize,
        /// Positions needed: the head's, the document's and one more.
        needed: usize,
        /// The model's window (`<arch>.context_length`).
        window: usize,
    },
    /// A text so long that even at the vocabulary's longest tokens it exceeds the context
    /// window: refused before it is tokenized.
    #[error(
        "the input is {bytes} bytes of text, at least {tokens} tokens for this model, but its context \
         window is {window} tokens; shorten the documents or the prompt"
    )]
    TextTooLong {
        /// Bytes of text (documents, question, system message, answer prefix).
        bytes: usize,
        /// The fewest tokens they can make.
        tokens: usize,
        /// The model's window.
        window: usize,
    },
    /// Fetching a model flowprefill knows (the default one, or another named by
    /// `fetch-model`) failed.
    #[error("fetching the model: {0}")]
    Fetch(String),
    /// A KV Packet adapter file that cannot be used.
    #[error("adapter {}: {detail}", path.display())]
    Adapter {
        /// The file.
        path: PathBuf,
        /// What is wrong and what to do.
        detail: String,
    },
    /// Another rank was lost or did not answer.
    #[error(transparent)]
    Comm(#[from] flowprefill_comm::CommError),
    /// A kernel rejected its inputs.
    #[error(transparent)]
    Kernel(#[from] flowprefill_kernels::KernelError),
    /// A peer sent a message that does not fit the protocol.
    #[error("message from rank {rank}: {detail}")]
    Protocol {
        /// The sender.
        rank: usize,
        /// What is wrong with it.
        detail: String,
    },
    /// An invariant of flowprefill itself does not hold: a bug.
    #[error("internal error: {0} (a bug in flowprefill; please report it)")]
    Internal(String),
    /// The job was stopped between two layers.
    #[error("{}", stopped_message(*.cause, phase))]
    Stopped {
        /// Where it stopped.
        phase: String,
        /// Why.
        cause: StopCause,
    },
    /// Filesystem error with the path or action it concerns.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

fn stopped_message(cause: StopCause, phase: &str) -> String {
    match cause {
        StopCause::Cancelled => format!("the job was cancelled during {phase} (its client went away)"),
        StopCause::Deadline(s) => format!("the job ran past its deadline of {s:.1} s during {phase}"),
    }
}

impl WorkerError {
    /// Whose fault the error is (see [`ErrorClass`]).
    pub fn class(&self) -> ErrorClass {
        use flowprefill_kernels::KernelError;
        match self {
            WorkerError::Input(_)
            | WorkerError::ContextTooLong { .. }
            | WorkerError::DocumentTooLong { .. }
            | WorkerError::TextTooLong { .. } => ErrorClass::Caller,
            WorkerError::ModelFile { .. }
            | WorkerError::UnsupportedArch { .. }
            | WorkerError::UnsupportedTensor { .. }
            | WorkerError::Metadata { .. }
            | WorkerError::Tokenizer(_)
            | WorkerError::Template(_)
            | WorkerError::Fetch(_)
            | WorkerError::Adapter { .. }
            | WorkerError::Io { .. } => ErrorClass::Model,
            WorkerError::Comm(e) => e.class(),
            WorkerError::Protocol { .. } => ErrorClass::Peer,
            WorkerError::Kernel(KernelError::Backend { .. } | KernelError::HeadLayout { .. }) => ErrorClass::Model,
            WorkerError::Kernel(KernelError::OutOfMemory { .. }) => ErrorClass::Resource,
            WorkerError::Kernel(KernelError::DeviceLost { .. }) => ErrorClass::Device,
            WorkerError::Kernel(KernelError::Shape { .. } | KernelError::Dtype { .. }) | WorkerError::Internal(_) => {
                ErrorClass::Internal
            }
            WorkerError::Stopped { cause: StopCause::Cancelled, .. } => ErrorClass::Cancelled,
            WorkerError::Stopped { cause: StopCause::Deadline(_), .. } => ErrorClass::Deadline,
        }
    }

    /// This error with `advice` when it is a kernel's [`KernelError::OutOfMemory`] (any other
    /// unchanged): see [`KernelError::advised`].
    ///
    /// [`KernelError::OutOfMemory`]: flowprefill_kernels::KernelError::OutOfMemory
    /// [`KernelError::advised`]: flowprefill_kernels::KernelError::advised
    pub fn advised(self, advice: flowprefill_kernels::OomAdvice) -> Self {
        match self {
            WorkerError::Kernel(e) => WorkerError::Kernel(e.advised(advice)),
            e => e,
        }
    }

    /// The message for the HTTP API (input errors name JSON fields, not flags).
    pub fn api_message(&self) -> String {
        match self {
            WorkerError::Input(e) => e.api_message(),
            WorkerError::ContextTooLong { tokens, window } => format!(
                "the input needs {tokens} token positions but the model's context window is {window}; \
                 shorten the documents or the query, or lower `max_tokens`"
            ),
            WorkerError::TextTooLong { bytes, tokens, window } => format!(
                "the input is {bytes} bytes of text, at least {tokens} tokens for this model, but its context \
                 window is {window} tokens; shorten the documents or the query"
            ),
            e => e.to_string(),
        }
    }
}

/// An internal-invariant error (a bug).
pub(crate) fn internal(msg: impl Into<String>) -> WorkerError {
    WorkerError::Internal(msg.into())
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, WorkerError>;

/// Attaches a description to an IO error.
pub(crate) fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> WorkerError {
    let what = what.into();
    move |source| WorkerError::Io { what, source }
}
