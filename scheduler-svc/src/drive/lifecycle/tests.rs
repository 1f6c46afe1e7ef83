//! Table tests of every lifecycle decision. Each group has one `check_…` helper that asks the
//! decision and renders its answer as a line of text, compared with what is expected, in the
//! style of placement's `check`. Live lessons start from [`fresh`] (PENDING, unplaced, first
//! generation) and change one thing.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::Duration;

use tonic::Code;
use tonic_types::{ErrorDetails, StatusExt as _};
use uuid::Uuid;

use super::*;
use crate::model::{EndpointInfo, Millis, SessionId};

const SSH: &str = "presentation.ssh";
const HTTP: &str = "presentation.http";

/// A live lesson just requested: PENDING, on no agent, generation 1 never observed.
fn fresh() -> LiveLesson {
    LiveLesson {
        id: LiveLessonId(Uuid::from_u128(7)),
        session_id: SessionId(Uuid::from_u128(1)),
        lesson_slug: "hello".into(),
        stage: 0,
        generation: 1,
        observed_generation: 0,
        status: Status::Pending,
        reason: String::new(),
        deleting: false,
        agent: None,
        handle: Vec::new(),
        endpoints: vec![endpoint()],
        persistent: false,
        created_at: Millis(0),
        last_active: Millis(0),
        pool_session: None,
    }
}

fn endpoint() -> EndpointInfo {
    EndpointInfo {
        name: "web".into(),
        presentations: Vec::new(),
        healthy: 1,
        total: 1,
    }
}

/// `fresh()` placed on `agent` in `status` (settled ones observed at their generation).
fn on(agent: &str, status: Status) -> LiveLesson {
    LiveLesson {
        agent: Some(agent.into()),
        status,
        observed_generation: if status.is_settled() { 1 } else { 0 },
        handle: b"h".to_vec(),
        ..fresh()
    }
}

/// A READY live lesson whose stage changed: CONFIGURING in generation 2 (as the store writes it).
fn stage_changed(agent: &str) -> LiveLesson {
    LiveLesson {
        stage: 1,
        generation: 2,
        status: Status::Configuring,
        reason: "stage change to 1".into(),
        ..on(agent, Status::Ready)
    }
}

/// A warm-pool member a learner claimed: READY, its pool session kept, its owner the learner's.
fn claimed_member(agent: &str) -> LiveLesson {
    LiveLesson {
        pool_session: Some(SessionId(Uuid::from_u128(99))),
        ..on(agent, Status::Ready)
    }
}

fn deleting(lesson: LiveLesson) -> LiveLesson {
    LiveLesson {
        deleting: true,
        generation: lesson.generation + 1,
        status: Status::Terminating,
        ..lesson
    }
}

fn report(generation: u64, status: Option<Status>, reason: &str) -> AgentReport {
    AgentReport {
        id: fresh().id,
        generation,
        status,
        reason: reason.into(),
        endpoints: vec![endpoint()],
        handle: Vec::new(),
    }
}

/// A failed call to agent `a`, with an ErrorInfo of `reason` when given.
fn failed(call: &'static str, code: Code, message: &str, reason: Option<&str>) -> Error {
    let status = match reason {
        Some(reason) => tonic::Status::with_error_details(
            code,
            message,
            ErrorDetails::with_error_info(reason, "antidote.io", HashMap::new()),
        ),
        None => tonic::Status::new(code, message),
    };
    Error::Agent {
        agent: "a".into(),
        call,
        status,
    }
}

fn not_found() -> Error {
    failed(
        "Get",
        Code::NotFound,
        "no such live lesson",
        Some("LIVE_LESSON_NOT_FOUND"),
    )
}

fn unavailable() -> Error {
    failed("Provision", Code::Unavailable, "connection refused", None)
}

/// A call the transport cut off (the agent was killed mid-call): UNKNOWN with a source.
fn cut_off() -> Error {
    Error::Agent {
        agent: "a".into(),
        call: "Provision",
        status: tonic::Status::from_error(Box::new(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "connection reset",
        ))),
    }
}

/// A ready agent offering SSH and HTTP presentations, with `load` of `capacity` (0: no limit).
fn agent(name: &str, load: u32, capacity: u32) -> Candidate {
    Candidate {
        name: name.into(),
        availability: Availability::Ready,
        drained: false,
        capabilities: Some(BTreeSet::from([SSH.to_owned(), HTTP.to_owned()])),
        labels: BTreeMap::from([("region".to_owned(), "eu".to_owned())]),
        load,
        capacity,
    }
}

fn lost(candidate: Candidate) -> Candidate {
    Candidate {
        availability: Availability::Lost,
        ..candidate
    }
}

fn down(candidate: Candidate) -> Candidate {
    Candidate {
        availability: Availability::Down("unavailable".into()),
        ..candidate
    }
}

fn drained(candidate: Candidate) -> Candidate {
    Candidate {
        drained: true,
        ..candidate
    }
}

/// Needs an SSH presentation on an agent carrying every label of `requires`.
fn needs(requires: &[(&str, &str)]) -> Result<Needs, String> {
    Ok(Needs {
        capabilities: vec![SSH],
        requires: requires
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        prefers: BTreeMap::new(),
    })
}

fn moved_from(agent: &str) -> PlacementRecord {
    PlacementRecord {
        moved_from: Some(agent.into()),
        ..PlacementRecord::default()
    }
}

/// An observation as one line: status, reason, then what else it writes.
fn line(observation: &Observation) -> String {
    let mut line = format!("{} `{}`", observation.status, observation.reason);
    if let Some(agent) = &observation.agent {
        line += &format!(" agent={agent}");
    }
    if observation.decision.is_some() {
        line += " decision";
    }
    if let Some(endpoints) = &observation.endpoints {
        let healthy: Vec<_> = endpoints.iter().map(|e| e.healthy.to_string()).collect();
        line += &format!(" healthy={}", healthy.join(","));
    }
    line
}

fn unplaced_line(unplaced: &Unplaced) -> String {
    match unplaced {
        Unplaced::Yet(reason) => format!("yet: {reason}"),
        Unplaced::Busy { reason, .. } => format!("busy: {reason}"),
        Unplaced::Never(reason) => format!("never: {reason}"),
    }
}

fn setback_line(setback: &Setback) -> String {
    match setback {
        Setback::Fail(reason) => format!("fail: {reason}"),
        Setback::Retry { status, reason } => format!("retry {status}: {reason}"),
    }
}

// --- route: what a run does with the live lesson it read ---

#[track_caller]
fn check_route(lesson: &LiveLesson, recovering: bool, suspected_by: Option<&str>, expect: &str) {
    let suspicion = suspected_by.map(|agent| Suspicion {
        agent: agent.into(),
        report: None,
    });
    let got = match route(lesson, recovering, suspicion) {
        Route::Remove => "remove".to_owned(),
        Route::Check(suspicion) => format!("check on {}", suspicion.agent),
        Route::Provision { recovering } => format!("provision (recovering: {recovering})"),
        Route::Idle => "idle".to_owned(),
    };
    assert_eq!(got, expect);
}

#[test]
fn removal_comes_before_anything_else() {
    check_route(&deleting(fresh()), false, None, "remove");
    check_route(&deleting(on("a", Status::Booting)), false, None, "remove");
    check_route(&deleting(on("a", Status::Ready)), true, Some("a"), "remove");
}

#[test]
fn settled_lessons_need_no_run() {
    check_route(&on("a", Status::Ready), false, None, "idle");
    check_route(&on("a", Status::Failed), false, None, "idle");
    check_route(&claimed_member("a"), false, None, "idle");
}

#[test]
fn unsettled_lessons_and_new_generations_are_provisioned() {
    check_route(&fresh(), false, None, "provision (recovering: false)");
    check_route(
        &on("a", Status::Booting),
        false,
        None,
        "provision (recovering: false)",
    );
    check_route(
        &stage_changed("a"),
        false,
        None,
        "provision (recovering: false)",
    );
    // A retry after FAILED: a new generation, PENDING again.
    let retry = LiveLesson {
        generation: 2,
        status: Status::Pending,
        ..on("a", Status::Failed)
    };
    check_route(&retry, false, None, "provision (recovering: false)");
}

#[test]
fn an_agent_restart_provisions_even_settled_lessons() {
    check_route(
        &on("a", Status::Ready),
        true,
        None,
        "provision (recovering: true)",
    );
    // A recovery wins over a suspicion: Recover finds out by itself.
    check_route(
        &on("a", Status::Ready),
        true,
        Some("a"),
        "provision (recovering: true)",
    );
}

#[test]
fn a_suspicion_is_checked_only_on_a_ready_lesson_of_that_agent() {
    check_route(&on("a", Status::Ready), false, Some("a"), "check on a");
    // Moved to another agent since the Watch said so.
    check_route(&on("b", Status::Ready), false, Some("a"), "idle");
    // FAILED already: nothing more to find out.
    check_route(&on("a", Status::Failed), false, Some("a"), "idle");
    // A new generation is under way: provisioning finds out by itself.
    check_route(
        &stage_changed("a"),
        false,
        Some("a"),
        "provision (recovering: false)",
    );
}

// --- where a live lesson runs ---

#[track_caller]
fn check_recorded(agent: Option<Presence>, expect: &str) {
    let got = match on_recorded("a", agent.map(|presence| ("agent a", presence))) {
        Ok(agent) => format!("on {agent}"),
        Err(unplaced) => unplaced_line(&unplaced),
    };
    assert_eq!(got, expect);
}

#[test]
fn a_recorded_agent_is_used_while_it_is_ready() {
    check_recorded(Some(Presence::Ready), "on agent a");
    check_recorded(
        Some(Presence::Unavailable("connection refused".into())),
        "yet: agent `a` is unavailable: connection refused",
    );
}

#[test]
fn a_lost_or_unconfigured_recorded_agent_is_never_called() {
    check_recorded(
        Some(Presence::Lost),
        "yet: agent `a` is lost; moving to another agent",
    );
    check_recorded(
        None,
        "never: agent `a` holding this live lesson is no longer configured",
    );
}

#[track_caller]
fn check_choose(
    record: &PlacementRecord,
    needs: Result<Needs, String>,
    agents: &[Candidate],
    expect: &str,
) {
    let got = match choose(&fresh(), record, needs, agents) {
        Ok(decision) => format!("chose {}", decision.agent),
        Err(unplaced) => unplaced_line(&unplaced),
    };
    assert_eq!(got, expect);
}

#[test]
fn placement_chooses_the_least_loaded_fitting_agent() {
    let none = PlacementRecord::default();
    check_choose(
        &none,
        needs(&[]),
        &[agent("a", 3, 0), agent("b", 1, 0)],
        "chose b",
    );
    check_choose(
        &none,
        needs(&[("region", "eu")]),
        &[down(agent("a", 0, 0)), agent("b", 5, 0)],
        "chose b",
    );
}

#[test]
fn only_busy_agents_make_a_lesson_wait_for_room() {
    let none = PlacementRecord::default();
    check_choose(
        &none,
        needs(&[]),
        &[agent("a", 2, 2)],
        "busy: no agent can take lesson `hello` now: `a`: full 2/2",
    );
    check_choose(
        &none,
        needs(&[]),
        &[down(agent("a", 0, 0))],
        "busy: no agent can take lesson `hello` now: `a`: unavailable",
    );
}

#[test]
fn a_drained_agent_makes_a_lesson_wait_not_fail() {
    let none = PlacementRecord::default();
    check_choose(
        &none,
        needs(&[]),
        &[drained(agent("a", 0, 0))],
        "busy: no agent can take lesson `hello` now: `a`: drained",
    );
    check_choose(
        &none,
        needs(&[]),
        &[drained(agent("a", 0, 0)), agent("b", 9, 10)],
        "chose b",
    );
}

#[test]
fn what_no_agent_could_ever_take_fails_at_once() {
    let none = PlacementRecord::default();
    check_choose(
        &none,
        needs(&[("region", "us")]),
        &[agent("a", 0, 0)],
        "never: no agent could ever take lesson `hello`: no agent has label region=us (`a`: missing label region=us (has region=eu))",
    );
    check_choose(
        &none,
        Err("the request requires region=us, the lesson region=eu".into()),
        &[agent("a", 0, 0)],
        "never: the request requires region=us, the lesson region=eu",
    );
}

#[test]
fn a_lesson_moved_off_a_lost_agent_does_not_count_on_it() {
    let moved = moved_from("a");
    check_choose(
        &moved,
        needs(&[]),
        &[lost(agent("a", 0, 0))],
        "never: agent `a` lost; no agent could ever take lesson `hello`: no agent has capability presentation.ssh (no agents are configured)",
    );
    check_choose(
        &moved,
        needs(&[]),
        &[lost(agent("a", 0, 0)), agent("b", 1, 1)],
        "busy: agent `a` lost; no agent can take lesson `hello` now: `a`: lost; `b`: full 1/1",
    );
    check_choose(
        &moved,
        needs(&[]),
        &[lost(agent("a", 0, 0)), agent("b", 0, 0)],
        "chose b",
    );
    // Back from being lost, it may take the live lesson again.
    check_choose(&moved, needs(&[]), &[agent("a", 0, 0)], "chose a");
}

// --- claim: the write that places a live lesson, and the first Provision's flag ---

#[track_caller]
fn check_new(
    lesson: &LiveLesson,
    chosen_now: bool,
    from: Option<&str>,
    recovering: bool,
    expect: bool,
) {
    assert_eq!(is_new(lesson, chosen_now, from, recovering), expect);
}

#[test]
fn only_a_first_placement_is_new() {
    check_new(&fresh(), true, None, false, true);
    // Moved off a lost agent: that agent was asked before.
    check_new(&fresh(), true, Some("a"), false, false);
    // Already on an agent (a retry, a restart of ours, a stage change).
    check_new(&on("a", Status::Booting), false, None, false, false);
    check_new(&stage_changed("a"), false, None, false, false);
    check_new(&fresh(), true, None, true, false);
}

#[track_caller]
fn check_claim(lesson: &LiveLesson, decided: bool, from: Option<&str>, expect: &str) {
    let decision = decided.then(|| Decision {
        agent: "b".into(),
        matched: BTreeMap::new(),
        load: 0,
        capacity: 0,
        excluded: Vec::new(),
        reason: "least loaded".into(),
    });
    let got = match claim(lesson, "b", decision.as_ref(), from) {
        None => "nothing to write".to_owned(),
        Some(claim) => format!(
            "{}{}",
            line(&claim.observation),
            if claim.counts_load { " +load" } else { "" }
        ),
    };
    assert_eq!(got, expect);
}

#[test]
fn a_claim_boots_a_pending_lesson_on_its_agent() {
    check_claim(
        &fresh(),
        true,
        None,
        "BOOTING `placed on agent `b`` agent=b decision +load",
    );
    check_claim(
        &fresh(),
        true,
        Some("a"),
        "BOOTING `agent `a` lost; moved to `b`` agent=b decision +load",
    );
    // A retry after FAILED on its recorded agent: BOOTING again, counted once already.
    let retry = LiveLesson {
        generation: 2,
        status: Status::Pending,
        ..on("b", Status::Failed)
    };
    check_claim(&retry, false, None, "BOOTING `placed on agent `b`` agent=b");
}

#[test]
fn a_placed_lesson_past_pending_is_not_claimed_again() {
    check_claim(&on("b", Status::Booting), false, None, "nothing to write");
    check_claim(&stage_changed("b"), false, None, "nothing to write");
    check_claim(&claimed_member("b"), false, None, "nothing to write");
}

// --- call: Provision or Recover ---

#[track_caller]
fn check_call(lesson: &LiveLesson, recovering: bool, offers_recover: bool, expect: Call) {
    assert_eq!(call(lesson, recovering, offers_recover, true), expect);
}

#[test]
fn recover_only_after_a_restart_by_a_handle_the_agent_can_take() {
    check_call(&on("a", Status::Ready), true, true, Call::Recover);
    // Not restarted, no handle to recover by, or an agent without Recover: Provision.
    check_call(
        &on("a", Status::Ready),
        false,
        true,
        Call::Provision { new: true },
    );
    let no_handle = LiveLesson {
        handle: Vec::new(),
        ..on("a", Status::Ready)
    };
    check_call(&no_handle, true, true, Call::Provision { new: true });
    check_call(
        &on("a", Status::Ready),
        true,
        false,
        Call::Provision { new: true },
    );
}

#[test]
fn a_recover_that_finds_nothing_provisions_again() {
    assert_eq!(
        after_recover_error(&not_found()),
        Some(Call::Provision { new: false })
    );
    let plain = failed("Recover", Code::NotFound, "gone", None);
    assert_eq!(
        after_recover_error(&plain),
        Some(Call::Provision { new: false })
    );
    assert_eq!(after_recover_error(&unavailable()), None);
}

// --- retry, backoff and FAILED with a reason ---

#[track_caller]
fn check_error(err: &Error, past_deadline: bool, expect: &str) {
    let got = setback_line(&after_call_error(
        &on("a", Status::Booting),
        err,
        past_deadline,
    ));
    assert_eq!(got, expect);
}

#[test]
fn retryable_agent_errors_are_retried_until_the_deadline() {
    check_error(
        &unavailable(),
        false,
        "retry BOOTING: agent `a` Provision failed: code: 'The service is currently unavailable', message: \"connection refused\"",
    );
    check_error(
        &unavailable(),
        true,
        "fail: agent `a` Provision: connection refused (Unavailable)",
    );
    let slow = failed("Provision", Code::DeadlineExceeded, "timeout expired", None);
    check_error(
        &slow,
        true,
        "fail: agent `a` Provision: timeout expired (DeadlineExceeded)",
    );
}

#[test]
fn a_call_the_transport_cut_off_is_retried() {
    let got = setback_line(&after_call_error(
        &on("a", Status::Booting),
        &cut_off(),
        false,
    ));
    assert!(got.starts_with("retry BOOTING: "), "{got}");
}

#[test]
fn final_agent_errors_fail_with_the_agents_reason() {
    let invalid = failed(
        "Provision",
        Code::InvalidArgument,
        "spec.endpoints[0].image: empty",
        Some("INVALID_SPEC"),
    );
    check_error(
        &invalid,
        false,
        "fail: agent `a` Provision: spec.endpoints[0].image: empty (InvalidArgument, INVALID_SPEC)",
    );
    check_error(
        &failed("Provision", Code::Internal, "boom", None),
        false,
        "fail: agent `a` Provision: boom (Internal)",
    );
    // RESOURCE_EXHAUSTED is retryable, but a request too large stays too large.
    let too_large = failed(
        "Provision",
        Code::ResourceExhausted,
        "spec of 5 MiB",
        Some("REQUEST_TOO_LARGE"),
    );
    check_error(
        &too_large,
        false,
        "fail: agent `a` Provision: spec of 5 MiB (ResourceExhausted, REQUEST_TOO_LARGE)",
    );
}

#[test]
fn errors_not_from_an_agent_fail_with_their_own_text() {
    let err = Error::InvalidArgument {
        field: "stage",
        reason: "out of range".into(),
    };
    assert_eq!(failure_reason(&err), err.to_string());
    check_error(&err, false, &format!("fail: {err}"));
}

#[track_caller]
fn check_unplaced(lesson: &LiveLesson, past_deadline: bool, expect: &str) {
    let got = setback_line(&unplaced(
        lesson,
        "no agent can take it now".into(),
        past_deadline,
    ));
    assert_eq!(got, expect);
}

#[test]
fn an_unplaced_lesson_waits_pending_until_its_deadline() {
    check_unplaced(&fresh(), false, "retry PENDING: no agent can take it now");
    check_unplaced(&fresh(), true, "fail: no agent can take it now");
    // Its agent away: it keeps its status while it waits.
    check_unplaced(
        &on("a", Status::Booting),
        false,
        "retry BOOTING: no agent can take it now",
    );
}

#[test]
fn a_progress_note_is_written_only_when_it_changes_something() {
    let waiting = LiveLesson {
        reason: "busy".into(),
        ..fresh()
    };
    assert!(note(&waiting, Status::Pending, "busy".into()).is_none());
    let written = note(&waiting, Status::Pending, "still busy".into()).map(|o| line(&o));
    assert_eq!(written.as_deref(), Some("PENDING `still busy`"));
    let written = note(&waiting, Status::Booting, "busy".into()).map(|o| line(&o));
    assert_eq!(written.as_deref(), Some("BOOTING `busy`"));
}

#[track_caller]
fn check_backoff(failures: u32, id: u128, expect: Duration) {
    let config = ReconcilerConfig {
        backoff_initial: Duration::from_millis(100),
        backoff_max: Duration::from_secs(10),
        ..ReconcilerConfig::default()
    };
    assert_eq!(
        backoff(&config, LiveLessonId(Uuid::from_u128(id)), failures),
        expect
    );
}

#[test]
fn backoff_doubles_from_the_first_delay_up_to_the_cap() {
    // An id whose low bits are a multiple of 1000 gets no jitter.
    check_backoff(1, 1000, Duration::from_millis(100));
    check_backoff(2, 1000, Duration::from_millis(200));
    check_backoff(4, 1000, Duration::from_millis(800));
    check_backoff(8, 1000, Duration::from_secs(10));
    check_backoff(40, 1000, Duration::from_secs(10));
    check_backoff(0, 1000, Duration::from_millis(100));
}

#[test]
fn backoff_is_spread_by_up_to_a_fifth_from_the_id() {
    check_backoff(1, 500, Duration::from_millis(110));
    check_backoff(1, 999, Duration::from_micros(119_980));
    check_backoff(8, 999, Duration::from_micros(11_998_000));
}

// --- await: what the agent reported, recorded, then settled, failed or waited for ---

/// Asks as the runtime does: what to record, then (with the status recorded) whether it
/// settled or is overdue.
#[track_caller]
fn check_settle(current: &LiveLesson, report: &AgentReport, past_deadline: bool, expect: &str) {
    let settle = settle(current, report);
    let mut now = current.clone();
    let mut got = Vec::new();
    if let Some(observation) = &settle.record {
        got.push(format!("record {}", line(observation)));
        now.status = observation.status;
    }
    let timeout = Duration::from_secs(600);
    got.push(match settle.settled {
        Some(true) => "settled READY".to_owned(),
        Some(false) => "settled FAILED".to_owned(),
        None => match overdue(&now, report, past_deadline, timeout) {
            Some(reason) => format!("fail: {reason}"),
            None => "wait".to_owned(),
        },
    });
    assert_eq!(got.join("; "), expect);
}

#[test]
fn a_settled_report_of_the_generation_is_recorded_and_settles_it() {
    check_settle(
        &on("a", Status::Booting),
        &report(1, Some(Status::Ready), "ready"),
        false,
        "record READY `ready` healthy=1; settled READY",
    );
    check_settle(
        &on("a", Status::Configuring),
        &report(1, Some(Status::Failed), "probe web failed"),
        false,
        "record FAILED `probe web failed` healthy=1; settled FAILED",
    );
    // Recovered after a restart, READY as recorded: written again (endpoints, handle).
    check_settle(
        &on("a", Status::Ready),
        &report(1, Some(Status::Ready), "recovered"),
        false,
        "record READY `recovered` healthy=1; settled READY",
    );
    // Settled even past the deadline: what the agent reached wins.
    check_settle(
        &on("a", Status::Configuring),
        &report(1, Some(Status::Ready), "ready"),
        true,
        "record READY `ready` healthy=1; settled READY",
    );
}

#[test]
fn an_unsettled_report_is_recorded_when_the_status_changes_then_waited_for() {
    check_settle(
        &on("a", Status::Booting),
        &report(1, Some(Status::Configuring), "stage 0"),
        false,
        "record CONFIGURING `stage 0` healthy=1; wait",
    );
    check_settle(
        &on("a", Status::Booting),
        &report(1, Some(Status::Booting), "pulling"),
        false,
        "wait",
    );
}

#[test]
fn a_report_of_another_generation_or_of_no_status_records_nothing() {
    check_settle(
        &stage_changed("a"),
        &report(1, Some(Status::Ready), "ready at stage 0"),
        false,
        "wait",
    );
    check_settle(
        &on("a", Status::Booting),
        &report(1, None, "being removed"),
        false,
        "wait",
    );
}

#[test]
fn past_the_deadline_an_unsettled_lesson_fails_naming_its_last_status() {
    check_settle(
        &on("a", Status::Booting),
        &report(
            1,
            Some(Status::Configuring),
            "probe web: connection refused",
        ),
        true,
        "record CONFIGURING `probe web: connection refused` healthy=1; fail: not READY within 10m (last status CONFIGURING: probe web: connection refused)",
    );
    check_settle(
        &on("a", Status::Booting),
        &report(1, Some(Status::Booting), "pulling"),
        true,
        "fail: not READY within 10m (last status BOOTING: pulling)",
    );
}

#[test]
fn a_stage_change_is_driven_on_its_agent_to_ready_again() {
    let lesson = stage_changed("a");
    check_route(&lesson, false, None, "provision (recovering: false)");
    check_recorded(Some(Presence::Ready), "on agent a");
    check_claim(&lesson, false, None, "nothing to write");
    check_new(&lesson, false, None, false, false);
    // CONFIGURING is what the stage change recorded: nothing to write until it settles.
    check_settle(
        &lesson,
        &report(2, Some(Status::Configuring), "stage 1"),
        false,
        "wait",
    );
    check_settle(
        &lesson,
        &report(2, Some(Status::Ready), "stage 1 ready"),
        false,
        "record READY `stage 1 ready` healthy=1; settled READY",
    );
}

#[test]
fn a_claimed_pool_member_at_another_stage_is_reconfigured_where_it_runs() {
    let claimed = LiveLesson {
        stage: 2,
        generation: 2,
        status: Status::Configuring,
        ..claimed_member("a")
    };
    check_route(&claimed, false, None, "provision (recovering: false)");
    check_claim(&claimed, false, None, "nothing to write");
    assert_eq!(
        call(&claimed, false, true, is_new(&claimed, false, None, false)),
        Call::Provision { new: false }
    );
}

// --- the waiter: what is news, when Get is asked ---

#[track_caller]
fn check_wait(until: Until, recorded: Status, heard: Result<Observed, Error>, expect: &str) {
    let waited = Waited {
        until,
        generation: 1,
        recorded,
    };
    let mut latest = report(1, None, "nothing yet");
    let wake = match heard {
        Ok(observed) => waited.watched(observed, &mut latest),
        Err(err) => waited.got(Err(err), &mut latest),
    };
    let got = format!("{wake:?}, latest `{}`", latest.reason);
    assert_eq!(got, expect);
}

fn says(generation: u64, status: Status, reason: &str) -> Result<Observed, Error> {
    Ok(Observed::Report(report(generation, Some(status), reason)))
}

#[test]
fn a_provisioning_waiter_wakes_on_a_new_status_of_its_generation() {
    let settled = Until::Settled;
    check_wait(
        settled,
        Status::Booting,
        says(1, Status::Configuring, "stage 0"),
        "Some(Report), latest `stage 0`",
    );
    check_wait(
        settled,
        Status::Booting,
        says(1, Status::Ready, "ready"),
        "Some(Report), latest `ready`",
    );
    // Settled wakes even when that status is recorded already.
    check_wait(
        settled,
        Status::Failed,
        says(1, Status::Failed, "died"),
        "Some(Report), latest `died`",
    );
}

#[test]
fn a_provisioning_waiter_keeps_waiting_on_what_is_no_news() {
    let settled = Until::Settled;
    check_wait(
        settled,
        Status::Booting,
        says(1, Status::Booting, "pulling"),
        "None, latest `pulling`",
    );
    check_wait(
        settled,
        Status::Booting,
        says(0, Status::Ready, "an older generation"),
        "None, latest `an older generation`",
    );
    check_wait(
        settled,
        Status::Booting,
        Ok(Observed::Nothing),
        "None, latest `nothing yet`",
    );
    check_wait(
        settled,
        Status::Booting,
        Err(unavailable()),
        "None, latest `nothing yet`",
    );
}

#[test]
fn a_waiter_wakes_when_the_agent_no_longer_holds_the_lesson() {
    for until in [Until::Settled, Until::Gone] {
        check_wait(
            until,
            Status::Booting,
            Ok(Observed::Deleted),
            "Some(Lost), latest `nothing yet`",
        );
        check_wait(
            until,
            Status::Booting,
            Err(not_found()),
            "Some(Lost), latest `nothing yet`",
        );
    }
}

#[test]
fn a_removal_waiter_wakes_only_when_the_objects_are_gone() {
    check_wait(
        Until::Gone,
        Status::Terminating,
        says(1, Status::Ready, "still there"),
        "None, latest `still there`",
    );
    check_wait(
        Until::Gone,
        Status::Terminating,
        says(1, Status::Failed, "failed"),
        "None, latest `failed`",
    );
}

#[test]
fn a_got_report_counts_as_a_watched_one() {
    let waited = Waited {
        until: Until::Settled,
        generation: 1,
        recorded: Status::Booting,
    };
    let mut latest = report(1, None, "");
    let wake = waited.got(Ok(report(1, Some(Status::Ready), "ready")), &mut latest);
    assert_eq!(
        (wake, latest.reason.as_str()),
        (Some(Wake::Report), "ready")
    );
    let wake = waited.got(Ok(report(1, Some(Status::Booting), "up")), &mut latest);
    assert_eq!((wake, latest.reason.as_str()), (None, "up"));
}

#[test]
fn polls_back_off_over_watch_up_to_sixteen_times_the_interval() {
    let interval = Duration::from_secs(2);
    let mut every = interval;
    let mut seen = Vec::new();
    for _ in 0..6 {
        every = next_poll(every, interval, true);
        seen.push(every.as_secs());
    }
    assert_eq!(seen, [4, 8, 16, 32, 32, 32]);
    // Without Watch, Get is the only news: its interval stays.
    assert_eq!(next_poll(interval, interval, false), interval);
}

#[test]
fn the_first_poll_is_spread_by_up_to_a_fifth_of_the_interval() {
    let interval = Duration::from_secs(2);
    let first = |id: u128| first_poll(interval, LiveLessonId(Uuid::from_u128(id)));
    assert_eq!(first(1000), Duration::from_secs(2));
    assert_eq!(first(500), Duration::from_millis(2200));
    assert_eq!(first(999), Duration::from_micros(2_399_600));
}

#[track_caller]
fn check_found(
    lesson: &LiveLesson,
    until: Until,
    waited: (u64, Until),
    woken_on: Option<&str>,
    expect: Found,
) {
    assert_eq!(found(lesson, until, waited.0, waited.1, woken_on), expect);
}

#[test]
fn a_run_takes_its_waiters_news_only_for_the_same_wait() {
    let booting = on("a", Status::Booting);
    check_found(
        &booting,
        Until::Settled,
        (1, Until::Settled),
        None,
        Found::Waiting,
    );
    check_found(
        &booting,
        Until::Settled,
        (1, Until::Settled),
        Some("a"),
        Found::News,
    );
    // News from an agent the live lesson is no longer on.
    check_found(
        &booting,
        Until::Settled,
        (1, Until::Settled),
        Some("b"),
        Found::Stale,
    );
    // A wait for an older generation (a stage change, a retry).
    check_found(
        &stage_changed("a"),
        Until::Settled,
        (1, Until::Settled),
        None,
        Found::Stale,
    );
    // A wait for something else of the same generation.
    check_found(
        &booting,
        Until::Settled,
        (1, Until::Gone),
        None,
        Found::Stale,
    );
}

// --- delete: removal, also during boot ---

#[test]
fn delete_during_boot_stops_the_wait_for_ready_and_removes() {
    let removing = deleting(on("a", Status::Booting));
    check_route(&removing, false, None, "remove");
    // The waiter waiting for READY of generation 1 is stale: stopped, Deprovision called.
    check_found(
        &removing,
        Until::Gone,
        (1, Until::Settled),
        None,
        Found::Stale,
    );
    check_found(
        &removing,
        Until::Gone,
        (1, Until::Settled),
        Some("a"),
        Found::Stale,
    );
    // Once a removal waiter waits, runs leave it be.
    check_found(
        &removing,
        Until::Gone,
        (2, Until::Gone),
        None,
        Found::Waiting,
    );
    check_found(
        &removing,
        Until::Gone,
        (2, Until::Gone),
        Some("a"),
        Found::News,
    );
}

#[test]
fn removal_asks_the_agent_unless_it_has_none_or_it_is_lost() {
    assert_eq!(remover(Some("a"), false), Some("a"));
    assert_eq!(remover(Some("a"), true), None);
    // Deleted before placement (while PENDING), or its agent no longer configured.
    assert_eq!(remover(None::<&str>, false), None);
}

#[track_caller]
fn check_removal(result: Result<bool, Error>, past_deadline: bool, expect: Removal) {
    assert_eq!(after_deprovision(&result, past_deadline), expect);
}

#[test]
fn removal_forgets_once_the_objects_are_gone_or_waits_for_them() {
    check_removal(Ok(true), false, Removal::Forget);
    check_removal(Ok(false), false, Removal::WaitGone);
    check_removal(Ok(false), true, Removal::WaitGone);
}

#[test]
fn a_failed_removal_is_retried_until_the_deadline_then_left_to_the_reaper() {
    check_removal(Err(unavailable()), false, Removal::Retry);
    check_removal(Err(cut_off()), false, Removal::Retry);
    check_removal(Err(unavailable()), true, Removal::Forget);
    check_removal(
        Err(failed("Deprovision", Code::Internal, "boom", None)),
        false,
        Removal::Forget,
    );
}

// --- a READY live lesson that broke or vanished on its agent ---

#[test]
fn a_failed_report_of_its_generation_breaks_a_ready_lesson_at_once() {
    let ready = on("a", Status::Ready);
    let got = held(
        &ready,
        Some(report(1, Some(Status::Failed), "container died")),
    );
    assert_eq!(
        got.map(|o| line(&o)).as_deref(),
        Some("FAILED `container died` healthy=0")
    );
    // An older generation's failure, or no report: ask the agent.
    assert!(held(&ready, Some(report(0, Some(Status::Failed), "old"))).is_none());
    assert!(held(&ready, None).is_none());
}

#[track_caller]
fn check_get(got: Result<AgentReport, Error>, expect: &str) {
    let answer = match after_get(&on("a", Status::Ready), "a", got) {
        Held::Broken(observation) => format!("broken: {}", line(&observation)),
        Held::Fine => "fine".to_owned(),
        Held::AskAgain(err) => format!("ask again: {err}"),
    };
    assert_eq!(answer, expect);
}

#[test]
fn get_decides_whether_a_suspected_lesson_broke() {
    check_get(
        Ok(report(1, Some(Status::Failed), "exited 137")),
        "broken: FAILED `exited 137` healthy=0",
    );
    check_get(
        Err(not_found()),
        "broken: FAILED `agent `a` no longer holds this live lesson: it was removed without the scheduler asking; ask again for a new one` healthy=0",
    );
    check_get(Ok(report(1, Some(Status::Ready), "fine")), "fine");
    check_get(Ok(report(0, Some(Status::Failed), "older")), "fine");
    check_get(
        Err(unavailable()),
        "ask again: agent `a` Provision failed: code: 'The service is currently unavailable', message: \"connection refused\"",
    );
}

#[test]
fn suspicions_are_checked_only_when_nobody_works_on_the_lesson() {
    assert!(worth_checking(false, false, false));
    assert!(!worth_checking(true, false, false));
    assert!(!worth_checking(false, true, false));
    assert!(!worth_checking(false, false, true));
}

#[test]
fn what_a_snapshot_lacks_of_the_agents_placed_lessons_is_suspected() {
    let [x, y, z] = [1, 2, 3].map(|n| LiveLessonId(Uuid::from_u128(n)));
    let held = HashSet::from([x, z]);
    assert_eq!(missing(vec![x, y, z], &held).collect::<Vec<_>>(), [y]);
    assert_eq!(missing(vec![x], &held).count(), 0);
}

// --- a lost agent ---

#[test]
fn a_lost_agents_lessons_move_saying_why() {
    let grace = Duration::from_secs(60);
    assert_eq!(
        lost_reason("a", grace, "connection refused"),
        "agent `a` lost (not ready for 1m: connection refused); moving to another agent"
    );
    assert_eq!(
        lost_reason("a", grace, ""),
        "agent `a` lost (not ready for 1m); moving to another agent"
    );
}

#[test]
fn moved_lessons_are_provisioned_again_unless_failed() {
    assert!(after_move(&fresh()));
    assert!(!after_move(&LiveLesson {
        agent: None,
        ..on("a", Status::Failed)
    }));
    // Then placement treats it as moved: the lost agent does not count, and it is not new.
    check_choose(
        &moved_from("a"),
        needs(&[]),
        &[lost(agent("a", 0, 0)), agent("b", 0, 0)],
        "chose b",
    );
    check_new(&fresh(), true, Some("a"), false, false);
}

// --- replicas: what the resync and the changes heard take up ---

#[test]
fn the_resync_enqueues_only_lessons_nobody_works_on() {
    assert!(unattended(false, false, false, false));
    assert!(!unattended(true, false, false, false));
    assert!(!unattended(false, true, false, false));
    assert!(!unattended(false, false, true, false));
    assert!(!unattended(false, false, false, true));
}

#[test]
fn a_change_heard_is_taken_up_unless_in_hand_here_or_elsewhere() {
    assert!(!taken_up(false, None, 2, false));
    assert!(taken_up(true, Some(2), 2, false));
    // Held here, but the change is a newer generation than the one worked on.
    assert!(!taken_up(true, Some(1), 2, false));
    assert!(taken_up(false, None, 2, true));
}
