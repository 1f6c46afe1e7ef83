//! Prometheus plumbing every process shares: the OpenMetrics encoding, the bucket sets, and the
//! small HTTP server of `/metrics` and `/healthz`.

use std::future::Future;
use std::net::SocketAddr;

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;

/// The content type of the OpenMetrics text format (what Prometheus scrapes).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Latency buckets of one call: 1 ms to ~65 s.
pub fn call_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(0.001, 2.0, 17)
}

/// Buckets of taking a live lesson to READY: 0.25 s to ~17 min.
pub fn provisioning_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(0.25, 2.0, 13)
}

/// A histogram family whose members use `buckets`.
pub type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// A gRPC code as a label value: its name (`Ok`, `Unavailable`, ...).
pub fn code_name(code: tonic::Code) -> String {
    format!("{code:?}")
}

/// The Prometheus text exposition of `registry`.
pub fn encode(registry: &Registry) -> String {
    let mut text = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut text, registry);
    text
}

/// Serves `GET /metrics` (and `GET /healthz`) on `listener` until `shutdown` completes.
pub async fn serve<F>(
    listener: TcpListener,
    render: F,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()>
where
    F: Fn() -> String + Clone + Send + Sync + 'static,
{
    let app = axum::Router::new()
        .route(
            "/metrics",
            axum::routing::get(move || {
                let render = render.clone();
                async move { ([(axum::http::header::CONTENT_TYPE, CONTENT_TYPE)], render()) }
            }),
        )
        .route("/healthz", axum::routing::get(|| async { "ok\n" }));
    let listener = axum::serve::ListenerExt::tap_io(listener, |stream| {
        let _ = stream.set_nodelay(true);
    });
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

/// Binds `address` (when given: metrics are off otherwise) for [`serve`] and prints
/// `metrics listening on ADDR` (before the agent's own `listening on ADDR`, which harnesses wait
/// for last). An error names the address.
pub async fn bind(address: Option<SocketAddr>) -> std::io::Result<Option<TcpListener>> {
    let Some(address) = address else {
        return Ok(None);
    };
    let listener = TcpListener::bind(address).await.map_err(|err| {
        std::io::Error::new(
            err.kind(),
            format!("cannot serve metrics on {address}: {err}"),
        )
    })?;
    println!("metrics listening on {}", listener.local_addr()?);
    Ok(Some(listener))
}
