//! The Rust agent SDK: write what your backend does, get the protocol right for free.
//!
//! An agent implements [`Backend`]: it describes itself, realises one generation of a live
//! lesson (create or find its objects, configure the stage, probe readiness), removes a live
//! lesson, and finds live lessons in its backend by label. [`Agent`] wraps it and answers every
//! `antidote.agent.v1` RPC by the rules of `proto/PROTOCOL.md`:
//!
//! - `Handshake`: highest common major version (FAILED_PRECONDITION naming both lists when there
//!   is none), a new instance id per process, capabilities, capacity.
//! - `Provision`: spec checks that name the field, idempotency on id + generation (same spec →
//!   current state, another spec → ALREADY_EXISTS, older → FAILED_PRECONDITION), capacity
//!   (RESOURCE_EXHAUSTED), adoption of objects found by label after a restart, one driver task
//!   per live lesson (a newer generation replaces it), READY/FAILED recorded conditionally on
//!   the generation.
//! - `Deprovision` (unknown id → OK), `Get` (NOT_FOUND), `List` (the backend's objects merged
//!   in), `Watch` (snapshot, changes, heartbeats, resync), `Recover`, `Plan`.
//!
//! [`serve`] adds `grpc.health.v1`, server reflection, TCP_NODELAY, a span per call carrying the
//! caller's W3C trace context, and graceful shutdown (Watch streams end, health turns
//! NOT_SERVING).
//!
//! Modules: [`book`] (the state book behind Get/List/Watch), [`errors`] (typed errors: ErrorInfo
//! details, reasons, the oversized-request layer), [`spec`] (generic spec checks and states), [`probe`] (readiness probes), [`trace`] (logging, OTLP span export, W3C trace
//! context), [`b3`] (Zipkin B3 trace context accepted from meshes), [`metrics`] (Prometheus `/metrics`), `agent` (the trait and the runtime), `server`
//! (serving, plaintext or mTLS: [`Listener`]), [`tls`] (mTLS with certificates re-read when
//! rotated, and the agents' `--tls-*` flags), [`dial`] (dial-in: the agent opens the connection, the scheduler calls over it), [`entrypoint`] (learners' way in: proxied HTTP presentations, web terminals, scheduler-signed tokens).

mod agent;
pub mod b3;
pub mod book;
pub mod dial;
pub mod entrypoint;
pub mod errors;
pub mod metrics;
pub mod output;
pub mod probe;
mod server;
pub mod spec;
pub mod tls;
pub mod trace;

pub use agent::{Agent, AgentService, Backend, Description, Report, Start};
pub use book::{MAX_HEARTBEAT, MAX_PAGE, StateBook, WatchStream, matches};
pub use server::{
    BodyDeadline, BodyTimedOut, Cuttable, GRACE, Listener, Transport, run, run_with_grace, serve,
    serve_with_grace, shutdown_signal,
};

/// Label names the scheduler puts in `LessonSpec.labels` (see PROTOCOL.md, "Labels").
pub mod labels {
    /// The scheduler's instance id.
    pub const INSTANCE: &str = "antidote.io/instance";
    /// The live lesson id.
    pub const LIVE_LESSON: &str = "antidote.io/live-lesson";
    /// The session id.
    pub const SESSION: &str = "antidote.io/session";
    /// The generation that created an object.
    pub const GENERATION: &str = "antidote.io/generation";
    /// The lesson slug.
    pub const LESSON: &str = "antidote.io/lesson";
    /// The scheduler deployment's cluster id (created in its database, shared by its
    /// replicas). Not in [`REQUIRED`]: schedulers before it did not send it, and objects
    /// without it are never reaped (PROTOCOL.md, "Labels").
    pub const CLUSTER: &str = "antidote.io/cluster";
    /// `true` on the objects of a live lesson created as a warm-pool member. Its
    /// [`SESSION`] is the pool session it was created in, for life, even after a learner's
    /// session claimed it: objects are never relabelled, the scheduler keeps the owner
    /// (PROTOCOL.md, "Labels"). Not in [`REQUIRED`].
    pub const POOL: &str = "antidote.io/pool";
    /// Every label a spec must carry.
    pub const REQUIRED: [&str; 5] = [INSTANCE, LIVE_LESSON, SESSION, GENERATION, LESSON];
}

/// Capability names (see `HandshakeResponse.capabilities`).
pub mod capabilities {
    /// SSH presentations can be exposed and probed.
    pub const PRESENTATION_SSH: &str = "presentation.ssh";
    /// HTTP presentations can be exposed and probed.
    pub const PRESENTATION_HTTP: &str = "presentation.http";
    /// Per-stage configuration runs.
    pub const STAGE_CONFIGURATION: &str = "stage.configuration";
    /// Live lessons cannot reach each other.
    pub const NETWORK_ISOLATION: &str = "network.isolation";
    /// `Plan` is implemented.
    pub const PLAN: &str = "plan";
    /// `Watch` is implemented.
    pub const WATCH: &str = "watch";
    /// `Watch` sends snapshots in pages when asked (`WatchRequest.snapshot_page_bytes`,
    /// PROTOCOL.md [W8]). The SDK offers it with `watch`.
    pub const WATCH_PAGES: &str = "watch.pages";
    /// `Recover` is implemented.
    pub const RECOVER: &str = "recover";
    /// What the capabilities of configuration types start with (`configuration.shell`, ...):
    /// an agent offering `stage.configuration` lists the types it runs; none listed means
    /// shell alone (PROTOCOL.md [V5]).
    pub const CONFIGURATION_PREFIX: &str = "configuration.";
    /// Shell configurations run.
    pub const CONFIGURATION_SHELL: &str = "configuration.shell";
    /// Python configurations run.
    pub const CONFIGURATION_PYTHON: &str = "configuration.python";
    /// Ansible playbooks run.
    pub const CONFIGURATION_ANSIBLE: &str = "configuration.ansible";
    /// NAPALM configurations run.
    pub const CONFIGURATION_NAPALM: &str = "configuration.napalm";
    /// Jupyter guide endpoints run (`Endpoint.jupyter_guide`, PROTOCOL.md [V7]).
    pub const GUIDE_JUPYTER: &str = "guide.jupyter";

    /// The capability of a configuration type: `configuration.` and the value's name in lower
    /// case.
    pub fn configuration(kind: crate::agent::v1::ConfigurationType) -> String {
        let name = kind.as_str_name();
        let name = name.strip_prefix("CONFIGURATION_TYPE_").unwrap_or(name);
        format!("{CONFIGURATION_PREFIX}{}", name.to_ascii_lowercase())
    }
}
