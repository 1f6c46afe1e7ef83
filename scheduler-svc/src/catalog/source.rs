//! Where a curriculum's files come from: a directory on disk, or a map of paths to contents.
//!
//! Loading asks only the questions of [`Source`] (is this a directory, is this a file, what does
//! this file hold, what does this directory hold), so one validation runs on both: [`Disk`] for
//! `Catalog::load`, [`Memory`] for `Catalog::from_files` (tests, fuzzing, tools holding a
//! curriculum that is not a directory). Each `Disk` answer is the `std::fs` call the loader made
//! before sources existed, so loading from disk behaves exactly as it did.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::fs;
use std::io;
use std::path::{Component, Path, PathBuf};

use super::error::CatalogError;

/// The file system questions loading asks; paths are always under the curriculum's root.
pub(super) trait Source {
    /// Whether `path` is a directory (following symbolic links, as `Path::is_dir` does).
    fn is_dir(&self, path: &Path) -> bool;
    /// Whether `path` is a regular file (following symbolic links, as `Path::is_file` does).
    fn is_file(&self, path: &Path) -> bool;
    /// The file's text; `InvalidData` when it is not UTF-8, `NotFound` when it does not exist.
    fn read(&self, path: &Path) -> io::Result<String>;
    /// The entries of a directory as (file name, path) pairs, in no particular order; entries
    /// that cannot be read are left out, as `fs::read_dir(..).flatten()` leaves them out.
    fn list(&self, dir: &Path) -> io::Result<Vec<(OsString, PathBuf)>>;
}

/// The real file system.
pub(super) struct Disk;

impl Source for Disk {
    fn is_dir(&self, path: &Path) -> bool {
        path.is_dir()
    }

    fn is_file(&self, path: &Path) -> bool {
        path.is_file()
    }

    fn read(&self, path: &Path) -> io::Result<String> {
        fs::read_to_string(path)
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<(OsString, PathBuf)>> {
        Ok(fs::read_dir(dir)?
            .flatten()
            .map(|entry| (entry.file_name(), entry.path()))
            .collect())
    }
}

/// A curriculum held in memory: files by path, and the directories those paths imply. An empty
/// directory cannot be expressed: a stage directory without files reads as missing, where on
/// disk its guide would be the first thing missing.
pub(super) struct Memory {
    /// Every file's contents, by full path (the root joined with the path as given).
    files: BTreeMap<PathBuf, Vec<u8>>,
    /// Every directory's entries, by full path; the root is always a directory.
    dirs: BTreeMap<PathBuf, BTreeSet<OsString>>,
}

impl Memory {
    /// Holds `files` (paths relative to `root`) as the curriculum in `root`. Refuses, naming
    /// each, the paths no directory could hold: empty, absolute or with `..`, given twice, or a
    /// file that another path treats as a directory.
    pub(super) fn new<P, C>(
        root: &Path,
        files: impl IntoIterator<Item = (P, C)>,
    ) -> Result<Memory, Vec<CatalogError>>
    where
        P: AsRef<Path>,
        C: AsRef<[u8]>,
    {
        let refuse = |path: &Path, reason: &str| CatalogError {
            file: root.join(path),
            lesson: None,
            field: String::new(),
            reason: reason.to_owned(),
        };
        let mut errors = Vec::new();
        let mut memory = Memory {
            files: BTreeMap::new(),
            dirs: BTreeMap::from([(root.to_owned(), BTreeSet::new())]),
        };
        for (path, contents) in files {
            let path = path.as_ref();
            let mut names = Vec::new();
            let mut inside = true;
            for component in path.components() {
                match component {
                    Component::Normal(name) => names.push(name),
                    Component::CurDir => {}
                    Component::ParentDir | Component::RootDir | Component::Prefix(_) => {
                        inside = false;
                    }
                }
            }
            if !inside || names.is_empty() {
                errors.push(refuse(
                    path,
                    "not a file path inside the curriculum (relative, without `..`)",
                ));
                continue;
            }
            let mut dir = root.to_owned();
            for name in &names[..names.len() - 1] {
                memory
                    .dirs
                    .entry(dir.clone())
                    .or_default()
                    .insert((*name).to_owned());
                dir.push(name);
                memory.dirs.entry(dir.clone()).or_default();
            }
            let name = names[names.len() - 1];
            memory
                .dirs
                .entry(dir.clone())
                .or_default()
                .insert(name.to_owned());
            let full = dir.join(name);
            if memory
                .files
                .insert(full, contents.as_ref().to_owned())
                .is_some()
            {
                errors.push(refuse(path, "given twice"));
            }
        }
        for file in memory.files.keys() {
            if memory.dirs.contains_key(file) {
                errors.push(CatalogError {
                    file: file.clone(),
                    lesson: None,
                    field: String::new(),
                    reason: "is both a file and a directory".to_owned(),
                });
            }
        }
        if errors.is_empty() {
            Ok(memory)
        } else {
            // Sorted by file, as every other list of curriculum errors is.
            errors.sort_by(|a, b| a.file.cmp(&b.file));
            Err(errors)
        }
    }
}

impl Source for Memory {
    fn is_dir(&self, path: &Path) -> bool {
        self.dirs.contains_key(path)
    }

    fn is_file(&self, path: &Path) -> bool {
        self.files.contains_key(path)
    }

    fn read(&self, path: &Path) -> io::Result<String> {
        let bytes = self
            .files
            .get(path)
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        String::from_utf8(bytes.clone())
            .map_err(|error| io::Error::new(io::ErrorKind::InvalidData, error))
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<(OsString, PathBuf)>> {
        let names = self
            .dirs
            .get(dir)
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        Ok(names
            .iter()
            .map(|name| (name.clone(), dir.join(name)))
            .collect())
    }
}
