//! Mesh mode: the kustomize components in `deploy/k8s/mesh` (Linkerd, Istio) on top of the base
//! manifests. No mesh runs here, so two kinds of check:
//!
//! - Against the test kube-apiserver: each variant (the base plus one component, built by an
//!   overlay of the kind an operator writes) passes the same strict server-side dry run as the
//!   base (`deploy.rs`), with the meshes' policy CRDs installed from
//!   `tests/fixtures/mesh-crds` so that the policy objects are validated field by field, not
//!   waved through. Deliberately broken policies must be refused. The CRDs are removed at the
//!   end, so other tests see the cluster as before.
//! - On the rendered manifests: the mesh policies admit the scheduler's identity alone to the
//!   agent's gRPC port, the probes still work behind the sidecar, the agent opts in to plaintext
//!   only here, and the base is not meshed. The base's own mTLS (its TLS Secrets, the agent's
//!   TLS variables, the scheduler's https:// address) is gone from every variant, and the real
//!   scheduler with a variant's configuration reaches the real agent-k8s with that variant's
//!   environment in plaintext.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use super::deploy::{
    self, FixtureCrds, agent_service, container_env, documents, dry_run, dry_run_count, find,
    k8s_dir, prepare_namespaces, relative, scheduler_accepts, scheduler_config, start_agent_k8s,
    start_scheduler, to_yaml, wait_agent,
};
use antidote_proto::api::v1 as api;

/// The fixture CRDs of the meshes (`tests/fixtures/mesh-crds`).
const MESH_CRDS: &str = "mesh-crds";

/// The agent's mTLS settings in the base (`--tls-*`, proto/net/src/tls.rs).
const TLS_ENV: [&str; 4] = [
    "ANTIDOTE_AGENT_TLS_CERT",
    "ANTIDOTE_AGENT_TLS_KEY",
    "ANTIDOTE_AGENT_TLS_CLIENT_CA",
    "ANTIDOTE_AGENT_TLS_REQUIRE_IDENTITY",
];

/// The Secrets Deployment `name` mounts.
fn secret_volumes(docs: &[Value], name: &str) -> Vec<String> {
    find(docs, "Deployment", name)["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v["secret"]["secretName"].as_str().map(str::to_owned))
        .collect()
}

/// The mesh variants, by their component's directory under `deploy/k8s/mesh`.
const MESHES: [&str; 2] = ["linkerd", "istio"];

/// The environment variable by which the SDK's agents opt in to plaintext on a non-loopback
/// address (`--insecure-plaintext`, proto/net/src/tls.rs).
const PLAINTEXT_ENV: &str = "ANTIDOTE_AGENT_INSECURE_PLAINTEXT";

/// The component directories under deploy/k8s of `mesh` (`None`: the base alone).
fn components(mesh: Option<&str>) -> Vec<String> {
    mesh.map(|mesh| format!("mesh/{mesh}"))
        .into_iter()
        .collect()
}

/// An overlay as an operator would write it (the base plus one mesh component, or the base
/// alone), in a temporary directory.
fn overlay(mesh: Option<&str>) -> tempfile::TempDir {
    let components = components(mesh);
    deploy::overlay(&components.iter().map(String::as_str).collect::<Vec<_>>())
}

/// The manifests kustomize renders for `mesh` (`None`: the base alone). Needs no cluster.
fn render(mesh: Option<&str>) -> Vec<Value> {
    let components = components(mesh);
    deploy::render(&components.iter().map(String::as_str).collect::<Vec<_>>())
}

fn all<'a>(docs: &'a [Value], api_version: &str, kind: &str) -> Vec<&'a Value> {
    docs.iter()
        .filter(|d| d["apiVersion"] == api_version && d["kind"] == kind)
        .collect()
}

/// The pod template's labels or annotations (`field`) of Deployment `name`.
fn pod_meta<'a>(docs: &'a [Value], name: &str, field: &str) -> &'a Value {
    &find(docs, "Deployment", name)["spec"]["template"]["metadata"][field]
}

/// Whether a selector's `matchLabels` all hold in `labels`.
fn selects(match_labels: &Value, labels: &Value) -> bool {
    let wanted = match_labels.as_object().expect("matchLabels");
    !wanted.is_empty() && wanted.iter().all(|(k, v)| &labels[k] == v)
}

/// What the rendered manifests say about the two workloads that matter.
struct Workloads<'a> {
    namespace: &'a str,
    /// The scheduler's ServiceAccount.
    scheduler_account: &'a str,
    scheduler_labels: &'a Value,
    agent_labels: &'a Value,
    /// The agent's gRPC container port: its name and number.
    agent_port: (&'a str, u64),
    agent_env: Vec<(&'a str, &'a str)>,
}

fn workloads(docs: &[Value]) -> Workloads<'_> {
    let scheduler = find(docs, "Deployment", "scheduler-svc");
    let agent = find(docs, "Deployment", "agent-k8s");
    let container = &agent["spec"]["template"]["spec"]["containers"][0];
    let port = container["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "grpc")
        .expect("the agent's container has a port named grpc");
    let number = port["containerPort"].as_u64().unwrap();
    let plaintext = container_env(agent)
        .iter()
        .any(|(k, v)| k == PLAINTEXT_ENV && v == "true");
    for probe in ["readinessProbe", "livenessProbe"] {
        if plaintext {
            // The probes that must keep working behind a sidecar: native gRPC probes of that
            // port.
            assert_eq!(
                container[probe]["grpc"]["port"].as_u64(),
                Some(number),
                "the agent's {probe} should be a gRPC probe of its gRPC port: {}",
                container[probe]
            );
            assert!(container[probe].get("httpGet").is_none(), "{probe}");
        } else {
            // The kubelet cannot do mTLS: HTTP probes of the metrics port (deploy.rs checks
            // that they answer).
            assert_eq!(
                container[probe]["httpGet"]["port"], "metrics",
                "the agent's {probe} should ask the metrics port: {}",
                container[probe]
            );
            assert!(container[probe].get("grpc").is_none(), "{probe}");
        }
    }
    Workloads {
        namespace: agent["metadata"]["namespace"].as_str().unwrap(),
        scheduler_account: scheduler["spec"]["template"]["spec"]["serviceAccountName"]
            .as_str()
            .unwrap_or("default"),
        scheduler_labels: &scheduler["spec"]["template"]["metadata"]["labels"],
        agent_labels: &agent["spec"]["template"]["metadata"]["labels"],
        agent_port: (port["name"].as_str().unwrap(), number),
        agent_env: container["env"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|e| {
                (
                    e["name"].as_str().unwrap(),
                    e["value"].as_str().unwrap_or_default(),
                )
            })
            .collect(),
    }
}

/// The ports of SSH presentations in the example curriculum (they must bypass the sidecars).
fn ssh_ports() -> BTreeSet<String> {
    fn walk(value: &serde_yaml::Value, ports: &mut BTreeSet<String>) {
        match value {
            serde_yaml::Value::Mapping(map) => {
                if map.get("type").and_then(|t| t.as_str()) == Some("ssh")
                    && let Some(port) = map.get("port").and_then(|p| p.as_u64())
                {
                    ports.insert(port.to_string());
                }
                map.values().for_each(|v| walk(v, ports));
            }
            serde_yaml::Value::Sequence(items) => items.iter().for_each(|v| walk(v, ports)),
            _ => {}
        }
    }
    let mut ports = BTreeSet::new();
    let lessons = antidote_tests::example_curriculum().join("lessons");
    for lesson in std::fs::read_dir(lessons).unwrap() {
        let meta = lesson.unwrap().path().join("lesson.meta.yaml");
        if let Ok(text) = std::fs::read_to_string(&meta) {
            walk(&serde_yaml::from_str(&text).unwrap(), &mut ports);
        }
    }
    assert!(
        !ports.is_empty(),
        "the example curriculum has SSH presentations"
    );
    ports
}

fn port_list(annotation: &Value) -> BTreeSet<String> {
    annotation
        .as_str()
        .unwrap_or_default()
        .split(',')
        .map(|p| p.trim().to_owned())
        .filter(|p| !p.is_empty())
        .collect()
}

#[test]
fn mesh_components_pass_a_strict_server_dry_run() {
    prepare_namespaces();
    let _crds = FixtureCrds::install(MESH_CRDS);
    let dir = tempfile::tempdir().unwrap();
    for mesh in MESHES {
        let objects = render(Some(mesh)).len();
        let overlay = overlay(Some(mesh));
        let (ok, output) = dry_run(&["-k", overlay.path().to_str().unwrap()]);
        assert!(ok, "the {mesh} variant was refused:\n{output}");
        assert_eq!(
            dry_run_count(&output),
            objects,
            "every object of the {mesh} variant should be dry-run applied:\n{output}"
        );
        println!("{output}");

        // Each policy file alone too, as `kubectl apply -f` of just the policy would send it.
        let policy = k8s_dir().join("mesh").join(mesh).join("policy.yaml");
        let (ok, output) = dry_run(&["-f", policy.to_str().unwrap()]);
        assert!(ok, "{} was refused:\n{output}", policy.display());
        assert_eq!(dry_run_count(&output), documents(&policy).len(), "{output}");
    }

    // The CRDs really validate: broken policies are refused, each for its own reason.
    type Edit = fn(&mut Value);
    let breakages: [(&str, &str, &str, Edit, &str); 5] = [
        (
            "istio",
            "AuthorizationPolicy",
            "a misspelt field in an Istio source",
            |p| p["spec"]["rules"][0]["from"][0]["source"]["principal"] = json!(["x"]),
            r#"unknown field "spec.rules[0].from[0].source.principal""#,
        ),
        (
            "istio",
            "AuthorizationPolicy",
            "an action Istio does not have",
            |p| p["spec"]["action"] = json!("PERMIT"),
            r#"Unsupported value: "PERMIT""#,
        ),
        (
            "istio",
            "PeerAuthentication",
            "port-level mTLS without a selector (a CEL rule of the CRD)",
            |p| {
                p["spec"].as_object_mut().unwrap().remove("selector");
            },
            "portLevelMtls requires selector",
        ),
        (
            "linkerd",
            "HTTPRoute",
            "a path match type the Gateway API does not have",
            |r| r["spec"]["rules"][0]["matches"][0]["path"]["type"] = json!("Prefix"),
            r#"Unsupported value: "Prefix""#,
        ),
        (
            "linkerd",
            "MeshTLSAuthentication",
            "both identities and identityRefs",
            |m| m["spec"]["identities"] = json!(["*"]),
            "must validate one and only one schema (oneOf)",
        ),
    ];
    for (mesh, kind, what, edit, refusal) in breakages {
        let mut docs = documents(&k8s_dir().join("mesh").join(mesh).join("policy.yaml"));
        let object = docs
            .iter_mut()
            .find(|d| d["kind"] == kind)
            .unwrap_or_else(|| panic!("{mesh}/policy.yaml has no {kind}"));
        edit(object);
        let file = dir.path().join(format!("{mesh}-{kind}.yaml"));
        std::fs::write(&file, to_yaml(&docs)).unwrap();
        let (ok, output) = dry_run(&["-f", file.to_str().unwrap()]);
        assert!(!ok, "{what} ({mesh} {kind}) was accepted:\n{output}");
        assert!(
            output.contains(refusal),
            "{what} ({mesh} {kind}): kubectl should say {refusal:?}:\n{output}"
        );
    }
}

#[test]
fn mesh_mode_is_opt_in_and_every_variant_makes_the_agent_plaintext_behind_its_sidecar() {
    let base = render(None);
    let w = workloads(&base);
    for name in ["scheduler-svc", "agent-k8s"] {
        for field in ["annotations", "labels"] {
            let meta = pod_meta(&base, name, field).to_string();
            assert!(
                !meta.contains("linkerd.io/inject") && !meta.contains("sidecar.istio.io/inject"),
                "the base meshes {name}: {meta}"
            );
        }
    }
    assert!(
        !w.agent_env.iter().any(|(k, _)| *k == PLAINTEXT_ENV),
        "the base agent serves plaintext on the pod network without a mesh: {:?}",
        w.agent_env
    );
    // The base does mTLS of its own (deploy.rs checks that it works).
    for variable in TLS_ENV {
        assert!(
            w.agent_env.iter().any(|(k, _)| *k == variable),
            "the base agent has no {variable}: {:?}",
            w.agent_env
        );
    }
    assert_eq!(secret_volumes(&base, "agent-k8s"), ["agent-k8s-tls"]);
    assert_eq!(
        secret_volumes(&base, "scheduler-svc"),
        ["scheduler-agent-client-tls", "scheduler-entrypoint-keys"]
    );
    assert!(
        scheduler_config(&base).contains(&format!("\"https://{}\"", agent_service(&base))),
        "{}",
        scheduler_config(&base)
    );

    for mesh in MESHES {
        let docs = render(Some(mesh));
        // No TLS Secret anywhere: nothing issues one in a mesh, and a pod would wait for it.
        // (The entrypoint signing key is the operator's, mesh or not.)
        assert_eq!(
            secret_volumes(&docs, "agent-k8s"),
            Vec::<String>::new(),
            "{mesh}: agent-k8s"
        );
        assert_eq!(
            secret_volumes(&docs, "scheduler-svc"),
            ["scheduler-entrypoint-keys"],
            "{mesh}: scheduler-svc"
        );
        let w = workloads(&docs);
        assert_eq!(
            w.agent_env
                .iter()
                .filter(|(k, _)| *k == PLAINTEXT_ENV)
                .map(|(_, v)| *v)
                .collect::<Vec<_>>(),
            ["true"],
            "{mesh}: the agent opts in to plaintext once: {:?}",
            w.agent_env
        );
        let tls: Vec<_> = w
            .agent_env
            .iter()
            .filter(|(k, _)| k.starts_with("ANTIDOTE_AGENT_TLS_"))
            .collect();
        assert!(
            tls.is_empty(),
            "{mesh}: TLS settings contradict {PLAINTEXT_ENV}: {tls:?}"
        );
        // The scheduler has an identity of its own, which the mesh policies name.
        assert_ne!(w.scheduler_account, "default", "{mesh}");
        let account = find(&docs, "ServiceAccount", w.scheduler_account);
        assert_eq!(account["metadata"]["namespace"], w.namespace, "{mesh}");
        assert_eq!(account["automountServiceAccountToken"], false, "{mesh}");
        // Services name their gRPC ports and say it is gRPC, for the mesh's protocol detection.
        for service in ["scheduler-svc", "agent-k8s"] {
            let ports = find(&docs, "Service", service)["spec"]["ports"]
                .as_array()
                .unwrap();
            let grpc = ports
                .iter()
                .find(|p| p["name"] == "grpc")
                .unwrap_or_else(|| panic!("{mesh}: Service {service} has no grpc port"));
            assert_eq!(grpc["appProtocol"], "grpc", "{mesh}: {service}");
        }
    }
}

/// The environment a variant (`None`: the base) gives agent-k8s's container.
fn agent_env(mesh: Option<&str>) -> Vec<(String, String)> {
    container_env(find(&render(mesh), "Deployment", "agent-k8s"))
}

/// The scheduler's configuration with its `[[agents]]` tables cut off (they come last).
fn before_agents(config: &str) -> &str {
    let at = config
        .find("[[agents]]")
        .unwrap_or_else(|| panic!("no [[agents]] in:\n{config}"));
    // The comment lines just above the table belong to it.
    let head = &config[..at];
    let mut end = head.len();
    for line in head.lines().rev() {
        if line.trim_start().starts_with('#') {
            end -= line.len() + 1;
        } else {
            break;
        }
    }
    &config[..end]
}

#[tokio::test]
async fn the_agent_serves_plaintext_on_the_pod_network_only_in_mesh_mode() {
    let dir = tempfile::tempdir().unwrap();
    // The base without its TLS settings and without the opt-in: the agent refuses to serve
    // plaintext on a non-loopback address.
    let without_tls: Vec<_> = agent_env(None)
        .into_iter()
        .filter(|(k, _)| !k.starts_with("ANTIDOTE_AGENT_TLS_"))
        .collect();
    let refused = start_agent_k8s(dir.path(), "base-without-tls", &without_tls)
        .await
        .err()
        .expect("the base agent started in plaintext on all interfaces");
    assert!(
        format!("{refused:#}").contains("--insecure-plaintext"),
        "the refusal should name the opt-in: {refused:#}"
    );
    // The opt-in on top of the base's TLS settings: refused too, which is why the mesh
    // components take those out.
    let mut both = agent_env(None);
    both.push((PLAINTEXT_ENV.to_owned(), "true".to_owned()));
    let refused = start_agent_k8s(dir.path(), "base-and-opt-in", &both)
        .await
        .err()
        .expect("the agent started with both TLS files and the plaintext opt-in");
    assert!(
        format!("{refused:#}").contains("--insecure-plaintext contradicts"),
        "{refused:#}"
    );

    // Each mesh variant: the opt-in its component sets is the one the agent knows, and the
    // scheduler with the variant's configuration reaches the agent in plaintext.
    for mesh in MESHES {
        let mut agent = start_agent_k8s(dir.path(), mesh, &agent_env(Some(mesh)))
            .await
            .unwrap_or_else(|e| panic!("agent-k8s of the {mesh} variant did not start: {e:#}"));
        assert!(agent.addr.ip().is_unspecified(), "{mesh}: {}", agent.addr);
        assert!(
            agent.log_text().contains("--insecure-plaintext"),
            "{mesh}: the agent should warn loudly that it serves plaintext:\n{}",
            agent.log_text()
        );

        let docs = render(Some(mesh));
        let address = format!("address = \"http://{}\"", agent_service(&docs));
        let config = scheduler_config(&docs);
        assert!(config.contains(&address), "{mesh}:\n{config}");
        let config = config.replace(
            &address,
            &format!("address = \"http://127.0.0.1:{}\"", agent.addr.port()),
        );
        let scheduler_dir = dir.path().join(format!("scheduler-{mesh}"));
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
        let k8s = wait_agent(
            &clients,
            "k8s",
            |a| a.state() == api::AgentState::Ready,
            logs,
        )
        .await;
        assert_eq!(k8s.tls_peer_sha256, "", "{mesh}: {k8s:?}");

        let status = scheduler.terminate().await.expect("the scheduler stops");
        assert!(status.success(), "{mesh}: {status}\n{}", logs());
        let status = agent.terminate().await.expect("agent-k8s stops");
        assert!(status.success(), "{mesh}: {status}\n{}", agent.log_text());
    }
}

#[tokio::test]
async fn every_variant_gives_the_scheduler_its_base_configuration_but_for_the_agent() {
    let base = render(None);
    let base_config = scheduler_config(&base);
    scheduler_accepts("the base's ConfigMap", &base_config).await;
    for mesh in MESHES {
        let docs = render(Some(mesh));
        let config = scheduler_config(&docs);
        // Plaintext to the agent's Service, no client certificate.
        assert!(
            config.contains(&format!("address = \"http://{}\"", agent_service(&docs))),
            "{mesh}:\n{config}"
        );
        let agents = &config[before_agents(&config).len()..];
        assert!(
            !agents.contains("https://")
                && !agents
                    .lines()
                    .any(|l| l.trim_start().starts_with("tls") || l.contains("[agents.tls]")),
            "{mesh}: the scheduler still dials with TLS:\n{agents}"
        );
        // The rest is the base's, word for word: the component replaces the whole file.
        assert_eq!(
            before_agents(&config),
            before_agents(&base_config),
            "{mesh}: deploy/k8s/mesh/common/scheduler-plaintext.yaml has drifted from \
             deploy/k8s/scheduler.yaml's antidote.toml"
        );
        assert_eq!(config.matches("[[agents]]").count(), 1, "{mesh}");
        scheduler_accepts(&format!("the {mesh} variant's ConfigMap"), &config).await;
    }
}

#[test]
fn linkerd_admits_only_the_scheduler_and_the_kubelets_health_checks() {
    let docs = render(Some("linkerd"));
    let w = workloads(&docs);
    for name in ["scheduler-svc", "agent-k8s"] {
        assert_eq!(
            pod_meta(&docs, name, "annotations")["linkerd.io/inject"],
            "enabled",
            "{name}"
        );
    }
    let skipped = port_list(
        &pod_meta(&docs, "agent-k8s", "annotations")["config.linkerd.io/skip-outbound-ports"],
    );
    assert!(
        ssh_ports().is_subset(&skipped),
        "SSH presentations ({:?}) must skip the agent's proxy: {skipped:?}",
        ssh_ports()
    );

    // One Server covers the agent's gRPC port, and only the agent's.
    let servers = all(&docs, "policy.linkerd.io/v1beta3", "Server");
    let covering: Vec<_> = servers
        .iter()
        .filter(|s| {
            selects(&s["spec"]["podSelector"]["matchLabels"], w.agent_labels)
                && (s["spec"]["port"] == w.agent_port.0 || s["spec"]["port"] == w.agent_port.1)
        })
        .collect();
    assert_eq!(covering.len(), 1, "{servers:#?}");
    let server = covering[0];
    assert!(!selects(
        &server["spec"]["podSelector"]["matchLabels"],
        w.scheduler_labels
    ));
    assert_eq!(server["spec"]["proxyProtocol"], "gRPC");
    assert!(matches!(
        server["spec"]["accessPolicy"].as_str(),
        None | Some("deny")
    ));
    let server_name = server["metadata"]["name"].as_str().unwrap();

    // Its routes, each with the authentications its policies require.
    let routes: Vec<_> = all(&docs, "policy.linkerd.io/v1beta3", "HTTPRoute")
        .into_iter()
        .filter(|r| {
            r["spec"]["parentRefs"]
                .as_array()
                .unwrap()
                .iter()
                .any(|p| p["kind"] == "Server" && p["name"] == server_name)
        })
        .collect();
    let policies = all(&docs, "policy.linkerd.io/v1alpha1", "AuthorizationPolicy");
    assert!(
        !policies
            .iter()
            .any(|p| p["spec"]["targetRef"]["kind"] != "HTTPRoute"),
        "with routes on the Server, every policy should target a route: {policies:#?}"
    );
    let authentications = |route: &Value| -> Vec<&Value> {
        let name = &route["metadata"]["name"];
        policies
            .iter()
            .filter(|p| p["spec"]["targetRef"]["name"] == *name)
            .flat_map(|p| p["spec"]["requiredAuthenticationRefs"].as_array().unwrap())
            .map(|r| {
                find(
                    &docs,
                    r["kind"].as_str().unwrap(),
                    r["name"].as_str().unwrap(),
                )
            })
            .collect()
    };
    let prefixes = |route: &Value| -> Vec<String> {
        route["spec"]["rules"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|rule| rule["matches"].as_array().unwrap())
            .map(|m| {
                assert_eq!(m["path"]["type"], "PathPrefix", "{route}");
                m["path"]["value"].as_str().unwrap().to_owned()
            })
            .collect()
    };
    let mut seen = BTreeSet::new();
    for route in &routes {
        let authentications = authentications(route);
        assert_eq!(authentications.len(), 1, "{route}: {authentications:#?}");
        let authentication = authentications[0];
        for prefix in prefixes(route) {
            seen.insert(prefix.clone());
            if prefix == "/grpc.health.v1.Health" {
                // The kubelet, from wherever: health alone.
                assert_eq!(authentication["kind"], "NetworkAuthentication", "{route}");
            } else {
                // Everything else: the scheduler's mesh identity alone.
                assert_eq!(authentication["kind"], "MeshTLSAuthentication", "{route}");
                assert_eq!(
                    authentication["spec"],
                    json!({"identityRefs": [{"kind": "ServiceAccount", "name": w.scheduler_account}]}),
                    "{route}"
                );
                assert_eq!(authentication["metadata"]["namespace"], w.namespace);
            }
        }
    }
    assert_eq!(
        seen,
        BTreeSet::from(["/".to_owned(), "/grpc.health.v1.Health".to_owned()]),
        "the routes should cover health and everything else"
    );
}

#[test]
fn istio_admits_only_the_scheduler_over_mtls() {
    let docs = render(Some("istio"));
    let w = workloads(&docs);
    for name in ["scheduler-svc", "agent-k8s"] {
        assert_eq!(
            pod_meta(&docs, name, "labels")["sidecar.istio.io/inject"],
            "true",
            "{name}"
        );
        let annotations = pod_meta(&docs, name, "annotations");
        // Istio rewrites the gRPC probes to its agent on 15020 unless told not to.
        assert_ne!(
            annotations["sidecar.istio.io/rewriteAppHTTPProbers"], "false",
            "{name}"
        );
        let config: Value =
            serde_json::from_str(annotations["proxy.istio.io/config"].as_str().unwrap()).unwrap();
        assert_eq!(config["holdApplicationUntilProxyStarts"], true, "{name}");
    }
    let excluded = port_list(
        &pod_meta(&docs, "agent-k8s", "annotations")["traffic.sidecar.istio.io/excludeOutboundPorts"],
    );
    assert!(
        ssh_ports().is_subset(&excluded),
        "SSH presentations ({:?}) must bypass the agent's sidecar: {excluded:?}",
        ssh_ports()
    );

    let port = w.agent_port.1.to_string();
    let principal = format!(
        "cluster.local/ns/{}/sa/{}",
        w.namespace, w.scheduler_account
    );
    let policies: Vec<_> = all(&docs, "security.istio.io/v1", "AuthorizationPolicy")
        .into_iter()
        .filter(|p| selects(&p["spec"]["selector"]["matchLabels"], w.agent_labels))
        .collect();
    assert_eq!(policies.len(), 1, "{policies:#?}");
    let policy = policies[0];
    assert!(!selects(
        &policy["spec"]["selector"]["matchLabels"],
        w.scheduler_labels
    ));
    assert_eq!(policy["spec"]["action"], "ALLOW");
    // Every rule that opens the gRPC port names the scheduler alone; at least one does.
    let rules = policy["spec"]["rules"].as_array().unwrap();
    let mut opening = 0;
    for rule in rules {
        let ports: Vec<&Value> = rule["to"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|to| to["operation"]["ports"].as_array().into_iter().flatten())
            .collect();
        if ports.is_empty() || ports.iter().any(|p| **p == port) {
            opening += 1;
            assert_eq!(
                rule["from"],
                json!([{"source": {"principals": [principal]}}]),
                "a rule opens port {port} to more than {principal}: {rule}"
            );
            assert!(rule.get("when").is_none(), "{rule}");
        }
    }
    assert_eq!(opening, 1, "{rules:#?}");

    let strict: Vec<_> = all(&docs, "security.istio.io/v1", "PeerAuthentication")
        .into_iter()
        .filter(|p| selects(&p["spec"]["selector"]["matchLabels"], w.agent_labels))
        .collect();
    assert_eq!(strict.len(), 1, "{strict:#?}");
    assert_eq!(strict[0]["spec"]["portLevelMtls"][&port]["mode"], "STRICT");
}

#[test]
fn relative_paths_climb_to_the_common_ancestor() {
    let check = |from: &str, to: &str, expect: &str| {
        assert_eq!(
            relative(Path::new(from), Path::new(to)),
            PathBuf::from(expect)
        );
    };
    check(
        "/tmp/x",
        "/work/main/deploy/k8s",
        "../../work/main/deploy/k8s",
    );
    check(
        "/work/main/target/tmp/a",
        "/work/main/deploy/k8s",
        "../../../deploy/k8s",
    );
    check("/a/b", "/a/b/c", "c");
}
