//! Serving an [`Agent`]: the gRPC server with health, reflection and graceful shutdown.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_util::sync::CancellationToken;

use crate::agent::v1::backend_server::BackendServer;

use super::agent::{Agent, AgentService, Backend};

/// How long in-flight calls may take to finish after shutdown begins.
pub const GRACE: Duration = Duration::from_secs(10);

/// Serves `agent` on `listener` until `shutdown` completes, then drains for at most [`GRACE`].
///
/// Besides `antidote.agent.v1.Backend` it serves `grpc.health.v1` (SERVING, NOT_SERVING once
/// shutdown begins) and server reflection (v1 and v1alpha). Every accepted connection gets TCP_NODELAY: the
/// protocol's small replies and Watch events must leave at once. W3C trace context in request
/// metadata is recorded on each call's span (see [`super::trace`]).
pub async fn serve<B: Backend>(
    agent: Arc<Agent<B>>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<BackendServer<AgentService<B>>>().await;
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(crate::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let (reflection, reflection_v1alpha) =
        (reflection().build_v1()?, reflection().build_v1alpha()?);
    let incoming = TcpListenerStream::new(listener).map(|stream| {
        let stream = stream?;
        // tonic's own tcp_nodelay does not apply to incoming streams we hand it.
        stream.set_nodelay(true)?;
        Ok::<_, std::io::Error>(stream)
    });
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
    let server = tonic::transport::Server::builder()
        .trace_fn(super::trace::span)
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
    tokio::select! {
        result = server => result?,
        () = async {
            stopping.cancelled().await;
            tokio::time::sleep(GRACE).await;
        } => tracing::warn!(grace = ?GRACE, "calls still running after the grace period; stopping anyway"),
    }
    Ok(())
}

/// What an agent binary does once its backend is built: serves `/metrics` on `metrics` (when
/// given, see [`super::metrics::bind`]), serves the agent on `listener` until `shutdown`, then
/// flushes the spans still queued in `telemetry`.
pub async fn run<B: Backend>(
    agent: Arc<Agent<B>>,
    listener: TcpListener,
    metrics: Option<TcpListener>,
    telemetry: super::trace::Telemetry,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let stop_metrics = CancellationToken::new();
    if let Some(metrics) = metrics {
        super::metrics::spawn(&agent, metrics, stop_metrics.clone());
    }
    let result = serve(agent, listener, shutdown).await;
    stop_metrics.cancel();
    telemetry.shutdown().await;
    result
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
