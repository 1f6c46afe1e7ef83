//! The curriculum as the rest of the scheduler sees it: validated, typed, with every file that a
//! lesson needs already located on disk.

use std::collections::BTreeMap;
use std::fmt;
use std::num::NonZeroU16;
use std::path::PathBuf;
use std::time::Duration;

use super::error::UnknownVariant;

/// Defines a fieldless enum spelled in curriculum files as lowercase words, with `as_str`,
/// `Display`, `FromStr` and serde all agreeing on one spelling per variant.
macro_rules! string_enum {
    (
        $(#[$meta:meta])*
        pub enum $name:ident as $kind:literal {
            $( $(#[$vmeta:meta])* $variant:ident = $text:literal, )+
        }
    ) => {
        $(#[$meta])*
        #[derive(
            Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord,
            serde::Serialize, serde::Deserialize,
        )]
        pub enum $name {
            $( $(#[$vmeta])* #[serde(rename = $text)] $variant, )+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The spelling used in curriculum files.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $( $name::$variant => $text, )+
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl std::str::FromStr for $name {
            type Err = UnknownVariant;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                match s {
                    $( $text => Ok($name::$variant), )+
                    _ => Err(UnknownVariant {
                        kind: $kind,
                        value: s.to_owned(),
                        expected: &[$($text),+],
                    }),
                }
            }
        }
    };
}

string_enum! {
    /// How far a lesson or collection has come towards production. A scheduler configured for a
    /// tier loads everything at that tier or above, so the declaration order (`Local < Ptr <
    /// Prod`) is the order that filtering compares.
    pub enum Tier as "tier" {
        /// Only for authors running a curriculum on their own machine.
        Local = "local",
        /// Public test ("ptr"): staged before production.
        Ptr = "ptr",
        /// Shown to everyone.
        Prod = "prod",
    }
}

string_enum! {
    /// Which shelf of the lesson catalogue a lesson sits on.
    pub enum Category as "category" {
        /// Basics every network engineer needs.
        Fundamentals = "fundamentals",
        /// One tool, in depth.
        Tools = "tools",
        /// Several tools combined into a way of working.
        Workflows = "workflows",
    }
}

string_enum! {
    /// What a stage's guide is written as, which decides the file name the guide must have.
    pub enum GuideType as "guide type" {
        /// `guide.md`.
        Markdown = "markdown",
        /// `guide.ipynb`, shown through Jupyter.
        Jupyter = "jupyter",
    }
}

impl Lesson {
    /// Whether any stage's guide is a Jupyter notebook, so the live lesson gets a guide
    /// endpoint ([`JUPYTER_GUIDE_ENDPOINT`]).
    pub fn has_jupyter_guide(&self) -> bool {
        self.stages
            .iter()
            .any(|stage| stage.guide_type == GuideType::Jupyter)
    }
}

impl Lesson {
    /// Whether any stage has a check, so its live lessons show which stages passed.
    pub fn has_checks(&self) -> bool {
        self.stages.iter().any(|stage| !stage.checks.is_empty())
    }
}

impl GuideType {
    /// The file name, inside `stage<N>/`, that a guide of this type must have.
    pub const fn file_name(self) -> &'static str {
        match self {
            GuideType::Markdown => "guide.md",
            GuideType::Jupyter => "guide.ipynb",
        }
    }
}

string_enum! {
    /// How a learner reaches a presentation, and so how readiness probes it.
    pub enum PresentationKind as "presentation type" {
        /// An interactive terminal over SSH.
        Ssh = "ssh",
        /// A web page shown in the browser.
        Http = "http",
    }
}

string_enum! {
    /// How an endpoint is configured at each stage, which decides the config file each stage
    /// must provide for it.
    pub enum ConfigurationType as "configuration type" {
        /// `stage<N>/configs/<endpoint>.py`, run with Python.
        Python = "python",
        /// `stage<N>/configs/<endpoint>.yml`, an Ansible playbook.
        Ansible = "ansible",
        /// `stage<N>/configs/<endpoint>-<driver>.txt`, pushed with the named NAPALM driver.
        Napalm = "napalm",
        /// `stage<N>/configs/<endpoint>.sh`, run by `sh` inside the endpoint. Our addition to
        /// Antidote's format, so that busybox-only images can be configured without Python.
        Shell = "shell",
    }
}

/// The name of the endpoint that serves a lesson's Jupyter guides (added to the live lesson of
/// any lesson with a `jupyter` stage), so no endpoint of such a lesson may have it.
pub const JUPYTER_GUIDE_ENDPOINT: &str = "jupyter-guide";

/// The port of the guide endpoint's HTTP presentation (Jupyter's own).
pub const JUPYTER_GUIDE_PORT: u16 = 8888;

/// How long a check or solution file may run when the lesson says nothing (`checkTimeout`).
pub const DEFAULT_CHECK_TIMEOUT: Duration = Duration::from_secs(30);

/// The NAPALM drivers a `<endpoint>-<driver>.txt` config file may name, as Antidote accepted.
pub const NAPALM_DRIVERS: &[&str] = &["junos", "eos", "iosxr", "nxos", "nxos_ssh", "ios"];

string_enum! {
    /// How much an image is trusted, which decides how its containers are isolated.
    pub enum Flavor as "flavor" {
        /// Privileged with `NET_ADMIN`: only for images that bring their own virtualisation.
        Trusted = "trusted",
        /// Sandboxed runtime, no extra privileges.
        Untrusted = "untrusted",
        /// Kept from older curricula; treated by backends as they see fit.
        Legacy = "legacy",
    }
}

string_enum! {
    /// Who stands behind a collection.
    pub enum CollectionType as "collection type" {
        /// A product vendor.
        Vendor = "vendor",
        /// A community project.
        Community = "community",
        /// A consultancy.
        Consultancy = "consultancy",
    }
}

/// `curriculum.meta.yaml`: the curriculum as a whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CurriculumMeta {
    /// Short name, e.g. `nrelabs`.
    pub name: String,
    /// One line for humans.
    pub description: String,
    /// Where the curriculum's site lives.
    pub website: Option<String>,
    /// The Antidote version the curriculum was written for (`aVer`); kept for display only.
    pub a_ver: Option<String>,
    /// The curriculum's repository (`gitRoot`), for "edit this lesson" links.
    pub git_root: Option<String>,
}

/// `collections/<dir>/collection.meta.yaml`: a group of lessons from one contributor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Collection {
    /// Unique, `^[a-z-]+$` as Antidote had it; lessons refer to it with `collection`.
    pub slug: String,
    /// Display title.
    pub title: String,
    /// URL of the contributor's logo.
    pub image: Option<String>,
    /// The contributor's website.
    pub website: Option<String>,
    /// Whom learners contact about the collection.
    pub contact_email: Option<String>,
    /// Why learners should look at the collection, in one paragraph.
    pub brief_description: String,
    /// Why learners should go on to its lessons, at length.
    pub long_description: String,
    /// Who stands behind it (`type`).
    pub kind: CollectionType,
    /// Collections below the configured tier are skipped like lessons.
    pub tier: Tier,
}

/// `images/<dir>/image.meta.yaml`: what an endpoint image needs from a backend.
///
/// `Debug` redacts both passwords, so that logging an image never leaks them.
#[derive(Clone, PartialEq, Eq)]
pub struct Image {
    /// Unique; endpoints refer to it with `image`.
    pub slug: String,
    /// For authors.
    pub description: String,
    /// Decides the isolation a backend gives the image's containers.
    pub flavor: Flavor,
    /// The user an ssh presentation logs in as.
    pub ssh_user: Option<String>,
    /// That user's password; a secret, never logged.
    pub ssh_password: Option<String>,
    /// The user stage configuration logs in as (NAPALM, Ansible).
    pub config_user: Option<String>,
    /// That user's password; a secret, never logged.
    pub config_password: Option<String>,
    /// Whether the backend must enable IP forwarding in the container (routers).
    pub enable_forwarding: bool,
    /// The interfaces connections attach to, in the order they are used; never `eth0`, which
    /// is the management interface every container has.
    pub network_interfaces: Vec<String>,
}

impl fmt::Debug for Image {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Written out by hand because a derived Debug would print both passwords.
        fn redacted(secret: &Option<String>) -> Option<&'static str> {
            secret.as_ref().map(|_| "<redacted>")
        }
        f.debug_struct("Image")
            .field("slug", &self.slug)
            .field("description", &self.description)
            .field("flavor", &self.flavor)
            .field("ssh_user", &self.ssh_user)
            .field("ssh_password", &redacted(&self.ssh_password))
            .field("config_user", &self.config_user)
            .field("config_password", &redacted(&self.config_password))
            .field("enable_forwarding", &self.enable_forwarding)
            .field("network_interfaces", &self.network_interfaces)
            .finish()
    }
}

/// `lessons/<dir>/lesson.meta.yaml` and its stage directories.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lesson {
    /// Unique, `^[a-z0-9-]+$`; the key learners request a lesson by.
    pub slug: String,
    /// Display name.
    pub name: String,
    /// Catalogue shelf.
    pub category: Category,
    /// Lessons below the configured tier are skipped.
    pub tier: Tier,
    /// Slugs of lessons to take first; all loaded whenever this lesson is.
    pub prereqs: Vec<String>,
    /// Long description.
    pub description: String,
    /// One line for lesson cards.
    pub short_description: String,
    /// Free-form search tags.
    pub tags: Vec<String>,
    /// Who wrote the lesson.
    pub authors: Vec<Author>,
    /// Slug of the collection the lesson belongs to, if any; loaded whenever this lesson is.
    pub collection: Option<String>,
    /// URL of a topology diagram.
    pub diagram: Option<String>,
    /// URL of an introductory video.
    pub video: Option<String>,
    /// How long to wait after every presentation is reachable before calling the lesson ready,
    /// for images whose services come up after their ports do.
    pub ready_delay: Duration,
    /// How long one try of a stage configuration may run (`configTimeout`), when the lesson
    /// says; agents cap it at their own `--config-timeout`.
    pub config_timeout: Option<Duration>,
    /// How long one check or solution file may run (`checkTimeout`, default
    /// [`DEFAULT_CHECK_TIMEOUT`]); agents cap it at their own configuration timeout.
    pub check_timeout: Duration,
    /// What to start, in lesson order (backends keep that order so addresses are stable).
    pub endpoints: Vec<Endpoint>,
    /// The lesson's steps, `stages[i].index == i`; never empty.
    pub stages: Vec<Stage>,
    /// Point-to-point links between endpoints, in the order interfaces are assigned.
    pub connections: Vec<Connection>,
    /// The lesson's directory, holding `lesson.meta.yaml` and the stage directories.
    pub dir: PathBuf,
    /// Labels the agent running it must and should carry (`placement:` in the file; empty when
    /// absent, which is every curriculum written before it existed).
    pub placement: LessonPlacement,
}

/// A lesson's `placement: { requires: {k: v}, prefers: {k: v} }`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LessonPlacement {
    /// Labels the agent must carry, every pair.
    pub requires: std::collections::BTreeMap<String, String>,
    /// Labels the agent should carry; more matches win over lower load.
    pub prefers: std::collections::BTreeMap<String, String>,
}

/// A lesson author.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Author {
    /// Display name.
    pub name: String,
    /// A page about them.
    pub link: Option<String>,
}

/// One container in a lesson.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// Unique in the lesson; also names its config files and its host name.
    pub name: String,
    /// Slug of an [`Image`] in the same curriculum.
    pub image: String,
    /// How each stage configures it; `None` means stages leave it alone.
    pub configuration_type: Option<ConfigurationType>,
    /// Ports to open besides the presentations' (e.g. an API other endpoints call).
    pub additional_ports: Vec<NonZeroU16>,
    /// How learners reach it; names unique within the endpoint.
    pub presentations: Vec<Presentation>,
}

/// A way for a learner to reach an endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Presentation {
    /// Unique within its endpoint; shown as a tab title and used in ingress host names.
    pub name: String,
    /// The port inside the endpoint.
    pub port: NonZeroU16,
    /// Terminal or web page (`type` in YAML).
    pub kind: PresentationKind,
}

/// One step of a lesson, with its guide and the configuration that brings each endpoint to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stage {
    /// Position in the lesson, counting from 0; the directory is `stage<index>/`.
    pub index: u32,
    /// What the stage is about.
    pub description: String,
    /// What the guide is written as.
    pub guide_type: GuideType,
    /// The guide file, checked to exist at load time.
    pub guide: PathBuf,
    /// A Jupyter guide's notebook, read at load time (at most
    /// [`antidote_proto::limits::MAX_NOTEBOOK`] bytes): it travels to the agent in the spec
    /// of the lesson's guide endpoint. `None` for a markdown guide.
    pub notebook: Option<String>,
    /// URL of a video for this stage.
    pub stage_video: Option<String>,
    /// The config file of every endpoint that has a configuration type, by endpoint name.
    pub configs: BTreeMap<String, StageConfig>,
    /// The stage's check files (`stage<N>/checks/<endpoint>.sh|.py`), by endpoint name: the
    /// stage's check passes when every one exits 0. Empty: the stage has no check.
    pub checks: BTreeMap<String, Script>,
    /// The stage's solution files (`stage<N>/solutions/<endpoint>.sh|.py`), by endpoint name:
    /// what a learner would do, run by `antidotectl admin test-lesson` to prove the checks.
    pub solutions: BTreeMap<String, Script>,
    /// Whether the stage's check must pass before the live lesson may go past it (`checks:` in
    /// the stage's metadata; advisory when absent).
    pub check_mode: CheckMode,
}

impl Stage {
    /// Whether moving past this stage needs its check to have passed.
    pub fn gated(&self) -> bool {
        self.check_mode == CheckMode::Gate && !self.checks.is_empty()
    }
}

string_enum! {
    /// What a stage's check decides (`checks:` in a stage's metadata).
    pub enum CheckMode as "check mode" {
        /// The check only tells the learner how they are doing (the default).
        Advisory = "advisory",
        /// A later stage is refused until the check has passed in that live lesson.
        Gate = "gate",
    }
}

/// A check or solution file of a stage, for one endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Script {
    /// The file it was read from.
    pub path: PathBuf,
    /// How it runs: `Shell` inside the endpoint (`<endpoint>.sh`), `Python` from the agent's
    /// configurator, reaching the endpoint by name (`<endpoint>.py`), as configurations do.
    pub kind: ConfigurationType,
    /// The file's text, read at load time.
    pub contents: String,
}

impl Script {
    /// The file's name (`client.sh`), as agents are sent it.
    pub fn file_name(&self) -> String {
        self.path
            .file_name()
            .map(|name| name.to_string_lossy().into_owned())
            .unwrap_or_default()
    }
}

/// An endpoint's configuration for one stage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageConfig {
    /// The file it was read from.
    pub path: PathBuf,
    /// The NAPALM driver named by the file name, for `napalm` endpoints only.
    pub driver: Option<String>,
    /// The file's text, read at load time so that a stage change never finds it missing.
    pub contents: String,
}

/// A point-to-point link between two endpoints of a lesson.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Connection {
    /// One end, an endpoint name.
    pub a: String,
    /// The other end, a different endpoint name.
    pub b: String,
    /// Addresses for the link, with host bits clear; `None` leaves addressing to the lesson.
    pub subnet: Option<ipnet::IpNet>,
}
