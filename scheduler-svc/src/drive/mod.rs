//! The drive layer: what moves live lessons toward their desired state. [`Reconciler`] (the
//! work queue and its workers, moving live lessons off lost agents: the runtime), `lifecycle`
//! (what the reconciler does next at each step, as pure functions), [`placement`] (which agent
//! takes a lesson, and why), the [`roster`] (drained and lost agents, operators' labels), the
//! [`reaper`] (TTL expiry and orphans), [`pools`] (warm pools) and the [`hub`] (changes fanned out to API watchers). It calls agents
//! through [`crate::agents`] and records what it observes in [`crate::store`]; it never sees an
//! agent.v1 message.

pub mod hub;
mod lifecycle;
pub mod placement;
pub mod pools;
mod queue;
pub mod reaper;
mod reconcile;
pub mod replicas;
mod room;
pub mod roster;

pub use hub::Hub;
pub use pools::Pools;
pub use reaper::Reaper;
pub use reconcile::{Identity, Reconciler, ReconcilerParts};
pub use replicas::Replica;
pub use roster::Roster;
