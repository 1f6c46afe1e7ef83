//! Fuzzing of the scheduler's parsers of outside input, on stable Rust (proptest): each target
//! generates valid inputs structurally, checks they are accepted, and checks that mutations of
//! them (and plain garbage) are accepted or refused with a well-formed error, never a panic or
//! a hang.
//!
//! - `catalog`: a curriculum held in memory (`Catalog::from_files`): `curriculum.meta.yaml`,
//!   collections, images, lessons with their stage guides and configs.
//! - `http`: the JSON/HTTP API's request decoding (path, query string, JSON body), through the
//!   real router.
//!
//! By default each property runs 500 to 1,000 inputs, so `cargo test --workspace` (and so
//! `tests/run`) includes them at a cost of seconds. `PROPTEST_CASES=N` runs N inputs per property
//! (`tests/fuzz/run` runs a million in release mode); `PROPTEST_RNG_SEED=S` replays a run. A
//! failure prints the smallest input proptest could shrink it to; every failure found becomes a
//! named regression test beside the target's properties.
#![forbid(unsafe_code)]

mod catalog;
mod http;

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fmt::Debug;
use std::time::Instant;

use proptest::strategy::Strategy;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

/// Runs `property` on `default_cases` inputs drawn from `strategy` (or `$PROPTEST_CASES`
/// inputs), then prints how many ran, how long they took and how many ended in each outcome
/// the property named; panics with the smallest failing input if the property failed.
pub fn fuzz<S>(
    name: &str,
    default_cases: u32,
    strategy: S,
    property: impl Fn(S::Value) -> Result<&'static str, TestCaseError>,
) where
    S: Strategy,
    S::Value: Debug,
{
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|cases| cases.parse().ok())
        .unwrap_or(default_cases);
    let config = Config {
        cases,
        // Failures become named regression tests, not files the runner replays.
        failure_persistence: None,
        // Shrinking a failure of a million-input run must end too.
        max_shrink_time: 120_000,
        ..Config::default()
    };
    let outcomes: RefCell<BTreeMap<&'static str, u64>> = RefCell::default();
    let started = Instant::now();
    let result = TestRunner::new(config).run(&strategy, |input| {
        let outcome = property(input)?;
        *outcomes.borrow_mut().entry(outcome).or_default() += 1;
        Ok(())
    });
    eprintln!(
        "fuzz {name}: {cases} inputs in {:.1?}: {:?}",
        started.elapsed(),
        outcomes.borrow()
    );
    if let Err(failure) = result {
        panic!("fuzz {name}: {failure}");
    }
}
