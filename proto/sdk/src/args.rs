//! What every agent binary does: the flags it shares ([`AgentArgs`]) and its start-up
//! ([`run`]).

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::agent::{Agent, Backend};
use crate::server::{GRACE, Transport, run_with_grace};

/// The flags every agent takes, flattened into its own (`#[command(flatten)] agent:
/// AgentArgs`). An agent gives them its own defaults and environment variables with clap's
/// `mut_arg`, e.g. `#[command(mut_arg("listen", |a| a.env("ANTIDOTE_MINE_LISTEN")))]`.
#[derive(Debug, Clone, clap::Args)]
pub struct AgentArgs {
    /// Where to serve antidote.agent.v1 (port 0: any; the bound address is printed).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// Where to serve Prometheus `/metrics` (off when unset; port 0: any, printed).
    #[arg(long)]
    pub metrics_listen: Option<SocketAddr>,
    /// mTLS towards the scheduler (`--tls-cert`, `--tls-key`, `--tls-client-ca`,
    /// `--tls-require-identity`; `ANTIDOTE_AGENT_TLS_*`), or `--insecure-plaintext` off loopback.
    #[command(flatten)]
    pub tls: crate::tls::TlsArgs,
    /// Dial in to the scheduler instead of listening (`--connect https://SCHEDULER:PORT`,
    /// `ANTIDOTE_AGENT_CONNECT`): no listening port at all, for agents behind NAT.
    #[cfg(feature = "dial-in")]
    #[command(flatten)]
    pub connect: crate::dial::ConnectArgs,
    /// Learners' way in (`--entrypoint-listen ADDR`, its TLS and keys): web terminals and
    /// proxied HTTP presentations.
    #[cfg(feature = "entrypoint")]
    #[command(flatten)]
    pub entrypoint: crate::entrypoint::EntrypointArgs,
    /// How long calls and streams may go on once shutdown began before their connections are
    /// cut; an agent offering a flag for it sets it.
    #[arg(skip = GRACE)]
    pub grace: Duration,
}

/// What an agent binary's `main` calls: logging and span export (`name` is the service name;
/// OTLP when `OTEL_EXPORTER_OTLP_ENDPOINT` is set), then the backend (`backend`, awaited with
/// logging on, so its connecting is logged), the transport (a listener, mTLS or plaintext where
/// that is safe, or dialling in), `/metrics`, the entrypoint, and serving until SIGTERM or
/// ctrl-c and at most [`AgentArgs::grace`] after.
///
/// It prints, for scripts and tests to wait for, `entrypoint listening on ADDR` (with one) and
/// then [`Transport::announce`]'s line, once the signal handlers are installed.
pub async fn run<B, E>(
    name: &str,
    args: AgentArgs,
    backend: impl Future<Output = Result<B, E>>,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>>
where
    B: Backend,
    E: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let telemetry = crate::trace::init_logging(name)?;
    let backend = backend.await.map_err(Into::into)?;
    let transport = transport(&args).await?;
    let metrics = crate::metrics::bind(args.metrics_listen).await?;
    #[cfg(feature = "entrypoint")]
    let entrypoint = args.entrypoint.bind().await?;
    #[cfg(feature = "entrypoint")]
    if let Some(bound) = &entrypoint {
        println!("entrypoint listening on {}", bound.listener.local_addr()?);
    }
    let signal = crate::shutdown_signal();
    println!("{}", transport.announce());
    let agent = Agent::new(backend);
    let shutdown = CancellationToken::new();
    agent.backend().background(agent.book(), &shutdown);
    #[cfg(feature = "entrypoint")]
    if let Some(bound) = entrypoint {
        agent.serve_entrypoint(bound, shutdown.clone());
    }
    let shutdown = async move {
        signal.await;
        shutdown.cancel();
    };
    run_with_grace(agent, transport, metrics, telemetry, shutdown, args.grace).await
}

/// The agent's transport: the connections it dials in with `--connect`, else its listener
/// (mTLS, or plaintext where that is safe or the operator's explicit choice).
async fn transport(
    args: &AgentArgs,
) -> Result<Transport, Box<dyn std::error::Error + Send + Sync>> {
    #[cfg(feature = "dial-in")]
    if let Some(dial) = args.connect.dial_in(&args.tls)? {
        return Ok(dial.into());
    }
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|err| format!("cannot listen on {}: {err}", args.listen))?;
    Ok(args.tls.listener(listener)?.into())
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    /// An agent's own flags around the shared ones, with its own default and variable.
    #[derive(clap::Parser)]
    #[command(mut_arg("listen", |a| a.env("ANTIDOTE_TEST_MINE_LISTEN").default_value("127.0.0.1:7079")))]
    struct Mine {
        #[command(flatten)]
        agent: AgentArgs,
        /// A flag of its own.
        #[arg(long, default_value_t = 3)]
        tries: u32,
    }

    #[test]
    fn an_agent_sets_its_own_defaults_on_the_shared_flags() {
        let mine = Mine::parse_from(["mine"]);
        assert_eq!(mine.agent.listen, "127.0.0.1:7079".parse().unwrap());
        assert_eq!(mine.agent.metrics_listen, None);
        assert_eq!(mine.agent.grace, GRACE);
        assert_eq!(mine.tries, 3);
        let mine = Mine::parse_from([
            "mine",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
        ]);
        assert_eq!(mine.agent.listen.port(), 0);
        assert!(mine.agent.metrics_listen.is_some());
    }
}
