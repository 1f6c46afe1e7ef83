//! Bounded shutdown: the signal that starts it, and connections that can be cut once its grace
//! is over.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_util::sync::CancellationToken;
use tonic::transport::server::Connected;

/// A future that completes on SIGTERM or SIGINT (ctrl-c).
///
/// The handlers are installed when this is called, not when the future is first polled: call it
/// before announcing readiness (printing `listening on`), so that a supervisor's SIGTERM sent
/// right after that line is never missed and never kills the process with the default action.
///
/// # Panics
///
/// Outside a Tokio runtime.
pub fn shutdown_signal() -> impl Future<Output = ()> + Send + 'static {
    use tokio::signal::unix::{SignalKind, signal};
    let term = signal(SignalKind::terminate());
    let interrupt = signal(SignalKind::interrupt());
    async move {
        match (term, interrupt) {
            (Ok(mut term), Ok(mut interrupt)) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = interrupt.recv() => {}
                }
            }
            (Ok(mut one), Err(_)) | (Err(_), Ok(mut one)) => {
                one.recv().await;
            }
            (Err(_), Err(_)) => std::future::pending().await,
        }
    }
}

/// A connection that can be cut: once its token is cancelled, reads end (EOF) and writes fail,
/// so the HTTP/2 server drops it with every call and stream on it. Servers wrap each accepted
/// connection in one to bound their shutdown (a health Watch or a reflection stream never ends
/// by itself).
pub struct Cuttable<IO> {
    io: IO,
    cut: Pin<Box<tokio_util::sync::WaitForCancellationFutureOwned>>,
}

impl<IO> Cuttable<IO> {
    /// Wraps `io`, cut when `cut` is cancelled.
    pub fn new(io: IO, cut: &CancellationToken) -> Cuttable<IO> {
        Cuttable {
            io,
            cut: Box::pin(cut.clone().cancelled_owned()),
        }
    }

    /// Whether the connection is cut; registers the task to be woken when it is.
    fn is_cut(&mut self, cx: &mut Context<'_>) -> bool {
        self.cut.as_mut().poll(cx).is_ready()
    }
}

fn cut_error() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::ConnectionAborted,
        "connection cut at the end of the shutdown grace",
    )
}

impl<IO: AsyncRead + Unpin> AsyncRead for Cuttable<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.is_cut(cx) {
            // End of stream.
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Cuttable<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if self.is_cut(cx) {
            return Poll::Ready(Err(cut_error()));
        }
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if self.is_cut(cx) {
            return Poll::Ready(Err(cut_error()));
        }
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl<IO: Connected> Connected for Cuttable<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}
