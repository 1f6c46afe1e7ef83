//! The fault matrix: real faults under load, and what each promises.
//!
//! - PostgreSQL crashes (kill -9 of the postmaster) and stops for a while under two replicas
//!   taking requests: every acknowledged request is kept and settles READY, calls during the
//!   outage are refused UNAVAILABLE (never another code, never a hang) and succeed when tried
//!   again, and both replicas recover by themselves (pool and LISTEN connection).
//! - The SQLite file's filesystem fills up (a small tmpfs): requests are refused naming the
//!   store's disk, nothing acknowledged is lost, and the scheduler resumes once space returns.
//! - An agent behind Shopify's toxiproxy: latency, then a black hole, then resets; and a
//!   Provision call cut off mid-call, retried rather than taken as the agent's answer; an agent
//!   whose every call is slow holds no more than its share of the reconcile workers.
//!
//! The PostgreSQL faults hit a server of the test's own (`tests/postgres/pg.sh` with a private
//! state directory and port), never the one other tests share.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use antidote_proto::api::v1 as api;
use antidote_tests::config::{Agent, SchedulerConfig, ms, secs};
use antidote_tests::journal::created;
use antidote_tests::{Clients, Process, Scheduler, Tokens, example_curriculum};
use tonic::Code;

use crate::postgres::{PrivatePostgres, start_on};
use crate::{PATIENCE, start_agent};

/// The longest any one call may take before it counts as a hang (the store's own waits, such as
/// a PostgreSQL connection's acquire timeout, are shorter).
const CALL_DEADLINE: Duration = Duration::from_secs(30);

/// What the clients of a load saw.
#[derive(Default)]
struct Tally {
    /// Acknowledged live lessons: (id, the replica that acknowledged it).
    acknowledged: Vec<(String, usize)>,
    /// UNAVAILABLE answers, per replica.
    unavailable: HashMap<usize, usize>,
    /// UNAVAILABLE answers per replica since `mark` was last set.
    unavailable_since_mark: HashMap<usize, usize>,
    /// The messages of UNAVAILABLE answers (a few, for the report).
    messages: BTreeSet<String>,
    /// Any other failure: a code other than UNAVAILABLE, or a call past [`CALL_DEADLINE`].
    wrong: Vec<String>,
}

/// Runs `call` until it succeeds, retrying after UNAVAILABLE (recorded in `tally` for
/// `replica`); any other failure, or a call taking longer than [`CALL_DEADLINE`], is recorded
/// as wrong and ends the retries.
async fn retried<T, F, Fut>(
    tally: &Mutex<Tally>,
    replica: usize,
    what: &str,
    mut call: F,
) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, tonic::Status>>,
{
    for _ in 0..1000 {
        let started = Instant::now();
        match tokio::time::timeout(CALL_DEADLINE, call()).await {
            Ok(Ok(value)) => return Some(value),
            Ok(Err(status)) if status.code() == Code::Unavailable => {
                let mut tally = tally.lock().unwrap();
                *tally.unavailable.entry(replica).or_default() += 1;
                *tally.unavailable_since_mark.entry(replica).or_default() += 1;
                if tally.messages.len() < 8 {
                    tally.messages.insert(status.message().to_owned());
                }
            }
            Ok(Err(status)) => {
                tally.lock().unwrap().wrong.push(format!(
                    "{what} on replica {replica}: {:?} {} (after {:?})",
                    status.code(),
                    status.message(),
                    started.elapsed()
                ));
                return None;
            }
            Err(_) => {
                tally.lock().unwrap().wrong.push(format!(
                    "{what} on replica {replica}: no answer within {CALL_DEADLINE:?}"
                ));
                return None;
            }
        }
        // Pacing between tries of a refused call.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tally
        .lock()
        .unwrap()
        .wrong
        .push(format!("{what} on replica {replica}: refused 1000 times"));
    None
}

/// One learner's requests: a session, then a live lesson, each retried after UNAVAILABLE.
async fn one_learner(clients: &Clients, replica: usize, slug: &str, tally: &Mutex<Tally>) {
    let Some(session) = retried(tally, replica, "CreateSession", || async {
        clients
            .session()
            .await
            .map_err(|err| match err.downcast::<tonic::Status>() {
                Ok(status) => status,
                Err(err) => tonic::Status::unknown(format!("{err:#}")),
            })
    })
    .await
    else {
        return;
    };
    let Some(lesson) = retried(tally, replica, "RequestLiveLesson", || {
        clients.request(&session, slug, 0)
    })
    .await
    else {
        return;
    };
    tally
        .lock()
        .unwrap()
        .acknowledged
        .push((lesson.id, replica));
}

/// Learners requesting live lessons from `replicas` (spread over them) until `stop`, each
/// learner once; at most `limit` learners.
fn load(
    replicas: Vec<Clients>,
    workers: usize,
    limit: usize,
    stop: Arc<AtomicBool>,
    tally: Arc<Mutex<Tally>>,
) -> tokio::task::JoinSet<()> {
    let slugs = ["hello-web", "routing-basics", "netcat-toolbox"];
    let next = Arc::new(AtomicUsize::new(0));
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..workers {
        let (replicas, stop, tally, next) =
            (replicas.clone(), stop.clone(), tally.clone(), next.clone());
        set.spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let n = next.fetch_add(1, Ordering::SeqCst);
                if n >= limit {
                    return;
                }
                let replica = n % replicas.len();
                one_learner(&replicas[replica], replica, slugs[n % slugs.len()], &tally).await;
            }
        });
    }
    set
}

/// Waits until `tally` satisfies `until` (checked as the load goes), or panics with `what`.
async fn wait_for(tally: &Mutex<Tally>, what: &str, until: impl Fn(&Tally) -> bool) {
    let waited = tokio::time::timeout(PATIENCE * 2, async {
        loop {
            if until(&tally.lock().unwrap()) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    if waited.is_err() {
        let tally = tally.lock().unwrap();
        panic!(
            "{what} did not happen: {} acknowledged, UNAVAILABLE {:?}, wrong {:?}",
            tally.acknowledged.len(),
            tally.unavailable,
            tally.wrong
        );
    }
}

fn logs(schedulers: &[&Scheduler], agent: &Process) -> String {
    let schedulers = schedulers
        .iter()
        .enumerate()
        .map(|(i, s)| (format!("scheduler {i}"), &s.process));
    antidote_tests::logs(schedulers.chain([("agent".to_owned(), agent)]))
}

/// Replicas' configuration for the PostgreSQL faults (the replicas tests'), on the agent at
/// `agent`.
fn replica_config(agent: &str) -> SchedulerConfig {
    crate::replicas::replica_config("e2e-faults").with_agent(Agent::new("loopback", agent))
}

/// Two replicas on a private PostgreSQL server, learners requesting live lessons from both
/// while the server is killed (-9) and restarted, then stopped long enough for every replica's
/// calls to be refused, then started again. Every call is answered, OK or UNAVAILABLE, within
/// its deadline; every refused call succeeds when tried again; every acknowledged live lesson
/// reaches READY as seen from the *other* replica (its Watch is fed by LISTEN/NOTIFY, which must
/// have been re-established, and by the resync after it) and was created once on the agent;
/// neither replica was restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restarted_mid_load_loses_nothing_acknowledged() {
    let postgres = PrivatePostgres::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let journal = dir.path().join("journal");
    let agent = start_agent(&dir, &["--boot-delay", "300ms"], &journal, None).await;
    let config = replica_config(&agent.url()).to_toml();
    let tokens = Tokens::default();
    let mut replicas = Vec::new();
    for _ in 0..2 {
        let mut replica = start_on(dir.path(), &postgres.url, &config).await;
        replica.clients.tokens = tokens.clone();
        replicas.push(replica);
    }
    let clients: Vec<Clients> = replicas.iter().map(|r| r.clients.clone()).collect();
    let all_logs = |replicas: &[Scheduler]| logs(&replicas.iter().collect::<Vec<_>>(), &agent);

    // A Watch opened on B before the faults, of a live lesson requested on A: it must follow the
    // live lesson to READY through them.
    let session = clients[0].session().await.unwrap();
    let early = clients[0].request(&session, "hello-web", 0).await.unwrap();
    let early_watch = {
        let b = clients[1].clone();
        let id = early.id.clone();
        tokio::spawn(async move { b.ready(&id).await })
    };

    let started = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Mutex::new(Tally::default()));
    let mut workers = load(clients.clone(), 6, 400, stop.clone(), tally.clone());

    // 1. A crash mid-load: kill -9 of the postmaster, started again at once (crash recovery).
    wait_for(&tally, "20 acknowledged requests", |t| {
        t.acknowledged.len() >= 20
    })
    .await;
    postgres.pg(&["restart", "kill"]).await;
    let crashed = tally.lock().unwrap().acknowledged.len();
    // 2. An outage: stopped until both replicas have refused calls, then started.
    wait_for(
        &tally,
        "20 more acknowledged requests after the crash",
        |t| t.acknowledged.len() >= crashed + 20,
    )
    .await;
    postgres.pg(&["stop"]).await;
    let outage = Instant::now();
    tally.lock().unwrap().unavailable_since_mark.clear();
    // One more learner on each replica: the load's workers may all be retrying on one replica
    // when the server stops (CI once saw 107 refusals from one and none from the other).
    for (replica, replica_clients) in clients.iter().enumerate() {
        let (replica_clients, tally) = (replica_clients.clone(), tally.clone());
        workers.spawn(async move {
            one_learner(&replica_clients, replica, "hello-web", &tally).await;
        });
    }
    wait_for(&tally, "UNAVAILABLE from both replicas", |t| {
        (0..2).all(|r| t.unavailable_since_mark.get(&r).copied().unwrap_or(0) >= 1)
    })
    .await;
    postgres.pg(&["start"]).await;
    let outage = outage.elapsed();
    let restarted = tally.lock().unwrap().acknowledged.len();
    // 3. Both replicas take requests again, without a restart.
    wait_for(
        &tally,
        "requests acknowledged by both replicas again",
        |t| {
            (0..2).all(|r| {
                t.acknowledged[restarted..]
                    .iter()
                    .filter(|(_, by)| *by == r)
                    .count()
                    >= 5
            })
        },
    )
    .await;
    stop.store(true, Ordering::SeqCst);
    while let Some(joined) = workers.join_next().await {
        joined.unwrap();
    }
    let load_time = started.elapsed();

    let tally = std::mem::take(&mut *tally.lock().unwrap());
    assert!(
        tally.wrong.is_empty(),
        "calls answered other than OK or UNAVAILABLE: {:#?}\n{}",
        tally.wrong,
        all_logs(&replicas)
    );
    // Neither replica was restarted: the same processes answered before and after (the load
    // above ended only once both had acknowledged requests again).

    // Every acknowledged live lesson READY, followed on the replica that did not acknowledge it.
    let mut ids: Vec<(String, usize)> = tally.acknowledged.clone();
    ids.push((early.id.clone(), 0));
    let settle = Instant::now();
    let mut waits = tokio::task::JoinSet::new();
    for (id, by) in ids.clone() {
        let other = clients[1 - by].clone();
        waits.spawn(async move { (other.ready(&id).await, id) });
    }
    while let Some(joined) = waits.join_next().await {
        let (result, id) = joined.unwrap();
        if let Err(err) = result {
            panic!("{id}: {err:#}\n{}", all_logs(&replicas));
        }
    }
    let settle = settle.elapsed();
    let early_ready = tokio::time::timeout(PATIENCE, early_watch)
        .await
        .expect("the early watch ends")
        .unwrap();
    if let Err(err) = early_ready {
        panic!(
            "the Watch opened on B before the faults: {err:#}\n{}",
            all_logs(&replicas)
        );
    }

    // Created exactly once each on the agent.
    let creations = created(&journal);
    let distinct: BTreeSet<_> = creations.iter().cloned().collect();
    let expected: BTreeSet<_> = ids.iter().map(|(id, _)| id.clone()).collect();
    assert_eq!(
        distinct,
        expected,
        "the agent created exactly the acknowledged live lessons\n{}",
        all_logs(&replicas)
    );
    assert_eq!(
        creations.len(),
        expected.len(),
        "each created once\n{}",
        all_logs(&replicas)
    );
    // The faults cut both replicas' LISTEN connections.
    for (i, replica) in replicas.iter().enumerate() {
        assert!(
            replica
                .process
                .log_text()
                .contains("lost the live-lesson change listener"),
            "replica {i} never lost its listener\n{}",
            all_logs(&replicas)
        );
    }
    // Both listen again: a live lesson requested on A after the faults (A holds its lease and
    // drives it) reaches READY as B's watchers see it, through B's new LISTEN connection.
    let session = clients[0].session().await.unwrap();
    let after = clients[0].request(&session, "hello-web", 0).await.unwrap();
    if let Err(err) = clients[1].ready(&after.id).await {
        panic!("after the faults: {err:#}\n{}", all_logs(&replicas));
    }
    println!(
        "faults: PostgreSQL kill -9 and a {outage:?} outage under load: {} acknowledged in \
         {load_time:?} ({} after the crash, {} before the outage), UNAVAILABLE answers {:?} \
         ({:?}), all READY {settle:?} after the load",
        expected.len(),
        crashed,
        restarted,
        tally.unavailable,
        tally.messages
    );
}

/// A small tmpfs mounted on a directory of the test's own (we are root), unmounted and removed
/// on drop: the filesystem a test fills up.
struct Tmpfs {
    /// The mount point.
    dir: PathBuf,
}

impl Tmpfs {
    fn mount(size: &str) -> Tmpfs {
        let dir = PathBuf::from(format!(
            "/tmp/antidote-full-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir).expect("mount point");
        let status = std::process::Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "tmpfs",
            ])
            .arg(&dir)
            .status()
            .expect("mount runs");
        assert!(
            status.success(),
            "mount -t tmpfs on {}: {status}",
            dir.display()
        );
        Tmpfs { dir }
    }

    /// Writes `filler` until the filesystem refuses (ENOSPC); returns the bytes written.
    fn fill(&self, filler: &Path) -> u64 {
        use std::io::Write as _;
        let mut file = std::fs::File::create(filler).expect("filler file");
        let chunk = vec![0xa5u8; 64 * 1024];
        let mut written = 0u64;
        loop {
            match file.write(&chunk) {
                Ok(0) => break,
                Ok(n) => written += n as u64,
                Err(err) if err.raw_os_error() == Some(28) => break, // ENOSPC
                Err(err) => panic!("filling {}: {err}", filler.display()),
            }
        }
        // What is still buffered fails the same way; the file keeps what fitted.
        let _ = file.flush();
        written
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.dir)
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A single scheduler's configuration on the test agent at `agent`: the replicas' without
/// `[replicas]`.
fn single_config(agent: &str) -> SchedulerConfig {
    let mut config = replica_config(agent);
    config.replicas = Default::default();
    config
}

/// The scheduler's SQLite file on a 16 MiB tmpfs that the test fills up while learners keep
/// requesting live lessons: once the store cannot write, every call is refused UNAVAILABLE or
/// RESOURCE_EXHAUSTED with a message naming the full disk, within its deadline; when the
/// filler is deleted the same scheduler (not restarted) takes requests again and every
/// acknowledged live lesson settles READY; after a restart every one of them is still there.
/// Live lessons BOOTING when the disk fills report READY while it is full: the reconciler's
/// write fails and is retried until space returns (the resync, an hour away, cannot help).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_on_a_full_filesystem_refuses_clearly_and_resumes() {
    let tmpfs = Tmpfs::mount("16m");
    let dir = tempfile::tempdir().expect("temp dir");
    let journal = dir.path().join("journal");
    // Live lessons BOOT for 2 s, so those requested before the disk fills report READY while
    // it is full; the resync is an hour away, so only the reconciler retrying its failed
    // writes (never reading them as "moved on") brings them READY.
    let agent = start_agent(&dir, &["--boot-delay", "2s"], &journal, None).await;
    let mut config = single_config(&agent.url());
    config.replicas.resync_interval = Some(secs(3600));
    let config = config.to_toml();
    let database = tmpfs.dir.join("antidote.db");
    let database = database.to_str().expect("a UTF-8 path");
    let mut scheduler = start_on(dir.path(), database, &config).await;
    let clients = scheduler.clients.clone();
    let all_logs = |s: &Scheduler| logs(&[s], &agent);

    // Some live lessons before the disk fills.
    let tally = Mutex::new(Tally::default());
    for i in 0..5 {
        one_learner(&clients, 0, ["hello-web", "routing-basics"][i % 2], &tally).await;
    }
    let filler = tmpfs.dir.join("filler");
    let filled = tmpfs.fill(&filler);

    // Learners keep asking until the store refuses (SQLite first reuses the space its files
    // already have).
    let mut refusal = None;
    for i in 0..5000 {
        let started = Instant::now();
        let call = async {
            let session = clients.session().await.map_err(|err| {
                err.downcast::<tonic::Status>()
                    .unwrap_or_else(|err| tonic::Status::unknown(format!("{err:#}")))
            })?;
            clients
                .request(&session, ["hello-web", "routing-basics"][i % 2], 0)
                .await
        };
        match tokio::time::timeout(CALL_DEADLINE, call).await {
            Ok(Ok(lesson)) => tally.lock().unwrap().acknowledged.push((lesson.id, 0)),
            Ok(Err(status)) => {
                refusal = Some((status, started.elapsed()));
                break;
            }
            Err(_) => panic!(
                "a call on the full disk got no answer within {CALL_DEADLINE:?}\n{}",
                all_logs(&scheduler)
            ),
        }
    }
    let (status, _) = refusal.unwrap_or_else(|| {
        panic!(
            "5000 learners fitted on a full disk\n{}",
            all_logs(&scheduler)
        )
    });
    let clear = |status: &tonic::Status| {
        matches!(status.code(), Code::Unavailable | Code::ResourceExhausted)
            && (status.message().contains("disk") || status.message().contains("full"))
    };
    assert!(
        clear(&status),
        "refused with {:?}: {}\n{}",
        status.code(),
        status.message(),
        all_logs(&scheduler)
    );
    let acknowledged_full = tally.lock().unwrap().acknowledged.len();
    // It stays refused, clearly and promptly, while the disk is full.
    for _ in 0..5 {
        let answer = tokio::time::timeout(CALL_DEADLINE, clients.session())
            .await
            .unwrap_or_else(|_| panic!("no answer on the full disk\n{}", all_logs(&scheduler)));
        if let Err(err) = answer {
            let status = err.downcast::<tonic::Status>().expect("a gRPC status");
            assert!(clear(&status), "{:?}: {}", status.code(), status.message());
        }
    }

    // The disk stays full until the reconciler failed to write what the agent reported (a
    // live lesson BOOTING before the fill went READY meanwhile). SQLite still commits what fits
    // in the space its files have (once the checkpointer has copied the WAL into the database
    // file, the WAL starts again from its beginning), so a report's write may succeed; learners
    // go on asking meanwhile, and those accepted boot and report in turn.
    let failed_write = tokio::time::timeout(PATIENCE, async {
        for i in 0.. {
            if scheduler
                .process
                .log_text()
                .contains("reconcile failed; retrying")
            {
                break;
            }
            let call = async {
                let session = clients.session().await.ok()?;
                clients
                    .request(&session, ["hello-web", "routing-basics"][i % 2], 0)
                    .await
                    .ok()
            };
            if let Ok(Some(lesson)) = tokio::time::timeout(CALL_DEADLINE, call).await {
                tally.lock().unwrap().acknowledged.push((lesson.id, 0));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    assert!(
        failed_write.is_ok(),
        "no observation write failed on the full disk\n{}",
        all_logs(&scheduler)
    );

    // Space returns: the same process takes requests again.
    std::fs::remove_file(&filler).expect("filler removed");
    for i in 0..5 {
        one_learner(&clients, 0, ["hello-web", "routing-basics"][i % 2], &tally).await;
    }
    let tally = std::mem::take(&mut *tally.lock().unwrap());
    assert!(
        tally.wrong.is_empty(),
        "{:#?}\n{}",
        tally.wrong,
        all_logs(&scheduler)
    );
    for (id, _) in &tally.acknowledged {
        if let Err(err) = clients.ready(id).await {
            panic!("{id}: {err:#}\n{}", all_logs(&scheduler));
        }
    }
    // Durable: after a restart, every acknowledged live lesson is there and READY.
    scheduler.process.terminate().await.unwrap();
    scheduler = start_on(dir.path(), database, &config).await;
    let mut again = scheduler.clients.clone();
    again.tokens = clients.tokens.clone();
    for (id, _) in &tally.acknowledged {
        let lesson = again.get(id).await.unwrap_or_else(|err| {
            panic!("{id} after the restart: {err}\n{}", all_logs(&scheduler))
        });
        assert_eq!(lesson.status(), api::LiveLessonStatus::Ready, "{id}");
    }
    let created: BTreeSet<_> = created(&journal).into_iter().collect();
    assert!(
        tally
            .acknowledged
            .iter()
            .all(|(id, _)| created.contains(id)),
        "every acknowledged live lesson was created on the agent"
    );
    println!(
        "faults: SQLite on a full tmpfs (filler {filled} bytes): {} acknowledged, {acknowledged_full} \
         of them before the first refusal ({:?}: {}), all READY after space returned and after a restart",
        tally.acknowledged.len(),
        status.code(),
        status.message()
    );
}

/// toxiproxy's API URL: the server `ANTIDOTE_TEST_TOXIPROXY` names (`tests/run` starts one), or the
/// one `tests/faults/toxiproxy.sh start` builds and starts when that is unset; never skipped.
fn toxiproxy() -> &'static str {
    static SERVER: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SERVER.get_or_init(|| {
        antidote_tests::server_url("ANTIDOTE_TEST_TOXIPROXY", "faults/toxiproxy.sh")
    })
}

/// One toxiproxy proxy of this test's own, deleted on drop.
struct Proxy {
    /// The API's URL.
    api: String,
    /// The proxy's unique name.
    name: String,
    /// Where it listens (the address the scheduler dials).
    listen: std::net::SocketAddr,
    web: antidote_tests::web::Web,
}

impl Proxy {
    /// A proxy on a free loopback port in front of `upstream`.
    async fn create(upstream: std::net::SocketAddr) -> Proxy {
        let api = toxiproxy().to_owned();
        let name = format!("antidote-{}", uuid::Uuid::new_v4().simple());
        let web = antidote_tests::web::Web::default();
        let body = serde_json::json!({
            "name": name, "listen": "127.0.0.1:0", "upstream": upstream.to_string(), "enabled": true,
        });
        let answer = web
            .post(&format!("{api}/proxies"), &body.to_string())
            .await
            .expect("toxiproxy answers");
        assert!(answer.status.is_success(), "POST /proxies: {answer:?}");
        let listen = answer.json().unwrap()["listen"]
            .as_str()
            .expect("the proxy's listen address")
            .parse()
            .expect("an address");
        Proxy {
            api,
            name,
            listen,
            web,
        }
    }

    /// Adds toxic `name` of `kind` to the stream `stream` (`upstream`: towards the agent,
    /// `downstream`: back) with `attributes`.
    async fn add(&self, name: &str, kind: &str, stream: &str, attributes: serde_json::Value) {
        let body = serde_json::json!({
            "name": name, "type": kind, "stream": stream, "toxicity": 1.0, "attributes": attributes,
        });
        let answer = self
            .web
            .post(
                &format!("{}/proxies/{}/toxics", self.api, self.name),
                &body.to_string(),
            )
            .await
            .expect("toxiproxy answers");
        assert!(answer.status.is_success(), "add toxic {name}: {answer:?}");
    }

    /// Enables or disables the proxy: disabling closes every connection through it at once
    /// (calls in flight are cut off) and refuses new ones until it is enabled again.
    async fn enable(&self, enabled: bool) {
        let answer = self
            .web
            .post(
                &format!("{}/proxies/{}", self.api, self.name),
                &serde_json::json!({ "enabled": enabled }).to_string(),
            )
            .await
            .expect("toxiproxy answers");
        assert!(answer.status.is_success(), "enable {enabled}: {answer:?}");
    }

    /// Removes toxic `name`.
    async fn remove(&self, name: &str) {
        let answer = self
            .web
            .send(
                hyper::Method::DELETE,
                &format!("{}/proxies/{}/toxics/{name}", self.api, self.name),
                &[],
                None,
            )
            .await
            .expect("toxiproxy answers");
        assert!(
            answer.status.is_success(),
            "remove toxic {name}: {answer:?}"
        );
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        // A blocking HTTP/1.0 DELETE (drop cannot await): the proxy's listener goes with it.
        use std::io::{Read as _, Write as _};
        let Some(authority) = self.api.strip_prefix("http://") else {
            return;
        };
        if let Ok(mut stream) = std::net::TcpStream::connect(authority) {
            let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
            let _ = write!(
                stream,
                "DELETE /proxies/{} HTTP/1.0\r\nHost: {authority}\r\n\r\n",
                self.name
            );
            let _ = stream.read_to_end(&mut Vec::new());
        }
    }
}

/// The scheduler's view of agent `loopback`.
async fn agent_view(clients: &Clients) -> api::Agent {
    clients
        .agents()
        .await
        .expect("ListAgents")
        .into_iter()
        .find(|a| a.name == "loopback")
        .expect("agent loopback is listed")
}

/// Waits until the scheduler's view of the agent satisfies `until`; returns that view.
async fn until_agent(
    clients: &Clients,
    what: &str,
    logs: impl Fn() -> String,
    until: impl Fn(&api::Agent) -> bool,
) -> api::Agent {
    let found = tokio::time::timeout(PATIENCE, async {
        loop {
            let view = agent_view(clients).await;
            if until(&view) {
                return view;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    match found {
        Ok(view) => view,
        Err(_) => panic!(
            "the agent never became {what}: {:?}\n{}",
            agent_view(clients).await,
            logs()
        ),
    }
}

/// Follows a live lesson until it settles: READY, or FAILED with a reason (a FAILED live lesson
/// without one is an error); within `limit` (its provision deadline and a margin).
async fn settles(clients: &Clients, id: &str, limit: Duration) -> anyhow::Result<api::LiveLesson> {
    let (_, lesson) = clients
        .follow(id, limit, |l| {
            matches!(
                l.status(),
                api::LiveLessonStatus::Ready | api::LiveLessonStatus::Failed
            )
        })
        .await?;
    if lesson.status() == api::LiveLessonStatus::Failed && lesson.failure_reason.is_empty() {
        anyhow::bail!("{id} FAILED without a reason");
    }
    Ok(lesson)
}

/// A test agent behind toxiproxy: with 2 s of latency each way a live lesson still reaches
/// READY and the agent stays READY; black-holed (the `timeout` toxic, both ways), the agent is
/// marked unavailable and then LOST with a reason, and a live lesson requested meanwhile settles
/// (READY once the agent is back, or FAILED with a reason) within its provision deadline;
/// reset (`reset_peer`), the agent is unavailable with a reason; each time the toxic is
/// removed, the agent comes back READY and takes live lessons again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_behind_latency_a_black_hole_and_resets() {
    const PROVISION: Duration = Duration::from_secs(60);
    let dir = tempfile::tempdir().expect("temp dir");
    let journal = dir.path().join("journal");
    let agent = start_agent(&dir, &["--boot-delay", "200ms"], &journal, None).await;
    let proxy = Proxy::create(agent.addr).await;
    let config = single_config(&format!("http://{}", proxy.listen))
        .with_provision_timeout(PROVISION)
        .with_reconciler(|r| {
            r.call_timeout = Some(secs(10));
            r.agent_grace = Some(secs(5));
        })
        .to_toml();
    let scheduler = Scheduler::start(dir.path(), &config)
        .await
        .expect("the scheduler starts");
    let clients = scheduler.clients.clone();
    let all_logs = || logs(&[&scheduler], &agent);
    let limit = PROVISION + Duration::from_secs(30);
    until_agent(&clients, "READY", all_logs, |a| {
        a.state() == api::AgentState::Ready
    })
    .await;

    // 1. 2 s of latency each way: slow, but READY, and the agent stays READY.
    proxy
        .add(
            "slow-up",
            "latency",
            "upstream",
            serde_json::json!({"latency": 2000}),
        )
        .await;
    proxy
        .add(
            "slow-down",
            "latency",
            "downstream",
            serde_json::json!({"latency": 2000}),
        )
        .await;
    let session = clients.session().await.unwrap();
    let slow = clients.request(&session, "hello-web", 0).await.unwrap();
    let started = Instant::now();
    let lesson = settles(&clients, &slow.id, limit)
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", all_logs()));
    assert_eq!(
        lesson.status(),
        api::LiveLessonStatus::Ready,
        "{}\n{}",
        lesson.failure_reason,
        all_logs()
    );
    let slow_ready = started.elapsed();
    assert_eq!(agent_view(&clients).await.state(), api::AgentState::Ready);
    proxy.remove("slow-up").await;
    proxy.remove("slow-down").await;

    // 2. Black-holed: nothing gets through either way, and no connection closes.
    proxy
        .add(
            "hole-up",
            "timeout",
            "upstream",
            serde_json::json!({"timeout": 0}),
        )
        .await;
    proxy
        .add(
            "hole-down",
            "timeout",
            "downstream",
            serde_json::json!({"timeout": 0}),
        )
        .await;
    let holed = Instant::now();
    let second = clients.session().await.unwrap();
    let during = clients.request(&second, "routing-basics", 0).await.unwrap();
    let lost = until_agent(&clients, "LOST with a reason", all_logs, |a| {
        a.state() == api::AgentState::Lost && !a.last_error.is_empty()
    })
    .await;
    let lost_after = holed.elapsed();
    proxy.remove("hole-up").await;
    proxy.remove("hole-down").await;
    until_agent(
        &clients,
        "READY again after the black hole",
        all_logs,
        |a| a.state() == api::AgentState::Ready,
    )
    .await;
    let back_after = holed.elapsed();
    let settled = settles(&clients, &during.id, limit)
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", all_logs()));
    // The live lesson READY before the black hole was moved off the lost agent; it settles too.
    let moved = settles(&clients, &slow.id, limit)
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", all_logs()));

    // 3. Resets: every connection is cut as soon as data flows.
    proxy
        .add(
            "reset-up",
            "reset_peer",
            "upstream",
            serde_json::json!({"timeout": 0}),
        )
        .await;
    let reset = until_agent(&clients, "unavailable with a reason", all_logs, |a| {
        a.state() != api::AgentState::Ready && !a.last_error.is_empty()
    })
    .await;
    let third = clients.session().await.unwrap();
    let after_reset = clients.request(&third, "netcat-toolbox", 0).await.unwrap();
    proxy.remove("reset-up").await;
    until_agent(&clients, "READY again after the resets", all_logs, |a| {
        a.state() == api::AgentState::Ready
    })
    .await;
    let last = settles(&clients, &after_reset.id, limit)
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", all_logs()));
    assert_eq!(
        last.status(),
        api::LiveLessonStatus::Ready,
        "{}\n{}",
        last.failure_reason,
        all_logs()
    );
    println!(
        "faults: agent behind toxiproxy: READY in {slow_ready:?} with 2 s latency each way; \
         black hole: LOST after {lost_after:?} ({:?}), READY again {back_after:?} after it began, \
         the lesson requested meanwhile {:?} {:?}, the one moved off the lost agent {:?}; \
         reset_peer: {:?} ({:?}), then the next lesson {:?}",
        lost.last_error,
        settled.status(),
        settled.failure_reason,
        moved.status(),
        reset.state(),
        reset.last_error,
        last.status()
    );
}

/// A Provision call cut off by the connection closing under it (the agent's answer is held back
/// by 2 s of latency, and the proxy drops every connection once the agent has created the
/// objects) is retried, not taken for the agent's final answer: tonic reports that cut as
/// UNKNOWN, a code the agent's own answer would make final (PROTOCOL.md [E3]: transport failures
/// are retried). Once the proxy is back, the live lesson is READY, created once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provision_cut_off_mid_call_is_retried_not_failed() {
    let dir = tempfile::tempdir().expect("temp dir");
    let journal = dir.path().join("journal");
    let agent = start_agent(&dir, &["--boot-delay", "200ms"], &journal, None).await;
    let proxy = Proxy::create(agent.addr).await;
    let config = single_config(&format!("http://{}", proxy.listen))
        .with_provision_timeout(secs(60))
        .with_reconciler(|r| {
            r.call_timeout = Some(secs(10));
            r.agent_grace = Some(secs(30));
        })
        .to_toml();
    let scheduler = Scheduler::start(dir.path(), &config)
        .await
        .expect("the scheduler starts");
    let clients = scheduler.clients.clone();
    let all_logs = || logs(&[&scheduler], &agent);
    until_agent(&clients, "READY", all_logs, |a| {
        a.state() == api::AgentState::Ready
    })
    .await;

    proxy
        .add(
            "slow-answers",
            "latency",
            "downstream",
            serde_json::json!({"latency": 2000}),
        )
        .await;
    let session = clients.session().await.unwrap();
    let lesson = clients.request(&session, "hello-web", 0).await.unwrap();
    // The agent got the Provision call and created the objects; its answer is still held back.
    tokio::time::timeout(PATIENCE, async {
        while !created(&journal).contains(&lesson.id) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("the agent never created {}\n{}", lesson.id, all_logs()));
    proxy.enable(false).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Back, answers still 2 s late (toxiproxy may time out removing a toxic whose links the
    // disabling cut): the retried Provision is slow but answered.
    proxy.enable(true).await;

    let settled = settles(&clients, &lesson.id, Duration::from_secs(90))
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", all_logs()));
    assert_eq!(
        settled.status(),
        api::LiveLessonStatus::Ready,
        "{}\n{}",
        settled.failure_reason,
        all_logs()
    );
    let log = scheduler.process.log_text();
    assert!(
        log.contains("agent call failed; retrying"),
        "the Provision call was not cut off mid-call (the test proves nothing):\n{}",
        all_logs()
    );
    let times = created(&journal)
        .iter()
        .filter(|id| **id == lesson.id)
        .count();
    assert_eq!(times, 1, "created {times} times\n{}", all_logs());
}

/// No worker starvation behind a slow agent: every call to agent `slow` takes 10 s
/// (toxiproxy latency on the way there) and twelve live lessons are placed on it, three times the
/// four workers. With `calls_per_agent = 2` it holds two workers; a live lesson requested after
/// them for agent `fast` is READY while no slow one is: its worker was free. (Had the slow calls
/// held every worker, the fast lesson would wait behind three rounds of 10 s calls, and the first
/// slow lessons would be READY before it.) Once the latency goes, every slow one is READY,
/// created once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_agent_holds_at_most_its_share_of_the_workers() {
    const SLOW: usize = 12;
    let dir = tempfile::tempdir().expect("temp dir");
    let slow_journal = dir.path().join("slow-journal");
    let slow = start_agent(&dir, &["--label", "speed=slow"], &slow_journal, None).await;
    let fast = start_agent(
        &dir,
        &["--label", "speed=fast"],
        &dir.path().join("fast-journal"),
        None,
    )
    .await;
    let proxy = Proxy::create(slow.addr).await;
    let config = SchedulerConfig::new("e2e-faults-share", &example_curriculum())
        .with_sessions_per_ip(0)
        .with_lessons_per_session(3)
        .with_retries(ms(500), ms(50), secs(1))
        .with_provision_timeout(secs(180))
        .with_reconciler(|r| {
            r.workers = Some(4);
            r.calls_per_agent = Some(2);
            r.call_timeout = Some(secs(60));
        })
        .with_agent(Agent::new("slow", format!("http://{}", proxy.listen)))
        .with_agent(Agent::new("fast", fast.url()))
        .to_toml();
    let scheduler = Scheduler::start(dir.path(), &config)
        .await
        .expect("the scheduler starts");
    let clients = scheduler.clients.clone();
    let all_logs = || {
        format!(
            "{}\n--- fast agent log ---\n{}",
            logs(&[&scheduler], &slow),
            fast.log_text()
        )
    };
    tokio::time::timeout(PATIENCE, async {
        loop {
            let agents = clients.agents().await.expect("ListAgents");
            if agents.len() == 2 && agents.iter().all(|a| a.state() == api::AgentState::Ready) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("the agents never became READY\n{}", all_logs()));

    proxy
        .add(
            "slow-calls",
            "latency",
            "upstream",
            serde_json::json!({"latency": 10_000}),
        )
        .await;
    let placed = |speed: &str| {
        Some(api::PlacementPreference {
            requires: HashMap::from([("speed".to_owned(), speed.to_owned())]),
            prefers: HashMap::new(),
        })
    };
    let mut slow_ids = Vec::new();
    let mut session = String::new();
    for i in 0..SLOW {
        if i % 3 == 0 {
            session = clients.session().await.unwrap();
        }
        let live = clients
            .request_placed(&session, "hello-web", 0, placed("slow"))
            .await
            .unwrap_or_else(|status| panic!("{status:?}\n{}", all_logs()));
        slow_ids.push(live.id);
    }
    let session = clients.session().await.unwrap();
    let quick = clients
        .request_placed(&session, "hello-web", 0, placed("fast"))
        .await
        .unwrap_or_else(|status| panic!("{status:?}\n{}", all_logs()));
    clients
        .ready(&quick.id)
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", all_logs()));
    for id in &slow_ids {
        let lesson = clients.get(id).await.unwrap();
        assert!(
            matches!(
                lesson.status(),
                api::LiveLessonStatus::Pending | api::LiveLessonStatus::Booting
            ),
            "slow live lesson {id} settled before the fast one was READY: {lesson:?}\n{}",
            all_logs()
        );
    }

    proxy.remove("slow-calls").await;
    for id in &slow_ids {
        let lesson = settles(&clients, id, Duration::from_secs(240))
            .await
            .unwrap_or_else(|err| panic!("{err:#}\n{}", all_logs()));
        assert_eq!(
            lesson.status(),
            api::LiveLessonStatus::Ready,
            "{}\n{}",
            lesson.failure_reason,
            all_logs()
        );
        let times = created(&slow_journal).iter().filter(|c| *c == id).count();
        assert_eq!(times, 1, "{id} created {times} times\n{}", all_logs());
    }
}

/// Rows of `sql` on database `url` (psql's unaligned output, one line a row, `|` between
/// columns).
pub(crate) fn query(url: &str, sql: &str) -> Vec<String> {
    let psql = ["/usr/lib/postgresql/15/bin/psql", "psql"]
        .into_iter()
        .find(|p| !p.starts_with('/') || Path::new(p).exists())
        .unwrap_or("psql");
    let output = std::process::Command::new(psql)
        .args([url, "-v", "ON_ERROR_STOP=1", "-At", "-c", sql])
        .output()
        .unwrap_or_else(|err| panic!("cannot run psql: {err}"));
    assert!(output.status.success(), "psql -c {sql:?}: {output:?}");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

/// Sends `signal` (`STOP`, `CONT`) to a process.
fn signal(process: &Process, signal: &str) {
    let pid = process.pid().expect("the process runs");
    let status = std::process::Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success(), "kill -{signal} {pid}: {status}");
}

/// A replica frozen (SIGSTOP) in the middle of its runs, past its leases, then resumed
/// (SIGCONT), writes nothing over what the replica that took its work over did. Replica A
/// reaches the agent through toxiproxy with 4 s of latency on the answers, so when the agent
/// has created the live lessons (at A's Provision calls: its journal says so) A's calls are
/// still in flight. A is frozen then; replica B starts, takes every live lesson over once A's
/// leases expire and brings them READY; then A resumes, its calls return BOOTING, and its
/// provision deadline (as short as the lease) passed while it was frozen: it would write
/// FAILED. Its writes are fenced by the lease: refused, and A drops the live lessons. Every live lesson stays READY (the event log shows no status after READY, and
/// no FAILED), each created once on the agent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_frozen_past_its_leases_writes_nothing_stale_when_it_resumes() {
    const LESSONS: usize = 6;
    let database = crate::postgres::TestDatabase::create();
    let dir = tempfile::tempdir().expect("temp dir");
    let journal = dir.path().join("journal");
    let agent = start_agent(&dir, &["--boot-delay", "2s"], &journal, None).await;
    let proxy = Proxy::create(agent.addr).await;
    let a_dir = dir.path().join("a");
    let b_dir = dir.path().join("b");
    std::fs::create_dir_all(&a_dir).unwrap();
    std::fs::create_dir_all(&b_dir).unwrap();
    // A's provision deadline is its lease's TTL: B cannot take a live lesson over (and bring it
    // READY) before A's lease expired, so A resumes past its deadline, with a FAILED to write.
    let a_config = replica_config(&format!("http://{}", proxy.listen))
        .with_provision_timeout(secs(2))
        .to_toml();
    let a = start_on(&a_dir, &database.url, &a_config).await;
    let tokens = a.clients.tokens.clone();
    let clients = a.clients.clone();
    until_agent(
        &clients,
        "READY",
        || a.process.log_text(),
        |agent| agent.state() == api::AgentState::Ready,
    )
    .await;
    proxy
        .add(
            "slow-answers",
            "latency",
            "downstream",
            serde_json::json!({"latency": 4000}),
        )
        .await;

    let mut ids = Vec::new();
    for _ in 0..LESSONS.div_ceil(3) {
        let session = clients.session().await.expect("a session");
        for slug in ["hello-web", "routing-basics", "netcat-toolbox"] {
            if ids.len() < LESSONS {
                ids.push(
                    clients
                        .request(&session, slug, 0)
                        .await
                        .expect("requested")
                        .id,
                );
            }
        }
    }
    // Every live lesson created on the agent at A's call, whose answer is still on its way.
    let expected: BTreeSet<String> = ids.iter().cloned().collect();
    tokio::time::timeout(PATIENCE, async {
        while created(&journal).into_iter().collect::<BTreeSet<_>>() != expected {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("not all created\n{}", logs(&[&a], &agent)));
    signal(&a.process, "STOP");
    let frozen = Instant::now();

    // B takes everything over once A's leases expire and brings it READY.
    let mut b = start_on(
        &b_dir,
        &database.url,
        &replica_config(&agent.url()).to_toml(),
    )
    .await;
    b.clients.tokens = tokens;
    let all_ready = |clients: Clients, ids: Vec<String>| async move {
        for id in &ids {
            let lesson = clients.get(id).await;
            if !matches!(lesson, Ok(l) if l.status() == api::LiveLessonStatus::Ready) {
                return false;
            }
        }
        true
    };
    let ready = tokio::time::timeout(PATIENCE, async {
        while !all_ready(b.clients.clone(), ids.clone()).await {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    if ready.is_err() {
        signal(&a.process, "CONT");
        panic!(
            "B did not bring everything READY\n{}",
            logs(&[&a, &b], &agent)
        );
    }
    let took_over = frozen.elapsed();
    signal(&a.process, "CONT");

    // A resumes: each of its runs ends in a refused write (or, had the fence failed, in a
    // stale status in the event log). Wait for one or the other for every live lesson.
    let stale = |url: &str| -> BTreeSet<String> {
        // Per live lesson, any event after its first READY is a regression, and FAILED too.
        let rows = query(
            url,
            "SELECT live_lesson_id, status FROM events WHERE live_lesson_id IS NOT NULL \
             ORDER BY seq",
        );
        let mut ready = BTreeSet::new();
        let mut stale = BTreeSet::new();
        for row in rows {
            let Some((id, status)) = row.split_once('|') else {
                continue;
            };
            if status == "FAILED" || (ready.contains(id) && status != "READY") {
                stale.insert(format!("{id} {status}"));
            }
            if status == "READY" {
                ready.insert(id.to_owned());
            }
        }
        stale
    };
    let decided = tokio::time::timeout(PATIENCE, async {
        loop {
            let log = a.process.log_text();
            let refused = ids
                .iter()
                .filter(|id| {
                    log.lines()
                        .any(|line| line.contains("write refused") && line.contains(id.as_str()))
                })
                .count();
            if refused == LESSONS || !stale(&database.url).is_empty() {
                return refused;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    let stale_now = stale(&database.url);
    assert!(
        stale_now.is_empty(),
        "the resumed replica wrote stale statuses: {stale_now:?}\n{}",
        logs(&[&a, &b], &agent)
    );
    let refused = decided.unwrap_or_else(|_| {
        panic!(
            "A's runs did not end; events: {:#?}\n{}",
            query(
                &database.url,
                "SELECT live_lesson_id, status, at, detail FROM events ORDER BY seq"
            ),
            logs(&[&a, &b], &agent)
        )
    });
    assert!(
        all_ready(b.clients.clone(), ids.clone()).await,
        "not all READY after A resumed\n{}",
        logs(&[&a, &b], &agent)
    );
    let creations = created(&journal);
    assert_eq!(
        creations.len(),
        LESSONS,
        "each live lesson created once: {creations:?}"
    );
    println!(
        "faults: SIGSTOP: B brought {LESSONS} live lessons READY {took_over:?} after A froze; \
         A resumed and {refused} of its writes were refused by the lease fence"
    );
}
