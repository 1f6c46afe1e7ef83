//! Tracing for every Antidote process: logs on stderr, spans exported over OTLP when an endpoint
//! is given, and the W3C trace context (`traceparent`, `tracestate`) carried in gRPC metadata.
//! Incoming calls may carry Zipkin B3 headers instead (service meshes send them): those continue
//! the trace too, and W3C wins when both are present ([`super::b3`]).
//!
//! With an endpoint, every span has a trace context: an incoming call's `traceparent` becomes
//! the parent of the call's span, and outgoing calls [`inject`] the current span's context. One
//! learner's request is then one trace across the scheduler and its agents.
//!
//! Without an endpoint no OpenTelemetry layer is installed (it cost the scheduler 15 % of its
//! CPU per lifecycle for spans nobody received), and the caller's trace context is passed
//! through instead: [`PassContext`] makes an incoming call's context current while its handler
//! runs, work it causes later can carry it ([`current_context`], then
//! `opentelemetry::context::FutureExt::with_context`), and outgoing calls made for it [`inject`]
//! it unchanged. An agent that exports then still joins the caller's trace, as a child of the
//! caller's span. A call without a trace context starts none.

use std::sync::LazyLock;
use std::time::Duration;

use opentelemetry::propagation::{
    Extractor, Injector, TextMapCompositePropagator, TextMapPropagator as _,
};
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
    // Only when spans go somewhere: see the module's documentation.
    let otel = endpoint.is_some().then(|| {
        tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("antidote"))
            .with_threads(false)
            .with_location(false)
            .with_filter(spans)
    });
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

/// Reads incoming trace context: each propagator in turn, a later one's valid context replacing
/// an earlier one's, so W3C (last) wins over B3 when a request carries both.
static INCOMING: LazyLock<TextMapCompositePropagator> = LazyLock::new(|| {
    TextMapCompositePropagator::new(vec![
        Box::new(super::b3::B3),
        Box::new(TraceContextPropagator::new()),
    ])
});

/// The trace context of incoming `headers`: W3C `traceparent` (and `tracestate`) when valid,
/// otherwise B3 (`b3`, or `x-b3-traceid` and `x-b3-spanid`), otherwise none.
pub fn extract(headers: &http::HeaderMap) -> opentelemetry::Context {
    INCOMING.extract(&HeaderExtractor(headers))
}

/// Makes the trace context in `headers` (if any, see [`extract`]) the parent of `span`.
pub fn set_parent(span: &tracing::Span, headers: &http::HeaderMap) {
    let context = extract(headers);
    if opentelemetry::trace::TraceContextExt::span(&context)
        .span_context()
        .is_valid()
    {
        let _ = span.set_parent(context);
    }
}

/// The trace context of the work running now: the current span's when spans are recorded,
/// otherwise the one passed through (an incoming call's, made current by [`PassContext`] or
/// `with_context`); empty outside any trace.
pub fn current_context() -> opentelemetry::Context {
    let recorded = tracing::Span::current().context();
    if opentelemetry::trace::TraceContextExt::span(&recorded)
        .span_context()
        .is_valid()
    {
        return recorded;
    }
    opentelemetry::Context::current()
}

/// Whether the work running now belongs to a trace (an API call's, a reconcile's), so that work
/// done without one (a background tick) can stay out of the exported traces.
pub fn in_trace() -> bool {
    opentelemetry::trace::TraceContextExt::span(&current_context())
        .span_context()
        .is_valid()
}

/// Writes the current trace context ([`current_context`]) into outgoing gRPC metadata.
pub fn inject(metadata: &mut MetadataMap) {
    let context = current_context();
    TraceContextPropagator::new().inject_context(&context, &mut MetadataInjector(metadata));
}

/// A server layer making each incoming call's trace context ([`extract`]) current while its
/// handler runs, so that without recorded spans it is still passed on ([`current_context`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct PassContext;

impl<S> tower::Layer<S> for PassContext {
    type Service = PassContextService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        PassContextService { inner }
    }
}

/// The service [`PassContext`] wraps around a server's routes.
#[derive(Clone, Debug)]
pub struct PassContextService<S> {
    inner: S,
}

impl<S, B> tower::Service<http::Request<B>> for PassContextService<S>
where
    S: tower::Service<http::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = opentelemetry::context::WithContext<S::Future>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        use opentelemetry::context::FutureExt as _;
        let context = extract(request.headers());
        self.inner.call(request).with_context(context)
    }
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

    /// What an incoming call's handler would send on: its [`current_traceparent`].
    async fn passed_on(headers: &[(&'static str, &str)]) -> String {
        use tower::{Layer as _, Service as _};
        let mut service = PassContext.layer(tower::service_fn(|_: http::Request<()>| async {
            Ok::<_, std::convert::Infallible>(current_traceparent())
        }));
        let mut request = http::Request::new(());
        for (name, value) in headers {
            request.headers_mut().insert(*name, value.parse().unwrap());
        }
        service.call(request).await.unwrap()
    }

    #[tokio::test]
    async fn without_recorded_spans_the_callers_context_is_passed_on_unchanged() {
        // No OpenTelemetry layer, as when nothing is exported; a span exists all the same.
        let _default = tracing::subscriber::set_default(tracing_subscriber::registry());
        let _span = tracing::info_span!("call").entered();
        let caller = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(passed_on(&[("traceparent", caller)]).await, caller);
        // A B3-only caller too, passed on as W3C.
        assert_eq!(
            passed_on(&[("b3", "4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1")]).await,
            caller
        );
        // No trace, none started.
        assert_eq!(passed_on(&[]).await, "");
        assert!(!in_trace());
    }

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

    /// The trace id that `headers` continue, if any.
    fn continued(headers: &[(&'static str, &str)]) -> Option<String> {
        let mut map = http::HeaderMap::new();
        for (name, value) in headers {
            map.insert(*name, value.parse().unwrap());
        }
        let context = extract(&map);
        let span = opentelemetry::trace::TraceContextExt::span(&context);
        let span = span.span_context();
        span.is_valid().then(|| span.trace_id().to_string())
    }

    #[test]
    fn b3_alone_continues_its_trace_and_w3c_wins_over_it() {
        let w3c = "4bf92f3577b34da6a3ce929d0e0e4736";
        let b3 = "80f198ee56343ba864fe8b2a57d3eff7";
        let traceparent = format!("00-{w3c}-00f067aa0ba902b7-01");
        let single = format!("{b3}-e457b5a2e4d86bd1-1");
        let multi = [("x-b3-traceid", b3), ("x-b3-spanid", "e457b5a2e4d86bd1")];
        assert_eq!(continued(&[("b3", &single)]).as_deref(), Some(b3));
        assert_eq!(continued(&multi).as_deref(), Some(b3));
        assert_eq!(
            continued(&[("traceparent", &traceparent), ("b3", &single)]).as_deref(),
            Some(w3c)
        );
        assert_eq!(
            continued(&[("b3", &single), ("traceparent", &traceparent)]).as_deref(),
            Some(w3c)
        );
        assert_eq!(
            continued(&[("traceparent", &traceparent), multi[0], multi[1]]).as_deref(),
            Some(w3c)
        );
        // A malformed traceparent does not hide a good B3 context, nor B3 garbage a good W3C one.
        assert_eq!(
            continued(&[("traceparent", "00-zz-yy-01"), ("b3", &single)]).as_deref(),
            Some(b3)
        );
        assert_eq!(
            continued(&[("traceparent", &traceparent), ("b3", "nonsense")]).as_deref(),
            Some(w3c)
        );
        assert_eq!(continued(&[("b3", "nonsense")]), None);
        assert_eq!(continued(&[]), None);
    }

    #[test]
    fn a_b3_parent_becomes_the_parent_of_our_span() {
        let provider = SdkTracerProvider::builder().build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        tracing::subscriber::with_default(subscriber, || {
            let mut headers = http::HeaderMap::new();
            headers.insert(
                "x-b3-traceid",
                "463ac35c9f6413ad48485a3953bb6124".parse().unwrap(),
            );
            headers.insert("x-b3-spanid", "a2fb4a1d1a96d312".parse().unwrap());
            headers.insert("x-b3-sampled", "1".parse().unwrap());
            let span = tracing::info_span!("call");
            set_parent(&span, &headers);
            let _entered = span.enter();
            let sent = current_traceparent();
            assert!(
                sent.starts_with("00-463ac35c9f6413ad48485a3953bb6124-") && sent.ends_with("-01"),
                "the B3 trace carries on as W3C, sampled: {sent}"
            );
            assert!(!sent.contains("a2fb4a1d1a96d312"), "{sent}");
        });
    }

    #[test]
    fn no_context_sends_nothing() {
        assert_eq!(current_traceparent(), "");
    }
}
