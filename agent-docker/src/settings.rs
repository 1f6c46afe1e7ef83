//! The agent's configuration, from flags and `ANTIDOTE_DOCKER_*` environment variables.

use std::time::Duration;

use crate::firewall::Mode;

/// Configuration of agent-docker.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "agent-docker",
    version,
    about = "Antidote's Docker backend agent",
    mut_arg("listen", |a| a.env("ANTIDOTE_DOCKER_LISTEN").default_value("127.0.0.1:7071")),
    mut_arg("metrics_listen", |a| a.env("ANTIDOTE_DOCKER_METRICS_LISTEN"))
)]
pub struct Settings {
    /// The flags every agent takes: `--listen` (`ANTIDOTE_DOCKER_LISTEN`, default
    /// 127.0.0.1:7071), `--metrics-listen` (`ANTIDOTE_DOCKER_METRICS_LISTEN`), mTLS, `--connect`
    /// and the entrypoint (reaching containers at their own addresses when the agent runs on
    /// the engine's host, at their published ports otherwise).
    #[command(flatten)]
    pub agent: antidote_sdk::AgentArgs,
    /// Image reference for a curriculum image slug; `{slug}` is replaced.
    #[arg(
        long,
        env = "ANTIDOTE_DOCKER_IMAGE_PATTERN",
        default_value = "antidote/{slug}:latest"
    )]
    pub image_pattern: String,
    /// Host address presentations are published on.
    #[arg(
        long,
        env = "ANTIDOTE_DOCKER_PUBLISH_HOST",
        default_value = "127.0.0.1"
    )]
    pub publish_host: String,
    /// Memory limit per endpoint container, in MiB (0: none).
    #[arg(long, env = "ANTIDOTE_DOCKER_MEMORY_MIB", default_value_t = 256)]
    pub memory_mib: u64,
    /// CPU limit per endpoint container, in CPUs (0: none).
    #[arg(long, env = "ANTIDOTE_DOCKER_CPUS", default_value_t = 1.0)]
    pub cpus: f64,
    /// How long readiness probes may take for one endpoint before the live lesson FAILs.
    #[arg(long, env = "ANTIDOTE_DOCKER_PROBE_TIMEOUT", default_value = "60s", value_parser = humantime::parse_duration)]
    pub probe_timeout: Duration,
    /// Tries of a stage's configuration before the live lesson FAILs.
    #[arg(long, env = "ANTIDOTE_DOCKER_CONFIG_TRIES", default_value_t = 3)]
    pub config_tries: u32,
    /// How long one run of a stage's configuration may take; a run still going then is killed
    /// and counts as a failed try. A lesson may ask for less (`configTimeout`), never more.
    #[arg(long, env = "ANTIDOTE_DOCKER_CONFIG_TIMEOUT", default_value = "5m", value_parser = humantime::parse_duration)]
    pub config_timeout: Duration,
    /// The image python, ansible and napalm configurations run in, one container per stage run
    /// on the lesson's network (built locally by tests/docker/configurator.sh). Checked at
    /// start: when the engine lacks it (or it is empty) the agent runs shell configurations only
    /// and does not offer the other types.
    #[arg(
        long,
        env = "ANTIDOTE_DOCKER_CONFIGURATOR_IMAGE",
        default_value = crate::configurator::DEFAULT_IMAGE
    )]
    pub configurator_image: String,
    /// The image a lesson's Jupyter guide endpoint runs (built locally by
    /// tests/docker/configurator.sh jupyter): Jupyter serving /antidote/guide on port 8888.
    /// Checked at start: when the engine lacks it (or it is empty) the agent does not offer
    /// `guide.jupyter`.
    #[arg(
        long,
        env = "ANTIDOTE_DOCKER_JUPYTER_IMAGE",
        default_value = crate::guide::DEFAULT_IMAGE
    )]
    pub jupyter_image: String,
    /// Memory limit of a configurator container, in MiB (0: none): ansible and NAPALM need more
    /// than an endpoint.
    #[arg(
        long,
        env = "ANTIDOTE_DOCKER_CONFIGURATOR_MEMORY_MIB",
        default_value_t = 1024
    )]
    pub configurator_memory_mib: u64,
    /// Extra wait after readiness, added to the lesson's own ready delay.
    #[arg(long, env = "ANTIDOTE_DOCKER_READY_DELAY", default_value = "0s", value_parser = humantime::parse_duration)]
    pub ready_delay: Duration,
    /// Run trusted (and legacy) images `--privileged`: an operator's opt-in, for network
    /// operating systems that need it, on engines that can grant it. Off, every endpoint gets the
    /// same confined set of capabilities (NET_ADMIN and NET_RAW for the lesson's networking).
    #[arg(long, env = "ANTIDOTE_DOCKER_TRUSTED_PRIVILEGED", default_value_t = false, action = clap::ArgAction::Set)]
    pub trusted_privileged: bool,
    /// The most processes (and threads) one endpoint may run: a fork bomb stops there (0: no
    /// limit).
    #[arg(long, env = "ANTIDOTE_DOCKER_PIDS_LIMIT", default_value_t = 1024)]
    pub pids_limit: i64,
    /// Let endpoints reach beyond their lesson's networks (the internet). The engine's host and
    /// the link-local metadata range stay out of reach either way.
    #[arg(long, env = "ANTIDOTE_DOCKER_ALLOW_EGRESS", default_value_t = false)]
    pub allow_egress: bool,
    /// Host firewall rules confining lesson networks (see `firewall`): `auto` installs them
    /// where the agent runs on the engine's host and warns once where it cannot; `required`
    /// refuses to run lessons it cannot confine; `off` never installs them.
    #[arg(long, env = "ANTIDOTE_DOCKER_FIREWALL", value_enum, default_value_t = Mode::Auto)]
    pub firewall: Mode,
    /// The most live lessons this agent takes (0: no limit).
    #[arg(long, env = "ANTIDOTE_DOCKER_MAX_LIVE_LESSONS", default_value_t = 0)]
    pub max_live_lessons: u32,
}

impl Settings {
    /// The image reference for a slug.
    pub fn image(&self, slug: &str) -> String {
        self.image_pattern.replace("{slug}", slug)
    }

    /// The image reference `endpoint` runs: the Jupyter image for a guide endpoint, its image
    /// slug's otherwise.
    pub fn image_of(&self, endpoint: &antidote_proto::agent::v1::Endpoint) -> String {
        if endpoint.jupyter_guide.is_some() {
            return self.jupyter_image.clone();
        }
        self.image(endpoint.image.as_ref().map_or("", |i| i.slug.as_str()))
    }
}
