//! Serving an [`Agent`]: the gRPC server with health, reflection and graceful shutdown.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_stream::wrappers::TcpListenerStream;
use tokio_stream::{Stream, StreamExt as _};
use tokio_util::sync::CancellationToken;
use tonic::transport::server::{Connected, TcpConnectInfo};

use crate::agent::v1::backend_server::BackendServer;

use super::agent::{Agent, AgentService, Backend};
use super::tls::ServerTls;

/// How long in-flight calls and open streams may go on after shutdown begins, by default.
pub const GRACE: Duration = Duration::from_secs(10);

/// Serves `agent` on `listener` until `shutdown` completes, then drains for at most [`GRACE`]:
/// calls and streams still open then (a health Watch, a reflection stream) are cut with their
/// connections.
///
/// Besides `antidote.agent.v1.Backend` it serves `grpc.health.v1` (SERVING, NOT_SERVING once
/// shutdown begins) and server reflection (v1 and v1alpha). Every accepted connection gets TCP_NODELAY: the
/// protocol's small replies and Watch events must leave at once. W3C trace context in request
/// metadata is recorded on each call's span (see [`super::trace`]).
///
/// `listener` is a bound [`TcpListener`] (plaintext) or a [`Listener`] (plaintext or mTLS, see
/// [`super::tls::TlsArgs::listener`]). With TLS, each accepted connection's handshake runs in
/// its own task (a slow or refused client never holds up others); a refused client is logged
/// and dropped before tonic sees a byte of it, so no RPC runs.
pub async fn serve<B: Backend>(
    agent: Arc<Agent<B>>,
    listener: impl Into<Listener>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    serve_with_grace(agent, listener, shutdown, GRACE).await
}

/// [`serve`] with its own grace: how long calls and streams may go on once shutdown began
/// before their connections are cut.
pub async fn serve_with_grace<B: Backend>(
    agent: Arc<Agent<B>>,
    listener: impl Into<Listener>,
    shutdown: impl Future<Output = ()> + Send + 'static,
    grace: Duration,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let stop_accepting = CancellationToken::new();
    let _stop_accepting = stop_accepting.clone().drop_guard();
    let incoming = listener.into().incoming(stop_accepting);
    serve_incoming(agent, incoming, shutdown, grace).await
}

/// [`serve`] on any stream of connections: a listener's, or the connections an agent dialled
/// in (`super::dial`: one per scheduler replica), all served at once by the same server.
pub(super) async fn serve_incoming<B, IO>(
    agent: Arc<Agent<B>>,
    incoming: impl Stream<Item = Result<IO, std::io::Error>> + Send + 'static,
    shutdown: impl Future<Output = ()> + Send + 'static,
    grace: Duration,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>>
where
    B: Backend,
    IO: AsyncRead + AsyncWrite + Connected + Unpin + Send + 'static,
{
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<BackendServer<AgentService<B>>>().await;
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(crate::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let (reflection, reflection_v1alpha) =
        (reflection().build_v1()?, reflection().build_v1alpha()?);
    let stopping = CancellationToken::new();
    let book = agent.book().clone();
    let on_shutdown = {
        let stopping = stopping.clone();
        async move {
            shutdown.await;
            tracing::info!("shutting down");
            health
                .set_not_serving::<BackendServer<AgentService<B>>>()
                .await;
            // Watch streams never end on their own; end them so the server can drain.
            book.close();
            stopping.cancel();
        }
    };
    // Cancelled after the grace: every connection still open is cut.
    let cut = CancellationToken::new();
    let incoming = {
        let cut = cut.clone();
        incoming.map(move |io| io.map(|io| Cuttable::new(io, &cut)))
    };
    let server = tonic::transport::Server::builder()
        // Pings find a dead caller; a dialled-in agent needs them to notice a scheduler gone
        // without a FIN and dial again.
        .http2_keepalive_interval(Some(Duration::from_secs(20)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .trace_fn(super::trace::span)
        // The caller's trace context, current while the call runs (kept when spans are not
        // exported: see `trace`).
        .layer(super::trace::PassContext)
        // Oversized requests are RESOURCE_EXHAUSTED (tonic says OUT_OF_RANGE).
        .layer(super::errors::RequestTooLarge {
            reason: crate::agent::v1::ErrorReason::RequestTooLarge.as_str_name(),
        })
        .add_service(health_service)
        // Both reflection versions: grpcio-reflection and older grpcurl know only v1alpha.
        .add_service(reflection)
        .add_service(reflection_v1alpha)
        .add_service(BackendServer::new(agent.service()))
        .serve_with_incoming_shutdown(incoming, on_shutdown);
    tokio::pin!(server);
    tokio::select! {
        result = &mut server => result?,
        () = async {
            stopping.cancelled().await;
            tokio::time::sleep(grace).await;
        } => {
            tracing::warn!(?grace, "calls still running after the grace period; cutting their connections");
            cut.cancel();
            // Every connection ends now, so the server finishes draining at once; it is not
            // waited for beyond a moment.
            let _ = tokio::time::timeout(Duration::from_secs(1), &mut server).await;
        }
    }
    Ok(())
}

/// A connection that can be cut: once its token is cancelled, reads end (EOF) and writes fail,
/// so the HTTP/2 server drops it with every call and stream on it. Servers wrap each accepted
/// connection in one to bound their shutdown (a health Watch or a reflection stream never ends
/// by itself).
pub struct Cuttable<IO> {
    io: IO,
    cut: Pin<Box<tokio_util::sync::WaitForCancellationFutureOwned>>,
}

impl<IO> Cuttable<IO> {
    /// Wraps `io`, cut when `cut` is cancelled.
    pub fn new(io: IO, cut: &CancellationToken) -> Cuttable<IO> {
        Cuttable {
            io,
            cut: Box::pin(cut.clone().cancelled_owned()),
        }
    }

    /// Whether the connection is cut; registers the task to be woken when it is.
    fn is_cut(&mut self, cx: &mut Context<'_>) -> bool {
        self.cut.as_mut().poll(cx).is_ready()
    }
}

fn cut_error() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::ConnectionAborted,
        "connection cut at the end of the shutdown grace",
    )
}

impl<IO: AsyncRead + Unpin> AsyncRead for Cuttable<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.is_cut(cx) {
            // End of stream.
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Cuttable<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if self.is_cut(cx) {
            return Poll::Ready(Err(cut_error()));
        }
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if self.is_cut(cx) {
            return Poll::Ready(Err(cut_error()));
        }
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl<IO: Connected> Connected for Cuttable<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

/// How an agent is reached: on its own listener (the scheduler dials it), or over the
/// connections it dials in to the scheduler (no listening socket at all).
pub enum Transport {
    /// Serve on this listener (plaintext or mTLS).
    Listen(Listener),
    /// Dial in, and serve on each connection (see [`super::dial`]).
    DialIn(super::dial::DialIn),
}

impl Transport {
    /// The line an agent prints once it is about to serve, which scripts and tests wait for:
    /// `listening on ADDR` (the bound address, port 0 resolved), or `dialling in to HOST:PORT`
    /// when it listens on nothing: one such line per `--connect` URL, in the order given.
    pub fn announce(&self) -> String {
        match self {
            Transport::Listen(listener) => match listener.local_addr() {
                Ok(addr) => format!("listening on {addr}"),
                Err(err) => format!("listening on an unknown address: {err}"),
            },
            Transport::DialIn(dial) => dial
                .authorities()
                .iter()
                .map(|authority| format!("dialling in to {authority}"))
                .collect::<Vec<_>>()
                .join("\n"),
        }
    }
}

impl From<TcpListener> for Transport {
    fn from(listener: TcpListener) -> Transport {
        Transport::Listen(listener.into())
    }
}

impl From<Listener> for Transport {
    fn from(listener: Listener) -> Transport {
        Transport::Listen(listener)
    }
}

impl From<super::dial::DialIn> for Transport {
    fn from(dial: super::dial::DialIn) -> Transport {
        Transport::DialIn(dial)
    }
}

/// What an agent binary does once its backend is built: serves `/metrics` on `metrics` (when
/// given, see [`super::metrics::bind`]), serves the agent on `transport` (a listener, or the
/// connections it dials in) until `shutdown` and at most [`GRACE`] after it, then flushes the
/// spans still queued in `telemetry`.
pub async fn run<B: Backend>(
    agent: Arc<Agent<B>>,
    transport: impl Into<Transport>,
    metrics: Option<TcpListener>,
    telemetry: super::trace::Telemetry,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    run_with_grace(agent, transport, metrics, telemetry, shutdown, GRACE).await
}

/// [`run`] with its own shutdown grace: how long calls and streams may go on once shutdown
/// began before their connections are cut.
pub async fn run_with_grace<B: Backend>(
    agent: Arc<Agent<B>>,
    transport: impl Into<Transport>,
    metrics: Option<TcpListener>,
    telemetry: super::trace::Telemetry,
    shutdown: impl Future<Output = ()> + Send + 'static,
    grace: Duration,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let stop_metrics = CancellationToken::new();
    if let Some(metrics) = metrics {
        super::metrics::spawn(&agent, metrics, stop_metrics.clone());
    }
    let result = match transport.into() {
        Transport::Listen(listener) => serve_with_grace(agent, listener, shutdown, grace).await,
        Transport::DialIn(dial) => {
            // Dialling stops when shutdown begins: no new connection while the server drains.
            let stop_dialling = CancellationToken::new();
            let links = dial.links(stop_dialling.clone());
            let shutdown = async move {
                shutdown.await;
                stop_dialling.cancel();
            };
            serve_incoming(agent, links, shutdown, grace).await
        }
    };
    stop_metrics.cancel();
    telemetry.shutdown().await;
    result
}

/// Where an agent serves: a bound socket, plaintext or mTLS.
pub struct Listener {
    tcp: TcpListener,
    tls: Option<Arc<ServerTls>>,
}

impl Listener {
    /// Plaintext (loopback, or a mesh doing mTLS: see [`super::tls::TlsArgs::listener`]).
    pub fn plain(tcp: TcpListener) -> Listener {
        Listener { tcp, tls: None }
    }

    /// mTLS: every connection's handshake must pass `tls` before it reaches the server.
    pub fn tls(tcp: TcpListener, tls: ServerTls) -> Listener {
        Listener {
            tcp,
            tls: Some(Arc::new(tls)),
        }
    }

    /// The bound address.
    pub fn local_addr(&self) -> std::io::Result<std::net::SocketAddr> {
        self.tcp.local_addr()
    }

    /// Accepted connections (handshaken, with TLS), until `stop`.
    fn incoming(
        self,
        stop: CancellationToken,
    ) -> Pin<Box<dyn Stream<Item = std::io::Result<Conn>> + Send>> {
        let Some(tls) = self.tls else {
            return Box::pin(TcpListenerStream::new(self.tcp).map(|stream| {
                let stream = stream?;
                // tonic's own tcp_nodelay does not apply to incoming streams we hand it.
                stream.set_nodelay(true)?;
                Ok(Conn::Plain(stream))
            }));
        };
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let tcp = self.tcp;
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    () = stop.cancelled() => return,
                    accepted = tcp.accept() => accepted,
                };
                let (stream, peer) = match accepted {
                    Ok(accepted) => accepted,
                    Err(err) => {
                        // Out of descriptors and the like: pause rather than spin.
                        tracing::warn!(error = %err, "accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                // The protocol's small replies and Watch events must leave at once.
                let _ = stream.set_nodelay(true);
                let (tls, tx) = (tls.clone(), tx.clone());
                tokio::spawn(async move {
                    match tls.accept(stream).await {
                        Ok(stream) => {
                            let _ = tx.send(Ok(Conn::Tls(Box::new(stream)))).await;
                        }
                        Err(err) => {
                            tracing::warn!(peer = %peer, error = %err, "refused a connection");
                        }
                    }
                });
            }
        });
        Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
    }
}

impl From<TcpListener> for Listener {
    fn from(tcp: TcpListener) -> Listener {
        Listener::plain(tcp)
    }
}

/// One accepted connection.
enum Conn {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

impl Connected for Conn {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        match self {
            Conn::Plain(tcp) => tcp.connect_info(),
            Conn::Tls(tls) => tls.get_ref().0.connect_info(),
        }
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_flush(cx),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Conn::Plain(s) => s.is_write_vectored(),
            Conn::Tls(s) => s.is_write_vectored(),
        }
    }
}

/// A future that completes on SIGTERM or SIGINT (ctrl-c).
///
/// The handlers are installed when this is called, not when the future is first polled: call it
/// before announcing readiness (printing `listening on`), so that a supervisor's SIGTERM sent
/// right after that line is never missed and never kills the process with the default action.
///
/// # Panics
///
/// Outside a Tokio runtime.
pub fn shutdown_signal() -> impl Future<Output = ()> + Send + 'static {
    use tokio::signal::unix::{SignalKind, signal};
    let term = signal(SignalKind::terminate());
    let interrupt = signal(SignalKind::interrupt());
    async move {
        match (term, interrupt) {
            (Ok(mut term), Ok(mut interrupt)) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = interrupt.recv() => {}
                }
            }
            (Ok(mut one), Err(_)) | (Err(_), Ok(mut one)) => {
                one.recv().await;
            }
            (Err(_), Err(_)) => std::future::pending().await,
        }
    }
}

/// A request body that must arrive whole within a deadline set when its headers did (the
/// slow-body guard: a client that completes its headers and then drips the body would hold a
/// request, and the connection, open for as long as it likes). Past the deadline the body
/// yields [`BodyTimedOut`], and so the request fails as the server reads it; a body that ended
/// in time is never touched.
pub struct BodyDeadline<B> {
    inner: B,
    /// Fires at the deadline; `None` once the body ended or timed out.
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    /// The bound, for the error.
    within: Duration,
    /// Whether [`BodyTimedOut`] was yielded: the body then ends.
    timed_out: bool,
}

impl<B: hyper::body::Body> BodyDeadline<B> {
    /// `inner`, due whole within `within` from now.
    pub fn new(inner: B, within: Duration) -> BodyDeadline<B> {
        // A body that is already complete (a GET's) needs no timer.
        let deadline = (!inner.is_end_stream()).then(|| Box::pin(tokio::time::sleep(within)));
        BodyDeadline {
            inner,
            deadline,
            within,
            timed_out: false,
        }
    }
}

/// A request body that did not arrive whole within its [`BodyDeadline`].
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("the request body did not arrive within {0:?}")]
pub struct BodyTimedOut(pub Duration);

impl BodyTimedOut {
    /// The [`BodyTimedOut`] somewhere in `err`'s chain of sources, if any (axum, hyper and
    /// the proxy's client wrap it).
    pub fn within(err: &(dyn std::error::Error + 'static)) -> Option<BodyTimedOut> {
        let mut cause = Some(err);
        while let Some(err) = cause {
            if let Some(timed_out) = err.downcast_ref::<BodyTimedOut>() {
                return Some(*timed_out);
            }
            cause = err.source();
        }
        None
    }
}

impl<B> hyper::body::Body for BodyDeadline<B>
where
    B: hyper::body::Body + Unpin,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Data = B::Data;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        if this.timed_out {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(None) => {
                this.deadline = None;
                Poll::Ready(None)
            }
            Poll::Ready(Some(frame)) => {
                if this.inner.is_end_stream() {
                    this.deadline = None;
                }
                Poll::Ready(Some(frame.map_err(Into::into)))
            }
            Poll::Pending => {
                let due = this
                    .deadline
                    .as_mut()
                    .is_some_and(|deadline| deadline.as_mut().poll(cx).is_ready());
                if !due {
                    return Poll::Pending;
                }
                this.deadline = None;
                this.timed_out = true;
                Poll::Ready(Some(Err(Box::new(BodyTimedOut(this.within)))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.timed_out || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt as _;

    #[tokio::test]
    async fn a_body_must_arrive_whole_before_its_deadline() {
        let within = Duration::from_millis(200);
        // A whole body in time passes untouched.
        let whole = http_body_util::Full::new(bytes::Bytes::from_static(b"{}"));
        let collected = BodyDeadline::new(whole, within).collect().await.unwrap();
        assert_eq!(collected.to_bytes(), "{}");
        // A body whose sender dawdles past the deadline fails with BodyTimedOut.
        let first = futures::stream::once(async {
            Ok::<_, std::convert::Infallible>(hyper::body::Frame::data(bytes::Bytes::from_static(
                b"{",
            )))
        });
        // The rest would come a minute later: far past the deadline.
        let rest = futures::stream::once(async {
            tokio::time::sleep(Duration::from_secs(60)).await;
            Ok(hyper::body::Frame::data(bytes::Bytes::from_static(b"}")))
        });
        let dawdling = futures::StreamExt::chain(first, rest);
        let body = http_body_util::StreamBody::new(Box::pin(dawdling));
        let err = BodyDeadline::new(body, within).collect().await.unwrap_err();
        let timed_out = BodyTimedOut::within(&*err).expect("BodyTimedOut in the chain");
        assert_eq!(timed_out.0, within);
    }
}
