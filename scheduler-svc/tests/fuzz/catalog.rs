//! The curriculum catalog, in memory (`Catalog::from_files`; the disk walk only feeds it).
//!
//! A [`Model`] is a valid curriculum drawn structurally (images, collections, lessons with
//! endpoints, presentations, connections, prereqs, stages, guides and configs, in nested
//! directories), rendered to files. Properties:
//! - `valid_curricula_load_as_written`: every model loads, at any tier, and the catalog says
//!   what the model says.
//! - `mutated_curricula_load_or_fail_well`: after text, YAML-tree and file mutations, loading
//!   either succeeds with a catalog that keeps every rule, or fails with well-formed errors
//!   (each under the root, naming a field by its path when it names one, lowercase, no trailing
//!   period, sorted by file); never a panic, never slow.
//! - `garbage_files_fail_well`: the same for files of arbitrary bytes at plausible paths.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::sample::select;
use proptest::string::string_regex;
use proptest::test_runner::TestCaseError;
use scheduler_svc::catalog::{Catalog, CatalogError, NAPALM_DRIVERS, Tier};
use serde_yaml::value::{Tag, TaggedValue};
use serde_yaml::{Mapping, Value};

use crate::fuzz;

/// Where every generated curriculum says it lives.
const ROOT: &str = "/fuzz/curriculum";

/// The longest any one input may take to load; far above the slowest seen (a few ms in a debug
/// build), so only a blow-up (an alias bomb, a quadratic walk) trips it.
const SLOW: Duration = Duration::from_secs(2);

/// Every key any curriculum file may hold: a field path in an error is made of these.
const KEYS: &[&str] = &[
    "a",
    "aVer",
    "additionalPorts",
    "authors",
    "b",
    "briefDescription",
    "category",
    "collection",
    "configPassword",
    "configUser",
    "configurationType",
    "connections",
    "contactEmail",
    "description",
    "diagram",
    "enableForwarding",
    "endpoints",
    "flavor",
    "gitRoot",
    "guideType",
    "image",
    "link",
    "longDescription",
    "name",
    "networkInterfaces",
    "port",
    "prereqs",
    "presentations",
    "readyDelay",
    "shortDescription",
    "slug",
    "sshPassword",
    "sshUser",
    "stageVideo",
    "stages",
    "subnet",
    "tags",
    "tier",
    "title",
    "type",
    "video",
    "website",
];

const TIERS: [Tier; 3] = [Tier::Local, Tier::Ptr, Tier::Prod];
const CATEGORIES: [&str; 3] = ["fundamentals", "tools", "workflows"];
const FLAVORS: [&str; 3] = ["trusted", "untrusted", "legacy"];
const COLLECTION_TYPES: [&str; 3] = ["vendor", "community", "consultancy"];
const CONFIGURATION_TYPES: [&str; 4] = ["python", "ansible", "napalm", "shell"];

// ---- the valid model ----

/// An image as drawn.
#[derive(Debug, Clone)]
struct ImageModel {
    slug: String,
    description: String,
    flavor: &'static str,
    ssh: Option<(String, String)>,
    config: Option<(String, String)>,
    forwarding: bool,
    interfaces: Vec<String>,
    group: Option<String>,
}

/// A collection as drawn.
#[derive(Debug, Clone)]
struct CollectionModel {
    slug: String,
    title: String,
    kind: &'static str,
    tier: usize,
    extras: Vec<(&'static str, String)>,
}

/// A presentation: name, port, `ssh` or `http`.
type PresentationModel = (String, u16, &'static str);

/// An endpoint as drawn; `image` and the configuration type index into their lists.
#[derive(Debug, Clone)]
struct EndpointModel {
    name: String,
    image: usize,
    configuration: Option<(&'static str, &'static str)>,
    additional_ports: Vec<u16>,
    presentations: Vec<PresentationModel>,
}

/// A lesson as drawn, with the text of its stage files.
#[derive(Debug, Clone)]
struct LessonModel {
    slug: String,
    name: String,
    category: &'static str,
    tier: usize,
    prereqs: Vec<usize>,
    collection: Option<usize>,
    texts: Vec<(&'static str, String)>,
    tags: Vec<String>,
    authors: Vec<(String, Option<String>)>,
    ready_delay: Option<u32>,
    endpoints: Vec<EndpointModel>,
    connections: Vec<(usize, usize, Option<ipnet::IpNet>)>,
    /// Per stage: markdown (else jupyter), description, the guide's text, each configured
    /// endpoint's config text.
    stages: Vec<(bool, String, String, Vec<String>)>,
    group: Option<String>,
}

/// A valid curriculum.
#[derive(Debug, Clone)]
struct Model {
    name: String,
    extras: Vec<(&'static str, String)>,
    images: Vec<ImageModel>,
    collections: Vec<CollectionModel>,
    lessons: Vec<LessonModel>,
}

/// Printable text of any script, including YAML's special words and characters.
fn text(min: usize) -> impl Strategy<Value = String> {
    let regex = |pattern: String| string_regex(&pattern).expect("a valid regex");
    prop_oneof![
        regex(format!("[ -~]{{{min},12}}")),
        regex(format!("\\PC{{{min},12}}")),
        select(
            &[
                "yes", "no", "~", "null", "1e3", "0x1f", "- a", "a: b", "#x", "&a", "*a"
            ][..]
        )
        .prop_map(String::from),
    ]
}

fn image() -> impl Strategy<Value = ImageModel> {
    (
        "[A-Za-z0-9-]{1,10}",
        text(0),
        select(&FLAVORS[..]),
        proptest::option::of((text(1), text(1))),
        proptest::option::of((text(1), text(1))),
        any::<bool>(),
        proptest::collection::vec("[a-z]{1,4}[0-9]{0,2}", 0..4),
        proptest::option::of("[a-z_]{1,6}"),
    )
        .prop_map(
            |(slug, description, flavor, ssh, config, forwarding, interfaces, group)| {
                let mut seen = BTreeSet::new();
                let interfaces = interfaces
                    .into_iter()
                    .filter(|name| name != "eth0" && seen.insert(name.clone()))
                    .collect();
                ImageModel {
                    slug,
                    description,
                    flavor,
                    ssh,
                    config,
                    forwarding,
                    interfaces,
                    group,
                }
            },
        )
}

fn collection() -> impl Strategy<Value = CollectionModel> {
    (
        "[a-z-]{1,10}",
        text(1),
        select(&COLLECTION_TYPES[..]),
        0..3usize,
        proptest::collection::vec(
            (
                select(
                    &[
                        "image",
                        "website",
                        "contactEmail",
                        "briefDescription",
                        "longDescription",
                    ][..],
                ),
                text(1),
            ),
            0..3,
        ),
    )
        .prop_map(|(slug, title, kind, tier, extras)| CollectionModel {
            slug,
            title,
            kind,
            tier,
            extras,
        })
}

fn endpoint() -> impl Strategy<Value = EndpointModel> {
    (
        "[a-z]([a-z0-9-]{0,8}[a-z0-9])?",
        any::<usize>(),
        proptest::option::of((select(&CONFIGURATION_TYPES[..]), select(NAPALM_DRIVERS))),
        proptest::collection::vec(1..=u16::MAX, 0..3),
        proptest::collection::vec((text(1), 1..=u16::MAX, select(&["ssh", "http"][..])), 0..3),
    )
        .prop_map(
            |(name, image, configuration, additional_ports, presentations)| EndpointModel {
                name,
                image,
                configuration,
                additional_ports,
                presentations,
            },
        )
}

fn subnet() -> impl Strategy<Value = ipnet::IpNet> {
    prop_oneof![
        (any::<u32>(), 0..=32u8).prop_map(|(address, prefix)| {
            ipnet::Ipv4Net::new(address.into(), prefix)
                .expect("prefix at most 32")
                .trunc()
                .into()
        }),
        (any::<u128>(), 0..=128u8).prop_map(|(address, prefix)| {
            ipnet::Ipv6Net::new(address.into(), prefix)
                .expect("prefix at most 128")
                .trunc()
                .into()
        }),
    ]
}

fn lesson() -> impl Strategy<Value = LessonModel> {
    let texts = proptest::collection::vec(
        (
            select(&["description", "shortDescription", "diagram", "video"][..]),
            text(1),
        ),
        0..3,
    );
    (
        (
            "[a-z0-9-]{1,10}",
            text(1),
            select(&CATEGORIES[..]),
            0..3usize,
        ),
        (
            proptest::collection::vec(any::<usize>(), 0..3),
            proptest::option::of(any::<usize>()),
            texts,
            proptest::collection::vec(text(1), 0..3),
            proptest::collection::vec((text(1), proptest::option::of(text(1))), 0..2),
            proptest::option::of(any::<u32>()),
        ),
        proptest::collection::vec(endpoint(), 1..4),
        proptest::collection::vec(
            (
                any::<usize>(),
                any::<usize>(),
                proptest::option::of(subnet()),
            ),
            0..3,
        ),
        proptest::collection::vec(
            (
                any::<bool>(),
                text(0),
                text(0),
                proptest::collection::vec(text(0), 4),
            ),
            1..4,
        ),
        proptest::option::of("[a-z_]{1,6}"),
    )
        .prop_map(
            |(
                (slug, name, category, tier),
                (prereqs, collection, texts, tags, authors, ready_delay),
                endpoints,
                connections,
                stages,
                group,
            )| LessonModel {
                slug,
                name,
                category,
                tier,
                prereqs,
                collection,
                texts,
                tags,
                authors,
                ready_delay,
                endpoints,
                connections,
                stages,
                group,
            },
        )
}

/// A valid curriculum: the drawn parts with every cross-reference made to hold (unique slugs
/// and names by suffix, references into what exists and loads wherever the referrer does).
fn model() -> impl Strategy<Value = Model> {
    (
        text(1),
        proptest::collection::vec(
            (
                select(&["description", "website", "aVer", "gitRoot"][..]),
                text(1),
            ),
            0..3,
        ),
        proptest::collection::vec(image(), 1..4),
        proptest::collection::vec(collection(), 0..3),
        proptest::collection::vec(lesson(), 0..4),
    )
        .prop_map(|(name, extras, mut images, mut collections, mut lessons)| {
            for (i, image) in images.iter_mut().enumerate() {
                image.slug = format!("{}-{i}", image.slug);
            }
            for (i, collection) in collections.iter_mut().enumerate() {
                collection.slug = format!("{}-{}", collection.slug, char::from(b'a' + i as u8));
            }
            let tiers: Vec<usize> = lessons.iter().map(|lesson| lesson.tier).collect();
            for (i, lesson) in lessons.iter_mut().enumerate() {
                lesson.slug = format!("{}-{i}", lesson.slug);
                let mut seen = BTreeSet::new();
                lesson.prereqs = lesson
                    .prereqs
                    .iter()
                    .map(|p| p % tiers.len())
                    .filter(|&p| p != i && tiers[p] >= lesson.tier && seen.insert(p))
                    .collect();
                lesson.collection = lesson
                    .collection
                    .filter(|_| !collections.is_empty())
                    .map(|c| c % collections.len())
                    .filter(|&c| collections[c].tier >= lesson.tier);
                let count = lesson.endpoints.len();
                for (j, endpoint) in lesson.endpoints.iter_mut().enumerate() {
                    endpoint.name = format!("{}{j}", endpoint.name);
                    endpoint.image %= images.len();
                    for (k, presentation) in endpoint.presentations.iter_mut().enumerate() {
                        presentation.0 = format!("{}{k}", presentation.0);
                    }
                    if endpoint.presentations.is_empty() && endpoint.additional_ports.is_empty() {
                        endpoint.presentations.push(("cli".into(), 22, "ssh"));
                    }
                }
                lesson.connections = lesson
                    .connections
                    .iter()
                    .map(|(a, b, subnet)| (a % count, b % count, *subnet))
                    .filter(|(a, b, _)| a != b)
                    .collect();
            }
            Model {
                name,
                extras,
                images,
                collections,
                lessons,
            }
        })
}

fn string(text: &str) -> Value {
    Value::String(text.to_owned())
}

fn mapping(pairs: impl IntoIterator<Item = (&'static str, Value)>) -> Value {
    Value::Mapping(
        pairs
            .into_iter()
            .map(|(key, value)| (string(key), value))
            .collect::<Mapping>(),
    )
}

fn yaml(value: &Value) -> Vec<u8> {
    serde_yaml::to_string(value)
        .expect("a Value always serialises")
        .into_bytes()
}

impl LessonModel {
    fn dir(&self, index: usize) -> String {
        match &self.group {
            Some(group) => format!("lessons/{group}/{index}-{}", self.slug),
            None => format!("lessons/{index}-{}", self.slug),
        }
    }

    /// The file an endpoint's config has in every stage.
    fn config_file(endpoint: &EndpointModel) -> Option<String> {
        let (kind, driver) = endpoint.configuration?;
        Some(match kind {
            "python" => format!("{}.py", endpoint.name),
            "ansible" => format!("{}.yml", endpoint.name),
            "shell" => format!("{}.sh", endpoint.name),
            _ => format!("{}-{driver}.txt", endpoint.name),
        })
    }
}

impl Model {
    /// The curriculum's files, by path relative to the root.
    fn files(&self) -> BTreeMap<String, Vec<u8>> {
        let mut files = BTreeMap::new();
        let mut meta = vec![("name", string(&self.name))];
        meta.extend(self.extras.iter().map(|(key, text)| (*key, string(text))));
        files.insert("curriculum.meta.yaml".to_owned(), yaml(&mapping(meta)));

        for (i, image) in self.images.iter().enumerate() {
            let mut pairs = vec![
                ("slug", string(&image.slug)),
                ("description", string(&image.description)),
                ("flavor", string(image.flavor)),
                ("enableForwarding", Value::Bool(image.forwarding)),
                (
                    "networkInterfaces",
                    Value::Sequence(image.interfaces.iter().map(|n| string(n)).collect()),
                ),
            ];
            if let Some((user, password)) = &image.ssh {
                pairs.push(("sshUser", string(user)));
                pairs.push(("sshPassword", string(password)));
            }
            if let Some((user, password)) = &image.config {
                pairs.push(("configUser", string(user)));
                pairs.push(("configPassword", string(password)));
            }
            let dir = match &image.group {
                Some(group) => format!("images/{group}/{i}"),
                None => format!("images/{i}"),
            };
            files.insert(format!("{dir}/image.meta.yaml"), yaml(&mapping(pairs)));
        }

        for (i, collection) in self.collections.iter().enumerate() {
            let mut pairs = vec![
                ("slug", string(&collection.slug)),
                ("title", string(&collection.title)),
                ("type", string(collection.kind)),
                ("tier", string(TIERS[collection.tier].as_str())),
            ];
            let mut seen = BTreeSet::new();
            for (key, text) in &collection.extras {
                if seen.insert(*key) {
                    pairs.push((key, string(text)));
                }
            }
            files.insert(
                format!("collections/{i}/collection.meta.yaml"),
                yaml(&mapping(pairs)),
            );
        }

        for (i, lesson) in self.lessons.iter().enumerate() {
            let dir = lesson.dir(i);
            let mut pairs = vec![
                ("slug", string(&lesson.slug)),
                ("name", string(&lesson.name)),
                ("category", string(lesson.category)),
                ("tier", string(TIERS[lesson.tier].as_str())),
            ];
            if !lesson.prereqs.is_empty() {
                pairs.push((
                    "prereqs",
                    Value::Sequence(
                        lesson
                            .prereqs
                            .iter()
                            .map(|&p| string(&self.lessons[p].slug))
                            .collect(),
                    ),
                ));
            }
            if let Some(c) = lesson.collection {
                pairs.push(("collection", string(&self.collections[c].slug)));
            }
            let mut seen = BTreeSet::new();
            for (key, text) in &lesson.texts {
                if seen.insert(*key) {
                    pairs.push((key, string(text)));
                }
            }
            pairs.push((
                "tags",
                Value::Sequence(lesson.tags.iter().map(|t| string(t)).collect()),
            ));
            pairs.push((
                "authors",
                Value::Sequence(
                    lesson
                        .authors
                        .iter()
                        .map(|(name, link)| {
                            let mut author = vec![("name", string(name))];
                            if let Some(link) = link {
                                author.push(("link", string(link)));
                            }
                            mapping(author)
                        })
                        .collect(),
                ),
            ));
            if let Some(delay) = lesson.ready_delay {
                pairs.push(("readyDelay", Value::from(delay)));
            }
            let endpoints = lesson
                .endpoints
                .iter()
                .map(|endpoint| {
                    let mut pairs = vec![
                        ("name", string(&endpoint.name)),
                        ("image", string(&self.images[endpoint.image].slug)),
                    ];
                    if let Some((kind, _)) = endpoint.configuration {
                        pairs.push(("configurationType", string(kind)));
                    }
                    if !endpoint.additional_ports.is_empty() {
                        pairs.push((
                            "additionalPorts",
                            Value::Sequence(
                                endpoint
                                    .additional_ports
                                    .iter()
                                    .map(|&p| Value::from(p))
                                    .collect(),
                            ),
                        ));
                    }
                    pairs.push((
                        "presentations",
                        Value::Sequence(
                            endpoint
                                .presentations
                                .iter()
                                .map(|(name, port, kind)| {
                                    mapping([
                                        ("name", string(name)),
                                        ("port", Value::from(*port)),
                                        ("type", string(kind)),
                                    ])
                                })
                                .collect(),
                        ),
                    ));
                    mapping(pairs)
                })
                .collect();
            pairs.push(("endpoints", Value::Sequence(endpoints)));
            let connections = lesson
                .connections
                .iter()
                .map(|(a, b, subnet)| {
                    let mut pairs = vec![
                        ("a", string(&lesson.endpoints[*a].name)),
                        ("b", string(&lesson.endpoints[*b].name)),
                    ];
                    if let Some(subnet) = subnet {
                        pairs.push(("subnet", string(&subnet.to_string())));
                    }
                    mapping(pairs)
                })
                .collect();
            pairs.push(("connections", Value::Sequence(connections)));
            let stages = lesson
                .stages
                .iter()
                .map(|(markdown, description, _, _)| {
                    mapping([
                        ("description", string(description)),
                        (
                            "guideType",
                            string(if *markdown { "markdown" } else { "jupyter" }),
                        ),
                    ])
                })
                .collect();
            pairs.push(("stages", Value::Sequence(stages)));
            files.insert(format!("{dir}/lesson.meta.yaml"), yaml(&mapping(pairs)));

            for (k, (markdown, _, guide, configs)) in lesson.stages.iter().enumerate() {
                let guide_name = if *markdown { "guide.md" } else { "guide.ipynb" };
                files.insert(
                    format!("{dir}/stage{k}/{guide_name}"),
                    guide.clone().into_bytes(),
                );
                for (endpoint, config) in lesson.endpoints.iter().zip(configs.iter().cycle()) {
                    if let Some(file) = LessonModel::config_file(endpoint) {
                        files.insert(
                            format!("{dir}/stage{k}/configs/{file}"),
                            config.clone().into_bytes(),
                        );
                    }
                }
            }
        }
        files
    }

    /// Asserts that `catalog`, loaded at `tier`, is what the model says.
    fn agrees(&self, catalog: &Catalog, tier: Tier) -> Result<(), TestCaseError> {
        let root = Path::new(ROOT);
        prop_assert_eq!(&catalog.meta.name, &self.name);
        let images: BTreeSet<&str> = self.images.iter().map(|i| i.slug.as_str()).collect();
        prop_assert_eq!(
            catalog
                .images
                .keys()
                .map(String::as_str)
                .collect::<BTreeSet<_>>(),
            images
        );
        for model in &self.images {
            let image = &catalog.images[&model.slug];
            prop_assert_eq!(&image.network_interfaces, &model.interfaces);
            prop_assert_eq!(image.flavor.as_str(), model.flavor);
            prop_assert_eq!(image.enable_forwarding, model.forwarding);
            prop_assert_eq!(
                image.ssh_password.as_deref(),
                model.ssh.as_ref().map(|(_, p)| p.as_str())
            );
        }
        let (loaded, skipped): (Vec<_>, Vec<_>) =
            self.collections.iter().partition(|c| TIERS[c.tier] >= tier);
        prop_assert_eq!(
            catalog.collections.keys().cloned().collect::<BTreeSet<_>>(),
            loaded
                .iter()
                .map(|c| c.slug.clone())
                .collect::<BTreeSet<_>>()
        );
        let mut skipped: Vec<String> = skipped.iter().map(|c| c.slug.clone()).collect();
        skipped.sort();
        prop_assert_eq!(&catalog.skipped_collections, &skipped);
        for model in loaded {
            let collection = &catalog.collections[&model.slug];
            prop_assert_eq!(&collection.title, &model.title);
            prop_assert_eq!(collection.kind.as_str(), model.kind);
        }

        let mut skipped = Vec::new();
        for (i, model) in self.lessons.iter().enumerate() {
            if TIERS[model.tier] < tier {
                skipped.push(model.slug.clone());
                prop_assert!(catalog.lesson(&model.slug).is_none());
                continue;
            }
            let Some(lesson) = catalog.lesson(&model.slug) else {
                return Err(TestCaseError::fail(format!(
                    "lesson {} missing",
                    model.slug
                )));
            };
            let dir = root.join(model.dir(i));
            prop_assert_eq!(&lesson.dir, &dir);
            prop_assert_eq!(&lesson.name, &model.name);
            prop_assert_eq!(lesson.category.as_str(), model.category);
            prop_assert_eq!(
                &lesson.prereqs,
                &model
                    .prereqs
                    .iter()
                    .map(|&p| self.lessons[p].slug.clone())
                    .collect::<Vec<_>>()
            );
            prop_assert_eq!(
                lesson.collection.as_deref(),
                model.collection.map(|c| self.collections[c].slug.as_str())
            );
            prop_assert_eq!(&lesson.tags, &model.tags);
            prop_assert_eq!(
                lesson.ready_delay,
                Duration::from_secs(model.ready_delay.unwrap_or(0).into())
            );
            prop_assert_eq!(lesson.endpoints.len(), model.endpoints.len());
            for (endpoint, model) in lesson.endpoints.iter().zip(&model.endpoints) {
                prop_assert_eq!(&endpoint.name, &model.name);
                prop_assert_eq!(&endpoint.image, &self.images[model.image].slug);
                prop_assert_eq!(
                    endpoint
                        .additional_ports
                        .iter()
                        .map(|p| p.get())
                        .collect::<Vec<_>>(),
                    model.additional_ports.clone()
                );
                let presentations: Vec<PresentationModel> = endpoint
                    .presentations
                    .iter()
                    .map(|p| (p.name.clone(), p.port.get(), p.kind.as_str()))
                    .collect();
                prop_assert_eq!(&presentations, &model.presentations);
            }
            let connections: Vec<(String, String, Option<ipnet::IpNet>)> = lesson
                .connections
                .iter()
                .map(|c| (c.a.clone(), c.b.clone(), c.subnet))
                .collect();
            let expected: Vec<(String, String, Option<ipnet::IpNet>)> = model
                .connections
                .iter()
                .map(|(a, b, subnet)| {
                    (
                        model.endpoints[*a].name.clone(),
                        model.endpoints[*b].name.clone(),
                        *subnet,
                    )
                })
                .collect();
            prop_assert_eq!(connections, expected);
            prop_assert_eq!(lesson.stages.len(), model.stages.len());
            for (k, (stage, (markdown, description, _, configs))) in
                lesson.stages.iter().zip(&model.stages).enumerate()
            {
                prop_assert_eq!(stage.index as usize, k);
                prop_assert_eq!(&stage.description, description);
                let guide = if *markdown { "guide.md" } else { "guide.ipynb" };
                prop_assert_eq!(&stage.guide, &dir.join(format!("stage{k}/{guide}")));
                let mut expected = BTreeMap::new();
                for (endpoint, config) in model.endpoints.iter().zip(configs.iter().cycle()) {
                    if let Some(file) = LessonModel::config_file(endpoint) {
                        let driver = endpoint
                            .configuration
                            .filter(|(kind, _)| *kind == "napalm")
                            .map(|(_, driver)| driver.to_owned());
                        expected.insert(
                            endpoint.name.clone(),
                            (dir.join(format!("stage{k}/configs/{file}")), driver, config),
                        );
                    }
                }
                let got: BTreeMap<_, _> = stage
                    .configs
                    .iter()
                    .map(|(name, c)| {
                        (
                            name.clone(),
                            (c.path.clone(), c.driver.clone(), &c.contents),
                        )
                    })
                    .collect();
                prop_assert_eq!(got, expected);
            }
        }
        skipped.sort();
        prop_assert_eq!(&catalog.skipped, &skipped);
        Ok(())
    }
}

// ---- checking any outcome ----

/// Loads `files` at `tier`, in memory, timing it.
fn load(
    files: &BTreeMap<String, Vec<u8>>,
    tier: Tier,
) -> Result<Result<Catalog, Vec<CatalogError>>, TestCaseError> {
    let started = Instant::now();
    let result = Catalog::from_files(Path::new(ROOT), files, tier).map_err(|errors| errors.0);
    let took = started.elapsed();
    prop_assert!(took < SLOW, "loading took {took:?}");
    Ok(result)
}

/// Whether `field` is a path of known keys with list indices: `endpoints[1].presentations[0].port`.
fn is_field_path(field: &str) -> bool {
    field.split('.').all(|segment| {
        let name = segment.split('[').next().unwrap_or_default();
        let indices = &segment[name.len()..];
        KEYS.contains(&name)
            && indices.split_terminator(']').all(|index| {
                index.strip_prefix('[').is_some_and(|digits| {
                    !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())
                })
            })
            && (indices.is_empty() || indices.ends_with(']'))
    })
}

/// Checks the errors of a failed load: never none, each under the root, naming its field by
/// path, worded as the house style says; sorted by file; no error twice.
pub fn errors_are_well_formed(errors: &[CatalogError]) -> Result<(), TestCaseError> {
    prop_assert!(!errors.is_empty(), "a failed load reports why");
    for error in errors {
        let line = error.to_string();
        // A path that no directory could hold (`/x`, `../x`) is named as it was given.
        prop_assert!(
            error.file.starts_with(ROOT) || error.reason.starts_with("not a file path inside"),
            "outside the root: {line}"
        );
        prop_assert!(!error.reason.is_empty(), "no reason: {line}");
        prop_assert!(!error.reason.ends_with('.'), "trailing period: {line}");
        prop_assert!(
            !error.reason.starts_with(|c: char| c.is_ascii_uppercase()),
            "capitalised: {line}"
        );
        prop_assert!(
            error.lesson.as_ref().is_none_or(|slug| !slug.is_empty()),
            "{line}"
        );
        if error.reason.starts_with("unknown field") {
            // The field ends with the unknown key as written, whatever it is.
            prop_assert!(!error.field.is_empty(), "an unknown field is named: {line}");
        } else if !error.field.is_empty() {
            prop_assert!(is_field_path(&error.field), "not a field path: {line}");
        }
    }
    prop_assert!(
        errors.windows(2).all(|pair| pair[0].file <= pair[1].file),
        "errors are sorted by file"
    );
    let distinct: BTreeSet<String> = errors.iter().map(ToString::to_string).collect();
    prop_assert_eq!(distinct.len(), errors.len(), "an error is reported twice");
    Ok(())
}

/// Checks that a loaded catalog keeps every rule the loader promises, whatever it was fed.
fn catalog_keeps_the_rules(
    catalog: &Catalog,
    files: &BTreeMap<String, Vec<u8>>,
    tier: Tier,
) -> Result<(), TestCaseError> {
    let root = Path::new(ROOT);
    let file =
        |path: &Path| -> Option<&Vec<u8>> { files.get(path.strip_prefix(root).ok()?.to_str()?) };
    prop_assert!(!catalog.meta.name.is_empty());
    for (slug, image) in &catalog.images {
        prop_assert_eq!(slug, &image.slug);
        prop_assert!(slug.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'));
        prop_assert!(!image.network_interfaces.iter().any(|n| n == "eth0"));
        let unique: BTreeSet<&String> = image.network_interfaces.iter().collect();
        prop_assert_eq!(unique.len(), image.network_interfaces.len());
    }
    for (slug, collection) in &catalog.collections {
        prop_assert_eq!(slug, &collection.slug);
        prop_assert!(collection.tier >= tier);
        prop_assert!(slug.chars().all(|c| c.is_ascii_lowercase() || c == '-'));
    }
    for (slug, lesson) in &catalog.lessons {
        prop_assert_eq!(slug, &lesson.slug);
        prop_assert!(!slug.is_empty());
        prop_assert!(lesson.tier >= tier);
        prop_assert!(
            slug.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        );
        prop_assert!(!lesson.name.is_empty());
        prop_assert!(file(&lesson.dir.join("lesson.meta.yaml")).is_some());
        for prereq in &lesson.prereqs {
            prop_assert!(prereq != slug);
            prop_assert!(
                catalog.lessons.contains_key(prereq),
                "prereq {prereq} not loaded"
            );
        }
        if let Some(collection) = &lesson.collection {
            prop_assert!(catalog.collections.contains_key(collection));
        }
        prop_assert!(!lesson.endpoints.is_empty());
        let mut names = BTreeSet::new();
        for endpoint in &lesson.endpoints {
            let name = &endpoint.name;
            prop_assert!(names.insert(name.as_str()), "endpoint {name} twice");
            prop_assert!(
                name.len() <= 63
                    && name.starts_with(|c: char| c.is_ascii_lowercase())
                    && name.ends_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
                    && name
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'),
                "endpoint name {name:?}"
            );
            prop_assert!(catalog.images.contains_key(&endpoint.image));
            prop_assert!(
                !endpoint.presentations.is_empty() || !endpoint.additional_ports.is_empty()
            );
            let presentations: BTreeSet<&String> =
                endpoint.presentations.iter().map(|p| &p.name).collect();
            prop_assert_eq!(presentations.len(), endpoint.presentations.len());
            prop_assert!(endpoint.presentations.iter().all(|p| !p.name.is_empty()));
        }
        for connection in &lesson.connections {
            prop_assert!(connection.a != connection.b);
            prop_assert!(names.contains(connection.a.as_str()));
            prop_assert!(names.contains(connection.b.as_str()));
            if let Some(subnet) = connection.subnet {
                prop_assert_eq!(subnet, subnet.trunc());
            }
        }
        prop_assert!(!lesson.stages.is_empty());
        for (k, stage) in lesson.stages.iter().enumerate() {
            prop_assert_eq!(stage.index as usize, k);
            prop_assert_eq!(
                &stage.guide,
                &lesson
                    .dir
                    .join(format!("stage{k}"))
                    .join(stage.guide_type.file_name())
            );
            prop_assert!(
                file(&stage.guide).is_some(),
                "guide {:?} missing",
                stage.guide
            );
            let configured: BTreeSet<&String> = lesson
                .endpoints
                .iter()
                .filter(|e| e.configuration_type.is_some())
                .map(|e| &e.name)
                .collect();
            prop_assert_eq!(stage.configs.keys().collect::<BTreeSet<_>>(), configured);
            for config in stage.configs.values() {
                prop_assert_eq!(
                    file(&config.path).map(Vec::as_slice),
                    Some(config.contents.as_bytes())
                );
                if let Some(driver) = &config.driver {
                    prop_assert!(NAPALM_DRIVERS.contains(&driver.as_str()));
                }
            }
        }
    }
    Ok(())
}

/// Loads `files` at `tier` and checks whichever way it went.
fn check_any(files: &BTreeMap<String, Vec<u8>>, tier: Tier) -> Result<&'static str, TestCaseError> {
    match load(files, tier)? {
        Ok(catalog) => {
            catalog_keeps_the_rules(&catalog, files, tier)?;
            Ok("accepted")
        }
        Err(errors) => {
            errors_are_well_formed(&errors)?;
            Ok("refused")
        }
    }
}

// ---- mutations ----

/// Strings worth trying where the loader expects something: YAML specials, enum words, bounds.
fn interesting() -> impl Strategy<Value = String> {
    prop_oneof![
        select(
            &[
                "",
                " ",
                "eth0",
                "eth1",
                "0",
                "1",
                "-1",
                "65535",
                "65536",
                "1.5",
                "local",
                "ptr",
                "prod",
                "staging",
                "fundamentals",
                "markdown",
                "jupyter",
                "python",
                "ansible",
                "napalm",
                "shell",
                "ssh",
                "http",
                "trusted",
                "vendor",
                "10.0.0.0/24",
                "10.0.0.1/24",
                "::/0",
                "fe80::1/64",
                "300.0.0.0/8",
                "null",
                "~",
                "true",
                "a.b",
                "x[0]",
                "<<",
                "UPPER",
                "with space",
                "é",
                "\u{0}",
                "\t",
                "\n",
            ][..],
        )
        .prop_map(String::from),
        select(KEYS).prop_map(String::from),
        "\\PC{0,16}",
        "[a-z0-9-]{1,70}",
    ]
}

fn any_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        (0..=70000u32).prop_map(Value::from),
        interesting().prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Sequence),
            proptest::collection::vec((interesting(), inner.clone()), 0..4).prop_map(|pairs| {
                Value::Mapping(
                    pairs
                        .into_iter()
                        .map(|(key, value)| (Value::String(key), value))
                        .collect(),
                )
            }),
            (inner.clone(), inner.clone()).prop_map(|(key, value)| {
                // A key that is not a string: YAML allows it, our files never use it.
                Value::Mapping([(key, value)].into_iter().collect())
            }),
            inner.prop_map(|value| Value::Tagged(Box::new(TaggedValue {
                tag: Tag::new("thing"),
                value,
            }))),
        ]
    })
}

/// A change to one node of a file's YAML tree, chosen by following `route`.
#[derive(Debug, Clone)]
enum TreeChange {
    Remove,
    Set(Value),
    RenameKey(String),
    AddKey(String, Value),
    Duplicate,
    WrapInList,
}

/// A path built from another file's directory: up some levels, down some names, a file name.
#[derive(Debug, Clone)]
struct Destination {
    beside: usize,
    up: usize,
    down: Vec<&'static str>,
    name: String,
}

#[derive(Debug, Clone)]
enum Mutation {
    /// Inserts a YAML token (or any text) into a file's text.
    Insert {
        file: usize,
        at: usize,
        text: String,
    },
    /// Deletes bytes from a file's text.
    Delete { file: usize, at: usize, len: usize },
    /// Cuts a file short.
    Truncate { file: usize, at: usize },
    /// Flips bits of one byte (which may leave the file not UTF-8).
    Flip { file: usize, at: usize, bits: u8 },
    /// Changes the parsed YAML tree of a file and writes it back.
    Tree {
        file: usize,
        route: Vec<usize>,
        change: TreeChange,
    },
    /// Removes a file.
    Remove { file: usize },
    /// Moves a file elsewhere.
    Move { file: usize, to: Destination },
    /// Copies a file elsewhere (a second lesson with the same slug, a config for another
    /// driver...).
    Copy { file: usize, to: Destination },
    /// Adds a file of arbitrary bytes.
    Add { to: Destination, contents: Vec<u8> },
}

/// YAML syntax worth inserting: anchors, aliases, merge keys, tags, flow and block markers,
/// document markers, directives, quotes, tabs and a byte-order mark.
const TOKENS: &[&str] = &[
    "&a ",
    "*a",
    "<<: *a\n",
    "<<: [*a, *a]\n",
    "a: &a [*a]\n",
    "!!str ",
    "!!binary ",
    "!x ",
    "{",
    "}",
    "[",
    "]",
    "- ",
    ": ",
    "? ",
    ",",
    "\t",
    "---\n",
    "...\n",
    "%YAML 1.1\n",
    "%TAG ! !x\n",
    "'",
    "\"",
    "#",
    "|\n",
    ">-\n",
    "\u{feff}",
    "\0",
    "\\",
    "\n  ",
    "\n",
    "  ",
    "\r",
    "key: value\n",
    "name: x\n",
    "- - - - - - - -",
    "[[[[[[[[[[[[",
    "{{{{{{{{{{",
    "0x",
    "1e400",
    ".nan",
    "&b [*a, *a, *a, *a, *a, *a, *a, *a]\n",
];

fn destination() -> impl Strategy<Value = Destination> {
    (
        any::<usize>(),
        0..4usize,
        proptest::collection::vec(
            select(
                &[
                    "lessons",
                    "images",
                    "collections",
                    "stage0",
                    "stage1",
                    "stage7",
                    "configs",
                    "a",
                    ".hidden",
                    "..",
                    ".",
                    "nested",
                ][..],
            ),
            0..10,
        ),
        prop_oneof![
            select(
                &[
                    "lesson.meta.yaml",
                    "image.meta.yaml",
                    "collection.meta.yaml",
                    "curriculum.meta.yaml",
                    "lesson.meta.yml",
                    "Lesson.meta.yaml",
                    "lesson.yaml",
                    "guide.md",
                    "guide.ipynb",
                    "stage0",
                    "configs",
                ][..],
            )
            .prop_map(String::from),
            "[a-z0-9]{1,6}(-(junos|eos|iosxr|nxos|nxos_ssh|ios|vyos))?\\.(sh|py|yml|txt)",
        ],
    )
        .prop_map(|(beside, up, down, name)| Destination {
            beside,
            up,
            down,
            name,
        })
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let change = prop_oneof![
        Just(TreeChange::Remove),
        any_value().prop_map(TreeChange::Set),
        interesting().prop_map(TreeChange::RenameKey),
        (interesting(), any_value()).prop_map(|(key, value)| TreeChange::AddKey(key, value)),
        Just(TreeChange::Duplicate),
        Just(TreeChange::WrapInList),
    ];
    let inserted = prop_oneof![select(TOKENS).prop_map(String::from), "\\PC{1,8}"];
    prop_oneof![
        3 => (any::<usize>(), any::<usize>(), inserted)
            .prop_map(|(file, at, text)| Mutation::Insert { file, at, text }),
        1 => (any::<usize>(), any::<usize>(), 1..16usize)
            .prop_map(|(file, at, len)| Mutation::Delete { file, at, len }),
        1 => (any::<usize>(), any::<usize>())
            .prop_map(|(file, at)| Mutation::Truncate { file, at }),
        1 => (any::<usize>(), any::<usize>(), 1..=u8::MAX)
            .prop_map(|(file, at, bits)| Mutation::Flip { file, at, bits }),
        8 => (any::<usize>(), proptest::collection::vec(any::<usize>(), 0..6), change)
            .prop_map(|(file, route, change)| Mutation::Tree { file, route, change }),
        1 => any::<usize>().prop_map(|file| Mutation::Remove { file }),
        1 => (any::<usize>(), destination()).prop_map(|(file, to)| Mutation::Move { file, to }),
        1 => (any::<usize>(), destination()).prop_map(|(file, to)| Mutation::Copy { file, to }),
        1 => (destination(), proptest::collection::vec(any::<u8>(), 0..64))
            .prop_map(|(to, contents)| Mutation::Add { to, contents }),
    ]
}

/// Applies `change` at the end of `route` in `node`.
fn change_tree(node: &mut Value, route: &[usize], change: &TreeChange) {
    match node {
        Value::Mapping(map) if !route.is_empty() && !map.is_empty() => {
            let index = route[0] % map.len();
            let key = map.keys().nth(index).cloned().expect("index below len");
            if route.len() > 1 {
                let child = map.get_mut(&key).expect("key from the map");
                return change_tree(child, &route[1..], change);
            }
            match change {
                TreeChange::Remove => {
                    map.remove(&key);
                }
                TreeChange::RenameKey(new) => {
                    let value = map.remove(&key).expect("key from the map");
                    map.insert(Value::String(new.clone()), value);
                }
                _ => change_tree(map.get_mut(&key).expect("key from the map"), &[], change),
            }
        }
        Value::Sequence(items) if !route.is_empty() && !items.is_empty() => {
            let index = route[0] % items.len();
            if route.len() > 1 {
                return change_tree(&mut items[index], &route[1..], change);
            }
            match change {
                TreeChange::Remove => {
                    items.remove(index);
                }
                TreeChange::Duplicate => {
                    let item = items[index].clone();
                    items.insert(index, item);
                }
                _ => change_tree(&mut items[index], &[], change),
            }
        }
        _ => match change {
            TreeChange::Remove => *node = Value::Null,
            TreeChange::Set(value) => *node = value.clone(),
            TreeChange::AddKey(key, value) => match node {
                Value::Mapping(map) => {
                    map.insert(Value::String(key.clone()), value.clone());
                }
                _ => *node = value.clone(),
            },
            TreeChange::WrapInList => *node = Value::Sequence(vec![node.clone()]),
            TreeChange::RenameKey(_) | TreeChange::Duplicate => {}
        },
    }
}

/// The path `to` names, from the directory of the `beside`-th file of `paths`.
fn resolve(paths: &[String], to: &Destination) -> String {
    let mut parts: Vec<&str> = match paths.get(to.beside % paths.len().max(1)) {
        Some(path) => path.split('/').collect(),
        None => Vec::new(),
    };
    parts.pop();
    for _ in 0..to.up {
        parts.pop();
    }
    parts.extend(to.down.iter().copied());
    parts.push(&to.name);
    parts.join("/")
}

/// Applies `mutation` to `files` (paths relative to the root).
fn mutate(files: &mut BTreeMap<String, Vec<u8>>, mutation: &Mutation) {
    let paths: Vec<String> = files.keys().cloned().collect();
    let pick = |file: &usize| -> Option<String> {
        (!paths.is_empty()).then(|| paths[file % paths.len()].clone())
    };
    match mutation {
        Mutation::Insert { file, at, text } => {
            if let Some(path) = pick(file) {
                let bytes = files.get_mut(&path).expect("picked from the map");
                let at = at % (bytes.len() + 1);
                bytes.splice(at..at, text.bytes());
            }
        }
        Mutation::Delete { file, at, len } => {
            if let Some(path) = pick(file) {
                let bytes = files.get_mut(&path).expect("picked from the map");
                let at = at % (bytes.len() + 1);
                let end = (at + len).min(bytes.len());
                bytes.drain(at..end);
            }
        }
        Mutation::Truncate { file, at } => {
            if let Some(path) = pick(file) {
                let bytes = files.get_mut(&path).expect("picked from the map");
                bytes.truncate(at % (bytes.len() + 1));
            }
        }
        Mutation::Flip { file, at, bits } => {
            if let Some(path) = pick(file) {
                let bytes = files.get_mut(&path).expect("picked from the map");
                if !bytes.is_empty() {
                    let at = at % bytes.len();
                    bytes[at] ^= bits;
                }
            }
        }
        Mutation::Tree {
            file,
            route,
            change,
        } => {
            if let Some(path) = pick(file) {
                let bytes = files.get_mut(&path).expect("picked from the map");
                if let Ok(mut value) = serde_yaml::from_slice::<Value>(bytes) {
                    change_tree(&mut value, route, change);
                    if let Ok(text) = serde_yaml::to_string(&value) {
                        *bytes = text.into_bytes();
                    }
                }
            }
        }
        Mutation::Remove { file } => {
            if let Some(path) = pick(file) {
                files.remove(&path);
            }
        }
        Mutation::Move { file, to } => {
            if let Some(path) = pick(file) {
                let contents = files.remove(&path).expect("picked from the map");
                files.insert(resolve(&paths, to), contents);
            }
        }
        Mutation::Copy { file, to } => {
            if let Some(path) = pick(file) {
                let contents = files[&path].clone();
                files.insert(resolve(&paths, to), contents);
            }
        }
        Mutation::Add { to, contents } => {
            files.insert(resolve(&paths, to), contents.clone());
        }
    }
}

// ---- properties ----

#[test]
fn valid_curricula_load_as_written() {
    let input = (model(), select(&TIERS[..]));
    fuzz("catalog: valid curricula", 500, input, |(model, tier)| {
        let files = model.files();
        match load(&files, tier)? {
            Ok(catalog) => {
                model.agrees(&catalog, tier)?;
                catalog_keeps_the_rules(&catalog, &files, tier)?;
                Ok("accepted")
            }
            Err(errors) => {
                let lines: Vec<String> = errors.iter().map(ToString::to_string).collect();
                Err(TestCaseError::fail(format!(
                    "a valid curriculum was refused at tier {tier}:\n{}",
                    lines.join("\n")
                )))
            }
        }
    });
}

#[test]
fn mutated_curricula_load_or_fail_well() {
    let input = (
        model(),
        proptest::collection::vec(mutation(), 1..4),
        select(&TIERS[..]),
    );
    fuzz(
        "catalog: mutated curricula",
        1000,
        input,
        |(model, mutations, tier)| {
            let mut files = model.files();
            for mutation in &mutations {
                mutate(&mut files, mutation);
            }
            check_any(&files, tier)
        },
    );
}

#[test]
fn garbage_files_fail_well() {
    let file = (
        prop_oneof![
            select(
                &[
                    "curriculum.meta.yaml",
                    "images/a/image.meta.yaml",
                    "collections/a/collection.meta.yaml",
                    "lessons/a/lesson.meta.yaml",
                    "lessons/a/stage0/guide.md",
                    "lessons/a/stage0/configs/web.sh",
                    "lessons/a/stage0/configs/web-eos.txt",
                ][..],
            )
            .prop_map(String::from),
            "[a-z./]{1,30}",
        ],
        prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..200),
            proptest::collection::vec(select(TOKENS), 0..40)
                .prop_map(|tokens| tokens.concat().into_bytes()),
            "(slug|name|tier|endpoints|stages|- |: |\\{|\\}|\\[|\\]|&a|\\*a|<<|\n| |x|1){0,60}"
                .prop_map(String::into_bytes),
        ],
    );
    let input = (
        proptest::collection::btree_map(file.0, file.1, 0..6),
        select(&TIERS[..]),
    );
    fuzz("catalog: garbage files", 1000, input, |(files, tier)| {
        // Paths no directory could hold are refused as such; the rest is loaded.
        check_any(&files, tier)
    });
}

// ---- regressions: each failure the fuzzer found, by name ----

/// Loads `files` (paths and texts) at prod and returns the error lines, root removed.
fn error_lines(files: &[(&str, &str)]) -> Vec<String> {
    let files: BTreeMap<String, Vec<u8>> = files
        .iter()
        .map(|(path, text)| ((*path).to_owned(), text.as_bytes().to_vec()))
        .collect();
    let Err(errors) = Catalog::from_files(Path::new(ROOT), &files, Tier::Prod) else {
        panic!("expected errors");
    };
    errors_are_well_formed(&errors.0).expect("well-formed errors");
    errors
        .0
        .iter()
        .map(|error| error.to_string().replace(&format!("{ROOT}/"), ""))
        .collect()
}

/// Found by `mutated_curricula_load_or_fail_well`: an empty key (`"": x`) was reported with an
/// empty field (`collection.meta.yaml: unknown field`), naming nothing.
#[test]
fn an_empty_key_is_named_as_yaml_writes_it() {
    assert_eq!(
        error_lines(&[("curriculum.meta.yaml", "{name: n, '': 1}")]),
        ["curriculum.meta.yaml: `\"\"`: unknown field"]
    );
}

/// Found by `garbage_files_fail_well`: the refused paths of `Catalog::from_files` came in the
/// order given, not sorted by file like every other list of curriculum errors.
#[test]
fn refused_in_memory_paths_are_sorted_by_file() {
    let files = [("..//b", ""), ("../a", "")];
    let lines = error_lines(&files);
    assert_eq!(lines.len(), 2);
    assert!(lines[0].starts_with("../a:"), "{lines:?}");
    assert!(lines[1].starts_with("..//b:"), "{lines:?}");
}

/// Not found by the fuzzer (random insertions rarely build them), so written out: a "billion
/// laughs" of aliases (plain and merged), deep flow nesting and deep block nesting are refused
/// as malformed YAML, quickly. serde_yaml stops at 128 levels, but only after parsing the whole
/// document, and its parser is quadratic in flow nesting (10,000 levels: ~0.1 s in release;
/// 100,000, a 200 KB file: ~27 s), so the nesting here stays at a size that answers at once.
#[test]
fn alias_bombs_and_deep_nesting_are_refused_quickly() {
    let mut bomb = String::from("name: x\na0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n");
    for level in 1..10 {
        let previous = format!("*a{}", level - 1);
        let items = [previous.as_str(); 9].join(", ");
        bomb.push_str(&format!("a{level}: &a{level} [{items}]\n"));
    }
    let merge_bomb = format!("{bomb}b: {{<<: *a9}}\n");
    let flow = format!("name: {}{}", "[".repeat(10_000), "]".repeat(10_000));
    let block: String = (0..10_000)
        .map(|i| format!("{}- \n", " ".repeat(i % 1000)))
        .collect();
    for text in [bomb, merge_bomb, flow, format!("name:\n{block}")] {
        let started = Instant::now();
        let lines = error_lines(&[("curriculum.meta.yaml", &text)]);
        assert!(started.elapsed() < SLOW, "took {:?}", started.elapsed());
        assert!(lines[0].contains("malformed yaml"), "{lines:?}");
    }
}
