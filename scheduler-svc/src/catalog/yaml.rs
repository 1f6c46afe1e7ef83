//! A strict reader over parsed YAML that records every problem in a file and keeps going.
//!
//! Deserialising straight into structs with serde stops at the first wrong field, so an author
//! would fix one mistake per run. Instead each file is parsed into a [`Value`] and read through
//! [`Node`], which reports unknown keys, missing keys and wrong types into a [`FileProblems`]
//! with the field's full path, and hands back whatever it could read.

use std::io;
use std::num::NonZeroU16;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde_yaml::{Mapping, Value};

use super::error::{CatalogError, UnknownVariant};
use super::source::Source;

/// The problems found in one file.
pub(super) struct FileProblems {
    file: PathBuf,
    lesson: Option<String>,
    /// Every problem in the order found, each marked when it is a reference to something the
    /// curriculum does not hold (see [`FileProblems::reference`]).
    problems: Vec<(CatalogError, Problem)>,
}

/// What kind of problem a [`FileProblems`] holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Problem {
    /// Wrong wherever the file is: the file itself is malformed.
    Structure,
    /// A reference to an image, collection or lesson that the curriculum does not hold (or
    /// would not load with the lesson); only an error if the lesson itself loads.
    Reference,
}

impl FileProblems {
    /// Starts an empty report about `file`.
    pub(super) fn new(file: PathBuf) -> Self {
        Self {
            file,
            lesson: None,
            problems: Vec::new(),
        }
    }

    /// Names the lesson in every error recorded from now on.
    pub(super) fn set_lesson(&mut self, slug: &str) {
        self.lesson = Some(slug.to_owned());
    }

    /// Records one problem with `field`; an empty field means the whole file.
    pub(super) fn error(&mut self, field: impl Into<String>, reason: impl Into<String>) {
        self.push(field.into(), reason.into(), Problem::Structure);
    }

    /// Records a reference from `field` to something the curriculum does not hold. As in
    /// Antidote, it only matters for a lesson that loads: for a lesson below the configured
    /// tier it is a warning ([`FileProblems::split`]). It does not count in
    /// [`FileProblems::count`], so a lesson whose only problems are references is still built,
    /// to be kept or skipped.
    pub(super) fn reference(&mut self, field: impl Into<String>, reason: impl Into<String>) {
        self.push(field.into(), reason.into(), Problem::Reference);
    }

    fn push(&mut self, field: String, reason: String, kind: Problem) {
        let error = CatalogError {
            file: self.file.clone(),
            lesson: self.lesson.clone(),
            field,
            reason,
        };
        self.problems.push((error, kind));
    }

    /// How many structural problems are recorded (references are not counted); comparing
    /// counts before and after reading a part tells whether that part was well formed.
    pub(super) fn count(&self) -> usize {
        self.problems
            .iter()
            .filter(|(_, kind)| *kind == Problem::Structure)
            .count()
    }

    /// Every recorded problem as an error, in the order they were found.
    pub(super) fn into_errors(self) -> Vec<CatalogError> {
        self.split(false).0
    }

    /// The recorded problems as errors and warnings, each in the order found: references are
    /// warnings when `lenient` (the lesson is skipped below the tier), errors otherwise.
    pub(super) fn split(self, lenient: bool) -> (Vec<CatalogError>, Vec<CatalogError>) {
        let mut errors = Vec::new();
        let mut warnings = Vec::new();
        for (error, kind) in self.problems {
            if lenient && kind == Problem::Reference {
                warnings.push(error);
            } else {
                errors.push(error);
            }
        }
        (errors, warnings)
    }
}

/// Reads and parses `path`, reporting an unreadable file or malformed YAML as one error.
pub(super) fn read(source: &dyn Source, path: &Path, report: &mut FileProblems) -> Option<Value> {
    let text = match source.read(path) {
        Ok(text) => text,
        Err(error) if error.kind() == io::ErrorKind::NotFound => {
            report.error("", "file does not exist");
            return None;
        }
        Err(error) if error.kind() == io::ErrorKind::InvalidData => {
            report.error("", "file is not valid utf-8");
            return None;
        }
        Err(error) => {
            report.error("", format!("cannot read file: {error}"));
            return None;
        }
    };
    // serde_yaml's messages already end with "at line L column C" when it knows where.
    let mut value = match serde_yaml::from_str::<Value>(&text) {
        Ok(value) => value,
        Err(error) => {
            report.error("", format!("malformed yaml: {error}"));
            return None;
        }
    };
    // Antidote's Go loader honoured merge keys (`<<: *defaults`), so curricula may use them.
    if let Err(error) = value.apply_merge() {
        report.error("", format!("malformed yaml: {error}"));
        return None;
    }
    Some(value)
}

/// A YAML mapping being read, with the path that leads to it from the top of its file.
pub(super) struct Node<'v> {
    path: String,
    map: &'v Mapping,
}

impl<'v> Node<'v> {
    /// Opens `value` as a mapping whose keys must all be among `known`, reporting every other
    /// key at once. Returns `None` (having reported why) if `value` is not a mapping.
    pub(super) fn open(
        path: &str,
        value: &'v Value,
        known: &[&str],
        report: &mut FileProblems,
    ) -> Option<Self> {
        let Value::Mapping(map) = value else {
            let reason = format!("must be a mapping, not {}", describe(value));
            if path.is_empty() {
                report.error("", format!("the file {reason}"));
            } else {
                report.error(path, reason);
            }
            return None;
        };
        let node = Self {
            path: path.to_owned(),
            map,
        };
        for key in map.keys() {
            let name = match key {
                Value::String(name) => name.clone(),
                other => scalar_text(other).unwrap_or_else(|| kind(other).to_owned()),
            };
            if !known.contains(&name.as_str()) {
                let reason = match suggest(&name, known) {
                    Some(close) if !name.is_empty() => {
                        format!("unknown field (did you mean `{close}`?)")
                    }
                    _ => "unknown field".to_owned(),
                };
                // An empty key would make a path that names nothing (empty, or ending in a
                // dot); it is shown as YAML writes it.
                let shown = if name.is_empty() { "\"\"" } else { &name };
                report.error(node.field(shown), reason);
            }
        }
        Some(node)
    }

    /// The path of `key` inside this mapping, e.g. `endpoints[0].name`.
    pub(super) fn field(&self, key: &str) -> String {
        if self.path.is_empty() {
            key.to_owned()
        } else {
            format!("{}.{key}", self.path)
        }
    }

    /// The path of this mapping itself.
    pub(super) fn path(&self) -> &str {
        &self.path
    }

    /// The value under `key`; an explicit `null` (`key:` with nothing after it) counts as
    /// absent, as it did for Antidote's Go loader.
    fn get(&self, key: &str) -> Option<&'v Value> {
        self.map.get(key).filter(|value| !value.is_null())
    }

    /// An optional string; absent, null and empty all mean `None`.
    pub(super) fn string(&self, key: &str, report: &mut FileProblems) -> Option<String> {
        let value = self.get(key)?;
        match scalar_text(value) {
            Some(text) if text.is_empty() => None,
            Some(text) => Some(text),
            None => {
                report.error(
                    self.field(key),
                    format!("must be a string, not {}", describe(value)),
                );
                None
            }
        }
    }

    /// A string that must be present and non-empty.
    pub(super) fn required_string(&self, key: &str, report: &mut FileProblems) -> Option<String> {
        if self.get(key).is_none() {
            report.error(self.field(key), "is required");
            return None;
        }
        let before = report.count();
        let text = self.string(key, report);
        if text.is_none() && report.count() == before {
            report.error(self.field(key), "must not be empty");
        }
        text
    }

    /// An optional string where absence means empty text (descriptions).
    pub(super) fn text(&self, key: &str, report: &mut FileProblems) -> String {
        self.string(key, report).unwrap_or_default()
    }

    /// An optional list of strings.
    pub(super) fn strings(&self, key: &str, report: &mut FileProblems) -> Vec<String> {
        self.items(key, report)
            .into_iter()
            .filter_map(|(field, value)| match scalar_text(value) {
                Some(text) => Some(text),
                None => {
                    report.error(field, format!("must be a string, not {}", describe(value)));
                    None
                }
            })
            .collect()
    }

    /// An optional boolean, false when absent.
    pub(super) fn flag(&self, key: &str, report: &mut FileProblems) -> bool {
        match self.get(key) {
            None => false,
            Some(Value::Bool(flag)) => *flag,
            Some(other) => {
                report.error(
                    self.field(key),
                    format!("must be true or false, not {}", describe(other)),
                );
                false
            }
        }
    }

    /// An optional integer.
    pub(super) fn integer(&self, key: &str, report: &mut FileProblems) -> Option<i64> {
        let value = self.get(key)?;
        let integer = value.as_i64();
        if integer.is_none() {
            report.error(
                self.field(key),
                format!("must be a whole number, not {}", describe(value)),
            );
        }
        integer
    }

    /// One of an enumeration's spellings; with `required`, absence is an error too.
    pub(super) fn choice<T>(
        &self,
        key: &str,
        required: bool,
        report: &mut FileProblems,
    ) -> Option<T>
    where
        T: FromStr<Err = UnknownVariant>,
    {
        let text = if required {
            self.required_string(key, report)?
        } else {
            self.string(key, report)?
        };
        match text.parse() {
            Ok(choice) => Some(choice),
            Err(error) => {
                report.error(self.field(key), error.to_string());
                None
            }
        }
    }

    /// An optional list, as `(path, item)` pairs such as `("endpoints[2]", ...)`.
    pub(super) fn items(&self, key: &str, report: &mut FileProblems) -> Vec<(String, &'v Value)> {
        match self.get(key) {
            None => Vec::new(),
            Some(Value::Sequence(items)) => items
                .iter()
                .enumerate()
                .map(|(index, item)| (format!("{}[{index}]", self.field(key)), item))
                .collect(),
            Some(other) => {
                report.error(
                    self.field(key),
                    format!("must be a list, not {}", describe(other)),
                );
                Vec::new()
            }
        }
    }

    /// An optional nested mapping under `key` whose keys must be among `known`.
    pub(super) fn child(
        &self,
        key: &str,
        known: &[&str],
        report: &mut FileProblems,
    ) -> Option<Node<'v>> {
        let value = self.get(key)?;
        Node::open(&self.field(key), value, known, report)
    }

    /// An optional mapping of labels: non-empty string keys to non-empty scalar values (numbers
    /// and booleans count as their spelling, as YAML authors write `gpu: true`).
    pub(super) fn labels(
        &self,
        key: &str,
        report: &mut FileProblems,
    ) -> std::collections::BTreeMap<String, String> {
        let mut labels = std::collections::BTreeMap::new();
        let Some(value) = self.get(key) else {
            return labels;
        };
        let Value::Mapping(map) = value else {
            report.error(
                self.field(key),
                format!("must be a mapping of labels, not {}", describe(value)),
            );
            return labels;
        };
        for (name, value) in map {
            let name = match scalar_text(name) {
                Some(name) if !name.is_empty() => name,
                _ => {
                    report.error(self.field(key), "label names must be non-empty strings");
                    continue;
                }
            };
            let field = format!("{}.{name}", self.field(key));
            match scalar_text(value) {
                Some(text) if !text.is_empty() => {
                    labels.insert(name, text);
                }
                _ => report.error(
                    field,
                    format!("must be a non-empty label value, not {}", describe(value)),
                ),
            }
        }
        labels
    }

    /// A port that must be present.
    pub(super) fn port(&self, key: &str, report: &mut FileProblems) -> Option<NonZeroU16> {
        match self.get(key) {
            None => {
                report.error(self.field(key), "is required");
                None
            }
            Some(value) => port(&self.field(key), value, report),
        }
    }
}

/// Reads a TCP port: a whole number from 1 to 65535.
pub(super) fn port(field: &str, value: &Value, report: &mut FileProblems) -> Option<NonZeroU16> {
    let port = value
        .as_u64()
        .and_then(|number| u16::try_from(number).ok())
        .and_then(NonZeroU16::new);
    if port.is_none() {
        report.error(
            field,
            format!(
                "{} is not a port (a whole number from 1 to 65535)",
                describe(value)
            ),
        );
    }
    port
}

/// The text of a scalar the way Antidote's Go loader accepted it into a string field: numbers
/// and booleans count as their spelling (`tags: [2019]`), collections do not.
fn scalar_text(value: &Value) -> Option<String> {
    match value {
        Value::String(text) => Some(text.clone()),
        Value::Number(number) => Some(number.to_string()),
        Value::Bool(flag) => Some(flag.to_string()),
        _ => None,
    }
}

/// Shows a value in a message such as "must be a list, not `foo`": scalars as their text,
/// anything else by its kind.
fn describe(value: &Value) -> String {
    match scalar_text(value) {
        Some(text) => format!("`{text}`"),
        None => kind(value).to_owned(),
    }
}

/// Names a value's kind.
fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Sequence(_) => "a list",
        Value::Mapping(_) => "a mapping",
        Value::Tagged(_) => "a tagged value",
    }
}

/// The known key an unknown one was probably meant to be: the same apart from case, `_` and
/// `-` (`short_description` for `shortDescription`), or at most two edits away (`prot`).
fn suggest<'k>(unknown: &str, known: &[&'k str]) -> Option<&'k str> {
    let normalise = |key: &str| -> String {
        key.chars()
            .filter(|c| *c != '_' && *c != '-')
            .flat_map(char::to_lowercase)
            .collect()
    };
    let wanted = normalise(unknown);
    if let Some(same) = known.iter().find(|key| normalise(key) == wanted) {
        return Some(same);
    }
    known
        .iter()
        .map(|key| (edit_distance(&wanted, &normalise(key)), *key))
        .filter(|(distance, _)| *distance <= 2)
        .min_by_key(|(distance, _)| *distance)
        .map(|(_, key)| key)
}

/// Levenshtein distance, counted in characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut previous: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut current = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let substitution = previous[j] + usize::from(ca != *cb);
            current[j + 1] = substitution.min(previous[j + 1] + 1).min(current[j] + 1);
        }
        previous = current;
    }
    previous[b.len()]
}
