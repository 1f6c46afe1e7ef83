//! Health and the handshake.

use antidote_proto::agent::v1 as proto;
use anyhow::{anyhow, ensure};
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

use super::expect_refusal;
use crate::report::{Verdict, describe, pass};
use crate::suite::Suite;

/// `health`: grpc.health.v1 says the Backend service is SERVING.
pub async fn health(suite: &mut Suite) -> Verdict {
    let status = HealthClient::new(suite.channel.clone())
        .check(HealthCheckRequest {
            service: proto::SERVICE_NAME.into(),
        })
        .await
        .map_err(|s| anyhow!("grpc.health.v1 Check: {}", describe(&s)))?
        .into_inner()
        .status;
    ensure!(
        status == ServingStatus::Serving as i32,
        "status {status}, expected SERVING (1)"
    );
    pass("")
}

/// `handshake`: two handshakes answer major 1, a name, a version, capacity and the same
/// instance id; the capabilities are kept for the other checks.
pub async fn handshake(suite: &mut Suite) -> Verdict {
    let request = suite.handshake_request();
    let first = suite
        .client
        .handshake(request.clone())
        .await
        .map_err(|s| anyhow!("Handshake: {}", describe(&s)))?
        .into_inner();
    let second = suite
        .client
        .handshake(request)
        .await
        .map_err(|s| anyhow!("second Handshake: {}", describe(&s)))?
        .into_inner();
    ensure!(
        first.major == proto::MAJOR,
        "major {}, expected 1",
        first.major
    );
    ensure!(!first.agent_name.is_empty(), "agent_name is empty");
    ensure!(!first.build_version.is_empty(), "build_version is empty");
    ensure!(!first.instance_id.is_empty(), "instance_id is empty");
    ensure!(
        first.instance_id == second.instance_id,
        "instance_id changed between two handshakes ({} → {}) without a restart",
        first.instance_id,
        second.instance_id
    );
    ensure!(first.capacity.is_some(), "capacity is missing");
    suite.instance_id = first.instance_id.clone();
    suite.capabilities = first.capabilities.clone();
    suite.entrypoint_url = first.entrypoint_url.clone();
    pass(format!(
        "{} {}, major 1, capabilities [{}]",
        first.agent_name,
        first.build_version,
        first.capabilities.join(", ")
    ))
}

/// `no-common-major`: a scheduler speaking only major 99 is refused with NO_COMMON_MAJOR,
/// whose metadata names both sides' majors.
pub async fn no_common_major(suite: &mut Suite) -> Verdict {
    let request = proto::HandshakeRequest {
        supported_majors: vec![99],
        ..suite.handshake_request()
    };
    let refusal = expect_refusal(
        suite.client.handshake(request).await,
        Code::FailedPrecondition,
        "NO_COMMON_MAJOR",
    )?;
    refusal.expect("scheduler_majors", "99")?;
    refusal.has("agent_majors")?;
    ensure!(
        refusal.metadata["agent_majors"]
            .split(',')
            .any(|m| m.trim() == proto::MAJOR.to_string()),
        "agent_majors {:?} lacks {}, the major it chose before",
        refusal.metadata["agent_majors"],
        proto::MAJOR
    );
    pass(refusal.message)
}
