//! Error codes: specs that break a rule, and ids the agent does not know.

use antidote_proto::agent::v1 as proto;
use antidote_proto::sdk::labels;
use anyhow::{anyhow, ensure};
use tonic::Code;

use super::expect_code;
use crate::report::{Outcome, Verdict, describe, pass};
use crate::suite::{Suite, new_id};

/// A way to break a valid spec: what it is, the field the refusal must name, and the break.
type Breaker = (&'static str, &'static str, fn(&mut proto::LessonSpec));

/// The spec rules `bad-spec-codes` breaks, one at a time.
const BAD_SPECS: &[Breaker] = &[
    ("an empty live lesson id", "live_lesson_id", |s| {
        s.live_lesson_id.clear()
    }),
    ("generation 0", "generation", |s| s.generation = 0),
    ("no endpoints", "endpoints", |s| {
        s.endpoints.clear();
        s.connections.clear();
    }),
    ("a label the guide requires missing", labels::SESSION, |s| {
        s.labels.remove(labels::SESSION);
    }),
    ("a port out of range", "port", |s| {
        if let Some(p) = s.endpoints[0].presentations.first_mut() {
            p.port = 70000;
        } else {
            s.endpoints[0].additional_ports.push(70000);
        }
    }),
    ("an unspecified presentation type", "type", |s| {
        s.endpoints[0].presentations.push(proto::Presentation {
            name: "odd".into(),
            r#type: 0,
            port: 9,
        })
    }),
    ("a connection to an unknown endpoint", "connections", |s| {
        s.connections[0].b = "ghost".into()
    }),
];

/// `bad-spec-codes`: each broken spec, and no spec at all, is INVALID_ARGUMENT naming its
/// field; List shows nothing afterwards. Every case runs, and the failure names each one wrong.
pub async fn bad_spec_codes(suite: &mut Suite) -> Verdict {
    let valid = suite.spec(&new_id(), 1, 0);
    let mut wrong = Vec::new();
    for (what, field, breaker) in BAD_SPECS {
        let mut spec = valid.clone();
        breaker(&mut spec);
        let result = suite
            .client
            .provision(proto::ProvisionRequest { spec: Some(spec) })
            .await;
        let refused = expect_code(result, Code::InvalidArgument).and_then(|message| {
            ensure!(
                message.contains(field),
                "the message does not name `{field}`: {message:?}"
            );
            Ok(message)
        });
        if let Err(err) = refused {
            wrong.push(format!("Provision with {what}: {err:#}"));
        }
    }
    let result = suite
        .client
        .provision(proto::ProvisionRequest { spec: None })
        .await;
    if let Err(err) = expect_code(result, Code::InvalidArgument) {
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
    let fields: Vec<_> = BAD_SPECS.iter().map(|(_, field, _)| *field).collect();
    pass(format!(
        "{} refused, each naming its field ({}), and a request without a spec; List shows nothing",
        BAD_SPECS.len(),
        fields.join(", ")
    ))
}

/// `get-unknown`: Get of an id the agent never saw is NOT_FOUND.
pub async fn get_unknown(suite: &mut Suite) -> Verdict {
    let result = suite
        .client
        .get(proto::GetRequest {
            live_lesson_id: new_id(),
        })
        .await;
    pass(expect_code(result, Code::NotFound)?)
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
    pass(format!("gone = {gone}"))
}

/// `recover-unknown`: Recover of an id the agent never saw is NOT_FOUND.
pub async fn recover_unknown(suite: &mut Suite) -> Verdict {
    let unknown = new_id();
    let spec = suite.spec(&unknown, 1, 0);
    let result = suite
        .client
        .recover(proto::RecoverRequest {
            live_lesson_id: unknown.clone(),
            handle: unknown.into_bytes(),
            spec: Some(spec),
        })
        .await;
    pass(expect_code(result, Code::NotFound)?)
}
