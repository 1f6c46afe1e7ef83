//! Compiles the .proto files with protox (a pure-Rust protobuf compiler), so that building needs
//! no system `protoc`, and writes the encoded descriptor set for gRPC server reflection.

use std::path::PathBuf;

use prost::Message as _;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "antidote/api/v1/curriculum.proto",
        "antidote/api/v1/sessions.proto",
        "antidote/api/v1/live_lessons.proto",
        "antidote/api/v1/admin.proto",
        "antidote/api/v1/errors.proto",
        "antidote/agent/v1/agent.proto",
    ];
    for file in files {
        println!("cargo:rerun-if-changed={file}");
    }
    let fds = protox::compile(files, ["."])?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out_dir.join("antidote_descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure()
        .bytes(".antidote.agent.v1.LiveLessonState.handle")
        .compile_fds(fds)?;
    Ok(())
}
