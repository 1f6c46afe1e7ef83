//! Outcomes, report lines and the summary, and the wording of agent answers in them.

use antidote_proto::agent::v1 as proto;
use proto::Phase;

/// What one check found.
pub enum Outcome {
    /// The rule holds; the detail says what was seen (may be empty).
    Pass(String),
    /// The rule is broken; the message says how.
    Fail(String),
    /// The check did not run, or cannot be decided from outside; the message says why.
    Skip(String),
}

/// What a check's body returns: an `Err` is a failure it could not go on from.
pub type Verdict = anyhow::Result<Outcome>;

/// A passing verdict with `detail`.
pub fn pass(detail: impl Into<String>) -> Verdict {
    Ok(Outcome::Pass(detail.into()))
}

/// The tally of a run: each check's outcome, printed as it comes.
#[derive(Default)]
pub struct Tally {
    /// Each check run so far with its outcome, in run order; later checks look up their needs
    /// here.
    lines: Vec<(&'static str, Outcome)>,
}

impl Tally {
    /// Prints the line of the check called `name`, which checks `what`, and keeps its outcome.
    pub fn record(&mut self, name: &'static str, what: &str, outcome: Outcome) {
        let (tag, detail) = match &outcome {
            Outcome::Pass(d) => ("PASS", d),
            Outcome::Fail(d) => ("FAIL", d),
            Outcome::Skip(d) => ("SKIP", d),
        };
        if detail.is_empty() {
            println!("  {tag}  {name}: {what}");
        } else {
            println!("  {tag}  {name}: {what}: {detail}");
        }
        self.lines.push((name, outcome));
    }

    /// The outcome of the check called `name`, if it ran.
    pub fn outcome(&self, name: &str) -> Option<&Outcome> {
        self.lines
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, outcome)| outcome)
    }

    fn count(&self, f: fn(&Outcome) -> bool) -> usize {
        self.lines.iter().filter(|(_, o)| f(o)).count()
    }

    /// How many checks failed.
    pub fn failed(&self) -> usize {
        self.count(|o| matches!(o, Outcome::Fail(_)))
    }

    /// `N passed, M failed, K skipped`.
    pub fn summary(&self) -> String {
        format!(
            "{} passed, {} failed, {} skipped",
            self.count(|o| matches!(o, Outcome::Pass(_))),
            self.failed(),
            self.count(|o| matches!(o, Outcome::Skip(_)))
        )
    }
}

/// A state in a few words: generation, stage, phase and reason.
pub fn summary(state: &proto::LiveLessonState) -> String {
    format!(
        "generation {} stage {} {:?} ({})",
        state.generation,
        state.stage,
        Phase::try_from(state.phase).unwrap_or(Phase::Unspecified),
        state.reason
    )
}

/// A gRPC error as `Code: message`.
pub fn describe(status: &tonic::Status) -> String {
    format!("{:?}: {}", status.code(), status.message())
}
