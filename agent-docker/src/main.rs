//! `agent-docker`: connects to the Docker engine, then serves antidote.agent.v1 until SIGTERM or
//! ctrl-c. The engine is the one Docker's own clients would use: `DOCKER_HOST` (a unix socket,
//! or `tcp://HOST:PORT`; with `DOCKER_TLS_VERIFY=1` the connection uses TLS with the `ca.pem`,
//! `cert.pem` and `key.pem` in `DOCKER_CERT_PATH`, default `~/.docker`), else the default
//! socket.

use agent_docker::backend::Agent;
use agent_docker::settings::Settings;
use antidote_proto::agent::v1::backend_server::BackendServer;
use anyhow::Context as _;
use clap::Parser as _;
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
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

    let listener = tokio::net::TcpListener::bind(settings.listen)
        .await
        .with_context(|| format!("cannot listen on {}", settings.listen))?;
    println!("listening on {}", listener.local_addr()?);
    let agent = Agent::new(docker, settings);
    let shutdown = CancellationToken::new();
    tokio::spawn(agent.clone().follow_events(shutdown.clone()));
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_service_status(
            antidote_proto::agent::v1::SERVICE_NAME,
            tonic_health::ServingStatus::Serving,
        )
        .await;
    let incoming = TcpListenerStream::new(listener).map(|stream| {
        let stream = stream?;
        // Small replies must leave at once (Nagle + delayed ACK would hold them ~40 ms).
        stream.set_nodelay(true)?;
        Ok::<_, std::io::Error>(stream)
    });
    let stop = shutdown.clone();
    tonic::transport::Server::builder()
        .add_service(health_service)
        .add_service(BackendServer::new(agent))
        .serve_with_incoming_shutdown(incoming, async move {
            wait_for_signal().await;
            stop.cancel();
        })
        .await?;
    Ok(())
}

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
