//! Python, ansible and napalm stage configurations as Jobs, the way Antidote ran them: a Job per
//! configured endpoint per stage, running `--configurator-image` in the live lesson's namespace,
//! reaching endpoints by their Service names.
//!
//! The stage's files come from the spec into one ConfigMap per generation
//! (`config-files-g<generation>`, key `<endpoint>.<file>`), mounted read-only at
//! `/antidote/stageN/configs/F`; the image's configuration credentials go into one Secret per
//! live lesson ([`SECRET`], rewritten every generation) and reach the Job's container only as
//! environment variables (`secretKeyRef`), never in its command line. The SDK's spec rules keep a
//! stage's files within 1 MiB, a ConfigMap's limit.

use std::collections::BTreeMap;

use antidote_proto::agent::v1 as proto;
use proto::ConfigurationType;
use serde_json::{Value, json};

use crate::cluster::{self, LABEL_CONFIG_STAGE};
use crate::settings::Settings;

/// The Secret holding the configurator's credentials, one per live lesson.
pub const SECRET: &str = "config-credentials";

/// The label on a stage's configuration ConfigMap (value: the generation).
pub const LABEL_CONFIG_GENERATION: &str = "antidote.io/config-generation";

/// Whether a configuration runs in the configurator (every type but shell).
pub fn runs_here(configuration: &proto::StageConfiguration) -> bool {
    configuration.r#type != ConfigurationType::Shell as i32
}

/// Whether any endpoint of the spec has a configuration the configurator runs.
pub fn needed(spec: &proto::LessonSpec) -> bool {
    spec.endpoints
        .iter()
        .any(|e| e.configuration.as_ref().is_some_and(runs_here))
}

/// The ConfigMap of a generation's configuration files.
pub fn configmap_name(generation: u64) -> String {
    format!("config-files-g{generation}")
}

/// Where a stage's configuration files are mounted.
pub fn config_dir(stage: u32) -> String {
    format!("/antidote/stage{stage}/configs")
}

/// The ConfigMap key of an endpoint's file (file names may repeat across endpoints).
fn key(endpoint: &str, file: &str) -> String {
    format!("{endpoint}.{file}")
}

fn base64(bytes: &[u8]) -> Value {
    serde_json::to_value(k8s_openapi::ByteString(bytes.to_vec()))
        .unwrap_or_else(|_| Value::String(String::new()))
}

/// The configuration files of the spec's stage that the configurator runs (binaryData: files
/// need not be UTF-8).
pub fn configmap_manifest(spec: &proto::LessonSpec) -> Value {
    let mut data = serde_json::Map::new();
    for endpoint in &spec.endpoints {
        if let Some(c) = endpoint.configuration.as_ref().filter(|c| runs_here(c)) {
            data.insert(key(&endpoint.name, &c.file_name), base64(&c.contents));
        }
    }
    let mut labels = cluster::lesson_labels(spec);
    labels.insert(LABEL_CONFIG_STAGE.into(), spec.stage.to_string());
    labels.insert(LABEL_CONFIG_GENERATION.into(), spec.generation.to_string());
    json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": configmap_name(spec.generation),
            "namespace": cluster::namespace(&spec.live_lesson_id),
            "labels": labels,
        },
        "binaryData": data,
    })
}

/// An endpoint's configuration credentials: the image's config user and password, its SSH ones
/// when it names none.
fn credentials(endpoint: &proto::Endpoint) -> (String, String) {
    let image = endpoint.image.clone().unwrap_or_default();
    if image.config_user.is_empty() {
        (image.ssh_user, image.ssh_password)
    } else {
        (image.config_user, image.config_password)
    }
}

/// The Secret of the configurator's credentials: `<endpoint>.user` and `<endpoint>.password`
/// for each endpoint the configurator configures.
pub fn secret_manifest(spec: &proto::LessonSpec) -> Value {
    let mut data = serde_json::Map::new();
    for endpoint in &spec.endpoints {
        if endpoint.configuration.as_ref().is_some_and(runs_here) {
            let (user, password) = credentials(endpoint);
            data.insert(format!("{}.user", endpoint.name), base64(user.as_bytes()));
            data.insert(
                format!("{}.password", endpoint.name),
                base64(password.as_bytes()),
            );
        }
    }
    json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": SECRET,
            "namespace": cluster::namespace(&spec.live_lesson_id),
            "labels": cluster::lesson_labels(spec),
        },
        "type": "Opaque",
        "data": data,
    })
}

/// The command of one configuration run: Antidote's (`python F`, `ansible-playbook -i
/// '<endpoint>,' F`, a NAPALM load-merge-and-commit of F); secrets only by name.
pub fn command(
    endpoint: &str,
    configuration: &proto::StageConfiguration,
    stage: u32,
) -> Vec<String> {
    let file = format!("{}/{}", config_dir(stage), configuration.file_name);
    match ConfigurationType::try_from(configuration.r#type) {
        Ok(ConfigurationType::Ansible) => vec![
            "ansible-playbook".into(),
            "-i".into(),
            format!("{endpoint},"),
            "-e".into(),
            "ansible_password={{ lookup('env', 'ANTIDOTE_CONFIG_PASSWORD') }}".into(),
            file,
        ],
        Ok(ConfigurationType::Napalm) => vec!["antidote-napalm".into(), file],
        _ => vec!["python3".into(), file],
    }
}

/// The configurator Job of endpoint `index` for the spec's stage: its file mounted from the
/// generation's ConfigMap, credentials from [`SECRET`] as environment variables, confined like
/// every Job, each try bounded by the pod's `activeDeadlineSeconds` and the whole by the Job's,
/// reaching the endpoint by its name (`service_ips`, in the pod's `/etc/hosts`).
pub fn job_manifest(
    settings: &Settings,
    spec: &proto::LessonSpec,
    index: usize,
    service_ips: &BTreeMap<String, String>,
) -> Value {
    let endpoint = &spec.endpoints[index];
    let configuration = endpoint.configuration.clone().unwrap_or_default();
    let mut job = cluster::job_manifest(settings, spec, index, service_ips);
    let secret = |name: &str, key: String| json!({ "name": name, "valueFrom": { "secretKeyRef": { "name": SECRET, "key": key } } });
    let pod = &mut job["spec"]["template"]["spec"];
    pod["volumes"] = json!([{
        "name": "configs",
        "configMap": {
            "name": configmap_name(spec.generation),
            "items": [{
                "key": key(&endpoint.name, &configuration.file_name),
                "path": configuration.file_name,
            }],
        },
    }]);
    let container = &mut pod["containers"][0];
    container["image"] = json!(settings.configurator_image.clone().unwrap_or_default());
    container["command"] = json!(command(&endpoint.name, &configuration, spec.stage));
    container["workingDir"] = json!(config_dir(spec.stage));
    container["volumeMounts"] = json!([{
        "name": "configs",
        "mountPath": config_dir(spec.stage),
        "readOnly": true,
    }]);
    container["env"] = json!([
        { "name": "ANTIDOTE_HOST", "value": endpoint.name },
        { "name": "ANTIDOTE_ENDPOINT", "value": endpoint.name },
        { "name": "ANTIDOTE_STAGE", "value": spec.stage.to_string() },
        { "name": "ANTIDOTE_NAPALM_DRIVER", "value": configuration.driver },
        { "name": "ANTIDOTE_NAPALM_PORT", "value": "22" },
        // ansible-core refuses to run without a UTF-8 locale; glibc always has this one.
        { "name": "LC_ALL", "value": "C.UTF-8" },
        secret("ANTIDOTE_CONFIG_USER", format!("{}.user", endpoint.name)),
        secret("ANSIBLE_REMOTE_USER", format!("{}.user", endpoint.name)),
        secret("ANTIDOTE_CONFIG_PASSWORD", format!("{}.password", endpoint.name)),
    ]);
    // The configurator's tools need more memory than an endpoint.
    if settings.configurator_memory_mib > 0 {
        container["resources"]["limits"]["memory"] =
            json!(format!("{}Mi", settings.configurator_memory_mib));
    }
    job
}

/// The container of a run's checks pod ([`checks_pod_manifest`]).
pub const CHECKS_CONTAINER: &str = "checks";

/// An endpoint's configuration credentials (user, password), as a python check file gets them.
pub fn check_credentials(endpoint: &proto::Endpoint) -> (String, String) {
    credentials(endpoint)
}

/// The pod a run's python check files run in (PROTOCOL.md [X3]): the configurator image idling
/// for at most `lifetime` (the pod's `activeDeadlineSeconds` too, so that it cannot outlive a
/// run whose agent died), confined and labelled like a configuration Job's pod (the lesson's
/// labels and its stage: never taken for an endpoint), reaching endpoints by their names
/// (`service_ips`, in its `/etc/hosts`). Each file runs in it by `pods/exec`; the pod is
/// deleted after the run.
pub fn checks_pod_manifest(
    settings: &Settings,
    spec: &proto::LessonSpec,
    name: &str,
    service_ips: &BTreeMap<String, String>,
    lifetime: std::time::Duration,
) -> Value {
    let seconds = lifetime.as_secs().max(1);
    // A configuration Job's pod, of endpoint 0's Job: the confinement, resources and name
    // resolution are the same; only what it runs and its labels differ.
    let job = cluster::job_manifest(settings, spec, 0, service_ips);
    let mut pod = job["spec"]["template"]["spec"].clone();
    let mut labels = cluster::lesson_labels(spec);
    labels.insert(LABEL_CONFIG_STAGE.into(), spec.stage.to_string());
    pod["activeDeadlineSeconds"] = json!(seconds);
    pod["terminationGracePeriodSeconds"] = json!(0);
    let container = &mut pod["containers"][0];
    container["name"] = json!(CHECKS_CONTAINER);
    container["image"] = json!(settings.configurator_image.clone().unwrap_or_default());
    container["command"] = json!(["sleep", seconds.to_string()]);
    container["workingDir"] = json!("/tmp");
    container["env"] = json!([
        // ansible-core refuses to run without a UTF-8 locale; glibc always has this one.
        { "name": "LC_ALL", "value": "C.UTF-8" },
    ]);
    if settings.configurator_memory_mib > 0 {
        container["resources"]["limits"]["memory"] =
            json!(format!("{}Mi", settings.configurator_memory_mib));
    }
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": cluster::namespace(&spec.live_lesson_id),
            "labels": labels,
        },
        "spec": pod,
    })
}

/// The capabilities agent-k8s adds for configuration types: shell always, the others with a
/// configurator image.
pub fn capabilities(settings: &Settings) -> Vec<&'static str> {
    use antidote_sdk::capabilities as c;
    let mut out = vec![c::CONFIGURATION_SHELL];
    if settings
        .configurator_image
        .as_ref()
        .is_some_and(|i| !i.is_empty())
    {
        out.extend([
            c::CONFIGURATION_PYTHON,
            c::CONFIGURATION_ANSIBLE,
            c::CONFIGURATION_NAPALM,
        ]);
    }
    out
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    fn spec() -> proto::LessonSpec {
        let endpoint =
            |name: &str, kind: ConfigurationType, file: &str, driver: &str| proto::Endpoint {
                name: name.into(),
                image: Some(proto::Image {
                    slug: "sshd".into(),
                    config_user: "antidote".into(),
                    config_password: "config-secret".into(),
                    ..Default::default()
                }),
                configuration: Some(proto::StageConfiguration {
                    r#type: kind as i32,
                    file_name: file.into(),
                    contents: b"print('hi')\n".to_vec(),
                    driver: driver.into(),
                }),
                ..Default::default()
            };
        proto::LessonSpec {
            live_lesson_id: "0b5d6c1e-2f7a-4c39-9a51-3c1f0e8d2a77".into(),
            generation: 3,
            stage: 1,
            endpoints: vec![
                endpoint("box", ConfigurationType::Python, "box.py", ""),
                endpoint("vqfx", ConfigurationType::Napalm, "vqfx-junos.txt", "junos"),
                endpoint("sh", ConfigurationType::Shell, "sh.sh", ""),
            ],
            ..Default::default()
        }
    }

    #[test]
    fn jobs_mount_their_file_and_take_credentials_from_the_secret() {
        let settings = Settings::parse_from([
            "agent-k8s",
            "--configurator-image",
            "antidote/configurator:latest",
        ]);
        let spec = spec();
        let ips = BTreeMap::from([("vqfx".to_owned(), "10.96.0.7".to_owned())]);
        let job = job_manifest(&settings, &spec, 1, &ips);
        let pod = &job["spec"]["template"]["spec"];
        let container = &pod["containers"][0];
        assert_eq!(container["image"], "antidote/configurator:latest");
        assert_eq!(
            container["command"],
            json!(["antidote-napalm", "/antidote/stage1/configs/vqfx-junos.txt"])
        );
        assert_eq!(
            container["volumeMounts"][0]["mountPath"],
            "/antidote/stage1/configs"
        );
        assert_eq!(pod["volumes"][0]["configMap"]["name"], "config-files-g3");
        assert_eq!(
            pod["volumes"][0]["configMap"]["items"][0],
            json!({ "key": "vqfx.vqfx-junos.txt", "path": "vqfx-junos.txt" })
        );
        let text = job.to_string();
        assert!(!text.contains("config-secret"), "{text}");
        assert!(
            text.contains(
                "\"secretKeyRef\":{\"key\":\"vqfx.password\",\"name\":\"config-credentials\"}"
            ),
            "{text}"
        );
        assert_eq!(job["spec"]["backoffLimit"], 2);
        assert_eq!(pod["activeDeadlineSeconds"], 300);
        // The endpoint by name, without DNS (the lesson policy allows none).
        assert_eq!(
            pod["hostAliases"],
            json!([{ "ip": "10.96.0.7", "hostnames": ["vqfx"] }])
        );
        assert_eq!(container["imagePullPolicy"], "IfNotPresent");

        let files = configmap_manifest(&spec);
        assert_eq!(files["binaryData"]["box.box.py"], "cHJpbnQoJ2hpJykK");
        assert!(
            files["binaryData"].get("sh.sh.sh").is_none(),
            "shell is not the configurator's"
        );
        let secret = secret_manifest(&spec);
        assert_eq!(secret["data"]["vqfx.user"], "YW50aWRvdGU=");
        assert!(capabilities(&settings).contains(&"configuration.napalm"));
        let checks = checks_pod_manifest(
            &settings,
            &spec,
            "checks-1a2b3c4d",
            &ips,
            std::time::Duration::from_secs(90),
        );
        assert_eq!(checks["kind"], "Pod");
        assert_eq!(checks["spec"]["activeDeadlineSeconds"], 90);
        assert_eq!(checks["spec"]["restartPolicy"], "Never");
        assert_eq!(checks["spec"]["automountServiceAccountToken"], false);
        assert_eq!(
            checks["spec"]["hostAliases"],
            json!([{ "ip": "10.96.0.7", "hostnames": ["vqfx"] }])
        );
        let container = &checks["spec"]["containers"][0];
        assert_eq!(container["command"], json!(["sleep", "90"]));
        assert_eq!(container["image"], "antidote/configurator:latest");
        assert!(
            checks["metadata"]["labels"]
                .get(cluster::LABEL_ENDPOINT)
                .is_none(),
            "a checks pod is no endpoint's"
        );
        assert!(!checks.to_string().contains("config-secret"));
        let plain = Settings::parse_from(["agent-k8s"]);
        assert_eq!(capabilities(&plain), vec!["configuration.shell"]);
    }
}
