//! Typed errors of the worker crate. Messages say what to change.

use std::path::PathBuf;

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
    /// Invalid request input (empty prompt, bad option).
    #[error("{0}")]
    Input(String),
    /// More tokens than the model's context window.
    #[error(
        "the input needs {tokens} token positions but the model's context window is {window}; \
         shorten the documents or the prompt, or lower --max-tokens"
    )]
    ContextTooLong {
        /// Positions needed.
        tokens: usize,
        /// The model's window (`<arch>.context_length`).
        window: usize,
    },
    /// Fetching the default model failed.
    #[error("fetching the default model: {0}")]
    Fetch(String),
    /// Another rank was lost or did not answer.
    #[error(transparent)]
    Comm(#[from] flowprefill_comm::CommError),
    /// A kernel rejected its inputs.
    #[error(transparent)]
    Kernel(#[from] flowprefill_kernels::KernelError),
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

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, WorkerError>;

/// Attaches a description to an IO error.
pub(crate) fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> WorkerError {
    let what = what.into();
    move |source| WorkerError::Io { what, source }
}
