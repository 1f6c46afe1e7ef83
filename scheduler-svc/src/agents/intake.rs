//! The agent intake: where agents behind NAT dial in (`--connect https://SCHEDULER:PORT`).
//!
//! Every connection is TLS with a client certificate signed by `agent_intake.client_ca` (others
//! are refused in the handshake). The agent's name is the one its certificate carries (its
//! first `spiffe://` URI SAN, else its first DNS SAN), so one agent cannot pose as another;
//! it is admitted when `agent_intake.agents` lists it or an `agent_intake.allow` pattern matches
//! it, and never under the name of an agent the scheduler dials (`[[agents]]`). An admitted
//! connection joins the [`Fleet`](super::Fleet): the scheduler then calls the agent over it as
//! over a dialled one (handshake, Watch, Recover on a new instance). A second connection of the
//! same name replaces the first (see `antidote_net::dial::Inbound`).

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;

use antidote_net::dial;
use antidote_net::tls::{ServerTls, TlsFiles, peer_identity};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::Fleet;
use crate::settings::AgentIntakeConfig;

/// Which certificate names may dial in.
#[derive(Debug, Clone)]
pub struct Admission {
    /// Names listed in `agent_intake.agents`.
    expected: BTreeSet<String>,
    /// `agent_intake.allow`.
    allow: Vec<Pattern>,
    /// Agents the scheduler dials: their names are never taken by an agent dialling in.
    dialled: BTreeSet<String>,
}

impl Admission {
    /// From the intake's configuration and the names of the agents the scheduler dials.
    pub fn new(config: &AgentIntakeConfig, dialled: impl IntoIterator<Item = String>) -> Self {
        Admission {
            expected: config.agents.iter().cloned().collect(),
            allow: config.allow.iter().map(|p| Pattern::new(p)).collect(),
            dialled: dialled.into_iter().collect(),
        }
    }

    /// Whether an agent whose certificate names it `name` may dial in; the error says why not.
    pub fn admit(&self, name: &str) -> Result<(), String> {
        if self.dialled.contains(name) {
            return Err(format!(
                "`{name}` is an agent this scheduler dials ([[agents]]): it cannot dial in under that name"
            ));
        }
        if self.expected.contains(name) || self.allow.iter().any(|p| p.matches(name)) {
            Ok(())
        } else {
            Err(format!(
                "`{name}` is neither in agent_intake.agents nor matched by agent_intake.allow"
            ))
        }
    }
}

/// An allowed name: literal text where `*` stands for one DNS label or one URI path segment
/// (any run of characters without `.` or `/`, at least one), so `*.agents.example` admits
/// `edge-1.agents.example` but not `a.b.agents.example`, and `spiffe://example.org/agent/*`
/// admits `spiffe://example.org/agent/edge-1` but not `spiffe://example.org/agent/a/b`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pattern {
    /// The pattern, in lower case.
    text: String,
}

impl Pattern {
    /// Parses a pattern (any text is one).
    pub fn new(text: &str) -> Pattern {
        Pattern {
            text: text.to_ascii_lowercase(),
        }
    }

    /// Whether `name` matches (DNS names compare without regard to case).
    pub fn matches(&self, name: &str) -> bool {
        glob(self.text.as_bytes(), name.to_ascii_lowercase().as_bytes())
    }
}

/// `*` matches one or more bytes other than `.` and `/`; everything else matches itself.
fn glob(pattern: &[u8], name: &[u8]) -> bool {
    match pattern.split_first() {
        None => name.is_empty(),
        Some((b'*', rest)) => {
            let run = name
                .iter()
                .position(|&b| b == b'.' || b == b'/')
                .unwrap_or(name.len());
            (1..=run).any(|n| glob(rest, &name[n..]))
        }
        Some((c, rest)) => name
            .split_first()
            .is_some_and(|(b, tail)| b == c && glob(rest, tail)),
    }
}

/// The intake's listener and what it needs.
pub struct Intake {
    /// The scheduler's server certificate, and the CA of agents' client certificates.
    tls: ServerTls,
    /// Which names are admitted.
    admission: Admission,
}

impl Intake {
    /// Loads the certificate files (an error names the one that does not load).
    pub fn new(config: &AgentIntakeConfig, admission: Admission) -> anyhow::Result<Intake> {
        let files = TlsFiles {
            cert: config.cert.clone(),
            key: config.key.clone(),
            ca: config.client_ca.clone(),
        };
        let tls = ServerTls::load(files, None)
            .map_err(|err| anyhow::anyhow!("key `agent_intake`: {err}"))?;
        Ok(Intake { tls, admission })
    }

    /// Accepts agents on `listener` until `shutdown`; each connection's handshake runs in its
    /// own task, so a slow or refused agent holds up no other.
    pub async fn serve(
        self,
        listener: TcpListener,
        fleet: Arc<Fleet>,
        tracker: TaskTracker,
        shutdown: CancellationToken,
    ) {
        let intake = Arc::new(self);
        antidote_net::accept::each(&listener, &shutdown, |tcp, peer| {
            let (intake, fleet) = (intake.clone(), fleet.clone());
            tracker.spawn(async move {
                if let Err(reason) = intake.admit(tcp, &fleet).await {
                    tracing::warn!(%peer, %reason, "agent intake: connection refused");
                }
            });
        })
        .await;
    }

    /// The handshake, the name, the admission; an admitted connection joins the fleet.
    async fn admit(&self, tcp: tokio::net::TcpStream, fleet: &Fleet) -> Result<(), String> {
        let (link, leaf) = dial::accept(&self.tls, tcp)
            .await
            .map_err(|err| err.to_string())?;
        let peer: SocketAddr = link.peer();
        let name = peer_identity(&leaf).ok_or_else(|| {
            "the certificate carries no DNS or spiffe:// name to know the agent by".to_owned()
        })?;
        self.admission.admit(&name)?;
        tracing::info!(agent = %name, %peer, "agent dialled in");
        fleet.dialled_in(&name, link);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `check(pattern, name, matches)`: the one table of the name patterns.
    fn check(pattern: &str, name: &str, matches: bool) {
        assert_eq!(
            Pattern::new(pattern).matches(name),
            matches,
            "`{pattern}` against `{name}`"
        );
    }

    #[test]
    fn patterns() {
        check("*.agents.example", "edge-1.agents.example", true);
        check("*.agents.example", "EDGE-1.Agents.example", true);
        check("*.agents.example", "a.b.agents.example", false);
        check("*.agents.example", ".agents.example", false);
        check("*.agents.example", "agents.example", false);
        check("*.agents.example", "edge-1.agents.example.evil", false);
        check("edge-1.agents.example", "edge-1.agents.example", true);
        check("edge-1.agents.example", "edge-2.agents.example", false);
        let spiffe = "spiffe://example.org/agent/*";
        check(spiffe, "spiffe://example.org/agent/edge-1", true);
        check(spiffe, "spiffe://example.org/agent/a/b", false);
        check(spiffe, "spiffe://example.org/agent/", false);
        check(spiffe, "spiffe://evil.org/agent/edge-1", false);
        check("edge-*.agents.example", "edge-7.agents.example", true);
        check("edge-*.agents.example", "core-7.agents.example", false);
        check("*-*.example", "a-b.example", true);
        check("*", "single", true);
        check("*", "two.labels", false);
    }

    #[test]
    fn admission() {
        let config = AgentIntakeConfig {
            allow: vec!["*.agents.example".into()],
            agents: vec!["spiffe://example.org/agent/lab".into()],
            ..AgentIntakeConfig::default()
        };
        let admission = Admission::new(&config, ["docker.agents.example".to_owned()]);
        assert!(admission.admit("edge-1.agents.example").is_ok());
        assert!(admission.admit("spiffe://example.org/agent/lab").is_ok());
        let err = admission
            .admit("spiffe://example.org/agent/other")
            .unwrap_err();
        assert!(err.contains("agent_intake.allow"), "{err}");
        // The name of an agent the scheduler dials is never taken, even when a pattern matches.
        let err = admission.admit("docker.agents.example").unwrap_err();
        assert!(err.contains("[[agents]]"), "{err}");
    }
}
