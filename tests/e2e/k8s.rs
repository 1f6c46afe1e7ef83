//! agent-k8s against a real kube-apiserver, etcd and kube-controller-manager
//! (`tests/k8s/controlplane.sh`, started by `tests/run`, which exports KUBECONFIG), with
//! `fake-kubelet` as the node. The agent runs with a token of the ServiceAccount bound to
//! `deploy/k8s/agent-k8s-rbac.yaml`, not as admin, so that file's admission policies apply to it
//! as they would in production (and a test checks, with that token, what they refuse). Every
//! object is checked through the API.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use antidote_proto::api::v1 as api;
use antidote_tests::{Process, Restartable, Scheduler, fetch, presentation, workspace_bin};
use api::LiveLessonStatus as S;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Namespace, Pod, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::{Ingress, NetworkPolicy};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::discovery::ApiResource;
use kube::runtime::conditions;
use kube::runtime::wait::await_condition;
use tempfile::TempDir;

use crate::PATIENCE;

fn admin_kubeconfig() -> PathBuf {
    std::env::var("KUBECONFIG")
        .expect("KUBECONFIG is not set: run tests/run, which starts the test control plane (tests/k8s/controlplane.sh)")
        .into()
}

pub(crate) async fn admin() -> kube::Client {
    kube::Client::try_default()
        .await
        .expect("the test control plane answers")
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .unwrap()
}

/// Applies deploy/k8s/agent-k8s-rbac.yaml and returns a kubeconfig holding a token of its
/// ServiceAccount.
pub(crate) async fn agent_kubeconfig(client: &kube::Client, dir: &Path) -> PathBuf {
    let text = std::fs::read_to_string(repo().join("deploy/k8s/agent-k8s-rbac.yaml")).unwrap();
    for document in serde_yaml::Deserializer::from_str(&text) {
        let object: serde_json::Value = serde::Deserialize::deserialize(document).unwrap();
        let kind = object["kind"].as_str().unwrap().to_owned();
        let (group, version) = match object["apiVersion"].as_str().unwrap().split_once('/') {
            Some((g, v)) => (g.to_owned(), v.to_owned()),
            None => (
                String::new(),
                object["apiVersion"].as_str().unwrap().to_owned(),
            ),
        };
        let plural = match kind.as_str() {
            "Namespace" => "namespaces",
            "ServiceAccount" => "serviceaccounts",
            "ClusterRole" => "clusterroles",
            "ClusterRoleBinding" => "clusterrolebindings",
            "ValidatingAdmissionPolicy" => "validatingadmissionpolicies",
            "ValidatingAdmissionPolicyBinding" => "validatingadmissionpolicybindings",
            other => panic!("unexpected kind {other} in the RBAC manifest"),
        };
        let resource = ApiResource {
            group,
            version,
            api_version: object["apiVersion"].as_str().unwrap().to_owned(),
            kind: kind.clone(),
            plural: plural.into(),
        };
        let name = object["metadata"]["name"].as_str().unwrap().to_owned();
        let api: Api<DynamicObject> = match object["metadata"]["namespace"].as_str() {
            Some(ns) => Api::namespaced_with(client.clone(), ns, &resource),
            None => Api::all_with(client.clone(), &resource),
        };
        api.patch(
            &name,
            &PatchParams::apply("antidote-tests").force(),
            &Patch::Apply(&object),
        )
        .await
        .unwrap_or_else(|e| panic!("applying {kind} {name}: {e}"));
    }
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), "antidote-system");
    let request = serde_json::json!({
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": { "expirationSeconds": 7200 },
    });
    let token: serde_json::Value = accounts
        .create_subresource("token", "agent-k8s", &PostParams::default(), &request)
        .await
        .expect("a token for the agent's ServiceAccount");
    let token = token["status"]["token"].as_str().unwrap().to_owned();
    let mut config: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(admin_kubeconfig()).unwrap()).unwrap();
    config["users"] =
        serde_yaml::from_str(&format!("- name: agent-k8s\n  user:\n    token: {token}\n")).unwrap();
    let contexts = config["contexts"].as_sequence_mut().unwrap();
    for context in contexts {
        context["context"]["user"] = "agent-k8s".into();
    }
    let path = dir.join("agent.kubeconfig");
    std::fs::write(&path, serde_yaml::to_string(&config).unwrap()).unwrap();
    path
}

/// A fake kubelet running the pods of one scheduler instance, on its own 127.N.x.y range so
/// parallel tests never collide.
pub(crate) async fn fake_kubelet(dir: &Path, instance: &str) -> Process {
    let octet = 100 + instance.bytes().map(u32::from).sum::<u32>() % 150;
    Process::spawn(
        &workspace_bin("fake-kubelet"),
        &[
            "--instance".into(),
            instance.into(),
            "--node".into(),
            format!("node-{instance}"),
            "--ip-prefix".into(),
            format!("127.{octet}"),
        ],
        dir.join("fake-kubelet.log"),
    )
    .await
    .expect("fake-kubelet starts")
}

/// agent-k8s as its ServiceAccount; returns it with the arguments and environment that restart
/// it on the same address.
pub(crate) async fn agent_k8s(
    dir: &Path,
    kubeconfig: &Path,
    extra: &[&str],
) -> (Process, Vec<String>, Vec<(&'static str, String)>) {
    let mut args: Vec<String> = vec![
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--probe-timeout".into(),
        "60s".into(),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    let env = vec![("KUBECONFIG", kubeconfig.display().to_string())];
    let agent = Process::spawn_with_env(
        &workspace_bin("agent-k8s"),
        &args,
        &env,
        dir.join(format!("agent-k8s-{}.log", uuid::Uuid::new_v4())),
    )
    .await
    .expect("agent-k8s starts");
    args[1] = agent.addr.to_string();
    (agent, args, env)
}

/// A scheduler, agent-k8s (as its ServiceAccount) and a fake kubelet for one instance.
struct K8sEnv {
    dir: TempDir,
    instance: String,
    client: kube::Client,
    kubelet: Process,
    agent: Process,
    agent_args: Vec<String>,
    agent_env: Vec<(&'static str, String)>,
    scheduler: Scheduler,
}

impl K8sEnv {
    async fn start(instance: &str, agent_extra: &[&str]) -> K8sEnv {
        let dir = tempfile::tempdir().unwrap();
        let client = admin().await;
        let kubeconfig = agent_kubeconfig(&client, dir.path()).await;
        let kubelet = fake_kubelet(dir.path(), instance).await;
        let (agent, agent_args, agent_env) = agent_k8s(dir.path(), &kubeconfig, agent_extra).await;
        let config = format!(
            r#"instance_id = "{instance}"
curriculum = "{curriculum}"
tier = "prod"
[limits]
sessions_per_ip = 0
[reaper]
interval = "500ms"
orphan_interval = "500ms"
orphan_grace = "1s"
[reconciler]
poll_interval = "500ms"
backoff_initial = "100ms"
backoff_max = "1s"
provision_timeout = "4m"
[[agents]]
name = "k8s"
address = "{agent}"
"#,
            curriculum = repo().join("tests/fixtures/k8s-curriculum").display(),
            agent = agent.url(),
        );
        let scheduler = Scheduler::start(dir.path(), &config)
            .await
            .expect("scheduler starts");
        K8sEnv {
            dir,
            instance: instance.into(),
            client,
            kubelet,
            agent,
            agent_args,
            agent_env,
            scheduler,
        }
    }

    fn logs(&self) -> String {
        format!(
            "--- scheduler ---\n{}\n--- agent-k8s ---\n{}\n--- fake-kubelet ---\n{}",
            self.scheduler.process.log_text(),
            self.agent.log_text(),
            self.kubelet.log_text()
        )
    }

    async fn ready(&self, lesson: &str, stage: u32) -> api::LiveLesson {
        let c = &self.scheduler.clients;
        let session = c.session().await.unwrap();
        let requested = c.request(&session, lesson, stage).await.unwrap();
        c.ready(&requested.id)
            .await
            .unwrap_or_else(|e| panic!("{e:#}\n{}", self.logs()))
    }

    fn namespaced<K>(&self, id: &str) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        <K as kube::Resource>::DynamicType: Default,
    {
        Api::namespaced(self.client.clone(), &format!("antidote-{id}"))
    }
}

fn labels_of(meta: &kube::api::ObjectMeta) -> BTreeMap<String, String> {
    meta.labels.clone().unwrap_or_default()
}

#[tokio::test]
async fn k8s_lesson_objects_stage_change_and_delete() {
    let env = K8sEnv::start("k8s-life", &["--ingress-class", "nginx"]).await;
    let ready = env.ready("two-tier", 0).await;
    let id = ready.id.clone();

    // The namespace and its labels.
    let namespaces: Api<Namespace> = Api::all(env.client.clone());
    let ns = namespaces.get(&format!("antidote-{id}")).await.unwrap();
    let labels = labels_of(&ns.metadata);
    assert_eq!(labels["antidote.io/instance"], "k8s-life");
    assert_eq!(labels["antidote.io/live-lesson"], id);
    assert_eq!(labels["antidote.io/session"], ready.session_id);
    assert_eq!(labels["antidote.io/lesson"], "two-tier");
    assert_eq!(labels["antidote.io/managed-by"], "agent-k8s");

    // Deny by default; DNS allowed to the cluster's DNS pods only, not to every namespace
    // (where it would reach other lessons' pods too).
    let policy = env
        .namespaced::<NetworkPolicy>(&id)
        .get("antidote-isolation")
        .await
        .unwrap();
    let policy_spec = policy.spec.unwrap();
    assert_eq!(policy_spec.policy_types.unwrap(), ["Ingress", "Egress"]);
    let egress = serde_json::to_string(&policy_spec.egress).unwrap();
    assert!(
        egress.contains("\"port\":53") && egress.contains("UDP"),
        "{egress}"
    );
    for rule in policy_spec.egress.iter().flatten() {
        for peer in rule.to.iter().flatten() {
            if let Some(namespaces) = &peer.namespace_selector {
                let pods = peer.pod_selector.as_ref();
                assert_eq!(
                    namespaces
                        .match_labels
                        .as_ref()
                        .map(|l| l["kubernetes.io/metadata.name"].as_str()),
                    Some("kube-system"),
                    "{egress}"
                );
                assert_eq!(
                    pods.and_then(|p| p.match_labels.as_ref())
                        .map(|l| l["k8s-app"].as_str()),
                    Some("kube-dns"),
                    "{egress}"
                );
            }
        }
    }
    let ingress_rules = serde_json::to_string(&policy_spec.ingress).unwrap();
    assert!(
        ingress_rules.contains("antidote.io/access"),
        "{ingress_rules}"
    );

    // Pods in lesson order on one node; none privileged (the router's image is trusted, but the
    // agent was not told to run trusted images privileged); no API token.
    let pods: Vec<Pod> = env
        .namespaced::<Pod>(&id)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items;
    let mut by_name: BTreeMap<String, Pod> = pods
        .into_iter()
        .filter(|p| !labels_of(&p.metadata).contains_key("antidote.io/config-stage"))
        .map(|p| (p.metadata.name.clone().unwrap(), p))
        .collect();
    assert_eq!(by_name.keys().collect::<Vec<_>>(), ["router", "web"]);
    let web = by_name.remove("web").unwrap();
    let router = by_name.remove("router").unwrap();
    let web_spec = web.spec.clone().unwrap();
    let router_spec = router.spec.clone().unwrap();
    assert_eq!(web_spec.node_name, router_spec.node_name, "one node");
    assert!(
        router_spec.affinity.is_some(),
        "the second pod follows the first"
    );
    assert!(web.metadata.creation_timestamp <= router.metadata.creation_timestamp);
    assert_eq!(web_spec.automount_service_account_token, Some(false));
    for spec in [&router_spec, &web_spec] {
        let container = &spec.containers[0];
        let context = container.security_context.clone().unwrap();
        assert_eq!(context.privileged, None, "{context:?}");
        assert_eq!(
            context.allow_privilege_escalation,
            Some(false),
            "{context:?}"
        );
        let capabilities = context.capabilities.unwrap();
        assert_eq!(capabilities.drop.unwrap(), ["ALL"]);
        let added = capabilities.add.unwrap();
        assert!(
            added.contains(&"NET_ADMIN".to_owned()) && !added.contains(&"SYS_ADMIN".to_owned())
        );
        let limits = container.resources.clone().unwrap().limits.unwrap();
        assert!(
            limits.contains_key("memory") && limits.contains_key("cpu"),
            "{limits:?}"
        );
    }

    // A Service per endpoint, an Ingress per http presentation.
    let service = env.namespaced::<Service>(&id).get("web").await.unwrap();
    let ports: Vec<i32> = service
        .spec
        .unwrap()
        .ports
        .unwrap()
        .iter()
        .map(|p| p.port)
        .collect();
    assert_eq!(ports, [8080, 22]);
    let ingress = env
        .namespaced::<Ingress>(&id)
        .get("web-page")
        .await
        .unwrap();
    let ingress_spec = ingress.spec.unwrap();
    assert_eq!(ingress_spec.ingress_class_name.as_deref(), Some("nginx"));
    let host = ingress_spec.rules.unwrap()[0].host.clone().unwrap();
    assert!(host.starts_with("page-web-"), "{host}");

    // Presentations answer on the pods' addresses; the URL names the Ingress host.
    let page = presentation(&ready, "web", "page");
    assert!(page.url.contains(&host), "{page:?}");
    let text = fetch(page).await;
    assert!(text.starts_with("HTTP/1.0 200"), "{text}");
    assert!(
        fetch(presentation(&ready, "router", "cli"))
            .await
            .starts_with("SSH-2.0-")
    );

    // The stage's configuration ran as a Job; a stage change runs a new one, old ones go.
    let jobs: Api<Job> = env.namespaced(&id);
    let job = jobs.get("config-web-g1").await.unwrap();
    let job_spec = job.spec.unwrap();
    assert_eq!(job_spec.backoff_limit, Some(2));
    // Bounded: 5 minutes per try, every try plus the controller's back-off in all.
    assert_eq!(job_spec.active_deadline_seconds, Some(3 * 300 + 30));
    assert_eq!(
        job_spec.template.spec.unwrap().active_deadline_seconds,
        Some(300)
    );
    let c = &env.scheduler.clients;
    c.request(&ready.session_id, "two-tier", 1).await.unwrap();
    let (_, staged) = c
        .follow(&id, PATIENCE, |l| l.stage == 1 && l.status() == S::Ready)
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", env.logs()));
    assert_eq!(staged.generation, 2);
    let names: Vec<String> = jobs
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|j| j.metadata.deletion_timestamp.is_none())
        .map(|j| j.metadata.name.unwrap())
        .collect();
    assert_eq!(names, ["config-web-g2"]);
    assert_eq!(
        presentation(&staged, "web", "page").address,
        page.address,
        "a stage change keeps the pods"
    );

    // Deleting the live lesson deletes the namespace, really.
    c.lessons
        .clone()
        .delete_live_lesson(api::DeleteLiveLessonRequest { id: id.clone() })
        .await
        .unwrap();
    c.gone(&id, PATIENCE).await.unwrap();
    assert!(
        namespaces
            .get_opt(&format!("antidote-{id}"))
            .await
            .unwrap()
            .is_none(),
        "the namespace is gone"
    );
}

#[tokio::test]
async fn k8s_failing_job_and_a_refused_object_fail_with_reasons() {
    // A RuntimeClass that does not exist makes the API server's admission refuse untrusted pods.
    let env = K8sEnv::start("k8s-fail", &["--untrusted-runtime-class", "Not_A_Name"]).await;
    let c = &env.scheduler.clients;
    let session = c.session().await.unwrap();
    let refused = c.request(&session, "sandboxed", 0).await.unwrap();
    let broken = c.request(&session, "broken-job", 0).await.unwrap();
    let failed = |id: String| async move {
        let (_, lesson) = c
            .follow(&id, Duration::from_secs(240), |l| {
                matches!(l.status(), S::Failed | S::Ready)
            })
            .await
            .unwrap();
        lesson
    };
    let refused = failed(refused.id).await;
    assert_eq!(refused.status(), S::Failed, "{}", env.logs());
    assert!(
        refused
            .failure_reason
            .contains("the API server refused Pod web")
            && refused
                .failure_reason
                .contains("RuntimeClass \"Not_A_Name\" not found"),
        "{}",
        refused.failure_reason
    );
    let broken = failed(broken.id).await;
    assert_eq!(broken.status(), S::Failed, "{}", env.logs());
    assert!(
        broken.failure_reason.contains("configuration box.sh")
            && broken.failure_reason.contains("3 tries")
            && broken.failure_reason.contains("BackoffLimitExceeded"),
        "{}",
        broken.failure_reason
    );
}

#[tokio::test]
async fn k8s_agent_restart_recovers_and_orphan_namespaces_go() {
    let mut env = K8sEnv::start("k8s-restart", &[]).await;
    let ready = env.ready("sandboxed", 0).await;
    let pods: Api<Pod> = env.namespaced(&ready.id);
    let before = pods.get("web").await.unwrap().metadata.uid;

    // An orphan: a labelled namespace the store does not know, with our cluster id (only
    // those are ever reaped: PROTOCOL.md, "Labels"), read off our own live lesson's namespace.
    let orphan = uuid::Uuid::new_v4().to_string();
    let namespaces: Api<Namespace> = Api::all(env.client.clone());
    let cluster = namespaces
        .get(&format!("antidote-{}", ready.id))
        .await
        .unwrap()
        .metadata
        .labels
        .unwrap_or_default()
        .remove("antidote.io/cluster")
        .expect("our live lesson's namespace carries the cluster label");
    let manifest = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": format!("antidote-{orphan}"),
            "labels": {
                "antidote.io/instance": env.instance,
                "antidote.io/cluster": cluster,
                "antidote.io/live-lesson": orphan,
                "antidote.io/session": orphan,
                "antidote.io/generation": "1",
                "antidote.io/lesson": "sandboxed",
                "antidote.io/managed-by": "agent-k8s",
            },
        },
    });
    namespaces
        .patch(
            &format!("antidote-{orphan}"),
            &PatchParams::apply("antidote-tests"),
            &Patch::Apply(&manifest),
        )
        .await
        .unwrap();

    // kill -9 and restart on the same port: the scheduler recovers the live lesson.
    env.agent.kill9().await;
    env.agent = Process::spawn_with_env(
        &workspace_bin("agent-k8s"),
        &env.agent_args,
        &env.agent_env,
        env.dir.path().join("agent-k8s-restarted.log"),
    )
    .await
    .expect("agent-k8s restarts");
    let c = &env.scheduler.clients;
    let lesson = c.ready(&ready.id).await.unwrap();
    assert_eq!(lesson.status(), S::Ready);
    let after = pods.get("web").await.unwrap().metadata.uid;
    assert_eq!(before, after, "the pod was adopted, not recreated");

    let gone = |ns: Option<&Namespace>| ns.is_none();
    tokio::time::timeout(
        PATIENCE,
        kube::runtime::wait::await_condition(
            namespaces.clone(),
            &format!("antidote-{orphan}"),
            gone,
        ),
    )
    .await
    .unwrap_or_else(|_| panic!("the orphan namespace is still there\n{}", env.logs()))
    .unwrap();
    assert!(
        namespaces
            .get_opt(&format!("antidote-{}", ready.id))
            .await
            .unwrap()
            .is_some(),
        "the known live lesson's namespace stays"
    );
}

#[tokio::test]
async fn agent_k8s_conforms() {
    let dir = tempfile::tempdir().unwrap();
    let client = admin().await;
    let kubeconfig = agent_kubeconfig(&client, dir.path()).await;
    let instance = format!("conformance-{}", &uuid::Uuid::new_v4().to_string()[..8]);
    let kubelet = fake_kubelet(dir.path(), &instance).await;
    // Restartable (`--restart-cmd`), with room for what the suite holds at once, so that the
    // restart and capacity checks run too.
    let agent = Restartable::spawn(
        &workspace_bin("agent-k8s"),
        &[
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--probe-timeout".into(),
            "60s".into(),
            "--max-live-lessons".into(),
            "3".into(),
        ],
        &[("KUBECONFIG", kubeconfig.display().to_string())],
        dir.path(),
        "agent-k8s",
    )
    .await
    .expect("agent-k8s starts");
    let restart = agent.restart_cmd();
    let output = tokio::process::Command::new(workspace_bin("antidote-conformance"))
        .args(["--agent", &agent.url(), "--instance", &instance])
        .args(["--restart-cmd", &restart])
        .output()
        .await
        .expect("antidote-conformance runs");
    let report = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && report.contains(" 0 failed"),
        "conformance failed ({}):\n{report}\n{}\n--- agent-k8s ---\n{}\n--- fake-kubelet ---\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr),
        agent.log_text(),
        kubelet.log_text()
    );
    assert!(report.contains("Namespace, NetworkPolicy, Pod"), "{report}");
    for ran in [
        "restart-adopt",
        "capacity-refusal",
        "failed-probe",
        "failed-config",
    ] {
        assert!(report.contains(&format!("PASS  {ran}:")), "{report}");
    }
}

/// The CustomResourceDefinition Multus installs, as its own deployment manifest declares it.
fn multus_crd() -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": { "name": "network-attachment-definitions.k8s.cni.cncf.io" },
        "spec": {
            "group": "k8s.cni.cncf.io",
            "scope": "Namespaced",
            "names": {
                "plural": "network-attachment-definitions",
                "singular": "network-attachment-definition",
                "kind": "NetworkAttachmentDefinition",
                "shortNames": ["net-attach-def"],
            },
            "versions": [{
                "name": "v1",
                "served": true,
                "storage": true,
                "schema": { "openAPIV3Schema": {
                    "type": "object",
                    "properties": {
                        "apiVersion": { "type": "string" },
                        "kind": { "type": "string" },
                        "metadata": { "type": "object" },
                        "spec": {
                            "type": "object",
                            "properties": { "config": { "type": "string" } },
                        },
                    },
                } },
            }],
        },
    })
}

/// The agent's own view of a live lesson (conditions are not part of the public API).
async fn agent_state(env: &K8sEnv, id: &str) -> antidote_proto::agent::v1::LiveLessonState {
    use antidote_proto::agent::v1 as proto;
    proto::backend_client::BackendClient::connect(env.agent.url())
        .await
        .unwrap()
        .get(proto::GetRequest {
            live_lesson_id: id.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .state
        .unwrap()
}

#[tokio::test]
async fn k8s_connections_become_attachments_where_multus_is_installed() {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    let env = K8sEnv::start("k8s-multus", &[]).await;
    let crds: Api<CustomResourceDefinition> = Api::all(env.client.clone());
    let crd_name = "network-attachment-definitions.k8s.cni.cncf.io";
    if let Some(crd) = crds.get_opt(crd_name).await.unwrap() {
        crds.delete(crd_name, &Default::default()).await.unwrap();
        let uid = crd.metadata.uid.unwrap();
        tokio::time::timeout(
            PATIENCE,
            await_condition(crds.clone(), crd_name, conditions::is_deleted(&uid)),
        )
        .await
        .expect("the CRD goes")
        .unwrap();
    }

    // Without Multus: READY, with a condition saying the links are flat.
    let flat = env.ready("two-tier", 0).await;
    let state = agent_state(&env, &flat.id).await;
    let missing = state
        .conditions
        .iter()
        .find(|c| c.reason == "MultusMissing")
        .unwrap_or_else(|| panic!("no MultusMissing condition: {:?}", state.conditions));
    assert!(!missing.status && missing.message.contains("NetworkAttachmentDefinition"));

    // With Multus's CRD: a NetworkAttachmentDefinition per connection, pods that join it.
    crds.patch(
        crd_name,
        &PatchParams::apply("antidote-tests").force(),
        &Patch::Apply(&multus_crd()),
    )
    .await
    .unwrap();
    tokio::time::timeout(
        PATIENCE,
        await_condition(crds.clone(), crd_name, conditions::is_crd_established()),
    )
    .await
    .expect("the CRD is established")
    .unwrap();
    let linked = env.ready("two-tier", 0).await;
    let resource = ApiResource {
        group: "k8s.cni.cncf.io".into(),
        version: "v1".into(),
        api_version: "k8s.cni.cncf.io/v1".into(),
        kind: "NetworkAttachmentDefinition".into(),
        plural: "network-attachment-definitions".into(),
    };
    let attachments: Api<DynamicObject> = Api::namespaced_with(
        env.client.clone(),
        &format!("antidote-{}", linked.id),
        &resource,
    );
    let link = attachments.get("link-0-web-router").await.unwrap();
    assert_eq!(
        labels_of(&link.metadata)["antidote.io/live-lesson"],
        linked.id
    );
    let config: serde_json::Value =
        serde_json::from_str(link.data["spec"]["config"].as_str().unwrap()).unwrap();
    assert_eq!(config["type"], "bridge");
    let pods: Api<Pod> = env.namespaced(&linked.id);
    for endpoint in ["web", "router"] {
        let pod = pods.get(endpoint).await.unwrap();
        let networks = pod.metadata.annotations.unwrap_or_default();
        assert!(
            networks["k8s.v1.cni.cncf.io/networks"].contains("link-0-web-router"),
            "{endpoint}: {networks:?}"
        );
    }
    let state = agent_state(&env, &linked.id).await;
    assert!(
        state.conditions.iter().all(|c| c.reason != "MultusMissing"),
        "{:?}",
        state.conditions
    );
    // Leave the cluster as we found it for the other tests.
    crds.delete(crd_name, &Default::default()).await.unwrap();
}

#[tokio::test]
async fn k8s_configuration_that_never_ends_fails_at_its_deadline() {
    let env = K8sEnv::start(
        "k8s-endless",
        &["--config-timeout", "2s", "--config-backoff-limit", "0"],
    )
    .await;
    let c = &env.scheduler.clients;
    let session = c.session().await.unwrap();
    let lesson = c.request(&session, "endless-job", 0).await.unwrap();
    let (_, lesson) = c
        .follow(&lesson.id, PATIENCE, |l| {
            matches!(l.status(), S::Failed | S::Ready)
        })
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", env.logs()));
    assert_eq!(lesson.status(), S::Failed, "{}", env.logs());
    for words in [
        "configuration box.sh",
        "did not finish within 2s",
        "DeadlineExceeded",
    ] {
        assert!(
            lesson.failure_reason.contains(words),
            "{words:?} in {}",
            lesson.failure_reason
        );
    }
    // The cluster bounds it, not only the agent: the Job and its pods carry the deadline.
    let job = env
        .namespaced::<Job>(&lesson.id)
        .get("config-box-g1")
        .await
        .unwrap()
        .spec
        .unwrap();
    assert_eq!(job.active_deadline_seconds, Some(2));
    assert_eq!(job.template.spec.unwrap().active_deadline_seconds, Some(2));
}

/// A kube client with the credentials of a kubeconfig file.
async fn client_of(kubeconfig: &Path) -> kube::Client {
    let file = kube::config::Kubeconfig::read_from(kubeconfig).unwrap();
    let config =
        kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
            .await
            .unwrap();
    kube::Client::try_from(config).unwrap()
}

/// The API server's answer to a write, for [`refused`].
type Answer = Result<(), kube::Error>;

/// Waits until `attempt` is refused by the API server with a message containing `because`,
/// and fails if it is still accepted after a while. Admission policies take effect once the
/// API server has loaded them (a second or two after they are applied), hence the retries;
/// every attempt is a dry run, so an accepted one changes nothing.
async fn refused<F, Fut>(what: &str, because: &str, attempt: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Answer>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        match attempt().await {
            Err(kube::Error::Api(status)) if status.message.contains(because) => return,
            Err(kube::Error::Api(status)) => {
                panic!("{what} was refused, but not because {because:?}: {status:?}")
            }
            Err(other) => panic!("{what}: {other}"),
            Ok(()) if tokio::time::Instant::now() > deadline => {
                panic!("{what} was allowed with the agent's token")
            }
            Ok(()) => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    }
}

#[tokio::test]
async fn k8s_agent_token_writes_only_in_the_namespaces_it_labels() {
    let dir = tempfile::tempdir().unwrap();
    let admin = admin().await;
    let agent = client_of(&agent_kubeconfig(&admin, dir.path()).await).await;
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    let pod = |extra: serde_json::Value| -> Pod {
        let mut pod = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": { "name": "intruder" },
            "spec": { "containers": [{ "name": "c", "image": "antidote/busybox:latest" }] },
        });
        if let (Some(spec), Some(extra)) = (pod["spec"].as_object_mut(), extra.as_object()) {
            spec.extend(extra.clone());
        }
        serde_json::from_value(pod).unwrap()
    };
    let namespace = |name: &str, labels: serde_json::Value| -> Namespace {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": { "name": name, "labels": labels },
        }))
        .unwrap()
    };
    const CONFINED: &str = "antidote-agent-k8s-namespaces";
    const HOST: &str = "antidote-agent-k8s-pods";
    const SERVICES: &str = "antidote-agent-k8s-services";
    let namespaces: Api<Namespace> = Api::all(agent.clone());

    // Outside its namespaces: refused, by the policy.
    let kube_system: Api<Pod> = Api::namespaced(agent.clone(), "kube-system");
    refused("a pod in kube-system", CONFINED, || async {
        kube_system
            .create(&dry, &pod(serde_json::json!({})))
            .await
            .map(drop)
    })
    .await;
    let delete_dry = DeleteParams {
        dry_run: true,
        ..Default::default()
    };
    // Deleting kube-system (or default, kube-public) is refused by NamespaceLifecycle before
    // any policy runs, so asserting it would prove nothing about ours. The agent's own home,
    // antidote-system, is protected by nothing else: its name starts with antidote- but it
    // does not carry the agent's label, so only the policy refuses its deletion.
    refused(
        "deleting antidote-system, its own home",
        CONFINED,
        || async {
            namespaces
                .delete("antidote-system", &delete_dry)
                .await
                .map(drop)
        },
    )
    .await;
    let foreign = format!("foreign-{}", &uuid::Uuid::new_v4().to_string()[..8]);
    Api::<Namespace>::all(admin.clone())
        .create(
            &PostParams::default(),
            &namespace(&foreign, serde_json::json!({})),
        )
        .await
        .unwrap();
    refused(
        "deleting a namespace it did not label",
        CONFINED,
        || async { namespaces.delete(&foreign, &delete_dry).await.map(drop) },
    )
    .await;
    refused("labelling kube-system as its own", CONFINED, || async {
        let patch = serde_json::json!({
            "metadata": { "labels": { "antidote.io/managed-by": "agent-k8s" } },
        });
        let params = PatchParams {
            dry_run: true,
            ..Default::default()
        };
        namespaces
            .patch("kube-system", &params, &Patch::Merge(&patch))
            .await
            .map(drop)
    })
    .await;
    refused("a namespace without its label", CONFINED, || async {
        let name = format!("antidote-{}", uuid::Uuid::new_v4());
        namespaces
            .create(&dry, &namespace(&name, serde_json::json!({})))
            .await
            .map(drop)
    })
    .await;
    refused("a namespace with the access label", CONFINED, || async {
        let name = format!("antidote-{}", uuid::Uuid::new_v4());
        let labels = serde_json::json!({
            "antidote.io/managed-by": "agent-k8s",
            "antidote.io/access": "true",
        });
        namespaces
            .create(&dry, &namespace(&name, labels))
            .await
            .map(drop)
    })
    .await;

    // Inside a namespace it labelled: allowed, but nothing that reaches into the node.
    let own = format!("antidote-{}", uuid::Uuid::new_v4());
    namespaces
        .create(
            &PostParams::default(),
            &namespace(
                &own,
                serde_json::json!({ "antidote.io/managed-by": "agent-k8s" }),
            ),
        )
        .await
        .expect("the agent creates a namespace it labels");
    let pods: Api<Pod> = Api::namespaced(agent.clone(), &own);
    pods.create(&dry, &pod(serde_json::json!({})))
        .await
        .expect("the agent creates pods in its own namespace");
    refused("a privileged pod", HOST, || async {
        let privileged = serde_json::json!({ "containers": [{
            "name": "c", "image": "antidote/busybox:latest",
            "securityContext": { "privileged": true },
        }] });
        pods.create(&dry, &pod(privileged)).await.map(drop)
    })
    .await;
    refused("a pod on the host's network", HOST, || async {
        pods.create(&dry, &pod(serde_json::json!({ "hostNetwork": true })))
            .await
            .map(drop)
    })
    .await;
    refused("a pod mounting the node's root", HOST, || async {
        let volumes =
            serde_json::json!({ "volumes": [{ "name": "root", "hostPath": { "path": "/" } }] });
        pods.create(&dry, &pod(volumes)).await.map(drop)
    })
    .await;
    // Nothing near-privileged either. Each case is one field away from a pod the agent makes.
    let container = |context: serde_json::Value| {
        serde_json::json!({ "containers": [{
            "name": "c", "image": "antidote/busybox:latest", "securityContext": context,
        }] })
    };
    // What agent-k8s gives a lesson container (cluster::security_context) is allowed.
    let lesson_context = serde_json::json!({
        "allowPrivilegeEscalation": false,
        "capabilities": { "drop": ["ALL"], "add": [
            "NET_ADMIN", "NET_RAW", "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID",
            "KILL", "NET_BIND_SERVICE", "SETGID", "SETUID", "SYS_CHROOT",
        ] },
        "seccompProfile": { "type": "RuntimeDefault" },
    });
    pods.create(&dry, &pod(container(lesson_context)))
        .await
        .expect("the agent creates lesson pods with its own security context");
    let near_privileged = [
        (
            "a pod adding SYS_ADMIN",
            container(serde_json::json!({ "capabilities": { "add": ["NET_ADMIN", "SYS_ADMIN"] } })),
        ),
        (
            "a pod adding ALL capabilities",
            container(serde_json::json!({ "capabilities": { "add": ["ALL"] } })),
        ),
        (
            "a pod adding CAP_SYS_PTRACE",
            container(serde_json::json!({ "capabilities": { "add": ["CAP_SYS_PTRACE"] } })),
        ),
        (
            "a pod without seccomp",
            serde_json::json!({
                "securityContext": { "seccompProfile": { "type": "Unconfined" } },
                "containers": [{ "name": "c", "image": "antidote/busybox:latest" }],
            }),
        ),
        (
            "a container without seccomp",
            container(serde_json::json!({ "seccompProfile": { "type": "Unconfined" } })),
        ),
        (
            "a container without AppArmor",
            container(serde_json::json!({ "appArmorProfile": { "type": "Unconfined" } })),
        ),
        (
            "a container allowed to escalate",
            container(serde_json::json!({ "allowPrivilegeEscalation": true })),
        ),
        (
            "a container with an unmasked /proc",
            // The API server itself wants hostUsers: false beside an unmasked /proc.
            serde_json::json!({
                "hostUsers": false,
                "containers": [{
                    "name": "c", "image": "antidote/busybox:latest",
                    "securityContext": { "procMount": "Unmasked" },
                }],
            }),
        ),
        (
            "an init container adding SYS_ADMIN",
            serde_json::json!({
                "initContainers": [{
                    "name": "i", "image": "antidote/busybox:latest",
                    "securityContext": { "capabilities": { "add": ["SYS_ADMIN"] } },
                }],
                "containers": [{ "name": "c", "image": "antidote/busybox:latest" }],
            }),
        ),
        (
            "a pod in the host's PID namespace",
            serde_json::json!({ "hostPID": true }),
        ),
        (
            "a pod in the host's IPC namespace",
            serde_json::json!({ "hostIPC": true }),
        ),
    ];
    for (what, extra) in near_privileged {
        refused(what, HOST, || async {
            pods.create(&dry, &pod(extra.clone())).await.map(drop)
        })
        .await;
    }
    refused("a Job adding SYS_ADMIN", HOST, || async {
        let job: Job = serde_json::from_value(serde_json::json!({
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": { "name": "intruder" },
            "spec": { "template": { "spec": {
                "restartPolicy": "Never",
                "containers": [{
                    "name": "c", "image": "antidote/busybox:latest",
                    "securityContext": { "capabilities": { "add": ["SYS_ADMIN"] } },
                }],
            } } },
        }))
        .unwrap();
        Api::<Job>::namespaced(agent.clone(), &own)
            .create(&dry, &job)
            .await
            .map(drop)
    })
    .await;

    // Services stay inside the cluster: ClusterIP, as the agent makes them, and nothing else.
    let services: Api<Service> = Api::namespaced(agent.clone(), &own);
    let service = |extra: serde_json::Value| -> Service {
        let mut service = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": { "name": "intruder" },
            "spec": {
                "selector": { "app": "intruder" },
                "ports": [{ "name": "http", "port": 80, "targetPort": 80, "protocol": "TCP" }],
            },
        });
        if let (Some(spec), Some(extra)) = (service["spec"].as_object_mut(), extra.as_object()) {
            spec.extend(extra.clone());
        }
        serde_json::from_value(service).unwrap()
    };
    services
        .create(&dry, &service(serde_json::json!({})))
        .await
        .expect("the agent creates ClusterIP Services in its own namespace");
    for (what, extra) in [
        (
            "a NodePort Service",
            serde_json::json!({ "type": "NodePort" }),
        ),
        (
            "a LoadBalancer Service",
            serde_json::json!({ "type": "LoadBalancer" }),
        ),
        (
            "a Service with externalIPs",
            serde_json::json!({ "externalIPs": ["203.0.113.7"] }),
        ),
        (
            "an ExternalName Service",
            serde_json::json!({
                "type": "ExternalName", "externalName": "kubernetes.default.svc.cluster.local",
                "selector": null,
            }),
        ),
    ] {
        refused(what, SERVICES, || async {
            services
                .create(&dry, &service(extra.clone()))
                .await
                .map(drop)
        })
        .await;
    }

    refused("a Job with a privileged pod", HOST, || async {
        let job: Job = serde_json::from_value(serde_json::json!({
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": { "name": "intruder" },
            "spec": { "template": { "spec": {
                "restartPolicy": "Never",
                "containers": [{
                    "name": "c", "image": "antidote/busybox:latest",
                    "securityContext": { "privileged": true },
                }],
            } } },
        }))
        .unwrap();
        Api::<Job>::namespaced(agent.clone(), &own)
            .create(&dry, &job)
            .await
            .map(drop)
    })
    .await;
    namespaces
        .delete(&own, &DeleteParams::default())
        .await
        .expect("the agent deletes a namespace it labelled");
    Api::<Namespace>::all(admin)
        .delete(&foreign, &DeleteParams::default())
        .await
        .unwrap();
}
