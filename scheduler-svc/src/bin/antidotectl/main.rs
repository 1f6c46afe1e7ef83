//! `antidotectl`: the command line of Antidote, a client of the scheduler's gRPC API.
//!
//! `--server` (or `ANTIDOTE_SERVER`, default `http://127.0.0.1:7070`) names the scheduler,
//! `--admin-server` (`ANTIDOTE_ADMIN_SERVER`, default `http://127.0.0.1:7072`) its admin
//! listener, `--token` (`ANTIDOTE_TOKEN`, default the quickstart's) the admin bearer token.
//! `session create` keeps the session's token (see `client::Credentials`) and the commands about
//! that session and its live lessons send it; `--session-token` overrides.
//! `--output json` prints messages in the proto3 JSON mapping (one per line when following),
//! `--output table` (the default) prints tables. Errors go to stderr as `error: CODE: message`
//! and the exit status is 1; a live lesson that ends FAILED is an error too.
//!
//! This file only parses flags and dispatches. `client` connects (and defines `Failure`, the
//! one-line error), `commands` has one function per subcommand, `render` does all the printing
//! (tables, JSON, the progress bar).

mod client;
mod commands;
mod render;
mod ssh;
mod test_lesson;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use scheduler_svc::catalog::Tier;

use client::{Clients, Result};
use render::Printer;

/// Where the quickstart (`deploy/local/run`) writes the admin token it generates.
const QUICKSTART_TOKEN: &str = "target/quickstart/admin-token";

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
    /// The scheduler's admin listener (gRPC AdminService).
    #[arg(
        long,
        global = true,
        env = "ANTIDOTE_ADMIN_SERVER",
        default_value = "http://127.0.0.1:7072"
    )]
    admin_server: String,
    /// The admin bearer token; default: the quickstart's (`target/quickstart/admin-token` in
    /// this directory or a parent, else beside this binary's `target/`).
    #[arg(long, global = true, env = "ANTIDOTE_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// A learner's session token, overriding the ones `session create` kept.
    #[arg(
        long,
        global = true,
        env = "ANTIDOTE_SESSION_TOKEN",
        hide_env_values = true
    )]
    session_token: Option<String>,
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
        /// A label (`key=value`) the agent must carry; repeatable.
        #[arg(long = "require", value_name = "KEY=VALUE")]
        requires: Vec<String>,
        /// A label (`key=value`) the agent should carry; repeatable.
        #[arg(long = "prefer", value_name = "KEY=VALUE")]
        prefers: Vec<String>,
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
    /// A terminal on an endpoint of your live lesson, through its agent's entrypoint (the
    /// same way in as a learner's browser tab); exits with the remote shell's status.
    Ssh {
        /// The live lesson id.
        id: String,
        /// The endpoint.
        endpoint: String,
        /// The ssh presentation, when the endpoint has several.
        #[arg(long)]
        presentation: Option<String>,
        /// A CA certificate (PEM) to check an https entrypoint with, instead of the system's.
        #[arg(long, env = "ANTIDOTE_ENTRYPOINT_CA")]
        entrypoint_ca: Option<PathBuf>,
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
    /// One live lesson with its placement: the agent chosen and why.
    Show {
        /// The live lesson id.
        id: String,
    },
    /// Place no new live lessons on an agent; those it holds stay until they end.
    Drain {
        /// The agent's name.
        agent: String,
    },
    /// Let placement choose a drained agent again.
    Resume {
        /// The agent's name.
        agent: String,
    },
    /// Warm pools: lessons kept READY for learners to claim.
    #[command(subcommand)]
    Pool(Pool),
    /// Start a lesson in a session of its own and prove its checks: at every stage with checks
    /// and solutions the check must fail, the solution run, the check then pass; every stage
    /// must come READY. Exits non-zero on any mismatch. Needs admin:write.
    TestLesson {
        /// The lesson's slug (or none with `--all`).
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        lesson: Option<String>,
        /// Test this stage only (the stages before it are passed through).
        #[arg(long)]
        stage: Option<u32>,
        /// Every lesson of the catalog.
        #[arg(long, conflicts_with = "stage")]
        all: bool,
        /// With `--all`, how many lessons run at once.
        #[arg(long, default_value_t = 2)]
        concurrency: usize,
    },
}

#[derive(Subcommand)]
enum Pool {
    /// Every pool with its target now and its unclaimed members.
    List,
    /// Set a lesson's pool at a stage: its size, and daily windows with their own size.
    Set {
        /// The lesson's slug.
        lesson: String,
        /// The stage members are kept at.
        #[arg(long, default_value_t = 0)]
        stage: u32,
        /// The target outside every window (0 empties the pool).
        #[arg(long)]
        size: u32,
        /// A daily window `HH:MM-HH:MM=SIZE` (the scheduler's `pools.time_zone`); repeat for
        /// more. Replaces the pool's windows.
        #[arg(long = "window", value_name = "FROM-TO=SIZE")]
        windows: Vec<String>,
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
        return commands::validate(dir, *tier);
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

/// The quickstart's admin token ([`QUICKSTART_TOKEN`]): in the working directory or the nearest
/// of its parents that has one (so any directory of the checkout works), else beside this
/// binary's build (`target/release/antidotectl` → `target/quickstart/admin-token`).
fn quickstart_token() -> Option<String> {
    let cwd = std::env::current_dir().ok();
    let built = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.join("quickstart/admin-token")));
    cwd.iter()
        .flat_map(|dir| dir.ancestors())
        .map(|dir| dir.join(QUICKSTART_TOKEN))
        .chain(built)
        .find_map(|path| std::fs::read_to_string(path).ok())
        .map(|token| token.trim().to_owned())
        .filter(|token| !token.is_empty())
}

/// Connects, then runs the subcommand.
async fn run(cli: Cli) -> Result<()> {
    let token = cli.token.or_else(quickstart_token);
    let c = Clients::connect(
        &cli.server,
        &cli.admin_server,
        token,
        cli.session_token,
        cli.timeout,
    )
    .await?;
    let out = Printer::new(cli.output);
    match cli.command {
        Command::Validate { .. } => unreachable!("handled before connecting"),
        Command::Lessons(Lessons::List {
            category,
            collection,
            tag,
        }) => commands::lessons_list(&c, &out, category, collection, tag).await,
        Command::Lessons(Lessons::Show { slug }) => commands::lessons_show(&c, &out, slug).await,
        Command::Session(Session::Create) => commands::session_create(&c, &out).await,
        Command::Session(Session::Show { id }) => commands::session_show(&c, &out, id).await,
        Command::Request {
            lesson,
            session,
            stage,
            no_follow,
            requires,
            prefers,
        } => {
            let placement = commands::placement(&requires, &prefers)?;
            commands::request(&c, &out, lesson, session, stage, no_follow, placement).await
        }
        Command::Watch { id } => commands::watch(&c, &out, id).await,
        Command::Get { id } => commands::get(&c, &out, id).await,
        Command::Stage {
            id,
            stage,
            no_follow,
        } => commands::stage(&c, &out, id, stage, no_follow).await,
        Command::Delete { id } => commands::delete(&c, &out, id).await,
        Command::Ssh {
            id,
            endpoint,
            presentation,
            entrypoint_ca,
        } => {
            let status = ssh::ssh(&c, id, endpoint, presentation, entrypoint_ca.as_deref()).await?;
            // The remote shell's status is ours; the terminal is already restored.
            std::process::exit(status);
        }
        Command::Plan { lesson, stage } => commands::plan(&c, &out, lesson, stage).await,
        Command::Admin(Admin::List {
            status,
            lesson,
            agent,
        }) => commands::admin_list(&c, &out, status, lesson, agent).await,
        Command::Admin(Admin::Kill { id }) => commands::admin_kill(&c, &out, id).await,
        Command::Admin(Admin::Persist { session, off }) => {
            commands::admin_persist(&c, &out, session, off).await
        }
        Command::Admin(Admin::Sessions) => commands::admin_sessions(&c, &out).await,
        Command::Admin(Admin::Events { id }) => commands::admin_events(&c, &out, id).await,
        Command::Admin(Admin::Show { id }) => commands::admin_show(&c, &out, id).await,
        Command::Admin(Admin::Drain { agent }) => {
            commands::admin_drain(&c, &out, agent, true).await
        }
        Command::Admin(Admin::Resume { agent }) => {
            commands::admin_drain(&c, &out, agent, false).await
        }
        Command::Admin(Admin::Pool(Pool::List)) => commands::admin_pool_list(&c, &out).await,
        Command::Admin(Admin::Pool(Pool::Set {
            lesson,
            stage,
            size,
            windows,
        })) => commands::admin_pool_set(&c, &out, lesson, stage, size, windows).await,
        Command::Admin(Admin::TestLesson {
            lesson,
            stage,
            all,
            concurrency,
        }) => commands::admin_test_lesson(&c, &out, lesson, stage, all, concurrency).await,
        Command::Agents(Agents::List) => commands::agents_list(&c, &out).await,
    }
}
