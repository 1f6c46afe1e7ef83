//! The namespaces and endpoint pods of READY live lessons, watched: one deleted behind the
//! agent's back (`kubectl delete namespace` or `kubectl delete pod`, a cleanup script, an
//! eviction; not Deprovision) turns its READY live lesson FAILED with a reason naming what went
//! (PROTOCOL.md [R9]): lesson pods are bare pods that nothing recreates, so a lesson without one
//! of them is broken. One watch of every namespace labelled `antidote.io/managed-by=agent-k8s`
//! and one of every endpoint pod so labelled serve all live lessons, started with the first that
//! becomes READY.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock};

use antidote_proto::agent::v1::Phase;
use antidote_sdk::{Reporter, labels};
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::Api;
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, Event};

use crate::cluster::{self, LABEL_CONFIG_STAGE, LABEL_ENDPOINT, LABEL_MANAGED};

/// The READY live lessons whose namespaces are watched.
pub struct Guard {
    /// The cluster.
    client: kube::Client,
    /// Per live lesson id: the report of its READY generation, through which FAILED goes out
    /// (dropped by the SDK once a newer generation began), and its endpoints' names (one pod
    /// each).
    ready: Mutex<HashMap<String, Guarded>>,
    /// Set when the watch starts (with the first READY live lesson), so it starts once.
    watching: OnceLock<()>,
}

/// A READY live lesson as the guard knows it.
struct Guarded {
    report: Reporter,
    endpoints: Vec<String>,
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

    /// The live lesson `id` is READY at `report`'s generation: its namespace and the pods of
    /// `endpoints` are watched from now on (the watches start if it is the first).
    pub fn ready(self: &Arc<Self>, id: &str, report: Reporter, endpoints: Vec<String>) {
        self.lock()
            .insert(id.to_owned(), Guarded { report, endpoints });
        if self.watching.set(()).is_ok() {
            tokio::spawn(self.clone().watch());
            tokio::spawn(self.clone().watch_pods());
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
        let Some(Guarded { report, .. }) = self.lock().remove(id) else {
            return;
        };
        tracing::warn!(live_lesson.id = %id, reason = %why, "a READY live lesson's objects went");
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

    /// Follows the endpoint pods (not the configuration Jobs' pods) until the process ends, as
    /// [`Guard::watch`] follows the namespaces: a pod deleted or being deleted fails its live
    /// lesson, and after every (re)list a guarded live lesson's pods that were not listed are
    /// looked up.
    async fn watch_pods(self: Arc<Self>) {
        let pods: Api<Pod> = Api::all(self.client.clone());
        let config = watcher::Config::default().labels(&format!(
            "{LABEL_MANAGED}=agent-k8s,{LABEL_ENDPOINT},!{LABEL_CONFIG_STAGE}"
        ));
        let mut events = std::pin::pin!(watcher::watcher(pods, config).default_backoff());
        let mut listed: HashSet<(String, String)> = HashSet::new();
        while let Some(event) = events.next().await {
            match event {
                Ok(Event::Init) => listed.clear(),
                Ok(Event::InitApply(pod)) => {
                    if let Some(key) = endpoint_pod(&pod) {
                        listed.insert(key);
                    }
                    self.pod_seen(&pod, false).await;
                }
                Ok(Event::Apply(pod)) => self.pod_seen(&pod, false).await,
                Ok(Event::Delete(pod)) => self.pod_seen(&pod, true).await,
                Ok(Event::InitDone) => {
                    let unlisted: Vec<(String, String)> = self
                        .lock()
                        .iter()
                        .flat_map(|(id, guarded)| {
                            guarded.endpoints.iter().map(|e| (id.clone(), e.clone()))
                        })
                        .filter(|key| !listed.contains(key))
                        .collect();
                    for (id, endpoint) in unlisted {
                        let pods: Api<Pod> =
                            Api::namespaced(self.client.clone(), &cluster::namespace(&id));
                        match pods.get_opt(&endpoint).await {
                            Ok(None) => self.pod_gone(&id, &endpoint).await,
                            Ok(Some(pod)) => self.pod_seen(&pod, false).await,
                            Err(err) => {
                                tracing::warn!(live_lesson.id = %id, error = %err, "cannot read a live lesson's pod")
                            }
                        }
                    }
                }
                Err(err) => tracing::warn!(error = %err, "watching lesson pods; retrying"),
            }
        }
    }

    /// An endpoint pod as it is now (`deleted`: the watch saw it go): deleted or terminating
    /// means its live lesson lost an endpoint.
    async fn pod_seen(&self, pod: &Pod, deleted: bool) {
        let Some((id, endpoint)) = endpoint_pod(pod) else {
            return;
        };
        if deleted || pod.metadata.deletion_timestamp.is_some() {
            self.pod_gone(&id, &endpoint).await;
        }
    }

    /// The pod of `endpoint` went. When its whole namespace is going, that is the news (its
    /// pods go with it); else the pod alone.
    async fn pod_gone(&self, id: &str, endpoint: &str) {
        let guarded = self
            .lock()
            .get(id)
            .is_some_and(|g| g.endpoints.iter().any(|e| e == endpoint));
        if !guarded {
            return;
        }
        let namespaces: Api<Namespace> = Api::all(self.client.clone());
        let namespace_going = match namespaces.get_opt(&cluster::namespace(id)).await {
            Ok(None) => true,
            Ok(Some(ns)) => ns.metadata.deletion_timestamp.is_some(),
            Err(_) => false,
        };
        if namespace_going {
            self.gone(id, deleted(id));
        } else {
            self.gone(
                id,
                format!(
                    "Pod {}/{endpoint} (endpoint `{endpoint}`) was deleted without Deprovision; \
                     nothing recreates it",
                    cluster::namespace(id)
                ),
            );
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

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Guarded>> {
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

/// The live lesson and endpoint an endpoint pod of ours belongs to (its name is the endpoint's).
fn endpoint_pod(pod: &Pod) -> Option<(String, String)> {
    let labels = pod.metadata.labels.as_ref()?;
    let endpoint = labels.get(LABEL_ENDPOINT)?;
    if labels.contains_key(LABEL_CONFIG_STAGE) || pod.metadata.name.as_ref() != Some(endpoint) {
        return None;
    }
    Some((labels.get(labels::LIVE_LESSON)?.clone(), endpoint.clone()))
}

/// The reason of a live lesson whose namespace went.
fn deleted(id: &str) -> String {
    format!(
        "Namespace {} was deleted without Deprovision; everything of the live lesson went with it",
        cluster::namespace(id)
    )
}
