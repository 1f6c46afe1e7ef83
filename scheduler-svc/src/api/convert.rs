//! Conversions from domain types to the public API's messages (`antidote.api.v1`), in one
//! place. (The agent protocol's are in `crate::agents`.)

use std::time::Duration;

use antidote_proto::api::v1 as api;

use crate::catalog::{Catalog, Collection, ConfigurationType, Lesson};
use crate::model::{
    CheckRun, LiveLesson, LiveLessonId, Millis, PlacementRecord, Session, StageChecks, Status,
    Wishes, expiry,
};

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

/// A live lesson for the API; `ttl` is the live-lesson TTL.
pub fn live_lesson(lesson: &LiveLesson, ttl: Duration) -> api::LiveLesson {
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
                        // Signed per answer, for the owner only (api::grpc::learner_view).
                        entrypoint_url: String::new(),
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
        expires_at: expiry(lesson.persistent, lesson.last_active, ttl).map(timestamp),
        // Filled in for lessons with checks (`with_checks`).
        passed_stages: Vec::new(),
        last_check: None,
    }
}

/// `lesson` with what its checks established.
pub fn with_checks(
    mut lesson: api::LiveLesson,
    id: LiveLessonId,
    checks: &StageChecks,
) -> api::LiveLesson {
    lesson.passed_stages = checks.passed.iter().copied().collect();
    lesson.last_check = checks.last.as_ref().map(|run| stage_check(id, run));
    lesson
}

fn millis(ms: u64) -> prost_types::Duration {
    prost_types::Duration {
        seconds: (ms / 1000) as i64,
        nanos: ((ms % 1000) * 1_000_000) as i32,
    }
}

/// One run of a stage's files for the API.
pub fn stage_check(id: LiveLessonId, run: &CheckRun) -> api::StageCheck {
    api::StageCheck {
        live_lesson_id: id.to_string(),
        stage: run.stage,
        passed: run.passed,
        endpoints: run
            .endpoints
            .iter()
            .map(|e| api::EndpointCheck {
                endpoint: e.endpoint.clone(),
                file_name: e.file_name.clone(),
                passed: e.passed,
                exit_code: e.exit_code,
                timed_out: e.timed_out,
                feedback: e.feedback.clone(),
                truncated: e.truncated,
                duration: Some(millis(e.duration_ms)),
            })
            .collect(),
        checked_at: Some(timestamp(Millis(run.at))),
        duration: Some(millis(run.duration_ms)),
    }
}

/// What a learner may see of a live lesson: everything but the backend it runs on. The agent's
/// name is for operators (the admin API keeps it), and so are presentations' backend `address`
/// and `url`: blanked unless `backend_addresses` (`[entrypoint] backend_addresses`, off by
/// default), and even then [`crate::api::grpc`] blanks them wherever it issues an entrypoint
/// URL. Failure reasons and events still name the agent where it failed (operators read them
/// too).
pub fn for_learner(mut lesson: api::LiveLesson, backend_addresses: bool) -> api::LiveLesson {
    lesson.agent.clear();
    if !backend_addresses {
        for presentation in lesson
            .endpoints
            .iter_mut()
            .flat_map(|e| e.presentations.iter_mut())
        {
            presentation.address.clear();
            presentation.url.clear();
        }
    }
    lesson
}

/// A session for the API.
pub fn session(session: &Session, ttl: Duration) -> api::Session {
    api::Session {
        id: session.id.to_string(),
        source_ip: session.source_ip.to_string(),
        persistent: session.persistent,
        created_at: Some(timestamp(session.created_at)),
        last_active: Some(timestamp(session.last_active)),
        expires_at: expiry(session.persistent, session.last_active, ttl).map(timestamp),
        // Answered once, by CreateSession; never read back.
        token: String::new(),
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
                checks: if s.checks.is_empty() {
                    String::new()
                } else {
                    s.check_mode.as_str().to_owned()
                },
                check_endpoints: lesson
                    .endpoints
                    .iter()
                    .filter(|e| s.checks.contains_key(&e.name))
                    .map(|e| e.name.clone())
                    .collect(),
                has_solutions: !s.solutions.is_empty(),
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

/// Most labels a request may require or prefer, each.
const MAX_WISHES: usize = 16;

/// Longest label key or value a request may give.
const MAX_LABEL: usize = 128;

/// A request's placement preference as wishes; `Err((field, why))` for a bad label.
pub fn wishes(
    placement: Option<api::PlacementPreference>,
) -> Result<Wishes, (&'static str, String)> {
    let Some(api::PlacementPreference { requires, prefers }) = placement else {
        return Ok(Wishes::default());
    };
    for (field, labels) in [
        ("placement.requires", &requires),
        ("placement.prefers", &prefers),
    ] {
        if labels.len() > MAX_WISHES {
            return Err((field, format!("at most {MAX_WISHES} labels")));
        }
        for (key, value) in labels {
            let fits = |text: &str| (1..=MAX_LABEL).contains(&text.chars().count());
            if !fits(key) || !fits(value) {
                let key: String = key.chars().take(MAX_LABEL).collect();
                return Err((
                    field,
                    format!("label `{key}`: keys and values must be 1-{MAX_LABEL} characters"),
                ));
            }
        }
    }
    Ok(Wishes {
        requires: requires.into_iter().collect(),
        prefers: prefers.into_iter().collect(),
    })
}

/// A live lesson's placement for operators; `None` when nothing was ever recorded.
pub fn placement(record: PlacementRecord) -> Option<api::Placement> {
    let PlacementRecord {
        wishes,
        decision,
        decided_at,
        moved_from,
    } = record;
    if decision.is_none() && moved_from.is_none() && wishes.is_empty() {
        return None;
    }
    let decision = decision.unwrap_or_default();
    Some(api::Placement {
        requires: wishes.requires.into_iter().collect(),
        prefers: wishes.prefers.into_iter().collect(),
        agent: decision.agent,
        reason: decision.reason,
        matched: decision.matched.into_iter().collect(),
        load: decision.load,
        capacity: decision.capacity,
        excluded: decision
            .excluded
            .into_iter()
            .map(|(agent, reason)| api::PlacementExclusion { agent, reason })
            .collect(),
        decided_at: decided_at.map(timestamp),
        moved_from: moved_from.unwrap_or_default(),
    })
}
