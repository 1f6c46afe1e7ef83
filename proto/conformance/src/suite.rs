//! The state checks share, and the calls they make through it: who the suite is (scheduler
//! instance and session), what the agent offers, and what earlier checks left behind (the Watch
//! stream, the live lessons provisioned).

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use antidote_proto::agent::v1 as proto;
use antidote_proto::agent::v1::backend_client::BackendClient;
use antidote_sdk::entrypoint::Signer;
use antidote_sdk::{capabilities, labels};
use anyhow::{Context as _, anyhow, bail, ensure};
use proto::watch_event::Event;
use proto::{Phase, PresentationType};
use tonic::transport::Channel;

use crate::report::{describe, summary};
use crate::watcher::Watcher;

/// What the test lessons run and how to reach the agent's operator side, from the flags.
pub struct Settings {
    /// The curriculum image slug of every endpoint (the agent maps it to its own reference).
    pub image: String,
    /// The port the image serves HTTP on, for the `web` presentation.
    pub http_port: u32,
    /// The port the image answers with an SSH banner, for the `cli` presentation.
    pub ssh_port: u32,
    /// How long a live lesson may take to become READY (and to go away).
    pub ready_timeout: Duration,
    /// An image slug the agent cannot run (`failed-image`).
    pub bad_image: String,
    /// A shell configuration that exits non-zero on the image (`failed-config`).
    pub failing_config: String,
    /// A port where the image accepts and never answers (`failed-probe`); 0 when there is none.
    pub silent_port: u32,
    /// The configuration credentials of the image (`image.config_user`/`config_password`),
    /// for configurators that log in to the endpoint; empty when not given.
    pub config_user: String,
    /// The configuration password.
    pub config_password: String,
    /// An image slug NAPALM can configure (`configuration-napalm`), if any.
    pub napalm_image: Option<String>,
    /// The NAPALM driver of that image.
    pub napalm_driver: String,
    /// A shell command that restarts the agent on the same address (the restart checks).
    pub restart_cmd: Option<String>,
    /// The most live lessons `capacity-refusal` creates to fill the agent.
    pub capacity_fill: u32,
    /// Whether `watch-resync` runs (it pushes thousands of generations).
    pub force_resync: bool,
    /// The agent's entrypoint as the suite reaches it (the `entrypoint-*` checks).
    pub entrypoint: Option<String>,
    /// An image slug whose SSH presentation admits `ssh_user` (`entrypoint-terminal`).
    pub terminal_image: Option<String>,
    /// The user `terminal_image` admits.
    pub ssh_user: String,
    /// Its password. Sent to the agent in specs only.
    pub ssh_password: String,
    /// The entrypoint's connection cap per client address.
    pub entrypoint_max_per_client: u32,
}

impl Settings {
    /// Why `flag` counts as not given, for a SKIP line.
    pub fn absence(&self, flag: &str) -> &'static str {
        match flag {
            "--silent-port" => "0: the image has no silent port",
            _ => "not given",
        }
    }

    /// Whether `flag` was given (for [`crate::checks::Need::Flag`]).
    pub fn given(&self, flag: &str) -> bool {
        match flag {
            "--restart-cmd" => self.restart_cmd.is_some(),
            "--napalm-image" => self.napalm_image.is_some(),
            "--silent-port" => self.silent_port != 0,
            "--force-resync" => self.force_resync,
            "--entrypoint" => self.entrypoint.is_some(),
            "--terminal-image" => self.terminal_image.is_some(),
            _ => false,
        }
    }
}

/// The label every spec carries besides the guide's five, to prove that agents keep labels
/// they do not know (PROTOCOL.md [L1]); its value is the run's instance id.
pub const EXTRA_LABEL: &str = "conformance.antidote.io/run";

/// The live lesson `restart-recover` made before restarting the agent, for `restart-adopt`.
pub struct Restarted {
    /// Its id.
    pub id: String,
    /// Its spec.
    pub spec: proto::LessonSpec,
    /// Its READY state before the restart.
    pub before: proto::LiveLessonState,
    /// When Recover (or Provision) adopted it.
    pub adopted_at: tokio::time::Instant,
}

/// The live lesson `provision-ready` made READY, which later checks work on.
#[derive(Clone)]
pub struct Lesson {
    /// Its id.
    pub id: String,
    /// The spec it was provisioned with (generation 1, stage 0).
    pub first: proto::LessonSpec,
    /// The newest spec the agent accepted for it (`stage-change` moves it on).
    pub current: proto::LessonSpec,
    /// Its first READY state: addresses and handle to compare with.
    pub ready: proto::LiveLessonState,
}

/// A Watch that `list-pages` opened on one of its live lessons before provisioning it, which
/// `watch-selector` reads once everything is removed.
pub struct Selected {
    /// The live lesson selected.
    pub id: String,
    /// The stream, or why it could not be opened.
    pub watch: anyhow::Result<Watcher>,
}

/// The live lesson the entrypoint checks reach: one endpoint `solo` whose `web` presentation
/// is HTTP, READY, kept until the suite's clean-up.
#[derive(Clone)]
pub struct Entry {
    /// Its id.
    pub id: String,
    /// Where the suite connects (`host:port` of the entrypoint URL, the live lesson's host
    /// put in where the URL has an origin per live lesson).
    pub connect: String,
    /// The `Host` the requests carry.
    pub host: String,
    /// Whether the entrypoint gives each live lesson an origin of its own.
    pub per_lesson: bool,
    /// The `web` presentation's backend address (`host:port`), for answers to compare with.
    pub backend: String,
}

/// Everything the checks share.
pub struct Suite {
    /// What the test lesson runs.
    pub settings: Settings,
    /// The agent's Backend service.
    pub client: BackendClient<Channel>,
    /// The connection itself, for grpc.health.v1.
    pub channel: Channel,
    /// Our scheduler instance id: every spec carries it, every List/Watch selects on it.
    pub instance: String,
    /// The session id every spec carries.
    pub session: String,
    /// What the agent offers, learnt by `handshake` (empty until it passes).
    pub capabilities: Vec<String>,
    /// The agent's instance id, learnt by `handshake` (a restart changes it).
    pub instance_id: String,
    /// Live lessons provisioned, removed at the end whatever happened.
    pub created: BTreeSet<String>,
    /// The Watch `watch-snapshot` opened before anything was provisioned (selector: our
    /// instance); when it is there, checks wait for READY on it instead of polling Get.
    pub watch: Option<Watcher>,
    /// The live lesson `provision-ready` made.
    pub lesson: Option<Lesson>,
    /// The Watch on one live lesson, from `list-pages` for `watch-selector`.
    pub selected: Option<Selected>,
    /// The live lessons `deprovision` removed, for `watch-deletions`.
    pub removed: BTreeSet<String>,
    /// The live lesson `concurrent-provision` made, for `concurrent-deprovision`.
    pub concurrent: Option<String>,
    /// What `restart-recover` found left after the restart, for `restart-adopt`: `None` until
    /// it ran, `Some(None)` when nothing outlived the agent's process.
    pub restarted: Option<Option<Restarted>>,
    /// The suite's entrypoint key: every Handshake offers it, every token is signed with it
    /// (the suite is the scheduler for the entrypoint checks).
    pub signer: Signer,
    /// The handshake's `entrypoint_url`, learnt by `handshake`.
    pub entrypoint_url: String,
    /// The live lesson the entrypoint checks reach, made by `entrypoint-tokens`.
    pub entry: Option<Entry>,
    /// A connection of its own with small HTTP/2 windows, for the watcher `watch-resync`
    /// stalls (none over a dialled-in connection: it then uses `channel`).
    pub stalled_channel: Option<Channel>,
}

impl Suite {
    /// A suite speaking as `instance` (a fresh one when `None`) on `channel`.
    pub fn new(channel: Channel, settings: Settings, instance: Option<String>) -> Suite {
        Suite {
            settings,
            client: BackendClient::new(channel.clone()),
            channel,
            instance: instance.unwrap_or_else(new_id),
            session: new_id(),
            capabilities: vec![],
            instance_id: String::new(),
            created: BTreeSet::new(),
            watch: None,
            lesson: None,
            selected: None,
            removed: BTreeSet::new(),
            concurrent: None,
            restarted: None,
            signer: Signer::generate(&format!("conformance-{}", &new_id()[..8])),
            entrypoint_url: String::new(),
            entry: None,
            stalled_channel: None,
        }
    }

    pub fn offers(&self, capability: &str) -> bool {
        self.capabilities.iter().any(|c| c == capability)
    }

    /// The handshake a scheduler of our instance sends.
    pub fn handshake_request(&self) -> proto::HandshakeRequest {
        proto::HandshakeRequest {
            supported_majors: vec![proto::MAJOR],
            scheduler_instance_id: self.instance.clone(),
            scheduler_version: "conformance".into(),
            capabilities: [
                capabilities::WATCH,
                capabilities::RECOVER,
                capabilities::PLAN,
            ]
            .map(String::from)
            .to_vec(),
            // The suite signs the entrypoint checks' tokens itself.
            entrypoint_keys: vec![proto::EntrypointKey {
                key_id: self.signer.key_id().to_owned(),
                public_key: self.signer.public_key().to_vec(),
            }],
            revoked_entrypoint_keys: Vec::new(),
        }
    }

    /// A lesson spec for live lesson `id`: two endpoints with the presentations the agent
    /// offers and, when it offers configuration, a shell configuration per stage.
    pub fn spec(&self, id: &str, generation: u64, stage: u32) -> proto::LessonSpec {
        let mut presentations = Vec::new();
        if self.offers(capabilities::PRESENTATION_HTTP) {
            presentations.push(proto::Presentation {
                name: "web".into(),
                r#type: PresentationType::Http as i32,
                port: self.settings.http_port,
            });
        }
        if self.offers(capabilities::PRESENTATION_SSH) {
            presentations.push(proto::Presentation {
                name: "cli".into(),
                r#type: PresentationType::Ssh as i32,
                port: self.settings.ssh_port,
            });
        }
        let configuration =
            self.offers(capabilities::STAGE_CONFIGURATION)
                .then(|| proto::StageConfiguration {
                    r#type: proto::ConfigurationType::Shell as i32,
                    file_name: format!("stage{stage}.sh"),
                    contents: format!("echo conformance stage {stage}\n").into_bytes(),
                    driver: String::new(),
                });
        let endpoint = |name: &str| proto::Endpoint {
            name: name.into(),
            image: Some(proto::Image {
                slug: self.settings.image.clone(),
                flavor: proto::Flavor::Untrusted as i32,
                config_user: self.settings.config_user.clone(),
                config_password: self.settings.config_password.clone(),
                ..Default::default()
            }),
            additional_ports: vec![],
            presentations: presentations.clone(),
            configuration: configuration.clone(),
            jupyter_guide: None,
        };
        proto::LessonSpec {
            live_lesson_id: id.to_owned(),
            session_id: self.session.clone(),
            lesson_slug: "conformance".into(),
            generation,
            stage,
            endpoints: vec![endpoint("alpha"), endpoint("beta")],
            connections: vec![proto::Connection {
                a: "alpha".into(),
                b: "beta".into(),
                subnet: String::new(),
            }],
            ready_delay: None,
            configuration_timeout: None,
            labels: HashMap::from([
                (labels::INSTANCE.into(), self.instance.clone()),
                (labels::LIVE_LESSON.into(), id.to_owned()),
                (labels::SESSION.into(), self.session.clone()),
                (labels::GENERATION.into(), generation.to_string()),
                (labels::LESSON.into(), "conformance".into()),
                (EXTRA_LABEL.into(), self.instance.clone()),
            ]),
        }
    }

    /// A one-endpoint spec (`solo`) for live lesson `id` at generation 1, for the checks that
    /// try one thing at a time.
    pub fn solo(&self, id: &str) -> proto::LessonSpec {
        let mut spec = self.spec(id, 1, 0);
        spec.endpoints.truncate(1);
        spec.endpoints[0].name = "solo".into();
        spec.connections.clear();
        spec
    }

    /// Our instance's label selector.
    pub fn selector(&self) -> HashMap<String, String> {
        HashMap::from([(labels::INSTANCE.to_owned(), self.instance.clone())])
    }

    /// The live lesson `provision-ready` made.
    pub fn lesson(&self) -> anyhow::Result<Lesson> {
        self.lesson
            .clone()
            .context("no live lesson (`provision-ready` did not pass)")
    }

    /// The Watch `watch-snapshot` opened.
    pub fn watcher(&mut self) -> anyhow::Result<&mut Watcher> {
        self.watch
            .as_mut()
            .context("no Watch stream (`watch-snapshot` did not pass)")
    }

    /// Provisions `spec`, remembering its live lesson for the clean-up. The first Provision of a
    /// live lesson says it is new, as the scheduler's does (PROTOCOL.md [P9]).
    pub async fn provision(
        &mut self,
        spec: proto::LessonSpec,
    ) -> Result<tonic::Response<proto::ProvisionResponse>, tonic::Status> {
        let new_live_lesson = self.created.insert(spec.live_lesson_id.clone());
        self.client
            .provision(proto::ProvisionRequest {
                spec: Some(spec),
                new_live_lesson,
            })
            .await
    }

    /// Every live lesson of our instance, in pages of `page_size` (0: the agent's default),
    /// checking no page is larger.
    pub async fn list_all(
        &mut self,
        page_size: u32,
    ) -> anyhow::Result<Vec<proto::LiveLessonState>> {
        let mut items = Vec::new();
        let mut token = String::new();
        for _ in 0..1000 {
            let page = self
                .client
                .list(proto::ListRequest {
                    label_selector: self.selector(),
                    page_size,
                    page_token: token.clone(),
                })
                .await
                .map_err(|s| anyhow!("List: {}", describe(&s)))?
                .into_inner();
            if page_size > 0 {
                ensure!(
                    page.items.len() <= page_size as usize,
                    "a page of {} items for page_size {page_size}",
                    page.items.len()
                );
            }
            items.extend(page.items);
            if page.next_page_token.is_empty() {
                return Ok(items);
            }
            token = page.next_page_token;
        }
        bail!("List did not end after 1000 pages")
    }

    /// Opens a Watch; returns it with the items of its first message, which must be a snapshot.
    pub async fn open_watch(
        &mut self,
        selector: HashMap<String, String>,
        heartbeat: Duration,
    ) -> anyhow::Result<(Watcher, Vec<proto::LiveLessonState>)> {
        let stream = self
            .client
            .watch(proto::WatchRequest {
                label_selector: selector,
                heartbeat_interval: Some(heartbeat.try_into()?),
                ..Default::default()
            })
            .await
            .map_err(|s| anyhow!("Watch: {}", describe(&s)))?
            .into_inner();
        let mut watcher = Watcher::new(stream);
        let first = watcher.next(Duration::from_secs(10)).await?;
        let Some(Event::Snapshot(snapshot)) = first.event else {
            bail!("the first Watch message is not a snapshot: {first:?}");
        };
        Ok((watcher, snapshot.items))
    }

    /// Waits until `generation` of live lesson `id` is READY: on the Watch stream when there
    /// is one, otherwise polling Get.
    pub async fn ready(
        &mut self,
        id: &str,
        generation: u64,
    ) -> anyhow::Result<proto::LiveLessonState> {
        let timeout = self.settings.ready_timeout;
        match self.watch.as_mut() {
            Some(watcher) => {
                watcher
                    .until(id, timeout, |s| {
                        s.generation == generation && s.phase == Phase::Ready as i32
                    })
                    .await
            }
            None => self.poll_ready(id, generation, timeout).await,
        }
    }

    /// Without Watch: polls Get until the generation is READY.
    async fn poll_ready(
        &mut self,
        id: &str,
        generation: u64,
        timeout: Duration,
    ) -> anyhow::Result<proto::LiveLessonState> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let state = self
                .client
                .get(proto::GetRequest {
                    live_lesson_id: id.to_owned(),
                })
                .await
                .map_err(|s| anyhow!("Get: {}", describe(&s)))?
                .into_inner()
                .state
                .context("no state")?;
            if state.generation == generation && state.phase == Phase::Ready as i32 {
                return Ok(state);
            }
            if state.generation == generation && state.phase == Phase::Failed as i32 {
                bail!("live lesson FAILED: {}", state.reason);
            }
            ensure!(
                tokio::time::Instant::now() < deadline,
                "not READY within {timeout:?}: {}",
                summary(&state)
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Get of `id`.
    pub async fn get(&mut self, id: &str) -> Result<proto::LiveLessonState, tonic::Status> {
        let state = self
            .client
            .get(proto::GetRequest {
                live_lesson_id: id.to_owned(),
            })
            .await?
            .into_inner()
            .state;
        state.ok_or_else(|| tonic::Status::internal("Get answered without a state"))
    }

    /// Deprovisions `id` and waits until Get says NOT_FOUND.
    pub async fn remove(&mut self, id: &str) -> anyhow::Result<()> {
        self.client
            .deprovision(proto::DeprovisionRequest {
                live_lesson_id: id.to_owned(),
                handle: id.as_bytes().to_vec(),
            })
            .await
            .map_err(|s| anyhow!("Deprovision of {id}: {}", describe(&s)))?;
        let timeout = self.settings.ready_timeout;
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            match self.get(id).await {
                Err(status) if status.code() == tonic::Code::NotFound => break,
                _ if tokio::time::Instant::now() > deadline => {
                    bail!("{id} not gone within {timeout:?} of its Deprovision")
                }
                _ => tokio::time::sleep(Duration::from_millis(250)).await,
            }
        }
        self.created.remove(id);
        Ok(())
    }

    /// Waits until `generation` of live lesson `id` is READY or FAILED; returns that state.
    pub async fn settled(
        &mut self,
        id: &str,
        generation: u64,
    ) -> anyhow::Result<proto::LiveLessonState> {
        let timeout = self.settings.ready_timeout;
        let settled = |s: &proto::LiveLessonState| {
            s.generation == generation
                && (s.phase == Phase::Ready as i32 || s.phase == Phase::Failed as i32)
        };
        if let Some(watcher) = self.watch.as_mut() {
            return watcher.until_settled(id, timeout, settled).await;
        }
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let state = self
                .get(id)
                .await
                .map_err(|s| anyhow!("Get: {}", describe(&s)))?;
            if settled(&state) {
                return Ok(state);
            }
            ensure!(
                tokio::time::Instant::now() < deadline,
                "neither READY nor FAILED within {timeout:?}: {}",
                summary(&state)
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Removes whatever the checks left behind (a failed check, or a run that stopped early).
    pub async fn clean_up(&mut self) {
        for id in std::mem::take(&mut self.created) {
            // Best effort: the report already says what went wrong, and an unknown id is OK.
            let _ = self
                .client
                .deprovision(proto::DeprovisionRequest {
                    live_lesson_id: id,
                    handle: Default::default(),
                })
                .await;
        }
    }
}

/// A fresh id (a hyphenated UUID), for live lessons, sessions and instances.
pub fn new_id() -> String {
    uuid::Uuid::new_v4().to_string()
}
