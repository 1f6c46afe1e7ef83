//! Host firewall rules that keep lesson networks away from the engine's host and the cloud
//! metadata address.
//!
//! Docker's own rules isolate one bridge network from another, but a container on any bridge
//! still reaches the host itself (every address it has: the bridge gateway, its LAN address,
//! anything bound on loopback-routed addresses such as 169.254.169.254 on some clouds) and,
//! through the host's routing, the metadata service and the internet. Docker 20.10's API has no
//! way to say "this network may not", so the agent installs its own iptables rules when it runs
//! in the engine's network namespace, one set per lesson network, keyed by the network's bridge
//! and tagged with the network's name (a comment), so that removal (and removal after a
//! restart) finds them by the live lesson's name stem:
//!
//! - `INPUT`: nothing new from the bridge to the host (`-i BR -m conntrack ! --ctstate
//!   ESTABLISHED,RELATED -j DROP`). Replies still flow: published presentations are served by
//!   docker-proxy on the host, which opens the connection to the container.
//! - `DOCKER-USER` (Docker evaluates it first in `FORWARD` and never edits it): nothing new
//!   leaves the bridge (`-i BR ! -o BR -m conntrack ! --ctstate ESTABLISHED,RELATED -j DROP`).
//!   Replies still flow: a presentation published on a non-loopback `--publish-host` is
//!   reached from other hosts through Docker's DNAT, and the container's answer is forwarded
//!   out of the bridge. With `--allow-egress`, only the link-local range of the metadata
//!   address is dropped (`-i BR -d 169.254.0.0/16 -j DROP`).
//!
//! The iptables variant is the one whose `FORWARD` chain jumps to `DOCKER-USER` (iptables-nft or
//! iptables-legacy, whichever dockerd uses). When the engine is remote, or its bridges are not in
//! this process's network namespace, or iptables cannot be run, nothing can be installed here:
//! the agent says so once, loudly, and marks every live lesson with a `HostConfined: false`
//! condition (`--firewall required` refuses to run lessons instead). IPv6 is not covered: lesson
//! networks are created IPv4-only.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::process::Command;

/// How the agent treats host confinement.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Install the rules where the agent can; warn once and carry on where it cannot.
    Auto,
    /// Install the rules; a live lesson whose networks cannot be confined fails, and the agent
    /// does not start when the rules cannot be installed at all.
    Required,
    /// Never install rules (lesson networks reach the host); warned about at start.
    Off,
}

/// A firewall failure, with the command and what it printed.
#[derive(Debug, thiserror::Error)]
pub enum FirewallError {
    /// iptables refused or could not run.
    #[error("`{command}` failed: {output}")]
    Command {
        /// The command line.
        command: String,
        /// Its stderr (or the spawn error).
        output: String,
    },
    /// Confinement is required but impossible here.
    #[error("lesson network `{network}` cannot be confined to its bridge: {why}")]
    Unconfinable {
        /// The network.
        network: String,
        /// Why not.
        why: String,
    },
}

/// Whether a network got its rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Confinement {
    /// The rules are in place.
    Confined,
    /// No rules: why not (already warned about).
    Unconfined(String),
}

/// What the agent can do on this host.
#[derive(Debug)]
enum State {
    /// Rules go in with this iptables binary; `batch` is its `-save`/`-restore` pair, when
    /// there is one, for changing several rules with one process.
    Active {
        iptables: PathBuf,
        batch: Option<Batch>,
    },
    /// Rules cannot go in; why.
    Unavailable(String),
    /// The operator turned confinement off.
    Off,
}

/// The agent's host firewall.
#[derive(Debug)]
pub struct Firewall {
    state: State,
    /// `--firewall required`: a lesson that cannot be confined fails.
    required: bool,
    /// `--allow-egress`: lessons may reach beyond their networks (never the host or the
    /// metadata range).
    allow_egress: bool,
    /// Set once the "cannot confine" warning was logged, so it is said once, not per lesson.
    warned: AtomicBool,
}

/// The chain Docker evaluates first for forwarded traffic and leaves to its users.
const DOCKER_USER: &str = "DOCKER-USER";
/// The range of the metadata address (169.254.169.254) and other link-local services.
const LINK_LOCAL: &str = "169.254.0.0/16";

impl Firewall {
    /// Finds out whether rules can be installed for the engine at `docker_host` (the
    /// `DOCKER_HOST` value; none: the default local socket).
    pub async fn detect(mode: Mode, allow_egress: bool, docker_host: Option<&str>) -> Firewall {
        let state = match mode {
            Mode::Off => State::Off,
            Mode::Auto | Mode::Required => match docker_host {
                Some(host) if !host.is_empty() && !host.starts_with("unix://") => {
                    State::Unavailable(format!(
                        "the Docker engine at {host} is remote, so agent-docker cannot install firewall rules on its host"
                    ))
                }
                _ => match find_iptables().await {
                    Ok(iptables) => State::Active {
                        batch: Batch::beside(&iptables),
                        iptables,
                    },
                    Err(why) => State::Unavailable(why),
                },
            },
        };
        Firewall {
            state,
            required: mode == Mode::Required,
            allow_egress,
            warned: AtomicBool::new(false),
        }
    }

    /// A firewall that installs nothing (for tests and tools).
    pub fn off() -> Firewall {
        Firewall {
            state: State::Off,
            required: false,
            allow_egress: false,
            warned: AtomicBool::new(true),
        }
    }

    /// Why lesson networks are not confined on this agent, if they are not (for the start-up
    /// message and `Required`'s refusal).
    pub fn unavailable(&self) -> Option<String> {
        match &self.state {
            State::Active { .. } => None,
            State::Unavailable(why) => Some(why.clone()),
            State::Off => Some("--firewall off".to_owned()),
        }
    }

    /// Whether `--firewall required` was asked for.
    pub fn required(&self) -> bool {
        self.required
    }

    /// Logs, once per agent, that lessons reach the host.
    fn warn_once(&self, why: &str) {
        if !self.warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                reason = %why,
                "LESSON NETWORKS ARE NOT CONFINED: endpoints can reach the engine's host and the cloud metadata address (169.254.169.254); install equivalent rules on the engine's host or run agent-docker there (see README)"
            );
        }
    }

    /// Logs the start-up warning when lessons will not be confined.
    pub fn warn_at_start(&self) {
        if let Some(why) = self.unavailable() {
            self.warn_once(&why);
        }
    }

    /// Installs the rules of lesson network `network` on bridge `bridge` (idempotent).
    /// `fresh`: the agent has just created the network, so its bridge is new and has no rules
    /// yet: they go in with one `iptables-restore` instead of a check and an insert per rule
    /// (each an iptables process taking the xtables lock, which dockerd takes too).
    pub async fn confine(
        &self,
        network: &str,
        bridge: &str,
        fresh: bool,
    ) -> Result<Confinement, FirewallError> {
        let (iptables, batch) = match &self.state {
            State::Active { iptables, batch } => (iptables, batch),
            State::Unavailable(why) => return self.unconfined(network, why.clone()),
            State::Off => return Ok(Confinement::Unconfined("--firewall off".to_owned())),
        };
        if !Path::new("/sys/class/net").join(bridge).exists() {
            return self.unconfined(
                network,
                format!(
                    "the engine's bridge {bridge} is not in agent-docker's network namespace (is the agent in a container, or the engine elsewhere?)"
                ),
            );
        }
        let rules = self.rules(network, bridge);
        if let (true, Some(batch)) = (fresh, batch) {
            match batch.restore(rules.iter().map(|rule| ("-I", rule))).await {
                Ok(()) => return Ok(Confinement::Confined),
                Err(err) => {
                    tracing::debug!(error = %err, "iptables-restore failed; rule by rule");
                }
            }
        }
        for rule in rules {
            let mut check = vec!["-w", "-C"];
            check.extend(rule.iter().map(String::as_str));
            if run(iptables, &check).await.is_ok() {
                continue;
            }
            let mut insert = vec!["-w", "-I"];
            insert.extend(rule.iter().map(String::as_str));
            run(iptables, &insert).await?;
        }
        Ok(Confinement::Confined)
    }

    fn unconfined(&self, network: &str, why: String) -> Result<Confinement, FirewallError> {
        if self.required {
            return Err(FirewallError::Unconfinable {
                network: network.to_owned(),
                why,
            });
        }
        self.warn_once(&why);
        Ok(Confinement::Unconfined(why))
    }

    /// The rules of one network: chain first, then the match, each tagged with the network.
    fn rules(&self, network: &str, bridge: &str) -> Vec<Vec<String>> {
        rules(network, bridge, self.allow_egress)
    }

    /// Removes every rule tagged with a network of the live lesson whose names start with
    /// `stem` (idempotent; nothing to do when the firewall is not active).
    pub async fn release(&self, stem: &str) -> Result<(), FirewallError> {
        let State::Active { iptables, batch } = &self.state else {
            return Ok(());
        };
        // One listing and one deletion of them all, when the batch tools are there; rule by
        // rule when that fails (a concurrent removal of the same live lesson deleted one
        // first, and a restore is all or nothing).
        if let Some(batch) = batch
            && let Ok(listing) = batch.save().await
        {
            let ours: Vec<Vec<String>> = listing
                .lines()
                .filter_map(|line| tagged_rule(line, stem))
                .filter(|rule| {
                    rule.first()
                        .is_some_and(|chain| chain == "INPUT" || chain == DOCKER_USER)
                })
                .collect();
            if ours.is_empty()
                || batch
                    .restore(ours.iter().map(|rule| ("-D", rule)))
                    .await
                    .is_ok()
            {
                return Ok(());
            }
        }
        for chain in ["INPUT", DOCKER_USER] {
            let listing = run(iptables, &["-w", "-S", chain]).await?;
            for line in listing.lines() {
                let Some(rule) = tagged_rule(line, stem) else {
                    continue;
                };
                let mut delete = vec!["-w", "-D"];
                delete.extend(rule.iter().map(String::as_str));
                if let Err(err) = run(iptables, &delete).await {
                    // A concurrent removal of the same live lesson may have deleted it first.
                    if still_listed(iptables, chain, line).await {
                        return Err(err);
                    }
                }
            }
        }
        Ok(())
    }
}

impl Firewall {
    /// Removes our rules whose bridge no longer exists (their lesson's networks went while no
    /// agent was watching: an engine restart or purge, an agent killed mid-removal). A bridge
    /// name is never reused (it derives from the network's random id), so such a rule can only
    /// be clutter. Returns how many went.
    pub async fn sweep(&self) -> Result<usize, FirewallError> {
        let State::Active { iptables, .. } = &self.state else {
            return Ok(0);
        };
        let mut removed = 0;
        for chain in ["INPUT", DOCKER_USER] {
            let listing = run(iptables, &["-w", "-S", chain]).await?;
            for line in listing.lines() {
                let Some(rule) = tagged_rule(line, "antidote") else {
                    continue;
                };
                let Some(bridge) = rule.windows(2).find(|w| w[0] == "-i").map(|w| &w[1]) else {
                    continue;
                };
                if Path::new("/sys/class/net").join(bridge).exists() {
                    continue;
                }
                let mut delete = vec!["-w", "-D"];
                delete.extend(rule.iter().map(String::as_str));
                if run(iptables, &delete).await.is_ok() {
                    removed += 1;
                }
            }
        }
        Ok(removed)
    }
}

/// The rules confining `bridge`, tagged with `network` (see the module docs).
fn rules(network: &str, bridge: &str, allow_egress: bool) -> Vec<Vec<String>> {
    let tag = ["-m", "comment", "--comment", network];
    let own = |parts: &[&str]| -> Vec<String> {
        parts
            .iter()
            .chain(tag.iter())
            .chain(["-j", "DROP"].iter())
            .map(|s| (*s).to_owned())
            .collect()
    };
    let forward = if allow_egress {
        own(&[DOCKER_USER, "-i", bridge, "-d", LINK_LOCAL])
    } else {
        // Replies leave the bridge: a client on another host reaches a presentation published
        // on a non-loopback --publish-host through Docker's DNAT and FORWARD, and the
        // container's answer goes out of the bridge. Only what the container starts is new.
        own(&[
            DOCKER_USER,
            "-i",
            bridge,
            "!",
            "-o",
            bridge,
            "-m",
            "conntrack",
            "!",
            "--ctstate",
            "ESTABLISHED,RELATED",
        ])
    };
    vec![
        own(&[
            "INPUT",
            "-i",
            bridge,
            "-m",
            "conntrack",
            "!",
            "--ctstate",
            "ESTABLISHED,RELATED",
        ]),
        forward,
    ]
}

/// The arguments after `-A` of an `iptables -S` line whose comment names a network starting
/// with `stem-`, if it is one of ours.
fn tagged_rule(line: &str, stem: &str) -> Option<Vec<String>> {
    let tokens: Vec<String> = line
        .split_whitespace()
        .map(|t| t.trim_matches('"').to_owned())
        .collect();
    if tokens.first().map(String::as_str) != Some("-A") {
        return None;
    }
    let prefix = format!("{stem}-");
    let tagged = tokens
        .windows(2)
        .any(|w| w[0] == "--comment" && w[1].starts_with(&prefix));
    tagged.then(|| tokens[1..].to_vec())
}

async fn still_listed(iptables: &Path, chain: &str, line: &str) -> bool {
    run(iptables, &["-w", "-S", chain])
        .await
        .is_ok_and(|listing| listing.lines().any(|l| l == line))
}

/// The `-save` and `-restore` tools of an iptables variant (`iptables-nft` →
/// `iptables-nft-save`, `iptables-nft-restore`), for listing and changing the filter table's
/// rules with one process each.
#[derive(Debug)]
struct Batch {
    save: PathBuf,
    restore: PathBuf,
}

impl Batch {
    /// The pair beside `iptables`, if both are there.
    fn beside(iptables: &Path) -> Option<Batch> {
        let name = iptables.file_name()?.to_str()?;
        let tool = |suffix: &str| iptables.with_file_name(format!("{name}-{suffix}"));
        let (save, restore) = (tool("save"), tool("restore"));
        (save.is_file() && restore.is_file()).then_some(Batch { save, restore })
    }

    /// The filter table's rules, as `-A CHAIN ...` lines.
    async fn save(&self) -> Result<String, FirewallError> {
        run(&self.save, &["-t", "filter"]).await
    }

    /// Applies `changes` (`-I` or `-D`, and a rule beginning with its chain) to the filter
    /// table in one transaction, leaving every other rule as it is.
    async fn restore<'r>(
        &self,
        changes: impl Iterator<Item = (&'static str, &'r Vec<String>)>,
    ) -> Result<(), FirewallError> {
        use tokio::io::AsyncWriteExt as _;
        let input = restore_input(changes);
        let command = || format!("{} --wait --noflush", self.restore.display());
        let failed = |output: String| FirewallError::Command {
            command: command(),
            output,
        };
        let mut child = Command::new(&self.restore)
            .args(["--wait", "--noflush"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|err| failed(err.to_string()))?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin
                .write_all(input.as_bytes())
                .await
                .map_err(|err| failed(err.to_string()))?;
        }
        let output = child
            .wait_with_output()
            .await
            .map_err(|err| failed(err.to_string()))?;
        if output.status.success() {
            Ok(())
        } else {
            Err(failed(
                String::from_utf8_lossy(&output.stderr).trim().to_owned(),
            ))
        }
    }
}

/// What `iptables-restore --noflush` reads to make `changes` (`-I`/`-D` and a rule beginning
/// with its chain) in the filter table, arguments quoted where they need it.
fn restore_input<'r>(changes: impl Iterator<Item = (&'static str, &'r Vec<String>)>) -> String {
    let mut input = String::from("*filter\n");
    for (op, rule) in changes {
        input.push_str(op);
        for arg in rule {
            input.push(' ');
            if arg.is_empty() || arg.contains(|c: char| c.is_whitespace() || c == '"') {
                input.push('"');
                input.push_str(&arg.replace('"', "\\\""));
                input.push('"');
            } else {
                input.push_str(arg);
            }
        }
        input.push('\n');
    }
    input.push_str("COMMIT\n");
    input
}

/// Runs iptables; its stdout on success.
async fn run(iptables: &Path, args: &[&str]) -> Result<String, FirewallError> {
    let command = || format!("{} {}", iptables.display(), args.join(" "));
    let output = Command::new(iptables)
        .args(args)
        .kill_on_drop(true)
        .output()
        .await
        .map_err(|err| FirewallError::Command {
            command: command(),
            output: err.to_string(),
        })?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        Err(FirewallError::Command {
            command: command(),
            output: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        })
    }
}

/// The iptables variant whose `FORWARD` chain jumps to Docker's `DOCKER-USER`: the one dockerd
/// uses (it may differ from the system's default `iptables`).
async fn find_iptables() -> Result<PathBuf, String> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).collect())
        .unwrap_or_default();
    dirs.extend(["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from));
    let mut tried = Vec::new();
    for name in ["iptables-nft", "iptables-legacy", "iptables"] {
        let Some(binary) = dirs.iter().map(|d| d.join(name)).find(|p| p.is_file()) else {
            continue;
        };
        match run(&binary, &["-w", "-S", "FORWARD"]).await {
            Ok(listing) if listing.lines().any(|l| l.ends_with("-j DOCKER-USER")) => {
                return Ok(binary);
            }
            Ok(_) => tried.push(format!("{name}: no jump to DOCKER-USER in FORWARD")),
            Err(err) => tried.push(format!("{name}: {err}")),
        }
    }
    if tried.is_empty() {
        return Err("no iptables binary found".to_owned());
    }
    Err(format!(
        "no iptables variant here has Docker's DOCKER-USER chain (is dockerd elsewhere, or running with --iptables=false?): {}",
        tried.join("; ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_drop_new_traffic_to_the_host_and_out_of_the_bridge() {
        let confined = rules("antidote-0123456789ab-lesson", "br-feedbeef0001", false);
        assert_eq!(
            confined[0].join(" "),
            "INPUT -i br-feedbeef0001 -m conntrack ! --ctstate ESTABLISHED,RELATED -m comment --comment antidote-0123456789ab-lesson -j DROP"
        );
        assert_eq!(
            confined[1].join(" "),
            "DOCKER-USER -i br-feedbeef0001 ! -o br-feedbeef0001 -m conntrack ! --ctstate ESTABLISHED,RELATED -m comment --comment antidote-0123456789ab-lesson -j DROP"
        );
        let egress = rules("antidote-0123456789ab-link0", "br-feedbeef0002", true);
        assert_eq!(
            egress[1].join(" "),
            "DOCKER-USER -i br-feedbeef0002 -d 169.254.0.0/16 -m comment --comment antidote-0123456789ab-link0 -j DROP"
        );
        assert!(
            egress[0].starts_with(&["INPUT".to_owned()]),
            "the host stays closed"
        );
    }

    #[test]
    fn a_batch_inserts_or_deletes_the_rules_as_written() {
        let rules = rules("antidote-0123456789ab-lesson", "br-x", false);
        let input = restore_input(rules.iter().map(|rule| ("-I", rule)));
        assert_eq!(
            input,
            "*filter\n\
             -I INPUT -i br-x -m conntrack ! --ctstate ESTABLISHED,RELATED -m comment --comment antidote-0123456789ab-lesson -j DROP\n\
             -I DOCKER-USER -i br-x ! -o br-x -m conntrack ! --ctstate ESTABLISHED,RELATED -m comment --comment antidote-0123456789ab-lesson -j DROP\n\
             COMMIT\n"
        );
        let odd = vec![
            "INPUT".to_owned(),
            "--comment".to_owned(),
            "a \"b\"".to_owned(),
        ];
        assert_eq!(
            restore_input([("-D", &odd)].into_iter()),
            "*filter\n-D INPUT --comment \"a \\\"b\\\"\"\nCOMMIT\n"
        );
    }

    #[tokio::test]
    async fn a_remote_engine_is_warned_about_or_refused_never_silently_unconfined() {
        let remote = Some("tcp://10.0.0.7:2376");
        let auto = Firewall::detect(Mode::Auto, false, remote).await;
        let why = auto
            .unavailable()
            .expect("a remote engine cannot be confined from here");
        assert!(
            why.contains("tcp://10.0.0.7:2376") && why.contains("remote"),
            "{why}"
        );
        let confinement = auto
            .confine("antidote-0123456789ab-lesson", "br-x", true)
            .await
            .unwrap();
        assert!(
            matches!(&confinement, Confinement::Unconfined(w) if w.contains("remote")),
            "{confinement:?}"
        );
        assert!(auto.warned.load(Ordering::Relaxed), "said once, loudly");

        let required = Firewall::detect(Mode::Required, false, remote).await;
        assert!(required.required());
        let refused = required
            .confine("antidote-0123456789ab-lesson", "br-x", true)
            .await;
        assert!(
            matches!(refused, Err(FirewallError::Unconfinable { .. })),
            "{refused:?}"
        );

        let off = Firewall::detect(Mode::Off, false, None).await;
        assert_eq!(off.unavailable().as_deref(), Some("--firewall off"));
        // Nothing to release where nothing was installed.
        off.release("antidote-0123456789ab").await.unwrap();
    }

    #[test]
    fn listed_rules_are_found_by_their_lesson_stem() {
        let nft = "-A INPUT -i br-6872e8d500b6 -m conntrack ! --ctstate RELATED,ESTABLISHED -m comment --comment antidote-0123456789ab-lesson -j DROP";
        let rule = tagged_rule(nft, "antidote-0123456789ab").unwrap();
        assert_eq!(rule[0], "INPUT");
        assert_eq!(rule.last().unwrap(), "DROP");
        // iptables-legacy quotes comments.
        let legacy = "-A DOCKER-USER -i br-1 ! -o br-1 -m comment --comment \"antidote-0123456789ab-link1\" -j DROP";
        assert!(
            tagged_rule(legacy, "antidote-0123456789ab")
                .unwrap()
                .contains(&"antidote-0123456789ab-link1".to_owned())
        );
        // Another lesson's, untagged, and chain definitions are not ours.
        assert!(tagged_rule(nft, "antidote-0123456789ac").is_none());
        assert!(tagged_rule("-A DOCKER-USER -j RETURN", "antidote-0123456789ab").is_none());
        assert!(tagged_rule("-N DOCKER-USER", "antidote-0123456789ab").is_none());
    }
}
