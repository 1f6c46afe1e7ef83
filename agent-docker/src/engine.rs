//! Every Docker call the agent makes, through bollard. Names are derived from the live lesson id
//! so that a retried Provision finds what an earlier attempt created instead of creating it
//! again; labels make everything findable after a restart.

use std::collections::{HashMap, HashSet};

use antidote_proto::agent::v1 as proto;
use bollard::Docker;
use bollard::errors::Error as DockerError;
use bollard::models::{
    ContainerCreateBody, EndpointSettings, ExecConfig, HostConfig, Ipam, IpamConfig,
    NetworkConnectRequest, NetworkCreateRequest, NetworkingConfig, PortBinding,
};
use bollard::query_parameters::{
    CreateContainerOptions, InspectContainerOptions, ListContainersOptions, ListNetworksOptions,
    RemoveContainerOptions,
};
use futures::StreamExt;

use crate::firewall::{Confinement, Firewall, FirewallError};
use crate::settings::Settings;

/// The label naming a live lesson (from the spec's labels).
pub const LABEL_LIVE_LESSON: &str = "antidote.io/live-lesson";
/// The label naming the endpoint a container realises.
pub const LABEL_ENDPOINT: &str = "antidote.io/endpoint";
/// The label marking objects this agent manages.
pub const LABEL_MANAGED: &str = "antidote.io/managed-by";

/// The capabilities of an unprivileged endpoint, after dropping all: NET_ADMIN and NET_RAW for
/// the lesson's own networking (addresses, routes, ping, captures; they act only on the
/// container's network namespace), and of the runtime's usual set what SSH servers, shells and
/// services on low ports need (switching users, owning files, chroot, audit records, binding
/// ports below 1024). MKNOD, SETFCAP and SETPCAP are left out.
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

pub use antidote_sdk::output::{OUTPUT_KEPT, PidLine, Run, Tail};

/// A Docker failure, with the engine's words.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The engine said no, or could not be reached.
    #[error("docker: {0}")]
    Docker(#[from] DockerError),
    /// The host firewall rules of a lesson network could not be installed or removed.
    #[error("firewall: {0}")]
    Firewall(#[from] FirewallError),
    /// An image is missing; no registry is used, so it must be built locally.
    #[error(
        "image `{image}` for endpoint `{endpoint}` is not present on the Docker engine (no registry is used: build it locally, e.g. tests/docker/images.sh)"
    )]
    MissingImage {
        /// The image reference.
        image: String,
        /// The endpoint needing it.
        endpoint: String,
    },
}

/// Whether an error is the engine's 404.
pub fn is_not_found(err: &DockerError) -> bool {
    matches!(
        err,
        DockerError::DockerResponseServerError {
            status_code: 404,
            ..
        }
    )
}

/// A short, stable name stem for a live lesson: `antidote-<first 12 hex of its id>`.
pub fn stem(live_lesson_id: &str) -> String {
    let hex: String = live_lesson_id
        .chars()
        .filter(char::is_ascii_hexdigit)
        .take(12)
        .collect();
    format!("antidote-{hex}")
}

/// The container name of an endpoint.
pub fn container_name(live_lesson_id: &str, endpoint: &str) -> String {
    format!("{}-{endpoint}", stem(live_lesson_id))
}

/// The lesson's own network (every endpoint is on it; names resolve on it).
pub fn lesson_network(live_lesson_id: &str) -> String {
    format!("{}-lesson", stem(live_lesson_id))
}

/// The network of the `index`th connection.
pub fn connection_network(live_lesson_id: &str, index: usize) -> String {
    format!("{}-link{index}", stem(live_lesson_id))
}

/// Labels for every object of a live lesson.
pub fn labels(spec: &proto::LessonSpec) -> HashMap<String, String> {
    let mut labels = spec.labels.clone();
    labels.insert(LABEL_LIVE_LESSON.into(), spec.live_lesson_id.clone());
    labels.insert(LABEL_MANAGED.into(), "agent-docker".into());
    labels
}

/// Where a created endpoint can be reached.
#[derive(Debug, Clone, Default)]
pub struct Placed {
    /// Container port → published `host:port`.
    pub published: HashMap<u16, String>,
    /// The address on the lesson network.
    pub internal_address: String,
}

/// The id of the network if this call created it (None: it was there, or a concurrent attempt
/// made it).
async fn ensure_network(
    docker: &Docker,
    name: &str,
    labels: &HashMap<String, String>,
    internal: bool,
    subnet: Option<&str>,
) -> Result<Option<String>, EngineError> {
    // `subnet` stays for engines where overlapping pools are allowed; today every caller
    // passes None (see `create`).
    let existing = docker
        .list_networks(Some(ListNetworksOptions {
            filters: Some(HashMap::from([("name".to_owned(), vec![name.to_owned()])])),
        }))
        .await?;
    if existing.iter().any(|n| n.name.as_deref() == Some(name)) {
        return Ok(None);
    }
    let request = NetworkCreateRequest {
        name: name.to_owned(),
        driver: Some("bridge".into()),
        internal: Some(internal),
        labels: Some(labels.clone()),
        ipam: subnet.map(|subnet| Ipam {
            config: Some(vec![IpamConfig {
                subnet: Some(subnet.to_owned()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    };
    match docker.create_network(request).await {
        Ok(created) => Ok(Some(created.id)),
        // A concurrent attempt created it first: same name, same owner.
        Err(DockerError::DockerResponseServerError {
            status_code: 409, ..
        }) => Ok(None),
        Err(err) => Err(err.into()),
    }
}

/// Creates (or finds) the lesson's networks and containers, in lesson order, starts them, and
/// reports where each endpoint's ports are published.
pub async fn create(
    docker: &Docker,
    settings: &Settings,
    firewall: &Firewall,
    spec: &proto::LessonSpec,
) -> Result<(HashMap<String, Placed>, Confinement), EngineError> {
    let id = &spec.live_lesson_id;
    let labels = labels(spec);
    let lesson_net = lesson_network(id);
    // Networks created here have new bridges: their firewall rules go in without a check.
    let mut fresh = HashMap::new();
    if let Some(created) = ensure_network(docker, &lesson_net, &labels, false, None).await? {
        fresh.insert(lesson_net.clone(), created);
    }
    for index in 0..spec.connections.len() {
        // The curriculum's subnet is not given to Docker's IPAM: Docker refuses overlapping
        // pools, and two learners taking the same lesson would collide. The lesson's
        // configuration addresses its links itself (as the example curriculum does). Links are
        // not `internal`: Docker filters internal bridges by their IPAM subnet, which would
        // drop the lesson's own addresses; other lessons are still cut off by Docker's
        // isolation between bridges.
        let network = connection_network(id, index);
        if let Some(created) = ensure_network(docker, &network, &labels, false, None).await? {
            fresh.insert(network, created);
        }
    }
    // Before any container exists, so that no endpoint ever runs unconfined. When this call
    // created every network of the lesson, it knows their bridges without asking the engine.
    let confinement = if fresh.len() == 1 + spec.connections.len() {
        let mut outcome = Confinement::Confined;
        for (name, network_id) in &fresh {
            if let Confinement::Unconfined(why) = firewall
                .confine(name, &default_bridge(network_id), true)
                .await?
            {
                outcome = Confinement::Unconfined(why);
            }
        }
        outcome
    } else {
        confine_networks(docker, firewall, id, &fresh).await?
    };
    let mut placed = HashMap::new();
    for endpoint in &spec.endpoints {
        let name = container_name(id, &endpoint.name);
        let image = endpoint.image.clone().unwrap_or_default();
        {
            let mut container_labels = labels.clone();
            container_labels.insert(LABEL_ENDPOINT.into(), endpoint.name.clone());
            let ports: Vec<u32> = endpoint
                .presentations
                .iter()
                .map(|p| p.port)
                .chain(endpoint.additional_ports.iter().copied())
                .collect();
            let port_bindings = ports
                .iter()
                .map(|port| {
                    (
                        format!("{port}/tcp"),
                        Some(vec![PortBinding {
                            host_ip: Some(settings.publish_host.clone()),
                            host_port: Some(String::new()),
                        }]),
                    )
                })
                .collect();
            let trusted = matches!(
                proto::Flavor::try_from(image.flavor),
                Ok(proto::Flavor::Trusted | proto::Flavor::Legacy)
            );
            let privileged = trusted && settings.trusted_privileged;
            let body = ContainerCreateBody {
                image: Some(settings.image_of(endpoint)),
                hostname: Some(endpoint.name.clone()),
                labels: Some(container_labels),
                exposed_ports: Some(ports.iter().map(|port| format!("{port}/tcp")).collect()),
                host_config: Some(HostConfig {
                    network_mode: Some(lesson_net.clone()),
                    port_bindings: Some(port_bindings),
                    privileged: Some(privileged),
                    // Privileged means every capability: dropping some would be a lie.
                    cap_drop: (!privileged).then(|| vec!["ALL".to_owned()]),
                    cap_add: (!privileged)
                        .then(|| LINUX_CAPABILITIES.iter().map(|c| (*c).to_owned()).collect()),
                    // No setuid binary (su, sudo) raises a process's privileges. The opt-in
                    // privileged endpoints are the operator's call and keep them.
                    security_opt: (!privileged).then(|| vec!["no-new-privileges:true".to_owned()]),
                    pids_limit: (settings.pids_limit > 0).then_some(settings.pids_limit),
                    memory: (settings.memory_mib > 0)
                        .then(|| (settings.memory_mib * 1024 * 1024) as i64),
                    nano_cpus: (settings.cpus > 0.0).then_some((settings.cpus * 1e9) as i64),
                    sysctls: Some(HashMap::from([(
                        "net.ipv4.ip_forward".to_owned(),
                        if image.enable_forwarding { "1" } else { "0" }.to_owned(),
                    )])),
                    ..Default::default()
                }),
                networking_config: Some(NetworkingConfig {
                    endpoints_config: Some(HashMap::from([(
                        lesson_net.clone(),
                        EndpointSettings {
                            aliases: Some(vec![endpoint.name.clone()]),
                            ..Default::default()
                        },
                    )])),
                }),
                ..Default::default()
            };
            // Create first and let a conflict say it exists: one call instead of two on the
            // common path, and no window between a check and the create.
            let created = match docker
                .create_container(
                    Some(CreateContainerOptions {
                        name: Some(name.clone()),
                        ..Default::default()
                    }),
                    body,
                )
                .await
            {
                Ok(_) => true,
                Err(DockerError::DockerResponseServerError {
                    status_code: 409, ..
                }) => false,
                Err(err) if is_not_found(&err) => {
                    return Err(EngineError::MissingImage {
                        image: settings.image_of(endpoint),
                        endpoint: endpoint.name.clone(),
                    });
                }
                Err(err) => return Err(err.into()),
            };
            for (index, connection) in spec.connections.iter().enumerate() {
                if created && (connection.a == endpoint.name || connection.b == endpoint.name) {
                    docker
                        .connect_network(
                            &connection_network(id, index),
                            NetworkConnectRequest {
                                container: name.clone(),
                                endpoint_config: Some(EndpointSettings {
                                    aliases: Some(vec![endpoint.name.clone()]),
                                    ..Default::default()
                                }),
                            },
                        )
                        .await?;
                }
            }
        }
        match docker.start_container(&name, None).await {
            Ok(()) => {}
            // 304: already running.
            Err(DockerError::DockerResponseServerError {
                status_code: 304, ..
            }) => {}
            Err(err) => return Err(err.into()),
        }
        placed.insert(
            endpoint.name.clone(),
            inspect(docker, &name, &lesson_net).await?,
        );
    }
    Ok((placed, confinement))
}

/// Installs the host firewall rules of every network of a live lesson (idempotent): the lesson's
/// bridges may not reach the host, nor beyond themselves unless egress is allowed. `fresh`
/// maps the networks just created to their ids (see [`Firewall::confine`]).
pub async fn confine_networks(
    docker: &Docker,
    firewall: &Firewall,
    live_lesson_id: &str,
    fresh: &HashMap<String, String>,
) -> Result<Confinement, EngineError> {
    let networks = docker
        .list_networks(Some(ListNetworksOptions {
            filters: Some(HashMap::from([(
                "label".to_owned(),
                vec![format!("{LABEL_LIVE_LESSON}={live_lesson_id}")],
            )])),
        }))
        .await?;
    let mut outcome = Confinement::Confined;
    for network in networks {
        let (Some(name), Some(id)) = (network.name, network.id) else {
            continue;
        };
        let bridge = network
            .options
            .as_ref()
            .and_then(|o| o.get("com.docker.network.bridge.name"))
            .cloned()
            .unwrap_or_else(|| default_bridge(&id));
        let fresh = fresh.contains_key(&name);
        if let Confinement::Unconfined(why) = firewall.confine(&name, &bridge, fresh).await? {
            outcome = Confinement::Unconfined(why);
        }
    }
    Ok(outcome)
}

/// The bridge Docker names for a network it was given no bridge name for: `br-` and the first
/// 12 characters of the network's id.
fn default_bridge(network_id: &str) -> String {
    format!("br-{}", &network_id[..12.min(network_id.len())])
}

/// Where a container's ports are published and its address on the lesson network.
pub async fn inspect(docker: &Docker, name: &str, lesson_net: &str) -> Result<Placed, EngineError> {
    let info = docker
        .inspect_container(name, None::<InspectContainerOptions>)
        .await?;
    let settings = info.network_settings.unwrap_or_default();
    let mut published = HashMap::new();
    for (key, bindings) in settings.ports.unwrap_or_default() {
        let Some(port) = key.split('/').next().and_then(|p| p.parse::<u16>().ok()) else {
            continue;
        };
        if let Some(binding) = bindings.unwrap_or_default().into_iter().next() {
            published.insert(
                port,
                format!(
                    "{}:{}",
                    binding.host_ip.unwrap_or_else(|| "127.0.0.1".into()),
                    binding.host_port.unwrap_or_default()
                ),
            );
        }
    }
    let internal_address = settings
        .networks
        .unwrap_or_default()
        .get(lesson_net)
        .and_then(|n| n.ip_address.clone())
        .unwrap_or_default();
    Ok(Placed {
        published,
        internal_address,
    })
}

/// The command a configuration runs as: a shell that reports its pid on stderr's first line,
/// then becomes the command (for a shell script: `sh -c SCRIPT`). `docker exec` starts it as a
/// session and process group leader, so the pid names the whole group when the run has to be
/// killed.
const CONFIG_WRAPPER: &str = "echo $$ >&2; exec \"$@\"";

/// Runs a shell script in a container for at most `timeout`. Returns how it ended and the
/// last [`OUTPUT_KEPT`] bytes of its combined output. A run still going at the timeout is
/// killed with its process group (best effort: the engine offers no way to stop an exec).
pub async fn exec_shell(
    docker: &Docker,
    container: &str,
    script: &str,
    timeout: std::time::Duration,
) -> Result<(Run, Tail), EngineError> {
    // The script goes on the shell's standard input, never as an argument: Linux refuses one
    // argument over 128 KiB and a script may hold 256 KiB (PROTOCOL.md [V5]). The shell reads
    // it whole before running it, so that what the script runs finds its stdin at its end, as
    // it would have with `sh -c`.
    exec_run(
        docker,
        container,
        &[
            "sh".to_owned(),
            "-c".to_owned(),
            "script=$(cat) && eval \"$script\"".to_owned(),
        ],
        vec![],
        None,
        Some(script.as_bytes().to_vec()),
        timeout,
    )
    .await
}

/// Runs a Python script in a container with `env`, for at most `timeout`, as [`exec_shell`]
/// runs a shell script: the script on the interpreter's standard input, read whole before it
/// runs (so its own reads of stdin find the end), never as an argument (PROTOCOL.md [V5]).
pub async fn exec_python(
    docker: &Docker,
    container: &str,
    file_name: &str,
    script: &str,
    env: Vec<String>,
    timeout: std::time::Duration,
) -> Result<(Run, Tail), EngineError> {
    let program = format!(
        "import sys; source = sys.stdin.read(); sys.stdin = open('/dev/null'); \
         exec(compile(source, {file_name:?}, 'exec'), {{'__name__': '__main__'}})"
    );
    exec_run(
        docker,
        container,
        &["python3".to_owned(), "-c".to_owned(), program],
        env,
        None,
        Some(script.as_bytes().to_vec()),
        timeout,
    )
    .await
}

/// Runs `argv` in a container with `env` (`NAME=value`; secrets go here, never in `argv`: the
/// engine shows an exec's command line to anyone who inspects it) in `working_dir`, for at most
/// `timeout`, as [`exec_shell`] runs a script: how it ended and the last [`OUTPUT_KEPT`] bytes
/// of its combined output; a run still going at the timeout is killed with its process group.
pub async fn exec_command(
    docker: &Docker,
    container: &str,
    argv: &[String],
    env: Vec<String>,
    working_dir: Option<String>,
    timeout: std::time::Duration,
) -> Result<(Run, Tail), EngineError> {
    exec_run(docker, container, argv, env, working_dir, None, timeout).await
}

/// [`exec_command`], with `stdin` written to the run's standard input (then closed) when given.
async fn exec_run(
    docker: &Docker,
    container: &str,
    argv: &[String],
    env: Vec<String>,
    working_dir: Option<String>,
    stdin: Option<Vec<u8>>,
    timeout: std::time::Duration,
) -> Result<(Run, Tail), EngineError> {
    let mut cmd = vec![
        "sh".to_owned(),
        "-c".to_owned(),
        CONFIG_WRAPPER.to_owned(),
        "antidote-config".to_owned(),
    ];
    cmd.extend(argv.iter().cloned());
    let exec = docker
        .create_exec(
            container,
            ExecConfig {
                attach_stdout: Some(true),
                attach_stderr: Some(true),
                attach_stdin: Some(stdin.is_some()),
                cmd: Some(cmd),
                env: (!env.is_empty()).then_some(env),
                working_dir,
                ..Default::default()
            },
        )
        .await?;
    let mut output = Tail::new(OUTPUT_KEPT);
    let mut pid = PidLine::new();
    let streamed = async {
        if let bollard::exec::StartExecResults::Attached {
            output: mut stream,
            mut input,
        } = docker.start_exec(&exec.id, None).await?
        {
            if let Some(bytes) = &stdin {
                use tokio::io::AsyncWriteExt as _;
                input.write_all(bytes).await.map_err(DockerError::from)?;
                // Closing our side is the run's end of input.
                input.shutdown().await.map_err(DockerError::from)?;
            }
            while let Some(chunk) = stream.next().await {
                match chunk? {
                    bollard::container::LogOutput::StdErr { message } => {
                        pid.feed(&message, &mut output)
                    }
                    other => output.push(other.as_ref()),
                }
            }
        }
        Ok::<_, EngineError>(())
    };
    match tokio::time::timeout(timeout, streamed).await {
        Ok(streamed) => {
            streamed?;
            let inspected = docker.inspect_exec(&exec.id).await?;
            Ok((Run::Exited(inspected.exit_code.unwrap_or(-1)), output))
        }
        Err(_) => {
            match pid.pid() {
                Some(pid) if pid > 1 => kill_group(docker, container, pid).await,
                _ => tracing::warn!(
                    container,
                    "a timed-out configuration run left no pid to kill"
                ),
            }
            Ok((Run::TimedOut, output))
        }
    }
}

/// Kills a configuration run's process group inside the container (busybox's `kill` takes no
/// `--`, hence the second form).
async fn kill_group(docker: &Docker, container: &str, pid: u32) {
    let kill = async {
        let exec = docker
            .create_exec(
                container,
                ExecConfig {
                    cmd: Some(vec![
                        "sh".into(),
                        "-c".into(),
                        "kill -KILL -- \"-$1\" 2>/dev/null || kill -KILL \"-$1\"".into(),
                        "antidote-kill".into(),
                        pid.to_string(),
                    ]),
                    ..Default::default()
                },
            )
            .await?;
        docker
            .start_exec(
                &exec.id,
                Some(bollard::exec::StartExecOptions {
                    detach: true,
                    ..Default::default()
                }),
            )
            .await?;
        Ok::<_, DockerError>(())
    };
    match tokio::time::timeout(std::time::Duration::from_secs(10), kill).await {
        Ok(Ok(())) => {}
        Ok(Err(err)) => {
            tracing::warn!(container, error = %err, "could not kill a timed-out configuration run")
        }
        Err(_) => tracing::warn!(container, "killing a timed-out configuration run timed out"),
    }
}

/// Containers with every label of `selector` (all states), as (name, labels, state).
pub async fn containers(
    docker: &Docker,
    selector: &HashMap<String, String>,
) -> Result<Vec<(String, HashMap<String, String>, String)>, EngineError> {
    let mut filters: Vec<String> = selector.iter().map(|(k, v)| format!("{k}={v}")).collect();
    filters.push(format!("{LABEL_MANAGED}=agent-docker"));
    let list = docker
        .list_containers(Some(ListContainersOptions {
            all: true,
            filters: Some(HashMap::from([("label".to_owned(), filters)])),
            ..Default::default()
        }))
        .await?;
    Ok(list
        .into_iter()
        .map(|c| {
            let name = c
                .names
                .unwrap_or_default()
                .first()
                .map(|n| n.trim_start_matches('/').to_owned())
                .unwrap_or_default();
            let state = c.state.map(|s| s.to_string()).unwrap_or_default();
            (name, c.labels.unwrap_or_default(), state)
        })
        .collect())
}

/// Labels of every live lesson that still has a network on the engine (a removal cut short can
/// leave networks without containers), one entry per live lesson.
pub async fn network_lessons(
    docker: &Docker,
    selector: &HashMap<String, String>,
) -> Result<Vec<HashMap<String, String>>, EngineError> {
    let mut filters: Vec<String> = selector.iter().map(|(k, v)| format!("{k}={v}")).collect();
    filters.push(format!("{LABEL_MANAGED}=agent-docker"));
    let networks = docker
        .list_networks(Some(ListNetworksOptions {
            filters: Some(HashMap::from([("label".to_owned(), filters)])),
        }))
        .await?;
    let mut seen = HashSet::new();
    Ok(networks
        .into_iter()
        .filter_map(|n| n.labels)
        .filter(|labels| {
            labels
                .get(LABEL_LIVE_LESSON)
                .is_some_and(|id| seen.insert(id.clone()))
        })
        .collect())
}

/// Removes every container and network of a live lesson, then the networks' firewall rules;
/// idempotent.
/// Waits (at most a minute) for a container whose removal is in progress to be gone; still
/// there, it is an error, so the caller tries the removal again.
async fn until_removed(docker: &Docker, name: &str) -> Result<(), EngineError> {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        match docker.inspect_container(name, None).await {
            Err(err) if is_not_found(&err) => return Ok(()),
            Err(err) => return Err(err.into()),
            Ok(_) if tokio::time::Instant::now() >= deadline => {
                return Err(EngineError::Docker(
                    DockerError::DockerResponseServerError {
                        status_code: 409,
                        message: format!("container {name} is still being removed"),
                    },
                ));
            }
            Ok(_) => tokio::time::sleep(std::time::Duration::from_millis(200)).await,
        }
    }
}

pub async fn remove(
    docker: &Docker,
    firewall: &Firewall,
    live_lesson_id: &str,
) -> Result<(), EngineError> {
    let selector = HashMap::from([(LABEL_LIVE_LESSON.to_owned(), live_lesson_id.to_owned())]);
    for (name, _, _) in containers(docker, &selector).await? {
        match docker
            .remove_container(
                &name,
                Some(RemoveContainerOptions {
                    force: true,
                    v: true,
                    ..Default::default()
                }),
            )
            .await
        {
            Ok(()) => {}
            Err(err) if is_not_found(&err) => {}
            // 409: removal already in progress (an earlier call whose deadline passed while a
            // large image's copy was deleted on vfs): gone only once that removal is over.
            Err(DockerError::DockerResponseServerError {
                status_code: 409, ..
            }) => until_removed(docker, &name).await?,
            Err(err) => return Err(err.into()),
        }
    }
    let networks = docker
        .list_networks(Some(ListNetworksOptions {
            filters: Some(HashMap::from([(
                "label".to_owned(),
                vec![format!("{LABEL_LIVE_LESSON}={live_lesson_id}")],
            )])),
        }))
        .await?;
    for network in networks {
        let Some(name) = network.name else { continue };
        match docker.remove_network(&name).await {
            Ok(()) => {}
            Err(err) if is_not_found(&err) => {}
            Err(err) => return Err(err.into()),
        }
    }
    // After the networks: their bridges are gone, so nothing slips out between the two.
    firewall.release(&stem(live_lesson_id)).await?;
    Ok(())
}
