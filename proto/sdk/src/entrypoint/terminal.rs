//! SSH presentations as a web terminal: a WebSocket at `.../terminal` whose far end is an SSH
//! session the entrypoint opens (russh, password authentication with the image's credentials,
//! a PTY and a login shell).
//!
//! The wire, both ways on one WebSocket:
//! - learner → entrypoint: binary frames are keystrokes (raw bytes to the shell); text frames
//!   are JSON: `{"type":"input","data":"ls\r"}` (keystrokes as text) or
//!   `{"type":"resize","cols":120,"rows":40}`.
//! - entrypoint → learner: binary frames are the terminal's output; a text frame
//!   `{"type":"exit","status":0}` when the shell exits, then a close. When the key of the token
//!   that opened the terminal is revoked, a close with code 1008 (policy) and [`WITHDRAWN`]
//!   ends it (a client may reconnect with a fresh token); a key merely retired from the key
//!   set ends nothing.
//!
//! The terminal's first size comes from the `cols` and `rows` query parameters (default
//! 80×24). The SSH session is opened before the upgrade is answered, so a presentation that does
//! not answer or refuses the credentials is an HTTP 502 rather than a WebSocket that closes.
//! The server's host key is not checked: the entrypoint reaches the presentation inside the
//! backend's network, where the agent itself created the endpoint (its host key is made on its
//! first start and known to nobody beforehand).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::{SinkExt as _, StreamExt as _};
use http::{HeaderValue, Request, Response, StatusCode, header};
use http_body_util::{BodyExt as _, Empty};
use hyper_util::rt::TokioIo;
use russh::ChannelMsg;
use russh::client;
use serde::Deserialize;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::protocol::Role;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_util::sync::CancellationToken;

use super::{Activity, Body, Inbound, Permit, Route, reply};

/// How long an SSH connection and login may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);

/// The reason of the close (code 1008, policy) that ends a terminal whose admitting token's key
/// was revoked.
pub const WITHDRAWN: &str = "the key of the token that opened this terminal was revoked";

/// A control message from the learner.
#[derive(Debug, Deserialize, PartialEq, Eq)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Control {
    /// Keystrokes as text.
    Input {
        /// The bytes, UTF-8.
        data: String,
    },
    /// The terminal's new size.
    Resize {
        /// Columns.
        cols: u32,
        /// Rows.
        rows: u32,
    },
}

struct Trusting;

impl client::Handler for Trusting {
    type Error = russh::Error;

    async fn check_server_key(
        &mut self,
        _key: &russh::keys::PublicKeyOrCertificate,
    ) -> Result<bool, Self::Error> {
        // See the module's docs: the endpoint is the agent's own, reached inside its network.
        Ok(true)
    }
}

fn size_from_query(query: Option<&str>) -> (u32, u32) {
    let mut size = (80, 24);
    for pair in query.unwrap_or_default().split('&') {
        match pair.split_once('=') {
            Some(("cols", v)) => size.0 = v.parse().unwrap_or(80).clamp(10, 1000),
            Some(("rows", v)) => size.1 = v.parse().unwrap_or(24).clamp(2, 1000),
            _ => {}
        }
    }
    size
}

/// An SSH session with a shell on a PTY.
async fn login(
    addr: SocketAddr,
    user: &str,
    password: &str,
    (cols, rows): (u32, u32),
) -> Result<(client::Handle<Trusting>, russh::Channel<client::Msg>), String> {
    let config = Arc::new(client::Config {
        keepalive_interval: Some(Duration::from_secs(30)),
        // Keystrokes are single bytes: each goes out at once, never held for Nagle.
        nodelay: true,
        ..Default::default()
    });
    let mut session = client::connect(config, addr, Trusting)
        .await
        .map_err(|err| format!("ssh connection to the presentation failed: {err}"))?;
    let auth = session
        .authenticate_password(user, password)
        .await
        .map_err(|err| format!("ssh authentication failed: {err}"))?;
    if !auth.success() {
        return Err("the presentation refused the image's ssh credentials".into());
    }
    let channel = session
        .channel_open_session()
        .await
        .map_err(|err| format!("ssh session refused: {err}"))?;
    channel
        .request_pty(false, "xterm-256color", cols, rows, 0, 0, &[])
        .await
        .map_err(|err| format!("pty refused: {err}"))?;
    channel
        .request_shell(false)
        .await
        .map_err(|err| format!("shell refused: {err}"))?;
    Ok((session, channel))
}

/// Answers a WebSocket upgrade with a terminal on the SSH presentation at `addr`.
pub(super) async fn open(
    mut request: Request<Inbound>,
    addr: SocketAddr,
    (user, password): (&str, &str),
    route: &Route,
    activity: Arc<Activity>,
    permit: Arc<Permit>,
    withdrawn: CancellationToken,
) -> Response<Body> {
    let headers = request.headers();
    let websocket = headers
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("websocket"));
    let Some(key) = headers.get(header::SEC_WEBSOCKET_KEY).cloned() else {
        return reply(StatusCode::BAD_REQUEST, "a WebSocket upgrade is required");
    };
    if !websocket
        || headers
            .get(header::SEC_WEBSOCKET_VERSION)
            .is_none_or(|v| v != "13")
    {
        return reply(
            StatusCode::BAD_REQUEST,
            "a WebSocket (version 13) upgrade is required",
        );
    }
    let size = size_from_query(request.uri().query());
    let (session, channel) =
        match tokio::time::timeout(CONNECT_TIMEOUT, login(addr, user, password, size)).await {
            Ok(Ok(opened)) => opened,
            Ok(Err(why)) => {
                tracing::info!(%addr, reason = %why, "web terminal not opened");
                return reply(StatusCode::BAD_GATEWAY, &why);
            }
            Err(_) => {
                return reply(
                    StatusCode::GATEWAY_TIMEOUT,
                    "the presentation's ssh server did not answer in time",
                );
            }
        };
    let upgrade = hyper::upgrade::on(&mut request);
    let live_lesson = route.live_lesson.clone();
    tokio::spawn(async move {
        let _permit = permit;
        let upgraded = match upgrade.await {
            Ok(upgraded) => upgraded,
            Err(err) => {
                tracing::debug!(error = %err, "terminal upgrade failed");
                return;
            }
        };
        let ws = WebSocketStream::from_raw_socket(TokioIo::new(upgraded), Role::Server, None).await;
        pump(ws, channel, &activity, &live_lesson, &withdrawn).await;
        let _ = session
            .disconnect(russh::Disconnect::ByApplication, "", "en")
            .await;
    });
    let mut response = Response::new(Empty::new().map_err(|never| match never {}).boxed());
    *response.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let headers = response.headers_mut();
    headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    headers.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    if let Ok(accept) = HeaderValue::from_str(&derive_accept_key(key.as_bytes())) {
        headers.insert(header::SEC_WEBSOCKET_ACCEPT, accept);
    }
    response
}

/// Moves bytes between the WebSocket and the SSH channel until either ends.
async fn pump<S>(
    ws: WebSocketStream<S>,
    channel: russh::Channel<client::Msg>,
    activity: &Activity,
    live_lesson: &str,
    withdrawn: &CancellationToken,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let (mut to_learner, mut from_learner) = ws.split();
    let (mut from_shell, to_shell) = channel.split();
    let mut close = None;
    loop {
        tokio::select! {
            () = withdrawn.cancelled() => {
                tracing::info!(%live_lesson, "web terminal ended: its token's key was revoked");
                close = Some(CloseFrame {
                    code: CloseCode::Policy,
                    reason: WITHDRAWN.into(),
                });
                break;
            }
            message = from_learner.next() => {
                let sent = match message {
                    Some(Ok(Message::Binary(bytes))) => {
                        activity.touch(live_lesson);
                        to_shell.data_bytes(bytes).await
                    }
                    Some(Ok(Message::Text(text))) => match serde_json::from_str::<Control>(&text) {
                        Ok(Control::Input { data }) => {
                            activity.touch(live_lesson);
                            to_shell.data_bytes(data.into_bytes()).await
                        }
                        Ok(Control::Resize { cols, rows }) => {
                            to_shell.window_change(cols.clamp(10, 1000), rows.clamp(2, 1000), 0, 0).await
                        }
                        Err(err) => {
                            tracing::debug!(error = %err, "terminal: unknown control message");
                            Ok(())
                        }
                    },
                    Some(Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_))) => Ok(()),
                    Some(Ok(Message::Close(_)) | Err(_)) | None => break,
                };
                if sent.is_err() {
                    break;
                }
            }
            message = from_shell.wait() => {
                let out = match message {
                    Some(ChannelMsg::Data { data }) | Some(ChannelMsg::ExtendedData { data, .. }) => {
                        Message::Binary(data.to_vec().into())
                    }
                    Some(ChannelMsg::ExitStatus { exit_status }) => Message::Text(
                        serde_json::json!({"type": "exit", "status": exit_status}).to_string().into(),
                    ),
                    // The exit status may follow the end of output; the close ends it.
                    Some(ChannelMsg::Close) | None => break,
                    Some(_) => continue,
                };
                if to_learner.send(out).await.is_err() {
                    break;
                }
            }
        }
    }
    let _ = to_shell.close().await;
    let _ = to_learner.send(Message::Close(close)).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controls() {
        assert_eq!(
            serde_json::from_str::<Control>(r#"{"type":"resize","cols":120,"rows":40}"#).unwrap(),
            Control::Resize {
                cols: 120,
                rows: 40
            }
        );
        assert_eq!(
            serde_json::from_str::<Control>(r#"{"type":"input","data":"ls\r"}"#).unwrap(),
            Control::Input {
                data: "ls\r".into()
            }
        );
        assert!(serde_json::from_str::<Control>(r#"{"type":"nope"}"#).is_err());
        assert_eq!(size_from_query(Some("cols=100&rows=30&x=1")), (100, 30));
        assert_eq!(size_from_query(None), (80, 24));
    }
}
