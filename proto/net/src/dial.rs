//! Dial-in: `antidote.agent.v1` over a connection the agent opened, for agents behind NAT or a
//! firewall that no scheduler can reach.
//!
//! The agent dials the scheduler's agent intake (`--connect https://SCHEDULER:PORT`) over TLS,
//! presenting its client certificate, whose name (a DNS or `spiffe://` URI SAN) is the agent's
//! name; it verifies the scheduler's server certificate. Then the roles flip: on that
//! connection the agent is the HTTP/2 (gRPC) *server* and the scheduler the client, so the
//! protocol, its rules and its conformance are exactly those of a dialled agent. Nothing else is
//! sent: no preface of our own, no hello (the name comes from the certificate), so any gRPC
//! server that can serve an already-connected socket can be an agent that dials in
//! (PROTOCOL.md, "Dial-in").
//!
//! Scheduler replicas (on PostgreSQL) each drive the live lessons whose lease they hold, on
//! any agent, so a dial-in agent keeps a connection to **every** replica: `--connect` once per
//! replica, or `--connect-all-addresses` to dial every address a URL's host resolves to (a
//! Kubernetes headless Service gives one per replica), resolved again periodically. Each
//! connection is dialled again on its own, with its own backoff; all are served at once by the
//! same server.
//!
//! Both ends are here, for every Rust caller:
//! - the agent's: [`ConnectArgs`] (the `--connect` flags, flattened into an agent's flags) and
//!   [`DialIn`], whose [`DialIn::links`] is the stream of connections `sdk::run` serves (all of
//!   them, each dialled again with exponential backoff and jitter whenever it ends);
//! - the caller's (the scheduler's intake, the conformance suite): [`accept`] (TLS with a
//!   client certificate) and [`Inbound`], one agent's accepted connections as a tonic
//!   [`Channel`] whose connector hands out the newest one: a reconnection is the agent's next
//!   dial.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use rustls::pki_types::CertificateDer;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{Notify, mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use tonic::transport::server::{Connected, TcpConnectInfo};
use tonic::transport::{Channel, Endpoint, Uri};

use super::tls::{ClientTls, Identity, PeerCert, ServerTls, TlsArgs, TlsError, TlsFiles};

/// How long dialling (TCP and the TLS handshake) may take before the attempt counts as failed.
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(10);

/// The first wait between dial attempts; it doubles (with jitter) up to [`BACKOFF_MAX`].
pub const BACKOFF_INITIAL: Duration = Duration::from_millis(200);

/// The longest wait between dial attempts.
pub const BACKOFF_MAX: Duration = Duration::from_secs(30);

/// The most connections one agent keeps (URLs given, or addresses found for all of them
/// together): more `--connect` URLs are refused at start; more addresses found are not dialled
/// (with a warning) until others go.
pub const MAX_LINKS: usize = 64;

/// How often `--connect-all-addresses` resolves each URL's host again, by default.
pub const RESOLVE_INTERVAL: Duration = Duration::from_secs(30);

/// A connection that lasted this long was a working one: the next dial starts the backoff
/// afresh. (A refused agent's connection ends at once, so its retries slow down.)
const STABLE: Duration = Duration::from_secs(5);

/// The `--connect` flags, flattened into each agent's flags beside [`TlsArgs`]: the TLS files
/// are the agent's own (its certificate names it to the scheduler; `--tls-client-ca` is the CA
/// of the scheduler's certificates, which verifies the scheduler's server certificate as it
/// verifies its client certificate when the scheduler dials).
#[derive(Debug, Clone, clap::Args)]
pub struct ConnectArgs {
    /// Dial in to the scheduler's agent intake at this URL (`https://SCHEDULER:PORT`) instead of
    /// listening: the agent then opens no port at all. Give it once per scheduler replica (or
    /// comma-separated in the environment variable): the agent keeps a connection to each, so
    /// every replica can drive its live lessons. Needs --tls-cert, --tls-key and
    /// --tls-client-ca; the scheduler's certificate must carry --tls-require-identity, or else
    /// the URL's host.
    #[arg(
        long,
        env = "ANTIDOTE_AGENT_CONNECT",
        value_name = "URL",
        value_delimiter = ','
    )]
    pub connect: Vec<String>,
    /// Dial every address each --connect host resolves to (a Kubernetes headless Service or a
    /// StatefulSet's: one per scheduler replica), one connection each, with the URL's host as
    /// the TLS server name; resolved again every --connect-resolve-interval: new addresses are
    /// dialled, connections to addresses gone are kept until they end and not dialled again.
    #[arg(long, env = "ANTIDOTE_AGENT_CONNECT_ALL_ADDRESSES")]
    pub connect_all_addresses: bool,
    /// How often --connect-all-addresses resolves the hosts again.
    #[arg(
        long,
        env = "ANTIDOTE_AGENT_CONNECT_RESOLVE_INTERVAL",
        value_name = "DURATION",
        default_value = "30s",
        value_parser = humantime::parse_duration
    )]
    pub connect_resolve_interval: Duration,
}

impl Default for ConnectArgs {
    fn default() -> Self {
        ConnectArgs {
            connect: Vec::new(),
            connect_all_addresses: false,
            connect_resolve_interval: RESOLVE_INTERVAL,
        }
    }
}

impl ConnectArgs {
    /// The dial-in these flags ask for; `None` when the agent listens instead.
    pub fn dial_in(&self, tls: &TlsArgs) -> Result<Option<DialIn>, DialError> {
        if self.connect.is_empty() {
            if self.connect_all_addresses {
                return Err(DialError::Flags(
                    "--connect-all-addresses needs --connect".into(),
                ));
            }
            return Ok(None);
        }
        let (Some(cert), Some(key), Some(ca)) = (&tls.tls_cert, &tls.tls_key, &tls.tls_client_ca)
        else {
            return Err(DialError::Flags(
                "--connect needs --tls-cert, --tls-key and --tls-client-ca: dialling in is always mutual TLS".into(),
            ));
        };
        if tls.insecure_plaintext {
            return Err(DialError::Flags(
                "--insecure-plaintext contradicts --connect (dialling in is always TLS)".into(),
            ));
        }
        if self.connect.len() > MAX_LINKS {
            return Err(DialError::Flags(format!(
                "--connect given {} times: at most {MAX_LINKS} (one per scheduler replica)",
                self.connect.len()
            )));
        }
        if self.connect_all_addresses && self.connect_resolve_interval.is_zero() {
            return Err(DialError::Flags(
                "--connect-resolve-interval must be more than 0".into(),
            ));
        }
        // Every URL is checked before any file is read.
        let mut seen = BTreeSet::new();
        let mut parsed = Vec::new();
        for url in &self.connect {
            let url = url.trim();
            let target = Target::parse(url)?;
            if !seen.insert(target.authority().to_ascii_lowercase()) {
                return Err(DialError::Url {
                    url: url.to_owned(),
                    reason: "given twice: two connections of one agent to one scheduler replace each other".into(),
                });
            }
            let identity = match &tls.tls_require_identity {
                Some(identity) => Identity::parse(identity)?,
                None => Identity::parse(&target.host).map_err(|_| DialError::Url {
                    url: url.to_owned(),
                    reason: "its host is not a DNS name: give --tls-require-identity".into(),
                })?,
            };
            parsed.push((target, identity));
        }
        let files = TlsFiles {
            cert: cert.clone(),
            key: key.clone(),
            ca: ca.clone(),
        };
        // One TLS configuration per identity the schedulers' certificates must carry (one in
        // all with --tls-require-identity, else one per host).
        let mut configs: BTreeMap<String, Arc<ClientTls>> = BTreeMap::new();
        let mut targets = Vec::new();
        for (target, identity) in parsed {
            let tls = match configs.get(&identity.to_string()) {
                Some(tls) => tls.clone(),
                None => {
                    let key = identity.to_string();
                    let tls = Arc::new(ClientTls::load(files.clone(), identity)?);
                    configs.insert(key, tls.clone());
                    tls
                }
            };
            targets.push(Dialled { target, tls });
        }
        Ok(Some(DialIn {
            targets,
            resolve_every: self
                .connect_all_addresses
                .then_some(self.connect_resolve_interval),
            resolver: system_resolver(),
        }))
    }
}

/// Why dialling in cannot even start.
#[derive(Debug, thiserror::Error)]
pub enum DialError {
    /// A `--connect` URL is not `https://HOST:PORT`, or is given twice.
    #[error("--connect `{url}`: {reason}")]
    Url {
        /// The URL given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Flags missing or contradicting `--connect`.
    #[error("{0}")]
    Flags(String),
    /// The TLS files do not load.
    #[error(transparent)]
    Tls(#[from] TlsError),
}

/// Where to dial: `https://HOST:PORT`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Target {
    /// The host as written (an IPv6 literal bracketed).
    host: String,
    /// The port: required, there is no well-known one.
    port: u16,
}

impl Target {
    fn parse(url: &str) -> Result<Target, DialError> {
        let bad = |reason: &str| DialError::Url {
            url: url.to_owned(),
            reason: reason.to_owned(),
        };
        let uri: Uri = url.parse().map_err(|_| bad("not a URL"))?;
        if uri.scheme_str() != Some("https") {
            return Err(bad("must start with https:// (dialling in is always TLS)"));
        }
        if uri.path_and_query().is_some_and(|p| p.as_str() != "/") {
            return Err(bad("must not have a path"));
        }
        let host = uri.host().ok_or_else(|| bad("has no host"))?;
        let port = uri.port_u16().ok_or_else(|| bad("has no port"))?;
        Ok(Target {
            host: host.to_owned(),
            port,
        })
    }

    fn authority(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }

    /// The host without an IPv6 literal's brackets, as resolvers and `connect` take it.
    fn bare_host(&self) -> &str {
        self.host.trim_start_matches('[').trim_end_matches(']')
    }
}

/// One `--connect` URL and the TLS configuration its scheduler is verified with.
struct Dialled {
    /// The intake.
    target: Target,
    /// Our certificate and the scheduler's expected identity, re-read when rotated.
    tls: Arc<ClientTls>,
}

/// A host's addresses, found by the system's resolver (`getaddrinfo`, which follows
/// `/etc/hosts` and DNS): a table in tests, since here `localhost` has one address only.
type Resolver = Arc<
    dyn Fn(String, u16) -> Pin<Box<dyn Future<Output = io::Result<Vec<SocketAddr>>> + Send>>
        + Send
        + Sync,
>;

fn system_resolver() -> Resolver {
    Arc::new(|host: String, port: u16| {
        Box::pin(async move {
            Ok(tokio::net::lookup_host((host.as_str(), port))
                .await?
                .collect())
        })
    })
}

/// The agent's side: where to dial, with which (reloading) TLS configurations.
pub struct DialIn {
    /// The intakes, one per `--connect` URL (at most [`MAX_LINKS`]).
    targets: Vec<Dialled>,
    /// With `--connect-all-addresses`: how often each host is resolved again.
    resolve_every: Option<Duration>,
    /// Finds the addresses of a host, with `--connect-all-addresses`.
    resolver: Resolver,
}

impl std::fmt::Debug for DialIn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DialIn")
            .field(
                "targets",
                &self.targets.iter().map(|t| &t.target).collect::<Vec<_>>(),
            )
            .field("resolve_every", &self.resolve_every)
            .finish_non_exhaustive()
    }
}

impl DialIn {
    /// `HOST:PORT` of each intake, in the order given.
    pub fn authorities(&self) -> Vec<String> {
        self.targets.iter().map(|t| t.target.authority()).collect()
    }

    /// The connections to serve, all at once: one per intake (with `--connect-all-addresses`,
    /// one per address each intake's host resolves to, at most [`MAX_LINKS`] in all). Each is
    /// dialled at once, then again whenever it ended, after a backoff of its own from
    /// [`BACKOFF_INITIAL`] doubling to [`BACKOFF_MAX`] with jitter, restarted after a
    /// connection that worked; one connection ending never disturbs the others. Failures are
    /// logged, never returned: the stream ends only when `stop` is cancelled (or the server
    /// stops taking connections).
    pub fn links(self, stop: CancellationToken) -> ReceiverStream<io::Result<Link>> {
        self.links_within(Arc::new(Budget::new(MAX_LINKS)), stop)
    }

    /// [`DialIn::links`], its dial loops counted in `budget`.
    fn links_within(
        self,
        budget: Arc<Budget>,
        stop: CancellationToken,
    ) -> ReceiverStream<io::Result<Link>> {
        let (tx, rx) = mpsc::channel(1);
        for dialled in self.targets {
            let dialled = Arc::new(dialled);
            match self.resolve_every {
                None => {
                    // Never refused: there are at most MAX_LINKS URLs (`dial_in`).
                    let slot = budget.take();
                    tokio::spawn(dial_loop(
                        dialled,
                        None,
                        tx.clone(),
                        stop.clone(),
                        CancellationToken::new(),
                        slot,
                    ));
                }
                Some(every) => {
                    tokio::spawn(fan_out(
                        dialled,
                        every,
                        self.resolver.clone(),
                        budget.clone(),
                        tx.clone(),
                        stop.clone(),
                    ));
                }
            }
        }
        ReceiverStream::new(rx)
    }

    /// This dial-in with another resolver (tests: names with several loopback addresses).
    #[cfg(test)]
    fn with_resolver(mut self, resolver: Resolver) -> DialIn {
        self.resolver = resolver;
        self
    }
}

/// How many dial loops may run at once (for all URLs and addresses together).
struct Budget {
    /// Loops running (a retired address's loop counts until its connection ends).
    live: AtomicUsize,
    /// The cap.
    max: usize,
}

/// One running dial loop's place in the [`Budget`], given back when the loop ends.
struct Slot(Option<Arc<Budget>>);

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(budget) = &self.0 {
            budget.live.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Budget {
    fn new(max: usize) -> Budget {
        Budget {
            live: AtomicUsize::new(0),
            max,
        }
    }

    /// A place, unless every one is taken.
    fn try_take(self: &Arc<Self>) -> Option<Slot> {
        self.live
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |live| {
                (live < self.max).then_some(live + 1)
            })
            .ok()
            .map(|_| Slot(Some(self.clone())))
    }

    /// A place, counted even beyond the cap (for the URLs, bounded by `dial_in`).
    fn take(self: &Arc<Self>) -> Slot {
        self.live.fetch_add(1, Ordering::AcqRel);
        Slot(Some(self.clone()))
    }

    /// Loops running.
    #[cfg(test)]
    fn live(&self) -> usize {
        self.live.load(Ordering::Acquire)
    }
}

/// The addresses of one host that have a dial loop, each with the token that retires it.
#[derive(Default)]
struct Fanout {
    links: BTreeMap<SocketAddr, CancellationToken>,
}

/// What a resolution changes: loops to start, addresses retired, addresses left undialled.
struct Changes {
    /// New addresses, each with its retiring token and its place in the budget.
    started: Vec<(SocketAddr, CancellationToken, Slot)>,
    /// Addresses no longer resolved: their loops were told not to dial again.
    retired: Vec<SocketAddr>,
    /// New addresses not dialled: the budget is spent.
    refused: Vec<SocketAddr>,
}

impl Fanout {
    /// Takes a resolution: retires addresses that are gone, starts new ones while the budget
    /// allows (lowest addresses first, so what is dialled does not depend on the resolver's
    /// order).
    fn update(&mut self, resolved: &[SocketAddr], budget: &Arc<Budget>) -> Changes {
        let now: BTreeSet<SocketAddr> = resolved.iter().copied().collect();
        let mut changes = Changes {
            started: Vec::new(),
            retired: Vec::new(),
            refused: Vec::new(),
        };
        self.links.retain(|addr, retire| {
            let keep = now.contains(addr);
            if !keep {
                retire.cancel();
                changes.retired.push(*addr);
            }
            keep
        });
        for addr in now {
            if self.links.contains_key(&addr) {
                continue;
            }
            match budget.try_take() {
                Some(slot) => {
                    let retire = CancellationToken::new();
                    self.links.insert(addr, retire.clone());
                    changes.started.push((addr, retire, slot));
                }
                None => changes.refused.push(addr),
            }
        }
        changes
    }
}

/// `--connect-all-addresses` for one URL: resolves its host now and every `every`, keeps a
/// dial loop per address found, and retires the loops of addresses that went away (their
/// connection is served until it ends, and not dialled again). A failed resolution, or one
/// that finds nothing, changes nothing: a resolver's hiccup must not drop working connections.
async fn fan_out(
    dialled: Arc<Dialled>,
    every: Duration,
    resolver: Resolver,
    budget: Arc<Budget>,
    tx: mpsc::Sender<io::Result<Link>>,
    stop: CancellationToken,
) {
    let scheduler = dialled.target.authority();
    let mut fanout = Fanout::default();
    loop {
        let resolution = tokio::select! {
            () = stop.cancelled() => return,
            () = tx.closed() => return,
            resolution = tokio::time::timeout(
                DIAL_TIMEOUT,
                resolver(dialled.target.bare_host().to_owned(), dialled.target.port),
            ) => resolution,
        };
        match resolution {
            Ok(Ok(addresses)) if !addresses.is_empty() => {
                let changes = fanout.update(&addresses, &budget);
                for address in changes.retired {
                    tracing::info!(%scheduler, %address, "no longer resolved: its connection is kept until it ends, and not dialled again");
                }
                if !changes.refused.is_empty() {
                    tracing::warn!(%scheduler, refused = ?changes.refused, max = MAX_LINKS, "more scheduler addresses than connections allowed: these are not dialled");
                }
                for (address, retire, slot) in changes.started {
                    tracing::info!(%scheduler, %address, "new address: dialling it");
                    tokio::spawn(dial_loop(
                        dialled.clone(),
                        Some(address),
                        tx.clone(),
                        stop.clone(),
                        retire,
                        slot,
                    ));
                }
            }
            Ok(Ok(_)) => {
                tracing::warn!(%scheduler, "the host resolves to no address; keeping the connections there are");
            }
            Ok(Err(err)) => {
                tracing::warn!(%scheduler, error = %err, "cannot resolve the host; keeping the connections there are");
            }
            Err(_) => {
                tracing::warn!(%scheduler, timeout = ?DIAL_TIMEOUT, "cannot resolve the host: timed out; keeping the connections there are");
            }
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tx.closed() => return,
            () = tokio::time::sleep(every) => {}
        }
    }
}

/// One connection's life: dial `address` (or the URL's host), hand the link to the server,
/// wait for it to end, back off, again; until `stop`, or until `retire` once the connection of
/// the moment ended (its address no longer resolves). `_slot` is held for as long.
async fn dial_loop(
    dialled: Arc<Dialled>,
    address: Option<SocketAddr>,
    tx: mpsc::Sender<io::Result<Link>>,
    stop: CancellationToken,
    retire: CancellationToken,
    _slot: Slot,
) {
    let scheduler = dialled.target.authority();
    let target = address;
    // Logged beside the URL's host and port: empty when the system resolves the host at each
    // dial.
    let address = address.map_or_else(String::new, |a| a.to_string());
    let mut backoff = Backoff::new(BACKOFF_INITIAL, BACKOFF_MAX);
    loop {
        let attempt = tokio::select! {
            () = stop.cancelled() => return,
            () = retire.cancelled() => return,
            attempt = tokio::time::timeout(DIAL_TIMEOUT, dial_once(&dialled, target)) => attempt,
        };
        match attempt {
            Ok(Ok((link, ended))) => {
                tracing::info!(%scheduler, %address, "dialled in; serving on the connection");
                let began = Instant::now();
                if tx.send(Ok(link)).await.is_err() {
                    // The server stopped taking connections: shutting down.
                    return;
                }
                let reason = tokio::select! {
                    () = stop.cancelled() => return,
                    reason = ended => reason.unwrap_or_else(|_| "closed".into()),
                };
                if retire.is_cancelled() {
                    tracing::info!(%scheduler, %address, %reason, "the connection to an address no longer resolved ended; not dialling it again");
                    return;
                }
                if began.elapsed() >= STABLE {
                    tracing::warn!(%scheduler, %address, %reason, "the connection to the scheduler ended; dialling again");
                    backoff.reset();
                } else {
                    // A refusal after the handshake (a name the intake does not admit, or
                    // our certificate refused) looks like this from here.
                    tracing::warn!(%scheduler, %address, %reason, "the scheduler ended the connection at once: its agent intake may refuse this agent's certificate or name (see the scheduler's log)");
                }
            }
            Ok(Err(err)) => {
                tracing::warn!(%scheduler, %address, error = %err, "cannot dial in");
            }
            Err(_) => {
                tracing::warn!(%scheduler, %address, timeout = ?DIAL_TIMEOUT, "cannot dial in: timed out");
            }
        }
        let delay = backoff.next();
        tokio::select! {
            () = stop.cancelled() => return,
            () = retire.cancelled() => return,
            () = tokio::time::sleep(delay) => {}
        }
    }
}

/// TCP to `address` (none: the URL's host, resolved by the system), then the TLS handshake
/// with the files of this moment and the URL's host as the server name.
async fn dial_once(
    dialled: &Dialled,
    address: Option<SocketAddr>,
) -> Result<(Link, oneshot::Receiver<String>), TlsError> {
    let target = &dialled.target;
    let tcp = match address {
        None => TcpStream::connect((target.bare_host(), target.port)).await,
        Some(address) => TcpStream::connect(address).await,
    }
    .map_err(|err| {
        let to = match address {
            None => target.authority(),
            Some(address) => format!("{} ({address})", target.authority()),
        };
        TlsError::Handshake(format!("cannot connect to {to}: {err}"))
    })?;
    // The protocol's small replies and Watch events must leave at once.
    let _ = tcp.set_nodelay(true);
    let local = tcp.local_addr().ok();
    let peer = tcp
        .peer_addr()
        .map_err(|err| TlsError::Handshake(err.to_string()))?;
    let tls = dialled.tls.connect(tcp, &target.host).await?;
    Ok(Link::new(tls, local, peer))
}

/// Exponential backoff with "equal jitter": each wait is half the current step plus a random
/// part of the other half, so agents cut off together do not dial back in lockstep.
struct Backoff {
    initial: Duration,
    max: Duration,
    step: Duration,
}

impl Backoff {
    fn new(initial: Duration, max: Duration) -> Backoff {
        Backoff {
            initial,
            max,
            step: initial,
        }
    }

    fn reset(&mut self) {
        self.step = self.initial;
    }

    fn next(&mut self) -> Duration {
        let half = self.step / 2;
        // A v4 UUID is 122 random bits from the OS; 64 of them pick the jitter.
        let random = uuid::Uuid::new_v4().as_u64_pair().0;
        let jitter = half.mul_f64(random as f64 / u64::MAX as f64);
        self.step = (self.step * 2).min(self.max);
        half + jitter
    }
}

/// Anything a [`Link`] can carry: a TLS stream of either side.
trait Io: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Io for T {}

/// One dialled-in connection, on either end: the agent serves gRPC on it, the caller makes
/// calls over it. It can be cut (the caller replaces it with a newer connection of the same
/// agent) and tells, when dropped, why it ended.
pub struct Link {
    /// The TLS stream.
    io: Box<dyn Io>,
    /// Our address.
    local: Option<SocketAddr>,
    /// The other end's address.
    peer: SocketAddr,
    /// Cut: every read and write fails from then on, which ends the HTTP/2 connection on it.
    /// Also cancelled when the link is dropped, so a holder can tell it is gone.
    cutter: CancellationToken,
    /// `cutter`'s cancellation as a future, polled by reads and writes so a cut wakes them.
    cut: Pin<Box<WaitForCancellationFutureOwned>>,
    /// The first I/O error, the reason given when the link ends.
    error: Option<String>,
    /// Told the reason when the link is dropped.
    ended: Option<oneshot::Sender<String>>,
    /// The other end's verified certificate, on the caller's side (for operators).
    cert: Option<PeerCert>,
}

impl Link {
    /// A link over an established stream, and the receiver told why it ended.
    fn new(
        io: impl AsyncRead + AsyncWrite + Send + Unpin + 'static,
        local: Option<SocketAddr>,
        peer: SocketAddr,
    ) -> (Link, oneshot::Receiver<String>) {
        let (tx, rx) = oneshot::channel();
        let cutter = CancellationToken::new();
        let link = Link {
            io: Box::new(io),
            local,
            peer,
            cut: Box::pin(cutter.clone().cancelled_owned()),
            cutter,
            error: None,
            ended: Some(tx),
            cert: None,
        };
        (link, rx)
    }

    /// The other end's address.
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// A token that cuts the link when cancelled, and is cancelled once the link is gone.
    pub fn cutter(&self) -> CancellationToken {
        self.cutter.clone()
    }

    fn poll_io<T>(
        &mut self,
        cx: &mut Context<'_>,
        op: impl FnOnce(Pin<&mut Box<dyn Io>>, &mut Context<'_>) -> Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if self.cut.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "replaced by a newer connection of the same agent",
            )));
        }
        let result = op(Pin::new(&mut self.io), cx);
        if let Poll::Ready(Err(err)) = &result
            && self.error.is_none()
        {
            // A TLS alert (the scheduler refusing our certificate after the handshake, as
            // TLS 1.3 does) reads as a sentence.
            self.error = Some(super::tls::describe_io(err));
        }
        result
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.cutter.cancel();
        if let Some(ended) = self.ended.take() {
            let _ = ended.send(
                self.error
                    .take()
                    .unwrap_or_else(|| "closed by the other end".into()),
            );
        }
    }
}

impl AsyncRead for Link {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.get_mut().poll_io(cx, |io, cx| io.poll_read(cx, buf))
    }
}

impl AsyncWrite for Link {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().poll_io(cx, |io, cx| io.poll_write(cx, buf))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().poll_io(cx, |io, cx| io.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Shutting down a cut link is fine: it only closes what is already dead.
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.get_mut()
            .poll_io(cx, |io, cx| io.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl Connected for Link {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        TcpConnectInfo {
            local_addr: self.local,
            remote_addr: Some(self.peer),
        }
    }
}

/// The caller's side of a dial-in: the TLS handshake on an accepted TCP connection (`tls`
/// requires a client certificate signed by its CA). Returns the link and the agent's verified
/// certificate (the leaf), from which the caller takes the agent's name
/// ([`super::tls::peer_identity`]).
pub async fn accept(
    tls: &ServerTls,
    tcp: TcpStream,
) -> Result<(Link, CertificateDer<'static>), TlsError> {
    // The protocol's small replies and Watch events must leave at once.
    let _ = tcp.set_nodelay(true);
    let local = tcp.local_addr().ok();
    let peer = tcp
        .peer_addr()
        .map_err(|err| TlsError::Handshake(err.to_string()))?;
    let stream = tls.accept(tcp).await?;
    let leaf = stream
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|chain| chain.first())
        .cloned()
        // Only an acceptor that does not require client certificates lets this through; refuse
        // rather than serve an anonymous agent.
        .ok_or_else(|| TlsError::Handshake("no client certificate presented".into()))?;
    let (mut link, _ended) = Link::new(stream, local, peer);
    link.cert = Some(PeerCert::of(&leaf));
    Ok((link, leaf))
}

/// One agent's dialled-in connections, as the caller uses them: the newest waits for the
/// channel's next connection attempt; offering one cuts the connection in use, so calls move
/// over at once. A second connection of the same agent therefore *replaces* the first: after
/// an agent restart the old connection may look alive for a while (a peer gone without a FIN),
/// and the name is proven by the certificate, so only the agent's key holder can replace it.
#[derive(Clone, Default)]
pub struct Inbound {
    inner: Arc<InboundInner>,
}

#[derive(Default)]
struct InboundInner {
    /// The newest connection, not yet taken by the channel.
    waiting: Mutex<Option<Link>>,
    /// The connection the channel runs on: its peer, its certificate and the token that
    /// cuts it.
    current: Mutex<Option<(SocketAddr, Option<PeerCert>, CancellationToken)>>,
    /// Woken when a connection is offered.
    arrived: Notify,
}

impl Inbound {
    /// Takes a newly accepted connection of this agent: it waits for the channel, and the one
    /// in use (if any) is cut.
    pub fn offer(&self, link: Link) {
        let previous = lock(&self.inner.waiting).replace(link);
        // An older connection never taken is simply closed.
        drop(previous);
        if let Some((_, _, cutter)) = lock(&self.inner.current).take() {
            cutter.cancel();
        }
        self.inner.arrived.notify_one();
    }

    /// The address the agent's connection comes from: the one in use, else the one waiting;
    /// `None` when the agent is not connected.
    pub fn peer(&self) -> Option<SocketAddr> {
        let current = lock(&self.inner.current)
            .as_ref()
            .filter(|(_, _, cutter)| !cutter.is_cancelled())
            .map(|(peer, _, _)| *peer);
        current.or_else(|| lock(&self.inner.waiting).as_ref().map(Link::peer))
    }

    /// The certificate the agent presented on its newest connection (kept after it ends, for
    /// operators: which certificate it last used, and when that expires).
    pub fn peer_cert(&self) -> Option<PeerCert> {
        if let Some(waiting) = lock(&self.inner.waiting).as_ref() {
            return waiting.cert.clone();
        }
        lock(&self.inner.current)
            .as_ref()
            .and_then(|(_, cert, _)| cert.clone())
    }

    /// Whether a connection is in use or waiting.
    pub fn is_connected(&self) -> bool {
        self.peer().is_some()
    }

    /// The next connection to use, waiting at most `wait` for the agent to dial in.
    async fn next(&self, wait: Duration) -> io::Result<Link> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let arrived = self.inner.arrived.notified();
            tokio::pin!(arrived);
            // Registered before looking, so an offer between the look and the wait wakes us.
            arrived.as_mut().enable();
            if let Some(link) = lock(&self.inner.waiting).take() {
                *lock(&self.inner.current) = Some((link.peer(), link.cert.clone(), link.cutter()));
                return Ok(link);
            }
            if tokio::time::timeout_at(deadline, arrived).await.is_err() {
                return Err(io::Error::new(
                    io::ErrorKind::NotConnected,
                    format!("the agent has not dialled in (waited {wait:?})"),
                ));
            }
        }
    }

    /// A channel over this agent's connections: `endpoint` gives its HTTP/2 settings (its URI
    /// is only a label: `http://NAME.dial-in`), each connection attempt takes the newest
    /// dialled-in connection or waits up to `wait` for one (then fails UNAVAILABLE, and the
    /// next call tries again).
    pub fn channel(&self, endpoint: Endpoint, wait: Duration) -> Channel {
        let inbound = self.clone();
        endpoint.connect_with_connector_lazy(tower::service_fn(move |_: Uri| {
            let inbound = inbound.clone();
            async move { inbound.next(wait).await.map(TokioIo::new) }
        }))
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Every critical section is a single assignment; a poisoned lock still holds a usable value.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_urls_must_be_https_with_a_port() {
        let ok = Target::parse("https://scheduler.example:7443").unwrap();
        assert_eq!(ok.authority(), "scheduler.example:7443");
        assert_eq!(
            Target::parse("https://[::1]:7443").unwrap().authority(),
            "[::1]:7443"
        );
        for (url, why) in [
            ("http://scheduler.example:7443", "https://"),
            ("https://scheduler.example", "no port"),
            ("https://scheduler.example:7443/agents", "path"),
            ("scheduler.example:7443", "https://"),
        ] {
            let err = Target::parse(url).unwrap_err().to_string();
            assert!(err.contains(why) && err.contains(url), "{url}: {err}");
        }
    }

    #[test]
    fn connect_needs_the_tls_files() {
        let connect = ConnectArgs {
            connect: vec!["https://127.0.0.1:7443".into()],
            ..ConnectArgs::default()
        };
        let err = connect
            .dial_in(&TlsArgs::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--tls-cert, --tls-key and --tls-client-ca"),
            "{err}"
        );
        let plaintext = TlsArgs {
            tls_cert: Some("c.pem".into()),
            tls_key: Some("k.pem".into()),
            tls_client_ca: Some("ca.pem".into()),
            insecure_plaintext: true,
            ..TlsArgs::default()
        };
        let err = connect.dial_in(&plaintext).unwrap_err().to_string();
        assert!(err.contains("--insecure-plaintext"), "{err}");
        assert!(
            ConnectArgs::default()
                .dial_in(&TlsArgs::default())
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn backoff_doubles_to_its_cap_with_jitter_and_resets() {
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(1));
        let waits: Vec<Duration> = (0..5).map(|_| backoff.next()).collect();
        let steps = [200, 400, 800, 1000, 1000].map(Duration::from_millis);
        for (wait, step) in waits.iter().zip(steps) {
            assert!(
                *wait >= step / 2 && *wait <= step,
                "{wait:?} not in [{step:?}/2, {step:?}]"
            );
        }
        backoff.reset();
        assert!(backoff.next() <= Duration::from_millis(200));
    }

    /// The TLS flags of an agent whose files are never read (the URLs are checked first).
    fn unread_files() -> TlsArgs {
        TlsArgs {
            tls_cert: Some("c.pem".into()),
            tls_key: Some("k.pem".into()),
            tls_client_ca: Some("ca.pem".into()),
            ..TlsArgs::default()
        }
    }

    fn urls(urls: &[&str]) -> ConnectArgs {
        ConnectArgs {
            connect: urls.iter().map(|u| (*u).to_owned()).collect(),
            ..ConnectArgs::default()
        }
    }

    #[test]
    fn connect_is_repeated_or_comma_separated_and_each_url_checked() {
        #[derive(clap::Parser)]
        struct Flags {
            #[command(flatten)]
            connect: ConnectArgs,
        }
        let flags = <Flags as clap::Parser>::try_parse_from([
            "agent",
            "--connect",
            "https://a.example:1,https://b.example:2",
            "--connect",
            "https://c.example:3",
        ])
        .unwrap();
        assert_eq!(
            flags.connect.connect,
            [
                "https://a.example:1",
                "https://b.example:2",
                "https://c.example:3"
            ]
        );
        assert!(!flags.connect.connect_all_addresses);
        assert_eq!(flags.connect.connect_resolve_interval, RESOLVE_INTERVAL);
        let flags = <Flags as clap::Parser>::try_parse_from([
            "agent",
            "--connect",
            "https://replicas.example:7443",
            "--connect-all-addresses",
            "--connect-resolve-interval",
            "5s",
        ])
        .unwrap();
        assert!(flags.connect.connect_all_addresses);
        assert_eq!(
            flags.connect.connect_resolve_interval,
            Duration::from_secs(5)
        );

        // The bad one of several is named; a URL given twice is refused (its two connections
        // would replace each other at the scheduler).
        let err = urls(&["https://a.example:1", "http://b.example:2"])
            .dial_in(&unread_files())
            .unwrap_err()
            .to_string();
        assert!(err.contains("`http://b.example:2`"), "{err}");
        let err = urls(&["https://a.example:1", "https://A.example:1/"])
            .dial_in(&unread_files())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`https://A.example:1/`") && err.contains("given twice"),
            "{err}"
        );
        // Bounded.
        let many: Vec<String> = (0..=MAX_LINKS)
            .map(|i| format!("https://r{i}.example:7443"))
            .collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        let err = urls(&many)
            .dial_in(&unread_files())
            .unwrap_err()
            .to_string();
        assert!(err.contains("at most 64"), "{err}");
        // --connect-all-addresses alone, or with no interval.
        let err = ConnectArgs {
            connect_all_addresses: true,
            ..ConnectArgs::default()
        }
        .dial_in(&unread_files())
        .unwrap_err()
        .to_string();
        assert!(err.contains("needs --connect"), "{err}");
        let err = ConnectArgs {
            connect_all_addresses: true,
            connect_resolve_interval: Duration::ZERO,
            ..urls(&["https://a.example:1"])
        }
        .dial_in(&unread_files())
        .unwrap_err()
        .to_string();
        assert!(err.contains("--connect-resolve-interval"), "{err}");
        // Good URLs get as far as the files.
        let err = urls(&["https://a.example:1", "https://b.example:2"])
            .dial_in(&unread_files())
            .unwrap_err()
            .to_string();
        assert!(err.contains("c.pem"), "{err}");
    }

    fn addr(text: &str) -> SocketAddr {
        text.parse().unwrap()
    }

    #[test]
    fn fan_out_starts_new_addresses_retires_gone_ones_and_keeps_to_the_budget() {
        let budget = Arc::new(Budget::new(3));
        let mut fanout = Fanout::default();
        let (a, b, c, d) = (
            addr("10.0.0.1:7443"),
            addr("10.0.0.2:7443"),
            addr("10.0.0.3:7443"),
            addr("10.0.0.4:7443"),
        );
        // Duplicates count once; the order found does not matter.
        let changes = fanout.update(&[b, a, b], &budget);
        let started: Vec<_> = changes.started.iter().map(|(a, _, _)| *a).collect();
        assert_eq!(started, [a, b]);
        assert!(changes.retired.is_empty() && changes.refused.is_empty());
        let mut loops: BTreeMap<SocketAddr, (CancellationToken, Slot)> = changes
            .started
            .into_iter()
            .map(|(a, t, s)| (a, (t, s)))
            .collect();
        assert_eq!(budget.live(), 2);

        // a is gone, c and d are new: a is retired (its loop still runs until its connection
        // ends, so it keeps its place), c takes the last place, d is refused.
        let changes = fanout.update(&[b, c, d], &budget);
        assert_eq!(changes.retired, [a]);
        assert!(loops[&a].0.is_cancelled() && !loops[&b].0.is_cancelled());
        let started: Vec<_> = changes.started.iter().map(|(a, _, _)| *a).collect();
        assert_eq!(started, [c]);
        assert_eq!(changes.refused, [d]);
        loops.extend(changes.started.into_iter().map(|(a, t, s)| (a, (t, s))));
        assert_eq!(budget.live(), 3);

        // a's connection ended, its loop too: d gets its place at the next resolution.
        loops.remove(&a);
        assert_eq!(budget.live(), 2);
        let changes = fanout.update(&[b, c, d], &budget);
        let started: Vec<_> = changes.started.iter().map(|(a, _, _)| *a).collect();
        assert_eq!(started, [d]);
        assert!(changes.retired.is_empty() && changes.refused.is_empty());

        // An address that comes back is dialled again.
        drop(changes);
        let changes = fanout.update(&[a, b, c], &budget);
        assert_eq!(changes.retired, [d]);
        let started: Vec<_> = changes.started.iter().map(|(a, _, _)| *a).collect();
        assert_eq!(started, [a]);
    }

    /// Certificates for the loopback tests: a CA, the intakes' certificate (for
    /// `intake.test` and 127.0.0.1) and an agent's, as files.
    struct Certs {
        _dir: tempfile::TempDir,
        intake: TlsFiles,
        agent: TlsArgs,
    }

    fn certs() -> Certs {
        use rcgen::{BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, Issuer};
        let dir = tempfile::tempdir().unwrap();
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca_pem = ca.self_signed(&ca_key).unwrap().pem();
        let issuer = Issuer::new(ca, ca_key);
        let write = |name: &str, text: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, text).unwrap();
            path
        };
        let ca = write("ca.pem", &ca_pem);
        let leaf = |name: &str, sans: Vec<String>| {
            let key = rcgen::KeyPair::generate().unwrap();
            let mut params = CertificateParams::new(sans).unwrap();
            params.extended_key_usages = vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ];
            let cert = params.signed_by(&key, &issuer).unwrap();
            (
                write(&format!("{name}.pem"), &cert.pem()),
                write(&format!("{name}.key"), &key.serialize_pem()),
            )
        };
        let (intake_cert, intake_key) =
            leaf("intake", vec!["intake.test".into(), "127.0.0.1".into()]);
        let (agent_cert, agent_key) = leaf("agent", vec!["agent.test".into()]);
        Certs {
            intake: TlsFiles {
                cert: intake_cert,
                key: intake_key,
                ca: ca.clone(),
            },
            agent: TlsArgs {
                tls_cert: Some(agent_cert),
                tls_key: Some(agent_key),
                tls_client_ca: Some(ca),
                ..TlsArgs::default()
            },
            _dir: dir,
        }
    }

    /// An intake on `listener`: every connection it accepts (the TLS handshake done, the
    /// client certificate checked), in order.
    fn intake(listener: tokio::net::TcpListener, files: &TlsFiles) -> mpsc::Receiver<Link> {
        let tls = Arc::new(ServerTls::load(files.clone(), None).unwrap());
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let (tls, tx) = (tls.clone(), tx.clone());
                tokio::spawn(async move {
                    if let Ok((link, _)) = accept(&tls, tcp).await {
                        let _ = tx.send(link).await;
                    }
                });
            }
        });
        rx
    }

    /// The next of `stream` within a generous bound (a failure, not a timing assertion).
    async fn next<T>(what: &str, next: impl Future<Output = Option<T>>) -> T {
        tokio::time::timeout(Duration::from_secs(30), next)
            .await
            .unwrap_or_else(|_| panic!("no {what} within 30 s"))
            .unwrap_or_else(|| panic!("{what}: the stream ended"))
    }

    /// Bytes written on one end of a link arrive at the other: the connection is alive.
    async fn alive(from: &mut Link, to: &mut Link) {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        from.write_all(b"ping").await.unwrap();
        from.flush().await.unwrap();
        let mut buf = [0; 4];
        tokio::time::timeout(Duration::from_secs(30), to.read_exact(&mut buf))
            .await
            .expect("the bytes arrive within 30 s")
            .unwrap();
        assert_eq!(&buf, b"ping");
    }

    async fn until(what: &str, condition: impl Fn() -> bool) {
        tokio::time::timeout(Duration::from_secs(30), async {
            while !condition() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("{what}: not within 30 s"));
    }

    #[tokio::test]
    async fn each_url_gets_its_own_connection_redialled_without_disturbing_the_others() {
        use tokio_stream::StreamExt as _;
        let certs = certs();
        let (one, two) = (
            tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
            tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
        );
        let (port_one, port_two) = (
            one.local_addr().unwrap().port(),
            two.local_addr().unwrap().port(),
        );
        let (mut intake_one, mut intake_two) =
            (intake(one, &certs.intake), intake(two, &certs.intake));
        let dial = urls(&[
            &format!("https://127.0.0.1:{port_one}"),
            &format!("https://127.0.0.1:{port_two}"),
        ])
        .dial_in(&certs.agent)
        .unwrap()
        .unwrap();
        assert_eq!(
            dial.authorities(),
            [
                format!("127.0.0.1:{port_one}"),
                format!("127.0.0.1:{port_two}")
            ]
        );
        let stop = CancellationToken::new();
        let mut links = dial.links(stop.clone());
        // Both connections are handed out, neither waiting for the other to end.
        let mut ours = BTreeMap::new();
        for _ in 0..2 {
            let link = next("a dialled link", links.next()).await.unwrap();
            ours.insert(link.peer().port(), link);
        }
        assert_eq!(
            ours.keys().copied().collect::<Vec<_>>(),
            BTreeSet::from([port_one, port_two])
                .into_iter()
                .collect::<Vec<_>>()
        );
        let mut theirs_one = next("intake one's connection", intake_one.recv()).await;
        let mut theirs_two = next("intake two's connection", intake_two.recv()).await;

        // The first connection ends: it is dialled again, and the second carries on.
        drop(theirs_one);
        drop(ours.remove(&port_one));
        let mut again = next("the link dialled again", links.next()).await.unwrap();
        assert_eq!(again.peer().port(), port_one);
        theirs_one = next("intake one's new connection", intake_one.recv()).await;
        alive(&mut again, &mut theirs_one).await;
        alive(ours.get_mut(&port_two).unwrap(), &mut theirs_two).await;
        alive(&mut theirs_two, ours.get_mut(&port_two).unwrap()).await;

        // Stopping ends the stream.
        stop.cancel();
        assert!(
            tokio::time::timeout(Duration::from_secs(30), links.next())
                .await
                .expect("the stream ends once stopped")
                .is_none()
        );
    }

    #[tokio::test]
    async fn all_addresses_are_dialled_new_ones_joined_gone_ones_left_when_they_end() {
        use tokio_stream::StreamExt as _;
        let certs = certs();
        // Two "replicas" on one port at two loopback addresses; the resolver (a table here:
        // this machine resolves no name to several addresses) says which exist.
        let first = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = first.local_addr().unwrap().port();
        let second = tokio::net::TcpListener::bind(("127.0.0.2", port))
            .await
            .expect("127.0.0.2 is loopback too");
        let (a, b) = (
            addr(&format!("127.0.0.1:{port}")),
            addr(&format!("127.0.0.2:{port}")),
        );
        let (mut intake_a, mut intake_b) =
            (intake(first, &certs.intake), intake(second, &certs.intake));
        let table = Arc::new(Mutex::new(vec![a]));
        let asked = Arc::new(AtomicUsize::new(0));
        let resolver: Resolver = {
            let (table, asked) = (table.clone(), asked.clone());
            Arc::new(move |host: String, p: u16| {
                assert_eq!((host.as_str(), p), ("intake.test", port));
                let found = lock(&table).clone();
                asked.fetch_add(1, Ordering::AcqRel);
                Box::pin(async move { Ok(found) })
            })
        };
        let connect = ConnectArgs {
            connect_all_addresses: true,
            connect_resolve_interval: Duration::from_millis(50),
            ..urls(&[&format!("https://intake.test:{port}")])
        };
        let dial = connect
            .dial_in(&certs.agent)
            .unwrap()
            .unwrap()
            .with_resolver(resolver);
        let budget = Arc::new(Budget::new(MAX_LINKS));
        let stop = CancellationToken::new();
        let mut links = dial.links_within(budget.clone(), stop.clone());
        // Resolutions seen after the table was last changed: the second one has certainly
        // acted on the change.
        let settled = |asked: &AtomicUsize| {
            let from = asked.load(Ordering::Acquire);
            move |asked: &AtomicUsize| asked.load(Ordering::Acquire) >= from + 2
        };

        // One address: one connection, verified against the URL's host (the intake's
        // certificate names intake.test).
        let mut ours_a = next("a's link", links.next()).await.unwrap();
        assert_eq!(ours_a.peer(), a);
        let mut theirs_a = next("a's connection", intake_a.recv()).await;
        alive(&mut ours_a, &mut theirs_a).await;

        // A second address appears: dialled at the next resolution.
        lock(&table).push(b);
        let mut ours_b = next("b's link", links.next()).await.unwrap();
        assert_eq!(ours_b.peer(), b);
        let mut theirs_b = next("b's connection", intake_b.recv()).await;
        assert_eq!(budget.live(), 2);

        // a disappears: its connection stays (still alive, still counted) until it ends, and
        // then it is not dialled again; b is untouched.
        *lock(&table) = vec![b];
        let done = settled(&asked);
        until("two resolutions after a went", || done(&asked)).await;
        alive(&mut theirs_a, &mut ours_a).await;
        assert_eq!(budget.live(), 2);
        drop(theirs_a);
        drop(ours_a);
        until("a's loop ends", || budget.live() == 1).await;
        alive(&mut ours_b, &mut theirs_b).await;

        // a comes back: dialled again.
        lock(&table).push(a);
        let ours_a = next("a's new link", links.next()).await.unwrap();
        assert_eq!(ours_a.peer(), a);
        next("a's new connection", intake_a.recv()).await;
        assert_eq!(budget.live(), 2);
        stop.cancel();
    }
}
