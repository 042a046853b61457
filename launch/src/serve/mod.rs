//! `flowprefill serve`: long-context jobs over HTTP, with Prometheus metrics.
//!
//! ```text
//!   POST /v1/jobs               documents + query + method knobs -> answer and stats (or SSE)
//!   POST /v1/chat/completions   OpenAI-compatible; documents and question in the user message,
//!                               separated by lines of `---`
//!   GET  /healthz               the process answers
//!   GET  /readyz                model loaded and every rank up (503 otherwise)
//!   GET  /metrics               Prometheus text (rank 0 aggregates every rank)
//! ```
//! Loopback by default; a non-loopback address needs `--token` (bearer, compared in constant
//! time) unless `--insecure` is given. A bounded queue answers 429 with Retry-After when full,
//! bodies above `--max-body-bytes` get 413, malformed JSON or fields 400 naming the field,
//! jobs past their deadline 504, a failed rank 503. SIGTERM (or Ctrl-C) stops accepting,
//! finishes every accepted job, stops the ranks and exits. Under `mpirun`, rank 0 serves and
//! the other ranks follow its broadcasts.

pub mod api;
pub mod metrics;
pub mod queue;

use crate::cmd::run::to_json;
use crate::Common;
use anyhow::{Context as _, Result};
use api::{ApiError, ChatRequest, JobRequest};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use flowprefill_coordinator::{Job, RunResult, ThreadRanks};
use metrics_exporter_prometheus::PrometheusHandle;
use queue::{CancelOnDrop, Event, Queue, Queued, Shared, World};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Arguments of `serve`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Address to listen on (port 0 picks a free port, printed at start).
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: String,
    /// Thread ranks (under mpirun every process is one rank instead).
    #[arg(long)]
    pub ranks: Option<usize>,
    /// Bearer token required on the job endpoints.
    #[arg(long, env = "FLOWPREFILL_TOKEN")]
    pub token: Option<String>,
    /// Allow a non-loopback address without a token.
    #[arg(long)]
    pub insecure: bool,
    /// Jobs that may wait in the queue.
    #[arg(long, default_value_t = 16)]
    pub queue: usize,
    /// Largest request body.
    #[arg(long, default_value_t = 8 << 20)]
    pub max_body_bytes: usize,
    /// Longest a job may take, queueing included (a request may ask for less).
    #[arg(long, default_value_t = 900.0)]
    pub job_timeout: f64,
    /// Seconds a rank waits for another before declaring it lost.
    #[arg(long, default_value_t = 120.0)]
    pub comm_timeout: f64,
    /// Also serve /metrics on this address.
    #[arg(long)]
    pub metrics_listen: Option<String>,
}

struct AppState {
    queue: Queue,
    shared: Arc<Shared>,
    token: Option<String>,
    prom: PrometheusHandle,
    job_limit: Duration,
    model: String,
    shutting_down: AtomicBool,
    next_id: AtomicU64,
}

fn error_response(e: &ApiError) -> Response {
    metrics::error(e.kind);
    let mut r = (StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR), axum::Json(e.body()))
        .into_response();
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

impl AppState {
    fn authorize(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let Some(expected) = &self.token else { return Ok(()) };
        let presented = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        if api::token_matches(presented, expected) {
            Ok(())
        } else {
            Err(ApiError::new(401, "unauthorized", "missing or wrong bearer token (Authorization: Bearer <token>)"))
        }
    }

    fn body(&self, body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
        body.map_err(|r| {
            if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::new(413, "too_large", "the request body is larger than the server's --max-body-bytes")
            } else {
                ApiError::bad_request(format!("cannot read the request body: {r}"))
            }
        })
    }

    fn enqueue(
        &self,
        job: Job,
        deadline_s: Option<f64>,
    ) -> Result<(tokio::sync::mpsc::UnboundedReceiver<Event>, CancelOnDrop), ApiError> {
        if self.shutting_down.load(Ordering::Relaxed) {
            return Err(ApiError::new(503, "shutting_down", "the service is shutting down"));
        }
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let q = Queued {
            job,
            accepted: Instant::now(),
            deadline: queue::deadline_of(deadline_s, self.job_limit),
            cancel: cancel.clone(),
            events: tx,
        };
        self.queue.submit(q)?;
        Ok((rx, CancelOnDrop::new(cancel)))
    }
}

/// Waits for a job's result (not streamed).
async fn wait(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    mut guard: CancelOnDrop,
) -> Result<Box<RunResult>, ApiError> {
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Text(_) => {}
            Event::Done(r) => {
                guard.disarm();
                return Ok(r);
            }
            Event::Failed(e) => {
                guard.disarm();
                return Err(e);
            }
        }
    }
    guard.disarm();
    Err(ApiError::new(500, "internal", "the job ended without a result"))
}

async fn jobs(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Response {
    let run = || -> Result<(Job, bool, Option<f64>), ApiError> {
        st.authorize(&headers)?;
        let body = st.body(body)?;
        api::parse::<JobRequest>(&body)?.into_job()
    };
    let (job, stream, deadline) = match run() {
        Ok(x) => x,
        Err(e) => return error_response(&e),
    };
    let (rx, guard) = match st.enqueue(job, deadline) {
        Ok(x) => x,
        Err(e) => return error_response(&e),
    };
    if !stream {
        return match wait(rx, guard).await {
            Ok(r) => axum::Json(to_json(&r)).into_response(),
            Err(e) => error_response(&e),
        };
    }
    let events = futures_util::stream::unfold((rx, guard, false), |(mut rx, mut guard, ended)| async move {
        if ended {
            return None;
        }
        let ev = match rx.recv().await {
            Some(Event::Text(s)) => {
                SseEvent::default().event("token").data(serde_json::json!({ "text": s }).to_string())
            }
            Some(Event::Done(r)) => {
                guard.disarm();
                return Some((
                    Ok::<_, std::convert::Infallible>(SseEvent::default().event("done").data(to_json(&r).to_string())),
                    (rx, guard, true),
                ));
            }
            Some(Event::Failed(e)) => {
                guard.disarm();
                metrics::error(e.kind);
                return Some((Ok(SseEvent::default().event("error").data(e.body().to_string())), (rx, guard, true)));
            }
            None => return None,
        };
        Some((Ok(ev), (rx, guard, false)))
    });
    Sse::new(events).keep_alive(KeepAlive::default()).into_response()
}

fn finish_reason(r: &RunResult) -> &'static str {
    match r.stop {
        flowprefill_worker::generate::StopReason::MaxTokens | flowprefill_worker::generate::StopReason::ContextFull => {
            "length"
        }
        _ => "stop",
    }
}

async fn chat(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Response {
    let run = || -> Result<(Job, bool, String), ApiError> {
        st.authorize(&headers)?;
        let body = st.body(body)?;
        api::parse::<ChatRequest>(&body)?.into_job()
    };
    let (job, stream, model) = match run() {
        Ok(x) => x,
        Err(e) => return error_response(&e),
    };
    let (rx, guard) = match st.enqueue(job, None) {
        Ok(x) => x,
        Err(e) => return error_response(&e),
    };
    let id = format!("chatcmpl-{}", st.next_id.fetch_add(1, Ordering::Relaxed));
    let created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    if !stream {
        return match wait(rx, guard).await {
            Ok(r) => {
                let prompt_tokens = r.n_head_tokens + r.n_context_tokens + r.n_prompt_tokens;
                axum::Json(serde_json::json!({
                    "id": id,
                    "object": "chat.completion",
                    "created": created,
                    "model": model,
                    "choices": [{
                        "index": 0,
                        "message": { "role": "assistant", "content": r.answer },
                        "finish_reason": finish_reason(&r),
                    }],
                    "usage": {
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": r.tokens.len(),
                        "total_tokens": prompt_tokens + r.tokens.len(),
                    },
                    "flowprefill": to_json(&r),
                }))
                .into_response()
            }
            Err(e) => error_response(&e),
        };
    }
    let chunk = move |delta: serde_json::Value, finish: Option<&str>| {
        serde_json::json!({
            "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{ "index": 0, "delta": delta, "finish_reason": finish }],
        })
        .to_string()
    };
    let first = chunk(serde_json::json!({ "role": "assistant", "content": "" }), None);
    let events =
        futures_util::stream::unfold((rx, guard, Some(first), 0u8), move |(mut rx, mut guard, pending, state)| {
            let chunk = chunk.clone();
            async move {
                if let Some(p) = pending {
                    return Some((
                        Ok::<_, std::convert::Infallible>(SseEvent::default().data(p)),
                        (rx, guard, None, state),
                    ));
                }
                match state {
                    0 => {}
                    1 => return Some((Ok(SseEvent::default().data("[DONE]")), (rx, guard, None, 2))),
                    _ => return None,
                }
                match rx.recv().await {
                    Some(Event::Text(s)) => Some((
                        Ok(SseEvent::default().data(chunk(serde_json::json!({ "content": s }), None))),
                        (rx, guard, None, 0),
                    )),
                    Some(Event::Done(r)) => {
                        guard.disarm();
                        Some((
                            Ok(SseEvent::default().data(chunk(serde_json::json!({}), Some(finish_reason(&r))))),
                            (rx, guard, None, 1),
                        ))
                    }
                    Some(Event::Failed(e)) => {
                        guard.disarm();
                        metrics::error(e.kind);
                        Some((Ok(SseEvent::default().data(e.body().to_string())), (rx, guard, None, 1)))
                    }
                    None => None,
                }
            }
        });
    Sse::new(events).keep_alive(KeepAlive::default()).into_response()
}

async fn healthz() -> Response {
    axum::Json(serde_json::json!({ "status": "ok" })).into_response()
}

async fn readyz(State(st): State<Arc<AppState>>) -> Response {
    let ready = st.shared.ready.load(Ordering::Relaxed) && !st.shutting_down.load(Ordering::Relaxed);
    let reason = st.shared.reason.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let body = serde_json::json!({
        "ready": ready,
        "model": st.model,
        "ranks": st.shared.ranks,
        "queue_depth": st.shared.depth.load(Ordering::Relaxed),
        "reason": if st.shutting_down.load(Ordering::Relaxed) { Some("shutting down".to_string()) } else { reason },
    });
    let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (status, axum::Json(body)).into_response()
}

async fn render_metrics(State(st): State<Arc<AppState>>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], st.prom.render()).into_response()
}

fn is_loopback(addr: &SocketAddr) -> bool {
    addr.ip().is_loopback()
}

/// Runs the command.
pub fn run(common: &Common, a: Args) -> Result<()> {
    let addr: SocketAddr =
        a.listen.parse().with_context(|| format!("--listen {}: expected IP:PORT, e.g. 127.0.0.1:8080", a.listen))?;
    anyhow::ensure!(
        is_loopback(&addr) || a.token.is_some() || a.insecure,
        "refusing to serve on non-loopback address {addr} without --token (pass --insecure to allow it)"
    );
    anyhow::ensure!(a.queue >= 1, "--queue must be at least 1");
    anyhow::ensure!(a.job_timeout > 0.0 && a.comm_timeout > 0.0, "--job-timeout and --comm-timeout must be positive");
    let comm_timeout = Duration::from_secs_f64(a.comm_timeout);
    let lm = Arc::new(crate::cmd::load_model(common)?);
    let model = crate::cmd::model_path(common)?
        .file_name()
        .map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned());

    #[cfg(feature = "mpi")]
    let world = if flowprefill_comm::mpi::launched_by_mpirun() {
        use flowprefill_comm::Communicator;
        anyhow::ensure!(
            a.ranks.is_none_or(|r| r == 1),
            "--ranks is for thread ranks; under mpirun every process is one rank"
        );
        let mut comm = flowprefill_comm::mpi::MpiComm::init()?;
        comm.set_timeout(comm_timeout);
        let engine = flowprefill_coordinator::Engine::new(lm.clone(), flowprefill_coordinator::DEFAULT_STORE_BYTES);
        if comm.rank() != 0 {
            // Followers run rank 0's jobs until it stops them.
            let n = engine.follow(&mut comm)?;
            eprintln!("rank {}: stopped after {n} jobs", comm.rank());
            return Ok(());
        }
        World::Mpi { comm, engine }
    } else {
        World::Threads(ThreadRanks::new(
            lm.clone(),
            a.ranks.unwrap_or(1),
            flowprefill_coordinator::DEFAULT_STORE_BYTES,
            comm_timeout,
        )?)
    };
    #[cfg(not(feature = "mpi"))]
    let world = World::Threads(ThreadRanks::new(
        lm.clone(),
        a.ranks.unwrap_or(1),
        flowprefill_coordinator::DEFAULT_STORE_BYTES,
        comm_timeout,
    )?);

    let prom = metrics::install()?;
    let (queue, shared, worker) = Queue::start(world, a.queue);
    let state = Arc::new(AppState {
        queue,
        shared: shared.clone(),
        token: a.token.clone(),
        prom: prom.clone(),
        job_limit: Duration::from_secs_f64(a.job_timeout),
        model,
        shutting_down: AtomicBool::new(false),
        next_id: AtomicU64::new(1),
    });
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let served = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| {
            format!("cannot listen on {addr} (is the port in use? pass another --listen, or port 0 for a free one)")
        })?;
        let local = listener.local_addr()?;
        println!("flowprefill serving on http://{local} ({} rank(s), queue {})", shared.ranks, a.queue);
        let app = Router::new()
            .route("/v1/jobs", post(jobs))
            .route("/v1/chat/completions", post(chat))
            .route("/healthz", get(healthz))
            .route("/readyz", get(readyz))
            .route("/metrics", get(render_metrics))
            .layer(DefaultBodyLimit::max(a.max_body_bytes))
            .with_state(state.clone());
        if let Some(m) = &a.metrics_listen {
            let maddr: SocketAddr = m.parse().with_context(|| format!("--metrics-listen {m}"))?;
            let ml = tokio::net::TcpListener::bind(maddr)
                .await
                .with_context(|| format!("cannot listen on {maddr} for metrics"))?;
            println!("metrics on http://{}/metrics", ml.local_addr()?);
            let mapp = Router::new().route("/metrics", get(render_metrics)).with_state(state.clone());
            tokio::spawn(async move {
                let _ = axum::serve(ml, mapp).await;
            });
        }
        let upkeep = prom.clone();
        tokio::spawn(async move {
            let mut t = tokio::time::interval(Duration::from_secs(5));
            loop {
                t.tick().await;
                upkeep.run_upkeep();
            }
        });
        let st = state.clone();
        let shutdown = async move {
            let term = async {
                #[cfg(unix)]
                if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                    s.recv().await;
                    return;
                }
                std::future::pending::<()>().await
            };
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {},
                _ = term => {},
                _ = st.shared.fatal.notified() => eprintln!("a rank failed and the world cannot be rebuilt"),
            }
            st.shutting_down.store(true, Ordering::Relaxed);
            eprintln!("shutting down: finishing {} queued job(s)", st.shared.depth.load(Ordering::Relaxed));
        };
        axum::serve(listener, app).with_graceful_shutdown(shutdown).await?;
        anyhow::Ok(())
    });
    let ready = shared.ready.load(Ordering::Relaxed);
    // Background tasks (metrics listener, upkeep) hold the state: stop them first.
    rt.shutdown_timeout(Duration::from_secs(5));
    drop(state);
    // The queue's last sender is gone: the worker drains, stops the ranks and ends.
    let _ = worker.join();
    served?;
    anyhow::ensure!(ready, "stopped after a rank failure");
    eprintln!("stopped");
    Ok(())
}
