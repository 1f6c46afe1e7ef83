//! `agent-k8s-node-gc`: removes, on the node it runs on, the lesson bridges and address pools
//! that no pod uses any more (`agent_k8s::node_gc`), every `--interval`, until SIGTERM. Runs in
//! the node's network namespace with CAP_NET_ADMIN and host-local's data directory mounted
//! (deploy/k8s/node-gc); it talks to no API server.

use std::path::PathBuf;
use std::time::Duration;

use agent_k8s::node_gc::Sweeper;
use antidote_sdk as sdk;
use anyhow::Context as _;
use clap::Parser as _;

#[derive(clap::Parser)]
#[command(
    version,
    about = "Removes the lesson bridges and address pools a node no longer uses"
)]
struct Args {
    /// Time between sweeps; a bridge or pool is removed when two sweeps in a row find it unused.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    interval: Duration,
    /// host-local's data directory (where its address pools are).
    #[arg(long, default_value = "/var/lib/cni/networks")]
    cni_networks_dir: PathBuf,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let _telemetry = sdk::trace::init_logging("agent-k8s-node-gc")?;
    let args = Args::parse();
    anyhow::ensure!(
        args.interval >= Duration::from_secs(1),
        "--interval must be at least 1s (it is {:?})",
        args.interval
    );
    let (connection, netlink, _) =
        rtnetlink::new_connection().context("cannot open a netlink socket")?;
    tokio::spawn(connection);
    let mut sweeper = Sweeper::new(&args.cni_networks_dir);
    let mut signal = std::pin::pin!(sdk::shutdown_signal());
    let mut ticks = tokio::time::interval(args.interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tracing::info!(interval = ?args.interval, pools = %args.cni_networks_dir.display(), "sweeping");
    loop {
        tokio::select! {
            () = &mut signal => return Ok(()),
            _ = ticks.tick() => {}
        }
        match sweeper.sweep(&netlink).await {
            Ok(swept) if swept.bridges.is_empty() && swept.pools.is_empty() => {
                tracing::debug!("swept: nothing to remove");
            }
            Ok(swept) => tracing::info!(bridges = ?swept.bridges, pools = ?swept.pools, "removed"),
            // A failed sweep (netlink refused, a directory unreadable) is tried again next time.
            Err(err) => tracing::warn!(%err, "sweep failed"),
        }
    }
}
