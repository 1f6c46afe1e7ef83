//! Conversions between domain types and generated protobuf types, in one place: the public API
//! (`antidote.api.v1`) and the agent protocol (`antidote.agent.v1`).

use std::collections::HashMap;
use std::time::Duration;

use antidote_proto::agent::v1 as agent;
use antidote_proto::api::v1 as api;

use crate::catalog::{Catalog, Collection, ConfigurationType, Flavor, Lesson, PresentationKind};
use crate::model::{EndpointInfo, LiveLesson, Millis, PresentationInfo, Session, Status};
use crate::store::Observation;

/// Labels every agent puts on the objects of a live lesson (DESIGN.md §1).
pub mod labels {
    /// The scheduler instance that owns the object.
    pub const INSTANCE: &str = "antidote.io/instance";
    /// The live lesson's id.
    pub const LIVE_LESSON: &str = "antidote.io/live-lesson";
    /// The session's id.
    pub const SESSION: &str = "antidote.io/session";
    /// The generation that created or last changed the object.
    pub const GENERATION: &str = "antidote.io/generation";
    /// The lesson's slug.
    pub const LESSON: &str = "antidote.io/lesson";
}

/// Ports as the wire carries them.
fn ports(ports: &[std::num::NonZeroU16]) -> Vec<u32> {
    ports.iter().map(|p| u32::from(p.get())).collect()
}

/// A timestamp for the API.
pub fn timestamp(at: Millis) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: at.0.div_euclid(1000),
        nanos: (at.0.rem_euclid(1000) * 1_000_000) as i32,
    }
}

fn duration(d: Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
    }
}

/// The API's status enum.
pub fn status(status: Status) -> api::LiveLessonStatus {
    match status {
        Status::Pending => api::LiveLessonStatus::Pending,
        Status::Booting => api::LiveLessonStatus::Booting,
        Status::Configuring => api::LiveLessonStatus::Configuring,
        Status::Ready => api::LiveLessonStatus::Ready,
        Status::Failed => api::LiveLessonStatus::Failed,
        Status::Terminating => api::LiveLessonStatus::Terminating,
    }
}

/// The domain status for an API filter; `None` for UNSPECIFIED.
pub fn status_filter(value: i32) -> Result<Option<Status>, String> {
    match api::LiveLessonStatus::try_from(value) {
        Ok(api::LiveLessonStatus::Unspecified) => Ok(None),
        Ok(api::LiveLessonStatus::Pending) => Ok(Some(Status::Pending)),
        Ok(api::LiveLessonStatus::Booting) => Ok(Some(Status::Booting)),
        Ok(api::LiveLessonStatus::Configuring) => Ok(Some(Status::Configuring)),
        Ok(api::LiveLessonStatus::Ready) => Ok(Some(Status::Ready)),
        Ok(api::LiveLessonStatus::Failed) => Ok(Some(Status::Failed)),
        Ok(api::LiveLessonStatus::Terminating) => Ok(Some(Status::Terminating)),
        Err(_) => Err(format!("unknown status {value}")),
    }
}

/// A live lesson for the API. `ttl` is `None` when its session is persistent.
pub fn live_lesson(lesson: &LiveLesson, ttl: Option<Duration>) -> api::LiveLesson {
    let (healthy, total) = lesson
        .endpoints
        .iter()
        .fold((0, 0), |(h, t), e| (h + e.healthy, t + e.total));
    api::LiveLesson {
        id: lesson.id.to_string(),
        session_id: lesson.session_id.to_string(),
        lesson_slug: lesson.lesson_slug.clone(),
        stage: lesson.stage,
        status: status(lesson.status) as i32,
        failure_reason: if lesson.status == Status::Failed {
            lesson.reason.clone()
        } else {
            String::new()
        },
        endpoints: lesson
            .endpoints
            .iter()
            .map(|e| api::LiveEndpoint {
                name: e.name.clone(),
                presentations: e
                    .presentations
                    .iter()
                    .map(|p| api::LivePresentation {
                        name: p.name.clone(),
                        r#type: p.kind.clone(),
                        address: p.address.clone(),
                        url: p.url.clone(),
                    })
                    .collect(),
                healthy: e.healthy,
                total: e.total,
            })
            .collect(),
        healthy,
        total,
        created_at: Some(timestamp(lesson.created_at)),
        last_active: Some(timestamp(lesson.last_active)),
        agent: lesson.agent.clone().unwrap_or_default(),
        generation: lesson.generation,
        expires_at: ttl.map(|ttl| timestamp(lesson.last_active.plus(ttl))),
    }
}

/// A session for the API.
pub fn session(session: &Session, ttl: Duration) -> api::Session {
    api::Session {
        id: session.id.to_string(),
        source_ip: session.source_ip.to_string(),
        persistent: session.persistent,
        created_at: Some(timestamp(session.created_at)),
        last_active: Some(timestamp(session.last_active)),
        expires_at: (!session.persistent).then(|| timestamp(session.last_active.plus(ttl))),
    }
}

/// A lesson for the API. `guides` holds each stage's guide text (empty for listings).
pub fn lesson(lesson: &Lesson, guides: &[String]) -> api::Lesson {
    api::Lesson {
        slug: lesson.slug.clone(),
        name: lesson.name.clone(),
        category: lesson.category.as_str().into(),
        tier: lesson.tier.to_string(),
        prereqs: lesson.prereqs.clone(),
        description: lesson.description.clone(),
        short_description: lesson.short_description.clone(),
        tags: lesson.tags.clone(),
        authors: lesson
            .authors
            .iter()
            .map(|a| api::Author {
                name: a.name.clone(),
                link: a.link.clone().unwrap_or_default(),
            })
            .collect(),
        collection: lesson.collection.clone().unwrap_or_default(),
        diagram: lesson.diagram.clone().unwrap_or_default(),
        video: lesson.video.clone().unwrap_or_default(),
        stages: lesson
            .stages
            .iter()
            .enumerate()
            .map(|(i, s)| api::Stage {
                index: s.index,
                description: s.description.clone(),
                guide_type: s.guide_type.as_str().into(),
                guide: guides.get(i).cloned().unwrap_or_default(),
                video: s.stage_video.clone().unwrap_or_default(),
            })
            .collect(),
        endpoints: lesson
            .endpoints
            .iter()
            .map(|e| api::LessonEndpoint {
                name: e.name.clone(),
                image: e.image.clone(),
                configuration_type: e
                    .configuration_type
                    .map(ConfigurationType::as_str)
                    .unwrap_or_default()
                    .into(),
                additional_ports: ports(&e.additional_ports),
                presentations: e
                    .presentations
                    .iter()
                    .map(|p| api::LessonPresentation {
                        name: p.name.clone(),
                        r#type: p.kind.as_str().into(),
                        port: u32::from(p.port.get()),
                    })
                    .collect(),
            })
            .collect(),
        connections: lesson
            .connections
            .iter()
            .map(|c| api::LessonConnection {
                a: c.a.clone(),
                b: c.b.clone(),
                subnet: c.subnet.map(|s| s.to_string()).unwrap_or_default(),
            })
            .collect(),
    }
}

/// A collection for the API.
pub fn collection(collection: &Collection, catalog: &Catalog) -> api::Collection {
    api::Collection {
        slug: collection.slug.clone(),
        title: collection.title.clone(),
        image: collection.image.clone().unwrap_or_default(),
        website: collection.website.clone().unwrap_or_default(),
        contact_email: collection.contact_email.clone().unwrap_or_default(),
        brief_description: collection.brief_description.clone(),
        long_description: collection.long_description.clone(),
        r#type: collection.kind.as_str().into(),
        tier: collection.tier.to_string(),
        lessons: catalog
            .lessons
            .values()
            .filter(|l| l.collection.as_deref() == Some(collection.slug.as_str()))
            .map(|l| l.slug.clone())
            .collect(),
    }
}

/// Everything an agent needs to realise `live` at its desired stage.
pub fn lesson_spec(
    instance_id: &str,
    live: &LiveLesson,
    lesson: &Lesson,
    catalog: &Catalog,
) -> agent::LessonSpec {
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
            }
        })
        .collect();
    agent::LessonSpec {
        live_lesson_id: live.id.to_string(),
        session_id: live.session_id.to_string(),
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
        labels: HashMap::from([
            (labels::INSTANCE.to_owned(), instance_id.to_owned()),
            (labels::LIVE_LESSON.to_owned(), live.id.to_string()),
            (labels::SESSION.to_owned(), live.session_id.to_string()),
            (labels::GENERATION.to_owned(), live.generation.to_string()),
            (labels::LESSON.to_owned(), live.lesson_slug.clone()),
        ]),
    }
}

/// The scheduler status an agent phase maps to while provisioning; `None` for phases that say
/// nothing about provisioning progress.
pub fn phase_status(phase: i32) -> Option<Status> {
    match agent::Phase::try_from(phase).ok()? {
        agent::Phase::Pending | agent::Phase::Booting => Some(Status::Booting),
        agent::Phase::Configuring => Some(Status::Configuring),
        agent::Phase::Ready => Some(Status::Ready),
        agent::Phase::Failed => Some(Status::Failed),
        agent::Phase::Terminating | agent::Phase::Unspecified => None,
    }
}

/// What to record for an agent's state.
pub fn observation(state: &agent::LiveLessonState, status: Status) -> Observation {
    Observation {
        status,
        reason: state.reason.clone(),
        endpoints: Some(
            state
                .endpoints
                .iter()
                .map(|e| EndpointInfo {
                    name: e.name.clone(),
                    presentations: e
                        .presentations
                        .iter()
                        .map(|p| PresentationInfo {
                            name: p.name.clone(),
                            kind: match agent::PresentationType::try_from(p.r#type) {
                                Ok(agent::PresentationType::Ssh) => "ssh",
                                Ok(agent::PresentationType::Http) => "http",
                                _ => "unknown",
                            }
                            .into(),
                            address: p.address.clone(),
                            url: p.url.clone(),
                        })
                        .collect(),
                    healthy: e.healthy,
                    total: e.total,
                })
                .collect(),
        ),
        handle: (!state.handle.is_empty()).then(|| state.handle.to_vec()),
        agent: None,
    }
}
