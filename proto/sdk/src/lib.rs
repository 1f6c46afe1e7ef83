//! The Rust agent SDK (`antidote-sdk`): write what your backend does, get the protocol right
//! for free.
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
//! Modules: `agent` (the trait and the runtime), [`book`] (the state book behind
//! Get/List/Watch), [`spec`] (generic spec checks and states), [`probe`] (readiness probes),
//! [`output`] (what a configuration printed, kept short), [`metrics`] (the agent's Prometheus
//! metrics), `server` (serving and [`run`]), `entrypoint` (feature `entrypoint`: learners'
//! way in, proxied HTTP presentations, web terminals, scheduler-signed tokens).
//!
//! Re-exported so that an agent depends on this crate alone: the protocol's names
//! ([`labels`], [`capabilities`], from `antidote-proto`), and from `antidote-net` [`errors`]
//! (typed errors), [`tls`] (mTLS, the `--tls-*` flags), [`trace`] and [`b3`] (logging, OTLP,
//! trace context), [`Listener`], [`Cuttable`], [`BodyDeadline`], [`shutdown_signal`], and
//! `dial` (feature `dial-in`: the agent dials the scheduler, which calls over the connection).
//!
//! Features: none by default, so an agent that only implements [`Backend`] builds without
//! SSH, WebSocket or JWT code. `entrypoint` adds the entrypoint (russh, tokio-tungstenite,
//! jsonwebtoken, ed25519-dalek); `dial-in` adds [`Transport::DialIn`] and the `--connect` flags.
#![forbid(unsafe_code)]

mod agent;
mod args;
pub mod book;
pub mod checks;
#[cfg(feature = "entrypoint")]
pub mod entrypoint;
mod error;
pub mod lesson;
pub mod metrics;
pub mod output;
pub mod pipeline;
pub mod probe;
mod server;
pub mod spec;

pub use agent::{Agent, AgentService, Backend, Description};
#[cfg(feature = "dial-in")]
pub use antidote_net::dial;
pub use antidote_net::{
    BodyDeadline, BodyTimedOut, Cuttable, Listener, b3, errors, shutdown_signal, tls, trace,
};
pub use antidote_proto::{capabilities, labels};
pub use args::{AgentArgs, run};
pub use book::{MAX_HEARTBEAT, MAX_PAGE, Reporter, StateBook, WatchStream, matches};
pub use error::Error;
pub use lesson::Lesson;
pub use pipeline::{Attempt, Limits, Placement, Start, Steps};
pub use server::{GRACE, Transport, run_with_grace, serve, serve_with_grace};
