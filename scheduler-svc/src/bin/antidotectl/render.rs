//! Everything `antidotectl` prints on stdout: `Printer` picks JSON (the proto3 JSON mapping of
//! the HTTP API, through `http::encode`) or a table (comfy-table, no borders) per `--output`;
//! `Progress` is the bar (or the JSON lines) while following a live lesson.

use std::time::Duration;

use antidote_proto::api::v1 as api;
use comfy_table::{Table, presets};
use indicatif::{ProgressBar, ProgressStyle};

use crate::Output;

/// Prints answers in the chosen `--output`.
pub struct Printer(Output);

impl Printer {
    pub fn new(output: Output) -> Printer {
        Printer(output)
    }

    /// Prints a message as JSON, or what `table` makes of it.
    pub fn print<T: prost::Message>(
        &self,
        message: &T,
        name: &str,
        table: impl FnOnce() -> String,
    ) {
        match self.0 {
            Output::Json => println!("{}", json(message, name)),
            Output::Table => println!("{}", table()),
        }
    }

    /// Reports a call without an answer worth printing.
    pub fn done(&self, text: &str) {
        match self.0 {
            Output::Json => println!("{{}}"),
            Output::Table => println!("{text}"),
        }
    }

    /// Shows where following a live lesson ended (JSON has already printed every state).
    pub fn settled(&self, live: &api::LiveLesson) {
        if self.0 == Output::Table {
            println!("{}", live_lesson(live));
        }
    }

    /// The reports of `admin test-lesson`: one JSON document, or a table of every stage with
    /// each lesson's problems below it.
    pub fn test_lessons(&self, reports: &[crate::test_lesson::LessonReport]) {
        match self.0 {
            Output::Json => {
                let ok = reports.iter().all(|r| r.ok());
                let document = serde_json::json!({ "ok": ok, "lessons": reports });
                println!("{document}");
            }
            Output::Table => println!("{}", test_lessons_table(reports)),
        }
    }

    /// What following a live lesson shows until it settles.
    pub fn progress(&self) -> Progress {
        Progress::new(self.0)
    }
}

/// A live lesson being followed: a progress bar on a terminal with `--output table`, each state
/// as a JSON line with `--output json`.
pub struct Progress {
    /// Whether each state is printed as a JSON line.
    output: Output,
    /// Hidden with `--output json`, so stdout stays one message per line.
    bar: ProgressBar,
}

impl Progress {
    fn new(output: Output) -> Progress {
        let bar = if output == Output::Table {
            ProgressBar::new(3)
        } else {
            ProgressBar::hidden()
        };
        bar.set_style(
            ProgressStyle::with_template("{spinner} {elapsed:>4} [{bar:20}] {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        bar.enable_steady_tick(Duration::from_millis(120));
        Progress { output, bar }
    }

    /// Shows one reported state.
    pub fn update(&self, live: &api::LiveLesson) {
        if self.output == Output::Json {
            println!("{}", json(live, "LiveLesson"));
        }
        self.bar.set_position(match live.status() {
            api::LiveLessonStatus::Booting => 1,
            api::LiveLessonStatus::Configuring => 2,
            api::LiveLessonStatus::Ready => 3,
            _ => 0,
        });
        let mut message = format!("{} stage {}", status_name(live.status), live.stage);
        if live.total > 0 {
            message.push_str(&format!(" ({}/{} healthy)", live.healthy, live.total));
        }
        if !live.failure_reason.is_empty() {
            message.push_str(&format!(": {}", live.failure_reason));
        }
        self.bar.set_message(message);
    }

    /// Removes the bar.
    pub fn finish(self) {
        self.bar.finish_and_clear();
    }
}

fn json<T: prost::Message>(message: &T, name: &str) -> String {
    scheduler_svc::api::http::encode(&scheduler_svc::api::http::message(name), message).to_string()
}

fn table<const N: usize>(header: [&str; N], rows: impl Iterator<Item = Vec<String>>) -> String {
    let mut table = Table::new();
    table.load_preset(presets::NOTHING).set_header(header);
    for row in rows {
        table.add_row(row);
    }
    table.to_string()
}

fn join<T: ToString>(items: impl Iterator<Item = T>) -> String {
    items.map(|i| i.to_string()).collect::<Vec<_>>().join(",")
}

/// A live lesson status without its prefix (`READY`).
pub fn status_name(status: i32) -> &'static str {
    api::LiveLessonStatus::try_from(status)
        .map(|s| s.as_str_name().trim_start_matches("LIVE_LESSON_STATUS_"))
        .unwrap_or("?")
}

fn time(at: Option<&prost_types::Timestamp>) -> String {
    at.map(ToString::to_string).unwrap_or_default()
}

pub fn lessons_table(lessons: &[api::Lesson]) -> String {
    table(
        ["SLUG", "NAME", "CATEGORY", "COLLECTION", "STAGES", "TIER"],
        lessons.iter().map(|l| {
            vec![
                l.slug.clone(),
                l.name.clone(),
                l.category.clone(),
                l.collection.clone(),
                l.stages.len().to_string(),
                l.tier.clone(),
            ]
        }),
    )
}

pub fn lesson(lesson: &api::Lesson) -> String {
    let mut text = format!(
        "{} ({})\n{}\ncategory: {}  collection: {}  tier: {}\n",
        lesson.name,
        lesson.slug,
        lesson.short_description,
        lesson.category,
        lesson.collection,
        lesson.tier
    );
    if !lesson.prereqs.is_empty() {
        text.push_str(&format!("prerequisites: {}\n", lesson.prereqs.join(", ")));
    }
    text.push_str("\nstages:\n");
    text.push_str(&table(
        ["STAGE", "DESCRIPTION"],
        lesson
            .stages
            .iter()
            .map(|s| vec![s.index.to_string(), s.description.clone()]),
    ));
    text.push_str("\n\nendpoints:\n");
    text.push_str(&table(
        ["NAME", "IMAGE", "PRESENTATIONS"],
        lesson.endpoints.iter().map(|e| {
            vec![
                e.name.clone(),
                e.image.clone(),
                join(
                    e.presentations
                        .iter()
                        .map(|p| format!("{} {}:{}", p.name, p.r#type, p.port)),
                ),
            ]
        }),
    ));
    text
}

pub fn live_lesson(live: &api::LiveLesson) -> String {
    let mut text = format!(
        "live lesson {}\nlesson: {}  stage: {}  status: {}  agent: {}  health: {}/{}\n",
        live.id,
        live.lesson_slug,
        live.stage,
        status_name(live.status),
        // Only operators' answers (the admin API) name the agent.
        if live.agent.is_empty() {
            "-"
        } else {
            &live.agent
        },
        live.healthy,
        live.total
    );
    if !live.failure_reason.is_empty() {
        text.push_str(&format!("reason: {}\n", live.failure_reason));
    }
    if let Some(expires) = &live.expires_at {
        text.push_str(&format!("expires if idle: {expires}\n"));
    }
    if !live.endpoints.is_empty() {
        text.push('\n');
        // Learners get the entrypoint's URL and no backend address, operators the backend's
        // address and URL: a column empty in every row is left out.
        let rows: Vec<[String; 6]> = live
            .endpoints
            .iter()
            .flat_map(|e| {
                e.presentations.iter().map(|p| {
                    [
                        e.name.clone(),
                        p.name.clone(),
                        p.r#type.clone(),
                        p.address.clone(),
                        p.url.clone(),
                        p.entrypoint_url.clone(),
                    ]
                })
            })
            .collect();
        let header = [
            "ENDPOINT",
            "PRESENTATION",
            "TYPE",
            "ADDRESS",
            "URL",
            "ENTRYPOINT",
        ];
        let shown: Vec<usize> = (0..header.len())
            .filter(|&c| c < 3 || rows.iter().any(|row| !row[c].is_empty()))
            .collect();
        let mut presentations = Table::new();
        presentations
            .load_preset(presets::NOTHING)
            .set_header(shown.iter().map(|&c| header[c]));
        for row in &rows {
            presentations.add_row(shown.iter().map(|&c| row[c].clone()));
        }
        text.push_str(&presentations.to_string());
    }
    text
}

pub fn live_lessons_table(lessons: &[api::LiveLesson]) -> String {
    table(
        [
            "ID", "LESSON", "STAGE", "STATUS", "AGENT", "HEALTH", "SESSION", "REASON",
        ],
        lessons.iter().map(|l| {
            vec![
                l.id.clone(),
                l.lesson_slug.clone(),
                l.stage.to_string(),
                status_name(l.status).to_owned(),
                l.agent.clone(),
                format!("{}/{}", l.healthy, l.total),
                l.session_id.clone(),
                l.failure_reason.clone(),
            ]
        }),
    )
}

pub fn sessions_table(sessions: &[api::Session]) -> String {
    table(
        [
            "ID",
            "SOURCE",
            "PERSISTENT",
            "CREATED",
            "LAST ACTIVE",
            "EXPIRES",
        ],
        sessions.iter().map(|s| {
            vec![
                s.id.clone(),
                s.source_ip.clone(),
                s.persistent.to_string(),
                time(s.created_at.as_ref()),
                time(s.last_active.as_ref()),
                time(s.expires_at.as_ref()),
            ]
        }),
    )
}

pub fn plan(plan: &api::PlanResponse) -> String {
    let mut text = format!("agent: {}\n", plan.agent);
    text.push_str(&table(
        ["KIND", "NAME", "PORTS", "DETAIL"],
        plan.objects.iter().map(|o| {
            vec![
                o.kind.clone(),
                o.name.clone(),
                join(o.ports.iter()),
                o.detail.clone(),
            ]
        }),
    ));
    for diagnostic in &plan.diagnostics {
        text.push_str(&format!("\nnote: {diagnostic}"));
    }
    text
}

pub fn events_table(events: &[api::Event]) -> String {
    table(
        ["AT", "STATUS", "GENERATION", "STAGE", "DETAIL"],
        events.iter().map(|e| {
            vec![
                time(e.at.as_ref()),
                status_name(e.status).to_owned(),
                e.generation.to_string(),
                e.stage.to_string(),
                e.detail.clone(),
            ]
        }),
    )
}

/// Labels as `k=v,k=v`, sorted.
fn labels(labels: &std::collections::HashMap<String, String>) -> String {
    let mut pairs: Vec<_> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    pairs.sort();
    pairs.join(",")
}

/// A live lesson with its placement, for operators.
pub fn admin_live_lesson(answer: &api::AdminLiveLesson) -> String {
    let mut text = answer
        .live_lesson
        .as_ref()
        .map(live_lesson)
        .unwrap_or_default();
    let failed = answer
        .live_lesson
        .as_ref()
        .is_some_and(|l| !l.failure_reason.is_empty());
    if !answer.status_reason.is_empty() && !failed {
        text.push_str(&format!("status reason: {}\n", answer.status_reason));
    }
    let Some(p) = &answer.placement else {
        text.push_str("\nplacement: never placed\n");
        return text;
    };
    text.push_str(&format!(
        "\nplacement: {}\nrequires: {}  prefers: {}  matched: {}\ndecided: {}\n",
        if p.agent.is_empty() { "-" } else { &p.agent },
        labels(&p.requires),
        labels(&p.prefers),
        labels(&p.matched),
        time(p.decided_at.as_ref()),
    ));
    if !p.moved_from.is_empty() {
        text.push_str(&format!("moved from lost agent: {}\n", p.moved_from));
    }
    if !p.reason.is_empty() {
        text.push_str(&format!("why: {}\n", p.reason));
    }
    if !p.excluded.is_empty() {
        text.push('\n');
        text.push_str(&table(
            ["AGENT", "NOT CHOSEN BECAUSE"],
            p.excluded
                .iter()
                .map(|e| vec![e.agent.clone(), e.reason.clone()]),
        ));
    }
    text
}

pub fn agents_table(agents: &[api::Agent]) -> String {
    table(
        [
            "NAME",
            "STATE",
            "ADDRESS",
            "KIND",
            "VERSION",
            "LOAD",
            "LABELS",
            "CAPABILITIES",
            "PEER CERT",
            "LAST ERROR",
        ],
        agents.iter().map(|a| {
            let state = api::AgentState::try_from(a.state)
                .map(|s| s.as_str_name().trim_start_matches("AGENT_STATE_"))
                .unwrap_or("?");
            let load = if a.max_live_lessons == 0 {
                a.live_lessons.to_string()
            } else {
                format!("{}/{}", a.live_lessons, a.max_live_lessons)
            };
            let state = if a.drained {
                format!("{state} (drained)")
            } else {
                state.to_owned()
            };
            vec![
                a.name.clone(),
                state,
                a.address.clone(),
                a.kind.clone(),
                a.build_version.clone(),
                load,
                labels(&a.labels),
                a.capabilities.join(","),
                peer_cert(a),
                if a.tls_error.is_empty() {
                    a.last_error.clone()
                } else {
                    a.tls_error.clone()
                },
            ]
        }),
    )
}

pub fn pools_table(pools: &[api::Pool]) -> String {
    table(
        [
            "LESSON", "STAGE", "TARGET", "READY", "STARTING", "REMOVING", "FAILED", "SIZE",
            "WINDOWS", "HITS", "MISSES", "SET BY",
        ],
        pools.iter().map(|p| {
            vec![
                p.lesson_slug.clone(),
                p.stage.to_string(),
                p.target.to_string(),
                p.ready.to_string(),
                p.starting.to_string(),
                p.removing.to_string(),
                p.failed.to_string(),
                p.size.to_string(),
                join(
                    p.windows
                        .iter()
                        .map(|w| format!("{}-{}={}", w.from, w.to, w.size)),
                ),
                p.hits.to_string(),
                p.misses.to_string(),
                format!("{} ({})", p.updated_by, p.source),
            ]
        }),
    )
}

/// The agent's mTLS certificate: the start of its SHA-256 and its expiry (empty: plaintext).
fn peer_cert(a: &api::Agent) -> String {
    if a.tls_peer_sha256.is_empty() {
        return String::new();
    }
    let expires = match a.tls_peer_expires_at.as_ref() {
        Some(at) => format!(" until {}", time(Some(at))),
        None => String::new(),
    };
    format!(
        "sha256:{}…{expires}",
        a.tls_peer_sha256.get(..16).unwrap_or("")
    )
}

/// `admin test-lesson`'s table: a row per stage walked (lesson, stage, check before, solution,
/// check after, time), then each problem on a line of its own.
pub fn test_lessons_table(reports: &[crate::test_lesson::LessonReport]) -> String {
    let rows = reports.iter().flat_map(|report| {
        report.stages.iter().map(move |row| {
            vec![
                report.lesson.clone(),
                row.stage.to_string(),
                row.check_before.clone(),
                row.solution.clone(),
                row.check_after.clone(),
                format!("{:.1}s", row.seconds),
                if row.problem.is_some() {
                    "MISMATCH"
                } else {
                    "ok"
                }
                .to_owned(),
            ]
        })
    });
    let mut text = table(
        [
            "LESSON",
            "STAGE",
            "CHECK BEFORE",
            "SOLUTION",
            "CHECK AFTER",
            "TIME",
            "RESULT",
        ],
        rows,
    );
    for report in reports {
        for row in &report.stages {
            if let Some(problem) = &row.problem {
                text.push_str(&format!(
                    "\n{} stage {}: {problem}",
                    report.lesson, row.stage
                ));
            }
        }
        if let Some(error) = &report.error {
            text.push_str(&format!("\n{}: {error}", report.lesson));
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lesson(presentation: api::LivePresentation) -> api::LiveLesson {
        api::LiveLesson {
            id: "l1".into(),
            lesson_slug: "hello".into(),
            status: api::LiveLessonStatus::Ready as i32,
            endpoints: vec![api::LiveEndpoint {
                name: "box".into(),
                presentations: vec![presentation],
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    #[test]
    fn learners_see_the_entrypoint_and_operators_the_backend() {
        let learner = live_lesson(&lesson(api::LivePresentation {
            name: "cli".into(),
            r#type: "ssh".into(),
            entrypoint_url: "https://entry.example/t/abc".into(),
            ..Default::default()
        }));
        let header = learner.lines().find(|l| l.contains("ENDPOINT")).unwrap();
        assert!(header.contains("ENTRYPOINT"), "{learner}");
        assert!(
            !header.contains("ADDRESS") && !header.contains(" URL"),
            "{learner}"
        );
        assert!(learner.contains("https://entry.example/t/abc"), "{learner}");

        let operator = live_lesson(&lesson(api::LivePresentation {
            name: "web".into(),
            r#type: "http".into(),
            address: "127.0.0.1:8080".into(),
            url: "http://127.0.0.1:8080/".into(),
            ..Default::default()
        }));
        let header = operator.lines().find(|l| l.contains("ENDPOINT")).unwrap();
        assert!(
            header.contains("ADDRESS") && header.contains("URL") && !header.contains("ENTRYPOINT"),
            "{operator}"
        );
        assert!(operator.contains("127.0.0.1:8080"), "{operator}");
    }
}
