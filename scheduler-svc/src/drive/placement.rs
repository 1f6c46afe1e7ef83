//! Placement: which agent takes a live lesson, and why. Pure functions over a view of the fleet
//! ([`Candidate`], built from the agents' [`Snapshot`]s, the operators' labels, drains and
//! losses), so the rules are table-tested without processes.
//!
//! [`choose`]: an agent is eligible when it is not lost, ready (handshake done, stream healthy),
//! not drained, offers every capability the lesson needs, carries every label it requires (the
//! lesson's and the request's) and has room. Among eligible agents the one carrying the most
//! preferred labels wins, then the least loaded (relative to capacity), then configuration
//! order. The answer says why: the labels matched, the load, and for every other agent what
//! excluded it (or that it ranked lower). When none is eligible, the error lists every agent's
//! reasons.
//!
//! [`possible`]: whether any agent the scheduler knows, in any state, could ever take the lesson
//! (labels and capabilities only: full, down, drained or lost agents may come back). An agent
//! whose handshake was never seen is judged by its configured labels alone: a label it lacks
//! there may still come from its handshake, so it may take the lesson.

use std::collections::{BTreeMap, BTreeSet};

use antidote_proto::capabilities;

use crate::agents::{AgentState, Snapshot};
use crate::catalog::{ConfigurationType, Lesson, PresentationKind};
use crate::model::{Decision, Wishes};

/// The capabilities an agent must offer to run a lesson.
pub fn capabilities_for(lesson: &Lesson) -> Vec<&'static str> {
    let mut needs = Vec::new();
    let presentations = || lesson.endpoints.iter().flat_map(|e| &e.presentations);
    if presentations().any(|p| p.kind == PresentationKind::Ssh) {
        needs.push(capabilities::PRESENTATION_SSH);
    }
    // The Jupyter guide endpoint is served over HTTP too.
    if presentations().any(|p| p.kind == PresentationKind::Http) || lesson.has_jupyter_guide() {
        needs.push(capabilities::PRESENTATION_HTTP);
    }
    if lesson
        .endpoints
        .iter()
        .any(|e| e.configuration_type.is_some())
    {
        needs.push(capabilities::STAGE_CONFIGURATION);
    }
    // Every configuration type the lesson uses, each once, in a fixed order (PROTOCOL.md [V5]).
    let types: BTreeSet<ConfigurationType> = lesson
        .endpoints
        .iter()
        .filter_map(|e| e.configuration_type)
        .collect();
    needs.extend(types.into_iter().map(configuration_capability));
    if lesson.has_jupyter_guide() {
        needs.push(capabilities::GUIDE_JUPYTER);
    }
    // A gated stage (`checks: gate`) is passed only by a check, which only an agent running
    // checks can run; advisory checks need nothing (the learner is told the agent cannot).
    if lesson.stages.iter().any(|stage| stage.gated()) {
        needs.push(capabilities::CHECKS);
    }
    needs
}

/// The capability of an agent that runs configurations of `kind`.
fn configuration_capability(kind: ConfigurationType) -> &'static str {
    match kind {
        ConfigurationType::Shell => capabilities::CONFIGURATION_SHELL,
        ConfigurationType::Python => capabilities::CONFIGURATION_PYTHON,
        ConfigurationType::Ansible => capabilities::CONFIGURATION_ANSIBLE,
        ConfigurationType::Napalm => capabilities::CONFIGURATION_NAPALM,
    }
}

/// Whether an agent whose handshake listed `offered` offers `capability`. An agent that lists
/// no configuration type at all runs shell alone (PROTOCOL.md [V5]: agents written before the
/// types were announced).
fn offers(offered: &BTreeSet<String>, capability: &str) -> bool {
    offered.contains(capability)
        || (capability == capabilities::CONFIGURATION_SHELL
            && !offered
                .iter()
                .any(|c| c.starts_with(capabilities::CONFIGURATION_PREFIX)))
}

/// What a live lesson asks of its agent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Needs {
    /// Capabilities the agent must offer.
    pub capabilities: Vec<&'static str>,
    /// Labels the agent must carry.
    pub requires: BTreeMap<String, String>,
    /// Labels the agent should carry.
    pub prefers: BTreeMap<String, String>,
}

impl Needs {
    /// The lesson's needs with the request's wishes added. A request requiring another value
    /// of a label the lesson requires can never be met: the error says which.
    pub fn of(lesson: &Lesson, wishes: &Wishes) -> Result<Needs, String> {
        let mut requires = lesson.placement.requires.clone();
        for (key, value) in &wishes.requires {
            match requires.get(key) {
                Some(own) if own != value => {
                    return Err(format!(
                        "lesson `{}` requires label {key}={own} but the request requires {key}={value}",
                        lesson.slug
                    ));
                }
                _ => {
                    requires.insert(key.clone(), value.clone());
                }
            }
        }
        let mut prefers = lesson.placement.prefers.clone();
        prefers.extend(wishes.prefers.clone());
        Ok(Needs {
            capabilities: capabilities_for(lesson),
            requires,
            prefers,
        })
    }
}

/// Whether an agent can be used now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Availability {
    /// Handshake done, stream healthy.
    Ready,
    /// Not ready (connecting, unavailable, incompatible), with what the scheduler last saw.
    Down(String),
    /// Not ready for longer than the grace period: its live lessons were moved away.
    Lost,
}

/// One agent as placement sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// Its name.
    pub name: String,
    /// Whether it can be used now.
    pub availability: Availability,
    /// Drained by an operator: no new live lessons.
    pub drained: bool,
    /// What its last handshake (since this scheduler started) offered; `None` before any.
    pub capabilities: Option<BTreeSet<String>>,
    /// Its labels: the handshake's with the configuration's over them.
    pub labels: BTreeMap<String, String>,
    /// Live lessons placed on it.
    pub load: u32,
    /// The most it takes; 0 for no limit.
    pub capacity: u32,
}

impl Candidate {
    /// The view of `agent`: `configured` are the operators' labels for it (they win over the
    /// handshake's), `drained` and `lost` what the drive layer knows of it.
    pub fn of(
        agent: &Snapshot,
        configured: &BTreeMap<String, String>,
        drained: bool,
        lost: bool,
    ) -> Candidate {
        let status = &agent.status;
        let availability = match status.state {
            _ if lost => Availability::Lost,
            AgentState::Ready => Availability::Ready,
            state => {
                let state = match state {
                    AgentState::Connecting => "connecting",
                    AgentState::Unavailable => "unavailable",
                    AgentState::Incompatible => "incompatible",
                    AgentState::Ready => "ready",
                };
                Availability::Down(if status.last_error.is_empty() {
                    state.to_owned()
                } else {
                    format!("{state} ({})", status.last_error)
                })
            }
        };
        let mut labels = status
            .handshake
            .as_ref()
            .map(|h| h.labels.clone())
            .unwrap_or_default();
        labels.extend(configured.clone());
        Candidate {
            name: agent.name.clone(),
            availability,
            drained,
            capabilities: status.handshake.as_ref().map(|h| h.capabilities.clone()),
            labels,
            load: agent.load,
            capacity: status.handshake.as_ref().map_or(0, |h| h.max_live_lessons),
        }
    }

    /// Its labels or capabilities that fall short of `needs`, as phrases ("missing label
    /// region=eu", "lacks capability stage.configuration"). Without a handshake, capabilities
    /// are unknown and a label may still come from it (`sure` false leaves those out).
    fn shortfalls(&self, needs: &Needs, sure: bool) -> Vec<String> {
        let mut out = Vec::new();
        for (key, value) in &needs.requires {
            match self.labels.get(key) {
                Some(have) if have == value => {}
                Some(have) => out.push(format!("missing label {key}={value} (has {key}={have})")),
                None if self.capabilities.is_none() && !sure => {}
                None => out.push(format!("missing label {key}={value}")),
            }
        }
        if let Some(offered) = &self.capabilities {
            let missing: Vec<_> = needs
                .capabilities
                .iter()
                .filter(|c| !offers(offered, c))
                .copied()
                .collect();
            if !missing.is_empty() {
                out.push(format!("lacks capability {}", missing.join(", ")));
            }
        }
        out
    }

    /// The requirements it does not meet, named as requirements ("label region=eu",
    /// "capability stage.configuration"), judged as [`Candidate::shortfalls`] with `sure`.
    fn unmet(&self, needs: &Needs) -> Vec<String> {
        let mut out: Vec<String> = needs
            .requires
            .iter()
            .filter(|(key, value)| self.labels.get(*key) != Some(value))
            .map(|(key, value)| format!("label {key}={value}"))
            .collect();
        if let Some(offered) = &self.capabilities {
            out.extend(
                needs
                    .capabilities
                    .iter()
                    .filter(|c| !offers(offered, c))
                    .map(|c| format!("capability {c}")),
            );
        }
        out
    }

    /// The preferred labels it carries.
    fn matched(&self, needs: &Needs) -> BTreeMap<String, String> {
        needs
            .prefers
            .iter()
            .filter(|(key, value)| self.labels.get(*key) == Some(value))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// "3/10", or "3 (no limit)".
    fn load_text(&self) -> String {
        if self.capacity > 0 {
            format!("{}/{}", self.load, self.capacity)
        } else {
            format!("{} (no limit)", self.load)
        }
    }
}

/// Every agent and why placement did not choose it, as `` `name`: why ``.
pub fn explain(excluded: &[(String, String)]) -> String {
    excluded
        .iter()
        .map(|(agent, why)| format!("`{agent}`: {why}"))
        .collect::<Vec<_>>()
        .join("; ")
}

fn pairs(labels: &BTreeMap<String, String>) -> String {
    labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Picks an agent and says why, or explains why none fits now (one entry per agent).
pub fn choose(agents: &[Candidate], needs: &Needs) -> Result<Decision, Vec<(String, String)>> {
    let mut excluded = Vec::new();
    // (preferred labels matched, load ratio, the agent), best so far first.
    let mut eligible: Vec<(usize, f64, &Candidate)> = Vec::new();
    for agent in agents {
        let mut why = Vec::new();
        match &agent.availability {
            Availability::Ready => {}
            Availability::Lost => why.push("lost".to_owned()),
            Availability::Down(state) => why.push(state.clone()),
        }
        if agent.drained {
            why.push("drained".to_owned());
        }
        why.extend(agent.shortfalls(needs, true));
        if agent.capacity > 0 && agent.load >= agent.capacity {
            why.push(format!("full {}/{}", agent.load, agent.capacity));
        }
        if !why.is_empty() {
            excluded.push((agent.name.clone(), why.join(", ")));
            continue;
        }
        let ratio = if agent.capacity > 0 {
            f64::from(agent.load) / f64::from(agent.capacity)
        } else {
            // Unlimited agents compare by absolute load, scaled far below any bounded ratio's
            // steps so a bounded agent at 0 % still ties with an idle unlimited one.
            f64::from(agent.load) / 1e6
        };
        eligible.push((agent.matched(needs).len(), ratio, agent));
    }
    if eligible.is_empty() {
        if agents.is_empty() {
            excluded.push(("*".into(), "no agents are configured".into()));
        }
        return Err(excluded);
    }
    // Stable: ties keep configuration order.
    eligible.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.total_cmp(&b.1)));
    let (_, _, chosen) = eligible[0];
    let matched = chosen.matched(needs);
    for (count, _, agent) in &eligible[1..] {
        let why = if *count < matched.len() {
            format!(
                "ranked lower: carries {count} of {} preferred labels",
                needs.prefers.len()
            )
        } else {
            format!("ranked lower: load {}", agent.load_text())
        };
        excluded.push((agent.name.clone(), why));
    }
    // Report the others in configuration order.
    let order: BTreeMap<&str, usize> = agents
        .iter()
        .enumerate()
        .map(|(i, a)| (a.name.as_str(), i))
        .collect();
    excluded.sort_by_key(|(name, _)| order.get(name.as_str()).copied());
    let mut reason = format!("chose `{}`", chosen.name);
    if !needs.requires.is_empty() {
        reason.push_str(&format!(": carries required {}", pairs(&needs.requires)));
    }
    if !needs.prefers.is_empty() {
        reason.push_str(&format!(
            "{} {} of {} preferred labels{}",
            if needs.requires.is_empty() { ":" } else { ";" },
            matched.len(),
            needs.prefers.len(),
            if matched.is_empty() {
                String::new()
            } else {
                format!(" ({})", pairs(&matched))
            }
        ));
    }
    reason.push_str(&format!(
        "{} load {}",
        if needs.requires.is_empty() && needs.prefers.is_empty() {
            ":"
        } else {
            ";"
        },
        chosen.load_text()
    ));
    if !excluded.is_empty() {
        reason.push_str(&format!(". Not chosen: {}", explain(&excluded)));
    }
    Ok(Decision {
        agent: chosen.name.clone(),
        matched,
        load: chosen.load,
        capacity: chosen.capacity,
        excluded,
        reason,
    })
}

/// Whether some agent among `agents` (any state) could ever take a live lesson with these
/// needs. The error names what is missing (`missing`: the requirements no agent meets, or, when
/// each is met by some agent but none meets all, those the closest agent lacks) and every
/// agent's shortfalls.
pub fn possible(agents: &[Candidate], needs: &Needs) -> Result<(), Impossible> {
    let mut shortfalls = Vec::new();
    for agent in agents {
        let short = agent.shortfalls(needs, false);
        if short.is_empty() {
            return Ok(());
        }
        shortfalls.push((agent, short));
    }
    // What no agent has at all.
    let mut missing: Vec<String> = Vec::new();
    for (key, value) in &needs.requires {
        if !agents.iter().any(|a| a.labels.get(key) == Some(value)) {
            missing.push(format!("label {key}={value}"));
        }
    }
    for capability in &needs.capabilities {
        if !agents.iter().any(|a| {
            a.capabilities
                .as_ref()
                .is_none_or(|c| offers(c, capability))
        }) {
            missing.push(format!("capability {capability}"));
        }
    }
    let combination = missing.is_empty();
    if combination && let Some((closest, _)) = shortfalls.iter().min_by_key(|(_, s)| s.len()) {
        missing = closest.unmet(needs);
    }
    let detail = if agents.is_empty() {
        "no agents are configured".to_owned()
    } else {
        shortfalls
            .iter()
            .map(|(agent, short)| format!("`{}`: {}", agent.name, short.join(", ")))
            .collect::<Vec<_>>()
            .join("; ")
    };
    Err(Impossible {
        missing: missing.join(", "),
        combination,
        detail,
    })
}

/// Why no agent could ever take a live lesson.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Impossible {
    /// What no agent has (`label region=eu`, `capability presentation.ssh`); when `combination`,
    /// what the closest agent lacks.
    pub missing: String,
    /// Every requirement is met by some agent, but no agent meets them all.
    pub combination: bool,
    /// Every agent's shortfalls.
    pub detail: String,
}

impl std::fmt::Display for Impossible {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.missing.is_empty(), self.combination) {
            (true, _) => write!(f, "{}", self.detail),
            (false, false) => write!(f, "no agent has {} ({})", self.missing, self.detail),
            (false, true) => write!(
                f,
                "no agent has everything it requires; the closest lacks {} ({})",
                self.missing, self.detail
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: &[&str] = &[
        capabilities::PRESENTATION_SSH,
        capabilities::PRESENTATION_HTTP,
        capabilities::STAGE_CONFIGURATION,
    ];

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    /// A ready agent offering every capability, carrying `with`, holding `load` of at most
    /// `max` (0 = unlimited).
    fn ready(name: &str, with: &[(&str, &str)], load: u32, max: u32) -> Candidate {
        Candidate {
            name: name.into(),
            availability: Availability::Ready,
            drained: false,
            capabilities: Some(ALL.iter().map(|c| (*c).to_owned()).collect()),
            labels: labels(with),
            load,
            capacity: max,
        }
    }

    fn offering(mut agent: Candidate, offers: &[&str]) -> Candidate {
        agent.capabilities = Some(offers.iter().map(|c| (*c).to_owned()).collect());
        agent
    }

    fn drained(mut agent: Candidate) -> Candidate {
        agent.drained = true;
        agent
    }

    fn lost(mut agent: Candidate) -> Candidate {
        agent.availability = Availability::Lost;
        agent
    }

    fn down(mut agent: Candidate, state: &str) -> Candidate {
        agent.availability = Availability::Down(state.into());
        agent
    }

    /// Never handshaked: only its configured labels are known.
    fn unknown(name: &str, configured: &[(&str, &str)]) -> Candidate {
        Candidate {
            capabilities: None,
            ..down(ready(name, configured, 0, 0), "connecting")
        }
    }

    fn needs(requires: &[(&str, &str)], prefers: &[(&str, &str)]) -> Needs {
        Needs {
            capabilities: ALL.to_vec(),
            requires: labels(requires),
            prefers: labels(prefers),
        }
    }

    /// Chooses among `agents` and compares the answer with `expect`: the chosen name and the
    /// reason, or `error: ` and every agent's reasons.
    #[track_caller]
    fn check(agents: &[Candidate], needs: &Needs, expect: &str) {
        let got = match choose(agents, needs) {
            Ok(decision) => format!("{}: {}", decision.agent, decision.reason),
            Err(why) => format!("error: {}", explain(&why)),
        };
        assert_eq!(got, expect);
    }

    /// Asks whether any agent could ever take it: `ok`, or the error's text.
    #[track_caller]
    fn check_possible(agents: &[Candidate], needs: &Needs, expect: &str) {
        let got = match possible(agents, needs) {
            Ok(()) => "ok".to_owned(),
            Err(impossible) => format!("{} | {impossible}", impossible.missing),
        };
        assert_eq!(got, expect);
    }

    #[test]
    fn no_agents() {
        check(
            &[],
            &needs(&[], &[]),
            "error: `*`: no agents are configured",
        );
        check_possible(
            &[],
            &needs(&[("region", "eu")], &[]),
            "label region=eu, capability presentation.ssh, capability presentation.http, \
             capability stage.configuration | no agent has label region=eu, capability \
             presentation.ssh, capability presentation.http, capability stage.configuration \
             (no agents are configured)",
        );
    }

    #[test]
    fn the_least_loaded_relative_to_capacity_wins() {
        let n = needs(&[], &[]);
        check(
            &[ready("a", &[], 5, 10), ready("b", &[], 2, 10)],
            &n,
            "b: chose `b`: load 2/10. Not chosen: `a`: ranked lower: load 5/10",
        );
        check(
            &[ready("a", &[], 5, 10), ready("b", &[], 4, 5)],
            &n,
            "a: chose `a`: load 5/10. Not chosen: `b`: ranked lower: load 4/5",
        );
    }

    #[test]
    fn ties_go_to_configuration_order() {
        let n = needs(&[], &[]);
        check(
            &[ready("a", &[], 1, 4), ready("b", &[], 1, 4)],
            &n,
            "a: chose `a`: load 1/4. Not chosen: `b`: ranked lower: load 1/4",
        );
        // An idle bounded agent ties with an idle unlimited one.
        check(
            &[ready("a", &[], 0, 4), ready("b", &[], 0, 0)],
            &n,
            "a: chose `a`: load 0/4. Not chosen: `b`: ranked lower: load 0 (no limit)",
        );
    }

    #[test]
    fn unlimited_agents_compare_by_load() {
        let n = needs(&[], &[]);
        check(
            &[ready("a", &[], 7, 0), ready("b", &[], 3, 0)],
            &n,
            "b: chose `b`: load 3 (no limit). Not chosen: `a`: ranked lower: load 7 (no limit)",
        );
        check(
            &[ready("a", &[], 1, 2), ready("b", &[], 900, 0)],
            &n,
            "b: chose `b`: load 900 (no limit). Not chosen: `a`: ranked lower: load 1/2",
        );
    }

    #[test]
    fn required_labels_filter_and_name_what_is_missing() {
        let n = needs(&[("region", "eu")], &[]);
        check(
            &[
                ready("a", &[("region", "us")], 0, 0),
                ready("b", &[], 0, 0),
                ready("c", &[("region", "eu"), ("disk", "ssd")], 9, 10),
            ],
            &n,
            "c: chose `c`: carries required region=eu; load 9/10. Not chosen: \
             `a`: missing label region=eu (has region=us); `b`: missing label region=eu",
        );
        check(
            &[ready("a", &[("region", "us")], 0, 0)],
            &n,
            "error: `a`: missing label region=eu (has region=us)",
        );
    }

    #[test]
    fn preferred_labels_win_over_load() {
        let n = needs(&[], &[("region", "eu"), ("disk", "ssd")]);
        check(
            &[
                ready("a", &[("region", "eu")], 0, 10),
                ready("b", &[("region", "eu"), ("disk", "ssd")], 8, 10),
                ready("c", &[], 0, 10),
            ],
            &n,
            "b: chose `b`: 2 of 2 preferred labels (disk=ssd, region=eu); load 8/10. Not chosen: \
             `a`: ranked lower: carries 1 of 2 preferred labels; \
             `c`: ranked lower: carries 0 of 2 preferred labels",
        );
        // Equal matches: load decides.
        check(
            &[
                ready("a", &[("region", "eu")], 3, 10),
                ready("b", &[("disk", "ssd")], 1, 10),
            ],
            &n,
            "b: chose `b`: 1 of 2 preferred labels (disk=ssd); load 1/10. Not chosen: \
             `a`: ranked lower: load 3/10",
        );
    }

    #[test]
    fn full_drained_lost_and_down_agents_are_skipped_with_why() {
        let n = needs(&[], &[]);
        check(
            &[
                ready("a", &[], 3, 3),
                drained(ready("b", &[], 0, 0)),
                lost(ready("c", &[], 0, 0)),
                down(
                    ready("d", &[], 0, 0),
                    "unavailable (handshake failed: refused)",
                ),
                ready("e", &[], 9, 10),
            ],
            &n,
            "e: chose `e`: load 9/10. Not chosen: `a`: full 3/3; `b`: drained; `c`: lost; \
             `d`: unavailable (handshake failed: refused)",
        );
        check(
            &[
                ready("a", &[], 10, 10),
                drained(ready("b", &[], 2, 3)),
                lost(ready("c", &[], 0, 0)),
            ],
            &n,
            "error: `a`: full 10/10; `b`: drained; `c`: lost",
        );
    }

    #[test]
    fn missing_capabilities_are_named() {
        let http = &[capabilities::PRESENTATION_HTTP];
        let ssh = Needs {
            capabilities: vec![capabilities::PRESENTATION_SSH],
            ..Needs::default()
        };
        check(
            &[offering(ready("a", &[], 0, 0), http), ready("b", &[], 5, 0)],
            &ssh,
            "b: chose `b`: load 5 (no limit). Not chosen: `a`: lacks capability presentation.ssh",
        );
        check(
            &[offering(ready("a", &[], 0, 0), http)],
            &needs(&[], &[]),
            "error: `a`: lacks capability presentation.ssh, stage.configuration",
        );
        // A lesson needing nothing runs anywhere that is ready.
        check(
            &[offering(ready("a", &[], 0, 0), &[])],
            &Needs::default(),
            "a: chose `a`: load 0 (no limit)",
        );
    }

    /// What a lesson whose endpoints use `types` needs of its agent, capabilities only.
    fn configured(types: &[ConfigurationType]) -> Needs {
        use crate::catalog::Endpoint;
        let mut lesson = lesson();
        lesson.endpoints = types
            .iter()
            .enumerate()
            .map(|(i, kind)| Endpoint {
                name: format!("e{i}"),
                image: "box".into(),
                configuration_type: Some(*kind),
                additional_ports: vec![],
                presentations: vec![],
            })
            .collect();
        Needs::of(&lesson, &Wishes::default()).unwrap()
    }

    #[test]
    fn a_lesson_needs_every_configuration_type_it_uses() {
        use ConfigurationType::{Ansible, Napalm, Python, Shell};
        assert_eq!(
            configured(&[Napalm, Python, Napalm, Ansible]).capabilities,
            [
                capabilities::STAGE_CONFIGURATION,
                capabilities::CONFIGURATION_PYTHON,
                capabilities::CONFIGURATION_ANSIBLE,
                capabilities::CONFIGURATION_NAPALM,
            ]
        );
        assert_eq!(
            configured(&[Shell]).capabilities,
            [
                capabilities::STAGE_CONFIGURATION,
                capabilities::CONFIGURATION_SHELL
            ]
        );
        assert!(configured(&[]).capabilities.is_empty());
    }

    #[test]
    fn configuration_types_choose_the_agent() {
        use ConfigurationType::{Ansible, Python, Shell};
        let with = |name, types: &[&'static str]| {
            let mut offers = vec![capabilities::STAGE_CONFIGURATION];
            offers.extend(types);
            offering(ready(name, &[], 0, 0), &offers)
        };
        let shell_only = with("shell", &[capabilities::CONFIGURATION_SHELL]);
        let all = with(
            "all",
            &[
                capabilities::CONFIGURATION_SHELL,
                capabilities::CONFIGURATION_PYTHON,
                capabilities::CONFIGURATION_ANSIBLE,
            ],
        );
        // An agent listing no type runs shell alone (PROTOCOL.md [V5]).
        let old = with("old", &[]);
        check(
            &[shell_only.clone(), old.clone(), all.clone()],
            &configured(&[Shell, Ansible]),
            "all: chose `all`: load 0 (no limit). Not chosen: `shell`: lacks capability \
             configuration.ansible; `old`: lacks capability configuration.ansible",
        );
        check(
            std::slice::from_ref(&old),
            &configured(&[Shell]),
            "old: chose `old`: load 0 (no limit)",
        );
        check(
            &[shell_only.clone(), old.clone()],
            &configured(&[Python, Ansible]),
            "error: `shell`: lacks capability configuration.python, configuration.ansible; \
             `old`: lacks capability configuration.python, configuration.ansible",
        );
        check_possible(
            &[shell_only.clone(), old.clone()],
            &configured(&[Ansible]),
            "capability configuration.ansible | no agent has capability configuration.ansible \
             (`shell`: lacks capability configuration.ansible; `old`: lacks capability \
             configuration.ansible)",
        );
        check_possible(&[shell_only, all], &configured(&[Ansible]), "ok");
        // Capabilities unknown before a handshake: it may yet run them.
        check_possible(&[unknown("new", &[])], &configured(&[Ansible]), "ok");
    }

    #[test]
    fn impossible_only_when_no_agent_in_any_state_could_ever() {
        let n = needs(&[("region", "eu")], &[]);
        // Full, drained, lost or down agents may come back: the lesson waits.
        for agent in [
            ready("a", &[("region", "eu")], 5, 5),
            drained(ready("a", &[("region", "eu")], 0, 0)),
            lost(ready("a", &[("region", "eu")], 0, 0)),
            down(ready("a", &[("region", "eu")], 0, 0), "unavailable"),
        ] {
            check_possible(&[ready("b", &[], 0, 0), agent], &n, "ok");
        }
        check_possible(
            &[ready("a", &[("region", "us")], 0, 0), ready("b", &[], 0, 0)],
            &n,
            "label region=eu | no agent has label region=eu (`a`: missing label region=eu \
             (has region=us); `b`: missing label region=eu)",
        );
        // Each requirement met by some agent, none meeting both: the closest one's shortfall.
        check_possible(
            &[
                ready("a", &[("region", "eu")], 0, 0),
                ready("b", &[("gpu", "yes")], 0, 0),
            ],
            &needs(&[("region", "eu"), ("gpu", "yes")], &[]),
            "label gpu=yes | no agent has everything it requires; the closest lacks label \
             gpu=yes (`a`: missing label gpu=yes; `b`: missing label region=eu)",
        );
        check_possible(
            &[offering(
                ready("a", &[], 0, 0),
                &[capabilities::PRESENTATION_HTTP],
            )],
            &Needs {
                capabilities: vec![capabilities::STAGE_CONFIGURATION],
                ..Needs::default()
            },
            "capability stage.configuration | no agent has capability stage.configuration \
             (`a`: lacks capability stage.configuration)",
        );
    }

    #[test]
    fn an_agent_never_heard_from_is_judged_by_its_configured_labels() {
        let n = needs(&[("region", "eu")], &[]);
        // Its handshake may still bring the label, and its capabilities are unknown.
        check_possible(&[unknown("a", &[])], &n, "ok");
        check_possible(&[unknown("a", &[("region", "eu")])], &n, "ok");
        // The configuration wins over any handshake: a configured other value is final.
        check_possible(
            &[unknown("a", &[("region", "us")])],
            &n,
            "label region=eu | no agent has label region=eu (`a`: missing label region=eu \
             (has region=us))",
        );
        // Placement itself never picks it before its handshake.
        check(
            &[unknown("a", &[("region", "eu")])],
            &n,
            "error: `a`: connecting",
        );
    }

    #[test]
    fn configured_labels_win_over_the_handshake() {
        use crate::agents::{AgentStatus, Handshake};
        let snapshot = Snapshot {
            name: "a".into(),
            address: "http://a".into(),
            status: AgentStatus {
                state: AgentState::Ready,
                handshake: Some(Handshake {
                    major: 1,
                    labels: labels(&[("region", "us"), ("disk", "ssd")]),
                    max_live_lessons: 4,
                    ..Handshake::default()
                }),
                last_error: String::new(),
                connected_at: None,
            },
            load: 1,
        };
        let candidate = Candidate::of(&snapshot, &labels(&[("region", "eu")]), true, false);
        assert_eq!(
            candidate.labels,
            labels(&[("disk", "ssd"), ("region", "eu")])
        );
        assert_eq!(
            (candidate.drained, candidate.load, candidate.capacity),
            (true, 1, 4)
        );
        assert_eq!(candidate.availability, Availability::Ready);
        let lost = Candidate::of(&snapshot, &BTreeMap::new(), false, true);
        assert_eq!(lost.availability, Availability::Lost);
    }

    /// A lesson with no endpoints and no placement.
    fn lesson() -> crate::catalog::Lesson {
        crate::catalog::Lesson {
            slug: "l".into(),
            name: String::new(),
            category: crate::catalog::Category::Fundamentals,
            tier: crate::catalog::Tier::Prod,
            prereqs: vec![],
            description: String::new(),
            short_description: String::new(),
            tags: vec![],
            authors: vec![],
            collection: None,
            diagram: None,
            video: None,
            ready_delay: std::time::Duration::ZERO,
            config_timeout: None,
            check_timeout: crate::catalog::DEFAULT_CHECK_TIMEOUT,
            endpoints: vec![],
            stages: vec![],
            connections: vec![],
            dir: Default::default(),
            placement: Default::default(),
        }
    }

    #[test]
    fn a_request_cannot_contradict_the_lessons_requirement() {
        let mut lesson = lesson();
        lesson.placement.requires = labels(&[("region", "eu")]);
        lesson.placement.prefers = labels(&[("disk", "ssd")]);
        let wishes = Wishes {
            requires: labels(&[("region", "eu"), ("zone", "b")]),
            prefers: labels(&[("disk", "hdd")]),
        };
        let merged = Needs::of(&lesson, &wishes).unwrap();
        assert_eq!(merged.requires, labels(&[("region", "eu"), ("zone", "b")]));
        assert_eq!(
            merged.prefers,
            labels(&[("disk", "hdd")]),
            "the request's wins"
        );
        let wishes = Wishes {
            requires: labels(&[("region", "us")]),
            ..Wishes::default()
        };
        assert_eq!(
            Needs::of(&lesson, &wishes).unwrap_err(),
            "lesson `l` requires label region=eu but the request requires region=us"
        );
    }
}
