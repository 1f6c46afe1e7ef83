//! agent-k8s's [`Backend`]: what a live lesson is on a Kubernetes cluster.
//!
//! The SDK's runtime applies the protocol's rules (generations, idempotency, adoption, Watch)
//! and calls [`Kubernetes::realise`] once per generation: it applies the namespace, policy,
//! pods, Services, Ingresses and attachments (created on a new live lesson, where a create is
//! cheaper than an apply; server-side applied on a change or adoption, and where a create
//! finds the object already there), watches the pods until they run, runs the stage's configuration Jobs (watched
//! to completion or failure), probes every presentation on the pod's address from inside the
//! cluster's network, and waits the ready delay. An error is the FAILED reason, quoting the API
//! server or the Job's failure.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use antidote_proto::agent::v1 as proto;
use antidote_sdk::pipeline::{Attempt, Limits, Placement, Reach, Steps};
use antidote_sdk::probe;
use antidote_sdk::{
    self as sdk, Backend, Description, Error, Lesson, Reporter, capabilities, labels,
};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod, Secret, Service};
use k8s_openapi::api::networking::v1::{Ingress, NetworkPolicy};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, PostParams, PropagationPolicy};
use kube::discovery::ApiResource;
use kube::runtime::wait::{await_condition, conditions};
use proto::Phase;
use tonic::Status;

use crate::cluster::{self, LABEL_MANAGED, explain};
use crate::configurator;
use crate::exec;
use crate::guard::Guard;
use crate::settings::Settings;

/// The capabilities agent-k8s offers.
pub const PROTOCOL_CAPABILITIES: &[&str] = &[
    capabilities::PRESENTATION_SSH,
    capabilities::PRESENTATION_HTTP,
    capabilities::STAGE_CONFIGURATION,
    capabilities::NETWORK_ISOLATION,
    capabilities::PLAN,
    capabilities::WATCH,
    capabilities::RECOVER,
    capabilities::CHECKS,
];

/// How long after a configuration Job's deadline the agent still waits for the Job controller
/// to mark it failed.
const JOB_VERDICT_GRACE: Duration = Duration::from_secs(30);

/// The NetworkAttachmentDefinition resource (Multus).
fn attachment_resource() -> ApiResource {
    ApiResource {
        group: "k8s.cni.cncf.io".into(),
        version: "v1".into(),
        api_version: "k8s.cni.cncf.io/v1".into(),
        kind: "NetworkAttachmentDefinition".into(),
        plural: "network-attachment-definitions".into(),
    }
}

/// What [`Kubernetes::apply_objects`] made.
struct Applied {
    /// Ingress hosts by Ingress name.
    hosts: HashMap<String, String>,
    /// Whether the connections became NetworkAttachmentDefinitions.
    attached: bool,
    /// Every endpoint's Service cluster IP, by endpoint name.
    service_ips: BTreeMap<String, String>,
}

/// The Kubernetes backend.
#[derive(Clone)]
pub struct Kubernetes {
    client: kube::Client,
    settings: Arc<Settings>,
    /// READY live lessons' namespaces, watched for deletions behind the agent's back.
    guard: Arc<Guard>,
}

impl Kubernetes {
    /// The backend of the cluster kubectl would use (`KUBECONFIG` or `~/.kube/config`, else the
    /// in-cluster service account), once its API server answers.
    pub async fn start(settings: Settings) -> Result<Kubernetes, Error> {
        let client = kube::Client::try_default().await.map_err(|err| {
            Error::unavailable(format!(
                "no Kubernetes cluster configured: set KUBECONFIG or run in a pod: {err}"
            ))
        })?;
        let version = client.apiserver_version().await.map_err(|err| {
            Error::unavailable(format!("the Kubernetes API server does not answer: {err}"))
        })?;
        tracing::info!(version = %version.git_version, "connected to Kubernetes");
        Ok(Kubernetes::new(client, settings))
    }

    /// A backend on `client`.
    pub fn new(client: kube::Client, settings: Settings) -> Kubernetes {
        Kubernetes {
            guard: Guard::new(client.clone()),
            client,
            settings: Arc::new(settings),
        }
    }

    /// Whether the cluster serves NetworkAttachmentDefinitions (Multus's CRD), asked each time
    /// a lesson with connections is realised or planned: the CRD may come and go while the agent
    /// runs.
    async fn serves_attachments(&self) -> bool {
        kube::discovery::group(&self.client, "k8s.cni.cncf.io")
            .await
            .is_ok_and(|group| {
                group
                    .recommended_resources()
                    .iter()
                    .any(|(resource, _)| resource.kind == "NetworkAttachmentDefinition")
            })
    }

    fn api<K>(&self, spec: &proto::LessonSpec) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        <K as kube::Resource>::DynamicType: Default,
    {
        Api::namespaced(
            self.client.clone(),
            &cluster::namespace(&spec.live_lesson_id),
        )
    }

    /// Applies every object of the live lesson, in order: namespace, policy (before any pod),
    /// attachments, Services, pods in lesson order (never changed once made: a pod's spec is
    /// immutable, see [`cluster::create_pod`]), Ingresses.
    ///
    /// `fresh` (a new live lesson, or one whose namespace was deleted): the objects are created rather than applied (see
    /// [`cluster::create_or_apply`]).
    async fn apply_objects(
        &self,
        spec: &proto::LessonSpec,
        fresh: bool,
    ) -> Result<Applied, String> {
        let settings = &self.settings;
        let namespaces: Api<Namespace> = Api::all(self.client.clone());
        let ns = cluster::namespace(&spec.live_lesson_id);
        cluster::create_or_apply(&namespaces, &ns, &cluster::namespace_manifest(spec), fresh)
            .await
            .map_err(|e| explain(&format!("Namespace {ns}"), &e))?;
        let policies: Api<NetworkPolicy> = self.api(spec);
        cluster::create_or_apply(
            &policies,
            "antidote-isolation",
            &cluster::network_policy_manifest(settings, spec),
            fresh,
        )
        .await
        .map_err(|e| explain("NetworkPolicy antidote-isolation", &e))?;
        let mut attached = !spec.connections.is_empty() && self.serves_attachments().await;
        if attached {
            let api: Api<DynamicObject> =
                Api::namespaced_with(self.client.clone(), &ns, &attachment_resource());
            for i in 0..spec.connections.len() {
                let manifest = cluster::attachment_manifest(spec, i);
                let name = manifest["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned();
                match cluster::apply(&api, &name, &manifest).await {
                    Ok(_) => {}
                    // The CRD went away since we asked: the links are flat, as without Multus.
                    Err(kube::Error::Api(status)) if status.code == 404 => {
                        attached = false;
                        break;
                    }
                    Err(e) => {
                        return Err(explain(&format!("NetworkAttachmentDefinition {name}"), &e));
                    }
                }
            }
        }
        // Services before pods: their cluster IPs go into every pod's /etc/hosts.
        let services: Api<Service> = self.api(spec);
        let mut service_ips = BTreeMap::new();
        for (i, endpoint) in spec.endpoints.iter().enumerate() {
            let service = cluster::create_or_apply(
                &services,
                &endpoint.name,
                &cluster::service_manifest(spec, i),
                fresh,
            )
            .await
            .map_err(|e| explain(&format!("Service {}", endpoint.name), &e))?;
            let ip = service.spec.and_then(|s| s.cluster_ip).unwrap_or_default();
            service_ips.insert(endpoint.name.clone(), ip);
        }
        let pods: Api<Pod> = self.api(spec);
        for (i, endpoint) in spec.endpoints.iter().enumerate() {
            let manifest = cluster::pod_manifest(settings, spec, i, attached, &service_ips);
            cluster::create_pod(&pods, &endpoint.name, &manifest, fresh)
                .await
                .map_err(|e| explain(&format!("Pod {}", endpoint.name), &e))?;
        }
        let ingresses: Api<Ingress> = self.api(spec);
        let mut hosts = HashMap::new();
        for (name, host, manifest) in cluster::ingress_manifests(settings, spec) {
            cluster::create_or_apply(&ingresses, &name, &manifest, fresh)
                .await
                .map_err(|e| explain(&format!("Ingress {name}"), &e))?;
            hosts.insert(name, host);
        }
        Ok(Applied {
            hosts,
            attached,
            service_ips,
        })
    }

    /// Watches a pod until it runs with an address; a pod that cannot run fails with why. While
    /// the cluster's scheduler finds no node for it, the live lesson's reason says so in the
    /// scheduler's words (`0/1 nodes are available: 1 Insufficient cpu`), and so does the
    /// FAILED reason if the probe timeout ends the wait.
    async fn running(
        &self,
        spec: &proto::LessonSpec,
        name: &str,
        deadline: tokio::time::Instant,
        report: &Reporter,
    ) -> Result<Pod, String> {
        let pods: Api<Pod> = self.api(spec);
        let unschedulable: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);
        let runs = |pod: Option<&Pod>| {
            let Some(status) = pod.and_then(|p| p.status.as_ref()) else {
                return false;
            };
            if let Some(why) = unschedulable_reason(status) {
                let mut seen = unschedulable.lock().unwrap_or_else(|e| e.into_inner());
                if seen.as_deref() != Some(why.as_str()) {
                    report.reason(format!("pod `{name}` waits for a node: {why}"));
                    *seen = Some(why);
                }
            }
            status.phase.as_deref() == Some("Running")
                && status.pod_ip.as_ref().is_some_and(|ip| !ip.is_empty())
                || matches!(status.phase.as_deref(), Some("Failed" | "Succeeded"))
                || waiting_reason(status).is_some()
        };
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let waited = tokio::time::timeout(left, await_condition(pods.clone(), name, &runs)).await;
        let pod = match waited {
            Ok(found) => found
                .map_err(|e| format!("watching pod `{name}`: {e}"))?
                .ok_or_else(|| format!("pod `{name}` disappeared"))?,
            Err(_) => {
                let timeout = self.settings.probe_timeout;
                let why = unschedulable
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone();
                return Err(match why {
                    Some(why) => format!("pod `{name}` found no node within {timeout:?}: {why}"),
                    None => format!("pod `{name}` is not running after {timeout:?}"),
                });
            }
        };
        let status = pod.status.clone().unwrap_or_default();
        if let Some(reason) = waiting_reason(&status) {
            return Err(format!("pod `{name}` cannot start: {reason}"));
        }
        if status.phase.as_deref() != Some("Running") {
            return Err(format!(
                "pod `{name}` stopped ({}): {}",
                status.phase.unwrap_or_default(),
                status.message.unwrap_or_default()
            ));
        }
        Ok(pod)
    }

    /// Waits until the live lesson's namespace is gone if it is being deleted; returns whether
    /// it was (then nothing of the live lesson exists any more).
    async fn await_deleted_namespace(
        &self,
        spec: &proto::LessonSpec,
        report: &Reporter,
    ) -> Result<bool, String> {
        let namespaces: Api<Namespace> = Api::all(self.client.clone());
        let name = cluster::namespace(&spec.live_lesson_id);
        let found = namespaces
            .get_opt(&name)
            .await
            .map_err(|e| explain(&format!("Namespace {name}"), &e))?;
        let Some(ns) = found.filter(|ns| ns.metadata.deletion_timestamp.is_some()) else {
            return Ok(false);
        };
        report.phase(
            Phase::Booting,
            format!("waiting for the deleted Namespace {name} to go before creating it again"),
        );
        let uid = ns.metadata.uid.unwrap_or_default();
        let limit = self.settings.probe_timeout;
        tokio::time::timeout(
            limit,
            await_condition(namespaces, &name, conditions::is_deleted(&uid)),
        )
        .await
        .map_err(|_| format!("Namespace {name} is still being deleted after {limit:?}"))?
        .map_err(|e| format!("watching Namespace {name}: {e}"))?;
        Ok(true)
    }

    /// Removes the configuration Jobs and files of other generations than `spec`'s.
    async fn remove_old_configuration(
        &self,
        spec: &proto::LessonSpec,
        jobs: &Api<Job>,
        configmaps: &Api<ConfigMap>,
        current_files: &str,
    ) -> Result<(), String> {
        let current: Vec<String> = spec
            .endpoints
            .iter()
            .map(|e| cluster::job_name(&e.name, spec.generation))
            .collect();
        let existing = jobs
            .list(&ListParams::default().labels(cluster::LABEL_CONFIG_STAGE))
            .await
            .map_err(|e| explain("listing configuration Jobs", &e))?;
        for job in existing {
            let name = job.metadata.name.unwrap_or_default();
            if !current.contains(&name) {
                let background = DeleteParams {
                    propagation_policy: Some(PropagationPolicy::Background),
                    ..Default::default()
                };
                match jobs.delete(&name, &background).await {
                    Ok(_) => {}
                    Err(kube::Error::Api(s)) if s.code == 404 => {}
                    Err(e) => return Err(explain(&format!("deleting Job {name}"), &e)),
                }
            }
        }
        // Files of older generations go too (their Jobs went above).
        let old_files = configmaps
            .list(&ListParams::default().labels(configurator::LABEL_CONFIG_GENERATION))
            .await
            .map_err(|e| explain("listing configuration ConfigMaps", &e))?;
        for configmap in old_files {
            let name = configmap.metadata.name.unwrap_or_default();
            if name != current_files {
                match configmaps.delete(&name, &DeleteParams::default()).await {
                    Ok(_) => {}
                    Err(kube::Error::Api(s)) if s.code == 404 => {}
                    Err(e) => return Err(explain(&format!("deleting ConfigMap {name}"), &e)),
                }
            }
        }
        Ok(())
    }

    /// Writes the stage's Jupyter notebook into the guide endpoint's pod, where Jupyter serves
    /// it (`/files/guide.ipynb`), before the probes: READY means the learner sees this stage's
    /// guide.
    async fn put_guide(&self, spec: &proto::LessonSpec) -> Result<(), String> {
        let pods: Api<Pod> = self.api(spec);
        for endpoint in &spec.endpoints {
            if let Some(guide) = &endpoint.jupyter_guide {
                let path = format!("{}/guide.ipynb", cluster::GUIDE_DIR);
                exec::put(
                    &pods,
                    &endpoint.name,
                    &endpoint.name,
                    &path,
                    &guide.notebook,
                )
                .await
                .map_err(|e| {
                    format!(
                        "writing the stage {} guide into pod `{}`: {e}",
                        spec.stage, endpoint.name
                    )
                })?;
            }
        }
        Ok(())
    }

    /// The configurator's Job for endpoint `index`, watched to Complete or Failed: the Job
    /// controller tries it `--config-backoff-limit` + 1 times, each pod bounded by
    /// `activeDeadlineSeconds`; the verdict ends with its last failed pod's exit code and output.
    async fn job(
        &self,
        spec: &proto::LessonSpec,
        index: usize,
        service_ips: &BTreeMap<String, String>,
    ) -> Result<(), String> {
        let endpoint = &spec.endpoints[index];
        let file = endpoint
            .configuration
            .as_ref()
            .map(|c| c.file_name.clone())
            .unwrap_or_default();
        // The configurator logs in to the endpoint's SSH server through its Service: when the
        // endpoint serves SSH on port 22, wait until that server answers (a running container
        // is not yet a listening one), so that a slow start costs no try of the configuration.
        let serves_ssh = endpoint
            .presentations
            .iter()
            .any(|p| p.port == 22 && p.r#type == proto::PresentationType::Ssh as i32);
        if let Some(ip) = service_ips.get(&endpoint.name).filter(|_| serves_ssh) {
            let deadline = tokio::time::Instant::now() + self.settings.probe_timeout;
            probe::until_ready(&format!("{ip}:22"), probe::Expect::SshBanner, deadline)
                .await
                .map_err(|last| {
                    format!(
                        "endpoint `{}` answered no SSH on port 22 within {:?}, so its {file} \
                         could not be applied: {last}",
                        endpoint.name, self.settings.probe_timeout
                    )
                })?;
        }
        let jobs: Api<Job> = self.api(spec);
        let name = cluster::job_name(&endpoint.name, spec.generation);
        let manifest = configurator::job_manifest(&self.settings, spec, index, service_ips);
        cluster::apply(&jobs, &name, &manifest)
            .await
            .map_err(|e| explain(&format!("Job {name}"), &e))?;
        let pods: Api<Pod> = self.api(spec);
        // The Job controller ends the Job at its deadline; the agent waits a little longer so
        // that the controller's verdict (and its reason) is what the learner sees.
        let deadline = self.settings.config_job_deadline(spec);
        let run = Duration::from_secs(self.settings.config_run_seconds(spec));
        let patience = deadline + JOB_VERDICT_GRACE;
        let tries = self.settings.config_backoff_limit + 1;
        let what = format!(
            "configuration {file} of endpoint `{}` for stage {}",
            endpoint.name, spec.stage
        );
        let finished = |job: Option<&Job>| job_outcome(job).is_some();
        let job = tokio::time::timeout(patience, await_condition(jobs, &name, finished))
            .await
            .map_err(|_| {
                format!("{what} did not finish within {deadline:?} (Job {name} was not ended by its deadline)")
            })?
            .map_err(|e| format!("watching Job {name}: {e}"))?;
        match job_outcome(job.as_ref()) {
            Some(Ok(())) => Ok(()),
            Some(Err(why)) if why.starts_with("DeadlineExceeded") => Err(format!(
                "{what} did not finish within {deadline:?} (up to {tries} tries of {run:?}, Job {name}): {why}{}",
                last_try(&pods, &name).await
            )),
            Some(Err(why)) => Err(format!(
                "{what} failed ({tries} tries of at most {run:?}, Job {name}): {why}{}",
                last_try(&pods, &name).await
            )),
            None => Err(format!("Job {name} disappeared")),
        }
    }

    /// Starts the pod a run's python check files run in ([`configurator::checks_pod_manifest`],
    /// idle for at most `lifetime`) and waits, within the probe timeout, until it runs; its
    /// name, or why it could not start. Nothing is reported: a run changes no live lesson's
    /// state (PROTOCOL.md [X5]).
    async fn start_checks_pod(
        &self,
        spec: &proto::LessonSpec,
        lifetime: Duration,
    ) -> Result<ChecksPod, String> {
        let services: Api<Service> = self.api(spec);
        let mut service_ips = BTreeMap::new();
        for endpoint in &spec.endpoints {
            let service = services
                .get_opt(&endpoint.name)
                .await
                .map_err(|e| explain(&format!("reading Service {}", endpoint.name), &e))?;
            if let Some(ip) = service.and_then(|s| s.spec?.cluster_ip) {
                service_ips.insert(endpoint.name.clone(), ip);
            }
        }
        let mut manifest =
            configurator::checks_pod_manifest(&self.settings, spec, "", &service_ips, lifetime);
        // A name of its own for every run: the last run's pod may still be terminating.
        manifest["metadata"]
            .as_object_mut()
            .map(|m| m.remove("name"));
        manifest["metadata"]["generateName"] = serde_json::json!("checks-");
        let pod: Pod = serde_json::from_value(manifest).map_err(|e| e.to_string())?;
        let params = PostParams {
            field_manager: Some(cluster::FIELD_MANAGER.into()),
            ..Default::default()
        };
        let pods: Api<Pod> = self.api(spec);
        let created = pods
            .create(&params, &pod)
            .await
            .map_err(|e| explain("creating the checks pod", &e))?;
        let name = created.metadata.name.unwrap_or_default();
        let checks_pod = ChecksPod {
            pods: pods.clone(),
            name: Some(name.clone()),
        };
        let settled = |pod: Option<&Pod>| {
            pod.and_then(|p| p.status.as_ref()).is_some_and(|status| {
                matches!(
                    status.phase.as_deref(),
                    Some("Running" | "Failed" | "Succeeded")
                ) || waiting_reason(status).is_some()
            })
        };
        let limit = self.settings.probe_timeout;
        let waited =
            tokio::time::timeout(limit, await_condition(pods.clone(), &name, settled)).await;
        let started = match waited {
            Ok(Ok(Some(pod))) => {
                let status = pod.status.unwrap_or_default();
                if let Some(why) = waiting_reason(&status) {
                    Err(format!("pod `{name}` cannot start: {why}"))
                } else if status.phase.as_deref() != Some("Running") {
                    Err(format!(
                        "pod `{name}` stopped ({}): {}",
                        status.phase.unwrap_or_default(),
                        status.message.unwrap_or_default()
                    ))
                } else {
                    Ok(())
                }
            }
            Ok(Ok(None)) => Err(format!("pod `{name}` disappeared")),
            Ok(Err(e)) => Err(format!("watching pod `{name}`: {e}")),
            Err(_) => {
                let why = pods
                    .get_opt(&name)
                    .await
                    .ok()
                    .flatten()
                    .and_then(|p| unschedulable_reason(p.status.as_ref()?));
                Err(match why {
                    Some(why) => format!("pod `{name}` found no node within {limit:?}: {why}"),
                    None => format!("pod `{name}` is not running after {limit:?}"),
                })
            }
        };
        match started {
            Ok(()) => Ok(checks_pod),
            Err(why) => {
                checks_pod.delete().await;
                Err(why)
            }
        }
    }

    /// The objects applied (`fresh`: created, see [`Kubernetes::apply_objects`]), with the
    /// `ConnectionsRealised` condition when the connections could not be.
    async fn apply(
        &self,
        lesson: &Lesson,
        fresh: bool,
        report: &Reporter,
    ) -> Result<Objects, Error> {
        let spec = lesson.spec();
        let applied = self.apply_objects(spec, fresh).await?;
        tracing::debug!("objects applied");
        if !spec.connections.is_empty() && !applied.attached {
            report.condition(
                "ConnectionsRealised",
                Some((
                    false,
                    "MultusMissing",
                    "the cluster has no NetworkAttachmentDefinition CRD (Multus): connections are not realised as separate links; endpoints reach each other on the pod network".into(),
                )),
            );
        }
        Ok(Objects { applied, fresh })
    }
}

/// What a live lesson is in the cluster, between the pipeline's steps.
pub struct Objects {
    /// What was applied.
    applied: Applied,
    /// Whether it was all created just now: then no older generation's configuration exists.
    fresh: bool,
}

/// The pipeline's steps on a Kubernetes cluster: objects created (new live lesson) or
/// server-side applied (stage change, adoption), pods watched until they run, configured by
/// `pods/exec` (shell) or as configurator Jobs, all endpoints at once, probed on the pods'
/// addresses from inside the cluster's network.
#[tonic::async_trait]
impl Steps for Kubernetes {
    type Objects = Objects;

    fn limits(&self) -> Limits {
        Limits {
            probe_timeout: self.settings.probe_timeout,
            configuration_tries: self.settings.config_backoff_limit + 1,
            configuration_timeout: self.settings.config_timeout,
            extra_ready_delay: self.settings.ready_delay,
            configure_at_once: true,
            ..Limits::default()
        }
    }

    async fn create(&self, lesson: &Lesson, report: &Reporter) -> Result<Objects, Error> {
        self.apply(lesson, true, report).await
    }

    /// A namespace deleted behind the agent's back (the live lesson went FAILED) is waited
    /// for to go: then everything is gone, and created again.
    async fn locate(&self, lesson: &Lesson, report: &Reporter) -> Result<Option<Objects>, Error> {
        if self.await_deleted_namespace(lesson.spec(), report).await? {
            return Ok(None);
        }
        self.apply(lesson, false, report).await.map(Some)
    }

    /// Every pod watched at once until it runs (the kubelet starts them together, and a watch
    /// opened only after the previous pod ran would add its round trips to the lesson's time);
    /// presentations at the pods' own addresses, HTTP ones' URLs at their Ingress hosts.
    async fn addresses(
        &self,
        lesson: &Lesson,
        objects: &Objects,
        report: &Reporter,
    ) -> Result<Vec<Placement>, Error> {
        let spec = lesson.spec();
        let deadline = tokio::time::Instant::now() + self.settings.probe_timeout;
        let pods = futures::future::try_join_all(
            spec.endpoints
                .iter()
                .map(|endpoint| self.running(spec, &endpoint.name, deadline, report)),
        )
        .await?;
        tracing::debug!("pods running");
        let scheme = if self.settings.ingress_tls_secret.is_some() {
            "https"
        } else {
            "http"
        };
        Ok(lesson
            .endpoints
            .iter()
            .zip(pods)
            .map(|(endpoint, pod)| {
                let ip = pod.status.and_then(|s| s.pod_ip).unwrap_or_default();
                let mut placement = Placement::new(ip.clone());
                for p in &endpoint.presentations {
                    let host = objects
                        .applied
                        .hosts
                        .get(&cluster::ingress_name(&endpoint.name, &p.name));
                    placement.presentations.insert(
                        p.name.clone(),
                        Reach {
                            address: format!("{ip}:{}", p.port),
                            url: host.map(|host| format!("{scheme}://{host}/")),
                        },
                    );
                }
                placement
            })
            .collect())
    }

    /// The stage's Jupyter notebook into the guide's pod, then what the configurator's Jobs
    /// mount: old generations' Jobs and files removed (none can exist on objects just created:
    /// they are made after the pods run, and a generation that got that far is changed, not
    /// created, by the next one), this generation's files and credentials applied.
    async fn prepare(&self, lesson: &Lesson, objects: &mut Objects) -> Result<(), Error> {
        let spec = lesson.spec();
        self.put_guide(spec).await?;
        let jobs: Api<Job> = self.api(spec);
        let configmaps: Api<ConfigMap> = self.api(spec);
        let current_files = configurator::configmap_name(spec.generation);
        if !objects.fresh {
            self.remove_old_configuration(spec, &jobs, &configmaps, &current_files)
                .await?;
        }
        if configurator::needed(spec) {
            cluster::apply(
                &configmaps,
                &current_files,
                &configurator::configmap_manifest(spec),
            )
            .await
            .map_err(|e| explain(&format!("ConfigMap {current_files}"), &e))?;
            let secrets: Api<Secret> = self.api(spec);
            cluster::apply(
                &secrets,
                configurator::SECRET,
                &configurator::secret_manifest(spec),
            )
            .await
            .map_err(|e| explain(&format!("Secret {}", configurator::SECRET), &e))?;
        }
        Ok(())
    }

    /// A shell script inside the endpoint's container (pods/exec), as agent-docker does by
    /// `docker exec`, one try; the configurator's types as a Job, which tries by itself.
    async fn configure(
        &self,
        lesson: &Lesson,
        objects: &Objects,
        index: usize,
        timeout: Duration,
    ) -> Result<Attempt, Error> {
        let spec = lesson.spec();
        let endpoint = &spec.endpoints[index];
        let Some(configuration) = &endpoint.configuration else {
            return Ok(Attempt::Settled(Ok(())));
        };
        if configurator::runs_here(configuration) {
            let verdict = self.job(spec, index, &objects.applied.service_ips).await;
            return Ok(Attempt::Settled(verdict));
        }
        let pods: Api<Pod> = self.api(spec);
        let stage = spec.stage.to_string();
        let (run, output) = exec::shell(
            &pods,
            &endpoint.name,
            &endpoint.name,
            &configuration.contents,
            (&endpoint.name, &stage),
            timeout,
        )
        .await
        .map_err(|err| Error::unavailable(err.to_string()))?;
        Ok(Attempt::Ran(run, output))
    }

    /// The READY generation's reporter goes to the guard, which turns it FAILED when its
    /// namespace or a pod is deleted behind the agent's back.
    fn ready(&self, lesson: &Lesson, report: Reporter) {
        let names = lesson.endpoints.iter().map(|e| e.name.clone()).collect();
        self.guard.ready(&lesson.id, report, names);
    }
}

/// The cluster scheduler's message for a pod it cannot place (`PodScheduled` false because
/// `Unschedulable`), if it cannot.
fn unschedulable_reason(status: &k8s_openapi::api::core::v1::PodStatus) -> Option<String> {
    status
        .conditions
        .iter()
        .flatten()
        .find(|c| {
            c.type_ == "PodScheduled"
                && c.status == "False"
                && c.reason.as_deref() == Some("Unschedulable")
        })
        .map(|c| c.message.clone().unwrap_or_else(|| "unschedulable".into()))
}

/// Why a pod's container cannot start (image pull errors and the like), if it cannot.
fn waiting_reason(status: &k8s_openapi::api::core::v1::PodStatus) -> Option<String> {
    status
        .container_statuses
        .iter()
        .flatten()
        .filter_map(|c| c.state.as_ref()?.waiting.as_ref())
        .find(|w| {
            matches!(
                w.reason.as_deref(),
                Some(
                    "ErrImagePull"
                        | "ErrImageNeverPull"
                        | "ImagePullBackOff"
                        | "InvalidImageName"
                        | "CreateContainerConfigError"
                        | "CreateContainerError"
                        | "RunContainerError"
                )
            )
        })
        .map(|w| {
            format!(
                "{}: {}",
                w.reason.clone().unwrap_or_default(),
                w.message.clone().unwrap_or_default()
            )
        })
}

/// A finished Job's outcome: Ok on Complete, Err(reason: message) on Failed; None while running.
fn job_outcome(job: Option<&Job>) -> Option<Result<(), String>> {
    let conditions = job?.status.as_ref()?.conditions.as_ref()?;
    for c in conditions {
        if c.status != "True" {
            continue;
        }
        match c.type_.as_str() {
            "Complete" => return Some(Ok(())),
            "Failed" => {
                return Some(Err(format!(
                    "{}: {}",
                    c.reason.clone().unwrap_or_default(),
                    c.message.clone().unwrap_or_default()
                )));
            }
            _ => {}
        }
    }
    None
}

/// How much of a failed try's output the FAILED reason quotes (the kubelet keeps at most 2 KiB
/// of a container's log tail as its termination message).
const REASON_TAIL: usize = 1024;

/// The last failed try of Job `job`, for the FAILED reason: `; last try: exit code N: <output
/// tail>`, from its pod's terminated state (the container's `terminationMessagePolicy:
/// FallbackToLogsOnError` makes the kubelet put the log's tail there). Empty when no failed pod
/// is left to read (the Job controller deletes the running one at the Job's deadline) or the
/// API cannot be read: the reason then stands on the Job's condition alone.
async fn last_try(pods: &Api<Pod>, job: &str) -> String {
    let Ok(list) = pods
        .list(&ListParams::default().labels(&format!("job-name={job}")))
        .await
    else {
        return String::new();
    };
    let terminated = list
        .items
        .iter()
        .filter_map(|pod| {
            let status = pod.status.as_ref()?;
            let container = status.container_statuses.as_ref()?.first()?;
            let state = container.state.as_ref()?.terminated.clone()?;
            Some((pod.metadata.creation_timestamp.clone(), state))
        })
        .filter(|(_, state)| state.exit_code != 0)
        .max_by(|a, b| a.0.cmp(&b.0));
    let Some((_, state)) = terminated else {
        return String::new();
    };
    let output = state.message.unwrap_or_default();
    let output = output.trim();
    let mut start = output.len().saturating_sub(REASON_TAIL);
    while !output.is_char_boundary(start) {
        start += 1;
    }
    let ellipsis = if start > 0 { "…" } else { "" };
    format!(
        "; last try: exit code {}: {ellipsis}{}",
        state.exit_code,
        &output[start..]
    )
}

/// A run's checks pod (python check files run in it): deleted by [`ChecksPod::delete`] once the
/// run ends, or in the background if the run is dropped before (its call was cancelled).
struct ChecksPod {
    pods: Api<Pod>,
    /// None once deleted.
    name: Option<String>,
}

impl ChecksPod {
    fn name(&self) -> &str {
        self.name.as_deref().unwrap_or_default()
    }

    async fn delete(mut self) {
        if let Some(name) = self.name.take() {
            delete_checks_pod(&self.pods, &name).await;
        }
    }
}

impl Drop for ChecksPod {
    fn drop(&mut self) {
        if let Some(name) = self.name.take()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            let pods = self.pods.clone();
            runtime.spawn(async move { delete_checks_pod(&pods, &name).await });
        }
    }
}

/// Deletes a run's checks pod at once (what still runs in it goes with it); a failure is
/// logged, and the pod's own deadline or the live lesson's removal ends it anyway.
async fn delete_checks_pod(pods: &Api<Pod>, name: &str) {
    let now = DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    match pods.delete(name, &now).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 => {}
        Err(err) => tracing::warn!(pod = name, error = %err, "could not delete a checks pod"),
    }
}

fn unavailable(what: &str, err: kube::Error) -> Error {
    let text = explain(what, &err);
    match err {
        kube::Error::Api(s) if s.code == 403 => Error::permission_denied(text),
        _ => Error::unavailable(text),
    }
}

#[tonic::async_trait]
impl Backend for Kubernetes {
    fn describe(&self) -> Description {
        let mut offered = PROTOCOL_CAPABILITIES.to_vec();
        offered.extend(configurator::capabilities(&self.settings));
        if self.settings.jupyter_image.is_some() {
            offered.push(capabilities::GUIDE_JUPYTER);
        }
        let mut description = Description::new("agent-k8s", env!("CARGO_PKG_VERSION"), &offered);
        description.max_live_lessons = self.settings.max_live_lessons;
        description.labels = HashMap::from([("backend".to_owned(), "kubernetes".to_owned())]);
        description
    }

    /// Check and solution files (PROTOCOL.md, "Checks"), one after another in the request's
    /// order: shell files inside their endpoint's container by `pods/exec`, as a shell
    /// configuration runs; python files by `pods/exec` in a pod of the configurator image
    /// started for the run (deleted after it), reaching the endpoint by its name with its
    /// configuration credentials, as a python configuration's Job does. Each is bounded by the
    /// request's timeout within `--config-timeout` (then killed with what it started) and its
    /// output by the exec's tail.
    async fn run_checks(
        &self,
        spec: &proto::LessonSpec,
        files: &[proto::CheckFile],
        timeout: Option<Duration>,
    ) -> Result<Vec<proto::CheckResult>, Status> {
        use antidote_sdk::checks::{self, Ended};
        use antidote_sdk::output::Run;
        let timeout = checks::check_timeout(timeout, self.settings.config_timeout);
        let is_python = |f: &proto::CheckFile| f.r#type == proto::ConfigurationType::Python as i32;
        let python = files.iter().filter(|f| is_python(f)).count();
        let configured = self
            .settings
            .configurator_image
            .as_ref()
            .is_some_and(|i| !i.is_empty());
        let checks_pod = if python > 0 && configured {
            // Room for every python file at its full time, after the pod's own start.
            let lifetime = timeout * u32::try_from(python).unwrap_or(u32::MAX)
                + self.settings.probe_timeout
                + Duration::from_secs(30);
            Some(self.start_checks_pod(spec, lifetime).await)
        } else {
            None
        };
        let pods: Api<Pod> = self.api(spec);
        let stage = spec.stage.to_string();
        let mut results = Vec::with_capacity(files.len());
        for file in files {
            let started = std::time::Instant::now();
            let run = if is_python(file) {
                let endpoint = spec.endpoints.iter().find(|e| e.name == file.endpoint);
                match (&checks_pod, endpoint) {
                    (Some(Ok(checks_pod)), Some(endpoint)) => {
                        let (user, password) = configurator::check_credentials(endpoint);
                        if user.contains('\n') || password.contains('\n') {
                            results.push(checks::not_run(
                                file,
                                format!(
                                    "the configuration credentials of endpoint `{}` hold a line break",
                                    endpoint.name
                                ),
                            ));
                            continue;
                        }
                        exec::python(
                            &pods,
                            checks_pod.name(),
                            configurator::CHECKS_CONTAINER,
                            &file.contents,
                            (&endpoint.name, &stage),
                            (&user, &password),
                            timeout,
                        )
                        .await
                    }
                    (Some(Err(why)), _) => {
                        results.push(checks::not_run(
                            file,
                            format!("the configurator pod did not start: {why}"),
                        ));
                        continue;
                    }
                    _ => {
                        results.push(checks::not_run(
                            file,
                            "python files need the configurator image (--configurator-image), \
                             which this agent was not given",
                        ));
                        continue;
                    }
                }
            } else {
                exec::shell(
                    &pods,
                    &file.endpoint,
                    &file.endpoint,
                    &file.contents,
                    (&file.endpoint, &stage),
                    timeout,
                )
                .await
            };
            results.push(match run {
                Ok((Run::Exited(code), output)) => {
                    let code = i32::try_from(code).unwrap_or(-1);
                    checks::result(file, Ended::Exited(code), &output, started.elapsed())
                }
                Ok((Run::TimedOut, output)) => {
                    checks::result(file, Ended::TimedOut, &output, started.elapsed())
                }
                Err(err) => checks::not_run(file, err.to_string()),
            });
        }
        if let Some(Ok(checks_pod)) = checks_pod {
            checks_pod.delete().await;
        }
        Ok(results)
    }

    /// Deletes the namespace (everything in it goes with it) and waits until it is gone.
    async fn remove(&self, live_lesson_id: &str) -> Result<(), Error> {
        self.guard.forget(live_lesson_id);
        let namespaces: Api<Namespace> = Api::all(self.client.clone());
        let name = cluster::namespace(live_lesson_id);
        let Some(ns) = namespaces
            .get_opt(&name)
            .await
            .map_err(|e| unavailable(&format!("reading Namespace {name}"), e))?
        else {
            return Ok(());
        };
        if ns
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(LABEL_MANAGED))
            .map(String::as_str)
            != Some("agent-k8s")
        {
            return Err(Error::failed_precondition(format!(
                "Namespace {name} is not managed by agent-k8s; left alone"
            )));
        }
        let uid = ns.metadata.uid.clone().unwrap_or_default();
        match namespaces.delete(&name, &DeleteParams::foreground()).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => return Ok(()),
            Err(e) => return Err(unavailable(&format!("deleting Namespace {name}"), e)),
        }
        tokio::time::timeout(
            Duration::from_secs(25),
            await_condition(namespaces, &name, conditions::is_deleted(&uid)),
        )
        .await
        .map_err(|_| Error::unavailable(format!("Namespace {name} is still being deleted")))?
        .map_err(|e| Error::unavailable(format!("watching Namespace {name}: {e}")))?;
        Ok(())
    }

    /// Live lessons are namespaces carrying our labels.
    async fn discover(
        &self,
        selector: &HashMap<String, String>,
    ) -> Result<Vec<HashMap<String, String>>, Error> {
        let namespaces: Api<Namespace> = Api::all(self.client.clone());
        let labels_of = |ns: Namespace| {
            let mut found: HashMap<String, String> = ns.metadata.labels?.into_iter().collect();
            (found.remove(LABEL_MANAGED).as_deref() == Some("agent-k8s")
                && found.contains_key(labels::LIVE_LESSON)
                && selector.iter().all(|(k, v)| found.get(k) == Some(v)))
            .then_some(found)
        };
        // One live lesson by id (what Provision asks before creating): its namespace is named
        // after it, so one GET answers instead of a LIST of every namespace.
        if let Some(id) = selector.get(labels::LIVE_LESSON) {
            let name = cluster::namespace(id);
            let found = namespaces
                .get_opt(&name)
                .await
                .map_err(|e| unavailable(&format!("reading Namespace {name}"), e))?;
            return Ok(found.and_then(labels_of).into_iter().collect());
        }
        let mut terms: Vec<String> = selector.iter().map(|(k, v)| format!("{k}={v}")).collect();
        terms.push(format!("{LABEL_MANAGED}=agent-k8s"));
        let list = namespaces
            .list(&ListParams::default().labels(&terms.join(",")))
            .await
            .map_err(|e| unavailable("listing Namespaces", e))?;
        Ok(list.into_iter().filter_map(labels_of).collect())
    }

    async fn plan(&self, spec: &proto::LessonSpec) -> Result<proto::PlanResponse, Status> {
        let ns = cluster::namespace(&spec.live_lesson_id);
        let object =
            |kind: &str, name: String, ports: Vec<u32>, detail: String| proto::PlannedObject {
                kind: kind.into(),
                name,
                ports,
                detail,
            };
        let mut objects = vec![
            object(
                "Namespace",
                ns.clone(),
                vec![],
                "the live lesson's objects; deleted with it".into(),
            ),
            object(
                "NetworkPolicy",
                format!("{ns}/antidote-isolation"),
                vec![],
                if self.settings.allow_egress {
                    "ingress from the lesson's pods and access namespaces; egress anywhere but the metadata range".into()
                } else {
                    "ingress from the lesson's pods and access namespaces; egress to the lesson's pods only (no DNS: endpoints are named in /etc/hosts)".into()
                },
            ),
        ];
        let mut diagnostics = Vec::new();
        let attachments = !spec.connections.is_empty() && self.serves_attachments().await;
        for (i, c) in spec.connections.iter().enumerate() {
            if attachments {
                let manifest = cluster::attachment_manifest(spec, i);
                objects.push(object(
                    "NetworkAttachmentDefinition",
                    format!(
                        "{ns}/{}",
                        manifest["metadata"]["name"].as_str().unwrap_or_default()
                    ),
                    vec![],
                    format!("bridge link {}–{}", c.a, c.b),
                ));
            } else {
                diagnostics.push(proto::Diagnostic {
                    severity: proto::Severity::Warning as i32,
                    field: format!("connections[{i}]"),
                    message: "no NetworkAttachmentDefinition CRD (Multus) in this cluster: the link is not realised".into(),
                });
            }
        }
        for (i, e) in spec.endpoints.iter().enumerate() {
            let image = e.image.clone().unwrap_or_default();
            let ports: Vec<u32> = cluster::ports(e).into_iter().map(|(_, p)| p).collect();
            objects.push(object(
                "Pod",
                format!("{ns}/{}", e.name),
                ports.clone(),
                format!("image {}", self.settings.image(&image.slug)),
            ));
            objects.push(object(
                "Service",
                format!("{ns}/{}", e.name),
                ports,
                "ClusterIP".into(),
            ));
            if let Some(c) = e
                .configuration
                .as_ref()
                .filter(|c| !configurator::runs_here(c))
            {
                objects.push(object(
                    "Exec",
                    format!("{ns}/{}", e.name),
                    vec![],
                    format!(
                        "stage {} configuration {} run inside the pod (pods/exec), {} tries of at most {:?}",
                        spec.stage,
                        c.file_name,
                        self.settings.config_backoff_limit + 1,
                        sdk::spec::configuration_timeout(spec, self.settings.config_timeout)
                    ),
                ));
            } else if e.configuration.is_some() {
                objects.push(object(
                    "Job",
                    format!("{ns}/{}", cluster::job_name(&e.name, spec.generation)),
                    vec![],
                    format!(
                        "stage {} configuration, backoffLimit {}, {}s per try, {}s in all",
                        spec.stage,
                        self.settings.config_backoff_limit,
                        self.settings.config_run_seconds(spec),
                        self.settings.config_job_deadline(spec).as_secs()
                    ),
                ));
            }
            let untrusted = !matches!(
                proto::Flavor::try_from(image.flavor),
                Ok(proto::Flavor::Trusted | proto::Flavor::Legacy)
            );
            if untrusted && self.settings.untrusted_runtime_class.is_none() {
                diagnostics.push(proto::Diagnostic {
                    severity: proto::Severity::Warning as i32,
                    field: format!("endpoints[{i}].image.flavor"),
                    message:
                        "untrusted image without a sandbox RuntimeClass (--untrusted-runtime-class)"
                            .into(),
                });
            }
        }
        for (name, host, _) in cluster::ingress_manifests(&self.settings, spec) {
            objects.push(object(
                "Ingress",
                format!("{ns}/{name}"),
                vec![],
                format!("host {host}"),
            ));
        }
        Ok(proto::PlanResponse {
            objects,
            diagnostics,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::PresentationType;

    #[test]
    fn presentation_types_name_ports() {
        assert_eq!(
            cluster::port_name(PresentationType::Ssh as i32, 22),
            "ssh-22"
        );
        assert_eq!(
            cluster::port_name(PresentationType::Http as i32, 65535),
            "http-65535"
        );
        assert_eq!(cluster::ingress_name("web", "Page_1"), "web-page-1");
    }
}
