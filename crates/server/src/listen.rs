//! The accept loop: HTTP/1.1 connections served by hyper with a cap on open connections, a
//! header-read timeout, an idle (keep-alive) timeout, and a graceful shutdown that cuts what
//! is still running after a deadline.
//!
//! Each connection's socket is wrapped to record when bytes last moved and when the head of
//! the next request began to arrive; a watchdog closes the connection when no request is being
//! handled and either the head took longer than the header timeout (a half-sent request,
//! slowloris) or nothing moved for the idle timeout.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{header, Request};
use axum::response::Response;
use futures_util::StreamExt;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;
use tower_service::Service;

/// Connection limits and timeouts.
#[derive(Clone, Debug)]
pub struct ConnLimits {
    /// A request's head must arrive within this long of its first byte.
    pub header_timeout: Duration,
    /// A request's body must arrive within this long of its head; a slower one is answered 408.
    pub body_timeout: Duration,
    /// A connection with no request in flight and no traffic for this long is closed.
    pub idle_timeout: Duration,
    /// Open connections at most; more are answered 503 and closed at once.
    pub max_connections: usize,
    /// After shutdown is asked, requests in flight get this long; then they are cut.
    pub shutdown_timeout: Duration,
}

impl Default for ConnLimits {
    fn default() -> Self {
        ConnLimits {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            max_connections: 512,
            shutdown_timeout: Duration::from_secs(30),
        }
    }
}

/// The answer to a connection over the cap (written once, without waiting, then closed).
const FULL: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
retry-after: 1\r\nconnection: close\r\ncontent-length: 129\r\n\r\n\
{\"error\":{\"message\":\"too many open connections; retry shortly\",\"type\":\"server_error\",\"param\":null,\"code\":\"too_many_connections\"}}";

/// Serves `router` on `listener` until `shutdown` completes, then lets requests in flight
/// finish for at most `limits.shutdown_timeout` and cuts the rest.
pub async fn serve(
    listener: TcpListener,
    router: axum::Router,
    limits: ConnLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut conns = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((stream, _)) => stream,
                    // Out of descriptors or a connection reset before accept: go on shortly.
                    Err(_) => {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                // Tokens are streamed in small writes; don't hold them back (Nagle).
                let _ = stream.set_nodelay(true);
                let Ok(permit) = slots.clone().try_acquire_owned() else {
                    let _ = stream.try_write(FULL);
                    continue;
                };
                let (router, limits, stop) = (router.clone(), limits.clone(), stop_rx.clone());
                conns.spawn(async move {
                    connection(stream, router, &limits, stop).await;
                    drop(permit);
                });
            }
        }
    }
    drop(listener);
    let _ = stop_tx.send(true);
    let drain = async { while conns.join_next().await.is_some() {} };
    if tokio::time::timeout(limits.shutdown_timeout, drain)
        .await
        .is_err()
    {
        conns.abort_all();
    }
    Ok(())
}

/// When a connection last saw traffic and what it is doing, in milliseconds since it opened.
struct Activity {
    opened: Instant,
    last_io: AtomicU64,
    /// When the head of the next request began to arrive, plus one; 0 while none is arriving.
    head_since: AtomicU64,
    /// Requests being handled.
    busy: AtomicUsize,
}

impl Activity {
    fn now(&self) -> u64 {
        self.opened.elapsed().as_millis() as u64
    }

    fn moved(&self, read: bool) {
        let now = self.now();
        self.last_io.store(now, Ordering::Relaxed);
        let idle = self.busy.load(Ordering::Acquire) == 0;
        if read && idle && self.head_since.load(Ordering::Relaxed) == 0 {
            self.head_since.store(now + 1, Ordering::Relaxed);
        }
    }

    /// True when the connection should be closed.
    fn expired(&self, limits: &ConnLimits) -> bool {
        if self.busy.load(Ordering::Acquire) > 0 {
            return false;
        }
        let now = self.now();
        match self.head_since.load(Ordering::Relaxed) {
            0 => {
                now.saturating_sub(self.last_io.load(Ordering::Relaxed))
                    >= millis(limits.idle_timeout)
            }
            since => (now + 1).saturating_sub(since) >= millis(limits.header_timeout),
        }
    }
}

fn millis(d: Duration) -> u64 {
    d.as_millis() as u64
}

/// Marks a request as being handled (its head has arrived) until dropped.
struct Busy(Arc<Activity>);

impl Busy {
    fn new(a: Arc<Activity>) -> Busy {
        a.busy.fetch_add(1, Ordering::AcqRel);
        a.head_since.store(0, Ordering::Relaxed);
        Busy(a)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.moved(false);
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A server-sent event stream keeps its connection busy (never idle) until the stream ends,
/// however long the model takes between events; other replies are written at once.
fn busy_while_streaming(resp: Response, busy: Busy) -> Response {
    let streaming = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    if !streaming {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let mut data = body.into_data_stream();
    let guarded = async_stream::stream! {
        let _busy = busy;
        while let Some(chunk) = data.next().await {
            yield chunk;
        }
    };
    Response::from_parts(parts, Body::from_stream(guarded))
}

/// Why a request body stopped: it did not arrive within the body timeout (the body extractor's
/// rejection carries it as its source; `routes` answers 408).
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within {0:?}")]
pub struct BodyTimeout(pub Duration);

/// `body` as it arrives, ending in a [`BodyTimeout`] error once `limit` has passed.
fn with_deadline(body: Incoming, limit: Duration) -> Body {
    let deadline = tokio::time::Instant::now() + limit;
    let mut data = Body::new(body).into_data_stream();
    Body::from_stream(async_stream::stream! {
        loop {
            match tokio::time::timeout_at(deadline, data.next()).await {
                Ok(Some(chunk)) => yield chunk,
                Ok(None) => break,
                Err(_) => {
                    yield Err(axum::Error::new(BodyTimeout(limit)));
                    break;
                }
            }
        }
    })
}

/// Serves one connection until it ends, expires or is cut at shutdown.
async fn connection(
    stream: TcpStream,
    router: axum::Router,
    limits: &ConnLimits,
    mut stop: watch::Receiver<bool>,
) {
    let act = Arc::new(Activity {
        opened: Instant::now(),
        last_io: AtomicU64::new(0),
        head_since: AtomicU64::new(0),
        busy: AtomicUsize::new(0),
    });
    let io = TokioIo::new(Watched {
        inner: stream,
        act: act.clone(),
    });
    let svc_act = act.clone();
    let body_timeout = limits.body_timeout;
    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
        let mut router = router.clone();
        let busy = Busy::new(svc_act.clone());
        async move {
            let req = req.map(|b| with_deadline(b, body_timeout));
            let resp: Result<_, Infallible> = router.call(req).await;
            resp.map(|r| busy_while_streaming(r, busy))
        }
    });
    let conn = hyper::server::conn::http1::Builder::new().serve_connection(io, svc);
    tokio::pin!(conn);
    let shortest = limits.header_timeout.min(limits.idle_timeout);
    let mut tick = tokio::time::interval((shortest / 4).max(Duration::from_millis(10)));
    let mut stopping = false;
    loop {
        tokio::select! {
            _ = conn.as_mut() => return,
            _ = tick.tick() => if act.expired(limits) { return },
            changed = stop.changed(), if !stopping => {
                stopping = true;
                if changed.is_ok() {
                    conn.as_mut().graceful_shutdown();
                }
            }
        }
    }
}

/// A socket that reports its traffic to [`Activity`].
struct Watched {
    inner: TcpStream,
    act: Arc<Activity>,
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.act.moved(true);
        }
        r
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, data);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.act.moved(false);
        }
        r
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.act.moved(false);
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
