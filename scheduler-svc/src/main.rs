//! `scheduler-svc`: parses flags, loads configuration and the catalog, binds, and runs until
//! SIGTERM or ctrl-c.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use scheduler_svc::catalog::{Catalog, Tier};
use scheduler_svc::settings::Config;
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(name = "scheduler-svc", version, about = "Antidote's scheduler")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the public API and drive the configured agents.
    Serve {
        /// Configuration file (TOML or YAML); `ANTIDOTE_*` environment variables override it.
        #[arg(long, short)]
        config: Option<PathBuf>,
    },
    /// Check a curriculum offline and print every problem found.
    Validate {
        /// The curriculum directory.
        dir: PathBuf,
        /// The lowest tier to load (prod, ptr or local).
        #[arg(long, default_value = "local")]
        tier: Tier,
    },
}

/// The allocator: glibc's malloc/free were about 8 % of the scheduler's CPU under load.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Validate { dir, tier } => validate(&dir, tier),
        Command::Serve { config } => {
            let runtime = match tokio::runtime::Runtime::new() {
                Ok(runtime) => runtime,
                Err(err) => {
                    eprintln!("error: cannot start the runtime: {err}");
                    return ExitCode::FAILURE;
                }
            };
            match runtime.block_on(serve(config)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(err) => {
                    eprintln!("error: {err:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

fn validate(dir: &std::path::Path, tier: Tier) -> ExitCode {
    match scheduler_svc::catalog::validate(dir, tier) {
        Ok(validation) => {
            // Warnings on stderr, the summary last on stdout, so scripts can read either.
            for warning in &validation.warnings {
                eprintln!("warning: {warning}");
            }
            println!("{}", validation.summary);
            ExitCode::SUCCESS
        }
        Err(errors) => {
            eprintln!("{errors}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(config: Option<PathBuf>) -> anyhow::Result<()> {
    let config = Config::load(config.as_deref())?;
    let telemetry = antidote_net::trace::init(
        config
            .telemetry
            .service_name
            .as_deref()
            .unwrap_or("scheduler-svc"),
        config.telemetry.otlp_endpoint.as_deref(),
    )
    .context("key `telemetry.otlp_endpoint`")?;
    let catalog = Catalog::load(&config.curriculum, config.tier)
        .with_context(|| format!("curriculum {}", config.curriculum.display()))?;
    for warning in &catalog.warnings {
        tracing::warn!(
            file = %warning.file.display(),
            lesson = warning.lesson.as_deref().unwrap_or_default(),
            field = %warning.field,
            reason = %warning.reason,
            "curriculum warning: a skipped lesson refers to what does not exist"
        );
    }
    tracing::info!(summary = %catalog.summary(config.tier), "curriculum loaded");
    let http = if config.http.enabled {
        let listener = tokio::net::TcpListener::bind(config.http.listen)
            .await
            .with_context(|| {
                format!(
                    "cannot listen on {} (key `http.listen`)",
                    config.http.listen
                )
            })?;
        println!("http listening on {}", listener.local_addr()?);
        Some(listener)
    } else {
        None
    };
    // The admin API listens apart from the learners' (and not at all unless configured).
    let mut admin = None;
    let mut admin_http = None;
    let mut metrics = None;
    for (address, key, label, slot) in [
        (config.admin.listen, "admin.listen", "admin", &mut admin),
        (
            config.admin.http_listen,
            "admin.http_listen",
            "admin http",
            &mut admin_http,
        ),
        (
            config.admin.metrics_listen,
            "admin.metrics_listen",
            "metrics",
            &mut metrics,
        ),
    ] {
        if let Some(address) = address {
            let listener = tokio::net::TcpListener::bind(address)
                .await
                .with_context(|| format!("cannot listen on {address} (key `{key}`)"))?;
            println!("{label} listening on {}", listener.local_addr()?);
            *slot = Some(listener);
        }
    }
    let agent_intake = match config.agent_intake.listen {
        Some(address) => {
            let listener = tokio::net::TcpListener::bind(address)
                .await
                .with_context(|| {
                    format!("cannot listen on {address} (key `agent_intake.listen`)")
                })?;
            println!("agent intake listening on {}", listener.local_addr()?);
            Some(listener)
        }
        None => None,
    };
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot listen on {} (key `listen`)", config.listen))?;
    let signal = antidote_net::shutdown_signal();
    // Tests and scripts read this line (last) to learn the port when `listen` asks for port 0.
    println!("listening on {}", listener.local_addr()?);
    let shutdown = CancellationToken::new();
    let trigger = shutdown.clone();
    tokio::spawn(async move {
        signal.await;
        tracing::info!("shutting down");
        trigger.cancel();
    });
    let listeners = scheduler_svc::Listeners {
        grpc: listener,
        http,
        admin,
        admin_http,
        metrics,
        agent_intake,
    };
    let result = scheduler_svc::run(config, catalog, listeners, shutdown).await;
    telemetry.shutdown().await;
    result
}
