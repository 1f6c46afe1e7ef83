//! Checks (PROTOCOL.md, "Checks"): `RunChecks` runs files on a READY live lesson and answers
//! each file's exit status and output tail ([X3]), ends a file that never ends at the timeout,
//! runs one at a time per live lesson ([X4]), changes nothing the agent reports ([X5]), and
//! refuses what it must ([X1], [X2]). Each check makes its own live lesson and removes it.

use std::time::{Duration, Instant};

use antidote_proto::agent::v1 as proto;
use antidote_proto::capabilities;
use anyhow::{Context as _, anyhow, bail, ensure};
use proto::{ConfigurationType, ErrorReason};
use tonic::Code;

use super::expect_refusal;
use crate::report::{Outcome, Verdict, describe, pass};
use crate::suite::{Suite, new_id};

/// A shell file for the suite's one endpoint.
fn file(suite: &Suite, file_name: &str, script: &str) -> proto::CheckFile {
    proto::CheckFile {
        endpoint: suite.solo(&new_id()).endpoints[0].name.clone(),
        r#type: ConfigurationType::Shell as i32,
        file_name: file_name.into(),
        contents: script.as_bytes().to_vec(),
    }
}

/// A request for `files` on `id` at `generation`, each bounded by `timeout`.
fn request(
    id: &str,
    generation: u64,
    files: Vec<proto::CheckFile>,
    timeout: Duration,
) -> proto::RunChecksRequest {
    proto::RunChecksRequest {
        live_lesson_id: id.into(),
        generation,
        files,
        timeout: timeout.try_into().ok(),
    }
}

/// Provisions the suite's one-endpoint lesson and waits until it is READY; its id.
async fn ready_solo(suite: &mut Suite) -> anyhow::Result<String> {
    let id = new_id();
    let spec = suite.solo(&id);
    suite
        .provision(spec)
        .await
        .map_err(|s| anyhow!("Provision: {}", describe(&s)))?;
    suite.ready(&id, 1).await?;
    Ok(id)
}

/// Runs `body` on a READY live lesson of its own, removing it afterwards whatever happened.
async fn on_ready_lesson<F>(suite: &mut Suite, body: F) -> Verdict
where
    F: for<'a> FnOnce(&'a mut Suite, String) -> futures::future::LocalBoxFuture<'a, Verdict>,
{
    let id = ready_solo(suite).await?;
    let verdict = body(suite, id.clone()).await;
    suite.remove(&id).await?;
    verdict
}

/// `checks-unimplemented`: without the `checks` capability, RunChecks is UNIMPLEMENTED
/// (NOT_IMPLEMENTED) [X1].
pub async fn unimplemented(suite: &mut Suite) -> Verdict {
    if suite.offers(capabilities::CHECKS) {
        return Ok(Outcome::Skip(
            "the agent offers `checks`: the other checks-* checks cover it".into(),
        ));
    }
    let answer = suite
        .client
        .run_checks(request(
            &new_id(),
            1,
            vec![file(suite, "check.sh", "exit 0\n")],
            Duration::from_secs(5),
        ))
        .await;
    expect_refusal(
        answer,
        Code::Unimplemented,
        ErrorReason::NotImplemented.as_str_name(),
    )?
    .expect("rpc", "RunChecks")?;
    pass("RunChecks without `checks` is UNIMPLEMENTED (NOT_IMPLEMENTED, rpc RunChecks)")
}

/// `checks-run`: a passing and a failing file in one request, answered in order with their
/// exit status and output; the live lesson's state, generation and revision unchanged [X3],
/// [X5].
pub async fn run(suite: &mut Suite) -> Verdict {
    on_ready_lesson(suite, |suite, id| {
        Box::pin(async move {
            let before = suite
                .get(&id)
                .await
                .map_err(|s| anyhow!("Get: {}", describe(&s)))?;
            let passing = file(suite, "passing.sh", "echo all good here\nexit 0\n");
            let mut failing = file(
                suite,
                "failing.sh",
                "echo not yet: the route is missing >&2\nexit 3\n",
            );
            // One file per endpoint: the failing one runs in a request of its own.
            let first = suite
                .client
                .run_checks(request(&id, 1, vec![passing], Duration::from_secs(30)))
                .await
                .map_err(|s| anyhow!("RunChecks: {}", describe(&s)))?
                .into_inner();
            ensure!(
                first.results.len() == 1,
                "one file, {} results",
                first.results.len()
            );
            let ok = &first.results[0];
            ensure!(
                ok.exited && ok.exit_code == 0 && !ok.timed_out && ok.error.is_empty(),
                "a file exiting 0 answered {ok:?}"
            );
            ensure!(
                ok.output.contains("all good here"),
                "its output is not in the answer: {:?}",
                ok.output
            );
            ensure!(
                ok.file_name == "passing.sh",
                "the result names {}",
                ok.file_name
            );
            failing.file_name = "failing.sh".into();
            let second = suite
                .client
                .run_checks(request(&id, 1, vec![failing], Duration::from_secs(30)))
                .await
                .map_err(|s| anyhow!("RunChecks: {}", describe(&s)))?
                .into_inner();
            let bad = second.results.first().context("no result")?;
            ensure!(
                bad.exited && bad.exit_code == 3,
                "a file exiting 3 answered {bad:?}"
            );
            ensure!(
                bad.output.contains("not yet: the route is missing"),
                "stderr is not in the output: {:?}",
                bad.output
            );
            // Over what one argument may hold (128 KiB): the file cannot go as `sh -c` [V5].
            let mut big = file(suite, "big.sh", "");
            let mut contents = "#".repeat(200 * 1024);
            contents.push_str("\necho the whole file ran\n");
            big.contents = contents.into_bytes();
            let third = suite
                .client
                .run_checks(request(&id, 1, vec![big], Duration::from_secs(30)))
                .await
                .map_err(|s| anyhow!("RunChecks of a 200 KiB file: {}", describe(&s)))?
                .into_inner();
            let big = third.results.first().context("no result")?;
            ensure!(
                big.exited && big.exit_code == 0 && big.output.contains("the whole file ran"),
                "a 200 KiB file answered {big:?}"
            );
            let after = suite
                .get(&id)
                .await
                .map_err(|s| anyhow!("Get: {}", describe(&s)))?;
            ensure!(
                after.phase == before.phase
                    && after.generation == before.generation
                    && after.revision == before.revision,
                "RunChecks changed the state: {} gen {} rev {} → {} gen {} rev {}",
                before.phase,
                before.generation,
                before.revision,
                after.phase,
                after.generation,
                after.revision
            );
            pass("exit 0 and exit 3 answered with their output, a 200 KiB file ran whole; the state untouched")
        })
    })
    .await
}

/// `checks-timeout`: a file that never ends is killed at the request's timeout and answered
/// `timed_out`, with what it wrote before [X3].
pub async fn timeout(suite: &mut Suite) -> Verdict {
    on_ready_lesson(suite, |suite, id| {
        Box::pin(async move {
            let hanging = file(suite, "hanging.sh", "echo started\nsleep 600\n");
            let started = Instant::now();
            let answer = suite
                .client
                .run_checks(request(&id, 1, vec![hanging], Duration::from_secs(2)))
                .await
                .map_err(|s| anyhow!("RunChecks: {}", describe(&s)))?
                .into_inner();
            let took = started.elapsed();
            let result = answer.results.first().context("no result")?;
            ensure!(
                result.timed_out && !result.exited,
                "a file sleeping 600 s with a 2 s timeout answered {result:?}"
            );
            ensure!(
                result.output.contains("started"),
                "what it wrote before the timeout is missing: {:?}",
                result.output
            );
            // Generous: the rule is that the file is ended, not how fast the agent answers.
            ensure!(
                took < Duration::from_secs(60),
                "answered only after {took:?}"
            );
            pass(format!("ended at the timeout, answered in {took:.1?}"))
        })
    })
    .await
}

/// `checks-one-at-a-time`: a second RunChecks while one runs on the same live lesson is
/// ABORTED (CHECKS_RUNNING) [X4].
pub async fn one_at_a_time(suite: &mut Suite) -> Verdict {
    on_ready_lesson(suite, |suite, id| {
        Box::pin(async move {
            let slow = file(suite, "slow.sh", "sleep 5\n");
            let quick = file(suite, "quick.sh", "exit 0\n");
            let mut first_client = suite.client.clone();
            let first = first_client.run_checks(request(
                &id,
                1,
                vec![slow],
                Duration::from_secs(30),
            ));
            tokio::pin!(first);
            let mut second_client = suite.client.clone();
            let mut refused = None;
            // Ask again and again while the first runs: one of them must be refused.
            let deadline = Instant::now() + Duration::from_secs(4);
            while refused.is_none() && Instant::now() < deadline {
                tokio::select! {
                    answer = &mut first => match answer {
                        // The other call got in first: this one was the second.
                        Err(status) if status.code() == Code::Aborted => {
                            expect_refusal::<()>(
                                Err(status),
                                Code::Aborted,
                                ErrorReason::ChecksRunning.as_str_name(),
                            )?;
                            return pass("a second run while one ran is ABORTED (CHECKS_RUNNING)");
                        }
                        other => bail!(
                            "the 5 s run ended before any second run was refused: {:?}",
                            other.map(|a| a.into_inner())
                        ),
                    },
                    answer = second_client.run_checks(request(&id, 1, vec![quick.clone()], Duration::from_secs(30))) => {
                        match answer {
                            Err(status) if status.code() == Code::Aborted => refused = Some(status),
                            Err(status) => bail!("a second run answered {}", describe(&status)),
                            // Sent before the first was admitted: ask again.
                            Ok(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                        }
                    }
                }
            }
            let status = refused.context("no second run was refused while the first ran")?;
            expect_refusal::<()>(
                Err(status),
                Code::Aborted,
                ErrorReason::ChecksRunning.as_str_name(),
            )?;
            let first = first
                .await
                .map_err(|s| anyhow!("the first RunChecks: {}", describe(&s)))?
                .into_inner();
            ensure!(
                first.results.first().is_some_and(|r| r.exited && r.exit_code == 0),
                "the first run answered {first:?}"
            );
            pass("a second run while one ran is ABORTED (CHECKS_RUNNING)")
        })
    })
    .await
}

/// `checks-refusals`: an unknown live lesson is NOT_FOUND, another generation NOT_READY, a
/// request breaking a rule INVALID_ARGUMENT naming its field, a live lesson being removed
/// NOT_READY or NOT_FOUND [X2].
pub async fn refusals(suite: &mut Suite) -> Verdict {
    let ok = file(suite, "check.sh", "exit 0\n");
    let unknown = suite
        .client
        .run_checks(request(
            &new_id(),
            1,
            vec![ok.clone()],
            Duration::from_secs(5),
        ))
        .await;
    expect_refusal(
        unknown,
        Code::NotFound,
        ErrorReason::LiveLessonNotFound.as_str_name(),
    )?;
    let id = ready_solo(suite).await?;
    let outcome = async {
        let other = suite
            .client
            .run_checks(request(&id, 2, vec![ok.clone()], Duration::from_secs(5)))
            .await;
        expect_refusal(
            other,
            Code::FailedPrecondition,
            ErrorReason::NotReady.as_str_name(),
        )
        .context("another generation")?;
        let none = suite
            .client
            .run_checks(request(&id, 1, vec![], Duration::from_secs(5)))
            .await;
        let refusal = expect_refusal(
            none,
            Code::InvalidArgument,
            ErrorReason::InvalidSpec.as_str_name(),
        )
        .context("no files")?;
        ensure!(
            refusal.metadata.get("field").map(String::as_str) == Some("files"),
            "no files: field {:?}",
            refusal.metadata.get("field")
        );
        let mut stranger = ok.clone();
        stranger.endpoint = "no-such-endpoint".into();
        let stranger = suite
            .client
            .run_checks(request(&id, 1, vec![stranger], Duration::from_secs(5)))
            .await;
        let refusal = expect_refusal(
            stranger,
            Code::InvalidArgument,
            ErrorReason::InvalidSpec.as_str_name(),
        )
        .context("an unknown endpoint")?;
        ensure!(
            refusal.metadata.get("field").map(String::as_str) == Some("files[0].endpoint"),
            "an unknown endpoint: field {:?}",
            refusal.metadata.get("field")
        );
        Ok::<_, anyhow::Error>(())
    }
    .await;
    // Being removed: refused, never run.
    suite
        .client
        .deprovision(proto::DeprovisionRequest {
            live_lesson_id: id.clone(),
            handle: id.as_bytes().to_vec(),
        })
        .await
        .map_err(|s| anyhow!("Deprovision: {}", describe(&s)))?;
    let removing = suite
        .client
        .run_checks(request(&id, 1, vec![ok], Duration::from_secs(5)))
        .await;
    let removing = match removing {
        Err(status) if status.code() == Code::NotFound => expect_refusal::<()>(
            Err(status),
            Code::NotFound,
            ErrorReason::LiveLessonNotFound.as_str_name(),
        ),
        other => expect_refusal(
            other,
            Code::FailedPrecondition,
            ErrorReason::NotReady.as_str_name(),
        ),
    };
    suite.remove(&id).await?;
    outcome?;
    removing.context("a live lesson being removed")?;
    pass("unknown NOT_FOUND; other generation and removal NOT_READY; bad requests INVALID_SPEC")
}
