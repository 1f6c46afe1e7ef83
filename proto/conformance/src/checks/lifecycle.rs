//! A live lesson from Provision to Deprovision: READY, idempotency, a stage change, Recover,
//! List pages, Plan, and removal.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use antidote_proto::agent::v1 as proto;
use antidote_sdk::{capabilities, labels};
use anyhow::{Context as _, anyhow, bail, ensure};
use proto::Phase;
use tonic::Code;

use super::expect_refusal;
use crate::probe::{addresses, check_ready};
use crate::report::{Verdict, describe, pass, summary};
use crate::suite::{EXTRA_LABEL, Lesson, Selected, Suite, new_id};

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
    ensure!(
        !state.handle.is_empty(),
        "Provision answered an empty handle"
    );
    let answered = summary(&state);
    let ready = suite.ready(&id, 1).await?;
    ensure!(
        !ready.handle.is_empty(),
        "the READY state has an empty handle"
    );
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

/// `conflicting-spec`: another spec at the same generation is ALREADY_EXISTS, SPEC_CONFLICT.
pub async fn conflicting_spec(suite: &mut Suite) -> Verdict {
    let mut other = suite.lesson()?.first;
    other.endpoints[0].additional_ports.push(9999);
    let refusal = expect_refusal(
        suite.provision(other.clone()).await,
        Code::AlreadyExists,
        "SPEC_CONFLICT",
    )?;
    refusal.expect("live_lesson_id", &other.live_lesson_id)?;
    refusal.expect("generation", "1")?;
    pass(refusal.message)
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

/// `older-generation`: after the stage change, generation 1 is FAILED_PRECONDITION,
/// GENERATION_OUTDATED naming both generations.
pub async fn older_generation(suite: &mut Suite) -> Verdict {
    let lesson = suite.lesson()?;
    let refusal = expect_refusal(
        suite.provision(lesson.first.clone()).await,
        Code::FailedPrecondition,
        "GENERATION_OUTDATED",
    )?;
    refusal.expect("live_lesson_id", &lesson.id)?;
    refusal.expect("generation", "1")?;
    refusal.expect("held_generation", &lesson.current.generation.to_string())?;
    pass(refusal.message)
}

/// `endpoints-fixed`: a newer generation that adds an endpoint, or one that drops the
/// connection, is INVALID_SPEC naming `spec.endpoints` / `spec.connections`, and the held
/// generation stays (PROTOCOL.md [S3]).
pub async fn endpoints_fixed(suite: &mut Suite) -> Verdict {
    let lesson = suite.lesson()?;
    let next = lesson.current.generation + 1;
    let mut added = suite.spec(&lesson.id, next, lesson.current.stage);
    let mut gamma = added.endpoints[1].clone();
    gamma.name = "gamma".into();
    added.endpoints.push(gamma);
    let refusal = expect_refusal(
        suite.provision(added).await,
        Code::InvalidArgument,
        "INVALID_SPEC",
    )
    .context("a newer generation with one more endpoint")?;
    refusal.expect("field", "spec.endpoints")?;
    let mut unlinked = suite.spec(&lesson.id, next, lesson.current.stage);
    unlinked.connections.clear();
    let refusal = expect_refusal(
        suite.provision(unlinked).await,
        Code::InvalidArgument,
        "INVALID_SPEC",
    )
    .context("a newer generation without the connection")?;
    refusal.expect("field", "spec.connections")?;
    let held = suite
        .get(&lesson.id)
        .await
        .map_err(|s| anyhow!("Get: {}", describe(&s)))?;
    ensure!(
        held.generation == lesson.current.generation && held.phase == Phase::Ready as i32,
        "after the refusals the live lesson is {}, expected generation {} READY",
        summary(&held),
        lesson.current.generation
    );
    pass(format!(
        "both refused; generation {} still READY",
        held.generation
    ))
}

/// `recover-held`: Recover of the live lesson the agent holds follows the Provision table: its
/// newest spec answers its state at that generation, the first (older) spec is
/// GENERATION_OUTDATED, another spec at the newest generation SPEC_CONFLICT, and a newer
/// generation becomes READY.
pub async fn recover_held(suite: &mut Suite) -> Verdict {
    let lesson = suite.lesson()?;
    let recover = |spec: proto::LessonSpec| proto::RecoverRequest {
        live_lesson_id: lesson.id.clone(),
        handle: lesson.ready.handle.to_vec(),
        spec: Some(spec),
    };
    let state = suite
        .client
        .recover(recover(lesson.current.clone()))
        .await
        .map_err(|s| anyhow!("Recover with the newest spec: {}", describe(&s)))?
        .into_inner()
        .state
        .context("no state")?;
    ensure!(
        state.generation == lesson.current.generation,
        "Recover with the newest spec answered {}",
        summary(&state)
    );
    expect_refusal(
        suite.client.recover(recover(lesson.first.clone())).await,
        Code::FailedPrecondition,
        "GENERATION_OUTDATED",
    )
    .context("Recover with an older generation")?;
    let mut other = lesson.current.clone();
    other.endpoints[0].additional_ports.push(9999);
    expect_refusal(
        suite.client.recover(recover(other)).await,
        Code::AlreadyExists,
        "SPEC_CONFLICT",
    )
    .context("Recover with another spec at the held generation")?;
    let next = lesson.current.generation + 1;
    let newer = suite.spec(&lesson.id, next, 0);
    suite
        .client
        .recover(recover(newer.clone()))
        .await
        .map_err(|s| anyhow!("Recover with a newer generation: {}", describe(&s)))?;
    if let Some(lesson) = suite.lesson.as_mut() {
        lesson.current = newer.clone();
    }
    let ready = suite
        .ready(&lesson.id, next)
        .await
        .context("after Recover with a newer generation")?;
    check_ready(&ready, &newer).await?;
    pass(format!(
        "same spec → {}; older → GENERATION_OUTDATED; another → SPEC_CONFLICT; generation \
         {next} → READY at stage 0",
        summary(&state)
    ))
}

/// `extra-labels`: the spec's label beyond the guide's five is on the READY state, and List
/// selecting on it alone finds the live lesson (and nothing with another value).
pub async fn extra_labels(suite: &mut Suite) -> Verdict {
    let lesson = suite.lesson()?;
    let value = &suite.instance;
    ensure!(
        lesson.ready.labels.get(EXTRA_LABEL) == Some(value),
        "the READY state's labels lack {EXTRA_LABEL}={value}: {:?}",
        lesson.ready.labels
    );
    let list = |value: String| proto::ListRequest {
        label_selector: HashMap::from([(EXTRA_LABEL.to_owned(), value)]),
        page_size: 0,
        page_token: String::new(),
    };
    let found = suite
        .client
        .list(list(value.clone()))
        .await
        .map_err(|s| anyhow!("List: {}", describe(&s)))?
        .into_inner()
        .items;
    ensure!(
        found.iter().any(|s| s.live_lesson_id == lesson.id),
        "List selecting {EXTRA_LABEL}={value} does not find the live lesson"
    );
    let none = suite
        .client
        .list(list(new_id()))
        .await
        .map_err(|s| anyhow!("List: {}", describe(&s)))?
        .into_inner()
        .items;
    ensure!(
        none.is_empty(),
        "List selecting {EXTRA_LABEL} with an unused value shows {} live lessons",
        none.len()
    );
    pass(format!("{EXTRA_LABEL} kept on the state and selectable"))
}

/// `plan-bad-spec`: Plan refuses a spec breaking a rule as Provision does (INVALID_SPEC, same
/// field), answers a valid spec without error diagnostics and with fields relative to the spec,
/// and answers (does not refuse) a spec whose image the agent cannot run.
pub async fn plan_bad_spec(suite: &mut Suite) -> Verdict {
    let mut broken = suite.spec(&new_id(), 1, 0);
    broken.generation = 0;
    let refusal = expect_refusal(
        suite
            .client
            .plan(proto::PlanRequest { spec: Some(broken) })
            .await,
        Code::InvalidArgument,
        "INVALID_SPEC",
    )
    .context("Plan of generation 0")?;
    refusal.expect("field", "spec.generation")?;
    let refusal = expect_refusal(
        suite.client.plan(proto::PlanRequest { spec: None }).await,
        Code::InvalidArgument,
        "INVALID_SPEC",
    )
    .context("Plan without a spec")?;
    refusal.expect("field", "spec")?;
    let valid = suite
        .client
        .plan(proto::PlanRequest {
            spec: Some(suite.spec(&new_id(), 1, 0)),
        })
        .await
        .map_err(|s| anyhow!("Plan of a valid spec: {}", describe(&s)))?
        .into_inner();
    let errors: Vec<_> = valid
        .diagnostics
        .iter()
        .filter(|d| d.severity == proto::Severity::Error as i32)
        .collect();
    ensure!(
        errors.is_empty(),
        "Plan of a valid spec has error diagnostics: {errors:?}"
    );
    if let Some(d) = valid
        .diagnostics
        .iter()
        .find(|d| d.field.starts_with("spec."))
    {
        bail!(
            "a diagnostic's field starts with `spec.`: {:?} (fields are relative to the spec)",
            d.field
        );
    }
    let mut ghost = suite.solo(&new_id());
    ghost.endpoints[0].image.get_or_insert_default().slug = suite.settings.bad_image.clone();
    let planned = suite
        .client
        .plan(proto::PlanRequest { spec: Some(ghost) })
        .await
        .map_err(|s| {
            anyhow!(
                "Plan of image `{}` (a backend matter, not a spec rule): {}",
                suite.settings.bad_image,
                describe(&s)
            )
        })?
        .into_inner();
    let flagged = planned
        .diagnostics
        .iter()
        .any(|d| d.severity == proto::Severity::Error as i32);
    pass(format!(
        "broken → INVALID_SPEC; valid → {} objects, {} warnings; image `{}` → OK{}",
        valid.objects.len(),
        valid.diagnostics.len(),
        suite.settings.bad_image,
        if flagged {
            " with an error diagnostic"
        } else {
            ""
        }
    ))
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
    expect_refusal(get, Code::NotFound, "LIVE_LESSON_NOT_FOUND").context("Get after Plan")?;
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
        expect_refusal(
            suite
                .client
                .get(proto::GetRequest {
                    live_lesson_id: id.clone(),
                })
                .await,
            Code::NotFound,
            "LIVE_LESSON_NOT_FOUND",
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
