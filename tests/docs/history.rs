//! No tracked file speaks of how the work was organised: numbered "stops", issue numbers,
//! dated diary entries, what was "tried and left out", citations of a design note outside the
//! repository. The product's files describe the product as it is; history belongs in git log.

use std::process::Command;

/// The words, as case-insensitive regular expressions, each with why it is history.
const WORDS: &[(&str, &str)] = &[
    (r"\bstop [0-9]+([^0-9>]|$)", "a numbered stop of the work"),
    (r"\bstop's\b", "a stop of the work"),
    (
        r"\b(first|second|third|fourth|fifth|sixth) stop\b",
        "a stop of the work",
    ),
    (r"\bissues? [0-9]+", "an issue number"),
    (r"\bissue [0-9]+'s\b", "an issue number"),
    (r"tried and left out", "what was tried, not what is"),
    (r"tried and taken back", "what was tried, not what is"),
    (r"\btaken back\b", "what was tried, not what is"),
    (r"\bthen \(20[0-9]{2}-", "a dated diary entry"),
    (r"\bthat night\b", "a diary's time"),
    (r"closing note", "an issue's closing note"),
    (r"DESIGN\.md", "a design note outside the repository"),
    (r"\bcommit [0-9a-f]{7,40}\b", "a commit hash in prose"),
    (
        r"\b[0-9a-f]{7}'s (scheduler|code|build)\b",
        "a commit hash in prose",
    ),
];

/// Files whose every byte is fixed once released, with why: a migration's checksum (sqlx: the
/// SHA-384 of the whole file, comments included) is kept in every database it ran on, and an
/// edit makes those databases refuse to start.
const FROZEN: &[(&str, &str)] = &[
    (
        "scheduler-svc/migrations/",
        "sqlx checksums every byte of an applied migration",
    ),
    (
        "scheduler-svc/migrations-postgres/",
        "sqlx checksums every byte of an applied migration",
    ),
];

/// This file names the words it looks for.
const SELF: &str = "tests/docs/history.rs";

#[test]
fn no_tracked_file_carries_development_history() {
    let repo = super::repo();
    let out = Command::new("git")
        .args(["ls-files", "-z"])
        .current_dir(&repo)
        .output()
        .expect("git ls-files runs");
    assert!(
        out.status.success(),
        "git ls-files: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let words: Vec<(regex::Regex, &str)> = WORDS
        .iter()
        .map(|(w, why)| {
            (
                regex::RegexBuilder::new(w)
                    .case_insensitive(true)
                    .build()
                    .expect("a valid pattern"),
                *why,
            )
        })
        .collect();
    let mut found = Vec::new();
    let mut checked = 0;
    for path in out.stdout.split(|b| *b == 0).filter(|p| !p.is_empty()) {
        let path = String::from_utf8_lossy(path);
        if path == SELF || FROZEN.iter().any(|(dir, _)| path.starts_with(dir)) {
            continue;
        }
        // Deleted in the working tree but still in the index: nothing to read.
        let Ok(bytes) = std::fs::read(repo.join(path.as_ref())) else {
            continue;
        };
        let Ok(text) = String::from_utf8(bytes) else {
            continue; // binary
        };
        checked += 1;
        for (n, line) in text.lines().enumerate() {
            for (re, why) in &words {
                if let Some(m) = re.find(line) {
                    found.push(format!("{path}:{}: {:?}: {why}", n + 1, m.as_str()));
                }
            }
        }
    }
    assert!(
        checked > 100,
        "only {checked} tracked text files read: is this a checkout?"
    );
    assert!(
        found.is_empty(),
        "{} line(s) of development history in tracked files (describe the product as it is; \
         history belongs in git log):\n{}",
        found.len(),
        found.join("\n")
    );
}

#[test]
fn the_history_words_are_found() {
    let words: Vec<regex::Regex> = WORDS
        .iter()
        .map(|(w, _)| {
            regex::RegexBuilder::new(w)
                .case_insensitive(true)
                .build()
                .unwrap()
        })
        .collect();
    let hit = |line: &str| words.iter().any(|re| re.is_match(line));
    for line in [
        "figures of the third stop, as measured",
        "Then (2026-12-06, second stop), each step",
        "stop 28's last build, unchanged",
        "issue 21's goal is tighter",
        "Tried and left out: the writer as a task",
        "Tried and taken back: time-ordered ids",
        "The agreed design is `../shared/DESIGN.md`",
        "against commit 0915f65's scheduler",
        "this machine that night",
    ] {
        assert!(hit(line), "not found: {line}");
    }
    for line in [
        "ANTIDOTE_K8S_STATE=$other \"$0\" stop 9>&- || true",
        "SIGTERM stops the scheduler within its grace",
        "Ctrl-C stops both; state stays in target/quickstart",
        "a session's token, kept for the next commands about this session",
    ] {
        assert!(!hit(line), "found in a line that is not history: {line}");
    }
}
