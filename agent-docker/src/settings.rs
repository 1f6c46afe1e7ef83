//! The agent's configuration, from flags and `ANTIDOTE_DOCKER_*` environment variables.

use std::net::SocketAddr;
use std::time::Duration;

/// Configuration of agent-docker.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "agent-docker",
    version,
    about = "Antidote's Docker backend agent"
)]
pub struct Settings {
    /// Where to serve antidote.agent.v1 (port 0: any; the bound address is printed).
    #[arg(long, env = "ANTIDOTE_DOCKER_LISTEN", default_value = "127.0.0.1:7071")]
    pub listen: SocketAddr,
    /// Where to serve Prometheus `/metrics` (off when unset; port 0: any, printed).
    #[arg(long, env = "ANTIDOTE_DOCKER_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
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
    /// Extra wait after readiness, added to the lesson's own ready delay.
    #[arg(long, env = "ANTIDOTE_DOCKER_READY_DELAY", default_value = "0s", value_parser = humantime::parse_duration)]
    pub ready_delay: Duration,
    /// Run trusted (and legacy) images privileged. With `false` they get NET_ADMIN and NET_RAW
    /// only: for engines that cannot grant every capability (such as nested sandboxes, where
    /// `--privileged` fails with "unable to apply caps").
    #[arg(long, env = "ANTIDOTE_DOCKER_TRUSTED_PRIVILEGED", default_value_t = true, action = clap::ArgAction::Set)]
    pub trusted_privileged: bool,
    /// The most live lessons this agent takes (0: no limit).
    #[arg(long, env = "ANTIDOTE_DOCKER_MAX_LIVE_LESSONS", default_value_t = 0)]
    pub max_live_lessons: u32,
}

impl Settings {
    /// The image reference for a slug.
    pub fn image(&self, slug: &str) -> String {
        self.image_pattern.replace("{slug}", slug)
    }
}
