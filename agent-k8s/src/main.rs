//! `agent-k8s`: connects to the Kubernetes API server, then serves antidote.agent.v1 until
//! SIGTERM or ctrl-c. The cluster is found as kubectl finds it: `KUBECONFIG` (or
//! `~/.kube/config`), else the in-cluster service account. Spans go to
//! `$OTEL_EXPORTER_OTLP_ENDPOINT` when it is set.

use agent_k8s::backend::Kubernetes;
use agent_k8s::settings::Settings;
use clap::Parser as _;

/// The allocator, as the scheduler's (glibc's malloc/free were a visible share of CPU under load).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let settings = Settings::parse();
    let agent = settings.agent.clone();
    antidote_sdk::run("agent-k8s", agent, Kubernetes::start(settings))
        .await
        .map_err(|err| anyhow::anyhow!(err))
}
