//! `deploy/k8s/postgres-ha` (three scheduler replicas on PostgreSQL) and the PostgreSQL service
//! of `deploy/compose`: the component over the base passes the same strict server-side dry run
//! as `deploy.rs`'s manifests (the test control plane, KUBECONFIG from `tests/run`), renders
//! what it promises (3 replicas, the URL from a Secret, a PodDisruptionBudget, no SQLite
//! volume, readiness on the database), and the readiness it relies on is real: a scheduler
//! whose database disappears reports its API NOT_SERVING while the process stays live.

use std::path::{Component, Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use antidote_tests::config::{Agent, SchedulerConfig};
use antidote_tests::example_curriculum;
use serde_json::Value;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use crate::deploy::{dry_run, dry_run_count, k8s_dir, kubectl_binary, prepare_namespaces, repo};
use crate::postgres::{TestDatabase, psql, start_on};
use crate::{PATIENCE, start_agent};

/// `to` relative to the directory `from` (kustomize takes relative paths only).
fn relative(from: &Path, to: &Path) -> PathBuf {
    let from: Vec<Component> = from.components().collect();
    let to: Vec<Component> = to.components().collect();
    let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
    let mut path = PathBuf::new();
    for _ in common..from.len() {
        path.push("..");
    }
    for part in &to[common..] {
        path.push(part.as_os_str());
    }
    path
}

/// An overlay of the base with the postgres-ha component, in a directory of its own.
fn overlay() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let here = dir.path().canonicalize().unwrap();
    let base = k8s_dir().canonicalize().unwrap();
    let kustomization = format!(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - {}\n\
         components:\n  - {}\n",
        relative(&here, &base).display(),
        relative(&here, &base.join("postgres-ha")).display()
    );
    std::fs::write(dir.path().join("kustomization.yaml"), kustomization).unwrap();
    dir
}

/// What kustomize renders for the overlay (no cluster needed).
fn render() -> Vec<Value> {
    let dir = overlay();
    let output = Command::new(kubectl_binary())
        .arg("kustomize")
        .arg(dir.path())
        .output()
        .expect("kubectl runs");
    assert!(
        output.status.success(),
        "kustomize failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_yaml::Deserializer::from_str(&String::from_utf8(output.stdout).unwrap())
        .map(|document| serde::Deserialize::deserialize(document).unwrap())
        .filter(|value: &Value| !value.is_null())
        .collect()
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> Option<&'a Value> {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
}

#[test]
fn postgres_ha_passes_a_strict_server_dry_run_and_renders_what_it_promises() {
    let docs = render();
    let deployment =
        find(&docs, "Deployment", "scheduler-svc").expect("the scheduler's Deployment");
    let spec = &deployment["spec"];
    assert_eq!(spec["replicas"], 3, "{deployment}");
    assert_eq!(spec["strategy"]["type"], "RollingUpdate", "{deployment}");
    let pod = &spec["template"]["spec"];
    let container = &pod["containers"][0];
    let env = container["env"].as_array().unwrap();
    let database = env
        .iter()
        .find(|e| e["name"] == "ANTIDOTE_DATABASE")
        .expect("ANTIDOTE_DATABASE is set");
    assert_eq!(
        database["valueFrom"]["secretKeyRef"],
        serde_json::json!({"name": "scheduler-database", "key": "url"}),
        "the URL comes from the Secret"
    );
    // No SQLite volume, no PVC.
    assert!(find(&docs, "PersistentVolumeClaim", "scheduler-data").is_none());
    let volumes: Vec<_> = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| &v["name"])
        .collect();
    assert!(!volumes.contains(&&Value::from("data")), "{volumes:?}");
    let mounts: Vec<_> = container["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["mountPath"].as_str().unwrap())
        .collect();
    assert!(!mounts.contains(&"/var/lib/antidote"), "{mounts:?}");
    // Readiness asks for the API (which follows the database); liveness for the process.
    assert_eq!(
        container["readinessProbe"]["grpc"]["service"],
        "antidote.api.v1.LiveLessonService"
    );
    assert!(container["livenessProbe"]["grpc"]["service"].is_null());
    // The budget keeps two of the three, and selects the scheduler's pods.
    let pdb = find(&docs, "PodDisruptionBudget", "scheduler-svc").expect("a PodDisruptionBudget");
    assert_eq!(pdb["spec"]["minAvailable"], 2);
    let labels = &spec["template"]["metadata"]["labels"];
    for (key, value) in pdb["spec"]["selector"]["matchLabels"].as_object().unwrap() {
        assert_eq!(
            &labels[key], value,
            "the budget selects the scheduler's pods"
        );
    }

    prepare_namespaces();
    let overlay = overlay();
    let (ok, output) = dry_run(&["-k", overlay.path().to_str().unwrap()]);
    assert!(ok, "the postgres-ha variant was refused:\n{output}");
    assert_eq!(dry_run_count(&output), docs.len(), "{output}");
    println!("{output}");
}

#[test]
fn compose_has_an_opt_in_postgres_service_the_scheduler_can_use() {
    let compose: Value = serde_yaml::from_str(
        &std::fs::read_to_string(repo().join("deploy/compose/compose.yaml")).unwrap(),
    )
    .unwrap();
    let postgres = &compose["services"]["postgres"];
    assert_eq!(
        postgres["profiles"],
        serde_json::json!(["postgres"]),
        "opt-in"
    );
    assert!(postgres["image"].as_str().unwrap().starts_with("postgres:"));
    assert!(
        postgres["command"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a == "listen_addresses=127.0.0.1"),
        "loopback only, like the rest"
    );
    assert!(
        compose["volumes"]
            .as_object()
            .unwrap()
            .contains_key("postgres-data")
    );
    let database = compose["services"]["scheduler"]["environment"]["ANTIDOTE_DATABASE"]
        .as_str()
        .unwrap();
    assert!(
        database.contains("ANTIDOTE_DATABASE") && database.contains("antidote.db"),
        "SQLite unless the operator sets ANTIDOTE_DATABASE: {database}"
    );
}

async fn status(channel: tonic::transport::Channel, service: &str) -> ServingStatus {
    let response = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: service.into(),
        })
        .await
        .unwrap()
        .into_inner();
    response.status()
}

/// The readiness the component's probe asks for follows the database: it goes NOT_SERVING when
/// the scheduler's database is dropped under it (connections killed), while `""`, the liveness
/// probe's, stays SERVING.
#[tokio::test]
async fn the_api_is_not_ready_while_its_database_is_gone() {
    let database = TestDatabase::create();
    let dir = tempfile::tempdir().expect("temp dir");
    let agent = start_agent(&dir, &[], &dir.path().join("journal"), None).await;
    let config = SchedulerConfig::new("e2e-ha", &example_curriculum())
        .with_agent(Agent::new("loopback", agent.url()))
        .to_toml();
    let scheduler = start_on(dir.path(), &database.url, &config).await;
    let channel = scheduler.clients.channel.clone();
    const API: &str = "antidote.api.v1.LiveLessonService";
    assert_eq!(status(channel.clone(), API).await, ServingStatus::Serving);

    psql(&format!("DROP DATABASE {} WITH (FORCE)", database.name));
    let not_serving = tokio::time::timeout(PATIENCE, async {
        while status(channel.clone(), API).await != ServingStatus::NotServing {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    assert!(
        not_serving.is_ok(),
        "still serving without a database\n{}",
        scheduler.process.log_text()
    );
    assert_eq!(
        status(channel, "").await,
        ServingStatus::Serving,
        "the process lives"
    );
}
