//! How much work this process's store asked of its database: write transactions (one per
//! batch, SQLite's writer and PostgreSQL's alike, and one per write made apart from batches),
//! the write jobs they carried (each in a savepoint of its batch), and reads that reached a
//! database connection (what a cache answered is not one). Counted from the store's open, for
//! `/metrics` (`antidote_store_*_total`) and the benchmarks' per-lifecycle figures; with
//! replicas, each counts its own.

use std::sync::atomic::{AtomicU64, Ordering};

/// The counters, shared by the store's clones and its writer tasks.
#[derive(Debug, Default)]
pub struct Traffic {
    transactions: AtomicU64,
    write_jobs: AtomicU64,
    reads: AtomicU64,
}

/// The counters at one instant.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TrafficCounts {
    /// Write transactions begun.
    pub transactions: u64,
    /// Write jobs run in them.
    pub write_jobs: u64,
    /// Queries on a reading connection.
    pub reads: u64,
}

impl Traffic {
    /// A transaction began, carrying `jobs` write jobs.
    pub(super) fn began(&self, jobs: usize) {
        self.transactions.fetch_add(1, Ordering::Relaxed);
        self.write_jobs.fetch_add(jobs as u64, Ordering::Relaxed);
    }

    /// A query went to a reading connection.
    pub(super) fn read(&self) {
        self.reads.fetch_add(1, Ordering::Relaxed);
    }

    /// The counters now.
    pub fn counts(&self) -> TrafficCounts {
        TrafficCounts {
            transactions: self.transactions.load(Ordering::Relaxed),
            write_jobs: self.write_jobs.load(Ordering::Relaxed),
            reads: self.reads.load(Ordering::Relaxed),
        }
    }
}
