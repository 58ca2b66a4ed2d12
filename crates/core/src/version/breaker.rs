//! Crash policy: a provider version that traps, overruns its deadline or hits
//! a limit `failures` times within `window` goes half-open. Before it serves
//! again it must pass an `all-instances` re-observe; until then its calls are
//! refused as unavailable, without running guest code that is failing. One
//! re-observe runs at a time: the calls that waited for it share its verdict.

use super::method_stats::Outcome;
use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Debug)]
pub(crate) struct Breaker {
    failures: usize,
    window: Duration,
    state: Mutex<State>,
    /// Held while a re-observe runs; holds the last one that failed.
    probe: tokio::sync::Mutex<Option<FailedProbe>>,
}

#[derive(Debug)]
struct FailedProbe {
    finished: Instant,
    reason: String,
}

#[derive(Debug, Default)]
struct State {
    recent: VecDeque<Instant>,
    half_open: bool,
    trips: u64,
}

impl Breaker {
    /// `failures == 0` turns the breaker off.
    pub(crate) fn new(failures: usize, window: Duration) -> Breaker {
        Breaker { failures, window, state: Mutex::default(), probe: Default::default() }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Count a call's outcome; true if this failure tripped the breaker.
    pub(crate) fn record(&self, outcome: Outcome, now: Instant) -> bool {
        if self.failures == 0 || !matches!(outcome, Outcome::Trap | Outcome::Deadline | Outcome::Limit) {
            return false;
        }
        let mut state = self.state();
        state.recent.push_back(now);
        while state.recent.front().is_some_and(|t| now.duration_since(*t) > self.window) {
            state.recent.pop_front();
        }
        if state.recent.len() >= self.failures && !state.half_open {
            state.half_open = true;
            state.trips += 1;
            return true;
        }
        false
    }

    pub(crate) fn is_half_open(&self) -> bool {
        self.state().half_open
    }

    /// Before a call on a half-open breaker: run `probe` (the re-observe) unless
    /// one is running, in which case wait for it and take its verdict. `Ok` if
    /// the breaker is closed afterwards; otherwise the failed probe's reason.
    pub(crate) async fn reobserve<F, Fut>(&self, probe: F) -> Result<(), String>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<(), String>>,
    {
        let arrived = Instant::now();
        let mut last_failed = self.probe.lock().await;
        if !self.is_half_open() {
            return Ok(());
        }
        if let Some(failed) = last_failed.as_ref()
            && failed.finished >= arrived
        {
            return Err(failed.reason.clone());
        }
        match probe().await {
            Ok(()) => {
                self.close();
                *last_failed = None;
                Ok(())
            }
            Err(reason) => {
                *last_failed = Some(FailedProbe { finished: Instant::now(), reason: reason.clone() });
                Err(reason)
            }
        }
    }

    /// The re-observe passed: serve again, with a clean slate.
    pub(crate) fn close(&self) {
        let mut state = self.state();
        state.half_open = false;
        state.recent.clear();
    }

    /// How often it went half-open.
    pub(crate) fn trips(&self) -> u64 {
        self.state().trips
    }

    pub(crate) fn describe(&self) -> String {
        format!("{} traps, deadline overruns or limits within {:?}", self.failures, self.window)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trips_on_failures_within_the_window_only() {
        let breaker = Breaker::new(3, Duration::from_secs(10));
        let t0 = Instant::now();
        assert!(!breaker.record(Outcome::Trap, t0));
        assert!(!breaker.record(Outcome::Error, t0), "a typed error is an answer, not a crash");
        assert!(!breaker.record(Outcome::Deadline, t0 + Duration::from_secs(1)));
        // The first failure has left the window by now.
        assert!(!breaker.record(Outcome::Limit, t0 + Duration::from_secs(11)));
        assert!(!breaker.is_half_open());
        // At 11 s: the failures at 1 s and 11 s are within the window, and this third one trips it.
        assert!(breaker.record(Outcome::Trap, t0 + Duration::from_secs(11)));
        assert!(breaker.is_half_open());
        assert!(!breaker.record(Outcome::Trap, t0 + Duration::from_secs(12)), "trips once");
        breaker.close();
        assert!(!breaker.is_half_open());
        assert_eq!(breaker.trips(), 1);
        let off = Breaker::new(0, Duration::from_secs(10));
        assert!((0..10).all(|_| !off.record(Outcome::Trap, t0)));
    }

    #[tokio::test]
    async fn one_reobserve_at_a_time_and_those_who_waited_share_its_verdict() {
        use std::sync::atomic::{AtomicU32, Ordering};
        let breaker = std::sync::Arc::new(Breaker::new(1, Duration::from_secs(60)));
        assert!(breaker.record(Outcome::Trap, Instant::now()));
        let probes = std::sync::Arc::new(AtomicU32::new(0));
        let failing = |breaker: std::sync::Arc<Breaker>, probes: std::sync::Arc<AtomicU32>| async move {
            breaker
                .reobserve(|| async {
                    probes.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    Err("still trapping".to_owned())
                })
                .await
        };
        let waiting: Vec<_> = (0..5).map(|_| tokio::spawn(failing(breaker.clone(), probes.clone()))).collect();
        for call in waiting {
            assert_eq!(call.await.unwrap(), Err("still trapping".to_owned()));
        }
        assert_eq!(probes.load(Ordering::SeqCst), 1, "five calls at once, one re-observe");
        // A call that comes after that verdict runs its own; once one passes, the rest serve.
        assert!(failing(breaker.clone(), probes.clone()).await.is_err());
        assert_eq!(probes.load(Ordering::SeqCst), 2);
        assert_eq!(breaker.reobserve(|| async { Ok(()) }).await, Ok(()));
        assert!(!breaker.is_half_open());
        assert_eq!(breaker.reobserve(|| async { Err("not run".to_owned()) }).await, Ok(()), "closed: no probe");
    }
}
