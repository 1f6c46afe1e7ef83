//! The deployment files in `deploy/`. Every Kubernetes manifest in `deploy/k8s`, one file at a
//! time and through its kustomization, must pass `kubectl apply --dry-run=server` against the
//! test kube-apiserver (`tests/k8s/controlplane.sh`, KUBECONFIG exported by `tests/run`) with
//! strict field validation and every server warning an error, in a namespace that warns about
//! anything the `restricted` Pod Security profile forbids. Deliberately broken copies go through
//! the same check and must be refused, which proves it can fail. The scheduler configurations
//! shipped with the manifests and with `deploy/compose` must start the real scheduler. No
//! deployment runs lessons privileged unless the operator opts in.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use antidote_tests::{Process, example_curriculum, workspace_bin};
use serde_json::{Value, json};

pub(super) fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .unwrap()
}

pub(super) fn k8s_dir() -> PathBuf {
    repo().join("deploy/k8s")
}

/// The kubectl that `tests/k8s/controlplane.sh` builds next to the control plane: in its cache
/// (`ANTIDOTE_K8S_CACHE`, default `~/.cache/antidote/k8s`), under the Kubernetes version the
/// script pins, read from the script so that a version bump there needs nothing here. A kubectl
/// found on PATH may be several minor versions away from the server.
pub(super) fn kubectl_binary() -> PathBuf {
    let script = std::fs::read_to_string(repo().join("tests/k8s/controlplane.sh")).unwrap();
    let version = script
        .lines()
        .find_map(|line| line.strip_prefix("K8S_VERSION="))
        .and_then(|rest| rest.split_whitespace().next())
        .expect("tests/k8s/controlplane.sh sets K8S_VERSION");
    let cache = match std::env::var_os("ANTIDOTE_K8S_CACHE") {
        Some(cache) => PathBuf::from(cache),
        None => PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into()))
            .join(".cache/antidote/k8s"),
    };
    let kubectl = cache.join(version).join("bin/kubectl");
    assert!(
        kubectl.exists(),
        "{} is missing: run tests/k8s/controlplane.sh build",
        kubectl.display()
    );
    kubectl
}

/// Runs kubectl against the test control plane; returns whether it succeeded and everything it
/// printed.
pub(super) fn kubectl(args: &[&str]) -> (bool, String) {
    assert!(
        std::env::var_os("KUBECONFIG").is_some(),
        "KUBECONFIG is not set: run tests/run, which starts the test control plane (tests/k8s/controlplane.sh)"
    );
    let output = Command::new(kubectl_binary())
        .args(args)
        .output()
        .expect("kubectl runs");
    let text = format!(
        "$ kubectl {}\n{}{}",
        args.join(" "),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), text)
}

/// The check itself, the same for the real manifests and the broken ones: a server-side dry run
/// (admission, defaulting and validation, nothing stored), unknown or duplicate fields refused
/// (`--validate=strict`), and any warning from the server (a Pod Security violation, a
/// deprecated API) an error.
pub(super) fn dry_run(source: &[&str]) -> (bool, String) {
    let mut args = vec![
        "apply",
        "--dry-run=server",
        "--validate=strict",
        "--warnings-as-errors",
    ];
    args.extend_from_slice(source);
    kubectl(&args)
}

/// Every manifest in deploy/k8s (the kustomization aside), sorted.
fn manifests() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(k8s_dir())
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| {
            path.extension().is_some_and(|ext| ext == "yaml")
                && path
                    .file_name()
                    .is_some_and(|name| name != "kustomization.yaml")
        })
        .collect();
    files.sort();
    files
}

/// The YAML documents of a file, as JSON values.
pub(super) fn documents(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap();
    serde_yaml::Deserializer::from_str(&text)
        .map(|document| serde::Deserialize::deserialize(document).unwrap())
        .filter(|value: &Value| !value.is_null())
        .collect()
}

pub(super) fn to_yaml(documents: &[Value]) -> String {
    documents
        .iter()
        .map(|document| serde_yaml::to_string(document).unwrap())
        .collect::<Vec<_>>()
        .join("---\n")
}

/// The one object of `kind` in `documents`.
fn object<'a>(documents: &'a mut [Value], kind: &str) -> &'a mut Value {
    let mut found = documents.iter_mut().filter(|d| d["kind"] == kind);
    let object = found.next().unwrap_or_else(|| panic!("no {kind}"));
    assert!(found.next().is_none(), "more than one {kind}");
    object
}

/// Makes every namespace the manifests put objects in exist for real, with Pod Security
/// warnings at the `restricted` level. A server-side dry run of a namespaced object fails when
/// its namespace does not exist, even if the same apply dry-runs the Namespace first (a dry run
/// stores nothing, and kustomize's ordering cannot help), so the Namespace objects are applied
/// first: the manifests' own, server-side, which is idempotent and safe for both tests here.
///
/// They are not deleted afterwards: `antidote-system` is also where `k8s.rs`, running
/// concurrently in this binary, applies agent-k8s-rbac.yaml and takes its ServiceAccount's
/// tokens; deleting it would pull that from under those tests. Pod Security warnings change
/// nothing for them (they create no pods there), and the control plane is thrown away by
/// `controlplane.sh stop`.
pub(super) fn prepare_namespaces() {
    let all: Vec<Value> = manifests().iter().flat_map(|f| documents(f)).collect();
    let defined: BTreeSet<&str> = all
        .iter()
        .filter(|d| d["kind"] == "Namespace")
        .map(|d| d["metadata"]["name"].as_str().unwrap())
        .collect();
    for document in &all {
        if let Some(namespace) = document["metadata"]["namespace"].as_str() {
            assert!(
                defined.contains(namespace),
                "{} {} is in namespace {namespace}, which no manifest in deploy/k8s defines",
                document["kind"],
                document["metadata"]["name"]
            );
        }
    }
    let mut namespaces: Vec<Value> = all
        .into_iter()
        .filter(|d| d["kind"] == "Namespace")
        .collect();
    for namespace in &mut namespaces {
        namespace["metadata"]["labels"]["pod-security.kubernetes.io/warn"] = json!("restricted");
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("namespaces.yaml");
    std::fs::write(&file, to_yaml(&namespaces)).unwrap();
    let (ok, output) = kubectl(&[
        "apply",
        "--server-side",
        "--field-manager=antidote-tests-deploy",
        "--force-conflicts",
        "-f",
        file.to_str().unwrap(),
    ]);
    assert!(ok, "creating the manifests' namespaces failed:\n{output}");
}

/// How many objects kubectl reports as dry-run applied.
pub(super) fn dry_run_count(output: &str) -> usize {
    output
        .lines()
        .filter(|line| line.ends_with("(server dry run)"))
        .count()
}

#[test]
fn deploy_k8s_manifests_pass_a_strict_server_dry_run() {
    prepare_namespaces();
    let files = manifests();
    let mut total = 0;
    for file in &files {
        let objects = documents(file).len();
        let (ok, output) = dry_run(&["-f", file.to_str().unwrap()]);
        assert!(ok, "{} was refused:\n{output}", file.display());
        assert_eq!(
            dry_run_count(&output),
            objects,
            "every object of {} should be dry-run applied:\n{output}",
            file.display()
        );
        println!("{output}");
        total += objects;
    }

    // The kustomization lists every manifest, so `kubectl apply -k` deploys them all.
    let kustomization = documents(&k8s_dir().join("kustomization.yaml"));
    let listed: BTreeSet<&str> = kustomization[0]["resources"]
        .as_array()
        .expect("kustomization.yaml lists resources")
        .iter()
        .map(|r| r.as_str().unwrap())
        .collect();
    let present: BTreeSet<&str> = files
        .iter()
        .map(|f| f.file_name().unwrap().to_str().unwrap())
        .collect();
    assert_eq!(
        listed, present,
        "kustomization.yaml should list every manifest"
    );
    let (ok, output) = dry_run(&["-k", k8s_dir().to_str().unwrap()]);
    assert!(ok, "the kustomization was refused:\n{output}");
    assert_eq!(dry_run_count(&output), total, "{output}");
    println!("{output}");
}

/// A deliberately broken copy of a manifest, and what kubectl must say about it.
struct Breakage {
    what: &'static str,
    file: &'static str,
    edit: fn(&mut [Value]),
    refusal: &'static str,
}

#[test]
fn deploy_k8s_dry_run_refuses_broken_manifests() {
    prepare_namespaces();
    let breakages = [
        Breakage {
            what: "an unknown field under a Deployment's spec",
            file: "scheduler.yaml",
            edit: |docs| object(docs, "Deployment")["spec"]["replica"] = json!(1),
            refusal: r#"unknown field "spec.replica""#,
        },
        Breakage {
            what: "a Service port out of range",
            file: "agent-k8s.yaml",
            edit: |docs| object(docs, "Service")["spec"]["ports"][0]["port"] = json!(70000),
            refusal: "must be between 1 and 65535",
        },
        Breakage {
            what: "a container the restricted Pod Security profile forbids",
            file: "scheduler.yaml",
            edit: |docs| {
                *object(docs, "Deployment")
                    .pointer_mut(
                        "/spec/template/spec/containers/0/securityContext/allowPrivilegeEscalation",
                    )
                    .expect("the scheduler's container sets allowPrivilegeEscalation") = json!(true)
            },
            refusal: r#"would violate PodSecurity "restricted"#,
        },
    ];
    let dir = tempfile::tempdir().unwrap();
    for breakage in breakages {
        let mut docs = documents(&k8s_dir().join(breakage.file));
        (breakage.edit)(&mut docs);
        let file = dir.path().join(breakage.file);
        std::fs::write(&file, to_yaml(&docs)).unwrap();
        let (ok, output) = dry_run(&["-f", file.to_str().unwrap()]);
        assert!(
            !ok,
            "{} in {} was accepted:\n{output}",
            breakage.what, breakage.file
        );
        assert!(
            output.contains(breakage.refusal),
            "{} in {}: kubectl should say {:?}:\n{output}",
            breakage.what,
            breakage.file,
            breakage.refusal
        );
    }
}

#[test]
fn deploy_k8s_scheduler_dials_the_agent_service() {
    let mut scheduler = documents(&k8s_dir().join("scheduler.yaml"));
    let mut agent = documents(&k8s_dir().join("agent-k8s.yaml"));
    let config = object(&mut scheduler, "ConfigMap")["data"]["antidote.toml"]
        .as_str()
        .unwrap()
        .to_owned();
    let service = object(&mut agent, "Service");
    let grpc = service["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "grpc")
        .expect("agent-k8s's Service has a grpc port");
    let address = format!(
        "address = \"http://{}.{}.svc:{}\"",
        service["metadata"]["name"].as_str().unwrap(),
        service["metadata"]["namespace"].as_str().unwrap(),
        grpc["port"]
    );
    assert!(
        config.contains(&address),
        "the scheduler's configuration should dial agent-k8s's Service with `{address}`:\n{config}"
    );
}

/// The real scheduler binary starts with `config` (every key of the file checked, unknown ones
/// refused), its addresses, database and curriculum moved into a temporary directory by
/// `ANTIDOTE_*` variables, which override the file.
async fn scheduler_accepts(name: &str, config: &str) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("antidote.toml");
    std::fs::write(&path, config).unwrap();
    let env = [
        ("ANTIDOTE_LISTEN", "127.0.0.1:0".to_owned()),
        ("ANTIDOTE_HTTP__LISTEN", "127.0.0.1:0".to_owned()),
        (
            "ANTIDOTE_DATABASE",
            dir.path().join("antidote.db").display().to_string(),
        ),
        (
            "ANTIDOTE_CURRICULUM",
            example_curriculum().display().to_string(),
        ),
    ];
    let log = dir.path().join("scheduler.log");
    let mut scheduler = Process::spawn_with_env(
        &workspace_bin("scheduler-svc"),
        &[
            "serve".into(),
            "--config".into(),
            path.display().to_string(),
        ],
        &env,
        log,
    )
    .await
    .unwrap_or_else(|e| panic!("the scheduler refused {name}: {e:#}\n{config}"));
    let status = scheduler.terminate().await.expect("the scheduler stops");
    assert!(
        status.success(),
        "the scheduler with {name} did not stop cleanly: {status}\n{}",
        scheduler.log_text()
    );
}

#[tokio::test]
async fn deploy_scheduler_configurations_start_the_scheduler() {
    let mut scheduler = documents(&k8s_dir().join("scheduler.yaml"));
    let configmap = object(&mut scheduler, "ConfigMap")["data"]["antidote.toml"]
        .as_str()
        .unwrap()
        .to_owned();
    scheduler_accepts("deploy/k8s/scheduler.yaml's ConfigMap", &configmap).await;
    let compose = std::fs::read_to_string(repo().join("deploy/compose/antidote.toml")).unwrap();
    scheduler_accepts("deploy/compose/antidote.toml", &compose).await;
}

/// The value of environment variable `name` in the first container of the Deployment in
/// `documents`, if it is set there.
fn deployment_env(documents: &mut [Value], name: &str) -> Option<String> {
    object(documents, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|e| e["name"] == name)
        .map(|e| e["value"].as_str().unwrap_or_default().to_owned())
}

#[test]
fn deploy_runs_no_lesson_privileged_unless_the_operator_opts_in() {
    // agent-k8s: privilege off, and the admission policy refusing privileged pods in place.
    let mut agent = documents(&k8s_dir().join("agent-k8s.yaml"));
    let privileged = deployment_env(&mut agent, "ANTIDOTE_K8S_TRUSTED_PRIVILEGED");
    assert!(
        matches!(privileged.as_deref(), None | Some("false")),
        "agent-k8s.yaml runs trusted images privileged: {privileged:?}"
    );
    let rbac = documents(&k8s_dir().join("agent-k8s-rbac.yaml"));
    let pods_policy = rbac
        .iter()
        .find(|d| {
            d["kind"] == "ValidatingAdmissionPolicy"
                && d["metadata"]["name"] == "antidote-agent-k8s-pods"
        })
        .expect("agent-k8s-rbac.yaml has the antidote-agent-k8s-pods policy");
    assert!(
        pods_policy
            .to_string()
            .contains("securityContext.privileged"),
        "{pods_policy}"
    );
    for name in ["antidote-agent-k8s-namespaces", "antidote-agent-k8s-pods"] {
        assert!(
            rbac.iter()
                .any(|d| d["kind"] == "ValidatingAdmissionPolicyBinding"
                    && d["spec"]["policyName"] == name
                    && d["spec"]["validationActions"] == json!(["Deny"])),
            "no binding denies by {name}"
        );
    }

    // agent-docker in Compose: off unless the operator's environment says otherwise.
    let compose: Value = serde_yaml::from_str(
        &std::fs::read_to_string(repo().join("deploy/compose/compose.yaml")).unwrap(),
    )
    .unwrap();
    let setting =
        compose["services"]["agent-docker"]["environment"]["ANTIDOTE_DOCKER_TRUSTED_PRIVILEGED"]
            .as_str()
            .unwrap_or("false");
    assert!(
        setting == "false" || setting.ends_with(":-false}"),
        "compose.yaml runs trusted images privileged by default: {setting}"
    );

    // The quickstart only ever turns it off (when an opt-in cannot be honoured).
    let quickstart = std::fs::read_to_string(repo().join("deploy/local/run")).unwrap();
    assert!(
        !quickstart.contains("export ANTIDOTE_DOCKER_TRUSTED_PRIVILEGED=true"),
        "deploy/local/run opts in to privileged endpoints"
    );
}
