//! `agent-k8s`: connects to the Kubernetes API server, then serves antidote.agent.v1 until
//! SIGTERM or ctrl-c. The cluster is found as kubectl finds it: `KUBECONFIG` (or
//! `~/.kube/config`), else the in-cluster service account. Spans go to
//! `$OTEL_EXPORTER_OTLP_ENDPOINT` when it is set.

use agent_k8s::backend::Kubernetes;
use agent_k8s::settings::Settings;
use antidote_sdk::{self as sdk, Agent};
use anyhow::Context as _;
use clap::Parser as _;

/// The allocator, as the scheduler's (glibc's malloc/free were a visible share of CPU under load).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let telemetry = sdk::trace::init_logging("agent-k8s")?;
    let settings = Settings::parse();
    let client = kube::Client::try_default()
        .await
        .context("no Kubernetes cluster configured: set KUBECONFIG or run in a pod")?;
    let version = client
        .apiserver_version()
        .await
        .context("the Kubernetes API server does not answer")?;
    tracing::info!(version = %version.git_version, "connected to Kubernetes");
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
    // Learners' way in: presentations resolve to the pods' addresses the agent reports, which
    // this process reaches from inside the cluster's network.
    let entrypoint = settings.entrypoint.bind().await?;
    if let Some(bound) = &entrypoint {
        println!("entrypoint listening on {}", bound.listener.local_addr()?);
    }
    let backend = Kubernetes::new(client, settings);
    let signal = sdk::shutdown_signal();
    println!("{}", transport.announce());
    let agent = Agent::new(backend);
    let shutdown = tokio_util::sync::CancellationToken::new();
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
