//! `deploy/k8s` deployed for real on the test node (`tests/k8s/cluster.sh`, KUBECONFIG from
//! `tests/run`): the image of deploy/Dockerfile's runtime stage, built from the workspace's
//! binaries by `tests/k8s/antidote-image.sh` and imported into the node (no registry), runs the
//! scheduler and agent-k8s as the manifests say, with the Secrets made by the very commands
//! deploy/k8s/kustomization.yaml documents. A learner outside the cluster (this process, on the
//! node's host network, through the Services' ClusterIPs and kube-proxy) opens a session, starts
//! routing-basics and reads the server's page through agent-k8s's entrypoint Service, as an
//! ingress controller would forward it (there is no ingress controller on the test node: the
//! manifests' Ingress is stored but serves nothing). The `postgres-ha` component runs three
//! scheduler replicas on a PostgreSQL server of this test's own, listening on the node's address
//! with a password; deleting one replica loses no lesson, and the others serve the API.
//!
//! The cluster is shared with the other tests. The deployments use instance ids of their own
//! (the lesson namespaces carry it as `antidote.io/instance`), run one at a time, and delete on
//! drop, pass or fail, everything they made: the manifests' objects in antidote-system, the
//! Secrets, the PersistentVolume, the lessons' namespaces. The antidote-system Namespace, the
//! agent's ServiceAccount and the cluster-wide RBAC and admission policies stay: `k8s.rs` applies
//! the same objects from the same file and runs its agents with that ServiceAccount's tokens at
//! the same time, so deleting them would pull them from under it.
//!
//! The image itself is checked against deploy/Dockerfile's last stage, file by file, so that
//! the script and the Dockerfile cannot drift apart.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use antidote_proto::api::v1 as api;
use antidote_tests::{Clients, presentation, with_token};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use crate::deploy::{documents, k8s_dir, kubectl, kubectl_binary, relative, repo, to_yaml};

const NAMESPACE: &str = "antidote-system";
const IMAGE: &str = "ghcr.io/antidote-labs/scheduler-svc:0.1.0";
/// Long enough for a busy 2-core machine to start pods and run a lesson's configurations.
const SLOW: Duration = Duration::from_secs(300);

/// The two deployments use the same object names in antidote-system: one at a time.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// kubectl, which must succeed; returns its output.
fn must(args: &[&str]) -> String {
    let (ok, text) = kubectl(args);
    assert!(ok, "{text}");
    text
}

/// What kubectl prints on stdout alone (for jsonpath queries).
fn query(args: &[&str]) -> String {
    let output = Command::new(kubectl_binary())
        .args(args)
        .output()
        .expect("kubectl runs");
    assert!(
        output.status.success(),
        "kubectl {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap().trim().to_owned()
}

/// The test node's facts (`$ANTIDOTE_K8S_STATE/node/env`, written by `cluster.sh start`).
fn node_env() -> BTreeMap<String, String> {
    let state = std::env::var("ANTIDOTE_K8S_STATE").unwrap_or_else(|_| "/tmp/antidote-k8s".into());
    let path = Path::new(&state).join("node/env");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|err| {
        panic!(
            "{}: {err}; the test node is not running (tests/k8s/cluster.sh start)",
            path.display()
        )
    });
    text.lines()
        .filter_map(|line| line.strip_prefix("export ").unwrap_or(line).split_once('='))
        .map(|(k, v)| (k.to_owned(), v.trim_matches(['"', '\'']).to_owned()))
        .collect()
}

/// Builds the deploy image if the binaries changed and imports it into the node.
fn image() {
    let script = repo().join("tests/k8s/antidote-image.sh");
    let output = Command::new(&script)
        .arg("--import")
        .output()
        .unwrap_or_else(|err| panic!("cannot run {}: {err}", script.display()));
    assert!(
        output.status.success(),
        "{} --import: {}\n{}",
        script.display(),
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Runs the commands of deploy/k8s/kustomization.yaml's header that make the Secrets (openssl,
/// then `kubectl create secret`), as written, in `dir`.
fn make_secrets_as_documented(dir: &Path) {
    let text = std::fs::read_to_string(k8s_dir().join("kustomization.yaml")).unwrap();
    let commands: Vec<&str> = text
        .lines()
        .filter_map(|line| line.strip_prefix("#   "))
        .skip_while(|line| !line.starts_with("openssl req -x509"))
        .collect();
    let last = commands
        .iter()
        .rposition(|line| line.contains("create secret"))
        .expect("kustomization.yaml documents `kubectl create secret`");
    let script = commands[..=last].join("\n");
    assert!(
        script.contains("scheduler-entrypoint-keys") && script.contains("agent-k8s-tls"),
        "the documented commands make every Secret:\n{script}"
    );
    let path = format!(
        "{}:{}",
        kubectl_binary().parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let output = Command::new("bash")
        .args(["-euo", "pipefail", "-c", &script])
        .current_dir(dir)
        .env("PATH", path)
        .output()
        .expect("bash runs");
    assert!(
        output.status.success(),
        "the Secrets, as kustomization.yaml says:\n{script}\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// One deployment of deploy/k8s through an overlay in a temporary directory; deletes what it
/// made when dropped.
struct Deployment {
    dir: tempfile::TempDir,
    /// The scheduler's instance_id: its lessons' namespaces carry it.
    instance: String,
    /// What the overlay renders: deleted on drop (but for the shared objects, see the file's
    /// doc).
    rendered: Vec<Value>,
    /// Secrets made here besides the manifests' objects.
    secrets: Vec<&'static str>,
}

impl Deployment {
    /// The overlay: deploy/k8s plus `components`, with these patches (each needed by the test
    /// node, not by a production cluster):
    /// - the scheduler's antidote.toml with an instance_id of this test's own, so that its
    ///   lessons' namespaces are told apart from those of the other tests sharing the cluster;
    /// - with the SQLite base, a PersistentVolume for the scheduler's claim: the test node runs
    ///   no storage provisioner (and so has no default StorageClass). A hostPath directory owned
    ///   by the image's user stands in for a provisioned disk (fsGroup cannot chown a hostPath);
    /// - with the node-gc component, a sweep every 2 s.
    fn apply(instance: &str, components: &[&str]) -> Deployment {
        let dir = tempfile::tempdir().unwrap();
        let here = dir.path().canonicalize().unwrap();
        let mut resources = vec![relative(&here, &k8s_dir()).display().to_string()];
        let scheduler = documents(&k8s_dir().join("scheduler.yaml"));
        let config = scheduler
            .iter()
            .find(|d| d["kind"] == "ConfigMap")
            .expect("scheduler.yaml's ConfigMap");
        let toml = config["data"]["antidote.toml"].as_str().unwrap();
        assert!(toml.contains("\ninstance_id = \"antidote\"\n"), "{toml}");
        let toml = toml.replace(
            "\ninstance_id = \"antidote\"\n",
            &format!("\ninstance_id = \"{instance}\"\n"),
        );
        let patch = json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": { "name": "scheduler-config", "namespace": NAMESPACE },
            "data": { "antidote.toml": toml },
        });
        std::fs::write(dir.path().join("scheduler-config.yaml"), to_yaml(&[patch])).unwrap();
        let sqlite = !components.contains(&"postgres-ha");
        if sqlite {
            let data = dir.path().join("scheduler-data");
            std::fs::create_dir(&data).unwrap();
            std::os::unix::fs::chown(&data, Some(10001), Some(10001)).unwrap();
            let volume = json!({
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": { "name": format!("{instance}-scheduler-data") },
                "spec": {
                    "capacity": { "storage": "1Gi" },
                    "accessModes": ["ReadWriteOnce"],
                    "persistentVolumeReclaimPolicy": "Retain",
                    "storageClassName": "",
                    "claimRef": { "namespace": NAMESPACE, "name": "scheduler-data" },
                    "hostPath": { "path": data.display().to_string(), "type": "Directory" },
                },
            });
            std::fs::write(dir.path().join("volume.yaml"), to_yaml(&[volume])).unwrap();
            resources.push("volume.yaml".into());
        }
        let mut kustomization = String::from(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n",
        );
        for resource in &resources {
            kustomization += &format!("  - {resource}\n");
        }
        if !components.is_empty() {
            kustomization += "components:\n";
            for component in components {
                kustomization += &format!(
                    "  - {}\n",
                    relative(&here, &k8s_dir().join(component)).display()
                );
            }
        }
        kustomization += "patches:\n  - path: scheduler-config.yaml\n";
        if components.contains(&"node-gc") {
            // Sweeps every 2 s rather than 30: the test waits for a removal, not for the pace.
            let patch = json!([{
                "op": "replace",
                "path": "/spec/template/spec/containers/0/args/0",
                "value": "--interval=2s",
            }]);
            std::fs::write(dir.path().join("node-gc-interval.json"), patch.to_string()).unwrap();
            kustomization += "  - path: node-gc-interval.json\n    target:\n      kind: DaemonSet\n      name: agent-k8s-node-gc\n";
        }
        std::fs::write(dir.path().join("kustomization.yaml"), kustomization).unwrap();

        let rendered_text = query(&["kustomize", &dir.path().display().to_string()]);
        let rendered = serde_yaml::Deserializer::from_str(&rendered_text)
            .map(|document| serde::Deserialize::deserialize(document).unwrap())
            .filter(|value: &Value| !value.is_null())
            .collect();
        let deployment = Deployment {
            dir,
            instance: instance.to_owned(),
            rendered,
            secrets: vec![
                "agent-k8s-tls",
                "scheduler-agent-client-tls",
                "scheduler-entrypoint-keys",
                "scheduler-database",
            ],
        };
        // What a failed earlier run may have left.
        deployment.clean();
        must(&["apply", "-k", &deployment.dir.path().display().to_string()]);
        deployment
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Waits until both Deployments have every replica ready; panics with the pods' state.
    fn ready(&self) {
        for deployment in ["agent-k8s", "scheduler-svc"] {
            let (ok, text) = kubectl(&[
                "-n",
                NAMESPACE,
                "rollout",
                "status",
                &format!("deployment/{deployment}"),
                &format!("--timeout={}s", SLOW.as_secs()),
            ]);
            assert!(ok, "{text}\n{}", self.diagnostics());
        }
    }

    /// The pods, their events and logs, for failure messages.
    fn diagnostics(&self) -> String {
        let mut out = kubectl(&["-n", NAMESPACE, "get", "pods,pvc,svc", "-o", "wide"]).1;
        out += &kubectl(&[
            "-n",
            NAMESPACE,
            "describe",
            "pods",
            "-l",
            "app.kubernetes.io/part-of=antidote",
        ])
        .1;
        for app in ["scheduler-svc", "agent-k8s"] {
            out += &kubectl(&[
                "-n",
                NAMESPACE,
                "logs",
                "-l",
                &format!("app.kubernetes.io/name={app}"),
                "--tail=60",
                "--prefix",
            ])
            .1;
        }
        out
    }

    /// A Service's ClusterIP address on `port`.
    fn service(&self, name: &str, port: u16) -> SocketAddr {
        let ip = query(&[
            "-n",
            NAMESPACE,
            "get",
            "service",
            name,
            "-o",
            "jsonpath={.spec.clusterIP}",
        ]);
        SocketAddr::new(
            ip.parse()
                .unwrap_or_else(|_| panic!("{name}'s ClusterIP: {ip:?}")),
            port,
        )
    }

    /// A learner's clients of the scheduler, through its Service (the admin listener is on no
    /// Service: these clients make no admin call).
    async fn learner(&self) -> Clients {
        let grpc = self.service("scheduler-svc", 7070);
        // A pod just turned ready is behind the Service once kube-proxy has synced its rules.
        let mut last = None;
        for _ in 0..60 {
            match Clients::connect(grpc, grpc).await {
                Ok(clients) => return clients,
                Err(err) => last = Some(err),
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        panic!(
            "the scheduler's Service at {grpc}: {:#}\n{}",
            last.unwrap(),
            self.diagnostics()
        )
    }

    /// Deletes everything the overlay made, but for the shared objects (the file's doc).
    fn clean(&self) {
        // The objects of the shared antidote-system Namespace's setup stay; a component's own
        // Namespace (node-gc's) goes, and everything in it.
        let shared = [
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
        ];
        let mut namespaced: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let mut cluster = Vec::new();
        for object in &self.rendered {
            let kind = object["kind"].as_str().unwrap_or_default();
            let name = object["metadata"]["name"].as_str().unwrap_or_default();
            if shared.contains(&kind) || (kind == "Namespace" && name == NAMESPACE) {
                continue;
            }
            let name = format!("{kind}/{name}");
            match object["metadata"]["namespace"].as_str() {
                Some(namespace) => namespaced.entry(namespace.into()).or_default().push(name),
                None => cluster.push(name),
            }
        }
        namespaced
            .entry(NAMESPACE.into())
            .or_default()
            .extend(self.secrets.iter().map(|s| format!("secret/{s}")));
        for (namespace, names) in &namespaced {
            let mut args = vec![
                "-n",
                namespace,
                "delete",
                "--ignore-not-found",
                "--wait=true",
                "--timeout=180s",
            ];
            args.extend(names.iter().map(String::as_str));
            let _ = kubectl(&args);
        }
        let _ = kubectl(&[
            "delete",
            "namespaces",
            "-l",
            &format!("antidote.io/instance={}", self.instance),
            "--ignore-not-found",
            "--wait=true",
            "--timeout=180s",
        ]);
        if !cluster.is_empty() {
            let mut args = vec![
                "delete",
                "--ignore-not-found",
                "--wait=true",
                "--timeout=60s",
            ];
            args.extend(cluster.iter().map(String::as_str));
            let _ = kubectl(&args);
        }
    }
}

impl Drop for Deployment {
    fn drop(&mut self) {
        self.clean();
    }
}

/// What an HTTP GET of `url` answers when sent to `entrypoint` (the entrypoint Service) with
/// the URL's host, as an ingress controller forwards a learner's request for that URL.
async fn through_the_entrypoint(entrypoint: SocketAddr, url: &str) -> (u16, String) {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(entrypoint).await.ok()?;
        let request = format!(
            "GET {path} HTTP/1.1\r\nHost: {authority}\r\nX-Forwarded-Proto: https\r\nConnection: close\r\n\r\n"
        );
        stream.write_all(request.as_bytes()).await.ok()?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await.ok()?;
        Some(String::from_utf8_lossy(&raw).into_owned())
    };
    let text = tokio::time::timeout(Duration::from_secs(30), exchange)
        .await
        .ok()
        .flatten()
        .unwrap_or_default();
    let status = text
        .lines()
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, text)
}

/// A live lesson followed until READY (or FAILED, which fails the test).
async fn ready(c: &Clients, id: &str, deployment: &Deployment) -> api::LiveLesson {
    let (_, lesson) = c
        .follow(id, SLOW, |l| {
            matches!(
                l.status(),
                api::LiveLessonStatus::Ready | api::LiveLessonStatus::Failed
            )
        })
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", deployment.diagnostics()));
    assert_eq!(
        lesson.status(),
        api::LiveLessonStatus::Ready,
        "{}: {}\n{}",
        id,
        lesson.failure_reason,
        deployment.diagnostics()
    );
    lesson
}

/// The live lesson as the scheduler has it now, with fresh presentation URLs.
async fn current(c: &Clients, id: &str, token: Option<String>) -> api::LiveLesson {
    c.lessons
        .clone()
        .get_live_lesson(with_token(
            api::GetLiveLessonRequest { id: id.into() },
            token,
        ))
        .await
        .unwrap_or_else(|status| panic!("GetLiveLesson {id}: {status}"))
        .into_inner()
}

/// The page of `endpoint`'s http presentation `name`, read through the entrypoint; asserts it
/// shows `want` (polling a little: the page is the one the stage's configuration wrote).
async fn page_shows(
    deployment: &Deployment,
    lesson: &api::LiveLesson,
    endpoint: &str,
    name: &str,
    want: &str,
) {
    let entrypoint = deployment.service("agent-k8s-entrypoint", 80);
    let url = presentation(lesson, endpoint, name).entrypoint_url.clone();
    assert!(
        !url.is_empty(),
        "{endpoint}/{name} has no entrypoint URL: {lesson:?}"
    );
    let mut last = (0, String::new());
    for _ in 0..30 {
        last = through_the_entrypoint(entrypoint, &url).await;
        if last.0 == 200 && last.1.contains(want) {
            return;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    panic!(
        "{url} through the entrypoint Service at {entrypoint}: {} {}\n{}",
        last.0,
        last.1,
        deployment.diagnostics()
    );
}

/// The base: the scheduler on SQLite (one replica) and agent-k8s, over mutual TLS, with the
/// node-gc component: the lesson's bridges and address pools stay on the node while it runs and
/// are gone once it is deleted.
#[tokio::test]
async fn k8s_deploy_base_runs_a_lesson_a_learner_reaches_through_the_entrypoint() {
    let _one = ONE_AT_A_TIME.lock().await;
    image();
    let deployment = Deployment::apply("k8s-deploy", &["node-gc"]);
    make_secrets_as_documented(deployment.path());
    deployment.ready();

    let c = deployment.learner().await;
    let session = c
        .session()
        .await
        .expect("a session through the scheduler's Service");
    let requested = c
        .request(&session, "routing-basics", 0)
        .await
        .unwrap_or_else(|status| panic!("{status}\n{}", deployment.diagnostics()));
    let lesson = ready(&c, &requested.id, &deployment).await;
    // The lesson runs in a namespace of its own, labelled with this deployment's instance.
    let namespaces = query(&[
        "get",
        "namespaces",
        "-l",
        &format!(
            "antidote.io/instance={},antidote.io/live-lesson={}",
            deployment.instance, lesson.id
        ),
        "-o",
        "name",
    ]);
    assert_eq!(namespaces, format!("namespace/antidote-{}", lesson.id));
    // Stage 0's configuration wrote the server's page; the learner reads it through the
    // entrypoint with the token the scheduler signed.
    page_shows(&deployment, &lesson, "server", "web", "server, 10.10.2.10").await;
    // Without the token the entrypoint admits nobody.
    let url = presentation(&lesson, "server", "web")
        .entrypoint_url
        .clone();
    let bare = url.split_once('?').map_or(url.as_str(), |(base, _)| base);
    let (status, text) =
        through_the_entrypoint(deployment.service("agent-k8s-entrypoint", 80), bare).await;
    assert_eq!(status, 401, "{text}");

    // The node keeps a bridge and an address pool per link while the lesson runs, through
    // sweeps of agent-k8s-node-gc; once the lesson is deleted, the sweeper removes them.
    let links = lesson_links(&lesson.id);
    assert_eq!(links.len(), 2, "routing-basics has two links: {links:?}");
    let (ok, text) = kubectl(&[
        "-n",
        "antidote-node",
        "rollout",
        "status",
        "daemonset/agent-k8s-node-gc",
        &format!("--timeout={}s", SLOW.as_secs()),
    ]);
    assert!(ok, "{text}\n{}", deployment.diagnostics());
    tokio::time::sleep(Duration::from_secs(6)).await; // three sweeps
    for (bridge, pool) in &links {
        assert!(
            bridge_exists(bridge),
            "{bridge} of a running lesson was removed"
        );
        assert!(
            pool.exists(),
            "{} of a running lesson was removed",
            pool.display()
        );
    }
    c.delete(&lesson.id, SLOW).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while links
        .iter()
        .any(|(bridge, pool)| bridge_exists(bridge) || pool.exists())
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the deleted lesson's bridges or pools are still on the node: {links:?}\n{}",
            query(&["-n", "antidote-node", "logs", "daemonset/agent-k8s-node-gc"])
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// A live lesson's links as the node has them: each NetworkAttachmentDefinition's bridge, and
/// its host-local pool directory (host-local's default data directory, as the test node's
/// networks leave it).
fn lesson_links(id: &str) -> Vec<(String, PathBuf)> {
    let list: Value = serde_json::from_str(&query(&[
        "-n",
        &format!("antidote-{id}"),
        "get",
        "network-attachment-definitions",
        "-o",
        "json",
    ]))
    .unwrap();
    let items = list["items"].as_array().cloned().unwrap_or_default();
    items
        .iter()
        .map(|nad| {
            let config: Value =
                serde_json::from_str(nad["spec"]["config"].as_str().unwrap()).unwrap();
            let bridge = config["bridge"].as_str().unwrap().to_owned();
            let network = config["name"].as_str().unwrap();
            (bridge, Path::new("/var/lib/cni/networks").join(network))
        })
        .collect()
}

fn bridge_exists(name: &str) -> bool {
    Path::new("/sys/class/net").join(name).exists()
}

/// A PostgreSQL server of this test's own, on the node's address so that pods reach it, with
/// password authentication; stopped and deleted on drop.
struct NodePostgres {
    dir: PathBuf,
    url: String,
}

impl NodePostgres {
    fn start(node_ip: &str, pod_cidr: &str) -> NodePostgres {
        let bin = Path::new("/usr/lib/postgresql/15/bin");
        if !bin.join("initdb").exists() {
            // tests/postgres/pg.sh installs Debian's postgresql-15.
            crate::postgres::server();
        }
        let dir = PathBuf::from(format!(
            "/tmp/antidote-pg-k8s-deploy-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir(&dir).unwrap();
        let password = uuid::Uuid::new_v4().simple().to_string();
        std::fs::write(dir.join("pw"), &password).unwrap();
        let port = {
            let listener =
                std::net::TcpListener::bind((node_ip, 0)).expect("a port on the node's address");
            listener.local_addr().unwrap().port()
        };
        let server = NodePostgres {
            url: format!(
                "postgres://antidote:{password}@{node_ip}:{port}/antidote?sslmode=disable"
            ),
            dir,
        };
        let run = |program: &str, args: &[&str]| {
            let output = Command::new("runuser")
                .args(["-u", "postgres", "--"])
                .arg(bin.join(program))
                .args(args)
                .output()
                .expect("runuser runs");
            assert!(
                output.status.success(),
                "{program} {args:?}: {}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
        };
        let status = Command::new("chown")
            .args(["-R", "postgres:"])
            .arg(&server.dir)
            .status()
            .unwrap();
        assert!(status.success());
        let data = server.dir.join("data").display().to_string();
        let sock = server.dir.display().to_string();
        run(
            "initdb",
            &[
                "-D",
                &data,
                "--username=postgres",
                "--auth-local=trust",
                "--auth-host=scram-sha-256",
                &format!("--pwfile={}/pw", sock),
                "--encoding=UTF8",
                "--no-sync",
            ],
        );
        let hba = server.dir.join("data/pg_hba.conf");
        let mut rules = std::fs::read_to_string(&hba).unwrap();
        rules += &format!(
            "host all all {pod_cidr} scram-sha-256\nhost all all {node_ip}/32 scram-sha-256\n"
        );
        std::fs::write(&hba, rules).unwrap();
        run(
            "pg_ctl",
            &[
                "-D",
                &data,
                "-l",
                &format!("{sock}/postgres.log"),
                "-w",
                "-t",
                "60",
                "-o",
                &format!("-p {port} -k {sock} -c listen_addresses={node_ip}"),
                "start",
            ],
        );
        for sql in [
            format!("CREATE ROLE antidote LOGIN PASSWORD '{password}'"),
            "CREATE DATABASE antidote OWNER antidote".to_owned(),
        ] {
            run(
                "psql",
                &[
                    "-h",
                    &sock,
                    "-p",
                    &port.to_string(),
                    "-U",
                    "postgres",
                    "-v",
                    "ON_ERROR_STOP=1",
                    "-q",
                    "-c",
                    &sql,
                ],
            );
        }
        server
    }
}

impl Drop for NodePostgres {
    fn drop(&mut self) {
        let _ = Command::new("runuser")
            .args([
                "-u",
                "postgres",
                "--",
                "/usr/lib/postgresql/15/bin/pg_ctl",
                "-D",
            ])
            .arg(self.dir.join("data"))
            .args(["-m", "immediate", "-w", "stop"])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The `postgres-ha` component: three scheduler replicas on PostgreSQL; one is deleted and no
/// lesson is lost.
#[tokio::test]
async fn k8s_deploy_postgres_ha_keeps_every_lesson_when_a_replica_goes() {
    let _one = ONE_AT_A_TIME.lock().await;
    image();
    let node = node_env();
    let postgres = NodePostgres::start(&node["NODE_IP"], &node["CLUSTER_CIDR"]);
    let deployment = Deployment::apply("k8s-deploy-ha", &["postgres-ha"]);
    make_secrets_as_documented(deployment.path());
    // postgres-ha/kustomization.yaml's command, with this server's URL (no TLS: the test server
    // has no certificate; production URLs ask for sslmode=verify-full).
    must(&[
        "-n",
        NAMESPACE,
        "create",
        "secret",
        "generic",
        "scheduler-database",
        &format!("--from-literal=url={}", postgres.url),
    ]);
    deployment.ready();
    let replicas = query(&[
        "-n",
        NAMESPACE,
        "get",
        "deployment",
        "scheduler-svc",
        "-o",
        "jsonpath={.status.readyReplicas}",
    ]);
    assert_eq!(replicas, "3", "{}", deployment.diagnostics());

    let c = deployment.learner().await;
    let session = c
        .session()
        .await
        .expect("a session through the scheduler's Service");
    let mut lessons = Vec::new();
    for (slug, endpoint, name, want) in [
        ("routing-basics", "server", "web", "server, 10.10.2.10"),
        ("hello-web", "web", "page", "Hello from Antidote"),
    ] {
        let requested = c
            .request(&session, slug, 0)
            .await
            .unwrap_or_else(|status| panic!("{slug}: {status}\n{}", deployment.diagnostics()));
        let lesson = ready(&c, &requested.id, &deployment).await;
        page_shows(&deployment, &lesson, endpoint, name, want).await;
        lessons.push((lesson.id.clone(), endpoint, name, want));
    }

    // One replica goes (as a node drain or a rollout takes it); the Deployment replaces it.
    let pods = query(&[
        "-n",
        NAMESPACE,
        "get",
        "pods",
        "-l",
        "app.kubernetes.io/name=scheduler-svc",
        "-o",
        "jsonpath={.items[*].metadata.name}",
    ]);
    let gone = pods
        .split_whitespace()
        .next()
        .expect("a scheduler pod")
        .to_owned();
    must(&[
        "-n",
        NAMESPACE,
        "delete",
        "pod",
        &gone,
        "--wait=true",
        "--timeout=120s",
    ]);
    let left = query(&[
        "-n",
        NAMESPACE,
        "get",
        "pods",
        "-l",
        "app.kubernetes.io/name=scheduler-svc",
        "-o",
        "jsonpath={.items[*].metadata.name}",
    ]);
    assert!(
        !left.split_whitespace().any(|p| p == gone),
        "{gone} still there: {left}"
    );

    // The other replicas serve the API (a new connection, and new sessions' writes), and every
    // lesson is still READY and reachable with fresh URLs.
    let c2 = deployment.learner().await;
    let session2 = c2
        .session()
        .await
        .expect("a session after the replica went");
    assert_ne!(session2, session);
    for (id, endpoint, name, want) in &lessons {
        let lesson = current(&c2, id, c.tokens.of_lesson(id)).await;
        assert_eq!(
            lesson.status(),
            api::LiveLessonStatus::Ready,
            "{id} after {gone} went: {lesson:?}\n{}",
            deployment.diagnostics()
        );
        page_shows(&deployment, &lesson, endpoint, name, want).await;
    }
    let namespaces = query(&[
        "get",
        "namespaces",
        "-l",
        &format!("antidote.io/instance={}", deployment.instance),
        "-o",
        "name",
    ]);
    let namespaces: BTreeSet<&str> = namespaces.lines().collect();
    let expected: BTreeSet<String> = lessons
        .iter()
        .map(|(id, ..)| format!("namespace/antidote-{id}"))
        .collect();
    assert_eq!(
        namespaces,
        expected.iter().map(String::as_str).collect::<BTreeSet<_>>()
    );
    // And the Deployment is back at three ready replicas.
    deployment.ready();
    drop(deployment);
    drop(postgres);
}

/// deploy/Dockerfile's instructions, comments dropped and continued lines joined, by stage.
fn dockerfile_stages() -> Vec<Vec<String>> {
    let text = std::fs::read_to_string(repo().join("deploy/Dockerfile")).unwrap();
    let mut stages: Vec<Vec<String>> = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('#') || (line.is_empty() && current.is_empty()) {
            continue;
        }
        match line.strip_suffix('\\') {
            Some(head) => {
                current += head;
                current.push(' ');
            }
            None => {
                current += line;
                let instruction = std::mem::take(&mut current);
                if instruction.starts_with("FROM ") {
                    stages.push(Vec::new());
                }
                stages
                    .last_mut()
                    .expect("the Dockerfile starts with FROM")
                    .push(instruction);
            }
        }
    }
    stages
}

/// The value after `flag` among `words`.
fn flag<'a>(words: &[&'a str], flag: &str) -> &'a str {
    let at = words.iter().position(|w| *w == flag);
    words[at.unwrap_or_else(|| panic!("{flag} in {words:?}")) + 1]
}

/// The image tests/k8s/antidote-image.sh builds has deploy/Dockerfile's runtime stage, checked
/// in the exported filesystem and the image's configuration: the binaries the build stage
/// builds where the stage copies them, the curriculum, the user and group with their ids, home
/// and shell, the directories and their owners, the CA bundle, USER, WORKDIR, EXPOSE and CMD.
#[test]
fn deploy_image_has_the_dockerfile_runtime_stage() {
    image();
    let stages = dockerfile_stages();
    let (runtime, build) = stages.split_last().expect("stages");
    let binaries: Vec<&str> = build
        .iter()
        .flatten()
        .flat_map(|i| {
            let words: Vec<&str> = i.split_whitespace().collect();
            words
                .windows(2)
                .filter(|w| w[0] == "--bin")
                .map(|w| w[1])
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(binaries.len(), 5, "{build:?}");

    let inspect = Command::new("docker")
        .args(["image", "inspect", IMAGE])
        .output()
        .expect("docker runs");
    assert!(
        inspect.status.success(),
        "{}",
        String::from_utf8_lossy(&inspect.stderr)
    );
    let inspect: Value = serde_json::from_slice(&inspect.stdout).unwrap();
    let config = &inspect[0]["Config"];

    let dir = tempfile::tempdir().unwrap();
    let export = dir.path().join("image.tar");
    let docker = |args: &[&str]| {
        let output = Command::new("docker")
            .args(args)
            .output()
            .expect("docker runs");
        assert!(
            output.status.success(),
            "docker {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8(output.stdout).unwrap().trim().to_owned()
    };
    let container = docker(&["create", IMAGE]);
    let exported = Command::new("docker")
        .args(["export", "-o", &export.display().to_string(), &container])
        .status();
    docker(&["rm", &container]);
    assert!(exported.expect("docker runs").success(), "docker export");
    let listing = Command::new("tar")
        .args(["--numeric-owner", "-tvf"])
        .arg(&export)
        .output()
        .expect("tar runs");
    assert!(listing.status.success());
    // path (without a trailing /) -> (mode string, "uid/gid")
    let files: BTreeMap<String, (String, String)> = String::from_utf8_lossy(&listing.stdout)
        .lines()
        .filter_map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            let name = words.get(5..)?.join(" ");
            let name = name.split(" -> ").next()?.trim_end_matches('/').to_owned();
            Some((
                format!("/{name}"),
                (words[0].to_owned(), words[1].to_owned()),
            ))
        })
        .collect();
    let read = |path: &str| {
        let output = Command::new("tar")
            .args(["-xOf"])
            .arg(&export)
            .arg(path.trim_start_matches('/'))
            .output()
            .expect("tar runs");
        assert!(output.status.success(), "{path} in the image");
        String::from_utf8(output.stdout).unwrap()
    };

    let mut checked = BTreeSet::new();
    for instruction in runtime {
        let (keyword, rest) = instruction.split_once(' ').unwrap_or((instruction, ""));
        checked.insert(keyword.to_owned());
        match keyword {
            "FROM" => assert!(rest.starts_with("debian:bookworm"), "{rest}"),
            "USER" => assert_eq!(config["User"], rest, "USER"),
            "WORKDIR" => assert_eq!(config["WorkingDir"], rest, "WORKDIR"),
            "CMD" => {
                let cmd: Value = serde_json::from_str(rest).unwrap();
                assert_eq!(config["Cmd"], cmd, "CMD");
            }
            "EXPOSE" => {
                let want: BTreeSet<String> = rest
                    .split_whitespace()
                    .map(|p| format!("{p}/tcp"))
                    .collect();
                let have: BTreeSet<String> = config["ExposedPorts"]
                    .as_object()
                    .map(|ports| ports.keys().cloned().collect())
                    .unwrap_or_default();
                assert_eq!(have, want, "EXPOSE");
            }
            "RUN" => {
                for command in rest.split("&&") {
                    let words: Vec<&str> = command.split_whitespace().collect();
                    match words.first().copied() {
                        Some("groupadd") => {
                            let (gid, name) = (flag(&words, "--gid"), words[words.len() - 1]);
                            assert!(
                                read("/etc/group")
                                    .lines()
                                    .any(|l| l.starts_with(&format!("{name}:x:{gid}:"))),
                                "group {name} {gid}: {}",
                                read("/etc/group")
                            );
                        }
                        Some("useradd") => {
                            let want = format!(
                                "{}:x:{}:{}::{}:{}",
                                words[words.len() - 1],
                                flag(&words, "--uid"),
                                flag(&words, "--gid"),
                                flag(&words, "--home-dir"),
                                flag(&words, "--shell"),
                            );
                            assert!(
                                read("/etc/passwd").lines().any(|l| l == want),
                                "{want} in {}",
                                read("/etc/passwd")
                            );
                        }
                        Some("mkdir") => {
                            for path in words.iter().skip(1).filter(|w| !w.starts_with('-')) {
                                let (mode, _) = files
                                    .get(*path)
                                    .unwrap_or_else(|| panic!("{path} in the image"));
                                assert!(mode.starts_with('d'), "{path} is a directory: {mode}");
                            }
                        }
                        Some("chown") => {
                            let (owner, path) = (words[1].replace(':', "/"), words[2]);
                            assert_eq!(
                                files.get(path).map(|f| f.1.as_str()),
                                Some(owner.as_str()),
                                "chown {path}"
                            );
                        }
                        Some("apt-get") if words.contains(&"install") => {
                            assert!(words.contains(&"ca-certificates"), "{command}");
                            assert!(
                                read("/etc/ssl/certs/ca-certificates.crt")
                                    .contains("BEGIN CERTIFICATE"),
                                "the CA bundle"
                            );
                        }
                        _ => {}
                    }
                }
            }
            "COPY" => {
                let words: Vec<&str> = rest.split_whitespace().collect();
                let dest = words[words.len() - 1].trim_end_matches('/');
                if words[0] == "--from=build" {
                    for bin in &binaries {
                        let path = format!("{dest}/{bin}");
                        let (mode, _) = files
                            .get(&path)
                            .unwrap_or_else(|| panic!("{path} in the image"));
                        assert!(mode.starts_with("-rwx"), "{path}: {mode}");
                    }
                } else {
                    assert_eq!(words[0], "deploy/curriculum", "{instruction}");
                    let source = repo().join("deploy/curriculum");
                    let mut want = BTreeSet::new();
                    let mut stack = vec![source.clone()];
                    while let Some(dir) = stack.pop() {
                        for entry in std::fs::read_dir(&dir).unwrap() {
                            let path = entry.unwrap().path();
                            if path
                                .file_name()
                                .is_some_and(|n| n == "__pycache__" || n == ".venv")
                            {
                                continue;
                            }
                            if path.is_dir() {
                                stack.push(path);
                            } else {
                                want.insert(format!(
                                    "{dest}/{}",
                                    path.strip_prefix(&source).unwrap().display()
                                ));
                            }
                        }
                    }
                    let have: BTreeSet<String> = files
                        .iter()
                        .filter(|(path, (mode, _))| {
                            path.starts_with(&format!("{dest}/")) && mode.starts_with('-')
                        })
                        .map(|(path, _)| path.clone())
                        .collect();
                    assert_eq!(have, want, "the curriculum at {dest}");
                    let meta = "curriculum.meta.yaml";
                    assert_eq!(
                        read(&format!("{dest}/{meta}")),
                        std::fs::read_to_string(source.join(meta)).unwrap()
                    );
                }
            }
            _ => {}
        }
    }
    for keyword in ["USER", "WORKDIR", "CMD", "EXPOSE", "RUN", "COPY"] {
        assert!(
            checked.contains(keyword),
            "the runtime stage has no {keyword}: {runtime:?}"
        );
    }
}

/// The `ANTIDOTE_*` names in `text` (set or mentioned), without prose prefixes such as
/// `ANTIDOTE_AGENT_TLS_*`.
fn variables(text: &str) -> BTreeSet<String> {
    text.match_indices("ANTIDOTE_")
        .map(|(at, _)| {
            text[at..]
                .chars()
                .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                .collect::<String>()
        })
        .filter(|name| !name.ends_with('_'))
        .collect()
}

/// Every agent-k8s variable the manifests set or mention (agent-k8s.yaml and the mesh
/// components' agent patch) is one the agent reads: a removed or renamed flag would otherwise
/// be ignored in silence.
#[test]
fn agent_k8s_manifests_name_only_variables_the_agent_reads() {
    let mut known = BTreeSet::new();
    let mut sources = vec![repo().join("agent-k8s/src/settings.rs")];
    let mut dirs = vec![repo().join("proto/sdk/src"), repo().join("proto/net/src")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                sources.push(path);
            }
        }
    }
    for source in &sources {
        let text = std::fs::read_to_string(source).unwrap();
        // `#[arg(env = "…")]`, and `mut_arg(…, |a| a.env("…"))` for the SDK's own flags.
        for pattern in ["env = \"", ".env(\""] {
            for (at, _) in text.match_indices(pattern) {
                let rest = &text[at + pattern.len()..];
                known.insert(rest[..rest.find('"').unwrap()].to_owned());
            }
        }
    }
    assert!(known.contains("ANTIDOTE_K8S_LISTEN"), "{known:?}");
    for manifest in ["agent-k8s.yaml", "mesh/common/agent-k8s-plaintext.yaml"] {
        let text = std::fs::read_to_string(k8s_dir().join(manifest)).unwrap();
        let unknown: Vec<String> = variables(&text)
            .into_iter()
            .filter(|name| !known.contains(name))
            .collect();
        assert!(
            unknown.is_empty(),
            "deploy/k8s/{manifest} names {unknown:?}, which agent-k8s does not read"
        );
    }
}
