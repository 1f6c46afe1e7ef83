//! Antidote's scheduler: it loads the lesson catalog, keeps sessions and live lessons in a
//! durable store, drives backend agents toward the desired state, reaps what is idle, and serves
//! the public gRPC API.
//!
//! Modules:
//! - [`catalog`], the YAML curriculum, strictly validated.
//! - [`model`], domain types (ids, statuses, sessions, live lessons).
//! - [`store`], SQLite persistence through sqlx.
//! - [`reconcile`], the work queue and workers that drive agents.
//! - [`fleet`], connections to agents, handshakes, Watch streams.
//! - [`placement`], which agent takes a live lesson.
//! - [`reaper`], TTL expiry and orphan collection.
//! - [`hub`], fan-out of changes to API watchers.
//! - [`server`], the `antidote.api.v1` services.
//! - [`http`], the same API as JSON over HTTP, server-sent events, OpenAPI, `/metrics`.
//! - [`metrics`], Prometheus metrics.
//! - [`wire`], protobuf ↔ domain conversions.
//! - [`settings`], configuration.
//! - [`error`], the error type and its gRPC codes.
#![forbid(unsafe_code)]

pub mod catalog;
pub mod error;
pub mod fleet;
pub mod http;
pub mod hub;
pub mod metrics;
pub mod model;
pub mod placement;
pub mod reaper;
pub mod reconcile;
pub mod server;
pub mod settings;
pub mod store;
pub mod wire;

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::catalog::Catalog;
use crate::fleet::{Fleet, SupervisorContext};
use crate::hub::Hub;
use crate::metrics::Metrics;
use crate::reaper::Reaper;
use crate::reconcile::Reconciler;
use crate::server::Api;
use crate::settings::Config;
use crate::store::Store;

/// Largest request the public API decodes: every request is a few ids and slugs.
const MAX_REQUEST_BYTES: usize = 64 * 1024;

/// How long in-flight work gets to finish after shutdown is asked for.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// The bound listeners.
pub struct Listeners {
    /// The gRPC API.
    pub grpc: TcpListener,
    /// The HTTP API (JSON, events, OpenAPI, metrics), unless turned off.
    pub http: Option<TcpListener>,
}

/// Runs the scheduler on bound listeners until `shutdown` is cancelled. The binary only parses
/// flags, binds and wires the signal.
pub async fn run(
    config: Config,
    catalog: Catalog,
    listeners: Listeners,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let listener = listeners.grpc;
    let config = Arc::new(config);
    let catalog = Arc::new(catalog);
    let store = Store::open(&config.database).await?;
    let metrics = Arc::new(Metrics::default());
    let fleet = Arc::new(Fleet::new(
        &config.agents,
        &config.reconciler,
        metrics.clone(),
    )?);
    let hub = Arc::new(Hub::default());
    let tracker = TaskTracker::new();

    let reconciler = Reconciler::new(
        store.clone(),
        catalog.clone(),
        fleet.clone(),
        hub.clone(),
        config.reconciler.clone(),
        config.instance_id.clone(),
        metrics.clone(),
    );
    let (fleet_tx, fleet_rx) = tokio::sync::mpsc::unbounded_channel();
    fleet.spawn_supervisors(
        &tracker,
        SupervisorContext {
            store: store.clone(),
            instance_id: config.instance_id.clone(),
            events: fleet_tx,
            shutdown: shutdown.clone(),
            backoff: (
                config.reconciler.backoff_initial,
                config.reconciler.backoff_max,
            ),
        },
    );
    reconciler
        .start(&tracker, shutdown.clone(), fleet_rx)
        .await?;
    let reaper = Reaper {
        store: store.clone(),
        reconciler: reconciler.clone(),
        hub: hub.clone(),
        fleet: fleet.clone(),
        ttl: config.ttl.clone(),
        config: config.reaper.clone(),
        instance_id: config.instance_id.clone(),
        metrics: metrics.clone(),
    };
    tracker.spawn(reaper.run(shutdown.clone()));

    let api = Api {
        store: store.clone(),
        catalog,
        reconciler,
        hub,
        fleet,
        config: config.clone(),
        shutdown: shutdown.clone(),
        metrics,
    };
    if let Some(listener) = listeners.http {
        tracing::info!(address = %listener.local_addr()?, "serving JSON/HTTP, /openapi.json and /metrics");
        let (api, config, shutdown) = (api.clone(), config.clone(), shutdown.clone());
        tracker.spawn(async move {
            if let Err(err) = http::serve(api, &config.http, listener, shutdown).await {
                tracing::error!(error = %err, "HTTP server stopped");
            }
        });
    }
    let (health, health_service) = tonic_health::server::health_reporter();
    for service in [
        "antidote.api.v1.CurriculumService",
        "antidote.api.v1.SessionService",
        "antidote.api.v1.LiveLessonService",
        "antidote.api.v1.AdminService",
        "",
    ] {
        health
            .set_service_status(service, tonic_health::ServingStatus::Serving)
            .await;
    }
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(antidote_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;

    tracing::info!(address = %listener.local_addr()?, "serving antidote.api.v1");
    // Every small API message must leave at once: without TCP_NODELAY, Nagle's algorithm and
    // delayed ACKs hold streamed updates back by ~40 ms. (`Server::tcp_nodelay` only applies to
    // listeners tonic binds itself.)
    let incoming = TcpListenerStream::new(listener).map(|stream| {
        let stream = stream?;
        stream.set_nodelay(true)?;
        Ok::<_, std::io::Error>(stream)
    });
    let serve_shutdown = shutdown.clone();
    tonic::transport::Server::builder()
        // A span per call, child of the caller's W3C trace context.
        .trace_fn(antidote_proto::sdk::trace::span)
        // Serve the API's streams and the many small calls of many learners on few connections.
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .add_service(health_service)
        .add_service(reflection)
        .add_service(api::v1_curriculum(api.clone()).max_decoding_message_size(MAX_REQUEST_BYTES))
        .add_service(api::v1_sessions(api.clone()).max_decoding_message_size(MAX_REQUEST_BYTES))
        .add_service(api::v1_live_lessons(api.clone()).max_decoding_message_size(MAX_REQUEST_BYTES))
        .add_service(api::v1_admin(api).max_decoding_message_size(MAX_REQUEST_BYTES))
        .serve_with_incoming_shutdown(incoming, serve_shutdown.cancelled_owned())
        .await?;

    tracing::info!("API stopped; waiting for background work");
    shutdown.cancel();
    tracker.close();
    if tokio::time::timeout(SHUTDOWN_GRACE, tracker.wait())
        .await
        .is_err()
    {
        tracing::warn!("background work did not stop within {SHUTDOWN_GRACE:?}");
    }
    store.close().await;
    Ok(())
}

/// Service constructors, so `run` reads as one list.
mod api {
    pub use antidote_proto::api::v1::admin_service_server::AdminServiceServer;
    pub use antidote_proto::api::v1::curriculum_service_server::CurriculumServiceServer;
    pub use antidote_proto::api::v1::live_lesson_service_server::LiveLessonServiceServer;
    pub use antidote_proto::api::v1::session_service_server::SessionServiceServer;

    use crate::server::Api;

    pub fn v1_curriculum(api: Api) -> CurriculumServiceServer<Api> {
        CurriculumServiceServer::new(api)
    }
    pub fn v1_sessions(api: Api) -> SessionServiceServer<Api> {
        SessionServiceServer::new(api)
    }
    pub fn v1_live_lessons(api: Api) -> LiveLessonServiceServer<Api> {
        LiveLessonServiceServer::new(api)
    }
    pub fn v1_admin(api: Api) -> AdminServiceServer<Api> {
        AdminServiceServer::new(api)
    }
}
