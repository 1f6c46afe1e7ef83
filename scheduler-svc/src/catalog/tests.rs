//! Data-driven tests: each writes a small curriculum to a temporary directory through [`check`]
//! and compares the error lines (or their absence) with what is expected. [`check`] also
//! validates the same files held in memory ([`Catalog::from_files`]) and asserts that both give
//! the same answer, so every case here is also a test that the two sources agree.

use std::collections::BTreeMap;
use std::fs;
use std::num::NonZeroU16;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{
    Catalog, CatalogErrors, Category, CollectionType, ConfigurationType, Flavor, GuideType,
    PresentationKind, Tier,
};

/// Marks a [`BASE`] file that a test wants absent.
const ABSENT: &str = "\0absent";

/// Files every test curriculum starts with: the curriculum's meta file, one image, one
/// collection. Tests add lessons, and may replace or (with [`ABSENT`]) remove these.
const BASE: &[(&str, &str)] = &[
    (
        "curriculum.meta.yaml",
        "
        name: test
        description: a curriculum for tests
        website: https://example.com
        aVer: 0.6.0
        gitRoot: https://example.com/curriculum.git
        ",
    ),
    (
        "images/box/image.meta.yaml",
        "
        slug: box
        description: busybox
        flavor: untrusted
        sshUser: antidote
        sshPassword: hunter2
        configUser: config
        configPassword: swordfish
        networkInterfaces: [eth1, eth2]
        ",
    ),
    (
        "collections/examples/collection.meta.yaml",
        "
        slug: examples
        title: Examples
        type: community
        tier: prod
        ",
    ),
];

/// The guide of `lessons/one/stage0`, the directory most tests put their lesson in.
const GUIDE0: (&str, &str) = ("lessons/one/stage0/guide.md", "# Stage 0\n");

/// The smallest valid lesson; tests copy it and change one thing.
const ONE: &str = "
    slug: one
    name: One
    category: fundamentals
    tier: prod
    endpoints:
    - name: web
      image: box
      presentations:
      - {name: page, port: 8080, type: http}
    stages:
    - {description: the only stage, guideType: markdown}
    ";

/// The lesson `yaml` in `lessons/one/`, with the guide of its first stage.
fn one(yaml: &str) -> Vec<(&str, &str)> {
    vec![("lessons/one/lesson.meta.yaml", yaml), GUIDE0]
}

/// Writes [`BASE`] overlaid with `files` (paths relative to the curriculum root, contents
/// dedented) to a fresh directory, loads it at `tier`, and asserts that the error lines, with
/// the directory's path removed, are exactly `expect`, and that the same files held in memory
/// give the same result. With nothing expected, returns the catalog.
#[track_caller]
fn check(files: &[(&str, &str)], tier: Tier, expect: &[&str]) -> Option<Catalog> {
    let dir = tempfile::tempdir().expect("temporary directory");
    let mut all: Vec<(&str, &str)> = BASE.to_vec();
    for (path, contents) in files {
        all.retain(|(base, _)| base != path);
        all.push((path, contents));
    }
    let mut memory = BTreeMap::new();
    for (path, contents) in all {
        if contents == ABSENT {
            continue;
        }
        memory.insert(path, dedent(contents));
        let path = dir.path().join(path);
        fs::create_dir_all(path.parent().expect("files are below the root")).expect("mkdir");
        fs::write(&path, dedent(contents)).expect("write");
    }
    let prefix = format!("{}/", dir.path().display());
    let loaded = Catalog::load(dir.path(), tier);
    same(&loaded, &Catalog::from_files(dir.path(), &memory, tier));
    match loaded {
        Ok(catalog) => {
            assert!(
                expect.is_empty(),
                "loaded, but expected errors:\n{expect:#?}"
            );
            Some(catalog)
        }
        Err(errors) => {
            let got: Vec<String> = errors
                .0
                .iter()
                .map(|error| error.to_string().replace(&prefix, ""))
                .collect();
            assert_eq!(got, expect, "errors differ");
            None
        }
    }
}

/// Asserts that loading from disk and from memory gave the same catalog or the same errors.
#[track_caller]
fn same(disk: &Result<Catalog, CatalogErrors>, memory: &Result<Catalog, CatalogErrors>) {
    match (disk, memory) {
        (Ok(disk), Ok(memory)) => {
            assert_eq!(disk.root, memory.root);
            assert_eq!(disk.meta, memory.meta);
            assert_eq!(disk.collections, memory.collections);
            assert_eq!(disk.images, memory.images);
            assert_eq!(disk.lessons, memory.lessons);
            assert_eq!(disk.skipped, memory.skipped);
            assert_eq!(disk.skipped_collections, memory.skipped_collections);
            assert_eq!(disk.warnings, memory.warnings);
        }
        (Err(disk), Err(memory)) => assert_eq!(disk, memory, "disk and memory disagree"),
        (disk, memory) => panic!("disk and memory disagree:\n{disk:?}\n{memory:?}"),
    }
}

/// Every file under `dir` (hidden ones too), by path relative to it, as bytes.
fn files_under(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    fn walk(root: &Path, dir: &Path, files: &mut BTreeMap<PathBuf, Vec<u8>>) {
        for entry in fs::read_dir(dir).expect("list") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                walk(root, &path, files);
            } else {
                let relative = path.strip_prefix(root).expect("below the root").to_owned();
                files.insert(relative, fs::read(&path).expect("read"));
            }
        }
    }
    let mut files = BTreeMap::new();
    walk(dir, dir, &mut files);
    files
}

/// Like [`check`], expecting success.
#[track_caller]
fn load(files: &[(&str, &str)], tier: Tier) -> Catalog {
    check(files, tier, &[]).expect("check returns the catalog when no error is expected")
}

/// The catalog's warnings as lines, with the curriculum's path removed.
fn warnings(catalog: &Catalog) -> Vec<String> {
    let prefix = format!("{}/", catalog.root.display());
    catalog
        .warnings
        .iter()
        .map(|warning| warning.to_string().replace(&prefix, ""))
        .collect()
}

/// Strips the indentation common to all non-blank lines, so YAML can sit indented in the test.
fn dedent(text: &str) -> String {
    let indent = text
        .lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| line.len() - line.trim_start().len())
        .min()
        .unwrap_or(0);
    let mut out = String::new();
    for line in text.lines().skip_while(|line| line.trim().is_empty()) {
        out.push_str(line.get(indent..).unwrap_or("").trim_end());
        out.push('\n');
    }
    out
}

fn port(number: u16) -> NonZeroU16 {
    NonZeroU16::new(number).expect("test ports are not zero")
}

// ---- loading what is valid ----

#[test]
fn minimal_lesson_loads() {
    let catalog = load(&one(ONE), Tier::Prod);
    assert_eq!(catalog.meta.name, "test");
    assert_eq!(catalog.meta.a_ver.as_deref(), Some("0.6.0"));
    let lesson = catalog.lesson("one").expect("lesson one");
    assert_eq!(lesson.name, "One");
    assert_eq!(lesson.category, Category::Fundamentals);
    assert_eq!(lesson.tier, Tier::Prod);
    assert_eq!(lesson.ready_delay, Duration::ZERO);
    assert_eq!(lesson.description, "");
    assert_eq!(lesson.collection, None);
    assert_eq!(lesson.endpoints.len(), 1);
    let web = &lesson.endpoints[0];
    assert_eq!((web.name.as_str(), web.image.as_str()), ("web", "box"));
    assert_eq!(web.configuration_type, None);
    assert_eq!(web.presentations[0].port, port(8080));
    assert_eq!(web.presentations[0].kind, PresentationKind::Http);
    assert_eq!(lesson.stages.len(), 1);
    assert_eq!(lesson.stages[0].index, 0);
    assert_eq!(lesson.stages[0].guide_type, GuideType::Markdown);
    assert!(
        lesson.stages[0]
            .guide
            .ends_with("lessons/one/stage0/guide.md")
    );
    assert!(lesson.stages[0].configs.is_empty());
    assert!(lesson.dir.ends_with("lessons/one"));
    let image = catalog.image("box").expect("image box");
    assert_eq!(image.flavor, Flavor::Untrusted);
    assert_eq!(image.ssh_password.as_deref(), Some("hunter2"));
    assert!(!image.enable_forwarding);
    assert_eq!(image.network_interfaces, ["eth1", "eth2"]);
    let collection = catalog.collection("examples").expect("collection");
    assert_eq!(collection.kind, CollectionType::Community);
    assert!(catalog.skipped.is_empty());
}

#[test]
fn every_key_and_configuration_type_loads() {
    let lesson = "
        slug: full
        name: Full
        category: workflows
        tier: prod
        prereqs: [one]
        description: every key there is
        shortDescription: full
        tags: [a, 2019, true]
        authors:
        - {name: Ada, link: https://example.com/ada}
        - {name: Bob}
        collection: examples
        diagram: https://example.com/d.png
        video: ''
        readyDelay: 30
        endpoints:
        - name: py
          image: box
          configurationType: python
          additionalPorts: [830]
        - name: ans
          image: box
          configurationType: ansible
          additionalPorts: [830, 831]
        - name: nap
          image: box
          configurationType: napalm
          presentations:
          - {name: cli, port: 22, type: ssh}
        - name: sh
          image: box
          configurationType: shell
          presentations:
          - {name: cli, port: 22, type: ssh}
          - {name: web, port: 8080, type: http}
        connections:
        - {a: py, b: ans, subnet: 10.1.0.0/24}
        - {a: nap, b: sh, subnet: 'fd00:1::/64'}
        - {a: sh, b: py}
        stages:
        - description: first
          guideType: markdown
          stageVideo: https://example.com/v0
        - description: second
          guideType: jupyter
        ";
    let mut files = one(ONE);
    files.extend([
        ("lessons/full/lesson.meta.yaml", lesson),
        ("lessons/full/stage0/guide.md", "# zero"),
        ("lessons/full/stage0/configs/py.py", "print('stage 0')"),
        ("lessons/full/stage0/configs/ans.yml", "- hosts: all"),
        (
            "lessons/full/stage0/configs/nap-junos.txt",
            "set system host-name nap",
        ),
        ("lessons/full/stage0/configs/sh.sh", "echo zero"),
        (
            "lessons/full/stage0/configs/notes.txt",
            "other files may sit beside configs",
        ),
        ("lessons/full/stage1/guide.ipynb", "{}"),
        ("lessons/full/stage1/configs/py.py", "print('stage 1')"),
        ("lessons/full/stage1/configs/ans.yml", "- hosts: all"),
        (
            "lessons/full/stage1/configs/nap-nxos_ssh.txt",
            "hostname nap",
        ),
        ("lessons/full/stage1/configs/sh.sh", "echo one"),
    ]);
    let catalog = load(&files, Tier::Prod);
    let lesson = catalog.lesson("full").expect("lesson full");
    assert_eq!(lesson.category, Category::Workflows);
    assert_eq!(lesson.prereqs, ["one"]);
    assert_eq!(lesson.tags, ["a", "2019", "true"]);
    assert_eq!(lesson.authors.len(), 2);
    assert_eq!(
        lesson.authors[0].link.as_deref(),
        Some("https://example.com/ada")
    );
    assert_eq!(lesson.authors[1].link, None);
    assert_eq!(lesson.collection.as_deref(), Some("examples"));
    assert_eq!(lesson.diagram.as_deref(), Some("https://example.com/d.png"));
    assert_eq!(lesson.video, None, "an empty string counts as absent");
    assert_eq!(lesson.ready_delay, Duration::from_secs(30));
    let types: Vec<_> = lesson
        .endpoints
        .iter()
        .map(|endpoint| endpoint.configuration_type)
        .collect();
    assert_eq!(
        types,
        [
            Some(ConfigurationType::Python),
            Some(ConfigurationType::Ansible),
            Some(ConfigurationType::Napalm),
            Some(ConfigurationType::Shell),
        ]
    );
    assert_eq!(lesson.endpoints[1].additional_ports, [port(830), port(831)]);
    assert_eq!(lesson.connections.len(), 3);
    assert_eq!(
        lesson.connections[0].subnet,
        Some("10.1.0.0/24".parse().expect("subnet"))
    );
    assert_eq!(
        lesson.connections[1].subnet,
        Some("fd00:1::/64".parse().expect("subnet"))
    );
    assert_eq!(lesson.connections[2].subnet, None);

    let stage0 = &lesson.stages[0];
    assert_eq!(
        stage0.stage_video.as_deref(),
        Some("https://example.com/v0")
    );
    assert_eq!(stage0.configs.len(), 4);
    assert_eq!(stage0.configs["py"].contents, "print('stage 0')\n");
    assert_eq!(stage0.configs["sh"].contents, "echo zero\n");
    assert!(stage0.configs["sh"].path.ends_with("stage0/configs/sh.sh"));
    assert_eq!(stage0.configs["sh"].driver, None);
    assert_eq!(stage0.configs["nap"].driver.as_deref(), Some("junos"));
    let stage1 = &lesson.stages[1];
    assert_eq!(stage1.index, 1);
    assert_eq!(stage1.guide_type, GuideType::Jupyter);
    assert!(stage1.guide.ends_with("stage1/guide.ipynb"));
    assert_eq!(stage1.notebook.as_deref(), Some("{}\n"));
    assert_eq!(stage0.notebook, None);
    assert!(lesson.has_jupyter_guide());
    assert_eq!(stage1.configs["nap"].driver.as_deref(), Some("nxos_ssh"));
    assert_eq!(stage1.configs["ans"].contents, "- hosts: all\n");
}

#[test]
fn an_empty_curriculum_needs_no_images_collections_or_lessons() {
    let catalog = load(
        &[
            ("images/box/image.meta.yaml", ABSENT),
            ("collections/examples/collection.meta.yaml", ABSENT),
        ],
        Tier::Local,
    );
    assert!(catalog.images.is_empty());
    assert!(catalog.collections.is_empty());
    assert!(catalog.lessons.is_empty());
}

#[test]
fn null_and_scalar_values_are_read_as_antidote_read_them() {
    // `key:` with nothing after it is null, which Antidote's loader read as empty.
    let catalog = load(
        &one("
            slug: one
            name: One
            category: tools
            tier: prod
            prereqs:
            diagram:
            tags: [2020, 1.5]
            endpoints:
            - name: web
              image: box
              configurationType:
              additionalPorts: [22]
            stages:
            - {guideType: markdown}
            "),
        Tier::Prod,
    );
    let lesson = catalog.lesson("one").expect("lesson one");
    assert!(lesson.prereqs.is_empty());
    assert_eq!(lesson.diagram, None);
    assert_eq!(lesson.tags, ["2020", "1.5"]);
    assert_eq!(lesson.endpoints[0].configuration_type, None);
    assert_eq!(lesson.stages[0].description, "");
}

#[test]
fn anchors_and_merge_keys_work_as_in_antidote() {
    let catalog = load(
        &one("
            slug: one
            name: One
            category: tools
            tier: prod
            endpoints:
            - &linux
              name: linux1
              image: box
              presentations: [{name: cli, port: 22, type: ssh}]
            - <<: *linux
              name: linux2
            stages: [{guideType: markdown}]
            "),
        Tier::Prod,
    );
    let lesson = catalog.lesson("one").expect("lesson one");
    let names: Vec<&str> = lesson.endpoints.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["linux1", "linux2"]);
    assert_eq!(lesson.endpoints[1].presentations[0].port, port(22));
}

#[test]
fn lessons_and_images_may_sit_in_nested_directories() {
    let catalog = load(
        &[
            ("lessons/fundamentals/one/lesson.meta.yaml", ONE),
            ("lessons/fundamentals/one/stage0/guide.md", "# hi"),
            ("images/box/image.meta.yaml", ABSENT),
            (
                "images/vendor/box/image.meta.yaml",
                "{slug: box, flavor: trusted}",
            ),
            // Hidden directories are not searched.
            ("lessons/.git/x/lesson.meta.yaml", "not: a lesson"),
        ],
        Tier::Prod,
    );
    assert!(catalog.lesson("one").is_some());
    assert_eq!(catalog.image("box").expect("box").flavor, Flavor::Trusted);
}

// ---- tiers ----

/// Three valid lessons, one per tier, in `lessons/{local,ptr,prod}/`.
fn tiered() -> Vec<(&'static str, &'static str)> {
    let mut files = Vec::new();
    for (file, yaml, guide) in [
        (
            "lessons/local/lesson.meta.yaml",
            "
            {slug: at-local, name: L, category: tools, tier: local,
             endpoints: [{name: e, image: box, additionalPorts: [1]}], stages: [{guideType: markdown}]}
            ",
            "lessons/local/stage0/guide.md",
        ),
        (
            "lessons/ptr/lesson.meta.yaml",
            "
            {slug: at-ptr, name: P, category: tools, tier: ptr,
             endpoints: [{name: e, image: box, additionalPorts: [1]}], stages: [{guideType: markdown}]}
            ",
            "lessons/ptr/stage0/guide.md",
        ),
        (
            "lessons/prod/lesson.meta.yaml",
            "
            {slug: at-prod, name: Q, category: tools, tier: prod,
             endpoints: [{name: e, image: box, additionalPorts: [1]}], stages: [{guideType: markdown}]}
            ",
            "lessons/prod/stage0/guide.md",
        ),
    ] {
        files.push((file, yaml));
        files.push((guide, "# guide"));
    }
    files.push((
        "collections/local/collection.meta.yaml",
        "{slug: local-only, title: L, type: vendor, tier: local}",
    ));
    files
}

#[test]
fn tier_filters_lessons_and_collections() {
    let slugs = |catalog: &Catalog| catalog.lessons.keys().cloned().collect::<Vec<_>>();

    let local = load(&tiered(), Tier::Local);
    assert_eq!(slugs(&local), ["at-local", "at-prod", "at-ptr"]);
    assert!(local.skipped.is_empty());
    assert!(local.collection("local-only").is_some());

    let ptr = load(&tiered(), Tier::Ptr);
    assert_eq!(slugs(&ptr), ["at-prod", "at-ptr"]);
    assert_eq!(ptr.skipped, ["at-local"]);
    assert_eq!(ptr.skipped_collections, ["local-only"]);
    assert!(ptr.lesson("at-local").is_none());

    let prod = load(&tiered(), Tier::Prod);
    assert_eq!(slugs(&prod), ["at-prod"]);
    assert_eq!(prod.skipped, ["at-local", "at-ptr"]);
    assert!(prod.collection("local-only").is_none());
    assert!(prod.collection("examples").is_some());
}

#[test]
fn skipped_lessons_are_still_validated() {
    // Their structure, so that `validate` at any tier finds every malformed file.
    check(
        &one("
            slug: one
            name: One
            category: tools
            tier: local
            endpoints: [{name: web, image: nope, additionalPorts: [0]}]
            stages: [{guideType: markdown}]
            "),
        Tier::Prod,
        &[
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[0].additionalPorts[0]`: `0` is not a port (a whole number from 1 to 65535)",
        ],
    );
}

/// Prod lessons and a ptr lesson naming an image that `images/` does not define, as in real
/// Antidote curricula.
fn with_a_ptr_lesson_naming_an_undefined_image() -> Vec<(&'static str, &'static str)> {
    let mut files = tiered();
    files.extend([
        (
            "lessons/draft/lesson.meta.yaml",
            "
            {slug: draft, name: D, category: tools, tier: ptr,
             endpoints: [{name: vqfx, image: vqfx-snap1, additionalPorts: [22]},
                         {name: web, image: box, additionalPorts: [1]}],
             stages: [{guideType: markdown}]}
            ",
        ),
        ("lessons/draft/stage0/guide.md", "# draft"),
    ]);
    files
}

#[test]
fn a_skipped_lesson_naming_an_undefined_image_is_a_warning() {
    let files = with_a_ptr_lesson_naming_an_undefined_image();
    let prod = load(&files, Tier::Prod);
    assert_eq!(
        warnings(&prod),
        [
            "lessons/draft/lesson.meta.yaml: lesson `draft`: `endpoints[0].image`: no image with slug `vqfx-snap1`"
        ]
    );
    assert_eq!(prod.lessons.keys().collect::<Vec<_>>(), ["at-prod"]);
    assert_eq!(prod.skipped, ["at-local", "at-ptr", "draft"]);
    assert!(
        prod.summary(Tier::Prod).ends_with(
            "valid at tier prod: 1 lesson loaded (3 skipped below the tier), 1 collection loaded \
             (1 skipped), 1 image, 1 warning"
        ),
        "{}",
        prod.summary(Tier::Prod)
    );
}

#[test]
fn a_loaded_lesson_naming_an_undefined_image_is_an_error() {
    let files = with_a_ptr_lesson_naming_an_undefined_image();
    for tier in [Tier::Ptr, Tier::Local] {
        check(
            &files,
            tier,
            &[
                "lessons/draft/lesson.meta.yaml: lesson `draft`: `endpoints[0].image`: no image with slug `vqfx-snap1`",
            ],
        );
    }
}

#[test]
fn every_broken_reference_of_loaded_lessons_is_reported_at_once() {
    let mut files = with_a_ptr_lesson_naming_an_undefined_image();
    files.extend([
        (
            "lessons/other/lesson.meta.yaml",
            "
            {slug: other, name: O, category: tools, tier: prod, collection: gone,
             endpoints: [{name: a, image: gone-a, additionalPorts: [1]},
                         {name: b, image: gone-b, additionalPorts: [1]}],
             stages: [{guideType: markdown}]}
            ",
        ),
        ("lessons/other/stage0/guide.md", "# other"),
    ]);
    check(
        &files,
        Tier::Ptr,
        &[
            "lessons/draft/lesson.meta.yaml: lesson `draft`: `endpoints[0].image`: no image with slug `vqfx-snap1`",
            "lessons/other/lesson.meta.yaml: lesson `other`: `endpoints[0].image`: no image with slug `gone-a`",
            "lessons/other/lesson.meta.yaml: lesson `other`: `endpoints[1].image`: no image with slug `gone-b`",
            "lessons/other/lesson.meta.yaml: lesson `other`: `collection`: no collection with slug `gone`",
        ],
    );
}

#[test]
fn a_skipped_lessons_broken_collection_and_prereqs_are_warnings() {
    let mut files = tiered();
    files.extend(one("
        slug: one
        name: One
        category: tools
        tier: ptr
        collection: local-only
        prereqs: [at-local, nowhere]
        endpoints: [{name: web, image: box, additionalPorts: [1]}]
        stages: [{guideType: markdown}]
        "));
    let prod = load(&files, Tier::Prod);
    assert_eq!(
        warnings(&prod),
        [
            "lessons/one/lesson.meta.yaml: lesson `one`: `collection`: collection `local-only` has tier local, below this lesson's tier ptr, so it is skipped wherever this lesson loads",
            "lessons/one/lesson.meta.yaml: lesson `one`: `prereqs[0]`: lesson `at-local` has tier local, below this lesson's tier ptr, so it is skipped wherever this lesson loads",
            "lessons/one/lesson.meta.yaml: lesson `one`: `prereqs[1]`: no lesson with slug `nowhere`",
        ]
    );
    assert!(prod.skipped.contains(&"one".to_owned()));
    // Loaded, the same lesson is refused for the same reasons.
    check(
        &files,
        Tier::Ptr,
        &[
            "lessons/one/lesson.meta.yaml: lesson `one`: `collection`: collection `local-only` has tier local, below this lesson's tier ptr, so it is skipped wherever this lesson loads",
            "lessons/one/lesson.meta.yaml: lesson `one`: `prereqs[0]`: lesson `at-local` has tier local, below this lesson's tier ptr, so it is skipped wherever this lesson loads",
            "lessons/one/lesson.meta.yaml: lesson `one`: `prereqs[1]`: no lesson with slug `nowhere`",
        ],
    );
}

#[test]
fn a_clean_curriculum_has_no_warnings() {
    for tier in Tier::ALL {
        assert!(load(&tiered(), *tier).warnings.is_empty());
    }
}

#[test]
fn tier_parses_displays_orders_and_serialises_in_lowercase() {
    assert!(Tier::Local < Tier::Ptr && Tier::Ptr < Tier::Prod);
    for tier in Tier::ALL {
        assert_eq!(tier.to_string().parse::<Tier>(), Ok(*tier));
    }
    assert_eq!("ptr".parse::<Tier>(), Ok(Tier::Ptr));
    assert_eq!(
        "Prod".parse::<Tier>().map_err(|error| error.to_string()),
        Err("unknown tier `Prod` (expected one of local, ptr, prod)".to_owned())
    );
    assert_eq!(
        serde_yaml::to_string(&Tier::Prod).expect("serialise"),
        "prod\n"
    );
    assert_eq!(
        serde_yaml::from_str::<Tier>("local").expect("parse"),
        Tier::Local
    );
    assert_eq!(ConfigurationType::Shell.to_string(), "shell");
    assert_eq!(GuideType::Jupyter.file_name(), "guide.ipynb");
}

// ---- the format's rules, one by one ----

#[test]
fn unknown_fields_are_reported_everywhere_at_once() {
    let mut files = one("
        slug: one
        name: One
        category: tools
        tier: prod
        lessonId: 12
        short_description: snake case
        authors: [{name: A, email: a@example.com}]
        endpoints:
        - name: web
          image: box
          imag: box
          presentations:
          - {name: page, prot: 8080, port: 8080, type: http}
        connections:
        - {a: web, b: web2, subnetz: 10.0.0.0/24, \"\": x}
        stages:
        - {guideType: markdown, guide: x}
        ");
    files.extend([
        (
            "images/box/image.meta.yaml",
            "{slug: box, flavor: trusted, privileged: true}",
        ),
        (
            "collections/examples/collection.meta.yaml",
            "{slug: examples, title: E, type: vendor, tier: prod, enabled: false, id: 1}",
        ),
        ("curriculum.meta.yaml", "{name: test, version: 2, '': 3}"),
    ]);
    check(
        &files,
        Tier::Prod,
        &[
            "collections/examples/collection.meta.yaml: `enabled`: unknown field",
            "collections/examples/collection.meta.yaml: `id`: unknown field",
            "curriculum.meta.yaml: `version`: unknown field",
            "curriculum.meta.yaml: `\"\"`: unknown field",
            "images/box/image.meta.yaml: `privileged`: unknown field",
            "lessons/one/lesson.meta.yaml: lesson `one`: `lessonId`: unknown field",
            "lessons/one/lesson.meta.yaml: lesson `one`: `short_description`: unknown field (did you mean `shortDescription`?)",
            "lessons/one/lesson.meta.yaml: lesson `one`: `authors[0].email`: unknown field",
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[0].imag`: unknown field (did you mean `image`?)",
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[0].presentations[0].prot`: unknown field (did you mean `port`?)",
            "lessons/one/lesson.meta.yaml: lesson `one`: `connections[0].subnetz`: unknown field (did you mean `subnet`?)",
            "lessons/one/lesson.meta.yaml: lesson `one`: `connections[0].\"\"`: unknown field",
            "lessons/one/lesson.meta.yaml: lesson `one`: `connections[0].b`: no endpoint named `web2` in this lesson",
            "lessons/one/lesson.meta.yaml: lesson `one`: `stages[0].guide`: unknown field",
        ],
    );
}

#[test]
fn malformed_yaml_is_one_error_with_line_and_column() {
    check(
        &one("slug: one\nname: [unclosed\ncategory: tools\n"),
        Tier::Prod,
        &[
            "lessons/one/lesson.meta.yaml: malformed yaml: did not find expected ',' or ']' at line 3 column 9, while parsing a flow sequence at line 2 column 7",
        ],
    );
}

#[test]
fn files_that_are_not_mappings_or_not_text() {
    let mut files = one("- slug: one");
    files.push(("images/box/image.meta.yaml", ""));
    files.push(("collections/examples/collection.meta.yaml", "just a string"));
    check(
        &files,
        Tier::Prod,
        &[
            "collections/examples/collection.meta.yaml: the file must be a mapping, not `just a string`",
            "images/box/image.meta.yaml: the file must be a mapping, not null",
            "lessons/one/lesson.meta.yaml: the file must be a mapping, not a list",
        ],
    );
}

#[test]
fn a_missing_curriculum_meta_or_directory_is_an_error() {
    check(
        &[("curriculum.meta.yaml", ABSENT)],
        Tier::Prod,
        &["curriculum.meta.yaml: file does not exist"],
    );
    let errors = Catalog::load(std::path::Path::new("/nonexistent/curriculum"), Tier::Prod)
        .expect_err("no such directory");
    assert_eq!(
        errors.to_string(),
        "1 curriculum error:\n/nonexistent/curriculum: curriculum directory does not exist"
    );
}

#[test]
fn misnamed_meta_files_are_reported_not_ignored() {
    check(
        &[
            ("lessons/one/lesson.meta.yml", ONE),
            (
                "images/other/Image.meta.yaml",
                "{slug: other, flavor: trusted}",
            ),
        ],
        Tier::Prod,
        &[
            "images/other/Image.meta.yaml: not read: the file must be named `image.meta.yaml`",
            "lessons/one/lesson.meta.yml: not read: the file must be named `lesson.meta.yaml`",
        ],
    );
}

#[test]
fn required_fields() {
    let mut files = one("
        slug: one
        endpoints:
        - {additionalPorts: [1]}
        - name: web
          image: box
          presentations: [{}]
        connections: [{}]
        authors: [{link: x}]
        stages: [{description: no guide type}]
        ");
    files.extend([
        ("images/box/image.meta.yaml", "{slug: box}"),
        (
            "collections/examples/collection.meta.yaml",
            "{slug: examples}",
        ),
        ("curriculum.meta.yaml", "{description: nameless}"),
    ]);
    check(
        &files,
        Tier::Prod,
        &[
            "collections/examples/collection.meta.yaml: `title`: is required",
            "collections/examples/collection.meta.yaml: `type`: is required",
            "collections/examples/collection.meta.yaml: `tier`: is required",
            "curriculum.meta.yaml: `name`: is required",
            "images/box/image.meta.yaml: `flavor`: is required",
            "lessons/one/lesson.meta.yaml: lesson `one`: `name`: is required",
            "lessons/one/lesson.meta.yaml: lesson `one`: `category`: is required",
            "lessons/one/lesson.meta.yaml: lesson `one`: `tier`: is required",
            "lessons/one/lesson.meta.yaml: lesson `one`: `authors[0].name`: is required",
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[0].name`: is required",
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[0].image`: is required",
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[1].presentations[0].name`: is required",
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[1].presentations[0].port`: is required",
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[1].presentations[0].type`: is required",
            "lessons/one/lesson.meta.yaml: lesson `one`: `connections[0].a`: is required",
            "lessons/one/lesson.meta.yaml: lesson `one`: `connections[0].b`: is required",
            "lessons/one/lesson.meta.yaml: lesson `one`: `stages[0].guideType`: is required",
        ],
    );
    check(
        &one("{name: No slug, slug: '', category: tools, tier: prod}"),
        Tier::Prod,
        &[
            "lessons/one/lesson.meta.yaml: `slug`: must not be empty",
            "lessons/one/lesson.meta.yaml: `endpoints`: a lesson needs at least one endpoint",
            "lessons/one/lesson.meta.yaml: `stages`: a lesson needs at least one stage",
        ],
    );
}

#[test]
fn wrong_types() {
    let mut files = one("
        slug: one
        name: [a, list]
        category: tools
        tier: prod
        tags: not-a-list
        readyDelay: soon
        endpoints:
        - name: web
          image: box
          additionalPorts: 22
          presentations: {name: page}
        - just a string
        stages: [{guideType: markdown}]
        ");
    files.push((
        "images/box/image.meta.yaml",
        "{slug: box, flavor: untrusted, enableForwarding: 'yes', networkInterfaces: [[eth1]]}",
    ));
    check(
        &files,
        Tier::Prod,
        &[
            "images/box/image.meta.yaml: `enableForwarding`: must be true or false, not `yes`",
            "images/box/image.meta.yaml: `networkInterfaces[0]`: must be a string, not a list",
            "lessons/one/lesson.meta.yaml: lesson `one`: `name`: must be a string, not a list",
            "lessons/one/lesson.meta.yaml: lesson `one`: `tags`: must be a list, not `not-a-list`",
            "lessons/one/lesson.meta.yaml: lesson `one`: `readyDelay`: must be a whole number, not `soon`",
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[0].additionalPorts`: must be a list, not `22`",
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[0].presentations`: must be a list, not a mapping",
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[0]`: an endpoint needs at least one presentation or additional port",
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[1]`: must be a mapping, not `just a string`",
        ],
    );
}

#[test]
fn bad_enum_values() {
    let mut files = one("
        slug: one
        name: One
        category: fundamental
        tier: production
        endpoints:
        - name: web
          image: box
          configurationType: puppet
          presentations: [{name: page, port: 80, type: https}]
        stages: [{guideType: html}]
        ");
    files.extend([
        (
            "images/box/image.meta.yaml",
            "{slug: box, flavor: privileged}",
        ),
        (
            "collections/examples/collection.meta.yaml",
            "{slug: examples, title: E, type: partner, tier: staging}",
        ),
    ]);
    check(
        &files,
        Tier::Prod,
        &[
            "collections/examples/collection.meta.yaml: `type`: unknown collection type `partner` (expected one of vendor, community, consultancy)",
            "collections/examples/collection.meta.yaml: `tier`: unknown tier `staging` (expected one of local, ptr, prod)",
            "images/box/image.meta.yaml: `flavor`: unknown flavor `privileged` (expected one of trusted, untrusted, legacy)",
            "lessons/one/lesson.meta.yaml: lesson `one`: `category`: unknown category `fundamental` (expected one of fundamentals, tools, workflows)",
            "lessons/one/lesson.meta.yaml: lesson `one`: `tier`: unknown tier `production` (expected one of local, ptr, prod)",
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[0].configurationType`: unknown configuration type `puppet` (expected one of python, ansible, napalm, shell)",
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[0].presentations[0].type`: unknown presentation type `https` (expected one of ssh, http)",
            "lessons/one/lesson.meta.yaml: lesson `one`: `stages[0].guideType`: unknown guide type `html` (expected one of markdown, jupyter)",
        ],
    );
}

#[test]
fn slug_patterns() {
    let mut files = one("
        slug: One_Lesson
        name: One
        category: tools
        tier: prod
        collection: ex4mples
        endpoints: [{name: web, image: my/box, additionalPorts: [1]}]
        stages: [{guideType: markdown}]
        ");
    files.extend([
        (
            "images/box/image.meta.yaml",
            "{slug: my/box, flavor: trusted}",
        ),
        (
            "collections/examples/collection.meta.yaml",
            "{slug: ex4mples, title: E, type: vendor, tier: prod}",
        ),
    ]);
    check(
        &files,
        Tier::Prod,
        &[
            "collections/examples/collection.meta.yaml: `slug`: `ex4mples` does not match ^[a-z-]+$",
            "images/box/image.meta.yaml: `slug`: `my/box` does not match ^[A-Za-z0-9-]+$",
            "lessons/one/lesson.meta.yaml: lesson `One_Lesson`: `slug`: `One_Lesson` does not match ^[a-z0-9-]+$",
        ],
    );
}

#[test]
fn duplicate_slugs() {
    let mut files = one(ONE);
    files.extend([
        ("lessons/two/lesson.meta.yaml", ONE),
        ("lessons/two/stage0/guide.md", "# again"),
        (
            "images/box2/image.meta.yaml",
            "{slug: box, flavor: trusted}",
        ),
        (
            "collections/again/collection.meta.yaml",
            "{slug: examples, title: E, type: vendor, tier: prod}",
        ),
    ]);
    check(
        &files,
        Tier::Prod,
        &[
            "collections/examples/collection.meta.yaml: `slug`: slug `examples` is already used by collections/again/collection.meta.yaml",
            "images/box2/image.meta.yaml: `slug`: slug `box` is already used by images/box/image.meta.yaml",
            "lessons/two/lesson.meta.yaml: lesson `one`: `slug`: slug `one` is already used by lessons/one/lesson.meta.yaml",
        ],
    );
}

#[test]
fn duplicate_endpoint_and_presentation_names() {
    check(
        &one("
            slug: one
            name: One
            category: tools
            tier: prod
            endpoints:
            - name: web
              image: box
              presentations:
              - {name: cli, port: 22, type: ssh}
              - {name: page, port: 80, type: http}
              - {name: cli, port: 2222, type: ssh}
            - name: web
              image: box
              additionalPorts: [1]
            stages: [{guideType: markdown}]
            "),
        Tier::Prod,
        &[
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[0].presentations[2].name`: presentation `cli` is already defined at `endpoints[0].presentations[0]`",
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[1].name`: endpoint `web` is already defined at `endpoints[0]`",
        ],
    );
}

#[test]
fn endpoint_names_must_be_dns_labels() {
    check(
        &one("
            slug: one
            name: One
            category: tools
            tier: prod
            endpoints:
            - {name: Web, image: box, additionalPorts: [1]}
            - {name: ../../etc, image: box, additionalPorts: [1]}
            - {name: web-, image: box, additionalPorts: [1]}
            - {name: web-1, image: box, additionalPorts: [1]}
            stages: [{guideType: markdown}]
            "),
        Tier::Prod,
        &[
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[0].name`: `Web` must be a lowercase dns label: ^[a-z]([a-z0-9-]*[a-z0-9])?$, at most 63 characters",
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[1].name`: `../../etc` must be a lowercase dns label: ^[a-z]([a-z0-9-]*[a-z0-9])?$, at most 63 characters",
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[2].name`: `web-` must be a lowercase dns label: ^[a-z]([a-z0-9-]*[a-z0-9])?$, at most 63 characters",
        ],
    );
}

#[test]
fn eth0_and_repeated_interfaces_are_rejected() {
    check(
        &[(
            "images/box/image.meta.yaml",
            "{slug: box, flavor: trusted, networkInterfaces: [eth0, eth1, eth1]}",
        )],
        Tier::Prod,
        &[
            "images/box/image.meta.yaml: `networkInterfaces[0]`: `eth0` is reserved for the management network and cannot carry connections",
            "images/box/image.meta.yaml: `networkInterfaces[2]`: `eth1` is listed twice",
        ],
    );
}

#[test]
fn endpoints_must_use_existing_images() {
    let mut files = one("
        slug: one
        name: One
        category: tools
        tier: prod
        endpoints:
        - {name: a, image: nope, configurationType: shell, additionalPorts: [1]}
        - {name: b, image: broken, additionalPorts: [1]}
        stages: [{guideType: markdown}]
        ");
    // A broken image is reported once, in its own file, not again at every endpoint using it;
    // an endpoint with a wrong image still has its config files checked.
    files.push((
        "images/broken/image.meta.yaml",
        "{slug: broken, flavor: weird}",
    ));
    check(
        &files,
        Tier::Prod,
        &[
            "images/broken/image.meta.yaml: `flavor`: unknown flavor `weird` (expected one of trusted, untrusted, legacy)",
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[0].image`: no image with slug `nope`",
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[0].configurationType`: `stage0/configs/a.sh` does not exist (configurationType is shell)",
        ],
    );
}

#[test]
fn connections() {
    check(
        &one("
            slug: one
            name: One
            category: tools
            tier: prod
            endpoints:
            - {name: a, image: box, additionalPorts: [1]}
            - {name: b, image: box, additionalPorts: [1]}
            connections:
            - {a: a, b: c}
            - {a: z, b: b}
            - {a: a, b: a}
            - {a: a, b: b, subnet: 10.0.0.0/33}
            - {a: a, b: b, subnet: ten}
            - {a: a, b: b, subnet: 10.0.0.1/24}
            - {a: a, b: b, subnet: 10.0.0.0}
            - {a: a, b: b, subnet: '2001:db8::/32'}
            stages: [{guideType: markdown}]
            "),
        Tier::Prod,
        &[
            "lessons/one/lesson.meta.yaml: lesson `one`: `connections[0].b`: no endpoint named `c` in this lesson",
            "lessons/one/lesson.meta.yaml: lesson `one`: `connections[1].a`: no endpoint named `z` in this lesson",
            "lessons/one/lesson.meta.yaml: lesson `one`: `connections[2]`: connects endpoint `a` to itself",
            "lessons/one/lesson.meta.yaml: lesson `one`: `connections[3].subnet`: `10.0.0.0/33` is not a subnet in cidr notation, e.g. 10.1.0.0/24",
            "lessons/one/lesson.meta.yaml: lesson `one`: `connections[4].subnet`: `ten` is not a subnet in cidr notation, e.g. 10.1.0.0/24",
            "lessons/one/lesson.meta.yaml: lesson `one`: `connections[5].subnet`: `10.0.0.1/24` has host bits set (the network is `10.0.0.0/24`)",
            "lessons/one/lesson.meta.yaml: lesson `one`: `connections[6].subnet`: `10.0.0.0` is not a subnet in cidr notation, e.g. 10.1.0.0/24",
        ],
    );
}

#[test]
fn bad_ports() {
    check(
        &one("
            slug: one
            name: One
            category: tools
            tier: prod
            endpoints:
            - name: web
              image: box
              additionalPorts: [0, 65535, 65536, -1, 1.5, '22', http]
              presentations:
              - {name: a, port: 0, type: ssh}
              - {name: b, port: 70000, type: ssh}
              - {name: c, port: twenty-two, type: ssh}
              - {name: d, port: 1, type: ssh}
            stages: [{guideType: markdown}]
            "),
        Tier::Prod,
        &[
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[0].additionalPorts[0]`: `0` is not a port (a whole number from 1 to 65535)",
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[0].additionalPorts[2]`: `65536` is not a port (a whole number from 1 to 65535)",
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[0].additionalPorts[3]`: `-1` is not a port (a whole number from 1 to 65535)",
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[0].additionalPorts[4]`: `1.5` is not a port (a whole number from 1 to 65535)",
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[0].additionalPorts[5]`: `22` is not a port (a whole number from 1 to 65535)",
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[0].additionalPorts[6]`: `http` is not a port (a whole number from 1 to 65535)",
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[0].presentations[0].port`: `0` is not a port (a whole number from 1 to 65535)",
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[0].presentations[1].port`: `70000` is not a port (a whole number from 1 to 65535)",
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[0].presentations[2].port`: `twenty-two` is not a port (a whole number from 1 to 65535)",
        ],
    );
}

#[test]
fn an_endpoint_needs_a_presentation_or_an_additional_port() {
    check(
        &one("
            slug: one
            name: One
            category: tools
            tier: prod
            endpoints:
            - {name: bare, image: box}
            - {name: empty, image: box, presentations: [], additionalPorts: []}
            - {name: ports, image: box, additionalPorts: [830]}
            stages: [{guideType: markdown}]
            "),
        Tier::Prod,
        &[
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[0]`: an endpoint needs at least one presentation or additional port",
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[1]`: an endpoint needs at least one presentation or additional port",
        ],
    );
}

#[test]
fn a_lesson_needs_endpoints_and_stages() {
    check(
        &one("{slug: one, name: One, category: tools, tier: prod, endpoints: [], stages: []}"),
        Tier::Prod,
        &[
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints`: a lesson needs at least one endpoint",
            "lessons/one/lesson.meta.yaml: lesson `one`: `stages`: a lesson needs at least one stage",
        ],
    );
}

#[test]
fn stage_directories_and_guides_must_exist() {
    check(
        &[
            (
                "lessons/one/lesson.meta.yaml",
                "
                slug: one
                name: One
                category: tools
                tier: prod
                endpoints: [{name: web, image: box, additionalPorts: [1]}]
                stages:
                - {guideType: markdown}
                - {guideType: jupyter}
                - {guideType: markdown}
                - {guideType: markdown}
                ",
            ),
            ("lessons/one/stage0/guide.ipynb", "{}"),
            ("lessons/one/stage1/guide.md", "# wrong type"),
            (
                "lessons/one/stage2/guide.md/README",
                "a directory is not a guide",
            ),
        ],
        Tier::Prod,
        &[
            "lessons/one/lesson.meta.yaml: lesson `one`: `stages[0].guideType`: `stage0/guide.md` does not exist (guideType is markdown)",
            "lessons/one/lesson.meta.yaml: lesson `one`: `stages[1].guideType`: `stage1/guide.ipynb` does not exist (guideType is jupyter)",
            "lessons/one/lesson.meta.yaml: lesson `one`: `stages[2].guideType`: `stage2/guide.md` does not exist (guideType is markdown)",
            "lessons/one/lesson.meta.yaml: lesson `one`: `stages[3]`: stage directory `stage3/` does not exist",
        ],
    );
}

#[test]
fn configuration_files_are_capped_per_file_and_per_stage() {
    use antidote_proto::limits::{MAX_CONFIGURATION_FILE, MAX_CONFIGURATION_STAGE};
    let lesson = "
        slug: one
        name: One
        category: tools
        tier: prod
        endpoints:
        - {name: a, image: box, configurationType: python, additionalPorts: [1]}
        - {name: b, image: box, configurationType: python, additionalPorts: [1]}
        - {name: c, image: box, configurationType: python, additionalPorts: [1]}
        - {name: d, image: box, configurationType: python, additionalPorts: [1]}
        - {name: e, image: box, configurationType: python, additionalPorts: [1]}
        stages: [{guideType: markdown}, {guideType: markdown}]
        ";
    // `check` ends every file with a newline: each text here is one byte short of its file.
    let full = "#".repeat(MAX_CONFIGURATION_FILE - 1);
    // The lesson with each stage's five files.
    let curriculum = |stage0: [&str; 5], stage1: [&str; 5]| {
        let mut files: Vec<(String, String)> = vec![
            ("lessons/one/lesson.meta.yaml".into(), lesson.into()),
            (GUIDE0.0.into(), GUIDE0.1.into()),
            ("lessons/one/stage1/guide.md".into(), "# stage 1".into()),
        ];
        for (stage, contents) in [stage0, stage1].iter().enumerate() {
            for (name, text) in ["a", "b", "c", "d", "e"].iter().zip(contents) {
                files.push((
                    format!("lessons/one/stage{stage}/configs/{name}.py"),
                    (*text).to_owned(),
                ));
            }
        }
        files
    };
    fn borrowed(files: &[(String, String)]) -> Vec<(&str, &str)> {
        files
            .iter()
            .map(|(path, text)| (path.as_str(), text.as_str()))
            .collect()
    }
    // Stage 0: one file a byte over the file cap. Stage 1: five files at the file cap, over the
    // stage's.
    let over = "#".repeat(MAX_CONFIGURATION_FILE);
    let small = "print(1)";
    let files = curriculum(
        [&over, small, small, small, small],
        [&full, &full, &full, &full, &full],
    );
    let stage_total = 5 * MAX_CONFIGURATION_FILE;
    assert!(stage_total > MAX_CONFIGURATION_STAGE);
    let file_error = format!(
        "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[0].configurationType`: `stage0/configs/a.py` holds {} bytes, over the 256 KiB a configuration file may hold",
        MAX_CONFIGURATION_FILE + 1
    );
    let stage_error = format!(
        "lessons/one/lesson.meta.yaml: lesson `one`: `stages[1]`: the configuration files of `stage1/configs/` hold {stage_total} bytes together, over the 1024 KiB a stage's may hold"
    );
    check(&borrowed(&files), Tier::Prod, &[&file_error, &stage_error]);
    // At the caps (a file of 256 KiB; a stage's files making 1 MiB exactly), it loads.
    let rest = "#".repeat(MAX_CONFIGURATION_STAGE - 3 * MAX_CONFIGURATION_FILE - small.len() - 2);
    let files = curriculum(
        [&full, small, small, small, small],
        [&full, &full, &full, &rest, small],
    );
    check(&borrowed(&files), Tier::Prod, &[]);
}

#[test]
fn jupyter_guides_are_read_capped_and_get_their_own_endpoint_name() {
    let big = format!(
        "{{\"cells\": [], \"pad\": \"{}\"}}",
        "x".repeat(antidote_proto::limits::MAX_NOTEBOOK)
    );
    check(
        &[
            (
                "lessons/one/lesson.meta.yaml",
                "
                slug: one
                name: One
                category: tools
                tier: prod
                endpoints:
                - {name: jupyter-guide, image: box, additionalPorts: [1]}
                stages: [{guideType: jupyter}, {guideType: jupyter}]
                ",
            ),
            ("lessons/one/stage0/guide.ipynb", "{}"),
            ("lessons/one/stage1/guide.ipynb", big.as_str()),
        ],
        Tier::Prod,
        &[
            "lessons/one/lesson.meta.yaml: lesson `one`: `stages[1].guideType`: `stage1/guide.ipynb` holds 524313 bytes, over the 512 KiB a jupyter guide may hold",
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[0].name`: `jupyter-guide` names the endpoint that serves this lesson's jupyter guides",
        ],
    );
    // A lesson without jupyter guides may use the name.
    let catalog = load(
        &[
            (
                "lessons/one/lesson.meta.yaml",
                "
                {slug: one, name: One, category: tools, tier: prod,
                 endpoints: [{name: jupyter-guide, image: box, additionalPorts: [1]}],
                 stages: [{guideType: markdown}]}
                ",
            ),
            GUIDE0,
        ],
        Tier::Prod,
    );
    assert!(!catalog.lesson("one").unwrap().has_jupyter_guide());
}

#[test]
fn every_configured_endpoint_needs_a_config_file_in_every_stage() {
    check(
        &[
            (
                "lessons/one/lesson.meta.yaml",
                "
                slug: one
                name: One
                category: tools
                tier: prod
                endpoints:
                - {name: py, image: box, configurationType: python, additionalPorts: [1]}
                - {name: ans, image: box, configurationType: ansible, additionalPorts: [1]}
                - {name: sh, image: box, configurationType: shell, additionalPorts: [1]}
                - {name: nap, image: box, configurationType: napalm, additionalPorts: [1]}
                - {name: plain, image: box, additionalPorts: [1]}
                stages: [{guideType: markdown}, {guideType: markdown}]
                ",
            ),
            GUIDE0,
            // Stage 0 has everything, under the wrong names.
            ("lessons/one/stage0/configs/py.python", ""),
            ("lessons/one/stage0/configs/ans.yaml", ""),
            ("lessons/one/stage0/configs/sh.bash", ""),
            ("lessons/one/stage0/configs/nap-vyos.txt", ""),
            ("lessons/one/stage0/configs/nap.txt", ""),
            // Stage 1 has no configs directory, and two napalm drivers would be one too many.
            ("lessons/one/stage1/guide.md", "# one"),
        ],
        Tier::Prod,
        &[
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[0].configurationType`: `stage0/configs/py.py` does not exist (configurationType is python)",
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[1].configurationType`: `stage0/configs/ans.yml` does not exist (configurationType is ansible)",
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[2].configurationType`: `stage0/configs/sh.sh` does not exist (configurationType is shell)",
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[3].configurationType`: `stage0/configs/nap-<driver>.txt` does not exist for any driver (configurationType is napalm; drivers are junos, eos, iosxr, nxos, nxos_ssh, ios)",
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[0].configurationType`: `stage1/configs/py.py` does not exist (configurationType is python)",
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[1].configurationType`: `stage1/configs/ans.yml` does not exist (configurationType is ansible)",
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[2].configurationType`: `stage1/configs/sh.sh` does not exist (configurationType is shell)",
            "lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[3].configurationType`: `stage1/configs/nap-<driver>.txt` does not exist for any driver (configurationType is napalm; drivers are junos, eos, iosxr, nxos, nxos_ssh, ios)",
        ],
    );
}

#[test]
fn one_napalm_driver_per_endpoint_and_stage() {
    check(
        &[
            (
                "lessons/one/lesson.meta.yaml",
                "
                slug: one
                name: One
                category: tools
                tier: prod
                endpoints: [{name: nap, image: box, configurationType: napalm, additionalPorts: [830]}]
                stages: [{guideType: markdown}]
                ",
            ),
            GUIDE0,
            ("lessons/one/stage0/configs/nap-junos.txt", ""),
            ("lessons/one/stage0/configs/nap-eos.txt", ""),
        ],
        Tier::Prod,
        &["lessons/one/lesson.meta.yaml: lesson `one`: `endpoints[0].configurationType`: `stage0/configs/` has several napalm configs for `nap`, so the driver is ambiguous: nap-eos.txt, nap-junos.txt"],
    );
}

#[test]
fn config_files_must_be_text() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let root = dir.path();
    for (path, contents) in BASE.iter().copied().chain([
        (
            "lessons/one/lesson.meta.yaml",
            "{slug: one, name: One, category: tools, tier: prod,
              endpoints: [{name: sh, image: box, configurationType: shell, additionalPorts: [1]}],
              stages: [{guideType: markdown}]}",
        ),
        GUIDE0,
    ]) {
        let path = root.join(path);
        fs::create_dir_all(path.parent().expect("below the root")).expect("mkdir");
        fs::write(path, dedent(contents)).expect("write");
    }
    let config: PathBuf = root.join("lessons/one/stage0/configs/sh.sh");
    fs::create_dir_all(config.parent().expect("below the root")).expect("mkdir");
    fs::write(&config, [0xff, 0xfe, 0x00]).expect("write");
    let errors = Catalog::load(root, Tier::Prod).expect_err("binary config");
    assert_eq!(
        errors.0[0].reason,
        "`stage0/configs/sh.sh` is not valid utf-8"
    );
    assert_eq!(errors.0[0].field, "endpoints[0].configurationType");
    same(
        &Err(errors),
        &Catalog::from_files(root, files_under(root), Tier::Prod),
    );
}

// ---- curricula held in memory ----

#[test]
fn in_memory_paths_must_be_files_inside_the_curriculum() {
    let root = Path::new("/curriculum");
    let errors = Catalog::from_files(
        root,
        [
            ("../outside.yaml", "x"),
            ("/etc/passwd", "x"),
            ("", "x"),
            ("lessons/one", "x"),
            ("lessons/one/lesson.meta.yaml", "x"),
            ("images/a.yaml", "x"),
            ("./images/a.yaml", "y"),
        ],
        Tier::Prod,
    )
    .expect_err("paths no directory could hold");
    let lines: Vec<String> = errors.0.iter().map(ToString::to_string).collect();
    assert_eq!(
        lines,
        [
            "/curriculum/: not a file path inside the curriculum (relative, without `..`)",
            "/curriculum/../outside.yaml: not a file path inside the curriculum (relative, without `..`)",
            "/curriculum/./images/a.yaml: given twice",
            "/curriculum/lessons/one: is both a file and a directory",
            "/etc/passwd: not a file path inside the curriculum (relative, without `..`)",
        ],
        "sorted by file, as every list of curriculum errors is"
    );
}

#[test]
fn an_empty_map_is_a_curriculum_without_its_meta_file() {
    let errors = Catalog::from_files(
        Path::new("c"),
        BTreeMap::<String, String>::new(),
        Tier::Prod,
    )
    .expect_err("no curriculum.meta.yaml");
    assert_eq!(
        errors.to_string(),
        "1 curriculum error:\nc/curriculum.meta.yaml: file does not exist"
    );
}

#[test]
fn prereqs_must_exist_and_load_wherever_the_lesson_does() {
    let mut files = tiered();
    files.extend(one("
        slug: one
        name: One
        category: tools
        tier: ptr
        prereqs: [at-prod, at-ptr, at-local, nowhere, one]
        endpoints: [{name: web, image: box, additionalPorts: [1]}]
        stages: [{guideType: markdown}]
        "));
    let expect = [
        "lessons/one/lesson.meta.yaml: lesson `one`: `prereqs[2]`: lesson `at-local` has tier local, below this lesson's tier ptr, so it is skipped wherever this lesson loads",
        "lessons/one/lesson.meta.yaml: lesson `one`: `prereqs[3]`: no lesson with slug `nowhere`",
        "lessons/one/lesson.meta.yaml: lesson `one`: `prereqs[4]`: a lesson cannot be its own prereq",
    ];
    // The same problems at every tier where the lesson loads; where it is skipped, only what
    // is wrong with the lesson itself.
    for tier in [Tier::Local, Tier::Ptr] {
        check(&files, tier, &expect);
    }
    check(&files, Tier::Prod, &expect[2..]);
}

#[test]
fn collections_must_exist_and_load_wherever_the_lesson_does() {
    let mut files = tiered();
    files.extend(one("
        slug: one
        name: One
        category: tools
        tier: prod
        collection: local-only
        endpoints: [{name: web, image: box, additionalPorts: [1]}]
        stages: [{guideType: markdown}]
        "));
    files.extend([
        (
            "lessons/two/lesson.meta.yaml",
            "
            slug: two
            name: Two
            category: tools
            tier: prod
            collection: nowhere
            endpoints: [{name: web, image: box, additionalPorts: [1]}]
            stages: [{guideType: markdown}]
            ",
        ),
        ("lessons/two/stage0/guide.md", "# two"),
    ]);
    check(
        &files,
        Tier::Local,
        &[
            "lessons/one/lesson.meta.yaml: lesson `one`: `collection`: collection `local-only` has tier local, below this lesson's tier prod, so it is skipped wherever this lesson loads",
            "lessons/two/lesson.meta.yaml: lesson `two`: `collection`: no collection with slug `nowhere`",
        ],
    );
}

#[test]
fn ready_delay_is_whole_non_negative_seconds() {
    for (value, expect) in [
        ("-5", "`readyDelay`: `-5` must not be negative"),
        ("1.5", "`readyDelay`: must be a whole number, not `1.5`"),
    ] {
        let lesson = format!(
            "{{slug: one, name: One, category: tools, tier: prod, readyDelay: {value},
              endpoints: [{{name: web, image: box, additionalPorts: [1]}}],
              stages: [{{guideType: markdown}}]}}"
        );
        let expect = format!("lessons/one/lesson.meta.yaml: lesson `one`: {expect}");
        check(&one(&lesson), Tier::Prod, &[&expect]);
    }
}

#[test]
fn config_timeout_is_whole_seconds_up_to_an_hour_and_optional() {
    let lesson = |value: &str| {
        format!(
            "{{slug: one, name: One, category: tools, tier: prod, configTimeout: {value},
              endpoints: [{{name: web, image: box, additionalPorts: [1]}}],
              stages: [{{guideType: markdown}}]}}"
        )
    };
    for (value, expect) in [("1", 1), ("90", 90), ("3600", 3600)] {
        let catalog = check(&one(&lesson(value)), Tier::Prod, &[]).expect("loads");
        assert_eq!(
            catalog.lesson("one").expect("loaded").config_timeout,
            Some(Duration::from_secs(expect))
        );
    }
    // Without the key, the agent's own timeout (every curriculum written before it).
    let plain = check(&one(ONE), Tier::Prod, &[]).expect("loads");
    assert_eq!(plain.lesson("one").expect("loaded").config_timeout, None);
    for (value, expect) in [
        ("0", "`configTimeout`: `0` must be from 1 to 3600 seconds"),
        ("-5", "`configTimeout`: `-5` must be from 1 to 3600 seconds"),
        (
            "3601",
            "`configTimeout`: `3601` must be from 1 to 3600 seconds",
        ),
        ("5m", "`configTimeout`: must be a whole number, not `5m`"),
        ("1.5", "`configTimeout`: must be a whole number, not `1.5`"),
    ] {
        let expect = format!("lessons/one/lesson.meta.yaml: lesson `one`: {expect}");
        check(&one(&lesson(value)), Tier::Prod, &[&expect]);
    }
}

#[test]
fn placement_labels_load_and_bad_ones_are_named() {
    let lesson = "{slug: one, name: One, category: tools, tier: prod,
      placement: {requires: {region: eu, gpu: true}, prefers: {disk: ssd}},
      endpoints: [{name: web, image: box, additionalPorts: [1]}],
      stages: [{guideType: markdown}]}";
    let catalog = check(&one(lesson), Tier::Prod, &[]).expect("loads");
    let placement = &catalog.lesson("one").expect("loaded").placement;
    let pairs = |m: &BTreeMap<String, String>| {
        m.iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
    };
    assert_eq!(pairs(&placement.requires), ["gpu=true", "region=eu"]);
    assert_eq!(pairs(&placement.prefers), ["disk=ssd"]);
    // Without the key, nothing is required (every curriculum written before it).
    let plain = check(&one(ONE), Tier::Prod, &[]).expect("loads");
    assert_eq!(
        plain.lesson("one").expect("loaded").placement,
        Default::default()
    );
    for (placement, expect) in [
        (
            "{require: {region: eu}}",
            "`placement.require`: unknown field (did you mean `requires`?)",
        ),
        (
            "{requires: [region]}",
            "`placement.requires`: must be a mapping of labels, not a list",
        ),
        (
            "{prefers: {region: ''}}",
            "`placement.prefers.region`: must be a non-empty label value, not ``",
        ),
        ("eu", "`placement`: must be a mapping, not `eu`"),
    ] {
        let lesson = format!(
            "{{slug: one, name: One, category: tools, tier: prod, placement: {placement},
              endpoints: [{{name: web, image: box, additionalPorts: [1]}}],
              stages: [{{guideType: markdown}}]}}"
        );
        let expect = format!("lessons/one/lesson.meta.yaml: lesson `one`: {expect}");
        check(&one(&lesson), Tier::Prod, &[&expect]);
    }
}

// ---- what errors and secrets look like ----

#[test]
fn error_display() {
    let dir = tempfile::tempdir().expect("temporary directory");
    fs::write(
        dir.path().join("curriculum.meta.yaml"),
        "{name: x, nmae: y, z: 1}",
    )
    .expect("write");
    let errors = Catalog::load(dir.path(), Tier::Prod).expect_err("unknown fields");
    let root = dir.path().display();
    assert_eq!(
        errors.to_string(),
        format!(
            "2 curriculum errors:\n\
             {root}/curriculum.meta.yaml: `nmae`: unknown field (did you mean `name`?)\n\
             {root}/curriculum.meta.yaml: `z`: unknown field"
        )
    );
    let error = &errors.0[0];
    assert_eq!(error.lesson, None);
    assert_eq!(error.field, "nmae");
    assert!(std::error::Error::source(&errors).is_none());
}

#[test]
fn image_debug_redacts_passwords() {
    let catalog = load(&[], Tier::Prod);
    let image = catalog.image("box").expect("image box");
    let debug = format!("{image:?}");
    assert!(!debug.contains("hunter2"), "{debug}");
    assert!(!debug.contains("swordfish"), "{debug}");
    assert!(
        debug.contains(r#"ssh_password: Some("<redacted>")"#),
        "{debug}"
    );
    assert!(debug.contains(r#"ssh_user: Some("antidote")"#), "{debug}");
    let catalog_debug = format!("{catalog:?}");
    assert!(!catalog_debug.contains("hunter2"), "{catalog_debug}");
}

// ---- our own example curriculum ----

/// `deploy/curriculum` in the repository; `ANTIDOTE_EXAMPLE_CURRICULUM` overrides it for builds
/// of this module outside `scheduler-svc`.
fn example_curriculum() -> PathBuf {
    std::env::var_os("ANTIDOTE_EXAMPLE_CURRICULUM")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/curriculum"))
}

#[test]
fn example_curriculum_loads_without_errors() {
    let dir = example_curriculum();
    let catalog = match Catalog::load(&dir, Tier::Local) {
        Ok(catalog) => catalog,
        Err(errors) => panic!("{}: {errors}", dir.display()),
    };
    assert!(catalog.lessons.len() >= 3, "{:?}", catalog.lessons.keys());
    assert!(catalog.skipped.is_empty());
    let local: Vec<&str> = catalog
        .lessons
        .values()
        .filter(|lesson| lesson.tier == Tier::Local)
        .map(|lesson| lesson.slug.as_str())
        .collect();
    assert!(!local.is_empty(), "one lesson exercises tier filtering");

    // Every configured endpoint is configured by shell, so the busybox images can run it.
    for lesson in catalog.lessons.values() {
        for endpoint in &lesson.endpoints {
            assert!(
                matches!(
                    endpoint.configuration_type,
                    None | Some(ConfigurationType::Shell)
                ),
                "{}/{}",
                lesson.slug,
                endpoint.name
            );
        }
    }

    let prod = Catalog::load(&dir, Tier::Prod).expect("loads at prod too");
    assert_eq!(prod.skipped, local);
}

#[test]
fn example_curriculum_loads_the_same_from_memory() {
    let dir = example_curriculum();
    for tier in Tier::ALL {
        same(
            &Catalog::load(&dir, *tier),
            &Catalog::from_files(&dir, files_under(&dir), *tier),
        );
    }
}

// ---- stage checks and solutions ----

/// A lesson of two endpoints (`client`, `server`) and two stages, for the checks' cases.
const CHECKED: &str = "
    slug: one
    name: One
    category: fundamentals
    tier: prod
    checkTimeout: 5
    endpoints:
    - name: client
      image: box
      presentations:
      - {name: cli, port: 22, type: ssh}
    - name: server
      image: box
      presentations:
      - {name: cli, port: 22, type: ssh}
    stages:
    - {description: add the route, guideType: markdown, checks: gate}
    - {description: done, guideType: markdown}
    ";

#[test]
fn checks_and_solutions_load_with_their_kind_and_mode() {
    let mut files = one(CHECKED);
    files.extend([
        ("lessons/one/stage1/guide.md", "# 1\n"),
        ("lessons/one/stage0/checks/client.sh", "ping -c1 10.0.0.2\n"),
        ("lessons/one/stage0/checks/server.py", "print('ok')\n"),
        ("lessons/one/stage0/checks/.gitkeep", ""),
        (
            "lessons/one/stage0/solutions/client.sh",
            "ip route add ...\n",
        ),
    ]);
    let catalog = load(&files, Tier::Prod);
    let lesson = catalog.lesson("one").unwrap();
    assert_eq!(lesson.check_timeout, Duration::from_secs(5));
    assert!(lesson.has_checks());
    let stage = &lesson.stages[0];
    assert_eq!(stage.check_mode, super::CheckMode::Gate);
    assert!(stage.gated());
    assert_eq!(stage.checks["client"].kind, ConfigurationType::Shell);
    assert_eq!(stage.checks["server"].kind, ConfigurationType::Python);
    assert_eq!(stage.checks["client"].file_name(), "client.sh");
    assert_eq!(stage.checks["client"].contents, "ping -c1 10.0.0.2\n");
    assert_eq!(stage.solutions.len(), 1);
    let last = &lesson.stages[1];
    assert!(last.checks.is_empty() && !last.gated());
    assert_eq!(last.check_mode, super::CheckMode::Advisory);
    // Without checks anywhere, the default timeout and no checks.
    let plain = load(&one(ONE), Tier::Prod);
    let plain = plain.lesson("one").unwrap();
    assert!(!plain.has_checks());
    assert_eq!(plain.check_timeout, super::DEFAULT_CHECK_TIMEOUT);
}

#[test]
fn check_files_are_validated_like_configuration_files() {
    let big = "#".repeat(256 * 1024 + 1);
    let mut files = one(CHECKED);
    files.extend([
        ("lessons/one/stage1/guide.md", "# 1\n"),
        ("lessons/one/stage0/checks/client.sh", "true\n"),
        ("lessons/one/stage0/checks/client.py", "pass\n"),
        ("lessons/one/stage0/checks/ghost.sh", "true\n"),
        ("lessons/one/stage0/checks/notes.txt", "hm\n"),
        ("lessons/one/stage0/solutions/server.sh", big.as_str()),
        ("lessons/one/stage1/checks/nested/client.sh", "true\n"),
    ]);
    check(
        &files,
        Tier::Prod,
        &[
            "lessons/one/lesson.meta.yaml: lesson `one`: `stages[0]`: `stage0/checks/` has both `client.py` and `client.sh` for endpoint `client`: one per endpoint",
            "lessons/one/lesson.meta.yaml: lesson `one`: `stages[0]`: `stage0/checks/ghost.sh` names no endpoint of this lesson (endpoints: client, server)",
            "lessons/one/lesson.meta.yaml: lesson `one`: `stages[0]`: `stage0/checks/notes.txt` is not named `<endpoint>.sh` or `<endpoint>.py`",
            "lessons/one/lesson.meta.yaml: lesson `one`: `stages[0]`: `stage0/solutions/server.sh` holds 262146 bytes, over the 256 KiB a file of solutions may hold",
            "lessons/one/lesson.meta.yaml: lesson `one`: `stages[1]`: `stage1/checks/nested/` is a directory; checks are files named `<endpoint>.sh` or `<endpoint>.py`",
        ],
    );
}

#[test]
fn a_gate_needs_a_check_and_timeouts_and_modes_are_checked() {
    let lesson = CHECKED
        .replace("checkTimeout: 5", "checkTimeout: 601")
        .replace(
            "guideType: markdown}",
            "guideType: markdown, checks: sometimes}",
        );
    let mut files = one(&lesson);
    files.push(("lessons/one/stage1/guide.md", "# 1\n"));
    check(
        &files,
        Tier::Prod,
        &[
            "lessons/one/lesson.meta.yaml: lesson `one`: `checkTimeout`: `601` must be from 1 to 600 seconds",
            "lessons/one/lesson.meta.yaml: lesson `one`: `stages[0].checks`: `gate` needs a check, and `stage0/checks/` holds none",
            "lessons/one/lesson.meta.yaml: lesson `one`: `stages[1].checks`: unknown check mode `sometimes` (expected one of advisory, gate)",
        ],
    );
}
