//! The SSH side of a fake pod: a real SSH server (russh) on every `ssh-*` container port,
//! admitting the curriculum images' credentials (password authentication) and giving each
//! session a real shell on a pseudo-terminal (util-linux `script` allocates it, so the shell
//! echoes, reads lines and answers `stty size` as on a node's container). The shell runs in an
//! empty directory of its own; the pod's addresses are on loopback, reachable only from this
//! machine.

use std::sync::Arc;

use russh::server::{Auth, Msg, Session};
use russh::{Channel, ChannelId};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpListener;
use tokio::process::ChildStdin;

/// The host key every fake pod presents (`ssh-keygen -t ed25519`): a test node's key, made
/// public here on purpose.
const HOST_KEY: &str = "-----BEGIN OPENSSH PRIVATE KEY-----
b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW
QyNTUxOQAAACBp5GWCH8MilqilmOLTUbbDSz3s4n32JweFCBj1DzeCrQAAAJBO7vRxTu70
cQAAAAtzc2gtZWQyNTUxOQAAACBp5GWCH8MilqilmOLTUbbDSz3s4n32JweFCBj1DzeCrQ
AAAEBStgUVg+EZz/GfgeTMDsrDBqZU++QtTRjGeQaPVKYjJWnkZYIfwyKWqKWY4tNRtsNL
PeziffYnB4UIGPUPN4KtAAAADGZha2Uta3ViZWxldAE=
-----END OPENSSH PRIVATE KEY-----
";

/// Who may log in.
#[derive(Clone)]
pub struct Credentials {
    pub user: String,
    pub password: String,
}

/// Serves SSH on `listener` until it is dropped (the pod is deleted).
pub async fn serve(listener: TcpListener, credentials: Credentials, pod: String) {
    let key = match russh::keys::decode_secret_key(HOST_KEY, None) {
        Ok(key) => key,
        Err(err) => {
            eprintln!("fake-kubelet: host key: {err}");
            return;
        }
    };
    let config = Arc::new(russh::server::Config {
        keys: vec![key],
        auth_rejection_time: std::time::Duration::from_millis(200),
        auth_rejection_time_initial: Some(std::time::Duration::ZERO),
        inactivity_timeout: Some(std::time::Duration::from_secs(600)),
        ..Default::default()
    });
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            return;
        };
        let handler = Pod {
            credentials: credentials.clone(),
            pod: pod.clone(),
            stdin: None,
            shell: false,
        };
        let config = config.clone();
        tokio::spawn(async move {
            match russh::server::run_stream(config, stream, handler).await {
                Ok(running) => {
                    let _ = running.await;
                }
                Err(err) => eprintln!("fake-kubelet: ssh session: {err}"),
            }
        });
    }
}

/// One SSH connection to a fake pod.
struct Pod {
    credentials: Credentials,
    pod: String,
    stdin: Option<ChildStdin>,
    /// A shell was started (one per connection); it ends when its stdin (ours) is dropped.
    shell: bool,
}

impl russh::server::Handler for Pod {
    type Error = russh::Error;

    async fn auth_password(&mut self, user: &str, password: &str) -> Result<Auth, Self::Error> {
        if user == self.credentials.user && password == self.credentials.password {
            Ok(Auth::Accept)
        } else {
            Ok(Auth::reject())
        }
    }

    async fn channel_open_session(
        &mut self,
        _channel: Channel<Msg>,
        reply: russh::server::ChannelOpenHandle,
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        if !self.shell {
            reply.accept().await;
        } else {
            reply
                .reject(russh::ChannelOpenFailure::AdministrativelyProhibited)
                .await;
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    async fn pty_request(
        &mut self,
        channel: ChannelId,
        _term: &str,
        _cols: u32,
        _rows: u32,
        _pix_width: u32,
        _pix_height: u32,
        _modes: &[(russh::Pty, u32)],
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        session.channel_success(channel)?;
        Ok(())
    }

    async fn shell_request(
        &mut self,
        channel: ChannelId,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        let home = std::env::temp_dir().join(format!("fake-kubelet-{}", self.pod));
        let _ = std::fs::create_dir_all(&home);
        let spawned = tokio::process::Command::new("script")
            .args([
                "--quiet",
                "--flush",
                "--return",
                "--command",
                "sh -i",
                "/dev/null",
            ])
            .current_dir(&home)
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .env("HOME", &home)
            .env("TERM", "xterm-256color")
            .env("PS1", format!("{}$ ", self.pod))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn();
        let mut child = match spawned {
            Ok(child) => child,
            Err(err) => {
                eprintln!("fake-kubelet: cannot start a shell: {err}");
                session.channel_failure(channel)?;
                return Ok(());
            }
        };
        self.stdin = child.stdin.take();
        let mut stdout = child.stdout.take().expect("piped");
        let handle = session.handle();
        self.shell = true;
        session.channel_success(channel)?;
        tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            loop {
                match stdout.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if handle.data(channel, buf[..n].to_vec()).await.is_err() {
                            return;
                        }
                    }
                }
            }
            // The shell's own status (`script --return`), as sshd reports it.
            let status = match child.wait().await {
                Ok(status) => status.code().unwrap_or(255) as u32,
                Err(_) => 255,
            };
            let _ = handle.exit_status_request(channel, status).await;
            let _ = handle.eof(channel).await;
            let _ = handle.close(channel).await;
        });
        Ok(())
    }

    async fn data(
        &mut self,
        _channel: ChannelId,
        data: &[u8],
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        if let Some(stdin) = &mut self.stdin
            && stdin.write_all(data).await.is_err()
        {
            self.stdin = None;
        }
        Ok(())
    }

    async fn channel_eof(
        &mut self,
        _channel: ChannelId,
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        self.stdin = None;
        Ok(())
    }
}
