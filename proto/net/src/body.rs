//! Request bodies with a deadline (the slow-body guard every HTTP server of ours applies).

use std::future::Future as _;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

/// A request body that must arrive whole within a deadline set when its headers did (the
/// slow-body guard: a client that completes its headers and then drips the body would hold a
/// request, and the connection, open for as long as it likes). Past the deadline the body
/// yields [`BodyTimedOut`], and so the request fails as the server reads it; a body that ended
/// in time is never touched.
pub struct BodyDeadline<B> {
    inner: B,
    /// Fires at the deadline; `None` once the body ended or timed out.
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    /// The bound, for the error.
    within: Duration,
    /// Whether [`BodyTimedOut`] was yielded: the body then ends.
    timed_out: bool,
}

impl<B: hyper::body::Body> BodyDeadline<B> {
    /// `inner`, due whole within `within` from now.
    pub fn new(inner: B, within: Duration) -> BodyDeadline<B> {
        // A body that is already complete (a GET's) needs no timer.
        let deadline = (!inner.is_end_stream()).then(|| Box::pin(tokio::time::sleep(within)));
        BodyDeadline {
            inner,
            deadline,
            within,
            timed_out: false,
        }
    }
}

/// A request body that did not arrive whole within its [`BodyDeadline`].
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("the request body did not arrive within {0:?}")]
pub struct BodyTimedOut(pub Duration);

impl BodyTimedOut {
    /// The [`BodyTimedOut`] somewhere in `err`'s chain of sources, if any (axum, hyper and
    /// the proxy's client wrap it).
    pub fn within(err: &(dyn std::error::Error + 'static)) -> Option<BodyTimedOut> {
        let mut cause = Some(err);
        while let Some(err) = cause {
            if let Some(timed_out) = err.downcast_ref::<BodyTimedOut>() {
                return Some(*timed_out);
            }
            cause = err.source();
        }
        None
    }
}

impl<B> hyper::body::Body for BodyDeadline<B>
where
    B: hyper::body::Body + Unpin,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Data = B::Data;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        if this.timed_out {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(None) => {
                this.deadline = None;
                Poll::Ready(None)
            }
            Poll::Ready(Some(frame)) => {
                if this.inner.is_end_stream() {
                    this.deadline = None;
                }
                Poll::Ready(Some(frame.map_err(Into::into)))
            }
            Poll::Pending => {
                let due = this
                    .deadline
                    .as_mut()
                    .is_some_and(|deadline| deadline.as_mut().poll(cx).is_ready());
                if !due {
                    return Poll::Pending;
                }
                this.deadline = None;
                this.timed_out = true;
                Poll::Ready(Some(Err(Box::new(BodyTimedOut(this.within)))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.timed_out || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt as _;

    #[tokio::test]
    async fn a_body_must_arrive_whole_before_its_deadline() {
        let within = Duration::from_millis(200);
        // A whole body in time passes untouched.
        let whole = http_body_util::Full::new(bytes::Bytes::from_static(b"{}"));
        let collected = BodyDeadline::new(whole, within).collect().await.unwrap();
        assert_eq!(collected.to_bytes(), "{}");
        // A body whose sender dawdles past the deadline fails with BodyTimedOut.
        let first = futures::stream::once(async {
            Ok::<_, std::convert::Infallible>(hyper::body::Frame::data(bytes::Bytes::from_static(
                b"{",
            )))
        });
        // The rest would come a minute later: far past the deadline.
        let rest = futures::stream::once(async {
            tokio::time::sleep(Duration::from_secs(60)).await;
            Ok(hyper::body::Frame::data(bytes::Bytes::from_static(b"}")))
        });
        let dawdling = futures::StreamExt::chain(first, rest);
        let body = http_body_util::StreamBody::new(Box::pin(dawdling));
        let err = BodyDeadline::new(body, within).collect().await.unwrap_err();
        let timed_out = BodyTimedOut::within(&*err).expect("BodyTimedOut in the chain");
        assert_eq!(timed_out.0, within);
    }
}
