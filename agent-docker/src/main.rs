//! `agent-docker`: connects to the Docker engine, then serves antidote.agent.v1 until SIGTERM or
//! ctrl-c. The engine is the one Docker's own clients would use: `DOCKER_HOST` (a unix socket,
//! or `tcp://HOST:PORT`; with `DOCKER_TLS_VERIFY=1` the connection uses TLS with the `ca.pem`,
//! `cert.pem` and `key.pem` in `DOCKER_CERT_PATH`, default `~/.docker`), else the default
//! socket. Spans go to `$OTEL_EXPORTER_OTLP_ENDPOINT` when it is set. On the engine's own host
//! (a unix socket, iptables at hand, root) it confines lesson networks with firewall rules;
//! elsewhere it says once that it cannot.

use std::sync::Arc;

use agent_docker::backend::Docker;
use agent_docker::firewall::Firewall;
use agent_docker::settings::Settings;
use antidote_sdk::{self as sdk, Agent, StateBook};
use anyhow::Context as _;
use clap::Parser as _;
use tokio_util::sync::CancellationToken;

/// The allocator, as the scheduler's (glibc's malloc/free were a visible share of CPU under load).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let telemetry = sdk::trace::init_logging("agent-docker")?;
    let settings = Settings::parse();
    let host =
        std::env::var("DOCKER_HOST").unwrap_or_else(|_| "unix:///var/run/docker.sock".into());
    let docker = bollard::Docker::connect_with_defaults()
        .with_context(|| format!("cannot use the Docker engine at {host}"))?;
    let docker = docker.negotiate_version().await.with_context(|| {
        format!(
            "no Docker engine answers at {host}: start one (tests/docker/dockerd.sh start prints a DOCKER_HOST for a private engine) and set DOCKER_HOST"
        )
    })?;
    let version = docker.version().await?;
    tracing::info!(engine = ?version.version, api = ?version.api_version, "connected to Docker");
    let firewall = Firewall::detect(
        settings.firewall,
        settings.allow_egress,
        std::env::var("DOCKER_HOST").ok().as_deref(),
    )
    .await;
    if let Some(why) = firewall.unavailable() {
        if firewall.required() {
            anyhow::bail!("--firewall required, but lesson networks cannot be confined: {why}");
        }
        firewall.warn_at_start();
    }
    match firewall.sweep().await {
        Ok(0) => {}
        Ok(count) => tracing::info!(
            count,
            "removed firewall rules of lesson networks that are gone"
        ),
        Err(err) => tracing::warn!(error = %err, "could not sweep stale firewall rules"),
    }

    // With --connect the agent dials in and opens no listening socket at all.
    let transport: sdk::Transport = match settings.connect.dial_in(&settings.tls)? {
        Some(dial) => dial.into(),
        None => {
            let listener = tokio::net::TcpListener::bind(settings.listen)
                .await
                .with_context(|| format!("cannot listen on {}", settings.listen))?;
            // mTLS, or plaintext where that is safe or the operator's explicit choice.
            settings.tls.listener(listener)?.into()
        }
    };
    let metrics = sdk::metrics::bind(settings.metrics_listen).await?;
    // Learners' way in: presentations resolve to the containers' own addresses when this agent
    // reaches them (it runs on the engine's host), to their published ports otherwise.
    let entrypoint = settings.entrypoint.bind().await?;
    if let Some(bound) = &entrypoint {
        println!("entrypoint listening on {}", bound.listener.local_addr()?);
    }
    let signal = sdk::shutdown_signal();
    println!("{}", transport.announce());
    let book = Arc::new(StateBook::default());
    let configurator = agent_docker::configurator::available(&docker, &settings).await;
    let jupyter = agent_docker::guide::available(&docker, &settings).await;
    let backend = Docker::new(docker, settings, firewall, book.clone())
        .with_configurator(configurator)
        .with_jupyter(jupyter);
    let shutdown = CancellationToken::new();
    tokio::spawn(backend.clone().follow_events(shutdown.clone()));
    let agent = Agent::with_book(backend, book);
    if let Some(bound) = entrypoint {
        agent.serve_entrypoint(bound, shutdown.clone());
    }
    sdk::run(agent, transport, metrics, telemetry, async move {
        signal.await;
        shutdown.cancel();
    })
    .await
    .map_err(|err| anyhow::anyhow!(err))
}
