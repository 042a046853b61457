//! The routes and their handlers.
//!
//! A job request goes through, in order: the bearer token (before any of the body is read),
//! the body (bounded in size and in time), the JSON (fields named in errors), admission
//! against the model and the server's limits (tokens counted, the context window, scoring
//! layers: 400 at once, before queueing), the queue (429 when full), then the job. A streamed
//! job's status is chosen when every rank has admitted it, so errors found before any work
//! still get their own status; only failures during the work arrive as an `error` event.

use super::api::{self, ApiError, ChatRequest, DocumentsRequest, JobRequest};
use super::metrics;
use super::queue::{CancelOnDrop, Event, Queue, Queued, Shared};
use super::ServeConfig;
use crate::cmd::run::to_json;
use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use flowprefill_coordinator::{admit, memory, Engine, Ingested, Job, RunResult, DEFAULT_STORE_BYTES};
use flowprefill_kernels::Device;
use flowprefill_worker::generate::StopReason;
use flowprefill_worker::interrupt::Watch;
use flowprefill_worker::store::documents::{Documents, ResolveError};
use flowprefill_worker::LoadedModel;
use futures_util::stream::{self, Stream};
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedReceiver;

/// A handler answers by itself this long after a job's deadline if the executor has not.
const ANSWER_GRACE: Duration = Duration::from_secs(2);

/// What the handlers share.
pub struct AppState {
    pub(super) queue: Queue,
    pub(super) shared: Arc<Shared>,
    pub(super) lm: Arc<LoadedModel<Device>>,
    pub(super) cfg: ServeConfig,
    pub(super) prom: metrics_exporter_prometheus::PrometheusHandle,
    pub(super) shutting_down: AtomicBool,
    next_id: AtomicU64,
    /// Admissions (tokenization) running at once.
    admitting: tokio::sync::Semaphore,
    /// Ranks sharing the device of this process (thread ranks: all of them).
    memory_peers: usize,
    /// Bytes the smallest job needs (`/readyz` is not ready below).
    smallest_job: usize,
    /// The engine `POST /v1/documents` prefills with (made on first use; one ingestion at a
    /// time), over the same disk tier as the ranks' stores.
    ingester: std::sync::Mutex<Option<Engine<Device>>>,
    /// `POST /v1/documents` requests running (one) or waiting for the ingester (`--queue`).
    ingesting: std::sync::atomic::AtomicUsize,
    /// Jobs admitted, for `--verify-rate`'s sampling.
    admitted: AtomicU64,
}

impl AppState {
    pub(super) fn new(
        queue: Queue,
        shared: Arc<Shared>,
        lm: Arc<LoadedModel<Device>>,
        cfg: ServeConfig,
        prom: metrics_exporter_prometheus::PrometheusHandle,
        memory_peers: usize,
    ) -> Self {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        let smallest_job = memory::smallest_job(&lm);
        if let Some(m) = memory::available(lm.model.backend(), cfg.memory_limit) {
            metrics::memory_free(&m.device, m.free);
        }
        metrics::ingestions_change(0.0);
        Self {
            memory_peers,
            smallest_job,
            queue,
            shared,
            lm,
            cfg,
            prom,
            shutting_down: AtomicBool::new(false),
            next_id: AtomicU64::new(1),
            admitting: tokio::sync::Semaphore::new(cores),
            ingester: std::sync::Mutex::new(None),
            ingesting: std::sync::atomic::AtomicUsize::new(0),
            admitted: AtomicU64::new(0),
        }
    }

    /// The ingested documents of the service's store (409 without one).
    fn documents(&self) -> Result<(Documents, flowprefill_coordinator::DiskTier), ApiError> {
        let Some(tier) = self.cfg.store.clone() else {
            return Err(ApiError::new(
                409,
                "no_store",
                "this service runs with --store off: documents are ingested into the disk store; restart it with \
                 --store FOLDER",
            ));
        };
        let docs = Documents::open(&tier.dir)
            .map_err(|e| ApiError::new(500, "internal", format!("the documents folder cannot be opened: {e}")))?;
        Ok((docs, tier))
    }

    /// The texts of `ids` (a 400 naming the first unknown one).
    fn resolve_ids(&self, ids: &[String]) -> Result<Vec<String>, ApiError> {
        let (docs, _) = self.documents()?;
        docs.resolve(ids).map_err(|e| match e {
            // The service's folder is not the client's business: the id alone.
            ResolveError::Unknown { id, .. } => ApiError::bad_request(format!(
                "field `document_ids`: unknown document id `{id}`: ingest the document first (POST /v1/documents)"
            )),
            ResolveError::Io(..) => ApiError::new(500, "internal", e.to_string()),
        })
    }

    /// Prefills `req`'s documents into the store (on a blocking thread): their ids, token
    /// counts and how many caches were made, once every cache is on disk. `watch` stops it
    /// between layers (the client went away, or `--job-timeout` passed, waiting included).
    fn ingest(&self, req: DocumentsRequest, watch: &Watch) -> Result<serde_json::Value, ApiError> {
        let (docs, tier) = self.documents()?;
        // Housekeeping, here and not on every lookup by id: what a killed ingestion left.
        let _ = docs.remove_dead_writes();
        let started = Instant::now();
        let mut guard = self.ingester.lock().unwrap_or_else(|p| p.into_inner());
        watch.check("ingest").map_err(|e| ApiError::from_coord(&flowprefill_coordinator::CoordError::from(e)))?;
        let engine =
            guard.get_or_insert_with(|| Engine::new(self.lm.clone(), DEFAULT_STORE_BYTES / 4).with_disk(Some(&tier)));
        // What is stored is what is on disk: the ingester's memory of earlier ingestions (which
        // the folder may no longer hold: `store clear`, a trim) would answer "stored" for a
        // document nothing holds, and keep device memory no job can reclaim.
        engine.store().clear();
        let before = engine.store().disk_stats().unwrap_or_default();
        let mut out = Vec::with_capacity(req.documents.len());
        let mut stored: Vec<String> = Vec::new();
        let mut each = || -> Result<(), ApiError> {
            for (i, text) in req.documents.iter().enumerate() {
                if self.shutting_down.load(Ordering::Relaxed) {
                    return Err(ApiError::new(503, "shutting_down", "the service is shutting down"));
                }
                // Kept under its id only once its caches are made (a document that fails is not
                // left behind as ingested).
                let Ingested { tokens, prefilled } =
                    engine.ingest(text, req.system.as_deref(), &mut || watch.check("ingest")).map_err(|e| {
                        if e.class() == flowprefill_coordinator::ErrorClass::Device {
                            // The ingester shares rank 0's GPU: the service stops as for a job.
                            self.shared.lose_device(&e);
                        }
                        let a = ApiError::from_coord(&e);
                        ApiError::new(a.status, a.kind, format!("documents[{i}]: {}", a.message))
                    })?;
                let (id, _) = docs
                    .put(text)
                    .map_err(|e| ApiError::new(500, "internal", format!("documents[{i}] cannot be kept: {e}")))?;
                metrics::document_ingested(prefilled > 0);
                out.push(serde_json::json!({ "id": id, "tokens": tokens, "prefilled": prefilled }));
                stored.push(id);
            }
            Ok(())
        };
        let done = each();
        // Nothing is kept in memory between ingestions, whatever the outcome; `clear` first
        // waits for the disk writes, so the caches made are on disk either way: the answer
        // promises it (a job sent next finds them), and after a failure the documents stored
        // before it stay usable.
        engine.store().clear();
        let (corrupt, write_failures) = engine.disk_faults_since_report();
        metrics::store_faults(corrupt, write_failures);
        if let Err(mut e) = done {
            if !stored.is_empty() {
                e.message = format!(
                    "{}; the documents before it are stored (ids {}): send only the rest again",
                    e.message,
                    stored.join(", ")
                );
            }
            return Err(e);
        }
        // ... and it keeps that promise: caches not written (a full disk) or deleted at once
        // for the budget are a 507 that says what to change, not a success.
        let lost = crate::cmd::ingest::Lost::between(&before, &engine.store().disk_stats().unwrap_or_default());
        if let Some(p) = lost.problem(&tier) {
            return Err(ApiError::new(507, "insufficient_storage", p));
        }
        Ok(serde_json::json!({ "documents": out, "seconds": started.elapsed().as_secs_f64() }))
    }

    /// The bearer token check (scheme case-insensitive, token compared in constant time).
    fn authorize(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let Some(expected) = &self.cfg.token else { return Ok(()) };
        let presented = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map_or("", |(_, t)| t.trim());
        if api::token_matches(presented, expected) {
            Ok(())
        } else {
            Err(ApiError::new(401, "unauthorized", "missing or wrong bearer token (Authorization: Bearer <token>)"))
        }
    }

    /// Reads the body after the token was checked: at most `max_body_bytes`, within
    /// `read_timeout`.
    async fn body(&self, headers: &HeaderMap, body: Body) -> Result<axum::body::Bytes, ApiError> {
        let limit = self.cfg.max_body_bytes;
        let too_large = || ApiError::new(413, "too_large", format!("the request body is larger than {limit} bytes"));
        let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        if declared.is_some_and(|n| n > limit as u64) {
            return Err(too_large());
        }
        match tokio::time::timeout(self.cfg.read_timeout, axum::body::to_bytes(body, limit)).await {
            Err(_) => Err(ApiError::new(
                408,
                "timeout",
                format!("the request body did not arrive within {:.0} s", self.cfg.read_timeout.as_secs_f64()),
            )),
            Ok(Err(e)) => {
                let e = e.into_inner();
                if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() {
                    Err(too_large())
                } else {
                    Err(ApiError::bad_request(format!("cannot read the request body: {e}")))
                }
            }
            Ok(Ok(b)) => Ok(b),
        }
    }

    /// Admission before queueing (see [`flowprefill_coordinator::admit`]), off the async
    /// threads (it tokenizes), a few at a time (a burst of large bodies must not take every
    /// core from the job being computed).
    /// Whether the service verifies the next job by itself: every job whose count crosses a
    /// multiple of 1/R (exactly the share R of jobs, spread evenly).
    fn sampled_for_verification(&self) -> bool {
        let r = self.cfg.verify_rate;
        if r <= 0.0 {
            return false;
        }
        let n = self.admitted.fetch_add(1, Ordering::Relaxed) as f64;
        ((n + 1.0) * r).floor() > (n * r).floor()
    }

    async fn admit(&self, mut job: Job) -> Result<Job, ApiError> {
        if !job.options.verify && self.sampled_for_verification() {
            job.options.verify = true;
        }
        let _turn = self
            .admitting
            .acquire()
            .await
            .map_err(|_| ApiError::new(503, "shutting_down", "the service is shutting down"))?;
        let (lm, limits) = (self.lm.clone(), self.cfg.limits);
        let (ranks, peers, limit) = (self.shared.ranks, self.memory_peers, self.cfg.memory_limit);
        let checked = tokio::task::spawn_blocking(move || {
            let a = admit(&lm, &job, &limits)?;
            if let Some(m) = memory::available(lm.model.backend(), limit) {
                metrics::memory_free(&m.device, m.free);
            }
            // Refused here when even emptied chunk stores would not make room (the ranks check
            // again, exactly, when the job starts).
            let reclaimable = peers * (DEFAULT_STORE_BYTES + DEFAULT_STORE_BYTES / 4);
            let room = memory::Room { rank: 0, ranks, peers, reclaimable, limit };
            memory::admit_memory(&lm, &job.options, &a.layout, room)?;
            if job.options.verify {
                // The exact twin runs after the answer, through the same world, over the same
                // request (the layout just built): it must fit too.
                let twin = flowprefill_coordinator::engine::exact_job(&job, ranks);
                memory::admit_memory(&lm, &twin.options, &a.layout, room)?;
            }
            Ok::<_, flowprefill_coordinator::CoordError>(job)
        })
        .await;
        match checked {
            Ok(Ok(job)) => Ok(job),
            Ok(Err(e)) => Err(ApiError::from_coord(&e)),
            Err(e) => Err(ApiError::new(500, "internal", format!("admission failed: {e}"))),
        }
    }

    /// Queues `job`, whose request arrived at `arrived`: its deadline counts from then (reading
    /// the body and admission included, as the client's clock does).
    fn enqueue(&self, job: Job, deadline_s: Option<f64>, arrived: Instant) -> Result<Pending, ApiError> {
        if self.shutting_down.load(Ordering::Relaxed) {
            return Err(ApiError::new(503, "shutting_down", "the service is shutting down"));
        }
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let deadline = super::queue::deadline_of(deadline_s, self.cfg.job_timeout, arrived);
        let q = Queued { job, accepted: Instant::now(), arrived, deadline, cancel: cancel.clone(), events: tx };
        self.queue.submit(q, &self.shutting_down)?;
        Ok(Pending { rx, guard: CancelOnDrop::new(cancel), answer_by: deadline + ANSWER_GRACE })
    }

    /// Token, body, JSON, admission, queue: a job waiting for its first event, whether to
    /// stream, and what `into_job` kept for the answer. `into_job` runs on a blocking thread
    /// (it may read the document store).
    async fn accept<T, X>(
        &self,
        headers: &HeaderMap,
        body: Body,
        into_job: impl FnOnce(T) -> Result<(Job, bool, Option<f64>, X), ApiError> + Send + 'static,
    ) -> Result<(Pending, bool, X), ApiError>
    where
        T: serde::de::DeserializeOwned + Send + 'static,
        X: Send + 'static,
    {
        let arrived = Instant::now();
        self.authorize(headers)?;
        let body = self.body(headers, body).await?;
        let request = api::parse::<T>(&body)?;
        let (job, stream, deadline, kept) = tokio::task::spawn_blocking(move || into_job(request))
            .await
            .map_err(|e| ApiError::new(500, "internal", format!("reading the request failed: {e}")))??;
        let job = self.admit(job).await?;
        Ok((self.enqueue(job, deadline, arrived)?, stream, kept))
    }
}

/// A queued job as its handler sees it.
struct Pending {
    rx: UnboundedReceiver<Event>,
    guard: CancelOnDrop,
    /// The handler answers 504 by itself at this time.
    answer_by: Instant,
}

impl Pending {
    /// The next event, or a deadline error when the executor has said nothing in time.
    async fn next(&mut self) -> Event {
        match tokio::time::timeout_at(self.answer_by.into(), self.rx.recv()).await {
            Ok(Some(ev)) => ev,
            Ok(None) => Event::Failed(ApiError::new(500, "internal", "the job ended without a result")),
            Err(_) => Event::Failed(ApiError::new(504, "deadline", "the job did not finish before its deadline")),
        }
    }

    /// Waits for the result, skipping progress events.
    async fn result(mut self) -> Result<Box<RunResult>, ApiError> {
        loop {
            match self.next().await {
                Event::Admitted | Event::Text(_) => {}
                Event::Done(r) => {
                    self.guard.disarm();
                    return Ok(r);
                }
                Event::Failed(e) => {
                    self.guard.disarm();
                    return Err(e);
                }
            }
        }
    }

    /// Waits until the job is admitted by every rank (or fails first: then that error is the
    /// response's status).
    async fn admitted(mut self) -> Result<(Self, Option<Event>), ApiError> {
        match self.next().await {
            Event::Admitted => Ok((self, None)),
            Event::Failed(e) => {
                self.guard.disarm();
                Err(e)
            }
            ev => Ok((self, Some(ev))),
        }
    }

    /// The remaining events as a stream (ends after the result or the error).
    fn events(self, first: Option<Event>) -> impl Stream<Item = Event> + Send {
        stream::unfold((self, first, false), |(mut p, first, ended)| async move {
            if ended {
                return None;
            }
            let ev = match first {
                Some(ev) => ev,
                None => p.next().await,
            };
            let last = matches!(ev, Event::Done(_) | Event::Failed(_));
            if last {
                p.guard.disarm();
            }
            Some((ev, (p, None, last)))
        })
    }
}

pub(super) fn error_response(e: &ApiError) -> Response {
    metrics::error(e.kind);
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut r = (status, axum::Json(e.body())).into_response();
    if let Some(s) = e.retry_after {
        if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
            r.headers_mut().insert(header::RETRY_AFTER, v);
        }
    }
    if e.status == 401 {
        r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    r
}

fn sse<S: Stream<Item = SseEvent> + Send + 'static>(events: S) -> Response {
    use futures_util::StreamExt;
    Sse::new(events.map(Ok::<_, Infallible>)).keep_alive(KeepAlive::default()).into_response()
}

async fn jobs(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    // Documents named by id are read from the store before admission.
    let resolver = st.clone();
    let into_job = move |mut r: JobRequest| {
        if let Some(ids) = r.document_ids.take() {
            if r.documents.is_some() || r.text.is_some() {
                return Err(ApiError::bad_request("give one of `documents`, `text` and `document_ids`"));
            }
            r.documents = Some(resolver.resolve_ids(&ids)?);
        }
        r.into_job().map(|(job, stream, deadline)| (job, stream, deadline, ()))
    };
    let (pending, stream, ()) = match st.accept::<JobRequest, ()>(&headers, body, into_job).await {
        Ok(x) => x,
        Err(e) => return error_response(&e),
    };
    if !stream {
        return match pending.result().await {
            Ok(r) => axum::Json(to_json(&r)).into_response(),
            Err(e) => error_response(&e),
        };
    }
    let (pending, first) = match pending.admitted().await {
        Ok(x) => x,
        Err(e) => return error_response(&e),
    };
    use futures_util::StreamExt;
    sse(pending.events(first).filter_map(|ev| async move {
        match ev {
            Event::Admitted => None,
            Event::Text(s) => {
                Some(SseEvent::default().event("token").data(serde_json::json!({ "text": s }).to_string()))
            }
            Event::Done(r) => Some(SseEvent::default().event("done").data(to_json(&r).to_string())),
            Event::Failed(e) => {
                metrics::error(e.kind);
                Some(SseEvent::default().event("error").data(e.body().to_string()))
            }
        }
    }))
}

async fn documents(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    match ingest(st, headers, body).await {
        Ok(v) => axum::Json(v).into_response(),
        // error_response counts the error.
        Err(e) => error_response(&e),
    }
}

/// `POST /v1/documents`: token, body, JSON, the documents' checks, then the prefill.
async fn ingest(st: Arc<AppState>, headers: HeaderMap, body: Body) -> Result<serde_json::Value, ApiError> {
    st.authorize(&headers)?;
    let body = st.body(&headers, body).await?;
    let req: DocumentsRequest = api::parse(&body)?;
    if st.shutting_down.load(Ordering::Relaxed) {
        return Err(ApiError::new(503, "shutting_down", "the service is shutting down"));
    }
    st.documents()?;
    let max = st.cfg.limits.max_documents;
    if req.documents.is_empty() || req.documents.len() > max {
        return Err(ApiError::bad_request(format!(
            "field `documents`: {} documents; give 1 to {max} per request",
            req.documents.len()
        )));
    }
    if let Some(i) = req.documents.iter().position(|d| d.trim().is_empty()) {
        return Err(ApiError::bad_request(format!(
            "field `documents[{i}]`: the document is empty; remove it or give it some text"
        )));
    }
    // One ingestion runs at a time; at most `--queue` wait, like jobs (each holds its body and
    // a blocking thread).
    let slot = IngestSlot::take(&st)?;
    // A client that goes away cancels its ingestion (between layers; what was stored stays).
    let cancel = Arc::new(AtomicBool::new(false));
    let _guard = CancelOnDrop::new(cancel.clone());
    let watch = Watch::new(Some(cancel), Some(st.cfg.job_timeout));
    let worker = st.clone();
    tokio::task::spawn_blocking(move || {
        let _slot = slot;
        let done = worker.ingest(req, &watch);
        if let Err(e) = &done {
            // Its client is gone: nobody answers it, but the errors counter still counts it.
            if e.kind == "cancelled" {
                metrics::error(e.kind);
            }
        }
        done
    })
    .await
    .map_err(|e| ApiError::new(500, "internal", format!("ingestion failed: {e}")))?
}

/// A `POST /v1/documents` request counted as waiting or running, and as work the shutdown
/// waits for, until dropped.
struct IngestSlot(Arc<AppState>);

impl IngestSlot {
    /// 429 with Retry-After when one ingestion runs and `--queue` wait.
    fn take(st: &Arc<AppState>) -> Result<Self, ApiError> {
        if st.ingesting.fetch_add(1, Ordering::Relaxed) > st.cfg.queue {
            st.ingesting.fetch_sub(1, Ordering::Relaxed);
            let mut e = ApiError::new(
                429,
                "queue_full",
                format!(
                    "{} document ingestions already wait behind the one running (--queue); retry later",
                    st.cfg.queue
                ),
            );
            e.retry_after = Some(st.shared.retry_after());
            return Err(e);
        }
        st.shared.outstanding.fetch_add(1, Ordering::Relaxed);
        // An ingestion holds the device as a job does: without this, the dashboard showed an
        // idle service while one prefilled.
        metrics::ingestions_change(1.0);
        Ok(Self(st.clone()))
    }
}

impl Drop for IngestSlot {
    fn drop(&mut self) {
        self.0.ingesting.fetch_sub(1, Ordering::Relaxed);
        metrics::ingestions_change(-1.0);
        self.0.shared.finished_one();
    }
}

/// OpenAI's `usage`: the prompt's tokens (the template's head, the context, the question) and
/// the answer's.
fn usage_of(r: &RunResult) -> serde_json::Value {
    let prompt_tokens = r.n_head_tokens + r.n_context_tokens + r.n_prompt_tokens;
    serde_json::json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": r.tokens.len(),
        "total_tokens": prompt_tokens + r.tokens.len(),
    })
}

fn finish_reason(r: &RunResult) -> &'static str {
    match r.stop {
        StopReason::MaxTokens | StopReason::ContextFull => "length",
        _ => "stop",
    }
}

async fn chat(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    let into_job = |r: ChatRequest| {
        let usage = r.include_usage()?;
        r.into_job().map(|(job, stream, model)| (job, stream, None, (model, usage)))
    };
    let (pending, stream, (model, include_usage)) =
        match st.accept::<ChatRequest, (String, bool)>(&headers, body, into_job).await {
            Ok(x) => x,
            Err(e) => return error_response(&e),
        };
    let id = format!("chatcmpl-{}", st.next_id.fetch_add(1, Ordering::Relaxed));
    let created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    if !stream {
        return match pending.result().await {
            Ok(r) => axum::Json(serde_json::json!({
                "id": id,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [{
                    "index": 0,
                    "message": { "role": "assistant", "content": r.answer },
                    "finish_reason": finish_reason(&r),
                }],
                "usage": usage_of(&r),
                "flowprefill": to_json(&r),
            }))
            .into_response(),
            Err(e) => error_response(&e),
        };
    }
    let (pending, first) = match pending.admitted().await {
        Ok(x) => x,
        Err(e) => return error_response(&e),
    };
    let (usage_id, usage_model) = (id.clone(), model.clone());
    let chunk = move |delta: serde_json::Value, finish: Option<&str>| {
        serde_json::json!({
            "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{ "index": 0, "delta": delta, "finish_reason": finish }],
        })
        .to_string()
    };
    // `stream_options.include_usage`: one more chunk before [DONE], no choices, the counts.
    let usage_chunk = move |r: &RunResult| {
        serde_json::json!({
            "id": usage_id, "object": "chat.completion.chunk", "created": created, "model": usage_model,
            "choices": [], "usage": usage_of(r),
        })
        .to_string()
    };
    let opening = SseEvent::default().data(chunk(serde_json::json!({ "role": "assistant", "content": "" }), None));
    use futures_util::StreamExt;
    let body = pending.events(first).filter_map(move |ev| {
        let data = match ev {
            Event::Admitted => None,
            Event::Text(s) => Some(vec![chunk(serde_json::json!({ "content": s }), None)]),
            Event::Done(r) => {
                let mut last = vec![chunk(serde_json::json!({}), Some(finish_reason(&r)))];
                if include_usage {
                    last.push(usage_chunk(&r));
                }
                last.push("[DONE]".to_string());
                Some(last)
            }
            Event::Failed(e) => {
                metrics::error(e.kind);
                Some(vec![e.body().to_string(), "[DONE]".to_string()])
            }
        };
        async move { data }
    });
    let events = stream::once(async move { opening })
        .chain(body.flat_map(|d| stream::iter(d.into_iter().map(|x| SseEvent::default().data(x)))));
    sse(events)
}

async fn healthz() -> Response {
    axum::Json(serde_json::json!({ "status": "ok" })).into_response()
}

async fn readyz(State(st): State<Arc<AppState>>) -> Response {
    let shutting = st.shutting_down.load(Ordering::Relaxed);
    let mut reason = st.shared.reason.lock().unwrap_or_else(|p| p.into_inner()).clone();
    // Not ready while the device cannot hold even the smallest job (another tenant took it).
    let memory = memory::available(st.lm.model.backend(), st.cfg.memory_limit);
    let starved = memory.as_ref().filter(|m| m.free < st.smallest_job);
    if let (Some(m), None) = (starved, &reason) {
        reason = Some(format!(
            "{} free on {}, below the {} the smallest job needs",
            flowprefill_kernels::gib(m.free),
            m.device,
            flowprefill_kernels::gib(st.smallest_job)
        ));
    }
    if let Some(m) = &memory {
        metrics::memory_free(&m.device, m.free);
    }
    let ready = st.shared.ready.load(Ordering::Relaxed) && !shutting && starved.is_none();
    let body = serde_json::json!({
        "ready": ready,
        "model": st.cfg.model_name,
        "ranks": st.shared.ranks,
        "ranks_up": if st.shared.ready.load(Ordering::Relaxed) { st.shared.ranks } else { 0 },
        "queue_depth": st.shared.depth.load(Ordering::Relaxed),
        "memory_free_bytes": memory.as_ref().map(|m| m.free),
        "reason": if shutting { Some("shutting down".to_string()) } else { reason },
    });
    let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (status, axum::Json(body)).into_response()
}

/// `/metrics`: behind the bearer token when the server has one.
async fn render_metrics(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = st.authorize(&headers) {
        return error_response(&e);
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], metrics::render(&st.prom)).into_response()
}

/// Every route.
pub(super) fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/jobs", post(jobs))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/documents", post(documents))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(render_metrics))
        .with_state(state)
}

/// Only `/metrics` (the separate metrics listener).
pub(super) fn metrics_router(state: Arc<AppState>) -> Router {
    Router::new().route("/metrics", get(render_metrics)).with_state(state)
}
