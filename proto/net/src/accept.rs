//! Accepting connections, the one way every listener of ours does it.
//!
//! - [`each`]: the accept loop: TCP_NODELAY on every connection, a short pause when accepting
//!   fails (out of descriptors), until a token is cancelled; the caller admits and serves.
//! - Admission: a [`Quota`] of connections per client [`network`] (an IPv4 address, an IPv6
//!   /64), whose [`Permit`] gives its place back when dropped; [`Limited`] is a connection
//!   holding one.
//! - The first-byte guard: [`Limited::opens_within`] waits, with a deadline, for a client's
//!   opening (HTTP/2's preface and first frame, or any first byte of anything else) and hands
//!   what it read to the server first.
//! - [`Listener`]: a bound socket served plaintext or with mTLS, each handshake in a task of
//!   its own (the agents' gRPC listener).

use std::collections::HashMap;
use std::hash::Hash;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_stream::Stream;
use tokio_util::sync::CancellationToken;
use tonic::transport::server::{Connected, TcpConnectInfo};

use crate::tls::ServerTls;

/// Where an agent serves: a bound socket, plaintext or mTLS.
pub struct Listener {
    tcp: TcpListener,
    tls: Option<Arc<ServerTls>>,
}

impl Listener {
    /// Plaintext (loopback, or a mesh doing mTLS: see [`crate::tls::TlsArgs::listener`]).
    pub fn plain(tcp: TcpListener) -> Listener {
        Listener { tcp, tls: None }
    }

    /// mTLS: every connection's handshake must pass `tls` before it reaches the server.
    pub fn tls(tcp: TcpListener, tls: ServerTls) -> Listener {
        Listener {
            tcp,
            tls: Some(Arc::new(tls)),
        }
    }

    /// The bound address.
    pub fn local_addr(&self) -> std::io::Result<std::net::SocketAddr> {
        self.tcp.local_addr()
    }

    /// Accepted connections (handshaken, with TLS), until `stop`.
    pub fn incoming(
        self,
        stop: CancellationToken,
    ) -> Pin<Box<dyn Stream<Item = std::io::Result<Conn>> + Send>> {
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let (tcp, tls) = (self.tcp, self.tls);
        tokio::spawn(async move {
            // The protocol's small replies and Watch events must leave at once: `each` sets
            // TCP_NODELAY (tonic's own applies only to listeners it binds).
            each(&tcp, &stop, |stream, peer| {
                let (tls, tx) = (tls.clone(), tx.clone());
                tokio::spawn(async move {
                    let Some(tls) = tls else {
                        let _ = tx.send(Ok(Conn::Plain(stream))).await;
                        return;
                    };
                    match tls.accept(stream).await {
                        Ok(stream) => {
                            let _ = tx.send(Ok(Conn::Tls(Box::new(stream)))).await;
                        }
                        Err(err) => {
                            tracing::warn!(peer = %peer, error = %err, "refused a connection");
                        }
                    }
                });
            })
            .await;
        });
        Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
    }
}

impl From<TcpListener> for Listener {
    fn from(tcp: TcpListener) -> Listener {
        Listener::plain(tcp)
    }
}

/// One accepted connection, plaintext or TLS.
pub enum Conn {
    /// A plaintext connection.
    Plain(TcpStream),
    /// A TLS connection whose handshake passed.
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

impl Connected for Conn {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        match self {
            Conn::Plain(tcp) => tcp.connect_info(),
            Conn::Tls(tls) => tls.get_ref().0.connect_info(),
        }
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_flush(cx),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Conn::Plain(s) => s.is_write_vectored(),
            Conn::Tls(s) => s.is_write_vectored(),
        }
    }
}

/// Accepts connections on `listener` until `stop` is cancelled and hands each to `serve` with
/// its peer, TCP_NODELAY set (small replies and streamed events must leave at once: Nagle's
/// algorithm and delayed ACKs would hold them ~40 ms). `serve` runs in the loop: it admits
/// (or drops, which closes) the connection and spawns what serves it, so a slow client never
/// holds accepting up. A failing accept (out of descriptors, say) pauses instead of spinning.
pub async fn each(
    listener: &TcpListener,
    stop: &CancellationToken,
    mut serve: impl FnMut(TcpStream, SocketAddr),
) {
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(err) => {
                tracing::warn!(error = %err, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        if let Err(err) = stream.set_nodelay(true) {
            tracing::debug!(error = %err, %peer, "cannot set TCP_NODELAY");
        }
        serve(stream, peer);
    }
}

/// What a client address counts as: an IPv4 address itself (an IPv4-mapped IPv6 one as that
/// IPv4 address), an IPv6 address its /64 (one subscriber's allocation; any address in it is
/// the same client).
pub fn network(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(std::net::Ipv6Addr::from(
                u128::from(v6) & !u128::from(u64::MAX),
            )),
        },
    }
}

/// Holders per key, each key at most `max`: one global cap would let an attacker fill it and
/// lock everyone else out; per-key caps keep each client to its share.
#[derive(Debug)]
pub struct Quota<K = String> {
    max: u32,
    held: Arc<Mutex<HashMap<K, u32>>>,
}

impl<K> Clone for Quota<K> {
    fn clone(&self) -> Self {
        Quota {
            max: self.max,
            held: self.held.clone(),
        }
    }
}

impl<K: Hash + Eq + Clone> Quota<K> {
    /// A quota of `max` holders per key.
    pub fn new(max: u32) -> Quota<K> {
        Quota {
            max,
            held: Arc::default(),
        }
    }

    /// A place for `key`, or `None` when it already holds `max`.
    pub fn take(&self, key: K) -> Option<Permit<K>> {
        let mut held = self.lock();
        let count = held.entry(key.clone()).or_insert(0);
        if *count >= self.max {
            return None;
        }
        *count += 1;
        Some(Permit {
            quota: self.clone(),
            key,
        })
    }

    /// How many places `key` holds (for tests and metrics).
    pub fn held<Q: Hash + Eq + ?Sized>(&self, key: &Q) -> u32
    where
        K: std::borrow::Borrow<Q>,
    {
        self.lock().get(key).copied().unwrap_or(0)
    }

    /// Its limit per key.
    pub fn max(&self) -> u32 {
        self.max
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<K, u32>> {
        // Every critical section is one map update; a poisoned map is still consistent.
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One place in a [`Quota`], given back on drop.
#[derive(Debug)]
pub struct Permit<K: Hash + Eq + Clone = String> {
    quota: Quota<K>,
    key: K,
}

impl<K: Hash + Eq + Clone> Drop for Permit<K> {
    fn drop(&mut self) {
        let mut held = self.quota.lock();
        if let Some(count) = held.get_mut(&self.key) {
            *count -= 1;
            if *count == 0 {
                held.remove(&self.key);
            }
        }
    }
}

/// An accepted connection holding its client network's place in a [`Quota`] until it closes.
#[derive(Debug)]
pub struct Limited {
    stream: TcpStream,
    _permit: Permit<IpAddr>,
    /// What [`Limited::opens_within`] read of the client's opening, handed to the server
    /// before anything else the socket reads.
    opening: Vec<u8>,
    /// How much of `opening` the server has read.
    replayed: usize,
}

/// The HTTP/2 connection preface (RFC 9113 3.4), which a client's SETTINGS frame follows.
pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// The largest first frame the guard waits for: HTTP/2's initial SETTINGS_MAX_FRAME_SIZE.
/// A longer one is the server's to refuse.
const FIRST_FRAME_MAX: usize = 16_384;

/// How much of a client's opening is complete (see [`Limited::opens_within`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Opening {
    /// More bytes are needed.
    Partial,
    /// The HTTP/2 preface and one whole frame (the first SETTINGS), or anything that is not
    /// HTTP/2's preface (HTTP/1: its headers have hyper's own timer): the server's from here.
    Complete,
}

/// Whether `read` (the first bytes a client sent) is a complete opening.
pub fn opening(read: &[u8]) -> Opening {
    let common = read.len().min(PREFACE.len());
    if read[..common] != PREFACE[..common] {
        // Not HTTP/2 (an HTTP/1 request line, or garbage the server refuses at once).
        return Opening::Complete;
    }
    let Some(frame) = read.get(PREFACE.len()..) else {
        return Opening::Partial;
    };
    if frame.len() < 9 {
        return Opening::Partial;
    }
    let length = usize::from(frame[0]) << 16 | usize::from(frame[1]) << 8 | usize::from(frame[2]);
    if length > FIRST_FRAME_MAX || frame.len() >= 9 + length {
        Opening::Complete
    } else {
        Opening::Partial
    }
}

impl Limited {
    /// Admits `stream` from `peer` if its [`network`] has room in `quota`; otherwise `None`, and
    /// the caller drops (closes) the stream.
    pub fn admit(stream: TcpStream, peer: SocketAddr, quota: &Quota<IpAddr>) -> Option<Limited> {
        let permit = quota.take(network(peer.ip()))?;
        Some(Limited {
            stream,
            _permit: permit,
            opening: Vec::new(),
            replayed: 0,
        })
    }

    /// Whether the client completes its opening within `within` (the first-byte guard): for
    /// HTTP/2, the preface and its first frame (the SETTINGS every client sends first); for
    /// anything else, its first byte (HTTP/1's headers then have hyper's `header_read_timeout`).
    /// A client that connects and says nothing, or drips the preface, would otherwise hold its
    /// socket forever: neither hyper-util's protocol sniffing (hyper#3756) nor tonic's and h2's
    /// wait for the preface and SETTINGS has a timer. `false` also when the client closed or the
    /// socket failed. What was read is handed to the server first.
    pub async fn opens_within(&mut self, within: Duration) -> bool {
        use tokio::io::AsyncReadExt as _;
        let read = async {
            let mut chunk = [0u8; 1024];
            loop {
                // Never more than the opening: the rest stays in the socket for the server.
                let want = match self.opening.len() < PREFACE.len() + 9 {
                    true => PREFACE.len() + 9 - self.opening.len(),
                    false => {
                        let frame = &self.opening[PREFACE.len()..];
                        let length = usize::from(frame[0]) << 16
                            | usize::from(frame[1]) << 8
                            | usize::from(frame[2]);
                        PREFACE.len() + 9 + length - self.opening.len()
                    }
                };
                let n = self.stream.read(&mut chunk[..want.min(1024)]).await?;
                if n == 0 {
                    return Ok::<bool, io::Error>(false);
                }
                self.opening.extend_from_slice(&chunk[..n]);
                if opening(&self.opening) == Opening::Complete {
                    return Ok(true);
                }
            }
        };
        matches!(tokio::time::timeout(within, read).await, Ok(Ok(true)))
    }
}

impl AsyncRead for Limited {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.replayed < this.opening.len() {
            let rest = &this.opening[this.replayed..];
            let n = rest.len().min(buf.remaining());
            buf.put_slice(&rest[..n]);
            this.replayed += n;
            if this.replayed == this.opening.len() {
                this.opening = Vec::new();
                this.replayed = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Limited {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

impl Connected for Limited {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.stream.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_opening_is_complete_with_the_preface_and_one_frame_or_when_it_is_not_http2() {
        let settings = [0, 0, 6, 4, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 100];
        let whole: Vec<u8> = [PREFACE, &settings[..]].concat();
        for n in 0..whole.len() {
            assert_eq!(opening(&whole[..n]), Opening::Partial, "{n} bytes");
        }
        assert_eq!(opening(&whole), Opening::Complete);
        // An empty SETTINGS frame is a whole frame.
        assert_eq!(
            opening(&[PREFACE, &[0, 0, 0, 4, 0, 0, 0, 0, 0][..]].concat()),
            Opening::Complete
        );
        // HTTP/1 and garbage are the server's at once; `P` alone might still be HTTP/2.
        assert_eq!(opening(b"G"), Opening::Complete);
        assert_eq!(opening(b"PO"), Opening::Complete);
        assert_eq!(opening(b"P"), Opening::Partial);
        // A first frame longer than HTTP/2 allows is the server's to refuse.
        assert_eq!(
            opening(&[PREFACE, &[0xff, 0xff, 0xff, 4][..]].concat()),
            Opening::Partial
        );
        assert_eq!(
            opening(&[PREFACE, &[0xff, 0xff, 0xff, 4, 0, 0, 0, 0, 0][..]].concat()),
            Opening::Complete
        );
    }

    #[test]
    fn each_key_has_its_own_places_given_back_on_drop() {
        let quota = Quota::<String>::new(2);
        let a1 = quota.take("a".into()).unwrap();
        let _a2 = quota.take("a".into()).unwrap();
        assert!(quota.take("a".into()).is_none(), "a is full");
        let _b = quota.take("b".into()).expect("b is not a's");
        drop(a1);
        assert_eq!(quota.held("a"), 1);
        assert!(quota.take("a".into()).is_some());
    }

    #[test]
    fn an_ipv6_client_is_its_64_and_a_mapped_ipv4_one_its_ipv4_address() {
        let ip = |text: &str| text.parse::<IpAddr>().unwrap();
        assert_eq!(network(ip("2001:db8:1:2::1")), ip("2001:db8:1:2::"));
        assert_eq!(network(ip("2001:db8:1:2:ffff::9")), ip("2001:db8:1:2::"));
        assert_ne!(network(ip("2001:db8:1:3::1")), ip("2001:db8:1:2::"));
        assert_eq!(network(ip("::ffff:10.0.0.1")), ip("10.0.0.1"));
        assert_eq!(network(ip("10.0.0.1")), ip("10.0.0.1"));
    }
}
