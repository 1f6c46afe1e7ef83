//! `antidotectl` as a process against a real scheduler and test agent: every command, both
//! output formats, following a live lesson to READY and to FAILED, and clear errors.

use std::process::Output;

use antidote_tests::{example_curriculum, workspace_bin};

use crate::{Env, Knobs};

struct Ctl {
    server: String,
}

impl Ctl {
    fn run(&self, args: &[&str]) -> Output {
        std::process::Command::new(workspace_bin("antidotectl"))
            .arg("--server")
            .arg(&self.server)
            .args(args)
            .output()
            .expect("antidotectl runs")
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
    let ctl = Ctl {
        server: env.scheduler.process.url(),
    };
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
        let nowhere = Ctl {
            server: "http://127.0.0.1:1".into(),
        }
        .fails(&["lessons", "list"]);
        assert!(
            nowhere.contains("cannot reach the scheduler at http://127.0.0.1:1")
                && nowhere.contains("refused"),
            "{nowhere}"
        );
        // validate works offline.
        let valid = Ctl {
            server: "http://127.0.0.1:1".into(),
        }
        .ok(&["validate", &example_curriculum().display().to_string()]);
        assert!(valid.contains("3 lessons"), "{valid}");
    })
    .await
    .unwrap();
}
