//! The API layer: `antidote.api.v1` as gRPC ([`grpc`]: the four services, validation at the
//! edge) and as JSON over HTTP ([`http`]), with the public API's conversions ([`convert`]).
//! Handlers write desired state to [`crate::store`] and hand changes to
//! [`crate::drive::Reconciler`]; only Plan and stage checks ([`checks`]) reach an agent, and
//! neither changes a live lesson's state.

pub mod auth;
pub mod checks;
mod convert;
mod grpc;
pub mod http;
pub mod limits;
mod pools;

use std::time::Duration;

use antidote_net::Cuttable;
use antidote_net::errors::RequestTooLarge;
use antidote_proto::api::v1::ErrorReason;
use antidote_proto::api::v1::admin_service_server::AdminServiceServer;
use antidote_proto::api::v1::curriculum_service_server::CurriculumServiceServer;
use antidote_proto::api::v1::live_lesson_service_server::LiveLessonServiceServer;
use antidote_proto::api::v1::session_service_server::SessionServiceServer;
pub use grpc::{Api, Watches};
use tokio::net::TcpListener;

/// Largest request the public API decodes: every request is a few ids and slugs.
const MAX_REQUEST_BYTES: usize = 64 * 1024;

/// The gRPC services whose health is reported (besides the empty name: the server as a whole).
const SERVICES: [&str; 4] = [
    "antidote.api.v1.CurriculumService",
    "antidote.api.v1.SessionService",
    "antidote.api.v1.LiveLessonService",
    "antidote.api.v1.AdminService",
];

/// How often (and how long at most) the health check asks the database.
const DATABASE_CHECK: Duration = Duration::from_secs(5);

/// Whether a status is tonic's refusal of a request that does not decode: prost's errors
/// (invalid UTF-8 in a string, a truncated message, a wrong wire type: tonic-prost maps them to
/// INTERNAL), a body that ends inside a gRPC frame, or a frame with a bad compression flag.
fn is_decode_error(status: &tonic::Status) -> bool {
    const MESSAGES: [&str; 3] = [
        "failed to decode Protobuf message",
        "Unexpected EOF decoding stream",
        "protocol error: received message with",
    ];
    status.code() == tonic::Code::Internal
        && MESSAGES.iter().any(|m| status.message().starts_with(m))
}

/// A tower layer for the API's gRPC servers: tonic's refusal of a request that does not decode
/// (INTERNAL, no ErrorInfo) becomes INVALID_ARGUMENT with reason MALFORMED_REQUEST. Such a
/// refusal comes before any handler answers, as a trailers-only answer (the status in the
/// headers); our handlers never answer INTERNAL with tonic's decode messages, so nothing else
/// is touched.
#[derive(Debug, Clone, Copy)]
pub struct MalformedRequest;

impl<S> tower::Layer<S> for MalformedRequest {
    type Service = MalformedRequestService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        MalformedRequestService { inner }
    }
}

/// The service [`MalformedRequest`] wraps around a server's routes.
#[derive(Debug, Clone)]
pub struct MalformedRequestService<S> {
    inner: S,
}

impl<S, Req, B> tower::Service<Req> for MalformedRequestService<S>
where
    S: tower::Service<Req, Response = axum::http::Response<B>>,
    S::Future: Send + 'static,
    B: Default + Send + 'static,
{
    type Response = axum::http::Response<B>;
    type Error = S::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<axum::http::Response<B>, S::Error>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Req) -> Self::Future {
        let answer = self.inner.call(request);
        Box::pin(async move {
            let response = answer.await?;
            match tonic::Status::from_header_map(response.headers()) {
                Some(status) if is_decode_error(&status) => Ok(antidote_net::errors::status(
                    tonic::Code::InvalidArgument,
                    ErrorReason::MalformedRequest.as_str_name(),
                    format!("the request message does not decode: {}", status.message()),
                    [],
                )
                .into_http()),
                _ => Ok(response),
            }
        })
    }
}

/// Which gRPC services a listener serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Services {
    /// Curriculum, sessions and live lessons: the learners' listener.
    Learners,
    /// AdminService alone: the operators' listener.
    Admin,
}

/// Serves the learners' or the operators' gRPC services (with grpc.health.v1 and reflection v1
/// and v1alpha) on `listener` until the API's shutdown token is cancelled.
pub async fn serve_grpc(api: Api, services: Services, listener: TcpListener) -> anyhow::Result<()> {
    tracing::info!(address = %listener.local_addr()?, ?services, "serving antidote.api.v1");
    // Each client network holds at most `limits.connections_per_address` connections; more
    // are closed at once (and never reach the server).
    let quota = limits::Quota::new(api.config.limits.connections_per_address);
    // Cancelled once the shutdown grace is over: connections still open (health and API
    // Watch streams, reflection streams) are cut, so shutdown is bounded.
    let cut = tokio_util::sync::CancellationToken::new();
    let cut_connections = cut.clone();
    // A connection is handed to the server only once its client has sent the HTTP/2 preface
    // and its first SETTINGS within `limits.header_read_timeout` (tonic and h2 would wait for
    // them forever, however slowly they drip); the wait runs in a task of its own, so silent
    // and slow clients never hold accepting up.
    let (admitted, incoming) = tokio::sync::mpsc::channel(64);
    let opening = api.config.limits.header_read_timeout;
    let accepting = api.shutdown.clone();
    tokio::spawn(async move {
        // Accepting also ends when the server stops taking connections.
        let closed = admitted.clone();
        let accept = antidote_net::accept::each(&listener, &accepting, move |stream, peer| {
            let Some(mut limited) = limits::Limited::admit(stream, peer, &quota) else {
                tracing::debug!(%peer, "connection refused: its address holds its share");
                return;
            };
            let (admitted, cut) = (admitted.clone(), cut_connections.clone());
            tokio::spawn(async move {
                if limited.opens_within(opening).await {
                    let _ = admitted
                        .send(Ok::<_, std::io::Error>(Cuttable::new(limited, &cut)))
                        .await;
                } else {
                    tracing::debug!(
                        %peer,
                        "connection closed: no HTTP/2 preface and SETTINGS within limits.header_read_timeout"
                    );
                }
            });
        });
        tokio::select! {
            () = accept => {}
            () = closed.closed() => {}
        }
    });
    let incoming = tokio_stream::wrappers::ReceiverStream::new(incoming);
    let shutdown = api.shutdown.clone();
    let grace = api.config.shutdown_grace;
    let mut server = tonic::transport::Server::builder()
        // A span per call, child of the caller's W3C trace context.
        .trace_fn(antidote_net::trace::span)
        // The caller's trace context, current while the call runs: passed on to agents even
        // when spans are not exported.
        .layer(antidote_net::trace::PassContext)
        // Serve the API's streams and the many small calls of many learners on few connections.
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        // Bounded: streams per connection, and how long a unary call may run (a Watch's
        // response starts at once, so its stream is not cut by this).
        .max_concurrent_streams(Some(api.config.limits.streams_per_connection))
        .timeout(api.config.limits.request_timeout)
        // Oversized requests are RESOURCE_EXHAUSTED with reason REQUEST_TOO_LARGE (tonic says
        // OUT_OF_RANGE).
        .layer(RequestTooLarge {
            reason: ErrorReason::RequestTooLarge.as_str_name(),
        })
        // A request that does not decode is the caller's fault: INVALID_ARGUMENT with reason
        // MALFORMED_REQUEST, as the JSON API's 400 (tonic says INTERNAL, which would let any
        // client raise "internal error" alerts at will).
        .layer(MalformedRequest);
    // Health and reflection (v1 and v1alpha), as every gRPC server of ours.
    let (server, health) =
        antidote_net::grpc::standard_services(&mut server, &[antidote_proto::FILE_DESCRIPTOR_SET])?;
    let names: &[&str] = match services {
        Services::Learners => &SERVICES[..3],
        Services::Admin => &SERVICES[3..4],
    };
    for service in names.iter().chain([&""]) {
        health
            .set_service_status(service, tonic_health::ServingStatus::Serving)
            .await;
    }
    // The API's services are SERVING while the database answers (readiness: a replica cut off
    // from PostgreSQL takes no traffic); `""` stays the process's own liveness, so a database
    // outage restarts nothing.
    {
        let (health, store, shutdown) = (health.clone(), api.store.clone(), api.shutdown.clone());
        let names: Vec<String> = names.iter().map(|name| name.to_string()).collect();
        tokio::spawn(async move {
            let mut serving = true;
            let mut tick = tokio::time::interval(DATABASE_CHECK);
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => {
                        // Health watchers learn at once that this process is going away.
                        for service in names.iter().map(String::as_str).chain([""]) {
                            health
                                .set_service_status(service, tonic_health::ServingStatus::NotServing)
                                .await;
                        }
                        return;
                    }
                    _ = tick.tick() => {}
                }
                let answers = tokio::time::timeout(DATABASE_CHECK, store.ping())
                    .await
                    .is_ok_and(|ping| ping.is_ok());
                if answers == serving {
                    continue;
                }
                serving = answers;
                let status = if answers {
                    tracing::info!("the database answers again: serving");
                    tonic_health::ServingStatus::Serving
                } else {
                    tracing::warn!("the database does not answer: not serving");
                    tonic_health::ServingStatus::NotServing
                };
                for service in &names {
                    health.set_service_status(service, status).await;
                }
            }
        });
    }
    let router = match services {
        Services::Learners => server
            .add_service(
                CurriculumServiceServer::new(api.clone())
                    .max_decoding_message_size(MAX_REQUEST_BYTES),
            )
            .add_service(
                SessionServiceServer::new(api.clone()).max_decoding_message_size(MAX_REQUEST_BYTES),
            )
            .add_service(
                LiveLessonServiceServer::new(api).max_decoding_message_size(MAX_REQUEST_BYTES),
            ),
        Services::Admin => server
            .add_service(AdminServiceServer::new(api).max_decoding_message_size(MAX_REQUEST_BYTES)),
    };
    let serving = router.serve_with_incoming_shutdown(incoming, shutdown.clone().cancelled_owned());
    tokio::pin!(serving);
    tokio::select! {
        result = &mut serving => result?,
        () = async {
            shutdown.cancelled().await;
            tokio::time::sleep(grace).await;
        } => {
            tracing::warn!(?services, ?grace, "calls and streams still open after the shutdown grace; cutting their connections");
            cut.cancel();
            // Every connection ends now; the server's drain is not waited for beyond a moment.
            let _ = tokio::time::timeout(Duration::from_secs(1), &mut serving).await;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_tonics_decode_refusals_are_malformed_requests() {
        let internal = |message: &str| tonic::Status::internal(message.to_owned());
        for refusal in [
            "failed to decode Protobuf message: GetLessonRequest.slug: invalid string value: data is not UTF-8 encoded",
            "failed to decode Protobuf message: buffer underflow",
            "Unexpected EOF decoding stream.",
            "protocol error: received message with invalid compression flag: 7 (valid flags are 0 and 1), while sending request",
        ] {
            assert!(is_decode_error(&internal(refusal)), "{refusal}");
        }
        // Our own faults stay INTERNAL, and other codes are never touched.
        assert!(!is_decode_error(&internal("cannot count live lessons")));
        assert!(!is_decode_error(&tonic::Status::invalid_argument(
            "failed to decode Protobuf message: x"
        )));
    }
}
