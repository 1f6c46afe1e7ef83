//! Typed configuration, loaded once: defaults → file → `ANTIDOTE_*` environment, then validated.
//! A bad value stops start-up with an error naming the key.
//!
//! Environment keys use `__` between levels: `ANTIDOTE_TTL__LIVE_LESSON=10m`,
//! `ANTIDOTE_LIMITS__SESSIONS_PER_IP=3`. Agents can be given as a comma-separated list of
//! `name=address`: `ANTIDOTE_AGENTS=docker=http://127.0.0.1:7071,k8s=http://10.0.0.5:7071`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::catalog::Tier;

/// Environment prefixes of other Antidote programs, which the scheduler ignores: agent-docker's
/// and agent-k8s's settings, and antidotectl's `ANTIDOTE_SERVER`.
pub const NOT_OURS: &[&str] = &[
    "ANTIDOTE_DOCKER_",
    "ANTIDOTE_K8S_",
    "ANTIDOTE_SERVER",
    // An agent's `--connect` (antidote_net::dial) and its TLS and plaintext flags
    // (antidote_net::tls::TlsArgs); `ANTIDOTE_AGENT_INTAKE__*` is ours.
    "ANTIDOTE_AGENT_CONNECT",
    "ANTIDOTE_AGENT_TLS_",
    "ANTIDOTE_AGENT_INSECURE_PLAINTEXT",
    // An agent's entrypoint flags (antidote_sdk::entrypoint::EntrypointArgs);
    // `ANTIDOTE_ENTRYPOINT__*` is ours.
    "ANTIDOTE_AGENT_ENTRYPOINT_",
    // The test suite's own settings (`ANTIDOTE_TEST_POSTGRES`: tests/postgres/pg.sh's server),
    // inherited by the schedulers the tests start.
    "ANTIDOTE_TEST_",
];

/// The scheduler's whole configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Where the public gRPC API listens. Port 0 picks a free port (printed at start-up).
    pub listen: SocketAddr,
    /// This scheduler's instance id; agents label every object with it, so several schedulers
    /// can share one backend.
    pub instance_id: String,
    /// The curriculum directory.
    pub curriculum: PathBuf,
    /// The lowest lesson tier loaded (prod > ptr > local).
    pub tier: Tier,
    /// Where the state lives: the path of an SQLite file (created if missing; one scheduler
    /// per file), or a `postgres://` URL (a database several replicas may share).
    pub database: crate::store::Database,
    /// How long idle live lessons and sessions live.
    pub ttl: TtlConfig,
    /// How much one address and one session may hold.
    pub limits: Limits,
    /// The reaper's schedule.
    pub reaper: ReaperConfig,
    /// The reconciler's pool, deadlines and retries.
    pub reconciler: ReconcilerConfig,
    /// Replicas sharing one PostgreSQL database: leases and the resync.
    pub replicas: ReplicasConfig,
    /// The agents to dial.
    pub agents: Vec<AgentConfig>,
    /// Where agents behind NAT dial in (`--connect`), and which of them are admitted; off
    /// unless `listen` is set.
    pub agent_intake: AgentIntakeConfig,
    /// Take the client address from the last `x-forwarded-for` entry, the one a trusted proxy
    /// in front of the scheduler added (only behind such a proxy: otherwise any client could
    /// pick its own address and dodge the per-IP limit).
    pub trust_forwarded_for: bool,
    /// The learners' JSON/HTTP API, server-sent events and the OpenAPI document.
    pub http: HttpConfig,
    /// The operators' API (gRPC AdminService, its JSON routes, `/metrics`) on listeners of its
    /// own, with bearer tokens; off unless configured.
    pub admin: AdminConfig,
    /// Where spans are exported (OTLP), if anywhere.
    pub telemetry: TelemetryConfig,
    /// Tokens for agents' entrypoints (learners' way in): signing keys, their lifetime, and
    /// agents' entrypoint URLs when their handshake does not say.
    pub entrypoint: EntrypointConfig,
    /// Warm pools: lessons kept READY for learners to claim (`[pools]`, `[[pools.lessons]]`).
    pub pools: PoolsConfig,
    /// How long, once shutdown begins (SIGTERM), calls and streams still open (API and health
    /// Watch streams, reflection, SSE) may go on before their connections are cut, and
    /// background work may take to stop: the process exits within about twice this.
    #[serde(with = "humantime_serde")]
    pub shutdown_grace: Duration,
}

/// Entrypoint tokens (PROTOCOL.md, "Entrypoint"). No keys: no token is signed and learners'
/// answers carry no `entrypoint_url`.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EntrypointConfig {
    /// Signing keys, `{ id = "k2", file = "k2.pem" }` (Ed25519, PKCS#8 PEM: `openssl genpkey
    /// -algorithm ed25519`). Every key's public half goes to agents at handshake, so tokens of
    /// an older key keep verifying while it is listed; every replica lists the same keys.
    pub keys: Vec<EntrypointKeyConfig>,
    /// The id of the key that signs; unset: the last listed. Rotation: add the new key, make it
    /// current, remove the old one once its tokens expired (a removed key admits nothing new;
    /// what it admitted, such as open terminals, goes on).
    pub current: Option<String>,
    /// Key ids revoked (a leaked key): agents refuse their tokens and end what they admitted
    /// (open terminals close with 1008). Not in `keys`.
    pub revoked: Vec<String>,
    /// How long a token admits (its `exp`): learners get a fresh one with every answer. At
    /// most 12h, half of the longest lifetime agents' entrypoints accept by default
    /// (`--entrypoint-max-token-lifetime`, 24h; an operator who lowers it keeps it at least
    /// twice this).
    #[serde(with = "humantime_serde")]
    pub token_ttl: Duration,
    /// Agents' entrypoint URLs by agent name, over what their handshakes say: best with an
    /// origin per live lesson, `{ docker = "https://{live_lesson}.lab.example" }` (the agent's
    /// `--entrypoint-url`); `https://lab.example:8443` serves every lesson from one origin.
    pub urls: std::collections::BTreeMap<String, String>,
    /// Whether learners see their presentations' backend `address`/`url` where they get no
    /// entrypoint URL (no keys, or the agent has no entrypoint). Off: learners never see a
    /// backend address (operators do, through the admin API). Where an entrypoint URL is
    /// issued, learners never get backend addresses, whatever this says.
    pub backend_addresses: bool,
}

impl Default for EntrypointConfig {
    fn default() -> Self {
        EntrypointConfig {
            keys: Vec::new(),
            current: None,
            revoked: Vec::new(),
            token_ttl: Duration::from_secs(600),
            urls: Default::default(),
            backend_addresses: false,
        }
    }
}

/// One entrypoint signing key.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EntrypointKeyConfig {
    /// Its key id (`kid`).
    pub id: String,
    /// The PKCS#8 PEM file of the Ed25519 private key.
    pub file: PathBuf,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 7070)),
            instance_id: "antidote".into(),
            curriculum: PathBuf::from("curriculum"),
            tier: Tier::Prod,
            database: crate::store::Database::Sqlite(PathBuf::from("antidote.db")),
            ttl: TtlConfig::default(),
            limits: Limits::default(),
            reaper: ReaperConfig::default(),
            reconciler: ReconcilerConfig::default(),
            replicas: ReplicasConfig::default(),
            agents: Vec::new(),
            agent_intake: AgentIntakeConfig::default(),
            trust_forwarded_for: false,
            http: HttpConfig::default(),
            admin: AdminConfig::default(),
            telemetry: TelemetryConfig::default(),
            entrypoint: EntrypointConfig::default(),
            pools: PoolsConfig::default(),
            shutdown_grace: Duration::from_secs(10),
        }
    }
}

/// Warm pools: per lesson and stage, how many members to keep READY. Written to the store at
/// start (`source` `config`); a pool an operator set (AdminService.SetPool) keeps the
/// operator's values.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PoolsConfig {
    /// The IANA time zone windows are read in (`Europe/Paris`); `UTC` by default.
    pub time_zone: String,
    /// How often every pool is brought to its target (also right after each claim).
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// Members created per pool per look, at most: a large target fills over several looks
    /// rather than asking agents for everything at once.
    pub batch: u32,
    /// The pools.
    pub lessons: Vec<PoolConfig>,
}

impl Default for PoolsConfig {
    fn default() -> Self {
        Self {
            time_zone: "UTC".into(),
            interval: Duration::from_secs(1),
            batch: 8,
            lessons: Vec::new(),
        }
    }
}

/// Largest pool target, so one typo cannot ask agents for a million lessons.
pub const MAX_POOL_SIZE: u32 = 1000;
/// Most windows per pool.
pub const MAX_POOL_WINDOWS: usize = 24;

/// One pool: `[[pools.lessons]] lesson = "routing-basics"`, `size = 3`, optional `stage`
/// (0) and `windows = [{ from = "08:45", to = "10:00", size = 30 }]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// The lesson's slug.
    pub lesson: String,
    /// The stage members are kept at.
    #[serde(default)]
    pub stage: u32,
    /// The target outside every window.
    #[serde(default)]
    pub size: u32,
    /// Daily windows with their own target (the largest of those holding wins).
    #[serde(default)]
    pub windows: Vec<crate::model::PoolWindow>,
}

impl PoolsConfig {
    fn validate(&self) -> Result<(), SettingsError> {
        let invalid = |key: String, reason: String| Err(SettingsError::Invalid { key, reason });
        if let Err(reason) = time_zone(&self.time_zone) {
            return invalid("pools.time_zone".into(), reason);
        }
        if self.interval.is_zero() {
            return invalid("pools.interval".into(), "must be longer than zero".into());
        }
        if self.batch == 0 {
            return invalid("pools.batch".into(), "must be at least 1".into());
        }
        let mut seen = std::collections::HashSet::new();
        for (i, pool) in self.lessons.iter().enumerate() {
            if let Err((_, reason)) = check_pool(pool.size, &pool.windows) {
                return invalid(format!("pools.lessons[{i}]"), reason);
            }
            if !seen.insert((pool.lesson.as_str(), pool.stage)) {
                return invalid(
                    format!("pools.lessons[{i}]"),
                    format!(
                        "a second pool for lesson `{}` stage {}",
                        pool.lesson, pool.stage
                    ),
                );
            }
        }
        Ok(())
    }
}

/// The time zone named `name` (IANA, from the system's tzdb; `UTC` needs none).
pub fn time_zone(name: &str) -> Result<jiff::tz::TimeZone, String> {
    if name.eq_ignore_ascii_case("UTC") {
        return Ok(jiff::tz::TimeZone::UTC);
    }
    jiff::tz::TimeZone::get(name).map_err(|err| format!("`{name}` is not a known time zone: {err}"))
}

/// The bounds of a pool's sizes and windows (the configuration's and the admin API's): what is
/// wrong, as (`size` or `windows`, why).
pub fn check_pool(
    size: u32,
    windows: &[crate::model::PoolWindow],
) -> Result<(), (&'static str, String)> {
    if windows.len() > MAX_POOL_WINDOWS {
        return Err(("windows", format!("at most {MAX_POOL_WINDOWS} windows")));
    }
    if size > MAX_POOL_SIZE {
        return Err((
            "size",
            format!("size {size} is over the limit of {MAX_POOL_SIZE}"),
        ));
    }
    if let Some(w) = windows.iter().find(|w| w.size > MAX_POOL_SIZE) {
        return Err((
            "windows",
            format!("size {} is over the limit of {MAX_POOL_SIZE}", w.size),
        ));
    }
    if let Some(w) = windows.iter().find(|w| w.from == w.to || w.from >= 1440) {
        return Err((
            "windows",
            format!(
                "window {}-{} is empty or starts at 24:00",
                crate::model::clock_time::show(w.from),
                crate::model::clock_time::show(w.to)
            ),
        ));
    }
    Ok(())
}

/// The admin API: never on the learners' listeners, and every call needs a bearer token.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdminConfig {
    /// Where gRPC AdminService listens (with health and reflection); unset: not served. Port 0
    /// picks a free port (printed as `admin listening on ADDR`).
    pub listen: Option<SocketAddr>,
    /// Where its JSON routes (`/v1/admin/...`) and `/metrics` listen; unset: not served
    /// (printed as `admin http listening on ADDR`). `/metrics` there needs an `admin:read`
    /// token, as every admin call does.
    pub http_listen: Option<SocketAddr>,
    /// Where `/metrics` (and `/healthz`) also listen, without a token: for a scraper on a
    /// network only operators reach (printed as `metrics listening on ADDR`); unset: not
    /// served.
    pub metrics_listen: Option<SocketAddr>,
    /// Static bearer tokens: high-entropy secrets configured by their SHA-256 only.
    pub tokens: Vec<AdminToken>,
    /// OIDC JWTs from the operators' single sign-on, accepted beside the static tokens; unset:
    /// only static tokens.
    pub oidc: Option<OidcConfig>,
}

/// Which OIDC JWTs the admin API accepts: signed by a key of a JWKS file, from one issuer, for
/// one audience, carrying the admin scopes in a claim.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OidcConfig {
    /// The `iss` every token must carry: the identity provider's issuer URL, exactly.
    pub issuer: String,
    /// The `aud` every token must carry: the client id the provider issues tokens for.
    pub audience: String,
    /// The provider's public keys as a JWKS document (`{"keys": [...]}`), kept current by the
    /// operator (re-read when it changes, so keys rotate without a restart).
    pub jwks_file: PathBuf,
    /// The claim holding the scopes `admin:read` / `admin:write`: a space-separated string (as
    /// OAuth's `scope`) or an array of strings.
    pub scope_claim: String,
    /// The claim naming the caller, audited as `oidc:VALUE`.
    pub identity_claim: String,
}

impl Default for OidcConfig {
    fn default() -> Self {
        Self {
            issuer: String::new(),
            audience: String::new(),
            jwks_file: PathBuf::new(),
            scope_claim: "scope".into(),
            identity_claim: "sub".into(),
        }
    }
}

/// One static admin token.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminToken {
    /// Who holds it: audited as `token:NAME`.
    pub name: String,
    /// The SHA-256 of the token, 64 hex digits (`printf %s TOKEN | sha256sum`).
    pub sha256: String,
    /// What it may do.
    pub scopes: Vec<Scope>,
}

/// What an admin token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum Scope {
    /// List live lessons, sessions, agents, events and the audit log; Plan.
    #[serde(rename = "admin:read")]
    Read,
    /// Kill live lessons, make sessions persistent (implies read).
    #[serde(rename = "admin:write")]
    Write,
}

impl Scope {
    /// As configured and audited.
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Read => "admin:read",
            Scope::Write => "admin:write",
        }
    }
}

impl OidcConfig {
    /// Every field set, and a JWKS file that can be read now (its keys are read by the admin
    /// API, which names any it cannot use).
    fn validate(&self) -> Result<(), SettingsError> {
        let invalid = |key: &str, reason: String| {
            Err(SettingsError::Invalid {
                key: format!("admin.oidc.{key}"),
                reason,
            })
        };
        for (key, value) in [
            ("issuer", &self.issuer),
            ("audience", &self.audience),
            ("scope_claim", &self.scope_claim),
            ("identity_claim", &self.identity_claim),
        ] {
            if value.is_empty() {
                return invalid(key, "must be set".into());
            }
        }
        if self.jwks_file.as_os_str().is_empty() {
            return invalid(
                "jwks_file",
                "must be set: the provider's JWKS document".into(),
            );
        }
        let path = self.jwks_file.display();
        let text = match std::fs::read(&self.jwks_file) {
            Ok(text) => text,
            Err(err) => return invalid("jwks_file", format!("cannot read `{path}`: {err}")),
        };
        let keys = serde_json::from_slice::<serde_json::Value>(&text)
            .ok()
            .and_then(|jwks| jwks.get("keys").map(serde_json::Value::is_array));
        if keys != Some(true) {
            return invalid(
                "jwks_file",
                format!("`{path}` is not a JWKS document (a JSON object with a `keys` array)"),
            );
        }
        Ok(())
    }
}

/// The HTTP listener: the public API as JSON (`/v1/...`), watch as server-sent events, the
/// OpenAPI document (`/openapi.json`), `/metrics` and `/healthz`.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpConfig {
    /// Whether to serve it at all.
    pub enabled: bool,
    /// Where it listens; port 0 picks a free port (printed as `http listening on ADDR`).
    pub listen: SocketAddr,
    /// Origins (`https://labs.example.org`) whose pages may call the API from a browser. Empty:
    /// no CORS headers, so browsers allow only same-origin pages. `*` must be asked for
    /// explicitly.
    pub cors_origins: Vec<String>,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            cors_origins: Vec::new(),
        }
    }
}

/// Span export over OTLP.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetryConfig {
    /// The OTLP/gRPC collector (`http://127.0.0.1:4317`). Unset: `$OTEL_EXPORTER_OTLP_ENDPOINT`,
    /// and no export when that is unset too. Empty: no export.
    pub otlp_endpoint: Option<String>,
    /// The `service.name` of exported spans.
    pub service_name: Option<String>,
}

/// Idle expiry, counted from last activity.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TtlConfig {
    /// A live lesson idle this long is removed (unless its session is persistent).
    #[serde(with = "humantime_serde")]
    pub live_lesson: Duration,
    /// A session idle this long is removed with its live lessons (unless persistent).
    #[serde(with = "humantime_serde")]
    pub session: Duration,
}

impl Default for TtlConfig {
    fn default() -> Self {
        Self {
            live_lesson: Duration::from_secs(30 * 60),
            session: Duration::from_secs(24 * 3600),
        }
    }
}

/// Admission limits.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Live sessions one source address (an IPv6 /64) may hold; 0 for no limit.
    pub sessions_per_ip: u32,
    /// Live lessons one session may hold; 0 for no limit.
    pub live_lessons_per_session: u32,
    /// Open connections one client address (an IPv6 /64) may hold on each public listener;
    /// more are closed at once, so no one address can exhaust the server's sockets.
    pub connections_per_address: u32,
    /// Watch streams (gRPC or server-sent events) one session may hold open.
    pub watches_per_session: u32,
    /// Watch streams one client address may hold open, whatever its sessions.
    pub watches_per_address: u32,
    /// Concurrent HTTP/2 streams per connection.
    pub streams_per_connection: u32,
    /// Longest a unary call may run (streams are bounded by their own lifetime).
    #[serde(with = "humantime_serde")]
    pub request_timeout: Duration,
    /// Longest a client may take to send an HTTP request's headers (the slowloris guard).
    #[serde(with = "humantime_serde")]
    pub header_read_timeout: Duration,
    /// Stage checks (CheckStage) one live lesson may run per minute, besides one at a time;
    /// 0 for no limit. Each runs scripts on the lesson's endpoints, so a learner pressing
    /// "Check" in a loop must not keep an agent busy.
    pub checks_per_minute: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            sessions_per_ip: 10,
            live_lessons_per_session: 3,
            connections_per_address: 256,
            watches_per_session: 16,
            watches_per_address: 128,
            streams_per_connection: 256,
            request_timeout: Duration::from_secs(30),
            header_read_timeout: Duration::from_secs(10),
            checks_per_minute: 10,
        }
    }
}

/// The reaper's schedule.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReaperConfig {
    /// How often idle live lessons and sessions are looked for.
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// How often agents are listed for orphans.
    #[serde(with = "humantime_serde")]
    pub orphan_interval: Duration,
    /// How long an orphan (an object an agent lists that the store does not know) must be seen
    /// before it is removed; it covers lessons whose creation is still committing.
    #[serde(with = "humantime_serde")]
    pub orphan_grace: Duration,
    /// How long events of removed live lessons are kept.
    #[serde(with = "humantime_serde")]
    pub event_retention: Duration,
}

impl Default for ReaperConfig {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(15),
            orphan_interval: Duration::from_secs(60),
            orphan_grace: Duration::from_secs(5 * 60),
            event_retention: Duration::from_secs(7 * 24 * 3600),
        }
    }
}

/// The reconciler's pool, deadlines and retries.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReconcilerConfig {
    /// Workers driving agents concurrently; work on one live lesson is always serialised.
    pub workers: usize,
    /// Calls to one agent that workers may have in flight at once (Provision, Recover,
    /// Deprovision): a slow or black-holed agent holds at most this many workers, each for up
    /// to `call_timeout`, and the rest go on driving the other agents. Live lessons over it wait
    /// off the workers and are tried again after `backoff_initial`. Default: the default
    /// workers (no cap), since with one busy agent a cap costs throughput.
    pub calls_per_agent: usize,
    /// Deadline of each agent call.
    #[serde(with = "humantime_serde")]
    pub call_timeout: Duration,
    /// How long a generation may take to reach READY before it is FAILED.
    #[serde(with = "humantime_serde")]
    pub provision_timeout: Duration,
    /// How long removal may take before the store forgets the live lesson and leaves what is
    /// left to the orphan reaper.
    #[serde(with = "humantime_serde")]
    pub terminate_timeout: Duration,
    /// First retry delay after a retryable agent error; doubles up to `backoff_max`.
    #[serde(with = "humantime_serde")]
    pub backoff_initial: Duration,
    /// Longest retry delay.
    #[serde(with = "humantime_serde")]
    pub backoff_max: Duration,
    /// How often a waiting live lesson's agent is asked with Get (Watch is a speed-up, Get is the
    /// truth): at first; over a Watch stream the interval then doubles up to 16 times this.
    #[serde(with = "humantime_serde")]
    pub poll_interval: Duration,
    /// How long an agent may be unreachable (not ready) before it is LOST: its live lessons are
    /// then moved to other agents (READY ones re-provisioned at their stage), or FAILED when
    /// none fits.
    #[serde(with = "humantime_serde")]
    pub agent_grace: Duration,
}

impl Default for ReconcilerConfig {
    fn default() -> Self {
        Self {
            workers: 64,
            calls_per_agent: 64,
            call_timeout: Duration::from_secs(30),
            provision_timeout: Duration::from_secs(15 * 60),
            terminate_timeout: Duration::from_secs(5 * 60),
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(10),
            poll_interval: Duration::from_secs(2),
            agent_grace: Duration::from_secs(60),
        }
    }
}

/// Work shared by replicas. Leases are only taken on PostgreSQL; the resync runs on both
/// backends.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReplicasConfig {
    /// How long a replica's lease (on a live lesson's work, or on the reaper's duties) lasts
    /// unless renewed; renewed every third of it. A replica that dies has its work taken over
    /// within about this long (plus `resync_interval`). Replicas' clocks must agree to well
    /// within it.
    #[serde(with = "humantime_serde")]
    pub lease_ttl: Duration,
    /// How often the store is searched for unsettled live lessons that no worker has: not in
    /// this process's queue and, on PostgreSQL, leased by no live replica.
    #[serde(with = "humantime_serde")]
    pub resync_interval: Duration,
}

impl Default for ReplicasConfig {
    fn default() -> Self {
        Self {
            lease_ttl: Duration::from_secs(15),
            resync_interval: Duration::from_secs(10),
        }
    }
}

/// The agent intake: a TLS listener where agents dial in (`--connect https://HOST:PORT`),
/// each named by its client certificate (its first `spiffe://` URI SAN, else its first DNS SAN).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgentIntakeConfig {
    /// Where it listens; unset: no agent can dial in. Port 0 picks a free port (printed as
    /// `agent intake listening on ADDR`).
    pub listen: Option<SocketAddr>,
    /// The scheduler's server certificate chain (PEM, leaf first), which agents verify; re-read
    /// when it changes.
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
    /// The CA certificates (PEM) that sign agents' client certificates: every other
    /// certificate is refused in the handshake.
    pub client_ca: PathBuf,
    /// Agents expected to dial in, by certificate name: listed (CONNECTING) before they first
    /// do, and admitted.
    pub agents: Vec<String>,
    /// Certificate names admitted besides `agents`, where `*` stands for one DNS label or one
    /// URI path segment: `["*.agents.example", "spiffe://example.org/agent/*"]`. Empty: only
    /// `agents`.
    pub allow: Vec<String>,
}

impl AgentIntakeConfig {
    /// With `listen` set, the three files are required; names and patterns must be DNS names or
    /// `spiffe://` URIs, and no name may be that of an agent the scheduler dials.
    fn validate(&self, dialled: &[AgentConfig]) -> Result<(), SettingsError> {
        let invalid = |key: String, reason: String| Err(SettingsError::Invalid { key, reason });
        if self.listen.is_none() {
            if !self.agents.is_empty() || !self.allow.is_empty() {
                return invalid(
                    "agent_intake.listen".into(),
                    "must be set when agent_intake.agents or agent_intake.allow is".into(),
                );
            }
            return Ok(());
        }
        for (key, path) in [
            ("cert", &self.cert),
            ("key", &self.key),
            ("client_ca", &self.client_ca),
        ] {
            if path.as_os_str().is_empty() {
                return invalid(
                    format!("agent_intake.{key}"),
                    "must be set: agents dial in over mutual TLS only".into(),
                );
            }
        }
        for (key, names) in [("agents", &self.agents), ("allow", &self.allow)] {
            for (i, name) in names.iter().enumerate() {
                // A pattern's `*` stands for a label: check the name it would be with one.
                let example = name.replace('*', "x");
                let valid = if let Some(rest) = example.strip_prefix("spiffe://") {
                    !rest.is_empty() && !rest.contains(char::is_whitespace)
                } else {
                    !example.contains("://")
                        && example.split('.').all(|label| {
                            !label.is_empty()
                                && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
                        })
                };
                if !valid {
                    return invalid(
                        format!("agent_intake.{key}[{i}]"),
                        format!("`{name}` is neither a DNS name nor a spiffe:// URI"),
                    );
                }
                if key == "agents" && dialled.iter().any(|agent| &agent.name == name) {
                    return invalid(
                        format!("agent_intake.{key}[{i}]"),
                        format!("`{name}` is also an agent to dial ([[agents]])"),
                    );
                }
            }
        }
        Ok(())
    }
}

/// One agent to dial.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentConfig {
    /// A name for logs, the API and the store.
    pub name: String,
    /// Its gRPC address, e.g. `http://127.0.0.1:7071`.
    pub address: String,
    /// Labels placement matches, merged over those the agent reports in its handshake (these
    /// win): `labels = { region = "eu" }`.
    pub labels: std::collections::BTreeMap<String, String>,
    /// mTLS to it (with an `https://` address); `None`: plaintext (loopback or a mesh).
    pub tls: Option<AgentTlsConfig>,
}

/// mTLS to one agent: the client certificate the scheduler presents and what the agent's
/// certificate must be. All files are re-read when they change (rotation without restart).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentTlsConfig {
    /// The CA certificates (PEM) that sign the agent's server certificate.
    pub ca: PathBuf,
    /// The scheduler's client certificate chain (PEM, leaf first), presented to the agent.
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
    /// The identity the agent's certificate must carry: a DNS name or a `spiffe://` URI.
    /// Unset: the host of the agent's address.
    #[serde(default)]
    pub server_name: Option<String>,
}

impl<'de> Deserialize<'de> for AgentConfig {
    /// Accepts a table `{ name, address }` or the string `name=address` (handy in environment
    /// variables).
    fn deserialize<D: serde::Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Text(String),
            Table {
                name: String,
                address: String,
                #[serde(default)]
                labels: std::collections::BTreeMap<String, String>,
                #[serde(default)]
                tls: Option<AgentTlsConfig>,
            },
        }
        match Raw::deserialize(de)? {
            Raw::Table {
                name,
                address,
                labels,
                tls,
            } => Ok(AgentConfig {
                name,
                address,
                labels,
                tls,
            }),
            Raw::Text(text) => match text.split_once('=') {
                Some((name, address)) => Ok(AgentConfig {
                    name: name.trim().to_owned(),
                    address: address.trim().to_owned(),
                    labels: Default::default(),
                    tls: None,
                }),
                None => Err(serde::de::Error::custom(format!(
                    "agent `{text}` should be `name=address`"
                ))),
            },
        }
    }
}

/// A configuration problem, naming the key.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    /// The file or environment could not be read or parsed.
    #[error("configuration: {0}")]
    Load(#[from] config::ConfigError),
    /// A value parsed but makes no sense.
    #[error("configuration key `{key}`: {reason}")]
    Invalid {
        /// The key.
        key: String,
        /// What is wrong.
        reason: String,
    },
}

impl Config {
    /// Loads defaults, then `file` (TOML or YAML by extension) if given, then `ANTIDOTE_*`
    /// environment variables, and validates the result.
    pub fn load(file: Option<&Path>) -> Result<Config, SettingsError> {
        Self::load_with_env(file, std::env::vars())
    }

    /// [`Config::load`] with the given environment. Variables of our prefix that belong to
    /// other programs ([`NOT_OURS`]: the agents', antidotectl's) are left out, so one shell can
    /// configure all of them; any other unknown `ANTIDOTE_*` key is an error naming it.
    pub fn load_with_env(
        file: Option<&Path>,
        env: impl Iterator<Item = (String, String)>,
    ) -> Result<Config, SettingsError> {
        let env = env
            .filter(|(key, _)| !NOT_OURS.iter().any(|other| key.starts_with(other)))
            .collect();
        let mut builder = config::Config::builder();
        if let Some(file) = file {
            builder = builder.add_source(config::File::from(file).required(true));
        }
        builder = builder.add_source(
            config::Environment::with_prefix("ANTIDOTE")
                .source(Some(env))
                .prefix_separator("_")
                .separator("__")
                .list_separator(",")
                .with_list_parse_key("agents")
                .try_parsing(true),
        );
        let config: Config = builder.build()?.try_deserialize()?;
        config.validate()?;
        Ok(config)
    }

    /// Checks what types alone cannot.
    pub fn validate(&self) -> Result<(), SettingsError> {
        let invalid = |key: &str, reason: &str| {
            Err(SettingsError::Invalid {
                key: key.into(),
                reason: reason.into(),
            })
        };
        if self.instance_id.is_empty()
            || !self
                .instance_id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-')
            || self.instance_id.len() > 40
        {
            return invalid(
                "instance_id",
                "must be 1-40 characters of letters, digits and dashes (it becomes a label)",
            );
        }
        let admin_served = self.admin.listen.is_some() || self.admin.http_listen.is_some();
        if admin_served && self.admin.tokens.is_empty() && self.admin.oidc.is_none() {
            return invalid(
                "admin.tokens",
                "the admin API is served (admin.listen or admin.http_listen) but no token can call it (set admin.tokens or admin.oidc)",
            );
        }
        if let Some(oidc) = &self.admin.oidc {
            oidc.validate()?;
        }
        for (i, token) in self.admin.tokens.iter().enumerate() {
            if token.sha256.len() != 64 || !token.sha256.chars().all(|c| c.is_ascii_hexdigit()) {
                return Err(SettingsError::Invalid {
                    key: format!("admin.tokens[{i}].sha256"),
                    reason: "must be the token's SHA-256 as 64 hex digits".into(),
                });
            }
            if token.name.is_empty() || token.scopes.is_empty() {
                return Err(SettingsError::Invalid {
                    key: format!("admin.tokens[{i}]"),
                    reason: "needs a name and at least one scope (admin:read, admin:write)".into(),
                });
            }
        }
        for (key, value) in [
            (
                "limits.connections_per_address",
                self.limits.connections_per_address,
            ),
            (
                "limits.watches_per_session",
                self.limits.watches_per_session,
            ),
            (
                "limits.watches_per_address",
                self.limits.watches_per_address,
            ),
            (
                "limits.streams_per_connection",
                self.limits.streams_per_connection,
            ),
        ] {
            if value == 0 {
                return invalid(key, "must be at least 1: every limit is bounded");
            }
        }
        for (key, value) in [
            ("limits.request_timeout", self.limits.request_timeout),
            (
                "limits.header_read_timeout",
                self.limits.header_read_timeout,
            ),
            ("ttl.live_lesson", self.ttl.live_lesson),
            ("ttl.session", self.ttl.session),
            ("reaper.interval", self.reaper.interval),
            ("reaper.orphan_interval", self.reaper.orphan_interval),
            ("reconciler.call_timeout", self.reconciler.call_timeout),
            (
                "reconciler.provision_timeout",
                self.reconciler.provision_timeout,
            ),
            (
                "reconciler.terminate_timeout",
                self.reconciler.terminate_timeout,
            ),
            (
                "reconciler.backoff_initial",
                self.reconciler.backoff_initial,
            ),
            ("reconciler.backoff_max", self.reconciler.backoff_max),
            ("reconciler.poll_interval", self.reconciler.poll_interval),
            ("reconciler.agent_grace", self.reconciler.agent_grace),
            ("replicas.lease_ttl", self.replicas.lease_ttl),
            ("replicas.resync_interval", self.replicas.resync_interval),
        ] {
            if value.is_zero() {
                return invalid(key, "must be longer than zero");
            }
        }
        self.pools.validate()?;
        if self.reconciler.workers == 0 {
            return invalid("reconciler.workers", "must be at least 1");
        }
        if !(1..=4096).contains(&self.reconciler.calls_per_agent) {
            return invalid("reconciler.calls_per_agent", "must be between 1 and 4096");
        }
        if self.reconciler.backoff_max < self.reconciler.backoff_initial {
            return invalid(
                "reconciler.backoff_max",
                "must not be shorter than reconciler.backoff_initial",
            );
        }
        for (i, origin) in self.http.cors_origins.iter().enumerate() {
            let valid = origin == "*"
                || ((origin.starts_with("http://") || origin.starts_with("https://"))
                    && !origin.ends_with('/')
                    && origin.parse::<tonic::transport::Uri>().is_ok_and(|uri| {
                        uri.host().is_some() && uri.path_and_query().is_none_or(|p| p == "/")
                    }));
            if !valid {
                return invalid(
                    &format!("http.cors_origins[{i}]"),
                    &format!(
                        "`{origin}` is not an origin: scheme://host[:port], no path or trailing slash (or `*`)"
                    ),
                );
            }
        }
        self.agent_intake.validate(&self.agents)?;
        let ids: Vec<&str> = self.entrypoint.keys.iter().map(|k| k.id.as_str()).collect();
        for (i, id) in ids.iter().enumerate() {
            if id.is_empty() || ids[..i].contains(id) {
                return invalid(
                    &format!("entrypoint.keys[{i}].id"),
                    "must be set and unique",
                );
            }
        }
        if let Some(current) = &self.entrypoint.current
            && !ids.contains(&current.as_str())
        {
            return invalid(
                "entrypoint.current",
                &format!("`{current}` is not the id of a key in entrypoint.keys"),
            );
        }
        if let Some(id) = self
            .entrypoint
            .revoked
            .iter()
            .find(|id| ids.contains(&id.as_str()))
        {
            return invalid(
                "entrypoint.revoked",
                &format!("`{id}` is revoked but still in entrypoint.keys: remove it from keys"),
            );
        }
        for (agent, url) in &self.entrypoint.urls {
            if let Err(err) = antidote_net::entrypoint::Template::parse(url) {
                return invalid(&format!("entrypoint.urls.{agent}"), &err);
            }
        }
        if self.entrypoint.token_ttl < Duration::from_secs(10) {
            return invalid("entrypoint.token_ttl", "must be at least 10s");
        }
        // Entrypoints refuse a token that lives longer than their bound (the SDK's
        // `--entrypoint-max-token-lifetime`, 24h by default): half of it leaves room.
        if self.entrypoint.token_ttl > antidote_net::entrypoint::token::MAX_LIFETIME / 2 {
            return invalid(
                "entrypoint.token_ttl",
                "must be at most 12h: agents' entrypoints refuse tokens that live longer than \
                 --entrypoint-max-token-lifetime (24h by default)",
            );
        }
        if let Some(endpoint) = &self.telemetry.otlp_endpoint
            && !endpoint.is_empty()
            && !(endpoint.starts_with("http://") || endpoint.starts_with("https://"))
        {
            return invalid(
                "telemetry.otlp_endpoint",
                &format!("`{endpoint}` must start with http:// or https://"),
            );
        }
        let mut names = std::collections::HashSet::new();
        for (i, agent) in self.agents.iter().enumerate() {
            if agent.name.is_empty() || !names.insert(agent.name.as_str()) {
                return invalid(
                    &format!("agents[{i}].name"),
                    &format!("`{}` is empty or used twice", agent.name),
                );
            }
            if let Err(err) = agent.address.parse::<tonic::transport::Uri>() {
                return invalid(
                    &format!("agents[{i}].address"),
                    &format!("`{}` is not a URI: {err}", agent.address),
                );
            }
            if let Some((key, value)) = agent
                .labels
                .iter()
                .find(|(key, value)| key.is_empty() || value.is_empty())
            {
                return invalid(
                    &format!("agents[{i}].labels"),
                    &format!("`{key}` = `{value}`: label keys and values must not be empty"),
                );
            }
            if !(agent.address.starts_with("http://") || agent.address.starts_with("https://")) {
                return invalid(
                    &format!("agents[{i}].address"),
                    &format!("`{}` must start with http:// or https://", agent.address),
                );
            }
            let https = agent.address.starts_with("https://");
            match &agent.tls {
                None if https => {
                    return invalid(
                        &format!("agents[{i}].tls"),
                        "an https:// address needs tls.ca, tls.cert and tls.key (mTLS)",
                    );
                }
                Some(_) if !https => {
                    return invalid(
                        &format!("agents[{i}].address"),
                        &format!(
                            "`{}` must start with https:// when tls is set",
                            agent.address
                        ),
                    );
                }
                Some(tls) => {
                    if let Some(name) = &tls.server_name
                        && let Err(err) = antidote_net::tls::Identity::parse(name)
                    {
                        return invalid(&format!("agents[{i}].tls.server_name"), &err.to_string());
                    }
                }
                None => {}
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load_toml(text: &str) -> Result<Config, SettingsError> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("antidote.toml");
        std::fs::write(&path, text).unwrap();
        Config::load(Some(&path))
    }

    #[test]
    fn file_overrides_defaults() {
        let config = load_toml(
            r#"
            listen = "127.0.0.1:0"
            tier = "local"
            [ttl]
            live_lesson = "90s"
            [[agents]]
            name = "docker"
            address = "http://127.0.0.1:7071"
            "#,
        )
        .unwrap();
        assert_eq!(config.ttl.live_lesson, Duration::from_secs(90));
        assert_eq!(config.ttl.session, Duration::from_secs(24 * 3600));
        assert_eq!(config.tier, Tier::Local);
        assert_eq!(config.agents[0].name, "docker");
    }

    #[test]
    fn bad_values_name_their_key() {
        let err = load_toml("[ttl]\nlive_lesson = \"soon\"\n").unwrap_err();
        assert!(err.to_string().contains("ttl.live_lesson"), "{err}");
        let err = load_toml("[limits]\nsessions_per_ip = -1\n").unwrap_err();
        assert!(err.to_string().contains("sessions_per_ip"), "{err}");
        let err = load_toml("[reconciler]\nworkers = 0\n").unwrap_err();
        assert!(err.to_string().contains("reconciler.workers"), "{err}");
        let err = load_toml("[reconciler]\ncalls_per_agent = 0\n").unwrap_err();
        assert!(
            err.to_string().contains("reconciler.calls_per_agent"),
            "{err}"
        );
        let err = load_toml("agents = [\"nameonly\"]\n").unwrap_err();
        assert!(err.to_string().contains("name=address"), "{err}");
        let err = load_toml("agents = [\"a=ftp://x\"]\n").unwrap_err();
        assert!(err.to_string().contains("agents[0].address"), "{err}");
        let err = load_toml("colour = \"blue\"\n").unwrap_err();
        assert!(err.to_string().contains("colour"), "{err}");
        for origin in [
            "labs.example.org",
            "https://labs.example.org/",
            "https://x.org/app",
        ] {
            let err = load_toml(&format!("[http]\ncors_origins = [\"{origin}\"]\n")).unwrap_err();
            assert!(err.to_string().contains("http.cors_origins[0]"), "{err}");
        }
        let err = load_toml("[telemetry]\notlp_endpoint = \"127.0.0.1:4317\"\n").unwrap_err();
        assert!(err.to_string().contains("telemetry.otlp_endpoint"), "{err}");
        // A revoked key must leave the key set (else it would still sign and be offered).
        let err = load_toml(
            "[entrypoint]\nkeys = [{ id = \"k1\", file = \"k1.pem\" }]\nrevoked = [\"k1\"]\n",
        )
        .unwrap_err();
        assert!(err.to_string().contains("entrypoint.revoked"), "{err}");
        assert!(err.to_string().contains("`k1`"), "{err}");
        // Entrypoint URLs are checked as agents check theirs.
        let err =
            load_toml("[entrypoint]\nurls = { docker = \"http://lab-{live_lesson}.example\" }\n")
                .unwrap_err();
        assert!(err.to_string().contains("entrypoint.urls.docker"), "{err}");
        assert!(err.to_string().contains("first label"), "{err}");
        assert!(
            load_toml(
                "[entrypoint]\nurls = { docker = \"http://{live_lesson}.localhost:7074\" }\n"
            )
            .is_ok()
        );
    }

    #[test]
    fn other_programs_variables_are_not_ours_but_typos_are_errors() {
        let env = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<Vec<_>>()
                .into_iter()
        };
        let config = Config::load_with_env(
            None,
            env(&[
                ("ANTIDOTE_DOCKER_TRUSTED_PRIVILEGED", "false"),
                ("ANTIDOTE_K8S_LISTEN", "0.0.0.0:7072"),
                ("ANTIDOTE_SERVER", "http://127.0.0.1:7070"),
                ("ANTIDOTE_AGENT_TLS_CERT", "/etc/antidote/tls/tls.crt"),
                ("ANTIDOTE_AGENT_INSECURE_PLAINTEXT", "true"),
                ("ANTIDOTE_AGENT_CONNECT", "https://scheduler:7443"),
                ("ANTIDOTE_TTL__LIVE_LESSON", "10m"),
            ]),
        )
        .unwrap();
        assert_eq!(config.ttl.live_lesson, Duration::from_secs(600));
        let err =
            Config::load_with_env(None, env(&[("ANTIDOTE_TTL__LIVE_LESON", "10m")])).unwrap_err();
        assert!(err.to_string().contains("live_leson"), "{err}");
    }

    #[test]
    fn http_defaults_are_closed() {
        let config = load_toml("").unwrap();
        assert!(config.http.cors_origins.is_empty(), "no CORS unless asked");
        assert!(config.http.enabled);
        let config = load_toml(
            "[http]\nenabled = false\ncors_origins = [\"https://labs.example.org\", \"http://127.0.0.1:3000\"]\n",
        )
        .unwrap();
        assert!(!config.http.enabled);
        assert_eq!(config.http.cors_origins.len(), 2);
    }

    #[test]
    fn admin_oidc_needs_issuer_audience_and_a_readable_jwks() {
        let dir = tempfile::tempdir().unwrap();
        let jwks = dir.path().join("jwks.json");
        std::fs::write(&jwks, r#"{"keys": []}"#).unwrap();
        let config = |oidc: &str| {
            format!(
                "admin.listen = \"127.0.0.1:0\"\n[admin.oidc]\n{}\n",
                oidc.replace("JWKS", &jwks.display().to_string())
            )
        };
        // With OIDC, no static token is needed; the claims have defaults.
        let loaded = load_toml(&config(
            "issuer = \"https://sso.example.org\"\naudience = \"antidote\"\njwks_file = \"JWKS\"",
        ))
        .unwrap();
        let oidc = loaded.admin.oidc.unwrap();
        assert!(loaded.admin.tokens.is_empty());
        assert_eq!(
            (oidc.scope_claim.as_str(), oidc.identity_claim.as_str()),
            ("scope", "sub")
        );
        for (oidc, key) in [
            (
                "audience = \"a\"\njwks_file = \"JWKS\"",
                "admin.oidc.issuer",
            ),
            (
                "issuer = \"i\"\njwks_file = \"JWKS\"",
                "admin.oidc.audience",
            ),
            ("issuer = \"i\"\naudience = \"a\"", "admin.oidc.jwks_file"),
            (
                "issuer = \"i\"\naudience = \"a\"\njwks_file = \"/nonexistent/jwks.json\"",
                "admin.oidc.jwks_file",
            ),
            (
                "issuer = \"i\"\naudience = \"a\"\njwks_file = \"JWKS\"\nscope = \"x\"",
                "scope",
            ),
        ] {
            let err = load_toml(&config(oidc)).unwrap_err();
            assert!(err.to_string().contains(key), "{oidc}: {err}");
        }
        std::fs::write(&jwks, "not json").unwrap();
        let err = load_toml(&config(
            "issuer = \"i\"\naudience = \"a\"\njwks_file = \"JWKS\"",
        ))
        .unwrap_err();
        assert!(err.to_string().contains("not a JWKS document"), "{err}");
        // Without OIDC, a served admin API still needs a static token.
        let err = load_toml("admin.listen = \"127.0.0.1:0\"\n").unwrap_err();
        assert!(err.to_string().contains("admin.tokens"), "{err}");
    }

    #[test]
    fn agents_carry_labels_and_a_grace() {
        let config = load_toml(
            "[reconciler]\nagent_grace = \"5s\"\n[[agents]]\nname = \"a\"\naddress = \"http://127.0.0.1:1\"\nlabels = { region = \"eu\" }\n",
        )
        .unwrap();
        assert_eq!(config.agents[0].labels["region"], "eu");
        assert_eq!(config.reconciler.agent_grace, Duration::from_secs(5));
        assert_eq!(
            load_toml("").unwrap().reconciler.agent_grace,
            Duration::from_secs(60)
        );
        let err = load_toml(
            "[[agents]]\nname = \"a\"\naddress = \"http://127.0.0.1:1\"\nlabels = { region = \"\" }\n",
        )
        .unwrap_err();
        assert!(err.to_string().contains("agents[0].labels"), "{err}");
        let err = load_toml("[reconciler]\nagent_grace = \"0s\"\n").unwrap_err();
        assert!(err.to_string().contains("reconciler.agent_grace"), "{err}");
    }

    #[test]
    fn pools_are_bounded_and_name_what_is_wrong() {
        let config = load_toml(
            "[pools]\ntime_zone = \"Europe/Paris\"\n[[pools.lessons]]\nlesson = \"a\"\nsize = 3\n\
             windows = [{ from = \"08:45\", to = \"10:00\", size = 30 }]\n",
        )
        .unwrap();
        let pool = &config.pools.lessons[0];
        assert_eq!((pool.stage, pool.size, pool.windows[0].size), (0, 3, 30));
        assert_eq!(pool.windows[0].from, 8 * 60 + 45);
        assert_eq!(load_toml("").unwrap().pools.time_zone, "UTC");
        for (text, key, detail) in [
            (
                "[pools]\ntime_zone = \"Mars/Olympus\"\n",
                "pools.time_zone",
                "Mars/Olympus",
            ),
            (
                "[[pools.lessons]]\nlesson = \"a\"\nsize = 1001\n",
                "pools.lessons[0]",
                "1001",
            ),
            (
                "[[pools.lessons]]\nlesson = \"a\"\n[[pools.lessons]]\nlesson = \"a\"\n",
                "pools.lessons[1]",
                "a second pool",
            ),
            (
                "[[pools.lessons]]\nlesson = \"a\"\nwindows = [{ from = \"10:00\", to = \"10:00\", size = 1 }]\n",
                "pools.lessons[0]",
                "empty",
            ),
            ("[pools]\nbatch = 0\n", "pools.batch", "at least 1"),
        ] {
            let err = load_toml(text).unwrap_err().to_string();
            assert!(err.contains(key) && err.contains(detail), "{text}: {err}");
        }
        let err = load_toml(
            "[[pools.lessons]]\nlesson = \"a\"\nwindows = [{ from = \"9:00\", to = \"10:00\", size = 1 }]\n",
        )
        .unwrap_err();
        assert!(err.to_string().contains("9:00"), "{err}");
    }

    #[test]
    fn agents_as_strings() {
        let config =
            load_toml("agents = [\"a=http://127.0.0.1:1\", \"b=http://127.0.0.1:2\"]\n").unwrap();
        assert_eq!(config.agents[1].address, "http://127.0.0.1:2");
    }
}
