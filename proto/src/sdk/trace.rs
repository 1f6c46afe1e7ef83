//! One span per call, carrying the caller's W3C trace context.
//!
//! The scheduler sends `traceparent` (and `tracestate`) in gRPC metadata on every agent call;
//! the span of the call records them, so an agent's logs of one request line up with the
//! scheduler's.

use tonic::codegen::http;

/// The span of one incoming call: the RPC's path and the caller's trace context.
pub fn span(request: &http::Request<()>) -> tracing::Span {
    let header = |name: &str| {
        request
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    tracing::info_span!(
        "rpc",
        rpc.method = %request.uri().path(),
        traceparent = %header("traceparent"),
    )
}

/// Logs to stderr, filtered by `RUST_LOG` (default `info`): what every agent binary sets up
/// first, so `listening on ADDR` stays alone on stdout.
pub fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
}
