//! Placement: which agent takes a new live lesson. A pure function over a snapshot of the
//! fleet ([`Snapshot`]), so the rules are table-tested without processes.
//!
//! An agent is eligible when it is ready (handshake done, stream healthy), offers every
//! capability the lesson needs, and has room. Among eligible agents the least loaded (relative
//! to capacity) wins, ties going to configuration order. When none is eligible, the error says
//! why for each agent.

use antidote_proto::sdk::capabilities;

use crate::agents::{AgentState, Snapshot};
use crate::catalog::{Lesson, PresentationKind};

/// The capabilities an agent must offer to run a lesson.
pub fn needs(lesson: &Lesson) -> Vec<&'static str> {
    let mut needs = Vec::new();
    let presentations = || lesson.endpoints.iter().flat_map(|e| &e.presentations);
    if presentations().any(|p| p.kind == PresentationKind::Ssh) {
        needs.push(capabilities::PRESENTATION_SSH);
    }
    if presentations().any(|p| p.kind == PresentationKind::Http) {
        needs.push(capabilities::PRESENTATION_HTTP);
    }
    if lesson
        .endpoints
        .iter()
        .any(|e| e.configuration_type.is_some())
    {
        needs.push(capabilities::STAGE_CONFIGURATION);
    }
    needs
}

/// Picks an agent's name, or explains why none fits (one reason per agent).
pub fn choose<'a>(agents: &'a [Snapshot], needs: &[&str]) -> Result<&'a str, String> {
    let mut reasons = Vec::new();
    let mut best: Option<(f64, &Snapshot)> = None;
    for agent in agents {
        let status = &agent.status;
        let handshake = match (&status.state, &status.handshake) {
            (AgentState::Ready, Some(handshake)) => handshake,
            (state, _) => {
                reasons.push(format!(
                    "`{}` is {state:?}{}",
                    agent.name,
                    if status.last_error.is_empty() {
                        String::new()
                    } else {
                        format!(" ({})", status.last_error)
                    }
                ));
                continue;
            }
        };
        let missing: Vec<_> = needs
            .iter()
            .filter(|need| !handshake.capabilities.contains(**need))
            .collect();
        if !missing.is_empty() {
            reasons.push(format!("`{}` lacks {missing:?}", agent.name));
            continue;
        }
        let (load, max) = (agent.load, handshake.max_live_lessons);
        if max > 0 && load >= max {
            reasons.push(format!("`{}` is full ({load}/{max})", agent.name));
            continue;
        }
        let ratio = if max > 0 {
            f64::from(load) / f64::from(max)
        } else {
            // Unlimited agents compare by absolute load, scaled far below any bounded ratio's
            // steps so a bounded agent at 0 % still ties with an idle unlimited one.
            f64::from(load) / 1e6
        };
        if best.is_none_or(|(r, _)| ratio < r) {
            best = Some((ratio, agent));
        }
    }
    match best {
        Some((_, agent)) => Ok(&agent.name),
        None if agents.is_empty() => Err("no agents are configured".into()),
        None => Err(reasons.join("; ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agents::{AgentStatus, Handshake};

    const ALL: &[&str] = &[
        capabilities::PRESENTATION_SSH,
        capabilities::PRESENTATION_HTTP,
        capabilities::STAGE_CONFIGURATION,
    ];

    /// A ready agent offering `offers`, holding `load` of at most `max` (0 = unlimited).
    fn ready(name: &str, offers: &[&str], load: u32, max: u32) -> Snapshot {
        Snapshot {
            name: name.into(),
            address: format!("http://{name}"),
            status: AgentStatus {
                state: AgentState::Ready,
                handshake: Some(Handshake {
                    major: 1,
                    capabilities: offers.iter().map(|c| (*c).to_owned()).collect(),
                    max_live_lessons: max,
                    ..Handshake::default()
                }),
                last_error: String::new(),
                connected_at: None,
            },
            load,
        }
    }

    /// An agent in `state` without a working handshake.
    fn down(name: &str, state: AgentState, error: &str) -> Snapshot {
        Snapshot {
            name: name.into(),
            address: format!("http://{name}"),
            status: AgentStatus {
                state,
                handshake: None,
                last_error: error.into(),
                connected_at: None,
            },
            load: 0,
        }
    }

    /// Chooses among `agents` for `needs` and compares the chosen name, or the error, with
    /// `expect`.
    #[track_caller]
    fn check(agents: &[Snapshot], needs: &[&str], expect: &str) {
        let got = match choose(agents, needs) {
            Ok(name) => name.to_owned(),
            Err(why) => format!("error: {why}"),
        };
        assert_eq!(got, expect);
    }

    #[test]
    fn no_agents() {
        check(&[], ALL, "error: no agents are configured");
    }

    #[test]
    fn the_least_loaded_relative_to_capacity_wins() {
        check(&[ready("a", ALL, 5, 10), ready("b", ALL, 2, 10)], ALL, "b");
        check(&[ready("a", ALL, 5, 10), ready("b", ALL, 4, 5)], ALL, "a");
    }

    #[test]
    fn ties_go_to_configuration_order() {
        check(&[ready("a", ALL, 1, 4), ready("b", ALL, 1, 4)], ALL, "a");
        // An idle bounded agent ties with an idle unlimited one.
        check(&[ready("a", ALL, 0, 4), ready("b", ALL, 0, 0)], ALL, "a");
    }

    #[test]
    fn unlimited_agents_compare_by_load() {
        check(&[ready("a", ALL, 7, 0), ready("b", ALL, 3, 0)], ALL, "b");
        check(&[ready("a", ALL, 1, 2), ready("b", ALL, 900, 0)], ALL, "b");
    }

    #[test]
    fn full_agents_are_skipped() {
        check(&[ready("a", ALL, 3, 3), ready("b", ALL, 9, 10)], ALL, "b");
        check(&[ready("a", ALL, 3, 3)], ALL, "error: `a` is full (3/3)");
    }

    #[test]
    fn missing_capabilities_are_named() {
        let http = &[capabilities::PRESENTATION_HTTP];
        check(
            &[ready("a", http, 0, 0), ready("b", ALL, 5, 0)],
            &[capabilities::PRESENTATION_SSH],
            "b",
        );
        check(
            &[ready("a", http, 0, 0)],
            ALL,
            r#"error: `a` lacks ["presentation.ssh", "stage.configuration"]"#,
        );
        // A lesson needing nothing runs anywhere that is ready.
        check(&[ready("a", &[], 0, 0)], &[], "a");
    }

    #[test]
    fn agents_not_ready_are_skipped_with_their_error() {
        check(
            &[
                down("a", AgentState::Unavailable, "handshake failed: refused"),
                ready("b", ALL, 0, 1),
            ],
            ALL,
            "b",
        );
        check(
            &[
                down("a", AgentState::Connecting, ""),
                down("b", AgentState::Incompatible, "no common major version"),
                ready("c", ALL, 1, 1),
            ],
            ALL,
            "error: `a` is Connecting; `b` is Incompatible (no common major version); \
             `c` is full (1/1)",
        );
    }
}
