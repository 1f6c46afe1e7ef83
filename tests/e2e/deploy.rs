//! The deployment files in `deploy/`. Every Kubernetes manifest in `deploy/k8s`, one file at a
//! time and through its kustomization, must pass `kubectl apply --dry-run=server` against the
//! test kube-apiserver (`tests/k8s/controlplane.sh`, KUBECONFIG exported by `tests/run`) with
//! strict field validation and every server warning an error, in a namespace that warns about
//! anything the `restricted` Pod Security profile forbids. Deliberately broken copies go through
//! the same check and must be refused, which proves it can fail. The scheduler configurations
//! shipped with the manifests and with `deploy/compose` must start the real scheduler. No
//! deployment runs lessons privileged unless the operator opts in.
//!
//! The base talks mTLS between the scheduler and agent-k8s. The cert-manager component that
//! issues its two Secrets passes the same dry run, with cert-manager's CRDs installed from
//! `tests/fixtures/cert-manager-crds`; and certificates with the names it asks for, written
//! where the Deployments mount the Secrets, make the real agent-k8s (with its Deployment's
//! environment) serve mTLS only, and the real scheduler (with its ConfigMap) reach it, while
//! callers without the scheduler's certificate are refused.

use std::collections::BTreeSet;
use std::fs::File;
use std::path::{Component, Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use antidote_proto::api::v1 as api;
use antidote_tests::pki::{Ca, Leaf, Validity};
use antidote_tests::{Clients, Process, admin_config, example_curriculum, workspace_bin};
use serde_json::{Value, json};

use crate::PATIENCE;

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

/// `to` as a path relative to `from` (both absolute): kustomize refuses absolute paths to
/// other kustomizations.
pub(super) fn relative(from: &Path, to: &Path) -> PathBuf {
    let from: Vec<Component> = from.components().collect();
    let to: Vec<Component> = to.components().collect();
    let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
    let mut path = PathBuf::new();
    for _ in common..from.len() {
        path.push("..");
    }
    for part in &to[common..] {
        path.push(part);
    }
    path
}

/// An overlay as an operator would write it: the base plus `components` (directories under
/// deploy/k8s: `mesh/linkerd`, `cert-manager`), in a temporary directory.
pub(super) fn overlay(components: &[&str]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let here = dir.path().canonicalize().unwrap();
    let mut kustomization = format!(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - {}\n",
        relative(&here, &k8s_dir()).display()
    );
    if !components.is_empty() {
        kustomization += "components:\n";
        for component in components {
            kustomization += &format!(
                "  - {}\n",
                relative(&here, &k8s_dir().join(component)).display()
            );
        }
    }
    std::fs::write(dir.path().join("kustomization.yaml"), kustomization).unwrap();
    dir
}

/// The manifests kustomize renders for the base plus `components`. Needs no cluster.
pub(super) fn render(components: &[&str]) -> Vec<Value> {
    let dir = overlay(components);
    let output = Command::new(kubectl_binary())
        .arg("kustomize")
        .arg(dir.path())
        .output()
        .expect("kubectl runs");
    assert!(
        output.status.success(),
        "kustomize failed for {components:?}:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8(output.stdout).unwrap();
    serde_yaml::Deserializer::from_str(&text)
        .map(|document| serde::Deserialize::deserialize(document).unwrap())
        .filter(|value: &Value| !value.is_null())
        .collect()
}

/// The one object of `kind` named `name` in rendered manifests.
pub(super) fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    let mut found = docs
        .iter()
        .filter(|d| d["kind"] == kind && d["metadata"]["name"] == name);
    let object = found.next().unwrap_or_else(|| panic!("no {kind} {name}"));
    assert!(found.next().is_none(), "more than one {kind} {name}");
    object
}

/// The CRDs of `tests/fixtures/<fixture>` installed in the test control plane for as long as
/// this lives, and removed when it drops (a failing test included). Every one of them carries
/// the label `antidote.io/test-fixture=<fixture>`; the test deletes by it and touches nothing
/// without it.
///
/// The CRD names are fixed by their groups, so two runs of a test against one control plane
/// must not overlap: one would delete the CRDs under the other. An exclusive lock on a file
/// named after the fixture and the control plane's kubeconfig serialises them (a lock held by a
/// killed process is released by the kernel). Installing is a server-side apply, idempotent
/// whatever an earlier, interrupted run left behind.
pub(super) struct FixtureCrds {
    label: String,
    _lock: File,
}

impl FixtureCrds {
    pub(super) fn install(fixture: &str) -> FixtureCrds {
        let dir = repo().join("tests/fixtures").join(fixture);
        let label = format!("antidote.io/test-fixture={fixture}");
        let kubeconfig = std::env::var("KUBECONFIG").expect(
            "KUBECONFIG is not set: run tests/run, which starts the test control plane (tests/k8s/controlplane.sh)",
        );
        let name: String = kubeconfig
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        let path = std::env::temp_dir().join(format!("antidote-{fixture}-{name}.lock"));
        let lock = File::create(&path).unwrap();
        lock.lock().expect("locking the fixture CRD lock file");

        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|entry| entry.unwrap().path())
            .filter(|path| path.extension().is_some_and(|ext| ext == "yaml"))
            .collect();
        files.sort();
        // A CRD of the same name without our label belongs to someone else (a real mesh or
        // cert-manager): replacing or deleting it would break their cluster.
        let mut names = Vec::new();
        for file in &files {
            for crd in documents(file) {
                assert_eq!(
                    crd["metadata"]["labels"]["antidote.io/test-fixture"],
                    fixture,
                    "{} lacks the label {label}",
                    file.display()
                );
                names.push(crd["metadata"]["name"].as_str().unwrap().to_owned());
            }
        }
        let (ok, output) = kubectl(&[
            "get",
            "crd",
            "-l",
            &format!("antidote.io/test-fixture!={fixture}"),
            "-o",
            "name",
        ]);
        assert!(ok, "{output}");
        for name in &names {
            assert!(
                !output
                    .lines()
                    .any(|line| line.ends_with(&format!("/{name}"))),
                "CRD {name} exists without the label {label}: it is not ours, refusing to replace it"
            );
        }

        let crds = FixtureCrds { label, _lock: lock };
        let (ok, output) = kubectl(&[
            "apply",
            "--server-side",
            &format!("--field-manager=antidote-tests-{fixture}"),
            "--force-conflicts",
            "-f",
            dir.to_str().unwrap(),
        ]);
        assert!(ok, "installing the {fixture} CRDs failed:\n{output}");
        // `kubectl wait` fails at once ("<nil> is of the type <nil>") on a CRD whose status the
        // API server has not written yet, instead of waiting: ask again until it waits.
        let mut tries = 0;
        let (ok, output) = loop {
            let (ok, output) = kubectl(&[
                "wait",
                "--for=condition=Established",
                "crd",
                "-l",
                &crds.label,
                "--timeout=60s",
            ]);
            tries += 1;
            if ok || tries == 20 || !output.contains("accessor error") {
                break (ok, output);
            }
            std::thread::sleep(std::time::Duration::from_millis(250));
        };
        assert!(ok, "the {fixture} CRDs were not established:\n{output}");
        assert_eq!(
            output
                .lines()
                .filter(|l| l.ends_with("condition met"))
                .count(),
            names.len(),
            "{output}"
        );
        crds
    }
}

impl Drop for FixtureCrds {
    fn drop(&mut self) {
        // Waits until they are gone (their objects too: a dry run stored none), so the next
        // holder of the lock starts from a clean cluster.
        let (ok, output) = kubectl(&[
            "delete",
            "crd",
            "-l",
            &self.label,
            "--wait=true",
            "--timeout=60s",
        ]);
        if !ok && !std::thread::panicking() {
            panic!(
                "removing the CRDs labelled {} failed:\n{output}",
                self.label
            );
        }
    }
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
            edit: |docs| {
                let service = docs
                    .iter_mut()
                    .find(|d| d["kind"] == "Service" && d["metadata"]["name"] == "agent-k8s")
                    .expect("agent-k8s's Service");
                service["spec"]["ports"][0]["port"] = json!(70000)
            },
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

/// `host:port` of agent-k8s's Service (its gRPC port), as the scheduler in the cluster dials it.
pub(super) fn agent_service(docs: &[Value]) -> String {
    let service = docs
        .iter()
        .find(|d| d["kind"] == "Service" && d["metadata"]["name"] == "agent-k8s")
        .expect("agent-k8s's Service");
    let grpc = service["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "grpc")
        .expect("agent-k8s's Service has a grpc port");
    format!(
        "{}.{}.svc:{}",
        service["metadata"]["name"].as_str().unwrap(),
        service["metadata"]["namespace"].as_str().unwrap(),
        grpc["port"]
    )
}

/// The antidote.toml of the scheduler's ConfigMap in `docs`.
pub(super) fn scheduler_config(docs: &[Value]) -> String {
    docs.iter()
        .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == "scheduler-config")
        .expect("the scheduler's ConfigMap")["data"]["antidote.toml"]
        .as_str()
        .expect("the ConfigMap has antidote.toml")
        .to_owned()
}

/// The string value of `key` in a line of TOML such as `tls = { ca = "…", cert = "…" }`.
fn toml_string<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let start = line.find(&format!("{key} = \""))? + key.len() + 4;
    let len = line[start..].find('"')?;
    Some(&line[start..start + len])
}

#[test]
fn deploy_k8s_scheduler_dials_the_agent_service() {
    let mut docs = documents(&k8s_dir().join("scheduler.yaml"));
    docs.extend(documents(&k8s_dir().join("agent-k8s.yaml")));
    let config = scheduler_config(&docs);
    let service = agent_service(&docs);
    let host = service.split(':').next().unwrap();
    // mTLS: https://, and the agent's certificate checked against the Service's name.
    let address = format!("address = \"https://{service}\"");
    assert!(
        config.contains(&address),
        "the scheduler's configuration should dial agent-k8s's Service with `{address}`:\n{config}"
    );
    let tls = config
        .lines()
        .find(|line| line.trim_start().starts_with("tls = {"))
        .unwrap_or_else(|| panic!("the agent has no `tls` in:\n{config}"));
    assert_eq!(toml_string(tls, "server_name"), Some(host), "{tls}");
    // The files are those of the Secret the scheduler's Deployment mounts, in cert-manager's
    // layout.
    let deployment = find(&docs, "Deployment", "scheduler-svc");
    for (key, file) in [("ca", "ca.crt"), ("cert", "tls.crt"), ("key", "tls.key")] {
        let path = toml_string(tls, key).unwrap_or_else(|| panic!("no tls.{key} in {tls}"));
        assert_eq!(
            secret_file(deployment, path),
            ("scheduler-agent-client-tls".to_owned(), file.to_owned()),
            "tls.{key}"
        );
    }
    // The entrypoint signing key, from its own Secret.
    let keys = config
        .lines()
        .find(|line| line.trim_start().starts_with("keys = [{"))
        .unwrap_or_else(|| panic!("no [entrypoint] keys in:\n{config}"));
    let file = toml_string(keys, "file").unwrap();
    assert_eq!(
        secret_file(deployment, file),
        ("scheduler-entrypoint-keys".to_owned(), "k1.pem".to_owned())
    );
}

/// The environment of the first container of `deployment`, in order.
pub(super) fn container_env(deployment: &Value) -> Vec<(String, String)> {
    deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| {
            (
                e["name"].as_str().unwrap().to_owned(),
                e["value"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

/// Where the file a Deployment's first container reads at `path` comes from: the Secret and
/// its key. The Secret must be mounted read-only over a directory of `path`, and not by
/// subPath (whose files the kubelet never updates: a renewed certificate would not reach the
/// program).
pub(super) fn secret_file(deployment: &Value, path: &str) -> (String, String) {
    let spec = &deployment["spec"]["template"]["spec"];
    let name = deployment["metadata"]["name"].as_str().unwrap();
    let (mount, file) = spec["containers"][0]["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .find_map(|mount| {
            let dir = mount["mountPath"].as_str()?.trim_end_matches('/');
            let file = path.strip_prefix(dir)?.strip_prefix('/')?;
            Some((mount, file))
        })
        .unwrap_or_else(|| panic!("{name}: {path} is on no volume"));
    assert_eq!(mount["readOnly"], true, "{name}: {mount}");
    assert!(mount.get("subPath").is_none(), "{name}: {mount}");
    let volume = spec["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|v| v["name"] == mount["name"])
        .unwrap_or_else(|| panic!("{name}: no volume {}", mount["name"]));
    let secret = &volume["secret"];
    let secret_name = secret["secretName"]
        .as_str()
        .unwrap_or_else(|| panic!("{name}: {path} is not from a Secret: {volume}"));
    let key = match secret["items"].as_array() {
        Some(items) => items
            .iter()
            .find(|item| item["path"] == file)
            .and_then(|item| item["key"].as_str())
            .unwrap_or_else(|| panic!("{name}: {path} is not among {volume}'s items")),
        None => file,
    };
    (secret_name.to_owned(), key.to_owned())
}

/// The real scheduler binary with `config` (every key of the file checked, unknown ones
/// refused), its addresses, database and curriculum moved into `dir` by `ANTIDOTE_*`
/// variables, which override the file.
async fn spawn_scheduler(dir: &Path, config: &str) -> anyhow::Result<Process> {
    // The entrypoint signing key the Deployment mounts from its Secret, made here.
    let keys = dir.join("entrypoint-keys");
    std::fs::create_dir_all(&keys).unwrap();
    std::fs::write(keys.join("k1.pem"), crate::entrypoint::KEY).unwrap();
    let config = config.replace("/etc/antidote-entrypoint/", &format!("{}/", keys.display()));
    // deploy/k8s's admin listener, 0.0.0.0:9090, may be another test's agent's port.
    let config = config
        .replace("\"0.0.0.0:9090\"", "\"127.0.0.1:0\"")
        .replace("\"0.0.0.0:9091\"", "\"127.0.0.1:0\"");
    let path = dir.join("antidote.toml");
    std::fs::write(&path, config).unwrap();
    let env = [
        ("ANTIDOTE_LISTEN", "127.0.0.1:0".to_owned()),
        ("ANTIDOTE_HTTP__LISTEN", "127.0.0.1:0".to_owned()),
        (
            "ANTIDOTE_DATABASE",
            dir.join("antidote.db").display().to_string(),
        ),
        (
            "ANTIDOTE_CURRICULUM",
            example_curriculum().display().to_string(),
        ),
    ];
    Process::spawn_with_env(
        &workspace_bin("scheduler-svc"),
        &[
            "serve".into(),
            "--config".into(),
            path.display().to_string(),
        ],
        &env,
        dir.join("scheduler.log"),
    )
    .await
}

/// The real scheduler binary starts with `config` ([`spawn_scheduler`]) and stops cleanly.
pub(super) async fn scheduler_accepts(name: &str, config: &str) {
    let dir = tempfile::tempdir().unwrap();
    let mut scheduler = spawn_scheduler(dir.path(), config)
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
    for name in [
        "antidote-agent-k8s-namespaces",
        "antidote-agent-k8s-pods",
        "antidote-agent-k8s-services",
    ] {
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

/// The fixture CRDs of cert-manager (`tests/fixtures/cert-manager-crds`).
const CERT_MANAGER_CRDS: &str = "cert-manager-crds";

/// The cert-manager component's directory under deploy/k8s.
const CERT_MANAGER: &str = "cert-manager";

#[test]
fn deploy_k8s_cert_manager_component_passes_a_strict_server_dry_run() {
    prepare_namespaces();
    let _crds = FixtureCrds::install(CERT_MANAGER_CRDS);
    let objects = render(&[CERT_MANAGER]).len();
    let overlay = overlay(&[CERT_MANAGER]);
    let (ok, output) = dry_run(&["-k", overlay.path().to_str().unwrap()]);
    assert!(
        ok,
        "the base with the cert-manager component was refused:\n{output}"
    );
    assert_eq!(dry_run_count(&output), objects, "{output}");
    println!("{output}");

    // The component's own resources alone, as `kubectl apply -f` would send them.
    let component = k8s_dir().join(CERT_MANAGER);
    let resources: Vec<PathBuf> = documents(&component.join("kustomization.yaml"))[0]["resources"]
        .as_array()
        .expect("the component lists resources")
        .iter()
        .map(|r| component.join(r.as_str().unwrap()))
        .collect();
    let mut issued = 0;
    for file in &resources {
        let (ok, output) = dry_run(&["-f", file.to_str().unwrap()]);
        assert!(ok, "{} was refused:\n{output}", file.display());
        assert_eq!(dry_run_count(&output), documents(file).len(), "{output}");
        issued += documents(file).len();
    }
    assert_eq!(
        objects,
        render(&[]).len() + issued,
        "the component adds its resources and changes nothing else's count"
    );

    // The CRDs really validate: broken objects are refused, each for its own reason.
    type Edit = fn(&mut Value);
    let breakages: [(&str, &str, &str, Edit, &str); 4] = [
        (
            "Certificate",
            "agent-k8s",
            "a usage cert-manager does not have",
            |c| c["spec"]["usages"][1] = json!("serverAuth"),
            r#"Unsupported value: "serverAuth""#,
        ),
        (
            "Certificate",
            "scheduler-agent-client",
            "a misspelt field",
            |c| c["spec"]["dnsName"] = json!(["x.example"]),
            r#"unknown field "spec.dnsName""#,
        ),
        (
            "Certificate",
            "scheduler-agent-client",
            "no secretName",
            |c| {
                c["spec"].as_object_mut().unwrap().remove("secretName");
            },
            "spec.secretName: Required value",
        ),
        (
            "Issuer",
            "antidote-agent-ca",
            "a CA issuer without its Secret",
            |i| {
                i["spec"]["ca"]
                    .as_object_mut()
                    .unwrap()
                    .remove("secretName");
            },
            "spec.ca.secretName: Required value",
        ),
    ];
    let dir = tempfile::tempdir().unwrap();
    for (kind, name, what, edit, refusal) in breakages {
        let mut docs: Vec<Value> = resources.iter().flat_map(|f| documents(f)).collect();
        let object = docs
            .iter_mut()
            .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("the component has no {kind} {name}"));
        edit(object);
        let file = dir.path().join(format!("{kind}-{name}.yaml"));
        std::fs::write(&file, to_yaml(&docs)).unwrap();
        let (ok, output) = dry_run(&["-f", file.to_str().unwrap()]);
        assert!(!ok, "{what} ({kind} {name}) was accepted:\n{output}");
        assert!(
            output.contains(refusal),
            "{what} ({kind} {name}): kubectl should say {refusal:?}:\n{output}"
        );
    }
}

/// The Certificate of the cert-manager component that fills Secret `secret`.
fn certificate_of<'a>(docs: &'a [Value], secret: &str) -> &'a Value {
    let mut found = docs
        .iter()
        .filter(|d| d["kind"] == "Certificate" && d["spec"]["secretName"] == secret);
    let certificate = found
        .next()
        .unwrap_or_else(|| panic!("no Certificate issues Secret {secret}"));
    assert!(found.next().is_none(), "two Certificates issue {secret}");
    certificate
}

/// The names a Certificate asks for: `DNS:…` for its dnsNames, `URI:…` for its uris.
fn certificate_names(certificate: &Value) -> Vec<String> {
    let list = |field: &str, prefix: &str| -> Vec<String> {
        certificate["spec"][field]
            .as_array()
            .into_iter()
            .flatten()
            .map(|name| format!("{prefix}{}", name.as_str().unwrap()))
            .collect()
    };
    [list("dnsNames", "DNS:"), list("uris", "URI:")].concat()
}

/// An identity as `--tls-require-identity` and the SDK's messages write it.
fn identity_name(identity: &str) -> String {
    if identity.starts_with("spiffe://") {
        format!("URI:{identity}")
    } else {
        format!("DNS:{identity}")
    }
}

/// The Secrets the base's TLS files come from: `(deployment, what, path, secret, key)` for the
/// agent's `ANTIDOTE_AGENT_TLS_{CERT,KEY,CLIENT_CA}` and the scheduler's `[[agents]] tls`.
fn tls_files(docs: &[Value]) -> Vec<(&'static str, String, String, String, String)> {
    let mut files = Vec::new();
    let agent = find(docs, "Deployment", "agent-k8s");
    let env = container_env(agent);
    for variable in [
        "ANTIDOTE_AGENT_TLS_CERT",
        "ANTIDOTE_AGENT_TLS_KEY",
        "ANTIDOTE_AGENT_TLS_CLIENT_CA",
    ] {
        let path = env
            .iter()
            .find(|(k, _)| k == variable)
            .unwrap_or_else(|| panic!("agent-k8s has no {variable}: {env:?}"))
            .1
            .clone();
        let (secret, key) = secret_file(agent, &path);
        files.push(("agent-k8s", variable.to_owned(), path, secret, key));
    }
    let scheduler = find(docs, "Deployment", "scheduler-svc");
    let config = scheduler_config(docs);
    let tls = config
        .lines()
        .find(|line| line.trim_start().starts_with("tls = {"))
        .unwrap_or_else(|| panic!("the scheduler dials no agent with tls:\n{config}"));
    for key in ["ca", "cert", "key"] {
        let path = toml_string(tls, key).unwrap().to_owned();
        let (secret, file) = secret_file(scheduler, &path);
        files.push(("scheduler-svc", format!("tls.{key}"), path, secret, file));
    }
    files
}

#[test]
fn deploy_k8s_cert_manager_issues_what_the_base_mounts_with_the_names_it_checks() {
    let docs = render(&[CERT_MANAGER]);
    // Each file comes from the key of cert-manager's layout that holds it.
    let expected = [
        ("ANTIDOTE_AGENT_TLS_CERT", "tls.crt"),
        ("ANTIDOTE_AGENT_TLS_KEY", "tls.key"),
        ("ANTIDOTE_AGENT_TLS_CLIENT_CA", "ca.crt"),
        ("tls.ca", "ca.crt"),
        ("tls.cert", "tls.crt"),
        ("tls.key", "tls.key"),
    ];
    let files = tls_files(&docs);
    for (deployment, what, path, secret, key) in &files {
        let want = expected.iter().find(|(w, _)| w == what).unwrap().1;
        assert_eq!(
            key, want,
            "{deployment} {what} = {path} is {secret}'s {key}"
        );
    }
    let secret_of = |deployment: &str| -> &str {
        let secrets: BTreeSet<&str> = files
            .iter()
            .filter(|f| f.0 == deployment)
            .map(|f| f.3.as_str())
            .collect();
        assert_eq!(secrets.len(), 1, "{deployment}: {secrets:?}");
        secrets.into_iter().next().unwrap()
    };
    let agent_cert = certificate_of(&docs, secret_of("agent-k8s"));
    let scheduler_cert = certificate_of(&docs, secret_of("scheduler-svc"));

    // One private CA signs both, and nothing signs it but the bootstrap issuer.
    let issuer = &agent_cert["spec"]["issuerRef"];
    assert_eq!(scheduler_cert["spec"]["issuerRef"], *issuer);
    assert!(
        matches!(issuer["kind"].as_str(), None | Some("Issuer")),
        "{issuer}"
    );
    let issuer = find(&docs, "Issuer", issuer["name"].as_str().unwrap());
    let ca_secret = issuer["spec"]["ca"]["secretName"]
        .as_str()
        .unwrap_or_else(|| panic!("not a CA issuer: {issuer}"));
    let ca = certificate_of(&docs, ca_secret);
    assert_eq!(ca["spec"]["isCA"], true, "{ca}");
    let bootstrap = find(
        &docs,
        "Issuer",
        ca["spec"]["issuerRef"]["name"].as_str().unwrap(),
    );
    assert!(bootstrap["spec"]["selfSigned"].is_object(), "{bootstrap}");
    for certificate in [agent_cert, scheduler_cert, ca] {
        assert_eq!(
            certificate["metadata"]["namespace"], issuer["metadata"]["namespace"],
            "{certificate}"
        );
    }

    // The agent's certificate names what the scheduler checks, for server use; the
    // scheduler's names what the agent requires, for client use.
    let config = scheduler_config(&docs);
    let tls = config
        .lines()
        .find(|line| line.trim_start().starts_with("tls = {"))
        .unwrap();
    let server_name = toml_string(tls, "server_name").unwrap();
    assert!(
        certificate_names(agent_cert).contains(&identity_name(server_name)),
        "{agent_cert}"
    );
    let required = container_env(find(&docs, "Deployment", "agent-k8s"))
        .into_iter()
        .find(|(k, _)| k == "ANTIDOTE_AGENT_TLS_REQUIRE_IDENTITY")
        .expect("agent-k8s requires the scheduler's identity")
        .1;
    assert!(
        certificate_names(scheduler_cert).contains(&identity_name(&required)),
        "{scheduler_cert}"
    );
    let usages = |c: &Value| c["spec"]["usages"].clone();
    assert!(
        usages(agent_cert)
            .as_array()
            .unwrap()
            .contains(&json!("server auth")),
        "{agent_cert}"
    );
    assert!(
        usages(scheduler_cert)
            .as_array()
            .unwrap()
            .contains(&json!("client auth")),
        "{scheduler_cert}"
    );
    assert!(
        !usages(agent_cert)
            .as_array()
            .unwrap()
            .contains(&json!("client auth")),
        "the agent's certificate must not work as a client certificate: {agent_cert}"
    );
}

/// The real agent-k8s binary with `env` (a Deployment's, as [`container_env`] reads it): the
/// listen address kept on all interfaces (the pod network) but its port free, metrics on a free
/// loopback port, and the test control plane's kubeconfig.
pub(super) async fn start_agent_k8s(
    dir: &Path,
    name: &str,
    env: &[(String, String)],
) -> anyhow::Result<Process> {
    let mut env: Vec<(&str, String)> = env
        .iter()
        .filter(|(k, _)| k != "RUST_LOG")
        .map(|(k, v)| {
            let v = match k.as_str() {
                "ANTIDOTE_K8S_LISTEN" => {
                    assert!(
                        v.starts_with("0.0.0.0:"),
                        "{name}: the agent listens on {v}"
                    );
                    "0.0.0.0:0".to_owned()
                }
                "ANTIDOTE_K8S_METRICS_LISTEN" => "127.0.0.1:0".to_owned(),
                _ => v.clone(),
            };
            (k.as_str(), v)
        })
        .collect();
    env.push((
        "KUBECONFIG",
        std::env::var("KUBECONFIG").expect("KUBECONFIG is not set: run tests/run"),
    ));
    Process::spawn_with_env(
        &workspace_bin("agent-k8s"),
        &[],
        &env,
        dir.join(format!("agent-k8s-{name}.log")),
    )
    .await
}

/// `config` without its `[admin]` table and `[[admin.tokens]]` entries (deploy/k8s's admin
/// listener, whose placeholder token nobody holds), so the test's own admin settings take their
/// place instead of being a duplicate key.
fn without_admin(config: &str) -> String {
    let mut kept = String::new();
    let mut skipping = false;
    for line in config.lines() {
        let header = line.trim();
        if header.starts_with('[') {
            skipping = header == "[admin]"
                || header.starts_with("[admin.")
                || header.starts_with("[[admin.");
        }
        if !skipping {
            kept.push_str(line);
            kept.push('\n');
        }
    }
    kept
}

/// [`spawn_scheduler`] with an admin listener (the test tokens of [`admin_config`]), and
/// clients for it.
pub(super) async fn start_scheduler(dir: &Path, config: &str) -> (Process, Clients) {
    let config = format!("{}{}", admin_config(), without_admin(config));
    let process = spawn_scheduler(dir, &config)
        .await
        .unwrap_or_else(|e| panic!("the scheduler refused its configuration: {e:#}\n{config}"));
    let admin = *process
        .extra
        .get("admin")
        .expect("the scheduler printed `admin listening on ADDR`");
    let clients = Clients::connect(process.addr, admin)
        .await
        .expect("clients connect to the scheduler");
    (process, clients)
}

/// Asks ListAgents until agent `name` satisfies `until`; panics after [`PATIENCE`] with what it
/// last showed and `logs`.
pub(super) async fn wait_agent(
    clients: &Clients,
    name: &str,
    until: impl Fn(&api::Agent) -> bool,
    logs: impl Fn() -> String,
) -> api::Agent {
    let started = Instant::now();
    loop {
        let agent = clients
            .agents()
            .await
            .expect("ListAgents")
            .into_iter()
            .find(|a| a.name == name)
            .unwrap_or_else(|| panic!("ListAgents has no agent {name}"));
        if until(&agent) {
            return agent;
        }
        if started.elapsed() > PATIENCE {
            panic!("agent {name} never got there: {agent:#?}\n{}", logs());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Writes a Secret of cert-manager's layout into `dir/<secret>/`: `leaf` as tls.crt and
/// tls.key, `ca` as ca.crt.
fn write_secret(dir: &Path, secret: &str, leaf: &Leaf, ca: &Ca) -> PathBuf {
    let dir = dir.join(secret);
    std::fs::create_dir_all(&dir).unwrap();
    leaf.write(&dir.join("tls.crt"), &dir.join("tls.key"));
    ca.write(&dir.join("ca.crt"));
    dir
}

#[tokio::test]
async fn deploy_k8s_base_serves_mtls_to_the_scheduler_alone() {
    let docs = render(&[CERT_MANAGER]);
    let dir = tempfile::tempdir().unwrap();
    let secrets = dir.path().join("secrets");

    // What cert-manager would issue: one CA (the component's), and for each Secret a
    // certificate with the names its Certificate asks for.
    let ca = Ca::new("antidote agent CA");
    let files = tls_files(&docs);
    let agent_secret = files
        .iter()
        .find(|f| f.0 == "agent-k8s")
        .map(|f| f.3.clone())
        .unwrap();
    let mut leaves = std::collections::BTreeMap::new();
    for secret in files.iter().map(|f| f.3.as_str()).collect::<BTreeSet<_>>() {
        let names = certificate_names(certificate_of(&docs, secret));
        let bare: Vec<&str> = names.iter().map(|n| &n[4..]).collect();
        let leaf = ca.issue(&bare, Validity::Until(2080, 1, 1));
        write_secret(&secrets, secret, &leaf, &ca);
        leaves.insert(secret.to_owned(), (names, leaf));
    }
    // Each mounted path of a Deployment, as the files are here (both pods may mount their
    // Secret at the same path).
    let local = |deployment: &str, path: &str| -> String {
        let (_, _, _, secret, key) = files
            .iter()
            .find(|f| f.0 == deployment && f.2 == path)
            .unwrap_or_else(|| panic!("{path} is not a TLS file of {deployment}"));
        secrets.join(secret).join(key).display().to_string()
    };

    // agent-k8s with its Deployment's environment, the TLS files where the Secret would be.
    let deployment = find(&docs, "Deployment", "agent-k8s");
    let env: Vec<(String, String)> = container_env(deployment)
        .into_iter()
        .map(|(k, v)| {
            if k.starts_with("ANTIDOTE_AGENT_TLS_") && k != "ANTIDOTE_AGENT_TLS_REQUIRE_IDENTITY" {
                let path = local("agent-k8s", &v);
                (k, path)
            } else {
                (k, v)
            }
        })
        .collect();
    assert!(
        !env.iter()
            .any(|(k, _)| k == "ANTIDOTE_AGENT_INSECURE_PLAINTEXT"),
        "{env:?}"
    );
    let identity = env
        .iter()
        .find(|(k, _)| k == "ANTIDOTE_AGENT_TLS_REQUIRE_IDENTITY")
        .expect("the agent requires the scheduler's identity")
        .1
        .clone();
    let mut agent = start_agent_k8s(dir.path(), "base", &env)
        .await
        .unwrap_or_else(|e| panic!("agent-k8s with the base's environment did not start: {e:#}"));
    assert!(agent.addr.ip().is_unspecified(), "{}", agent.addr);
    assert!(
        agent.log_text().contains("serving mTLS only"),
        "{}",
        agent.log_text()
    );
    let port = agent.addr.port();

    // The kubelet's probes: plain HTTP on the metrics port, which answers.
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    let metrics_port = container["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "metrics")
        .expect("a metrics port")["containerPort"]
        .as_u64()
        .unwrap();
    let metrics_listen = env
        .iter()
        .find(|(k, _)| k == "ANTIDOTE_K8S_METRICS_LISTEN")
        .map(|(_, v)| v.clone())
        .unwrap_or_default();
    assert_eq!(
        container_env(deployment)
            .iter()
            .find(|(k, _)| k == "ANTIDOTE_K8S_METRICS_LISTEN")
            .map(|(_, v)| v.as_str()),
        Some(format!("0.0.0.0:{metrics_port}").as_str()),
        "the probes' port is where the agent serves /healthz ({metrics_listen})"
    );
    let metrics = agent
        .extra_url("metrics")
        .expect("the agent serves metrics");
    for probe in ["readinessProbe", "livenessProbe"] {
        let get = &container[probe]["httpGet"];
        assert!(
            get["port"] == "metrics" || get["port"] == metrics_port,
            "{probe} should ask the metrics port over HTTP: {}",
            container[probe]
        );
        let path = get["path"].as_str().unwrap();
        let answer = antidote_tests::web::Web::default()
            .get(&format!("{metrics}{path}"))
            .await
            .expect("the probe's GET");
        assert!(answer.status.is_success(), "{probe}: {}", answer.status);
    }

    // The scheduler with its ConfigMap, dialling this agent instead of the Service (the
    // certificate is still checked against the Service's name), with the TLS files where the
    // Secret would be; and an impostor: the agent's own certificate, of the same CA, offered
    // as a client certificate.
    let mut config = scheduler_config(&docs);
    let service = agent_service(&docs);
    let address = format!("address = \"https://{service}\"");
    assert!(config.contains(&address), "{config}");
    config = config.replace(&address, &format!("address = \"https://127.0.0.1:{port}\""));
    for (deployment, _, path, _, _) in &files {
        if *deployment == "scheduler-svc" {
            config = config.replace(
                &format!("\"{path}\""),
                &format!("\"{}\"", local(deployment, path)),
            );
        }
    }
    let tls = config
        .lines()
        .find(|line| line.trim_start().starts_with("tls = {"))
        .unwrap()
        .to_owned();
    let agent_secret_dir = secrets.join(&agent_secret);
    let impostor = tls
        .replace(
            toml_string(&tls, "cert").unwrap(),
            &agent_secret_dir.join("tls.crt").display().to_string(),
        )
        .replace(
            toml_string(&tls, "key").unwrap(),
            &agent_secret_dir.join("tls.key").display().to_string(),
        );
    config += &format!(
        "\n[[agents]]\nname = \"impostor\"\naddress = \"https://127.0.0.1:{port}\"\n{}\n",
        impostor.trim()
    );
    let scheduler_dir = dir.path().join("scheduler");
    std::fs::create_dir_all(&scheduler_dir).unwrap();
    let (mut scheduler, clients) = start_scheduler(&scheduler_dir, &config).await;
    let (scheduler_log, agent_log) = (scheduler.log.clone(), agent.log.clone());
    let logs = || {
        let read = |path: &PathBuf| std::fs::read_to_string(path).unwrap_or_default();
        format!(
            "--- scheduler ---\n{}\n--- agent-k8s ---\n{}",
            read(&scheduler_log),
            read(&agent_log)
        )
    };

    // The scheduler reaches the agent over mTLS and sees the agent's certificate.
    let (agent_names, agent_leaf) = &leaves[&agent_secret];
    let k8s = wait_agent(
        &clients,
        "k8s",
        |a| a.state() == api::AgentState::Ready && !a.tls_peer_sha256.is_empty(),
        logs,
    )
    .await;
    assert_eq!(k8s.tls_peer_sha256, agent_leaf.sha256());
    assert_eq!(&k8s.tls_peer_names, agent_names);
    assert_eq!(k8s.tls_error, "");

    // Everyone else is refused in the handshake, and the agent says why.
    let impostor = wait_agent(
        &clients,
        "impostor",
        |a| a.tls_error.contains("the peer refused the handshake"),
        logs,
    )
    .await;
    assert_ne!(impostor.state(), api::AgentState::Ready, "{impostor:?}");
    let not_valid = format!("certificate is not valid for {}", identity_name(&identity));
    agent.until_logged(&not_valid, PATIENCE).await.unwrap();

    let plaintext = antidote_proto::agent::v1::backend_client::BackendClient::connect(format!(
        "http://127.0.0.1:{port}"
    ))
    .await
    .expect("TCP and HTTP/2 setup is lazy enough to connect")
    .handshake(antidote_proto::agent::v1::HandshakeRequest::default())
    .await;
    assert!(plaintext.is_err(), "{plaintext:?}");
    agent
        .until_logged("the peer does not speak TLS (plaintext?)", PATIENCE)
        .await
        .unwrap();

    // A TLS client that trusts the agent but has no certificate of its own.
    let host = service.split(':').next().unwrap();
    let no_cert = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::process::Command::new("openssl")
            .args([
                "s_client",
                "-connect",
                &format!("127.0.0.1:{port}"),
                "-servername",
                host,
                "-verify_hostname",
                host,
                "-verify_return_error",
                "-CAfile",
            ])
            .arg(agent_secret_dir.join("ca.crt"))
            .args(["-alpn", "h2"])
            .stdin(std::process::Stdio::null())
            .output(),
    )
    .await
    .expect("openssl s_client finishes")
    .expect("openssl runs (tests/run installs it)");
    agent
        .until_logged("no client certificate presented", PATIENCE)
        .await
        .unwrap();
    println!("{}", String::from_utf8_lossy(&no_cert.stdout));

    let status = scheduler.terminate().await.expect("the scheduler stops");
    assert!(status.success(), "{status}\n{}", logs());
    let status = agent.terminate().await.expect("agent-k8s stops");
    assert!(status.success(), "{status}\n{}", agent.log_text());
}
