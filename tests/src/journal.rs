//! The test agent's creation journal (`--journal FILE`): one line per object creation,
//! `create LIVE_LESSON GENERATION`, and one per adoption after a restart,
//! `adopt LIVE_LESSON GENERATION`. Tests read it to prove what was created, and how often.

use std::collections::HashMap;
use std::path::Path;

/// The live-lesson ids the agent created objects for, in order, with repeats (empty when the
/// journal does not exist yet).
pub fn created(journal: &Path) -> Vec<String> {
    entries(journal, "create")
}

/// The live-lesson ids whose objects the agent adopted after a restart, in order.
pub fn adopted(journal: &Path) -> Vec<String> {
    entries(journal, "adopt")
}

/// How many times the agent created objects for each live lesson.
pub fn creations_by_lesson(journal: &Path) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for id in created(journal) {
        *counts.entry(id).or_default() += 1;
    }
    counts
}

/// The ids of the journal's `kind` lines.
fn entries(journal: &Path, kind: &str) -> Vec<String> {
    std::fs::read_to_string(journal)
        .unwrap_or_default()
        .lines()
        .filter_map(|line| {
            let mut words = line.split(' ');
            (words.next() == Some(kind)).then(|| words.next().unwrap_or_default().to_owned())
        })
        .collect()
}
