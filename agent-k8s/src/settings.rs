//! The agent's configuration, from flags and `ANTIDOTE_K8S_*` environment variables.

use std::net::SocketAddr;
use std::time::Duration;

/// Configuration of agent-k8s.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "agent-k8s",
    version,
    about = "Antidote's Kubernetes backend agent"
)]
pub struct Settings {
    /// Where to serve antidote.agent.v1 (port 0: any; the bound address is printed).
    #[arg(long, env = "ANTIDOTE_K8S_LISTEN", default_value = "127.0.0.1:7072")]
    pub listen: SocketAddr,
    /// Where to serve Prometheus `/metrics` (off when unset; port 0: any, printed).
    #[arg(long, env = "ANTIDOTE_K8S_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// Image reference for a curriculum image slug; `{slug}` is replaced.
    #[arg(
        long,
        env = "ANTIDOTE_K8S_IMAGE_PATTERN",
        default_value = "antidote/{slug}:latest"
    )]
    pub image_pattern: String,
    /// RuntimeClass for untrusted images (a sandbox such as gVisor or Kata); none: the default.
    #[arg(long, env = "ANTIDOTE_K8S_UNTRUSTED_RUNTIME_CLASS")]
    pub untrusted_runtime_class: Option<String>,
    /// IngressClass of the Ingress made for each http presentation; none: the cluster default.
    #[arg(long, env = "ANTIDOTE_K8S_INGRESS_CLASS")]
    pub ingress_class: Option<String>,
    /// Host of each http presentation's Ingress; `{presentation}`, `{endpoint}`, `{lesson}` and
    /// `{short}` (the first 8 characters of the live lesson id) are replaced.
    #[arg(
        long,
        env = "ANTIDOTE_K8S_INGRESS_HOST",
        default_value = "{presentation}-{endpoint}-{short}.antidote.localhost"
    )]
    pub ingress_host: String,
    /// TLS secret for the Ingresses (in the live lesson's namespace); none: plain HTTP.
    #[arg(long, env = "ANTIDOTE_K8S_INGRESS_TLS_SECRET")]
    pub ingress_tls_secret: Option<String>,
    /// Let endpoints reach anything (the policy otherwise allows only the lesson's own pods
    /// and DNS).
    #[arg(long, env = "ANTIDOTE_K8S_ALLOW_EGRESS", default_value_t = false)]
    pub allow_egress: bool,
    /// Namespaces carrying this label (key=value) may reach every lesson's pods: the agent's own
    /// (for probes) and the ingress controller's.
    #[arg(
        long,
        env = "ANTIDOTE_K8S_ACCESS_LABEL",
        default_value = "antidote.io/access=true"
    )]
    pub access_label: String,
    /// How long pods may take to run and presentations to answer before the live lesson FAILs.
    #[arg(long, env = "ANTIDOTE_K8S_PROBE_TIMEOUT", default_value = "120s", value_parser = humantime::parse_duration)]
    pub probe_timeout: Duration,
    /// Retries of a stage's configuration Job (`backoffLimit`).
    #[arg(long, env = "ANTIDOTE_K8S_CONFIG_BACKOFF_LIMIT", default_value_t = 3)]
    pub config_backoff_limit: u32,
    /// How long a configuration Job may take.
    #[arg(long, env = "ANTIDOTE_K8S_CONFIG_TIMEOUT", default_value = "10m", value_parser = humantime::parse_duration)]
    pub config_timeout: Duration,
    /// Extra wait after readiness, added to the lesson's own ready delay.
    #[arg(long, env = "ANTIDOTE_K8S_READY_DELAY", default_value = "0s", value_parser = humantime::parse_duration)]
    pub ready_delay: Duration,
    /// Memory limit per endpoint pod, in MiB (0: none).
    #[arg(long, env = "ANTIDOTE_K8S_MEMORY_MIB", default_value_t = 256)]
    pub memory_mib: u64,
    /// CPU limit per endpoint pod, in millicores (0: none).
    #[arg(long, env = "ANTIDOTE_K8S_MILLICPUS", default_value_t = 1000)]
    pub millicpus: u64,
    /// The most live lessons this agent takes (0: no limit).
    #[arg(long, env = "ANTIDOTE_K8S_MAX_LIVE_LESSONS", default_value_t = 0)]
    pub max_live_lessons: u32,
}

impl Settings {
    /// The image reference for a slug.
    pub fn image(&self, slug: &str) -> String {
        self.image_pattern.replace("{slug}", slug)
    }

    /// The access label as (key, value).
    pub fn access_label(&self) -> (String, String) {
        match self.access_label.split_once('=') {
            Some((k, v)) => (k.to_owned(), v.to_owned()),
            None => (self.access_label.clone(), "true".to_owned()),
        }
    }
}
