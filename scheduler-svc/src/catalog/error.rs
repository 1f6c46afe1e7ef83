//! The problems a curriculum can have, each naming where it is and why it is wrong.

use std::fmt;
use std::path::PathBuf;

/// One problem found while loading a curriculum.
///
/// Authors fix curricula from these messages alone, so each one says which file, which lesson
/// (when the file is a lesson), which field (as a path such as
/// `endpoints[1].presentations[0].port`) and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct CatalogError {
    /// The file that holds the problem; for a missing stage directory, guide or config file this
    /// is the `lesson.meta.yaml` that asked for it, so the author knows what to edit.
    pub file: PathBuf,
    /// The lesson's slug, when the file is a lesson and its slug could be read.
    pub lesson: Option<String>,
    /// The offending field as a path from the top of the file; empty when the problem concerns
    /// the whole file (unreadable, malformed YAML).
    pub field: String,
    /// Why the field is wrong: lowercase, no trailing period, naming the offending value.
    pub reason: String,
}

impl fmt::Display for CatalogError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: ", self.file.display())?;
        if let Some(lesson) = &self.lesson {
            write!(f, "lesson `{lesson}`: ")?;
        }
        if !self.field.is_empty() {
            write!(f, "`{}`: ", self.field)?;
        }
        f.write_str(&self.reason)
    }
}

/// Every problem found in a curriculum, so that one run of `validate` shows them all.
///
/// Never empty when returned by [`super::Catalog::load`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct CatalogErrors(pub Vec<CatalogError>);

impl fmt::Display for CatalogErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let count = self.0.len();
        let noun = if count == 1 { "error" } else { "errors" };
        write!(f, "{count} curriculum {noun}:")?;
        for error in &self.0 {
            write!(f, "\n{error}")?;
        }
        Ok(())
    }
}

/// A string that names none of an enumeration's values, e.g. `tier: staging`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {kind} `{value}` (expected one of {})", .expected.join(", "))]
pub struct UnknownVariant {
    /// What was being parsed, e.g. `tier` or `guide type`.
    pub kind: &'static str,
    /// The text that matched nothing.
    pub value: String,
    /// Every accepted spelling, so the message can list them.
    pub expected: &'static [&'static str],
}
