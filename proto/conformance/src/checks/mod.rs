//! The checks: the table that drives a run ([`CHECKS`]), the selection `--check` makes, and
//! the runner that skips a check whose needs are not met. The bodies live in one module per
//! topic: `handshake` (health and handshake), `codes` (refusals: bad specs, unknown ids, typed
//! error details), `scripts` (RunChecks: check and solution files), `lifecycle` (a live lesson from Provision to Deprovision), `watch` (the Watch
//! stream), `resync` (a stalled watcher forced to resync), `paths` (ready delay, configuration
//! types, the FAILED paths, retries, capacity), `entrypoint` (learners' way in, with tokens the
//! suite signs) and `restart` (Recover and adoption after the agent restarts).

mod codes;
mod entrypoint;
mod handshake;
mod lifecycle;
mod paths;
mod restart;
mod resync;
mod scripts;
mod watch;

pub use resync::STALLED_WINDOW;

use std::collections::{BTreeSet, HashMap};
use std::fmt;

use antidote_sdk::capabilities;
use anyhow::{bail, ensure};
use futures::future::LocalBoxFuture;
use tonic::Code;
use tonic_types::{ErrorDetail, StatusExt as _};

use crate::report::{Outcome, Tally, Verdict, describe};
use crate::suite::Suite;

/// A check's body: it works on the suite's shared state and says what it found.
pub type Body = for<'a> fn(&'a mut Suite) -> LocalBoxFuture<'a, Verdict>;

/// One named check.
pub struct Check {
    /// A short kebab-case id, for `--check` and the report.
    pub name: &'static str,
    /// What it checks, in one line (the report line says it after the name).
    pub what: &'static str,
    /// What must hold before it runs; every needed check comes earlier in [`CHECKS`].
    pub needs: &'static [Need],
    /// The body.
    pub run: Body,
}

/// Something a check needs before it runs.
#[derive(Clone, Copy)]
pub enum Need {
    /// This check passed earlier in the run (and left the state this one works on).
    Check(&'static str),
    /// The agent offers this capability in its handshake.
    Capability(&'static str),
    /// The suite was given this flag (e.g. `--restart-cmd`), which says how to do something
    /// only the agent's operator knows.
    Flag(&'static str),
}

impl fmt::Display for Need {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Need::Check(name) => write!(f, "{name}"),
            Need::Capability(capability) => write!(f, "capability {capability}"),
            Need::Flag(flag) => write!(f, "flag {flag}"),
        }
    }
}

const HANDSHAKE: Need = Need::Check("handshake");
const PROVISION_READY: Need = Need::Check("provision-ready");
const STAGE_CHANGE: Need = Need::Check("stage-change");
const LIST_PAGES: Need = Need::Check("list-pages");
const WATCH_SNAPSHOT: Need = Need::Check("watch-snapshot");
const DEPROVISION: Need = Need::Check("deprovision");
const WATCH: Need = Need::Capability(capabilities::WATCH);
const RECOVER: Need = Need::Capability(capabilities::RECOVER);
const PLAN: Need = Need::Capability(capabilities::PLAN);
const CONFIGURATION: Need = Need::Capability(capabilities::STAGE_CONFIGURATION);
const RUNS_CHECKS: Need = Need::Capability(capabilities::CHECKS);
const HTTP: Need = Need::Capability(capabilities::PRESENTATION_HTTP);
const ENTRYPOINT: Need = Need::Flag("--entrypoint");
const ENTRYPOINT_TOKENS: Need = Need::Check("entrypoint-tokens");

/// Every check, in run order.
pub const CHECKS: &[Check] = &[
    Check {
        name: "health",
        what: "grpc.health.v1 says antidote.agent.v1.Backend is SERVING",
        needs: &[],
        run: |suite| Box::pin(handshake::health(suite)),
    },
    Check {
        name: "handshake",
        what: "Handshake answers major 1, name, version, capacity and a stable instance id",
        needs: &[],
        run: |suite| Box::pin(handshake::handshake(suite)),
    },
    Check {
        name: "no-common-major",
        what: "Handshake with no common major is FAILED_PRECONDITION (NO_COMMON_MAJOR)",
        needs: &[HANDSHAKE],
        run: |suite| Box::pin(handshake::no_common_major(suite)),
    },
    Check {
        name: "bad-spec-codes",
        what: "bad specs are INVALID_ARGUMENT (INVALID_SPEC) naming their field, and create nothing",
        needs: &[HANDSHAKE],
        run: |suite| Box::pin(codes::bad_spec_codes(suite)),
    },
    Check {
        name: "error-details",
        what: "every refusal carries a google.rpc.ErrorInfo with its reason and metadata",
        needs: &[HANDSHAKE],
        run: |suite| Box::pin(codes::error_details(suite)),
    },
    Check {
        name: "request-too-large",
        what: "a 4 MiB request is served; larger ones are served or refused with REQUEST_TOO_LARGE",
        needs: &[HANDSHAKE],
        run: |suite| Box::pin(codes::request_too_large(suite)),
    },
    Check {
        name: "get-unknown",
        what: "Get of an unknown id is NOT_FOUND (LIVE_LESSON_NOT_FOUND)",
        needs: &[HANDSHAKE],
        run: |suite| Box::pin(codes::get_unknown(suite)),
    },
    Check {
        name: "deprovision-unknown",
        what: "Deprovision of an unknown id is OK",
        needs: &[HANDSHAKE],
        run: |suite| Box::pin(codes::deprovision_unknown(suite)),
    },
    Check {
        name: "recover-unknown",
        what: "Recover of an unknown id is NOT_FOUND (LIVE_LESSON_NOT_FOUND)",
        needs: &[HANDSHAKE, RECOVER],
        run: |suite| Box::pin(codes::recover_unknown(suite)),
    },
    Check {
        name: "watch-snapshot",
        what: "Watch starts with a snapshot",
        needs: &[HANDSHAKE, WATCH],
        run: |suite| Box::pin(watch::snapshot(suite)),
    },
    Check {
        name: "provision-ready",
        what: "the live lesson becomes READY",
        needs: &[HANDSHAKE],
        run: |suite| Box::pin(lifecycle::provision_ready(suite)),
    },
    Check {
        name: "idempotent-provision",
        what: "Provision again with the same spec changes nothing",
        needs: &[PROVISION_READY],
        run: |suite| Box::pin(lifecycle::idempotent_provision(suite)),
    },
    Check {
        name: "conflicting-spec",
        what: "another spec at the same generation is ALREADY_EXISTS (SPEC_CONFLICT)",
        needs: &[PROVISION_READY],
        run: |suite| Box::pin(lifecycle::conflicting_spec(suite)),
    },
    Check {
        name: "get-agrees",
        what: "Get agrees with Watch",
        needs: &[PROVISION_READY],
        run: |suite| Box::pin(lifecycle::get_agrees(suite)),
    },
    Check {
        name: "extra-labels",
        what: "labels beyond the guide's five are kept and selectable",
        needs: &[PROVISION_READY],
        run: |suite| Box::pin(lifecycle::extra_labels(suite)),
    },
    Check {
        name: "stage-change",
        what: "a newer generation changes the stage in place",
        needs: &[PROVISION_READY],
        run: |suite| Box::pin(lifecycle::stage_change(suite)),
    },
    Check {
        name: "older-generation",
        what: "an older generation is FAILED_PRECONDITION (GENERATION_OUTDATED)",
        needs: &[STAGE_CHANGE],
        run: |suite| Box::pin(lifecycle::older_generation(suite)),
    },
    Check {
        name: "endpoints-fixed",
        what: "a newer generation that changes the endpoints or connections is INVALID_ARGUMENT",
        needs: &[STAGE_CHANGE],
        run: |suite| Box::pin(lifecycle::endpoints_fixed(suite)),
    },
    Check {
        name: "recover-held",
        what: "Recover of a held live lesson follows the Provision table",
        needs: &[STAGE_CHANGE, RECOVER],
        run: |suite| Box::pin(lifecycle::recover_held(suite)),
    },
    Check {
        name: "list-pages",
        what: "List pages are complete and stable",
        needs: &[PROVISION_READY],
        run: |suite| Box::pin(lifecycle::list_pages(suite)),
    },
    Check {
        name: "watch-reconnect",
        what: "a new Watch's snapshot is complete and current (v1 has no resume)",
        needs: &[LIST_PAGES, WATCH],
        run: |suite| Box::pin(watch::reconnect(suite)),
    },
    Check {
        name: "watch-pages",
        what: "asked for pages, a Watch snapshot comes in bounded pages at one revision",
        needs: &[
            LIST_PAGES,
            WATCH,
            Need::Capability(capabilities::WATCH_PAGES),
        ],
        run: |suite| Box::pin(watch::pages(suite)),
    },
    Check {
        name: "plan-no-side-effects",
        what: "Plan has no side effects",
        needs: &[HANDSHAKE, PLAN],
        run: |suite| Box::pin(lifecycle::plan_no_side_effects(suite)),
    },
    Check {
        name: "plan-bad-spec",
        what: "Plan refuses a broken spec like Provision and answers diagnostics otherwise",
        needs: &[HANDSHAKE, PLAN],
        run: |suite| Box::pin(lifecycle::plan_bad_spec(suite)),
    },
    Check {
        name: "watch-heartbeat",
        what: "Watch heartbeats come every interval, at the stream's last revision",
        needs: &[HANDSHAKE, WATCH],
        run: |suite| Box::pin(watch::heartbeat(suite)),
    },
    Check {
        name: "deprovision",
        what: "Deprovision removes everything",
        needs: &[PROVISION_READY],
        run: |suite| Box::pin(lifecycle::deprovision(suite)),
    },
    Check {
        name: "watch-deletions",
        what: "Watch reports TERMINATING, then a deletion",
        needs: &[WATCH_SNAPSHOT, DEPROVISION, WATCH],
        run: |suite| Box::pin(watch::deletions(suite)),
    },
    Check {
        name: "watch-selector",
        what: "Watch filters by label selector",
        needs: &[LIST_PAGES, DEPROVISION, WATCH],
        run: |suite| Box::pin(watch::selector(suite)),
    },
    Check {
        name: "watch-resync",
        what: "a watcher that stalls while thousands of changes happen gets a resync and a snapshot",
        needs: &[HANDSHAKE, WATCH, Need::Flag("--force-resync")],
        run: |suite| Box::pin(resync::resync(suite)),
    },
    Check {
        name: "concurrent-provision",
        what: "identical Provisions at once all answer OK and create once",
        needs: &[HANDSHAKE],
        run: |suite| Box::pin(paths::concurrent_provision(suite)),
    },
    Check {
        name: "concurrent-deprovision",
        what: "identical Deprovisions at once all answer OK and delete once",
        needs: &[Need::Check("concurrent-provision")],
        run: |suite| Box::pin(paths::concurrent_deprovision(suite)),
    },
    Check {
        name: "ready-delay",
        what: "READY waits the lesson's ready delay, on every generation",
        needs: &[HANDSHAKE],
        run: |suite| Box::pin(paths::ready_delay(suite)),
    },
    Check {
        name: "configuration-shell",
        what: "a shell configuration is applied",
        needs: &[HANDSHAKE, CONFIGURATION],
        run: |suite| Box::pin(paths::configuration_shell(suite)),
    },
    Check {
        name: "configuration-python",
        what: "a python configuration is applied",
        needs: &[HANDSHAKE, Need::Capability(paths::CONFIGURATION_PYTHON)],
        run: |suite| Box::pin(paths::configuration_python(suite)),
    },
    Check {
        name: "configuration-ansible",
        what: "an ansible configuration is applied",
        needs: &[HANDSHAKE, Need::Capability(paths::CONFIGURATION_ANSIBLE)],
        run: |suite| Box::pin(paths::configuration_ansible(suite)),
    },
    Check {
        name: "configuration-napalm",
        what: "a napalm configuration is applied",
        needs: &[
            HANDSHAKE,
            Need::Capability(paths::CONFIGURATION_NAPALM),
            Need::Flag("--napalm-image"),
        ],
        run: |suite| Box::pin(paths::configuration_napalm(suite)),
    },
    Check {
        name: "guide-jupyter",
        what: "a Jupyter guide endpoint serves each generation's notebook",
        needs: &[HANDSHAKE, Need::Capability(capabilities::GUIDE_JUPYTER)],
        run: |suite| Box::pin(paths::guide_jupyter(suite)),
    },
    Check {
        name: "failed-image",
        what: "an image that does not start makes the generation FAILED, naming it",
        needs: &[HANDSHAKE],
        run: |suite| Box::pin(paths::failed_image(suite)),
    },
    Check {
        name: "failed-config",
        what: "a configuration that exits non-zero makes the generation FAILED, naming it",
        needs: &[HANDSHAKE, CONFIGURATION],
        run: |suite| Box::pin(paths::failed_config(suite)),
    },
    Check {
        name: "failed-probe",
        what: "a presentation that never answers makes the generation FAILED, naming it",
        needs: &[HANDSHAKE, Need::Flag("--silent-port")],
        run: |suite| Box::pin(paths::failed_probe(suite)),
    },
    Check {
        name: "capacity-refusal",
        what: "a new live lesson beyond capacity is RESOURCE_EXHAUSTED (CAPACITY_EXHAUSTED)",
        needs: &[HANDSHAKE],
        run: |suite| Box::pin(paths::capacity_refusal(suite)),
    },
    Check {
        name: "entrypoint-tokens",
        what: "the entrypoint admits exactly the suite's tokens for a presentation (401, 403, 404)",
        needs: &[HANDSHAKE, HTTP, ENTRYPOINT],
        run: |suite| Box::pin(entrypoint::tokens(suite)),
    },
    Check {
        name: "entrypoint-keys",
        what: "retired and revoked keys get 401, another instance's key 403",
        needs: &[ENTRYPOINT_TOKENS],
        run: |suite| Box::pin(entrypoint::keys(suite)),
    },
    Check {
        name: "entrypoint-cookie",
        what: "a query-parameter admission sets the cookie, which admits only same-origin requests",
        needs: &[ENTRYPOINT_TOKENS],
        run: |suite| Box::pin(entrypoint::cookie(suite)),
    },
    Check {
        name: "entrypoint-proxy",
        what: "path and query reach the presentation, the bare prefix redirects, pages are sandboxed",
        needs: &[ENTRYPOINT_TOKENS],
        run: |suite| Box::pin(entrypoint::proxy(suite)),
    },
    Check {
        name: "entrypoint-activity",
        what: "a navigation moves last_active, a page script's reads do not",
        needs: &[ENTRYPOINT_TOKENS],
        run: |suite| Box::pin(entrypoint::activity(suite)),
    },
    Check {
        name: "entrypoint-connection-cap",
        what: "one connection past the per-client cap is closed unanswered",
        needs: &[ENTRYPOINT_TOKENS],
        run: |suite| Box::pin(entrypoint::connection_cap(suite)),
    },
    Check {
        name: "entrypoint-terminal",
        what: "a web terminal runs what is typed, tells the exit status, and closes on revocation",
        needs: &[
            HANDSHAKE,
            Need::Capability(capabilities::PRESENTATION_SSH),
            ENTRYPOINT,
            Need::Flag("--terminal-image"),
        ],
        run: |suite| Box::pin(entrypoint::terminal(suite)),
    },
    Check {
        name: "checks-unimplemented",
        what: "without the `checks` capability, RunChecks is UNIMPLEMENTED (NOT_IMPLEMENTED)",
        needs: &[HANDSHAKE],
        run: |suite| Box::pin(scripts::unimplemented(suite)),
    },
    Check {
        name: "checks-run",
        what: "RunChecks answers each file's exit status and output, and changes no state",
        needs: &[HANDSHAKE, RUNS_CHECKS],
        run: |suite| Box::pin(scripts::run(suite)),
    },
    Check {
        name: "checks-timeout",
        what: "a check that never ends is killed at the timeout and answered timed_out",
        needs: &[HANDSHAKE, RUNS_CHECKS],
        run: |suite| Box::pin(scripts::timeout(suite)),
    },
    Check {
        name: "checks-one-at-a-time",
        what: "a second RunChecks while one runs is ABORTED (CHECKS_RUNNING)",
        needs: &[HANDSHAKE, RUNS_CHECKS],
        run: |suite| Box::pin(scripts::one_at_a_time(suite)),
    },
    Check {
        name: "checks-refusals",
        what: "RunChecks of an unknown, another generation's or a terminating live lesson, or breaking a rule, is refused",
        needs: &[HANDSHAKE, RUNS_CHECKS],
        run: |suite| Box::pin(scripts::refusals(suite)),
    },
    Check {
        name: "restart-recover",
        what: "after a restart, List, Get, Watch and Recover agree on what is left",
        needs: &[HANDSHAKE, Need::Flag("--restart-cmd")],
        run: |suite| Box::pin(restart::recover(suite)),
    },
    Check {
        name: "restart-adopt",
        what: "what outlived the restart is adopted, not recreated",
        needs: &[Need::Check("restart-recover")],
        run: |suite| Box::pin(restart::adopt(suite)),
    },
];

/// The checks to run for `--check names` (every check when there are none): the named ones
/// and everything they need, transitively, in table order. The names are valid (clap checks
/// them against [`CHECKS`]).
pub fn select(names: &[String]) -> Vec<&'static Check> {
    if names.is_empty() {
        return CHECKS.iter().collect();
    }
    let mut wanted: BTreeSet<&str> = names.iter().map(String::as_str).collect();
    // Needs come earlier in the table, so one pass from the end reaches every need of a need.
    for check in CHECKS.iter().rev() {
        if wanted.contains(check.name) {
            for need in check.needs {
                if let Need::Check(name) = need {
                    wanted.insert(*name);
                }
            }
        }
    }
    CHECKS
        .iter()
        .filter(|check| wanted.contains(check.name))
        .collect()
}

/// Prints `checks`, one line each: name, what it checks, what it needs.
pub fn print_list(checks: &[&Check]) {
    let width = checks.iter().map(|c| c.name.len()).max().unwrap_or(0);
    for check in checks {
        let needs = check
            .needs
            .iter()
            .map(Need::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        if needs.is_empty() {
            println!("{:width$}  {}", check.name, check.what);
        } else {
            println!("{:width$}  {} (needs {needs})", check.name, check.what);
        }
    }
}

/// Runs `checks` in order, printing each line as it ends; a check whose needs are not met is
/// skipped, saying which.
pub async fn run(suite: &mut Suite, checks: &[&Check]) -> Tally {
    let mut report = Tally::default();
    for check in checks {
        let missing = missing(check, suite, &report);
        let outcome = if missing.is_empty() {
            match (check.run)(suite).await {
                Ok(outcome) => outcome,
                Err(err) => Outcome::Fail(format!("{err:#}")),
            }
        } else {
            Outcome::Skip(format!("needs {}", missing.join("; ")))
        };
        report.record(check.name, check.what, outcome);
    }
    report
}

/// What `check` needs that is not there: checks that did not pass or, when they all did,
/// capabilities the agent does not offer (the capabilities are only known after `handshake`).
fn missing(check: &Check, suite: &Suite, report: &Tally) -> Vec<String> {
    let checks: Vec<String> = check
        .needs
        .iter()
        .filter_map(|need| match need {
            Need::Check(name) => match report.outcome(name) {
                Some(Outcome::Pass(_)) => None,
                Some(Outcome::Fail(_)) => Some(format!("`{name}`, which failed")),
                Some(Outcome::Skip(_)) => Some(format!("`{name}`, which was skipped")),
                None => Some(format!("`{name}`, which did not run")),
            },
            Need::Capability(_) | Need::Flag(_) => None,
        })
        .collect();
    if !checks.is_empty() {
        return checks;
    }
    check
        .needs
        .iter()
        .filter_map(|need| match need {
            Need::Capability(capability) if !suite.offers(capability) => {
                Some(format!("the agent to offer `{capability}`"))
            }
            Need::Flag(flag) if !suite.settings.given(flag) => {
                Some(format!("`{flag}` ({})", suite.settings.absence(flag)))
            }
            _ => None,
        })
        .collect()
}

/// What a typed refusal said: its message and its ErrorInfo's metadata.
pub struct Refusal {
    /// The status message (for people: reported, never decided on).
    pub message: String,
    /// The ErrorInfo's metadata.
    pub metadata: HashMap<String, String>,
}

impl Refusal {
    /// Checks that the metadata has `key` = `value`.
    pub fn expect(&self, key: &str, value: &str) -> anyhow::Result<()> {
        ensure!(
            self.metadata.get(key).map(String::as_str) == Some(value),
            "ErrorInfo metadata `{key}` is {:?}, expected {value:?} (metadata {:?})",
            self.metadata.get(key),
            self.metadata
        );
        Ok(())
    }

    /// Checks that the metadata has a non-empty `key`.
    pub fn has(&self, key: &str) -> anyhow::Result<()> {
        ensure!(
            self.metadata.get(key).is_some_and(|v| !v.is_empty()),
            "ErrorInfo metadata lacks `{key}` (metadata {:?})",
            self.metadata
        );
        Ok(())
    }
}

/// Expects `result` to be a refusal with `code` carrying exactly one `google.rpc.ErrorInfo` of
/// domain `antidote.io` and `reason` (PROTOCOL.md, "Errors").
fn expect_refusal<T: fmt::Debug>(
    result: Result<tonic::Response<T>, tonic::Status>,
    code: Code,
    reason: &str,
) -> anyhow::Result<Refusal> {
    let status = match result {
        Ok(response) => bail!("expected {code:?}, got OK: {:?}", response.into_inner()),
        Err(status) => status,
    };
    ensure!(
        status.code() == code,
        "expected {code:?} ({reason}), got {}",
        describe(&status)
    );
    typed(&status, reason)
}

/// The refusal `status` is, checking its ErrorInfo says `reason`.
fn typed(status: &tonic::Status, reason: &str) -> anyhow::Result<Refusal> {
    let details = status.check_error_details_vec().map_err(|err| {
        anyhow::anyhow!(
            "{}: the details do not decode as google.rpc details: {err}",
            describe(status)
        )
    })?;
    let infos: Vec<_> = details
        .into_iter()
        .filter_map(|detail| match detail {
            ErrorDetail::ErrorInfo(info) => Some(info),
            _ => None,
        })
        .collect();
    let [info] = infos.as_slice() else {
        bail!(
            "{}: {} google.rpc.ErrorInfo in the details, expected one",
            describe(status),
            infos.len()
        );
    };
    ensure!(
        info.domain == antidote_sdk::errors::DOMAIN,
        "{}: ErrorInfo domain {:?}, expected {:?}",
        describe(status),
        info.domain,
        antidote_sdk::errors::DOMAIN
    );
    ensure!(
        info.reason == reason,
        "{}: ErrorInfo reason {:?}, expected {reason:?}",
        describe(status),
        info.reason
    );
    Ok(Refusal {
        message: status.message().to_owned(),
        metadata: info.metadata.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn position(name: &str) -> Option<usize> {
        CHECKS.iter().position(|c| c.name == name)
    }

    #[test]
    fn names_are_unique_kebab_case_ids() {
        let mut seen = BTreeSet::new();
        for check in CHECKS {
            assert!(seen.insert(check.name), "`{}` twice", check.name);
            assert!(
                !check.name.is_empty()
                    && !check.name.starts_with('-')
                    && !check.name.ends_with('-')
                    && check
                        .name
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'),
                "`{}` is not kebab-case",
                check.name
            );
        }
    }

    #[test]
    fn needed_checks_exist_and_run_earlier() {
        for (at, check) in CHECKS.iter().enumerate() {
            for need in check.needs {
                if let Need::Check(name) = need {
                    let needed = position(name)
                        .unwrap_or_else(|| panic!("`{}` needs unknown `{name}`", check.name));
                    assert!(needed < at, "`{}` runs before `{name}`", check.name);
                }
            }
        }
    }

    #[test]
    fn every_check_but_the_first_two_comes_after_the_handshake() {
        for check in CHECKS {
            let needed = run_order(&[check.name]);
            if !["health", "handshake"].contains(&check.name) {
                assert!(
                    needed.contains(&"handshake"),
                    "`{}`: {needed:?}",
                    check.name
                );
            }
        }
    }

    /// The names `--check names` runs.
    fn run_order(names: &[&str]) -> Vec<&'static str> {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        select(&names).iter().map(|c| c.name).collect()
    }

    #[test]
    fn a_selection_brings_its_needs_in_table_order() {
        assert_eq!(
            run_order(&["idempotent-provision"]),
            ["handshake", "provision-ready", "idempotent-provision"]
        );
        assert_eq!(
            run_order(&["watch-deletions", "health"]),
            [
                "health",
                "handshake",
                "watch-snapshot",
                "provision-ready",
                "deprovision",
                "watch-deletions"
            ]
        );
        assert_eq!(
            run_order(&["older-generation"]),
            [
                "handshake",
                "provision-ready",
                "stage-change",
                "older-generation"
            ]
        );
        assert_eq!(run_order(&[]).len(), CHECKS.len());
    }

    #[test]
    fn the_module_doc_describes_every_check_and_its_needs() {
        let doc = include_str!("../main.rs");
        for check in CHECKS {
            let row = format!("//! | `{}` | ", check.name);
            let line = doc
                .lines()
                .find(|line| line.starts_with(&row))
                .unwrap_or_else(|| panic!("the module doc's table lacks `{}`", check.name));
            let needs = check
                .needs
                .iter()
                .map(|need| match need {
                    Need::Check(name) => format!("`{name}`"),
                    Need::Capability(capability) => format!("`{capability}` offered"),
                    Need::Flag(flag) => format!("`{flag}` given"),
                })
                .collect::<Vec<_>>()
                .join(", ");
            let cell = if needs.is_empty() {
                "|".to_owned()
            } else {
                format!("{needs} |")
            };
            assert!(
                line[row.len()..].starts_with(&cell),
                "the module doc says `{}` needs something else than {needs}: {line}",
                check.name
            );
        }
    }
}
