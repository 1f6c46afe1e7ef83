//! `agent-k8s`: connects to the Kubernetes API server, then serves antidote.agent.v1 until
//! SIGTERM or ctrl-c. The cluster is found as kubectl finds it: `KUBECONFIG` (or
//! `~/.kube/config`), else the in-cluster service account.

use agent_k8s::backend::Kubernetes;
use agent_k8s::settings::Settings;
use antidote_proto::sdk::{self, Agent};
use anyhow::Context as _;
use clap::Parser as _;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    sdk::trace::init_logging();
    let settings = Settings::parse();
    let client = kube::Client::try_default()
        .await
        .context("no Kubernetes cluster configured: set KUBECONFIG or run in a pod")?;
    let version = client
        .apiserver_version()
        .await
        .context("the Kubernetes API server does not answer")?;
    tracing::info!(version = %version.git_version, "connected to Kubernetes");
    let listener = tokio::net::TcpListener::bind(settings.listen)
        .await
        .with_context(|| format!("cannot listen on {}", settings.listen))?;
    let backend = Kubernetes::new(client, settings);
    println!("listening on {}", listener.local_addr()?);
    sdk::serve(Agent::new(backend), listener, sdk::shutdown_signal())
        .await
        .map_err(|err| anyhow::anyhow!(err))
}
