//! `antidotectl`: the command line of Antidote, a client of the scheduler's gRPC API.
//!
//! `--server` (or `ANTIDOTE_SERVER`, default `http://127.0.0.1:7070`) names the scheduler;
//! `--output json` prints messages in the proto3 JSON mapping (one per line when following),
//! `--output table` (the default) prints tables. Errors go to stderr as `error: CODE: message`
//! and the exit status is 1; a live lesson that ends FAILED is an error too.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use antidote_proto::api::v1 as api;
use api::admin_service_client::AdminServiceClient;
use api::curriculum_service_client::CurriculumServiceClient;
use api::live_lesson_service_client::LiveLessonServiceClient;
use api::session_service_client::SessionServiceClient;
use clap::{Parser, Subcommand, ValueEnum};
use comfy_table::{Table, presets};
use indicatif::{ProgressBar, ProgressStyle};
use scheduler_svc::catalog::Tier;
use tokio_stream::StreamExt as _;
use tonic::transport::{Channel, Endpoint};

#[derive(Parser)]
#[command(name = "antidotectl", version, about = "Antidote's command line")]
struct Cli {
    /// The scheduler's gRPC address.
    #[arg(
        long,
        global = true,
        env = "ANTIDOTE_SERVER",
        default_value = "http://127.0.0.1:7070"
    )]
    server: String,
    /// How to print results.
    #[arg(long, short, global = true, value_enum, default_value_t = Output::Table)]
    output: Output,
    /// Deadline of each call (following a live lesson has none).
    #[arg(long, global = true, default_value = "15s", value_parser = humantime::parse_duration)]
    timeout: Duration,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Output {
    Table,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// The lesson catalog.
    #[command(subcommand)]
    Lessons(Lessons),
    /// Check a curriculum directory offline and print every problem found.
    Validate {
        /// The curriculum directory.
        dir: PathBuf,
        /// The lowest tier to load (prod, ptr or local).
        #[arg(long, default_value = "local")]
        tier: Tier,
    },
    /// Learner sessions.
    #[command(subcommand)]
    Session(Session),
    /// Ask for a live lesson and follow it until READY or FAILED.
    Request {
        /// The lesson slug.
        lesson: String,
        /// The session (see `session create`).
        #[arg(long)]
        session: String,
        /// The stage to start at.
        #[arg(long, default_value_t = 0)]
        stage: u32,
        /// Print the answer and return at once instead of following.
        #[arg(long)]
        no_follow: bool,
    },
    /// Follow a live lesson until READY or FAILED.
    Watch {
        /// The live lesson id.
        id: String,
    },
    /// Show a live lesson.
    Get {
        /// The live lesson id.
        id: String,
    },
    /// Change a live lesson's stage and follow it until READY or FAILED.
    Stage {
        /// The live lesson id.
        id: String,
        /// The stage.
        stage: u32,
        /// Return at once instead of following.
        #[arg(long)]
        no_follow: bool,
    },
    /// Delete a live lesson.
    Delete {
        /// The live lesson id.
        id: String,
    },
    /// What provisioning a lesson would create, without creating anything.
    Plan {
        /// The lesson slug.
        lesson: String,
        /// The stage.
        #[arg(long, default_value_t = 0)]
        stage: u32,
    },
    /// Operators' commands.
    #[command(subcommand)]
    Admin(Admin),
    /// The agents the scheduler drives.
    #[command(subcommand)]
    Agents(Agents),
}

#[derive(Subcommand)]
enum Lessons {
    /// List lessons.
    List {
        /// Only this category.
        #[arg(long, default_value = "")]
        category: String,
        /// Only this collection.
        #[arg(long, default_value = "")]
        collection: String,
        /// Only lessons with this tag.
        #[arg(long, default_value = "")]
        tag: String,
    },
    /// Show one lesson.
    Show {
        /// The lesson slug.
        slug: String,
    },
}

#[derive(Subcommand)]
enum Session {
    /// Create a session; prints its id.
    Create,
    /// Show a session.
    Show {
        /// The session id.
        id: String,
    },
}

#[derive(Subcommand)]
enum Admin {
    /// Every live lesson, optionally filtered.
    List {
        /// Only this status (READY, FAILED, ...).
        #[arg(long)]
        status: Option<String>,
        /// Only this lesson.
        #[arg(long, default_value = "")]
        lesson: String,
        /// Only live lessons on this agent.
        #[arg(long, default_value = "")]
        agent: String,
    },
    /// Remove a live lesson now.
    Kill {
        /// The live lesson id.
        id: String,
    },
    /// Make a session persistent (exempt from idle expiry), or not with `--off`.
    Persist {
        /// The session id.
        session: String,
        /// Make it expire again.
        #[arg(long)]
        off: bool,
    },
    /// Every live session.
    Sessions,
    /// A live lesson's recorded transitions.
    Events {
        /// The live lesson id.
        id: String,
    },
}

#[derive(Subcommand)]
enum Agents {
    /// List agents with their state, capabilities and load.
    List,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::Validate { dir, tier } = &cli.command {
        return validate(dir, *tier);
    }
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("error: cannot start the runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err}");
            ExitCode::FAILURE
        }
    }
}

fn validate(dir: &std::path::Path, tier: Tier) -> ExitCode {
    match scheduler_svc::catalog::validate(dir, tier) {
        Ok(summary) => {
            println!("{summary}");
            ExitCode::SUCCESS
        }
        Err(errors) => {
            eprintln!("{errors}");
            ExitCode::FAILURE
        }
    }
}

/// A failure worth one line on stderr.
#[derive(Debug)]
struct Failure(String);

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<tonic::Status> for Failure {
    fn from(status: tonic::Status) -> Self {
        let code = scheduler_svc::api::http::code_name(status.code());
        if status.code() == tonic::Code::Unavailable {
            return Failure(format!(
                "{code}: the scheduler is unreachable or shutting down ({})",
                status.message()
            ));
        }
        Failure(format!("{code}: {}", status.message()))
    }
}

type Result<T> = std::result::Result<T, Failure>;

struct Clients {
    curriculum: CurriculumServiceClient<Channel>,
    sessions: SessionServiceClient<Channel>,
    lessons: LiveLessonServiceClient<Channel>,
    admin: AdminServiceClient<Channel>,
    timeout: Duration,
}

impl Clients {
    async fn connect(server: &str, timeout: Duration) -> Result<Clients> {
        let endpoint = Endpoint::from_shared(server.to_owned())
            .map_err(|err| Failure(format!("--server `{server}` is not a URL: {err}")))?
            .connect_timeout(Duration::from_secs(3))
            .tcp_nodelay(true);
        let channel = endpoint.connect().await.map_err(|err| {
            // The deepest cause says what happened ("Connection refused").
            let mut cause: &dyn std::error::Error = &err;
            while let Some(source) = cause.source() {
                cause = source;
            }
            Failure(format!(
                "cannot reach the scheduler at {server}: {cause} (is it running? set --server or ANTIDOTE_SERVER)"
            ))
        })?;
        Ok(Clients {
            curriculum: CurriculumServiceClient::new(channel.clone()),
            sessions: SessionServiceClient::new(channel.clone()),
            lessons: LiveLessonServiceClient::new(channel.clone()),
            admin: AdminServiceClient::new(channel),
            timeout,
        })
    }

    fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request.set_timeout(self.timeout);
        request
    }
}

async fn run(cli: Cli) -> Result<()> {
    let c = Clients::connect(&cli.server, cli.timeout).await?;
    let out = Printer(cli.output);
    match cli.command {
        Command::Validate { .. } => unreachable!("handled before connecting"),
        Command::Lessons(Lessons::List {
            category,
            collection,
            tag,
        }) => {
            let answer = c
                .curriculum
                .clone()
                .list_lessons(c.request(api::ListLessonsRequest {
                    category,
                    collection,
                    tag,
                }))
                .await?
                .into_inner();
            out.print(&answer, "ListLessonsResponse", || {
                table(
                    ["SLUG", "NAME", "CATEGORY", "COLLECTION", "STAGES", "TIER"],
                    answer.lessons.iter().map(|l| {
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
            });
        }
        Command::Lessons(Lessons::Show { slug }) => {
            let lesson = c
                .curriculum
                .clone()
                .get_lesson(c.request(api::GetLessonRequest { slug }))
                .await?
                .into_inner();
            out.print(&lesson, "Lesson", || show_lesson(&lesson));
        }
        Command::Session(Session::Create) => {
            let session = c
                .sessions
                .clone()
                .create_session(c.request(api::CreateSessionRequest {}))
                .await?
                .into_inner();
            out.print(&session, "Session", || session.id.clone());
        }
        Command::Session(Session::Show { id }) => {
            let session = c
                .sessions
                .clone()
                .get_session(c.request(api::GetSessionRequest { id }))
                .await?
                .into_inner();
            out.print(&session, "Session", || {
                sessions_table(std::slice::from_ref(&session))
            });
        }
        Command::Request {
            lesson,
            session,
            stage,
            no_follow,
        } => {
            let live = c
                .lessons
                .clone()
                .request_live_lesson(c.request(api::RequestLiveLessonRequest {
                    session_id: session,
                    lesson_slug: lesson,
                    stage,
                }))
                .await?
                .into_inner();
            settle(&c, &out, live, no_follow).await?;
        }
        Command::Watch { id } => {
            follow(&c, &out, &id, 0).await?;
        }
        Command::Get { id } => {
            let live = c
                .lessons
                .clone()
                .get_live_lesson(c.request(api::GetLiveLessonRequest { id }))
                .await?
                .into_inner();
            out.print(&live, "LiveLesson", || show_live_lesson(&live));
        }
        Command::Stage {
            id,
            stage,
            no_follow,
        } => {
            let live = c
                .lessons
                .clone()
                .set_stage(c.request(api::SetStageRequest { id, stage }))
                .await?
                .into_inner();
            settle(&c, &out, live, no_follow).await?;
        }
        Command::Delete { id } => {
            c.lessons
                .clone()
                .delete_live_lesson(c.request(api::DeleteLiveLessonRequest { id: id.clone() }))
                .await?;
            out.done(&format!("live lesson {id} is being removed"));
        }
        Command::Plan { lesson, stage } => {
            let plan = c
                .admin
                .clone()
                .plan(c.request(api::PlanRequest {
                    lesson_slug: lesson,
                    stage,
                }))
                .await?
                .into_inner();
            out.print(&plan, "PlanResponse", || {
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
            });
        }
        Command::Admin(Admin::List {
            status,
            lesson,
            agent,
        }) => {
            let status = match status {
                None => 0,
                Some(name) => parse_status(&name)?,
            };
            let answer = c
                .admin
                .clone()
                .list_live_lessons(c.request(api::AdminListLiveLessonsRequest {
                    status,
                    lesson_slug: lesson,
                    agent,
                }))
                .await?
                .into_inner();
            out.print(&answer, "AdminListLiveLessonsResponse", || {
                live_lessons_table(&answer.live_lessons)
            });
        }
        Command::Admin(Admin::Kill { id }) => {
            c.admin
                .clone()
                .kill_live_lesson(c.request(api::KillLiveLessonRequest { id: id.clone() }))
                .await?;
            out.done(&format!("live lesson {id} is being removed"));
        }
        Command::Admin(Admin::Persist { session, off }) => {
            let session = c
                .admin
                .clone()
                .persist_session(c.request(api::PersistSessionRequest {
                    id: session,
                    persistent: !off,
                }))
                .await?
                .into_inner();
            out.print(&session, "Session", || {
                sessions_table(std::slice::from_ref(&session))
            });
        }
        Command::Admin(Admin::Sessions) => {
            let answer = c
                .admin
                .clone()
                .list_sessions(c.request(api::ListSessionsRequest {}))
                .await?
                .into_inner();
            out.print(&answer, "ListSessionsResponse", || {
                sessions_table(&answer.sessions)
            });
        }
        Command::Admin(Admin::Events { id }) => {
            let answer = c
                .admin
                .clone()
                .list_events(c.request(api::ListEventsRequest { live_lesson_id: id }))
                .await?
                .into_inner();
            out.print(&answer, "ListEventsResponse", || {
                table(
                    ["AT", "STATUS", "GENERATION", "STAGE", "DETAIL"],
                    answer.events.iter().map(|e| {
                        vec![
                            time(e.at.as_ref()),
                            status_name(e.status).to_owned(),
                            e.generation.to_string(),
                            e.stage.to_string(),
                            e.detail.clone(),
                        ]
                    }),
                )
            });
        }
        Command::Agents(Agents::List) => {
            let answer = c
                .admin
                .clone()
                .list_agents(c.request(api::ListAgentsRequest {}))
                .await?
                .into_inner();
            out.print(&answer, "ListAgentsResponse", || {
                table(
                    [
                        "NAME",
                        "STATE",
                        "ADDRESS",
                        "KIND",
                        "VERSION",
                        "LOAD",
                        "CAPABILITIES",
                        "LAST ERROR",
                    ],
                    answer.agents.iter().map(|a| {
                        let state = api::AgentState::try_from(a.state)
                            .map(|s| s.as_str_name().trim_start_matches("AGENT_STATE_"))
                            .unwrap_or("?");
                        let load = if a.max_live_lessons == 0 {
                            a.live_lessons.to_string()
                        } else {
                            format!("{}/{}", a.live_lessons, a.max_live_lessons)
                        };
                        vec![
                            a.name.clone(),
                            state.to_owned(),
                            a.address.clone(),
                            a.kind.clone(),
                            a.build_version.clone(),
                            load,
                            a.capabilities.join(","),
                            a.last_error.clone(),
                        ]
                    }),
                )
            });
        }
    }
    Ok(())
}

/// Prints `live` as answered, or follows it to READY or FAILED.
async fn settle(c: &Clients, out: &Printer, live: api::LiveLesson, no_follow: bool) -> Result<()> {
    if no_follow {
        out.print(&live, "LiveLesson", || show_live_lesson(&live));
        Ok(())
    } else {
        follow(c, out, &live.id, live.generation).await
    }
}

/// Follows a live lesson until READY or FAILED (of `generation` or newer, when given): a
/// progress bar on a terminal, then the live lesson; each state as a JSON line with `--output
/// json`. FAILED is an error.
async fn follow(c: &Clients, out: &Printer, id: &str, generation: u64) -> Result<()> {
    let mut stream = c
        .lessons
        .clone()
        .watch_live_lesson(api::WatchLiveLessonRequest { id: id.to_owned() })
        .await?
        .into_inner();
    let bar = if out.0 == Output::Table {
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
    let mut last = None;
    while let Some(item) = stream.next().await {
        let live = item?;
        if out.0 == Output::Json {
            println!("{}", json(&live, "LiveLesson"));
        }
        let status = live.status();
        bar.set_position(match status {
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
        bar.set_message(message);
        let settled = matches!(
            status,
            api::LiveLessonStatus::Ready | api::LiveLessonStatus::Failed
        ) && live.generation >= generation;
        last = Some(live);
        if settled {
            break;
        }
    }
    bar.finish_and_clear();
    let Some(live) = last else {
        return Err(Failure(format!("live lesson {id} is gone")));
    };
    if out.0 == Output::Table {
        println!("{}", show_live_lesson(&live));
    }
    match live.status() {
        api::LiveLessonStatus::Ready => Ok(()),
        api::LiveLessonStatus::Failed => Err(Failure(format!(
            "live lesson {id} FAILED: {}",
            live.failure_reason
        ))),
        _ => Err(Failure(format!(
            "live lesson {id} went away while {}",
            status_name(live.status)
        ))),
    }
}

struct Printer(Output);

impl Printer {
    /// Prints a message as JSON, or what `table` makes of it.
    fn print<T: prost::Message>(&self, message: &T, name: &str, table: impl FnOnce() -> String) {
        match self.0 {
            Output::Json => println!("{}", json(message, name)),
            Output::Table => println!("{}", table()),
        }
    }

    /// Reports a call without an answer worth printing.
    fn done(&self, text: &str) {
        match self.0 {
            Output::Json => println!("{{}}"),
            Output::Table => println!("{text}"),
        }
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

fn status_name(status: i32) -> &'static str {
    api::LiveLessonStatus::try_from(status)
        .map(|s| s.as_str_name().trim_start_matches("LIVE_LESSON_STATUS_"))
        .unwrap_or("?")
}

fn parse_status(name: &str) -> Result<i32> {
    let full = format!(
        "LIVE_LESSON_STATUS_{}",
        name.trim_start_matches("LIVE_LESSON_STATUS_")
            .to_uppercase()
    );
    api::LiveLessonStatus::from_str_name(&full)
        .map(|s| s as i32)
        .ok_or_else(|| {
            Failure(format!(
                "--status `{name}`: one of PENDING, BOOTING, CONFIGURING, READY, FAILED, TERMINATING"
            ))
        })
}

fn time(at: Option<&prost_types::Timestamp>) -> String {
    at.map(ToString::to_string).unwrap_or_default()
}

fn show_lesson(lesson: &api::Lesson) -> String {
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

fn show_live_lesson(live: &api::LiveLesson) -> String {
    let mut text = format!(
        "live lesson {}\nlesson: {}  stage: {}  status: {}  agent: {}  health: {}/{}\n",
        live.id,
        live.lesson_slug,
        live.stage,
        status_name(live.status),
        live.agent,
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
        text.push_str(&table(
            ["ENDPOINT", "PRESENTATION", "TYPE", "ADDRESS", "URL"],
            live.endpoints.iter().flat_map(|e| {
                e.presentations.iter().map(|p| {
                    vec![
                        e.name.clone(),
                        p.name.clone(),
                        p.r#type.clone(),
                        p.address.clone(),
                        p.url.clone(),
                    ]
                })
            }),
        ));
    }
    text
}

fn live_lessons_table(lessons: &[api::LiveLesson]) -> String {
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

fn sessions_table(sessions: &[api::Session]) -> String {
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
