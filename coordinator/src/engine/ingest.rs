//! Ingestion: documents prefilled into the chunk store before any question names them (the
//! premise of InfoFlow KV, paper 003 §1: retrieved documents' caches are made offline and
//! assembled at query time).
//!
//! A document is one chunk of a `documents` request; its cache is looked up by the head it was
//! prefilled behind, its start position and its tokens. Ingestion makes the two forms a query
//! looks up: behind the template's head (the first document under prefix mode `none`, and every
//! document under `shared`, CacheClip's mode) and alone from position 0 (every later document
//! under `none`). Star Attention's anchored chunks depend on the first document of each request
//! and are not made ahead. A form already in the store (RAM or disk) is not made again.

use super::Engine;
use crate::error::{internal, Result};
use crate::layout::Layout;
use crate::request::{Context, Request};
use flowprefill_kernels::Backend;
use flowprefill_worker::interrupt::Check;
use flowprefill_worker::{Field, InputError, WorkerError};

/// The request a document is ingested as: it alone, no question, behind the head of `system`.
fn document_request(document: &str, system: Option<&str>) -> Request {
    Request {
        conversation: Default::default(),
        context: Context::Documents(vec![document.to_string()]),
        query: String::new(),
        system: system.map(str::to_string),
        answer_prefix: None,
    }
}

/// What ingesting one document did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ingested {
    /// The document's tokens (as a query's layout tokenizes it).
    pub tokens: usize,
    /// Chunk caches made now, of the two forms (0: the store held both already).
    pub prefilled: usize,
}

impl<B: Backend> Engine<B> {
    /// Prefills `document` into this engine's chunk store (and its disk tier, written through)
    /// in the forms queries look up (see the module docs), behind the head of `system` (the
    /// system message the queries will use; `None`: the template's own). `check` runs before
    /// every layer.
    pub fn ingest(&self, document: &str, system: Option<&str>, check: Check<'_>) -> Result<Ingested> {
        if document.trim().is_empty() {
            return Err(
                InputError::new(Field::Document(0), "the document is empty; remove it or give it some text").into()
            );
        }
        let lm = &*self.lm;
        let req = document_request(document, system);
        let layout = Layout::build(lm, &req)?;
        let window = lm.model.config().context_length;
        let tokens = layout.chunks.first().map_or(0, Vec::len);
        let needed = layout.head.len() + tokens + 1;
        if needed > window {
            return Err(WorkerError::DocumentTooLong { tokens, needed, window }.into());
        }
        // Ingesting is for the disk tier: what was made is written even when a later form
        // failed, unless the GPU was lost (its last results cannot be trusted, and reading them
        // back would wait on a kernel that may never finish).
        let made = self.ingest_forms(lm, &layout, check);
        if made.as_ref().is_err_and(|e| e.class() == crate::ErrorClass::Device) {
            self.store.forget_pending();
        } else {
            self.store.persist_pending(lm.model.backend());
        }
        // One document is prefilled on one rank: more ranks do not spread it.
        let (first, alone) = made.map_err(|e| e.advised(self.oom_advice(false)))?;
        if first.chunks.len() != 1 || alone.chunks.len() != 1 {
            return Err(internal("ingestion made no chunk cache"));
        }
        Ok(Ingested { tokens, prefilled: (first.misses + alone.misses) as usize })
    }

    /// Whether the disk tier holds the files of every cache a job needs of `document` (as
    /// [`Engine::ingest`] made them behind the head of `system`): the head's, and the
    /// document's behind it and alone. `false` without a disk tier. What an ingestion checks
    /// at its end: the store may have deleted any of them to stay within its budget, the head's
    /// too, which every document shares (counting this ingestion's writes misses that).
    pub fn on_disk(&self, document: &str, system: Option<&str>) -> Result<bool> {
        let Some(disk) = self.store.disk() else { return Ok(false) };
        let lm = &*self.lm;
        let req = document_request(document, system);
        let layout = Layout::build(lm, &req)?;
        let Some(doc) = layout.chunks.first() else { return Ok(false) };
        let key = |head: &[u32], start: usize, tokens: &[u32]| {
            super::caches::chunk_key(&lm.model, head, start as u32, tokens)
        };
        Ok([key(&[], 0, &layout.head), key(&layout.head, layout.head.len(), doc), key(&[], 0, doc)]
            .iter()
            .all(|k| disk.holds(k)))
    }

    /// The caches a document is looked up in: behind the head (the first document's form, and
    /// every document's in shared mode) and alone from position 0 (a later document's form in
    /// prefix mode none), the head's first so that the counts are the document's own.
    fn ingest_forms(
        &self,
        lm: &flowprefill_worker::LoadedModel<B>,
        layout: &Layout,
        check: Check<'_>,
    ) -> Result<(super::caches::Caches<B>, super::caches::Caches<B>)> {
        let shared = crate::request::PrefixMode::Shared;
        self.caches(lm, &self.store, layout, shared, &[], &mut *check)?;
        // The head's cache is made (and waits to be written): a fault here leaves one behind.
        self.fault_point(flowprefill_comm::launcher_rank().unwrap_or(0), "ingest")?;
        let first = self.caches(lm, &self.store, layout, shared, &[0], &mut *check)?;
        let mut later = layout.clone();
        later.chunks.insert(0, Vec::new());
        let alone = self.caches(lm, &self.store, &later, crate::request::PrefixMode::None, &[1], check)?;
        Ok((first, alone))
    }
}
