//! The agent's configuration, from flags and `ANTIDOTE_K8S_*` environment variables.

use std::time::Duration;

use antidote_proto::agent::v1::LessonSpec;
use antidote_sdk::spec::configuration_timeout;

/// Configuration of agent-k8s.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "agent-k8s",
    version,
    about = "Antidote's Kubernetes backend agent",
    mut_arg("listen", |a| a.env("ANTIDOTE_K8S_LISTEN").default_value("127.0.0.1:7072")),
    mut_arg("metrics_listen", |a| a.env("ANTIDOTE_K8S_METRICS_LISTEN"))
)]
pub struct Settings {
    /// The flags every agent takes: `--listen` (`ANTIDOTE_K8S_LISTEN`, default
    /// 127.0.0.1:7072), `--metrics-listen` (`ANTIDOTE_K8S_METRICS_LISTEN`), mTLS, `--connect`
    /// and the entrypoint (reaching pods at their addresses in the cluster's network; deploy/k8s
    /// exposes it through the `agent-k8s-entrypoint` Service and an Ingress).
    #[command(flatten)]
    pub agent: antidote_sdk::AgentArgs,
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
    /// Retries of a stage's configuration: of a shell script run inside the endpoint, and of a
    /// configurator Job (its `backoffLimit`): 2, so 3 tries in all as PROTOCOL.md's [R3] says.
    #[arg(long, env = "ANTIDOTE_K8S_CONFIG_BACKOFF_LIMIT", default_value_t = 2)]
    pub config_backoff_limit: u32,
    /// How long one run (one pod) of a stage's configuration Job may take, rounded up to whole
    /// seconds: the pod's `activeDeadlineSeconds`. The Job as a whole gets every try's time plus
    /// the Job controller's back-off between tries ([`Settings::config_job_deadline`]). A lesson
    /// may ask for less (`configTimeout`, LessonSpec.configuration_timeout), never more. It also
    /// bounds each check or solution file (a lesson's `checkTimeout` may be less).
    #[arg(long, env = "ANTIDOTE_K8S_CONFIG_TIMEOUT", default_value = "5m", value_parser = humantime::parse_duration)]
    pub config_timeout: Duration,
    /// The image python, ansible and napalm configurations run in, as the stage's Jobs, and
    /// python check files, in a pod started for each run (built locally by
    /// tests/docker/configurator.sh; push it where the cluster pulls from). Without it the agent
    /// runs shell configurations and check files only and does not offer the other types.
    #[arg(long, env = "ANTIDOTE_K8S_CONFIGURATOR_IMAGE")]
    pub configurator_image: Option<String>,
    /// The image a lesson's Jupyter guide endpoint runs (built locally by
    /// tests/docker/configurator.sh jupyter; push it where the cluster pulls from): Jupyter
    /// serving /antidote/guide on port 8888. Without it the agent does not offer
    /// `guide.jupyter`.
    #[arg(long, env = "ANTIDOTE_K8S_JUPYTER_IMAGE")]
    pub jupyter_image: Option<String>,
    /// Memory limit of a configurator Job's container, in MiB (0: the endpoints' limit).
    #[arg(
        long,
        env = "ANTIDOTE_K8S_CONFIGURATOR_MEMORY_MIB",
        default_value_t = 1024
    )]
    pub configurator_memory_mib: u64,
    /// Extra wait after readiness, added to the lesson's own ready delay.
    #[arg(long, env = "ANTIDOTE_K8S_READY_DELAY", default_value = "0s", value_parser = humantime::parse_duration)]
    pub ready_delay: Duration,
    /// Run trusted (and legacy) images privileged: an operator's opt-in, for network operating
    /// systems that need it. Off, every lesson container gets the same confined security
    /// context. deploy/k8s's admission policy refuses privileged pods from the agent until the
    /// operator removes that check too.
    #[arg(long, env = "ANTIDOTE_K8S_TRUSTED_PRIVILEGED", default_value_t = false, action = clap::ArgAction::Set)]
    pub trusted_privileged: bool,
    /// Memory limit per endpoint pod, in MiB (0: none).
    #[arg(long, env = "ANTIDOTE_K8S_MEMORY_MIB", default_value_t = 256)]
    pub memory_mib: u64,
    /// CPU limit per endpoint pod, in millicores (0: none).
    #[arg(long, env = "ANTIDOTE_K8S_MILLICPUS", default_value_t = 1000)]
    pub millicpus: u64,
    /// CPU request per endpoint pod and configuration Job, in millicores: what the scheduler
    /// reserves on a node (the limit is what a pod may burst to). Lessons idle most of the
    /// time, so a small request packs a node; at most the limit.
    #[arg(long, env = "ANTIDOTE_K8S_REQUEST_MILLICPUS", default_value_t = 50)]
    pub request_millicpus: u64,
    /// Memory request per endpoint pod and configuration Job, in MiB; at most the limit.
    #[arg(long, env = "ANTIDOTE_K8S_REQUEST_MEMORY_MIB", default_value_t = 64)]
    pub request_memory_mib: u64,
    /// `imagePullPolicy` of every container the agent makes: `IfNotPresent` pulls an image once
    /// per node (Kubernetes' own default would be `Always` for `:latest` references, a registry
    /// pull on every start), `Always` on every start, `Never` uses only images already on the
    /// node (images imported into the node's runtime, as the tests do).
    #[arg(long, env = "ANTIDOTE_K8S_IMAGE_PULL_POLICY", default_value = "IfNotPresent", value_parser = ["IfNotPresent", "Always", "Never"])]
    pub image_pull_policy: String,
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
        label(&self.access_label)
    }

    /// One configuration run's time limit for `spec` (its own timeout capped by
    /// `--config-timeout`) in whole seconds (at least 1), for `activeDeadlineSeconds`.
    pub fn config_run_seconds(&self, spec: &LessonSpec) -> u64 {
        configuration_timeout(spec, self.config_timeout)
            .as_secs_f64()
            .ceil()
            .max(1.0) as u64
    }

    /// How long a configuration Job may live in all: every try its full time, plus the Job
    /// controller's back-off before each retry (10 s, doubling, at most 6 min).
    pub fn config_job_deadline(&self, spec: &LessonSpec) -> Duration {
        let tries = u64::from(self.config_backoff_limit) + 1;
        let mut seconds = self.config_run_seconds(spec) * tries;
        let mut backoff = 10u64;
        for _ in 0..self.config_backoff_limit {
            seconds += backoff.min(360);
            backoff = backoff.saturating_mul(2);
        }
        Duration::from_secs(seconds)
    }
}

/// `key=value` as (key, value); a bare key means `key=true`.
fn label(text: &str) -> (String, String) {
    match text.split_once('=') {
        Some((k, v)) => (k.to_owned(), v.to_owned()),
        None => (text.to_owned(), "true".to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    #[test]
    fn a_configuration_job_gets_every_try_and_the_back_off_between_them() {
        let settings = |args: &[&str]| {
            Settings::parse_from(std::iter::once("agent-k8s").chain(args.iter().copied()))
        };
        let defaults = settings(&[]);
        assert!(!defaults.trusted_privileged, "privilege is an opt-in");
        let spec = LessonSpec::default();
        assert_eq!(defaults.config_run_seconds(&spec), 300);
        // 3 tries of 5 min ([R3]), and 10 + 20 s of back-off.
        assert_eq!(defaults.config_backoff_limit, 2);
        assert_eq!(
            defaults.config_job_deadline(&spec),
            Duration::from_secs(3 * 300 + 30)
        );
        // A lesson asks for less: its time, every try.
        let asks = |seconds: u64| LessonSpec {
            configuration_timeout: Duration::from_secs(seconds).try_into().ok(),
            ..LessonSpec::default()
        };
        assert_eq!(defaults.config_run_seconds(&asks(2)), 2);
        assert_eq!(
            defaults.config_job_deadline(&asks(2)),
            Duration::from_secs(3 * 2 + 30)
        );
        // More than the operator allows: the operator's ceiling.
        assert_eq!(defaults.config_run_seconds(&asks(3600)), 300);
        let short = settings(&["--config-timeout", "1500ms", "--config-backoff-limit", "0"]);
        assert_eq!(short.config_run_seconds(&spec), 2);
        assert_eq!(short.config_job_deadline(&spec), Duration::from_secs(2));
        assert_eq!(defaults.image_pull_policy, "IfNotPresent");
        assert!(
            Settings::try_parse_from(["agent-k8s", "--image-pull-policy", "Sometimes"]).is_err()
        );
    }
}
