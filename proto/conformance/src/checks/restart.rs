//! An agent restart (`--restart-cmd`): what the new process says about a live lesson the old
//! one made READY, and its adoption (PROTOCOL.md "Restarts, Recover and adoption").

use std::time::Duration;

use antidote_proto::agent::v1 as proto;
use antidote_sdk::capabilities;
use anyhow::{Context as _, anyhow, bail, ensure};
use proto::Phase;
use tonic::Code;

use super::expect_refusal;
use crate::probe::{addresses, check_ready};
use crate::report::{Outcome, Verdict, describe, pass, summary};
use crate::suite::{Restarted, Suite, new_id};

/// The ready delay of the live lesson that lives through the restart: adoption waits it too.
const READY_DELAY: Duration = Duration::from_secs(2);

/// `restart-recover`: makes a live lesson READY, restarts the agent with `--restart-cmd`, and
/// checks what the new process says: a new instance id; the old Watch stream ends and a new one
/// does not show the live lesson (not held yet); then either List shows it BOOTING while Get is
/// NOT_FOUND, and Recover (Provision without `recover`) takes it on, or List does not show it,
/// Recover is NOT_FOUND and Provision creates it afresh to READY.
pub async fn recover(suite: &mut Suite) -> Verdict {
    let command = suite
        .settings
        .restart_cmd
        .clone()
        .context("no --restart-cmd")?;
    let id = new_id();
    let mut spec = suite.solo(&id);
    spec.ready_delay = Some(READY_DELAY.try_into()?);
    suite
        .provision(spec.clone())
        .await
        .map_err(|s| anyhow!("Provision: {}", describe(&s)))?;
    let before = suite.ready(&id, 1).await?;
    check_ready(&before, &spec).await?;

    let old = suite
        .client
        .handshake(suite.handshake_request())
        .await
        .map_err(|s| anyhow!("Handshake before the restart: {}", describe(&s)))?
        .into_inner()
        .instance_id;
    restart(&command).await?;
    let new = new_instance(suite, &old).await?;
    suite.instance_id = new.clone();

    if let Some(mut stream) = suite.watch.take() {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            ensure!(
                !left.is_zero(),
                "the Watch stream of the old process still delivers 10 s after the restart"
            );
            if stream.next(left).await.is_err() {
                break;
            }
        }
    }
    if suite.offers(capabilities::WATCH) {
        let (watcher, items) = suite
            .open_watch(suite.selector(), Duration::from_secs(1))
            .await
            .context("Watch after the restart")?;
        ensure!(
            items.iter().all(|s| s.live_lesson_id != id),
            "the first snapshot after the restart shows the live lesson, which nothing has \
             recovered yet: {}",
            items
                .iter()
                .find(|s| s.live_lesson_id == id)
                .map(summary)
                .unwrap_or_default()
        );
        suite.watch = Some(watcher);
    }

    let listed = suite.list_all(0).await?;
    let found = listed.into_iter().find(|s| s.live_lesson_id == id);
    let recover = suite.offers(capabilities::RECOVER);
    let Some(found) = found else {
        if recover {
            expect_refusal(
                suite
                    .client
                    .recover(proto::RecoverRequest {
                        live_lesson_id: id.clone(),
                        handle: before.handle.to_vec(),
                        spec: Some(spec.clone()),
                    })
                    .await,
                Code::NotFound,
                "LIVE_LESSON_NOT_FOUND",
            )
            .context("Recover of a live lesson List does not show")?;
        }
        suite
            .provision(spec.clone())
            .await
            .map_err(|s| anyhow!("Provision after the restart: {}", describe(&s)))?;
        let ready = suite.ready(&id, 1).await?;
        check_ready(&ready, &spec).await?;
        suite.remove(&id).await?;
        suite.restarted = Some(None);
        return pass(format!(
            "instance {old} → {new}; nothing outlived the process: List without it{}, \
             provisioned again to READY",
            if recover { ", Recover NOT_FOUND" } else { "" }
        ));
    };
    ensure!(
        found.phase == Phase::Booting as i32,
        "List shows the live lesson not recovered yet as {}, expected BOOTING",
        summary(&found)
    );
    ensure!(
        !found.handle.is_empty(),
        "List shows it with an empty handle"
    );
    for (key, value) in &spec.labels {
        ensure!(
            found.labels.get(key) == Some(value),
            "List shows it with label {key} = {:?}, expected {value:?}",
            found.labels.get(key)
        );
    }
    let refusal = expect_refusal(
        suite
            .client
            .get(proto::GetRequest {
                live_lesson_id: id.clone(),
            })
            .await,
        Code::NotFound,
        "LIVE_LESSON_NOT_FOUND",
    )
    .context("Get of a live lesson not recovered yet")?;
    refusal.expect("live_lesson_id", &id)?;
    let adopted_at = tokio::time::Instant::now();
    let (call, answer) = if recover {
        let answer = suite
            .client
            .recover(proto::RecoverRequest {
                live_lesson_id: id.clone(),
                handle: found.handle.to_vec(),
                spec: Some(spec.clone()),
            })
            .await
            .map(|r| r.into_inner().state);
        ("Recover", answer)
    } else {
        let answer = suite
            .provision(spec.clone())
            .await
            .map(|r| r.into_inner().state);
        ("Provision", answer)
    };
    let state = answer
        .map_err(|s| anyhow!("{call} after the restart: {}", describe(&s)))?
        .with_context(|| format!("{call} answered without a state"))?;
    ensure!(
        state.generation == 1 && state.phase != Phase::Failed as i32,
        "{call} after the restart answered {}",
        summary(&state)
    );
    suite.restarted = Some(Some(Restarted {
        id,
        spec,
        before,
        adopted_at,
    }));
    pass(format!(
        "instance {old} → {new}; the old stream ended, the new one does not show it; List \
         shows it BOOTING, Get NOT_FOUND; {call} answered {}",
        summary(&state)
    ))
}

/// Runs `command` with `sh -c`, which must succeed within two minutes.
async fn restart(command: &str) -> anyhow::Result<()> {
    let run = tokio::process::Command::new("sh")
        .arg("-c")
        .arg(command)
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .map_err(|_| anyhow!("--restart-cmd did not finish within 120 s"))?
        .context("--restart-cmd could not run")?;
    if !output.status.success() {
        bail!(
            "--restart-cmd failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}

/// Handshakes until the agent answers with an instance id other than `old`.
async fn new_instance(suite: &mut Suite, old: &str) -> anyhow::Result<String> {
    let timeout = suite.settings.ready_timeout;
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let last = match suite.client.handshake(suite.handshake_request()).await {
            Ok(answer) if answer.get_ref().instance_id != old => {
                return Ok(answer.into_inner().instance_id);
            }
            Ok(_) => "the same instance id".to_owned(),
            Err(status) => describe(&status),
        };
        if tokio::time::Instant::now() > deadline {
            bail!("no handshake with a new instance id within {timeout:?} of the restart ({last})");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// `restart-adopt`: the live lesson that outlived the restart becomes READY again on the same
/// addresses (adopted, not recreated), no sooner than its ready delay after Recover, and
/// answers its probes.
pub async fn adopt(suite: &mut Suite) -> Verdict {
    let Some(restarted) = suite.restarted.take().flatten() else {
        return Ok(Outcome::Skip(
            "nothing outlived the agent's process (List did not show the live lesson after the \
             restart): nothing to adopt"
                .into(),
        ));
    };
    let outcome = async {
        let ready = suite.ready(&restarted.id, 1).await?;
        let elapsed = restarted.adopted_at.elapsed();
        ensure!(
            elapsed >= READY_DELAY,
            "READY {elapsed:?} after the adoption, before its ready delay of {READY_DELAY:?}"
        );
        ensure!(
            addresses(&ready) == addresses(&restarted.before),
            "the presentations moved: {:?} before the restart, {:?} after",
            addresses(&restarted.before),
            addresses(&ready)
        );
        check_ready(&ready, &restarted.spec).await
    }
    .await;
    suite.remove(&restarted.id).await?;
    pass(format!(
        "READY on the same addresses, no sooner than the ready delay; {}",
        outcome?
    ))
}
