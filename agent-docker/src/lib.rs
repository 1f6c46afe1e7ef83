//! agent-docker: an `antidote.agent.v1` backend that realises live lessons on a Docker engine
//! through bollard.
//!
//! Modules:
//! - [`backend`], the SDK `Backend`: takes one generation of a live lesson to READY (create or
//!   find, configure by exec, probe through the published ports), removes and discovers by
//!   label, plans; the SDK's `Agent` applies the protocol's rules around it.
//! - [`configurator`], python, ansible and napalm configurations from one configurator
//!   container per stage run on the lesson's network.
//! - [`guide`], Jupyter guide endpoints: the Jupyter image, the stage's notebook written in.
//! - [`engine`], every Docker call: networks, containers (confined: capabilities, pids,
//!   memory, CPU, no-new-privileges), exec (bounded in time and output), inspection.
//! - [`firewall`], the host iptables rules that keep lesson networks off the engine's host and
//!   the metadata address.
//! - [`settings`], the agent's configuration.
//!
//! Every object carries the labels of the spec (instance, live lesson, session, generation,
//! lesson) plus `antidote.io/endpoint` on containers, so the engine itself is the truth: after a
//! restart, List and Recover rebuild everything from labels.
#![forbid(unsafe_code)]

pub mod backend;
pub mod configurator;
pub mod engine;
pub mod firewall;
pub mod guide;
pub mod settings;
