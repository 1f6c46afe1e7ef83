//! `agent-docker`: connects to the Docker engine, then serves antidote.agent.v1 until SIGTERM or
//! ctrl-c. The engine is the one Docker's own clients would use: `DOCKER_HOST` (a unix socket,
//! or `tcp://HOST:PORT`; with `DOCKER_TLS_VERIFY=1` the connection uses TLS with the `ca.pem`,
//! `cert.pem` and `key.pem` in `DOCKER_CERT_PATH`, default `~/.docker`), else the default
//! socket. Spans go to `$OTEL_EXPORTER_OTLP_ENDPOINT` when it is set. On the engine's own host
//! (a unix socket, iptables at hand, root) it confines lesson networks with firewall rules;
//! elsewhere it says once that it cannot.

use agent_docker::backend::Docker;
use agent_docker::settings::Settings;
use clap::Parser as _;

/// The allocator, as the scheduler's (glibc's malloc/free were a visible share of CPU under load).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let settings = Settings::parse();
    let agent = settings.agent.clone();
    antidote_sdk::run("agent-docker", agent, Docker::start(settings))
        .await
        .map_err(|err| anyhow::anyhow!(err))
}
