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
use antidote_tests::{
    Clients, Process, Scheduler, admin_config, example_curriculum, with_token, workspace_bin,
};

use crate::{Env, Knobs, PATIENCE, start_agent};

/// The test server's maintenance URL.
pub(crate) fn server() -> &'static str {
    static SERVER: OnceLock<String> = OnceLock::new();
    SERVER.get_or_init(|| {
        if let Ok(url) = std::env::var("ANTIDOTE_TEST_POSTGRES")
            && !url.is_empty()
        {
            return url;
        }
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("postgres/pg.sh");
        let output = std::process::Command::new(&script)
            .arg("start")
            .stderr(std::process::Stdio::inherit())
            .output()
            .unwrap_or_else(|err| panic!("cannot run {}: {err}", script.display()));
        let stdout = String::from_utf8_lossy(&output.stdout);
        match stdout
            .lines()
            .last()
            .and_then(|line| line.strip_prefix("ANTIDOTE_TEST_POSTGRES="))
        {
            Some(url) if output.status.success() => url.to_owned(),
            _ => panic!("ANTIDOTE_TEST_POSTGRES is unset and pg.sh start failed: {stdout}"),
        }
    })
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

fn config(agent: &str) -> String {
    format!(
        r#"instance_id = "e2e-postgres"
curriculum = "{curriculum}"
tier = "local"
[reaper]
interval = "200ms"
orphan_interval = "200ms"
orphan_grace = "500ms"
[reconciler]
poll_interval = "500ms"
backoff_initial = "50ms"
backoff_max = "1s"
provision_timeout = "2m"
[[agents]]
name = "loopback"
address = "{agent}"
"#,
        curriculum = example_curriculum().display(),
    )
}

/// The agent's creation journal: the live-lesson id of each creation.
fn creations(journal: &PathBuf) -> Vec<String> {
    std::fs::read_to_string(journal)
        .unwrap_or_default()
        .lines()
        .map(|line| line.split(' ').nth(1).unwrap_or_default().to_owned())
        .collect()
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
        .lessons
        .clone()
        .get_live_lesson(with_token(
            api::GetLiveLessonRequest {
                id: first.id.clone(),
            },
            c.tokens.of_lesson(&first.id),
        ))
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", logs(&scheduler)))
        .into_inner();
    assert_eq!(again.status(), api::LiveLessonStatus::Ready);
    assert_eq!(again.endpoints, ready.endpoints);
    c.ready(&second.id)
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", logs(&scheduler)));
    // Asking again meets the same live lesson: the unique key held across the restart.
    let asked = c.request(&session, "hello-web", 0).await.unwrap();
    assert_eq!(asked.id, first.id);
    let mut created = creations(&journal);
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
