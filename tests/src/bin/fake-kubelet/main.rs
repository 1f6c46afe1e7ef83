//! `fake-kubelet`: the node of the test control plane, which has no real kubelet (the way kwok
//! does it). It registers a Node and keeps it Ready, binds the pods of one Antidote instance to
//! it (there is no kube-scheduler either), and "runs" them:
//!
//! - an endpoint pod gets a loopback address (`--ip-prefix`, e.g. 127.77.0.5) and, for every
//!   container port, a real listener there: `--silent-port` accepts and never says a word (the
//!   conformance suite's `failed-probe`), ports named `ssh-*` are
//!   real SSH servers (password login with the test images' credentials, a shell on a
//!   pseudo-terminal: `ssh.rs`), `http-*`
//!   answer HTTP with a page naming the pod (and a WebSocket upgrade with an echo that names
//!   the pod too, for the entrypoint's proxied upgrades), others accept and close. Then it is
//!   Running.
//! - a Job's pod succeeds, unless its command or a file it mounts from a ConfigMap (a
//!   configurator's script) contains `--fail-marker`: then it fails with exit code 1 (the Job
//!   controller retries it up to the Job's backoffLimit) and, when its container's
//!   `terminationMessagePolicy` is `FallbackToLogsOnError`, a termination message holding the
//!   lines that name the marker (what a script printing its marker line would leave as its log's
//!   tail); or `--hang-marker`: then it runs until something deletes it (the Job controller
//!   does, at the Job's `activeDeadlineSeconds`; a real kubelet would also end it at the pod's
//!   own).
//! - a pod whose image contains `--missing-image` stays Waiting with ErrImagePull.
//! - a pod being deleted (its namespace is) is removed at once, listeners closed.
//!
//! It prints `listening on ADDR` (a health port) once the Node is registered.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use serde_json::json;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::task::JoinHandle;

mod ssh;

#[derive(Parser)]
#[command(
    name = "fake-kubelet",
    about = "A fake node for the test control plane"
)]
struct Args {
    /// The Node's name.
    #[arg(long, default_value = "fake-node")]
    node: String,
    /// Only pods labelled antidote.io/instance=<this> are bound to the node.
    #[arg(long)]
    instance: String,
    /// Pods get <prefix>.<n>.<m> addresses (two octets, e.g. 127.77).
    #[arg(long, default_value = "127.77")]
    ip_prefix: String,
    /// A Job pod whose command contains this fails.
    #[arg(long, default_value = "fake-kubelet: fail")]
    fail_marker: String,
    /// A Job pod whose command contains this never ends.
    #[arg(long, default_value = "fake-kubelet: hang")]
    hang_marker: String,
    /// A container port whose listener accepts connections and never answers, whatever its
    /// name (antidote-conformance's `--silent-port`, 9 by default).
    #[arg(long, default_value_t = 9)]
    silent_port: u16,
    /// A pod whose image contains this cannot pull it.
    #[arg(long, default_value = "ghost")]
    missing_image: String,
    /// The user `ssh-*` ports admit (the test curricula's images' `sshUser`).
    #[arg(long, default_value = "antidote")]
    ssh_user: String,
    /// Its password (the images' `sshPassword`).
    #[arg(long, default_value = "antidote")]
    ssh_password: String,
}

const MANAGER: &str = "fake-kubelet";

struct Kubelet {
    args: Args,
    client: kube::Client,
    /// Listener tasks of running pods, by pod uid.
    running: HashMap<String, Vec<JoinHandle<()>>>,
    next_ip: u32,
}

impl Kubelet {
    async fn register(&self) -> anyhow::Result<()> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let node = json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.args.node,
                "labels": { "kubernetes.io/hostname": self.args.node, "type": "fake-kubelet" },
            },
        });
        nodes
            .patch(
                &self.args.node,
                &PatchParams::apply(MANAGER).force(),
                &Patch::Apply(&node),
            )
            .await
            .context("registering the Node")?;
        self.heartbeat().await
    }

    /// Keeps the Node Ready (the node lifecycle controller would otherwise evict its pods).
    async fn heartbeat(&self) -> anyhow::Result<()> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        let status = json!({
            "apiVersion": "v1",
            "kind": "Node",
            "status": {
                "capacity": { "cpu": "64", "memory": "256Gi", "pods": "1000" },
                "allocatable": { "cpu": "64", "memory": "256Gi", "pods": "1000" },
                "addresses": [{ "type": "InternalIP", "address": "127.0.0.1" }],
                "conditions": [{
                    "type": "Ready", "status": "True", "reason": "FakeKubelet",
                    "message": "fake-kubelet is ready", "lastHeartbeatTime": now,
                    "lastTransitionTime": now,
                }],
            },
        });
        nodes
            .patch_status(
                &self.args.node,
                &PatchParams::apply(MANAGER).force(),
                &Patch::Apply(&status),
            )
            .await
            .context("updating the Node's status")?;
        Ok(())
    }

    fn ours(&self, pod: &Pod) -> bool {
        pod.metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("antidote.io/instance"))
            == Some(&self.args.instance)
    }

    async fn handle(&mut self, pod: Pod) -> anyhow::Result<()> {
        if !self.ours(&pod) {
            return Ok(());
        }
        let name = pod.metadata.name.clone().unwrap_or_default();
        let namespace = pod.metadata.namespace.clone().unwrap_or_default();
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &namespace);
        if pod.metadata.deletion_timestamp.is_some() {
            if let Some(listeners) = self.running.remove(&uid) {
                for listener in listeners {
                    listener.abort();
                }
            }
            match api
                .delete(&name, &DeleteParams::default().grace_period(0))
                .await
            {
                Ok(_) | Err(kube::Error::Api(_)) => {}
                Err(e) => return Err(e.into()),
            }
            return Ok(());
        }
        let spec = pod.spec.clone().unwrap_or_default();
        let Some(node) = spec.node_name.clone() else {
            let binding = json!({
                "apiVersion": "v1",
                "kind": "Binding",
                "metadata": { "name": name },
                "target": { "apiVersion": "v1", "kind": "Node", "name": self.args.node },
            });
            let bound: Result<serde_json::Value, _> = api
                .create_subresource("binding", &name, &PostParams::default(), &binding)
                .await;
            if let Err(e) = bound {
                eprintln!("fake-kubelet: binding {namespace}/{name}: {e}");
            }
            return Ok(());
        };
        let phase = pod
            .status
            .as_ref()
            .and_then(|s| s.phase.clone())
            .unwrap_or_default();
        if node != self.args.node
            || self.running.contains_key(&uid)
            || !matches!(phase.as_str(), "" | "Pending")
        {
            return Ok(());
        }
        let container = spec.containers.first().cloned().unwrap_or_default();
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        let job = pod
            .metadata
            .owner_references
            .iter()
            .flatten()
            .any(|o| o.kind == "Job");
        let status = if job {
            let mut command = container
                .command
                .iter()
                .flatten()
                .chain(container.args.iter().flatten())
                .cloned()
                .collect::<Vec<_>>()
                .join(" ");
            command.push('\n');
            command.push_str(&self.mounted_files(&namespace, &spec).await);
            let failed = command.contains(&self.args.fail_marker);
            let output = if failed
                && container.termination_message_policy.as_deref() == Some("FallbackToLogsOnError")
            {
                command
                    .lines()
                    .filter(|line| line.contains(&self.args.fail_marker))
                    .collect::<Vec<_>>()
                    .join("\n")
            } else {
                String::new()
            };
            self.running.insert(uid, vec![]);
            if command.contains(&self.args.hang_marker) {
                json!({
                    "phase": "Running",
                    "hostIP": "127.0.0.1",
                    "startTime": now,
                    "containerStatuses": [{
                        "name": container.name, "image": container.image.clone().unwrap_or_default(), "imageID": "",
                        "ready": true, "started": true, "restartCount": 0,
                        "state": { "running": { "startedAt": now } },
                    }],
                })
            } else {
                json!({
                    "phase": if failed { "Failed" } else { "Succeeded" },
                    "startTime": now,
                    "containerStatuses": [{
                        "name": container.name, "image": container.image.clone().unwrap_or_default(), "imageID": "",
                        "ready": false, "restartCount": 0,
                        "state": { "terminated": {
                            "exitCode": if failed { 1 } else { 0 },
                            "reason": if failed { "Error" } else { "Completed" },
                            "message": output,
                            "startedAt": now, "finishedAt": now,
                        } },
                    }],
                })
            }
        } else if container
            .image
            .as_deref()
            .unwrap_or_default()
            .contains(&self.args.missing_image)
        {
            self.running.insert(uid, vec![]);
            json!({
                "phase": "Pending",
                "containerStatuses": [{
                    "name": container.name, "image": container.image.clone().unwrap_or_default(), "imageID": "",
                    "ready": false, "restartCount": 0,
                    "state": { "waiting": {
                        "reason": "ErrImagePull",
                        "message": format!("image {} not found (fake-kubelet)", container.image.clone().unwrap_or_default()),
                    } },
                }],
            })
        } else {
            self.next_ip += 1;
            let ip: Ipv4Addr = format!(
                "{}.{}.{}",
                self.args.ip_prefix,
                self.next_ip / 250,
                self.next_ip % 250 + 1
            )
            .parse()?;
            let mut listeners = Vec::new();
            for port in container.ports.iter().flatten() {
                let address = SocketAddr::from((ip, port.container_port as u16));
                let listener = tokio::net::TcpListener::bind(address)
                    .await
                    .with_context(|| format!("binding {address} for {namespace}/{name}"))?;
                let kind = if address.port() == self.args.silent_port {
                    "silent".to_owned()
                } else {
                    port.name.clone().unwrap_or_default()
                };
                let page = format!("{namespace}/{name} on {}\n", self.args.node);
                if kind.starts_with("ssh") {
                    let credentials = ssh::Credentials {
                        user: self.args.ssh_user.clone(),
                        password: self.args.ssh_password.clone(),
                    };
                    listeners.push(tokio::spawn(ssh::serve(
                        listener,
                        credentials,
                        name.clone(),
                    )));
                } else {
                    listeners.push(tokio::spawn(serve(listener, kind, page)));
                }
            }
            self.running.insert(uid, listeners);
            json!({
                "phase": "Running",
                "hostIP": "127.0.0.1",
                "podIP": ip.to_string(),
                "podIPs": [{ "ip": ip.to_string() }],
                "startTime": now,
                "conditions": [
                    { "type": "Ready", "status": "True", "lastTransitionTime": now },
                    { "type": "ContainersReady", "status": "True", "lastTransitionTime": now },
                ],
                "containerStatuses": [{
                    "name": container.name, "image": container.image.clone().unwrap_or_default(), "imageID": "",
                    "ready": true, "started": true, "restartCount": 0,
                    "state": { "running": { "startedAt": now } },
                }],
            })
        };
        let patch = json!({ "apiVersion": "v1", "kind": "Pod", "status": status });
        api.patch_status(
            &name,
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await
        .with_context(|| format!("updating the status of {namespace}/{name}"))?;
        Ok(())
    }
}

impl Kubelet {
    /// The text of every ConfigMap item a pod mounts (the configurator's scripts), one after
    /// the other; a ConfigMap that cannot be read counts as empty (the pod would not start on
    /// a real node either, and the Job's outcome then shows it).
    async fn mounted_files(
        &self,
        namespace: &str,
        spec: &k8s_openapi::api::core::v1::PodSpec,
    ) -> String {
        let api: Api<ConfigMap> = Api::namespaced(self.client.clone(), namespace);
        let mut text = String::new();
        for volume in spec.volumes.iter().flatten() {
            let Some(source) = &volume.config_map else {
                continue;
            };
            let Ok(configmap) = api.get(&source.name).await else {
                eprintln!(
                    "fake-kubelet: ConfigMap {namespace}/{} unreadable",
                    source.name
                );
                continue;
            };
            let wanted = |key: &String| {
                source
                    .items
                    .as_ref()
                    .is_none_or(|items| items.iter().any(|i| &i.key == key))
            };
            for (key, value) in configmap.data.iter().flatten() {
                if wanted(key) {
                    text.push_str(value);
                    text.push('\n');
                }
            }
            for (key, value) in configmap.binary_data.iter().flatten() {
                if wanted(key) {
                    text.push_str(&String::from_utf8_lossy(&value.0));
                    text.push('\n');
                }
            }
        }
        text
    }
}

/// Serves one container port the way its name says.
async fn serve(listener: tokio::net::TcpListener, kind: String, page: String) {
    loop {
        let Ok((mut stream, _)) = listener.accept().await else {
            return;
        };
        let kind = kind.clone();
        let page = page.clone();
        tokio::spawn(async move {
            if kind == "silent" {
                // Hold the connection open, saying nothing, until the client gives up.
                let mut buf = [0u8; 1024];
                while matches!(stream.read(&mut buf).await, Ok(n) if n > 0) {}
            } else if kind.starts_with("http") {
                if asks_websocket(&stream).await {
                    echo_websocket(stream, &page).await;
                    return;
                }
                let mut buf = [0u8; 1024];
                let _ = stream.read(&mut buf).await;
                let response = format!(
                    "HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n{page}",
                    page.len()
                );
                let _ = stream.write_all(response.as_bytes()).await;
            }
        });
    }
}

/// Whether the request waiting on `stream` (peeked at, not read) asks for a WebSocket.
async fn asks_websocket(stream: &tokio::net::TcpStream) -> bool {
    let mut buf = [0u8; 4096];
    for _ in 0..50 {
        let Ok(n) = stream.peek(&mut buf).await else {
            return false;
        };
        let head = String::from_utf8_lossy(&buf[..n]).to_ascii_lowercase();
        if head.contains("\r\n\r\n") || n == buf.len() {
            return head.contains("\r\nupgrade: websocket\r\n");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

/// A WebSocket echo: every text message comes back prefixed with the pod's page.
async fn echo_websocket(stream: tokio::net::TcpStream, page: &str) {
    use futures::SinkExt as _;
    use tokio_tungstenite::tungstenite::Message;
    let Ok(mut ws) = tokio_tungstenite::accept_async(stream).await else {
        return;
    };
    while let Some(Ok(message)) = ws.next().await {
        let reply = match message {
            Message::Text(text) => Message::text(format!("{} echo: {text}", page.trim())),
            Message::Close(_) => return,
            _ => continue,
        };
        if ws.send(reply).await.is_err() {
            return;
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let client = kube::Client::try_default().await.context("KUBECONFIG")?;
    let mut kubelet = Kubelet {
        args,
        client: client.clone(),
        running: HashMap::new(),
        next_ip: 0,
    };
    kubelet.register().await?;
    let health = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!("listening on {}", health.local_addr()?);
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = health.accept().await {
            let _ = stream.write_all(b"HTTP/1.0 200 OK\r\n\r\nok").await;
        }
    });
    let pods: Api<Pod> = Api::all(client);
    let selector = format!("antidote.io/instance={}", kubelet.args.instance);
    let mut events = watcher(pods, watcher::Config::default().labels(&selector)).boxed();
    let mut ticker = tokio::time::interval(Duration::from_secs(10));
    loop {
        tokio::select! {
            _ = ticker.tick() => {
                if let Err(e) = kubelet.heartbeat().await {
                    eprintln!("fake-kubelet: {e:#}");
                }
            }
            event = events.next() => {
                let Some(event) = event else { return Ok(()) };
                let pods = match event {
                    Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod)) => vec![pod],
                    Ok(_) => vec![],
                    Err(e) => {
                        eprintln!("fake-kubelet: watch: {e}");
                        vec![]
                    }
                };
                for pod in pods {
                    if let Err(e) = kubelet.handle(pod).await {
                        eprintln!("fake-kubelet: {e:#}");
                    }
                }
            }
        }
    }
}
