//! Antidote's scheduler: it loads the lesson catalog, keeps sessions and live lessons in a
//! durable store, drives backend agents toward the desired state, reaps what is idle, and serves
//! the public gRPC API.
//!
//! Layers, each using only those after it (ARCHITECTURE.md has the map):
//! - [`api`]: `antidote.api.v1` as gRPC and JSON/HTTP, the public API's conversions.
//! - [`drive`]: the reconciler, placement, the reaper and the watchers' hub.
//! - [`agents`]: the agent protocol's client side: connections, handshakes, Watch, load, and
//!   every `antidote.agent.v1` conversion.
//! - [`store`]: SQLite or PostgreSQL persistence through sqlx.
//!
//! Shared by all: [`catalog`] (the YAML curriculum), [`model`] (ids, statuses, sessions, live
//! lessons), [`metrics`], [`settings`], [`error`] and [`entrypoint`] (the entrypoint tokens' key set).
#![forbid(unsafe_code)]

pub mod agents;
pub mod api;
pub mod catalog;
pub mod drive;
pub mod entrypoint;
pub mod error;
pub mod metrics;
pub mod model;
pub mod settings;
pub mod store;

use std::sync::Arc;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::agents::{Fleet, SupervisorContext};
use crate::api::auth::AdminAuth;
use crate::api::http::Surface;
use crate::api::{Api, Services, Watches};
use crate::catalog::Catalog;
use crate::drive::{Hub, Identity, Pools, Reaper, Reconciler, ReconcilerParts, Replica, Roster};
use crate::metrics::Metrics;
use crate::model::Millis;
use crate::settings::Config;
use crate::store::Store;

/// The bound listeners.
pub struct Listeners {
    /// The gRPC API.
    pub grpc: TcpListener,
    /// The learners' HTTP API (JSON, events, OpenAPI), unless turned off.
    pub http: Option<TcpListener>,
    /// The operators' gRPC AdminService, when configured.
    pub admin: Option<TcpListener>,
    /// The operators' JSON admin routes and `/metrics` (for an `admin:read` token), when
    /// configured.
    pub admin_http: Option<TcpListener>,
    /// `/metrics` without a token, when configured (`admin.metrics_listen`).
    pub metrics: Option<TcpListener>,
    /// The agent intake, where agents dial in, when configured (`agent_intake.listen`).
    pub agent_intake: Option<TcpListener>,
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
    // Created by the first scheduler on this database, shared by its replicas: agents label
    // every object with it, and only objects carrying it are ever collected as orphans.
    let cluster_id = store.cluster_id(Millis::now()).await?;
    // On PostgreSQL this process is one of possibly several replicas: a lease holder.
    let replica =
        (store.backend() == "postgres").then(|| Arc::new(Replica::new(config.replicas.lease_ttl)));
    tracing::info!(
        %cluster_id,
        replica = replica.as_ref().map_or("", |r| r.id.as_str()),
        backend = store.backend(),
        "store open"
    );
    let mut metrics = Metrics::default();
    metrics.count_store(store.traffic());
    let metrics = Arc::new(metrics);
    let entrypoint = Arc::new(
        crate::entrypoint::Tokens::load(&config.entrypoint)
            .map_err(|err| anyhow::anyhow!(err))?
            .issued_by(&config.instance_id),
    );
    let fleet = Arc::new(Fleet::new(
        &config.agents,
        &config.reconciler,
        metrics.clone(),
    )?);
    // Agents that dial in are known before the reconciler counts loads, so the live lessons of
    // one that dialled in before a restart keep their agent while it dials in again.
    let intake = match &listeners.agent_intake {
        Some(_) => {
            fleet.accept_dial_ins(&config.agent_intake.agents);
            let admission = agents::intake::Admission::new(
                &config.agent_intake,
                config.agents.iter().map(|agent| agent.name.clone()),
            );
            Some(agents::intake::Intake::new(
                &config.agent_intake,
                admission,
            )?)
        }
        None => None,
    };
    let hub = Arc::new(Hub::default());
    let tracker = TaskTracker::new();

    let roster = Arc::new(
        Roster::new(
            store.clone(),
            fleet.clone(),
            &config.agents,
            config.reconciler.agent_grace,
            metrics.clone(),
        )
        .await?,
    );
    let reconciler = Reconciler::new(ReconcilerParts {
        store: store.clone(),
        catalog: catalog.clone(),
        fleet: fleet.clone(),
        roster,
        hub: hub.clone(),
        config: config.reconciler.clone(),
        identity: Identity {
            instance_id: config.instance_id.clone(),
            cluster_id: cluster_id.clone(),
            replica: replica.clone(),
        },
        replicas: config.replicas.clone(),
        metrics: metrics.clone(),
    });
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
            entrypoint_keys: entrypoint.public_keys(),
            revoked_entrypoint_keys: entrypoint.revoked().to_vec(),
        },
    );
    if let (Some(intake), Some(listener)) = (intake, listeners.agent_intake) {
        tracing::info!(address = %listener.local_addr()?, "agent intake: agents may dial in");
        tracker.spawn(intake.serve(listener, fleet.clone(), tracker.clone(), shutdown.clone()));
    }
    reconciler
        .start(&tracker, shutdown.clone(), fleet_rx)
        .await?;
    // Warm pools: the configured ones written to the store, then kept at their targets.
    let pools = Pools::new(
        store.clone(),
        catalog.clone(),
        reconciler.clone(),
        config.pools.clone(),
        replica.clone(),
        metrics.clone(),
        None,
    )?;
    pools.start(&tracker, shutdown.clone()).await?;
    let reaper = Reaper {
        store: store.clone(),
        reconciler: reconciler.clone(),
        fleet: fleet.clone(),
        ttl: config.ttl.clone(),
        config: config.reaper.clone(),
        instance_id: config.instance_id.clone(),
        cluster_id,
        replica,
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
        admin_auth: Arc::new(AdminAuth::new(&config.admin)),
        watches: Watches::new(&config.limits),
        entrypoint,
        pools,
        checks: Arc::new(api::checks::Checks::new(config.limits.checks_per_minute)),
    };
    for (listener, surface) in [
        (listeners.http, Surface::Learners),
        (listeners.admin_http, Surface::Admin),
        (listeners.metrics, Surface::Metrics),
    ] {
        let Some(listener) = listener else { continue };
        tracing::info!(address = %listener.local_addr()?, ?surface, "serving JSON/HTTP");
        let (api, config, shutdown) = (api.clone(), config.clone(), shutdown.clone());
        tracker.spawn(async move {
            if let Err(err) = api::http::serve(api, &config.http, surface, listener, shutdown).await
            {
                tracing::error!(error = %err, ?surface, "HTTP server stopped");
            }
        });
    }
    if let Some(listener) = listeners.admin {
        let admin = api.clone();
        tracker.spawn(async move {
            if let Err(err) = api::serve_grpc(admin, Services::Admin, listener).await {
                tracing::error!(error = %err, "admin gRPC server stopped");
            }
        });
    }
    api::serve_grpc(api, Services::Learners, listener).await?;

    tracing::info!("API stopped; waiting for background work");
    shutdown.cancel();
    tracker.close();
    // The API servers drained (or cut what was left) within the grace; background work gets
    // one more.
    let grace = config.shutdown_grace;
    if tokio::time::timeout(grace, tracker.wait()).await.is_err() {
        tracing::warn!(
            ?grace,
            "background work did not stop within the shutdown grace"
        );
    }
    store.close().await;
    Ok(())
}
