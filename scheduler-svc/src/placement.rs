//! Placement: which agent takes a new live lesson. Pure functions over the fleet's state, so the
//! rules are testable without processes.
//!
//! An agent is eligible when it is ready (handshake done, stream healthy), offers every
//! capability the lesson needs, and has room. Among eligible agents the least loaded (relative
//! to capacity) wins, ties going to configuration order.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::catalog::{Lesson, PresentationKind};
use crate::fleet::Agent;

/// The capabilities an agent must offer to run a lesson.
pub fn needs(lesson: &Lesson) -> Vec<&'static str> {
    let mut needs = Vec::new();
    let presentations = || lesson.endpoints.iter().flat_map(|e| &e.presentations);
    if presentations().any(|p| p.kind == PresentationKind::Ssh) {
        needs.push("presentation.ssh");
    }
    if presentations().any(|p| p.kind == PresentationKind::Http) {
        needs.push("presentation.http");
    }
    if lesson
        .endpoints
        .iter()
        .any(|e| e.configuration_type.is_some())
    {
        needs.push("stage.configuration");
    }
    needs
}

/// Picks an agent, or explains why none fits (one reason per agent).
pub fn choose(agents: &[Arc<Agent>], needs: &[&str]) -> Result<Arc<Agent>, String> {
    let mut reasons = Vec::new();
    let mut best: Option<(f64, &Arc<Agent>)> = None;
    for agent in agents {
        if !agent.is_ready() {
            let status = agent.status();
            reasons.push(format!(
                "`{}` is {:?}{}",
                agent.name,
                status.state,
                if status.last_error.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", status.last_error)
                }
            ));
            continue;
        }
        let capabilities = agent.capabilities();
        let missing: Vec<_> = needs
            .iter()
            .filter(|need| !capabilities.contains(**need))
            .collect();
        if !missing.is_empty() {
            reasons.push(format!("`{}` lacks {missing:?}", agent.name));
            continue;
        }
        let load = agent.load.load(Ordering::Relaxed);
        let max = agent.max_live_lessons();
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
        Some((_, agent)) => Ok(agent.clone()),
        None if agents.is_empty() => Err("no agents are configured".into()),
        None => Err(reasons.join("; ")),
    }
}
