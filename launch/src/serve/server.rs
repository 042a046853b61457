//! The accept loop: HTTP/1.1 connections with a header deadline, a bound on open
//! connections, and a graceful shutdown that waits for accepted jobs but not for slow clients.
//!
//! ```text
//!   accept ── connections >= max?  drop it (the client retries)
//!      └──── http1 (headers within read_timeout) ── router
//!   shutdown (signal, or the world failed for good):
//!      still accepting, but new jobs get 503 and /readyz 503 (/metrics and /healthz answer)
//!      ─ every job and ingestion accepted so far finishes ─ stop accepting ─ open
//!      connections get `grace` to write their answers ─ the rest are closed
//! ```

use super::queue::Shared;
use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// How connections are handled.
#[derive(Clone, Copy, Debug)]
pub struct ConnLimits {
    /// Time a client has to send the request headers.
    pub header_timeout: Duration,
    /// Connections open at once; more are closed at accept.
    pub max_connections: usize,
    /// After the last accepted job finished, how long open connections may still take.
    pub grace: Duration,
}

/// Accepts one connection of `listener` and serves `app` on it in a task of its own, with the
/// header deadline and within the bound on open connections (`open`); `graceful` watches it.
async fn accept_one(
    listener: &TcpListener,
    app: &Router,
    open: &Arc<Semaphore>,
    limits: ConnLimits,
    graceful: &GracefulShutdown,
) {
    let stream = match listener.accept().await {
        Ok((s, _)) => s,
        Err(e) => {
            // Out of file descriptors and the like: back off instead of spinning.
            tracing::warn!(error = %e, "accept failed");
            tokio::time::sleep(Duration::from_millis(50)).await;
            return;
        }
    };
    let Ok(permit) = open.clone().try_acquire_owned() else {
        tracing::warn!(max = limits.max_connections, "too many open connections; closing a new one");
        return;
    };
    let conn = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
    let conn = graceful.watch(conn);
    tokio::spawn(async move {
        let _ = conn.await;
        drop(permit);
    });
}

/// Serves `app` on `listener` until `shutdown` completes or the world of ranks fails for good
/// (`shared.fatal`); then drains as described in the module docs. `on_stop` runs when
/// the shutdown begins (it flips the service to "shutting down": new work gets 503).
pub async fn run(
    listener: TcpListener,
    app: Router,
    shared: Arc<Shared>,
    limits: ConnLimits,
    shutdown: impl Future<Output = ()>,
    on_stop: impl FnOnce(),
) {
    let graceful = GracefulShutdown::new();
    let open = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    tokio::pin!(shutdown);
    let sh = &shared;
    let fatal = move || async move {
        while !sh.fatal.load(Ordering::Relaxed) {
            let changed = sh.changed.notified();
            if sh.fatal.load(Ordering::Relaxed) {
                break;
            }
            changed.await;
        }
    };
    loop {
        tokio::select! {
            () = accept_one(&listener, &app, &open, limits, &graceful) => {}
            _ = &mut shutdown => break,
            _ = fatal() => {
                crate::say!("a rank failed and the world cannot be rebuilt: stopping");
                break;
            }
        }
    }
    on_stop();
    crate::say!(
        "shutting down: finishing {} accepted job(s) (a second Ctrl-C or SIGTERM stops at once)",
        shared.outstanding.load(Ordering::Relaxed)
    );
    // Accepted jobs finish (each is bounded by its deadline, and a stuck one by the watchdog).
    // Meanwhile the port still answers: a new job gets 503 (shutting down), /readyz 503, and
    // /metrics shows the drain.
    let drained = async {
        while shared.outstanding.load(Ordering::SeqCst) > 0 && !shared.fatal.load(Ordering::Relaxed) {
            let changed = shared.changed.notified();
            if shared.outstanding.load(Ordering::Relaxed) == 0 {
                break;
            }
            let _ = tokio::time::timeout(Duration::from_millis(200), changed).await;
        }
    };
    tokio::pin!(drained);
    loop {
        tokio::select! {
            () = &mut drained => break,
            () = accept_one(&listener, &app, &open, limits, &graceful) => {}
        }
    }
    drop(listener);
    // Then connections get a bounded time to write their answers; slow clients are cut off.
    if tokio::time::timeout(limits.grace, graceful.shutdown()).await.is_err() {
        crate::say!("closing connections still open after {:.0} s", limits.grace.as_secs_f64());
    }
}

/// Serves `app` on `listener` (the metrics' own address) with the same header deadline and
/// bound on open connections, until the runtime stops.
pub async fn run_plain(listener: TcpListener, app: Router, limits: ConnLimits) {
    let open = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    // Never shut down: the connections end with the runtime.
    let graceful = GracefulShutdown::new();
    loop {
        accept_one(&listener, &app, &open, limits, &graceful).await;
    }
}
