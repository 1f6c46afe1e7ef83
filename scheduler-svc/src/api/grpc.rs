//! The public gRPC API (`antidote.api.v1`): validation at the edge, then the store, the catalog
//! and the reconciler. Handlers never talk to agents except for Plan and stage checks
//! (`api::checks`), which change no live lesson's state; provisioning is the reconciler's job.

use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;

use antidote_net::errors;
use antidote_proto::api::v1 as api;
use antidote_proto::api::v1::ErrorReason;
use api::admin_service_server::AdminService;
use api::curriculum_service_server::CurriculumService;
use api::live_lesson_service_server::LiveLessonService;
use api::session_service_server::SessionService;
use futures::Stream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use super::auth::{self, AdminAuth};
use super::checks;
use super::convert as wire;
use super::limits::Quota;
use crate::agents::{AgentState, Desired, Fleet, Transport};
use crate::catalog::Catalog;
use crate::drive::{Hub, Reconciler, placement};
use crate::error::Error;
use crate::metrics::Metrics;
use crate::model::{self, LiveLesson, LiveLessonId, Millis, SessionId, expiry};
use crate::settings::{Config, Scope};
use crate::store::{LessonFilter, Requested, Store};

/// Longest lesson slug accepted, so a huge string cannot reach the store or the logs.
const MAX_SLUG: usize = 128;

/// The state every handler shares.
#[derive(Clone)]
pub struct Api {
    /// Desired state is written here; reads answer from here.
    pub store: Store,
    /// The lessons learners ask for.
    pub catalog: Arc<Catalog>,
    /// Where desired-state changes are handed over.
    pub reconciler: Reconciler,
    /// Live-lesson watchers subscribe here.
    pub hub: Arc<Hub>,
    /// Agents, for listing and Plan.
    pub fleet: Arc<Fleet>,
    /// TTLs, limits, instance id.
    pub config: Arc<Config>,
    /// Ends Watch streams at shutdown.
    pub shutdown: CancellationToken,
    /// What `/metrics` renders.
    pub metrics: Arc<Metrics>,
    /// The admin API's tokens.
    pub admin_auth: Arc<AdminAuth>,
    /// Open Watch streams per session and per client address.
    pub watches: Watches,
    /// Entrypoint tokens: learners' answers carry a URL per presentation.
    pub entrypoint: Arc<crate::entrypoint::Tokens>,
    /// Warm pools: requests for a pooled lesson claim a READY member first.
    pub pools: crate::drive::Pools,
    /// Stage checks in progress and recent, per live lesson (their limits).
    pub checks: Arc<checks::Checks>,
}

/// Open Watch streams (gRPC and server-sent events alike), bounded per session and per client
/// address (its network).
#[derive(Clone, Debug)]
pub struct Watches {
    /// Per session id.
    pub per_session: Quota,
    /// Per client network.
    pub per_address: Quota,
}

impl Watches {
    /// The quotas `limits` sets.
    pub fn new(limits: &crate::settings::Limits) -> Watches {
        Watches {
            per_session: Quota::new(limits.watches_per_session),
            per_address: Quota::new(limits.watches_per_address),
        }
    }
}

type Result<T> = std::result::Result<Response<T>, Status>;

/// The client's address in an `x-forwarded-for` header: the last entry, the one our trusted
/// proxy added. Earlier entries come from the client (or proxies before ours) and could be
/// anything, so they are ignored.
fn forwarded_client(header: &str) -> &str {
    header.rsplit(',').next().unwrap_or_default().trim()
}

impl Api {
    fn source_ip<T>(&self, request: &Request<T>) -> std::result::Result<IpAddr, Error> {
        if self.config.trust_forwarded_for
            && let Some(forwarded) = request
                .metadata()
                .get("x-forwarded-for")
                .and_then(|v| v.to_str().ok())
        {
            let last = forwarded_client(forwarded);
            return last.parse().map_err(|_| Error::InvalidArgument {
                field: "x-forwarded-for",
                reason: format!("`{last}` is not an IP address"),
            });
        }
        request
            .remote_addr()
            .map(|addr| addr.ip())
            .ok_or(Error::InvalidArgument {
                field: "peer",
                reason: "the connection has no peer address".into(),
            })
    }

    /// The session whose token the call carries: UNAUTHENTICATED without one it knows.
    async fn learner<T>(&self, request: &Request<T>) -> std::result::Result<SessionId, Error> {
        let token = auth::bearer(request.metadata()).ok_or_else(|| {
            Error::Unauthenticated(
                "calls about a session need its token: `authorization: Bearer TOKEN`".into(),
            )
        })?;
        self.store
            .session_by_token(auth::hash(token))
            .await?
            .ok_or_else(|| {
                Error::Unauthenticated("the session token is unknown or its session expired".into())
            })
    }

    /// The caller's live lesson `id`: another session's answers NOT_FOUND exactly as an unknown
    /// one does (no existence oracle).
    pub(super) async fn owned<T>(
        &self,
        request: &Request<T>,
        id: LiveLessonId,
    ) -> std::result::Result<LiveLesson, Error> {
        let session = self.learner(request).await?;
        match self.store.live_lesson(id).await {
            Ok(lesson) if lesson.session_id == session => Ok(lesson),
            Ok(_) | Err(Error::LiveLessonNotFound(_)) => Err(Error::LiveLessonNotFound(id)),
            Err(err) => Err(err),
        }
    }

    /// Admits an admin call whose token has `scope`, and audits it (refusals too) as `action`
    /// on `target`. Returns the caller's identity.
    pub(super) async fn admin<T>(
        &self,
        request: &Request<T>,
        scope: Scope,
        action: &str,
        target: &str,
    ) -> std::result::Result<String, Error> {
        let (identity, outcome, refusal) = match self.admin_auth.check(request.metadata(), scope) {
            Ok(identity) => (identity, "ok".to_owned(), None),
            Err((identity, err)) => {
                let outcome = err.reason().0.as_str_name().to_owned();
                (identity, outcome, Some(err))
            }
        };
        tracing::info!(target: "audit", %identity, action, target, %outcome, "admin call");
        // An unauthenticated caller's refusals are written a few per network and minute only.
        let recorded = match &refusal {
            Some(err) if err.code() == tonic::Code::Unauthenticated => {
                let network = request
                    .remote_addr()
                    .map(|peer| crate::store::network(peer.ip()))
                    .unwrap_or_default();
                self.admin_auth
                    .refusals
                    .audit(network, std::time::Instant::now())
            }
            _ => true,
        };
        if recorded {
            self.store
                .audit(Millis::now(), &identity, action, target, &outcome)
                .await?;
        }
        match refusal {
            Some(err) => Err(err),
            None => Ok(identity),
        }
    }

    /// A live lesson as its learner sees it: no backend names ([`wire::for_learner`]), an
    /// entrypoint URL with a fresh token per presentation ([`learner_view`]).
    pub(super) fn api_lesson(&self, lesson: &LiveLesson) -> api::LiveLesson {
        learner_view(
            lesson,
            self.config.ttl.live_lesson,
            &self.entrypoint,
            &self.fleet,
        )
    }

    /// The live lesson as its learner sees it, with what its checks established (read only
    /// for lessons that have checks).
    pub(super) async fn learner_lesson(
        &self,
        live: &LiveLesson,
    ) -> std::result::Result<api::LiveLesson, Error> {
        self.with_checks(self.api_lesson(live), live).await
    }

    /// `view` of `live` with what its checks established (read only for lessons that have
    /// checks).
    async fn with_checks(
        &self,
        view: api::LiveLesson,
        live: &LiveLesson,
    ) -> std::result::Result<api::LiveLesson, Error> {
        let has_checks = self
            .catalog
            .lesson(&live.lesson_slug)
            .is_some_and(crate::catalog::Lesson::has_checks);
        if !has_checks {
            return Ok(view);
        }
        let checks = self.store.stage_checks(live.id).await?;
        Ok(wire::with_checks(view, live.id, &checks))
    }

    /// Runs the `files` of `live`'s current stage on its agent (`checks::Checks::run`);
    /// `limited` for a learner's run.
    async fn run_stage_files(
        &self,
        live: &LiveLesson,
        files: checks::Files,
        limited: bool,
    ) -> std::result::Result<model::CheckRun, Error> {
        let parts = checks::RunParts {
            catalog: &self.catalog,
            fleet: &self.fleet,
            store: &self.store,
            hub: &self.hub,
            metrics: &self.metrics,
        };
        self.checks.run(parts, live, files, limited).await
    }

    /// Refuses a move past a gated stage whose check has not passed (`checks::gate`).
    async fn gate(
        &self,
        lesson: &crate::catalog::Lesson,
        id: Option<LiveLessonId>,
        from: u32,
        to: u32,
    ) -> std::result::Result<(), Error> {
        checks::gate(&self.store, lesson, id, from, to).await
    }

    /// A live lesson as an operator sees it (the admin API): with its agent.
    fn admin_lesson(&self, lesson: &LiveLesson) -> api::LiveLesson {
        wire::live_lesson(lesson, self.config.ttl.live_lesson)
    }

    fn check_lesson(&self, slug: &str, stage: u32) -> std::result::Result<(), Error> {
        if slug.is_empty() || slug.len() > MAX_SLUG {
            return Err(Error::InvalidArgument {
                field: "lesson_slug",
                reason: format!("must be 1..={MAX_SLUG} characters"),
            });
        }
        let lesson = self
            .catalog
            .lesson(slug)
            .ok_or_else(|| Error::LessonNotFound(slug.to_owned()))?;
        let stages = lesson.stages.len() as u32;
        if stage >= stages {
            return Err(Error::StageOutOfRange {
                lesson: slug.to_owned(),
                stage,
                last: stages.saturating_sub(1),
            });
        }
        Ok(())
    }

    /// The admin API's view of the agents `keep` selects, in configuration order.
    fn agents(&self, keep: impl Fn(&str) -> bool) -> Vec<api::Agent> {
        let roster = self.reconciler.roster();
        self.fleet
            .snapshot()
            .into_iter()
            .filter(|agent| keep(&agent.name))
            .map(|agent| {
                let view = roster.candidate_named(&agent.name);
                let (labels, drained, lost) = match view {
                    Some(view) => (
                        view.labels.into_iter().collect(),
                        view.drained,
                        view.availability == placement::Availability::Lost,
                    ),
                    None => Default::default(),
                };
                // mTLS: the agent's certificate on the last connection, or why it failed.
                let tls = self
                    .fleet
                    .get(&agent.name)
                    .and_then(|agent| agent.tls_status())
                    .unwrap_or_default();
                let tls_error = tls
                    .failure
                    .map(|failure| format!("agent {}: {failure}", agent.name))
                    .unwrap_or_default();
                let peer = tls.peer.unwrap_or_default();
                // Dialled, or dial-in and from where.
                let (transport, peer_address) =
                    match self.fleet.get(&agent.name).map(|agent| agent.transport()) {
                        Some(Transport::DialIn { peer }) => (
                            api::AgentTransport::DialIn,
                            peer.map(|peer| peer.to_string()).unwrap_or_default(),
                        ),
                        _ => (api::AgentTransport::Dialled, String::new()),
                    };
                let status = agent.status;
                let handshake = status.handshake.unwrap_or_default();
                api::Agent {
                    name: agent.name,
                    address: agent.address,
                    state: match status.state {
                        _ if lost => api::AgentState::Lost,
                        AgentState::Connecting => api::AgentState::Connecting,
                        AgentState::Ready => api::AgentState::Ready,
                        AgentState::Unavailable => api::AgentState::Unavailable,
                        AgentState::Incompatible => api::AgentState::Incompatible,
                    } as i32,
                    major: handshake.major,
                    kind: handshake.kind,
                    build_version: handshake.build_version,
                    instance_id: handshake.instance_id,
                    capabilities: handshake.capabilities.into_iter().collect(),
                    max_live_lessons: handshake.max_live_lessons,
                    live_lessons: agent.load,
                    last_error: status.last_error,
                    connected_at: status.connected_at.map(wire::timestamp),
                    labels,
                    drained,
                    tls_peer_sha256: peer.sha256,
                    tls_peer_expires_at: peer.not_after.map(prost_types::Timestamp::from),
                    tls_peer_names: peer.names,
                    tls_error,
                    transport: transport as i32,
                    peer_address,
                }
            })
            .collect()
    }

    /// The admin API's view of one agent (NOT_FOUND when unknown).
    fn agent(&self, name: &str) -> Result<api::Agent> {
        self.agents(|agent| agent == name)
            .pop()
            .map(Response::new)
            .ok_or_else(|| Error::AgentNotFound(name.to_owned()).into())
    }

    async fn delete(&self, id: LiveLessonId, detail: &str) -> std::result::Result<(), Error> {
        let lesson = self.store.mark_deleting(id, detail, Millis::now()).await?;
        self.reconciler.changed(&lesson);
        Ok(())
    }
}

#[tonic::async_trait]
impl CurriculumService for Api {
    async fn get_curriculum(
        &self,
        _: Request<api::GetCurriculumRequest>,
    ) -> Result<api::Curriculum> {
        let meta = &self.catalog.meta;
        Ok(Response::new(api::Curriculum {
            name: meta.name.clone(),
            description: meta.description.clone(),
            website: meta.website.clone().unwrap_or_default(),
            antidote_version: meta.a_ver.clone().unwrap_or_default(),
            git_root: meta.git_root.clone().unwrap_or_default(),
            tier: self.config.tier.to_string(),
            lesson_count: self.catalog.lessons.len() as u32,
        }))
    }

    async fn list_lessons(
        &self,
        request: Request<api::ListLessonsRequest>,
    ) -> Result<api::ListLessonsResponse> {
        let filter = request.into_inner();
        let lessons = self
            .catalog
            .lessons
            .values()
            .filter(|l| filter.category.is_empty() || l.category.as_str() == filter.category)
            .filter(|l| {
                filter.collection.is_empty()
                    || l.collection.as_deref() == Some(filter.collection.as_str())
            })
            .filter(|l| filter.tag.is_empty() || l.tags.contains(&filter.tag))
            .map(|l| wire::lesson(l, &[]))
            .collect();
        Ok(Response::new(api::ListLessonsResponse { lessons }))
    }

    async fn get_lesson(&self, request: Request<api::GetLessonRequest>) -> Result<api::Lesson> {
        let slug = request.into_inner().slug;
        let lesson = self
            .catalog
            .lesson(&slug)
            .ok_or_else(|| Error::LessonNotFound(slug.chars().take(MAX_SLUG).collect()))?;
        let mut guides = Vec::with_capacity(lesson.stages.len());
        for stage in &lesson.stages {
            // Guides are read on demand: they can be large and are rarely all needed.
            let text = tokio::fs::read_to_string(&stage.guide)
                .await
                .map_err(|err| {
                    errors::status(
                        tonic::Code::Internal,
                        ErrorReason::InternalError.as_str_name(),
                        format!("cannot read guide {}: {err}", stage.guide.display()),
                        [],
                    )
                })?;
            guides.push(text);
        }
        Ok(Response::new(wire::lesson(lesson, &guides)))
    }

    async fn get_lesson_prereqs(
        &self,
        request: Request<api::GetLessonPrereqsRequest>,
    ) -> Result<api::GetLessonPrereqsResponse> {
        let slug = request.into_inner().slug;
        let root = self
            .catalog
            .lesson(&slug)
            .ok_or_else(|| Error::LessonNotFound(slug.chars().take(MAX_SLUG).collect()))?;
        // Depth-first post-order: every lesson after its own prerequisites. `seen` also stops
        // cycles, which validation rejects anyway.
        fn visit(catalog: &Catalog, slug: &str, seen: &mut Vec<String>, out: &mut Vec<String>) {
            if seen.iter().any(|s| s == slug) {
                return;
            }
            seen.push(slug.to_owned());
            if let Some(lesson) = catalog.lesson(slug) {
                for prereq in &lesson.prereqs {
                    visit(catalog, prereq, seen, out);
                }
            }
            out.push(slug.to_owned());
        }
        let mut seen = vec![root.slug.clone()];
        let mut slugs = Vec::new();
        for prereq in &root.prereqs {
            visit(&self.catalog, prereq, &mut seen, &mut slugs);
        }
        Ok(Response::new(api::GetLessonPrereqsResponse { slugs }))
    }

    async fn list_collections(
        &self,
        _: Request<api::ListCollectionsRequest>,
    ) -> Result<api::ListCollectionsResponse> {
        let collections = self
            .catalog
            .collections
            .values()
            .map(|c| wire::collection(c, &self.catalog))
            .collect();
        Ok(Response::new(api::ListCollectionsResponse { collections }))
    }

    async fn get_collection(
        &self,
        request: Request<api::GetCollectionRequest>,
    ) -> Result<api::Collection> {
        let slug = request.into_inner().slug;
        let collection = self
            .catalog
            .collection(&slug)
            .ok_or_else(|| Error::CollectionNotFound(slug.chars().take(MAX_SLUG).collect()))?;
        Ok(Response::new(wire::collection(collection, &self.catalog)))
    }
}

#[tonic::async_trait]
impl SessionService for Api {
    #[tracing::instrument(skip_all)]
    async fn create_session(
        &self,
        request: Request<api::CreateSessionRequest>,
    ) -> Result<api::Session> {
        let ip = self.source_ip(&request)?;
        let (token, hash) = auth::new_session_token()?;
        let session = self
            .store
            .create_session(ip, hash, self.config.limits.sessions_per_ip, Millis::now())
            .await?;
        tracing::debug!(session.id = %session.id, source_ip = %ip, "session created");
        Ok(Response::new(api::Session {
            token,
            ..wire::session(&session, self.config.ttl.session)
        }))
    }

    async fn get_session(&self, request: Request<api::GetSessionRequest>) -> Result<api::Session> {
        let caller = self.learner(&request).await?;
        let id: SessionId = request.into_inner().id.parse().map_err(Error::from)?;
        if id != caller {
            return Err(Error::SessionNotFound(id).into());
        }
        let session = self.store.session(id).await?;
        Ok(Response::new(wire::session(
            &session,
            self.config.ttl.session,
        )))
    }
}

type LessonStream =
    Pin<Box<dyn Stream<Item = std::result::Result<api::LiveLesson, Status>> + Send>>;

#[tonic::async_trait]
impl LiveLessonService for Api {
    #[tracing::instrument(skip_all, fields(lesson = tracing::field::Empty, live_lesson.id = tracing::field::Empty))]
    async fn request_live_lesson(
        &self,
        request: Request<api::RequestLiveLessonRequest>,
    ) -> Result<api::LiveLesson> {
        let caller = self.learner(&request).await?;
        let api::RequestLiveLessonRequest {
            session_id,
            lesson_slug,
            stage,
            placement,
        } = request.into_inner();
        let session: SessionId = session_id.parse().map_err(Error::from)?;
        if session != caller {
            return Err(Error::SessionNotFound(session).into());
        }
        self.check_lesson(&lesson_slug, stage)?;
        let wishes = wire::wishes(placement)
            .map_err(|(field, reason)| Error::InvalidArgument { field, reason })?;
        // check_lesson proved the lesson exists.
        if let Some(definition) = self.catalog.lesson(&lesson_slug) {
            self.reconciler.check_possible(definition, &wishes)?;
        }
        tracing::Span::current().record("lesson", lesson_slug.as_str());
        // A gated stage (`checks: gate`) below the one asked for must have passed in the
        // session's live lesson of this lesson; one not yet created has passed none.
        if let Some(definition) = self.catalog.lesson(&lesson_slug)
            && definition
                .stages
                .iter()
                .any(|s| s.gated() && s.index < stage)
        {
            let existing = self
                .store
                .session_live_lessons(session)
                .await?
                .into_iter()
                .find(|l| l.lesson_slug == lesson_slug && !l.deleting);
            let (id, from) = match &existing {
                Some(live) => (Some(live.id), live.stage),
                None => (None, 0),
            };
            self.gate(definition, id, from, stage).await?;
        }
        // A pooled lesson: a READY member claimed at once, if there is one (drive::pools).
        if let Some(definition) = self.catalog.lesson(&lesson_slug) {
            let limit = self.config.limits.live_lessons_per_session;
            let claimed = self.pools.claim(session, definition, stage, &wishes, limit);
            if let Some((lesson, _)) = claimed.await? {
                return Ok(Response::new(self.learner_lesson(&lesson).await?));
            }
        }
        let (lesson, outcome) = self
            .store
            .request_live_lesson(
                session,
                &lesson_slug,
                stage,
                self.config.limits.live_lessons_per_session,
                Millis::now(),
            )
            .await?;
        tracing::Span::current().record("live_lesson.id", tracing::field::display(lesson.id));
        // What the request asks of the agent applies wherever the live lesson is placed next:
        // now, on a retry, or after its agent is lost. Recorded before the reconciler hears of
        // it, so placement never runs without it.
        let placeable = outcome != Requested::Touched || lesson.agent.is_none();
        if placeable && (!wishes.is_empty() || outcome == Requested::Changed) {
            self.store.set_wishes(lesson.id, &wishes).await?;
        }
        if outcome != Requested::Touched {
            self.reconciler.changed(&lesson);
        }
        Ok(Response::new(self.learner_lesson(&lesson).await?))
    }

    async fn get_live_lesson(
        &self,
        request: Request<api::GetLiveLessonRequest>,
    ) -> Result<api::LiveLesson> {
        let id: LiveLessonId = request.get_ref().id.parse().map_err(Error::from)?;
        let lesson = self.owned(&request, id).await?;
        Ok(Response::new(self.learner_lesson(&lesson).await?))
    }

    async fn list_live_lessons(
        &self,
        request: Request<api::ListLiveLessonsRequest>,
    ) -> Result<api::ListLiveLessonsResponse> {
        let caller = self.learner(&request).await?;
        let id: SessionId = request
            .into_inner()
            .session_id
            .parse()
            .map_err(Error::from)?;
        if id != caller {
            return Err(Error::SessionNotFound(id).into());
        }
        // The session must exist (and be live), even when it holds no live lesson.
        self.store.session(id).await?;
        let mut live_lessons = Vec::new();
        for lesson in self.store.session_live_lessons(id).await? {
            live_lessons.push(self.learner_lesson(&lesson).await?);
        }
        Ok(Response::new(api::ListLiveLessonsResponse { live_lessons }))
    }

    type WatchLiveLessonStream = LessonStream;

    async fn watch_live_lesson(
        &self,
        request: Request<api::WatchLiveLessonRequest>,
    ) -> Result<Self::WatchLiveLessonStream> {
        let id: LiveLessonId = request.get_ref().id.parse().map_err(Error::from)?;
        let caller = self.learner(&request).await?;
        // Each session and each client address holds a bounded number of open watches; the
        // permits travel with the stream and are given back when it ends.
        let address = crate::store::network(self.source_ip(&request)?);
        let permits = (
            self.watches
                .per_session
                .take(caller.to_string())
                .ok_or(Error::TooManyStreams {
                    scope: "session",
                    limit: self.watches.per_session.max(),
                })?,
            self.watches
                .per_address
                .take(address)
                .ok_or(Error::TooManyStreams {
                    scope: "address",
                    limit: self.watches.per_address.max(),
                })?,
        );
        // Subscribe first, then read: a change between the two shows up as a (deduplicated)
        // update instead of being lost.
        let mut updates = self.hub.subscribe(id);
        let first = match self.store.live_lesson(id).await {
            Ok(first) if first.session_id != caller => Err(Error::LiveLessonNotFound(id)),
            other => other,
        };
        let first = match first {
            Ok(first) => first,
            Err(err) => {
                drop(updates);
                self.hub.release(id);
                return Err(err.into());
            }
        };
        let ttl = self.config.ttl.live_lesson;
        let shutdown = self.shutdown.clone();
        let (entrypoint, fleet) = (self.entrypoint.clone(), self.fleet.clone());
        // A lesson with checks: every update reads what its checks established, and one that
        // only they changed (a check ended: api::checks) is sent too.
        let checks_of = self
            .catalog
            .lesson(&first.lesson_slug)
            .is_some_and(crate::catalog::Lesson::has_checks)
            .then(|| self.store.clone());
        let read_checks = move |id: LiveLessonId| {
            let store = checks_of.clone();
            async move {
                match store {
                    Some(store) => store.stage_checks(id).await.map(Some),
                    None => Ok(None),
                }
            }
        };
        let view = move |lesson: &LiveLesson, checks: &Option<model::StageChecks>| {
            let view = learner_view(lesson, ttl, &entrypoint, &fleet);
            match checks {
                Some(checks) => wire::with_checks(view, lesson.id, checks),
                None => view,
            }
        };
        let mut last_checks = match read_checks(id).await {
            Ok(checks) => checks,
            Err(err) => {
                drop(updates);
                self.hub.release(id);
                return Err(err.into());
            }
        };
        let stream = async_stream(move |tx| async move {
            let _permits = permits;
            let mut last = first.clone();
            if tx.send(Ok(view(&first, &last_checks))).await.is_err() {
                return;
            }
            loop {
                tokio::select! {
                    // The client went away: stop following.
                    _ = tx.closed() => return,
                    _ = shutdown.cancelled() => {
                        let _ = tx.send(Err(errors::status(
                            tonic::Code::Unavailable,
                            ErrorReason::ShuttingDown.as_str_name(),
                            "the scheduler is shutting down; watch again",
                            [],
                        ))).await;
                        return;
                    }
                    changed = updates.changed() => {
                        if changed.is_err() {
                            return;
                        }
                    }
                }
                let update = updates.borrow_and_update().clone();
                let Some(lesson) = update else {
                    // Gone: the stream ends with OK.
                    return;
                };
                let checks = match read_checks(lesson.id).await {
                    Ok(checks) => checks,
                    // The store is away for a moment: the checks stay as last sent.
                    Err(_) => last_checks.clone(),
                };
                if lesson == last && checks == last_checks {
                    continue;
                }
                last = lesson.clone();
                last_checks = checks;
                if tx.send(Ok(view(&lesson, &last_checks))).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(stream))
    }

    async fn heartbeat(
        &self,
        request: Request<api::HeartbeatRequest>,
    ) -> Result<api::HeartbeatResponse> {
        let id: LiveLessonId = request.get_ref().id.parse().map_err(Error::from)?;
        self.owned(&request, id).await?;
        let lesson = self.store.heartbeat(id, Millis::now()).await?;
        Ok(Response::new(api::HeartbeatResponse {
            expires_at: expiry(
                lesson.persistent,
                lesson.last_active,
                self.config.ttl.live_lesson,
            )
            .map(wire::timestamp),
        }))
    }

    #[tracing::instrument(skip_all, fields(live_lesson.id = tracing::field::Empty))]
    async fn set_stage(&self, request: Request<api::SetStageRequest>) -> Result<api::LiveLesson> {
        let id: LiveLessonId = request.get_ref().id.parse().map_err(Error::from)?;
        let stage = request.get_ref().stage;
        tracing::Span::current().record("live_lesson.id", tracing::field::display(id));
        let current = self.owned(&request, id).await?;
        self.check_lesson(&current.lesson_slug, stage)?;
        if let Some(definition) = self.catalog.lesson(&current.lesson_slug) {
            self.gate(definition, Some(id), current.stage, stage)
                .await?;
        }
        let (lesson, outcome) = self.store.set_stage(id, stage, Millis::now()).await?;
        if outcome != Requested::Touched {
            self.reconciler.changed(&lesson);
        }
        Ok(Response::new(self.learner_lesson(&lesson).await?))
    }

    #[tracing::instrument(skip_all, fields(live_lesson.id = tracing::field::Empty))]
    async fn check_stage(
        &self,
        request: Request<api::CheckStageRequest>,
    ) -> Result<api::StageCheck> {
        let id: LiveLessonId = request.get_ref().id.parse().map_err(Error::from)?;
        tracing::Span::current().record("live_lesson.id", tracing::field::display(id));
        let lesson = self.owned(&request, id).await?;
        let run = self
            .run_stage_files(&lesson, checks::Files::Checks, true)
            .await?;
        Ok(Response::new(wire::stage_check(id, &run)))
    }

    async fn delete_live_lesson(
        &self,
        request: Request<api::DeleteLiveLessonRequest>,
    ) -> Result<api::DeleteLiveLessonResponse> {
        let id: LiveLessonId = request.get_ref().id.parse().map_err(Error::from)?;
        self.owned(&request, id).await?;
        self.delete(id, "deleted").await?;
        Ok(Response::new(api::DeleteLiveLessonResponse {}))
    }
}

#[tonic::async_trait]
impl AdminService for Api {
    async fn list_live_lessons(
        &self,
        request: Request<api::AdminListLiveLessonsRequest>,
    ) -> Result<api::AdminListLiveLessonsResponse> {
        self.admin(&request, Scope::Read, "AdminService.ListLiveLessons", "")
            .await?;
        let api::AdminListLiveLessonsRequest {
            status,
            lesson_slug,
            agent,
        } = request.into_inner();
        let filter = LessonFilter {
            status: wire::status_filter(status).map_err(|reason| Error::InvalidArgument {
                field: "status",
                reason,
            })?,
            lesson_slug: (!lesson_slug.is_empty()).then_some(lesson_slug),
            agent: (!agent.is_empty()).then_some(agent),
        };
        let live_lessons = self
            .store
            .live_lessons(&filter)
            .await?
            .iter()
            .map(|l| self.admin_lesson(l))
            .collect();
        Ok(Response::new(api::AdminListLiveLessonsResponse {
            live_lessons,
        }))
    }

    async fn kill_live_lesson(
        &self,
        request: Request<api::KillLiveLessonRequest>,
    ) -> Result<api::KillLiveLessonResponse> {
        let raw = request.get_ref().id.clone();
        self.admin(&request, Scope::Write, "AdminService.KillLiveLesson", &raw)
            .await?;
        let id: LiveLessonId = raw.parse().map_err(Error::from)?;
        self.delete(id, "killed by an operator").await?;
        Ok(Response::new(api::KillLiveLessonResponse {}))
    }

    async fn list_sessions(
        &self,
        request: Request<api::ListSessionsRequest>,
    ) -> Result<api::ListSessionsResponse> {
        self.admin(&request, Scope::Read, "AdminService.ListSessions", "")
            .await?;
        let sessions = self
            .store
            .sessions()
            .await?
            .iter()
            .map(|s| wire::session(s, self.config.ttl.session))
            .collect();
        Ok(Response::new(api::ListSessionsResponse { sessions }))
    }

    async fn persist_session(
        &self,
        request: Request<api::PersistSessionRequest>,
    ) -> Result<api::Session> {
        let target = request.get_ref().id.clone();
        self.admin(
            &request,
            Scope::Write,
            "AdminService.PersistSession",
            &target,
        )
        .await?;
        let api::PersistSessionRequest { id, persistent } = request.into_inner();
        let id: SessionId = id.parse().map_err(Error::from)?;
        let session = self.store.persist_session(id, persistent).await?;
        Ok(Response::new(wire::session(
            &session,
            self.config.ttl.session,
        )))
    }

    async fn list_agents(
        &self,
        request: Request<api::ListAgentsRequest>,
    ) -> Result<api::ListAgentsResponse> {
        self.admin(&request, Scope::Read, "AdminService.ListAgents", "")
            .await?;
        let agents = self.agents(|_| true);
        Ok(Response::new(api::ListAgentsResponse { agents }))
    }

    async fn plan(&self, request: Request<api::PlanRequest>) -> Result<api::PlanResponse> {
        self.admin(&request, Scope::Read, "AdminService.Plan", "")
            .await?;
        let api::PlanRequest { lesson_slug, stage } = request.into_inner();
        self.check_lesson(&lesson_slug, stage)?;
        // check_lesson proved the lesson exists.
        let definition = self
            .catalog
            .lesson(&lesson_slug)
            .ok_or_else(|| Error::LessonNotFound(lesson_slug.clone()))?;
        let needs = placement::Needs::of(definition, &Default::default()).map_err(|why| {
            Error::NoAgent {
                lesson: lesson_slug.clone(),
                why,
            }
        })?;
        let candidates = self.reconciler.roster().candidates();
        let decision =
            placement::choose(&candidates, &needs).map_err(|excluded| Error::NoAgent {
                lesson: lesson_slug.clone(),
                why: placement::explain(&excluded),
            })?;
        let name = decision.agent.as_str();
        let agent = self.fleet.get(name).ok_or_else(|| Error::NoAgent {
            lesson: lesson_slug.clone(),
            why: format!("agent `{name}` left the fleet"),
        })?;
        // A throwaway live lesson: Plan has no side effects, so its ids are never used again.
        let probe = LiveLesson {
            id: LiveLessonId::new(),
            session_id: SessionId::new(),
            lesson_slug: lesson_slug.clone(),
            stage,
            generation: 1,
            observed_generation: 0,
            status: model::Status::Pending,
            reason: String::new(),
            deleting: false,
            agent: Some(agent.name.clone()),
            handle: Vec::new(),
            endpoints: Vec::new(),
            persistent: false,
            created_at: Millis::now(),
            last_active: Millis::now(),
            pool_session: None,
        };
        let plan = agent
            .plan(&Desired {
                instance_id: &self.config.instance_id,
                cluster_id: self.reconciler.cluster_id(),
                live: &probe,
                lesson: definition,
                catalog: &self.catalog,
            })
            .await?;
        Ok(Response::new(api::PlanResponse {
            agent: agent.name.clone(),
            objects: plan
                .objects
                .into_iter()
                .map(|o| api::PlannedObject {
                    kind: o.kind,
                    name: o.name,
                    ports: o.ports,
                    detail: o.detail,
                })
                .collect(),
            diagnostics: plan.diagnostics,
        }))
    }

    async fn list_events(
        &self,
        request: Request<api::ListEventsRequest>,
    ) -> Result<api::ListEventsResponse> {
        let target = request.get_ref().live_lesson_id.clone();
        self.admin(&request, Scope::Read, "AdminService.ListEvents", &target)
            .await?;
        let id: LiveLessonId = target.parse().map_err(Error::from)?;
        let events = self
            .store
            .events(id)
            .await?
            .into_iter()
            .map(|e| api::Event {
                seq: e.seq as u64,
                live_lesson_id: e.live_lesson_id.to_string(),
                at: Some(wire::timestamp(e.at)),
                status: wire::status(e.status) as i32,
                generation: e.generation,
                stage: e.stage,
                detail: e.detail,
            })
            .collect();
        Ok(Response::new(api::ListEventsResponse { events }))
    }

    async fn get_live_lesson(
        &self,
        request: Request<api::AdminGetLiveLessonRequest>,
    ) -> Result<api::AdminLiveLesson> {
        let target = request.get_ref().id.clone();
        self.admin(&request, Scope::Read, "AdminService.GetLiveLesson", &target)
            .await?;
        let id: LiveLessonId = target.parse().map_err(Error::from)?;
        let lesson = self.store.live_lesson(id).await?;
        let mut record = self.store.placement(id).await?;
        // Shown as placement saw them: the lesson's labels with the request's.
        if let Some(needs) = self
            .catalog
            .lesson(&lesson.lesson_slug)
            .and_then(|definition| placement::Needs::of(definition, &record.wishes).ok())
        {
            record.wishes.requires = needs.requires;
            record.wishes.prefers = needs.prefers;
        }
        Ok(Response::new(api::AdminLiveLesson {
            live_lesson: Some(
                self.with_checks(self.admin_lesson(&lesson), &lesson)
                    .await?,
            ),
            placement: wire::placement(record),
            status_reason: lesson.reason.clone(),
        }))
    }

    async fn drain_agent(&self, request: Request<api::DrainAgentRequest>) -> Result<api::Agent> {
        let name = request.get_ref().name.clone();
        let identity = self
            .admin(&request, Scope::Write, "AdminService.DrainAgent", &name)
            .await?;
        self.reconciler.roster().drain(&name, &identity).await?;
        self.agent(&name)
    }

    async fn resume_agent(&self, request: Request<api::ResumeAgentRequest>) -> Result<api::Agent> {
        let name = request.get_ref().name.clone();
        self.admin(&request, Scope::Write, "AdminService.ResumeAgent", &name)
            .await?;
        self.reconciler.roster().resume(&name).await?;
        self.agent(&name)
    }

    async fn list_audit(
        &self,
        request: Request<api::ListAuditRequest>,
    ) -> Result<api::ListAuditResponse> {
        self.admin(&request, Scope::Read, "AdminService.ListAudit", "")
            .await?;
        let limit = match request.into_inner().limit {
            0 => 100,
            n => n.min(1000),
        };
        let entries = self
            .store
            .audit_log(limit)
            .await?
            .into_iter()
            .map(|e| api::AuditEntry {
                seq: e.seq as u64,
                at: Some(wire::timestamp(e.at)),
                identity: e.identity,
                action: e.action,
                target: e.target,
                outcome: e.outcome,
            })
            .collect();
        Ok(Response::new(api::ListAuditResponse { entries }))
    }

    async fn list_pools(
        &self,
        request: Request<api::ListPoolsRequest>,
    ) -> Result<api::ListPoolsResponse> {
        super::pools::list_pools(self, request).await
    }

    async fn set_pool(&self, request: Request<api::SetPoolRequest>) -> Result<api::Pool> {
        super::pools::set_pool(self, request).await
    }

    async fn test_stage(&self, request: Request<api::TestStageRequest>) -> Result<api::StageCheck> {
        let target = request.get_ref().live_lesson_id.clone();
        self.admin(&request, Scope::Write, "AdminService.TestStage", &target)
            .await?;
        let api::TestStageRequest {
            live_lesson_id,
            files,
        } = request.into_inner();
        let id: LiveLessonId = live_lesson_id.parse().map_err(Error::from)?;
        let files = match api::StageFiles::try_from(files) {
            Ok(api::StageFiles::Checks) => checks::Files::Checks,
            Ok(api::StageFiles::Solutions) => checks::Files::Solutions,
            _ => {
                return Err(Error::InvalidArgument {
                    field: "files",
                    reason: "must be STAGE_FILES_CHECKS or STAGE_FILES_SOLUTIONS".into(),
                }
                .into());
            }
        };
        let lesson = self.store.live_lesson(id).await?;
        let run = self.run_stage_files(&lesson, files, false).await?;
        Ok(Response::new(wire::stage_check(id, &run)))
    }
}

/// A stream fed by a task through a small channel; the task stops when the client goes away.
fn async_stream<F, Fut>(body: F) -> LessonStream
where
    F: FnOnce(tokio::sync::mpsc::Sender<std::result::Result<api::LiveLesson, Status>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(body(tx));
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
}

/// A live lesson as its owner sees it: [`wire::for_learner`], and per presentation the agent's
/// entrypoint URL with a fresh token (when the scheduler signs tokens and knows the agent's
/// entrypoint: `[entrypoint] urls`, else its handshake). Only ever called for the session's
/// owner: the token is the way in.
fn learner_view(
    lesson: &LiveLesson,
    ttl: std::time::Duration,
    tokens: &crate::entrypoint::Tokens,
    fleet: &Fleet,
) -> api::LiveLesson {
    let mut view = wire::for_learner(wire::live_lesson(lesson, ttl), tokens.backend_addresses());
    if !tokens.enabled() {
        return view;
    }
    let Some(agent) = lesson.agent.as_deref() else {
        return view;
    };
    let base = match tokens.configured_url(agent) {
        Some(url) => url.to_owned(),
        None => match fleet.get(agent) {
            Some(agent) => agent.entrypoint_url(),
            None => return view,
        },
    };
    if base.is_empty() {
        return view;
    }
    let id = lesson.id.to_string();
    for endpoint in &mut view.endpoints {
        for presentation in &mut endpoint.presentations {
            let ssh = presentation.r#type == "ssh";
            if let Some(url) = tokens.url(&base, &id, &endpoint.name, &presentation.name, ssh) {
                presentation.entrypoint_url = url;
                // The learner's way in replaces the backend's: never both.
                presentation.address.clear();
                presentation.url.clear();
            }
        }
    }
    view
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_client_is_the_entry_our_proxy_added() {
        assert_eq!(super::forwarded_client("203.0.113.7"), "203.0.113.7");
        assert_eq!(
            super::forwarded_client("6.6.6.6, 198.51.100.2 , 203.0.113.7"),
            "203.0.113.7",
            "a spoofed first entry is ignored"
        );
    }
}
