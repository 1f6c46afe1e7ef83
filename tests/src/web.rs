//! A small HTTP/1.1 client for the tests of the JSON API, `/metrics` and server-sent events
//! (hyper's client; nothing hand-parsed but the event-stream lines).

use std::time::Duration;

use anyhow::Context as _;
use http_body_util::{BodyExt as _, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{HeaderMap, Method, Request, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// An answer, body read whole.
#[derive(Debug)]
pub struct Answer {
    /// The status.
    pub status: StatusCode,
    /// The headers.
    pub headers: HeaderMap,
    /// The body as text.
    pub body: String,
}

impl Answer {
    /// The body as JSON.
    pub fn json(&self) -> anyhow::Result<serde_json::Value> {
        serde_json::from_str(&self.body).with_context(|| format!("not JSON: {}", self.body))
    }
}

/// The client. Like a browser, it keeps the cookies servers set (name and value; paths and
/// expiry are not needed by the tests) and sends them back.
#[derive(Clone)]
pub struct Web {
    client: Client<HttpConnector, Full<Bytes>>,
    cookies: std::sync::Arc<std::sync::Mutex<Vec<(String, String)>>>,
}

impl Default for Web {
    fn default() -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        Web {
            client: Client::builder(TokioExecutor::new()).build(connector),
            cookies: Default::default(),
        }
    }
}

impl Web {
    /// Another browser on the same connection pool: its own cookie jar (its own session).
    pub fn fresh_jar(&self) -> Web {
        Web {
            client: self.client.clone(),
            cookies: Default::default(),
        }
    }

    /// Sends a request; `body` is sent as `application/json` when given.
    pub async fn send(
        &self,
        method: Method,
        url: &str,
        headers: &[(&str, &str)],
        body: Option<&str>,
    ) -> anyhow::Result<Answer> {
        let response = self.open(method, url, headers, body).await?;
        let status = response.status();
        let headers = response.headers().clone();
        let bytes = tokio::time::timeout(Duration::from_secs(30), response.into_body().collect())
            .await
            .context("body not complete within 30 s")??
            .to_bytes();
        Ok(Answer {
            status,
            headers,
            body: String::from_utf8_lossy(&bytes).into_owned(),
        })
    }

    /// GET.
    pub async fn get(&self, url: &str) -> anyhow::Result<Answer> {
        self.send(Method::GET, url, &[], None).await
    }

    /// GET of the scheduler's `/metrics` at `url`, as an operator with an `admin:read` token
    /// (the admin listener's `/metrics` needs one).
    pub async fn scrape(&self, url: &str) -> anyhow::Result<Answer> {
        let token = format!("Bearer {}", crate::ADMIN_READ_TOKEN);
        self.send(Method::GET, url, &[("authorization", &token)], None)
            .await
    }

    /// POST with a JSON body.
    pub async fn post(&self, url: &str, body: &str) -> anyhow::Result<Answer> {
        self.send(Method::POST, url, &[], Some(body)).await
    }

    async fn open(
        &self,
        method: Method,
        url: &str,
        headers: &[(&str, &str)],
        body: Option<&str>,
    ) -> anyhow::Result<hyper::Response<Incoming>> {
        let mut request = Request::builder().method(method).uri(url);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let cookies = self
            .cookies
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(name, value)| format!("{name}={value}"))
            .collect::<Vec<_>>()
            .join("; ");
        if !cookies.is_empty() {
            request = request.header("cookie", cookies);
        }
        if body.is_some()
            && !headers
                .iter()
                .any(|(n, _)| n.eq_ignore_ascii_case("content-type"))
        {
            request = request.header("content-type", "application/json");
        }
        let request = request.body(Full::new(Bytes::from(body.unwrap_or_default().to_owned())))?;
        let response = tokio::time::timeout(Duration::from_secs(30), self.client.request(request))
            .await
            .context("no answer within 30 s")?
            .with_context(|| format!("cannot reach {url}"))?;
        let mut cookies = self.cookies.lock().unwrap_or_else(|p| p.into_inner());
        for set in response.headers().get_all("set-cookie") {
            let Some((name, value)) = set
                .to_str()
                .ok()
                .and_then(|v| v.split(';').next())
                .and_then(|pair| pair.split_once('='))
            else {
                continue;
            };
            cookies.retain(|(n, _)| n != name);
            cookies.push((name.trim().to_owned(), value.trim().to_owned()));
        }
        drop(cookies);
        Ok(response)
    }

    /// Opens a server-sent event stream.
    pub async fn events(&self, url: &str) -> anyhow::Result<Events> {
        let response = self
            .open(Method::GET, url, &[("accept", "text/event-stream")], None)
            .await?;
        anyhow::ensure!(
            response.status() == StatusCode::OK,
            "{url} answered {}",
            response.status()
        );
        Ok(Events {
            body: response.into_body(),
            buffer: Vec::new(),
        })
    }
}

/// A server-sent event stream.
pub struct Events {
    body: Incoming,
    /// Raw bytes: a character may be split across frames.
    buffer: Vec<u8>,
}

/// One event.
#[derive(Debug, Clone)]
pub struct ServerEvent {
    /// `event:` (empty when absent).
    pub event: String,
    /// `data:` lines joined.
    pub data: String,
}

impl Events {
    /// The next event (comments and keep-alives skipped); `None` when the stream ends.
    pub async fn next(&mut self) -> anyhow::Result<Option<ServerEvent>> {
        loop {
            if let Some(end) = self.buffer.windows(2).position(|w| w == b"\n\n") {
                let raw: Vec<u8> = self.buffer.drain(..end + 2).collect();
                let block = String::from_utf8(raw).context("an event is not UTF-8")?;
                let mut event = ServerEvent {
                    event: String::new(),
                    data: String::new(),
                };
                for line in block.lines() {
                    // One space after the colon is part of the syntax, not of the value.
                    let field = |name: &str| {
                        line.strip_prefix(name)
                            .map(|v| v.strip_prefix(' ').unwrap_or(v))
                    };
                    if let Some(value) = field("event:") {
                        event.event = value.to_owned();
                    } else if let Some(value) = field("data:") {
                        if !event.data.is_empty() {
                            event.data.push('\n');
                        }
                        event.data.push_str(value);
                    }
                }
                if event.event.is_empty() && event.data.is_empty() {
                    continue;
                }
                return Ok(Some(event));
            }
            match self.body.frame().await {
                None => return Ok(None),
                Some(frame) => {
                    if let Ok(data) = frame?.into_data() {
                        self.buffer.extend_from_slice(&data);
                    }
                }
            }
        }
    }
}

/// The value of a sample in a Prometheus text exposition: the line starting with `series`
/// (name and labels exactly as exposed, e.g. `antidote_live_lessons{status="READY"}`).
pub fn sample(exposition: &str, series: &str) -> Option<f64> {
    exposition.lines().find_map(|line| {
        let rest = line.strip_prefix(series)?.strip_prefix(' ')?;
        rest.split_whitespace().next()?.parse().ok()
    })
}
