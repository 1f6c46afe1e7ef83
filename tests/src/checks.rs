//! Stage checks as a user meets them, for the end-to-end tests of every agent: the checks
//! fixture curriculum, CheckStage with the live lesson's session token (a learner's "Check"),
//! and AdminService.TestStage of a stage's solutions (what `antidotectl admin test-lesson`
//! runs between its two checks).

use std::path::{Path, PathBuf};

use antidote_proto::api::v1 as api;

use crate::{Clients, with_token};

/// The checks fixture (tests/fixtures/checks-curriculum): a gated stage, checks without bounds
/// of their own, a broken solution, a slow check.
pub fn curriculum() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/checks-curriculum")
}

/// CheckStage of live lesson `id` with its session's token.
pub async fn check_stage(c: &Clients, id: &str) -> Result<api::StageCheck, tonic::Status> {
    let request = with_token(
        api::CheckStageRequest { id: id.into() },
        c.tokens.of_lesson(id),
    );
    Ok(c.lessons.clone().check_stage(request).await?.into_inner())
}

/// AdminService.TestStage running the current stage's solution files on live lesson `id`.
pub async fn run_solutions(c: &Clients, id: &str) -> Result<api::StageCheck, tonic::Status> {
    let request = api::TestStageRequest {
        live_lesson_id: id.into(),
        files: api::StageFiles::Solutions as i32,
    };
    Ok(c.admin.clone().test_stage(request).await?.into_inner())
}
