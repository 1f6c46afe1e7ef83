//! A live lesson from Provision to Deprovision: READY, idempotency, a stage change, Recover,
//! List pages, Plan, and removal.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use antidote_proto::agent::v1 as proto;
use antidote_proto::sdk::{capabilities, labels};
use anyhow::{Context as _, anyhow, bail, ensure};
use proto::Phase;
use tonic::Code;

use super::expect_code;
use crate::probe::{addresses, check_ready};
use crate::report::{Verdict, describe, pass, summary};
use crate::suite::{Lesson, Selected, Suite, new_id};

/// `provision-ready`: Provision of a new live lesson answers at once with a phase on the way
/// to READY, then the live lesson becomes READY and every presentation answers from here.
pub async fn provision_ready(suite: &mut Suite) -> Verdict {
    let id = new_id();
    let spec = suite.spec(&id, 1, 0);
    let state = suite
        .provision(spec.clone())
        .await
        .map_err(|s| anyhow!("Provision: {}", describe(&s)))?
        .into_inner()
        .state
        .context("Provision answered without a state")?;
    ensure!(
        state.generation == 1,
        "Provision answered generation {}",
        state.generation
    );
    ensure!(
        [
            Phase::Pending,
            Phase::Booting,
            Phase::Configuring,
            Phase::Ready
        ]
        .map(|p| p as i32)
        .contains(&state.phase),
        "Provision answered {}",
        summary(&state)
    );
    let answered = summary(&state);
    let ready = suite.ready(&id, 1).await?;
    suite.lesson = Some(Lesson {
        id,
        first: spec.clone(),
        current: spec.clone(),
        ready: ready.clone(),
    });
    let detail = check_ready(&ready, &spec).await?;
    pass(format!("Provision answered at once: {answered}; {detail}"))
}

/// `idempotent-provision`: the same spec again answers the current READY state, same
/// addresses.
pub async fn idempotent_provision(suite: &mut Suite) -> Verdict {
    let lesson = suite.lesson()?;
    let again = suite
        .provision(lesson.first.clone())
        .await
        .map_err(|s| anyhow!("{}", describe(&s)))?
        .into_inner()
        .state
        .context("no state")?;
    ensure!(
        again.generation == 1 && again.phase == Phase::Ready as i32,
        "answered {}",
        summary(&again)
    );
    ensure!(
        addresses(&again) == addresses(&lesson.ready),
        "presentations moved: {:?} → {:?}",
        addresses(&lesson.ready),
        addresses(&again)
    );
    pass("OK with the current READY state, same addresses")
}

/// `conflicting-spec`: another spec at the same generation is ALREADY_EXISTS.
pub async fn conflicting_spec(suite: &mut Suite) -> Verdict {
    let mut other = suite.lesson()?.first;
    other.endpoints[0].additional_ports.push(9999);
    pass(expect_code(
        suite.provision(other).await,
        Code::AlreadyExists,
    )?)
}

/// `get-agrees`: Get tells the READY state Watch (or Get) showed, at a revision no older.
pub async fn get_agrees(suite: &mut Suite) -> Verdict {
    let lesson = suite.lesson()?;
    let got = suite
        .client
        .get(proto::GetRequest {
            live_lesson_id: lesson.id.clone(),
        })
        .await
        .map_err(|s| anyhow!("Get: {}", describe(&s)))?
        .into_inner()
        .state
        .context("Get answered without a state")?;
    ensure!(
        got.generation == lesson.ready.generation && got.phase == lesson.ready.phase,
        "Get says {}, Watch said {}",
        summary(&got),
        summary(&lesson.ready)
    );
    ensure!(
        got.revision >= lesson.ready.revision,
        "Get's revision {} is older than Watch's {}",
        got.revision,
        lesson.ready.revision
    );
    pass(format!("revision {}", got.revision))
}

/// `stage-change`: generation 2 at stage 1 becomes READY in place, on the same addresses.
pub async fn stage_change(suite: &mut Suite) -> Verdict {
    let lesson = suite.lesson()?;
    let spec = suite.spec(&lesson.id, 2, 1);
    let state = suite
        .provision(spec.clone())
        .await
        .map_err(|s| anyhow!("Provision: {}", describe(&s)))?
        .into_inner()
        .state
        .context("no state")?;
    if let Some(lesson) = suite.lesson.as_mut() {
        lesson.current = spec.clone();
    }
    ensure!(state.generation == 2, "answered {}", summary(&state));
    let ready = suite.ready(&lesson.id, 2).await?;
    let detail = check_ready(&ready, &spec).await?;
    ensure!(
        addresses(&ready) == addresses(&lesson.ready),
        "the stage change moved the presentations: {:?} → {:?}",
        addresses(&lesson.ready),
        addresses(&ready)
    );
    pass(format!("READY at stage 1 in place; {detail}"))
}

/// `older-generation`: after the stage change, generation 1 is FAILED_PRECONDITION.
pub async fn older_generation(suite: &mut Suite) -> Verdict {
    let first = suite.lesson()?.first;
    pass(expect_code(
        suite.provision(first).await,
        Code::FailedPrecondition,
    )?)
}

/// `recover-held`: Recover of the live lesson the agent holds, with its newest spec, answers
/// its state at that generation.
pub async fn recover_held(suite: &mut Suite) -> Verdict {
    let lesson = suite.lesson()?;
    let state = suite
        .client
        .recover(proto::RecoverRequest {
            live_lesson_id: lesson.id.clone(),
            handle: lesson.ready.handle.to_vec(),
            spec: Some(lesson.current.clone()),
        })
        .await
        .map_err(|s| anyhow!("Recover: {}", describe(&s)))?
        .into_inner()
        .state
        .context("no state")?;
    ensure!(
        state.generation == lesson.current.generation,
        "Recover answered {}",
        summary(&state)
    );
    pass(summary(&state))
}

/// `list-pages`: with two more live lessons READY, pages of 1 hold each of the three once, in
/// the order one page has. When the agent offers Watch, a Watch selecting the first of the two
/// is opened before it exists, for `watch-selector`.
pub async fn list_pages(suite: &mut Suite) -> Verdict {
    let a = suite.lesson()?.id;
    let b = new_id();
    let c = new_id();
    if suite.offers(capabilities::WATCH) {
        let selector = HashMap::from([(labels::LIVE_LESSON.to_owned(), b.clone())]);
        let watch = suite
            .open_watch(selector, Duration::from_secs(1))
            .await
            .map(|(watcher, _)| watcher);
        suite.selected = Some(Selected {
            id: b.clone(),
            watch,
        });
    }
    for id in [&b, &c] {
        let spec = suite.spec(id, 1, 0);
        suite
            .provision(spec)
            .await
            .map_err(|s| anyhow!("Provision: {}", describe(&s)))?;
    }
    for id in [&b, &c] {
        suite.ready(id, 1).await?;
    }
    let whole: Vec<String> = suite
        .list_all(0)
        .await?
        .into_iter()
        .map(|s| s.live_lesson_id)
        .collect();
    let paged: Vec<String> = suite
        .list_all(1)
        .await?
        .into_iter()
        .map(|s| s.live_lesson_id)
        .collect();
    let expected: BTreeSet<String> = [a, b, c].into();
    let unique: BTreeSet<String> = paged.iter().cloned().collect();
    ensure!(
        unique == expected && paged.len() == 3,
        "pages of 1 gave {paged:?}, expected each of {expected:?} once"
    );
    ensure!(
        whole == paged,
        "one page {whole:?} and pages of 1 {paged:?} disagree on order"
    );
    pass("3 live lessons, pages of 1 in the same stable order as one page")
}

/// `plan-no-side-effects`: Plan lists the objects it would create, and creates nothing.
pub async fn plan_no_side_effects(suite: &mut Suite) -> Verdict {
    let d = new_id();
    let plan = suite
        .client
        .plan(proto::PlanRequest {
            spec: Some(suite.spec(&d, 1, 0)),
        })
        .await
        .map_err(|s| anyhow!("Plan: {}", describe(&s)))?
        .into_inner();
    ensure!(!plan.objects.is_empty(), "Plan lists no objects");
    let get = suite
        .client
        .get(proto::GetRequest {
            live_lesson_id: d.clone(),
        })
        .await;
    expect_code(get, Code::NotFound).context("Get after Plan")?;
    let listed = suite.list_all(0).await?;
    ensure!(
        listed.iter().all(|s| s.live_lesson_id != d),
        "List shows the planned live lesson"
    );
    let kinds: BTreeSet<&str> = plan.objects.iter().map(|o| o.kind.as_str()).collect();
    pass(format!(
        "{} objects ({}), nothing created",
        plan.objects.len(),
        kinds.into_iter().collect::<Vec<_>>().join(", ")
    ))
}

/// `deprovision`: every live lesson the suite provisioned goes (waiting out TERMINATING), Get
/// is NOT_FOUND, a second Deprovision is OK, and List is empty.
pub async fn deprovision(suite: &mut Suite) -> Verdict {
    let first = suite.lesson()?.id;
    let timeout = suite.settings.ready_timeout;
    let ids: BTreeSet<String> = suite.created.clone();
    for id in &ids {
        let gone = suite
            .client
            .deprovision(proto::DeprovisionRequest {
                live_lesson_id: id.clone(),
                handle: id.clone().into_bytes(),
            })
            .await
            .map_err(|s| anyhow!("Deprovision: {}", describe(&s)))?
            .into_inner()
            .gone;
        if !gone {
            // Removal goes on: the agent shows TERMINATING until it is done.
            let deadline = tokio::time::Instant::now() + timeout;
            loop {
                let get = suite
                    .client
                    .get(proto::GetRequest {
                        live_lesson_id: id.clone(),
                    })
                    .await;
                match get {
                    Err(status) if status.code() == Code::NotFound => break,
                    _ if tokio::time::Instant::now() > deadline => {
                        bail!("{id} not gone within {timeout:?}")
                    }
                    _ => tokio::time::sleep(Duration::from_millis(250)).await,
                }
            }
        }
        expect_code(
            suite
                .client
                .get(proto::GetRequest {
                    live_lesson_id: id.clone(),
                })
                .await,
            Code::NotFound,
        )
        .with_context(|| format!("Get of removed {id}"))?;
    }
    suite
        .client
        .deprovision(proto::DeprovisionRequest {
            live_lesson_id: first,
            handle: Default::default(),
        })
        .await
        .map_err(|s| anyhow!("second Deprovision: {}", describe(&s)))?;
    let left = suite.list_all(0).await?;
    ensure!(
        left.is_empty(),
        "List still shows {} live lessons",
        left.len()
    );
    suite.created.clear();
    let count = ids.len();
    suite.removed = ids;
    pass(format!(
        "{count} gone, Get NOT_FOUND, a second Deprovision OK, List empty"
    ))
}
