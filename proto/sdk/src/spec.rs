//! Spec checks every agent needs, and the states built from a spec.
//!
//! [`check`] applies the rules of `agent.proto` that do not depend on the backend; each error is
//! INVALID_ARGUMENT naming the field (`spec.endpoints[1].presentations[0].port: …`).

use std::collections::HashSet;
use std::time::Duration;

use tonic::Status;

use antidote_proto::agent::v1::{
    ConfigurationType, Endpoint, EndpointState, LessonSpec, LiveLessonState, Phase,
    PresentationState, PresentationType,
};

use antidote_proto::limits::{MAX_CONFIGURATION_FILE, MAX_CONFIGURATION_STAGE, MAX_NOTEBOOK};

/// The most labels a spec may carry (PROTOCOL.md [S2]; the scheduler sends 6 or 7): every
/// state, and so every Watch event, carries them all.
pub const MAX_LABELS: usize = 32;

/// The most bytes of one label's key, and of its value (PROTOCOL.md [S2]).
pub const MAX_LABEL_BYTES: usize = 253;

use super::{capabilities, errors, labels};

/// Checks `spec` against the protocol's rules and what the agent offers.
pub fn check(spec: &LessonSpec, offered: &[String]) -> Result<(), Status> {
    let bad = |field: String, why: String| Err(errors::invalid(field, why));
    let offers = |capability: &str| offered.iter().any(|c| c == capability);
    if !is_uuid(&spec.live_lesson_id) {
        return bad(
            "spec.live_lesson_id".into(),
            format!("`{}` is not a UUID", spec.live_lesson_id),
        );
    }
    if spec.generation == 0 {
        return bad("spec.generation".into(), "must be at least 1".into());
    }
    for label in labels::REQUIRED {
        if spec.labels.get(label).is_none_or(|v| v.is_empty()) {
            return bad(format!("spec.labels[{label}]"), "is missing".into());
        }
    }
    if spec.labels[labels::LIVE_LESSON] != spec.live_lesson_id {
        return bad(
            format!("spec.labels[{}]", labels::LIVE_LESSON),
            format!(
                "`{}` is not the live lesson id `{}`",
                spec.labels[labels::LIVE_LESSON],
                spec.live_lesson_id
            ),
        );
    }
    if spec.labels.len() > MAX_LABELS {
        return bad(
            "spec.labels".into(),
            format!(
                "{} labels, over the {MAX_LABELS} a spec may carry",
                spec.labels.len()
            ),
        );
    }
    if let Some(key) = spec
        .labels
        .iter()
        .filter(|(k, v)| k.len() > MAX_LABEL_BYTES || v.len() > MAX_LABEL_BYTES)
        .map(|(k, _)| k)
        .min()
    {
        return bad(
            format!("spec.labels[{key}]"),
            format!("its key or value is over {MAX_LABEL_BYTES} bytes"),
        );
    }
    if spec.endpoints.is_empty() {
        return bad("spec.endpoints".into(), "must not be empty".into());
    }
    let mut names = HashSet::new();
    for (i, endpoint) in spec.endpoints.iter().enumerate() {
        let field = format!("spec.endpoints[{i}]");
        if !is_dns_label(&endpoint.name) {
            return bad(
                format!("{field}.name"),
                format!(
                    "`{}` is not a DNS label (1-63 of a-z, 0-9 and -, starting with a letter)",
                    endpoint.name
                ),
            );
        }
        if !names.insert(endpoint.name.as_str()) {
            return bad(
                format!("{field}.name"),
                format!("`{}` appears twice", endpoint.name),
            );
        }
        if endpoint.image.as_ref().is_none_or(|i| i.slug.is_empty()) {
            return bad(format!("{field}.image.slug"), "is empty".into());
        }
        for (j, port) in endpoint.additional_ports.iter().enumerate() {
            if !(1..=65535).contains(port) {
                return bad(
                    format!("{field}.additional_ports[{j}]"),
                    format!("{port} is not in 1..65535"),
                );
            }
        }
        let mut presentation_names = HashSet::new();
        for (j, p) in endpoint.presentations.iter().enumerate() {
            let field = format!("{field}.presentations[{j}]");
            if p.name.is_empty() || !presentation_names.insert(p.name.as_str()) {
                return bad(
                    format!("{field}.name"),
                    format!("`{}` is empty or appears twice", p.name),
                );
            }
            if !(1..=65535).contains(&p.port) {
                return bad(
                    format!("{field}.port"),
                    format!("{} is not in 1..65535", p.port),
                );
            }
            let needed = match PresentationType::try_from(p.r#type) {
                Ok(PresentationType::Ssh) => capabilities::PRESENTATION_SSH,
                Ok(PresentationType::Http) => capabilities::PRESENTATION_HTTP,
                _ => return bad(format!("{field}.type"), "must be SSH or HTTP".into()),
            };
            if !offers(needed) {
                return bad(
                    format!("{field}.type"),
                    format!("this agent does not offer `{needed}`"),
                );
            }
        }
        if let Some(guide) = &endpoint.jupyter_guide {
            if !offers(capabilities::GUIDE_JUPYTER) {
                return bad(
                    format!("{field}.jupyter_guide"),
                    format!(
                        "this agent does not offer `{}`",
                        capabilities::GUIDE_JUPYTER
                    ),
                );
            }
            if guide.notebook.len() > MAX_NOTEBOOK {
                return bad(
                    format!("{field}.jupyter_guide.notebook"),
                    format!(
                        "{} bytes, over the {} KiB a notebook may hold",
                        guide.notebook.len(),
                        MAX_NOTEBOOK / 1024
                    ),
                );
            }
            if endpoint.configuration.is_some() {
                return bad(
                    format!("{field}.configuration"),
                    "a Jupyter guide endpoint is not configured".into(),
                );
            }
        }
        if let Some(configuration) = &endpoint.configuration {
            if !offers(capabilities::STAGE_CONFIGURATION) {
                return bad(
                    format!("{field}.configuration"),
                    format!(
                        "this agent does not offer `{}`",
                        capabilities::STAGE_CONFIGURATION
                    ),
                );
            }
            let kind = ConfigurationType::try_from(configuration.r#type)
                .unwrap_or(ConfigurationType::Unspecified);
            if kind == ConfigurationType::Unspecified {
                return bad(
                    format!("{field}.configuration.type"),
                    "is unspecified".into(),
                );
            }
            if !runs(offered, kind) {
                return bad(
                    format!("{field}.configuration.type"),
                    format!(
                        "this agent does not offer `{}`",
                        capabilities::configuration(kind)
                    ),
                );
            }
            if !is_file_name(&configuration.file_name) {
                return bad(
                    format!("{field}.configuration.file_name"),
                    format!(
                        "`{}` is not a file name (1-253 of A-Z, a-z, 0-9, `.`, `_` and `-`; not `.` or `..`)",
                        configuration.file_name
                    ),
                );
            }
            if configuration.contents.len() > MAX_CONFIGURATION_FILE {
                return bad(
                    format!("{field}.configuration.contents"),
                    format!(
                        "{} bytes, over the {} KiB a configuration file may hold",
                        configuration.contents.len(),
                        MAX_CONFIGURATION_FILE / 1024
                    ),
                );
            }
            if kind == ConfigurationType::Napalm && !is_driver(&configuration.driver) {
                return bad(
                    format!("{field}.configuration.driver"),
                    format!(
                        "`{}` is not a NAPALM driver name (a-z, 0-9 and _, starting with a letter)",
                        configuration.driver
                    ),
                );
            }
        }
    }
    let total: usize = spec
        .endpoints
        .iter()
        .filter_map(|e| e.configuration.as_ref())
        .map(|c| c.contents.len())
        .sum();
    if total > MAX_CONFIGURATION_STAGE {
        return bad(
            "spec.endpoints".into(),
            format!(
                "the stage's configuration files hold {total} bytes, over the {} KiB a stage may hold",
                MAX_CONFIGURATION_STAGE / 1024
            ),
        );
    }
    for (i, c) in spec.connections.iter().enumerate() {
        for (side, end) in [("a", &c.a), ("b", &c.b)] {
            if !names.contains(end.as_str()) {
                return bad(
                    format!("spec.connections[{i}].{side}"),
                    format!("names unknown endpoint `{end}`"),
                );
            }
        }
    }
    Ok(())
}

/// Whether an agent offering `offered` runs configurations of `kind`: those it lists as
/// `configuration.<type>`, or shell alone when it lists none (PROTOCOL.md [V5]).
pub fn runs(offered: &[String], kind: ConfigurationType) -> bool {
    let listed = offered
        .iter()
        .any(|c| c.starts_with(capabilities::CONFIGURATION_PREFIX));
    if listed {
        let wanted = capabilities::configuration(kind);
        offered.contains(&wanted)
    } else {
        kind == ConfigurationType::Shell
    }
}

/// Checks that `newer`, a newer generation of the live lesson `held` is, changes only what may
/// change between generations: the generation, stage, ready delay, the endpoints'
/// configurations and image credentials, and the generation label (PROTOCOL.md [S3]). The error
/// names the first top-level field that differs.
pub fn same_lesson(held: &LessonSpec, newer: &LessonSpec) -> Result<(), Status> {
    fn endpoints(spec: &LessonSpec) -> Vec<Endpoint> {
        spec.endpoints
            .iter()
            .cloned()
            .map(|mut endpoint| {
                endpoint.configuration = None;
                // The notebook is the stage's; that there is a guide is the lesson's.
                if let Some(guide) = endpoint.jupyter_guide.as_mut() {
                    guide.notebook.clear();
                }
                if let Some(image) = endpoint.image.as_mut() {
                    image.ssh_user.clear();
                    image.ssh_password.clear();
                    image.config_user.clear();
                    image.config_password.clear();
                }
                endpoint
            })
            .collect()
    }
    fn labels(spec: &LessonSpec) -> std::collections::HashMap<&str, &str> {
        spec.labels
            .iter()
            .filter(|(k, _)| k.as_str() != labels::GENERATION)
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect()
    }
    let changed = if held.session_id != newer.session_id {
        "spec.session_id"
    } else if held.lesson_slug != newer.lesson_slug {
        "spec.lesson_slug"
    } else if endpoints(held) != endpoints(newer) {
        "spec.endpoints"
    } else if held.connections != newer.connections {
        "spec.connections"
    } else if labels(held) != labels(newer) {
        "spec.labels"
    } else {
        return Ok(());
    };
    Err(errors::invalid(
        changed,
        format!(
            "differs from generation {} of this live lesson; only the stage, the ready delay, \
             configurations and image credentials change between generations",
            held.generation
        ),
    ))
}

/// The state of a spec's live lesson before anything is known: endpoints named, nothing healthy.
pub fn initial_state(
    spec: &LessonSpec,
    phase: Phase,
    reason: impl Into<String>,
) -> LiveLessonState {
    LiveLessonState {
        live_lesson_id: spec.live_lesson_id.clone(),
        generation: spec.generation,
        stage: spec.stage,
        phase: phase as i32,
        reason: reason.into(),
        endpoints: spec
            .endpoints
            .iter()
            .map(|e| EndpointState {
                name: e.name.clone(),
                total: e.presentations.len() as u32,
                ..Default::default()
            })
            .collect(),
        handle: spec.live_lesson_id.clone().into_bytes().into(),
        conditions: vec![],
        labels: spec.labels.clone(),
        revision: 0,
        last_active: None,
    }
}

/// A presentation's reported state at `address` (host:port), with a URL for HTTP.
pub fn presentation_state(name: &str, kind: i32, address: impl Into<String>) -> PresentationState {
    let address = address.into();
    PresentationState {
        name: name.to_owned(),
        r#type: kind,
        url: if kind == PresentationType::Http as i32 {
            format!("http://{address}/")
        } else {
            String::new()
        },
        address,
    }
}

/// The lesson's ready delay.
pub fn ready_delay(spec: &LessonSpec) -> Duration {
    spec.ready_delay
        .map(|d| Duration::new(d.seconds.max(0) as u64, d.nanos.max(0) as u32))
        .unwrap_or_default()
}

/// How long one try of a stage configuration may run: the lesson's `configuration_timeout`
/// when it sets a positive one, capped at `ceiling` (the agent's `--config-timeout`, the
/// operator's limit); otherwise `ceiling`. PROTOCOL.md [R3].
pub fn configuration_timeout(spec: &LessonSpec, ceiling: Duration) -> Duration {
    match spec.configuration_timeout {
        Some(d) if d.seconds > 0 || (d.seconds == 0 && d.nanos > 0) => {
            Duration::new(d.seconds.max(0) as u64, d.nanos.max(0) as u32).min(ceiling)
        }
        _ => ceiling,
    }
}

/// Whether `text` is a UUID in its hyphenated, lower-case form (PROTOCOL.md [S2]: backends
/// derive names from it, and some, like Kubernetes namespaces, must be lower case).
pub fn is_uuid(text: &str) -> bool {
    text.len() == 36
        && !text.bytes().any(|b| b.is_ascii_uppercase())
        && uuid::Uuid::try_parse(text).is_ok()
}

/// Whether `name` can be a configuration's file name in a directory of its own and a ConfigMap
/// key: 1-253 of `A-Za-z0-9._-`, not `.` or `..` (so never a path).
pub fn is_file_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Whether `name` can be a NAPALM driver's name (`junos`, `nxos_ssh`, ...).
pub fn is_driver(name: &str) -> bool {
    name.bytes().next().is_some_and(|b| b.is_ascii_lowercase())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

/// Whether `name` is a DNS label as the curriculum requires of endpoint names.
pub fn is_dns_label(name: &str) -> bool {
    let bytes = name.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 63
        && bytes[0].is_ascii_lowercase()
        && bytes[bytes.len() - 1] != b'-'
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
}

#[cfg(test)]
mod tests {
    use super::*;
    use antidote_proto::agent::v1::{Endpoint, Image, Presentation, StageConfiguration};

    fn spec() -> LessonSpec {
        LessonSpec {
            live_lesson_id: "0b5d6c1e-2f7a-4c39-9a51-3c1f0e8d2a77".into(),
            generation: 1,
            labels: labels::REQUIRED
                .iter()
                .map(|l| {
                    (
                        (*l).to_owned(),
                        "0b5d6c1e-2f7a-4c39-9a51-3c1f0e8d2a77".to_owned(),
                    )
                })
                .collect(),
            endpoints: vec![Endpoint {
                name: "web".into(),
                image: Some(Image {
                    slug: "busybox".into(),
                    ..Default::default()
                }),
                presentations: vec![Presentation {
                    name: "http".into(),
                    r#type: PresentationType::Http as i32,
                    port: 8080,
                }],
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    fn all() -> Vec<String> {
        [
            capabilities::PRESENTATION_HTTP,
            capabilities::PRESENTATION_SSH,
            capabilities::STAGE_CONFIGURATION,
        ]
        .map(String::from)
        .to_vec()
    }

    #[test]
    fn the_lessons_configuration_timeout_is_capped_by_the_agents() {
        let ceiling = Duration::from_secs(300);
        let with = |seconds: i64, nanos: i32| LessonSpec {
            configuration_timeout: Some(prost_types::Duration { seconds, nanos }),
            ..spec()
        };
        assert_eq!(configuration_timeout(&spec(), ceiling), ceiling, "absent");
        assert_eq!(configuration_timeout(&with(0, 0), ceiling), ceiling, "zero");
        assert_eq!(
            configuration_timeout(&with(-5, 0), ceiling),
            ceiling,
            "negative"
        );
        assert_eq!(
            configuration_timeout(&with(2, 0), ceiling),
            Duration::from_secs(2)
        );
        assert_eq!(
            configuration_timeout(&with(0, 500_000_000), ceiling),
            Duration::from_millis(500)
        );
        assert_eq!(
            configuration_timeout(&with(3600, 0), ceiling),
            ceiling,
            "capped"
        );
    }

    /// Applies `change` to a valid spec and returns the error message (or "ok").
    fn check_with(change: impl FnOnce(&mut LessonSpec), offered: &[String]) -> String {
        let mut spec = spec();
        change(&mut spec);
        match check(&spec, offered) {
            Ok(()) => "ok".into(),
            Err(status) => {
                assert_eq!(status.code(), tonic::Code::InvalidArgument);
                status.message().to_owned()
            }
        }
    }

    #[test]
    fn labels_are_bounded_in_number_and_size() {
        let offered = all();
        let long = "x".repeat(MAX_LABEL_BYTES + 1);
        assert_eq!(
            check_with(
                |s| {
                    s.labels.insert("k".into(), long.clone());
                },
                &offered
            ),
            format!("spec.labels[k]: its key or value is over {MAX_LABEL_BYTES} bytes")
        );
        assert_eq!(
            check_with(
                |s| {
                    s.labels.insert(long.clone(), "v".into());
                },
                &offered
            ),
            format!("spec.labels[{long}]: its key or value is over {MAX_LABEL_BYTES} bytes")
        );
        let at_bound = "x".repeat(MAX_LABEL_BYTES);
        assert_eq!(
            check_with(
                |s| {
                    s.labels.insert(at_bound.clone(), at_bound.clone());
                },
                &offered
            ),
            "ok"
        );
        assert_eq!(
            check_with(
                |s| {
                    for n in s.labels.len()..=MAX_LABELS {
                        s.labels.insert(format!("extra/{n}"), "v".into());
                    }
                },
                &offered
            ),
            format!("spec.labels: 33 labels, over the {MAX_LABELS} a spec may carry")
        );
    }

    #[test]
    fn every_rule_names_its_field() {
        type Change = Box<dyn FnOnce(&mut LessonSpec)>;
        let cases: Vec<(Change, &str)> = vec![
            (Box::new(|_| {}), "ok"),
            (
                Box::new(|s| s.live_lesson_id = "x".into()),
                "spec.live_lesson_id: `x` is not a UUID",
            ),
            (
                Box::new(|s| {
                    s.live_lesson_id = s.live_lesson_id.to_uppercase();
                }),
                "spec.live_lesson_id: `0B5D6C1E-2F7A-4C39-9A51-3C1F0E8D2A77` is not a UUID",
            ),
            (
                Box::new(|s| s.generation = 0),
                "spec.generation: must be at least 1",
            ),
            (
                Box::new(|s| {
                    s.labels.remove(labels::SESSION);
                }),
                "spec.labels[antidote.io/session]: is missing",
            ),
            (
                Box::new(|s| {
                    s.labels.insert(labels::LIVE_LESSON.into(), "other".into());
                }),
                "spec.labels[antidote.io/live-lesson]: `other` is not the live lesson id `0b5d6c1e-2f7a-4c39-9a51-3c1f0e8d2a77`",
            ),
            (
                Box::new(|s| s.endpoints.clear()),
                "spec.endpoints: must not be empty",
            ),
            (
                Box::new(|s| s.endpoints[0].name = "Web_1".into()),
                "spec.endpoints[0].name: `Web_1` is not a DNS label (1-63 of a-z, 0-9 and -, starting with a letter)",
            ),
            (
                Box::new(|s| s.endpoints.push(s.endpoints[0].clone())),
                "spec.endpoints[1].name: `web` appears twice",
            ),
            (
                Box::new(|s| s.endpoints[0].image = None),
                "spec.endpoints[0].image.slug: is empty",
            ),
            (
                Box::new(|s| s.endpoints[0].presentations[0].port = 70000),
                "spec.endpoints[0].presentations[0].port: 70000 is not in 1..65535",
            ),
            (
                Box::new(|s| s.endpoints[0].presentations[0].r#type = 0),
                "spec.endpoints[0].presentations[0].type: must be SSH or HTTP",
            ),
            (
                Box::new(|s| {
                    s.endpoints[0].configuration = Some(StageConfiguration::default());
                }),
                "spec.endpoints[0].configuration.type: is unspecified",
            ),
            (
                Box::new(|s| {
                    s.connections.push(antidote_proto::agent::v1::Connection {
                        a: "web".into(),
                        b: "ghost".into(),
                        subnet: String::new(),
                    })
                }),
                "spec.connections[0].b: names unknown endpoint `ghost`",
            ),
        ];
        for (change, expected) in cases {
            assert_eq!(check_with(change, &all()), expected);
        }
    }

    #[test]
    fn capabilities_not_offered_are_refused() {
        let only_ssh = vec![capabilities::PRESENTATION_SSH.to_owned()];
        assert_eq!(
            check_with(|_| {}, &only_ssh),
            "spec.endpoints[0].presentations[0].type: this agent does not offer `presentation.http`"
        );
        let http = vec![capabilities::PRESENTATION_HTTP.to_owned()];
        assert_eq!(
            check_with(
                |s| {
                    s.endpoints[0].configuration = Some(StageConfiguration {
                        r#type: ConfigurationType::Shell as i32,
                        ..Default::default()
                    })
                },
                &http
            ),
            "spec.endpoints[0].configuration: this agent does not offer `stage.configuration`"
        );
        // Shell alone unless types are listed; then only those.
        let python = |s: &mut LessonSpec| {
            s.endpoints[0].configuration = Some(StageConfiguration {
                r#type: ConfigurationType::Python as i32,
                file_name: "web.py".into(),
                ..Default::default()
            })
        };
        assert_eq!(
            check_with(python, &all()),
            "spec.endpoints[0].configuration.type: this agent does not offer `configuration.python`"
        );
        let mut listed = all();
        listed.push("configuration.python".into());
        assert_eq!(check_with(python, &listed), "ok");
        assert!(runs(&all(), ConfigurationType::Shell));
        assert!(!runs(&listed, ConfigurationType::Shell));
    }

    #[test]
    fn configuration_files_are_plain_names_and_bounded_in_size() {
        let offered = {
            let mut all = all();
            all.extend(["configuration.shell", "configuration.napalm"].map(String::from));
            all
        };
        let configured = |file_name: &str, size: usize, kind: ConfigurationType, driver: &str| {
            let (file_name, driver) = (file_name.to_owned(), driver.to_owned());
            move |s: &mut LessonSpec| {
                s.endpoints[0].configuration = Some(StageConfiguration {
                    r#type: kind as i32,
                    file_name,
                    contents: vec![b'#'; size],
                    driver,
                })
            }
        };
        let shell = ConfigurationType::Shell;
        let napalm = ConfigurationType::Napalm;
        type Change = Box<dyn FnOnce(&mut LessonSpec)>;
        let cases: Vec<(Change, &str)> = vec![
            (Box::new(configured("web.sh", 10, shell, "")), "ok"),
            (
                Box::new(configured("web-junos.txt", 256 * 1024, napalm, "junos")),
                "ok",
            ),
            (
                Box::new(configured("../etc/passwd", 10, shell, "")),
                "spec.endpoints[0].configuration.file_name: `../etc/passwd` is not a file name (1-253 of A-Z, a-z, 0-9, `.`, `_` and `-`; not `.` or `..`)",
            ),
            (
                Box::new(configured("..", 10, shell, "")),
                "spec.endpoints[0].configuration.file_name: `..` is not a file name (1-253 of A-Z, a-z, 0-9, `.`, `_` and `-`; not `.` or `..`)",
            ),
            (
                Box::new(configured("", 10, shell, "")),
                "spec.endpoints[0].configuration.file_name: `` is not a file name (1-253 of A-Z, a-z, 0-9, `.`, `_` and `-`; not `.` or `..`)",
            ),
            (
                Box::new(configured("web.sh", 256 * 1024 + 1, shell, "")),
                "spec.endpoints[0].configuration.contents: 262145 bytes, over the 256 KiB a configuration file may hold",
            ),
            (
                Box::new(configured("web-.txt", 10, napalm, "")),
                "spec.endpoints[0].configuration.driver: `` is not a NAPALM driver name (a-z, 0-9 and _, starting with a letter)",
            ),
            (
                Box::new(|s: &mut LessonSpec| {
                    for i in 0..5 {
                        let mut endpoint = s.endpoints[0].clone();
                        endpoint.name = format!("e{i}");
                        endpoint.configuration = Some(StageConfiguration {
                            r#type: ConfigurationType::Shell as i32,
                            file_name: "e.sh".into(),
                            contents: vec![b'#'; 250 * 1024],
                            driver: String::new(),
                        });
                        s.endpoints.push(endpoint);
                    }
                }),
                "spec.endpoints: the stage's configuration files hold 1280000 bytes, over the 1024 KiB a stage may hold",
            ),
        ];
        for (change, expected) in cases {
            assert_eq!(check_with(change, &offered), expected);
        }
    }

    #[test]
    fn jupyter_guides_need_the_capability_and_a_bounded_notebook() {
        use antidote_proto::agent::v1::JupyterGuide;
        let guide = |size: usize| {
            move |s: &mut LessonSpec| {
                s.endpoints[0].jupyter_guide = Some(JupyterGuide {
                    notebook: vec![b' '; size],
                })
            }
        };
        assert_eq!(
            check_with(guide(10), &all()),
            "spec.endpoints[0].jupyter_guide: this agent does not offer `guide.jupyter`"
        );
        let mut offered = all();
        offered.push(capabilities::GUIDE_JUPYTER.into());
        assert_eq!(check_with(guide(MAX_NOTEBOOK), &offered), "ok");
        assert_eq!(
            check_with(guide(MAX_NOTEBOOK + 1), &offered),
            "spec.endpoints[0].jupyter_guide.notebook: 524289 bytes, over the 512 KiB a notebook may hold"
        );
        // Another stage's notebook is the same lesson.
        let mut held = spec();
        guide(3)(&mut held);
        let mut newer = held.clone();
        newer.generation += 1;
        guide(7)(&mut newer);
        assert!(same_lesson(&held, &newer).is_ok());
    }

    #[test]
    fn a_newer_generation_changes_only_what_may_change() {
        let held = spec();
        let mut newer = spec();
        newer.generation = 2;
        newer.stage = 1;
        newer.labels.insert(labels::GENERATION.into(), "2".into());
        newer.endpoints[0].configuration = Some(StageConfiguration {
            r#type: ConfigurationType::Shell as i32,
            ..Default::default()
        });
        newer.endpoints[0].image.as_mut().unwrap().ssh_password = "rotated".into();
        assert!(same_lesson(&held, &newer).is_ok());
        let mut added = newer.clone();
        added.endpoints.push(added.endpoints[0].clone());
        added.endpoints[1].name = "db".into();
        let status = same_lesson(&held, &added).unwrap_err();
        assert!(
            status.message().starts_with("spec.endpoints: "),
            "{}",
            status.message()
        );
        let mut linked = newer.clone();
        linked
            .connections
            .push(antidote_proto::agent::v1::Connection {
                a: "web".into(),
                b: "web".into(),
                subnet: String::new(),
            });
        let status = same_lesson(&held, &linked).unwrap_err();
        assert!(
            status.message().starts_with("spec.connections: "),
            "{}",
            status.message()
        );
    }
}
