//! `antidotectl ssh LIVE_LESSON ENDPOINT`: a terminal in your terminal, through the agent's
//! entrypoint (proto/PROTOCOL.md, "Entrypoint"): the same WebSocket a learner's browser tab
//! uses, opened with the fresh token of the session owner's GetLiveLesson answer. Nothing here
//! talks SSH: the entrypoint is the SSH client, inside the backend's network.
//!
//! When stdin is a terminal it is put in raw mode (`stty raw -echo`, restored on the way out)
//! and its size follows SIGWINCH; otherwise (a pipe) bytes are passed as they are, which is how
//! scripts and the tests drive it. The remote shell's exit status becomes ours.

use std::io::IsTerminal as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;

use antidote_proto::api::v1 as api;
use futures::{SinkExt as _, StreamExt as _};
use std::io::{Read as _, Write as _};

use tokio::io::{AsyncRead, AsyncWrite};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;

use crate::client::{Clients, Failure, Result};

/// The shell's exit status, once the terminal ended.
pub async fn ssh(
    c: &Clients,
    id: String,
    endpoint: String,
    presentation: Option<String>,
    ca: Option<&Path>,
) -> Result<i32> {
    let live = c
        .lessons
        .clone()
        .get_live_lesson(c.learner(api::GetLiveLessonRequest { id: id.clone() }, &id))
        .await?
        .into_inner();
    let url = terminal_url(&live, &endpoint, presentation.as_deref())?;
    let raw = RawMode::enter();
    let (cols, rows) = raw.size().unwrap_or((80, 24));
    let url = format!("{url}&cols={cols}&rows={rows}");
    let status = match connect(&url, ca).await? {
        Stream::Plain(ws) => pump(ws, &raw).await,
        Stream::Tls(ws) => pump(ws, &raw).await,
    };
    drop(raw);
    status
}

/// The WebSocket URL of the endpoint's SSH presentation.
fn terminal_url(
    live: &api::LiveLesson,
    endpoint: &str,
    presentation: Option<&str>,
) -> Result<String> {
    let found = live
        .endpoints
        .iter()
        .find(|e| e.name == endpoint)
        .ok_or_else(|| {
            let names: Vec<&str> = live.endpoints.iter().map(|e| e.name.as_str()).collect();
            Failure(format!(
                "live lesson {} has no endpoint `{endpoint}` (it has: {})",
                live.id,
                names.join(", ")
            ))
        })?;
    let ssh: Vec<&api::LivePresentation> = found
        .presentations
        .iter()
        .filter(|p| p.r#type == "ssh" && presentation.is_none_or(|name| p.name == name))
        .collect();
    let chosen = match ssh.as_slice() {
        [one] => *one,
        [] => {
            return Err(Failure(match presentation {
                Some(name) => format!("endpoint `{endpoint}` has no ssh presentation `{name}`"),
                None => format!("endpoint `{endpoint}` has no ssh presentation"),
            }));
        }
        many => {
            let names: Vec<&str> = many.iter().map(|p| p.name.as_str()).collect();
            return Err(Failure(format!(
                "endpoint `{endpoint}` has several ssh presentations; pick one with --presentation ({})",
                names.join(", ")
            )));
        }
    };
    if chosen.entrypoint_url.is_empty() {
        return Err(Failure(format!(
            "no entrypoint for {endpoint}/{}: the live lesson is not READY, its agent serves no entrypoint, or the scheduler signs no entrypoint tokens ([entrypoint] keys)",
            chosen.name
        )));
    }
    Ok(chosen.entrypoint_url.clone())
}

#[allow(clippy::large_enum_variant)] // one value per run
enum Stream {
    Plain(WebSocketStream<tokio::net::TcpStream>),
    Tls(WebSocketStream<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>),
}

/// Opens the WebSocket at an `http(s)://` entrypoint URL; for https the server is checked
/// against the system's roots, or `ca` when given.
async fn connect(url: &str, ca: Option<&Path>) -> Result<Stream> {
    let (tls, rest) = if let Some(rest) = url.strip_prefix("https://") {
        (true, rest)
    } else if let Some(rest) = url.strip_prefix("http://") {
        (false, rest)
    } else {
        return Err(Failure(format!("the entrypoint URL {url} is not http(s)")));
    };
    let authority = rest.split('/').next().unwrap_or(rest);
    let (host, has_port) = match authority.rsplit_once(':') {
        Some((host, port)) if !port.contains(']') => (host, true),
        _ => (authority, false),
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let address = match (has_port, tls) {
        (true, _) => authority.to_owned(),
        (false, true) => format!("{authority}:443"),
        (false, false) => format!("{authority}:80"),
    };
    let tcp = tokio::net::TcpStream::connect(&address)
        .await
        .map_err(|err| Failure(format!("cannot reach the entrypoint {address}: {err}")))?;
    let _ = tcp.set_nodelay(true);
    let ws_url = format!("{}://{rest}", if tls { "wss" } else { "ws" });
    if !tls {
        let (ws, _) = tokio_tungstenite::client_async(ws_url, tcp)
            .await
            .map_err(refused)?;
        return Ok(Stream::Plain(ws));
    }
    let mut roots = rustls::RootCertStore::empty();
    match ca {
        Some(path) => {
            let bad = |err: &dyn std::fmt::Display| {
                Failure(format!("--entrypoint-ca {}: {err}", path.display()))
            };
            let pem = std::fs::read(path).map_err(|err| bad(&err))?;
            for cert in
                <rustls::pki_types::CertificateDer as rustls::pki_types::pem::PemObject>::pem_slice_iter(&pem)
            {
                roots
                    .add(cert.map_err(|err| bad(&err))?)
                    .map_err(|err| bad(&err))?;
            }
        }
        None => {
            for cert in rustls_native_certs::load_native_certs().certs {
                let _ = roots.add(cert);
            }
        }
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|err| Failure(format!("TLS: {err}")))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let name = rustls::pki_types::ServerName::try_from(host.to_owned())
        .map_err(|err| Failure(format!("the entrypoint's host {host}: {err}")))?;
    let stream = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .map_err(|err| Failure(format!("TLS to the entrypoint {address}: {err}")))?;
    let (ws, _) = tokio_tungstenite::client_async(ws_url, stream)
        .await
        .map_err(refused)?;
    Ok(Stream::Tls(ws))
}

/// Why the WebSocket was not opened, in the terms of PROTOCOL.md's entrypoint answers.
fn refused(err: tokio_tungstenite::tungstenite::Error) -> Failure {
    match err {
        tokio_tungstenite::tungstenite::Error::Http(response) => Failure(format!(
            "the entrypoint refused the terminal: HTTP {}{}",
            response.status(),
            match response.status().as_u16() {
                401 => " (token missing, expired or not signed by this scheduler's keys)",
                403 => " (the token is for another live lesson or presentation)",
                502 => " (the endpoint's SSH server did not answer or refused the login)",
                _ => "",
            }
        )),
        other => Failure(format!("the terminal's WebSocket failed: {other}")),
    }
}

/// Moves bytes between our terminal and the WebSocket until the shell exits.
async fn pump<S>(ws: WebSocketStream<S>, raw: &RawMode) -> Result<i32>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let (mut to_shell, mut from_shell) = ws.split();
    // Our stdin is read on a thread of its own (a blocking read); its chunks come over a
    // channel, which closes when stdin ends.
    let (keys_tx, mut keys) = tokio::sync::mpsc::channel::<Vec<u8>>(16);
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin().lock();
        let mut buf = vec![0u8; 4096];
        while let Ok(n @ 1..) = stdin.read(&mut buf) {
            if keys_tx.blocking_send(buf[..n].to_vec()).is_err() {
                return;
            }
        }
    });
    let mut stdout = std::io::stdout();
    let mut stdin_open = true;
    let mut resized = resize_signals();
    let mut status = None;
    loop {
        tokio::select! {
            read = keys.recv(), if stdin_open => match read {
                // A pipe ended: the shell has its input; wait for it to finish.
                None => stdin_open = false,
                Some(bytes) => {
                    if to_shell.send(Message::Binary(bytes.into())).await.is_err() {
                        break;
                    }
                }
            },
            Some(()) = next_resize(&mut resized) => {
                if let Some((cols, rows)) = raw.size() {
                    let resize = serde_json::json!({"type": "resize", "cols": cols, "rows": rows});
                    let _ = to_shell.send(Message::Text(resize.to_string().into())).await;
                }
            }
            message = from_shell.next() => match message {
                Some(Ok(Message::Binary(bytes))) => {
                    if stdout.write_all(&bytes).is_err() {
                        break;
                    }
                    let _ = stdout.flush();
                }
                Some(Ok(Message::Text(text))) => {
                    if let Ok(exit) = serde_json::from_str::<serde_json::Value>(&text)
                        && exit["type"] == "exit"
                    {
                        status = exit["status"].as_i64();
                    }
                }
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => break,
                Some(Ok(_)) => {}
            },
        }
    }
    let _ = stdout.flush();
    match status {
        Some(status) => Ok(i32::try_from(status).unwrap_or(255)),
        None => Err(Failure(
            "the terminal closed without the shell's exit status (the entrypoint or the endpoint went away)".into(),
        )),
    }
}

fn resize_signals() -> Option<tokio::signal::unix::Signal> {
    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::window_change()).ok()
}

async fn next_resize(signals: &mut Option<tokio::signal::unix::Signal>) -> Option<()> {
    match signals {
        Some(signals) => signals.recv().await,
        None => std::future::pending().await,
    }
}

/// Our terminal in raw mode while this lives (when stdin is a terminal at all).
struct RawMode {
    saved: Option<String>,
}

impl RawMode {
    fn enter() -> RawMode {
        if !std::io::stdin().is_terminal() {
            return RawMode { saved: None };
        }
        let saved = stty(&["-g"]).map(|s| s.trim().to_owned());
        if saved.is_some() {
            let _ = stty(&["raw", "-echo"]);
        }
        RawMode { saved }
    }

    /// (columns, rows) of our terminal.
    fn size(&self) -> Option<(u32, u32)> {
        self.saved.as_ref()?;
        let size = stty(&["size"])?;
        let mut parts = size.split_whitespace();
        let rows = parts.next()?.parse().ok()?;
        let cols = parts.next()?.parse().ok()?;
        Some((cols, rows))
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        if let Some(saved) = &self.saved {
            let _ = stty(&[saved]);
        }
    }
}

/// `stty ARGS` on our terminal (stdin), its output.
fn stty(args: &[&str]) -> Option<String> {
    let output = Command::new("stty")
        .args(args)
        .stdin(Stdio::inherit())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).into_owned())
}
