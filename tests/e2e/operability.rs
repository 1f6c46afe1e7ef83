//! What operators and web front ends see: `/metrics` of the scheduler and of an agent after a
//! lifecycle, the JSON/HTTP API with server-sent events, its errors, OpenAPI and CORS, and one
//! trace across the scheduler and an agent received by a real OTLP receiver.

use std::time::{Duration, Instant};

use antidote_proto::api::v1 as api;
use antidote_tests::otlp::Receiver;
use antidote_tests::web::{Web, sample};
use hyper::{Method, StatusCode};

use crate::{Env, Knobs, PATIENCE};

#[tokio::test]
async fn metrics_count_a_lifecycle_on_scheduler_and_agent() {
    let env = Env::start(&["--metrics-listen", "127.0.0.1:0"], Knobs::default()).await;
    let c = &env.scheduler.clients;
    let web = Web::default();
    let scheduler_metrics = format!(
        "{}/metrics",
        env.scheduler.process.extra_url("admin http").unwrap()
    );
    let agent_metrics = format!("{}/metrics", env.agent.extra_url("metrics").unwrap());

    let session = c.session().await.unwrap();
    let lesson = c.request(&session, "hello-web", 0).await.unwrap();
    let ready = c.ready(&lesson.id).await.unwrap();
    assert_eq!(
        ready.status(),
        api::LiveLessonStatus::Ready,
        "{}",
        env.logs()
    );

    let during = web.scrape(&scheduler_metrics).await.unwrap();
    assert_eq!(during.status, StatusCode::OK);
    assert!(
        during.headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/openmetrics-text"),
        "{:?}",
        during.headers
    );
    let text = &during.body;
    assert_eq!(
        sample(text, r#"antidote_live_lessons{status="READY"}"#),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(text, r#"antidote_sessions{kind="ephemeral"}"#),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(text, r#"antidote_agent_ready{agent="loopback"}"#),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(
            text,
            r#"antidote_provisioning_duration_seconds_count{lesson="hello-web",outcome="ready"}"#
        ),
        Some(1.0),
        "{text}"
    );
    assert!(
        sample(
            text,
            r#"antidote_agent_call_duration_seconds_count{agent="loopback",rpc="Provision",code="Ok"}"#
        )
        .is_some_and(|n| n >= 1.0),
        "{text}"
    );

    c.delete(&lesson.id, PATIENCE).await.unwrap();
    let after = web.scrape(&scheduler_metrics).await.unwrap().body;
    assert_eq!(
        sample(&after, r#"antidote_live_lessons{status="READY"}"#),
        Some(0.0),
        "{after}"
    );
    assert!(
        sample(
            &after,
            r#"antidote_agent_call_duration_seconds_count{agent="loopback",rpc="Deprovision",code="Ok"}"#
        )
        .is_some_and(|n| n >= 1.0),
        "{after}"
    );

    let agent = web.get(&agent_metrics).await.unwrap();
    assert_eq!(agent.status, StatusCode::OK);
    let text = &agent.body;
    assert!(
        sample(
            text,
            r#"antidote_agent_rpc_duration_seconds_count{rpc="Provision",code="Ok"}"#
        )
        .is_some_and(|n| n >= 1.0),
        "{text}"
    );
    assert_eq!(
        sample(
            text,
            r#"antidote_agent_realise_duration_seconds_count{outcome="ready"}"#
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(text, r#"antidote_agent_live_lessons{phase="ready"}"#),
        Some(0.0),
        "{text}"
    );
    // The scheduler said the live lesson was new (PROTOCOL.md [P9]): the agent looked for no
    // objects to adopt before creating it.
    assert_eq!(
        sample(
            text,
            r#"antidote_agent_adoption_looks_total{found="false"}"#
        )
        .unwrap_or(0.0),
        0.0,
        "{text}"
    );
    // Getting an unknown id is an error the agent counts by its code.
    let _ = env
        .agent_client()
        .await
        .get(antidote_proto::agent::v1::GetRequest {
            live_lesson_id: "nobody".into(),
        })
        .await
        .unwrap_err();
    let text = web.get(&agent_metrics).await.unwrap().body;
    assert_eq!(
        sample(
            &text,
            r#"antidote_agent_rpc_duration_seconds_count{rpc="Get",code="NotFound"}"#
        ),
        Some(1.0),
        "{text}"
    );
}

#[tokio::test]
async fn json_api_runs_a_lifecycle_with_server_sent_events() {
    let env = Env::start(&["--boot-delay", "200ms"], Knobs::default()).await;
    let base = env.scheduler.process.extra_url("http").unwrap();
    let web = Web::default();

    let lessons = web.get(&format!("{base}/v1/lessons")).await.unwrap();
    assert_eq!(lessons.status, StatusCode::OK, "{}", lessons.body);
    assert!(
        lessons.body.contains("\"slug\":\"netcat-toolbox\""),
        "{}",
        lessons.body
    );

    let session = web.post(&format!("{base}/v1/sessions"), "").await.unwrap();
    assert_eq!(session.status, StatusCode::OK, "{}", session.body);
    let session_id = session.json().unwrap()["id"].as_str().unwrap().to_owned();

    let requested = web
        .post(
            &format!("{base}/v1/live-lessons"),
            &format!(r#"{{"sessionId": "{session_id}", "lessonSlug": "netcat-toolbox"}}"#),
        )
        .await
        .unwrap();
    assert_eq!(requested.status, StatusCode::OK, "{}", requested.body);
    let lesson = requested.json().unwrap();
    let id = lesson["id"].as_str().unwrap().to_owned();
    assert_eq!(lesson["status"], "LIVE_LESSON_STATUS_PENDING", "{lesson}");
    assert_eq!(
        lesson["generation"], "1",
        "64-bit integers are strings: {lesson}"
    );

    // Follow it as server-sent events until READY.
    let mut events = web
        .events(&format!("{base}/v1/live-lessons/{id}/watch"))
        .await
        .unwrap();
    let mut seen = Vec::new();
    let deadline = Instant::now() + PATIENCE;
    let ready = loop {
        let event = tokio::time::timeout_at(deadline.into(), events.next())
            .await
            .expect("READY within patience")
            .unwrap()
            .expect("the stream lasts while the lesson lives");
        assert_eq!(event.event, "live_lesson", "{event:?}");
        let state: serde_json::Value = serde_json::from_str(&event.data).unwrap();
        let status = state["status"].as_str().unwrap().to_owned();
        seen.push(status.clone());
        assert_ne!(
            status,
            "LIVE_LESSON_STATUS_FAILED",
            "{state}\n{}",
            env.logs()
        );
        if status == "LIVE_LESSON_STATUS_READY" {
            break state;
        }
    };
    assert!(
        seen.len() >= 2,
        "the current state first, then changes: {seen:?}"
    );
    let endpoints = ready["endpoints"].as_array().unwrap();
    assert!(!endpoints.is_empty(), "{ready}");

    // Stage change through PUT; the watch shows it settle again.
    let changed = web
        .send(
            Method::PUT,
            &format!("{base}/v1/live-lessons/{id}/stage"),
            &[],
            Some(r#"{"stage": 1}"#),
        )
        .await
        .unwrap();
    assert_eq!(changed.status, StatusCode::OK, "{}", changed.body);
    assert_eq!(changed.json().unwrap()["stage"], 1);
    loop {
        let event = tokio::time::timeout_at(deadline.into(), events.next())
            .await
            .expect("stage 1 READY within patience")
            .unwrap()
            .unwrap();
        let state: serde_json::Value = serde_json::from_str(&event.data).unwrap();
        if state["stage"] == 1 && state["status"] == "LIVE_LESSON_STATUS_READY" {
            break;
        }
    }

    let heartbeat = web
        .post(&format!("{base}/v1/live-lessons/{id}/heartbeat"), "")
        .await
        .unwrap();
    assert_eq!(heartbeat.status, StatusCode::OK, "{}", heartbeat.body);
    assert!(
        heartbeat.json().unwrap()["expiresAt"].is_string(),
        "{}",
        heartbeat.body
    );

    let listed = web
        .get(&format!("{base}/v1/live-lessons?session_id={session_id}"))
        .await
        .unwrap();
    assert!(listed.body.contains(&id), "{}", listed.body);

    let deleted = web
        .send(
            Method::DELETE,
            &format!("{base}/v1/live-lessons/{id}"),
            &[],
            None,
        )
        .await
        .unwrap();
    assert_eq!(deleted.status, StatusCode::OK, "{}", deleted.body);
    // The event stream ends once the live lesson is gone.
    let end = tokio::time::timeout_at(deadline.into(), async {
        while let Some(event) = events.next().await.unwrap() {
            assert_eq!(event.event, "live_lesson", "{event:?}");
        }
    })
    .await;
    assert!(end.is_ok(), "the stream ends after the delete");
    let gone = web
        .get(&format!("{base}/v1/live-lessons/{id}"))
        .await
        .unwrap();
    assert_eq!(gone.status, StatusCode::NOT_FOUND, "{}", gone.body);
}

#[tokio::test]
async fn json_api_errors_openapi_and_cors() {
    let env = Env::start(
        &[],
        Knobs {
            config: Env::config()
                .with_http_listen("127.0.0.1:0")
                .with_cors_origins(&["https://labs.example.org"]),
            ..Knobs::default()
        },
    )
    .await;
    let base = env.scheduler.process.extra_url("http").unwrap();
    let admin = env.scheduler.process.extra_url("admin http").unwrap();
    let web = Web::default();

    // Without a session token, live-lesson calls are UNAUTHENTICATED (401).
    let anonymous = web
        .get(&format!("{base}/v1/live-lessons/{}", uuid::Uuid::new_v4()))
        .await
        .unwrap();
    assert_eq!(
        anonymous.status,
        StatusCode::UNAUTHORIZED,
        "{}",
        anonymous.body
    );
    assert_eq!(anonymous.json().unwrap()["reason"], "UNAUTHENTICATED");
    // A session: its token comes back as an HttpOnly, SameSite=Strict cookie (which this client
    // keeps, as a browser does) besides the JSON.
    let session = web.post(&format!("{base}/v1/sessions"), "").await.unwrap();
    let cookie = session.headers["set-cookie"].to_str().unwrap().to_owned();
    assert!(
        cookie.starts_with("antidote_session=ast_")
            && cookie.contains("HttpOnly")
            && cookie.contains("SameSite=Strict"),
        "{cookie}"
    );
    assert!(
        session.json().unwrap()["token"]
            .as_str()
            .unwrap()
            .starts_with("ast_")
    );

    // Bad input: the gRPC code's name, the HTTP status grpc-gateway uses, and what is wrong.
    let bad_id = web
        .get(&format!("{base}/v1/live-lessons/not-a-uuid"))
        .await
        .unwrap();
    assert_eq!(bad_id.status, StatusCode::BAD_REQUEST, "{}", bad_id.body);
    assert_eq!(bad_id.json().unwrap()["code"], "INVALID_ARGUMENT");
    assert_eq!(bad_id.json().unwrap()["reason"], "MALFORMED_ID");
    let unknown = web
        .get(&format!("{base}/v1/live-lessons/{}", uuid::Uuid::new_v4()))
        .await
        .unwrap();
    assert_eq!(unknown.status, StatusCode::NOT_FOUND, "{}", unknown.body);
    assert_eq!(unknown.json().unwrap()["code"], "NOT_FOUND");
    assert_eq!(unknown.json().unwrap()["reason"], "LIVE_LESSON_NOT_FOUND");
    assert!(
        unknown.json().unwrap()["metadata"]["live_lesson_id"].is_string(),
        "{}",
        unknown.body
    );
    let malformed = web
        .post(
            &format!("{base}/v1/live-lessons"),
            r#"{"sessionId": "x", "stage": "two"}"#,
        )
        .await
        .unwrap();
    assert_eq!(
        malformed.status,
        StatusCode::BAD_REQUEST,
        "{}",
        malformed.body
    );
    assert!(malformed.body.contains("stage"), "{}", malformed.body);
    assert_eq!(malformed.json().unwrap()["reason"], "MALFORMED_REQUEST");
    let unknown_field = web
        .post(&format!("{base}/v1/live-lessons"), r#"{"colour": "blue"}"#)
        .await
        .unwrap();
    assert_eq!(unknown_field.status, StatusCode::BAD_REQUEST);
    assert!(
        unknown_field.body.contains("colour"),
        "{}",
        unknown_field.body
    );
    let not_json = web.post(&format!("{base}/v1/sessions"), "{").await.unwrap();
    assert_eq!(
        not_json.status,
        StatusCode::BAD_REQUEST,
        "{}",
        not_json.body
    );
    let huge = format!(r#"{{"sessionId": "{}"}}"#, "x".repeat(200 * 1024));
    // On its own client: the server closes a connection whose body it refused, and a pooled
    // connection closed under the next request would fail that request instead.
    let too_big = Web::default()
        .post(&format!("{base}/v1/live-lessons"), &huge)
        .await
        .unwrap();
    assert_eq!(
        too_big.status,
        StatusCode::PAYLOAD_TOO_LARGE,
        "{}",
        too_big.body
    );
    // Only JSON bodies (a text/plain POST is a cross-site request browsers send unasked).
    let plain = web
        .send(
            Method::POST,
            &format!("{base}/v1/sessions"),
            &[("content-type", "text/plain")],
            Some("{}"),
        )
        .await
        .unwrap();
    assert_eq!(
        plain.status,
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "{}",
        plain.body
    );
    assert!(plain.body.contains("application/json"), "{}", plain.body);
    let wrong_method = web
        .send(Method::PATCH, &format!("{base}/v1/sessions"), &[], None)
        .await
        .unwrap();
    assert_eq!(wrong_method.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(wrong_method.json().unwrap()["code"], "UNIMPLEMENTED");
    assert_eq!(wrong_method.json().unwrap()["reason"], "ROUTE_NOT_FOUND");
    assert_eq!(
        too_big.json().unwrap()["code"],
        "INVALID_ARGUMENT",
        "errors are JSON"
    );
    assert_eq!(too_big.json().unwrap()["reason"], "REQUEST_TOO_LARGE");
    // Enums in the query by name or by number, on the admin listener with the admin token.
    let bearer = format!("Bearer {}", antidote_tests::ADMIN_TOKEN);
    for status in ["LIVE_LESSON_STATUS_READY", "4"] {
        let listed = web
            .send(
                Method::GET,
                &format!("{admin}/v1/admin/live-lessons?status={status}"),
                &[("authorization", &bearer)],
                None,
            )
            .await
            .unwrap();
        assert_eq!(listed.status, StatusCode::OK, "{status}: {}", listed.body);
    }
    // The admin API is not on the learners' listener at all, and needs its token on its own.
    let learners_admin = web
        .get(&format!("{base}/v1/admin/live-lessons"))
        .await
        .unwrap();
    assert_eq!(
        learners_admin.status,
        StatusCode::NOT_FOUND,
        "{}",
        learners_admin.body
    );
    let tokenless = web
        .get(&format!("{admin}/v1/admin/live-lessons"))
        .await
        .unwrap();
    assert_eq!(
        tokenless.status,
        StatusCode::UNAUTHORIZED,
        "{}",
        tokenless.body
    );
    let no_route = web.get(&format!("{base}/v2/lessons")).await.unwrap();
    assert_eq!(no_route.status, StatusCode::NOT_FOUND);
    assert!(no_route.body.contains("openapi.json"), "{}", no_route.body);
    let unknown_lesson = web
        .get(&format!("{base}/v1/lessons/no-such-lesson"))
        .await
        .unwrap();
    assert_eq!(unknown_lesson.status, StatusCode::NOT_FOUND);
    assert!(
        unknown_lesson.body.contains("no-such-lesson"),
        "{}",
        unknown_lesson.body
    );

    // The OpenAPI document describes what is served.
    let doc = web
        .get(&format!("{base}/openapi.json"))
        .await
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(doc["openapi"], "3.1.0");
    assert!(
        doc["paths"]["/v1/live-lessons/{id}/watch"]["get"].is_object(),
        "{doc}"
    );
    assert!(doc["components"]["schemas"]["LiveLesson"].is_object());

    // CORS: the configured origin only.
    let preflight = |origin: &'static str| {
        let web = web.clone();
        let url = format!("{base}/v1/sessions");
        async move {
            web.send(
                Method::OPTIONS,
                &url,
                &[
                    ("origin", origin),
                    ("access-control-request-method", "POST"),
                    ("access-control-request-headers", "content-type"),
                ],
                None,
            )
            .await
            .unwrap()
        }
    };
    let allowed = preflight("https://labs.example.org").await;
    assert_eq!(
        allowed.headers["access-control-allow-origin"], "https://labs.example.org",
        "{:?}",
        allowed.headers
    );
    let refused = preflight("https://evil.example.com").await;
    assert!(
        !refused.headers.contains_key("access-control-allow-origin"),
        "{:?}",
        refused.headers
    );
}

#[tokio::test]
async fn cors_is_closed_by_default() {
    let env = Env::start(&[], Knobs::default()).await;
    let base = env.scheduler.process.extra_url("http").unwrap();
    let answer = Web::default()
        .send(
            Method::GET,
            &format!("{base}/v1/lessons"),
            &[("origin", "https://labs.example.org")],
            None,
        )
        .await
        .unwrap();
    assert_eq!(answer.status, StatusCode::OK);
    assert!(
        !answer.headers.contains_key("access-control-allow-origin"),
        "{:?}",
        answer.headers
    );
}

/// A hello-web lesson requested with a caller's trace context (a new trace id under
/// `caller_span`, as a mesh or a web front end would send it) and READY. Its agent exports to a
/// real OTLP receiver; the scheduler too when `scheduler_exports`. Returns the receiver, the
/// environment and the trace id.
async fn traced_request(scheduler_exports: bool, caller_span: &str) -> (Receiver, Env, String) {
    let receiver = Receiver::default();
    let collector = format!("http://{}", receiver.start().await.unwrap());
    let endpoint = if scheduler_exports {
        collector.as_str()
    } else {
        ""
    };
    let env = Env::start(
        &[],
        Knobs {
            config: Env::config().with_otlp_endpoint(endpoint),
            agent_env: vec![("OTEL_EXPORTER_OTLP_ENDPOINT", collector.clone())],
        },
    )
    .await;
    let c = &env.scheduler.clients;
    let session = c.session().await.unwrap();
    let trace_id = uuid::Uuid::new_v4().simple().to_string();
    let mut request = tonic::Request::new(api::RequestLiveLessonRequest {
        session_id: session.clone(),
        lesson_slug: "hello-web".into(),
        stage: 0,
        placement: None,
    });
    request.metadata_mut().insert(
        "traceparent",
        format!("00-{trace_id}-{caller_span}-01").parse().unwrap(),
    );
    let lesson = c
        .lessons
        .clone()
        .request_live_lesson(request)
        .await
        .unwrap()
        .into_inner();
    let ready = c.ready(&lesson.id).await.unwrap();
    assert_eq!(
        ready.status(),
        api::LiveLessonStatus::Ready,
        "{}",
        env.logs()
    );
    (receiver, env, trace_id)
}

#[tokio::test]
async fn one_request_is_one_trace_across_scheduler_and_agent() {
    let (receiver, env, trace_id) = traced_request(true, "00f067aa0ba902b7").await;

    // Spans are exported in batches (every few seconds): wait until both processes sent theirs.
    let complete = |spans: &[antidote_tests::otlp::Span]| {
        let has = |service: &str, name: &str| {
            spans
                .iter()
                .any(|s| s.trace_id == trace_id && s.service == service && s.name == name)
        };
        has("scheduler-svc", "agent.call") && has("test-agent", "realise")
    };
    let all = receiver.wait_for(Duration::from_secs(60), complete).await;
    assert!(
        complete(&all),
        "no complete trace {trace_id} within 60 s; received: {all:#?}\n{}",
        env.logs()
    );
    let spans: Vec<_> = all.into_iter().filter(|s| s.trace_id == trace_id).collect();
    let names = |service: &str| {
        spans
            .iter()
            .filter(|s| s.service == service)
            .map(|s| s.name.as_str())
            .collect::<Vec<_>>()
    };
    let scheduler = names("scheduler-svc");
    for name in [
        "rpc",
        "request_live_lesson",
        "reconcile",
        "provision",
        "agent.call",
    ] {
        assert!(
            scheduler.contains(&name),
            "scheduler spans {scheduler:?} lack {name}"
        );
    }
    let agent = names("test-agent");
    for name in ["rpc", "realise"] {
        assert!(agent.contains(&name), "agent spans {agent:?} lack {name}");
    }
    // The agent's call span is a child of the scheduler's Provision call span.
    let provision_call = spans
        .iter()
        .find(|s| {
            s.service == "scheduler-svc"
                && s.name == "agent.call"
                && s.attributes
                    .iter()
                    .any(|(k, v)| k == "rpc" && v == "Provision")
        })
        .expect("a Provision call span");
    assert!(
        spans.iter().any(|s| s.service == "test-agent"
            && s.name == "rpc"
            && s.parent_id == provision_call.span_id),
        "no agent span under the scheduler's Provision call: {spans:#?}"
    );
    // The first span's parent is the caller's.
    assert!(
        spans.iter().any(|s| s.parent_id == "00f067aa0ba902b7"),
        "{spans:#?}"
    );
    // No credentials travel in spans: nothing names a password or a token.
    for span in receiver.spans() {
        for (key, value) in &span.attributes {
            let text = format!("{key}={value}").to_lowercase();
            assert!(
                !text.contains("password") && !text.contains("token"),
                "span {} carries {text}",
                span.name
            );
        }
    }
}

/// A scheduler that exports no spans records none (no OpenTelemetry layer: it cost 15 % of its
/// CPU), yet passes the caller's trace context on: an exporting agent's spans join the caller's
/// trace, as children of the caller's span.
#[tokio::test]
async fn a_scheduler_exporting_nothing_still_passes_the_callers_trace_to_its_agent() {
    let caller_span = "5a1e5a1e5a1e5a1e";
    // The scheduler exports nothing; its agent does.
    let (receiver, env, trace_id) = traced_request(false, caller_span).await;
    let provisioned = |spans: &[antidote_tests::otlp::Span]| {
        spans.iter().any(|s| {
            s.trace_id == trace_id
                && s.service == "test-agent"
                && s.name == "rpc"
                && s.parent_id == caller_span
        }) && spans
            .iter()
            .any(|s| s.trace_id == trace_id && s.service == "test-agent" && s.name == "realise")
    };
    let all = receiver
        .wait_for(Duration::from_secs(60), provisioned)
        .await;
    assert!(
        provisioned(&all),
        "the agent's Provision span is not in trace {trace_id} under the caller's span \
         {caller_span} within 60 s; received: {all:#?}\n{}",
        env.logs()
    );
    assert!(
        all.iter().all(|s| s.service != "scheduler-svc"),
        "the scheduler exported spans: {all:#?}"
    );
}
