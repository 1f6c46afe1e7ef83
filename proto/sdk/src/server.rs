//! Serving an [`Agent`]: the gRPC server with health, reflection and graceful shutdown.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use antidote_net::{Cuttable, Listener};
use antidote_proto::agent::v1::backend_server::BackendServer;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio_stream::{Stream, StreamExt as _};
use tokio_util::sync::CancellationToken;
use tonic::transport::server::Connected;

use super::agent::{Agent, AgentService, Backend};

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
    let mut server = tonic::transport::Server::builder()
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
            reason: antidote_proto::agent::v1::ErrorReason::RequestTooLarge.as_str_name(),
        });
    let (router, health) =
        antidote_net::grpc::standard_services(&mut server, &[antidote_proto::FILE_DESCRIPTOR_SET])?;
    health.set_serving::<BackendServer<AgentService<B>>>().await;
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
    let server = router
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

/// How an agent is reached: on its own listener (the scheduler dials it), or over the
/// connections it dials in to the scheduler (no listening socket at all).
pub enum Transport {
    /// Serve on this listener (plaintext or mTLS).
    Listen(Listener),
    /// Dial in, and serve on each connection (see [`super::dial`]).
    #[cfg(feature = "dial-in")]
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
            #[cfg(feature = "dial-in")]
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

#[cfg(feature = "dial-in")]
impl From<super::dial::DialIn> for Transport {
    fn from(dial: super::dial::DialIn) -> Transport {
        Transport::DialIn(dial)
    }
}

/// What [`crate::run`] does once the agent is built, for a binary that builds its own: serves
/// `/metrics` on `metrics` (when given, see [`super::metrics::bind`]), serves the agent on
/// `transport` (a listener, or the connections it dials in) until `shutdown` and at most `grace`
/// after it (how long calls and streams may go on once shutdown began before their connections
/// are cut), then flushes the spans still queued in `telemetry`.
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
        #[cfg(feature = "dial-in")]
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
