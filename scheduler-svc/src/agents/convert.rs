//! Every conversion between the scheduler's domain and `antidote.agent.v1`, in one place: the
//! spec sent to agents (with the labels they must put on their objects), and what comes back
//! (states, handshakes, plans) as domain values. No other module of the scheduler names an
//! agent.v1 type.

use std::collections::HashMap;
use std::time::Duration;

use antidote_net::errors;
use antidote_proto::agent::v1 as agent;
use antidote_proto::labels;

use super::{AgentReport, CheckFile, Desired, FileOutcome, Handshake, Plan, PlannedObject};
use crate::catalog::{
    ConfigurationType, Flavor, JUPYTER_GUIDE_ENDPOINT, JUPYTER_GUIDE_PORT, PresentationKind,
};
use crate::error::Error;
use crate::model::{EndpointInfo, LiveLessonId, PresentationInfo, Status};

/// Ports as the wire carries them.
fn ports(ports: &[std::num::NonZeroU16]) -> Vec<u32> {
    ports.iter().map(|p| u32::from(p.get())).collect()
}

fn duration(d: Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
    }
}

/// The wire type of a configuration type.
fn configuration_type(kind: ConfigurationType) -> agent::ConfigurationType {
    match kind {
        ConfigurationType::Python => agent::ConfigurationType::Python,
        ConfigurationType::Ansible => agent::ConfigurationType::Ansible,
        ConfigurationType::Napalm => agent::ConfigurationType::Napalm,
        ConfigurationType::Shell => agent::ConfigurationType::Shell,
    }
}

/// A RunChecks request: `files` on live lesson `id` at `generation`, each bounded by
/// `timeout`.
pub fn run_checks(
    id: LiveLessonId,
    generation: u64,
    files: &[CheckFile],
    timeout: Duration,
) -> agent::RunChecksRequest {
    agent::RunChecksRequest {
        live_lesson_id: id.to_string(),
        generation,
        files: files
            .iter()
            .map(|file| agent::CheckFile {
                endpoint: file.endpoint.clone(),
                r#type: configuration_type(file.kind) as i32,
                file_name: file.file_name.clone(),
                contents: file.contents.clone().into_bytes(),
            })
            .collect(),
        timeout: Some(duration(timeout)),
    }
}

/// How one file ran, from the agent's answer.
pub fn file_outcome(result: agent::CheckResult) -> FileOutcome {
    let agent::CheckResult {
        endpoint,
        file_name,
        exited,
        exit_code,
        timed_out,
        output,
        truncated,
        duration,
        error,
    } = result;
    FileOutcome {
        endpoint,
        file_name,
        exited,
        exit_code,
        timed_out,
        output,
        truncated,
        duration: duration
            .and_then(|d| Duration::try_from(d).ok())
            .unwrap_or_default(),
        error,
    }
}

/// Everything an agent needs to realise `live` at its desired stage.
pub fn lesson_spec(desired: &Desired<'_>) -> agent::LessonSpec {
    let Desired {
        instance_id,
        cluster_id,
        live,
        lesson,
        catalog,
    } = *desired;
    let stage = lesson.stages.get(live.stage as usize);
    let endpoints = lesson
        .endpoints
        .iter()
        .map(|e| {
            let image = catalog.image(&e.image);
            agent::Endpoint {
                name: e.name.clone(),
                image: image.map(|i| agent::Image {
                    slug: i.slug.clone(),
                    flavor: match i.flavor {
                        Flavor::Trusted => agent::Flavor::Trusted,
                        Flavor::Untrusted => agent::Flavor::Untrusted,
                        Flavor::Legacy => agent::Flavor::Legacy,
                    } as i32,
                    ssh_user: i.ssh_user.clone().unwrap_or_default(),
                    ssh_password: i.ssh_password.clone().unwrap_or_default(),
                    config_user: i.config_user.clone().unwrap_or_default(),
                    config_password: i.config_password.clone().unwrap_or_default(),
                    enable_forwarding: i.enable_forwarding,
                    network_interfaces: i.network_interfaces.clone(),
                }),
                additional_ports: ports(&e.additional_ports),
                presentations: e
                    .presentations
                    .iter()
                    .map(|p| agent::Presentation {
                        name: p.name.clone(),
                        r#type: match p.kind {
                            PresentationKind::Ssh => agent::PresentationType::Ssh,
                            PresentationKind::Http => agent::PresentationType::Http,
                        } as i32,
                        port: u32::from(p.port.get()),
                    })
                    .collect(),
                configuration: e.configuration_type.and_then(|kind| {
                    let config = stage?.configs.get(&e.name)?;
                    Some(agent::StageConfiguration {
                        r#type: match kind {
                            ConfigurationType::Python => agent::ConfigurationType::Python,
                            ConfigurationType::Ansible => agent::ConfigurationType::Ansible,
                            ConfigurationType::Napalm => agent::ConfigurationType::Napalm,
                            ConfigurationType::Shell => agent::ConfigurationType::Shell,
                        } as i32,
                        file_name: config
                            .path
                            .file_name()
                            .map(|n| n.to_string_lossy().into_owned())
                            .unwrap_or_default(),
                        contents: config.contents.clone().into_bytes(),
                        driver: config.driver.clone().unwrap_or_default(),
                    })
                }),
                jupyter_guide: None,
            }
        })
        .chain(lesson.has_jupyter_guide().then(|| jupyter_guide(stage)))
        .collect();
    // A pool member's specs carry its pool session for life (crate::drive::pools).
    let session = live.pool_session.unwrap_or(live.session_id).to_string();
    let mut labels = HashMap::from([
        (labels::INSTANCE.to_owned(), instance_id.to_owned()),
        (labels::CLUSTER.to_owned(), cluster_id.to_owned()),
        (labels::LIVE_LESSON.to_owned(), live.id.to_string()),
        (labels::SESSION.to_owned(), session.clone()),
        (labels::GENERATION.to_owned(), live.generation.to_string()),
        (labels::LESSON.to_owned(), live.lesson_slug.clone()),
    ]);
    if live.pool_session.is_some() {
        labels.insert(labels::POOL.to_owned(), "true".to_owned());
    }
    agent::LessonSpec {
        live_lesson_id: live.id.to_string(),
        session_id: session,
        lesson_slug: live.lesson_slug.clone(),
        generation: live.generation,
        stage: live.stage,
        endpoints,
        connections: lesson
            .connections
            .iter()
            .map(|c| agent::Connection {
                a: c.a.clone(),
                b: c.b.clone(),
                subnet: c.subnet.map(|s| s.to_string()).unwrap_or_default(),
            })
            .collect(),
        ready_delay: Some(duration(lesson.ready_delay)),
        configuration_timeout: lesson.config_timeout.map(duration),
        labels,
    }
}

/// What agents are sent for `lesson` at `stage`, whoever the live lesson is: its spec with the
/// identity (ids, session, generation, labels) left out, in the wire's encoding. Warm pools hash
/// it (crate::drive::pools::fingerprint): it names no path on the scheduler's disk and no Rust
/// type's layout, only what reaches an agent (images, presentations, connections, the stage's
/// configuration files' names and contents, notebooks, the ready delay).
pub fn stage_spec_bytes(
    lesson: &crate::catalog::Lesson,
    catalog: &crate::catalog::Catalog,
    stage: u32,
) -> Vec<u8> {
    let nobody = uuid::Uuid::nil();
    let live = crate::model::LiveLesson {
        id: LiveLessonId(nobody),
        session_id: crate::model::SessionId(nobody),
        lesson_slug: lesson.slug.clone(),
        stage,
        generation: 0,
        observed_generation: 0,
        status: Status::Pending,
        reason: String::new(),
        deleting: false,
        agent: None,
        handle: Vec::new(),
        endpoints: Vec::new(),
        persistent: false,
        created_at: crate::model::Millis(0),
        last_active: crate::model::Millis(0),
        pool_session: None,
    };
    let mut spec = lesson_spec(&Desired {
        instance_id: "",
        cluster_id: "",
        live: &live,
        lesson,
        catalog,
    });
    spec.labels.clear();
    spec.live_lesson_id.clear();
    spec.session_id.clear();
    prost::Message::encode_to_vec(&spec)
}

/// What a stage without a notebook shows on the guide endpoint of a lesson whose other stages
/// have one: a valid notebook saying so.
const NO_NOTEBOOK: &str = r#"{"cells": [{"cell_type": "markdown", "metadata": {}, "source": ["This stage's guide is not a notebook."]}], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}"#;

/// The endpoint serving a lesson's Jupyter guides (Antidote added one to every lesson with a
/// `jupyter` stage): the agent runs it from its own Jupyter image and serves `stage`'s
/// notebook on its HTTP presentation `web`.
fn jupyter_guide(stage: Option<&crate::catalog::Stage>) -> agent::Endpoint {
    let notebook = stage
        .and_then(|s| s.notebook.as_deref())
        .unwrap_or(NO_NOTEBOOK);
    agent::Endpoint {
        name: JUPYTER_GUIDE_ENDPOINT.to_owned(),
        // Agents run their own Jupyter image; the slug names it for messages and plans.
        image: Some(agent::Image {
            slug: "jupyter".to_owned(),
            flavor: agent::Flavor::Untrusted as i32,
            ..Default::default()
        }),
        additional_ports: vec![],
        presentations: vec![agent::Presentation {
            name: "web".to_owned(),
            r#type: agent::PresentationType::Http as i32,
            port: u32::from(JUPYTER_GUIDE_PORT),
        }],
        configuration: None,
        jupyter_guide: Some(agent::JupyterGuide {
            notebook: notebook.as_bytes().to_vec(),
        }),
    }
}

/// The scheduler status an agent phase maps to while provisioning; `None` for phases that say
/// nothing about provisioning progress.
fn phase_status(phase: i32) -> Option<Status> {
    match agent::Phase::try_from(phase).ok()? {
        agent::Phase::Pending | agent::Phase::Booting => Some(Status::Booting),
        agent::Phase::Configuring => Some(Status::Configuring),
        agent::Phase::Ready => Some(Status::Ready),
        agent::Phase::Failed => Some(Status::Failed),
        agent::Phase::Terminating | agent::Phase::Unspecified => None,
    }
}

/// An agent's state of one live lesson as a report; `None` when its id is not one of ours (we
/// only ever hand out UUIDs, so such an object was not created for this scheduler).
pub fn report(state: agent::LiveLessonState) -> Option<AgentReport> {
    let agent::LiveLessonState {
        live_lesson_id,
        generation,
        phase,
        reason,
        endpoints,
        handle,
        // Conditions and the stage are the agent's detail; the reason carries what learners see.
        ..
    } = state;
    let id = live_lesson_id.parse::<LiveLessonId>().ok()?;
    Some(AgentReport {
        id,
        generation,
        status: phase_status(phase),
        reason,
        endpoints: endpoints
            .into_iter()
            .map(|e| EndpointInfo {
                name: e.name,
                presentations: e
                    .presentations
                    .into_iter()
                    .map(|p| PresentationInfo {
                        name: p.name,
                        kind: match agent::PresentationType::try_from(p.r#type) {
                            Ok(agent::PresentationType::Ssh) => "ssh",
                            Ok(agent::PresentationType::Http) => "http",
                            _ => "unknown",
                        }
                        .into(),
                        address: p.address,
                        url: p.url,
                    })
                    .collect(),
                healthy: e.healthy,
                total: e.total,
            })
            .collect(),
        handle: handle.to_vec(),
    })
}

/// Whether an agent's error says it holds nothing of the live lesson: the reason
/// LIVE_LESSON_NOT_FOUND, or NOT_FOUND from an agent that sends no reason.
pub fn lost_it(err: &Error) -> bool {
    let Error::Agent { status, .. } = err else {
        return false;
    };
    match errors::reason(status) {
        Some((reason, _)) => reason == agent::ErrorReason::LiveLessonNotFound.as_str_name(),
        None => status.code() == tonic::Code::NotFound,
    }
}

/// Whether a failed agent call may succeed if tried again: a retryable code
/// ([`crate::error::is_retryable`]) or a call the transport cut off ([`cut_off`]), unless the
/// agent's reason says no retry can help (a request too large stays too large).
pub fn retryable(err: &Error) -> bool {
    let Error::Agent { status, .. } = err else {
        return false;
    };
    let hopeless = errors::reason(status)
        .is_some_and(|(reason, _)| reason == agent::ErrorReason::RequestTooLarge.as_str_name());
    (crate::error::is_retryable(status.code()) || cut_off(status)) && !hopeless
}

/// Whether the transport, not the agent, ended the call (PROTOCOL.md [E3]): an agent killed
/// mid-Provision resets the connection, and tonic reports that as UNKNOWN ("transport error") or
/// INTERNAL (an HTTP/2 error), codes an agent's own answer would make final. tonic gives every
/// status it makes from a local error that error as its source; a status decoded from what the
/// agent sent has none.
fn cut_off(status: &tonic::Status) -> bool {
    std::error::Error::source(status).is_some()
}

/// What a handshake established.
pub fn handshake(response: agent::HandshakeResponse) -> Handshake {
    let agent::HandshakeResponse {
        major,
        agent_name,
        build_version,
        instance_id,
        capabilities,
        capacity,
        labels,
        // Kept by `Agent::handshake` itself: only the learners' answers read it.
        entrypoint_url: _,
    } = response;
    Handshake {
        major,
        kind: agent_name,
        build_version,
        instance_id,
        capabilities: capabilities.into_iter().collect(),
        max_live_lessons: capacity.map_or(0, |c| c.max_live_lessons),
        labels: labels.into_iter().collect(),
    }
}

/// A plan as the admin API shows it: objects, and diagnostics as `severity field: message`.
pub fn plan(response: agent::PlanResponse) -> Plan {
    Plan {
        objects: response
            .objects
            .into_iter()
            .map(|o| PlannedObject {
                kind: o.kind,
                name: o.name,
                ports: o.ports,
                detail: o.detail,
            })
            .collect(),
        diagnostics: response
            .diagnostics
            .into_iter()
            .map(|d| {
                let severity = match agent::Severity::try_from(d.severity) {
                    Ok(agent::Severity::Error) => "error",
                    Ok(agent::Severity::Warning) => "warning",
                    _ => "note",
                };
                format!("{severity} {}: {}", d.field, d.message)
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(id: &str, phase: agent::Phase) -> agent::LiveLessonState {
        agent::LiveLessonState {
            live_lesson_id: id.into(),
            generation: 3,
            stage: 1,
            phase: phase as i32,
            reason: "probing".into(),
            endpoints: vec![agent::EndpointState {
                name: "web".into(),
                presentations: vec![
                    agent::PresentationState {
                        name: "page".into(),
                        r#type: agent::PresentationType::Http as i32,
                        address: "127.0.0.1:8080".into(),
                        url: "http://127.0.0.1:8080/".into(),
                    },
                    agent::PresentationState {
                        name: "cli".into(),
                        r#type: agent::PresentationType::Ssh as i32,
                        address: "127.0.0.1:2222".into(),
                        url: String::new(),
                    },
                    agent::PresentationState {
                        name: "odd".into(),
                        r#type: 42,
                        address: "127.0.0.1:1".into(),
                        url: String::new(),
                    },
                ],
                healthy: 1,
                total: 2,
                internal_address: "10.0.0.2".into(),
            }],
            handle: b"h-1".to_vec().into(),
            ..Default::default()
        }
    }

    #[test]
    fn a_state_becomes_a_report() {
        let id = LiveLessonId::new();
        let report = report(state(&id.to_string(), agent::Phase::Configuring)).unwrap();
        let presentation = |name: &str, kind: &str, address: &str, url: &str| PresentationInfo {
            name: name.into(),
            kind: kind.into(),
            address: address.into(),
            url: url.into(),
        };
        assert_eq!(
            report,
            AgentReport {
                id,
                generation: 3,
                status: Some(Status::Configuring),
                reason: "probing".into(),
                endpoints: vec![EndpointInfo {
                    name: "web".into(),
                    presentations: vec![
                        presentation("page", "http", "127.0.0.1:8080", "http://127.0.0.1:8080/"),
                        presentation("cli", "ssh", "127.0.0.1:2222", ""),
                        presentation("odd", "unknown", "127.0.0.1:1", ""),
                    ],
                    healthy: 1,
                    total: 2,
                }],
                handle: b"h-1".to_vec(),
            }
        );
    }

    #[test]
    fn the_jupyter_guide_endpoint_serves_the_stages_notebook() {
        let stage = |notebook: Option<&str>| crate::catalog::Stage {
            index: 0,
            description: String::new(),
            guide_type: crate::catalog::GuideType::Jupyter,
            guide: Default::default(),
            notebook: notebook.map(str::to_owned),
            stage_video: None,
            configs: Default::default(),
            checks: Default::default(),
            solutions: Default::default(),
            check_mode: crate::catalog::CheckMode::Advisory,
        };
        let guide = jupyter_guide(Some(&stage(Some("{\"cells\": []}"))));
        assert_eq!(guide.name, "jupyter-guide");
        assert_eq!(guide.presentations.len(), 1);
        assert_eq!(guide.presentations[0].port, 8888);
        assert_eq!(
            guide.presentations[0].r#type,
            agent::PresentationType::Http as i32
        );
        assert_eq!(guide.configuration, None);
        assert_eq!(guide.jupyter_guide.unwrap().notebook, b"{\"cells\": []}");
        // A markdown stage of the same lesson: a notebook saying so.
        let markdown = jupyter_guide(Some(&stage(None))).jupyter_guide.unwrap();
        let parsed: serde_json::Value = serde_json::from_slice(&markdown.notebook).unwrap();
        assert_eq!(parsed["nbformat"], 4);
    }

    #[test]
    fn phases_map_to_statuses() {
        let id = LiveLessonId::new().to_string();
        for (phase, status) in [
            (agent::Phase::Pending, Some(Status::Booting)),
            (agent::Phase::Booting, Some(Status::Booting)),
            (agent::Phase::Configuring, Some(Status::Configuring)),
            (agent::Phase::Ready, Some(Status::Ready)),
            (agent::Phase::Failed, Some(Status::Failed)),
            (agent::Phase::Terminating, None),
            (agent::Phase::Unspecified, None),
        ] {
            assert_eq!(
                report(state(&id, phase)).unwrap().status,
                status,
                "{phase:?}"
            );
        }
        let mut unknown = state(&id, agent::Phase::Ready);
        unknown.phase = 99;
        assert_eq!(report(unknown).unwrap().status, None);
    }

    #[test]
    fn ids_that_are_not_ours_are_refused_and_upper_case_uuids_accepted() {
        assert!(report(state("not-a-uuid", agent::Phase::Ready)).is_none());
        assert!(report(state("", agent::Phase::Ready)).is_none());
        let id = LiveLessonId::new();
        let upper = id.to_string().to_uppercase();
        assert_eq!(report(state(&upper, agent::Phase::Ready)).unwrap().id, id);
    }

    #[test]
    fn handshakes_and_plans_keep_what_operators_see() {
        let handshake = handshake(agent::HandshakeResponse {
            major: 1,
            agent_name: "agent-docker".into(),
            build_version: "0.1.0".into(),
            instance_id: "i-1".into(),
            capabilities: vec!["watch".into(), "plan".into(), "watch".into()],
            capacity: Some(agent::Capacity {
                max_live_lessons: 7,
                live_lessons: 2,
            }),
            labels: HashMap::from([("region".into(), "eu".into())]),
            entrypoint_url: String::new(),
        });
        assert_eq!(
            handshake.capabilities.iter().collect::<Vec<_>>(),
            ["plan", "watch"]
        );
        assert_eq!(handshake.max_live_lessons, 7);
        assert_eq!(handshake.labels["region"], "eu");
        let plan = plan(agent::PlanResponse {
            objects: vec![agent::PlannedObject {
                kind: "container".into(),
                name: "antidote-1-web".into(),
                ports: vec![8080],
                detail: String::new(),
            }],
            diagnostics: vec![
                agent::Diagnostic {
                    severity: agent::Severity::Error as i32,
                    field: "endpoints[0].image".into(),
                    message: "no such image".into(),
                },
                agent::Diagnostic {
                    severity: agent::Severity::Warning as i32,
                    field: "ready_delay".into(),
                    message: "ignored".into(),
                },
            ],
        });
        assert_eq!(plan.objects[0].name, "antidote-1-web");
        assert_eq!(
            plan.diagnostics,
            [
                "error endpoints[0].image: no such image",
                "warning ready_delay: ignored"
            ]
        );
    }

    #[test]
    fn retries_follow_the_code_unless_the_reason_says_hopeless() {
        let failed = |code, reason: Option<agent::ErrorReason>| Error::Agent {
            agent: "a".into(),
            call: "Provision",
            status: match reason {
                Some(reason) => errors::agent(reason, "no", []),
                None => tonic::Status::new(code, "no"),
            },
        };
        assert!(retryable(&failed(tonic::Code::Unavailable, None)));
        assert!(retryable(&failed(
            tonic::Code::ResourceExhausted,
            Some(agent::ErrorReason::CapacityExhausted)
        )));
        assert!(!retryable(&failed(
            tonic::Code::ResourceExhausted,
            Some(agent::ErrorReason::RequestTooLarge)
        )));
        assert!(!retryable(&failed(tonic::Code::InvalidArgument, None)));
        // The agent answering UNKNOWN is final; the connection breaking under a call is not.
        assert!(!retryable(&failed(tonic::Code::Unknown, None)));
        let reset = tonic::Status::from_error(Box::new(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "connection reset by peer",
        )));
        assert_eq!(reset.code(), tonic::Code::Unknown);
        assert!(retryable(&Error::Agent {
            agent: "a".into(),
            call: "Provision",
            status: reset,
        }));
        assert!(lost_it(&failed(tonic::Code::NotFound, None)));
        assert!(lost_it(&failed(
            tonic::Code::NotFound,
            Some(agent::ErrorReason::LiveLessonNotFound)
        )));
    }
}
