//! agent-k8s: an `antidote.agent.v1` backend that realises live lessons on a Kubernetes cluster
//! through kube-rs.
//!
//! Modules:
//! - [`backend`], the SDK `Backend`: takes one generation of a live lesson to READY (apply the
//!   objects, watch the pods run, run the stage's configuration (shell scripts inside the
//!   endpoints, the configurator's as Jobs), probe the pods' addresses), removes a live lesson by deleting its namespace, discovers live lessons by the
//!   namespaces' labels, plans, runs stage checks; the SDK's `Agent` applies the protocol's
//!   rules around it.
//! - [`cluster`], the names and manifests of every object, and server-side apply.
//! - [`configurator`], python, ansible and napalm configurations as Jobs of the configurator
//!   image, their files in a ConfigMap, credentials in a Secret.
//! - [`exec`], shell configurations and check files inside an endpoint's container through
//!   `pods/exec`, python check files in a run's configurator pod.
//! - [`guard`], one watch of the agent's namespaces: a READY live lesson whose namespace is
//!   deleted behind the agent's back becomes FAILED.
//! - [`node_gc`], what `agent-k8s-node-gc` removes from a node once no pod uses it: lesson
//!   bridges and address pools.
//! - [`settings`], the agent's configuration.
//!
//! Every object carries the labels of the spec (instance, live lesson, session, generation,
//! lesson) plus `antidote.io/managed-by=agent-k8s`, so the cluster itself is the truth: after a
//! restart, List and Recover rebuild everything from labels.
#![forbid(unsafe_code)]

pub mod backend;
pub mod cluster;
pub mod configurator;
pub mod exec;
pub mod guard;
pub mod node_gc;
pub mod settings;
