//! agent-docker: an `antidote.agent.v1` backend that realises live lessons on a Docker engine
//! through bollard.
//!
//! Modules:
//! - [`backend`], the gRPC service: idempotent Provision/Deprovision, Get/List/Watch from the
//!   state book, Recover, Plan, and the driver task that takes a live lesson to READY.
//! - [`engine`], every Docker call: networks, containers, exec, inspection, events.
//! - [`probe`], readiness probes (TCP, SSH banner, HTTP) against published ports.
//! - [`settings`], the agent's configuration.
//!
//! Every object carries the labels of the spec (instance, live lesson, session, generation,
//! lesson) plus `antidote.io/endpoint` on containers, so the engine itself is the truth: after a
//! restart, List and Recover rebuild everything from labels.
#![forbid(unsafe_code)]

pub mod backend;
pub mod engine;
pub mod probe;
pub mod settings;
