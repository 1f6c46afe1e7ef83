//! The documentation's own tests: the book's generated reference pages match what the code
//! defines now, no tracked file carries development history, and README's two commands are the
//! ones CI runs.
//!
//! A reference page that differs from what its generator makes fails its test with a diff
//! hint; `ANTIDOTE_BLESS=1 cargo test -p antidote-tests --test docs` writes every page again.
//! The flags page runs the workspace's binaries: build them first
//! (`cargo build --workspace --bins`; `tests/run` does).

mod architecture;
mod config;
mod flags;
mod history;
mod metrics;
mod proto;
mod readme;

use std::path::{Path, PathBuf};

/// The repository's root.
fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ is in the repository")
        .to_path_buf()
}

/// Compares `docs/src/reference/<page>` with `generated`; with `ANTIDOTE_BLESS=1` writes it.
fn check_page(page: &str, generated: &str) {
    let path = repo().join("docs/src/reference").join(page);
    if std::env::var_os("ANTIDOTE_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(&path, generated).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        return;
    }
    let written = std::fs::read_to_string(&path).unwrap_or_default();
    if written != generated {
        let first = written
            .lines()
            .zip(generated.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| written.lines().count().min(generated.lines().count()));
        panic!(
            "docs/src/reference/{page} is stale: from line {} it differs from what the code \
             defines now\n  page:      {:?}\n  generated: {:?}\nrun `ANTIDOTE_BLESS=1 cargo test \
             -p antidote-tests --test docs` and commit the page",
            first + 1,
            written.lines().nth(first).unwrap_or("<end of file>"),
            generated.lines().nth(first).unwrap_or("<end of file>"),
        );
    }
}

#[test]
fn configuration_reference_is_current() {
    let source = std::fs::read_to_string(repo().join("scheduler-svc/src/settings.rs")).unwrap();
    check_page("configuration.md", &config::render(&source));
}

#[test]
fn flags_reference_is_current() {
    let exe = std::env::current_exe().unwrap();
    let mut dir = exe.parent().unwrap().to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    // A checkout whose binaries were never built (a plain `cargo test` on a fresh clone) has
    // nothing to ask for its help: said in one line, as the store's PostgreSQL variants do.
    // tests/run builds every binary before it runs this; one built and another not is a failure.
    let bins = flags::binaries(&repo());
    if bins.iter().all(|(_, bin)| !dir.join(bin).exists()) {
        eprintln!(
            "flags_reference_is_current: skipped: no binary in {} (cargo build --workspace --bins)",
            dir.display()
        );
        return;
    }
    check_page("flags.md", &flags::render(&repo(), &dir));
}

#[test]
fn error_reasons_reference_is_current() {
    check_page("errors.md", &proto::errors());
}

#[test]
fn services_reference_is_current() {
    check_page("services.md", &proto::services());
}

#[test]
fn metrics_reference_is_current() {
    check_page("metrics.md", &metrics::render(&repo()));
}
