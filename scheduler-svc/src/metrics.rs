//! The scheduler's Prometheus metrics, served on `/metrics` of the HTTP listener (OpenMetrics
//! text):
//! - `antidote_live_lessons{status}` and `antidote_sessions{kind}`: counted in the store at
//!   each scrape, so they are right after a restart and across replicas;
//! - `antidote_provisioning_duration_seconds{lesson, outcome}`: one generation from the start of
//!   its work to READY or FAILED;
//! - `antidote_agent_call_duration_seconds{agent, rpc, code}` and
//!   `antidote_agent_call_errors_total{agent, rpc, code}`: every call to an agent (Watch
//!   excepted);
//! - `antidote_agent_ready{agent}`: 1 when the agent's handshake holds, 0 otherwise;
//! - `antidote_agent_state{agent, state}`: 1 for each of `ready`, `lost` (unreachable past
//!   `reconciler.agent_grace`, its live lessons moved) and `drained` that holds, else 0; set by
//!   the reconciler's look at the fleet;
//! - `antidote_agent_watch_streams_total{agent}`: Watch streams opened to the agent (one per
//!   connection: a count that climbs means streams keep breaking);
//! - `antidote_agent_watch_snapshot_states{agent}` and `antidote_agent_watch_snapshot_pages{agent}`:
//!   the live lessons and pages (PROTOCOL.md [W8]) of the agent's last complete snapshot;
//! - `antidote_reaper_actions_total{action}`: live lessons expired (`expire_live_lesson`,
//!   `expire_session`), orphans removed (`remove_orphan`), events pruned (`prune_events`);
//! - `antidote_reaper_duty_runs_total{duty}`: ticks this process ran a duty (`expire`,
//!   `orphans`); with replicas, only the one holding the `reaper` lease does, so summed over
//!   replicas it is one per tick;
//! - warm pools: `antidote_pool_target{lesson, stage}` (the target now, windows applied; set at
//!   every look at the pools), `antidote_pool_members{lesson, stage, status}` (unclaimed
//!   members, counted in the store at each scrape; `TERMINATING` for those being removed) and
//!   `antidote_pool_claims_total{lesson, result}` (requests for a pooled lesson: `hit` claimed
//!   a READY member, `miss` found none and was provisioned; a session that could take none,
//!   having the lesson already, at its limit or expired, is neither; per process). A deleted
//!   pool's target goes at the next look.
//! - stage checks: `antidote_checks_total{lesson, stage, result}` (runs of a stage's checks,
//!   learners' and `TestStage`'s: `passed`, `failed`, `error` when the agent could not run them)
//!   and `antidote_check_duration_seconds{lesson, stage}` (from the call to the agent's answer).
//! - the store's work against its database since this process opened it:
//!   `antidote_store_transactions_total` (write transactions: one per batch of write jobs),
//!   `antidote_store_write_jobs_total` (the jobs they carried) and `antidote_store_reads_total`
//!   (queries on a reading connection; what the store's caches answered is not counted).

use std::sync::Arc;
use std::time::Duration;

use antidote_net::metrics::{
    HistogramFamily, call_buckets, code_name, encode, provisioning_buckets,
};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric as _};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use crate::model::Status;
use crate::store::{Counts, Traffic};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusLabels {
    status: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProvisionLabels {
    lesson: String,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    agent: String,
    rpc: &'static str,
    code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AgentLabels {
    agent: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AgentStateLabels {
    agent: String,
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabels {
    lesson: String,
    stage: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolMemberLabels {
    lesson: String,
    stage: String,
    status: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClaimLabels {
    lesson: String,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CheckLabels {
    lesson: String,
    stage: String,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CheckStageLabels {
    lesson: String,
    stage: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ActionLabels {
    action: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DutyLabels {
    duty: &'static str,
}

/// A duty of the reaper, run once per tick by one process.
#[derive(Clone, Copy, Debug)]
pub enum ReaperDuty {
    /// Expiring idle live lessons and sessions, pruning events.
    Expire,
    /// Collecting orphans on the agents.
    Orphans,
}

/// What the reaper did.
#[derive(Clone, Copy, Debug)]
pub enum ReaperAction {
    /// A live lesson idle past its TTL was marked for removal.
    ExpireLiveLesson,
    /// A live lesson of a session idle past its TTL was marked for removal.
    ExpireSession,
    /// An orphan's objects were removed from an agent.
    RemoveOrphan,
    /// Events of removed live lessons were pruned (counted per event).
    PruneEvents,
}

impl ReaperAction {
    fn as_str(self) -> &'static str {
        match self {
            ReaperAction::ExpireLiveLesson => "expire_live_lesson",
            ReaperAction::ExpireSession => "expire_session",
            ReaperAction::RemoveOrphan => "remove_orphan",
            ReaperAction::PruneEvents => "prune_events",
        }
    }
}

/// The scheduler's metrics; one per process, passed to whoever records.
pub struct Metrics {
    registry: Registry,
    live_lessons: Family<StatusLabels, Gauge>,
    sessions: Family<KindLabels, Gauge>,
    provisioning: HistogramFamily<ProvisionLabels>,
    agent_calls: HistogramFamily<CallLabels>,
    agent_errors: Family<CallLabels, Counter>,
    agent_ready: Family<AgentLabels, Gauge>,
    reaper: Family<ActionLabels, Counter>,
    reaper_duties: Family<DutyLabels, Counter>,
    agent_state: Family<AgentStateLabels, Gauge>,
    pool_target: Family<PoolLabels, Gauge>,
    pool_members: Family<PoolMemberLabels, Gauge>,
    pool_claims: Family<ClaimLabels, Counter>,
    /// Every (lesson, stage) whose members were ever counted, so a status whose count fell to
    /// zero shows 0 rather than its last value.
    pools_seen: std::sync::Mutex<std::collections::BTreeSet<(String, u32)>>,
    watch_streams: Family<AgentLabels, Counter>,
    snapshot_states: Family<AgentLabels, Gauge>,
    snapshot_pages: Family<AgentLabels, Gauge>,
    checks: Family<CheckLabels, Counter>,
    check_duration: HistogramFamily<CheckStageLabels>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("antidote");
        let live_lessons = Family::<StatusLabels, Gauge>::default();
        let sessions = Family::<KindLabels, Gauge>::default();
        let provisioning = HistogramFamily::<ProvisionLabels>::new_with_constructor(|| {
            Histogram::new(provisioning_buckets())
        });
        let agent_calls =
            HistogramFamily::<CallLabels>::new_with_constructor(|| Histogram::new(call_buckets()));
        let agent_errors = Family::<CallLabels, Counter>::default();
        let agent_ready = Family::<AgentLabels, Gauge>::default();
        let reaper = Family::<ActionLabels, Counter>::default();
        let reaper_duties = Family::<DutyLabels, Counter>::default();
        let agent_state = Family::<AgentStateLabels, Gauge>::default();
        let pool_target = Family::<PoolLabels, Gauge>::default();
        let pool_members = Family::<PoolMemberLabels, Gauge>::default();
        let pool_claims = Family::<ClaimLabels, Counter>::default();
        registry.register(
            "pool_target",
            "Warm pools: the target now (time windows applied)",
            pool_target.clone(),
        );
        registry.register(
            "pool_members",
            "Warm pools: unclaimed members by status",
            pool_members.clone(),
        );
        registry.register(
            "pool_claims",
            "Requests for a pooled lesson: hit (a READY member claimed) or miss (provisioned)",
            pool_claims.clone(),
        );
        registry.register(
            "agent_state",
            "1 for each state of the agent that holds (ready, lost, drained), else 0",
            agent_state.clone(),
        );
        registry.register(
            "live_lessons",
            "Live lessons by status",
            live_lessons.clone(),
        );
        registry.register(
            "sessions",
            "Live sessions by kind (ephemeral, persistent)",
            sessions.clone(),
        );
        registry.register_with_unit(
            "provisioning_duration",
            "Time from the start of a generation's work to READY or FAILED",
            Unit::Seconds,
            provisioning.clone(),
        );
        registry.register_with_unit(
            "agent_call_duration",
            "Calls to agents by agent, method and gRPC code (Watch excepted)",
            Unit::Seconds,
            agent_calls.clone(),
        );
        registry.register(
            "agent_call_errors",
            "Calls to agents that ended with a code other than OK",
            agent_errors.clone(),
        );
        registry.register(
            "agent_ready",
            "1 when the agent's handshake holds, else 0",
            agent_ready.clone(),
        );
        registry.register(
            "reaper_actions",
            "What the reaper did: expired live lessons, removed orphans, pruned events",
            reaper.clone(),
        );
        registry.register(
            "reaper_duty_runs",
            "Ticks this process ran a reaper duty (one replica at a time does)",
            reaper_duties.clone(),
        );
        let watch_streams = Family::<AgentLabels, Counter>::default();
        let snapshot_states = Family::<AgentLabels, Gauge>::default();
        let snapshot_pages = Family::<AgentLabels, Gauge>::default();
        registry.register(
            "agent_watch_streams",
            "Watch streams opened to the agent",
            watch_streams.clone(),
        );
        registry.register(
            "agent_watch_snapshot_states",
            "Live lessons in the agent's last complete Watch snapshot",
            snapshot_states.clone(),
        );
        registry.register(
            "agent_watch_snapshot_pages",
            "Pages of the agent's last complete Watch snapshot",
            snapshot_pages.clone(),
        );
        let checks = Family::<CheckLabels, Counter>::default();
        let check_duration = HistogramFamily::<CheckStageLabels>::new_with_constructor(|| {
            Histogram::new(call_buckets())
        });
        registry.register(
            "checks",
            "Runs of a stage's checks by lesson, stage and result (passed, failed, error)",
            checks.clone(),
        );
        registry.register_with_unit(
            "check_duration",
            "Runs of a stage's checks, from the call to the agent's answer",
            Unit::Seconds,
            check_duration.clone(),
        );
        Metrics {
            checks,
            check_duration,
            pool_target,
            pool_members,
            pool_claims,
            pools_seen: Default::default(),
            watch_streams,
            snapshot_states,
            snapshot_pages,
            registry,
            live_lessons,
            sessions,
            provisioning,
            agent_calls,
            agent_errors,
            agent_ready,
            reaper,
            reaper_duties,
            agent_state,
        }
    }
}

impl Metrics {
    /// Records one generation settled as READY (`ready`) or FAILED after `took`.
    pub fn provisioned(&self, lesson: &str, ready: bool, took: Duration) {
        let outcome = if ready { "ready" } else { "failed" };
        self.provisioning
            .get_or_create(&ProvisionLabels {
                lesson: lesson.to_owned(),
                outcome,
            })
            .observe(took.as_secs_f64());
    }

    /// Records one answered agent call.
    pub fn agent_call(&self, agent: &str, rpc: &'static str, code: tonic::Code, took: Duration) {
        let labels = CallLabels {
            agent: agent.to_owned(),
            rpc,
            code: code_name(code),
        };
        self.agent_calls
            .get_or_create(&labels)
            .observe(took.as_secs_f64());
        if code != tonic::Code::Ok {
            self.agent_errors.get_or_create(&labels).inc();
        }
    }

    /// Records one run of a stage's checks: `result` is `passed`, `failed` or `error`.
    pub fn checked(&self, lesson: &str, stage: u32, result: &'static str, took: Duration) {
        let stage = stage.to_string();
        self.checks
            .get_or_create(&CheckLabels {
                lesson: lesson.to_owned(),
                stage: stage.clone(),
                result,
            })
            .inc();
        self.check_duration
            .get_or_create(&CheckStageLabels {
                lesson: lesson.to_owned(),
                stage,
            })
            .observe(took.as_secs_f64());
    }

    /// Serves the store's traffic counters (`antidote_store_*_total`), read at each scrape.
    pub fn count_store(&mut self, traffic: Arc<Traffic>) {
        self.registry
            .register_collector(Box::new(StoreTraffic(traffic)));
    }

    /// Counts a Watch stream opened to an agent.
    pub fn watch_opened(&self, agent: &str) {
        self.watch_streams
            .get_or_create(&AgentLabels {
                agent: agent.to_owned(),
            })
            .inc();
    }

    /// Records an agent's complete Watch snapshot: how many live lessons, in how many pages.
    pub fn watch_snapshot(&self, agent: &str, states: usize, pages: usize) {
        let labels = AgentLabels {
            agent: agent.to_owned(),
        };
        self.snapshot_states
            .get_or_create(&labels)
            .set(states as i64);
        self.snapshot_pages.get_or_create(&labels).set(pages as i64);
    }

    /// Sets a warm pool's target now.
    pub fn pool_target(&self, lesson: &str, stage: u32, target: u32) {
        self.pool_target
            .get_or_create(&PoolLabels {
                lesson: lesson.to_owned(),
                stage: stage.to_string(),
            })
            .set(i64::from(target));
    }

    /// Drops the target of a pool that no longer exists.
    pub fn forget_pool_target(&self, lesson: &str, stage: u32) {
        self.pool_target.remove(&PoolLabels {
            lesson: lesson.to_owned(),
            stage: stage.to_string(),
        });
    }

    /// Counts a request for a pooled lesson: `hit` when it claimed a member.
    pub fn pool_claim(&self, lesson: &str, hit: bool) {
        self.pool_claims
            .get_or_create(&ClaimLabels {
                lesson: lesson.to_owned(),
                result: if hit { "hit" } else { "miss" },
            })
            .inc();
    }

    /// Counts reaper actions.
    pub fn reaped(&self, action: ReaperAction, count: u64) {
        self.reaper
            .get_or_create(&ActionLabels {
                action: action.as_str(),
            })
            .inc_by(count);
    }

    /// Counts a tick on which this process ran `duty`.
    pub fn duty_ran(&self, duty: ReaperDuty) {
        self.reaper_duties
            .get_or_create(&DutyLabels {
                duty: match duty {
                    ReaperDuty::Expire => "expire",
                    ReaperDuty::Orphans => "orphans",
                },
            })
            .inc();
    }

    /// Records which of an agent's states hold: ready, lost, drained.
    pub fn agent_state(&self, agent: &str, ready: bool, lost: bool, drained: bool) {
        for (state, holds) in [("ready", ready), ("lost", lost), ("drained", drained)] {
            self.agent_state
                .get_or_create(&AgentStateLabels {
                    agent: agent.to_owned(),
                    state,
                })
                .set(i64::from(holds));
        }
    }

    /// The exposition, with the store's counts and each agent's readiness (name, ready) as of
    /// now.
    pub fn render<'a>(
        &self,
        counts: &Counts,
        agents: impl IntoIterator<Item = (&'a str, bool)>,
    ) -> String {
        for status in Status::ALL {
            let count = counts
                .statuses
                .iter()
                .find(|(name, _)| name == status.as_str())
                .map_or(0, |(_, count)| *count);
            self.live_lessons
                .get_or_create(&StatusLabels {
                    status: status.as_str(),
                })
                .set(count);
        }
        self.sessions
            .get_or_create(&KindLabels { kind: "persistent" })
            .set(counts.persistent_sessions);
        self.sessions
            .get_or_create(&KindLabels { kind: "ephemeral" })
            .set(counts.sessions - counts.persistent_sessions);
        let mut seen = self
            .pools_seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        seen.extend(
            counts
                .pools
                .iter()
                .map(|p| (p.lesson_slug.clone(), p.stage)),
        );
        for (lesson, stage) in seen.iter() {
            for status in Status::ALL.iter().map(|s| s.as_str()) {
                let count = counts
                    .pools
                    .iter()
                    .find(|p| &p.lesson_slug == lesson && p.stage == *stage && p.status == status)
                    .map_or(0, |p| p.count);
                self.pool_members
                    .get_or_create(&PoolMemberLabels {
                        lesson: lesson.clone(),
                        stage: stage.to_string(),
                        status: status.to_owned(),
                    })
                    .set(count);
            }
        }
        drop(seen);
        for (agent, ready) in agents {
            self.agent_ready
                .get_or_create(&AgentLabels {
                    agent: agent.to_owned(),
                })
                .set(i64::from(ready));
        }
        encode(&self.registry)
    }
}

/// The store's [`Traffic`], encoded as counters at each scrape.
#[derive(Debug)]
struct StoreTraffic(Arc<Traffic>);

impl Collector for StoreTraffic {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let counts = self.0.counts();
        for (name, help, value) in [
            (
                "store_transactions",
                "Write transactions the store began (one per batch of write jobs)",
                counts.transactions,
            ),
            (
                "store_write_jobs",
                "Write jobs the store ran in its transactions",
                counts.write_jobs,
            ),
            (
                "store_reads",
                "Queries the store sent to a reading connection (its caches' answers not counted)",
                counts.reads,
            ),
        ] {
            let counter = ConstCounter::new(value);
            let metric = encoder.encode_descriptor(name, help, None, counter.metric_type())?;
            counter.encode(metric)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Millis;
    use crate::store::Store;

    /// What a scrape says of the store is what it did: its transactions, jobs and reads.
    #[tokio::test]
    async fn a_scrape_counts_the_stores_transactions_jobs_and_reads() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("t.db")).await.unwrap();
        let mut metrics = Metrics::default();
        metrics.count_store(store.traffic());
        let value = |text: &str, name: &str| -> u64 {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
                .unwrap_or_else(|| panic!("{name} in\n{text}"))
        };
        let counts = store.counts().await.unwrap();
        let before = metrics.render(&counts, []);
        store
            .create_session("127.0.0.1".parse().unwrap(), [1; 32], 0, Millis(1))
            .await
            .unwrap();
        let after = metrics.render(&store.counts().await.unwrap(), []);
        for (name, more) in [
            ("antidote_store_transactions_total", 1),
            ("antidote_store_write_jobs_total", 1),
            // The second scrape's counts.
            ("antidote_store_reads_total", 1),
        ] {
            assert!(
                value(&after, name) >= value(&before, name) + more,
                "{name}: {before}\n{after}"
            );
        }
        assert_eq!(
            value(&after, "antidote_store_transactions_total"),
            value(&before, "antidote_store_transactions_total") + 1
        );
    }
}
