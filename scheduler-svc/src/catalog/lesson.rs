//! Reading `lessons/<dir>/lesson.meta.yaml` and checking everything inside one lesson: its
//! endpoints, presentations, connections and stages, the images and collection it names, and
//! the files its stages need.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use serde_yaml::Value;

use super::meta::{self, LESSON_SLUG, Parsed};
use super::model::{
    Author, Category, CheckMode, ConfigurationType, Connection, DEFAULT_CHECK_TIMEOUT, Endpoint,
    GuideType, JUPYTER_GUIDE_ENDPOINT, Lesson, LessonPlacement, Presentation, PresentationKind,
    Stage, Tier,
};
use super::source::Source;
use super::stage;
use super::yaml::{self, FileProblems, Node};

/// What a lesson may refer to outside itself, collected before lessons are read.
///
/// Both hold every slug that some file declared, even files that failed to load, so that one
/// broken image is reported once rather than again at every endpoint that uses it.
pub(super) struct Known<'a> {
    /// Every declared image slug.
    pub(super) images: &'a BTreeSet<String>,
    /// Every declared collection slug, with its tier if that could be read.
    pub(super) collections: &'a BTreeMap<String, Option<Tier>>,
}

/// What reading one lesson produced.
pub(super) struct Draft {
    /// Slug, tier and (if the lesson had no problem at all) the lesson.
    pub(super) parsed: Parsed<Lesson>,
    /// The prereqs as written, checked once every lesson has been read.
    pub(super) prereqs: Vec<String>,
}

/// The keys of a lesson file, as Antidote defined them.
const LESSON_KEYS: &[&str] = &[
    "name",
    "slug",
    "category",
    "tier",
    "prereqs",
    "description",
    "shortDescription",
    "tags",
    "authors",
    "collection",
    "diagram",
    "video",
    "readyDelay",
    "configTimeout",
    "checkTimeout",
    "endpoints",
    "stages",
    "connections",
    "placement",
];

/// Reads the lesson whose `lesson.meta.yaml` (already parsed into `value`) sits in `dir`.
pub(super) fn read(
    source: &dyn Source,
    dir: &Path,
    value: &Value,
    known: &Known<'_>,
    report: &mut FileProblems,
) -> Draft {
    // Name the lesson in every error, including the unknown-key errors that opening the node
    // reports before any field is read.
    if let Some(slug) = value.get("slug").and_then(Value::as_str)
        && !slug.is_empty()
    {
        report.set_lesson(slug);
    }
    let before = report.count();
    let Some(node) = Node::open("", value, LESSON_KEYS, report) else {
        return Draft {
            parsed: Parsed::nothing(),
            prereqs: Vec::new(),
        };
    };

    let slug = meta::slug(&node, &LESSON_SLUG, report);
    if let Some(slug) = &slug {
        // Covers slugs the early look missed, such as `slug: 42`.
        report.set_lesson(slug);
    }
    let name = node.required_string("name", report);
    let category = node.choice::<Category>("category", true, report);
    let tier = node.choice::<Tier>("tier", true, report);
    let prereqs = node.strings("prereqs", report);
    let description = node.text("description", report);
    let short_description = node.text("shortDescription", report);
    let tags = node.strings("tags", report);
    let authors = authors(&node, report);
    let collection = node.string("collection", report);
    let diagram = node.string("diagram", report);
    let video = node.string("video", report);
    let ready_delay = ready_delay(&node, report);
    let config_timeout = config_timeout(&node, report);
    let check_timeout = check_timeout(&node, report);
    let (endpoints, endpoint_names) = endpoints(&node, known, report);
    let connections = connections(&node, &endpoint_names, report);
    let stages = stages(source, dir, &node, &endpoints, report);
    if stages.iter().any(|s| s.guide_type == GuideType::Jupyter)
        && let Some((field, _)) = endpoints
            .iter()
            .find(|(_, e)| e.name == JUPYTER_GUIDE_ENDPOINT)
    {
        report.error(
            format!("{field}.name"),
            format!(
                "`{JUPYTER_GUIDE_ENDPOINT}` names the endpoint that serves this lesson's jupyter \
                 guides"
            ),
        );
    }
    let placement = placement(&node, report);

    if let Some(collection) = &collection {
        check_collection(&node, collection, tier, known, report);
    }

    let lesson = match (&slug, name, category, tier) {
        (Some(slug), Some(name), Some(category), Some(tier)) if report.count() == before => {
            Some(Lesson {
                slug: slug.clone(),
                name,
                category,
                tier,
                prereqs: prereqs.clone(),
                description,
                short_description,
                tags,
                authors,
                collection,
                diagram,
                video,
                ready_delay,
                config_timeout,
                check_timeout,
                endpoints: endpoints
                    .into_iter()
                    .map(|(_, endpoint)| endpoint)
                    .collect(),
                stages,
                connections,
                dir: dir.to_owned(),
                placement,
            })
        }
        _ => None,
    };
    Draft {
        parsed: Parsed {
            slug,
            tier,
            item: lesson,
        },
        prereqs,
    }
}

/// `authors: [{name, link}]`.
fn authors(node: &Node<'_>, report: &mut FileProblems) -> Vec<Author> {
    let mut authors = Vec::new();
    for (field, value) in node.items("authors", report) {
        let Some(author) = Node::open(&field, value, &["name", "link"], report) else {
            continue;
        };
        let name = author.required_string("name", report);
        let link = author.string("link", report);
        if let Some(name) = name {
            authors.push(Author { name, link });
        }
    }
    authors
}

/// `placement: { requires: {k: v}, prefers: {k: v} }`: labels the agent must and should carry.
fn placement(node: &Node<'_>, report: &mut FileProblems) -> LessonPlacement {
    let Some(placement) = node.child("placement", &["requires", "prefers"], report) else {
        return LessonPlacement::default();
    };
    LessonPlacement {
        requires: placement.labels("requires", report),
        prefers: placement.labels("prefers", report),
    }
}

/// `readyDelay`, in whole seconds; zero when absent.
fn ready_delay(node: &Node<'_>, report: &mut FileProblems) -> Duration {
    match node.integer("readyDelay", report) {
        None => Duration::ZERO,
        Some(seconds) => match u64::try_from(seconds) {
            Ok(seconds) => Duration::from_secs(seconds),
            Err(_) => {
                report.error(
                    node.field("readyDelay"),
                    format!("`{seconds}` must not be negative"),
                );
                Duration::ZERO
            }
        },
    }
}

/// The longest `configTimeout` a lesson may ask for, in seconds. Agents cap it further at their
/// own `--config-timeout`.
pub const MAX_CONFIG_TIMEOUT: i64 = 3600;

/// `configTimeout`, in whole seconds (1 to [`MAX_CONFIG_TIMEOUT`]), as `readyDelay` is; absent:
/// the agent's own timeout.
fn config_timeout(node: &Node<'_>, report: &mut FileProblems) -> Option<Duration> {
    let seconds = node.integer("configTimeout", report)?;
    if !(1..=MAX_CONFIG_TIMEOUT).contains(&seconds) {
        report.error(
            node.field("configTimeout"),
            format!("`{seconds}` must be from 1 to {MAX_CONFIG_TIMEOUT} seconds"),
        );
        return None;
    }
    // In range, so positive.
    Some(Duration::from_secs(seconds.unsigned_abs()))
}

/// The longest `checkTimeout` a lesson may ask for, in seconds: a learner waits for the
/// answer.
pub const MAX_CHECK_TIMEOUT: i64 = 600;

/// `checkTimeout`, in whole seconds (1 to [`MAX_CHECK_TIMEOUT`]); absent:
/// [`DEFAULT_CHECK_TIMEOUT`].
fn check_timeout(node: &Node<'_>, report: &mut FileProblems) -> Duration {
    let Some(seconds) = node.integer("checkTimeout", report) else {
        return DEFAULT_CHECK_TIMEOUT;
    };
    if !(1..=MAX_CHECK_TIMEOUT).contains(&seconds) {
        report.error(
            node.field("checkTimeout"),
            format!("`{seconds}` must be from 1 to {MAX_CHECK_TIMEOUT} seconds"),
        );
        return DEFAULT_CHECK_TIMEOUT;
    }
    // In range, so positive.
    Duration::from_secs(seconds.unsigned_abs())
}

/// Whether `name` can name an endpoint: backends use it as a host name, a Kubernetes object
/// name and a file name, so it must be a lowercase DNS label (RFC 1123, starting with a
/// letter). Curricula that ran on Antidote already obeyed this, since Kubernetes enforced it.
fn is_endpoint_name(name: &str) -> bool {
    let bytes = name.as_bytes();
    let (Some(first), Some(last)) = (bytes.first(), bytes.last()) else {
        return false;
    };
    bytes.len() <= 63
        && first.is_ascii_lowercase()
        && (last.is_ascii_lowercase() || last.is_ascii_digit())
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
}

/// `endpoints`: returns the endpoints with a valid name, each with its path, and the names of
/// all endpoints (valid or not) for checking connections.
fn endpoints(
    node: &Node<'_>,
    known: &Known<'_>,
    report: &mut FileProblems,
) -> (Vec<(String, Endpoint)>, BTreeSet<String>) {
    const KEYS: &[&str] = &[
        "name",
        "image",
        "configurationType",
        "additionalPorts",
        "presentations",
    ];
    let items = node.items("endpoints", report);
    if items.is_empty() {
        report.error(
            node.field("endpoints"),
            "a lesson needs at least one endpoint",
        );
    }
    let mut endpoints = Vec::new();
    // Where each name was first defined, to point duplicates at it.
    let mut first_defined: BTreeMap<String, String> = BTreeMap::new();
    for (field, value) in items {
        let Some(endpoint) = Node::open(&field, value, KEYS, report) else {
            continue;
        };
        let name = endpoint.required_string("name", report);
        if let Some(name) = &name {
            if !is_endpoint_name(name) {
                report.error(
                    endpoint.field("name"),
                    format!(
                        "`{name}` must be a lowercase dns label: ^[a-z]([a-z0-9-]*[a-z0-9])?$, \
                         at most 63 characters"
                    ),
                );
            }
            if let Some(first) = first_defined.get(name) {
                report.error(
                    endpoint.field("name"),
                    format!("endpoint `{name}` is already defined at `{first}`"),
                );
            } else {
                first_defined.insert(name.clone(), field.clone());
            }
        }
        let image = endpoint.required_string("image", report);
        if let Some(image) = &image
            && !known.images.contains(image)
        {
            report.reference(
                endpoint.field("image"),
                format!("no image with slug `{image}`"),
            );
        }
        let configuration_type =
            endpoint.choice::<ConfigurationType>("configurationType", false, report);
        let port_items = endpoint.items("additionalPorts", report);
        let has_ports = !port_items.is_empty();
        let additional_ports = port_items
            .into_iter()
            .filter_map(|(field, value)| yaml::port(&field, value, report))
            .collect();
        let presentation_items = endpoint.items("presentations", report);
        if presentation_items.is_empty() && !has_ports {
            report.error(
                &field,
                "an endpoint needs at least one presentation or additional port",
            );
        }
        let presentations = presentations(presentation_items, report);
        // Kept even when something else in it is wrong, so that its config files are still
        // checked in every stage; the lesson itself is dropped if anything at all was wrong,
        // so the placeholder for a missing image never leaves this module. An invalid name is
        // never kept: it would be joined into config file paths.
        if let Some(name) = name
            && is_endpoint_name(&name)
        {
            endpoints.push((
                field,
                Endpoint {
                    name,
                    image: image.unwrap_or_default(),
                    configuration_type,
                    additional_ports,
                    presentations,
                },
            ));
        }
    }
    (endpoints, first_defined.into_keys().collect())
}

/// An endpoint's `presentations`.
fn presentations(items: Vec<(String, &Value)>, report: &mut FileProblems) -> Vec<Presentation> {
    let mut presentations = Vec::new();
    let mut first_defined: BTreeMap<String, String> = BTreeMap::new();
    for (field, value) in items {
        let Some(presentation) = Node::open(&field, value, &["name", "port", "type"], report)
        else {
            continue;
        };
        let name = presentation.required_string("name", report);
        if let Some(name) = &name {
            if let Some(first) = first_defined.get(name) {
                report.error(
                    presentation.field("name"),
                    format!("presentation `{name}` is already defined at `{first}`"),
                );
            } else {
                first_defined.insert(name.clone(), field.clone());
            }
        }
        let port = presentation.port("port", report);
        let kind = presentation.choice::<PresentationKind>("type", true, report);
        if let (Some(name), Some(port), Some(kind)) = (name, port, kind) {
            presentations.push(Presentation { name, port, kind });
        }
    }
    presentations
}

/// `connections`; `endpoints` holds every endpoint name the lesson declares.
fn connections(
    node: &Node<'_>,
    endpoints: &BTreeSet<String>,
    report: &mut FileProblems,
) -> Vec<Connection> {
    let mut connections = Vec::new();
    for (field, value) in node.items("connections", report) {
        let Some(connection) = Node::open(&field, value, &["a", "b", "subnet"], report) else {
            continue;
        };
        let before = report.count();
        let a = connection.required_string("a", report);
        let b = connection.required_string("b", report);
        for (key, end) in [("a", &a), ("b", &b)] {
            if let Some(end) = end
                && !endpoints.contains(end)
            {
                report.error(
                    connection.field(key),
                    format!("no endpoint named `{end}` in this lesson"),
                );
            }
        }
        if let (Some(a), Some(b)) = (&a, &b)
            && a == b
        {
            report.error(&field, format!("connects endpoint `{a}` to itself"));
        }
        let subnet = connection
            .string("subnet", report)
            .and_then(|text| subnet(&connection.field("subnet"), &text, report));
        if let (Some(a), Some(b)) = (a, b)
            && report.count() == before
        {
            connections.push(Connection { a, b, subnet });
        }
    }
    connections
}

/// A connection's `subnet`: CIDR notation with the host bits clear, since it names a network
/// that addresses are handed out from, not an address.
fn subnet(field: &str, text: &str, report: &mut FileProblems) -> Option<ipnet::IpNet> {
    match text.parse::<ipnet::IpNet>() {
        Ok(net) if net.trunc() == net => Some(net),
        Ok(net) => {
            report.error(
                field,
                format!(
                    "`{text}` has host bits set (the network is `{}`)",
                    net.trunc()
                ),
            );
            None
        }
        Err(_) => {
            report.error(
                field,
                format!("`{text}` is not a subnet in cidr notation, e.g. 10.1.0.0/24"),
            );
            None
        }
    }
}

/// `stages`, with each stage's files located in `source`.
fn stages(
    source: &dyn Source,
    dir: &Path,
    node: &Node<'_>,
    endpoints: &[(String, Endpoint)],
    report: &mut FileProblems,
) -> Vec<Stage> {
    const KEYS: &[&str] = &["description", "guideType", "stageVideo", "checks"];
    let items = node.items("stages", report);
    if items.is_empty() {
        report.error(node.field("stages"), "a lesson needs at least one stage");
    }
    let mut stages = Vec::new();
    for (index, (field, value)) in (0u32..).zip(items) {
        let Some(stage) = Node::open(&field, value, KEYS, report) else {
            continue;
        };
        let description = stage.text("description", report);
        let guide_type = stage.choice::<GuideType>("guideType", true, report);
        let stage_video = stage.string("stageVideo", report);
        let check_mode = stage
            .choice::<CheckMode>("checks", false, report)
            .unwrap_or(CheckMode::Advisory);
        let Some(guide_type) = guide_type else {
            continue;
        };
        let Some(files) = stage::locate(
            source,
            dir,
            index,
            stage.path(),
            guide_type,
            endpoints,
            report,
        ) else {
            continue;
        };
        if check_mode == CheckMode::Gate && files.checks.is_empty() {
            report.error(
                stage.field("checks"),
                format!("`gate` needs a check, and `stage{index}/checks/` holds none"),
            );
            continue;
        }
        stages.push(Stage {
            index,
            description,
            guide_type,
            guide: files.guide,
            notebook: files.notebook,
            stage_video,
            configs: files.configs,
            checks: files.checks,
            solutions: files.solutions,
            check_mode,
        });
    }
    stages
}

/// Checks that the lesson's `collection` exists and is loaded wherever the lesson is.
fn check_collection(
    node: &Node<'_>,
    collection: &str,
    tier: Option<Tier>,
    known: &Known<'_>,
    report: &mut FileProblems,
) {
    match known.collections.get(collection) {
        None => report.reference(
            node.field("collection"),
            format!("no collection with slug `{collection}`"),
        ),
        Some(Some(collection_tier)) => {
            if let Some(tier) = tier
                && *collection_tier < tier
            {
                report.reference(
                    node.field("collection"),
                    format!(
                        "collection `{collection}` has tier {collection_tier}, below this \
                         lesson's tier {tier}, so it is skipped wherever this lesson loads"
                    ),
                );
            }
        }
        // The collection's own file reports its broken tier.
        Some(None) => {}
    }
}
