//! Python, ansible and napalm stage configurations, the way Antidote ran them: from a
//! configurator container on the lesson's network, which reaches endpoints by their names.
//!
//! One configurator container per stage run of a live lesson (never one per endpoint: on
//! Docker's vfs driver every container copies its image, and the configurator image is large):
//! [`Configurator::start`] creates `<stem>-configurator` from `--configurator-image` with the
//! lesson's labels (so removal and orphan collection find it), writes the stage's files to
//! `/antidote/stageN/configs/F` (one archive upload), then each configuration runs by exec
//! ([`command`]: `python3 F`, `ansible-playbook -i '<endpoint>,' F`, `antidote-napalm F`), bounded
//! in time and output like shell runs. Credentials reach it only through the exec's environment
//! ([`environment`]), never its command line; [`Configurator::finish`] removes the container.

use std::collections::HashMap;

use antidote_proto::agent::v1 as proto;
use bollard::Docker;
use bollard::errors::Error as DockerError;
use bollard::models::{ContainerCreateBody, HostConfig};
use bollard::query_parameters::{
    CreateContainerOptions, RemoveContainerOptions, UploadToContainerOptions,
};
use proto::ConfigurationType;

use crate::engine::{self, EngineError, Run, Tail};
use crate::settings::Settings;

/// The configurator image agent-docker uses unless told otherwise (built by
/// `tests/docker/configurator.sh`).
pub const DEFAULT_IMAGE: &str = "antidote/configurator:latest";

/// The label marking a configurator container (value: the stage it configures).
pub const LABEL_CONFIGURATOR: &str = "antidote.io/configurator-stage";

/// The container name of a live lesson's configurator.
pub fn container_name(live_lesson_id: &str) -> String {
    format!("{}-configurator", engine::stem(live_lesson_id))
}

/// Where a stage's configuration files are written in the configurator.
pub fn config_dir(stage: u32) -> String {
    format!("/antidote/stage{stage}/configs")
}

/// Whether the configurator image is on the engine: without it, agent-docker runs shell
/// configurations only and does not claim the others (checked once, at start).
pub async fn available(docker: &Docker, settings: &Settings) -> bool {
    if settings.configurator_image.is_empty() {
        return false;
    }
    match docker.inspect_image(&settings.configurator_image).await {
        Ok(_) => true,
        Err(err) => {
            tracing::warn!(
                image = %settings.configurator_image,
                error = %err,
                "the configurator image is not on the engine (build it with tests/docker/configurator.sh): python, ansible and napalm configurations are not offered"
            );
            false
        }
    }
}

/// Whether a configuration runs in the configurator (every type but shell, which runs in the
/// endpoint itself).
pub fn runs_here(configuration: &proto::StageConfiguration) -> bool {
    configuration.r#type != ConfigurationType::Shell as i32
}

/// The command line of one configuration run (no secrets: see [`environment`]).
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
            // The password from the environment, by name: never on the command line.
            "-e".into(),
            "ansible_password={{ lookup('env', 'ANTIDOTE_CONFIG_PASSWORD') }}".into(),
            file,
        ],
        Ok(ConfigurationType::Napalm) => vec!["antidote-napalm".into(), file],
        _ => vec!["python3".into(), file],
    }
}

/// The environment of one configuration run: the endpoint it configures, the stage, the image's
/// configuration credentials (its SSH credentials when it names none) and the NAPALM driver.
pub fn environment(
    endpoint: &proto::Endpoint,
    configuration: &proto::StageConfiguration,
    stage: u32,
) -> Vec<String> {
    let image = endpoint.image.clone().unwrap_or_default();
    let (user, password) = if image.config_user.is_empty() {
        (image.ssh_user, image.ssh_password)
    } else {
        (image.config_user, image.config_password)
    };
    vec![
        format!("ANTIDOTE_HOST={}", endpoint.name),
        format!("ANTIDOTE_ENDPOINT={}", endpoint.name),
        format!("ANTIDOTE_STAGE={stage}"),
        format!("ANTIDOTE_CONFIG_USER={user}"),
        format!("ANTIDOTE_CONFIG_PASSWORD={password}"),
        format!("ANSIBLE_REMOTE_USER={user}"),
        format!("ANTIDOTE_NAPALM_DRIVER={}", configuration.driver),
        "ANTIDOTE_NAPALM_PORT=22".into(),
        // ansible-core refuses to run without a UTF-8 locale; glibc always has this one.
        "LC_ALL=C.UTF-8".into(),
    ]
}

/// A tar archive (ustar) of the stage's configuration files at `antidote/stageN/configs/F`.
pub fn archive(spec: &proto::LessonSpec) -> Vec<u8> {
    let mut out = Vec::new();
    let dir = config_dir(spec.stage);
    let dir = dir.trim_start_matches('/');
    let mut path = String::new();
    for part in dir.split('/') {
        path.push_str(part);
        path.push('/');
        header(&mut out, &path, 0, b'5');
    }
    for endpoint in &spec.endpoints {
        let Some(configuration) = &endpoint.configuration else {
            continue;
        };
        if !runs_here(configuration) {
            continue;
        }
        // The spec rules make the name 1-253 plain characters: with the 25-byte directory the
        // path fits ustar's 100 bytes only up to 74; longer names go in a GNU long-name entry.
        let name = format!("{dir}/{}", configuration.file_name);
        if name.len() >= 100 {
            // A GNU long-name entry ('L') carries the whole path; the header after it is cut.
            header(&mut out, "././@LongLink", name.len() + 1, b'L');
            out.extend_from_slice(name.as_bytes());
            out.push(0);
            pad(&mut out);
            header(&mut out, &name[..99], configuration.contents.len(), b'0');
        } else {
            header(&mut out, &name, configuration.contents.len(), b'0');
        }
        out.extend_from_slice(&configuration.contents);
        pad(&mut out);
    }
    out.extend_from_slice(&[0u8; 1024]);
    out
}

/// A tar archive of one file at `path` (relative, under 100 bytes, its directories created),
/// for an upload at `/`.
pub fn one_file(path: &str, contents: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut dir = String::new();
    let parts: Vec<&str> = path.split('/').collect();
    for part in &parts[..parts.len() - 1] {
        dir.push_str(part);
        dir.push('/');
        header(&mut out, &dir, 0, b'5');
    }
    header(&mut out, path, contents.len(), b'0');
    out.extend_from_slice(contents);
    pad(&mut out);
    out.extend_from_slice(&[0u8; 1024]);
    out
}

/// One ustar header: a directory (`5`), a file (`0`) or a GNU long name (`L`), owned by root.
fn header(out: &mut Vec<u8>, path: &str, size: usize, kind: u8) {
    let directory = kind == b'5';
    let mut h = [0u8; 512];
    h[..path.len()].copy_from_slice(path.as_bytes());
    let octal = |field: &mut [u8], value: u64| {
        let text = format!("{value:0width$o}\0", width = field.len() - 1);
        field.copy_from_slice(text.as_bytes());
    };
    octal(&mut h[100..108], if directory { 0o755 } else { 0o644 });
    octal(&mut h[108..116], 0);
    octal(&mut h[116..124], 0);
    octal(&mut h[124..136], size as u64);
    octal(&mut h[136..148], 0);
    h[156] = kind;
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    // The checksum is computed with its own field as spaces.
    h[148..156].copy_from_slice(b"        ");
    let sum: u32 = h.iter().map(|b| u32::from(*b)).sum();
    let text = format!("{sum:06o}\0 ");
    h[148..156].copy_from_slice(text.as_bytes());
    out.extend_from_slice(&h);
}

fn pad(out: &mut Vec<u8>) {
    let over = out.len() % 512;
    if over != 0 {
        out.resize(out.len() + 512 - over, 0);
    }
}

/// A running configurator container for one stage run.
pub struct Configurator {
    /// Its container name.
    pub name: String,
}

impl Configurator {
    /// Creates and starts the live lesson's configurator for `spec`'s stage (replacing one left
    /// by an earlier run) and writes the stage's files into it.
    pub async fn start(
        docker: &Docker,
        settings: &Settings,
        spec: &proto::LessonSpec,
    ) -> Result<Configurator, EngineError> {
        Self::start_named(docker, settings, spec, container_name(&spec.live_lesson_id)).await
    }

    /// A configurator for a run of python check or solution files, apart from the stage's
    /// (a stage change going on beside it keeps its own).
    pub async fn start_for_checks(
        docker: &Docker,
        settings: &Settings,
        spec: &proto::LessonSpec,
    ) -> Result<Configurator, EngineError> {
        let name = format!("{}-checks", container_name(&spec.live_lesson_id));
        Self::start_named(docker, settings, spec, name).await
    }

    /// [`Configurator::start`] under `name`.
    async fn start_named(
        docker: &Docker,
        settings: &Settings,
        spec: &proto::LessonSpec,
        name: String,
    ) -> Result<Configurator, EngineError> {
        remove(docker, &name).await?;
        let mut labels = engine::labels(spec);
        labels.insert(LABEL_CONFIGURATOR.into(), spec.stage.to_string());
        let body = ContainerCreateBody {
            image: Some(settings.configurator_image.clone()),
            cmd: Some(vec!["sleep".into(), "infinity".into()]),
            hostname: Some("configurator".into()),
            labels: Some(labels),
            host_config: Some(HostConfig {
                // On the lesson's network: endpoints by their names, nothing else.
                network_mode: Some(engine::lesson_network(&spec.live_lesson_id)),
                cap_drop: Some(vec!["ALL".into()]),
                security_opt: Some(vec!["no-new-privileges:true".into()]),
                pids_limit: (settings.pids_limit > 0).then_some(settings.pids_limit),
                memory: (settings.configurator_memory_mib > 0)
                    .then(|| (settings.configurator_memory_mib * 1024 * 1024) as i64),
                nano_cpus: (settings.cpus > 0.0).then_some((settings.cpus * 1e9) as i64),
                ..Default::default()
            }),
            ..Default::default()
        };
        match docker
            .create_container(
                Some(CreateContainerOptions {
                    name: Some(name.clone()),
                    ..Default::default()
                }),
                body,
            )
            .await
        {
            Ok(_) => {}
            Err(err) if engine::is_not_found(&err) => {
                return Err(EngineError::MissingImage {
                    image: settings.configurator_image.clone(),
                    endpoint: "configurator".into(),
                });
            }
            Err(err) => return Err(err.into()),
        }
        let configurator = Configurator { name };
        let started = async {
            docker.start_container(&configurator.name, None).await?;
            docker
                .upload_to_container(
                    &configurator.name,
                    Some(UploadToContainerOptions {
                        path: "/".into(),
                        ..Default::default()
                    }),
                    bollard::body_full(archive(spec).into()),
                )
                .await?;
            Ok::<_, EngineError>(())
        };
        if let Err(err) = started.await {
            configurator.finish(docker).await;
            return Err(err);
        }
        Ok(configurator)
    }

    /// Runs one endpoint's configuration once, for at most `timeout`.
    pub async fn run(
        &self,
        docker: &Docker,
        endpoint: &proto::Endpoint,
        configuration: &proto::StageConfiguration,
        stage: u32,
        timeout: std::time::Duration,
    ) -> Result<(Run, Tail), EngineError> {
        engine::exec_command(
            docker,
            &self.name,
            &command(&endpoint.name, configuration, stage),
            environment(endpoint, configuration, stage),
            Some(config_dir(stage)),
            timeout,
        )
        .await
    }

    /// Runs a python check or solution file (its text on `python3`'s stdin) against `endpoint` once,
    /// for at most `timeout`, with a configuration's environment (its credentials only there).
    pub async fn run_python(
        &self,
        docker: &Docker,
        endpoint: &proto::Endpoint,
        file_name: &str,
        script: &str,
        stage: u32,
        timeout: std::time::Duration,
    ) -> Result<(Run, Tail), EngineError> {
        let configuration = proto::StageConfiguration::default();
        engine::exec_python(
            docker,
            &self.name,
            file_name,
            script,
            environment(endpoint, &configuration, stage),
            timeout,
        )
        .await
    }

    /// Removes the configurator (and whatever still runs in it).
    pub async fn finish(self, docker: &Docker) {
        if let Err(err) = remove(docker, &self.name).await {
            tracing::warn!(container = %self.name, error = %err, "could not remove the configurator; the lesson's removal will");
        }
    }
}

async fn remove(docker: &Docker, name: &str) -> Result<(), EngineError> {
    match docker
        .remove_container(
            name,
            Some(RemoveContainerOptions {
                force: true,
                v: true,
                ..Default::default()
            }),
        )
        .await
    {
        Ok(()) => Ok(()),
        Err(err) if engine::is_not_found(&err) => Ok(()),
        Err(DockerError::DockerResponseServerError {
            status_code: 409, ..
        }) => Ok(()),
        Err(err) => Err(err.into()),
    }
}

/// The capabilities agent-docker adds for configuration types: shell always, the others when
/// the configurator image is there.
pub fn capabilities(available: bool) -> Vec<&'static str> {
    use antidote_sdk::capabilities as c;
    let mut out = vec![c::CONFIGURATION_SHELL];
    if available {
        out.extend([
            c::CONFIGURATION_PYTHON,
            c::CONFIGURATION_ANSIBLE,
            c::CONFIGURATION_NAPALM,
        ]);
    }
    out
}

/// Labels of a configurator container, for tests and discovery: it carries the lesson's.
pub fn is_configurator(labels: &HashMap<String, String>) -> bool {
    labels.contains_key(LABEL_CONFIGURATOR)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint(kind: ConfigurationType, file: &str, driver: &str) -> proto::Endpoint {
        proto::Endpoint {
            name: "box".into(),
            image: Some(proto::Image {
                slug: "sshd".into(),
                ssh_user: "learner".into(),
                ssh_password: "ssh-secret".into(),
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
        }
    }

    #[test]
    fn commands_name_the_file_and_never_a_secret() {
        for (kind, file, driver, expected) in [
            (
                ConfigurationType::Python,
                "box.py",
                "",
                vec!["python3", "/antidote/stage2/configs/box.py"],
            ),
            (
                ConfigurationType::Ansible,
                "box.yml",
                "",
                vec![
                    "ansible-playbook",
                    "-i",
                    "box,",
                    "-e",
                    "ansible_password={{ lookup('env', 'ANTIDOTE_CONFIG_PASSWORD') }}",
                    "/antidote/stage2/configs/box.yml",
                ],
            ),
            (
                ConfigurationType::Napalm,
                "box-junos.txt",
                "junos",
                vec!["antidote-napalm", "/antidote/stage2/configs/box-junos.txt"],
            ),
        ] {
            let e = endpoint(kind, file, driver);
            let c = e.configuration.as_ref().unwrap();
            let line = command(&e.name, c, 2);
            assert_eq!(line, expected);
            assert!(!line.join(" ").contains("secret"));
            let env = environment(&e, c, 2);
            assert!(env.contains(&"ANTIDOTE_CONFIG_USER=antidote".to_owned()));
            assert!(env.contains(&"ANTIDOTE_CONFIG_PASSWORD=config-secret".to_owned()));
            assert!(env.contains(&"ANTIDOTE_HOST=box".to_owned()));
            assert!(env.contains(&format!("ANTIDOTE_NAPALM_DRIVER={driver}")));
        }
        // Without configuration credentials, the SSH ones.
        let mut e = endpoint(ConfigurationType::Python, "box.py", "");
        e.image.as_mut().unwrap().config_user.clear();
        let env = environment(&e, e.configuration.as_ref().unwrap(), 0);
        assert!(env.contains(&"ANTIDOTE_CONFIG_USER=learner".to_owned()));
        assert!(env.contains(&"ANTIDOTE_CONFIG_PASSWORD=ssh-secret".to_owned()));
    }

    #[test]
    fn the_archive_holds_the_stage_files_under_antidote() {
        let mut spec = proto::LessonSpec {
            stage: 1,
            endpoints: vec![endpoint(ConfigurationType::Python, "box.py", "")],
            ..Default::default()
        };
        let mut shell = endpoint(ConfigurationType::Shell, "other.sh", "");
        shell.name = "other".into();
        spec.endpoints.push(shell);
        let long = "x".repeat(200);
        let mut third = endpoint(ConfigurationType::Python, &long, "");
        third.name = "third".into();
        spec.endpoints.push(third);
        let tar = archive(&spec);
        assert_eq!(tar.len() % 512, 0);
        let text = String::from_utf8_lossy(&tar);
        assert!(text.contains("antidote/stage1/configs/box.py"));
        assert!(text.contains("print('hi')"));
        assert!(!text.contains("other.sh"), "shell runs in the endpoint");
        assert!(text.contains(&format!("antidote/stage1/configs/{long}")));
        // Every header's checksum is right (what `tar` itself checks).
        let mut offset = 0;
        let mut headers = 0;
        while offset + 512 <= tar.len() && tar[offset] != 0 {
            let h = &tar[offset..offset + 512];
            let stored = u32::from_str_radix(
                std::str::from_utf8(&h[148..154]).unwrap().trim_matches(' '),
                8,
            )
            .unwrap();
            let sum: u32 = h
                .iter()
                .enumerate()
                .map(|(i, b)| {
                    if (148..156).contains(&i) {
                        32
                    } else {
                        u32::from(*b)
                    }
                })
                .sum();
            assert_eq!(stored, sum, "header at {offset}");
            let size = u64::from_str_radix(
                std::str::from_utf8(&h[124..135])
                    .unwrap()
                    .trim_matches('\0'),
                8,
            )
            .unwrap() as usize;
            offset += 512 + size.div_ceil(512) * 512;
            headers += 1;
        }
        // Three directories, the long name's entry and two files.
        assert_eq!(headers, 6);
    }
}
