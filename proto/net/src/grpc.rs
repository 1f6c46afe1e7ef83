//! The services every gRPC server of ours carries beside its own: `grpc.health.v1` and server
//! reflection, both versions (grpcio-reflection and older grpcurl know only v1alpha).

use tonic::transport::Server;
use tonic::transport::server::Router;
use tonic_health::server::HealthReporter;

/// Adds health and reflection (of `files`, the encoded descriptor sets of the server's own
/// services, and of health's) to `server`; the reporter sets what health answers.
pub fn standard_services<L: Clone>(
    server: &mut Server<L>,
    files: &[&'static [u8]],
) -> Result<(Router<L>, HealthReporter), tonic_reflection::server::Error> {
    let (health, health_service) = tonic_health::server::health_reporter();
    let reflection = || {
        files.iter().fold(
            tonic_reflection::server::Builder::configure()
                .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET),
            |builder, file| builder.register_encoded_file_descriptor_set(file),
        )
    };
    let (v1, v1alpha) = (reflection().build_v1()?, reflection().build_v1alpha()?);
    let router = server
        .add_service(health_service)
        .add_service(v1)
        .add_service(v1alpha);
    Ok((router, health))
}
