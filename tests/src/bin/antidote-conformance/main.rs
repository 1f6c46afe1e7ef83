//! `antidote-conformance`: checks a running agent against `proto/PROTOCOL.md`.
//!
//! ```text
//! antidote-conformance --agent http://127.0.0.1:7071 [--image busybox] [--http-port 8080]
//!     [--ssh-port 22] [--ready-timeout 180s] [--instance ID] [--check NAME]...
//! antidote-conformance --list [--check NAME]...
//! ```
//!
//! It speaks to the agent as the scheduler would, on its own scheduler instance id (so it never
//! touches live lessons of anyone else). The suite is a table of named checks
//! ([`checks::CHECKS`]), run in table order; each says what it needs: capabilities the agent
//! must offer in its handshake, and checks that must have passed first because they leave the
//! state it works on (the capabilities, the Watch stream, a READY live lesson).
//!
//! | check | needs | what it checks |
//! |---|---|---|
//! | `health` | | `grpc.health.v1` says `antidote.agent.v1.Backend` is SERVING |
//! | `handshake` | | major 1, a name, a build version, capacity, an instance id stable across two handshakes; learns the capabilities |
//! | `no-common-major` | `handshake` | a Handshake with no common major is FAILED_PRECONDITION naming the scheduler's majors |
//! | `bad-spec-codes` | `handshake` | each spec rule broken (id, generation, endpoints, labels, port, presentation type, connections, no spec) is INVALID_ARGUMENT naming its field, and List shows nothing afterwards |
//! | `get-unknown` | `handshake` | Get of an unknown id is NOT_FOUND |
//! | `deprovision-unknown` | `handshake` | Deprovision of an unknown id is OK |
//! | `recover-unknown` | `handshake`, `recover` offered | Recover of an unknown id is NOT_FOUND |
//! | `watch-snapshot` | `handshake`, `watch` offered | a Watch on our (fresh) instance starts with an empty snapshot; later checks wait on this stream and check its revisions never go back |
//! | `provision-ready` | `handshake` | Provision of a new live lesson answers at once with a non-terminal phase, then it becomes READY: endpoints in lesson order, the spec's labels, every presentation healthy, with an address (and a url for HTTP), answering its probe from here |
//! | `idempotent-provision` | `provision-ready` | Provision again with the same spec answers READY with the same addresses |
//! | `conflicting-spec` | `provision-ready` | another spec at the same generation is ALREADY_EXISTS |
//! | `get-agrees` | `provision-ready` | Get agrees with the READY state Watch (or Get) showed, at a revision no older |
//! | `stage-change` | `provision-ready` | generation 2 at stage 1 becomes READY in place, on the same addresses |
//! | `older-generation` | `stage-change` | Provision of generation 1 after that is FAILED_PRECONDITION |
//! | `recover-held` | `provision-ready`, `recover` offered | Recover of a live lesson the agent holds answers its state at the newest spec's generation |
//! | `list-pages` | `provision-ready` | with two more live lessons READY, pages of 1 list all three once, in the same order as one page |
//! | `plan-no-side-effects` | `handshake`, `plan` offered | Plan lists objects and creates nothing (Get NOT_FOUND, not in List) |
//! | `watch-heartbeat` | `watch-snapshot`, `watch` offered | a heartbeat arrives when nothing changes (1 s interval) |
//! | `deprovision` | `provision-ready` | every live lesson the suite provisioned is removed (waiting out TERMINATING), Get is NOT_FOUND, a second Deprovision is OK, List is empty |
//! | `watch-deletions` | `watch-snapshot`, `deprovision`, `watch` offered | Watch sends a `deleted` event for each removed live lesson, revisions rising |
//! | `watch-selector` | `list-pages`, `deprovision`, `watch` offered | a Watch selecting one live lesson (opened by `list-pages`) shows only that one's events, its deletion included |
//! | `watch-resync` | `handshake`, `watch` offered | always SKIP: forcing a resync needs thousands of changes while a watcher stalls; the SDK's StateBook tests cover it |
//!
//! `--list` prints the same table from the code, one line per check.
//!
//! # Needs and `--check`
//!
//! A check runs when every check it needs has passed and the agent offers every capability it
//! needs; otherwise it is reported SKIP with what is missing (`needs `provision-ready`, which
//! failed`). Every check but `health` and `handshake` needs `handshake`, directly or through
//! another check, since the handshake tells the capabilities (the specs the suite sends use the
//! presentations and configuration the agent offers).
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
//! - `checks`: the table, the selection, the runner, and the check bodies by topic
//!   (`handshake`, `codes`, `lifecycle`, `watch`).
//! - `suite`: the state checks share (connection, capabilities, the Watch stream, the live
//!   lessons made) and the calls they make through it.
//! - `watcher`: a Watch stream that checks its revisions as it reads.
//! - `probe`: readiness checks of a READY state, probing presentations from here.
//! - `report`: outcomes, report lines and the summary.
#![forbid(unsafe_code)]

mod checks;
mod probe;
mod report;
mod suite;
mod watcher;

use std::process::ExitCode;
use std::time::Duration;

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
    #[arg(long, required_unless_present = "list")]
    agent: Option<String>,
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
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let selection = checks::select(&args.checks);
    if args.list {
        checks::print_list(&selection);
        return ExitCode::SUCCESS;
    }
    // clap requires --agent unless --list is given, and --list has returned above.
    let Some(agent) = args.agent else {
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
    let channel = match endpoint.connect().await {
        Ok(channel) => channel,
        Err(err) => {
            eprintln!("antidote-conformance: cannot reach the agent at {agent}: {err}");
            return ExitCode::from(2);
        }
    };
    println!("antidote-conformance: checking the agent at {agent}");
    let settings = Settings {
        image: args.image,
        http_port: args.http_port,
        ssh_port: args.ssh_port,
        ready_timeout: args.ready_timeout,
    };
    let mut suite = Suite::new(channel, settings, args.instance);
    let report = checks::run(&mut suite, &selection).await;
    suite.clean_up().await;
    println!("{}", report.summary());
    if report.failed() == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
