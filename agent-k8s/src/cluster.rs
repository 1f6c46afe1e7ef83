//! What a live lesson is on Kubernetes: the names and manifests of its objects, and the
//! server-side apply that creates or updates them.
//!
//! Per live lesson: a namespace `antidote-<id>` with the spec's labels; a deny-by-default
//! NetworkPolicy (the lesson's own pods, and namespaces carrying the access label; no DNS: the
//! lesson's names are in every pod's `/etc/hosts`); containers without privilege (see
//! [`security_context`]), with small requests under their limits and the operator's
//! `imagePullPolicy`; a Service per endpoint (made first: its cluster IP is the endpoint's
//! address in `/etc/hosts`); one pod per endpoint (lesson order; every pod after the first is
//! kept on the first one's node; never changed once made); an Ingress per http presentation; a
//! NetworkAttachmentDefinition per connection where Multus is installed (a bridge and address
//! pool of the live lesson's own); a Job per endpoint per stage for the configurator's types.
//! Every object carries the spec's labels plus `antidote.io/managed-by`.

use std::collections::BTreeMap;

use antidote_proto::agent::v1 as proto;
use antidote_sdk::labels;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams, PostParams};
use proto::{Flavor, PresentationType};
use serde::Serialize;
use serde_json::{Value, json};

use crate::settings::Settings;

/// The field manager of every apply.
pub const FIELD_MANAGER: &str = "antidote-agent-k8s";
/// Marks objects this agent manages.
pub const LABEL_MANAGED: &str = "antidote.io/managed-by";
/// The endpoint a pod, Service or Job belongs to.
pub const LABEL_ENDPOINT: &str = "antidote.io/endpoint";
/// Marks configuration Jobs (value: the stage).
pub const LABEL_CONFIG_STAGE: &str = "antidote.io/config-stage";

/// The capabilities of a lesson container, after dropping all: NET_ADMIN and NET_RAW for the
/// lesson's own networking (they act only on the pod's network namespace), and of the runtime's
/// usual set what SSH servers, shells and services on low ports need. MKNOD, SETFCAP and
/// SETPCAP are left out. (agent-docker gives its containers the same set.)
pub const LINUX_CAPABILITIES: &[&str] = &[
    "NET_ADMIN",
    "NET_RAW",
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "NET_BIND_SERVICE",
    "SETGID",
    "SETUID",
    "SYS_CHROOT",
];

/// The link-local range of cloud metadata services (169.254.169.254), closed even to lessons
/// that may reach the internet.
pub const METADATA_RANGE: &str = "169.254.0.0/16";

/// A lesson container's security context: privileged only for a trusted image on an agent
/// whose operator opted in; otherwise no privilege escalation, every capability dropped but
/// [`LINUX_CAPABILITIES`], the runtime's default seccomp profile.
pub fn security_context(privileged: bool) -> Value {
    if privileged {
        // The API server refuses allowPrivilegeEscalation: false beside privileged: true.
        json!({ "privileged": true })
    } else {
        json!({
            "allowPrivilegeEscalation": false,
            "capabilities": { "drop": ["ALL"], "add": LINUX_CAPABILITIES },
            "seccompProfile": { "type": "RuntimeDefault" },
        })
    }
}

/// Memory and CPU of a lesson container: the limits it may use, and the (smaller) requests the
/// scheduler reserves for it on a node. Without explicit requests Kubernetes makes them equal
/// to the limits, and a whole CPU per pod would keep a three-endpoint lesson off a 2-CPU node.
fn resources(settings: &Settings) -> Value {
    let mut limits = serde_json::Map::new();
    let mut requests = serde_json::Map::new();
    let request = |asked: u64, limit: u64| if limit > 0 { asked.min(limit) } else { asked };
    if settings.memory_mib > 0 {
        limits.insert("memory".into(), json!(format!("{}Mi", settings.memory_mib)));
    }
    let memory = request(settings.request_memory_mib, settings.memory_mib);
    if memory > 0 {
        requests.insert("memory".into(), json!(format!("{memory}Mi")));
    }
    if settings.millicpus > 0 {
        limits.insert("cpu".into(), json!(format!("{}m", settings.millicpus)));
    }
    let cpu = request(settings.request_millicpus, settings.millicpus);
    if cpu > 0 {
        requests.insert("cpu".into(), json!(format!("{cpu}m")));
    }
    json!({ "limits": limits, "requests": requests })
}

/// The namespace of a live lesson.
pub fn namespace(live_lesson_id: &str) -> String {
    format!("antidote-{live_lesson_id}")
}

/// The spec's labels plus ours.
pub fn lesson_labels(spec: &proto::LessonSpec) -> BTreeMap<String, String> {
    let mut labels: BTreeMap<String, String> = spec
        .labels
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    labels.insert(LABEL_MANAGED.into(), "agent-k8s".into());
    labels
}

fn endpoint_labels(spec: &proto::LessonSpec, endpoint: &str) -> BTreeMap<String, String> {
    let mut labels = lesson_labels(spec);
    labels.insert(LABEL_ENDPOINT.into(), endpoint.into());
    labels
}

/// A port's name in pod and Service specs (≤ 15 characters, unique per port).
pub fn port_name(kind: i32, port: u32) -> String {
    match PresentationType::try_from(kind) {
        Ok(PresentationType::Ssh) => format!("ssh-{port}"),
        Ok(PresentationType::Http) => format!("http-{port}"),
        _ => format!("tcp-{port}"),
    }
}

/// An endpoint's ports: presentations first, then additional ports, each port once.
pub fn ports(endpoint: &proto::Endpoint) -> Vec<(String, u32)> {
    let mut seen = std::collections::HashSet::new();
    endpoint
        .presentations
        .iter()
        .map(|p| (port_name(p.r#type, p.port), p.port))
        .chain(
            endpoint
                .additional_ports
                .iter()
                .map(|p| (port_name(0, *p), *p)),
        )
        .filter(|(_, port)| seen.insert(*port))
        .collect()
}

/// The Ingress name of an http presentation.
pub fn ingress_name(endpoint: &str, presentation: &str) -> String {
    let name: String = format!("{endpoint}-{presentation}")
        .to_ascii_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    name.trim_matches('-').chars().take(63).collect()
}

/// The host an http presentation's Ingress serves.
pub fn ingress_host(
    settings: &Settings,
    spec: &proto::LessonSpec,
    endpoint: &str,
    presentation: &str,
) -> String {
    settings
        .ingress_host
        .replace(
            "{presentation}",
            &ingress_name(presentation, "").replace('-', ""),
        )
        .replace("{endpoint}", endpoint)
        .replace("{lesson}", &spec.lesson_slug)
        .replace(
            "{short}",
            &spec.live_lesson_id[..8.min(spec.live_lesson_id.len())],
        )
}

/// The configuration Job of an endpoint for the spec's stage (named by generation, so a newer
/// generation never collides with an older Job still being deleted).
pub fn job_name(endpoint: &str, generation: u64) -> String {
    format!("config-{endpoint}-g{generation}")
}

pub fn namespace_manifest(spec: &proto::LessonSpec) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": namespace(&spec.live_lesson_id),
            "labels": lesson_labels(spec),
        },
    })
}

/// Deny by default: ingress only from the lesson's own pods and from namespaces carrying the
/// access label; egress only to the lesson's own pods or, when egress is allowed, anywhere but
/// the metadata range. No DNS: a lesson's endpoints find each other through `/etc/hosts`
/// ([`host_aliases`]), so a lesson cannot look up, forward or reverse, any other lesson's names.
pub fn network_policy_manifest(settings: &Settings, spec: &proto::LessonSpec) -> Value {
    let (access_key, access_value) = settings.access_label();
    let egress = if settings.allow_egress {
        json!([
            { "to": [{ "podSelector": {} }, { "namespaceSelector": {} }] },
            { "to": [
                { "ipBlock": { "cidr": "0.0.0.0/0", "except": [METADATA_RANGE] } },
                { "ipBlock": { "cidr": "::/0", "except": ["fd00:ec2::254/128"] } },
            ] },
        ])
    } else {
        json!([{ "to": [{ "podSelector": {} }] }])
    };
    json!({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": "antidote-isolation",
            "namespace": namespace(&spec.live_lesson_id),
            "labels": lesson_labels(spec),
        },
        "spec": {
            "podSelector": {},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [
                { "from": [{ "podSelector": {} }] },
                { "from": [{ "namespaceSelector": { "matchLabels": { access_key: access_value } } }] },
            ],
            "egress": egress,
        },
    })
}

/// `hostAliases` naming every endpoint of the lesson by its Service's cluster IP (Services are
/// made before pods for this): endpoints and configurators reach each other by name without
/// any DNS, which the lesson policy does not allow.
pub fn host_aliases(service_ips: &BTreeMap<String, String>) -> Value {
    let mut by_ip: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (name, ip) in service_ips {
        if !ip.is_empty() && ip != "None" {
            by_ip.entry(ip).or_default().push(name);
        }
    }
    Value::Array(
        by_ip
            .into_iter()
            .map(|(ip, names)| json!({ "ip": ip, "hostnames": names }))
            .collect(),
    )
}

/// The NetworkAttachmentDefinition name of connection `index`.
pub fn attachment_name(spec: &proto::LessonSpec, index: usize) -> String {
    let connection = &spec.connections[index];
    format!("link-{index}-{}-{}", connection.a, connection.b)
}

/// Multus's `k8s.v1.cni.cncf.io/networks` value for endpoint `index`: the attachments of its
/// connections in connection order, named as the image expects its interfaces (eth1, eth2…).
pub fn attachments_annotation(spec: &proto::LessonSpec, index: usize) -> Option<String> {
    let endpoint = &spec.endpoints[index];
    let interfaces = endpoint
        .image
        .as_ref()
        .map(|i| i.network_interfaces.as_slice())
        .unwrap_or_default();
    let networks: Vec<Value> = spec
        .connections
        .iter()
        .enumerate()
        .filter(|(_, c)| c.a == endpoint.name || c.b == endpoint.name)
        .enumerate()
        .map(|(k, (i, _))| match interfaces.get(k) {
            Some(interface) => json!({ "name": attachment_name(spec, i), "interface": interface }),
            None => json!({ "name": attachment_name(spec, i) }),
        })
        .collect();
    (!networks.is_empty()).then(|| Value::Array(networks).to_string())
}

/// Endpoint `index`'s pod; `attached`: the cluster has Multus, so the pod joins its
/// connections' NetworkAttachmentDefinitions; `service_ips`: every endpoint's Service address,
/// for the pod's `/etc/hosts` ([`host_aliases`]).
pub fn pod_manifest(
    settings: &Settings,
    spec: &proto::LessonSpec,
    index: usize,
    attached: bool,
    service_ips: &BTreeMap<String, String>,
) -> Value {
    let endpoint = &spec.endpoints[index];
    let image = endpoint.image.clone().unwrap_or_default();
    let trusted = matches!(
        Flavor::try_from(image.flavor),
        Ok(Flavor::Trusted | Flavor::Legacy)
    );
    let image_ref = match (&endpoint.jupyter_guide, &settings.jupyter_image) {
        (Some(_), Some(jupyter)) => jupyter.clone(),
        _ => settings.image(&image.slug),
    };
    let mut pod_spec = json!({
        "hostname": endpoint.name,
        // Learners get a shell on these pods: no API credentials, no service links.
        "automountServiceAccountToken": false,
        "enableServiceLinks": false,
        "restartPolicy": "Always",
        "hostAliases": host_aliases(service_ips),
        "containers": [{
            "name": endpoint.name,
            "image": image_ref,
            "imagePullPolicy": settings.image_pull_policy,
            "ports": ports(endpoint)
                .into_iter()
                .map(|(name, port)| json!({ "name": name, "containerPort": port, "protocol": "TCP" }))
                .collect::<Vec<_>>(),
            "securityContext": security_context(trusted && settings.trusted_privileged),
            "resources": resources(settings),
        }],
    });
    if index > 0 {
        // Every endpoint on the node of the lesson's first pod: links between them stay local.
        pod_spec["affinity"] = json!({
            "podAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [{
                    "labelSelector": { "matchLabels": {
                        labels::LIVE_LESSON: spec.live_lesson_id,
                        LABEL_ENDPOINT: spec.endpoints[0].name,
                    } },
                    "topologyKey": "kubernetes.io/hostname",
                }],
            },
        });
    }
    if !trusted && let Some(class) = &settings.untrusted_runtime_class {
        pod_spec["runtimeClassName"] = json!(class);
    }
    if endpoint.jupyter_guide.is_some() {
        // The notebook's directory, written by the agent through pods/exec at every generation
        // ([`crate::exec::put`]): Jupyter serves the new stage's notebook as soon as the stage
        // is READY (a ConfigMap volume is refreshed only at the kubelet's next sync, up to a
        // minute later), and an emptyDir outlives restarts of the container.
        pod_spec["volumes"] = json!([{ "name": "guide", "emptyDir": { "sizeLimit": "16Mi" } }]);
        pod_spec["containers"][0]["volumeMounts"] = json!([{
            "name": "guide",
            "mountPath": GUIDE_DIR,
        }]);
    }
    let mut pod = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": endpoint.name,
            "namespace": namespace(&spec.live_lesson_id),
            "labels": endpoint_labels(spec, &endpoint.name),
        },
        "spec": pod_spec,
    });
    if attached && let Some(networks) = attachments_annotation(spec, index) {
        pod["metadata"]["annotations"] = json!({ "k8s.v1.cni.cncf.io/networks": networks });
    }
    pod
}

/// Where the Jupyter image serves files from: the guide's notebook is `guide.ipynb` there.
pub const GUIDE_DIR: &str = "/antidote/guide";

pub fn service_manifest(spec: &proto::LessonSpec, index: usize) -> Value {
    let endpoint = &spec.endpoints[index];
    let ports: Vec<Value> = ports(endpoint)
        .into_iter()
        .map(|(name, port)| json!({ "name": name, "port": port, "targetPort": port, "protocol": "TCP" }))
        .collect();
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": endpoint.name,
            "namespace": namespace(&spec.live_lesson_id),
            "labels": endpoint_labels(spec, &endpoint.name),
        },
        "spec": {
            "selector": {
                labels::LIVE_LESSON: spec.live_lesson_id,
                LABEL_ENDPOINT: endpoint.name,
            },
            "ports": ports,
        },
    })
}

/// One Ingress per http presentation: (name, host, manifest).
pub fn ingress_manifests(
    settings: &Settings,
    spec: &proto::LessonSpec,
) -> Vec<(String, String, Value)> {
    let mut out = Vec::new();
    for endpoint in &spec.endpoints {
        for p in &endpoint.presentations {
            if p.r#type != PresentationType::Http as i32 {
                continue;
            }
            let name = ingress_name(&endpoint.name, &p.name);
            let host = ingress_host(settings, spec, &endpoint.name, &p.name);
            let mut ingress_spec = json!({
                "rules": [{
                    "host": host,
                    "http": { "paths": [{
                        "path": "/",
                        "pathType": "Prefix",
                        "backend": { "service": {
                            "name": endpoint.name,
                            "port": { "number": p.port },
                        } },
                    }] },
                }],
            });
            if let Some(class) = &settings.ingress_class {
                ingress_spec["ingressClassName"] = json!(class);
            }
            if let Some(secret) = &settings.ingress_tls_secret {
                ingress_spec["tls"] = json!([{ "hosts": [host], "secretName": secret }]);
            }
            let manifest = json!({
                "apiVersion": "networking.k8s.io/v1",
                "kind": "Ingress",
                "metadata": {
                    "name": name,
                    "namespace": namespace(&spec.live_lesson_id),
                    "labels": endpoint_labels(spec, &endpoint.name),
                },
                "spec": ingress_spec,
            });
            out.push((name, host, manifest));
        }
    }
    out
}

/// The Linux bridge of connection `index` on the node: `adl` and 12 hex digits of a SHA-256 of
/// the live lesson id and the index (15 characters, the most an interface name may have). Two
/// lessons never share a bridge (a shared prefix of their ids does not make one), and an
/// operator's firewall can name every lesson bridge, and only them, by the prefix `adl`.
pub fn bridge_name(live_lesson_id: &str, index: usize) -> String {
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(format!("{live_lesson_id}/{index}").as_bytes());
    let hex: String = digest.iter().take(6).map(|b| format!("{b:02x}")).collect();
    format!("{BRIDGE_PREFIX}{hex}")
}

/// The prefix of every lesson bridge's name ([`bridge_name`]).
pub const BRIDGE_PREFIX: &str = "adl";

/// A bridge NetworkAttachmentDefinition per connection (Multus). Its CNI network name is the
/// lesson's own (`antidote-<id>-<index>`), so that host-local keeps one address pool per link
/// of each live lesson: copies of a lesson never draw from one pool, and a link of a /24 holds
/// its two endpoints however many copies a node runs.
pub fn attachment_manifest(spec: &proto::LessonSpec, index: usize) -> Value {
    let connection = &spec.connections[index];
    let mut ipam = json!({});
    if !connection.subnet.is_empty() {
        ipam = json!({ "type": "host-local", "subnet": connection.subnet });
    }
    let config = json!({
        "cniVersion": "0.3.1",
        "name": format!("antidote-{}-{index}", spec.live_lesson_id),
        "type": "bridge",
        "bridge": bridge_name(&spec.live_lesson_id, index),
        "ipam": ipam,
    });
    json!({
        "apiVersion": "k8s.cni.cncf.io/v1",
        "kind": "NetworkAttachmentDefinition",
        "metadata": {
            "name": attachment_name(spec, index),
            "namespace": namespace(&spec.live_lesson_id),
            "labels": lesson_labels(spec),
        },
        "spec": { "config": config.to_string() },
    })
}

/// The base of a configuration Job of one endpoint for the spec's stage (the configurator fills
/// in its image, command and files: [`crate::configurator::job_manifest`]): confined, each try
/// bounded by the pod's `activeDeadlineSeconds` and the whole Job by its own, the lesson's names
/// in `/etc/hosts`. A failed try's output tail becomes its termination message, which the agent
/// quotes in the FAILED reason.
pub fn job_manifest(
    settings: &Settings,
    spec: &proto::LessonSpec,
    index: usize,
    service_ips: &BTreeMap<String, String>,
) -> Value {
    let endpoint = &spec.endpoints[index];
    let mut job_labels = endpoint_labels(spec, &endpoint.name);
    job_labels.insert(LABEL_CONFIG_STAGE.into(), spec.stage.to_string());
    json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": job_name(&endpoint.name, spec.generation),
            "namespace": namespace(&spec.live_lesson_id),
            "labels": job_labels,
        },
        "spec": {
            "backoffLimit": settings.config_backoff_limit,
            "activeDeadlineSeconds": settings.config_job_deadline(spec).as_secs(),
            "template": {
                "metadata": { "labels": job_labels },
                "spec": {
                    "restartPolicy": "Never",
                    "activeDeadlineSeconds": settings.config_run_seconds(spec),
                    "automountServiceAccountToken": false,
                    "enableServiceLinks": false,
                    "hostAliases": host_aliases(service_ips),
                    "containers": [{
                        "name": "configure",
                        "imagePullPolicy": settings.image_pull_policy,
                        "terminationMessagePolicy": "FallbackToLogsOnError",
                        "env": [],
                        "securityContext": security_context(false),
                        "resources": resources(settings),
                    }],
                },
            },
        },
    })
}

/// Creates or updates `manifest` by server-side apply.
pub async fn apply<K>(api: &Api<K>, name: &str, manifest: &Value) -> Result<K, kube::Error>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    api.patch(
        name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(manifest),
    )
    .await
}

/// Creates `manifest` (POST) when `fresh` (nothing of the live lesson should exist yet), else
/// applies it; an object that exists after all (a crashed attempt left it) is applied over.
///
/// A create costs the API server less than an apply that creates (no read first, no merge),
/// which is what a new live lesson's eight to ten objects are. The creation records the same
/// field manager (as an Update); later applies (stage changes, adoption) take over every field
/// they set. They would not remove a field that the creating manifest had and a later one
/// drops, but a live lesson's manifests keep the same fields across generations (only label
/// values and the guide's notebook change).
pub async fn create_or_apply<K>(
    api: &Api<K>,
    name: &str,
    manifest: &Value,
    fresh: bool,
) -> Result<K, kube::Error>
where
    K: kube::Resource + Clone + Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    if fresh {
        let object: K =
            serde_json::from_value(manifest.clone()).map_err(kube::Error::SerdeError)?;
        let params = PostParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..Default::default()
        };
        match api.create(&params, &object).await {
            Err(kube::Error::Api(status)) if status.code == 409 => {}
            done => return done,
        }
    }
    apply(api, name, manifest).await
}

/// Creates a pod unless it exists. Unlike [`create_or_apply`], never applies over an existing
/// pod: a pod's spec is immutable but for a few fields, so an apply after an agent restart with
/// other `--millicpus`, `--memory-mib`, `--trusted-privileged` or runtime class flags would be
/// refused (422) and fail a READY lesson. Such flags reach the lessons created after the
/// change; the pods of earlier ones keep what they were made with.
pub async fn create_pod(
    api: &Api<Pod>,
    name: &str,
    manifest: &Value,
    fresh: bool,
) -> Result<(), kube::Error> {
    if !fresh && api.get_opt(name).await?.is_some() {
        return Ok(());
    }
    let object: Pod = serde_json::from_value(manifest.clone()).map_err(kube::Error::SerdeError)?;
    let params = PostParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..Default::default()
    };
    match api.create(&params, &object).await {
        Ok(_) => Ok(()),
        // Made by a crashed attempt, or by another request of ours just now: it stands.
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(()),
        Err(e) => Err(e),
    }
}

/// A kube error in words that quote the API server.
pub fn explain(what: &str, err: &kube::Error) -> String {
    match err {
        kube::Error::Api(status) => format!(
            "the API server refused {what}: {} ({}, {})",
            status.message, status.reason, status.code
        ),
        other => format!("{what}: {other}"),
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    fn settings(extra: &[&str]) -> Settings {
        Settings::parse_from(std::iter::once("agent-k8s").chain(extra.iter().copied()))
    }

    fn endpoint(name: &str, flavor: Flavor, interfaces: &[&str]) -> proto::Endpoint {
        proto::Endpoint {
            name: name.into(),
            image: Some(proto::Image {
                slug: "busybox".into(),
                flavor: flavor as i32,
                network_interfaces: interfaces.iter().map(|s| s.to_string()).collect(),
                ..Default::default()
            }),
            presentations: vec![proto::Presentation {
                name: "cli".into(),
                r#type: PresentationType::Ssh as i32,
                port: 22,
            }],
            ..Default::default()
        }
    }

    fn spec() -> proto::LessonSpec {
        let link = |a: &str, b: &str| proto::Connection {
            a: a.into(),
            b: b.into(),
            subnet: String::new(),
        };
        proto::LessonSpec {
            live_lesson_id: "0f2c6a7e-1111-4222-8333-444455556666".into(),
            generation: 2,
            endpoints: vec![
                endpoint("client", Flavor::Untrusted, &["eth1"]),
                endpoint("router", Flavor::Trusted, &["eth1", "eth2"]),
                endpoint("server", Flavor::Untrusted, &[]),
            ],
            connections: vec![link("client", "router"), link("router", "server")],
            ..Default::default()
        }
    }

    /// A container with no privilege: no escalation, everything dropped but the confined set.
    fn assert_confined(context: &Value) {
        assert!(context["privileged"].is_null(), "{context}");
        assert_eq!(context["allowPrivilegeEscalation"], false, "{context}");
        assert_eq!(context["capabilities"]["drop"], json!(["ALL"]), "{context}");
        let added = context["capabilities"]["add"].as_array().unwrap();
        assert!(added.contains(&json!("NET_ADMIN")) && added.contains(&json!("NET_RAW")));
        assert!(!added.contains(&json!("SYS_ADMIN")) && !added.contains(&json!("ALL")));
        assert_eq!(context["seccompProfile"]["type"], "RuntimeDefault");
    }

    /// The admission policy in deploy/k8s refuses any added capability it does not list, so
    /// a capability added here but not there would fail every lesson in production.
    #[test]
    fn the_admission_policy_allows_exactly_the_capabilities_lessons_get() {
        let rbac = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../deploy/k8s/agent-k8s-rbac.yaml"),
        )
        .unwrap();
        let (_, rule) = rbac
            .split_once("x.capabilities.add.all(a, a in [")
            .expect("the pods policy lists the capabilities it allows");
        let (list, _) = rule.split_once(']').unwrap();
        let mut allowed: Vec<&str> = list
            .split(',')
            .map(|c| c.trim().trim_matches('\''))
            .collect();
        let mut ours = LINUX_CAPABILITIES.to_vec();
        allowed.sort_unstable();
        ours.sort_unstable();
        assert_eq!(allowed, ours);
    }

    #[test]
    fn pods_follow_the_first_one_and_get_no_privilege_by_default() {
        let settings = settings(&["--untrusted-runtime-class", "gvisor"]);
        let spec = spec();
        let client = pod_manifest(&settings, &spec, 0, false, &no_ips());
        assert!(client["spec"]["affinity"].is_null(), "the first pod leads");
        assert_eq!(client["spec"]["runtimeClassName"], "gvisor");
        assert_confined(&client["spec"]["containers"][0]["securityContext"]);
        assert_eq!(
            client["spec"]["containers"][0]["resources"],
            json!({
                "limits": { "memory": "256Mi", "cpu": "1000m" },
                // A node reserves far less than the limits: lessons idle most of the time.
                "requests": { "memory": "64Mi", "cpu": "50m" },
            })
        );
        assert_eq!(
            client["spec"]["containers"][0]["imagePullPolicy"],
            "IfNotPresent"
        );
        assert_eq!(client["spec"]["automountServiceAccountToken"], false);
        assert_eq!(
            client["spec"]["containers"][0]["ports"][0]["name"],
            "ssh-22"
        );
        // The router's image is trusted: still not privileged unless the operator says so.
        let router = pod_manifest(&settings, &spec, 1, false, &no_ips());
        assert_confined(&router["spec"]["containers"][0]["securityContext"]);
        let opted_in = settings_privileged();
        let router_privileged = pod_manifest(&opted_in, &spec, 1, false, &no_ips());
        assert_eq!(
            router_privileged["spec"]["containers"][0]["securityContext"],
            json!({ "privileged": true })
        );
        assert_confined(
            &pod_manifest(&opted_in, &spec, 0, false, &no_ips())["spec"]["containers"][0]["securityContext"],
        );
        assert!(router["spec"]["runtimeClassName"].is_null());
        let term = &router["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            [0];
        assert_eq!(
            term["labelSelector"]["matchLabels"][LABEL_ENDPOINT],
            "client"
        );
        assert_eq!(term["topologyKey"], "kubernetes.io/hostname");
        assert!(
            router["metadata"]["annotations"].is_null(),
            "no Multus, no networks"
        );
    }

    #[test]
    fn attachments_name_interfaces_in_connection_order() {
        let spec = spec();
        let router = pod_manifest(&settings(&[]), &spec, 1, true, &no_ips());
        let networks: Value = serde_json::from_str(
            router["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"]
                .as_str()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(
            networks,
            json!([
                { "name": "link-0-client-router", "interface": "eth1" },
                { "name": "link-1-router-server", "interface": "eth2" },
            ])
        );
        // An image that names no interfaces lets Multus name them.
        assert_eq!(
            attachments_annotation(&spec, 2).unwrap(),
            r#"[{"name":"link-1-router-server"}]"#
        );
        let attachment = attachment_manifest(&spec, 1);
        assert_eq!(attachment["metadata"]["name"], "link-1-router-server");
        let config: Value =
            serde_json::from_str(attachment["spec"]["config"].as_str().unwrap()).unwrap();
        assert_eq!(config["type"], "bridge");
        assert!(
            config["bridge"].as_str().unwrap().len() <= 15,
            "a Linux interface name"
        );
    }

    fn no_ips() -> BTreeMap<String, String> {
        BTreeMap::new()
    }

    fn settings_privileged() -> Settings {
        settings(&["--trusted-privileged", "true"])
    }

    #[test]
    fn configuration_jobs_are_confined_and_bounded_in_time() {
        let settings = settings(&["--config-timeout", "90s", "--config-backoff-limit", "1"]);
        let job = job_manifest(&settings, &spec(), 1, &no_ips());
        assert_eq!(job["spec"]["activeDeadlineSeconds"], 90 * 2 + 10);
        let pod = &job["spec"]["template"]["spec"];
        assert_eq!(pod["activeDeadlineSeconds"], 90);
        // A lesson asking for less (configTimeout) gets its time; asking for more, the agent's.
        let mut short = spec();
        short.configuration_timeout = std::time::Duration::from_secs(5).try_into().ok();
        let job = job_manifest(&settings, &short, 1, &no_ips());
        assert_eq!(job["spec"]["template"]["spec"]["activeDeadlineSeconds"], 5);
        assert_eq!(job["spec"]["activeDeadlineSeconds"], 5 * 2 + 10);
        let mut long = spec();
        long.configuration_timeout = std::time::Duration::from_secs(3600).try_into().ok();
        let job = job_manifest(&settings, &long, 1, &no_ips());
        assert_eq!(job["spec"]["template"]["spec"]["activeDeadlineSeconds"], 90);
        assert_confined(&pod["containers"][0]["securityContext"]);
        assert_eq!(
            pod["containers"][0]["resources"]["limits"]["memory"],
            "256Mi"
        );
        // Even for a trusted image on an agent that opted in.
        let job = job_manifest(&settings_privileged(), &spec(), 1, &no_ips());
        assert_confined(&job["spec"]["template"]["spec"]["containers"][0]["securityContext"]);
    }

    #[test]
    fn lessons_get_no_dns_and_find_their_endpoints_in_etc_hosts() {
        let policy = network_policy_manifest(&settings(&[]), &spec());
        let egress = policy["spec"]["egress"].as_array().unwrap();
        assert_eq!(egress, &vec![json!({ "to": [{ "podSelector": {} }] })]);
        // With egress allowed, still not the metadata address.
        let open = network_policy_manifest(&settings(&["--allow-egress"]), &spec());
        let text = open["spec"]["egress"].to_string();
        assert!(text.contains("\"except\":[\"169.254.0.0/16\"]"), "{text}");
        let ips = BTreeMap::from([
            ("client".to_owned(), "10.96.3.4".to_owned()),
            ("router".to_owned(), "10.96.3.5".to_owned()),
            ("headless".to_owned(), "None".to_owned()),
        ]);
        let pod = pod_manifest(&settings(&[]), &spec(), 0, false, &ips);
        assert_eq!(
            pod["spec"]["hostAliases"],
            json!([
                { "ip": "10.96.3.4", "hostnames": ["client"] },
                { "ip": "10.96.3.5", "hostnames": ["router"] },
            ])
        );
    }

    #[test]
    fn small_requests_under_the_limits() {
        let tight = settings(&["--millicpus", "20", "--memory-mib", "0"]);
        assert_eq!(
            resources(&tight),
            json!({ "limits": { "cpu": "20m" }, "requests": { "cpu": "20m", "memory": "64Mi" } })
        );
    }

    #[test]
    fn every_link_of_every_lesson_has_its_own_bridge_and_address_pool() {
        let a = spec();
        let mut b = spec();
        // Same first 8 characters: the old naming gave both lessons one bridge.
        b.live_lesson_id = "0f2c6a7e-9999-4222-8333-444455556666".into();
        let bridge = |spec: &proto::LessonSpec, i: usize| {
            let config: Value = serde_json::from_str(
                attachment_manifest(spec, i)["spec"]["config"]
                    .as_str()
                    .unwrap(),
            )
            .unwrap();
            (
                config["bridge"].as_str().unwrap().to_owned(),
                config["name"].as_str().unwrap().to_owned(),
            )
        };
        let names = [bridge(&a, 0), bridge(&a, 1), bridge(&b, 0), bridge(&b, 1)];
        for (i, (bridge, network)) in names.iter().enumerate() {
            assert!(
                bridge.starts_with(BRIDGE_PREFIX) && bridge.len() == 15,
                "{bridge}"
            );
            for (other, network_other) in &names[i + 1..] {
                assert_ne!(bridge, other);
                assert_ne!(network, network_other);
            }
        }
        assert_eq!(bridge(&a, 0), bridge(&a, 0), "stable across calls");
    }

    #[test]
    fn jobs_are_named_per_generation() {
        assert_eq!(job_name("router", 3), "config-router-g3");
        assert_eq!(namespace("abc"), "antidote-abc");
    }
    #[test]
    fn the_jupyter_guide_pod_runs_the_jupyter_image_and_mounts_the_notebook() {
        let settings = settings(&["--jupyter-image", "registry.example/antidote/jupyter:1"]);
        let mut spec = spec();
        let mut guide = endpoint("jupyter-guide", Flavor::Untrusted, &[]);
        guide.jupyter_guide = Some(proto::JupyterGuide {
            notebook: b"{\"cells\": []}".to_vec(),
        });
        spec.endpoints.push(guide);
        let pod = pod_manifest(&settings, &spec, 3, false, &no_ips());
        let container = &pod["spec"]["containers"][0];
        assert_eq!(container["image"], "registry.example/antidote/jupyter:1");
        assert_eq!(container["volumeMounts"][0]["mountPath"], GUIDE_DIR);
        assert_eq!(pod["spec"]["volumes"][0]["emptyDir"]["sizeLimit"], "16Mi");
        assert_confined(&container["securityContext"]);
        // Other endpoints are untouched.
        let other = pod_manifest(&settings, &spec, 0, false, &no_ips());
        assert!(other["spec"]["volumes"].is_null(), "{other}");
    }
}
