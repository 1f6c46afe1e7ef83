//! Accepting connections: a bound socket served plaintext or with mTLS, each handshake in a
//! task of its own.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_stream::wrappers::TcpListenerStream;
use tokio_stream::{Stream, StreamExt as _};
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
        let Some(tls) = self.tls else {
            return Box::pin(TcpListenerStream::new(self.tcp).map(|stream| {
                let stream = stream?;
                // tonic's own tcp_nodelay does not apply to incoming streams we hand it.
                stream.set_nodelay(true)?;
                Ok(Conn::Plain(stream))
            }));
        };
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let tcp = self.tcp;
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    () = stop.cancelled() => return,
                    accepted = tcp.accept() => accepted,
                };
                let (stream, peer) = match accepted {
                    Ok(accepted) => accepted,
                    Err(err) => {
                        // Out of descriptors and the like: pause rather than spin.
                        tracing::warn!(error = %err, "accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                // The protocol's small replies and Watch events must leave at once.
                let _ = stream.set_nodelay(true);
                let (tls, tx) = (tls.clone(), tx.clone());
                tokio::spawn(async move {
                    match tls.accept(stream).await {
                        Ok(stream) => {
                            let _ = tx.send(Ok(Conn::Tls(Box::new(stream)))).await;
                        }
                        Err(err) => {
                            tracing::warn!(peer = %peer, error = %err, "refused a connection");
                        }
                    }
                });
            }
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

