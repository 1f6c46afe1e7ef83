//! Tracing for every Antidote process: logs on stderr, spans exported over OTLP when an endpoint
//! is given, and the W3C trace context (`traceparent`, `tracestate`) carried in gRPC metadata.
//!
//! Every process installs the OpenTelemetry layer, exporter or not, so a span always has a trace
//! context: an incoming call's `traceparent` becomes the parent of the call's span, and outgoing
//! calls [`inject`] the current span's context. One learner's request is then one trace across
//! the scheduler and its agents. Without an endpoint the spans are simply not exported (nothing
//! is dialled, nothing is logged about it).

use std::time::Duration;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator as _};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tonic::codegen::http;
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

/// The standard variable naming the OTLP collector when no endpoint is configured.
pub const OTLP_ENDPOINT_ENV: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";

/// Keeps the span exporter alive; [`Telemetry::shutdown`] flushes what is queued.
#[must_use = "dropping it stops span export"]
pub struct Telemetry {
    provider: SdkTracerProvider,
    /// Where spans go, if anywhere.
    pub endpoint: Option<String>,
}

impl Telemetry {
    /// Flushes queued spans (bounded by the exporter's timeout) and stops exporting. The SDK
    /// blocks on the export, which runs on a Tokio task: the wait happens on a blocking thread,
    /// never on a runtime worker (where it could wait for itself).
    pub async fn shutdown(self) {
        let provider = self.provider;
        let flush = self.endpoint.is_some();
        let _ = tokio::task::spawn_blocking(move || {
            if flush {
                let _ = provider.force_flush();
            }
            let _ = provider.shutdown();
        })
        .await;
    }
}

/// Why telemetry could not start.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The OTLP exporter refused its configuration.
    #[error("OTLP endpoint `{endpoint}`: {reason}")]
    Exporter {
        /// The endpoint given.
        endpoint: String,
        /// The exporter's complaint.
        reason: String,
    },
    /// A global subscriber is already installed.
    #[error("logging is already set up: {0}")]
    AlreadySet(String),
}

/// Sets up logging to stderr, filtered by `RUST_LOG` (default `info`), and the OpenTelemetry
/// layer. Spans are exported over OTLP/gRPC to `endpoint`, or to `$OTEL_EXPORTER_OTLP_ENDPOINT`
/// when `endpoint` is `None`; an empty endpoint turns export off. Call it inside the Tokio
/// runtime (the exporter's batch task runs on it), before printing `listening on ADDR`.
pub fn init(service_name: &str, endpoint: Option<&str>) -> Result<Telemetry, TelemetryError> {
    let endpoint = match endpoint {
        Some(endpoint) => endpoint.trim().to_owned(),
        None => std::env::var(OTLP_ENDPOINT_ENV).unwrap_or_default(),
    };
    let endpoint = (!endpoint.is_empty()).then_some(endpoint);
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(service_name.to_owned())
        .build();
    let mut provider = SdkTracerProvider::builder().with_resource(resource);
    if let Some(endpoint) = &endpoint {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint.clone())
            .with_timeout(Duration::from_secs(5))
            .build()
            .map_err(|err| TelemetryError::Exporter {
                endpoint: endpoint.clone(),
                reason: err.to_string(),
            })?;
        // The batch task runs on Tokio: tonic's channel needs its reactor.
        let processor =
            opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor::builder(
                exporter,
                opentelemetry_sdk::runtime::Tokio,
            )
            .build();
        provider = provider.with_span_processor(processor);
    }
    let provider = provider.build();
    // Spans do not depend on `RUST_LOG` (quiet logs must not cut traces): our own spans at INFO,
    // never the transport's (the exporter would trace its own traffic).
    let spans = tracing_subscriber::filter::Targets::new()
        .with_default(tracing::Level::INFO)
        .with_target("h2", tracing::level_filters::LevelFilter::OFF)
        .with_target("hyper", tracing::level_filters::LevelFilter::OFF)
        .with_target("hyper_util", tracing::level_filters::LevelFilter::OFF)
        .with_target("tonic", tracing::level_filters::LevelFilter::OFF)
        .with_target("tower", tracing::level_filters::LevelFilter::OFF)
        .with_target("opentelemetry", tracing::level_filters::LevelFilter::OFF)
        .with_target(
            "opentelemetry_sdk",
            tracing::level_filters::LevelFilter::OFF,
        )
        .with_target(
            "opentelemetry_otlp",
            tracing::level_filters::LevelFilter::OFF,
        );
    let otel = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("antidote"))
        .with_threads(false)
        .with_location(false)
        .with_filter(spans);
    let logs = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        );
    tracing_subscriber::registry()
        .with(logs)
        .with(otel)
        .try_init()
        .map_err(|err| TelemetryError::AlreadySet(err.to_string()))?;
    if let Some(endpoint) = &endpoint {
        tracing::info!(%endpoint, "exporting spans over OTLP");
    }
    Ok(Telemetry { provider, endpoint })
}

/// [`init`] with the endpoint from `$OTEL_EXPORTER_OTLP_ENDPOINT` (export off when unset): what
/// an agent binary sets up first, inside its runtime.
pub fn init_logging(service_name: &str) -> Result<Telemetry, TelemetryError> {
    init(service_name, None)
}

/// The span of one incoming call: the RPC's path, child of the caller's trace context. Health
/// checks and reflection get none: a probe every few seconds is not worth a trace.
pub fn span(request: &http::Request<()>) -> tracing::Span {
    let path = request.uri().path();
    if path.starts_with("/grpc.health.") || path.starts_with("/grpc.reflection.") {
        return tracing::Span::none();
    }
    let span = tracing::info_span!("rpc", rpc.method = %path);
    set_parent(&span, request.headers());
    span
}

/// Makes the trace context in `headers` (if any) the parent of `span`.
pub fn set_parent(span: &tracing::Span, headers: &http::HeaderMap) {
    let context = TraceContextPropagator::new().extract(&HeaderExtractor(headers));
    if opentelemetry::trace::TraceContextExt::span(&context)
        .span_context()
        .is_valid()
    {
        let _ = span.set_parent(context);
    }
}

/// Whether the current span belongs to a trace (an API call's, a reconcile's), so that work done
/// without one (a background tick) can stay out of the exported traces.
pub fn in_trace() -> bool {
    opentelemetry::trace::TraceContextExt::span(&tracing::Span::current().context())
        .span_context()
        .is_valid()
}

/// Writes the current span's trace context into outgoing gRPC metadata.
pub fn inject(metadata: &mut MetadataMap) {
    let context = tracing::Span::current().context();
    TraceContextPropagator::new().inject_context(&context, &mut MetadataInjector(metadata));
}

/// The current span's `traceparent` header value (empty when there is no valid context).
pub fn current_traceparent() -> String {
    let mut metadata = MetadataMap::new();
    inject(&mut metadata);
    metadata
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

struct HeaderExtractor<'a>(&'a http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

struct MetadataInjector<'a>(&'a mut MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(key), Ok(value)) = (
            MetadataKey::from_bytes(key.as_bytes()),
            MetadataValue::try_from(value),
        ) {
            self.0.insert(key, value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_traceparent_survives_extract_then_inject() {
        let provider = SdkTracerProvider::builder().build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        tracing::subscriber::with_default(subscriber, || {
            let mut headers = http::HeaderMap::new();
            headers.insert(
                "traceparent",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
                    .parse()
                    .unwrap(),
            );
            let span = tracing::info_span!("call");
            set_parent(&span, &headers);
            let _entered = span.enter();
            let sent = current_traceparent();
            assert!(
                sent.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"),
                "the trace id carries on: {sent}"
            );
            assert!(
                !sent.contains("00f067aa0ba902b7"),
                "the span id is our span's: {sent}"
            );
        });
    }

    #[test]
    fn no_context_sends_nothing() {
        assert_eq!(current_traceparent(), "");
    }
}
