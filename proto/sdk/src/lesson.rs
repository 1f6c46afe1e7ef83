//! The live lesson as a backend sees it: domain values read once from the wire's `LessonSpec`.
//!
//! Each conversion destructures its wire message whole, so a field added to `agent.proto` is a
//! compile error here until it is handled. Ports are [`NonZeroU16`], durations [`Duration`],
//! enumerations Rust enums: what [`spec::check`](crate::spec::check) has already refused never
//! reaches a backend. The wire spec a lesson was read from stays at hand ([`Lesson::spec`]) for
//! backends whose manifests are still built from it.

use std::collections::HashMap;
use std::num::NonZeroU16;
use std::time::Duration;

use antidote_proto::agent::v1 as proto;
use tonic::Status;

use crate::errors;

/// One generation of a live lesson: what to realise.
#[derive(Debug, Clone)]
pub struct Lesson {
    /// The live lesson's id (a UUID, [S2]): backends derive their objects' names from it.
    pub id: String,
    /// The learner's session, for labels and logs.
    pub session_id: String,
    /// The curriculum lesson's slug.
    pub slug: String,
    /// This generation; only a newer one replaces it.
    pub generation: u64,
    /// The stage whose configuration runs.
    pub stage: u32,
    /// The endpoints, in lesson order (states list them so, [R6]).
    pub endpoints: Vec<Endpoint>,
    /// Links between two endpoints.
    pub connections: Vec<Connection>,
    /// Waited after the probes pass and the configuration ran ([R4]).
    pub ready_delay: Duration,
    /// The labels every object carries (and List and Watch select by).
    pub labels: HashMap<String, String>,
    /// The lesson's own bound on one configuration try, when it sets a positive one ([R3]).
    pub configuration_timeout: Option<Duration>,
    /// The wire spec this was read from.
    spec: proto::LessonSpec,
}

/// One machine of a lesson.
#[derive(Debug, Clone)]
pub struct Endpoint {
    /// Its name, a DNS label, unique in the lesson.
    pub name: String,
    /// What it runs.
    pub image: Image,
    /// TCP ports the lesson's other endpoints reach by the endpoint's name.
    pub additional_ports: Vec<NonZeroU16>,
    /// The ports learners reach, each probed before READY ([R1], [R2]).
    pub presentations: Vec<Presentation>,
    /// This stage's configuration of the endpoint, if it has one.
    pub configuration: Option<Configuration>,
    /// The stage's Jupyter notebook, when the endpoint is the lesson's Jupyter guide.
    pub jupyter_guide: Option<Vec<u8>>,
}

/// What an endpoint runs, and the credentials it is reached with.
#[derive(Clone)]
pub struct Image {
    /// The curriculum's name for it; the backend maps it to a reference of its own ([R5]).
    pub slug: String,
    /// How far it is trusted.
    pub flavor: Flavor,
    /// Learners' SSH login.
    pub ssh_user: String,
    /// Learners' SSH password.
    pub ssh_password: String,
    /// The configurators' login.
    pub config_user: String,
    /// The configurators' password.
    pub config_password: String,
    /// Whether the endpoint forwards packets (a router).
    pub enable_forwarding: bool,
    /// Interfaces the image expects, in order.
    pub network_interfaces: Vec<String>,
}

impl std::fmt::Debug for Image {
    /// Passwords never reach a log.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Image")
            .field("slug", &self.slug)
            .field("flavor", &self.flavor)
            .field("ssh_user", &self.ssh_user)
            .field("config_user", &self.config_user)
            .field("enable_forwarding", &self.enable_forwarding)
            .field("network_interfaces", &self.network_interfaces)
            .finish_non_exhaustive()
    }
}

/// How far an image is trusted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    /// Unsaid, or said untrusted: confined as tightly as the backend can.
    Untrusted,
    /// Made by the curriculum's authors.
    Trusted,
    /// An older image run as it always was.
    Legacy,
}

/// A port learners reach.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Presentation {
    /// Its name, unique in the endpoint.
    pub name: String,
    /// What answers there, and so what its probe expects.
    pub kind: PresentationKind,
    /// The port on the endpoint.
    pub port: NonZeroU16,
}

/// What a presentation serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PresentationKind {
    /// An SSH server: its probe waits for a banner.
    Ssh,
    /// An HTTP server: its probe waits for a status line.
    Http,
}

impl PresentationKind {
    /// What its probe expects.
    pub fn expect(self) -> crate::probe::Expect {
        match self {
            PresentationKind::Ssh => crate::probe::Expect::SshBanner,
            PresentationKind::Http => crate::probe::Expect::Http,
        }
    }

    /// Its wire value.
    pub fn wire(self) -> proto::PresentationType {
        match self {
            PresentationKind::Ssh => proto::PresentationType::Ssh,
            PresentationKind::Http => proto::PresentationType::Http,
        }
    }
}

/// One stage's configuration of one endpoint.
#[derive(Debug, Clone)]
pub struct Configuration {
    /// What runs it.
    pub kind: ConfigurationKind,
    /// Its file name, which FAILED reasons name ([R3]).
    pub file_name: String,
    /// The file.
    pub contents: Vec<u8>,
    /// The NAPALM driver (NAPALM only).
    pub driver: String,
}

/// What runs a configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigurationKind {
    /// `sh` inside the endpoint.
    Shell,
    /// A Python script.
    Python,
    /// An Ansible playbook.
    Ansible,
    /// A NAPALM configuration.
    Napalm,
}

/// A link between two endpoints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Connection {
    /// One end's endpoint name.
    pub a: String,
    /// The other end's.
    pub b: String,
    /// The link's subnet, when the lesson gives one.
    pub subnet: Option<String>,
}

impl Lesson {
    /// The wire spec this lesson was read from.
    pub fn spec(&self) -> &proto::LessonSpec {
        &self.spec
    }

    /// The time one configuration try may take: the lesson's own bound capped at `ceiling` (the
    /// operator's limit), else `ceiling` ([R3]).
    pub fn configuration_timeout(&self, ceiling: Duration) -> Duration {
        self.configuration_timeout
            .map_or(ceiling, |asked| asked.min(ceiling))
    }
}

/// A wire duration as a [`Duration`], `None` when absent or not positive.
fn positive(duration: Option<prost_types::Duration>) -> Option<Duration> {
    let d = duration?;
    (d.seconds > 0 || (d.seconds == 0 && d.nanos > 0))
        .then(|| Duration::new(d.seconds.max(0) as u64, d.nanos.max(0) as u32))
}

/// A wire port as a port, or INVALID_ARGUMENT naming `field`.
fn port(value: u32, field: impl FnOnce() -> String) -> Result<NonZeroU16, Status> {
    u16::try_from(value)
        .ok()
        .and_then(NonZeroU16::new)
        .ok_or_else(|| errors::invalid(field(), format!("{value} is not in 1..65535")))
}

impl TryFrom<proto::LessonSpec> for Lesson {
    type Error = Status;

    fn try_from(spec: proto::LessonSpec) -> Result<Lesson, Status> {
        let proto::LessonSpec {
            live_lesson_id,
            session_id,
            lesson_slug,
            generation,
            stage,
            endpoints,
            connections,
            ready_delay,
            labels,
            configuration_timeout,
        } = spec.clone();
        let endpoints = endpoints
            .into_iter()
            .enumerate()
            .map(|(i, e)| endpoint(e, &format!("spec.endpoints[{i}]")))
            .collect::<Result<_, _>>()?;
        Ok(Lesson {
            id: live_lesson_id,
            session_id,
            slug: lesson_slug,
            generation,
            stage,
            endpoints,
            connections: connections.into_iter().map(Connection::from).collect(),
            ready_delay: positive(ready_delay).unwrap_or_default(),
            labels,
            configuration_timeout: positive(configuration_timeout),
            spec,
        })
    }
}

fn endpoint(endpoint: proto::Endpoint, field: &str) -> Result<Endpoint, Status> {
    let proto::Endpoint {
        name,
        image,
        additional_ports,
        presentations,
        configuration,
        jupyter_guide,
    } = endpoint;
    let additional_ports = additional_ports
        .into_iter()
        .enumerate()
        .map(|(j, p)| port(p, || format!("{field}.additional_ports[{j}]")))
        .collect::<Result<_, _>>()?;
    let presentations = presentations
        .into_iter()
        .enumerate()
        .map(|(j, p)| presentation(p, &format!("{field}.presentations[{j}]")))
        .collect::<Result<_, _>>()?;
    let configuration = configuration
        .map(|c| self::configuration(c, &format!("{field}.configuration")))
        .transpose()?;
    Ok(Endpoint {
        name,
        image: image
            .map(Image::from)
            .ok_or_else(|| errors::invalid(format!("{field}.image"), "is missing"))?,
        additional_ports,
        presentations,
        configuration,
        jupyter_guide: jupyter_guide.map(|proto::JupyterGuide { notebook }| notebook),
    })
}

fn presentation(presentation: proto::Presentation, field: &str) -> Result<Presentation, Status> {
    let proto::Presentation { name, r#type, port } = presentation;
    let kind = match proto::PresentationType::try_from(r#type) {
        Ok(proto::PresentationType::Ssh) => PresentationKind::Ssh,
        Ok(proto::PresentationType::Http) => PresentationKind::Http,
        Ok(proto::PresentationType::Unspecified) | Err(_) => {
            return Err(errors::invalid(
                format!("{field}.type"),
                "must be SSH or HTTP",
            ));
        }
    };
    Ok(Presentation {
        name,
        kind,
        port: self::port(port, || format!("{field}.port"))?,
    })
}

fn configuration(
    configuration: proto::StageConfiguration,
    field: &str,
) -> Result<Configuration, Status> {
    let proto::StageConfiguration {
        r#type,
        file_name,
        contents,
        driver,
    } = configuration;
    let kind = match proto::ConfigurationType::try_from(r#type) {
        Ok(proto::ConfigurationType::Shell) => ConfigurationKind::Shell,
        Ok(proto::ConfigurationType::Python) => ConfigurationKind::Python,
        Ok(proto::ConfigurationType::Ansible) => ConfigurationKind::Ansible,
        Ok(proto::ConfigurationType::Napalm) => ConfigurationKind::Napalm,
        Ok(proto::ConfigurationType::Unspecified) | Err(_) => {
            return Err(errors::invalid(
                format!("{field}.type"),
                "must be a configuration type",
            ));
        }
    };
    Ok(Configuration {
        kind,
        file_name,
        contents,
        driver,
    })
}

impl From<proto::Image> for Image {
    fn from(image: proto::Image) -> Image {
        let proto::Image {
            slug,
            flavor,
            ssh_user,
            ssh_password,
            config_user,
            config_password,
            enable_forwarding,
            network_interfaces,
        } = image;
        Image {
            slug,
            flavor: match proto::Flavor::try_from(flavor) {
                Ok(proto::Flavor::Trusted) => Flavor::Trusted,
                Ok(proto::Flavor::Legacy) => Flavor::Legacy,
                Ok(proto::Flavor::Untrusted | proto::Flavor::Unspecified) | Err(_) => {
                    Flavor::Untrusted
                }
            },
            ssh_user,
            ssh_password,
            config_user,
            config_password,
            enable_forwarding,
            network_interfaces,
        }
    }
}

impl From<proto::Connection> for Connection {
    fn from(connection: proto::Connection) -> Connection {
        let proto::Connection { a, b, subnet } = connection;
        Connection {
            a,
            b,
            subnet: (!subnet.is_empty()).then_some(subnet),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> proto::LessonSpec {
        proto::LessonSpec {
            live_lesson_id: "3f1e0c9a-6b8d-4a59-9a0e-2d4c5b6a7e81".into(),
            generation: 2,
            stage: 1,
            endpoints: vec![proto::Endpoint {
                name: "web".into(),
                image: Some(proto::Image {
                    slug: "busybox".into(),
                    ssh_password: "secret".into(),
                    ..Default::default()
                }),
                presentations: vec![proto::Presentation {
                    name: "page".into(),
                    r#type: proto::PresentationType::Http as i32,
                    port: 8080,
                }],
                configuration: Some(proto::StageConfiguration {
                    r#type: proto::ConfigurationType::Shell as i32,
                    file_name: "web.sh".into(),
                    contents: b"true".to_vec(),
                    driver: String::new(),
                }),
                ..Default::default()
            }],
            ready_delay: Some(prost_types::Duration {
                seconds: 1,
                nanos: 500_000_000,
            }),
            configuration_timeout: Some(prost_types::Duration {
                seconds: -3,
                nanos: 0,
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_spec_reads_as_domain_values() {
        let lesson = Lesson::try_from(spec()).unwrap();
        assert_eq!(lesson.ready_delay, Duration::from_millis(1500));
        assert_eq!(
            lesson.configuration_timeout, None,
            "a negative bound is none"
        );
        let ceiling = Duration::from_secs(300);
        assert_eq!(lesson.configuration_timeout(ceiling), ceiling);
        let web = &lesson.endpoints[0];
        assert_eq!(web.presentations[0].kind, PresentationKind::Http);
        assert_eq!(web.presentations[0].port.get(), 8080);
        assert_eq!(
            web.configuration.as_ref().map(|c| c.kind),
            Some(ConfigurationKind::Shell)
        );
        assert_eq!(web.image.flavor, Flavor::Untrusted);
        assert!(!format!("{:?}", web.image).contains("secret"));
        assert_eq!(lesson.spec(), &spec());
    }

    #[test]
    fn what_a_domain_value_cannot_hold_names_its_field() {
        let mut wide = spec();
        wide.endpoints[0].presentations[0].port = 70000;
        assert_eq!(
            Lesson::try_from(wide).unwrap_err().message(),
            "spec.endpoints[0].presentations[0].port: 70000 is not in 1..65535"
        );
        let mut untyped = spec();
        untyped.endpoints[0].presentations[0].r#type = 0;
        assert_eq!(
            Lesson::try_from(untyped).unwrap_err().message(),
            "spec.endpoints[0].presentations[0].type: must be SSH or HTTP"
        );
    }
}
