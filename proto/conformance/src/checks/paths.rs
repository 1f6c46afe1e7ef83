//! The paths beside the main lifecycle: retries (identical calls at once), the ready delay,
//! each configuration type the agent claims, the FAILED paths (an image that does not start, a
//! configuration that fails, a presentation that never answers) and capacity. Each check makes
//! its own live lessons and removes them.

use std::time::Duration;

use antidote_proto::agent::v1 as proto;
use antidote_sdk::capabilities;
use anyhow::{Context as _, anyhow, bail, ensure};
use proto::{ConfigurationType, Phase, PresentationType};
use tonic::Code;

use super::expect_refusal;
use crate::probe::check_ready;
use crate::report::{Outcome, Verdict, describe, pass, summary};
use crate::suite::{Suite, new_id};

/// The capability of shell configurations (PROTOCOL.md [V5]).
pub const CONFIGURATION_SHELL: &str = "configuration.shell";
/// The capability of python configurations.
pub const CONFIGURATION_PYTHON: &str = "configuration.python";
/// The capability of ansible playbooks.
pub const CONFIGURATION_ANSIBLE: &str = "configuration.ansible";
/// The capability of NAPALM configurations.
pub const CONFIGURATION_NAPALM: &str = "configuration.napalm";

/// Every configuration type with its capability.
const TYPES: [(ConfigurationType, &str); 4] = [
    (ConfigurationType::Shell, CONFIGURATION_SHELL),
    (ConfigurationType::Python, CONFIGURATION_PYTHON),
    (ConfigurationType::Ansible, CONFIGURATION_ANSIBLE),
    (ConfigurationType::Napalm, CONFIGURATION_NAPALM),
];

/// The configuration types the agent runs: those it lists, or shell alone when it offers
/// `stage.configuration` and lists none (PROTOCOL.md [V5]).
pub fn claimed_types(suite: &Suite) -> Vec<ConfigurationType> {
    if !suite.offers(capabilities::STAGE_CONFIGURATION) {
        return vec![];
    }
    let listed: Vec<_> = TYPES
        .iter()
        .filter(|(_, capability)| suite.offers(capability))
        .map(|(kind, _)| *kind)
        .collect();
    if listed.is_empty() {
        vec![ConfigurationType::Shell]
    } else {
        listed
    }
}

/// A shell configuration.
pub fn shell(file_name: &str, script: &str) -> proto::StageConfiguration {
    proto::StageConfiguration {
        r#type: proto::ConfigurationType::Shell as i32,
        file_name: file_name.into(),
        contents: script.as_bytes().to_vec(),
        driver: String::new(),
    }
}

/// A configuration type the agent does not run, if there is one.
pub fn unclaimed_type(suite: &Suite) -> Option<ConfigurationType> {
    let claimed = claimed_types(suite);
    TYPES
        .iter()
        .map(|(kind, _)| *kind)
        .find(|kind| !claimed.contains(kind))
}

/// How many identical calls the retry checks make at once.
const AT_ONCE: usize = 5;

/// `concurrent-provision`: five identical Provisions of a new live lesson at once all answer
/// OK for it; it becomes READY and List shows it once (PROTOCOL.md [P7]).
pub async fn concurrent_provision(suite: &mut Suite) -> Verdict {
    let id = new_id();
    let spec = suite.solo(&id);
    suite.created.insert(id.clone());
    let calls = (0..AT_ONCE).map(|_| {
        let mut client = suite.client.clone();
        let spec = spec.clone();
        async move {
            client
                .provision(proto::ProvisionRequest {
                    spec: Some(spec),
                    new_live_lesson: true,
                })
                .await
        }
    });
    let answers = futures::future::join_all(calls).await;
    for (n, answer) in answers.into_iter().enumerate() {
        let state = answer
            .map_err(|s| anyhow!("call {} of {AT_ONCE}: {}", n + 1, describe(&s)))?
            .into_inner()
            .state
            .context("an answer without a state")?;
        ensure!(
            state.live_lesson_id == id
                && state.generation == 1
                && state.phase != Phase::Failed as i32,
            "call {} of {AT_ONCE} answered {}",
            n + 1,
            summary(&state)
        );
    }
    let ready = suite.ready(&id, 1).await?;
    check_ready(&ready, &spec).await?;
    let listed = suite.list_all(0).await?;
    let count = listed.iter().filter(|s| s.live_lesson_id == id).count();
    ensure!(count == 1, "List shows the live lesson {count} times");
    suite.concurrent = Some(id);
    pass(format!(
        "{AT_ONCE} calls at once all OK; READY; listed once"
    ))
}

/// `concurrent-deprovision`: five identical Deprovisions of that live lesson at once all answer
/// OK; it goes (Get NOT_FOUND), and the Watch stream tells one deletion, after TERMINATING
/// (PROTOCOL.md [D2], [D4]).
pub async fn concurrent_deprovision(suite: &mut Suite) -> Verdict {
    let id = suite
        .concurrent
        .take()
        .context("`concurrent-provision` left no live lesson")?;
    let calls = (0..AT_ONCE).map(|_| {
        let mut client = suite.client.clone();
        let id = id.clone();
        async move {
            client
                .deprovision(proto::DeprovisionRequest {
                    live_lesson_id: id.clone(),
                    handle: id.into_bytes(),
                })
                .await
        }
    });
    for (n, answer) in futures::future::join_all(calls)
        .await
        .into_iter()
        .enumerate()
    {
        answer.map_err(|s| anyhow!("call {} of {AT_ONCE}: {}", n + 1, describe(&s)))?;
    }
    suite.remove(&id).await?;
    let Some(watcher) = suite.watch.as_mut() else {
        return pass(format!(
            "{AT_ONCE} calls at once all OK; Get NOT_FOUND (no Watch stream to count deletions)"
        ));
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !watcher.deleted.contains(&id) {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        ensure!(!left.is_zero(), "no `deleted` event within 30 s");
        watcher.next(left).await?;
    }
    // A second deletion would come right after the first: read on for a second.
    let quiet = tokio::time::Instant::now() + Duration::from_secs(1);
    loop {
        let left = quiet.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() || watcher.next(left).await.is_err() {
            break;
        }
    }
    let deletions = watcher.deletions.get(&id).copied().unwrap_or(0);
    ensure!(
        deletions == 1,
        "{deletions} `deleted` events for one removal"
    );
    let before = watcher.phase_before_deletion.get(&id).copied();
    ensure!(
        before == Some(Phase::Terminating as i32),
        "the live lesson was last shown {:?} before its deletion, not TERMINATING",
        before.map(|p| Phase::try_from(p).unwrap_or(Phase::Unspecified))
    );
    pass(format!(
        "{AT_ONCE} calls at once all OK; Get NOT_FOUND; TERMINATING, then one `deleted`"
    ))
}

/// The ready delay `ready-delay` asks for.
const READY_DELAY: Duration = Duration::from_secs(3);

/// `ready-delay`: with a 3 s ready delay, READY comes no sooner than 3 s after Provision, both
/// for the first generation and for a stage change (PROTOCOL.md [R4]).
pub async fn ready_delay(suite: &mut Suite) -> Verdict {
    let id = new_id();
    let mut spec = suite.solo(&id);
    spec.ready_delay = Some(READY_DELAY.try_into()?);
    let outcome = async {
        let mut took = Vec::new();
        for (generation, stage) in [(1, 0), (2, 1)] {
            let mut spec = spec.clone();
            if generation > 1 {
                let next = suite.spec(&id, generation, stage);
                spec.generation = generation;
                spec.stage = stage;
                spec.labels = next.labels;
                spec.endpoints[0].configuration = next.endpoints[0].configuration.clone();
            }
            let asked = tokio::time::Instant::now();
            suite
                .provision(spec.clone())
                .await
                .map_err(|s| anyhow!("Provision of generation {generation}: {}", describe(&s)))?;
            let ready = suite.ready(&id, generation).await?;
            let elapsed = asked.elapsed();
            ensure!(
                elapsed >= READY_DELAY,
                "generation {generation} was READY {elapsed:?} after Provision, before its \
                 ready delay of {READY_DELAY:?}"
            );
            check_ready(&ready, &spec).await?;
            took.push(format!(
                "generation {generation} after {:.1} s",
                elapsed.as_secs_f64()
            ));
        }
        Ok::<_, anyhow::Error>(took)
    }
    .await;
    suite.remove(&id).await?;
    pass(format!(
        "ready delay {READY_DELAY:?}: {}",
        outcome?.join(", ")
    ))
}

/// Provisions a one-endpoint live lesson with `configuration` (on `image` when given), waits
/// until it settles, removes it; passes when it was READY.
async fn configured(
    suite: &mut Suite,
    configuration: proto::StageConfiguration,
    image: Option<String>,
) -> Verdict {
    let id = new_id();
    let mut spec = suite.solo(&id);
    if let Some(image) = image {
        spec.endpoints[0].image.get_or_insert_default().slug = image;
    }
    let file = configuration.file_name.clone();
    spec.endpoints[0].configuration = Some(configuration);
    let settled = async {
        suite
            .provision(spec.clone())
            .await
            .map_err(|s| anyhow!("Provision: {}", describe(&s)))?;
        suite.settled(&id, 1).await
    }
    .await;
    suite.remove(&id).await?;
    let state = settled?;
    ensure!(
        state.phase == Phase::Ready as i32,
        "the live lesson configured by {file} settled {}",
        summary(&state)
    );
    pass(format!("{file} applied; READY"))
}

/// `configuration-shell`: a live lesson with a shell configuration of about 200 KiB becomes
/// READY.
pub async fn configuration_shell(suite: &mut Suite) -> Verdict {
    if !claimed_types(suite).contains(&ConfigurationType::Shell) {
        return Ok(Outcome::Skip(format!(
            "the agent lists its configuration types without `{CONFIGURATION_SHELL}`"
        )));
    }
    // Past Linux's 128 KiB limit on one argument: the agent must not run it as `sh -c`
    // (PROTOCOL.md [V5]).
    let script = format!(
        "{}echo antidote-conformance shell configuration\n",
        "# padding past the 128 KiB one argument may hold, within the 256 KiB of a file\n"
            .repeat(2600)
    );
    configured(suite, shell("conformance.sh", &script), None).await
}

/// `configuration-python`: a live lesson with a python configuration becomes READY.
pub async fn configuration_python(suite: &mut Suite) -> Verdict {
    let configuration = proto::StageConfiguration {
        r#type: ConfigurationType::Python as i32,
        file_name: "conformance.py".into(),
        contents: b"print('antidote-conformance python configuration')\n".to_vec(),
        driver: String::new(),
    };
    configured(suite, configuration, None).await
}

/// `configuration-ansible`: a live lesson with an ansible playbook becomes READY.
pub async fn configuration_ansible(suite: &mut Suite) -> Verdict {
    let playbook = "- hosts: all\n  gather_facts: false\n  tasks:\n    - name: antidote-conformance\n      raw: echo antidote-conformance ansible configuration\n";
    let configuration = proto::StageConfiguration {
        r#type: ConfigurationType::Ansible as i32,
        file_name: "conformance.yml".into(),
        contents: playbook.as_bytes().to_vec(),
        driver: String::new(),
    };
    configured(suite, configuration, None).await
}

/// `configuration-napalm`: a live lesson of the NAPALM image with a napalm configuration
/// becomes READY.
pub async fn configuration_napalm(suite: &mut Suite) -> Verdict {
    let image = suite
        .settings
        .napalm_image
        .clone()
        .context("no --napalm-image")?;
    let configuration = proto::StageConfiguration {
        r#type: ConfigurationType::Napalm as i32,
        file_name: format!("solo-{}.txt", suite.settings.napalm_driver),
        contents: b"hostname antidote-conformance\n".to_vec(),
        driver: suite.settings.napalm_driver.clone(),
    };
    configured(suite, configuration, Some(image)).await
}

/// How long a Jupyter guide endpoint may take, after READY, to serve the generation's notebook
/// (PROTOCOL.md [V7]: it must have handed it over by READY and should be serving it).
const NOTEBOOK_PATIENCE: Duration = Duration::from_secs(90);

/// A notebook whose one markdown cell says `marker`.
fn notebook(marker: &str) -> Vec<u8> {
    serde_json::json!({
        "cells": [{"cell_type": "markdown", "metadata": {}, "source": [marker]}],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 5,
    })
    .to_string()
    .into_bytes()
}

/// `guide-jupyter`: a live lesson with a Jupyter guide endpoint (PROTOCOL.md [V7]) becomes
/// READY, its `web` presentation serves the spec's notebook as `/files/guide.ipynb`, and after
/// a stage change the new generation's notebook.
pub async fn guide_jupyter(suite: &mut Suite) -> Verdict {
    let id = new_id();
    let mut spec = suite.solo(&id);
    let guide = |stage: u32| proto::Endpoint {
        name: "jupyter-guide".into(),
        image: Some(proto::Image {
            slug: "jupyter".into(),
            flavor: proto::Flavor::Untrusted as i32,
            ..Default::default()
        }),
        additional_ports: vec![],
        presentations: vec![proto::Presentation {
            name: "web".into(),
            r#type: PresentationType::Http as i32,
            port: 8888,
        }],
        configuration: None,
        jupyter_guide: Some(proto::JupyterGuide {
            notebook: notebook(&format!("antidote-conformance guide, stage {stage}")),
        }),
    };
    spec.endpoints.push(guide(0));
    let outcome = async {
        let mut waited = Vec::new();
        for (generation, stage) in [(1, 0), (2, 1)] {
            let mut spec = spec.clone();
            spec.generation = generation;
            spec.stage = stage;
            spec.endpoints[1] = guide(stage);
            for endpoint in &mut spec.endpoints[..1] {
                if let Some(configuration) = &mut endpoint.configuration {
                    configuration.file_name = format!("stage{stage}.sh");
                }
            }
            suite
                .provision(spec)
                .await
                .map_err(|s| anyhow!("Provision of generation {generation}: {}", describe(&s)))?;
            let state = suite.settled(&id, generation).await?;
            ensure!(
                state.phase == Phase::Ready as i32,
                "generation {generation} (stage {stage}) with a Jupyter guide settled {}",
                summary(&state)
            );
            let web = state
                .endpoints
                .iter()
                .find(|e| e.name == "jupyter-guide")
                .and_then(|e| e.presentations.iter().find(|p| p.name == "web"))
                .context("READY without the jupyter-guide endpoint's `web` presentation")?;
            let url = format!("http://{}/files/guide.ipynb", web.address);
            let marker = format!("antidote-conformance guide, stage {stage}");
            let started = std::time::Instant::now();
            loop {
                let last = match crate::probe::get(&url).await {
                    Ok(answer)
                        if answer.status == hyper::StatusCode::OK
                            && answer.body.contains(&marker) =>
                    {
                        break;
                    }
                    Ok(answer) => format!(
                        "{} {}",
                        answer.status,
                        answer.body.chars().take(200).collect::<String>()
                    ),
                    Err(err) => format!("{err:#}"),
                };
                ensure!(
                    started.elapsed() < NOTEBOOK_PATIENCE,
                    "GET {url} did not serve stage {stage}'s notebook within {NOTEBOOK_PATIENCE:?} \
                     of READY; last answer: {last}"
                );
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            waited.push(format!(
                "stage {stage} {:.1} s",
                started.elapsed().as_secs_f64()
            ));
        }
        anyhow::Ok(waited)
    }
    .await;
    suite.remove(&id).await?;
    let waited = outcome?;
    pass(format!(
        "/files/guide.ipynb served each generation's notebook (after READY: {})",
        waited.join(", ")
    ))
}

/// Provisions `spec` (a new live lesson that is bound to fail), checks the answer is not a
/// refusal nor FAILED at once, waits until it settles, removes it; returns the settled state.
async fn failing(
    suite: &mut Suite,
    spec: proto::LessonSpec,
) -> anyhow::Result<proto::LiveLessonState> {
    let id = spec.live_lesson_id.clone();
    let settled = async {
        let answered = suite
            .provision(spec)
            .await
            .map_err(|s| {
                anyhow!(
                    "Provision was refused ({}); the failure belongs on the state",
                    describe(&s)
                )
            })?
            .into_inner()
            .state
            .context("Provision answered without a state")?;
        ensure!(
            answered.phase != Phase::Failed as i32,
            "Provision answered FAILED at once; it must accept and fail later: {}",
            summary(&answered)
        );
        suite.settled(&id, 1).await
    }
    .await;
    suite.remove(&id).await?;
    settled
}

/// Checks `state` is FAILED with a reason naming `what`.
fn failed_naming(state: &proto::LiveLessonState, what: &str) -> Verdict {
    ensure!(
        state.phase == Phase::Failed as i32,
        "expected FAILED, the live lesson settled {}",
        summary(state)
    );
    ensure!(
        state.reason.contains(what),
        "the FAILED reason does not name `{what}`: {:?}",
        state.reason
    );
    // Every Watch event carries the reason (PROTOCOL.md [R10]).
    ensure!(
        state.reason.len() <= 4096,
        "the FAILED reason is {} bytes, over the 4 KiB a reason may hold",
        state.reason.len()
    );
    pass(format!("FAILED: {}", state.reason))
}

/// `failed-image`: a live lesson of `--bad-image` is accepted, then FAILED with a reason naming
/// the slug (PROTOCOL.md [R5]).
pub async fn failed_image(suite: &mut Suite) -> Verdict {
    let mut spec = suite.solo(&new_id());
    let slug = suite.settings.bad_image.clone();
    spec.endpoints[0].image.get_or_insert_default().slug = slug.clone();
    let state = failing(suite, spec).await?;
    failed_naming(&state, &slug)
}

/// `failed-config`: a live lesson whose shell configuration is `--failing-config` is FAILED
/// with a reason naming the configuration's file (PROTOCOL.md [R3]).
pub async fn failed_config(suite: &mut Suite) -> Verdict {
    if !claimed_types(suite).contains(&ConfigurationType::Shell) {
        return Ok(Outcome::Skip(format!(
            "--failing-config is a shell script and the agent does not list `{CONFIGURATION_SHELL}`"
        )));
    }
    let mut spec = suite.solo(&new_id());
    let script = suite.settings.failing_config.clone();
    spec.endpoints[0].configuration = Some(shell("fails-on-purpose.sh", &script));
    let state = failing(suite, spec).await?;
    failed_naming(&state, "fails-on-purpose.sh")
}

/// `failed-probe`: a live lesson whose one presentation is on `--silent-port` (SSH when the
/// agent offers it) is FAILED with a reason naming the presentation (PROTOCOL.md [R2]).
pub async fn failed_probe(suite: &mut Suite) -> Verdict {
    let mut spec = suite.solo(&new_id());
    let kind = if suite.offers(capabilities::PRESENTATION_SSH) {
        PresentationType::Ssh
    } else if suite.offers(capabilities::PRESENTATION_HTTP) {
        PresentationType::Http
    } else {
        return Ok(Outcome::Skip(
            "the agent offers no presentation type to probe".into(),
        ));
    };
    spec.endpoints[0].presentations = vec![proto::Presentation {
        name: "silent".into(),
        r#type: kind as i32,
        port: suite.settings.silent_port,
    }];
    let state = failing(suite, spec).await?;
    failed_naming(&state, "silent")
}

/// `capacity-refusal`: the agent filled to `max_live_lessons` refuses one more live lesson with
/// RESOURCE_EXHAUSTED, CAPACITY_EXHAUSTED (`max_live_lessons` in the metadata), yet accepts a
/// held one again; the handshake counts the held ones; a removal frees a place (PROTOCOL.md
/// [C1], [C2]).
pub async fn capacity_refusal(suite: &mut Suite) -> Verdict {
    let capacity = handshake_capacity(suite).await?;
    let max = capacity.max_live_lessons;
    if max == 0 {
        return Ok(Outcome::Skip(
            "capacity.max_live_lessons is 0: the agent sets no limit to reach".into(),
        ));
    }
    let free = max.saturating_sub(capacity.live_lessons);
    let most = suite.settings.capacity_fill;
    if free > most {
        return Ok(Outcome::Skip(format!(
            "{free} of {max} places are free: more than the {most} this check fills \
             (--capacity-fill {most}; raise it, or run the agent with a lower limit)"
        )));
    }
    let mut filled = Vec::new();
    let outcome = fill_and_refuse(suite, max, free, &mut filled).await;
    for id in &filled {
        suite.remove(id).await?;
    }
    let detail = outcome?;
    // A removal frees a place.
    let again = new_id();
    let accepted = suite.provision(suite.solo(&again)).await;
    suite.remove(&again).await?;
    accepted.map_err(|s| {
        anyhow!(
            "after the removals, a new live lesson is still refused: {}",
            describe(&s)
        )
    })?;
    // Removed while still being created: nothing of them may be left (PROTOCOL.md [D2]).
    filled.push(again);
    let left: Vec<String> = suite
        .list_all(0)
        .await?
        .into_iter()
        .map(|s| s.live_lesson_id)
        .filter(|id| filled.contains(id))
        .collect();
    ensure!(
        left.is_empty(),
        "List still shows {left:?}, removed right after Provision (objects created after the \
         removal looked for them?)"
    );
    pass(format!(
        "{detail}; after the removals one more is accepted; List shows none of them"
    ))
}

/// The handshake's capacity now.
async fn handshake_capacity(suite: &mut Suite) -> anyhow::Result<proto::Capacity> {
    suite
        .client
        .handshake(suite.handshake_request())
        .await
        .map_err(|s| anyhow!("Handshake: {}", describe(&s)))?
        .into_inner()
        .capacity
        .context("the handshake has no capacity")
}

/// Fills the `free` places (recording them in `filled`), then checks the refusal, the held
/// live lesson accepted again and the handshake's count.
async fn fill_and_refuse(
    suite: &mut Suite,
    max: u32,
    free: u32,
    filled: &mut Vec<String>,
) -> anyhow::Result<String> {
    for n in 0..free {
        let id = new_id();
        filled.push(id.clone());
        suite.provision(suite.solo(&id)).await.map_err(|s| {
            anyhow!(
                "live lesson {} of the {free} free places was refused: {}",
                n + 1,
                describe(&s)
            )
        })?;
    }
    let extra = new_id();
    let refusal = expect_refusal(
        suite.provision(suite.solo(&extra)).await,
        Code::ResourceExhausted,
        "CAPACITY_EXHAUSTED",
    )
    .with_context(|| format!("Provision of a new live lesson with {max} of {max} held"))?;
    suite.created.remove(&extra);
    refusal.expect("max_live_lessons", &max.to_string())?;
    if let Some(held) = filled.first() {
        suite.provision(suite.solo(held)).await.map_err(|s| {
            anyhow!(
                "a held live lesson was refused at capacity: {}",
                describe(&s)
            )
        })?;
    }
    let capacity = handshake_capacity(suite).await?;
    if capacity.live_lessons != max {
        bail!(
            "the handshake counts {} live lessons held, with {max} held",
            capacity.live_lessons
        );
    }
    Ok(format!(
        "{free} filled to {max}; one more refused (CAPACITY_EXHAUSTED, max_live_lessons {max}); \
         a held one accepted again; the handshake counts {max}"
    ))
}
