//! The JSON/HTTP API's request decoding (`scheduler_svc::api::http`), through the real router.
//!
//! The router is the public entry point of decoding (path parameters, query strings and JSON
//! bodies become request messages through the descriptor set); its handlers run on an `Api`
//! with a real store in a temporary directory, the example curriculum and no agent. Requests
//! are drawn from `ROUTES` and each route's request descriptor, so new routes and fields are
//! fuzzed without changing this file. Properties:
//! - `valid_requests_are_decoded`: a request whose fields all have values of their type (in
//!   the path, query or body, by the field's name or JSON name) is never refused by decoding;
//!   whatever the handler answers is a well-formed answer.
//! - `mutated_requests_are_answered_well`: after mutations of the body (bytes, JSON values,
//!   unknown and duplicate fields), query, path, method and headers, the answer is JSON: 2xx,
//!   or an error with a known code, a known reason and a message, and the HTTP status of its
//!   code; never 500, never a panic, never slow.

use std::net::SocketAddr;
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::connect_info::MockConnectInfo;
use axum::http::{Method, Request, StatusCode, header};
use proptest::prelude::*;
use proptest::sample::select;
use proptest::strategy::{BoxedStrategy, Union};
use proptest::test_runner::TestCaseError;
use prost_reflect::{FieldDescriptor, Kind, MessageDescriptor};
use scheduler_svc::agents::Fleet;
use scheduler_svc::api::http::{self, ROUTES, Route, Surface};
use scheduler_svc::api::{Api, Watches};
use scheduler_svc::catalog::{Catalog, Tier};
use scheduler_svc::drive::{Hub, Identity, Reconciler, ReconcilerParts, Roster};
use scheduler_svc::metrics::Metrics;
use scheduler_svc::settings::Config;
use scheduler_svc::store::Store;
use serde_json::{Map, Value, json};
use tokio_util::sync::CancellationToken;
use tower::ServiceExt as _;

use crate::fuzz;

/// The longest one request may take; far above the slowest seen, so only a blow-up trips it.
const SLOW: Duration = Duration::from_secs(2);

/// An `Api` on a fresh store, and the router serving every route of it.
struct Server {
    runtime: tokio::runtime::Runtime,
    router: axum::Router,
    slugs: Vec<String>,
    _dir: tempfile::TempDir,
}

static SERVER: LazyLock<Server> = LazyLock::new(|| {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let dir = tempfile::tempdir().expect("temporary directory");
    let curriculum = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/curriculum");
    let catalog = Arc::new(Catalog::load(&curriculum, Tier::Local).expect("example curriculum"));
    let slugs = catalog.lessons.keys().cloned().collect();
    let config = Arc::new(Config::default());
    let store = runtime
        .block_on(Store::open(&dir.path().join("fuzz.db")))
        .expect("store");
    let metrics = Arc::new(Metrics::default());
    let fleet = Arc::new(
        Fleet::new(&config.agents, &config.reconciler, metrics.clone()).expect("empty fleet"),
    );
    let hub = Arc::new(Hub::default());
    // Never started: requests only enqueue, and no generated request names a live lesson
    // that exists.
    let roster = Arc::new(
        runtime
            .block_on(Roster::new(
                store.clone(),
                fleet.clone(),
                &config.agents,
                config.reconciler.agent_grace,
                metrics.clone(),
            ))
            .expect("roster"),
    );
    let reconciler = Reconciler::new(ReconcilerParts {
        store: store.clone(),
        catalog: catalog.clone(),
        fleet: fleet.clone(),
        roster,
        hub: hub.clone(),
        config: config.reconciler.clone(),
        identity: Identity {
            instance_id: config.instance_id.clone(),
            cluster_id: "fuzz".into(),
            replica: None,
        },
        replicas: config.replicas.clone(),
        metrics: metrics.clone(),
    });
    let pools = scheduler_svc::drive::Pools::new(
        store.clone(),
        catalog.clone(),
        reconciler.clone(),
        config.pools.clone(),
        None,
        metrics.clone(),
        None,
    )
    .expect("the default pools configuration");
    let api = Api {
        pools,
        store,
        catalog,
        reconciler,
        hub,
        fleet,
        config: config.clone(),
        shutdown: CancellationToken::new(),
        metrics,
        admin_auth: Arc::default(),
        watches: Watches::new(&config.limits),
        entrypoint: Arc::default(),
        checks: Arc::new(scheduler_svc::api::checks::Checks::new(
            config.limits.checks_per_minute,
        )),
    };
    let router = http::router(api, &config.http, Surface::All)
        .layer(MockConnectInfo(SocketAddr::from(([127, 0, 0, 1], 40000))));
    Server {
        runtime,
        router,
        slugs,
        _dir: dir,
    }
});

/// One HTTP request, as sent.
#[derive(Debug, Clone)]
struct HttpRequest {
    route: usize,
    method: String,
    path: Vec<String>,
    query: Vec<(String, String)>,
    raw_query: String,
    content_type: Option<String>,
    headers: Vec<(&'static str, String)>,
    body: Vec<u8>,
}

/// Percent-encodes everything but RFC 3986's unreserved characters.
fn encode(text: &str) -> String {
    let mut out = String::new();
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

impl HttpRequest {
    fn uri(&self) -> String {
        let mut uri = String::new();
        for segment in &self.path {
            uri.push('/');
            uri.push_str(segment);
        }
        let mut query: Vec<String> = self
            .query
            .iter()
            .map(|(name, value)| format!("{}={}", encode(name), encode(value)))
            .collect();
        if !self.raw_query.is_empty() {
            query.push(self.raw_query.clone());
        }
        if !query.is_empty() {
            uri.push('?');
            uri.push_str(&query.join("&"));
        }
        uri
    }
}

/// What the server answered.
#[derive(Debug)]
struct Answer {
    status: StatusCode,
    event_stream: bool,
    json: Option<Value>,
}

/// Sends `request` through the router; `None` if it is not even an HTTP request (a URI or
/// header the `http` crate refuses, which no server would receive).
fn send(request: &HttpRequest) -> Result<Option<Answer>, TestCaseError> {
    let server = &*SERVER;
    let Ok(method) = Method::from_bytes(request.method.as_bytes()) else {
        return Ok(None);
    };
    let mut builder = Request::builder().method(method).uri(request.uri());
    if let Some(content_type) = &request.content_type {
        builder = builder.header(header::CONTENT_TYPE, content_type.as_str());
    }
    for (name, value) in &request.headers {
        builder = builder.header(*name, value.as_str());
    }
    let Ok(http_request) = builder.body(Body::from(request.body.clone())) else {
        return Ok(None);
    };
    let started = Instant::now();
    let answer = server.runtime.block_on(async {
        let response = server
            .router
            .clone()
            .oneshot(http_request)
            .await
            .expect("the router is infallible");
        let status = response.status();
        let event_stream = response
            .headers()
            .get(header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
        if event_stream {
            // A stream never ends by itself; its first event is not decoding's business.
            return Answer {
                status,
                event_stream,
                json: None,
            };
        }
        let body = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .expect("bodies are in memory");
        Answer {
            status,
            event_stream,
            json: serde_json::from_slice(&body).ok(),
        }
    });
    let took = started.elapsed();
    prop_assert!(took < SLOW, "the request took {took:?}");
    Ok(Some(answer))
}

/// Every code name of google.rpc.Code, with the HTTP status grpc-gateway gives it.
fn code_status(name: &str) -> Option<StatusCode> {
    use tonic::Code;
    let codes = [
        Code::Cancelled,
        Code::Unknown,
        Code::InvalidArgument,
        Code::DeadlineExceeded,
        Code::NotFound,
        Code::AlreadyExists,
        Code::PermissionDenied,
        Code::ResourceExhausted,
        Code::FailedPrecondition,
        Code::Aborted,
        Code::OutOfRange,
        Code::Unimplemented,
        Code::Internal,
        Code::Unavailable,
        Code::DataLoss,
        Code::Unauthenticated,
    ];
    codes
        .into_iter()
        .find(|code| http::code_name(*code) == name)
        .map(http::http_status)
}

/// Checks any answer: JSON; an error names a known code and reason, has a message, and has the
/// HTTP status of its code (the HTTP layer's own refusals say what happened with 413, 415, 405
/// or 400); nothing is an internal error.
fn answer_is_well_formed(
    request: &HttpRequest,
    answer: &Answer,
) -> Result<&'static str, TestCaseError> {
    let route = &ROUTES[request.route];
    if answer.event_stream {
        prop_assert_eq!(answer.status, StatusCode::OK);
        return Ok("event stream");
    }
    if request.method == "HEAD" {
        // Answered like GET, without the body.
        return Ok("head");
    }
    let Some(json) = &answer.json else {
        return Err(TestCaseError::fail(format!(
            "{}: the answer is not JSON",
            answer.status
        )));
    };
    if answer.status.is_success() {
        return Ok("success");
    }
    let field = |name: &str| json.get(name).and_then(Value::as_str);
    let (Some(code), Some(reason), Some(message)) =
        (field("code"), field("reason"), field("message"))
    else {
        return Err(TestCaseError::fail(format!("not an error body: {json}")));
    };
    prop_assert!(json.get("metadata").is_some_and(Value::is_object), "{json}");
    prop_assert!(!message.is_empty(), "{json}");
    prop_assert!(
        antidote_proto::api::v1::ErrorReason::from_str_name(reason).is_some(),
        "unknown reason: {json}"
    );
    prop_assert!(
        answer.status.as_u16() < 500 || code == "UNAVAILABLE",
        "{}: {json}",
        answer.status
    );
    prop_assert!(reason != "INTERNAL_ERROR", "{}: {json}", answer.status);
    let Some(status) = code_status(code) else {
        return Err(TestCaseError::fail(format!("unknown code: {json}")));
    };
    let refusal = [
        StatusCode::PAYLOAD_TOO_LARGE,
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        StatusCode::METHOD_NOT_ALLOWED,
        StatusCode::BAD_REQUEST,
    ];
    prop_assert!(
        answer.status == status || refusal.contains(&answer.status),
        "{} for {code}: {json}",
        answer.status
    );
    if reason == "MALFORMED_REQUEST" && !message.starts_with("the body") {
        // What was malformed is named: a field, a parameter, a header, a type (prost-reflect
        // quotes names with ', ours with `).
        prop_assert!(message.contains(['`', '\'']), "names nothing: {json}");
    }
    Ok(if is_decoding_refusal(route, json) {
        "refused by decoding"
    } else {
        "refused by the handler"
    })
}

/// Whether an error answer is decoding's (or the HTTP layer's) refusal rather than the
/// handler's verdict on well-typed values.
fn is_decoding_refusal(route: &Route, json: &Value) -> bool {
    let reason = json
        .get("reason")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let message = json
        .get("message")
        .and_then(Value::as_str)
        .unwrap_or_default();
    matches!(
        reason,
        "MALFORMED_REQUEST" | "ROUTE_NOT_FOUND" | "REQUEST_TOO_LARGE" | "INTERNAL_ERROR"
    ) || message.starts_with(&format!("{}:", route.input))
        || message.starts_with(&format!("{} field", route.input))
}

// ---- valid requests, from the descriptors ----

/// A valid value for a field of `kind` as the proto3 JSON mapping writes it.
fn json_scalar(kind: &Kind, slugs: &[String], depth: u32) -> BoxedStrategy<Value> {
    match kind {
        Kind::Bool => any::<bool>().prop_map(Value::Bool).boxed(),
        Kind::String => prop_oneof![
            "\\PC{0,20}",
            select(slugs.to_vec()),
            any::<u128>().prop_map(|n| uuid::Uuid::from_u128(n).to_string()),
        ]
        .prop_map(Value::String)
        .boxed(),
        Kind::Bytes => proptest::collection::vec(any::<u8>(), 0..16)
            .prop_map(|bytes| Value::String(self::base64::encode(&bytes)))
            .boxed(),
        Kind::Int32 | Kind::Sint32 | Kind::Sfixed32 => prop_oneof![
            any::<i32>().prop_map(Value::from),
            any::<i32>().prop_map(|n| Value::String(n.to_string())),
        ]
        .boxed(),
        Kind::Uint32 | Kind::Fixed32 => prop_oneof![
            any::<u32>().prop_map(Value::from),
            any::<u32>().prop_map(|n| Value::String(n.to_string())),
        ]
        .boxed(),
        Kind::Int64 | Kind::Sint64 | Kind::Sfixed64 => prop_oneof![
            any::<i64>().prop_map(|n| Value::String(n.to_string())),
            (-(1i64 << 53)..(1i64 << 53)).prop_map(Value::from),
        ]
        .boxed(),
        Kind::Uint64 | Kind::Fixed64 => prop_oneof![
            any::<u64>().prop_map(|n| Value::String(n.to_string())),
            (0..(1u64 << 53)).prop_map(Value::from),
        ]
        .boxed(),
        Kind::Float | Kind::Double => prop_oneof![
            (-1e6f64..1e6).prop_map(Value::from),
            select(&["NaN", "Infinity", "-Infinity"][..]).prop_map(Value::from),
        ]
        .boxed(),
        Kind::Enum(descriptor) => {
            let values: Vec<(String, i32)> = descriptor
                .values()
                .map(|v| (v.name().to_owned(), v.number()))
                .collect();
            select(values)
                .prop_flat_map(|(name, number)| {
                    prop_oneof![Just(Value::String(name)), Just(Value::from(number))]
                })
                .boxed()
        }
        Kind::Message(descriptor) => json_message(descriptor, slugs, depth),
    }
}

/// A valid JSON object for `message`, `depth` messages deep at most.
fn json_message(message: &MessageDescriptor, slugs: &[String], depth: u32) -> BoxedStrategy<Value> {
    match message.full_name() {
        "google.protobuf.Timestamp" => (0i64..253_402_300_799, 0u32..1_000_000_000)
            .prop_map(|(seconds, nanos)| {
                let time = rfc3339(seconds, nanos);
                Value::String(time)
            })
            .boxed(),
        "google.protobuf.Duration" => (0i64..315_576_000_000, 0u32..1_000_000_000)
            .prop_map(|(seconds, nanos)| Value::String(format!("{seconds}.{nanos:09}s")))
            .boxed(),
        _ if depth == 0 => Just(json!({})).boxed(),
        _ => {
            let fields: Vec<FieldDescriptor> = message.fields().collect();
            let values: Vec<BoxedStrategy<Option<(String, Value)>>> = fields
                .iter()
                .map(|field| {
                    let names = (field.name().to_owned(), field.json_name().to_owned());
                    proptest::option::of((any::<bool>(), json_field(field, slugs, depth - 1)))
                        .prop_map(move |value| {
                            value.map(|(json_name, value)| {
                                let name = if json_name { &names.1 } else { &names.0 };
                                (name.clone(), value)
                            })
                        })
                        .boxed()
                })
                .collect();
            values
                .prop_map(|pairs| Value::Object(pairs.into_iter().flatten().collect()))
                .boxed()
        }
    }
}

/// A valid JSON value for `field`: a list, a map or one value.
fn json_field(field: &FieldDescriptor, slugs: &[String], depth: u32) -> BoxedStrategy<Value> {
    if field.is_map() {
        let Kind::Message(entry) = field.kind() else {
            unreachable!("a map field's kind is its entry message")
        };
        let key = entry.map_entry_key_field().kind();
        let value = json_field(&entry.map_entry_value_field(), slugs, depth);
        let key = json_scalar(&key, slugs, depth).prop_map(|key| match key {
            Value::String(text) => text,
            other => other.to_string(),
        });
        proptest::collection::btree_map(key, value, 0..3)
            .prop_map(|map| Value::Object(map.into_iter().collect()))
            .boxed()
    } else if field.is_list() {
        proptest::collection::vec(json_scalar(&field.kind(), slugs, depth), 0..3)
            .prop_map(Value::Array)
            .boxed()
    } else {
        json_scalar(&field.kind(), slugs, depth)
    }
}

/// A valid value for a field set from the URL, as text (`scalar` in `api::http` reads it).
fn url_value(kind: &Kind, slugs: &[String]) -> BoxedStrategy<String> {
    match kind {
        Kind::Bool => select(&["true", "false", "1", "0"][..])
            .prop_map(String::from)
            .boxed(),
        Kind::Enum(_) | Kind::String | Kind::Int32 | Kind::Uint32 | Kind::Int64 | Kind::Uint64 => {
            json_scalar(kind, slugs, 0)
                .prop_map(|value| match value {
                    Value::String(text) => text,
                    other => other.to_string(),
                })
                .boxed()
        }
        _ => json_scalar(kind, slugs, 0)
            .prop_map(|v| v.to_string())
            .boxed(),
    }
}

/// Seconds and nanoseconds since the epoch in RFC 3339 (UTC), without a date crate.
fn rfc3339(seconds: i64, nanos: u32) -> String {
    let days = seconds.div_euclid(86_400);
    let rest = seconds.rem_euclid(86_400);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{nanos:09}Z",
        rest / 3600,
        rest / 60 % 60,
        rest % 60
    )
}

/// Base64 (standard alphabet, padded), as proto3 JSON writes bytes.
mod base64 {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

    pub fn encode(bytes: &[u8]) -> String {
        let mut out = String::new();
        for chunk in bytes.chunks(3) {
            let n = chunk
                .iter()
                .enumerate()
                .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
            for i in 0..4 {
                if i <= chunk.len() {
                    out.push(char::from(ALPHABET[(n >> (18 - 6 * i) & 63) as usize]));
                } else {
                    out.push('=');
                }
            }
        }
        out
    }
}

/// The names in a route's path template, in order, and the template's segments.
fn template(route: &Route) -> Vec<(bool, &'static str)> {
    route
        .path
        .split('/')
        .skip(1)
        .map(
            |part| match part.strip_prefix('{').and_then(|p| p.strip_suffix('}')) {
                Some(name) => (true, name),
                None => (false, part),
            },
        )
        .collect()
}

/// A request's query parameters and body.
type QueryAndBody = (Vec<(String, String)>, Vec<u8>);

/// A valid request for route `index`.
fn valid_request_for(index: usize, slugs: &[String]) -> BoxedStrategy<HttpRequest> {
    let route = &ROUTES[index];
    let input = http::message(route.input);
    let segments = template(route);
    let in_path: Vec<&str> = segments
        .iter()
        .filter(|(p, _)| *p)
        .map(|(_, n)| *n)
        .collect();
    let path: Vec<BoxedStrategy<String>> = segments
        .iter()
        .map(|(param, part)| {
            if *param {
                let field = input
                    .get_field_by_name(part)
                    .expect("a route's path names fields");
                // An empty segment would be another path; a filter would reject too often for
                // a million-input run.
                url_value(&field.kind(), slugs)
                    .prop_map(|v| {
                        if v.is_empty() {
                            "x".to_owned()
                        } else {
                            encode(&v)
                        }
                    })
                    .boxed()
            } else {
                Just((*part).to_owned()).boxed()
            }
        })
        .collect();
    let others: Vec<FieldDescriptor> = input
        .fields()
        .filter(|f| !in_path.contains(&f.name()))
        .collect();
    let rest: BoxedStrategy<QueryAndBody> = if route.body {
        let values: Vec<BoxedStrategy<Option<(String, Value)>>> = others
            .iter()
            .map(|field| {
                let names = (field.name().to_owned(), field.json_name().to_owned());
                proptest::option::of((any::<bool>(), json_field(field, slugs, 2)))
                    .prop_map(move |value| {
                        value.map(|(json, value)| {
                            (
                                if json {
                                    names.1.clone()
                                } else {
                                    names.0.clone()
                                },
                                value,
                            )
                        })
                    })
                    .boxed()
            })
            .collect();
        (values, any::<u8>())
            .prop_map(|(pairs, style)| {
                let object: Map<String, Value> = pairs.into_iter().flatten().collect();
                // An empty body is `{}` or nothing; whitespace is allowed around JSON.
                let body = match (object.is_empty(), style % 3) {
                    (true, 0) => Vec::new(),
                    (_, 1) => serde_json::to_vec_pretty(&object).expect("JSON"),
                    _ => serde_json::to_vec(&object).expect("JSON"),
                };
                (Vec::new(), body)
            })
            .boxed()
    } else {
        let values: Vec<BoxedStrategy<Option<(String, String)>>> = others
            .iter()
            .filter(|f| !f.is_list() && !f.is_map() && !matches!(f.kind(), Kind::Message(_)))
            .map(|field| {
                let names = (field.name().to_owned(), field.json_name().to_owned());
                proptest::option::of((any::<bool>(), url_value(&field.kind(), slugs)))
                    .prop_map(move |value| {
                        value.map(|(json, value)| {
                            (
                                if json {
                                    names.1.clone()
                                } else {
                                    names.0.clone()
                                },
                                value,
                            )
                        })
                    })
                    .boxed()
            })
            .collect();
        values
            .prop_map(|pairs| (pairs.into_iter().flatten().collect(), Vec::new()))
            .boxed()
    };
    let content_type = if route.body {
        select(
            &[
                "application/json",
                "application/json; charset=utf-8",
                "Application/JSON",
            ][..],
        )
        .prop_map(|t| Some(t.to_owned()))
        .boxed()
    } else {
        Just(None).boxed()
    };
    (path, rest, content_type)
        .prop_map(move |(path, (query, body), content_type)| HttpRequest {
            route: index,
            method: ROUTES[index].method.to_owned(),
            path,
            query,
            raw_query: String::new(),
            content_type,
            headers: Vec::new(),
            body,
        })
        .boxed()
}

/// A valid request for any route.
fn valid_request() -> impl Strategy<Value = HttpRequest> {
    let slugs = SERVER.slugs.clone();
    Union::new((0..ROUTES.len()).map(|index| valid_request_for(index, &slugs)))
}

// ---- mutations ----

fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        select(
            &[
                -1i64,
                0,
                1,
                4_294_967_295,
                4_294_967_296,
                9_007_199_254_740_993
            ][..]
        )
        .prop_map(Value::from),
        select(
            &[
                "",
                "1",
                "-1",
                "1.5",
                "1e3",
                "0x10",
                "NaN",
                "Infinity",
                "true",
                "null",
                "4294967296",
                "18446744073709551616",
                "LIVE_LESSON_STATUS_READY",
                "READY",
                "1970-01-01T00:00:00Z",
                "1.5s",
                "AAAA",
                "\u{0}",
                "\u{feff}",
            ][..]
        )
        .prop_map(Value::from),
        "\\PC{0,16}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            proptest::collection::vec(("\\PC{0,8}", inner), 0..4)
                .prop_map(|pairs| Value::Object(pairs.into_iter().collect())),
        ]
    })
}

/// Field names worth trying: every request field of every route, in both spellings, and
/// near misses.
fn any_name() -> impl Strategy<Value = String> {
    let mut names: Vec<String> = ROUTES
        .iter()
        .flat_map(|route| {
            http::message(route.input)
                .fields()
                .flat_map(|f| [f.name().to_owned(), f.json_name().to_owned()])
                .collect::<Vec<_>>()
        })
        .collect();
    names.extend(["", "@type", "__proto__", "ID", "id ", "Id"].map(String::from));
    names.sort();
    names.dedup();
    prop_oneof![select(names), "\\PC{0,10}"]
}

#[derive(Debug, Clone)]
enum HttpMutation {
    /// Inserts bytes (JSON syntax or anything) into the body.
    BodyInsert { at: usize, bytes: Vec<u8> },
    /// Deletes bytes from the body.
    BodyDelete { at: usize, len: usize },
    /// Flips bits of a body byte.
    BodyFlip { at: usize, bits: u8 },
    /// Sets a field of the body's JSON object (known, unknown, either spelling) to any value.
    BodySet { name: String, value: Value },
    /// Writes a field twice in the body's text.
    BodyDuplicate { name: String, value: Value },
    /// Replaces the body by any JSON value, or nests it.
    BodyReplace(Value),
    /// A body larger than the limit.
    BodyHuge(usize),
    /// Adds a query parameter of any name and value.
    QueryAdd { name: String, value: String },
    /// Appends raw text to the query string (bad escapes, `&&`, `=`, `+`).
    QueryRaw(String),
    /// Replaces a path segment by raw text (bad escapes, encoded slashes, invalid UTF-8).
    PathSegment { index: usize, raw: String },
    /// Adds a path segment.
    PathAppend(String),
    /// Another method.
    Method(String),
    /// Another content type, or none.
    ContentType(Option<String>),
    /// A header that reaches decoding or the handler.
    Header { name: &'static str, value: String },
}

/// Headers that reach decoding or the handler.
const HEADERS: &[&str] = &[
    "x-forwarded-for",
    "content-encoding",
    "traceparent",
    "accept",
    "authorization",
    "cookie",
];

/// Values of those headers worth trying.
const HEADER_VALUES: &[&str] = &[
    "1.2.3.4",
    "::1",
    "1.2.3.4, 5.6.7.8",
    "not an address",
    "gzip",
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    "00-zz-zz-01",
    "Bearer x",
    "session=x",
    "a=b; c",
];

fn mutation() -> impl Strategy<Value = HttpMutation> {
    let json_token = select(
        &[
            "{",
            "}",
            "[",
            "]",
            ",",
            ":",
            "\"",
            "\\",
            "\\u",
            "\\ud800",
            "null",
            "1e999",
            "-",
            " ",
            "\n",
            "\u{0}",
            "\u{feff}",
            "{\"a\":",
            "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[",
        ][..],
    )
    .prop_map(|t| t.as_bytes().to_vec());
    let raw_url = prop_oneof![
        select(
            &[
                "%", "%G0", "%FF", "%C3%28", "%00", "%2F", "%2E%2E", "..", ".", "+", "&", "&&",
                "=", "==", "a=1&a=2", "%E2%82", ";", "#", "?", "//", "%20", "\u{e9}",
            ][..]
        )
        .prop_map(String::from),
        "[a-z%0-9=&+._~-]{0,12}",
    ];
    prop_oneof![
        2 => (any::<usize>(), prop_oneof![json_token, proptest::collection::vec(any::<u8>(), 1..6)])
            .prop_map(|(at, bytes)| HttpMutation::BodyInsert { at, bytes }),
        1 => (any::<usize>(), 1..8usize).prop_map(|(at, len)| HttpMutation::BodyDelete { at, len }),
        1 => (any::<usize>(), 1..=u8::MAX)
            .prop_map(|(at, bits)| HttpMutation::BodyFlip { at, bits }),
        4 => (any_name(), any_json())
            .prop_map(|(name, value)| HttpMutation::BodySet { name, value }),
        1 => (any_name(), any_json())
            .prop_map(|(name, value)| HttpMutation::BodyDuplicate { name, value }),
        1 => any_json().prop_map(HttpMutation::BodyReplace),
        1 => (60_000..70_000usize).prop_map(HttpMutation::BodyHuge),
        3 => (any_name(), prop_oneof!["\\PC{0,12}", raw_url.clone()])
            .prop_map(|(name, value)| HttpMutation::QueryAdd { name, value }),
        2 => raw_url.clone().prop_map(HttpMutation::QueryRaw),
        2 => (any::<usize>(), raw_url.clone())
            .prop_map(|(index, raw)| HttpMutation::PathSegment { index, raw }),
        1 => raw_url.prop_map(HttpMutation::PathAppend),
        1 => select(&["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"][..])
            .prop_map(|m| HttpMutation::Method(m.to_owned())),
        1 => proptest::option::of(select(
            &["application/json", "text/plain", "application/json;", "application/jsonx",
              "application/x-www-form-urlencoded", "", "application/json; charset=latin1"][..],
        ))
        .prop_map(|t| HttpMutation::ContentType(t.map(String::from))),
        1 => (
            select(HEADERS),
            prop_oneof![
                select(HEADER_VALUES).prop_map(String::from),
                "[ -~]{0,20}",
            ],
        )
            .prop_map(|(name, value)| HttpMutation::Header { name, value }),
    ]
}

/// Applies `mutation` to `request`.
fn mutate(request: &mut HttpRequest, mutation: &HttpMutation) {
    let body_object = |request: &HttpRequest| -> Map<String, Value> {
        match serde_json::from_slice::<Value>(&request.body) {
            Ok(Value::Object(object)) => object,
            _ => Map::new(),
        }
    };
    match mutation {
        HttpMutation::BodyInsert { at, bytes } => {
            let at = at % (request.body.len() + 1);
            request.body.splice(at..at, bytes.iter().copied());
        }
        HttpMutation::BodyDelete { at, len } => {
            let at = at % (request.body.len() + 1);
            let end = (at + len).min(request.body.len());
            request.body.drain(at..end);
        }
        HttpMutation::BodyFlip { at, bits } => {
            if !request.body.is_empty() {
                let at = at % request.body.len();
                request.body[at] ^= bits;
            }
        }
        HttpMutation::BodySet { name, value } => {
            let mut object = body_object(request);
            object.insert(name.clone(), value.clone());
            request.body = serde_json::to_vec(&object).expect("JSON");
        }
        HttpMutation::BodyDuplicate { name, value } => {
            let object = body_object(request);
            let mut text = serde_json::to_string(&object).expect("JSON");
            text.pop();
            let separator = if object.is_empty() { "" } else { "," };
            let pair = |v: &Value| format!("{}:{v}", Value::String(name.clone()));
            text.push_str(&format!("{separator}{},{}}}", pair(value), pair(value)));
            request.body = text.into_bytes();
        }
        HttpMutation::BodyReplace(value) => {
            let nested = json!({ "outer": value });
            request.body =
                serde_json::to_vec(if value.is_object() { &nested } else { value }).expect("JSON");
        }
        HttpMutation::BodyHuge(size) => {
            let mut object = body_object(request);
            object.insert("padding".into(), Value::String("x".repeat(*size)));
            request.body = serde_json::to_vec(&object).expect("JSON");
        }
        HttpMutation::QueryAdd { name, value } => {
            request.query.push((name.clone(), value.clone()));
        }
        HttpMutation::QueryRaw(raw) => request.raw_query.push_str(raw),
        HttpMutation::PathSegment { index, raw } => {
            if !request.path.is_empty() {
                let index = index % request.path.len();
                request.path[index] = raw.clone();
            }
        }
        HttpMutation::PathAppend(raw) => request.path.push(raw.clone()),
        HttpMutation::Method(method) => request.method = method.clone(),
        HttpMutation::ContentType(content_type) => request.content_type = content_type.clone(),
        HttpMutation::Header { name, value } => request.headers.push((name, value.clone())),
    }
}

// ---- properties ----

#[test]
fn valid_requests_are_decoded() {
    fuzz("http: valid requests", 1000, valid_request(), |request| {
        let Some(answer) = send(&request)? else {
            return Err(TestCaseError::fail(format!(
                "a valid request is not HTTP: {}",
                request.uri()
            )));
        };
        let outcome = answer_is_well_formed(&request, &answer)?;
        if let Some(json) = &answer.json
            && !answer.status.is_success()
        {
            prop_assert!(
                !is_decoding_refusal(&ROUTES[request.route], json),
                "a valid request was refused by decoding: {} {}: {json}",
                request.method,
                request.uri()
            );
        }
        Ok(outcome)
    });
}

#[test]
fn mutated_requests_are_answered_well() {
    let input = (valid_request(), proptest::collection::vec(mutation(), 1..4));
    fuzz(
        "http: mutated requests",
        1000,
        input,
        |(mut request, mutations)| {
            for mutation in &mutations {
                mutate(&mut request, mutation);
            }
            match send(&request)? {
                None => Ok("not HTTP"),
                Some(answer) => answer_is_well_formed(&request, &answer),
            }
        },
    );
}

// ---- regressions: each failure the fuzzer found, by name ----

/// Found by `mutated_requests_are_answered_well`: prost-reflect names an unknown field in
/// single quotes (`unrecognized field name ''`), which the property first took for a message
/// naming nothing. The answer is right; kept as the example of a name-quoted message.
#[test]
fn an_empty_field_name_in_a_body_is_refused_naming_it() {
    let route = ROUTES
        .iter()
        .position(|r| r.rpc == "SessionService.CreateSession")
        .expect("CreateSession has a route");
    let request = HttpRequest {
        route,
        method: "POST".into(),
        path: vec!["v1".into(), "sessions".into()],
        query: Vec::new(),
        raw_query: String::new(),
        content_type: Some("application/json".into()),
        headers: Vec::new(),
        body: br#"{"": null}"#.to_vec(),
    };
    let answer = send(&request).expect("answered in time").expect("HTTP");
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    answer_is_well_formed(&request, &answer).expect("well-formed");
    let json = answer.json.expect("JSON");
    assert_eq!(json["reason"], "MALFORMED_REQUEST", "{json}");
}
