//! Refusals: specs that break a rule, ids the agent does not know, and the typed details
//! (`google.rpc.ErrorInfo`) every refusal carries.

use antidote_proto::agent::v1 as proto;
use antidote_sdk::{capabilities, labels};
use anyhow::{anyhow, ensure};
use tonic::Code;

use super::paths::{shell, unclaimed_type};
use super::{expect_refusal, typed};
use crate::report::{Outcome, Verdict, describe, pass};
use crate::suite::{EXTRA_LABEL, Suite, new_id};

/// A way to break a valid spec: what it is, the `field` the refusal must name, and the break.
type Breaker = (&'static str, &'static str, fn(&mut proto::LessonSpec));

/// The spec rules `bad-spec-codes` breaks, one at a time (PROTOCOL.md [S2]).
const BAD_SPECS: &[Breaker] = &[
    ("an empty live lesson id", "spec.live_lesson_id", |s| {
        s.live_lesson_id.clear()
    }),
    ("an upper-case live lesson id", "spec.live_lesson_id", |s| {
        s.live_lesson_id = s.live_lesson_id.to_uppercase();
        s.labels
            .insert(labels::LIVE_LESSON.into(), s.live_lesson_id.clone());
    }),
    ("generation 0", "spec.generation", |s| s.generation = 0),
    ("no endpoints", "spec.endpoints", |s| {
        s.endpoints.clear();
        s.connections.clear();
    }),
    (
        "a label the guide requires missing",
        "spec.labels[antidote.io/session]",
        |s| {
            s.labels.remove(labels::SESSION);
        },
    ),
    (
        "an endpoint name that is not a DNS label",
        "spec.endpoints[1].name",
        |s| {
            s.endpoints[1].name = "Beta_1".into();
            s.connections.clear();
        },
    ),
    (
        "an additional port out of range",
        "spec.endpoints[0].additional_ports[0]",
        |s| s.endpoints[0].additional_ports = vec![70000],
    ),
    (
        "an unspecified presentation type",
        "spec.endpoints[0].presentations[0].type",
        |s| {
            s.endpoints[0].presentations.insert(
                0,
                proto::Presentation {
                    name: "odd".into(),
                    r#type: 0,
                    port: 1234,
                },
            )
        },
    ),
    (
        "a connection to an unknown endpoint",
        "spec.connections[0].b",
        |s| s.connections[0].b = "ghost".into(),
    ),
    (
        "two endpoints of one name (the second is named)",
        "spec.endpoints[1].name",
        |s| {
            s.endpoints[1].name = s.endpoints[0].name.clone();
            s.connections.clear();
        },
    ),
    (
        "an endpoint without an image",
        "spec.endpoints[0].image.slug",
        |s| s.endpoints[0].image = None,
    ),
    (
        "a label value of 254 bytes",
        "spec.labels[conformance.antidote.io/run]",
        |s| {
            s.labels.insert(EXTRA_LABEL.into(), "x".repeat(254));
        },
    ),
    ("33 labels", "spec.labels", |s| {
        for n in s.labels.len()..33 {
            s.labels
                .insert(format!("conformance.antidote.io/l{n}"), "x".into());
        }
    }),
];

/// `bad-spec-codes`: each broken spec, and no spec at all, is INVALID_ARGUMENT with reason
/// INVALID_SPEC and `field` its path; List shows nothing afterwards. Every case runs, and the
/// failure names each one wrong.
pub async fn bad_spec_codes(suite: &mut Suite) -> Verdict {
    // A fresh live lesson id per case: a case wrongly accepted leaves nothing the next one
    // could stumble on.
    let valid = || suite.spec(&new_id(), 1, 0);
    let mut cases: Vec<(String, String, proto::LessonSpec)> = BAD_SPECS
        .iter()
        .map(|(what, field, breaker)| {
            let mut spec = valid();
            breaker(&mut spec);
            (what.to_string(), field.to_string(), spec)
        })
        .collect();
    // A port out of range, on whichever presentation the agent offers.
    let mut spec = valid();
    if let Some(p) = spec.endpoints[0].presentations.first_mut() {
        p.port = 70000;
        cases.push((
            "a port out of range".into(),
            "spec.endpoints[0].presentations[0].port".into(),
            spec,
        ));
    }
    // A Jupyter guide on an agent that does not offer `guide.jupyter`.
    if !suite.offers(capabilities::GUIDE_JUPYTER) {
        let mut spec = valid();
        spec.endpoints[1].jupyter_guide = Some(proto::JupyterGuide {
            notebook: b"{}".to_vec(),
        });
        spec.endpoints[1].configuration = None;
        cases.push((
            "a Jupyter guide without guide.jupyter".into(),
            "spec.endpoints[1].jupyter_guide".into(),
            spec,
        ));
    }
    // A configuration the agent does not run: any, without `stage.configuration`; otherwise a
    // type it does not list.
    let mut spec = valid();
    if !suite.offers(capabilities::STAGE_CONFIGURATION) {
        spec.endpoints[0].configuration = Some(shell("stage0.sh", "true"));
        cases.push((
            "a configuration without stage.configuration".into(),
            "spec.endpoints[0].configuration".into(),
            spec,
        ));
    } else if let Some(kind) = unclaimed_type(suite) {
        spec.endpoints[0].configuration = Some(proto::StageConfiguration {
            r#type: kind as i32,
            ..shell("stage0.cfg", "true")
        });
        cases.push((
            format!("a configuration of type {kind:?}, which the agent does not list"),
            "spec.endpoints[0].configuration.type".into(),
            spec,
        ));
    }
    let mut wrong = Vec::new();
    let mut accepted = Vec::new();
    for (what, field, spec) in &cases {
        let result = suite
            .client
            .provision(proto::ProvisionRequest {
                spec: Some(spec.clone()),
                ..Default::default()
            })
            .await;
        if result.is_ok() {
            accepted.push(spec.live_lesson_id.clone());
        }
        let refused = expect_refusal(result, Code::InvalidArgument, "INVALID_SPEC")
            .and_then(|refusal| refusal.expect("field", field));
        if let Err(err) = refused {
            wrong.push(format!("Provision with {what}: {err:#}"));
        }
    }
    // What was wrongly accepted goes again, so that later checks start clean.
    for id in accepted {
        if let Err(err) = suite.remove(&id).await {
            wrong.push(format!("{err:#}"));
        }
    }
    let result = suite
        .client
        .provision(proto::ProvisionRequest::default())
        .await;
    if let Err(err) = expect_refusal(result, Code::InvalidArgument, "INVALID_SPEC")
        .and_then(|refusal| refusal.expect("field", "spec"))
    {
        wrong.push(format!("Provision without a spec: {err:#}"));
    }
    match suite.list_all(0).await {
        Ok(items) if !items.is_empty() => wrong.push(format!(
            "List shows {} live lessons after refused specs",
            items.len()
        )),
        Ok(_) => {}
        Err(err) => wrong.push(format!("{err:#}")),
    }
    if !wrong.is_empty() {
        return Ok(Outcome::Fail(wrong.join("; ")));
    }
    pass(format!(
        "{} broken specs and a request without a spec refused, each with INVALID_SPEC and its \
         field; List shows nothing",
        cases.len()
    ))
}

/// `error-details`: the refusals that need no state, each with its ErrorInfo (reason and
/// metadata). Every case runs; the failure names each one wrong.
pub async fn error_details(suite: &mut Suite) -> Verdict {
    let mut wrong = Vec::new();
    let mut right = Vec::new();
    let mut note = |what: &str, result: anyhow::Result<()>| match result {
        Ok(()) => right.push(what.to_owned()),
        Err(err) => wrong.push(format!("{what}: {err:#}")),
    };

    let request = proto::HandshakeRequest {
        supported_majors: vec![98, 99],
        ..suite.handshake_request()
    };
    let result = suite.client.handshake(request).await;
    note(
        "Handshake without a common major",
        expect_refusal(result, Code::FailedPrecondition, "NO_COMMON_MAJOR").and_then(|r| {
            r.expect("scheduler_majors", "98,99")?;
            r.has("agent_majors")
        }),
    );
    let request = proto::HandshakeRequest {
        supported_majors: vec![],
        ..suite.handshake_request()
    };
    let result = suite.client.handshake(request).await;
    note(
        "Handshake with no majors",
        expect_refusal(result, Code::FailedPrecondition, "NO_COMMON_MAJOR").map(drop),
    );

    let unknown = new_id();
    let result = suite
        .client
        .get(proto::GetRequest {
            live_lesson_id: unknown.clone(),
        })
        .await;
    note(
        "Get of an unknown id",
        expect_refusal(result, Code::NotFound, "LIVE_LESSON_NOT_FOUND")
            .and_then(|r| r.expect("live_lesson_id", &unknown)),
    );

    let mut spec = suite.spec(&new_id(), 1, 0);
    spec.generation = 0;
    let result = suite
        .client
        .provision(proto::ProvisionRequest {
            spec: Some(spec),
            ..Default::default()
        })
        .await;
    note(
        "Provision of generation 0",
        expect_refusal(result, Code::InvalidArgument, "INVALID_SPEC")
            .and_then(|r| r.expect("field", "spec.generation")),
    );

    if suite.offers(capabilities::RECOVER) {
        let result = suite
            .client
            .recover(proto::RecoverRequest {
                live_lesson_id: unknown.clone(),
                handle: unknown.clone().into_bytes(),
                spec: Some(suite.spec(&unknown, 1, 0)),
            })
            .await;
        note(
            "Recover of an unknown id",
            expect_refusal(result, Code::NotFound, "LIVE_LESSON_NOT_FOUND")
                .and_then(|r| r.expect("live_lesson_id", &unknown)),
        );
        let result = suite
            .client
            .recover(proto::RecoverRequest {
                live_lesson_id: unknown.clone(),
                handle: unknown.clone().into_bytes(),
                spec: None,
            })
            .await;
        note(
            "Recover without a spec",
            expect_refusal(result, Code::InvalidArgument, "INVALID_SPEC")
                .and_then(|r| r.expect("field", "spec")),
        );
        let result = suite
            .client
            .recover(proto::RecoverRequest {
                live_lesson_id: new_id(),
                handle: unknown.clone().into_bytes(),
                spec: Some(suite.spec(&unknown, 1, 0)),
            })
            .await;
        note(
            "Recover whose id is not its spec's",
            expect_refusal(result, Code::InvalidArgument, "INVALID_SPEC")
                .and_then(|r| r.expect("field", "spec.live_lesson_id")),
        );
    }

    if suite.offers(capabilities::PLAN) {
        let mut spec = suite.spec(&new_id(), 1, 0);
        spec.endpoints[0].name = "Not_A_Label".into();
        spec.connections.clear();
        let result = suite
            .client
            .plan(proto::PlanRequest { spec: Some(spec) })
            .await;
        note(
            "Plan of a broken spec",
            expect_refusal(result, Code::InvalidArgument, "INVALID_SPEC")
                .and_then(|r| r.expect("field", "spec.endpoints[0].name")),
        );
    } else if let Err(status) = suite
        .client
        .plan(proto::PlanRequest {
            spec: Some(suite.spec(&new_id(), 1, 0)),
        })
        .await
    {
        // Not offered: an agent that does not implement it says so, typed.
        note(
            "Plan without the `plan` capability",
            (|| {
                ensure!(
                    status.code() == Code::Unimplemented,
                    "expected UNIMPLEMENTED, got {}",
                    describe(&status)
                );
                typed(&status, "NOT_IMPLEMENTED")?.expect("rpc", "Plan")
            })(),
        );
    }

    if !wrong.is_empty() {
        return Ok(Outcome::Fail(wrong.join("; ")));
    }
    pass(format!(
        "{} refusals typed: {}",
        right.len(),
        right.join(", ")
    ))
}

/// The protocol's request limit (PROTOCOL.md [E4]): every request up to it is served.
const REQUEST_LIMIT: usize = 4 << 20;

/// A GetRequest padded with a field the agent does not know, to any encoded size: agents skip
/// unknown fields, so it is served like a Get of `live_lesson_id`.
#[derive(Clone, PartialEq, prost::Message)]
struct PaddedGet {
    /// The live lesson asked for.
    #[prost(string, tag = "1")]
    live_lesson_id: String,
    /// Bytes in a field no agent knows.
    #[prost(bytes = "vec", tag = "1000")]
    padding: Vec<u8>,
}

impl PaddedGet {
    /// A Get of `id` whose encoded message is exactly `size` bytes.
    fn of_size(id: &str, size: usize) -> PaddedGet {
        let mut get = PaddedGet {
            live_lesson_id: id.to_owned(),
            padding: Vec::new(),
        };
        // The padding's key and length prefix grow with it: settle on the length that fits.
        let mut padding = size - prost::Message::encoded_len(&get) - 6;
        while {
            get.padding = vec![0; padding];
            prost::Message::encoded_len(&get) != size
        } {
            padding = padding + size - prost::Message::encoded_len(&get);
        }
        get
    }
}

/// `request-too-large`: a Get padded to exactly 4 MiB (4,194,304 bytes encoded, without the
/// 5-byte frame prefix) is served: NOT_FOUND naming the id. Padded to 4 MiB and a byte, and
/// to 8 MiB, it is served or refused RESOURCE_EXHAUSTED, REQUEST_TOO_LARGE, with `limit`
/// from 4194304 to below the request's size (PROTOCOL.md [E4]): the agent raised its gRPC
/// library's own limit, whose refusal carries no ErrorInfo.
pub async fn request_too_large(suite: &mut Suite) -> Verdict {
    let mut grpc = tonic::client::Grpc::new(suite.channel.clone());
    let mut said = Vec::new();
    for size in [REQUEST_LIMIT, REQUEST_LIMIT + 1, 2 * REQUEST_LIMIT] {
        let id = new_id();
        grpc.ready()
            .await
            .map_err(|err| anyhow!("the connection is not ready: {err}"))?;
        let result = grpc
            .unary(
                tonic::Request::new(PaddedGet::of_size(&id, size)),
                tonic::codegen::http::uri::PathAndQuery::from_static(
                    "/antidote.agent.v1.Backend/Get",
                ),
                tonic_prost::ProstCodec::<PaddedGet, proto::GetResponse>::default(),
            )
            .await;
        match result {
            Err(status) if status.code() == Code::NotFound => {
                typed(&status, "LIVE_LESSON_NOT_FOUND")?.expect("live_lesson_id", &id)?;
                said.push(format!("{size} bytes served"));
            }
            Err(status) if status.code() == Code::ResourceExhausted && size > REQUEST_LIMIT => {
                let refusal = typed(&status, "REQUEST_TOO_LARGE")?;
                let limit: usize = refusal
                    .metadata
                    .get("limit")
                    .and_then(|l| l.parse().ok())
                    .ok_or_else(|| {
                        anyhow!(
                            "ErrorInfo metadata `limit` is not a number of bytes: {:?}",
                            refusal.metadata
                        )
                    })?;
                ensure!(
                    (REQUEST_LIMIT..size).contains(&limit),
                    "a {size}-byte request refused with limit {limit}: the limit must be at least {REQUEST_LIMIT} and below the size refused"
                );
                said.push(format!("{size} bytes REQUEST_TOO_LARGE (limit {limit})"));
            }
            other => {
                return Ok(Outcome::Fail(format!(
                    "a Get of {size} bytes: expected {}, got {}",
                    if size > REQUEST_LIMIT {
                        "NOT_FOUND or RESOURCE_EXHAUSTED (REQUEST_TOO_LARGE)"
                    } else {
                        "NOT_FOUND: every request up to 4 MiB is served"
                    },
                    match other {
                        Ok(_) => "OK".to_owned(),
                        Err(status) => describe(&status),
                    }
                )));
            }
        }
    }
    pass(said.join(", "))
}

/// Ids that are not UUIDs, which name nothing an agent holds and must never reach a path or a
/// backend's names (PROTOCOL.md [G4]).
const NOT_UUIDS: &[&str] = &["../../etc", "Not-A-UUID", "a b"];

/// `get-unknown`: Get of an id the agent never saw, and of ids that are not UUIDs, is
/// NOT_FOUND, LIVE_LESSON_NOT_FOUND naming the id.
pub async fn get_unknown(suite: &mut Suite) -> Verdict {
    let unknown = new_id();
    let mut message = String::new();
    for id in std::iter::once(unknown.as_str()).chain(NOT_UUIDS.iter().copied()) {
        let result = suite
            .client
            .get(proto::GetRequest {
                live_lesson_id: id.to_owned(),
            })
            .await;
        let refusal = expect_refusal(result, Code::NotFound, "LIVE_LESSON_NOT_FOUND")
            .map_err(|err| anyhow!("Get of `{id}`: {err:#}"))?;
        refusal.expect("live_lesson_id", id)?;
        if message.is_empty() {
            message = refusal.message;
        }
    }
    pass(format!(
        "{message} (and for {} ids that are not UUIDs)",
        NOT_UUIDS.len()
    ))
}

/// `deprovision-unknown`: Deprovision of an id the agent never saw, and of ids that are not
/// UUIDs, is OK with `gone = true`.
pub async fn deprovision_unknown(suite: &mut Suite) -> Verdict {
    let unknown = new_id();
    for id in std::iter::once(unknown.as_str()).chain(NOT_UUIDS.iter().copied()) {
        let gone = suite
            .client
            .deprovision(proto::DeprovisionRequest {
                live_lesson_id: id.to_owned(),
                handle: Default::default(),
            })
            .await
            .map_err(|s| anyhow!("Deprovision of `{id}`: {}", describe(&s)))?
            .into_inner()
            .gone;
        ensure!(gone, "gone = false for `{id}`, which the agent never held");
    }
    pass(format!(
        "gone = true, also for {} ids that are not UUIDs",
        NOT_UUIDS.len()
    ))
}

/// `recover-unknown`: Recover of an id the agent never saw is NOT_FOUND, LIVE_LESSON_NOT_FOUND.
pub async fn recover_unknown(suite: &mut Suite) -> Verdict {
    let unknown = new_id();
    let spec = suite.spec(&unknown, 1, 0);
    let result = suite
        .client
        .recover(proto::RecoverRequest {
            live_lesson_id: unknown.clone(),
            handle: unknown.clone().into_bytes(),
            spec: Some(spec),
        })
        .await;
    let refusal = expect_refusal(result, Code::NotFound, "LIVE_LESSON_NOT_FOUND")?;
    refusal.expect("live_lesson_id", &unknown)?;
    pass(refusal.message)
}
