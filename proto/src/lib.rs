//! Antidote's wire protocols, generated from the `.proto` files beside this crate.
//!
//! - [`api::v1`]: the public API served by the scheduler (`antidote.api.v1`).
//! - [`agent::v1`]: the protocol between the scheduler and backend agents (`antidote.agent.v1`).
//! - [`FILE_DESCRIPTOR_SET`], every file's descriptor, for gRPC server reflection.
//! - [`sdk`], building blocks for agents written in Rust.
//!
//! Generated types stay at the edges of the other crates: each converts them to its own domain
//! types in one module.
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

pub mod sdk;

/// The encoded `FileDescriptorSet` of every Antidote proto file, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/antidote_descriptor.bin"));
