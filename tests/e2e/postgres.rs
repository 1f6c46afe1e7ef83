//! The store's backends end to end: a scheduler configured with `database = "postgres://..."`
//! takes live lessons through their whole lifecycle and keeps them across a `kill -9`; a
//! second scheduler on one SQLite file is refused with a clear error.
//!
//! The PostgreSQL server is the one `ANTIDOTE_TEST_POSTGRES` names (`tests/run` starts it), or
//! the one `tests/postgres/pg.sh start` starts when that is unset; never skipped. Each test
//! creates a database of its own (with Debian's `psql`) and drops it.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use antidote_proto::api::v1 as api;
use antidote_tests::config::{Agent, SchedulerConfig};
use antidote_tests::{
    Clients, Process, Scheduler, admin_config, example_curriculum, journal, server_url, with_token,
    workspace_bin,
};

use crate::{Env, Knobs, PATIENCE, start_agent};

/// The test server's maintenance URL.
pub(crate) fn server() -> &'static str {
    static SERVER: OnceLock<String> = OnceLock::new();
    SERVER.get_or_init(|| server_url("ANTIDOTE_TEST_POSTGRES", "postgres/pg.sh"))
}

/// Runs one SQL command on the test server's maintenance database.
pub(crate) fn psql(sql: &str) {
    let psql = ["/usr/lib/postgresql/15/bin/psql", "psql"]
        .into_iter()
        .find(|p| !p.starts_with('/') || Path::new(p).exists())
        .unwrap_or("psql");
    let status = std::process::Command::new(psql)
        .args([server(), "-v", "ON_ERROR_STOP=1", "-q", "-c", sql])
        .status()
        .unwrap_or_else(|err| panic!("cannot run psql: {err}"));
    assert!(status.success(), "psql -c {sql:?}: {status}");
}

/// A database of this test's own on the test server, dropped with the guard.
pub(crate) struct TestDatabase {
    pub(crate) name: String,
    pub(crate) url: String,
}

impl TestDatabase {
    pub(crate) fn create() -> TestDatabase {
        let name = format!("antidote_e2e_{}", uuid::Uuid::new_v4().simple());
        psql(&format!("CREATE DATABASE {name}"));
        let server = server();
        let root = server.rsplit_once('/').map_or(server, |(root, _)| root);
        TestDatabase {
            url: format!("{root}/{name}"),
            name,
        }
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        psql(&format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.name
        ));
    }
}

/// A PostgreSQL server of a test's own (for faults, or TLS): `tests/postgres/pg.sh` with a private
/// state directory and port. Stopped and deleted on drop.
pub(crate) struct PrivatePostgres {
    /// pg.sh's state directory (cluster, socket, log).
    state: PathBuf,
    /// Its TCP port on 127.0.0.1.
    pub(crate) port: u16,
    /// The maintenance database's URL, which the schedulers use too.
    pub(crate) url: String,
}

impl PrivatePostgres {
    pub(crate) async fn start() -> PrivatePostgres {
        PrivatePostgres::start_with(None).await
    }

    /// A server serving TLS with `tls`'s server.crt and server.key, and TCP clients only over
    /// TLS (pg.sh's ANTIDOTE_PG_TLS_DIR).
    pub(crate) async fn start_tls(tls: &Path) -> PrivatePostgres {
        PrivatePostgres::start_with(Some(tls)).await
    }

    async fn start_with(tls: Option<&Path>) -> PrivatePostgres {
        // The server is stopped and started again on this port.
        let port = antidote_tests::port_to_keep();
        let server = PrivatePostgres {
            state: PathBuf::from(format!(
                "/tmp/antidote-pg-faults-{}",
                uuid::Uuid::new_v4().simple()
            )),
            port,
            url: format!("postgres://postgres@127.0.0.1:{port}/postgres"),
        };
        server.pg_with(&["start"], tls).await;
        server
    }

    /// Runs `pg.sh ARGS` on this server; panics if it fails.
    pub(crate) async fn pg(&self, args: &[&str]) {
        self.pg_with(args, None).await
    }

    async fn pg_with(&self, args: &[&str], tls: Option<&Path>) {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("postgres/pg.sh");
        let mut command = tokio::process::Command::new(&script);
        command
            .args(args)
            .env("ANTIDOTE_PG_STATE", &self.state)
            .env("ANTIDOTE_PG_PORT", self.port.to_string())
            .stdin(std::process::Stdio::null());
        if let Some(tls) = tls {
            command.env("ANTIDOTE_PG_TLS_DIR", tls);
        }
        let output = command
            .output()
            .await
            .unwrap_or_else(|err| panic!("cannot run {}: {err}", script.display()));
        assert!(
            output.status.success(),
            "pg.sh {args:?}: {}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("postgres/pg.sh");
        let _ = std::process::Command::new(script)
            .arg("purge")
            .env("ANTIDOTE_PG_STATE", &self.state)
            .env("ANTIDOTE_PG_PORT", self.port.to_string())
            .stdin(std::process::Stdio::null())
            .output();
        // pg.sh's start lock beside the state directory.
        let mut lock = self.state.clone().into_os_string();
        lock.push(".lock");
        let _ = std::fs::remove_file(lock);
    }
}

/// Starts the scheduler binary with `config` and `database = "<url>"` in its configuration
/// file (as an operator writes it), like [`Scheduler::start`] does with an SQLite file.
pub(crate) async fn start_on(dir: &Path, url: &str, config: &str) -> Scheduler {
    let path = dir.join("antidote-postgres.toml");
    let full = format!(
        "listen = \"127.0.0.1:0\"\ndatabase = \"{url}\"\nhttp.listen = \"127.0.0.1:0\"\n{}{config}",
        admin_config()
    );
    std::fs::write(&path, full).expect("config written");
    let log = dir.join(format!("scheduler-{}.log", uuid::Uuid::new_v4()));
    let process = Process::spawn(
        &workspace_bin("scheduler-svc"),
        &[
            "serve".into(),
            "--config".into(),
            path.display().to_string(),
        ],
        log,
    )
    .await
    .expect("the scheduler starts on PostgreSQL");
    let admin = process.extra["admin"];
    let clients = Clients::connect(process.addr, admin)
        .await
        .expect("clients connect");
    Scheduler {
        process,
        clients,
        dir: dir.to_path_buf(),
    }
}

/// The quick configuration on the test agent at `agent`.
fn config(agent: &str) -> String {
    SchedulerConfig::quick("e2e-postgres", &example_curriculum())
        .with_agent(Agent::new("loopback", agent))
        .to_toml()
}

#[tokio::test]
async fn a_lesson_lifecycle_on_postgres_survives_kill_9() {
    let database = TestDatabase::create();
    let dir = tempfile::tempdir().expect("temp dir");
    let journal = dir.path().join("journal");
    let agent = start_agent(&dir, &["--boot-delay", "1500ms"], &journal, None).await;
    let config = config(&agent.url());
    let mut scheduler = start_on(dir.path(), &database.url, &config).await;
    let logs = |s: &Scheduler| {
        format!(
            "--- scheduler log ---\n{}\n--- agent log ---\n{}",
            s.process.log_text(),
            agent.log_text()
        )
    };
    let c = scheduler.clients.clone();
    let session = c.session().await.unwrap();
    let first = c.request(&session, "hello-web", 0).await.unwrap();
    let ready = c
        .ready(&first.id)
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", logs(&scheduler)));
    // A second one is still booting on the agent when the scheduler dies.
    let second = c.request(&session, "routing-basics", 0).await.unwrap();
    c.follow(&second.id, PATIENCE, |l| {
        l.status() == api::LiveLessonStatus::Booting
    })
    .await
    .unwrap_or_else(|err| panic!("{err:#}\n{}", logs(&scheduler)));
    scheduler.process.kill9().await;

    scheduler = start_on(dir.path(), &database.url, &config).await;
    let tokens = c.tokens.clone();
    let mut c = scheduler.clients.clone();
    c.tokens = tokens;
    // The ready one is still READY, with the same endpoints; the booting one resumes.
    let again = c
        .get(&first.id)
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", logs(&scheduler)));
    assert_eq!(again.status(), api::LiveLessonStatus::Ready);
    assert_eq!(again.endpoints, ready.endpoints);
    c.ready(&second.id)
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", logs(&scheduler)));
    // Asking again meets the same live lesson: the unique key held across the restart.
    let asked = c.request(&session, "hello-web", 0).await.unwrap();
    assert_eq!(asked.id, first.id);
    let mut created = journal::created(&journal);
    created.sort();
    let mut expected = vec![first.id.clone(), second.id.clone()];
    expected.sort();
    assert_eq!(
        created, expected,
        "each live lesson was created exactly once"
    );

    for id in [&first.id, &second.id] {
        c.delete(id, PATIENCE)
            .await
            .unwrap_or_else(|err| panic!("{err:#}\n{}", logs(&scheduler)));
    }
    // Removal is recorded too: after another restart the session is there, without them.
    scheduler.process.terminate().await.unwrap();
    let scheduler = start_on(dir.path(), &database.url, &config).await;
    let mut c2 = scheduler.clients.clone();
    c2.tokens = c.tokens.clone();
    let listed = c2
        .lessons
        .clone()
        .list_live_lessons(with_token(
            api::ListLiveLessonsRequest {
                session_id: session.clone(),
            },
            c2.tokens.of_session(&session),
        ))
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", logs(&scheduler)))
        .into_inner();
    assert!(listed.live_lessons.is_empty(), "{listed:?}");
}

#[tokio::test]
async fn a_second_scheduler_on_one_sqlite_file_is_refused() {
    let mut env = Env::start(&[], Knobs::default()).await;
    // The same configuration file, hence the same SQLite file: the second process exits with
    // the reason.
    let second = tokio::process::Command::new(workspace_bin("scheduler-svc"))
        .arg("serve")
        .arg("--config")
        .arg(env.dir.path().join("antidote.toml"))
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(PATIENCE, second)
        .await
        .expect("the second scheduler exits")
        .expect("the second scheduler runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("is in use by another scheduler (pid "),
        "{stderr}"
    );
    // The first one is unharmed, and once it is gone the file is free.
    let c = env.scheduler.clients.clone();
    let session = c.session().await.unwrap();
    let lesson = c.request(&session, "hello-web", 0).await.unwrap();
    c.ready(&lesson.id)
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", env.logs()));
    env.scheduler.process.terminate().await.unwrap();
    env.scheduler = Scheduler::start(env.dir.path(), &env.config)
        .await
        .expect("the file is free once its scheduler stopped");
}

/// Runs `scheduler-svc serve` on `url` and expects it to refuse to start: its exit's stderr.
async fn refused_start(dir: &Path, url: &str, agent: &str) -> String {
    let path = dir.join("antidote-refused.toml");
    std::fs::write(
        &path,
        format!(
            "listen = \"127.0.0.1:0\"\ndatabase = \"{url}\"\n{}",
            config(agent)
        ),
    )
    .unwrap();
    let run = tokio::process::Command::new(workspace_bin("scheduler-svc"))
        .arg("serve")
        .arg("--config")
        .arg(&path)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(PATIENCE, run)
        .await
        .unwrap_or_else(|_| panic!("the scheduler on {url} neither started nor exited"))
        .expect("the scheduler runs");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(!output.status.success(), "started on {url}: {stderr}");
    stderr
}

/// PostgreSQL on another machine is reached over TLS that verifies the server. The test's own
/// server takes TCP clients over TLS only, with a certificate from a CA the test makes: a
/// scheduler whose URL says `sslmode=verify-full` and names that CA runs a lesson on it over
/// TLS (pg_stat_ssl says so); plaintext is refused by the server, and a CA that did not sign
/// the server's certificate is refused by the scheduler, both at start and naming why.
#[tokio::test]
async fn postgresql_over_tls_is_verified_and_plaintext_refused() {
    use antidote_tests::pki::{Ca, Validity};
    let dir = tempfile::tempdir().unwrap();
    let tls = dir.path().join("pg-tls");
    std::fs::create_dir_all(&tls).unwrap();
    let ca = Ca::new("antidote-test-postgres-ca");
    ca.issue(&["localhost", "127.0.0.1"], Validity::Until(2080, 1, 1))
        .write(&tls.join("server.crt"), &tls.join("server.key"));
    let ca_file = dir.path().join("ca.pem");
    ca.write(&ca_file);
    let stranger = dir.path().join("stranger.pem");
    Ca::new("stranger").write(&stranger);
    let postgres = PrivatePostgres::start_tls(&tls).await;
    let journal = dir.path().join("journal");
    let agent = start_agent(&dir, &[], &journal, None).await;
    let base = format!("postgres://postgres@localhost:{}/postgres", postgres.port);

    let stderr = refused_start(dir.path(), &format!("{base}?sslmode=disable"), &agent.url()).await;
    assert!(
        stderr.contains("no encryption") && stderr.contains("pg_hba.conf"),
        "plaintext: {stderr}"
    );
    let stderr = refused_start(
        dir.path(),
        &format!(
            "{base}?sslmode=verify-full&sslrootcert={}",
            stranger.display()
        ),
        &agent.url(),
    )
    .await;
    assert!(
        stderr.contains("certificate") && stderr.contains("UnknownIssuer"),
        "another CA: {stderr}"
    );

    let url = format!(
        "{base}?sslmode=verify-full&sslrootcert={}",
        ca_file.display()
    );
    let scheduler = start_on(dir.path(), &url, &config(&agent.url())).await;
    let c = &scheduler.clients;
    let lesson = c
        .request(&c.session().await.unwrap(), "hello-web", 0)
        .await
        .unwrap();
    c.ready(&lesson.id)
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", scheduler.process.log_text()));
    let connections = crate::faults::query(
        &format!(
            "{base}?sslmode=verify-full&sslrootcert={}",
            ca_file.display()
        ),
        "SELECT s.ssl FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
         WHERE a.application_name = 'antidote-scheduler'",
    );
    assert!(
        !connections.is_empty() && connections.iter().all(|ssl| ssl == "t"),
        "the scheduler's connections and whether each is TLS: {connections:?}"
    );
}
