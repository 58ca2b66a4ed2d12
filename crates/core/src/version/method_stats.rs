//! Per-method outcomes and latency of one loaded provider version, kept as
//! atomics on the call path and read by `/metrics`.

use super::CallError;
use crate::manifest::Method;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the latency histogram, in seconds: from a warm call (µs) to a VM start (minutes).
pub(crate) const BUCKETS_SECONDS: [f64; 12] =
    [0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 300.0];

/// How a call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The provider answered with a result.
    Ok,
    /// The provider answered with a typed error.
    Error,
    /// The guest trapped.
    Trap,
    /// Stopped at its deadline.
    Deadline,
    /// Stopped at a resource limit (memory, call data, records).
    Limit,
    /// No instance to run it on.
    Instantiate,
    /// Refused by the crash policy (half-open).
    Unavailable,
    /// The host's storage failed to make the call's kv changes durable.
    Storage,
    /// Refused: the provider's calls at once were at `max-concurrent-calls`.
    Busy,
}

impl Outcome {
    /// Every outcome, in the order `/metrics` prints them.
    pub const ALL: [Outcome; 9] = [
        Outcome::Ok,
        Outcome::Error,
        Outcome::Trap,
        Outcome::Deadline,
        Outcome::Limit,
        Outcome::Instantiate,
        Outcome::Unavailable,
        Outcome::Storage,
        Outcome::Busy,
    ];

    /// The outcome's label in `/metrics`.
    pub fn name(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Error => "error",
            Outcome::Trap => "trap",
            Outcome::Deadline => "deadline",
            Outcome::Limit => "limit",
            Outcome::Instantiate => "instantiate",
            Outcome::Unavailable => "unavailable",
            Outcome::Storage => "storage",
            Outcome::Busy => "busy",
        }
    }

    pub(crate) fn of<T>(result: &Result<T, CallError>) -> Outcome {
        match result {
            Ok(_) => Outcome::Ok,
            Err(CallError::Guest { .. }) => Outcome::Error,
            Err(CallError::Trap { .. }) => Outcome::Trap,
            Err(CallError::Deadline { .. }) => Outcome::Deadline,
            Err(CallError::Limit { .. }) => Outcome::Limit,
            Err(CallError::Instantiate { .. }) => Outcome::Instantiate,
            Err(CallError::Unavailable { .. }) => Outcome::Unavailable,
            Err(CallError::Storage { .. }) => Outcome::Storage,
            Err(CallError::Busy { .. }) => Outcome::Busy,
        }
    }
}

/// One method's counters.
#[derive(Debug, Default)]
pub struct MethodStats {
    outcomes: [AtomicU64; Outcome::ALL.len()],
    /// Non-cumulative counts per bucket; the last slot is beyond the last bound.
    buckets: [AtomicU64; 13],
    sum_micros: AtomicU64,
}

impl MethodStats {
    pub(crate) fn observe(&self, outcome: Outcome, elapsed: Duration) {
        let index = Outcome::ALL.iter().position(|o| *o == outcome).unwrap_or(0);
        self.outcomes[index].fetch_add(1, Ordering::Relaxed);
        let seconds = elapsed.as_secs_f64();
        let bucket = BUCKETS_SECONDS.iter().position(|bound| seconds <= *bound).unwrap_or(BUCKETS_SECONDS.len());
        self.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        self.sum_micros.fetch_add(elapsed.as_micros() as u64, Ordering::Relaxed);
    }

    /// Calls that ended with `outcome`.
    pub fn outcome(&self, outcome: Outcome) -> u64 {
        let index = Outcome::ALL.iter().position(|o| *o == outcome).unwrap_or(0);
        self.outcomes[index].load(Ordering::Relaxed)
    }

    /// Calls observed.
    pub fn count(&self) -> u64 {
        self.buckets.iter().map(|b| b.load(Ordering::Relaxed)).sum()
    }

    /// Cumulative counts per bound (Prometheus `le`), then the total.
    pub fn cumulative(&self) -> Vec<(f64, u64)> {
        let mut total = 0;
        BUCKETS_SECONDS
            .iter()
            .zip(&self.buckets)
            .map(|(bound, count)| {
                total += count.load(Ordering::Relaxed);
                (*bound, total)
            })
            .collect()
    }

    /// Seconds spent in calls, all told.
    pub fn sum_seconds(&self) -> f64 {
        self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6
    }
}

/// Every method's counters.
#[derive(Debug, Default)]
pub struct MethodTable([MethodStats; 6]);

impl MethodTable {
    /// The counters of `method`.
    pub fn get(&self, method: Method) -> &MethodStats {
        &self.0[Method::ALL.iter().position(|m| *m == method).unwrap_or(0)]
    }

    /// Each method with its counters.
    pub fn iter(&self) -> impl Iterator<Item = (Method, &MethodStats)> {
        Method::ALL.into_iter().zip(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_and_a_cumulative_histogram() {
        let table = MethodTable::default();
        let start = table.get(Method::StartInstance);
        start.observe(Outcome::Ok, Duration::from_micros(50));
        start.observe(Outcome::Ok, Duration::from_millis(3));
        start.observe(Outcome::Deadline, Duration::from_secs(600));
        assert_eq!((start.outcome(Outcome::Ok), start.outcome(Outcome::Deadline), start.count()), (2, 1, 3));
        let cumulative = start.cumulative();
        assert_eq!(cumulative[0], (0.0001, 1));
        assert_eq!(cumulative[3], (0.005, 2));
        assert_eq!(cumulative.last(), Some(&(300.0, 2)), "600 s is only in +Inf");
        assert!((start.sum_seconds() - 600.00305).abs() < 1e-6);
        assert_eq!(table.get(Method::Describe).count(), 0);
        assert_eq!(table.iter().count(), 6);
    }
}
