//! Per-client bounds on what the public listeners hold open: connections per client address
//! and Watch streams per session and per address. One global cap would let an attacker fill it
//! and lock everyone else out; per-key caps keep each client to its share.
//!
//! A [`Quota`] (`antidote_net::accept`'s, which the agents' entrypoint uses too) counts
//! holders per key (a client network, or a session id); [`Quota::take`] hands out a permit that
//! gives its place back when dropped, however the connection or stream ends. [`Limited`] is a
//! connection holding its network's place, with the first-byte guard.

use std::collections::HashMap;
use std::sync::Mutex;

pub use antidote_net::accept::{Limited, Quota};

/// How many refusals of unauthenticated admin calls the audit log records per client network
/// per minute, and from all networks together; beyond, a refusal is only logged (a stranger
/// who reaches the admin port cannot grow the database at will).
pub const AUDITED_REFUSALS: (u32, u32) = (10, 600);

/// The window of [`AUDITED_REFUSALS`].
const REFUSAL_WINDOW: std::time::Duration = std::time::Duration::from_secs(60);

/// Networks remembered at most; a new one beyond them is not audited in this window.
const REFUSAL_NETWORKS: usize = 10_000;

/// Counts unauthenticated admin refusals per client network and minute (see
/// [`AUDITED_REFUSALS`]).
#[derive(Debug, Default)]
pub struct Refusals {
    /// Network (`""`: all of them) → its window's start and count.
    seen: Mutex<HashMap<String, (std::time::Instant, u32)>>,
}

impl Refusals {
    /// Counts a refusal from `network` at `now`; whether it is still within the budget, and so
    /// audited.
    pub fn audit(&self, network: String, now: std::time::Instant) -> bool {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        if seen.len() > REFUSAL_NETWORKS {
            seen.retain(|_, (since, _)| now.duration_since(*since) < REFUSAL_WINDOW);
        }
        let count = |key: String, max: u32, seen: &mut HashMap<_, _>| {
            if seen.len() > REFUSAL_NETWORKS && !seen.contains_key(&key) {
                return false;
            }
            let entry: &mut (std::time::Instant, u32) = seen.entry(key).or_insert((now, 0));
            if now.duration_since(entry.0) >= REFUSAL_WINDOW {
                *entry = (now, 0);
            }
            entry.1 = entry.1.saturating_add(1);
            entry.1 <= max
        };
        let (per_network, overall) = AUDITED_REFUSALS;
        count(network, per_network, &mut seen) && count(String::new(), overall, &mut seen)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_audited_a_few_per_network_and_minute() {
        let refusals = Refusals::default();
        let start = std::time::Instant::now();
        let (per_network, overall) = AUDITED_REFUSALS;
        let audited = (0..3 * per_network)
            .filter(|_| refusals.audit("10.0.0.1".into(), start))
            .count();
        assert_eq!(audited, per_network as usize);
        assert!(
            refusals.audit("10.0.0.2".into(), start),
            "another network has its own"
        );
        let later = start + REFUSAL_WINDOW;
        assert!(
            refusals.audit("10.0.0.1".into(), later),
            "a new minute, a new budget"
        );
        // All networks together: at most `overall` a minute.
        let many = (0..2 * overall)
            .filter(|n| refusals.audit(format!("10.1.{}.{}", n / 250, n % 250), later))
            .count();
        assert!(many < overall as usize, "{many} audited in one minute");
    }
}
