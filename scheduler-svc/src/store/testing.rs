//! Both backends for the store's tests: [`on_both!`] turns each test into `NAME::sqlite` and
//! `NAME::postgres`. The PostgreSQL one runs on the server `ANTIDOTE_TEST_POSTGRES` names
//! (`tests/run` always names one; `tests/postgres/pg.sh start` or `env` prints the line); when
//! it is unset the PostgreSQL variants pass without running and one line on stderr says they
//! were skipped, so the unit tests need no database server. Each test gets a database of its
//! own, dropped afterwards.

use std::io::Write as _;
use std::sync::{Once, OnceLock};

use sqlx::{Connection as _, Executor as _, PgConnection};

use super::Database;

/// A database for one test, removed when dropped.
pub(crate) struct Scratch {
    /// What to open.
    pub(crate) database: Database,
    /// The SQLite file's directory.
    _dir: Option<tempfile::TempDir>,
    /// The PostgreSQL server's maintenance URL and the database created on it.
    created: Option<(String, String)>,
}

impl Scratch {
    /// A fresh SQLite file.
    pub(crate) fn sqlite() -> Scratch {
        let dir = tempfile::tempdir().expect("a temporary directory");
        Scratch {
            database: Database::Sqlite(dir.path().join("t.db")),
            _dir: Some(dir),
            created: None,
        }
    }

    /// A fresh database on the test PostgreSQL server, or `None` (said once on stderr) when
    /// `ANTIDOTE_TEST_POSTGRES` names none.
    pub(crate) async fn postgres_if_given() -> Option<Scratch> {
        let Some(server) = server() else {
            say_skipped();
            return None;
        };
        let name = format!("antidote_test_{}", uuid::Uuid::new_v4().simple());
        let mut admin = PgConnection::connect(server)
            .await
            .unwrap_or_else(|err| panic!("cannot connect to the test PostgreSQL {server}: {err}"));
        admin
            .execute(format!("CREATE DATABASE {name}").as_str())
            .await
            .unwrap_or_else(|err| panic!("cannot create database {name}: {err}"));
        let _ = admin.close().await;
        Some(Scratch {
            database: Database::Postgres(with_database(server, &name)),
            _dir: None,
            created: Some((server.to_owned(), name)),
        })
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let Some((server, name)) = self.created.take() else {
            return;
        };
        // Drop may run inside a runtime: a thread of its own with a runtime of its own.
        let dropped = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime");
            runtime.block_on(async {
                let mut admin = PgConnection::connect(&server).await?;
                admin
                    .execute(format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)").as_str())
                    .await?;
                admin.close().await
            })
        })
        .join();
        if let Ok(Err(err)) = dropped {
            eprintln!("cannot drop a test database: {err}");
        }
    }
}

/// `url` with its database replaced by `name`.
pub(crate) fn with_database(url: &str, name: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, format!("?{query}")),
        None => (url, String::new()),
    };
    let scheme_end = base.find("://").map_or(0, |at| at + 3);
    let host_and_path = &base[scheme_end..];
    let root = match host_and_path.find('/') {
        Some(slash) => &base[..scheme_end + slash],
        None => base,
    };
    format!("{root}/{name}{query}")
}

/// The variable naming the test PostgreSQL server (its maintenance URL).
const POSTGRES_VAR: &str = "ANTIDOTE_TEST_POSTGRES";

/// The test server's maintenance URL (its `postgres` database), if `ANTIDOTE_TEST_POSTGRES`
/// gives one. Nothing is started or installed here: a contributor's `cargo test` needs no root
/// and no server, and `tests/run` starts one and names it.
fn server() -> Option<&'static str> {
    static SERVER: OnceLock<Option<String>> = OnceLock::new();
    SERVER
        .get_or_init(|| {
            std::env::var(POSTGRES_VAR)
                .ok()
                .filter(|url| !url.is_empty())
        })
        .as_deref()
}

/// One line on stderr, once per test binary, that the PostgreSQL variants did not run. Written
/// to the stream itself, past the test harness's capture, so a passing run shows it too.
fn say_skipped() {
    static SAID: Once = Once::new();
    SAID.call_once(|| {
        let _ = writeln!(
            std::io::stderr(),
            "store tests: {POSTGRES_VAR} is unset, so the PostgreSQL variants are skipped \
             (`tests/postgres/pg.sh start` starts a server and prints the line to export)"
        );
    });
}

/// Defines each test twice, as `NAME::sqlite` and `NAME::postgres`: the body gets the database
/// (to reopen it) and a store opened on it.
///
/// ```ignore
/// on_both! {
///     async fn name(database, store) { ... }
/// }
/// ```
macro_rules! on_both {
    ($(async fn $name:ident($database:ident, $store:ident) $body:block)*) => {$(
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            #[allow(unused_variables)]
            async fn body(
                $database: $crate::store::Database,
                $store: $crate::store::Store,
            ) $body

            async fn run(scratch: $crate::store::testing::Scratch) {
                let store = $crate::store::Store::open(&scratch.database).await.unwrap();
                body(scratch.database.clone(), store).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn sqlite() {
                run($crate::store::testing::Scratch::sqlite()).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn postgres() {
                if let Some(scratch) = $crate::store::testing::Scratch::postgres_if_given().await {
                    run(scratch).await;
                }
            }
        }
    )*};
}

pub(crate) use on_both;

#[cfg(test)]
mod tests {
    use super::with_database;

    #[test]
    fn urls_get_the_test_database() {
        for (url, expect) in [
            (
                "postgres://postgres@127.0.0.1:54329/postgres",
                "postgres://postgres@127.0.0.1:54329/t1",
            ),
            (
                "postgres://u:p@h/postgres?sslmode=disable",
                "postgres://u:p@h/t1?sslmode=disable",
            ),
            ("postgresql://h:5432", "postgresql://h:5432/t1"),
        ] {
            assert_eq!(with_database(url, "t1"), expect, "{url}");
        }
    }
}
