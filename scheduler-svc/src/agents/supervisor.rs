//! One supervisor task per agent: handshake (retrying with backoff), then follow the agent's
//! Watch stream; when the stream breaks, mark the agent unavailable and start over. A handshake
//! reporting a new instance id means the agent restarted: the supervisor tells the reconciler,
//! which recovers the agent's live lessons. What the stream says of live lessons nobody waits
//! for goes to the reconciler too: a failure, a deletion, and, in each complete snapshot of an
//! agent that did not restart, which live lessons it holds (one placed on it and missing was
//! removed behind the scheduler's back).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use antidote_proto::agent::v1 as proto;
use antidote_proto::{capabilities, labels};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;
use tonic::{Code, Request};

use super::{Agent, AgentState, FleetEvent, Observed, convert};
use crate::error::Error;
use crate::model::{LiveLessonId, Millis, Status};
use crate::store::Store;

/// The capabilities this scheduler understands, sent in the handshake.
pub const SCHEDULER_CAPABILITIES: &[&str] = &[
    capabilities::PRESENTATION_SSH,
    capabilities::PRESENTATION_HTTP,
    capabilities::STAGE_CONFIGURATION,
    capabilities::NETWORK_ISOLATION,
    capabilities::PLAN,
    capabilities::WATCH,
    capabilities::WATCH_PAGES,
    capabilities::RECOVER,
];

/// The heartbeat interval asked of agents' Watch streams.
const HEARTBEAT: Duration = Duration::from_secs(5);

/// A Watch stream quiet for this long is taken as broken (four missed heartbeats).
const QUIET_LIMIT: Duration = Duration::from_secs(20);

/// The largest Watch snapshot page asked of agents (PROTOCOL.md [W8]): well below the 4 MiB
/// a gRPC message may have by default, so a snapshot of any size arrives.
pub const SNAPSHOT_PAGE_BYTES: u32 = 1024 * 1024;

/// Without Watch, how long the supervisor waits before handshaking again to notice restarts
/// (waiting workers poll with Get meanwhile).
const REHANDSHAKE: Duration = Duration::from_secs(10);

/// What supervisors need.
#[derive(Clone)]
pub struct SupervisorContext {
    /// Where agents' instance ids are kept, to notice restarts across our own restarts.
    pub store: Store,
    /// This scheduler's instance id, sent in handshakes and selected on in Watch.
    pub instance_id: String,
    /// Where restarts and unsolicited states are reported.
    pub events: mpsc::UnboundedSender<FleetEvent>,
    /// Stops the supervisor.
    pub shutdown: CancellationToken,
    /// Backoff bounds between reconnections.
    pub backoff: (Duration, Duration),
    /// The entrypoint key set's ids and public keys, sent in every handshake.
    pub entrypoint_keys: Vec<(String, Vec<u8>)>,
    /// The entrypoint key ids revoked (`[entrypoint] revoked`), sent in every handshake.
    pub revoked_entrypoint_keys: Vec<String>,
}

// Debug level: it lasts as long as the process, so as a trace it would never end.
#[tracing::instrument(skip_all, level = "debug", fields(agent = %agent.name))]
pub(super) async fn supervise(agent: Arc<Agent>, ctx: SupervisorContext) {
    let (initial, max) = ctx.backoff;
    let mut delay = initial;
    loop {
        let outcome = tokio::select! {
            _ = ctx.shutdown.cancelled() => return,
            outcome = connect_and_follow(&agent, &ctx) => outcome,
        };
        match outcome {
            Ok(()) => delay = initial,
            Err(Failure::Unavailable(reason)) => {
                // Over mTLS the transport knows better than the call why it failed (the
                // agent's certificate, or the agent refusing ours).
                let reason = match agent.tls_status().and_then(|tls| tls.failure) {
                    Some(failure) => format!("agent {}: {failure}", agent.name),
                    None => reason,
                };
                tracing::warn!(%reason, "agent unavailable");
                agent.set_status(|s| {
                    s.state = AgentState::Unavailable;
                    s.last_error = reason;
                });
            }
            Err(Failure::Incompatible(reason)) => {
                tracing::error!(%reason, "agent incompatible");
                agent.set_status(|s| {
                    s.state = AgentState::Incompatible;
                    s.last_error = reason;
                });
                // An incompatible agent will not change until it is upgraded: ask rarely.
                delay = max;
            }
        }
        tokio::select! {
            _ = ctx.shutdown.cancelled() => return,
            _ = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(max);
    }
}

enum Failure {
    Unavailable(String),
    Incompatible(String),
}

/// Handshakes, then follows the Watch stream until it ends. Returns `Ok` when a healthy stream
/// ended (so the backoff restarts from its initial value).
async fn connect_and_follow(agent: &Agent, ctx: &SupervisorContext) -> Result<(), Failure> {
    let request = proto::HandshakeRequest {
        supported_majors: vec![proto::MAJOR],
        scheduler_instance_id: ctx.instance_id.clone(),
        scheduler_version: env!("CARGO_PKG_VERSION").to_owned(),
        capabilities: SCHEDULER_CAPABILITIES
            .iter()
            .map(|c| (*c).to_owned())
            .collect(),
        entrypoint_keys: ctx
            .entrypoint_keys
            .iter()
            .map(|(key_id, public_key)| proto::EntrypointKey {
                key_id: key_id.clone(),
                public_key: public_key.clone(),
            })
            .collect(),
        revoked_entrypoint_keys: ctx.revoked_entrypoint_keys.clone(),
    };
    let handshake = match agent.handshake(request).await {
        Ok(handshake) => handshake,
        Err(Error::Agent { status, .. }) => {
            return Err(match status.code() {
                Code::Unimplemented => Failure::Incompatible(format!(
                    "agent does not serve {} (it may speak another major version): {}",
                    proto::SERVICE_NAME,
                    status.message()
                )),
                Code::FailedPrecondition | Code::InvalidArgument => {
                    Failure::Incompatible(format!("handshake refused: {}", status.message()))
                }
                _ => Failure::Unavailable(format!("handshake failed: {status}")),
            });
        }
        Err(err) => return Err(Failure::Unavailable(err.to_string())),
    };
    if handshake.major != proto::MAJOR {
        return Err(Failure::Incompatible(format!(
            "agent chose major version {} but this scheduler speaks only {}",
            handshake.major,
            proto::MAJOR
        )));
    }
    if handshake.instance_id.is_empty() {
        return Err(Failure::Incompatible(
            "handshake carries no instance_id".into(),
        ));
    }
    let previous = ctx.store.agent_instance(&agent.name).await.ok().flatten();
    if previous.as_deref() != Some(handshake.instance_id.as_str())
        && let Err(err) = ctx
            .store
            .set_agent_instance(&agent.name, &handshake.instance_id, Millis::now())
            .await
    {
        return Err(Failure::Unavailable(format!(
            "cannot record instance id: {err}"
        )));
    }
    tracing::info!(
        kind = %handshake.kind,
        version = %handshake.build_version,
        instance = %handshake.instance_id,
        capabilities = ?handshake.capabilities,
        "agent ready"
    );
    let restarted = previous
        .as_deref()
        .is_some_and(|previous| previous != handshake.instance_id);
    let watch = handshake.capabilities.contains(capabilities::WATCH);
    agent.connected(handshake);
    if restarted {
        let _ = ctx.events.send(FleetEvent::Restarted(agent.name.clone()));
    }
    if !watch {
        tokio::time::sleep(REHANDSHAKE).await;
        return Ok(());
    }
    follow(agent, ctx, restarted).await
}

/// Follows the Watch stream. After a restart (`restarted`) the agent holds only what it adopts
/// on Recover, so its snapshots say nothing of what vanished; otherwise each complete snapshot
/// goes to the reconciler.
async fn follow(agent: &Agent, ctx: &SupervisorContext, restarted: bool) -> Result<(), Failure> {
    let request = proto::WatchRequest {
        label_selector: HashMap::from([(labels::INSTANCE.to_owned(), ctx.instance_id.clone())]),
        heartbeat_interval: Some(prost_types::Duration {
            seconds: HEARTBEAT.as_secs() as i64,
            nanos: 0,
        }),
        // Agents offering `watch.pages` send snapshots in pages; others ignore it and send one
        // message, which is taken as before.
        snapshot_page_bytes: SNAPSHOT_PAGE_BYTES,
    };
    // No deadline on the stream itself: heartbeats prove it is alive.
    let mut stream = agent
        .client
        .clone()
        .watch({
            let mut request = Request::new(request);
            antidote_net::trace::inject(request.metadata_mut());
            request
        })
        .await
        .map_err(|status| Failure::Unavailable(format!("Watch failed: {status}")))?
        .into_inner();
    agent.watch_opened();
    // The snapshot being received: live lessons and pages so far (PROTOCOL.md [W8]), and
    // their ids.
    let mut snapshot = (0, 0);
    let mut held = HashSet::new();
    loop {
        let next = tokio::time::timeout(QUIET_LIMIT, stream.next()).await;
        let event = match next {
            Err(_) => {
                return Err(Failure::Unavailable(format!(
                    "no Watch message for {QUIET_LIMIT:?}"
                )));
            }
            Ok(None) => return Ok(()),
            Ok(Some(Err(status))) => {
                return Err(Failure::Unavailable(format!("Watch broke: {status}")));
            }
            Ok(Some(Ok(event))) => event,
        };
        use proto::watch_event::Event;
        match event.event {
            Some(Event::Snapshot(page)) => {
                // Every page is routed as it comes: states are complete in themselves. Only
                // what is missing needs the whole view: the ids are kept until the last page.
                snapshot = (snapshot.0 + page.items.len(), snapshot.1 + 1);
                for state in page.items {
                    if let Ok(id) = state.live_lesson_id.parse::<LiveLessonId>() {
                        held.insert(id);
                    }
                    route(agent, ctx, state);
                }
                if !page.more {
                    tracing::debug!(
                        count = snapshot.0,
                        pages = snapshot.1,
                        "Watch snapshot complete"
                    );
                    agent.watch_snapshot(snapshot.0, snapshot.1);
                    snapshot = (0, 0);
                    let held = std::mem::take(&mut held);
                    if !restarted {
                        let _ = ctx
                            .events
                            .send(FleetEvent::Snapshot(agent.name.clone(), held));
                    }
                }
            }
            Some(Event::Changed(state)) => route(agent, ctx, state),
            Some(Event::Deleted(deleted)) => {
                if let Ok(id) = deleted.live_lesson_id.parse::<LiveLessonId>()
                    && !agent.deliver(id, Observed::Deleted)
                {
                    let _ = ctx
                        .events
                        .send(FleetEvent::Vanished(agent.name.clone(), id));
                }
            }
            Some(Event::Heartbeat(_)) | Some(Event::Resync(_)) | None => {}
        }
    }
}

/// Hands a state to the worker waiting for it; a failure nobody waits for (a READY lesson whose
/// container died) goes to the reconciler.
fn route(agent: &Agent, ctx: &SupervisorContext, state: proto::LiveLessonState) {
    if let Some(at) = &state.last_active
        && let Ok(id) = state.live_lesson_id.parse::<LiveLessonId>()
    {
        apply_activity(ctx, id, at);
    }
    let Some(report) = convert::report(state) else {
        return;
    };
    let failed = report.status == Some(Status::Failed);
    if !agent.deliver(report.id, Observed::Report(report.clone())) && failed {
        let _ = ctx
            .events
            .send(FleetEvent::Unsolicited(agent.name.clone(), report));
    }
}

/// Learners' activity the agent's entrypoint saw (`LiveLessonState.last_active`) counts as the
/// live lesson's: its last-active time moves forward to it (never back, never past now: a
/// snapshot repeats old times, and agents' clocks may run ahead).
fn apply_activity(ctx: &SupervisorContext, id: LiveLessonId, at: &prost_types::Timestamp) {
    let reported = Millis(at.seconds.saturating_mul(1000) + i64::from(at.nanos / 1_000_000));
    let now = Millis::now();
    let at = if reported.0 > now.0 { now } else { reported };
    let store = ctx.store.clone();
    tokio::spawn(async move {
        match store.live_lesson(id).await {
            Ok(lesson) if lesson.last_active.0 < at.0 => {
                if let Err(err) = store.heartbeat(id, at).await {
                    tracing::debug!(live_lesson.id = %id, error = %err, "activity not recorded");
                }
            }
            _ => {}
        }
    });
}
