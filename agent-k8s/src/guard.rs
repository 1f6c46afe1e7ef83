//! The namespaces of READY live lessons, watched: one deleted behind the agent's back
//! (`kubectl delete namespace`, a cleanup script; not Deprovision) turns its READY live lesson
//! FAILED with a reason naming the namespace (PROTOCOL.md [R9]). One watch of every namespace
//! labelled `antidote.io/managed-by=agent-k8s` serves all live lessons, started with the first
//! that becomes READY.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock};

use antidote_proto::agent::v1::Phase;
use antidote_sdk::{Reporter, labels};
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::Api;
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, Event};

use crate::cluster::{self, LABEL_MANAGED};

/// The READY live lessons whose namespaces are watched.
pub struct Guard {
    /// The cluster.
    client: kube::Client,
    /// Per live lesson id: the report of its READY generation, through which FAILED goes out
    /// (dropped by the SDK once a newer generation began).
    ready: Mutex<HashMap<String, Reporter>>,
    /// Set when the watch starts (with the first READY live lesson), so it starts once.
    watching: OnceLock<()>,
}

impl Guard {
    /// A guard of nothing yet, on `client`'s cluster.
    pub fn new(client: kube::Client) -> Arc<Guard> {
        Arc::new(Guard {
            client,
            ready: Mutex::new(HashMap::new()),
            watching: OnceLock::new(),
        })
    }

    /// The live lesson `id` is READY at `report`'s generation: its namespace is watched from now
    /// on (the watch starts if it is the first).
    pub fn ready(self: &Arc<Self>, id: &str, report: Reporter) {
        self.lock().insert(id.to_owned(), report);
        if self.watching.set(()).is_ok() {
            tokio::spawn(self.clone().watch());
        }
    }

    /// The live lesson `id` is being removed (Deprovision): its namespace's deletion is no news.
    pub fn forget(&self, id: &str) {
        self.lock().remove(id);
    }

    /// The namespace of `id` is gone or going: a READY live lesson becomes FAILED with `why`,
    /// and no endpoint is healthy any more. Any other phase (TERMINATING: a Deprovision
    /// deleted it; a newer generation at work) is left as it is.
    fn gone(&self, id: &str, why: String) {
        let Some(report) = self.lock().remove(id) else {
            return;
        };
        tracing::warn!(live_lesson.id = %id, reason = %why, "a READY live lesson's namespace went");
        report.update(|state| {
            if state.phase == Phase::Ready as i32 {
                state.phase = Phase::Failed as i32;
                state.reason = why;
                for endpoint in &mut state.endpoints {
                    endpoint.healthy = 0;
                }
            }
        });
    }

    /// Follows the namespaces until the process ends. A deletion, or a deletion timestamp (the
    /// namespace is terminating), fails the live lesson at once; after every (re)list, a
    /// guarded live lesson whose namespace was not listed is looked up, and fails if it is gone
    /// (it went while the watch was down).
    async fn watch(self: Arc<Self>) {
        let namespaces: Api<Namespace> = Api::all(self.client.clone());
        let config = watcher::Config::default().labels(&format!("{LABEL_MANAGED}=agent-k8s"));
        let mut events =
            std::pin::pin!(watcher::watcher(namespaces.clone(), config).default_backoff());
        let mut listed = HashSet::new();
        while let Some(event) = events.next().await {
            match event {
                Ok(Event::Init) => listed.clear(),
                Ok(Event::InitApply(ns)) => {
                    if let Some(id) = live_lesson(&ns) {
                        listed.insert(id);
                    }
                    self.seen(&ns);
                }
                Ok(Event::Apply(ns)) => self.seen(&ns),
                Ok(Event::Delete(ns)) => {
                    if let Some(id) = live_lesson(&ns) {
                        self.gone(&id, deleted(&id));
                    }
                }
                Ok(Event::InitDone) => {
                    let unlisted: Vec<String> = self
                        .lock()
                        .keys()
                        .filter(|id| !listed.contains(*id))
                        .cloned()
                        .collect();
                    for id in unlisted {
                        // Made after the list was taken, or gone: a GET tells.
                        match namespaces.get_opt(&cluster::namespace(&id)).await {
                            Ok(None) => self.gone(&id, deleted(&id)),
                            Ok(Some(ns)) => self.seen(&ns),
                            Err(err) => {
                                tracing::warn!(live_lesson.id = %id, error = %err, "cannot read a live lesson's namespace")
                            }
                        }
                    }
                }
                Err(err) => tracing::warn!(error = %err, "watching namespaces; retrying"),
            }
        }
    }

    /// A namespace as it is now: terminating means going.
    fn seen(&self, ns: &Namespace) {
        if ns.metadata.deletion_timestamp.is_some()
            && let Some(id) = live_lesson(ns)
        {
            self.gone(&id, deleted(&id));
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Reporter>> {
        // Every critical section is one map operation; a poisoned lock is still consistent.
        self.ready.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The live lesson a namespace of ours belongs to.
fn live_lesson(ns: &Namespace) -> Option<String> {
    ns.metadata
        .labels
        .as_ref()?
        .get(labels::LIVE_LESSON)
        .cloned()
}

/// The reason of a live lesson whose namespace went.
fn deleted(id: &str) -> String {
    format!(
        "Namespace {} was deleted without Deprovision; everything of the live lesson went with it",
        cluster::namespace(id)
    )
}
