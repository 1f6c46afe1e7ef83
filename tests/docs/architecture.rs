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

/// The module path (`drive::reconcile::waiter`) of each Rust file under `src`.
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let relative = file.strip_prefix(src).unwrap().with_extension("");
    let mut path: Vec<String> = relative
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(
        path.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        path.pop();
    }
    path
}

/// The crate-internal paths a file names (`use` trees and every path in its items), each
/// resolved to a full path from the crate root; inline modules (`mod tests`) move `super`.
struct Named {
    module: Vec<String>,
    found: Vec<Vec<String>>,
}

impl Named {
    fn resolve(&mut self, segments: &[String]) {
        let mut at = self.module.clone();
        let rest = match segments.first().map(String::as_str) {
            Some("crate") => {
                at.clear();
                &segments[1..]
            }
            Some("super") => {
                let supers = segments.iter().take_while(|s| *s == "super").count();
                at.truncate(at.len().saturating_sub(supers));
                &segments[supers..]
            }
            Some("self") => &segments[1..],
            _ => return,
        };
        at.extend(rest.iter().cloned());
        self.found.push(at);
    }

    fn use_tree(&mut self, tree: &syn::UseTree, prefix: &mut Vec<String>) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                self.use_tree(&p.tree, prefix);
                prefix.pop();
            }
            syn::UseTree::Name(n) => {
                prefix.push(n.ident.to_string());
                self.resolve(&prefix.clone());
                prefix.pop();
            }
            syn::UseTree::Rename(r) => {
                prefix.push(r.ident.to_string());
                self.resolve(&prefix.clone());
                prefix.pop();
            }
            syn::UseTree::Glob(_) => self.resolve(&prefix.clone()),
            syn::UseTree::Group(g) => {
                for tree in &g.items {
                    self.use_tree(tree, prefix);
                }
            }
        }
    }
}

impl<'ast> syn::visit::Visit<'ast> for Named {
    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        self.use_tree(&item.tree, &mut Vec::new());
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        let segments: Vec<String> = path.segments.iter().map(|s| s.ident.to_string()).collect();
        self.resolve(&segments);
        syn::visit::visit_path(self, path);
    }

    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        self.module.push(item.ident.to_string());
        syn::visit::visit_item_mod(self, item);
        self.module.pop();
    }
}

/// The cycles among sibling modules of the crate whose sources are `src`: for every module,
/// its children `a` → `b` when code in `a` (or below it) names `b` (or below it). A module
/// naming its own ancestors is not counted (`super::Type` from a child is how Rust nests).
fn module_cycles(src: &Path) -> Vec<String> {
    use std::collections::{BTreeMap, BTreeSet};
    let mut files = Vec::new();
    rust_files(src, &mut files);
    files.sort();
    let modules: BTreeSet<Vec<String>> = files.iter().map(|f| module_of(src, f)).collect();
    // parent → child → (sibling child → a file naming it)
    let mut edges: BTreeMap<Vec<String>, BTreeMap<String, BTreeMap<String, String>>> =
        BTreeMap::new();
    for file in &files {
        let module = module_of(src, file);
        let text = std::fs::read_to_string(file).unwrap();
        let parsed = syn::parse_file(&text)
            .unwrap_or_else(|e| panic!("{} does not parse: {e}", file.display()));
        let mut named = Named {
            module: module.clone(),
            found: Vec::new(),
        };
        syn::visit::Visit::visit_file(&mut named, &parsed);
        for target in named.found {
            let common = module
                .iter()
                .zip(&target)
                .take_while(|(a, b)| a == b)
                .count();
            if common >= module.len() || common >= target.len() {
                continue; // itself, below itself, or an ancestor
            }
            let parent = module[..common].to_vec();
            let to = &target[common];
            let mut child = parent.clone();
            child.push(to.clone());
            if !modules.contains(&child) {
                continue; // an item of the parent, not a module
            }
            edges
                .entry(parent)
                .or_default()
                .entry(module[common].clone())
                .or_default()
                .entry(to.clone())
                .or_insert_with(|| file.strip_prefix(src).unwrap().display().to_string());
        }
    }
    let mut cycles = Vec::new();
    for (parent, graph) in &edges {
        // Two siblings that reach each other, by a walk over the graph from each.
        let reach = |from: &str| {
            let mut seen = BTreeSet::new();
            let mut todo = vec![from.to_owned()];
            while let Some(at) = todo.pop() {
                for next in graph.get(&at).into_iter().flat_map(|m| m.keys()) {
                    if seen.insert(next.clone()) {
                        todo.push(next.clone());
                    }
                }
            }
            seen
        };
        for (a, names) in graph {
            for b in names.keys() {
                if a < b && reach(b).contains(a) {
                    let at = if parent.is_empty() {
                        "crate".to_owned()
                    } else {
                        parent.join("::")
                    };
                    cycles.push(format!(
                        "{at}: `{a}` names `{b}` ({}) and `{b}` reaches `{a}` back",
                        names[b]
                    ));
                }
            }
        }
    }
    cycles
}

/// No module cycle in any crate: sibling modules depend one way, so each can be read (and
/// unit-tested) knowing only those below it.
#[test]
fn no_module_names_a_sibling_that_names_it_back() {
    let repo = super::repo();
    let mut cycles = Vec::new();
    for src in [
        "scheduler-svc/src",
        "agent-docker/src",
        "agent-k8s/src",
        "proto/src",
        "proto/net/src",
        "proto/sdk/src",
        "proto/conformance/src",
        "tests/src",
    ] {
        cycles.extend(
            module_cycles(&repo.join(src))
                .into_iter()
                .map(|c| format!("{src}: {c}")),
        );
    }
    assert!(cycles.is_empty(), "module cycles:\n{}", cycles.join("\n"));
}
