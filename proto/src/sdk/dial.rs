//! Dial-in: `antidote.agent.v1` over a connection the agent opened, for agents behind NAT or a
//! firewall that no scheduler can reach.
//!
//! The agent dials the scheduler's agent intake (`--connect https://SCHEDULER:PORT`) over TLS,
//! presenting its client certificate, whose name (a DNS or `spiffe://` URI SAN) is the agent's
//! name; it verifies the scheduler's server certificate. Then the roles flip: on that one
//! connection the agent is the HTTP/2 (gRPC) *server* and the scheduler the client, so the
//! protocol, its rules and its conformance are exactly those of a dialled agent. Nothing else is
//! sent: no preface of our own, no hello (the name comes from the certificate), so any gRPC
//! server that can serve an already-connected socket can be an agent that dials in
//! (PROTOCOL.md, "Dial-in").
//!
//! Both ends are here, for every Rust caller:
//! - the agent's: [`ConnectArgs`] (the `--connect` flag, flattened into an agent's flags) and
//!   [`DialIn`], whose [`DialIn::links`] is the stream of connections `sdk::run` serves, dialled
//!   again with exponential backoff and jitter whenever one ends;
//! - the caller's (the scheduler's intake, the conformance suite): [`accept`] (TLS with a
//!   client certificate) and [`Inbound`], one agent's accepted connections as a tonic
//!   [`Channel`] whose connector hands out the newest one: a reconnection is the agent's next
//!   dial.

use std::future::Future as _;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
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

/// A connection that lasted this long was a working one: the next dial starts the backoff
/// afresh. (A refused agent's connection ends at once, so its retries slow down.)
const STABLE: Duration = Duration::from_secs(5);

/// The `--connect` flag, flattened into each agent's flags beside [`TlsArgs`]: the TLS files
/// are the agent's own (its certificate names it to the scheduler; `--tls-client-ca` is the CA
/// of the scheduler's certificates, which verifies the scheduler's server certificate as it
/// verifies its client certificate when the scheduler dials).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ConnectArgs {
    /// Dial in to the scheduler's agent intake at this URL (`https://SCHEDULER:PORT`) instead of
    /// listening: the agent then opens no port at all. Needs --tls-cert, --tls-key and
    /// --tls-client-ca; the scheduler's certificate must carry --tls-require-identity, or else
    /// the URL's host.
    #[arg(long, env = "ANTIDOTE_AGENT_CONNECT", value_name = "URL")]
    pub connect: Option<String>,
}

impl ConnectArgs {
    /// The dial-in these flags ask for; `None` when the agent listens instead.
    pub fn dial_in(&self, tls: &TlsArgs) -> Result<Option<DialIn>, DialError> {
        let Some(url) = &self.connect else {
            return Ok(None);
        };
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
        let target = Target::parse(url)?;
        let identity = match &tls.tls_require_identity {
            Some(identity) => Identity::parse(identity)?,
            None => Identity::parse(&target.host).map_err(|_| DialError::Url {
                url: url.clone(),
                reason: "its host is not a DNS name: give --tls-require-identity".into(),
            })?,
        };
        let files = TlsFiles {
            cert: cert.clone(),
            key: key.clone(),
            ca: ca.clone(),
        };
        Ok(Some(DialIn {
            target,
            tls: Arc::new(ClientTls::load(files, identity)?),
        }))
    }
}

/// Why dialling in cannot even start.
#[derive(Debug, thiserror::Error)]
pub enum DialError {
    /// The `--connect` URL is not `https://HOST:PORT`.
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
}

/// The agent's side: where to dial, with which (reloading) TLS configuration.
pub struct DialIn {
    /// The intake.
    target: Target,
    /// Our certificate and the scheduler's expected identity, re-read when rotated.
    tls: Arc<ClientTls>,
}

impl std::fmt::Debug for DialIn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DialIn")
            .field("target", &self.target)
            .finish_non_exhaustive()
    }
}

impl DialIn {
    /// `HOST:PORT` of the intake.
    pub fn authority(&self) -> String {
        self.target.authority()
    }

    /// The connections to serve, one at a time: each is dialled when the previous one ended
    /// (the first at once), after a backoff from [`BACKOFF_INITIAL`] doubling to
    /// [`BACKOFF_MAX`] with jitter, restarted after a connection that worked. Failures are
    /// logged, never returned: the stream ends only when `stop` is cancelled.
    pub fn links(self, stop: CancellationToken) -> ReceiverStream<io::Result<Link>> {
        let (tx, rx) = mpsc::channel(1);
        tokio::spawn(self.dial_loop(tx, stop));
        ReceiverStream::new(rx)
    }

    async fn dial_loop(self, tx: mpsc::Sender<io::Result<Link>>, stop: CancellationToken) {
        let scheduler = self.authority();
        let mut backoff = Backoff::new(BACKOFF_INITIAL, BACKOFF_MAX);
        loop {
            let attempt = tokio::select! {
                () = stop.cancelled() => return,
                attempt = tokio::time::timeout(DIAL_TIMEOUT, self.dial_once()) => attempt,
            };
            match attempt {
                Ok(Ok((link, ended))) => {
                    tracing::info!(%scheduler, "dialled in; serving on the connection");
                    let began = Instant::now();
                    if tx.send(Ok(link)).await.is_err() {
                        // The server stopped taking connections: shutting down.
                        return;
                    }
                    let reason = tokio::select! {
                        () = stop.cancelled() => return,
                        reason = ended => reason.unwrap_or_else(|_| "closed".into()),
                    };
                    if began.elapsed() >= STABLE {
                        tracing::warn!(%scheduler, %reason, "the connection to the scheduler ended; dialling again");
                        backoff.reset();
                    } else {
                        // A refusal after the handshake (a name the intake does not admit, or
                        // our certificate refused) looks like this from here.
                        tracing::warn!(%scheduler, %reason, "the scheduler ended the connection at once: its agent intake may refuse this agent's certificate or name (see the scheduler's log)");
                    }
                }
                Ok(Err(err)) => {
                    tracing::warn!(%scheduler, error = %err, "cannot dial in");
                }
                Err(_) => {
                    tracing::warn!(%scheduler, timeout = ?DIAL_TIMEOUT, "cannot dial in: timed out");
                }
            }
            let delay = backoff.next();
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(delay) => {}
            }
        }
    }

    /// TCP, then the TLS handshake with the files of this moment.
    async fn dial_once(&self) -> Result<(Link, oneshot::Receiver<String>), TlsError> {
        let host = self
            .target
            .host
            .trim_start_matches('[')
            .trim_end_matches(']');
        let tcp = TcpStream::connect((host, self.target.port))
            .await
            .map_err(|err| {
                TlsError::Handshake(format!("cannot connect to {}: {err}", self.authority()))
            })?;
        // The protocol's small replies and Watch events must leave at once.
        let _ = tcp.set_nodelay(true);
        let local = tcp.local_addr().ok();
        let peer = tcp
            .peer_addr()
            .map_err(|err| TlsError::Handshake(err.to_string()))?;
        let tls = self.tls.connect(tcp, &self.target.host).await?;
        Ok(Link::new(tls, local, peer))
    }
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
            connect: Some("https://127.0.0.1:7443".into()),
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
}
