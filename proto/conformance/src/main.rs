//! `antidote-conformance`: checks a running agent against `proto/PROTOCOL.md`.
//!
//! ```text
//! antidote-conformance --agent http://127.0.0.1:7071 [--restart-cmd CMD] [--image busybox]
//!     [--http-port 8080] [--ssh-port 22] [--bad-image ghost] [--failing-config SCRIPT]
//!     [--silent-port 9] [--napalm-image SLUG [--napalm-driver eos]] [--ready-timeout 180s]
//!     [--config-user USER --config-password PASSWORD] [--capacity-fill 32] [--force-resync]
//!     [--entrypoint URL [--terminal-image SLUG --ssh-user USER --ssh-password PASSWORD]
//!      [--entrypoint-max-per-client 256]] [--instance ID] [--check NAME]...
//! antidote-conformance --list [--check NAME]...
//! ```
//!
//! It speaks to the agent as the scheduler would, on its own scheduler instance id (so it never
//! touches live lessons of anyone else). The suite is a table of named checks
//! ([`checks::CHECKS`]), run in table order; each says what it needs: capabilities the agent
//! must offer in its handshake, flags that say how to do what only the agent's operator knows
//! (restart it), and checks that must have passed first because they leave the state it works
//! on (the capabilities, the Watch stream, a READY live lesson). The guide's table "Rules and
//! their checks" says which rule each check proves.
//!
//! | check | needs | what it checks |
//! |---|---|---|
//! | `health` | | `grpc.health.v1` says `antidote.agent.v1.Backend` is SERVING |
//! | `handshake` | | major 1, a name, a build version, capacity, an instance id stable across two handshakes; learns the capabilities |
//! | `no-common-major` | `handshake` | a Handshake with no common major is FAILED_PRECONDITION, reason NO_COMMON_MAJOR with both lists |
//! | `bad-spec-codes` | `handshake` | each spec rule broken (id, upper-case id, generation, endpoints, a label, port, presentation type, configuration, connections, no spec) is INVALID_ARGUMENT, reason INVALID_SPEC, `field` its path; List shows nothing afterwards |
//! | `error-details` | `handshake` | refusals without state (handshake, Get, Recover, Provision, Plan) carry one ErrorInfo of domain antidote.io with the documented reason and metadata |
//! | `request-too-large` | `handshake` | a request of exactly 4 MiB (unknown fields padding a Get) is served; one of 4 MiB and a byte, and one of 8 MiB, are served or refused RESOURCE_EXHAUSTED with REQUEST_TOO_LARGE and a `limit` from 4194304 to below the request's size |
//! | `get-unknown` | `handshake` | Get of an unknown id is NOT_FOUND, LIVE_LESSON_NOT_FOUND naming the id |
//! | `deprovision-unknown` | `handshake` | Deprovision of an unknown id is OK |
//! | `recover-unknown` | `handshake`, `recover` offered | Recover of an unknown id is NOT_FOUND, LIVE_LESSON_NOT_FOUND naming the id |
//! | `watch-snapshot` | `handshake`, `watch` offered | a Watch on our (fresh) instance starts with an empty snapshot; later checks wait on this stream and check its revisions never go back |
//! | `provision-ready` | `handshake` | Provision of a new live lesson answers at once with a non-terminal phase and a handle, then it becomes READY: endpoints in lesson order, the spec's labels, every presentation healthy, with an address (and a url for HTTP), answering its probe from here |
//! | `idempotent-provision` | `provision-ready` | Provision again with the same spec answers READY with the same addresses |
//! | `conflicting-spec` | `provision-ready` | another spec at the same generation is ALREADY_EXISTS, SPEC_CONFLICT |
//! | `get-agrees` | `provision-ready` | Get agrees with the READY state Watch (or Get) showed, at a revision no older |
//! | `extra-labels` | `provision-ready` | a label beyond the guide's five is on the state, and List selects on it |
//! | `stage-change` | `provision-ready` | generation 2 at stage 1 becomes READY in place, on the same addresses |
//! | `older-generation` | `stage-change` | Provision of generation 1 after that is FAILED_PRECONDITION, GENERATION_OUTDATED with both generations |
//! | `endpoints-fixed` | `stage-change` | a newer generation adding an endpoint, or dropping a connection, is INVALID_SPEC naming `spec.endpoints` / `spec.connections`; the held generation stays |
//! | `recover-held` | `stage-change`, `recover` offered | Recover of a held live lesson: the same spec answers its state, an older one GENERATION_OUTDATED, another spec SPEC_CONFLICT, a newer generation becomes READY |
//! | `list-pages` | `provision-ready` | with two more live lessons READY, pages of 1 list all three once, in the same order as one page |
//! | `watch-reconnect` | `list-pages`, `watch` offered | a second Watch's snapshot holds every live lesson List shows, in one message, at a revision no older than anything told before, each state no newer than it |
//! | `watch-pages` | `list-pages`, `watch` offered, `watch.pages` offered | asked for pages of a bounded size, a Watch snapshot comes as several messages at one revision, `more` set on all but the last, holding every live lesson List shows ([W8]) |
//! | `plan-no-side-effects` | `handshake`, `plan` offered | Plan lists objects and creates nothing (Get NOT_FOUND, not in List) |
//! | `plan-bad-spec` | `handshake`, `plan` offered | Plan of a broken spec is INVALID_SPEC with Provision's field; of a valid one, OK without error diagnostics; of an image the agent cannot run, OK |
//! | `watch-heartbeat` | `handshake`, `watch` offered | on a quiet stream at a 1 s interval, heartbeats come at most 2 s apart at the snapshot's revision |
//! | `deprovision` | `provision-ready` | every live lesson the suite provisioned is removed (waiting out TERMINATING), Get is NOT_FOUND, a second Deprovision is OK, List is empty |
//! | `watch-deletions` | `watch-snapshot`, `deprovision`, `watch` offered | Watch shows each removed live lesson TERMINATING, then one `deleted` event, revisions rising |
//! | `watch-selector` | `list-pages`, `deprovision`, `watch` offered | a Watch selecting one live lesson (opened by `list-pages`) shows only that one's events, its deletion included |
//! | `watch-resync` | `handshake`, `watch` offered, `--force-resync` given | a watcher on a connection with a 16 KiB HTTP/2 window stops reading while 10,000 generations of one live lesson are pushed (the suite's other stream reading on): it gets a resync at its last revision, then a snapshot, and its view reaches the newest generation READY; more than 8,392 messages without a resync fail ([W7]) |
//! | `concurrent-provision` | `handshake` | five identical Provisions of a new live lesson at once all answer OK; it becomes READY and List shows it once |
//! | `concurrent-deprovision` | `concurrent-provision` | five identical Deprovisions at once all answer OK; Get is NOT_FOUND; Watch tells one deletion |
//! | `ready-delay` | `handshake` | with a 3 s ready delay, READY comes no sooner than 3 s after Provision, and again after a stage change |
//! | `configuration-shell` | `handshake`, `stage.configuration` offered | a live lesson with a shell configuration becomes READY (unless the agent lists types without `configuration.shell`) |
//! | `configuration-python` | `handshake`, `configuration.python` offered | a live lesson with a python configuration becomes READY |
//! | `configuration-ansible` | `handshake`, `configuration.ansible` offered | a live lesson with an ansible playbook becomes READY |
//! | `configuration-napalm` | `handshake`, `configuration.napalm` offered, `--napalm-image` given | a live lesson of the NAPALM image with a napalm configuration becomes READY |
//! | `guide-jupyter` | `handshake`, `guide.jupyter` offered | a live lesson with a Jupyter guide endpoint ([V7]) becomes READY and its `web` presentation serves the spec's notebook as `/files/guide.ipynb` within 90 s of READY, then, after a stage change, the new generation's |
//! | `failed-image` | `handshake` | a live lesson of `--bad-image` is accepted, then FAILED with a reason naming the slug |
//! | `failed-config` | `handshake`, `stage.configuration` offered | a live lesson whose configuration is `--failing-config` is FAILED with a reason naming the file |
//! | `failed-probe` | `handshake`, `--silent-port` given | a live lesson with a presentation on `--silent-port` is FAILED with a reason naming the presentation |
//! | `capacity-refusal` | `handshake` | filled to `max_live_lessons` (SKIP when 0, or more places free than `--capacity-fill`, 32 by default), one more is RESOURCE_EXHAUSTED, CAPACITY_EXHAUSTED; a held one is not refused; the handshake counts them; a removal frees a place; List shows nothing of them once removed |
//! | `entrypoint-tokens` | `handshake`, `presentation.http` offered, `--entrypoint` given | through the entrypoint a READY HTTP presentation answers as at its address with the suite's token (query or `Authorization: Bearer` in any spelling); none, malformed, expired or too long-lived: 401; another live lesson, endpoint or presentation: 403; a live lesson not held: 401, then 404 with its token ([H6]) |
//! | `entrypoint-keys` | `entrypoint-tokens` | a retired key and a revoked key get 401; another instance's key 403 (401 with a token naming ours); the suite's own key still admits ([H2]-[H4]) |
//! | `entrypoint-cookie` | `entrypoint-tokens` | a query-parameter admission sets `antidote_entrypoint` (the token, host-only, Path the prefix, HttpOnly, Max-Age within the token's life, SameSite of the entrypoint's kind); it admits without Sec-Fetch-Site or with same-origin/none, 403 cross-site and same-site ([H7]) |
//! | `entrypoint-proxy` | `entrypoint-tokens` | a path and query reach the presentation as at its address (token left out), the prefix without its slash redirects to it, one origin's answers carry the sandbox policy ([H5], [H8]) |
//! | `entrypoint-activity` | `entrypoint-tokens` | reads of a page script (Sec-Fetch-Mode cors, no-cors, same-origin, websocket) leave last_active alone; a navigation moves it within 15 s ([H12]) |
//! | `entrypoint-connection-cap` | `entrypoint-tokens` | `--entrypoint-max-per-client` connections are answered, one more is closed unanswered, closing one frees its place ([H11]) |
//! | `entrypoint-terminal` | `handshake`, `presentation.ssh` offered, `--entrypoint` given, `--terminal-image` given | a web terminal runs a JSON and a binary input frame, tells `exit 7` and closes; another site's Origin is 403; revoking the key of an open terminal closes it with 1008 ([H9], [H4], [H5]) |
//! | `checks-unimplemented` | `handshake` | without `checks` offered, RunChecks is UNIMPLEMENTED, reason NOT_IMPLEMENTED, `rpc` RunChecks (SKIP when the agent offers `checks`) ([X1], [V4]) |
//! | `checks-run` | `handshake`, `checks` offered | a file exiting 0 and one exiting 3 are answered with their exit status and output (stderr included), a 200 KiB file runs whole; phase, generation and revision unchanged ([X3], [X5]) |
//! | `checks-timeout` | `handshake`, `checks` offered | a file sleeping 600 s with a 2 s timeout is answered `timed_out` with what it wrote before ([X3]) |
//! | `checks-one-at-a-time` | `handshake`, `checks` offered | a second RunChecks while a 5 s one runs on the same live lesson is ABORTED (CHECKS_RUNNING) ([X4]) |
//! | `checks-refusals` | `handshake`, `checks` offered | an unknown live lesson is NOT_FOUND, another generation NOT_READY, no files and an unknown endpoint INVALID_SPEC naming the field, a live lesson being removed NOT_READY or NOT_FOUND ([X2]) |
//! | `restart-recover` | `handshake`, `--restart-cmd` given | a READY live lesson, then the restart: a new instance id; the old stream ends; a new one does not show it; List shows it BOOTING and Get is NOT_FOUND, or List does not and Recover is NOT_FOUND; Recover (Provision without `recover`) takes it on |
//! | `restart-adopt` | `restart-recover` | what outlived the restart becomes READY on the same addresses, no sooner than its ready delay after Recover (SKIP when nothing outlived it) |
//!
//! `--list` prints the same table from the code, one line per check.
//!
//! # Needs and `--check`
//!
//! A check runs when every check it needs has passed and the agent offers every capability and
//! the suite was given every flag it needs; otherwise it is reported SKIP with what is missing
//! (`needs `provision-ready`, which failed`). Every check but `health` and `handshake` needs
//! `handshake`, directly or through another check, since the handshake tells the capabilities
//! (the specs the suite sends use the presentations and configuration the agent offers).
//!
//! `--check NAME` (repeatable) runs only the named checks and, before them, every check they
//! need (transitively); those run and are reported like the others. The run follows table order
//! whatever the order of the flags: `--check stage-change` runs `handshake`, `provision-ready`,
//! `stage-change`. A check that is selected but not needed can still shape the run: when
//! `watch-snapshot` runs, later checks wait for READY on its stream, otherwise they poll Get. An
//! unknown name is a usage error (exit 2) listing the valid ones.
//!
//! `--list` prints every check (or, with `--check`, those that would run) with its one-line
//! description and its needs, and exits without contacting an agent.
//!
//! # Report
//!
//! One line per check, `  PASS  provision-ready: the live lesson becomes READY: <detail>` (FAIL
//! with the reason, SKIP with why), then `N passed, M failed, K skipped`. The exit code is 0 when
//! no check failed, 1 when one did, 2 when the flags are wrong or the agent cannot be reached.
//! Every live lesson the suite provisioned is deprovisioned at the end, whatever happened.
//!
//! # Modules
//!
//! - `checks`: the table, the selection, the runner, typed-refusal checking, and the check
//!   bodies by topic (`handshake`, `codes`, `lifecycle`, `watch`, `paths`, `restart`).
//! - `suite`: the state checks share (connection, capabilities, the Watch stream, the live
//!   lessons made) and the calls they make through it.
//! - `watcher`: a Watch stream that checks its revisions as it reads.
//! - `probe`: readiness checks of a READY state, probing presentations from here.
//! - `report`: outcomes, report lines and the summary.
#![forbid(unsafe_code)]

mod accept;
mod checks;
mod probe;
mod report;
mod suite;
mod watcher;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use antidote_sdk::tls;

use clap::Parser;
use clap::builder::PossibleValuesParser;

use crate::suite::{Settings, Suite};

#[derive(Parser)]
#[command(
    name = "antidote-conformance",
    about = "Checks a running antidote.agent.v1 agent against the protocol guide"
)]
struct Args {
    /// The agent's address, e.g. http://127.0.0.1:7071.
    #[arg(long, required_unless_present_any = ["list", "accept_agent"])]
    agent: Option<String>,
    /// Dial-in: listen here as a scheduler's agent intake (printing `intake listening on ADDR`)
    /// and check the agent that dials in (`--connect https://ADDR`), over its connection.
    /// Needs --tls-cert and --tls-key (the suite's server certificate) and --tls-ca (the CA of
    /// the agent's client certificate); --tls-server-name, when given, is the identity the
    /// agent's certificate must carry.
    #[arg(long, value_name = "ADDR", conflicts_with = "agent", requires_all = ["tls_ca", "tls_cert", "tls_key"])]
    accept_agent: Option<String>,
    /// Run only this check, after the checks it needs (repeatable; `--list` names them).
    #[arg(
        long = "check",
        value_name = "NAME",
        value_parser = PossibleValuesParser::new(checks::CHECKS.iter().map(|c| c.name)),
        hide_possible_values = true
    )]
    checks: Vec<String>,
    /// Print the checks (those `--check` selects, or all) with what they need, and exit.
    #[arg(long)]
    list: bool,
    /// The curriculum image slug of the test lesson's endpoints (the agent maps it to its own
    /// image reference).
    #[arg(long, default_value = "busybox")]
    image: String,
    /// The port the image serves HTTP on (used when the agent offers presentation.http).
    #[arg(long, default_value_t = 8080)]
    http_port: u32,
    /// The port the image answers with an SSH banner (used when the agent offers
    /// presentation.ssh).
    #[arg(long, default_value_t = 22)]
    ssh_port: u32,
    /// How long a live lesson may take to become READY.
    #[arg(long, default_value = "180s", value_parser = humantime::parse_duration)]
    ready_timeout: Duration,
    /// The scheduler instance id the suite speaks as (default: a fresh one per run). Fix it when
    /// the backend needs to know, e.g. a test node that only runs one instance's pods.
    #[arg(long)]
    instance: Option<String>,
    /// A curriculum image slug the agent cannot run: its endpoints never start.
    #[arg(long, default_value = "ghost")]
    bad_image: String,
    /// A shell configuration that exits non-zero on `--image`.
    #[arg(
        long,
        default_value = "echo 'antidote-conformance: fails on purpose' >&2; exit 3"
    )]
    failing_config: String,
    /// A port where `--image` accepts connections and never answers (0: none; `failed-probe`
    /// is skipped).
    #[arg(long, default_value_t = 9)]
    silent_port: u32,
    /// The configuration user `--image` admits over SSH (the spec's `image.config_user`), for
    /// configurators that log in to the endpoint (`configuration-ansible`); empty: none.
    #[arg(long, default_value = "")]
    config_user: String,
    /// Its password (`image.config_password`). Sent to the agent in specs only.
    #[arg(long, default_value = "")]
    config_password: String,
    /// A curriculum image slug NAPALM can configure (for agents claiming
    /// `configuration.napalm`).
    #[arg(long)]
    napalm_image: Option<String>,
    /// The NAPALM driver of `--napalm-image` (its configuration is `hostname …`).
    #[arg(long, default_value = "eos")]
    napalm_driver: String,
    /// A shell command that restarts the agent on the same address (`sh -c CMD`); the suite then
    /// waits for a handshake with a new instance id. Without it the restart checks are skipped.
    #[arg(long)]
    restart_cmd: Option<String>,
    /// The most live lessons `capacity-refusal` creates to fill the agent: it runs when the
    /// free places (max_live_lessons minus live_lessons) are at most this, and is skipped,
    /// naming both numbers, when more are free or the agent sets no limit.
    #[arg(long, default_value_t = 32)]
    capacity_fill: u32,
    /// Run `watch-resync`: stall one Watch stream (a 16 KiB HTTP/2 window, nothing read) while
    /// 10,000 generations of one live lesson are pushed, so the agent must drop and resync it.
    #[arg(long)]
    force_resync: bool,
    /// The agent's entrypoint as the suite reaches it (plain http://, with `{live_lesson}` where
    /// the agent has an origin per live lesson): the `entrypoint-*` checks run, with tokens the
    /// suite signs (its key goes in its Handshake).
    #[arg(long, value_name = "URL")]
    entrypoint: Option<String>,
    /// An image slug whose SSH presentation on --ssh-port admits --ssh-user to a POSIX shell
    /// (`entrypoint-terminal`).
    #[arg(long, requires = "entrypoint")]
    terminal_image: Option<String>,
    /// The user --terminal-image admits over SSH (the spec's `image.ssh_user`).
    #[arg(long, default_value = "")]
    ssh_user: String,
    /// Its password (`image.ssh_password`). Sent to the agent in specs only.
    #[arg(long, default_value = "")]
    ssh_password: String,
    /// The entrypoint's connection cap per client address (`entrypoint-connection-cap` fills it).
    #[arg(long, default_value_t = 256)]
    entrypoint_max_per_client: u32,
    /// mTLS: the CA certificates (PEM) that sign the agent's certificate. With --tls-cert and
    /// --tls-key, the suite connects as a scheduler would over mTLS (an `https://` --agent).
    #[arg(long, requires_all = ["tls_cert", "tls_key"])]
    tls_ca: Option<PathBuf>,
    /// mTLS: the client certificate (PEM) the suite presents, one the agent accepts.
    #[arg(long, requires_all = ["tls_ca", "tls_key"])]
    tls_cert: Option<PathBuf>,
    /// mTLS: its private key (PEM).
    #[arg(long, requires_all = ["tls_ca", "tls_cert"])]
    tls_key: Option<PathBuf>,
    /// mTLS: the identity the agent's certificate must carry (a DNS name or a spiffe:// URI);
    /// default: the host of --agent.
    #[arg(long, requires = "tls_ca")]
    tls_server_name: Option<String>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let selection = checks::select(&args.checks);
    if args.list {
        checks::print_list(&selection);
        return ExitCode::SUCCESS;
    }
    if let Some(addr) = args.accept_agent.clone() {
        // clap requires the three TLS flags with --accept-agent.
        let (Some(ca), Some(cert), Some(key)) = (&args.tls_ca, &args.tls_cert, &args.tls_key)
        else {
            eprintln!(
                "antidote-conformance: --accept-agent needs --tls-ca, --tls-cert and --tls-key"
            );
            return ExitCode::from(2);
        };
        let files = tls::TlsFiles {
            cert: cert.clone(),
            key: key.clone(),
            ca: ca.clone(),
        };
        let channel = match accept::channel(&addr, files, args.tls_server_name.as_deref()).await {
            Ok(channel) => channel,
            Err(err) => {
                eprintln!("antidote-conformance: {err}");
                return ExitCode::from(2);
            }
        };
        println!("antidote-conformance: checking the agent that dialled in to {addr}");
        return check(channel, None, args, &selection).await;
    }
    // clap requires --agent unless --list or --accept-agent is given, and both have returned
    // above.
    let Some(agent) = args.agent.clone() else {
        eprintln!("antidote-conformance: --agent is required");
        return ExitCode::from(2);
    };
    let endpoint = match tonic::transport::Endpoint::from_shared(agent.clone()) {
        Ok(endpoint) => endpoint
            .connect_timeout(Duration::from_secs(10))
            .timeout(Duration::from_secs(60)),
        Err(err) => {
            eprintln!("antidote-conformance: `{agent}` is not an address: {err}");
            return ExitCode::from(2);
        }
    };
    // The watcher `watch-resync` stalls has a connection of its own, whose small windows let
    // the agent send it only a few events before flow control stops them.
    let stalled_endpoint = endpoint
        .clone()
        .initial_stream_window_size(checks::STALLED_WINDOW)
        .initial_connection_window_size(checks::STALLED_WINDOW);
    let (channel, stalled) = match (&args.tls_ca, &args.tls_cert, &args.tls_key) {
        (Some(ca), Some(cert), Some(key)) => {
            let files = tls::TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                ca: ca.clone(),
            };
            match mtls_channel(&agent, endpoint, files, args.tls_server_name.as_deref()).await {
                Ok((channel, client)) => (channel, client.channel(stalled_endpoint)),
                Err(err) => {
                    eprintln!("antidote-conformance: cannot reach the agent at {agent}: {err}");
                    return ExitCode::from(2);
                }
            }
        }
        _ => match endpoint.connect().await {
            Ok(channel) => (channel, stalled_endpoint.connect_lazy()),
            Err(err) => {
                eprintln!("antidote-conformance: cannot reach the agent at {agent}: {err}");
                return ExitCode::from(2);
            }
        },
    };
    println!("antidote-conformance: checking the agent at {agent}");
    check(channel, Some(stalled), args, &selection).await
}

/// Runs the selected checks over `channel` and prints the report.
async fn check(
    channel: tonic::transport::Channel,
    stalled: Option<tonic::transport::Channel>,
    args: Args,
    selection: &[&checks::Check],
) -> ExitCode {
    let settings = Settings {
        image: args.image,
        http_port: args.http_port,
        ssh_port: args.ssh_port,
        ready_timeout: args.ready_timeout,
        bad_image: args.bad_image,
        failing_config: args.failing_config,
        silent_port: args.silent_port,
        config_user: args.config_user,
        config_password: args.config_password,
        napalm_image: args.napalm_image,
        napalm_driver: args.napalm_driver,
        restart_cmd: args.restart_cmd,
        capacity_fill: args.capacity_fill,
        force_resync: args.force_resync,
        entrypoint: args.entrypoint,
        terminal_image: args.terminal_image,
        ssh_user: args.ssh_user,
        ssh_password: args.ssh_password,
        entrypoint_max_per_client: args.entrypoint_max_per_client,
    };
    let mut suite = Suite::new(channel, settings, args.instance);
    suite.stalled_channel = stalled;
    let report = checks::run(&mut suite, selection).await;
    suite.clean_up().await;
    println!("{}", report.summary());
    if report.failed() == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// A channel to the agent over mTLS, proven by one health check: a refused handshake is an
/// error naming why (the agent's certificate, or the agent refusing ours). The client TLS comes
/// back too, for the suite's second connection.
async fn mtls_channel(
    agent: &str,
    endpoint: tonic::transport::Endpoint,
    files: tls::TlsFiles,
    server_name: Option<&str>,
) -> Result<(tonic::transport::Channel, std::sync::Arc<tls::ClientTls>), String> {
    let host = endpoint.uri().host().unwrap_or_default().to_owned();
    let identity = tls::Identity::parse(server_name.unwrap_or(host.trim_matches(['[', ']'])))
        .map_err(|err| err.to_string())?;
    let client =
        std::sync::Arc::new(tls::ClientTls::load(files, identity).map_err(|err| err.to_string())?);
    if !agent.starts_with("https://") {
        return Err("with --tls-* the agent's address must start with https://".into());
    }
    let channel = client.channel(endpoint);
    let check = tonic_health::pb::health_client::HealthClient::new(channel.clone())
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await;
    match check {
        Ok(_) => Ok((channel, client)),
        Err(status) => Err(client
            .status()
            .failure
            .unwrap_or_else(|| status.to_string())),
    }
}
