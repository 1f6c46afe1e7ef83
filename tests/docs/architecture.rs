//! ARCHITECTURE.md's invariants that no compiler checks, checked on the sources.

use std::path::Path;

/// The code of a Rust file, without its comments (line comments and doc comments).
fn code(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) if !l[..i].contains('"') => &l[..i],
            _ => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `(file, line)` of every use of `needle` in the code of the files under `dir`.
fn uses(dir: &Path, needle: &str) -> Vec<String> {
    let mut files = Vec::new();
    rust_files(dir, &mut files);
    files.sort();
    let mut found = Vec::new();
    for file in files {
        for (n, line) in code(&file).lines().enumerate() {
            if line.contains(needle) {
                found.push(format!("{}:{}: {}", file.display(), n + 1, line.trim()));
            }
        }
    }
    found
}

/// The scheduler's layers import one way: `api` → `drive` → `agents` → `store`; a layer never
/// names one before it.
#[test]
fn scheduler_layers_import_one_way() {
    let src = super::repo().join("scheduler-svc/src");
    let layers = ["api", "drive", "agents", "store"];
    let mut wrong = Vec::new();
    for (i, layer) in layers.iter().enumerate() {
        for before in &layers[..i] {
            wrong.extend(uses(&src.join(layer), &format!("crate::{before}")));
        }
    }
    assert!(
        wrong.is_empty(),
        "a layer names one before it:\n{}",
        wrong.join("\n")
    );
}

/// The generated `antidote.agent.v1` types stay in the scheduler's `agents/`: every other part
/// speaks domain values.
#[test]
fn agent_wire_types_stay_in_agents() {
    let src = super::repo().join("scheduler-svc/src");
    let mut wrong = Vec::new();
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        if path.file_name().is_some_and(|n| n == "agents") {
            continue;
        }
        if path.is_dir() {
            wrong.extend(uses(&path, "antidote_proto::agent"));
        } else if path.extension().is_some_and(|e| e == "rs") {
            for (n, line) in code(&path).lines().enumerate() {
                if line.contains("antidote_proto::agent") {
                    wrong.push(format!("{}:{}: {}", path.display(), n + 1, line.trim()));
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "agent.v1 types outside agents/:\n{}",
        wrong.join("\n")
    );
}

/// Every member takes the workspace's lints, among them `unsafe_code = "forbid"`.
#[test]
fn every_crate_takes_the_workspace_lints() {
    let repo = super::repo();
    let root = std::fs::read_to_string(repo.join("Cargo.toml")).unwrap();
    let lints = root
        .split("[workspace.lints.rust]")
        .nth(1)
        .expect("Cargo.toml has [workspace.lints.rust]");
    assert!(
        lints
            .lines()
            .take_while(|l| !l.starts_with('['))
            .any(|l| l.replace(' ', "") == "unsafe_code=\"forbid\""),
        "[workspace.lints.rust] forbids unsafe_code"
    );
    let members = root
        .split("members = [")
        .nth(1)
        .and_then(|m| m.split(']').next())
        .expect("Cargo.toml lists its members");
    let mut checked = 0;
    for member in members
        .split(',')
        .map(|m| m.trim().trim_matches('"'))
        .filter(|m| !m.is_empty())
    {
        let manifest = std::fs::read_to_string(repo.join(member).join("Cargo.toml")).unwrap();
        let lints = manifest.split("[lints]").nth(1).unwrap_or("");
        assert!(
            lints
                .lines()
                .take_while(|l| !l.starts_with('['))
                .any(|l| l.replace(' ', "") == "workspace=true"),
            "{member}/Cargo.toml takes the workspace's lints ([lints] workspace = true)"
        );
        checked += 1;
    }
    assert!(checked >= 8, "only {checked} members found");
}

/// The scheduler builds on the wire crate and `antidote-net`, never on the agent SDK, so a
/// change to the scheduler changes nothing third-party agents build on.
#[test]
fn the_scheduler_does_not_depend_on_the_sdk() {
    let manifest = std::fs::read_to_string(super::repo().join("scheduler-svc/Cargo.toml")).unwrap();
    assert!(
        !manifest
            .lines()
            .any(|l| l.trim_start().starts_with("antidote-sdk")),
        "scheduler-svc/Cargo.toml names antidote-sdk"
    );
}

/// The `[dependencies]` of a manifest: (name, whether optional).
fn dependencies(manifest: &str) -> Vec<(String, bool)> {
    let Some(section) = manifest.split("\n[dependencies]\n").nth(1) else {
        return Vec::new();
    };
    section
        .lines()
        .take_while(|l| !l.starts_with('['))
        .filter(|l| !l.trim_start().starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let name = l.split(['=', '.']).next()?.trim().to_owned();
            Some((name, l.contains("optional = true")))
        })
        .collect()
}

/// The wire crate is prost and tonic alone; the SSH, WebSocket and JWT code agents and the
/// scheduler do not all need is optional, behind the `entrypoint` features.
#[test]
fn the_wire_net_and_sdk_crates_pull_only_what_every_user_needs() {
    let repo = super::repo();
    let read = |p: &str| std::fs::read_to_string(repo.join(p)).unwrap();
    let wire: Vec<String> = dependencies(&read("proto/Cargo.toml"))
        .into_iter()
        .map(|d| d.0)
        .collect();
    assert_eq!(
        wire,
        ["prost", "prost-types", "tonic", "tonic-prost"],
        "proto/Cargo.toml"
    );
    for (manifest, heavy) in [
        (
            "proto/net/Cargo.toml",
            &[
                "russh",
                "tokio-tungstenite",
                "jsonwebtoken",
                "ed25519-dalek",
            ][..],
        ),
        (
            "proto/sdk/Cargo.toml",
            &[
                "russh",
                "tokio-tungstenite",
                "jsonwebtoken",
                "ed25519-dalek",
                "hyper",
            ][..],
        ),
    ] {
        for (name, optional) in dependencies(&read(manifest)) {
            assert!(
                !heavy.contains(&name.as_str()) || optional,
                "{manifest}: `{name}` must be optional (behind a feature)"
            );
        }
    }
}
