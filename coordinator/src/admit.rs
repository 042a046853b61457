//! Admission: every check of a job that needs the model (token counts, the context window,
//! the scoring layers, sampling) plus the caller's cost bounds, before any work.
//!
//! ```text
//!   service handler:  admit(job, service limits) ──> 400 at once, or queue the job
//!   every rank, at the start of the job:  admit(job, no limits) ──> agreed by all ranks
//! ```
//! The same function runs in both places, so a job the service queued is a job the ranks
//! accept, and a job the ranks refuse is refused by all of them alike (see the engine).

use crate::error::Result;
use crate::layout::Layout;
use crate::request::{validate, Context, EvictPolicy, Job, Method};
use flowprefill_kernels::Backend;
use flowprefill_worker::sampling::Sampler;
use flowprefill_worker::{Field, InputError, LoadedModel, WorkerError};

/// Cost bounds of one request (what one caller may ask of the ranks).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Limits {
    /// Documents per request.
    pub max_documents: usize,
    /// Chunks per request (documents, or pieces of a text).
    pub max_chunks: usize,
    /// Context tokens per request (the model's window bounds it too).
    pub max_context_tokens: usize,
}

impl Limits {
    /// No bound beyond the model's window (the command line).
    pub const NONE: Limits =
        Limits { max_documents: usize::MAX, max_chunks: usize::MAX, max_context_tokens: usize::MAX };
}

impl Default for Limits {
    /// The service's defaults: a request of a few hundred documents is a long-context job;
    /// thousands of tiny chunks are a denial of service (each chunk is a separate prefill and
    /// a separate attention segment in every layer).
    fn default() -> Self {
        Limits { max_documents: 256, max_chunks: 256, max_context_tokens: usize::MAX }
    }
}

/// A job that passed admission: its tokens and sizes.
#[derive(Clone, Debug)]
pub struct Admitted {
    /// The tokenized request.
    pub layout: Layout,
}

impl Admitted {
    /// Context chunks.
    pub fn chunks(&self) -> usize {
        self.layout.chunks.len()
    }

    /// Context tokens.
    pub fn context_tokens(&self) -> usize {
        self.layout.n_context()
    }
}

fn bad(field: Field, problem: impl Into<String>) -> crate::error::CoordError {
    InputError::new(field, problem).into()
}

/// Checks `job` against the model and `limits`; returns its layout.
pub fn admit<B: Backend>(lm: &LoadedModel<B>, job: &Job, limits: &Limits) -> Result<Admitted> {
    let (req, opts) = (&job.request, &job.options);
    validate(req, opts)?;
    if let Context::Documents(docs) = &req.context {
        if docs.len() > limits.max_documents {
            return Err(bad(
                Field::Documents,
                format!("{} documents; this server takes at most {} per request", docs.len(), limits.max_documents),
            ));
        }
    }
    Sampler::new(opts.sampling.clone())?;
    let cfg = lm.model.config();
    if opts.evict.is_some_and(|e| e.policy == EvictPolicy::Lookahead) && lm.model.lookahead_rows() == 0 {
        return Err(bad(
            Field::Evict,
            format!(
                "lookahead needs a LookaheadKV adapter for {}: start flowprefill with --lookahead-adapter PATH \
                 (made by `flowprefill train lookahead`), or evict with snapkv",
                cfg.name
            ),
        ));
    }
    if let Some(adapter) = opts.method.info().adapter.filter(|a| !a.loaded(lm)) {
        return Err(adapter.missing(opts.method.name(), lm).into());
    }
    if let Some((a, b)) = opts.score_layers {
        if b >= cfg.n_layers {
            return Err(bad(Field::ScoreLayers, format!("{a}-{b}: the model has layers 0-{}", cfg.n_layers - 1)));
        }
    }
    let layout = Layout::for_method(lm, req, opts.method)?;
    if layout.chunks.len() > limits.max_chunks {
        let field = if matches!(req.context, Context::Text { .. }) { Field::ChunkTokens } else { Field::Documents };
        return Err(bad(
            field,
            format!(
                "the context makes {} chunks; this server takes at most {} per request (use fewer, larger chunks)",
                layout.chunks.len(),
                limits.max_chunks
            ),
        ));
    }
    // The system prompt and a chat's turns before the context are prefilled in front of every
    // chunk: they count as context (documents pasted into an earlier turn are not a way around
    // the limit). The layout tokenized them once already.
    let earlier = layout.head_text;
    if layout.n_context() + earlier > limits.max_context_tokens {
        let turns =
            if earlier > 0 { format!(" and the system prompt and turns before it {earlier}") } else { String::new() };
        return Err(bad(
            Field::Documents,
            format!(
                "the context has {} tokens{turns}; this server takes at most {} per request",
                layout.n_context(),
                limits.max_context_tokens
            ),
        ));
    }
    if layout.n_context() == 0 && opts.method != Method::Full {
        return Err(bad(Field::Documents, "the context has no tokens"));
    }
    let window = cfg.context_length;
    if layout.total_len() + 1 > window {
        return Err(WorkerError::ContextTooLong { tokens: layout.total_len() + 1, window }.into());
    }
    Ok(Admitted { layout })
}
