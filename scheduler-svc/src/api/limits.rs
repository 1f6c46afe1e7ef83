//! Per-client bounds on what the public listeners hold open: connections per client address
//! and Watch streams per session and per address. One global cap would let an attacker fill it
//! and lock everyone else out; per-key caps keep each client to its share.
//!
//! A [`Quota`] counts holders per key (an address's network, see
//! [`crate::store::network`], or a session id); [`Quota::take`] hands out a [`Permit`] that
//! gives its place back when dropped, however the connection or stream ends.

use std::collections::HashMap;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// Holders per key, each key at most `max`.
#[derive(Debug, Clone)]
pub struct Quota {
    max: u32,
    held: Arc<Mutex<HashMap<String, u32>>>,
}

impl Quota {
    /// A quota of `max` holders per key.
    pub fn new(max: u32) -> Quota {
        Quota {
            max,
            held: Arc::default(),
        }
    }

    /// A place for `key`, or `None` when it already holds `max`.
    pub fn take(&self, key: String) -> Option<Permit> {
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
    pub fn held(&self, key: &str) -> u32 {
        self.lock().get(key).copied().unwrap_or(0)
    }

    /// Its limit per key.
    pub fn max(&self) -> u32 {
        self.max
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, u32>> {
        // Every critical section is one map update; a poisoned map is still consistent.
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One place in a [`Quota`], given back on drop.
#[derive(Debug)]
pub struct Permit {
    quota: Quota,
    key: String,
}

impl Drop for Permit {
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

/// An accepted connection holding its place in the per-address quota until it closes.
#[derive(Debug)]
pub struct Limited {
    stream: TcpStream,
    _permit: Permit,
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
    /// Admits `stream` from a client address if its network has room; otherwise `None`, and the
    /// caller drops (closes) the stream.
    pub fn admit(stream: TcpStream, quota: &Quota) -> Option<Limited> {
        let peer = stream.peer_addr().ok()?;
        let permit = quota.take(crate::store::network(peer.ip()))?;
        Some(Limited {
            stream,
            _permit: permit,
            opening: Vec::new(),
            replayed: 0,
        })
    }

    /// Whether the client completes its opening within `within` (the handshake guard): for
    /// HTTP/2, the preface and its first frame (the SETTINGS every client sends first); for
    /// anything else, its first byte (HTTP/1's headers then have hyper's `header_read_timeout`).
    /// A client that connects and says nothing, or drips the preface, would otherwise hold its
    /// socket forever: neither hyper-util's protocol sniffing (hyper#3756) nor tonic's and h2's
    /// wait for the preface and SETTINGS has a timer. `false` also when the client closed or the
    /// socket failed. What was read is handed to the server first.
    pub async fn opens_within(&mut self, within: std::time::Duration) -> bool {
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

impl tonic::transport::server::Connected for Limited {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.stream.connect_info()
    }
}

/// How many refusals of unauthenticated admin calls the audit log records per client network
/// per minute, and from all networks together; beyond, a refusal is only logged (a stranger
/// who reaches the admin port cannot grow the database at will).
pub const AUDITED_REFUSALS: (u32, u32) = (10, 600);

/// The window of [`AUDITED_REFUSALS`].
const REFUSAL_WINDOW: std::time::Duration = std::time::Duration::from_secs(60);

/// Networks remembered at most; a new one beyond them is not audited in this window.
const REFUSAL_NETWORKS: usize = 10_000;

/// Counts unauthenticated admin refusals per client network and minute (see
/// [`AUDITED_REFUSALS`]).
#[derive(Debug, Default)]
pub struct Refusals {
    /// Network (`""`: all of them) → its window's start and count.
    seen: Mutex<HashMap<String, (std::time::Instant, u32)>>,
}

impl Refusals {
    /// Counts a refusal from `network` at `now`; whether it is still within the budget, and so
    /// audited.
    pub fn audit(&self, network: String, now: std::time::Instant) -> bool {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        if seen.len() > REFUSAL_NETWORKS {
            seen.retain(|_, (since, _)| now.duration_since(*since) < REFUSAL_WINDOW);
        }
        let count = |key: String, max: u32, seen: &mut HashMap<_, _>| {
            if seen.len() > REFUSAL_NETWORKS && !seen.contains_key(&key) {
                return false;
            }
            let entry: &mut (std::time::Instant, u32) = seen.entry(key).or_insert((now, 0));
            if now.duration_since(entry.0) >= REFUSAL_WINDOW {
                *entry = (now, 0);
            }
            entry.1 = entry.1.saturating_add(1);
            entry.1 <= max
        };
        let (per_network, overall) = AUDITED_REFUSALS;
        count(network, per_network, &mut seen) && count(String::new(), overall, &mut seen)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_audited_a_few_per_network_and_minute() {
        let refusals = Refusals::default();
        let start = std::time::Instant::now();
        let (per_network, overall) = AUDITED_REFUSALS;
        let audited = (0..3 * per_network)
            .filter(|_| refusals.audit("10.0.0.1".into(), start))
            .count();
        assert_eq!(audited, per_network as usize);
        assert!(
            refusals.audit("10.0.0.2".into(), start),
            "another network has its own"
        );
        let later = start + REFUSAL_WINDOW;
        assert!(
            refusals.audit("10.0.0.1".into(), later),
            "a new minute, a new budget"
        );
        // All networks together: at most `overall` a minute.
        let many = (0..2 * overall)
            .filter(|n| refusals.audit(format!("10.1.{}.{}", n / 250, n % 250), later))
            .count();
        assert!(many < overall as usize, "{many} audited in one minute");
    }

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
        let quota = Quota::new(2);
        let a1 = quota.take("a".into()).unwrap();
        let _a2 = quota.take("a".into()).unwrap();
        assert!(quota.take("a".into()).is_none(), "a is full");
        let _b = quota.take("b".into()).expect("b is not a's");
        drop(a1);
        assert_eq!(quota.held("a"), 1);
        assert!(quota.take("a".into()).is_some());
    }
}
