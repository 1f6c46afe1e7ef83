//! The curriculum catalog: loads a curriculum directory in Antidote's on-disk format, unchanged,
//! validates it strictly and reports every problem at once.
//!
//! A curriculum directory holds:
//!
//! ```text
//! curriculum.meta.yaml
//! collections/<dir>/collection.meta.yaml      (optional directory)
//! images/<dir>/image.meta.yaml                (optional directory)
//! lessons/<dir>/lesson.meta.yaml
//! lessons/<dir>/stage<N>/guide.md | guide.ipynb
//! lessons/<dir>/stage<N>/configs/<endpoint>.py | .yml | .sh | -<driver>.txt
//! lessons/<dir>/stage<N>/checks/<endpoint>.sh | .py      (optional)
//! lessons/<dir>/stage<N>/solutions/<endpoint>.sh | .py   (optional)
//! ```
//!
//! As in Antidote, `<dir>` may be nested (`lessons/fundamentals/intro/`): every directory that
//! holds the meta file is an item, and the search does not descend into an item's own
//! directory. Hidden directories (`.git`) are not searched. The additions to the format:
//! configuration type `shell` (`<endpoint>.sh`), for busybox-only images; per stage, check
//! files (the stage's check passes when every one exits 0) and solution files of the same two
//! kinds, a stage's `checks: gate|advisory` and a lesson's `checkTimeout`.
//!
//! # Validation
//!
//! Loading never stops at the first problem: [`Catalog::load`] returns every [`CatalogError`]
//! in the curriculum, each naming file, lesson, field and reason, sorted by file. Tiers work as
//! in Antidote: every lesson's structure is validated whatever the configured tier, then the
//! lessons below the tier are skipped. A lesson's references outside itself (the images of its
//! endpoints, its collection, its prereqs) must exist and be loaded wherever the lesson is
//! (checked against the lesson's own tier: it may not depend on a lesson or collection of a
//! lower tier). For a loaded lesson a broken reference is an error; for a skipped one it is a
//! warning ([`Catalog::warnings`]), since Antidote never checked them and real curricula that
//! ran at tier prod hold lessons at tier ptr naming images they never defined.
//!
//! [`Catalog::load`] reads files with blocking I/O; call it from `spawn_blocking` in async code.
//! [`Catalog::from_files`] validates a curriculum held in memory (a map of paths to contents)
//! by the same rules, without touching the disk: the loader asks its questions of a `Source`,
//! the disk or that map.
//!
//! # Modules
//! - `model`: the typed curriculum ([`Lesson`], [`Image`], [`Collection`], the enums).
//! - `error`: [`CatalogError`], [`CatalogErrors`], [`UnknownVariant`].
//! - `yaml`: a YAML reader that records every problem with its field path and keeps going.
//! - `meta`: `curriculum.meta.yaml`, `collection.meta.yaml`, `image.meta.yaml`; slug rules.
//! - `lesson`: `lesson.meta.yaml` and the checks within one lesson.
//! - `stage`: locating each stage's directory, guide and config files.
//! - `source`: where files come from: the disk, or a map of paths to contents.

mod error;
mod lesson;
mod meta;
mod model;
mod source;
mod stage;
mod yaml;

#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

pub use self::error::{CatalogError, CatalogErrors, UnknownVariant};
pub use self::model::{
    Author, Category, CheckMode, Collection, CollectionType, ConfigurationType, Connection,
    CurriculumMeta, DEFAULT_CHECK_TIMEOUT, Endpoint, Flavor, GuideType, Image,
    JUPYTER_GUIDE_ENDPOINT, JUPYTER_GUIDE_PORT, Lesson, LessonPlacement, NAPALM_DRIVERS,
    Presentation, PresentationKind, Script, Stage, StageConfig, Tier,
};

use self::lesson::Known;
use self::meta::Parsed;
use self::source::{Disk, Memory, Source};
use self::yaml::FileProblems;

/// A loaded, validated curriculum.
#[derive(Debug, Clone)]
pub struct Catalog {
    /// The directory the curriculum was loaded from; every other path in the catalog is under it.
    pub root: PathBuf,
    /// What `curriculum.meta.yaml` says about the curriculum as a whole.
    pub meta: CurriculumMeta,
    /// Collections at or above the configured tier, by slug.
    pub collections: BTreeMap<String, Collection>,
    /// Every image, by slug; images have no tier.
    pub images: BTreeMap<String, Image>,
    /// Lessons at or above the configured tier, by slug.
    pub lessons: BTreeMap<String, Lesson>,
    /// Slugs of the valid lessons below the configured tier, sorted, so that an operator can
    /// see why a lesson is missing.
    pub skipped: Vec<String>,
    /// Slugs of the valid collections below the configured tier, sorted, for the same reason.
    pub skipped_collections: Vec<String>,
    /// Problems that stopped nothing: a skipped lesson's references to images, collections or
    /// prereqs that do not exist or do not load with it (Antidote never checked those, and
    /// curricula that ran at tier prod for years hold them). Sorted by file; `validate` prints
    /// them and `serve` logs them.
    pub warnings: Vec<CatalogError>,
}

/// What the `validate` commands print on success: the warnings and a summary with the counts.
#[derive(Debug, Clone)]
pub struct Validation {
    /// The catalog's warnings ([`Catalog::warnings`]), printed one per line.
    pub warnings: Vec<CatalogError>,
    /// One line: what loaded and what was skipped.
    pub summary: String,
}

/// Loads the curriculum in `dir` at `tier` for the `validate` commands.
pub fn validate(dir: &Path, tier: Tier) -> Result<Validation, CatalogErrors> {
    let catalog = Catalog::load(dir, tier)?;
    Ok(Validation {
        summary: catalog.summary(tier),
        warnings: catalog.warnings,
    })
}

impl Catalog {
    /// Loads and validates the curriculum in `dir`, keeping the lessons and collections at or
    /// above `tier`; returns all problems at once.
    pub fn load(dir: &Path, tier: Tier) -> Result<Catalog, CatalogErrors> {
        Self::load_from(&Disk, dir, tier)
    }

    /// Validates the curriculum whose files are `files` (paths relative to the curriculum's
    /// root, each with its contents) exactly as [`Catalog::load`] validates a directory holding
    /// them, without any I/O. `root` is where the curriculum is said to live: every path in the
    /// catalog and in its errors is under it. Directories are those the paths imply. A path no
    /// directory could hold (absolute, with `..`, given twice, both a file and a directory) is
    /// an error naming it.
    pub fn from_files<P, C>(
        root: &Path,
        files: impl IntoIterator<Item = (P, C)>,
        tier: Tier,
    ) -> Result<Catalog, CatalogErrors>
    where
        P: AsRef<Path>,
        C: AsRef<[u8]>,
    {
        let memory = Memory::new(root, files).map_err(CatalogErrors)?;
        Self::load_from(&memory, root, tier)
    }

    /// Loads and validates the curriculum in `dir` as `source` shows it.
    fn load_from(source: &dyn Source, dir: &Path, tier: Tier) -> Result<Catalog, CatalogErrors> {
        if !source.is_dir(dir) {
            return Err(CatalogErrors(vec![CatalogError {
                file: dir.to_owned(),
                lesson: None,
                field: String::new(),
                reason: "curriculum directory does not exist".to_owned(),
            }]));
        }
        let mut errors = Vec::new();

        let meta = {
            let file = dir.join("curriculum.meta.yaml");
            let mut report = FileProblems::new(file.clone());
            let meta = yaml::read(source, &file, &mut report)
                .and_then(|value| meta::curriculum(&value, &mut report));
            errors.extend(report.into_errors());
            meta
        };

        // Images and collections come first because lessons refer to them; prereqs are checked
        // last, once every lesson's slug and tier is known.
        let mut images = BTreeMap::new();
        let mut image_files = BTreeMap::new();
        for file in discover(source, &dir.join("images"), "image.meta.yaml", &mut errors) {
            let mut report = FileProblems::new(file.clone());
            let parsed = yaml::read(source, &file, &mut report)
                .map_or_else(Parsed::nothing, |value| meta::image(&value, &mut report));
            if let Some(slug) = parsed.slug
                && claim(&mut image_files, &slug, &file, &mut report)
                && let Some(image) = parsed.item
            {
                images.insert(slug, image);
            }
            errors.extend(report.into_errors());
        }

        let mut collections = BTreeMap::new();
        let mut skipped_collections = Vec::new();
        let mut collection_files = BTreeMap::new();
        let mut collection_tiers = BTreeMap::new();
        for file in discover(
            source,
            &dir.join("collections"),
            "collection.meta.yaml",
            &mut errors,
        ) {
            let mut report = FileProblems::new(file.clone());
            let parsed = yaml::read(source, &file, &mut report)
                .map_or_else(Parsed::nothing, |value| {
                    meta::collection(&value, &mut report)
                });
            if let Some(slug) = parsed.slug
                && claim(&mut collection_files, &slug, &file, &mut report)
            {
                collection_tiers.insert(slug.clone(), parsed.tier);
                if let Some(collection) = parsed.item {
                    if collection.tier >= tier {
                        collections.insert(slug, collection);
                    } else {
                        skipped_collections.push(slug);
                    }
                }
            }
            errors.extend(report.into_errors());
        }

        let image_slugs: BTreeSet<String> = image_files.into_keys().collect();
        let known = Known {
            images: &image_slugs,
            collections: &collection_tiers,
        };
        let mut drafts = Vec::new();
        // References that only skipped lessons make; they stop nothing.
        let mut warnings = Vec::new();
        let mut lesson_files = BTreeMap::new();
        let mut lesson_tiers = BTreeMap::new();
        for file in discover(
            source,
            &dir.join("lessons"),
            "lesson.meta.yaml",
            &mut errors,
        ) {
            let mut report = FileProblems::new(file.clone());
            // `discover` only returns files inside a directory, so there is always a parent.
            let lesson_dir = file.parent().unwrap_or(dir).to_owned();
            let Some(value) = yaml::read(source, &file, &mut report) else {
                errors.extend(report.into_errors());
                continue;
            };
            let draft = lesson::read(source, &lesson_dir, &value, &known, &mut report);
            if let Some(slug) = &draft.parsed.slug
                && claim(&mut lesson_files, slug, &file, &mut report)
            {
                lesson_tiers.insert(slug.clone(), draft.parsed.tier);
            }
            let (found, lenient) = report.split(is_below(draft.parsed.tier, tier));
            // Reading built the lesson unless its structure was wrong; a loaded lesson's
            // references to what does not exist are errors too, and also keep it out.
            let read_clean = found.is_empty();
            errors.extend(found);
            warnings.extend(lenient);
            drafts.push((file, draft, read_clean));
        }

        let mut lessons = BTreeMap::new();
        let mut skipped = Vec::new();
        for (file, draft, read_clean) in drafts {
            let Some(slug) = draft.parsed.slug else {
                continue;
            };
            let mut report = FileProblems::new(file);
            report.set_lesson(&slug);
            check_prereqs(
                &slug,
                draft.parsed.tier,
                &draft.prereqs,
                &lesson_tiers,
                &mut report,
            );
            let (found, lenient) = report.split(is_below(draft.parsed.tier, tier));
            // A loaded lesson's references were errors, found when it was read.
            let clean = read_clean && found.is_empty();
            errors.extend(found);
            warnings.extend(lenient);
            // A duplicate slug was reported against the later file; keep only the first.
            if let Some(lesson) = draft.parsed.item
                && clean
                && !lessons.contains_key(&slug)
            {
                if lesson.tier >= tier {
                    lessons.insert(slug, lesson);
                } else {
                    skipped.push(slug);
                }
            }
        }
        skipped.sort();
        skipped_collections.sort();
        warnings.sort_by(|a, b| a.file.cmp(&b.file));

        match meta {
            Some(meta) if errors.is_empty() => Ok(Catalog {
                root: dir.to_owned(),
                meta,
                collections,
                images,
                lessons,
                skipped,
                skipped_collections,
                warnings,
            }),
            _ => {
                // `meta` is only missing after its problem was recorded, so this is never empty.
                debug_assert!(!errors.is_empty());
                // Stable, so each file's problems keep the order they were found in.
                errors.sort_by(|a, b| a.file.cmp(&b.file));
                Err(CatalogErrors(errors))
            }
        }
    }

    /// One line saying what loaded at `tier` and what was skipped, with the warnings' count.
    pub fn summary(&self, tier: Tier) -> String {
        let plural = |count: usize, noun: &str| {
            format!("{count} {noun}{}", if count == 1 { "" } else { "s" })
        };
        format!(
            "{}: valid at tier {tier}: {} loaded ({} skipped below the tier), {} loaded ({} \
             skipped), {}, {}",
            self.root.display(),
            plural(self.lessons.len(), "lesson"),
            self.skipped.len(),
            plural(self.collections.len(), "collection"),
            self.skipped_collections.len(),
            plural(self.images.len(), "image"),
            plural(self.warnings.len(), "warning"),
        )
    }

    /// The loaded lesson with this slug; `None` if it does not exist or was skipped by tier.
    pub fn lesson(&self, slug: &str) -> Option<&Lesson> {
        self.lessons.get(slug)
    }

    /// The image with this slug.
    pub fn image(&self, slug: &str) -> Option<&Image> {
        self.images.get(slug)
    }

    /// The loaded collection with this slug; `None` if it does not exist or was skipped by tier.
    pub fn collection(&self, slug: &str) -> Option<&Collection> {
        self.collections.get(slug)
    }
}

/// Records that `file` defines `slug`, or reports the duplicate if an earlier file did.
/// Returns whether the slug was new.
fn claim(
    first_files: &mut BTreeMap<String, PathBuf>,
    slug: &str,
    file: &Path,
    report: &mut FileProblems,
) -> bool {
    if let Some(first) = first_files.get(slug) {
        report.error(
            "slug",
            format!("slug `{slug}` is already used by {}", first.display()),
        );
        false
    } else {
        first_files.insert(slug.to_owned(), file.to_owned());
        true
    }
}

/// Whether a lesson of tier `lesson` is skipped when loading at `tier`; a lesson whose tier
/// could not be read is never skipped (it is an error already).
fn is_below(lesson: Option<Tier>, tier: Tier) -> bool {
    lesson.is_some_and(|lesson| lesson < tier)
}

/// Checks that every prereq names a lesson that is loaded wherever this one is.
fn check_prereqs(
    slug: &str,
    tier: Option<Tier>,
    prereqs: &[String],
    lesson_tiers: &BTreeMap<String, Option<Tier>>,
    report: &mut FileProblems,
) {
    for (index, prereq) in prereqs.iter().enumerate() {
        let field = format!("prereqs[{index}]");
        if prereq == slug {
            report.error(field, "a lesson cannot be its own prereq");
            continue;
        }
        match lesson_tiers.get(prereq) {
            None => report.reference(field, format!("no lesson with slug `{prereq}`")),
            Some(Some(prereq_tier)) => {
                if let Some(tier) = tier
                    && *prereq_tier < tier
                {
                    report.reference(
                        field,
                        format!(
                            "lesson `{prereq}` has tier {prereq_tier}, below this lesson's tier \
                             {tier}, so it is skipped wherever this lesson loads"
                        ),
                    );
                }
            }
            // The prereq's own file reports its broken tier.
            Some(None) => {}
        }
    }
}

/// How deep below `lessons/`, `images/` or `collections/` items are searched for; deep enough
/// for any grouping, shallow enough that a symlink loop ends quickly.
const MAX_DEPTH: usize = 8;

/// Finds every `file_name` under `dir`, sorted; a missing `dir` holds none.
fn discover(
    source: &dyn Source,
    dir: &Path,
    file_name: &str,
    errors: &mut Vec<CatalogError>,
) -> Vec<PathBuf> {
    let mut found = Vec::new();
    if source.is_dir(dir) {
        walk(source, dir, file_name, 0, &mut found, errors);
    }
    found.sort();
    found
}

/// One step of [`discover`].
fn walk(
    source: &dyn Source,
    dir: &Path,
    file_name: &str,
    depth: usize,
    found: &mut Vec<PathBuf>,
    errors: &mut Vec<CatalogError>,
) {
    let candidate = dir.join(file_name);
    if source.is_file(&candidate) {
        // An item's directory is its own (stage directories, Dockerfiles): not searched on.
        found.push(candidate);
        return;
    }
    let entries = match source.list(dir) {
        Ok(entries) => entries,
        Err(error) => {
            errors.push(CatalogError {
                file: dir.to_owned(),
                lesson: None,
                field: String::new(),
                reason: format!("cannot list directory: {error}"),
            });
            return;
        }
    };
    let mut subdirs = Vec::new();
    for (name, path) in entries {
        let name = name.to_string_lossy();
        if name.starts_with('.') {
            continue;
        }
        if source.is_dir(&path) {
            subdirs.push(path);
        } else if depth > 0 && is_misnamed(&name, file_name) {
            // Without this, a lesson whose meta file is misspelt would silently not exist.
            errors.push(CatalogError {
                file: path,
                lesson: None,
                field: String::new(),
                reason: format!("not read: the file must be named `{file_name}`"),
            });
        }
    }
    if depth == MAX_DEPTH {
        return;
    }
    subdirs.sort();
    for subdir in subdirs {
        walk(source, &subdir, file_name, depth + 1, found, errors);
    }
}

/// Whether `name` looks like a misspelling of `expected` (`lesson.meta.yml`, `Lesson.meta.yaml`,
/// `lesson.yaml`): same first word, a YAML extension, a different name.
fn is_misnamed(name: &str, expected: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    let stem = expected.split('.').next().unwrap_or(expected);
    name != expected
        && lower.starts_with(stem)
        && (lower.ends_with(".yaml") || lower.ends_with(".yml"))
}
