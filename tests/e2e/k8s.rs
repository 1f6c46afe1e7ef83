//! agent-k8s on a real single-node cluster (`tests/k8s/cluster.sh`, started by `tests/run`,
//! which exports KUBECONFIG): etcd, kube-apiserver, kube-controller-manager and kube-scheduler,
//! a kubelet with containerd, CNI bridges, Multus, kube-router enforcing NetworkPolicy and
//! CoreDNS. Lesson images are built locally and imported into the node's containerd, and the
//! agent runs with `--image-pull-policy Never` and a token of the ServiceAccount bound to
//! `deploy/k8s/agent-k8s-rbac.yaml`, not as admin, so that file's admission policies apply to it
//! as they would in production (and a test checks, with that token, what they refuse).
//!
//! Every promise is checked by its effect on real pods: the page a stage's configuration wrote
//! is served by the endpoint's own web server, a route is there (or not) when seen from inside
//! the client pod, another lesson's pods are out of reach, a configuration that hangs is killed
//! inside its pod.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use antidote_proto::api::v1 as api;
use antidote_tests::config::{Agent, SchedulerConfig, secs};
use antidote_tests::{
    Process, Restartable, Scheduler, checks, example_curriculum, fetch, presentation, workspace_bin,
};
use api::LiveLessonStatus as S;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Namespace, Pod, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::{Ingress, NetworkPolicy};
use kube::api::{
    Api, AttachParams, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams,
};
use kube::discovery::ApiResource;
use tempfile::TempDir;
use tokio::io::AsyncReadExt as _;

use crate::PATIENCE;

fn admin_kubeconfig() -> PathBuf {
    std::env::var("KUBECONFIG")
        .expect("KUBECONFIG is not set: run tests/run, which starts the test cluster (tests/k8s/cluster.sh)")
        .into()
}

pub(crate) async fn admin() -> kube::Client {
    kube::Client::try_default()
        .await
        .expect("the test cluster answers")
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .unwrap()
}

fn k8s_curriculum() -> PathBuf {
    repo().join("tests/fixtures/k8s-curriculum")
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

/// The flags every test's agent-k8s gets: the images were imported into the node's
/// containerd, and there is no registry to pull from.
pub(crate) const LOCAL_IMAGES: [&str; 2] = ["--image-pull-policy", "Never"];

/// agent-k8s as its ServiceAccount, on the test node's local images; returns it with the
/// arguments and environment that restart it on the same address.
pub(crate) async fn agent_k8s(
    dir: &Path,
    kubeconfig: &Path,
    extra: &[&str],
) -> (Process, Vec<String>, Vec<(&'static str, String)>) {
    let mut args: Vec<String> = vec!["--listen".into(), "127.0.0.1:0".into()];
    if !extra.contains(&"--probe-timeout") {
        args.extend(["--probe-timeout".into(), "90s".into()]);
    }
    args.extend(LOCAL_IMAGES.iter().map(|a| a.to_string()));
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

/// The scheduler configuration of a test on agent-k8s (without the agent): a real backend's,
/// tier `prod`, four minutes to provision on a busy node.
pub(crate) fn scheduler_config(instance: &str, curriculum: &Path) -> SchedulerConfig {
    SchedulerConfig::on_real_backend(instance, curriculum, secs(240)).with_tier("prod")
}

/// Deletes, when dropped, every lesson namespace of a scheduler instance (without waiting):
/// a test's lessons must not outlive it on the one shared node, whose CPU requests they would
/// hold while later tests wait for room, whether the test passed or not.
pub(crate) struct Leftovers(pub String);

impl Drop for Leftovers {
    fn drop(&mut self) {
        let _ = std::process::Command::new(crate::deploy::kubectl_binary())
            .args([
                "delete",
                "namespace",
                "--wait=false",
                "--ignore-not-found",
                "-l",
            ])
            .arg(format!("antidote.io/instance={}", self.0))
            .output();
    }
}

/// A scheduler and agent-k8s (as its ServiceAccount, on the node's local images) for one
/// instance, whose lesson namespaces go when it is dropped.
pub(crate) struct K8sEnv {
    pub(crate) dir: TempDir,
    pub(crate) instance: String,
    /// An admin client of the test cluster.
    pub(crate) client: kube::Client,
    pub(crate) agent: Process,
    /// The agent's arguments and environment, which start it again on the same address.
    pub(crate) agent_args: Vec<String>,
    pub(crate) agent_env: Vec<(&'static str, String)>,
    pub(crate) scheduler: Scheduler,
    /// The scheduler's configuration, to start it again.
    pub(crate) config: String,
    /// Deletes the instance's lesson namespaces when the environment goes.
    pub(crate) leftovers: Leftovers,
}

impl K8sEnv {
    /// On the k8s fixture curriculum.
    pub(crate) async fn start(instance: &str, agent_extra: &[&str]) -> K8sEnv {
        K8sEnv::with_curriculum(instance, agent_extra, &k8s_curriculum()).await
    }

    pub(crate) async fn with_curriculum(
        instance: &str,
        agent_extra: &[&str],
        curriculum: &Path,
    ) -> K8sEnv {
        let config = scheduler_config(instance, curriculum);
        K8sEnv::with_config(tempfile::tempdir().unwrap(), config, agent_extra).await
    }

    /// agent-k8s with `agent_extra`, and a scheduler configured by `config`, to which the agent
    /// is added as `k8s`; files in `dir`.
    pub(crate) async fn with_config(
        dir: TempDir,
        config: SchedulerConfig,
        agent_extra: &[&str],
    ) -> K8sEnv {
        let client = admin().await;
        let kubeconfig = agent_kubeconfig(&client, dir.path()).await;
        // Dropped first thing if the start fails: whatever it made goes too.
        let leftovers = Leftovers(config.instance_id.clone());
        let (agent, agent_args, agent_env) = agent_k8s(dir.path(), &kubeconfig, agent_extra).await;
        let instance = config.instance_id.clone();
        let config = config.with_agent(Agent::new("k8s", agent.url())).to_toml();
        let scheduler = Scheduler::start(dir.path(), &config)
            .await
            .expect("scheduler starts");
        K8sEnv {
            dir,
            instance,
            client,
            agent,
            agent_args,
            agent_env,
            scheduler,
            config,
            leftovers,
        }
    }

    pub(crate) fn logs(&self) -> String {
        format!(
            "--- scheduler ---\n{}\n--- agent-k8s ---\n{}",
            self.scheduler.process.log_text(),
            self.agent.log_text(),
        )
    }

    pub(crate) async fn ready(&self, lesson: &str, stage: u32) -> api::LiveLesson {
        let c = &self.scheduler.clients;
        let session = c.session().await.unwrap();
        let requested = c.request(&session, lesson, stage).await.unwrap();
        c.ready(&requested.id)
            .await
            .unwrap_or_else(|e| panic!("{e:#}\n{}", self.logs()))
    }

    /// Asks for `lesson` and follows it until it settles, READY or FAILED.
    pub(crate) async fn settled(&self, lesson: &str, limit: Duration) -> api::LiveLesson {
        let c = &self.scheduler.clients;
        let session = c.session().await.unwrap();
        let requested = c.request(&session, lesson, 0).await.unwrap();
        let (_, lesson) = c
            .follow(&requested.id, limit, |l| {
                matches!(l.status(), S::Failed | S::Ready)
            })
            .await
            .unwrap_or_else(|e| panic!("{e:#}\n{}", self.logs()));
        lesson
    }

    pub(crate) fn namespaced<K>(&self, id: &str) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        <K as kube::Resource>::DynamicType: Default,
    {
        Api::namespaced(self.client.clone(), &format!("antidote-{id}"))
    }

    /// Follows a live lesson of generation `generation` until READY or FAILED.
    pub(crate) async fn settle(
        &self,
        id: &str,
        generation: u64,
        limit: Duration,
    ) -> api::LiveLesson {
        let (_, lesson) = self
            .scheduler
            .clients
            .follow(id, limit, |l| {
                l.generation == generation && matches!(l.status(), S::Ready | S::Failed)
            })
            .await
            .unwrap_or_else(|e| panic!("{e:#}\n{}", self.logs()));
        lesson
    }

    /// Deletes the live lessons and waits until each is gone.
    pub(crate) async fn delete_all(&self, ids: &[&str]) {
        for id in ids {
            self.scheduler
                .clients
                .delete(id, PATIENCE)
                .await
                .unwrap_or_else(|e| panic!("{e:#}\n{}", self.logs()));
        }
    }

    /// The container log of endpoint `pod` of live lesson `id`.
    pub(crate) async fn log_of(&self, id: &str, pod: &str) -> String {
        self.namespaced::<Pod>(id)
            .logs(pod, &Default::default())
            .await
            .unwrap_or_default()
    }

    /// Runs `script` with `sh -c` inside endpoint `pod` of live lesson `id`.
    pub(crate) async fn exec(&self, id: &str, pod: &str, script: &str) -> Exec {
        exec(&self.namespaced::<Pod>(id), pod, script).await
    }
}

/// What a command run inside a pod did.
#[derive(Debug)]
pub(crate) struct Exec {
    /// Its exit code.
    pub code: i64,
    /// Its stdout and stderr.
    pub output: String,
}

/// Runs `script` with `sh -c` in the first container of `pod` (as `kubectl exec` would), for
/// at most 60 s.
pub(crate) async fn exec(pods: &Api<Pod>, pod: &str, script: &str) -> Exec {
    let params = AttachParams::default().stdout(true).stderr(true);
    let run = async {
        let mut attached = pods
            .exec(pod, ["sh", "-c", script], &params)
            .await
            .unwrap_or_else(|e| panic!("exec in {pod}: {e}"));
        let mut stdout = attached.stdout().unwrap();
        let mut stderr = attached.stderr().unwrap();
        let status = attached.take_status().unwrap();
        let mut out = Vec::new();
        let mut err = Vec::new();
        let _ = tokio::join!(stdout.read_to_end(&mut out), stderr.read_to_end(&mut err));
        let status = status.await;
        out.extend_from_slice(&err);
        let code = match status {
            Some(s) if s.status.as_deref() == Some("Success") => 0,
            Some(s) => s
                .details
                .and_then(|d| d.causes)
                .into_iter()
                .flatten()
                .find(|c| c.reason.as_deref() == Some("ExitCode"))
                .and_then(|c| c.message?.parse().ok())
                .unwrap_or(-1),
            None => -1,
        };
        Exec {
            code,
            output: String::from_utf8_lossy(&out).into_owned(),
        }
    };
    tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .unwrap_or_else(|_| panic!("exec in {pod} did not end within 60 s"))
}

/// Whether a TCP connection from inside `pod` to `target` (host:port) is accepted within 3 s
/// (busybox's nc; `-w 3` bounds the connect).
async fn reaches(pods: &Api<Pod>, pod: &str, target: &str) -> bool {
    let (host, port) = target.rsplit_once(':').unwrap();
    let ran = exec(
        pods,
        pod,
        &format!(
            "nc -w 3 {host} {port} </dev/null >/dev/null 2>&1 && echo REACHED || echo REFUSED"
        ),
    )
    .await;
    assert!(
        ran.code == 0 && (ran.output.contains("REACHED") || ran.output.contains("REFUSED")),
        "nc in {pod} did not run: {ran:?}"
    );
    ran.output.contains("REACHED")
}

/// How long after a pod starts the node's policy enforcer may take to apply the lesson's
/// NetworkPolicy to it: kube-router programs a new pod's address on its next sync after the pod
/// event (the book's security page tells operators), and a sync it aborted is redone by the
/// next one (tests/k8s/cluster.sh runs one every 15 s); the isolation must hold once it has.
const ENFORCER_LAG: Duration = Duration::from_secs(30);

/// Whether `target` is (or within `lag` becomes) out of reach from `pod`.
async fn closed_within(pods: &Api<Pod>, pod: &str, target: &str, lag: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + lag;
    loop {
        if !reaches(pods, pod, target).await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// What the node's policy enforcer did about the pod at `pod_ip`, for a failure message: its
/// rules that name the pod (`iptables -S` of kube-router's chains; none: it has not programmed
/// the pod) and the last lines of its log (`-v=1`: each sync, how long it took, and why one
/// was aborted).
fn enforcer_state(pod_ip: &str) -> String {
    let logs = admin_kubeconfig()
        .parent()
        .expect("the kubeconfig sits in the cluster's state directory")
        .join("node/logs/kube-router.log");
    let mut state = format!("kube-router's rules for {pod_ip}:\n");
    for chain in [
        "KUBE-ROUTER-INPUT",
        "KUBE-ROUTER-FORWARD",
        "KUBE-ROUTER-OUTPUT",
    ] {
        let listed = std::process::Command::new("iptables")
            .args(["-S", chain])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_else(|e| format!("iptables -S {chain}: {e}\n"));
        for line in listed
            .lines()
            .filter(|l| l.contains(&format!("{pod_ip}/32")))
        {
            state.push_str(line);
            state.push('\n');
        }
    }
    let log = std::fs::read_to_string(&logs).unwrap_or_else(|e| format!("{}: {e}", logs.display()));
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.starts_with('E') || l.contains("took") || l.contains("Aborting"))
        .collect();
    state.push_str(&format!("the last of {}:\n", logs.display()));
    for line in &lines[lines.len().saturating_sub(20)..] {
        state.push_str(line);
        state.push('\n');
    }
    state
}

/// Fetches `path` from an HTTP presentation's pod address, from the host.
async fn page(presentation: &api::LivePresentation, path: &str) -> String {
    use tokio::io::AsyncWriteExt as _;
    let mut stream = tokio::net::TcpStream::connect(&presentation.address)
        .await
        .expect("the presentation accepts connections");
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut bytes = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut bytes)).await;
    String::from_utf8_lossy(&bytes).into_owned()
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

    // Deny by default, without DNS: egress only to the lesson's own pods.
    let policy = env
        .namespaced::<NetworkPolicy>(&id)
        .get("antidote-isolation")
        .await
        .unwrap();
    let policy_spec = policy.spec.unwrap();
    assert_eq!(policy_spec.policy_types.unwrap(), ["Ingress", "Egress"]);
    let egress = serde_json::to_string(&policy_spec.egress).unwrap();
    assert_eq!(egress, r#"[{"to":[{"podSelector":{}}]}]"#);
    let ingress_rules = serde_json::to_string(&policy_spec.ingress).unwrap();
    assert!(
        ingress_rules.contains("antidote.io/access"),
        "{ingress_rules}"
    );

    // Pods in lesson order on one node; none privileged (the router's image is trusted, but the
    // agent was not told to run trusted images privileged); no API token; small requests.
    let pods: Vec<Pod> = env
        .namespaced::<Pod>(&id)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items;
    let mut by_name: BTreeMap<String, Pod> = pods
        .into_iter()
        .map(|p| (p.metadata.name.clone().unwrap(), p))
        .collect();
    assert_eq!(
        by_name.keys().collect::<Vec<_>>(),
        ["router", "web"],
        "the endpoints' pods and nothing else: shell configurations run inside them"
    );
    let web = by_name.remove("web").unwrap();
    let router = by_name.remove("router").unwrap();
    let web_spec = web.spec.clone().unwrap();
    let router_spec = router.spec.clone().unwrap();
    assert_eq!(web_spec.node_name, router_spec.node_name, "one node");
    assert!(
        router_spec.affinity.is_some(),
        "the second pod follows the first"
    );
    assert_eq!(web_spec.automount_service_account_token, Some(false));
    for spec in [&router_spec, &web_spec] {
        let container = &spec.containers[0];
        assert_eq!(container.image_pull_policy.as_deref(), Some("Never"));
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
        let resources = container.resources.clone().unwrap();
        let limits = resources.limits.unwrap();
        assert!(
            limits.contains_key("memory") && limits.contains_key("cpu"),
            "{limits:?}"
        );
        assert_eq!(resources.requests.unwrap()["cpu"].0, "50m");
    }

    // A Service per endpoint, an Ingress per http presentation.
    let service = env.namespaced::<Service>(&id).get("web").await.unwrap();
    let router_ip = env
        .namespaced::<Service>(&id)
        .get("router")
        .await
        .unwrap()
        .spec
        .unwrap()
        .cluster_ip
        .unwrap();
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
    let web_page = presentation(&ready, "web", "page");
    assert!(web_page.url.contains(&host), "{web_page:?}");
    let text = fetch(web_page).await;
    assert!(text.starts_with("HTTP/1.1 200 OK"), "{text}");
    assert!(
        fetch(presentation(&ready, "router", "cli"))
            .await
            .starts_with("SSH-2.0-")
    );

    // The stage's configuration ran inside the web pod: its httpd serves what the script wrote,
    // with the endpoint's name in ANTIDOTE_ENDPOINT.
    let staged = page(web_page, "/stage.html").await;
    assert!(
        staged.contains("stage 0 for web"),
        "{staged}\n{}",
        env.logs()
    );
    // The lesson's names resolve without DNS: /etc/hosts names the router by its Service.
    let hosts = env.exec(&id, "web", "cat /etc/hosts").await;
    assert!(
        hosts
            .output
            .lines()
            .any(|l| l.starts_with(&router_ip) && l.contains("router")),
        "{hosts:?}"
    );
    let pods: Api<Pod> = env.namespaced(&id);
    assert!(
        reaches(&pods, "web", "router:22").await,
        "the lesson's own endpoint, by name"
    );

    // A stage change runs the next stage's script in the same pod; no Job is ever made.
    let c = &env.scheduler.clients;
    c.request(&ready.session_id, "two-tier", 1).await.unwrap();
    let (_, staged) = c
        .follow(&id, PATIENCE, |l| l.stage == 1 && l.status() == S::Ready)
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", env.logs()));
    assert_eq!(staged.generation, 2);
    let now = page(presentation(&staged, "web", "page"), "/stage.html").await;
    assert!(now.contains("stage 1 for web"), "{now}");
    assert_eq!(
        presentation(&staged, "web", "page").address,
        web_page.address,
        "a stage change keeps the pods"
    );
    let jobs: Api<Job> = env.namespaced(&id);
    assert!(
        jobs.list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty(),
        "shell configurations make no Jobs"
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
async fn k8s_failing_configuration_and_a_refused_object_fail_with_reasons() {
    // A RuntimeClass that does not exist makes the API server's admission refuse untrusted pods.
    let env = K8sEnv::start("k8s-fail", &["--untrusted-runtime-class", "Not_A_Name"]).await;
    let (refused, broken) = tokio::join!(
        env.settled("sandboxed", Duration::from_secs(240)),
        env.settled("broken-job", Duration::from_secs(240)),
    );
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
    assert_eq!(broken.status(), S::Failed, "{}", env.logs());
    // The script's own exit code and words, from inside the endpoint, after three tries.
    for words in [
        "configuration box.sh of endpoint `box` for stage 0 failed 3 times",
        "exit code 3",
        "box.sh: cannot configure this box on purpose",
    ] {
        assert!(
            broken.failure_reason.contains(words),
            "{words:?} in {}",
            broken.failure_reason
        );
    }
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

    // kill -9 and restart on the same port, with other resource flags than the pod was made
    // with: the scheduler recovers the live lesson, and the agent adopts the pod as it is (a
    // pod's spec is immutable: applying the new limits over it would be refused, 422).
    env.agent.kill9().await;
    let mut args = env.agent_args.clone();
    args.extend(["--millicpus", "700", "--memory-mib", "200"].map(String::from));
    env.agent = Process::spawn_with_env(
        &workspace_bin("agent-k8s"),
        &args,
        &env.agent_env,
        env.dir.path().join("agent-k8s-restarted.log"),
    )
    .await
    .expect("agent-k8s restarts");
    let c = &env.scheduler.clients;
    let lesson = c.ready(&ready.id).await.unwrap();
    assert_eq!(lesson.status(), S::Ready, "{}", lesson.failure_reason);
    let after = pods.get("web").await.unwrap().metadata.uid;
    assert_eq!(before, after, "the pod was adopted, not recreated");
    let fresh = env.ready("sandboxed", 0).await;
    // Still READY after a whole new lesson went through the restarted agent.
    let still = c.ready(&ready.id).await.unwrap();
    assert_eq!(
        still.status(),
        S::Ready,
        "{}\n{}",
        still.failure_reason,
        env.logs()
    );
    let limits = env
        .namespaced::<Pod>(&fresh.id)
        .get("web")
        .await
        .unwrap()
        .spec
        .unwrap()
        .containers[0]
        .resources
        .clone()
        .unwrap()
        .limits
        .unwrap();
    assert_eq!(limits["cpu"].0, "700m", "new lessons get the new flags");

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
    // Restartable (`--restart-cmd`), with room for what the suite holds at once, so that the
    // restart and capacity checks run too.
    let mut args: Vec<String> = vec![
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--probe-timeout".into(),
        "60s".into(),
        "--max-live-lessons".into(),
        "3".into(),
    ];
    args.extend(LOCAL_IMAGES.iter().map(|a| a.to_string()));
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let entrypoint = format!("http://127.0.0.1:{port}");
    args.extend(
        [
            "--entrypoint-listen",
            &format!("127.0.0.1:{port}"),
            "--entrypoint-url",
            &entrypoint,
            "--entrypoint-insecure-plaintext",
            "--entrypoint-activity-interval",
            "500ms",
        ]
        .map(String::from),
    );
    let agent = Restartable::spawn(
        &workspace_bin("agent-k8s"),
        &args,
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
        .args(["--force-resync", "--entrypoint", &entrypoint])
        .output()
        .await
        .expect("antidote-conformance runs");
    let report = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && report.contains(" 0 failed"),
        "conformance failed ({}):\n{report}\n{}\n--- agent-k8s ---\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr),
        agent.log_text(),
    );
    // Plan names what a lesson is on this cluster: with Multus, the links too; shell
    // configurations as execs inside the pods, no Job.
    for kind in [
        "Exec",
        "Namespace",
        "NetworkAttachmentDefinition",
        "NetworkPolicy",
        "Pod",
        "Service",
    ] {
        assert!(
            report.contains(kind),
            "{kind} missing from the plan:\n{report}"
        );
    }
    for ran in [
        "restart-adopt",
        "capacity-refusal",
        "failed-probe",
        "failed-config",
        "watch-resync",
        "entrypoint-tokens",
        "entrypoint-activity",
        "checks-run",
        "checks-timeout",
        "checks-one-at-a-time",
        "checks-refusals",
    ] {
        assert!(report.contains(&format!("PASS  {ran}:")), "{report}");
    }
    // It offers `checks`, so the refusal of an agent without them is not its to show.
    assert!(report.contains("SKIP  checks-unimplemented:"), "{report}");
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

/// routing-basics, the example curriculum's lesson, on the real node: three pods joined by
/// Multus links (a bridge and an address pool per link of this live lesson), configured by its
/// shell scripts from inside each pod. Before stage 1 the client has no route to the server;
/// after it, the client fetches the server's page across the router. Checked from inside the
/// client pod, as the learner would.
#[tokio::test]
async fn k8s_routing_basics_routes_across_the_router_after_stage_one() {
    let env = K8sEnv::with_curriculum("k8s-routing", &[], &example_curriculum()).await;
    let ready = env.ready("routing-basics", 0).await;
    let id = ready.id.clone();
    let state = agent_state(&env, &id).await;
    assert!(
        state.conditions.iter().all(|c| c.reason != "MultusMissing"),
        "{:?}",
        state.conditions
    );
    let resource = ApiResource {
        group: "k8s.cni.cncf.io".into(),
        version: "v1".into(),
        api_version: "k8s.cni.cncf.io/v1".into(),
        kind: "NetworkAttachmentDefinition".into(),
        plural: "network-attachment-definitions".into(),
    };
    let attachments: Api<DynamicObject> =
        Api::namespaced_with(env.client.clone(), &format!("antidote-{id}"), &resource);
    let link = attachments.get("link-0-client-router").await.unwrap();
    let config: serde_json::Value =
        serde_json::from_str(link.data["spec"]["config"].as_str().unwrap()).unwrap();
    assert_eq!(config["type"], "bridge");
    assert!(
        config["bridge"].as_str().unwrap().starts_with("adl"),
        "{config}"
    );

    // Every link is there, with the addresses stage 0 gave it, on the image's interface names.
    let client_links = env.exec(&id, "client", "ip -4 addr show eth1").await;
    assert!(
        client_links.output.contains("10.10.1.10/24"),
        "{client_links:?}"
    );
    let router_links = env.exec(&id, "router", "ip -4 addr show").await;
    assert!(
        router_links.output.contains("10.10.1.1/24")
            && router_links.output.contains("10.10.2.1/24"),
        "{router_links:?}"
    );
    let pods: Api<Pod> = env.namespaced(&id);
    assert!(
        reaches(&pods, "client", "10.10.1.1:22").await,
        "the router, across link 0"
    );
    assert!(
        !reaches(&pods, "client", "10.10.2.10:8080").await,
        "stage 0 has no route to the server's network"
    );

    let c = &env.scheduler.clients;
    c.request(&ready.session_id, "routing-basics", 1)
        .await
        .unwrap();
    c.follow(&id, PATIENCE, |l| l.stage == 1 && l.status() == S::Ready)
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", env.logs()));
    let fetched = env
        .exec(
            &id,
            "client",
            "printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 3 10.10.2.10 8080",
        )
        .await;
    assert!(
        fetched.output.contains("Stage 1: routed"),
        "the client reaches the server through the router after stage 1: {fetched:?}\n{}",
        env.logs()
    );
    let route = env.exec(&id, "client", "ip route").await;
    assert!(
        route.output.contains("10.10.2.0/24 via 10.10.1.1"),
        "{route:?}"
    );
}

#[tokio::test]
async fn k8s_configuration_that_never_ends_is_killed_at_its_timeout() {
    let env = K8sEnv::start(
        "k8s-endless",
        &["--config-timeout", "2s", "--config-backoff-limit", "0"],
    )
    .await;
    let lesson = env.settled("endless-job", PATIENCE).await;
    assert_eq!(lesson.status(), S::Failed, "{}", env.logs());
    for words in [
        "configuration box.sh",
        "failed 1 times",
        "did not finish within 2s and was killed",
        "still configuring",
    ] {
        assert!(
            lesson.failure_reason.contains(words),
            "{words:?} in {}",
            lesson.failure_reason
        );
    }
    // Killed inside the pod, with what it started: no sleep of the script is left running.
    let left = env.exec(&lesson.id, "box", "ps -o pid,args").await;
    assert!(
        !left.output.contains("sleep 100000"),
        "the script's sleep still runs: {left:?}"
    );
}

/// Resources on a real scheduler: small requests let a three-endpoint lesson onto the 2-CPU
/// test node (with requests equal to a whole CPU each it never scheduled), and a lesson that
/// fits no node fails with the cluster scheduler's own words, not a guess.
#[tokio::test]
async fn k8s_requests_fit_a_small_node_and_an_unschedulable_pod_says_why() {
    let env = K8sEnv::start("k8s-fit", &[]).await;
    let three = env.ready("three-pods", 0).await;
    assert_eq!(three.endpoints.len(), 3);

    let greedy = K8sEnv::start(
        "k8s-greedy",
        &[
            "--millicpus",
            "64000",
            "--request-millicpus",
            "64000",
            "--probe-timeout",
            "20s",
        ],
    )
    .await;
    let failed = greedy.settled("sandboxed", PATIENCE).await;
    assert_eq!(failed.status(), S::Failed, "{}", greedy.logs());
    for words in ["pod `web` found no node within 20s", "Insufficient cpu"] {
        assert!(
            failed.failure_reason.contains(words),
            "{words:?} in {}",
            failed.failure_reason
        );
    }
}

/// Isolation, enforced by the node's NetworkPolicy enforcer: from a pod of lesson A, lesson B's
/// pods and Services, the API server (through the `kubernetes` Service and at its own address)
/// and the node's kubelet are out of reach, and no name resolves through the cluster DNS; A's
/// own endpoints stay reachable. An agent with `--allow-egress` lets its lessons out (the
/// node's API server answers them) but still keeps other lessons' pods closed. (The metadata address, closed even with egress allowed, has no
/// listener on this machine, so a check of it here could not fail: the policy's `except` is
/// checked in agent-k8s's unit tests.)
#[tokio::test]
async fn k8s_lessons_are_isolated_from_each_other_the_node_and_the_api_server() {
    let env = K8sEnv::start("k8s-isolation", &[]).await;
    let (a, b) = tokio::join!(env.ready("two-tier", 0), env.ready("two-tier", 0));
    let kubernetes: Api<Service> = Api::namespaced(env.client.clone(), "default");
    let kubernetes_ip = kubernetes
        .get("kubernetes")
        .await
        .unwrap()
        .spec
        .unwrap()
        .cluster_ip
        .unwrap();
    let b_web = presentation(&b, "web", "page").address.clone();
    let b_service = env
        .namespaced::<Service>(&b.id)
        .get("web")
        .await
        .unwrap()
        .spec
        .unwrap()
        .cluster_ip
        .unwrap();
    let a_pods: Api<Pod> = env.namespaced(&a.id);
    assert!(reaches(&a_pods, "web", "router:22").await, "A's own router");
    // The node: its address and kubelet port, and the API server's own address.
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(env.client.clone());
    let node = nodes
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .remove(0);
    let status = node.status.unwrap();
    let node_ip = status
        .addresses
        .unwrap_or_default()
        .into_iter()
        .find(|a| a.type_ == "InternalIP")
        .expect("the node has an InternalIP")
        .address;
    let kubelet_port = status
        .daemon_endpoints
        .unwrap()
        .kubelet_endpoint
        .unwrap()
        .port;
    let slices: Api<k8s_openapi::api::discovery::v1::EndpointSlice> =
        Api::namespaced(env.client.clone(), "default");
    let slice = slices
        .list(&kube::api::ListParams::default().labels("kubernetes.io/service-name=kubernetes"))
        .await
        .unwrap()
        .items
        .remove(0);
    let api_server = format!(
        "{}:{}",
        slice.endpoints.unwrap()[0].addresses[0],
        slice.ports.unwrap()[0].port.unwrap()
    );
    for (what, target) in [
        ("B's web pod", b_web.clone()),
        ("B's web Service", format!("{b_service}:8080")),
        ("the API server's Service", format!("{kubernetes_ip}:443")),
        ("the API server", api_server),
        ("the node's kubelet", format!("{node_ip}:{kubelet_port}")),
    ] {
        if !closed_within(&a_pods, "web", &target, ENFORCER_LAG).await {
            let pod = a_pods.get("web").await.unwrap();
            let ip = pod.status.and_then(|s| s.pod_ip).unwrap_or_default();
            panic!(
                "{what} ({target}) is still reachable from lesson A's pod {ip} {ENFORCER_LAG:?} after READY\n{}",
                enforcer_state(&ip)
            );
        }
    }
    // No DNS at all: the cluster DNS refuses nothing, the policy drops the query.
    let dns = env
        .exec(
            &a.id,
            "web",
            &format!(
                "nslookup -timeout=2 web.antidote-{}.svc.cluster.local 10.96.0.10 2>&1; echo rc=$?",
                b.id
            ),
        )
        .await;
    assert!(
        !dns.output.contains(&b_service),
        "lesson B's Service resolves from lesson A: {dns:?}"
    );

    // Egress allowed: out to the node (the API server answers), still not into lesson B.
    let open = K8sEnv::start("k8s-egress", &["--allow-egress"]).await;
    let c = open.ready("two-tier", 0).await;
    let c_pods: Api<Pod> = open.namespaced(&c.id);
    assert!(
        reaches(&c_pods, "web", &format!("{kubernetes_ip}:443")).await,
        "with --allow-egress the lesson reaches beyond itself\n{}",
        open.logs()
    );
    assert!(
        !reaches(&c_pods, "web", &b_web).await,
        "B stays closed to C"
    );
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

/// The directory of a pod's cgroup in the node's pids controller (cgroup v1's `pids`
/// hierarchy, or the unified one), found by the pod's uid under `kubepods`.
fn pod_pids_cgroup(uid: &str) -> PathBuf {
    let name = format!("pod{uid}");
    let roots = ["/sys/fs/cgroup/pids/kubepods", "/sys/fs/cgroup/kubepods"];
    for root in roots {
        let root = Path::new(root);
        let candidates = [
            root.join(&name),
            root.join("burstable").join(&name),
            root.join("besteffort").join(&name),
        ];
        if let Some(dir) = candidates
            .into_iter()
            .find(|d| d.join("pids.max").is_file())
        {
            return dir;
        }
    }
    panic!("no pids cgroup for pod {uid} under {roots:?}")
}

/// Forks the kernel refused at a pids limit in `cgroup` and the cgroups below it (the
/// containers': cgroup v1 counts a refusal where the forking task is).
fn forks_refused(cgroup: &Path) -> u64 {
    let here = std::fs::read_to_string(cgroup.join("pids.events"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("max "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0);
    let below: u64 = std::fs::read_dir(cgroup)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().is_dir())
        .map(|e| forks_refused(&e.path()))
        .sum();
    here + below
}

/// A fork bomb in one lesson stops at the node's pids limit (`podPidsLimit`, 512 on the test
/// node) under the pod's CPU limit: the pod never holds more than 512 processes and the kernel
/// refuses the bomb's forks, another lesson's pod on the same node still runs commands and
/// serves its page, and deleting the lesson ends every process of the bomb.
#[tokio::test]
async fn k8s_a_fork_bomb_stops_at_the_pods_pids_limit_and_spares_other_lessons() {
    let env = K8sEnv::start("k8s-forkbomb", &[]).await;
    let (bomb, other) = tokio::join!(env.ready("sandboxed", 0), env.ready("sandboxed", 0));
    // Should an assertion fail, the bomb must not outlive the test and slow every other one.
    struct Defuse(String);
    impl Drop for Defuse {
        fn drop(&mut self) {
            let _ = std::process::Command::new(crate::deploy::kubectl_binary())
                .args([
                    "delete",
                    "namespace",
                    &self.0,
                    "--wait=false",
                    "--ignore-not-found",
                ])
                .output();
        }
    }
    let _defuse = Defuse(format!("antidote-{}", bomb.id));
    let pod = env.namespaced::<Pod>(&bomb.id).get("web").await.unwrap();
    let cgroup = pod_pids_cgroup(&pod.metadata.uid.clone().unwrap());
    let read = |file: &str| {
        std::fs::read_to_string(cgroup.join(file))
            .unwrap_or_else(|e| panic!("{}: {e}", cgroup.join(file).display()))
            .trim()
            .to_owned()
    };
    assert_eq!(read("pids.max"), "512", "the pod's pids limit");
    assert_eq!(forks_refused(&cgroup), 0, "no fork refused yet");

    // The classic bomb, detached so that the exec returns at once.
    let started = env
        .exec(
            &bomb.id,
            "web",
            "(f() { f | f & }; f) </dev/null >/tmp/bomb.log 2>&1 & echo started",
        )
        .await;
    assert!(started.output.contains("started"), "{started:?}");
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while forks_refused(&cgroup) == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no fork was refused: pids.current {}",
            read("pids.current")
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let current: u64 = read("pids.current").parse().unwrap();
    assert!(
        current <= 512,
        "{current} processes in a pod limited to 512"
    );
    if cgroup.join("pids.peak").is_file() {
        let peak: u64 = read("pids.peak").parse().unwrap();
        assert!(
            peak <= 512,
            "{peak} processes at once in a pod limited to 512"
        );
    }

    // The other lesson, on the same node, is not starved.
    let alive = env.exec(&other.id, "web", "echo alive").await;
    assert_eq!((alive.code, alive.output.trim()), (0, "alive"), "{alive:?}");
    let served = page(presentation(&other, "web", "page"), "/").await;
    assert!(served.starts_with("HTTP/1."), "{served}");

    // Deleting the lesson ends the bomb: the pod's cgroup goes with its last process.
    let c = &env.scheduler.clients;
    c.delete(&bomb.id, PATIENCE)
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", env.logs()));
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while cgroup.exists() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} still exists after the lesson was deleted",
            cgroup.display()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    c.delete(&other.id, PATIENCE).await.unwrap();
}

/// Stage checks through the scheduler on agent-k8s, as a learner and an author meet them: the
/// gated stage's check runs inside the endpoint's pod and fails with the script's own message;
/// the stage's solution (AdminService.TestStage, what `antidotectl admin test-lesson` runs)
/// changes that pod, after which the check passes, the stage is among the live lesson's passed
/// stages and the live lesson is still READY at the same generation.
#[tokio::test]
async fn k8s_a_gated_stage_fails_its_check_then_passes_after_the_solution() {
    let env = K8sEnv::with_curriculum("k8s-checks-gate", &[], &checks::curriculum()).await;
    let live = env.ready("gated", 0).await;
    assert!(live.passed_stages.is_empty() && live.last_check.is_none());
    let c = &env.scheduler.clients;

    let failed = checks::check_stage(c, &live.id)
        .await
        .unwrap_or_else(|e| panic!("{e:?}\n{}", env.logs()));
    assert!(!failed.passed, "{failed:?}");
    let feedback = &failed.endpoints[0];
    assert_eq!(
        (feedback.endpoint.as_str(), feedback.file_name.as_str()),
        ("box", "box.sh")
    );
    assert!(!feedback.passed && feedback.exit_code == 1 && !feedback.timed_out);
    assert_eq!(
        feedback.feedback,
        "/tmp/done is missing: run touch /tmp/done on the box tab\n"
    );

    let solution = checks::run_solutions(c, &live.id).await.unwrap();
    assert!(solution.passed, "{solution:?}\n{}", env.logs());
    // The solution ran in the endpoint's own container.
    let made = env.exec(&live.id, "box", "ls /tmp/done").await;
    assert_eq!(made.code, 0, "{made:?}");

    let passed = checks::check_stage(c, &live.id).await.unwrap();
    assert!(passed.passed, "{passed:?}");
    assert_eq!(passed.endpoints[0].feedback, "found /tmp/done\n");
    let shown = c.get(&live.id).await.unwrap();
    assert_eq!(shown.passed_stages, [0]);
    assert!(
        shown
            .last_check
            .as_ref()
            .is_some_and(|l| l.passed && l.stage == 0)
    );
    assert_eq!(
        (shown.status(), shown.generation),
        (S::Ready, live.generation),
        "a check changes no live lesson"
    );
    env.delete_all(&[&live.id]).await;
}

/// A check still running at the lesson's checkTimeout is killed inside its pod with everything
/// it started (no `sleep` of it is left in the container), and one printing 100 MB answers the
/// end of what it wrote, within the protocol's 16 KiB.
#[tokio::test]
async fn k8s_a_check_that_never_ends_is_killed_in_its_pod_and_a_loud_one_is_cut() {
    let env = K8sEnv::with_curriculum("k8s-checks-bounded", &[], &checks::curriculum()).await;
    let live = env.ready("bounded", 0).await;
    let c = &env.scheduler.clients;
    let answer = checks::check_stage(c, &live.id)
        .await
        .unwrap_or_else(|e| panic!("{e:?}\n{}", env.logs()));
    assert!(!answer.passed);
    let hanging = &answer.endpoints[0];
    assert_eq!(hanging.endpoint, "hanging");
    assert!(hanging.timed_out && !hanging.passed, "{hanging:?}");
    assert!(
        hanging
            .feedback
            .contains("waiting for something that never comes"),
        "{}",
        hanging.feedback
    );
    let left = env.exec(&live.id, "hanging", "ps -o pid,args").await;
    assert!(
        !left.output.contains("sleep 100000"),
        "the check's sleep still runs in its pod: {left:?}"
    );
    let loud = &answer.endpoints[1];
    assert_eq!(
        (loud.endpoint.as_str(), loud.exit_code),
        ("loud", 1),
        "{loud:?}"
    );
    assert!(
        loud.truncated && loud.feedback.len() <= 16 * 1024,
        "{loud:?}"
    );
    assert!(loud.feedback.ends_with("the last line of a long answer\n"));
    env.delete_all(&[&live.id]).await;
}

/// A python check file on agent-k8s (RunChecks, as the scheduler sends it): it runs in the
/// configurator pod started for the run, logs in to the endpoint by its name over SSH with the
/// image's configuration credentials and reads what a shell solution file, run inside the
/// endpoint's own container, left there. The run's configurator pod is gone after each run,
/// and the password is never in what the files answer. A run whose call is cancelled (its
/// client went away) leaves nothing running either: not the shell file's `sleep` in the
/// endpoint's container, nor the python file's configurator pod.
#[tokio::test]
async fn k8s_a_python_check_logs_in_from_the_configurator_and_a_cancelled_run_leaves_nothing() {
    use antidote_proto::agent::v1 as proto;
    use antidote_proto::labels;
    let dir = tempfile::tempdir().unwrap();
    let admin_client = admin().await;
    let kubeconfig = agent_kubeconfig(&admin_client, dir.path()).await;
    let (agent, _, _) = agent_k8s(
        dir.path(),
        &kubeconfig,
        &["--configurator-image", "antidote/configurator:latest"],
    )
    .await;
    let instance = format!(
        "k8s-python-check-{}",
        &uuid::Uuid::new_v4().to_string()[..8]
    );
    let _leftovers = Leftovers(instance.clone());
    let mut client = proto::backend_client::BackendClient::connect(agent.url())
        .await
        .unwrap();
    client
        .handshake(proto::HandshakeRequest {
            supported_majors: vec![1],
            scheduler_instance_id: instance.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    let id = uuid::Uuid::new_v4().to_string();
    let password = "antidotepassword";
    let spec = proto::LessonSpec {
        live_lesson_id: id.clone(),
        session_id: "python-check".into(),
        lesson_slug: "python-check".into(),
        generation: 1,
        endpoints: vec![proto::Endpoint {
            name: "box".into(),
            image: Some(proto::Image {
                slug: "sshd".into(),
                flavor: proto::Flavor::Untrusted as i32,
                config_user: "antidote".into(),
                config_password: password.into(),
                ..Default::default()
            }),
            presentations: vec![proto::Presentation {
                name: "cli".into(),
                r#type: proto::PresentationType::Ssh as i32,
                port: 22,
            }],
            ..Default::default()
        }],
        labels: [
            (labels::INSTANCE, instance.as_str()),
            (labels::LIVE_LESSON, id.as_str()),
            (labels::SESSION, "python-check"),
            (labels::GENERATION, "1"),
            (labels::LESSON, "python-check"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect(),
        ..Default::default()
    };
    client
        .provision(proto::ProvisionRequest {
            spec: Some(spec),
            new_live_lesson: true,
        })
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let state = client
            .get(proto::GetRequest {
                live_lesson_id: id.clone(),
            })
            .await
            .unwrap()
            .into_inner()
            .state
            .unwrap();
        match state.phase() {
            proto::Phase::Ready => break,
            proto::Phase::Failed => panic!("{state:?}\n{}", agent.log_text()),
            _ if tokio::time::Instant::now() > deadline => {
                panic!("not READY: {state:?}\n{}", agent.log_text())
            }
            _ => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    }
    let check =
        |kind: proto::ConfigurationType, name: &str, contents: &str| proto::RunChecksRequest {
            live_lesson_id: id.clone(),
            generation: 1,
            files: vec![proto::CheckFile {
                endpoint: "box".into(),
                r#type: kind as i32,
                file_name: name.into(),
                contents: contents.as_bytes().to_vec(),
            }],
            timeout: Some(prost_types::Duration {
                seconds: 60,
                nanos: 0,
            }),
        };
    let python = r#"import os
import paramiko

client = paramiko.SSHClient()
client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
client.connect(os.environ["ANTIDOTE_HOST"], port=22, username=os.environ["ANTIDOTE_CONFIG_USER"],
               password=os.environ["ANTIDOTE_CONFIG_PASSWORD"], look_for_keys=False,
               allow_agent=False, timeout=30)
_, out, err = client.exec_command("id -un; cat /tmp/answer")
status = out.channel.recv_exit_status()
print(out.read().decode() + err.read().decode(), end="")
raise SystemExit(status)
"#;
    let checks_pods = || async {
        let pods: Api<Pod> = Api::namespaced(admin_client.clone(), &format!("antidote-{id}"));
        pods.list(&ListParams::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .filter_map(|p| p.metadata.name)
            .filter(|n| n.starts_with("checks-"))
            .collect::<Vec<_>>()
    };
    let mut answers = Vec::new();
    for (kind, name, contents) in [
        (proto::ConfigurationType::Python, "box.py", python),
        (
            proto::ConfigurationType::Shell,
            "box.sh",
            "echo 42 > /tmp/answer\nchmod 644 /tmp/answer\n",
        ),
        (proto::ConfigurationType::Python, "box.py", python),
    ] {
        let answer = client
            .run_checks(check(kind, name, contents))
            .await
            .unwrap_or_else(|e| panic!("{e:?}\n{}", agent.log_text()))
            .into_inner()
            .results
            .remove(0);
        assert!(answer.error.is_empty(), "{answer:?}\n{}", agent.log_text());
        assert!(!answer.output.contains(password), "{answer:?}");
        // The run's configurator pod went with the run.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while !checks_pods().await.is_empty() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{:?} left",
                checks_pods().await
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        answers.push(answer);
    }
    let before = &answers[0];
    assert!(before.exited && before.exit_code == 1, "{before:?}");
    assert!(
        before.output.starts_with("antidote\n") && before.output.contains("/tmp/answer"),
        "logged in as the configuration user, found no answer yet: {before:?}"
    );
    assert!(
        answers[1].exited && answers[1].exit_code == 0,
        "{:?}",
        answers[1]
    );
    let after = &answers[2];
    assert!(after.exited && after.exit_code == 0, "{after:?}");
    assert_eq!(after.output, "antidote\n42\n");

    for (kind, name, contents) in [
        (
            proto::ConfigurationType::Shell,
            "box.sh",
            "echo started; sleep 4321\n",
        ),
        (
            proto::ConfigurationType::Python,
            "box.py",
            "import time\ntime.sleep(4321)\n",
        ),
    ] {
        // The previous run's cancellation may not have reached the agent yet (CHECKS_RUNNING).
        loop {
            let call = client.run_checks(check(kind, name, contents));
            match tokio::time::timeout(Duration::from_secs(5), call).await {
                Err(_) => break,
                Ok(Err(status)) if status.code() == tonic::Code::Aborted => {
                    tokio::time::sleep(Duration::from_millis(200)).await
                }
                Ok(answer) => panic!("{name} was not cancelled: {answer:?}"),
            }
        }
    }
    let processes = "for p in /proc/[0-9]*; do tr '\\0' ' ' <$p/cmdline; echo; done\n";
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let call = client.run_checks(check(proto::ConfigurationType::Shell, "ps.sh", processes));
        let left = match call.await {
            Ok(answer) => answer.into_inner().results.remove(0).output,
            // Still ending the cancelled run.
            Err(status) if status.code() == tonic::Code::Aborted => "(busy)".into(),
            Err(status) => panic!("{status:?}"),
        };
        let pods = checks_pods().await;
        if !left.contains("sleep 4321") && !left.contains("(busy)") && pods.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "left after a cancelled run: {pods:?}\n{left}\n{}",
            agent.log_text()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    client
        .deprovision(proto::DeprovisionRequest {
            live_lesson_id: id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
}
