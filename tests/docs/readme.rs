//! README's two commands are the product's quickstart and exactly what CI runs.

#[test]
fn readme_two_commands_are_what_ci_runs() {
    let repo = super::repo();
    let readme = std::fs::read_to_string(repo.join("README.md")).unwrap();
    let section = readme
        .split("## The two commands")
        .nth(1)
        .expect("README.md has a section `## The two commands`");
    let block = section
        .split("```sh\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("the section opens with a sh code block");
    let commands: Vec<&str> = block
        .lines()
        .map(|l| l.split('#').next().unwrap().trim())
        .filter(|l| !l.is_empty())
        .collect();
    assert_eq!(
        commands,
        ["deploy/local/run", "tests/run"],
        "README's two commands"
    );
    for command in &commands {
        let meta = std::fs::metadata(repo.join(command)).unwrap();
        assert!(
            std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o111 != 0,
            "{command} is executable"
        );
    }
    let ci = std::fs::read_to_string(repo.join(".ci/run")).unwrap();
    let run: Vec<&str> = ci
        .lines()
        .filter(|l| !l.trim_start().starts_with('#') && !l.trim().is_empty())
        .filter(|l| !l.starts_with("set ") && !l.starts_with("cd "))
        .collect();
    assert_eq!(
        run,
        ["exec tests/run"],
        ".ci/run runs README's test command and nothing else"
    );
    let lines = readme.lines().count();
    assert!(
        lines < 150,
        "README.md has {lines} lines: the manual belongs in the book (docs/)"
    );
}
