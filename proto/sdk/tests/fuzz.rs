//! Fuzzing of the SDK's spec check, `sdk::spec::check(&LessonSpec, &[String])`, on stable Rust
//! (proptest), against the rules table of PROTOCOL.md ([S1], [S2]) written out independently
//! here as [`broken_rules`].
//!
//! - `valid_specs_are_accepted`: a spec drawn to keep every rule is accepted by an agent that
//!   offers what it needs, and refused, naming the presentation or configuration, by one that
//!   lacks one capability it needs.
//! - `mutated_specs_are_judged_by_the_rules`: after field mutations (ids, generation, labels,
//!   names, images, ports, types, configurations, connections, offered capabilities), `check`
//!   accepts exactly the specs that break no rule, and otherwise answers INVALID_ARGUMENT with
//!   reason `INVALID_SPEC`, metadata `field` one of the broken rules' fields, and the message
//!   `field: why`; `ready_delay` and `initial_state` take any spec.
//! - `decoded_bytes_are_judged_by_the_rules`: the same for specs decoded from mutated wire
//!   bytes (what a Provision call carries), and from plain garbage.
//!
//! By default each property runs 1,000 inputs (seconds, in `cargo test --workspace`);
//! `PROPTEST_CASES=N` runs N (`tests/fuzz/run` runs a million in release mode),
//! `PROPTEST_RNG_SEED=S` replays a run. Each failure found is a named regression test below.
#![forbid(unsafe_code)]

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Debug;
use std::time::{Duration, Instant};

use antidote_proto::agent::v1::{
    ConfigurationType, Connection, Endpoint, Image, LessonSpec, Phase, Presentation,
    PresentationType, StageConfiguration,
};
use antidote_sdk::{capabilities, errors, labels, spec};
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use prost::Message as _;

/// The longest one check may take; only a blow-up trips it.
const SLOW: Duration = Duration::from_secs(1);

/// Every capability an agent may offer.
const PROTOCOL_CAPABILITIES: [&str; 11] = [
    capabilities::PRESENTATION_SSH,
    capabilities::PRESENTATION_HTTP,
    capabilities::STAGE_CONFIGURATION,
    capabilities::NETWORK_ISOLATION,
    capabilities::PLAN,
    capabilities::WATCH,
    capabilities::RECOVER,
    capabilities::CONFIGURATION_SHELL,
    capabilities::CONFIGURATION_PYTHON,
    capabilities::CONFIGURATION_ANSIBLE,
    capabilities::CONFIGURATION_NAPALM,
];

/// The capability that announces a configuration type ([V5]), for the types that exist.
fn runs_capability(kind: i32) -> Option<&'static str> {
    match ConfigurationType::try_from(kind).ok()? {
        ConfigurationType::Unspecified => None,
        ConfigurationType::Python => Some(capabilities::CONFIGURATION_PYTHON),
        ConfigurationType::Ansible => Some(capabilities::CONFIGURATION_ANSIBLE),
        ConfigurationType::Napalm => Some(capabilities::CONFIGURATION_NAPALM),
        ConfigurationType::Shell => Some(capabilities::CONFIGURATION_SHELL),
    }
}

/// Runs `property` on `default_cases` inputs (or `$PROPTEST_CASES`), printing the count, the
/// time and each outcome's count; panics with the smallest failing input.
fn fuzz<S>(
    name: &str,
    default_cases: u32,
    strategy: S,
    property: impl Fn(S::Value) -> Result<&'static str, TestCaseError>,
) where
    S: Strategy,
    S::Value: Debug,
{
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|cases| cases.parse().ok())
        .unwrap_or(default_cases);
    let config = Config {
        cases,
        // Failures become named regression tests, not files the runner replays.
        failure_persistence: None,
        max_shrink_time: 120_000,
        ..Config::default()
    };
    let outcomes: RefCell<BTreeMap<&'static str, u64>> = RefCell::default();
    let started = Instant::now();
    let result = TestRunner::new(config).run(&strategy, |input| {
        let outcome = property(input)?;
        *outcomes.borrow_mut().entry(outcome).or_default() += 1;
        Ok(())
    });
    eprintln!(
        "fuzz {name}: {cases} inputs in {:.1?}: {:?}",
        started.elapsed(),
        outcomes.borrow()
    );
    if let Err(failure) = result {
        panic!("fuzz {name}: {failure}");
    }
}

// ---- the rules, written out from PROTOCOL.md [S2] ----

/// Whether `name` is a DNS label: `^[a-z]([a-z0-9-]{0,61}[a-z0-9])?$`.
fn dns_label(name: &str) -> bool {
    let bytes = name.as_bytes();
    (1..=63).contains(&bytes.len())
        && bytes[0].is_ascii_lowercase()
        && (bytes[bytes.len() - 1].is_ascii_lowercase() || bytes[bytes.len() - 1].is_ascii_digit())
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
}

/// Whether `id` is a UUID, hyphenated, in lower case.
fn lower_uuid(id: &str) -> bool {
    let groups: Vec<&str> = id.split('-').collect();
    groups.len() == 5
        && groups.iter().zip([8, 4, 4, 4, 12]).all(|(group, len)| {
            group.len() == len
                && group
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        })
}

/// The fields of every rule `spec` breaks for an agent offering `offered`; empty when it keeps
/// them all. A broken label names `spec.labels[K]`, as [S1]'s example does.
fn broken_rules(spec: &LessonSpec, offered: &[String]) -> BTreeSet<String> {
    let offers = |capability: &str| offered.iter().any(|c| c == capability);
    let mut broken = BTreeSet::new();
    if !lower_uuid(&spec.live_lesson_id) {
        broken.insert("spec.live_lesson_id".to_owned());
    }
    if spec.generation == 0 {
        broken.insert("spec.generation".to_owned());
    }
    for label in labels::REQUIRED {
        if spec.labels.get(label).is_none_or(String::is_empty) {
            broken.insert(format!("spec.labels[{label}]"));
        }
    }
    if spec
        .labels
        .get(labels::LIVE_LESSON)
        .is_some_and(|id| !id.is_empty() && *id != spec.live_lesson_id)
    {
        broken.insert(format!("spec.labels[{}]", labels::LIVE_LESSON));
    }
    if spec.endpoints.is_empty() {
        broken.insert("spec.endpoints".to_owned());
    }
    let mut names = BTreeSet::new();
    for (i, endpoint) in spec.endpoints.iter().enumerate() {
        let at = format!("spec.endpoints[{i}]");
        if !dns_label(&endpoint.name) || !names.insert(endpoint.name.as_str()) {
            broken.insert(format!("{at}.name"));
        }
        if endpoint
            .image
            .as_ref()
            .is_none_or(|image| image.slug.is_empty())
        {
            broken.insert(format!("{at}.image.slug"));
        }
        for (k, port) in endpoint.additional_ports.iter().enumerate() {
            if !(1..=65535).contains(port) {
                broken.insert(format!("{at}.additional_ports[{k}]"));
            }
        }
        let mut presentations = BTreeSet::new();
        for (j, presentation) in endpoint.presentations.iter().enumerate() {
            let at = format!("{at}.presentations[{j}]");
            if presentation.name.is_empty() || !presentations.insert(presentation.name.as_str()) {
                broken.insert(format!("{at}.name"));
            }
            if !(1..=65535).contains(&presentation.port) {
                broken.insert(format!("{at}.port"));
            }
            let needed = match PresentationType::try_from(presentation.r#type) {
                Ok(PresentationType::Ssh) => Some(capabilities::PRESENTATION_SSH),
                Ok(PresentationType::Http) => Some(capabilities::PRESENTATION_HTTP),
                _ => None,
            };
            if !needed.is_some_and(offers) {
                broken.insert(format!("{at}.type"));
            }
        }
        if let Some(configuration) = &endpoint.configuration {
            if !offers(capabilities::STAGE_CONFIGURATION) {
                broken.insert(format!("{at}.configuration"));
            }
            // [V5]: the types an agent runs are those it lists as `configuration.<type>`, or
            // shell alone when it lists none.
            let listed = offered
                .iter()
                .any(|c| c.starts_with(capabilities::CONFIGURATION_PREFIX));
            let runs = match runs_capability(configuration.r#type) {
                None => false,
                Some(capability) if listed => offers(capability),
                Some(capability) => capability == capabilities::CONFIGURATION_SHELL,
            };
            if !runs {
                broken.insert(format!("{at}.configuration.type"));
            }
            // A plain file name (it is written as a file and a ConfigMap key), at most 256 KiB,
            // and a NAPALM configuration names its driver.
            let name = &configuration.file_name;
            let plain = !name.is_empty()
                && name.len() <= 253
                && name != "."
                && name != ".."
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c));
            if !plain {
                broken.insert(format!("{at}.configuration.file_name"));
            }
            if configuration.contents.len() > 256 * 1024 {
                broken.insert(format!("{at}.configuration.contents"));
            }
            let driver = &configuration.driver;
            if configuration.r#type == ConfigurationType::Napalm as i32
                && !(driver.starts_with(|c: char| c.is_ascii_lowercase())
                    && driver
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            {
                broken.insert(format!("{at}.configuration.driver"));
            }
        }
    }
    // Every configuration file of the stage together: at most 1 MiB.
    let total: usize = spec
        .endpoints
        .iter()
        .filter_map(|e| e.configuration.as_ref())
        .map(|c| c.contents.len())
        .sum();
    if total > 1024 * 1024 {
        broken.insert("spec.endpoints".to_owned());
    }
    // An endpoint named twice still names an endpoint.
    let all: BTreeSet<&str> = spec.endpoints.iter().map(|e| e.name.as_str()).collect();
    for (i, connection) in spec.connections.iter().enumerate() {
        for (side, end) in [("a", &connection.a), ("b", &connection.b)] {
            if !all.contains(end.as_str()) {
                broken.insert(format!("spec.connections[{i}].{side}"));
            }
        }
    }
    broken
}

/// Checks `spec` and compares the verdict with the rules: accepted exactly when no rule is
/// broken; otherwise INVALID_ARGUMENT, INVALID_SPEC, `field` one of the broken rules' fields,
/// message `field: why`. Also runs the SDK's other functions of a spec.
fn judged_by_the_rules(
    spec: &LessonSpec,
    offered: &[String],
) -> Result<&'static str, TestCaseError> {
    let started = Instant::now();
    let verdict = spec::check(spec, offered);
    let _ = spec::ready_delay(spec);
    let state = spec::initial_state(spec, Phase::Pending, "fuzz");
    prop_assert_eq!(state.endpoints.len(), spec.endpoints.len());
    let took = started.elapsed();
    prop_assert!(took < SLOW, "the check took {took:?}");
    let broken = broken_rules(spec, offered);
    match verdict {
        Ok(()) => {
            prop_assert!(broken.is_empty(), "accepted, but it breaks {broken:?}");
            Ok("accepted")
        }
        Err(status) => {
            prop_assert_eq!(status.code(), tonic::Code::InvalidArgument);
            let Some((reason, metadata)) = errors::reason(&status) else {
                return Err(TestCaseError::fail(format!("no ErrorInfo: {status:?}")));
            };
            prop_assert_eq!(reason, "INVALID_SPEC");
            let field = metadata.get("field").cloned().unwrap_or_default();
            prop_assert!(
                status.message().starts_with(&format!("{field}: ")),
                "the message does not start with its field `{field}`: {}",
                status.message()
            );
            prop_assert!(
                broken.contains(&field),
                "refused naming `{field}` ({}), but the broken rules are {broken:?}",
                status.message()
            );
            Ok("refused")
        }
    }
}

// ---- valid specs ----

/// The capabilities `spec` needs.
fn needs(spec: &LessonSpec) -> BTreeSet<&'static str> {
    let mut needs = BTreeSet::new();
    for endpoint in &spec.endpoints {
        for presentation in &endpoint.presentations {
            needs.insert(if presentation.r#type == PresentationType::Ssh as i32 {
                capabilities::PRESENTATION_SSH
            } else {
                capabilities::PRESENTATION_HTTP
            });
        }
        if let Some(configuration) = &endpoint.configuration {
            needs.insert(capabilities::STAGE_CONFIGURATION);
            needs.extend(runs_capability(configuration.r#type));
        }
    }
    needs
}

fn uuid() -> impl Strategy<Value = String> {
    any::<u128>().prop_map(|n| uuid::Uuid::from_u128(n).hyphenated().to_string())
}

fn endpoint() -> impl Strategy<Value = Endpoint> {
    let presentation = ("\\PC{1,8}", 1..=65535u32, select(&[1, 2][..]));
    let configuration = (
        1..=4i32,
        "[a-z0-9][a-zA-Z0-9._-]{0,11}",
        proptest::collection::vec(any::<u8>(), 0..32),
        "[a-z][a-z0-9_]{0,5}",
    )
        .prop_map(|(r#type, file_name, contents, driver)| StageConfiguration {
            r#type,
            file_name,
            contents,
            driver,
        });
    (
        "[a-z]([a-z0-9-]{0,20}[a-z0-9])?",
        "\\PC{1,12}",
        (
            0..=3i32,
            any::<bool>(),
            proptest::collection::vec("[a-z]{1,4}[0-9]", 0..3),
        ),
        proptest::collection::vec(1..=65535u32, 0..3),
        proptest::collection::vec(presentation, 0..3),
        proptest::option::of(configuration),
    )
        .prop_map(
            |(
                name,
                slug,
                (flavor, enable_forwarding, network_interfaces),
                additional_ports,
                presentations,
                configuration,
            )| {
                Endpoint {
                    name,
                    image: Some(Image {
                        slug,
                        flavor,
                        enable_forwarding,
                        network_interfaces,
                        ..Image::default()
                    }),
                    additional_ports,
                    presentations: presentations
                        .into_iter()
                        .enumerate()
                        .map(|(k, (name, port, r#type))| Presentation {
                            name: format!("{name}{k}"),
                            r#type,
                            port,
                        })
                        .collect(),
                    configuration,
                    jupyter_guide: None,
                }
            },
        )
}

/// A spec that keeps every rule, and capabilities that include what it needs.
fn valid_spec() -> impl Strategy<Value = (LessonSpec, Vec<String>)> {
    (
        (
            uuid(),
            uuid(),
            "[a-z0-9-]{1,12}",
            1..=u64::MAX,
            any::<u32>(),
        ),
        proptest::collection::vec(endpoint(), 1..5),
        proptest::collection::vec((any::<usize>(), any::<usize>(), "[0-9./a-f:]{0,18}"), 0..4),
        proptest::option::of((any::<i64>(), any::<i32>())),
        (
            proptest::collection::vec(("[a-z./-]{1,20}", "\\PC{0,10}"), 0..3),
            "[a-z0-9-]{1,12}",
        ),
        (
            proptest::collection::vec(select(&PROTOCOL_CAPABILITIES[..]), 0..4),
            any::<bool>(),
        ),
    )
        .prop_map(
            |(
                (id, session, lesson, generation, stage),
                mut endpoints,
                connections,
                delay,
                (extra_labels, instance),
                (extra_capabilities, listing),
            )| {
                for (i, endpoint) in endpoints.iter_mut().enumerate() {
                    endpoint.name = format!("{}{i}", endpoint.name);
                }
                let count = endpoints.len();
                let connections = connections
                    .into_iter()
                    .map(|(a, b, subnet)| Connection {
                        a: endpoints[a % count].name.clone(),
                        b: endpoints[b % count].name.clone(),
                        subnet,
                    })
                    .collect();
                let mut labels: HashMap<String, String> = extra_labels.into_iter().collect();
                labels.insert(labels::INSTANCE.into(), instance);
                labels.insert(labels::LIVE_LESSON.into(), id.clone());
                labels.insert(labels::SESSION.into(), session.clone());
                labels.insert(labels::GENERATION.into(), generation.to_string());
                labels.insert(labels::LESSON.into(), lesson.clone());
                let spec = LessonSpec {
                    live_lesson_id: id,
                    session_id: session,
                    lesson_slug: lesson,
                    generation,
                    stage,
                    endpoints,
                    connections,
                    ready_delay: delay
                        .map(|(seconds, nanos)| prost_types::Duration { seconds, nanos }),
                    labels,
                    // Any duration, negative ones too: the agents read it, never refuse it.
                    configuration_timeout: delay
                        .map(|(seconds, nanos)| prost_types::Duration { seconds, nanos }),
                };
                let mut offered: Vec<String> = needs(&spec).into_iter().map(String::from).collect();
                offered.extend(extra_capabilities.into_iter().map(String::from));
                // An agent that lists no configuration type runs shell alone ([V5]).
                let listed = |c: &String| c.starts_with(capabilities::CONFIGURATION_PREFIX);
                if !listing
                    && offered
                        .iter()
                        .filter(|c| listed(c))
                        .all(|c| c == capabilities::CONFIGURATION_SHELL)
                {
                    offered.retain(|c| !listed(c));
                }
                (spec, offered)
            },
        )
}

// ---- mutations ----

/// Strings worth trying as ids, names and labels.
fn any_text() -> impl Strategy<Value = String> {
    prop_oneof![
        select(
            &[
                "",
                "-",
                "a-",
                "-a",
                "1a",
                "a",
                "A",
                "web",
                "Web",
                "a_b",
                "a.b",
                "é",
                "0B5D6C1E-2F7A-4C39-9A51-3C1F0E8D2A77",
                "0b5d6c1e-2f7a-4c39-9a51-3c1f0e8d2a77",
                "{0b5d6c1e-2f7a-4c39-9a51-3c1f0e8d2a77}",
                "0b5d6c1e2f7a4c399a513c1f0e8d2a77",
                "urn:uuid:0b5d6c1e-2f7a-4c39-9a51-3c1f0e8d2a77",
                "0b5d6c1e-2f7a-4c39-9a51-3c1f0e8d2a7g",
                "0b5d6c1e-2f7a-4c39-9a51+3c1f0e8d2a77",
                "00000000-0000-0000-0000-000000000000",
                "0b5d6c1e-2f7a-4c39-9a51-3c1f0e8d2a7\u{e9}",
            ][..],
        )
        .prop_map(String::from),
        uuid().prop_map(|id| id.to_uppercase()),
        "[a-z]([a-z0-9-]{61,63})[a-z0-9]",
        "[a-zA-Z0-9_.-]{0,12}",
        "\\PC{0,12}",
    ]
}

fn any_port() -> impl Strategy<Value = u32> {
    prop_oneof![
        select(&[0u32, 1, 22, 65535, 65536, u32::MAX][..]),
        any::<u32>(),
    ]
}

fn any_enum() -> impl Strategy<Value = i32> {
    prop_oneof![
        select(&[0i32, 1, 2, 3, 4, 5, -1, i32::MAX, i32::MIN][..]),
        any::<i32>()
    ]
}

/// One change to a spec or to the capabilities offered; indices pick the endpoint, the
/// presentation, the connection.
#[derive(Debug, Clone)]
enum SpecMutation {
    Id(String),
    /// The id and the label that must equal it, together.
    IdAndLabel(String),
    Generation(u64),
    RemoveLabel(usize),
    SetLabel(usize, String),
    AddLabel(String, String),
    ClearEndpoints,
    DuplicateEndpoint(usize),
    EndpointName(usize, String),
    NoImage(usize),
    ImageSlug(usize, String),
    AdditionalPort(usize, u32),
    PresentationName(usize, usize, String),
    DuplicatePresentation(usize, usize),
    PresentationPort(usize, usize, u32),
    PresentationType(usize, usize, i32),
    Configuration(usize, Option<i32>),
    ConnectionEnd(usize, bool, String),
    AddConnection(String, String),
    Withdraw(usize),
    Offer(String),
}

fn spec_mutation() -> impl Strategy<Value = SpecMutation> {
    let i = any::<usize>;
    prop_oneof![
        any_text().prop_map(SpecMutation::Id),
        any_text().prop_map(SpecMutation::IdAndLabel),
        select(&[0u64, 1, u64::MAX][..]).prop_map(SpecMutation::Generation),
        i().prop_map(SpecMutation::RemoveLabel),
        (i(), any_text()).prop_map(|(k, v)| SpecMutation::SetLabel(k, v)),
        (any_text(), any_text()).prop_map(|(k, v)| SpecMutation::AddLabel(k, v)),
        Just(SpecMutation::ClearEndpoints),
        i().prop_map(SpecMutation::DuplicateEndpoint),
        (i(), any_text()).prop_map(|(e, v)| SpecMutation::EndpointName(e, v)),
        i().prop_map(SpecMutation::NoImage),
        (i(), any_text()).prop_map(|(e, v)| SpecMutation::ImageSlug(e, v)),
        (i(), any_port()).prop_map(|(e, v)| SpecMutation::AdditionalPort(e, v)),
        (i(), i(), any_text()).prop_map(|(e, p, v)| SpecMutation::PresentationName(e, p, v)),
        (i(), i()).prop_map(|(e, p)| SpecMutation::DuplicatePresentation(e, p)),
        (i(), i(), any_port()).prop_map(|(e, p, v)| SpecMutation::PresentationPort(e, p, v)),
        (i(), i(), any_enum()).prop_map(|(e, p, v)| SpecMutation::PresentationType(e, p, v)),
        (i(), proptest::option::of(any_enum()))
            .prop_map(|(e, v)| SpecMutation::Configuration(e, v)),
        (i(), any::<bool>(), any_text()).prop_map(|(c, a, v)| SpecMutation::ConnectionEnd(c, a, v)),
        (any_text(), any_text()).prop_map(|(a, b)| SpecMutation::AddConnection(a, b)),
        i().prop_map(SpecMutation::Withdraw),
        prop_oneof![
            select(&PROTOCOL_CAPABILITIES[..]).prop_map(String::from),
            any_text()
        ]
        .prop_map(SpecMutation::Offer),
    ]
}

/// The endpoint `e` picks, if there is any.
fn pick(spec: &mut LessonSpec, e: usize) -> Option<&mut Endpoint> {
    let count = spec.endpoints.len();
    (count > 0).then(|| &mut spec.endpoints[e % count])
}

/// Applies `mutation` to `spec` and `offered`.
fn mutate(spec: &mut LessonSpec, offered: &mut Vec<String>, mutation: &SpecMutation) {
    let endpoints = spec.endpoints.len();
    match mutation {
        SpecMutation::Id(id) => spec.live_lesson_id = id.clone(),
        SpecMutation::IdAndLabel(id) => {
            spec.live_lesson_id = id.clone();
            spec.labels.insert(labels::LIVE_LESSON.into(), id.clone());
        }
        SpecMutation::Generation(generation) => spec.generation = *generation,
        SpecMutation::RemoveLabel(k) => {
            spec.labels
                .remove(labels::REQUIRED[k % labels::REQUIRED.len()]);
        }
        SpecMutation::SetLabel(k, value) => {
            spec.labels.insert(
                labels::REQUIRED[k % labels::REQUIRED.len()].to_owned(),
                value.clone(),
            );
        }
        SpecMutation::AddLabel(key, value) => {
            spec.labels.insert(key.clone(), value.clone());
        }
        SpecMutation::ClearEndpoints => spec.endpoints.clear(),
        SpecMutation::DuplicateEndpoint(e) => {
            if endpoints > 0 {
                let copy = spec.endpoints[e % endpoints].clone();
                spec.endpoints.push(copy);
            }
        }
        SpecMutation::EndpointName(e, name) => {
            if let Some(endpoint) = pick(spec, *e) {
                endpoint.name = name.clone();
            }
        }
        SpecMutation::NoImage(e) => {
            if let Some(endpoint) = pick(spec, *e) {
                endpoint.image = None;
            }
        }
        SpecMutation::ImageSlug(e, slug) => {
            if let Some(endpoint) = pick(spec, *e) {
                endpoint.image.get_or_insert_default().slug = slug.clone();
            }
        }
        SpecMutation::AdditionalPort(e, port) => {
            if let Some(endpoint) = pick(spec, *e) {
                endpoint.additional_ports.push(*port);
            }
        }
        SpecMutation::PresentationName(e, p, name) => {
            if let Some(endpoint) = pick(spec, *e)
                && !endpoint.presentations.is_empty()
            {
                let count = endpoint.presentations.len();
                endpoint.presentations[p % count].name = name.clone();
            }
        }
        SpecMutation::DuplicatePresentation(e, p) => {
            if let Some(endpoint) = pick(spec, *e)
                && !endpoint.presentations.is_empty()
            {
                let count = endpoint.presentations.len();
                let copy = endpoint.presentations[p % count].clone();
                endpoint.presentations.push(copy);
            }
        }
        SpecMutation::PresentationPort(e, p, port) => {
            if let Some(endpoint) = pick(spec, *e) {
                match endpoint.presentations.len() {
                    0 => endpoint.presentations.push(Presentation {
                        name: "p".into(),
                        r#type: PresentationType::Ssh as i32,
                        port: *port,
                    }),
                    count => endpoint.presentations[p % count].port = *port,
                }
            }
        }
        SpecMutation::PresentationType(e, p, kind) => {
            if let Some(endpoint) = pick(spec, *e)
                && !endpoint.presentations.is_empty()
            {
                let count = endpoint.presentations.len();
                endpoint.presentations[p % count].r#type = *kind;
            }
        }
        SpecMutation::Configuration(e, kind) => {
            if let Some(endpoint) = pick(spec, *e) {
                endpoint.configuration = kind.map(|r#type| StageConfiguration {
                    r#type,
                    ..StageConfiguration::default()
                });
            }
        }
        SpecMutation::ConnectionEnd(c, a, name) => {
            if !spec.connections.is_empty() {
                let count = spec.connections.len();
                let connection = &mut spec.connections[c % count];
                if *a {
                    connection.a = name.clone();
                } else {
                    connection.b = name.clone();
                }
            }
        }
        SpecMutation::AddConnection(a, b) => spec.connections.push(Connection {
            a: a.clone(),
            b: b.clone(),
            subnet: String::new(),
        }),
        SpecMutation::Withdraw(k) => {
            if !offered.is_empty() {
                let count = offered.len();
                offered.remove(k % count);
            }
        }
        SpecMutation::Offer(capability) => offered.push(capability.clone()),
    }
}

/// A change to encoded bytes.
#[derive(Debug, Clone)]
enum ByteMutation {
    Flip { at: usize, bits: u8 },
    Insert { at: usize, bytes: Vec<u8> },
    Delete { at: usize, len: usize },
    Truncate { at: usize },
}

fn byte_mutation() -> impl Strategy<Value = ByteMutation> {
    prop_oneof![
        (any::<usize>(), 1..=u8::MAX).prop_map(|(at, bits)| ByteMutation::Flip { at, bits }),
        (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..8))
            .prop_map(|(at, bytes)| ByteMutation::Insert { at, bytes }),
        (any::<usize>(), 1..8usize).prop_map(|(at, len)| ByteMutation::Delete { at, len }),
        any::<usize>().prop_map(|at| ByteMutation::Truncate { at }),
    ]
}

fn mutate_bytes(bytes: &mut Vec<u8>, mutation: &ByteMutation) {
    match mutation {
        ByteMutation::Flip { at, bits } => {
            if !bytes.is_empty() {
                let at = at % bytes.len();
                bytes[at] ^= bits;
            }
        }
        ByteMutation::Insert { at, bytes: new } => {
            let at = at % (bytes.len() + 1);
            bytes.splice(at..at, new.iter().copied());
        }
        ByteMutation::Delete { at, len } => {
            let at = at % (bytes.len() + 1);
            let end = (at + len).min(bytes.len());
            bytes.drain(at..end);
        }
        ByteMutation::Truncate { at } => bytes.truncate(at % (bytes.len() + 1)),
    }
}

// ---- properties ----

#[test]
fn valid_specs_are_accepted() {
    fuzz(
        "spec: valid specs",
        1000,
        (valid_spec(), any::<usize>()),
        |((spec, offered), k)| {
            prop_assert!(
                spec::check(&spec, &offered).is_ok(),
                "refused: {:?}",
                spec::check(&spec, &offered)
            );
            judged_by_the_rules(&spec, &offered)?;
            // Without a presentation's capability or `stage.configuration`, the spec is
            // refused at a presentation or a configuration. (Without a `configuration.<type>`
            // it may still run, as shell, when no type is listed any more: left to the rules.)
            let needs: Vec<&str> = needs(&spec)
                .into_iter()
                .filter(|c| !c.starts_with(capabilities::CONFIGURATION_PREFIX))
                .collect();
            if needs.is_empty() {
                return Ok("accepted (needs no capability)");
            }
            let lacking = needs[k % needs.len()];
            let fewer: Vec<String> = offered.iter().filter(|c| *c != lacking).cloned().collect();
            let Err(status) = spec::check(&spec, &fewer) else {
                return Err(TestCaseError::fail(format!("accepted without `{lacking}`")));
            };
            prop_assert!(
                status
                    .message()
                    .contains(&format!("does not offer `{lacking}`")),
                "{}",
                status.message()
            );
            judged_by_the_rules(&spec, &fewer)?;
            Ok("accepted, and refused without a capability it needs")
        },
    );
}

#[test]
fn mutated_specs_are_judged_by_the_rules() {
    let input = (
        valid_spec(),
        proptest::collection::vec(spec_mutation(), 1..4),
    );
    fuzz(
        "spec: mutated specs",
        1000,
        input,
        |((mut spec, mut offered), mutations)| {
            for mutation in &mutations {
                mutate(&mut spec, &mut offered, mutation);
            }
            judged_by_the_rules(&spec, &offered)
        },
    );
}

#[test]
fn decoded_bytes_are_judged_by_the_rules() {
    let input = (
        valid_spec(),
        proptest::collection::vec(byte_mutation(), 1..4),
        proptest::collection::vec(any::<u8>(), 0..128),
    );
    fuzz(
        "spec: decoded bytes",
        1000,
        input,
        |((spec, offered), mutations, garbage)| {
            let mut bytes = spec.encode_to_vec();
            for mutation in &mutations {
                mutate_bytes(&mut bytes, mutation);
            }
            let mut outcome = "not a spec";
            for bytes in [bytes, garbage] {
                if let Ok(spec) = LessonSpec::decode(bytes.as_slice()) {
                    outcome = judged_by_the_rules(&spec, &offered)?;
                }
            }
            Ok(outcome)
        },
    );
}

// ---- regressions: each failure the fuzzer found, by name ----

/// The spec every regression starts from: one endpoint with one HTTP presentation.
fn minimal_spec() -> (LessonSpec, Vec<String>) {
    let id = "0b5d6c1e-2f7a-4c39-9a51-3c1f0e8d2a77";
    let spec = LessonSpec {
        live_lesson_id: id.into(),
        generation: 1,
        labels: labels::REQUIRED
            .iter()
            .map(|label| ((*label).to_owned(), id.to_owned()))
            .collect(),
        endpoints: vec![Endpoint {
            name: "web".into(),
            image: Some(Image {
                slug: "busybox".into(),
                ..Image::default()
            }),
            presentations: vec![Presentation {
                name: "http".into(),
                r#type: PresentationType::Http as i32,
                port: 8080,
            }],
            ..Endpoint::default()
        }],
        ..LessonSpec::default()
    };
    (spec, vec![capabilities::PRESENTATION_HTTP.to_owned()])
}

/// Found by `mutated_specs_are_judged_by_the_rules`: [S2] wants the id "hyphenated, lower
/// case" (ids are compared as strings, and agent-k8s puts it in namespace names, which must be
/// lower case), but `spec::is_uuid` also took upper case, so `...-00126483429A` was accepted.
#[test]
fn an_upper_case_live_lesson_id_is_refused() {
    let (mut spec, offered) = minimal_spec();
    let id = "0B5D6C1E-2F7A-4C39-9A51-3C1F0E8D2A77";
    spec.live_lesson_id = id.into();
    spec.labels.insert(labels::LIVE_LESSON.into(), id.into());
    assert_eq!(
        judged_by_the_rules(&spec, &offered).map_err(|e| e.to_string()),
        Ok("refused")
    );
}

/// Found by `mutated_specs_are_judged_by_the_rules`: a missing label was refused with
/// `field` = `spec.labels`, where [S1] names the label itself
/// (`spec.labels[antidote.io/session]`), as the check already did for a wrong
/// `antidote.io/live-lesson`.
#[test]
fn a_missing_label_is_named_by_its_key() {
    let (mut spec, offered) = minimal_spec();
    spec.labels.remove(labels::SESSION);
    let status = spec::check(&spec, &offered).expect_err("a label is missing");
    let (_, metadata) = errors::reason(&status).expect("an ErrorInfo");
    assert_eq!(metadata["field"], "spec.labels[antidote.io/session]");
    assert_eq!(
        judged_by_the_rules(&spec, &offered).map_err(|e| e.to_string()),
        Ok("refused")
    );
}
