//! Readiness probes as the protocol defines them: a TCP connect, an SSH banner (a line starting
//! `SSH-`), an HTTP status line in answer to `GET /`.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// What to expect on a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// Any accepted connection.
    Tcp,
    /// A line starting with `SSH-`.
    SshBanner,
    /// An answer to `GET /` starting with `HTTP/`.
    Http,
}

/// One probe with a deadline; `Err` says what was seen instead.
pub async fn probe(address: &str, expect: Expect, timeout: Duration) -> Result<(), String> {
    let attempt = async {
        let mut stream = TcpStream::connect(address)
            .await
            .map_err(|err| format!("connect: {err}"))?;
        if expect == Expect::Tcp {
            return Ok(());
        }
        if expect == Expect::Http {
            stream
                .write_all(b"GET / HTTP/1.0\r\nHost: antidote\r\n\r\n")
                .await
                .map_err(|err| format!("write: {err}"))?;
        }
        let mut buf = [0u8; 64];
        let n = stream
            .read(&mut buf)
            .await
            .map_err(|err| format!("read: {err}"))?;
        let head = &buf[..n];
        let wanted: &[u8] = if expect == Expect::Http {
            b"HTTP/"
        } else {
            b"SSH-"
        };
        if head.starts_with(wanted) {
            Ok(())
        } else if n == 0 {
            Err("connection closed without a greeting".into())
        } else {
            Err(format!(
                "unexpected greeting {:?}",
                String::from_utf8_lossy(head)
                    .chars()
                    .take(40)
                    .collect::<String>()
            ))
        }
    };
    match tokio::time::timeout(timeout, attempt).await {
        Ok(result) => result,
        Err(_) => Err(format!("no answer within {timeout:?}")),
    }
}

/// What a presentation type is probed for.
pub fn expect(kind: i32) -> Expect {
    match antidote_proto::agent::v1::PresentationType::try_from(kind) {
        Ok(antidote_proto::agent::v1::PresentationType::Ssh) => Expect::SshBanner,
        Ok(antidote_proto::agent::v1::PresentationType::Http) => Expect::Http,
        _ => Expect::Tcp,
    }
}

/// Probes until success or `deadline`; returns the last failure on timeout.
pub async fn until_ready(
    address: &str,
    expect: Expect,
    deadline: tokio::time::Instant,
) -> Result<(), String> {
    let mut last = String::from("never probed");
    while tokio::time::Instant::now() < deadline {
        match probe(address, expect, Duration::from_secs(2)).await {
            Ok(()) => return Ok(()),
            Err(err) => last = err,
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Err(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn probes_tell_banners_apart() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            loop {
                let (mut stream, _) = listener.accept().await.unwrap();
                let _ = stream.write_all(b"SSH-2.0-test\r\n").await;
            }
        });
        let second = Duration::from_secs(1);
        assert_eq!(probe(&address, Expect::SshBanner, second).await, Ok(()));
        assert_eq!(probe(&address, Expect::Tcp, second).await, Ok(()));
        let err = probe(&address, Expect::Http, second).await.unwrap_err();
        assert!(err.contains("SSH-2.0"), "{err}");
    }
}
