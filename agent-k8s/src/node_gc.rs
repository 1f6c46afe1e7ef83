//! What a node keeps of a live lesson after its pods are gone, and its removal.
//!
//! Each link of a live lesson is a Linux bridge on the node (`adl` + 12 hex,
//! [`crate::cluster::bridge_name`]) and a host-local address pool (the directory
//! `<networks dir>/antidote-<live lesson id>-<index>`), both made by the CNI plugins when the
//! first pod of the link starts. The bridge plugin never removes a bridge, and host-local keeps a
//! pool's directory after its last address is released: a node would gather one bridge and one
//! directory per link of every lesson it ever ran. `agent-k8s-node-gc` runs on every node (a
//! DaemonSet, `deploy/k8s/node-gc`) and sweeps them:
//!
//! - a lesson bridge with no port (no pod's interface on it) in two sweeps in a row is deleted:
//!   one sweep's worth of grace covers a pod that is being set up, whose bridge the plugin has
//!   made but not yet joined;
//! - a lesson pool directory is deleted when its link's bridge is gone and it holds no address
//!   (only host-local's `lock` and `last_reserved_ip.*` files) in two sweeps in a row, under the
//!   pool's own lock, as host-local takes it.
//!
//! Nothing else on the node is touched: only bridges whose names [`is_lesson_bridge`] and
//! directories whose names [`pool_link`] recognise.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use rtnetlink::packet_route::link::{InfoKind, LinkAttribute, LinkInfo, LinkMessage};

use crate::cluster::{BRIDGE_PREFIX, bridge_name};

/// Whether `name` is a lesson bridge's: [`BRIDGE_PREFIX`] and 12 lowercase hex digits.
pub fn is_lesson_bridge(name: &str) -> bool {
    name.strip_prefix(BRIDGE_PREFIX).is_some_and(|hex| {
        hex.len() == 12
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

/// The link a host-local pool directory belongs to: `antidote-<live lesson id>-<index>` gives
/// the name of that link's bridge. `None` for every other directory.
pub fn pool_link(directory: &str) -> Option<String> {
    let rest = directory.strip_prefix("antidote-")?;
    let (id, index) = rest.rsplit_once('-')?;
    let index: usize = index.parse().ok()?;
    // Live lesson ids are UUIDs in their hyphenated lowercase form.
    let uuid = id.len() == 36
        && id.bytes().enumerate().all(|(i, b)| match i {
            8 | 13 | 18 | 23 => b == b'-',
            _ => b.is_ascii_digit() || (b'a'..=b'f').contains(&b),
        });
    uuid.then(|| bridge_name(id, index))
}

/// A bridge as one sweep saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bridge {
    pub name: String,
    pub index: u32,
    /// Interfaces attached to it (veths of pods).
    pub ports: usize,
}

/// What one sweep decided.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Verdict {
    /// Bridges empty in this sweep and the one before: to delete.
    pub delete: Vec<Bridge>,
    /// Bridges empty for the first time: kept, and deleted next sweep if still empty.
    pub empty: BTreeSet<String>,
}

/// The sweep's decision over the node's lesson bridges, given the names found empty by the
/// sweep before.
pub fn judge_bridges(bridges: &[Bridge], empty_before: &BTreeSet<String>) -> Verdict {
    let mut verdict = Verdict::default();
    for bridge in bridges.iter().filter(|b| is_lesson_bridge(&b.name)) {
        if bridge.ports > 0 {
            continue;
        }
        if empty_before.contains(&bridge.name) {
            verdict.delete.push(bridge.clone());
        } else {
            verdict.empty.insert(bridge.name.clone());
        }
    }
    verdict
}

/// Whether a host-local pool directory's entries hold an address: host-local writes one file
/// per address it hands out, named by the address (beside `lock` and `last_reserved_ip.N`).
pub fn holds_addresses<'a>(entries: impl IntoIterator<Item = &'a str>) -> bool {
    entries
        .into_iter()
        .any(|name| name.parse::<std::net::IpAddr>().is_ok())
}

/// The bridges among a link dump (every link of the node): name, index and port count.
pub fn bridges_of(links: &[LinkMessage]) -> Vec<Bridge> {
    let mut ports: BTreeMap<u32, usize> = BTreeMap::new();
    let mut bridges = Vec::new();
    for link in links {
        let mut name = None;
        let mut bridge = false;
        for attribute in &link.attributes {
            match attribute {
                LinkAttribute::IfName(n) => name = Some(n.clone()),
                LinkAttribute::Controller(master) => *ports.entry(*master).or_default() += 1,
                LinkAttribute::LinkInfo(infos) => {
                    bridge |= infos
                        .iter()
                        .any(|info| matches!(info, LinkInfo::Kind(InfoKind::Bridge)));
                }
                _ => {}
            }
        }
        if let (true, Some(name)) = (bridge, name) {
            bridges.push(Bridge {
                name,
                index: link.header.index,
                ports: 0,
            });
        }
    }
    for bridge in &mut bridges {
        bridge.ports = ports.get(&bridge.index).copied().unwrap_or(0);
    }
    bridges
}

/// What one sweep removed.
#[derive(Debug, Default)]
pub struct Swept {
    pub bridges: Vec<String>,
    pub pools: Vec<PathBuf>,
}

/// The sweeper of one node: remembers what the last sweep found empty.
pub struct Sweeper {
    networks: PathBuf,
    empty_bridges: BTreeSet<String>,
    idle_pools: BTreeSet<PathBuf>,
}

impl Sweeper {
    /// A sweeper of the bridges of this network namespace and the pools under `networks`
    /// (host-local's data directory, `/var/lib/cni/networks` unless a network configures
    /// another).
    pub fn new(networks: impl Into<PathBuf>) -> Sweeper {
        Sweeper {
            networks: networks.into(),
            empty_bridges: BTreeSet::new(),
            idle_pools: BTreeSet::new(),
        }
    }

    /// One sweep: deletes the bridges and pools idle since the sweep before.
    pub async fn sweep(&mut self, netlink: &rtnetlink::Handle) -> anyhow::Result<Swept> {
        use futures::TryStreamExt as _;
        let links: Vec<LinkMessage> = netlink.link().get().execute().try_collect().await?;
        let bridges = bridges_of(&links);
        let verdict = judge_bridges(&bridges, &self.empty_bridges);
        let mut swept = Swept::default();
        for bridge in verdict.delete {
            match netlink.link().del(bridge.index).execute().await {
                Ok(()) => swept.bridges.push(bridge.name),
                // Gone meanwhile (or replaced: the index is not the name's any more).
                Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -ENODEV => {}
                Err(err) => tracing::warn!(bridge = %bridge.name, %err, "cannot delete"),
            }
        }
        self.empty_bridges = verdict.empty;

        let present: BTreeSet<&str> = bridges
            .iter()
            .map(|b| b.name.as_str())
            .filter(|name| !swept.bridges.iter().any(|gone| gone == name))
            .collect();
        let mut idle = BTreeSet::new();
        for (path, bridge) in self.pools()? {
            if present.contains(bridge.as_str()) {
                continue;
            }
            if !self.idle_pools.contains(&path) {
                if !pool_holds_addresses(&path)? {
                    idle.insert(path);
                }
                continue;
            }
            match remove_pool(&path) {
                Ok(true) => swept.pools.push(path),
                Ok(false) => {}
                Err(err) => tracing::warn!(pool = %path.display(), %err, "cannot remove"),
            }
        }
        self.idle_pools = idle;
        Ok(swept)
    }

    /// The lesson pools under the networks directory, with their links' bridge names.
    fn pools(&self) -> std::io::Result<Vec<(PathBuf, String)>> {
        let entries = match std::fs::read_dir(&self.networks) {
            Ok(entries) => entries,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(err) => return Err(err),
        };
        let mut pools = Vec::new();
        for entry in entries {
            let entry = entry?;
            let Some(bridge) = entry.file_name().to_str().and_then(pool_link) else {
                continue;
            };
            if entry.file_type()?.is_dir() {
                pools.push((entry.path(), bridge));
            }
        }
        Ok(pools)
    }
}

/// `ENODEV`, what the kernel answers for a link index that no longer exists.
const ENODEV: i32 = 19;

fn names(dir: &Path) -> std::io::Result<Vec<String>> {
    std::fs::read_dir(dir)?
        .map(|entry| Ok(entry?.file_name().to_string_lossy().into_owned()))
        .collect()
}

fn pool_holds_addresses(dir: &Path) -> std::io::Result<bool> {
    match names(dir) {
        Ok(names) => Ok(holds_addresses(names.iter().map(String::as_str))),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(true),
        Err(err) => Err(err),
    }
}

/// Removes a pool directory holding no address, under host-local's lock on it (a pod starting
/// on the link now would hold it); `false` when it holds an address again or is gone.
fn remove_pool(dir: &Path) -> std::io::Result<bool> {
    let lock = match std::fs::File::open(dir.join("lock")) {
        Ok(lock) => Some(lock),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => None,
        Err(err) => return Err(err),
    };
    if let Some(lock) = &lock {
        lock.lock()?;
    }
    if pool_holds_addresses(dir)? {
        return Ok(false);
    }
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(true),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(err) => Err(err),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "0b6f3a52-8f0e-4a53-9a3e-4a1d2c3b4e5f";

    fn bridge(name: &str, ports: usize) -> Bridge {
        Bridge {
            name: name.into(),
            index: 7,
            ports,
        }
    }

    #[test]
    fn only_lesson_bridges_are_recognised() {
        assert!(is_lesson_bridge(&bridge_name(ID, 0)));
        for other in [
            "cni0",
            "docker0",
            "adl",
            "adl12345678901",
            "adl1234567890123",
            "adlABCDEF123456",
            "br-424b9714d1c8",
        ] {
            assert!(!is_lesson_bridge(other), "{other}");
        }
    }

    #[test]
    fn a_pool_names_its_links_bridge() {
        assert_eq!(
            pool_link(&format!("antidote-{ID}-2")),
            Some(bridge_name(ID, 2))
        );
        for other in [
            "cbr0",
            "antidote-",
            "antidote-x-1",
            &format!("antidote-{ID}"),
            &format!("antidote-{ID}-x"),
            &format!("k8s-{ID}-1"),
        ] {
            assert_eq!(pool_link(other), None, "{other}");
        }
    }

    #[test]
    fn an_empty_bridge_is_deleted_on_its_second_empty_sweep_only() {
        let empty = bridge(&bridge_name(ID, 0), 0);
        let first = judge_bridges(std::slice::from_ref(&empty), &BTreeSet::new());
        assert!(first.delete.is_empty());
        assert_eq!(first.empty, BTreeSet::from([empty.name.clone()]));
        let second = judge_bridges(std::slice::from_ref(&empty), &first.empty);
        assert_eq!(second.delete, vec![empty]);
        assert!(second.empty.is_empty());
    }

    #[test]
    fn a_bridge_with_a_port_or_not_a_lessons_is_kept() {
        let used = bridge(&bridge_name(ID, 0), 1);
        let docker = bridge("docker0", 0);
        let before = BTreeSet::from([used.name.clone(), docker.name.clone()]);
        let verdict = judge_bridges(&[used, docker], &before);
        assert_eq!(verdict, Verdict::default());
    }

    #[test]
    fn a_pool_holds_addresses_by_its_address_files() {
        assert!(!holds_addresses(["lock", "last_reserved_ip.0"]));
        assert!(holds_addresses(["lock", "10.10.1.2", "last_reserved_ip.0"]));
        assert!(holds_addresses(["fd00::2"]));
    }

    #[test]
    fn a_pool_is_removed_only_without_addresses() {
        let dir = tempfile::tempdir().unwrap();
        let pool = dir.path().join(format!("antidote-{ID}-0"));
        std::fs::create_dir(&pool).unwrap();
        std::fs::write(pool.join("lock"), "").unwrap();
        std::fs::write(pool.join("10.10.1.2"), "container\neth1").unwrap();
        assert!(!remove_pool(&pool).unwrap());
        assert!(pool.exists());
        std::fs::remove_file(pool.join("10.10.1.2")).unwrap();
        std::fs::write(pool.join("last_reserved_ip.0"), "10.10.1.2").unwrap();
        assert!(remove_pool(&pool).unwrap());
        assert!(!pool.exists());
        assert!(!remove_pool(&pool).unwrap());
    }
}
