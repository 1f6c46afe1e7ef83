//! `antidotectl` as a process against a real scheduler and test agent: every command, both
//! output formats, following a live lesson to READY and to FAILED, and clear errors.

use std::process::Output;

use antidote_tests::{example_curriculum, workspace_bin};

use crate::{Env, Knobs};

struct Ctl {
    server: String,
    /// The admin listener.
    admin: String,
    /// Where antidotectl keeps session tokens (its own per test).
    state: std::path::PathBuf,
    /// The admin token to pass, if any.
    token: Option<String>,
}

impl Ctl {
    fn new(server: String, admin: String, state: &std::path::Path) -> Ctl {
        Ctl {
            server,
            admin,
            state: state.to_path_buf(),
            token: Some(antidote_tests::ADMIN_TOKEN.to_owned()),
        }
    }

    fn run(&self, args: &[&str]) -> Output {
        let mut command = std::process::Command::new(workspace_bin("antidotectl"));
        command
            .arg("--server")
            .arg(&self.server)
            .arg("--admin-server")
            .arg(&self.admin)
            .env("ANTIDOTE_STATE_DIR", &self.state)
            .env_remove("ANTIDOTE_TOKEN")
            .env_remove("ANTIDOTE_SESSION_TOKEN");
        if let Some(token) = &self.token {
            command.env("ANTIDOTE_TOKEN", token);
        }
        command.args(args).output().expect("antidotectl runs")
    }

    /// Runs and expects success; returns stdout.
    fn ok(&self, args: &[&str]) -> String {
        let output = self.run(args);
        assert!(
            output.status.success(),
            "antidotectl {args:?} failed: {}\n{}",
            String::from_utf8_lossy(&output.stderr),
            String::from_utf8_lossy(&output.stdout)
        );
        String::from_utf8(output.stdout).unwrap()
    }

    /// Runs and expects failure; returns stderr.
    fn fails(&self, args: &[&str]) -> String {
        let output = self.run(args);
        assert!(
            !output.status.success(),
            "antidotectl {args:?} should fail: {}",
            String::from_utf8_lossy(&output.stdout)
        );
        String::from_utf8(output.stderr).unwrap()
    }

    fn json(&self, args: &[&str]) -> serde_json::Value {
        let mut all = vec!["--output", "json"];
        all.extend_from_slice(args);
        let text = self.ok(&all);
        serde_json::from_str(text.lines().last().unwrap_or_default())
            .unwrap_or_else(|e| panic!("{args:?}: not JSON ({e}): {text}"))
    }
}

#[tokio::test]
async fn antidotectl_drives_a_lifecycle_in_tables_and_json() {
    let env = Env::start(&["--fail-lesson", "routing-basics"], Knobs::default()).await;
    let state = tempfile::tempdir().unwrap();
    let ctl = Ctl::new(
        env.scheduler.process.url(),
        env.scheduler.process.extra_url("admin").unwrap(),
        state.path(),
    );
    // Blocking processes: off the runtime's threads.
    tokio::task::spawn_blocking(move || {
        let list = ctl.ok(&["lessons", "list"]);
        assert!(
            list.contains("SLUG") && list.contains("netcat-toolbox"),
            "{list}"
        );
        let lessons = ctl.json(&["lessons", "list"]);
        assert!(
            lessons["lessons"].as_array().unwrap().len() >= 3,
            "{lessons}"
        );
        let show = ctl.ok(&["lessons", "show", "netcat-toolbox"]);
        assert!(
            show.contains("stages:") && show.contains("endpoints:"),
            "{show}"
        );

        let session = ctl.ok(&["session", "create"]).trim().to_owned();
        assert_eq!(session.len(), 36, "a session id: {session}");

        // request follows to READY, then prints where to connect.
        let ready = ctl.ok(&["request", "netcat-toolbox", "--session", &session]);
        assert!(ready.contains("status: READY"), "{ready}");
        assert!(
            ready.contains("ENDPOINT") && ready.contains("127.0.0.1:"),
            "{ready}"
        );
        let id = ready
            .lines()
            .find_map(|l| l.strip_prefix("live lesson "))
            .unwrap()
            .trim()
            .to_owned();

        let got = ctl.json(&["get", &id]);
        assert_eq!(got["status"], "LIVE_LESSON_STATUS_READY", "{got}");
        // Another learner (no kept tokens) cannot see this one's live lesson: NOT_FOUND, as if
        // it did not exist.
        let elsewhere = tempfile::tempdir().unwrap();
        let stranger = Ctl::new(ctl.server.clone(), ctl.admin.clone(), elsewhere.path());
        stranger.ok(&["session", "create"]);
        let hidden = stranger.fails(&["get", &id]);
        assert!(hidden.contains("(LIVE_LESSON_NOT_FOUND)"), "{hidden}");

        // Asking again returns the same live lesson.
        let again = ctl.json(&[
            "request",
            "netcat-toolbox",
            "--session",
            &session,
            "--no-follow",
        ]);
        assert_eq!(again["id"], got["id"]);

        // A stage change, followed as JSON lines until READY at stage 1.
        let staged = ctl.json(&["stage", &id, "1"]);
        assert_eq!(staged["stage"], 1, "{staged}");
        assert_eq!(staged["status"], "LIVE_LESSON_STATUS_READY", "{staged}");

        let plan = ctl.ok(&["plan", "netcat-toolbox"]);
        assert!(
            plan.contains("agent: loopback") && plan.contains("KIND"),
            "{plan}"
        );

        let listed = ctl.ok(&["admin", "list", "--status", "ready"]);
        assert!(listed.contains(&id), "{listed}");
        let none = ctl.ok(&["admin", "list", "--status", "failed"]);
        assert!(!none.contains(&id), "{none}");
        let persisted = ctl.json(&["admin", "persist", &session]);
        assert_eq!(persisted["persistent"], true, "{persisted}");
        let events = ctl.ok(&["admin", "events", &id]);
        assert!(events.contains("READY"), "{events}");
        // Placement, for operators: the agent and why; drain and resume.
        let shown = ctl.ok(&["admin", "show", &id]);
        assert!(
            shown.contains("placement: loopback") && shown.contains("why: chose `loopback`"),
            "{shown}"
        );
        let drained = ctl.json(&["admin", "drain", "loopback"]);
        assert_eq!(drained["drained"], true, "{drained}");
        let listed = ctl.ok(&["agents", "list"]);
        assert!(listed.contains("READY (drained)"), "{listed}");
        let resumed = ctl.json(&["admin", "resume", "loopback"]);
        assert_ne!(resumed["drained"], true, "{resumed}");
        let unknown_agent = ctl.fails(&["admin", "drain", "nowhere"]);
        assert!(
            unknown_agent.contains("(AGENT_NOT_FOUND)"),
            "{unknown_agent}"
        );
        // A label no agent carries: refused at once, naming it.
        let impossible = ctl.fails(&[
            "request",
            "hello-web",
            "--session",
            &session,
            "--require",
            "region=mars",
        ]);
        assert!(
            impossible.starts_with("error: FAILED_PRECONDITION:")
                && impossible.contains("region=mars")
                && impossible.contains("(PLACEMENT_IMPOSSIBLE)"),
            "{impossible}"
        );
        let malformed = ctl.fails(&[
            "request",
            "hello-web",
            "--session",
            &session,
            "--prefer",
            "x",
        ]);
        assert!(malformed.contains("KEY=VALUE"), "{malformed}");
        let agents = ctl.ok(&["agents", "list"]);
        assert!(
            agents.contains("loopback") && agents.contains("READY"),
            "{agents}"
        );

        // A lesson that fails: following it ends in an error naming the reason.
        let failed = ctl.fails(&["request", "routing-basics", "--session", &session]);
        assert!(
            failed.contains("FAILED") && failed.contains("routing-basics"),
            "{failed}"
        );

        let deleted = ctl.ok(&["delete", &id]);
        assert!(deleted.contains("being removed"), "{deleted}");

        // Clear errors: an unknown id, a bad status name, an unreachable scheduler.
        let unknown = ctl.fails(&["get", &uuid::Uuid::new_v4().to_string()]);
        assert!(unknown.starts_with("error: NOT_FOUND:"), "{unknown}");
        assert!(
            unknown.trim_end().ends_with("(LIVE_LESSON_NOT_FOUND)"),
            "the typed reason is shown: {unknown}"
        );
        let bad = ctl.fails(&["admin", "list", "--status", "sleepy"]);
        assert!(bad.contains("--status `sleepy`"), "{bad}");
        // The admin API refuses a missing or wrong token, with its reason.
        let mut anonymous = Ctl::new(ctl.server.clone(), ctl.admin.clone(), &ctl.state);
        anonymous.token = None;
        let refused = anonymous.fails(&["admin", "sessions"]);
        assert!(
            refused.starts_with("error: UNAUTHENTICATED:") && refused.contains("(UNAUTHENTICATED)"),
            "{refused}"
        );
        anonymous.token = Some("not-the-token".into());
        let refused = anonymous.fails(&["agents", "list"]);
        assert!(refused.starts_with("error: UNAUTHENTICATED:"), "{refused}");
        let nowhere = Ctl::new("http://127.0.0.1:1".into(), ctl.admin.clone(), &ctl.state)
            .fails(&["lessons", "list"]);
        assert!(
            nowhere.contains("cannot reach the scheduler at http://127.0.0.1:1")
                && nowhere.contains("refused"),
            "{nowhere}"
        );
        // validate works offline.
        let valid = Ctl::new("http://127.0.0.1:1".into(), ctl.admin.clone(), &ctl.state)
            .ok(&["validate", &example_curriculum().display().to_string()]);
        assert!(valid.contains("3 lessons"), "{valid}");
    })
    .await
    .unwrap();
}
