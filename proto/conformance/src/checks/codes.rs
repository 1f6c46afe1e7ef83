//! Refusals: specs that break a rule, ids the agent does not know, and the typed details
//! (`google.rpc.ErrorInfo`) every refusal carries.

use antidote_proto::agent::v1 as proto;
use antidote_sdk::{capabilities, labels};
use anyhow::{anyhow, ensure};
use tonic::Code;

use super::{expect_refusal, typed};
use crate::report::{Outcome, Verdict, describe, pass};
use crate::suite::{Suite, new_id};

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
    } else if let Some(kind) = super::paths::unclaimed_type(suite) {
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

/// A shell configuration.
pub fn shell(file_name: &str, script: &str) -> proto::StageConfiguration {
    proto::StageConfiguration {
        r#type: proto::ConfigurationType::Shell as i32,
        file_name: file_name.into(),
        contents: script.as_bytes().to_vec(),
        driver: String::new(),
    }
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

/// `request-too-large`: Get with a 5 MiB id is either served (NOT_FOUND: the agent accepts
/// larger messages than it must) or refused with RESOURCE_EXHAUSTED, REQUEST_TOO_LARGE and the
/// limit (PROTOCOL.md [E4]).
pub async fn request_too_large(suite: &mut Suite) -> Verdict {
    let huge = "a".repeat(5 << 20);
    let result = suite
        .client
        .get(proto::GetRequest {
            live_lesson_id: huge,
        })
        .await;
    match result {
        Err(status) if status.code() == Code::NotFound => {
            typed(&status, "LIVE_LESSON_NOT_FOUND")?;
            pass("served (NOT_FOUND): the agent accepts 5 MiB requests")
        }
        Err(status) if status.code() == Code::ResourceExhausted => {
            let refusal = typed(&status, "REQUEST_TOO_LARGE")?;
            refusal.has("limit")?;
            pass(format!(
                "RESOURCE_EXHAUSTED, REQUEST_TOO_LARGE, limit {}",
                refusal.metadata["limit"]
            ))
        }
        other => Ok(Outcome::Fail(format!(
            "expected NOT_FOUND or RESOURCE_EXHAUSTED (REQUEST_TOO_LARGE), got {}",
            match other {
                Ok(_) => "OK".to_owned(),
                Err(status) => describe(&status),
            }
        ))),
    }
}

/// `get-unknown`: Get of an id the agent never saw is NOT_FOUND, LIVE_LESSON_NOT_FOUND.
pub async fn get_unknown(suite: &mut Suite) -> Verdict {
    let unknown = new_id();
    let result = suite
        .client
        .get(proto::GetRequest {
            live_lesson_id: unknown.clone(),
        })
        .await;
    let refusal = expect_refusal(result, Code::NotFound, "LIVE_LESSON_NOT_FOUND")?;
    refusal.expect("live_lesson_id", &unknown)?;
    pass(refusal.message)
}

/// `deprovision-unknown`: Deprovision of an id the agent never saw is OK.
pub async fn deprovision_unknown(suite: &mut Suite) -> Verdict {
    let gone = suite
        .client
        .deprovision(proto::DeprovisionRequest {
            live_lesson_id: new_id(),
            handle: Default::default(),
        })
        .await
        .map_err(|s| anyhow!("{}", describe(&s)))?
        .into_inner()
        .gone;
    ensure!(gone, "gone = false for an id the agent never held");
    pass("gone = true")
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
