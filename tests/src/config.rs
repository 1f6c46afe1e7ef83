//! Scheduler configurations for the tests, built as values rather than written as TOML text:
//! [`SchedulerConfig`] holds the tables the tests set (every key optional: an unset key is the
//! scheduler's default), `with_*` methods set them, and [`SchedulerConfig::to_toml`] writes the
//! file the scheduler reads (serialised with serde; [`Scheduler::start`](crate::Scheduler::start)
//! adds `listen`, `database` and the admin listeners).
//!
//! Two starting points cover most tests: [`SchedulerConfig::quick`] (the test agent on loopback:
//! a fast reaper and retries) and [`SchedulerConfig::on_real_backend`] (agent-docker or
//! agent-k8s: a slower reaper, no per-address session limit, the provisioning deadline given).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Serialize, Serializer};
use serde_json::{Map, Value};

/// A scheduler's configuration file, as the tests set it.
#[derive(Debug, Clone, Serialize)]
pub struct SchedulerConfig {
    /// The scheduler's instance id: agents label every object with it.
    pub instance_id: String,
    /// The curriculum directory.
    pub curriculum: PathBuf,
    /// The lowest lesson tier loaded (`local` or `prod`).
    pub tier: String,
    /// How long calls and streams may go on once SIGTERM arrives.
    #[serde(serialize_with = "duration", skip_serializing_if = "Option::is_none")]
    pub shutdown_grace: Option<Duration>,
    /// `[ttl]`.
    pub ttl: Ttl,
    /// `[limits]`.
    pub limits: Limits,
    /// `[reaper]`.
    pub reaper: Reaper,
    /// `[reconciler]`.
    pub reconciler: Reconciler,
    /// `[replicas]`.
    pub replicas: Replicas,
    /// `[http]`.
    pub http: Http,
    /// `[admin]`: more than the listeners and tokens every test scheduler gets.
    pub admin: Admin,
    /// `[telemetry]`.
    pub telemetry: Telemetry,
    /// `[entrypoint]`.
    pub entrypoint: Entrypoint,
    /// `[pools]`.
    pub pools: Pools,
    /// `[agent_intake]`, where agents dial in.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agent_intake: Option<Intake>,
    /// `[[agents]]`, the agents the scheduler dials.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub agents: Vec<Agent>,
}

/// `[ttl]`: how long idle live lessons and sessions live.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Ttl {
    #[serde(serialize_with = "duration", skip_serializing_if = "Option::is_none")]
    pub live_lesson: Option<Duration>,
    #[serde(serialize_with = "duration", skip_serializing_if = "Option::is_none")]
    pub session: Option<Duration>,
}

/// `[limits]`: what one address and one session may hold.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Limits {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sessions_per_ip: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub live_lessons_per_session: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub connections_per_address: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub watches_per_session: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub watches_per_address: Option<u32>,
    #[serde(serialize_with = "duration", skip_serializing_if = "Option::is_none")]
    pub header_read_timeout: Option<Duration>,
    #[serde(serialize_with = "duration", skip_serializing_if = "Option::is_none")]
    pub request_timeout: Option<Duration>,
}

/// `[reaper]`: its schedule.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Reaper {
    #[serde(serialize_with = "duration", skip_serializing_if = "Option::is_none")]
    pub interval: Option<Duration>,
    #[serde(serialize_with = "duration", skip_serializing_if = "Option::is_none")]
    pub orphan_interval: Option<Duration>,
    #[serde(serialize_with = "duration", skip_serializing_if = "Option::is_none")]
    pub orphan_grace: Option<Duration>,
}

/// `[reconciler]`: its workers, deadlines and retries.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Reconciler {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workers: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub calls_per_agent: Option<u32>,
    #[serde(serialize_with = "duration", skip_serializing_if = "Option::is_none")]
    pub poll_interval: Option<Duration>,
    #[serde(serialize_with = "duration", skip_serializing_if = "Option::is_none")]
    pub backoff_initial: Option<Duration>,
    #[serde(serialize_with = "duration", skip_serializing_if = "Option::is_none")]
    pub backoff_max: Option<Duration>,
    #[serde(serialize_with = "duration", skip_serializing_if = "Option::is_none")]
    pub call_timeout: Option<Duration>,
    #[serde(serialize_with = "duration", skip_serializing_if = "Option::is_none")]
    pub provision_timeout: Option<Duration>,
    #[serde(serialize_with = "duration", skip_serializing_if = "Option::is_none")]
    pub agent_grace: Option<Duration>,
}

/// `[replicas]`: leases and the resync of replicas sharing one database.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Replicas {
    #[serde(serialize_with = "duration", skip_serializing_if = "Option::is_none")]
    pub lease_ttl: Option<Duration>,
    #[serde(serialize_with = "duration", skip_serializing_if = "Option::is_none")]
    pub resync_interval: Option<Duration>,
}

/// `[http]`: the learners' JSON API. Unset `listen`: a free loopback port.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Http {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub cors_origins: Vec<String>,
}

/// `[admin]` beyond the test listeners and tokens.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Admin {
    /// `/metrics` on a listener of its own.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics_listen: Option<String>,
    /// `[admin.oidc]`: SSO JWTs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub oidc: Option<Oidc>,
}

/// `[admin.oidc]`.
#[derive(Debug, Clone, Serialize)]
pub struct Oidc {
    pub issuer: String,
    pub audience: String,
    pub jwks_file: PathBuf,
}

/// `[telemetry]`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Telemetry {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub otlp_endpoint: Option<String>,
}

/// `[entrypoint]`: the keys that sign learners' entrypoint tokens.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Entrypoint {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub keys: Vec<EntrypointKey>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub revoked: Vec<String>,
    #[serde(serialize_with = "duration", skip_serializing_if = "Option::is_none")]
    pub token_ttl: Option<Duration>,
}

/// One signing key: `{ id, file }`.
#[derive(Debug, Clone, Serialize)]
pub struct EntrypointKey {
    pub id: String,
    pub file: PathBuf,
}

/// `[pools]`: warm pools.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Pools {
    #[serde(serialize_with = "duration", skip_serializing_if = "Option::is_none")]
    pub interval: Option<Duration>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub lessons: Vec<Pool>,
}

/// `[[pools.lessons]]`: one lesson's pool.
#[derive(Debug, Clone, Serialize)]
pub struct Pool {
    pub lesson: String,
    pub size: u32,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub windows: Vec<PoolWindow>,
}

/// A time window of a pool: `size` members from `from` to `to` (times of day).
#[derive(Debug, Clone, Serialize)]
pub struct PoolWindow {
    pub from: String,
    pub to: String,
    pub size: u32,
}

/// `[agent_intake]`: the listener agents dial in to, and whom it admits.
#[derive(Debug, Clone, Serialize)]
pub struct Intake {
    pub listen: String,
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: PathBuf,
    pub allow: Vec<String>,
    pub agents: Vec<String>,
}

/// `[[agents]]`: one agent the scheduler dials.
#[derive(Debug, Clone, Serialize)]
pub struct Agent {
    pub name: String,
    pub address: String,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls: Option<AgentTls>,
}

/// An agent's `tls`: the CA its certificate is checked against, the scheduler's client
/// certificate, and the name the agent's certificate must carry.
#[derive(Debug, Clone, Serialize)]
pub struct AgentTls {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
    pub server_name: String,
}

impl Agent {
    /// An agent at `address` (`http://…` or `https://…`).
    pub fn new(name: &str, address: impl Into<String>) -> Agent {
        Agent {
            name: name.to_owned(),
            address: address.into(),
            labels: BTreeMap::new(),
            tls: None,
        }
    }

    /// With the labels the operator gives it.
    pub fn with_labels<'a>(mut self, labels: impl IntoIterator<Item = (&'a str, &'a str)>) -> Self {
        self.labels.extend(
            labels
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned())),
        );
        self
    }

    /// Dialled over mutual TLS.
    pub fn with_tls(mut self, tls: AgentTls) -> Self {
        self.tls = Some(tls);
        self
    }
}

impl Pool {
    /// `size` members of `lesson` at all times.
    pub fn new(lesson: &str, size: u32) -> Pool {
        Pool {
            lesson: lesson.to_owned(),
            size,
            windows: Vec::new(),
        }
    }

    /// With a window of `size` members from `from` to `to`.
    pub fn with_window(mut self, from: &str, to: &str, size: u32) -> Self {
        self.windows.push(PoolWindow {
            from: from.to_owned(),
            to: to.to_owned(),
            size,
        });
        self
    }
}

/// Milliseconds, for short literals in tests' configurations.
pub const fn ms(millis: u64) -> Duration {
    Duration::from_millis(millis)
}

/// Seconds.
pub const fn secs(seconds: u64) -> Duration {
    Duration::from_secs(seconds)
}

impl SchedulerConfig {
    /// `instance_id` on `curriculum`, tier `local`, every other key the scheduler's default.
    pub fn new(instance_id: &str, curriculum: &Path) -> SchedulerConfig {
        SchedulerConfig {
            instance_id: instance_id.to_owned(),
            curriculum: curriculum.to_owned(),
            tier: "local".to_owned(),
            shutdown_grace: None,
            ttl: Ttl::default(),
            limits: Limits::default(),
            reaper: Reaper::default(),
            reconciler: Reconciler::default(),
            replicas: Replicas::default(),
            http: Http::default(),
            admin: Admin::default(),
            telemetry: Telemetry::default(),
            entrypoint: Entrypoint::default(),
            pools: Pools::default(),
            agent_intake: None,
            agents: Vec::new(),
        }
    }

    /// For the test agent on loopback: the reaper every 200 ms (orphans after 500 ms), retries
    /// from 50 ms to 1 s, agents polled every 500 ms, provisioning bounded at 2 min.
    pub fn quick(instance_id: &str, curriculum: &Path) -> SchedulerConfig {
        SchedulerConfig::new(instance_id, curriculum)
            .with_reaper(ms(200), ms(200), ms(500))
            .with_retries(ms(500), ms(50), secs(1))
            .with_provision_timeout(secs(120))
    }

    /// For agent-docker or agent-k8s: the reaper every 500 ms (orphans after 1 s), retries
    /// from 100 ms to 1 s, agents polled every 500 ms, no per-address session limit, and
    /// `provision_timeout` for real images and pods.
    pub fn on_real_backend(
        instance_id: &str,
        curriculum: &Path,
        provision_timeout: Duration,
    ) -> SchedulerConfig {
        SchedulerConfig::new(instance_id, curriculum)
            .with_sessions_per_ip(0)
            .with_reaper(ms(500), ms(500), secs(1))
            .with_retries(ms(500), ms(100), secs(1))
            .with_provision_timeout(provision_timeout)
    }

    pub fn with_tier(mut self, tier: &str) -> Self {
        self.tier = tier.to_owned();
        self
    }

    pub fn with_shutdown_grace(mut self, grace: Duration) -> Self {
        self.shutdown_grace = Some(grace);
        self
    }

    /// `[ttl] live_lesson`.
    pub fn with_lesson_ttl(mut self, ttl: Duration) -> Self {
        self.ttl.live_lesson = Some(ttl);
        self
    }

    /// `[ttl] session`.
    pub fn with_session_ttl(mut self, ttl: Duration) -> Self {
        self.ttl.session = Some(ttl);
        self
    }

    /// `[limits] sessions_per_ip` (0: none).
    pub fn with_sessions_per_ip(mut self, sessions: u32) -> Self {
        self.limits.sessions_per_ip = Some(sessions);
        self
    }

    /// `[limits] live_lessons_per_session`.
    pub fn with_lessons_per_session(mut self, lessons: u32) -> Self {
        self.limits.live_lessons_per_session = Some(lessons);
        self
    }

    /// `[limits] watches_per_address`.
    pub fn with_watches_per_address(mut self, watches: u32) -> Self {
        self.limits.watches_per_address = Some(watches);
        self
    }

    /// Sets `[limits]` keys through a closure, for the bounds tests' rarer ones.
    pub fn with_limits(mut self, set: impl FnOnce(&mut Limits)) -> Self {
        set(&mut self.limits);
        self
    }

    /// `[reaper]`: its interval, the orphan sweep's interval and an orphan's grace period.
    pub fn with_reaper(
        mut self,
        interval: Duration,
        orphan_interval: Duration,
        orphan_grace: Duration,
    ) -> Self {
        self.reaper = Reaper {
            interval: Some(interval),
            orphan_interval: Some(orphan_interval),
            orphan_grace: Some(orphan_grace),
        };
        self
    }

    /// `[reconciler] poll_interval`, `backoff_initial`, `backoff_max`.
    pub fn with_retries(mut self, poll: Duration, initial: Duration, max: Duration) -> Self {
        self.reconciler.poll_interval = Some(poll);
        self.reconciler.backoff_initial = Some(initial);
        self.reconciler.backoff_max = Some(max);
        self
    }

    /// `[reconciler] backoff_initial` and `backoff_max` alone.
    pub fn with_backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.reconciler.backoff_initial = Some(initial);
        self.reconciler.backoff_max = Some(max);
        self
    }

    /// `[reconciler] provision_timeout`.
    pub fn with_provision_timeout(mut self, timeout: Duration) -> Self {
        self.reconciler.provision_timeout = Some(timeout);
        self
    }

    /// Sets `[reconciler]` keys through a closure (workers, calls per agent, deadlines).
    pub fn with_reconciler(mut self, set: impl FnOnce(&mut Reconciler)) -> Self {
        set(&mut self.reconciler);
        self
    }

    /// `[replicas]`: the lease's lifetime and the resync's interval.
    pub fn with_replicas(mut self, lease_ttl: Duration, resync_interval: Duration) -> Self {
        self.replicas = Replicas {
            lease_ttl: Some(lease_ttl),
            resync_interval: Some(resync_interval),
        };
        self
    }

    /// `[http] listen`.
    pub fn with_http_listen(mut self, listen: &str) -> Self {
        self.http.listen = Some(listen.to_owned());
        self
    }

    /// `[http] cors_origins`.
    pub fn with_cors_origins(mut self, origins: &[&str]) -> Self {
        self.http.cors_origins = origins.iter().map(|o| o.to_string()).collect();
        self
    }

    /// `[admin] metrics_listen`.
    pub fn with_metrics_listen(mut self, listen: &str) -> Self {
        self.admin.metrics_listen = Some(listen.to_owned());
        self
    }

    /// `[admin.oidc]`.
    pub fn with_oidc(mut self, issuer: &str, audience: &str, jwks_file: &Path) -> Self {
        self.admin.oidc = Some(Oidc {
            issuer: issuer.to_owned(),
            audience: audience.to_owned(),
            jwks_file: jwks_file.to_owned(),
        });
        self
    }

    /// `[telemetry] otlp_endpoint`.
    pub fn with_otlp_endpoint(mut self, endpoint: &str) -> Self {
        self.telemetry.otlp_endpoint = Some(endpoint.to_owned());
        self
    }

    /// `[entrypoint]`: signing keys `(id, file)` (the last one signs) and the tokens' lifetime.
    pub fn with_entrypoint_keys(mut self, keys: &[(&str, &Path)], token_ttl: Duration) -> Self {
        self.entrypoint.keys = keys
            .iter()
            .map(|(id, file)| EntrypointKey {
                id: id.to_string(),
                file: file.to_path_buf(),
            })
            .collect();
        self.entrypoint.token_ttl = Some(token_ttl);
        self
    }

    /// `[entrypoint] revoked`.
    pub fn with_revoked_keys(mut self, revoked: &[&str]) -> Self {
        self.entrypoint.revoked = revoked.iter().map(|k| k.to_string()).collect();
        self
    }

    /// `[pools] interval`.
    pub fn with_pools_interval(mut self, interval: Duration) -> Self {
        self.pools.interval = Some(interval);
        self
    }

    /// One more `[[pools.lessons]]`.
    pub fn with_pool(mut self, pool: Pool) -> Self {
        self.pools.lessons.push(pool);
        self
    }

    /// `[agent_intake]`.
    pub fn with_intake(mut self, intake: Intake) -> Self {
        self.agent_intake = Some(intake);
        self
    }

    /// One more `[[agents]]`.
    pub fn with_agent(mut self, agent: Agent) -> Self {
        self.agents.push(agent);
        self
    }

    /// The TOML file.
    pub fn to_toml(&self) -> String {
        let value = serde_json::to_value(self).expect("a configuration serialises");
        let Value::Object(mut root) = value else {
            unreachable!("a struct serialises to an object")
        };
        // `[admin]` as dotted keys (`admin.metrics_listen = …`), before any table: the test
        // harness puts the admin listeners and tokens in front of the file as dotted keys, and
        // TOML forbids a `[admin]` header for a table that dotted keys defined (its sub-tables,
        // `[admin.oidc]`, are allowed).
        let mut admin = match root.remove("admin") {
            Some(Value::Object(admin)) => admin,
            _ => Map::new(),
        };
        let mut out = String::new();
        let nested: Map<String, Value> = admin
            .iter()
            .filter(|(_, v)| v.is_object())
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        admin.retain(|_, v| !v.is_object() && !v.is_null());
        let (plain, tables): (Map<String, Value>, Map<String, Value>) = root
            .into_iter()
            .partition(|(_, v)| !v.is_object() && !is_array_of_tables(v));
        write_table(&mut out, "", &plain);
        for (key, value) in &admin {
            out.push_str(&format!("admin.{} = {}\n", toml_key(key), inline(value)));
        }
        write_table(&mut out, "", &tables);
        write_table(&mut out, "admin", &nested);
        out
    }
}

/// A duration as the scheduler reads it (`500ms`, `2m`).
fn duration<S: Serializer>(value: &Option<Duration>, serializer: S) -> Result<S::Ok, S::Error> {
    match value {
        Some(d) => serializer.serialize_str(&humantime::format_duration(*d).to_string()),
        None => serializer.serialize_none(),
    }
}

/// Writes `table` at `path` as TOML (keys in alphabetical order): its plain keys, then its tables (`[path.key]`), then its
/// arrays of tables (`[[path.key]]`). Tables with nothing in them are left out.
fn write_table(out: &mut String, path: &str, table: &Map<String, Value>) {
    let mut tables = Vec::new();
    let mut arrays = Vec::new();
    for (key, value) in table {
        match value {
            Value::Null => {}
            Value::Object(inner) => tables.push((key, inner)),
            Value::Array(items) if is_array_of_tables(value) => arrays.push((key, items)),
            _ => out.push_str(&format!("{} = {}\n", toml_key(key), inline(value))),
        }
    }
    let under = |key: &str| match path {
        "" => toml_key(key),
        _ => format!("{path}.{}", toml_key(key)),
    };
    for (key, inner) in tables {
        if inner.values().all(Value::is_null) {
            continue;
        }
        out.push_str(&format!("[{}]\n", under(key)));
        write_table(out, &under(key), inner);
    }
    for (key, items) in arrays {
        for item in items {
            out.push_str(&format!("[[{}]]\n", under(key)));
            if let Value::Object(inner) = item {
                write_table(out, &under(key), inner);
            }
        }
    }
}

/// Whether `value` is written as `[[…]]` tables.
fn is_array_of_tables(value: &Value) -> bool {
    matches!(value, Value::Array(items) if !items.is_empty() && items.iter().all(Value::is_object))
}

/// A key, bare when TOML allows it, quoted otherwise.
fn toml_key(key: &str) -> String {
    let bare = !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if bare {
        key.to_owned()
    } else {
        inline(&Value::from(key))
    }
}

/// A value on one line: strings in TOML's basic form (JSON's escapes are TOML's), arrays and
/// inline tables.
fn inline(value: &Value) -> String {
    match value {
        Value::Array(items) => {
            let items: Vec<String> = items.iter().map(inline).collect();
            format!("[{}]", items.join(", "))
        }
        Value::Object(table) => {
            let entries: Vec<String> = table
                .iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| format!("{} = {}", toml_key(k), inline(v)))
                .collect();
            format!("{{ {} }}", entries.join(", "))
        }
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The file the builder writes, as the scheduler's own settings loader reads it.
    fn loaded(config: &SchedulerConfig) -> scheduler_svc::settings::Config {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("antidote.toml");
        std::fs::write(&path, config.to_toml()).unwrap();
        scheduler_svc::settings::Config::load_with_env(Some(&path), std::iter::empty())
            .unwrap_or_else(|err| panic!("{err}\n{}", config.to_toml()))
    }

    #[test]
    fn unset_keys_are_left_to_the_schedulers_defaults() {
        let config = SchedulerConfig::new("t", Path::new("/c"));
        assert_eq!(
            config.to_toml(),
            "curriculum = \"/c\"\ninstance_id = \"t\"\ntier = \"local\"\n"
        );
    }

    /// `[admin]` keys are dotted, so the harness's own dotted admin keys in front stay valid.
    #[test]
    fn admin_keys_stand_beside_the_harness_s_admin_listeners() {
        let dir = tempfile::tempdir().unwrap();
        let jwks = dir.path().join("jwks.json");
        std::fs::write(&jwks, r#"{"keys": []}"#).unwrap();
        let config = SchedulerConfig::new("t", dir.path())
            .with_metrics_listen("127.0.0.1:0")
            .with_oidc("https://sso.example.test", "antidote-admin", &jwks)
            .with_agent(Agent::new("a", "http://127.0.0.1:1"));
        let text = format!("{}{}", crate::admin_config(), config.to_toml());
        assert!(
            text.contains("\nadmin.metrics_listen = \"127.0.0.1:0\"\n"),
            "{text}"
        );
        assert!(text.contains("\n[admin.oidc]\n"), "{text}");
        let path = dir.path().join("antidote.toml");
        std::fs::write(&path, &text).unwrap();
        scheduler_svc::settings::Config::load_with_env(Some(&path), std::iter::empty())
            .unwrap_or_else(|err| panic!("{err}\n{text}"));
    }

    #[test]
    fn every_table_reaches_the_scheduler_as_set() {
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("k1 \"quoted\".pem");
        let config = SchedulerConfig::on_real_backend("e2e", dir.path(), secs(180))
            .with_tier("prod")
            .with_lesson_ttl(secs(20))
            .with_session_ttl(secs(24 * 3600))
            .with_lessons_per_session(5)
            .with_limits(|l| l.header_read_timeout = Some(secs(3)))
            .with_reconciler(|r| r.workers = Some(4))
            .with_replicas(secs(2), ms(500))
            .with_http_listen("127.0.0.1:0")
            .with_entrypoint_keys(&[("k1", &key)], secs(120))
            .with_pools_interval(ms(200))
            .with_pool(Pool::new("hello-web", 2).with_window("08:00", "17:00", 4))
            .with_agent(Agent::new("eu", "http://127.0.0.1:1").with_labels([("region", "eu")]))
            .with_agent(Agent::new("us", "http://127.0.0.1:2"));
        let seen = loaded(&config);
        assert_eq!(seen.instance_id, "e2e");
        assert_eq!(seen.tier.as_str(), "prod");
        assert_eq!(seen.ttl.live_lesson, secs(20));
        assert_eq!(seen.ttl.session, secs(24 * 3600));
        assert_eq!(seen.limits.sessions_per_ip, 0);
        assert_eq!(seen.limits.live_lessons_per_session, 5);
        assert_eq!(seen.reaper.orphan_grace, secs(1));
        assert_eq!(seen.reconciler.backoff_initial, ms(100));
        assert_eq!(seen.reconciler.provision_timeout, secs(180));
        assert_eq!(seen.reconciler.workers, 4);
        assert_eq!(seen.replicas.resync_interval, ms(500));
        assert_eq!(seen.entrypoint.keys[0].file, key);
        assert_eq!(seen.entrypoint.token_ttl, secs(120));
        assert_eq!(seen.pools.interval, ms(200));
        assert_eq!(seen.pools.lessons[0].windows.len(), 1);
        assert_eq!(seen.agents.len(), 2);
        assert_eq!(
            seen.agents[0].labels.get("region").map(String::as_str),
            Some("eu")
        );
        assert!(seen.agents[1].labels.is_empty());
    }
}
