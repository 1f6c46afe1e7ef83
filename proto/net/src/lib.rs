//! What the scheduler and the agents share on the wire below the protocol: how they connect,
//! serve, trace and fail.
//!
//! - [`tls`]: mTLS on rustls with certificates re-read when rotated, peer identities, and the
//!   agents' `--tls-*` flags ([`tls::TlsArgs`]).
//! - [`dial`]: dial-in, both ends: the agent dials, the scheduler (or the conformance suite)
//!   accepts and calls over the connection.
//! - [`accept`]: accepting connections, plaintext or mTLS, each handshake in its own task
//!   ([`Listener`]).
//! - [`shutdown`]: the signal that starts a shutdown ([`shutdown_signal`]) and connections cut
//!   when its grace is over ([`Cuttable`]).
//! - [`body`]: request bodies due whole within a deadline ([`BodyDeadline`]).
//! - [`grpc`]: health and reflection, which every gRPC server of ours carries.
//! - [`errors`]: typed gRPC errors (`google.rpc.ErrorInfo` with a reason), the one mapping.
//! - [`trace`] and [`b3`]: logging, OTLP span export, W3C (and B3) trace context across hops.
//! - [`metrics`]: the OpenMetrics encoding and the `/metrics` server.
//! - `entrypoint` (feature `entrypoint`): the entrypoint's URLs and tokens, which the
//!   scheduler signs and agents verify.
//!
//! Both the scheduler and the agent SDK (`antidote-sdk`) build on this crate, so no copy of any
//! of it lives in either; the SDK re-exports what agents need.
#![forbid(unsafe_code)]

pub mod accept;
pub mod b3;
pub mod body;
pub mod dial;
#[cfg(feature = "entrypoint")]
pub mod entrypoint;
pub mod errors;
pub mod grpc;
pub mod metrics;
pub mod shutdown;
pub mod tls;
pub mod trace;

pub use accept::{Conn, Listener};
pub use body::{BodyDeadline, BodyTimedOut};
pub use shutdown::{Cuttable, shutdown_signal};
