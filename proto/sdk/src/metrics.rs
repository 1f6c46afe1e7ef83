//! Prometheus metrics of an agent, and the small HTTP server that exposes them on `/metrics`.
//!
//! [`AgentMetrics`] is kept by every [`super::Agent`]:
//! - `antidote_agent_rpc_duration_seconds{rpc, code}`: every answered RPC (Watch excepted: it
//!   lasts as long as the scheduler's connection), by gRPC code;
//! - `antidote_agent_realise_duration_seconds{outcome}`: one generation from Provision to READY
//!   or FAILED;
//! - `antidote_agent_live_lessons{phase}`: the live lessons held, counted at scrape time.
//!
//! The encoding, the buckets and the `/metrics` server are `antidote_net::metrics`'s (the
//! scheduler exposes its own metrics with them), re-exported here.

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;

use antidote_proto::agent::v1::Phase;

use super::StateBook;

pub use antidote_net::metrics::{
    CONTENT_TYPE, HistogramFamily, bind, call_buckets, code_name, encode, provisioning_buckets,
    serve,
};

/// Labels of one RPC's outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RpcLabels {
    /// The method, as in the .proto (`Provision`).
    pub rpc: &'static str,
    /// The gRPC code name (`Ok`, `NotFound`, ...).
    pub code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabels {
    phase: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FoundLabels {
    found: &'static str,
}

/// An agent's metrics.
pub struct AgentMetrics {
    registry: Registry,
    rpcs: HistogramFamily<RpcLabels>,
    realise: HistogramFamily<OutcomeLabels>,
    live_lessons: Family<PhaseLabels, Gauge>,
    looks: Family<FoundLabels, prometheus_client::metrics::counter::Counter>,
}

impl std::fmt::Debug for AgentMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentMetrics").finish_non_exhaustive()
    }
}

impl Default for AgentMetrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("antidote_agent");
        let rpcs =
            HistogramFamily::<RpcLabels>::new_with_constructor(|| Histogram::new(call_buckets()));
        let realise = HistogramFamily::<OutcomeLabels>::new_with_constructor(|| {
            Histogram::new(provisioning_buckets())
        });
        let live_lessons = Family::<PhaseLabels, Gauge>::default();
        let looks = Family::<FoundLabels, prometheus_client::metrics::counter::Counter>::default();
        registry.register_with_unit(
            "rpc_duration",
            "Answered antidote.agent.v1 calls by method and gRPC code (Watch excepted)",
            prometheus_client::registry::Unit::Seconds,
            rpcs.clone(),
        );
        registry.register_with_unit(
            "realise_duration",
            "Time from Provision to READY or FAILED of one generation",
            prometheus_client::registry::Unit::Seconds,
            realise.clone(),
        );
        registry.register(
            "live_lessons",
            "Live lessons held, by phase",
            live_lessons.clone(),
        );
        registry.register(
            "adoption_looks",
            "Looks in the backend for a live lesson's objects before creating it (Provision or \
             Recover of one not held here, not said to be new), by whether any were found",
            looks.clone(),
        );
        AgentMetrics {
            registry,
            rpcs,
            realise,
            live_lessons,
            looks,
        }
    }
}

impl AgentMetrics {
    /// Times one RPC and records its code (`Cancelled` when the caller went away first). Every
    /// RPC passes here, so this is also where an error without an ErrorInfo gets one
    /// ([`super::errors::typed`]): no agent on the SDK answers an untyped error.
    pub async fn rpc<T>(
        &self,
        rpc: &'static str,
        call: impl Future<Output = Result<T, tonic::Status>>,
    ) -> Result<T, tonic::Status> {
        let mut outcome = RpcOutcome {
            metrics: self,
            rpc,
            started: Instant::now(),
            code: tonic::Code::Cancelled,
        };
        let result = call.await.map_err(super::errors::typed);
        outcome.code = match &result {
            Ok(_) => tonic::Code::Ok,
            Err(status) => status.code(),
        };
        result
    }

    /// Counts one look for a live lesson's objects, and whether any were `found`.
    pub fn looked(&self, found: bool) {
        let found = if found { "true" } else { "false" };
        self.looks.get_or_create(&FoundLabels { found }).inc();
    }

    /// Records one generation's time to READY (`ready`) or FAILED.
    pub fn realised(&self, ready: bool, started: Instant) {
        let outcome = if ready { "ready" } else { "failed" };
        self.realise
            .get_or_create(&OutcomeLabels { outcome })
            .observe(started.elapsed().as_secs_f64());
    }

    /// The text exposition, with the live-lesson counts taken from `book` now.
    pub fn render(&self, book: &StateBook) -> String {
        let mut counts = std::collections::BTreeMap::new();
        for phase in [
            Phase::Pending,
            Phase::Booting,
            Phase::Configuring,
            Phase::Ready,
            Phase::Failed,
            Phase::Terminating,
        ] {
            counts.insert(phase as i32, 0i64);
        }
        for phase in book.phases() {
            *counts.entry(phase).or_default() += 1;
        }
        for (phase, count) in counts {
            let phase = Phase::try_from(phase).map_or("unknown", |p| phase_name(p));
            self.live_lessons
                .get_or_create(&PhaseLabels { phase })
                .set(count);
        }
        encode(&self.registry)
    }
}

/// Records one RPC when it ends, however it ends.
struct RpcOutcome<'a> {
    metrics: &'a AgentMetrics,
    rpc: &'static str,
    started: Instant,
    code: tonic::Code,
}

impl Drop for RpcOutcome<'_> {
    fn drop(&mut self) {
        self.metrics
            .rpcs
            .get_or_create(&RpcLabels {
                rpc: self.rpc,
                code: code_name(self.code),
            })
            .observe(self.started.elapsed().as_secs_f64());
    }
}

fn phase_name(phase: Phase) -> &'static str {
    match phase {
        Phase::Unspecified => "unspecified",
        Phase::Pending => "pending",
        Phase::Booting => "booting",
        Phase::Configuring => "configuring",
        Phase::Ready => "ready",
        Phase::Failed => "failed",
        Phase::Terminating => "terminating",
    }
}

/// Serves an agent's metrics in the background until `shutdown` is cancelled.
pub fn spawn<B: super::Backend>(
    agent: &Arc<super::Agent<B>>,
    listener: TcpListener,
    shutdown: tokio_util::sync::CancellationToken,
) {
    let agent = agent.clone();
    tokio::spawn(async move {
        let render = move || agent.metrics().render(agent.book());
        if let Err(err) = serve(listener, render, shutdown.cancelled_owned()).await {
            tracing::error!(error = %err, "metrics server stopped");
        }
    });
}
