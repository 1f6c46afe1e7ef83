//! `--accept-agent ADDR`: the suite over dial-in. It listens as a scheduler's agent intake
//! would (TLS, a client certificate signed by `--tls-ca` required, and carrying
//! `--tls-server-name` when given), the agent dials it (`--connect https://ADDR`), and every
//! check runs over the connection the agent opened, with the suite as the gRPC client, through
//! the same SDK code the scheduler uses (`sdk::dial`). When the agent restarts (the restart
//! checks) it dials in again and the suite's calls move to the new connection.

use std::time::Duration;

use antidote_sdk::dial::{self, Inbound};
use antidote_sdk::tls::{self, Identity, ServerTls, TlsFiles};
use tokio::net::TcpListener;
use tonic::transport::{Channel, Endpoint};

/// How long a call waits for the agent to dial (in again).
const DIAL_WAIT: Duration = Duration::from_secs(60);

/// Listens on `addr` (printing `intake listening on ADDR` for scripts) and returns a channel
/// over the agent's dialled-in connections, proven by one health check once it dialled in.
pub async fn channel(
    addr: &str,
    files: TlsFiles,
    identity: Option<&str>,
) -> Result<Channel, String> {
    let require = identity
        .map(Identity::parse)
        .transpose()
        .map_err(|err| err.to_string())?;
    let tls = ServerTls::load(files, require).map_err(|err| err.to_string())?;
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|err| format!("cannot listen on {addr}: {err}"))?;
    let local = listener.local_addr().map_err(|err| err.to_string())?;
    println!("intake listening on {local}");
    let inbound = Inbound::default();
    tokio::spawn(accept_loop(listener, tls, inbound.clone()));
    let endpoint = Endpoint::from_static("http://dial-in.invalid").timeout(Duration::from_secs(60));
    let channel = inbound.channel(endpoint, DIAL_WAIT);
    tonic_health::pb::health_client::HealthClient::new(channel.clone())
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await
        .map_err(|status| format!("no agent dialled in to {local} and answered: {status}"))?;
    Ok(channel)
}

/// Accepts connections for the life of the process; a refused one is reported on stderr.
async fn accept_loop(listener: TcpListener, tls: ServerTls, inbound: Inbound) {
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(err) => {
                eprintln!("antidote-conformance: accept failed: {err}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        match dial::accept(&tls, tcp).await {
            Ok((link, leaf)) => {
                let name = tls::peer_identity(&leaf).unwrap_or_else(|| "(no name)".into());
                eprintln!("antidote-conformance: agent {name} dialled in from {peer}");
                inbound.offer(link);
            }
            Err(err) => eprintln!("antidote-conformance: refused a connection from {peer}: {err}"),
        }
    }
}
