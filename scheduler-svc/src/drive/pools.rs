//! Warm pools: popular lessons kept READY at a stage, handed to a learner the
//! moment they ask.
//!
//! A pool is (lesson, stage) with a target: its base size, or the largest size among its daily
//! time windows holding now (in `pools.time_zone`). Pools come from the configuration
//! (`[[pools.lessons]]`, written to the store at start) or from operators
//! (AdminService.SetPool), and live in the store, so every replica sees the same targets.
//!
//! **Members** are ordinary live lessons created in a pool session of their own
//! ([`crate::store`], `pools`): placed, provisioned, relocated, watched and removed by the
//! reconciler like any other, never expired by TTL (the pool session is persistent), and
//! counted in agents' loads. Agents see nothing new but the `antidote.io/pool` label: a
//! member's specs carry its pool session for life (PROTOCOL.md forbids changing a spec's
//! session between generations, and objects are never relabelled), and the scheduler keeps
//! who owns it.
//!
//! **The look** ([`Pools::look`], every `pools.interval` and right after each claim): per
//! pool, under the pool's lease on PostgreSQL (one replica at a time maintains each pool),
//! FAILED members and members of a lesson definition that changed are removed; members beyond
//! the target are removed (those not READY first, then the newest); missing members are
//! created, at most `pools.batch` per look and only into room agents have, never while a
//! learner's live lesson waits for room, and after a member failed only once its pool's
//! backoff passed. Everything is read from the store each time, so a restarted scheduler (or
//! another replica) carries on with exactly the members that exist: none lost, none doubled.
//!
//! **A claim** ([`Pools::claim`]): a request for a pooled lesson first tries to take a READY
//! member of its stage's pool, else of the lesson's stage-0 pool (then changes stage), on an
//! agent the lesson's and the request's placement labels accept. One statement moves the
//! member to the learner's session (see the store); the answer is READY at once and the event
//! log says it came from the pool. A member is handed out at most once: a claimed member never
//! goes back, and a learner's deleted lesson is removed like any other.
//!
//! **Giving way** (`drive::room`): when a learner's live lesson cannot be placed because the
//! agents that fit are full, one unclaimed member on such an agent is removed to make room
//! (the reconciler calls it while the live lesson waits).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use sha2::{Digest as _, Sha256};
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::placement::{self, Candidate, Needs};
use super::reconcile::Reconciler;
use super::replicas::Replica;
use crate::catalog::{Catalog, Lesson};
use crate::error::Error;
use crate::metrics::Metrics;
use crate::model::{LiveLesson, Millis, PoolWindow, SessionId, Status, Wishes, pool_target};
use crate::settings::PoolsConfig;
use crate::store::{Claim, PoolCount, Requested, Store, WarmPool};

/// Pool sessions older than this without a live lesson are swept (a creation cut short).
const SWEEP_AFTER: Duration = Duration::from_secs(60);
/// The longest a pool waits to replace a failed member.
const MAX_FAILURE_BACKOFF: Duration = Duration::from_secs(60);

/// Where the time of day comes from: the system clock, or a test's.
pub type Clock = Arc<dyn Fn() -> Millis + Send + Sync>;

/// A pool as operators see it: its settings, its target now and its unclaimed members.
#[derive(Debug, Clone)]
pub struct PoolView {
    /// The stored pool (source `removed` for members left of a pool that no longer exists).
    pub pool: WarmPool,
    /// The target now (windows applied); 0 for a pool that no longer exists.
    pub target: u32,
    /// Unclaimed members by status (`TERMINATING` for those being removed).
    pub members: Vec<PoolCount>,
    /// Requests for the lesson this process answered from its pools, and those it provisioned.
    pub hits: u64,
    /// See `hits`.
    pub misses: u64,
}

/// Shared handle to the pools.
#[derive(Clone)]
pub struct Pools {
    inner: Arc<Inner>,
}

struct Inner {
    /// Pools, members, claims.
    store: Store,
    /// Lessons' definitions (fingerprints, placement needs).
    catalog: Arc<Catalog>,
    /// Creating and removing members is desired state like any other: it is handed over here.
    reconciler: Reconciler,
    /// Time zone, interval, batch, the configured pools.
    config: PoolsConfig,
    /// `config.time_zone`, parsed.
    time_zone: jiff::tz::TimeZone,
    /// This process as a replica (pool leases); `None` on SQLite.
    replica: Option<Arc<Replica>>,
    /// Targets, hits and misses.
    metrics: Arc<Metrics>,
    /// The time of day windows are judged at.
    clock: Clock,
    /// Wakes the look early (after a claim, an operator's change).
    wake: Notify,
    /// The (lesson, stage) pairs claims look at: pools and pairs with members, as of the last
    /// look or change. Requests for anything else never touch the pool tables.
    pooled: RwLock<HashSet<(String, u32)>>,
    /// Per pool: consecutive failed members and when the next may be created.
    failures: Mutex<HashMap<(String, u32), (u32, Instant)>>,
    /// Per lesson: claims that found a member (hits) and those that did not (misses).
    claims: Mutex<HashMap<String, (u64, u64)>>,
    /// When empty pool sessions were last swept (once per [`SWEEP_AFTER`]).
    swept: Mutex<Option<Instant>>,
    /// The pools whose target `/metrics` shows.
    targets_shown: Mutex<HashSet<(String, u32)>>,
}

impl Pools {
    /// The pools of `config`; call [`Pools::start`] to write the configured ones to the store
    /// and keep them at their targets.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        store: Store,
        catalog: Arc<Catalog>,
        reconciler: Reconciler,
        config: PoolsConfig,
        replica: Option<Arc<Replica>>,
        metrics: Arc<Metrics>,
        clock: Option<Clock>,
    ) -> Result<Pools, Error> {
        let time_zone = crate::settings::time_zone(&config.time_zone).map_err(|reason| {
            Error::InvalidArgument {
                field: "pools.time_zone",
                reason,
            }
        })?;
        Ok(Pools {
            inner: Arc::new(Inner {
                store,
                catalog,
                reconciler,
                config,
                time_zone,
                replica,
                metrics,
                clock: clock.unwrap_or_else(|| Arc::new(Millis::now)),
                wake: Notify::new(),
                pooled: RwLock::new(HashSet::new()),
                failures: Mutex::new(HashMap::new()),
                claims: Mutex::new(HashMap::new()),
                swept: Mutex::new(None),
                targets_shown: Mutex::new(HashSet::new()),
            }),
        })
    }

    /// Checks the configured pools against the curriculum, writes them to the store, and
    /// starts the look.
    pub async fn start(
        &self,
        tracker: &TaskTracker,
        shutdown: CancellationToken,
    ) -> Result<(), Error> {
        let inner = &self.inner;
        let mut configured = Vec::new();
        for (i, pool) in inner.config.lessons.iter().enumerate() {
            check_lesson(&inner.catalog, &pool.lesson, pool.stage).map_err(|reason| {
                Error::InvalidArgument {
                    field: "pools.lessons",
                    reason: format!("pools.lessons[{i}]: {reason}"),
                }
            })?;
            configured.push((
                pool.lesson.clone(),
                pool.stage,
                pool.size,
                pool.windows.clone(),
            ));
        }
        inner
            .store
            .sync_configured_pools(&configured, Millis::now())
            .await?;
        self.refresh().await?;
        let this = self.clone();
        tracker.spawn(async move {
            let mut tick = tokio::time::interval(this.inner.config.interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tick.tick() => {}
                    _ = this.inner.wake.notified() => {}
                }
                if let Err(err) = this.look().await {
                    tracing::warn!(error = %err, "pools: look failed; next look retries");
                }
            }
        });
        Ok(())
    }

    /// Reads which (lesson, stage) pairs claims should look at.
    async fn refresh(&self) -> Result<(Vec<WarmPool>, Vec<(String, u32)>), Error> {
        let store = &self.inner.store;
        let pools = store.pools().await?;
        let mut keys: Vec<(String, u32)> = pools
            .iter()
            .map(|p| (p.lesson_slug.clone(), p.stage))
            .collect();
        for key in store.pooled_lessons().await? {
            if !keys.contains(&key) {
                keys.push(key);
            }
        }
        *self
            .inner
            .pooled
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = keys.iter().cloned().collect();
        Ok((pools, keys))
    }

    /// The minute of the day now, in the pools' time zone.
    fn minute_now(&self) -> u16 {
        minute_of_day((self.inner.clock)(), &self.inner.time_zone)
    }

    /// Brings every pool to its target (see the module's documentation).
    #[tracing::instrument(skip_all, level = "debug")]
    pub async fn look(&self) -> Result<(), Error> {
        let inner = &self.inner;
        let (pools, keys) = self.refresh().await?;
        let minute = self.minute_now();
        // A deleted pool's target goes (its members, if any, are shown by status until gone).
        {
            let current: HashSet<(String, u32)> = pools
                .iter()
                .map(|p| (p.lesson_slug.clone(), p.stage))
                .collect();
            let mut shown = lock(&inner.targets_shown);
            for (lesson, stage) in shown.difference(&current) {
                inner.metrics.forget_pool_target(lesson, *stage);
            }
            *shown = current;
        }
        if keys.is_empty() {
            return Ok(());
        }
        let swept = *lock(&inner.swept);
        if swept.is_none_or(|at| at.elapsed() >= SWEEP_AFTER) {
            let cutoff = Millis::now().minus(SWEEP_AFTER);
            match inner.store.sweep_pool_sessions(cutoff).await {
                Ok(_) => *lock(&inner.swept) = Some(Instant::now()),
                Err(err) => tracing::warn!(error = %err, "pools: cannot sweep empty pool sessions"),
            }
        }
        let waiting = inner.store.waiting_for_room().await?;
        for (lesson, stage) in keys {
            let pool = pools
                .iter()
                .find(|p| p.lesson_slug == lesson && p.stage == stage);
            let definition = inner
                .catalog
                .lesson(&lesson)
                .filter(|d| (stage as usize) < d.stages.len());
            let target = match (pool, definition) {
                (Some(pool), Some(_)) => pool_target(pool.size, &pool.windows, minute),
                _ => 0,
            };
            if pool.is_some() {
                inner.metrics.pool_target(&lesson, stage, target);
            }
            if let Some(replica) = &inner.replica
                && !replica
                    .take(&inner.store, &format!("pool:{lesson}:{stage}"))
                    .await?
            {
                continue;
            }
            if let Err(err) = self
                .maintain(&lesson, stage, target, definition, waiting)
                .await
            {
                tracing::warn!(lesson = %lesson, stage, error = %err, "pools: cannot maintain a pool");
            }
        }
        Ok(())
    }

    /// Brings one pool to `target`.
    async fn maintain(
        &self,
        lesson: &str,
        stage: u32,
        target: u32,
        definition: Option<&Lesson>,
        waiting: i64,
    ) -> Result<(), Error> {
        let inner = &self.inner;
        let fingerprint = definition.map(|d| fingerprint(&inner.catalog, d, stage));
        let members = inner.store.pool_members(lesson, stage).await?;
        // An operator drains an agent to empty it: its members go, and are made elsewhere.
        let drained: HashSet<String> = inner
            .reconciler
            .roster()
            .candidates()
            .into_iter()
            .filter(|c| c.drained)
            .map(|c| c.name)
            .collect();
        let mut kept: Vec<LiveLesson> = Vec::new();
        let mut failed = false;
        for (member, made_from) in members {
            if member.deleting {
                continue;
            }
            let why = if member.status == Status::Failed {
                failed = true;
                Some(format!(
                    "warm pool member failed ({}); replaced",
                    member.reason
                ))
            } else if made_from != fingerprint {
                Some("the lesson's definition changed; warm pool member replaced".to_owned())
            } else {
                member
                    .agent
                    .as_ref()
                    .filter(|agent| drained.contains(*agent))
                    .map(|agent| format!("agent `{agent}` drained; warm pool member replaced"))
            };
            match why {
                Some(why) => self.remove(member, &why).await?,
                None => kept.push(member),
            }
        }
        let key = (lesson.to_owned(), stage);
        {
            let mut failures = lock(&inner.failures);
            if failed {
                let count = failures.get(&key).map_or(0, |(count, _)| *count) + 1;
                let delay = Duration::from_secs(1)
                    .saturating_mul(1 << count.min(6))
                    .min(MAX_FAILURE_BACKOFF);
                tracing::info!(
                    lesson,
                    stage,
                    failures = count,
                    ?delay,
                    "pools: a member failed; backing off"
                );
                failures.insert(key.clone(), (count, Instant::now() + delay));
            } else if kept.iter().any(|m| m.status == Status::Ready) {
                failures.remove(&key);
            }
        }
        let have = kept.len() as u32;
        if have > target {
            // Those not READY first (nobody can claim them yet), then the newest.
            kept.sort_by_key(|m| (m.status == Status::Ready, std::cmp::Reverse(m.created_at)));
            for member in kept.into_iter().take((have - target) as usize) {
                self.remove(member, "the warm pool shrank").await?;
            }
            return Ok(());
        }
        let (Some(definition), Some(fingerprint)) = (definition, fingerprint) else {
            return Ok(());
        };
        if have == target || waiting > 0 {
            return Ok(());
        }
        if lock(&inner.failures)
            .get(&key)
            .is_some_and(|(_, until)| *until > Instant::now())
        {
            return Ok(());
        }
        let room = match Needs::of(definition, &Wishes::default()) {
            Ok(needs) => room_for(&inner.reconciler.roster().candidates(), &needs),
            Err(_) => 0,
        };
        let missing = (target - have).min(inner.config.batch).min(room);
        for _ in 0..missing {
            let member = inner
                .store
                .add_pool_member(lesson, stage, &fingerprint, Millis::now())
                .await?;
            tracing::info!(live_lesson.id = %member.id, lesson, stage, "pools: member created");
            inner.reconciler.changed(&member);
        }
        Ok(())
    }

    /// Removes an unclaimed member (unless claimed meanwhile).
    async fn remove(&self, member: LiveLesson, why: &str) -> Result<(), Error> {
        if let Some(removed) = self
            .inner
            .store
            .remove_pool_member(member.id, why, Millis::now())
            .await?
        {
            tracing::info!(live_lesson.id = %member.id, lesson = %member.lesson_slug, reason = why, "pools: member removed");
            self.inner.reconciler.changed(&removed);
        }
        Ok(())
    }

    /// Hands a READY member to `session`'s request for `lesson` at `stage` (see the module's
    /// documentation): the claimed live lesson, `Created` when it is at `stage` already,
    /// `Changed` when it was claimed from the stage-0 pool and is now changing stage. `None`
    /// when the lesson is not pooled or no member could be claimed (the request then
    /// provisions as usual).
    pub async fn claim(
        &self,
        session: SessionId,
        lesson: &Lesson,
        stage: u32,
        wishes: &Wishes,
        limit: u32,
    ) -> Result<Option<(LiveLesson, Requested)>, Error> {
        let inner = &self.inner;
        let pool_stage = {
            let pooled = inner
                .pooled
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if pooled.contains(&(lesson.slug.clone(), stage)) {
                stage
            } else if pooled.contains(&(lesson.slug.clone(), 0)) {
                0
            } else {
                return Ok(None);
            }
        };
        let Ok(needs) = Needs::of(lesson, wishes) else {
            return Ok(None);
        };
        // Asking again for a lesson the session has is neither a hit nor a miss, and needs no
        // write: the request only touches it.
        if inner.store.has_live_lesson(session, &lesson.slug).await? {
            return Ok(None);
        }
        let agents = accepting(&inner.reconciler.roster().candidates(), &needs);
        let now = Millis::now();
        let claim = inner
            .store
            .claim_pool_member(
                session,
                &lesson.slug,
                pool_stage,
                &fingerprint(&inner.catalog, lesson, pool_stage),
                &agents,
                limit,
                now,
            )
            .await?;
        // A hit takes a member; a miss found none to take. A session that could take none
        // (it has the lesson already, holds its limit, or expired) is neither: its request
        // fails or touches what it has, whatever the pool holds.
        let hit = match &claim {
            Claim::Claimed(_) => Some(true),
            Claim::NoMember => Some(false),
            Claim::Declined(why) => {
                tracing::debug!(lesson = %lesson.slug, ?why, "pools: the session takes no member");
                None
            }
        };
        if let Some(hit) = hit {
            inner.metrics.pool_claim(&lesson.slug, hit);
            let mut claims = lock(&inner.claims);
            let (hits, misses) = claims.entry(lesson.slug.clone()).or_default();
            *if hit { hits } else { misses } += 1;
        }
        let Some(member) = claim.member() else {
            return Ok(None);
        };
        tracing::info!(live_lesson.id = %member.id, lesson = %lesson.slug, stage = pool_stage, "claimed from the warm pool");
        // The request's labels apply wherever it is placed next (after its agent is lost).
        if !wishes.is_empty() {
            inner.store.set_wishes(member.id, wishes).await?;
        }
        // Refill behind it.
        inner.wake.notify_one();
        if member.stage == stage {
            inner.reconciler.changed(&member);
            return Ok(Some((member, Requested::Created)));
        }
        let (changed, outcome) = inner.store.set_stage(member.id, stage, now).await?;
        inner.reconciler.changed(&changed);
        Ok(Some((changed, outcome)))
    }

    /// Every pool (and what is left of removed ones) with its target now and its members.
    pub async fn list(&self) -> Result<Vec<PoolView>, Error> {
        let (pools, keys) = self.refresh().await?;
        let counts = self.inner.store.pool_counts().await?;
        let minute = self.minute_now();
        let claims = lock(&self.inner.claims).clone();
        Ok(keys
            .into_iter()
            .map(|(lesson, stage)| {
                let (hits, misses) = claims.get(&lesson).copied().unwrap_or_default();
                let members = counts
                    .iter()
                    .filter(|c| c.lesson_slug == lesson && c.stage == stage)
                    .cloned()
                    .collect();
                match pools
                    .iter()
                    .find(|p| p.lesson_slug == lesson && p.stage == stage)
                {
                    Some(pool) => PoolView {
                        target: pool_target(pool.size, &pool.windows, minute),
                        pool: pool.clone(),
                        members,
                        hits,
                        misses,
                    },
                    None => PoolView {
                        pool: WarmPool {
                            lesson_slug: lesson,
                            stage,
                            size: 0,
                            windows: Vec::new(),
                            source: "removed".into(),
                            updated_by: String::new(),
                            updated_at: Millis(0),
                        },
                        target: 0,
                        members,
                        hits,
                        misses,
                    },
                }
            })
            .collect())
    }

    /// Sets a pool for an operator (`identity`): INVALID_ARGUMENT or NOT_FOUND naming what is
    /// wrong; the look runs at once.
    pub async fn set(
        &self,
        lesson: &str,
        stage: u32,
        size: u32,
        windows: &[PoolWindow],
        identity: &str,
    ) -> Result<WarmPool, Error> {
        check_lesson(&self.inner.catalog, lesson, stage).map_err(|reason| {
            match self.inner.catalog.lesson(lesson) {
                None => Error::LessonNotFound(lesson.to_owned()),
                Some(_) => Error::InvalidArgument {
                    field: "stage",
                    reason,
                },
            }
        })?;
        crate::settings::check_pool(size, windows)
            .map_err(|(field, reason)| Error::InvalidArgument { field, reason })?;
        let pool = self
            .inner
            .store
            .set_pool(lesson, stage, size, windows, identity, Millis::now())
            .await?;
        self.refresh().await?;
        self.inner.wake.notify_one();
        Ok(pool)
    }

    /// The target of `pool` now.
    pub fn target(&self, pool: &WarmPool) -> u32 {
        pool_target(pool.size, &pool.windows, self.minute_now())
    }
}

/// Why a pool for `lesson` at `stage` cannot exist, if it cannot.
fn check_lesson(catalog: &Catalog, lesson: &str, stage: u32) -> Result<(), String> {
    let definition = catalog
        .lesson(lesson)
        .ok_or_else(|| format!("no lesson `{lesson}` in the curriculum"))?;
    if stage as usize >= definition.stages.len() {
        return Err(format!(
            "lesson `{lesson}` has no stage {stage} (its last is {})",
            definition.stages.len().saturating_sub(1)
        ));
    }
    Ok(())
}

/// What a member of `lesson`'s pool at `stage` is made from, hashed: the spec agents are sent
/// for that stage without its identity ([`crate::agents::stage_spec_bytes`]: images,
/// presentations, connections, the stage's configuration files' contents, notebooks, the
/// ready delay) and the lesson's placement labels. No path (the same curriculum mounted
/// elsewhere, on another replica, gives the same fingerprint) and no Rust type's layout; an
/// edit agents never see (a description, a guide) keeps the members. A member of another
/// fingerprint is replaced and never claimed.
pub fn fingerprint(catalog: &Catalog, lesson: &Lesson, stage: u32) -> String {
    let mut hasher = Sha256::new();
    let mut part = |bytes: &[u8]| {
        hasher.update((bytes.len() as u64).to_be_bytes());
        hasher.update(bytes);
    };
    part(b"antidote pool member v2");
    part(&crate::agents::stage_spec_bytes(lesson, catalog, stage));
    for (kind, labels) in [
        ("requires", &lesson.placement.requires),
        ("prefers", &lesson.placement.prefers),
    ] {
        for (key, value) in labels {
            part(kind.as_bytes());
            part(key.as_bytes());
            part(value.as_bytes());
        }
    }
    hex::encode(&hasher.finalize()[..12])
}

/// Minutes after midnight of `at` in `zone`.
pub fn minute_of_day(at: Millis, zone: &jiff::tz::TimeZone) -> u16 {
    let Ok(timestamp) = jiff::Timestamp::from_millisecond(at.0) else {
        return 0;
    };
    let time = timestamp.to_zoned(zone.clone()).time();
    time.hour() as u16 * 60 + time.minute() as u16
}

/// The agents a claim may take a member from: those placement would accept for `needs` if
/// load did not count (the member is there already), each with how many of the preferred
/// labels it carries (a member is taken from one carrying the most).
fn accepting(candidates: &[Candidate], needs: &Needs) -> Vec<(String, usize)> {
    candidates
        .iter()
        .filter(|c| {
            let unloaded = Candidate {
                load: 0,
                capacity: 0,
                ..(*c).clone()
            };
            placement::choose(&[unloaded], needs).is_ok()
        })
        .map(|c| {
            let preferred = needs
                .prefers
                .iter()
                .filter(|(key, value)| c.labels.get(*key) == Some(*value))
                .count();
            (c.name.clone(), preferred)
        })
        .collect()
}

/// How many more members of `lesson` agents have room for (agents without a limit: plenty).
fn room_for(candidates: &[Candidate], needs: &Needs) -> u32 {
    candidates
        .iter()
        .filter(|c| placement::choose(std::slice::from_ref(*c), needs).is_ok())
        .map(|c| {
            if c.capacity == 0 {
                u32::MAX / 2
            } else {
                c.capacity.saturating_sub(c.load)
            }
        })
        .fold(0u32, u32::saturating_add)
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::drive::placement::Availability;

    fn agent(name: &str, region: &str, load: u32, capacity: u32) -> Candidate {
        Candidate {
            name: name.into(),
            availability: Availability::Ready,
            drained: false,
            capabilities: None,
            labels: BTreeMap::from([("region".to_owned(), region.to_owned())]),
            load,
            capacity,
        }
    }

    #[test]
    fn claims_look_past_load_and_growth_stays_within_room() {
        let eu = |requires: &[(&str, &str)]| Needs {
            capabilities: Vec::new(),
            requires: requires
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            prefers: BTreeMap::new(),
        };
        let full = agent("a", "eu", 2, 2);
        let roomy = agent("b", "us", 1, 4);
        let drained = Candidate {
            drained: true,
            ..agent("c", "eu", 0, 4)
        };
        let down = Candidate {
            availability: Availability::Down("unavailable".into()),
            ..agent("d", "eu", 0, 4)
        };
        let all = [full.clone(), roomy.clone(), drained, down];
        // A member on a full agent can still be claimed; not from a drained or down one.
        let names = |agents: Vec<(String, usize)>| -> Vec<String> {
            agents.into_iter().map(|(name, _)| name).collect()
        };
        assert_eq!(names(accepting(&all, &eu(&[]))), ["a", "b"]);
        assert_eq!(names(accepting(&all, &eu(&[("region", "eu")]))), ["a"]);
        // Preferred labels rank agents, they exclude none.
        let prefers_us = Needs {
            prefers: BTreeMap::from([("region".to_owned(), "us".to_owned())]),
            ..eu(&[])
        };
        assert_eq!(
            accepting(&all, &prefers_us),
            [("a".to_owned(), 0), ("b".to_owned(), 1)]
        );
        // Growth: only the room agents that fit have.
        assert_eq!(room_for(&all, &eu(&[])), 3);
        assert_eq!(room_for(&all, &eu(&[("region", "eu")])), 0);
        let unlimited = agent("e", "us", 50, 0);
        assert!(room_for(&[unlimited], &eu(&[])) > 1000);
    }

    #[test]
    fn the_time_of_day_is_the_zone_s() {
        // 2026-01-15 08:50 UTC.
        let at = Millis(
            jiff::Timestamp::from_second(1_768_467_000)
                .unwrap()
                .as_millisecond(),
        );
        assert_eq!(minute_of_day(at, &jiff::tz::TimeZone::UTC), 8 * 60 + 50);
        let paris = jiff::tz::TimeZone::get("Europe/Paris").unwrap();
        assert_eq!(minute_of_day(at, &paris), 9 * 60 + 50, "UTC+1 in January");
    }

    /// A change to a test curriculum's files.
    type Edit = fn(&mut BTreeMap<&'static str, String>);

    /// A two-stage lesson's curriculum, with `edit` applied to its files, loaded as if it lived
    /// at `root`.
    fn curriculum(root: &str, edit: impl Fn(&mut BTreeMap<&'static str, String>)) -> Catalog {
        let mut files: BTreeMap<&'static str, String> = BTreeMap::from([
            (
                "curriculum.meta.yaml",
                "name: test\ndescription: fingerprints\n".to_owned(),
            ),
            (
                "images/box/image.meta.yaml",
                "slug: box\ndescription: a box\nflavor: untrusted\nsshUser: antidote\n\
                 sshPassword: antidote\nnetworkInterfaces: [eth1]\n"
                    .to_owned(),
            ),
            (
                "lessons/two/lesson.meta.yaml",
                "slug: two\nname: Two\ncategory: fundamentals\ntier: prod\n\
                 shortDescription: two stages\n\
                 endpoints:\n- name: web\n  image: box\n  configurationType: shell\n\
                 \x20 presentations:\n  - {name: page, port: 8080, type: http}\n\
                 - name: cli\n  image: box\n  presentations:\n  - {name: cli, port: 22, type: ssh}\n\
                 connections:\n- {a: web, b: cli}\n\
                 stages:\n- {description: first, guideType: markdown}\n\
                 - {description: second, guideType: markdown}\n"
                    .to_owned(),
            ),
            ("lessons/two/stage0/guide.md", "# Stage 0\n".to_owned()),
            ("lessons/two/stage0/configs/web.sh", "echo zero > /www/index.html\n".to_owned()),
            ("lessons/two/stage1/guide.md", "# Stage 1\n".to_owned()),
            ("lessons/two/stage1/configs/web.sh", "echo one > /www/index.html\n".to_owned()),
        ]);
        edit(&mut files);
        Catalog::from_files(
            std::path::Path::new(root),
            files,
            crate::catalog::Tier::Prod,
        )
        .expect("the test curriculum loads")
    }

    fn fingerprint_of(catalog: &Catalog, stage: u32) -> String {
        let lesson = catalog.lesson("two").expect("the lesson `two`");
        fingerprint(catalog, lesson, stage)
    }

    #[test]
    fn fingerprints_name_what_agents_get_not_where_the_curriculum_lives() {
        let here = curriculum("/srv/curriculum", |_| {});
        let there = curriculum("/mnt/replica-2/antidote/curriculum", |_| {});
        assert_ne!(
            here.lesson("two").unwrap().dir,
            there.lesson("two").unwrap().dir,
            "the test needs two paths"
        );
        for stage in [0, 1] {
            assert_eq!(
                fingerprint_of(&here, stage),
                fingerprint_of(&there, stage),
                "the same lesson at another path, stage {stage}"
            );
        }
        assert_ne!(
            fingerprint_of(&here, 0),
            fingerprint_of(&here, 1),
            "stages differ"
        );
        // What agents never see keeps the members: descriptions, guides.
        let described = curriculum("/srv/curriculum", |files| {
            let meta = files.get_mut("lessons/two/lesson.meta.yaml").unwrap();
            *meta = meta.replace("two stages", "two stages, described again");
            files.insert(
                "lessons/two/stage0/guide.md",
                "# Stage 0, rewritten\n".into(),
            );
        });
        assert_eq!(fingerprint_of(&here, 0), fingerprint_of(&described, 0));
        // What agents get replaces them: a configuration's contents, a presentation's port, an
        // image's credentials, a connection, the ready delay, the placement labels.
        let changes: [(&str, Edit); 6] = [
            ("stage 0's configuration", |files| {
                files.insert(
                    "lessons/two/stage0/configs/web.sh",
                    "echo 0 > /www/index.html\n".into(),
                );
            }),
            ("a port", |files| {
                let meta = files.get_mut("lessons/two/lesson.meta.yaml").unwrap();
                *meta = meta.replace("port: 8080", "port: 8081");
            }),
            ("the image", |files| {
                let meta = files.get_mut("images/box/image.meta.yaml").unwrap();
                *meta = meta.replace("sshPassword: antidote", "sshPassword: changed");
            }),
            ("the connections", |files| {
                let meta = files.get_mut("lessons/two/lesson.meta.yaml").unwrap();
                *meta = meta.replace(
                    "- {a: web, b: cli}",
                    "- {a: web, b: cli, subnet: 10.9.0.0/24}",
                );
            }),
            ("the ready delay", |files| {
                let meta = files.get_mut("lessons/two/lesson.meta.yaml").unwrap();
                meta.push_str("readyDelay: 5\n");
            }),
            ("the placement", |files| {
                let meta = files.get_mut("lessons/two/lesson.meta.yaml").unwrap();
                meta.push_str("placement:\n  requires: {region: eu}\n");
            }),
        ];
        for (what, change) in changes {
            let changed = curriculum("/srv/curriculum", change);
            assert_ne!(
                fingerprint_of(&here, 0),
                fingerprint_of(&changed, 0),
                "a change of {what} must replace stage 0's members"
            );
        }
        // Stage 1's configuration is not stage 0's members' business: moved on, they are sent
        // stage 1 as it is then.
        let later = curriculum("/srv/curriculum", |files| {
            files.insert(
                "lessons/two/stage1/configs/web.sh",
                "echo 1 > /www/index.html\n".into(),
            );
        });
        assert_eq!(fingerprint_of(&here, 0), fingerprint_of(&later, 0));
        assert_ne!(fingerprint_of(&here, 1), fingerprint_of(&later, 1));
    }
}
