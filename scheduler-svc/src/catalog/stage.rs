//! Finding a stage's files in the curriculum's source: its directory, its guide and each
//! endpoint's config file.
//!
//! Problems are reported against the `lesson.meta.yaml` field that asked for the file (the
//! stage, its `guideType`, the endpoint's `configurationType`), with the missing file named
//! relative to the lesson directory.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};

use antidote_proto::limits::{MAX_CONFIGURATION_FILE, MAX_CONFIGURATION_STAGE, MAX_NOTEBOOK};

use super::model::{ConfigurationType, Endpoint, GuideType, NAPALM_DRIVERS, Script, StageConfig};
use super::source::Source;
use super::yaml::FileProblems;

/// A stage's files, found.
pub(super) struct StageFiles {
    /// The guide.
    pub(super) guide: PathBuf,
    /// A Jupyter guide's text.
    pub(super) notebook: Option<String>,
    /// Each configured endpoint's config, by endpoint name.
    pub(super) configs: BTreeMap<String, StageConfig>,
    /// The check files in `checks/`, by endpoint name.
    pub(super) checks: BTreeMap<String, Script>,
    /// The solution files in `solutions/`, by endpoint name.
    pub(super) solutions: BTreeMap<String, Script>,
}

/// Locates stage `index` of the lesson in `dir`. `field` is the stage's path in the lesson file
/// (`stages[1]`); `endpoints` pairs each cleanly read endpoint with its path (`endpoints[0]`).
pub(super) fn locate(
    source: &dyn Source,
    dir: &Path,
    index: u32,
    field: &str,
    guide_type: GuideType,
    endpoints: &[(String, Endpoint)],
    report: &mut FileProblems,
) -> Option<StageFiles> {
    let stage_name = format!("stage{index}");
    let stage_dir = dir.join(&stage_name);
    if !source.is_dir(&stage_dir) {
        // Without the directory every file in it is missing too; one error says it all.
        report.error(
            field,
            format!("stage directory `{stage_name}/` does not exist"),
        );
        return None;
    }
    let before = report.count();

    let guide = stage_dir.join(guide_type.file_name());
    let mut notebook = None;
    if !source.is_file(&guide) {
        report.error(
            format!("{field}.guideType"),
            format!(
                "`{stage_name}/{}` does not exist (guideType is {guide_type})",
                guide_type.file_name()
            ),
        );
    } else if guide_type == GuideType::Jupyter {
        let shown = format!("{stage_name}/{}", guide_type.file_name());
        match source.read(&guide) {
            Ok(text) if text.len() > MAX_NOTEBOOK => report.error(
                format!("{field}.guideType"),
                format!(
                    "`{shown}` holds {} bytes, over the {} KiB a jupyter guide may hold",
                    text.len(),
                    MAX_NOTEBOOK / 1024
                ),
            ),
            Ok(text) => notebook = Some(text),
            Err(error) if error.kind() == io::ErrorKind::InvalidData => {
                report.error(
                    format!("{field}.guideType"),
                    format!("`{shown}` is not valid utf-8"),
                );
            }
            Err(error) => report.error(
                format!("{field}.guideType"),
                format!("cannot read `{shown}`: {error}"),
            ),
        }
    }

    let mut configs = BTreeMap::new();
    for (endpoint_field, endpoint) in endpoints {
        let Some(configuration_type) = endpoint.configuration_type else {
            continue;
        };
        let field = format!("{endpoint_field}.configurationType");
        let found = match plain_extension(configuration_type) {
            None => find_napalm(source, &stage_dir, &stage_name, endpoint, &field, report),
            Some(extension) => {
                let file_name = format!("{}.{extension}", endpoint.name);
                if source.is_file(&stage_dir.join("configs").join(&file_name)) {
                    Some((file_name, None))
                } else {
                    report.error(
                        &field,
                        format!(
                            "`{stage_name}/configs/{file_name}` does not exist \
                             (configurationType is {configuration_type})"
                        ),
                    );
                    None
                }
            }
        };
        let Some((file_name, driver)) = found else {
            continue;
        };
        let path = stage_dir.join("configs").join(&file_name);
        let shown = format!("{stage_name}/configs/{file_name}");
        match source.read(&path) {
            // The agents' caps (PROTOCOL.md [S2]): over them every Provision of the lesson
            // would be refused, so the lesson is refused at load.
            Ok(contents) if contents.len() > MAX_CONFIGURATION_FILE => report.error(
                &field,
                format!(
                    "`{shown}` holds {} bytes, over the {} KiB a configuration file may hold",
                    contents.len(),
                    MAX_CONFIGURATION_FILE / 1024
                ),
            ),
            Ok(contents) => {
                configs.insert(
                    endpoint.name.clone(),
                    StageConfig {
                        path,
                        driver,
                        contents,
                    },
                );
            }
            Err(error) if error.kind() == io::ErrorKind::InvalidData => {
                report.error(&field, format!("`{shown}` is not valid utf-8"));
            }
            Err(error) => report.error(&field, format!("cannot read `{shown}`: {error}")),
        }
    }

    let total: usize = configs.values().map(|c| c.contents.len()).sum();
    if total > MAX_CONFIGURATION_STAGE {
        report.error(
            field,
            format!(
                "the configuration files of `{stage_name}/configs/` hold {total} bytes together, \
                 over the {} KiB a stage's may hold",
                MAX_CONFIGURATION_STAGE / 1024
            ),
        );
    }

    let checks = scripts(
        source,
        &stage_dir,
        &stage_name,
        "checks",
        endpoints,
        field,
        report,
    );
    let solutions = scripts(
        source,
        &stage_dir,
        &stage_name,
        "solutions",
        endpoints,
        field,
        report,
    );

    (report.count() == before).then_some(StageFiles {
        guide,
        notebook,
        configs,
        checks,
        solutions,
    })
}

/// The check or solution files of a stage (`kind` is the directory: `checks` or `solutions`):
/// each `<endpoint>.sh` (run inside the endpoint) or `<endpoint>.py` (run from the
/// configurator), one per endpoint at most, held to the caps of configuration files since
/// they travel to agents the same way. A missing directory holds none.
fn scripts(
    source: &dyn Source,
    stage_dir: &Path,
    stage_name: &str,
    kind: &str,
    endpoints: &[(String, Endpoint)],
    field: &str,
    report: &mut FileProblems,
) -> BTreeMap<String, Script> {
    let dir = stage_dir.join(kind);
    let mut found = BTreeMap::new();
    if !source.is_dir(&dir) {
        return found;
    }
    let mut entries = match source.list(&dir) {
        Ok(entries) => entries,
        Err(error) => {
            report.error(
                field,
                format!("cannot list `{stage_name}/{kind}/`: {error}"),
            );
            return found;
        }
    };
    entries.sort();
    let names: Vec<&str> = endpoints.iter().map(|(_, e)| e.name.as_str()).collect();
    for (file_name, path) in entries {
        let file_name = file_name.to_string_lossy().into_owned();
        // Editors' and version control's files (`.gitkeep`, `.swp`) are not scripts.
        if file_name.starts_with('.') {
            continue;
        }
        let shown = format!("{stage_name}/{kind}/{file_name}");
        if source.is_dir(&path) {
            report.error(
                field,
                format!("`{shown}/` is a directory; {kind} are files named `<endpoint>.sh` or `<endpoint>.py`"),
            );
            continue;
        }
        let (endpoint, script_kind) = match file_name.rsplit_once('.') {
            Some((endpoint, "sh")) => (endpoint, ConfigurationType::Shell),
            Some((endpoint, "py")) => (endpoint, ConfigurationType::Python),
            _ => {
                report.error(
                    field,
                    format!("`{shown}` is not named `<endpoint>.sh` or `<endpoint>.py`"),
                );
                continue;
            }
        };
        if !names.contains(&endpoint) {
            report.error(
                field,
                format!(
                    "`{shown}` names no endpoint of this lesson (endpoints: {})",
                    names.join(", ")
                ),
            );
            continue;
        }
        if let Some(other) = found.get(endpoint).map(Script::file_name) {
            report.error(
                field,
                format!(
                    "`{stage_name}/{kind}/` has both `{other}` and `{file_name}` for endpoint `{endpoint}`: \
                     one per endpoint"
                ),
            );
            continue;
        }
        match source.read(&path) {
            Ok(contents) if contents.len() > MAX_CONFIGURATION_FILE => report.error(
                field,
                format!(
                    "`{shown}` holds {} bytes, over the {} KiB a file of {kind} may hold",
                    contents.len(),
                    MAX_CONFIGURATION_FILE / 1024
                ),
            ),
            Ok(contents) => {
                found.insert(
                    endpoint.to_owned(),
                    Script {
                        path,
                        kind: script_kind,
                        contents,
                    },
                );
            }
            Err(error) if error.kind() == io::ErrorKind::InvalidData => {
                report.error(field, format!("`{shown}` is not valid utf-8"));
            }
            Err(error) => report.error(field, format!("cannot read `{shown}`: {error}")),
        }
    }
    let total: usize = found.values().map(|s| s.contents.len()).sum();
    if total > MAX_CONFIGURATION_STAGE {
        report.error(
            field,
            format!(
                "the files of `{stage_name}/{kind}/` hold {total} bytes together, over the {}                  KiB a stage's may hold",
                MAX_CONFIGURATION_STAGE / 1024
            ),
        );
    }
    found
}

/// The extension of `<endpoint>.<extension>` config files, for every type but napalm, whose
/// file name carries a driver instead.
fn plain_extension(configuration_type: ConfigurationType) -> Option<&'static str> {
    match configuration_type {
        ConfigurationType::Python => Some("py"),
        ConfigurationType::Ansible => Some("yml"),
        ConfigurationType::Shell => Some("sh"),
        ConfigurationType::Napalm => None,
    }
}

/// Finds the one `<endpoint>-<driver>.txt` in the stage's `configs/`, returning its file name
/// and driver.
fn find_napalm(
    source: &dyn Source,
    stage_dir: &Path,
    stage_name: &str,
    endpoint: &Endpoint,
    field: &str,
    report: &mut FileProblems,
) -> Option<(String, Option<String>)> {
    let prefix = format!("{}-", endpoint.name);
    let mut matches = Vec::new();
    // A missing configs/ directory simply holds no config; other files may sit beside ours.
    if let Ok(entries) = source.list(&stage_dir.join("configs")) {
        for (file_name, path) in entries {
            let Ok(file_name) = file_name.into_string() else {
                continue;
            };
            let driver = file_name
                .strip_prefix(&prefix)
                .and_then(|rest| rest.strip_suffix(".txt"));
            if let Some(driver) = driver
                && NAPALM_DRIVERS.contains(&driver)
                && source.is_file(&path)
            {
                matches.push((file_name.clone(), Some(driver.to_owned())));
            }
        }
    }
    matches.sort();
    match matches.len() {
        0 => {
            report.error(
                field,
                format!(
                    "`{stage_name}/configs/{}-<driver>.txt` does not exist for any driver \
                     (configurationType is napalm; drivers are {})",
                    endpoint.name,
                    NAPALM_DRIVERS.join(", ")
                ),
            );
            None
        }
        1 => matches.pop(),
        _ => {
            let names: Vec<&str> = matches.iter().map(|(name, _)| name.as_str()).collect();
            report.error(
                field,
                format!(
                    "`{stage_name}/configs/` has several napalm configs for `{}`, so the driver \
                     is ambiguous: {}",
                    endpoint.name,
                    names.join(", ")
                ),
            );
            None
        }
    }
}
