//! The public API as JSON over HTTP, for web front ends, beside the gRPC API.
//!
//! Every route in [`ROUTES`] transcodes to the same `antidote.api.v1` method the gRPC server
//! runs (the handlers of [`crate::api::Api`], so validation, limits and errors are the same):
//! path parameters, query parameters and the JSON body fill the request message by the proto3
//! JSON mapping (through the descriptor set, `prost-reflect`), and the answer is the response
//! message in that mapping (lowerCamelCase names, enums by name, 64-bit integers as strings,
//! timestamps in RFC 3339; default values included). Errors are
//! `{"code": "NOT_FOUND", "reason": "LIVE_LESSON_NOT_FOUND", "message": "...", "metadata": {...}}`
//! with the HTTP status grpc-gateway uses for the code; `reason` is the ErrorInfo reason the gRPC
//! API sends (`antidote.api.v1.ErrorReason`), what clients decide on.
//! `WatchLiveLesson` is a stream of server-sent events (`event: live_lesson`, the JSON message as
//! data; `event: error` then the end if the stream fails).
//!
//! Also served: `GET /openapi.json` (generated from the same routes and descriptors, see
//! [`openapi`]), `GET /metrics` (Prometheus) and `GET /healthz`, and on the learners' listener
//! the learner page (`/learn/`, [`page`]). CORS answers only the origins in `http.cors_origins`
//! (none by default).

pub mod openapi;
pub mod page;

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use antidote_net::errors;
use antidote_proto::api::v1 as api;
use antidote_proto::api::v1::ErrorReason;
use antidote_proto::api::v1::admin_service_server::AdminService;
use antidote_proto::api::v1::curriculum_service_server::CurriculumService as _;
use antidote_proto::api::v1::live_lesson_service_server::LiveLessonService;
use antidote_proto::api::v1::session_service_server::SessionService as _;
use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection, QueryRejection};
use axum::extract::{ConnectInfo, Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, get};
use futures::future::BoxFuture;
use futures::{Stream, StreamExt as _};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use opentelemetry::context::FutureExt as _;
use prost::Message as _;
use prost_reflect::{DescriptorPool, DynamicMessage, Kind, MessageDescriptor, SerializeOptions};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tonic::transport::server::TcpConnectInfo;
use tower_http::cors::{AllowOrigin, CorsLayer};
use tracing::Instrument as _;

use crate::api::{Api, auth};
use crate::settings::HttpConfig;

/// Largest JSON body accepted: every request is a few ids and slugs.
const MAX_BODY_BYTES: usize = 64 * 1024;

/// The descriptors of `antidote.api.v1` (and what it imports).
pub static POOL: LazyLock<DescriptorPool> = LazyLock::new(|| {
    DescriptorPool::decode(antidote_proto::FILE_DESCRIPTOR_SET)
        .expect("the build embeds a valid descriptor set")
});

/// One JSON route: an HTTP method and path template for one RPC, and what runs it.
#[derive(Debug, Clone, Copy)]
pub struct Route {
    /// GET, POST, PUT or DELETE.
    pub method: &'static str,
    /// An axum path template (`/v1/lessons/{slug}`); each `{name}` fills the request field
    /// of that name.
    pub path: &'static str,
    /// Service and method (`LiveLessonService.RequestLiveLesson`).
    pub rpc: &'static str,
    /// The request message (`antidote.api.v1.RequestLiveLessonRequest`).
    pub input: &'static str,
    /// The response message, or of each event for a stream.
    pub output: &'static str,
    /// Whether the request fields not in the path come from a JSON body (else from the query).
    pub body: bool,
    /// Whether the answer is a server-sent event stream.
    pub stream: bool,
    /// Runs the RPC on the gRPC handlers, so each RPC is named once, here, beside its path.
    run: Handler,
}

/// What a route runs once the HTTP layer has checked the request and gathered its fields.
type Handler = fn(Api, Call) -> BoxFuture<'static, Response>;

/// A unary gRPC handler of [`Api`] (a closure around the `async_trait` method, which a fn
/// pointer cannot name directly), as [`unary`] runs it.
type Rpc<Req, Resp> = for<'a> fn(
    &'a Api,
    tonic::Request<Req>,
) -> BoxFuture<'a, Result<tonic::Response<Resp>, tonic::Status>>;

const fn route(
    method: &'static str,
    path: &'static str,
    rpc: &'static str,
    input: &'static str,
    output: &'static str,
    run: Handler,
) -> Route {
    Route {
        method,
        path,
        rpc,
        input,
        output,
        body: matches!(method.as_bytes(), b"POST" | b"PUT"),
        stream: false,
        run,
    }
}

/// Every JSON route; the router and the OpenAPI document are both made from this list. Each
/// entry runs its RPC through [`unary`] (or [`watch`], the one stream); a unit test checks the
/// messages and streaming against the RPC's descriptor.
pub const ROUTES: &[Route] = &[
    route(
        "GET",
        "/v1/curriculum",
        "CurriculumService.GetCurriculum",
        "GetCurriculumRequest",
        "Curriculum",
        |api, call| unary(api, call, |api, request| api.get_curriculum(request)),
    ),
    route(
        "GET",
        "/v1/lessons",
        "CurriculumService.ListLessons",
        "ListLessonsRequest",
        "ListLessonsResponse",
        |api, call| unary(api, call, |api, request| api.list_lessons(request)),
    ),
    route(
        "GET",
        "/v1/lessons/{slug}",
        "CurriculumService.GetLesson",
        "GetLessonRequest",
        "Lesson",
        |api, call| unary(api, call, |api, request| api.get_lesson(request)),
    ),
    route(
        "GET",
        "/v1/lessons/{slug}/prereqs",
        "CurriculumService.GetLessonPrereqs",
        "GetLessonPrereqsRequest",
        "GetLessonPrereqsResponse",
        |api, call| unary(api, call, |api, request| api.get_lesson_prereqs(request)),
    ),
    route(
        "GET",
        "/v1/collections",
        "CurriculumService.ListCollections",
        "ListCollectionsRequest",
        "ListCollectionsResponse",
        |api, call| unary(api, call, |api, request| api.list_collections(request)),
    ),
    route(
        "GET",
        "/v1/collections/{slug}",
        "CurriculumService.GetCollection",
        "GetCollectionRequest",
        "Collection",
        |api, call| unary(api, call, |api, request| api.get_collection(request)),
    ),
    route(
        "POST",
        "/v1/sessions",
        "SessionService.CreateSession",
        "CreateSessionRequest",
        "Session",
        |api, call| Box::pin(create_session(api, call)),
    ),
    route(
        "GET",
        "/v1/sessions/{id}",
        "SessionService.GetSession",
        "GetSessionRequest",
        "Session",
        |api, call| unary(api, call, |api, request| api.get_session(request)),
    ),
    route(
        "POST",
        "/v1/live-lessons",
        "LiveLessonService.RequestLiveLesson",
        "RequestLiveLessonRequest",
        "LiveLesson",
        |api, call| unary(api, call, |api, request| api.request_live_lesson(request)),
    ),
    route(
        "GET",
        "/v1/live-lessons",
        "LiveLessonService.ListLiveLessons",
        "ListLiveLessonsRequest",
        "ListLiveLessonsResponse",
        |api, call| {
            unary(api, call, |api, request| {
                LiveLessonService::list_live_lessons(api, request)
            })
        },
    ),
    route(
        "GET",
        "/v1/live-lessons/{id}",
        "LiveLessonService.GetLiveLesson",
        "GetLiveLessonRequest",
        "LiveLesson",
        |api, call| {
            unary(api, call, |api, request| {
                LiveLessonService::get_live_lesson(api, request)
            })
        },
    ),
    Route {
        stream: true,
        ..route(
            "GET",
            "/v1/live-lessons/{id}/watch",
            "LiveLessonService.WatchLiveLesson",
            "WatchLiveLessonRequest",
            "LiveLesson",
            |api, call| Box::pin(watch(api, call)),
        )
    },
    route(
        "POST",
        "/v1/live-lessons/{id}/heartbeat",
        "LiveLessonService.Heartbeat",
        "HeartbeatRequest",
        "HeartbeatResponse",
        |api, call| unary(api, call, |api, request| api.heartbeat(request)),
    ),
    route(
        "PUT",
        "/v1/live-lessons/{id}/stage",
        "LiveLessonService.SetStage",
        "SetStageRequest",
        "LiveLesson",
        |api, call| unary(api, call, |api, request| api.set_stage(request)),
    ),
    route(
        "POST",
        "/v1/live-lessons/{id}/check",
        "LiveLessonService.CheckStage",
        "CheckStageRequest",
        "StageCheck",
        |api, call| unary(api, call, |api, request| api.check_stage(request)),
    ),
    route(
        "DELETE",
        "/v1/live-lessons/{id}",
        "LiveLessonService.DeleteLiveLesson",
        "DeleteLiveLessonRequest",
        "DeleteLiveLessonResponse",
        |api, call| unary(api, call, |api, request| api.delete_live_lesson(request)),
    ),
    route(
        "GET",
        "/v1/admin/live-lessons",
        "AdminService.ListLiveLessons",
        "AdminListLiveLessonsRequest",
        "AdminListLiveLessonsResponse",
        |api, call| {
            unary(api, call, |api, request| {
                AdminService::list_live_lessons(api, request)
            })
        },
    ),
    route(
        "DELETE",
        "/v1/admin/live-lessons/{id}",
        "AdminService.KillLiveLesson",
        "KillLiveLessonRequest",
        "KillLiveLessonResponse",
        |api, call| unary(api, call, |api, request| api.kill_live_lesson(request)),
    ),
    route(
        "GET",
        "/v1/admin/live-lessons/{live_lesson_id}/events",
        "AdminService.ListEvents",
        "ListEventsRequest",
        "ListEventsResponse",
        |api, call| unary(api, call, |api, request| api.list_events(request)),
    ),
    route(
        "GET",
        "/v1/admin/sessions",
        "AdminService.ListSessions",
        "ListSessionsRequest",
        "ListSessionsResponse",
        |api, call| unary(api, call, |api, request| api.list_sessions(request)),
    ),
    route(
        "PUT",
        "/v1/admin/sessions/{id}/persistent",
        "AdminService.PersistSession",
        "PersistSessionRequest",
        "Session",
        |api, call| unary(api, call, |api, request| api.persist_session(request)),
    ),
    route(
        "GET",
        "/v1/admin/agents",
        "AdminService.ListAgents",
        "ListAgentsRequest",
        "ListAgentsResponse",
        |api, call| unary(api, call, |api, request| api.list_agents(request)),
    ),
    route(
        "POST",
        "/v1/admin/plan",
        "AdminService.Plan",
        "PlanRequest",
        "PlanResponse",
        |api, call| unary(api, call, |api, request| api.plan(request)),
    ),
    route(
        "GET",
        "/v1/admin/live-lessons/{id}",
        "AdminService.GetLiveLesson",
        "AdminGetLiveLessonRequest",
        "AdminLiveLesson",
        |api, call| {
            unary(api, call, |api, request| {
                AdminService::get_live_lesson(api, request)
            })
        },
    ),
    route(
        "POST",
        "/v1/admin/agents/{name}/drain",
        "AdminService.DrainAgent",
        "DrainAgentRequest",
        "Agent",
        |api, call| unary(api, call, |api, request| api.drain_agent(request)),
    ),
    route(
        "POST",
        "/v1/admin/agents/{name}/resume",
        "AdminService.ResumeAgent",
        "ResumeAgentRequest",
        "Agent",
        |api, call| unary(api, call, |api, request| api.resume_agent(request)),
    ),
    route(
        "GET",
        "/v1/admin/audit",
        "AdminService.ListAudit",
        "ListAuditRequest",
        "ListAuditResponse",
        |api, call| unary(api, call, |api, request| api.list_audit(request)),
    ),
    route(
        "GET",
        "/v1/admin/pools",
        "AdminService.ListPools",
        "ListPoolsRequest",
        "ListPoolsResponse",
        |api, call| unary(api, call, |api, request| api.list_pools(request)),
    ),
    route(
        "PUT",
        "/v1/admin/pools/{lesson_slug}/{stage}",
        "AdminService.SetPool",
        "SetPoolRequest",
        "Pool",
        |api, call| unary(api, call, |api, request| api.set_pool(request)),
    ),
    route(
        "POST",
        "/v1/admin/live-lessons/{live_lesson_id}/test",
        "AdminService.TestStage",
        "TestStageRequest",
        "StageCheck",
        |api, call| unary(api, call, |api, request| api.test_stage(request)),
    ),
];

/// The descriptor of a message of `antidote.api.v1` by its short name.
pub fn message(name: &str) -> MessageDescriptor {
    POOL.get_message_by_name(&format!("antidote.api.v1.{name}"))
        .unwrap_or_else(|| panic!("ROUTES names `{name}`, which antidote.api.v1 lacks"))
}

/// Serves one surface of the HTTP API on `listener` until `shutdown` is cancelled.
///
/// The accept loop is ours (not `axum::serve`) for the bounds axum does not offer: each client
/// address (its network) holds at most `limits.connections_per_address` connections (more are
/// closed at once), a client must send its first byte (HTTP/2: the whole preface and its first
/// SETTINGS), and then a request's headers, within `limits.header_read_timeout` each, and a
/// request's body within `limits.request_timeout` of its headers (the silent-client, slowloris
/// and slow-body guards; a late body is a 408 and the connection's end), HTTP/2 clients
/// get at most `limits.streams_per_connection` streams per connection, and every connection gets TCP_NODELAY (small answers and events must
/// leave at once: without it Nagle's algorithm and delayed ACKs held them ~40 ms; api-bench
/// measured 88 ms per lifecycle). At shutdown, connections finish their requests (bounded).
pub async fn serve(
    api: Api,
    config: &HttpConfig,
    surface: Surface,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let limits = api.config.limits.clone();
    let grace = api.config.shutdown_grace;
    let app = router(api, config, surface);
    // Cancelled once the grace is over: connections still open (SSE streams) are cut.
    let cut = CancellationToken::new();
    let quota = super::limits::Quota::new(limits.connections_per_address);
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    // HTTP/2 (h2c) clients get the gRPC listener's bounds: streams per connection, and pings
    // that close a connection whose peer is gone.
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(limits.streams_per_connection)
        .keep_alive_interval(Duration::from_secs(30));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    antidote_net::accept::each(&listener, &shutdown, |stream, peer| {
        let Some(mut stream) = super::limits::Limited::admit(stream, peer, &quota) else {
            tracing::debug!(%peer, "connection refused: its address holds its share");
            return;
        };
        let (app, builder, cut) = (app.clone(), builder.clone(), cut.clone());
        // Counted by the graceful shutdown from now on, so a connection whose first byte
        // arrives during shutdown is drained like the others.
        let watcher = graceful.watcher();
        let (opening, body_within) = (limits.header_read_timeout, limits.request_timeout);
        tokio::spawn(async move {
            // The handshake guard: hyper-util's protocol sniffing and h2's wait for the preface
            // have no timer (hyper#3756), so a client that connects and sends nothing, or drips
            // the HTTP/2 preface, would hold its socket forever.
            if !stream.opens_within(opening).await {
                tracing::debug!(%peer, "connection closed: no HTTP/1 byte or HTTP/2 preface and SETTINGS within limits.header_read_timeout");
                return;
            }
            let service = hyper::service::service_fn(
                move |mut request: hyper::Request<hyper::body::Incoming>| {
                    request.extensions_mut().insert(ConnectInfo(peer));
                    // The slow-body guard: the body is due whole within request_timeout of
                    // its headers; a late one is a 408 and the end of the connection.
                    let request = request.map(|body| {
                        axum::body::Body::new(antidote_net::BodyDeadline::new(
                            body,
                            body_within,
                        ))
                    });
                    tower::ServiceExt::oneshot(app.clone(), request)
                },
            );
            let connection = builder.serve_connection_with_upgrades(
                TokioIo::new(antidote_net::Cuttable::new(stream, &cut)),
                service,
            );
            if let Err(err) = watcher.watch(connection).await {
                tracing::debug!(error = %err, %peer, "HTTP connection ended");
            }
        });
    })
    .await;
    drop(listener);
    if tokio::time::timeout(grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            ?grace,
            "HTTP connections still open after the shutdown grace; cutting them"
        );
        cut.cancel();
    }
    Ok(())
}

/// Which routes a listener serves: the learners' never serves the admin API (its routes answer
/// 404 there), the admin listener serves only it (and `/metrics`, whose scrape counts tables
/// and names lessons and agents: for an `admin:read` token), a metrics listener only
/// `/metrics` (to anyone who reaches it: the operator's choice of network).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Surface {
    /// The learners' listener (`http.listen`).
    Learners,
    /// The operators' listener (`admin.http_listen`).
    Admin,
    /// `/metrics` and `/healthz` without a token (`admin.metrics_listen`).
    Metrics,
    /// Every route (documentation only).
    All,
}

impl Surface {
    /// Whether this surface serves `route`.
    pub fn serves(self, route: &Route) -> bool {
        let admin = route.rpc.starts_with("AdminService.");
        match self {
            Surface::Learners => !admin,
            Surface::Admin => admin,
            Surface::Metrics => false,
            Surface::All => true,
        }
    }
}

/// The HTTP application of one surface.
pub fn router(api: Api, config: &HttpConfig, surface: Surface) -> axum::Router {
    let mut router = axum::Router::new();
    for route in ROUTES.iter().filter(|r| surface.serves(r)) {
        router = router.route(route.path, method_router(route));
    }
    match surface {
        // Behind `admin:read`, as every admin call is.
        Surface::Admin => router = router.route("/metrics", get(guarded_metrics)),
        Surface::Metrics => router = router.route("/metrics", get(metrics)),
        Surface::Learners | Surface::All => {}
    }
    if surface == Surface::Learners {
        router = page::routes(router);
    }
    let document = Arc::new(openapi::document_of(surface).to_string());
    router = router
        .route(
            "/openapi.json",
            get(move || {
                let document = document.clone();
                async move {
                    (
                        [(header::CONTENT_TYPE, "application/json")],
                        document.as_str().to_owned(),
                    )
                }
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .method_not_allowed_fallback(|method: Method, uri: axum::http::Uri| async move {
            (
                StatusCode::METHOD_NOT_ALLOWED,
                axum::Json(error_body(
                    Code::Unimplemented,
                    ErrorReason::RouteNotFound.as_str_name(),
                    &format!("{} does not take {method}: see /openapi.json", uri.path()),
                    &HashMap::new(),
                )),
            )
        })
        .fallback(|method: Method, uri: axum::http::Uri| async move {
            error(
                Code::NotFound,
                ErrorReason::RouteNotFound,
                format!("no route {method} {}: see /openapi.json", uri.path()),
            )
        });
    let router = router.with_state(api);
    match cors(&config.cors_origins) {
        Some(cors) => router.layer(cors),
        None => router,
    }
}

fn cors(origins: &[String]) -> Option<CorsLayer> {
    if origins.is_empty() {
        return None;
    }
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(
            origins
                .iter()
                .filter_map(|origin| HeaderValue::from_str(origin).ok()),
        )
    };
    Some(
        CorsLayer::new()
            .allow_origin(allow)
            .allow_methods([Method::GET, Method::POST, Method::PUT, Method::DELETE])
            .allow_headers([
                header::CONTENT_TYPE,
                header::HeaderName::from_static("traceparent"),
                header::HeaderName::from_static("tracestate"),
            ])
            .max_age(Duration::from_secs(600)),
    )
}

/// `/metrics` on the admin listener: for a token with `admin:read` (401 without one, 403
/// without the scope, in the API's error shape). Scrapes are not written to the audit log
/// (one every few seconds would fill it); refusals are logged.
async fn guarded_metrics(
    State(api): State<Api>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
) -> Response {
    let metadata = tonic::metadata::MetadataMap::from_headers(headers);
    match api
        .admin_auth
        .check(&metadata, crate::settings::Scope::Read)
    {
        Ok(_) => metrics(State(api)).await,
        Err((identity, err)) => {
            tracing::info!(target: "audit", %identity, %peer, action = "metrics", outcome = ?err.reason().0, "admin call refused");
            status_response(&tonic::Status::from(err))
        }
    }
}

async fn metrics(State(api): State<Api>) -> Response {
    match api.store.counts().await {
        Ok(counts) => (
            [(header::CONTENT_TYPE, antidote_net::metrics::CONTENT_TYPE)],
            api.metrics.render(
                &counts,
                api.fleet
                    .agents()
                    .iter()
                    .map(|a| (a.name.as_str(), a.is_ready())),
            ),
        )
            .into_response(),
        Err(err) => error(
            Code::Unavailable,
            ErrorReason::InternalError,
            format!("cannot count live lessons: {err}"),
        ),
    }
}

/// What every handler gets: its route, the route's fields as JSON, the caller's address and
/// headers.
struct Call {
    /// Names the request and response messages for transcoding.
    route: &'static Route,
    /// The request message's fields, from the path, the query or the body.
    fields: serde_json::Map<String, serde_json::Value>,
    /// The caller, for per-IP limits (what tonic would see).
    peer: SocketAddr,
    /// For `x-forwarded-for`.
    headers: HeaderMap,
}

fn method_router(route: &'static Route) -> MethodRouter<Api> {
    let handler = move |State(api): State<Api>,
                        ConnectInfo(peer): ConnectInfo<SocketAddr>,
                        params: Result<Path<HashMap<String, String>>, PathRejection>,
                        query: Result<Query<Vec<(String, String)>>, QueryRejection>,
                        headers: HeaderMap,
                        body: Result<Bytes, BytesRejection>| async move {
        let span = tracing::info_span!("http", http.route = route.path, rpc = route.rpc);
        antidote_net::trace::set_parent(&span, &headers);
        // Current while the call runs, so that it is passed on without recorded spans too.
        let context = antidote_net::trace::extract(&headers);
        async move {
            // Axum's own refusals, in the API's error shape.
            let (params, query, body) = match (params, query, body) {
                (Ok(Path(params)), Ok(Query(query)), Ok(body)) => (params, query, body),
                (Err(err), _, _) => return rejection(err.status(), err.body_text()),
                (_, Err(err), _) => return rejection(err.status(), err.body_text()),
                (_, _, Err(err)) => {
                    if let Some(timed_out) = antidote_net::BodyTimedOut::within(&err) {
                        return body_timed_out(timed_out);
                    }
                    return rejection(err.status(), err.body_text());
                }
            };
            // Only JSON bodies: a form or text/plain POST is a "simple" cross-site request that
            // browsers send without asking CORS first; requiring JSON makes them ask.
            if route.body && !is_json(&headers) {
                return rejection(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    format!(
                        "{} {} takes `content-type: application/json` (an empty body is `{{}}` or nothing)",
                        route.method, route.path
                    ),
                );
            }
            let fields = match fields(route, params, query, &body) {
                Ok(fields) => fields,
                Err(message) => {
                    return error(Code::InvalidArgument, ErrorReason::MalformedRequest, message);
                }
            };
            (route.run)(
                api,
                Call {
                    route,
                    fields,
                    peer,
                    headers,
                },
            )
            .await
        }
        .instrument(span)
        .with_context(context)
        .await
    };
    let handler = axum::routing::on(
        match route.method {
            "GET" => axum::routing::MethodFilter::GET,
            "POST" => axum::routing::MethodFilter::POST,
            "PUT" => axum::routing::MethodFilter::PUT,
            _ => axum::routing::MethodFilter::DELETE,
        },
        handler,
    );
    handler.layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
}

fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|essence| essence.trim().eq_ignore_ascii_case("application/json"))
}

/// A refusal by the HTTP layer itself (size, encoding, media type), as an INVALID_ARGUMENT error
/// with the HTTP status that says what happened (413, 415, 400).
fn rejection(status: StatusCode, message: String) -> Response {
    let reason = if status == StatusCode::PAYLOAD_TOO_LARGE {
        ErrorReason::RequestTooLarge
    } else {
        ErrorReason::MalformedRequest
    };
    let body = error_body(
        Code::InvalidArgument,
        reason.as_str_name(),
        &message,
        &HashMap::new(),
    );
    (status, axum::Json(body)).into_response()
}

/// The answer to a body that did not arrive within `limits.request_timeout`: 408,
/// DEADLINE_EXCEEDED with reason REQUEST_TIMEOUT, and the connection closed (the rest of the
/// body is never read).
fn body_timed_out(timed_out: antidote_net::BodyTimedOut) -> Response {
    let body = error_body(
        Code::DeadlineExceeded,
        ErrorReason::RequestTimeout.as_str_name(),
        &format!(
            "the request body did not arrive within limits.request_timeout ({:?})",
            timed_out.0
        ),
        &HashMap::from([("timeout".to_owned(), format!("{:?}", timed_out.0))]),
    );
    (
        StatusCode::REQUEST_TIMEOUT,
        [(header::CONNECTION, HeaderValue::from_static("close"))],
        axum::Json(body),
    )
        .into_response()
}

/// Path parameters, then the query or the body, as one JSON object of request fields.
fn fields(
    route: &Route,
    params: HashMap<String, String>,
    query: Vec<(String, String)>,
    body: &[u8],
) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    let input = message(route.input);
    let mut fields = serde_json::Map::new();
    if route.body && !body.iter().all(u8::is_ascii_whitespace) {
        match serde_json::from_slice::<serde_json::Value>(body) {
            Ok(serde_json::Value::Object(object)) => fields = object,
            Ok(_) => return Err("the body must be a JSON object".into()),
            Err(err) => return Err(format!("the body is not JSON: {err}")),
        }
    } else if !route.body {
        for (name, value) in query {
            let value =
                scalar(&input, &name, value).map_err(|why| format!("query `{name}`: {why}"))?;
            fields.insert(name, value);
        }
    }
    for (name, value) in params {
        let value = scalar(&input, &name, value).map_err(|why| format!("path `{name}`: {why}"))?;
        if let Some(other) = fields.insert(name.clone(), value.clone())
            && other != value
        {
            return Err(format!(
                "`{name}` is `{value}` in the path but `{other}` in the body"
            ));
        }
    }
    Ok(fields)
}

/// A query or path string as the JSON value the field's type takes.
fn scalar(
    input: &MessageDescriptor,
    name: &str,
    value: String,
) -> Result<serde_json::Value, String> {
    let field = input
        .get_field_by_name(name)
        .or_else(|| input.get_field_by_json_name(name))
        .ok_or_else(|| {
            let known: Vec<_> = input.fields().map(|f| f.name().to_owned()).collect();
            format!(
                "no such field in {} (fields: {})",
                input.name(),
                known.join(", ")
            )
        })?;
    if field.is_list() || field.is_map() {
        return Err("not settable from a URL".into());
    }
    Ok(match field.kind() {
        Kind::Bool => match value.as_str() {
            "true" | "1" => serde_json::Value::Bool(true),
            "false" | "0" => serde_json::Value::Bool(false),
            _ => return Err(format!("`{value}` is not true or false")),
        },
        // An enum by name, or by number as proto3 JSON allows.
        Kind::Enum(_) => match value.parse::<i64>() {
            Ok(number) => serde_json::Value::from(number),
            Err(_) => serde_json::Value::String(value),
        },
        Kind::Uint32 | Kind::Fixed32 | Kind::Int32 | Kind::Sint32 | Kind::Sfixed32 => {
            let number: i64 = value
                .parse()
                .map_err(|_| format!("`{value}` is not an integer"))?;
            serde_json::Value::from(number)
        }
        _ => serde_json::Value::String(value),
    })
}

/// Decodes the request message from JSON fields (proto3 JSON mapping, unknown names refused).
fn decode<T: prost::Message + Default>(
    route: &Route,
    fields: serde_json::Map<String, serde_json::Value>,
) -> Result<T, tonic::Status> {
    // Track where in the JSON a value is refused, so the message names the field.
    let mut track = serde_path_to_error::Track::new();
    let deserializer =
        serde_path_to_error::Deserializer::new(serde_json::Value::Object(fields), &mut track);
    let dynamic =
        DynamicMessage::deserialize(message(route.input), deserializer).map_err(|err| {
            let path = track.path().to_string();
            let (field, metadata) = if path == "." {
                (String::new(), None)
            } else {
                (format!(" field `{path}`"), Some(("field", path.clone())))
            };
            errors::status(
                Code::InvalidArgument,
                ErrorReason::MalformedRequest.as_str_name(),
                format!("{}{field}: {err}", route.input),
                metadata,
            )
        })?;
    T::decode(dynamic.encode_to_vec().as_slice()).map_err(|err| {
        errors::status(
            Code::Internal,
            ErrorReason::InternalError.as_str_name(),
            format!("transcoding {}: {err}", route.input),
            [],
        )
    })
}

/// A response message as JSON (proto3 JSON mapping, defaults included).
pub fn encode<T: prost::Message>(output: &MessageDescriptor, message: &T) -> serde_json::Value {
    let bytes = message.encode_to_vec();
    match DynamicMessage::decode(output.clone(), bytes.as_slice()) {
        Ok(dynamic) => dynamic
            .serialize_with_options(
                serde_json::value::Serializer,
                &SerializeOptions::new().skip_default_fields(false),
            )
            .unwrap_or(serde_json::Value::Null),
        Err(_) => serde_json::Value::Null,
    }
}

/// The tonic request a gRPC client would have sent: the message, the caller's address (for
/// per-IP limits), `x-forwarded-for` when present.
fn request<T>(message: T, call: &Call) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Some(forwarded) = call.headers.get("x-forwarded-for")
        && let Ok(value) = forwarded.to_str()
        && let Ok(value) = value.parse()
    {
        request.metadata_mut().insert("x-forwarded-for", value);
    }
    // The learner's session token: the `authorization` header, or else the session cookie
    // (browsers' EventSource cannot send headers).
    let authorization = call
        .headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .or_else(|| session_cookie(&call.headers).map(|token| format!("Bearer {token}")));
    if let Some(value) = authorization.and_then(|v| v.parse().ok()) {
        request.metadata_mut().insert("authorization", value);
    }
    request.extensions_mut().insert(TcpConnectInfo {
        local_addr: None,
        remote_addr: Some(call.peer),
    });
    request
}

/// The session token in the `antidote_session` cookie, if any.
fn session_cookie(headers: &HeaderMap) -> Option<&str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| *name == auth::SESSION_COOKIE)
        .map(|(_, value)| value)
}

/// CreateSession: the answer as JSON, and the token also as an HttpOnly, SameSite=Strict cookie
/// for the API's paths, so a page's EventSource (which cannot send headers) is authenticated
/// and scripts cannot read it.
async fn create_session(api: Api, mut call: Call) -> Response {
    let decoded =
        match decode::<api::CreateSessionRequest>(call.route, std::mem::take(&mut call.fields)) {
            Ok(decoded) => decoded,
            Err(status) => return status_response(&status),
        };
    let timeout = api.config.limits.request_timeout;
    match bounded(timeout, api.create_session(request(decoded, &call))).await {
        Ok(response) => {
            let session = response.into_inner();
            // `Secure` when the learner reached us over TLS: the scheduler serves plain HTTP, so
            // TLS is a proxy's (an ingress or mesh), which says so in `X-Forwarded-Proto`.
            let secure = if over_tls(&call.headers) {
                "; Secure"
            } else {
                ""
            };
            let cookie = format!(
                "{}={}; Path=/v1; HttpOnly; SameSite=Strict; Max-Age={}{secure}",
                auth::SESSION_COOKIE,
                session.token,
                api.config.ttl.session.as_secs()
            );
            let body = axum::Json(encode(&message(call.route.output), &session));
            match HeaderValue::from_str(&cookie) {
                Ok(cookie) => ([(header::SET_COOKIE, cookie)], body).into_response(),
                Err(_) => body.into_response(),
            }
        }
        Err(status) => status_response(&status),
    }
}

/// `call`, or DEADLINE_EXCEEDED once it has run `timeout` (`limits.request_timeout`, as on the
/// gRPC listener).
async fn bounded<T>(
    timeout: Duration,
    call: impl Future<Output = Result<T, tonic::Status>>,
) -> Result<T, tonic::Status> {
    tokio::time::timeout(timeout, call)
        .await
        .unwrap_or_else(|_| {
            Err(tonic::Status::deadline_exceeded(format!(
                "the call ran longer than limits.request_timeout ({timeout:?})"
            )))
        })
}

/// Whether the request reached the proxy in front of us over TLS (`X-Forwarded-Proto: https`
/// or `Forwarded: proto=https`).
fn over_tls(headers: &HeaderMap) -> bool {
    let says_https = |value: &str| value.trim().eq_ignore_ascii_case("https");
    headers
        .get("x-forwarded-proto")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').next().is_some_and(says_https))
        || headers
            .get(header::FORWARDED)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| {
                v.split([';', ','])
                    .filter_map(|pair| pair.trim().split_once('='))
                    .any(|(k, v)| {
                        k.eq_ignore_ascii_case("proto") && says_https(v.trim_matches('"'))
                    })
            })
}

/// Runs a unary RPC: decodes the request, calls the handler, answers its response as JSON.
fn unary<Req, Resp>(api: Api, mut call: Call, rpc: Rpc<Req, Resp>) -> BoxFuture<'static, Response>
where
    Req: prost::Message + Default + 'static,
    Resp: prost::Message + 'static,
{
    Box::pin(async move {
        let decoded = match decode::<Req>(call.route, std::mem::take(&mut call.fields)) {
            Ok(decoded) => decoded,
            Err(status) => return status_response(&status),
        };
        let timeout = api.config.limits.request_timeout;
        match bounded(timeout, rpc(&api, request(decoded, &call))).await {
            Ok(response) => {
                axum::Json(encode(&message(call.route.output), response.get_ref())).into_response()
            }
            Err(status) => status_response(&status),
        }
    })
}

/// Runs `WatchLiveLesson`: decodes the request, answers server-sent events.
async fn watch(api: Api, mut call: Call) -> Response {
    let fields = std::mem::take(&mut call.fields);
    let decoded = match decode::<api::WatchLiveLessonRequest>(call.route, fields) {
        Ok(decoded) => decoded,
        Err(status) => return status_response(&status),
    };
    let stream = match api.watch_live_lesson(request(decoded, &call)).await {
        Ok(response) => response.into_inner(),
        Err(status) => return status_response(&status),
    };
    Sse::new(events(stream, message(call.route.output)))
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}

/// Each update as `event: live_lesson`; a failure as `event: error`, which ends the stream.
fn events<S>(stream: S, output: MessageDescriptor) -> impl Stream<Item = Result<Event, Infallible>>
where
    S: Stream<Item = Result<api::LiveLesson, tonic::Status>> + Send + 'static,
{
    stream
        .scan(false, |failed, item| {
            if *failed {
                return std::future::ready(None);
            }
            *failed = item.is_err();
            std::future::ready(Some(item))
        })
        .map(move |item| {
            Ok(match item {
                Ok(lesson) => Event::default()
                    .event("live_lesson")
                    .json_data(encode(&output, &lesson))
                    .unwrap_or_default(),
                Err(status) => Event::default()
                    .event("error")
                    .json_data(status_body(&status))
                    .unwrap_or_default(),
            })
        })
}

/// The HTTP status grpc-gateway gives a gRPC code.
pub fn http_status(code: Code) -> StatusCode {
    match code {
        Code::Ok => StatusCode::OK,
        Code::Cancelled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
        Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => {
            StatusCode::BAD_REQUEST
        }
        Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::Unknown | Code::Internal | Code::DataLoss => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// The code's name as in google.rpc.Code (`NOT_FOUND`).
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// The JSON error: the gRPC code's name, the typed reason (an `antidote.api.v1.ErrorReason`
/// value name, what clients decide on), the message for people and the reason's metadata.
fn error_body(
    code: Code,
    reason: &str,
    message: &str,
    metadata: &HashMap<String, String>,
) -> serde_json::Value {
    serde_json::json!({
        "code": code_name(code),
        "reason": reason,
        "message": message,
        "metadata": metadata,
    })
}

/// The JSON error of a status, with the reason and metadata of its ErrorInfo.
fn status_body(status: &tonic::Status) -> serde_json::Value {
    let (reason, metadata) = errors::reason(status).unwrap_or_else(|| {
        (
            ErrorReason::InternalError.as_str_name().to_owned(),
            HashMap::new(),
        )
    });
    error_body(status.code(), &reason, status.message(), &metadata)
}

/// An error of the HTTP layer itself (no handler ran).
fn error(code: Code, reason: ErrorReason, message: String) -> Response {
    let body = error_body(code, reason.as_str_name(), &message, &HashMap::new());
    (http_status(code), axum::Json(body)).into_response()
}

fn status_response(status: &tonic::Status) -> Response {
    (http_status(status.code()), axum::Json(status_body(status))).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_route_names_real_messages_and_path_fields() {
        for route in ROUTES {
            let input = message(route.input);
            message(route.output);
            for part in route.path.split('/') {
                if let Some(name) = part.strip_prefix('{').and_then(|p| p.strip_suffix('}')) {
                    assert!(
                        input.get_field_by_name(name).is_some(),
                        "{}: `{name}` is not a field of {}",
                        route.path,
                        route.input
                    );
                }
            }
        }
    }

    #[test]
    fn every_route_agrees_with_its_rpc_descriptor() {
        let mut rpcs = std::collections::HashSet::new();
        for route in ROUTES {
            assert!(rpcs.insert(route.rpc), "{} has two routes", route.rpc);
            let (service, method) = route.rpc.split_once('.').unwrap();
            let service = POOL
                .get_service_by_name(&format!("antidote.api.v1.{service}"))
                .unwrap_or_else(|| panic!("{}: no such service", route.rpc));
            let method = service
                .methods()
                .find(|m| m.name() == method)
                .unwrap_or_else(|| panic!("{}: no such method", route.rpc));
            assert_eq!(method.input(), message(route.input), "{}", route.rpc);
            assert_eq!(method.output(), message(route.output), "{}", route.rpc);
            assert_eq!(method.is_server_streaming(), route.stream, "{}", route.rpc);
        }
        let methods: usize = POOL
            .services()
            .filter(|s| s.package_name() == "antidote.api.v1")
            .map(|s| s.methods().len())
            .sum();
        assert_eq!(
            rpcs.len(),
            methods,
            "every RPC of antidote.api.v1 has a route"
        );
    }

    #[test]
    fn query_values_take_their_field_type() {
        let route = ROUTES
            .iter()
            .find(|r| r.rpc == "AdminService.ListLiveLessons")
            .unwrap();
        let fields = fields(
            route,
            HashMap::new(),
            vec![("status".into(), "LIVE_LESSON_STATUS_READY".into())],
            b"",
        )
        .unwrap();
        let request: api::AdminListLiveLessonsRequest = decode(route, fields).unwrap();
        assert_eq!(request.status, api::LiveLessonStatus::Ready as i32);
        let err = super::fields(
            route,
            HashMap::new(),
            vec![("colour".into(), "x".into())],
            b"",
        )
        .unwrap_err();
        assert!(
            err.contains("colour") && err.contains("lesson_slug"),
            "{err}"
        );
    }

    #[test]
    fn bodies_are_checked_against_the_message() {
        let route = ROUTES
            .iter()
            .find(|r| r.rpc == "LiveLessonService.RequestLiveLesson")
            .unwrap();
        let fields = fields(
            route,
            HashMap::new(),
            Vec::new(),
            br#"{"sessionId": "s", "lesson_slug": "hello-web", "stage": 1}"#,
        )
        .unwrap();
        let request: api::RequestLiveLessonRequest = decode(route, fields).unwrap();
        assert_eq!(request.lesson_slug, "hello-web");
        assert_eq!(request.stage, 1);
        let fields =
            super::fields(route, HashMap::new(), Vec::new(), br#"{"stage": "two"}"#).unwrap();
        let err = decode::<api::RequestLiveLessonRequest>(route, fields).unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert!(err.message().contains("RequestLiveLessonRequest"), "{err}");
        assert!(err.message().contains("field `stage`"), "{err}");
        assert!(super::fields(route, HashMap::new(), Vec::new(), b"[1]").is_err());
    }

    #[test]
    fn answers_use_the_proto3_json_mapping() {
        let lesson = api::LiveLesson {
            id: "x".into(),
            status: api::LiveLessonStatus::Ready as i32,
            created_at: Some(prost_types::Timestamp {
                seconds: 0,
                nanos: 0,
            }),
            ..Default::default()
        };
        let json = encode(&message("LiveLesson"), &lesson);
        assert_eq!(json["status"], "LIVE_LESSON_STATUS_READY");
        assert_eq!(json["createdAt"], "1970-01-01T00:00:00Z");
        assert_eq!(
            json["stage"],
            serde_json::json!(0),
            "defaults are shown: {json}"
        );
        assert_eq!(
            json["generation"], "0",
            "64-bit integers are strings: {json}"
        );
    }
}
