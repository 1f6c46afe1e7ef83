//! Antidote's wire protocols, generated from the `.proto` files beside this crate.
//!
//! - [`api::v1`]: the public API served by the scheduler (`antidote.api.v1`).
//! - [`agent::v1`]: the protocol between the scheduler and backend agents (`antidote.agent.v1`).
//! - [`FILE_DESCRIPTOR_SET`], every file's descriptor, for gRPC server reflection.
//! - [`labels`], [`capabilities`] and [`limits`]: the names and bounds PROTOCOL.md defines
//!   beside the messages, which every side of the protocol needs.
//!
//! Nothing else: no SDK, no networking (those are `antidote-sdk` and `antidote-net`), so a
//! crate that only speaks the protocol depends on prost and tonic alone. Generated types stay
//! at the edges of the other crates: each converts them to its own domain types in one module.
#![forbid(unsafe_code)]

/// The public API.
pub mod api {
    /// Major version 1.
    pub mod v1 {
        #![allow(missing_docs, clippy::all)]
        tonic::include_proto!("antidote.api.v1");
    }
}

/// The agent protocol.
pub mod agent {
    /// Major version 1.
    pub mod v1 {
        #![allow(missing_docs, clippy::all)]
        tonic::include_proto!("antidote.agent.v1");

        /// The gRPC service name agents register with `grpc.health.v1`.
        pub const SERVICE_NAME: &str = "antidote.agent.v1.Backend";
        /// The major version this module speaks.
        pub const MAJOR: u32 = 1;
    }
}

/// The encoded `FileDescriptorSet` of every Antidote proto file, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/antidote_descriptor.bin"));

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

/// The protocol's capability names: what an agent offers in `HandshakeResponse.capabilities`
/// (not Linux capabilities).
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
    /// `RunChecks` is implemented: a stage's check and solution files run on a READY live
    /// lesson (PROTOCOL.md, "Checks").
    pub const CHECKS: &str = "checks";

    /// The capability of a configuration type: `configuration.` and the value's name in lower
    /// case.
    pub fn configuration(kind: crate::agent::v1::ConfigurationType) -> String {
        let name = kind.as_str_name();
        let name = name.strip_prefix("CONFIGURATION_TYPE_").unwrap_or(name);
        format!("{CONFIGURATION_PREFIX}{}", name.to_ascii_lowercase())
    }
}

/// Bounds on what a spec may carry: agents refuse more (the SDK's spec check), and the
/// scheduler refuses a catalog that would need more.
pub mod limits {
    /// The most bytes one configuration file may hold (PROTOCOL.md [S2]): agents write it to a file
    /// (agent-k8s: a ConfigMap key).
    pub const MAX_CONFIGURATION_FILE: usize = 256 * 1024;

    /// The most bytes the configuration files of one stage may hold together: one ConfigMap holds
    /// them all on agent-k8s, and Kubernetes caps a ConfigMap at 1 MiB.
    pub const MAX_CONFIGURATION_STAGE: usize = 1024 * 1024;

    /// The most bytes a Jupyter guide's notebook may hold (PROTOCOL.md [V7]): agent-k8s keeps it in
    /// a ConfigMap, and a spec must stay well inside a gRPC message.
    pub const MAX_NOTEBOOK: usize = 512 * 1024;

    /// The most bytes of a check's output an agent answers (`CheckResult.output`, its tail):
    /// what a learner reads as feedback (PROTOCOL.md [X3]).
    pub const MAX_CHECK_OUTPUT: usize = 16 * 1024;
}
