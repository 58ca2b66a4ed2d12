//! The bounds on what a provider can grow outside its guest's linear memory
//! (the `[limits]` a manifest sets, and the host's fixed cuts), the ones all
//! its stores share (its log rate), and how often each one refused or cut
//! something: counted per provider version, shown in `/metrics` as
//! `broker_quota_refusals_total{…,quota="…"}`.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// One bound, named as `[limits]` names it (or, for fixed cuts, as the
/// metrics do).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quota {
    /// `call-data-mib`: data handed to the host in one host call or answer.
    CallData,
    /// `max-records`: instances in one `all-instances` answer.
    Records,
    /// Status `data` beyond the host's fixed cut (entries and bytes).
    StatusData,
    /// `log-lines-per-second`: lines over the provider's rate, suppressed.
    LogLines,
    /// `max-concurrent-calls`: calls refused as busy after `queue-wait`.
    Concurrency,
    /// `kv-keys`: kv changes refused, the namespace at its keys.
    KvKeys,
    /// `kv-mib`: kv changes refused, the namespace at its bytes.
    KvBytes,
}

impl Quota {
    /// Every bound, in the order the metrics list them.
    pub const ALL: [Quota; 7] = [
        Quota::CallData,
        Quota::Records,
        Quota::StatusData,
        Quota::LogLines,
        Quota::Concurrency,
        Quota::KvKeys,
        Quota::KvBytes,
    ];

    /// Its name: the `[limits]` key, or the cut's.
    pub fn name(self) -> &'static str {
        match self {
            Quota::CallData => "call-data-mib",
            Quota::Records => "max-records",
            Quota::StatusData => "status-data",
            Quota::LogLines => "log-lines-per-second",
            Quota::Concurrency => "max-concurrent-calls",
            Quota::KvKeys => "kv-keys",
            Quota::KvBytes => "kv-mib",
        }
    }

    fn index(self) -> usize {
        Quota::ALL.iter().position(|q| *q == self).unwrap_or(0)
    }
}

/// `[limits]`' default `kv-keys`.
pub const DEFAULT_KV_KEYS: usize = 100_000;
/// `[limits]`' default `kv-mib`.
pub const DEFAULT_KV_MIB: u64 = 64;
/// `[limits]`' default `log-lines-per-second`.
pub const DEFAULT_LOG_LINES_PER_SECOND: u32 = 100;

/// What one namespace may hold (`kv-keys`, `kv-mib`): keys and bytes (keys
/// and values together). A change that would grow the namespace past either
/// is refused; one that shrinks it never is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvQuota {
    /// Most keys.
    pub keys: usize,
    /// Most bytes, keys and values together.
    pub bytes: usize,
}

impl KvQuota {
    /// No bound: for the host's own writes (tools, tests), never a guest's.
    pub const UNBOUNDED: KvQuota = KvQuota { keys: usize::MAX, bytes: usize::MAX };
}

/// One provider version's shared bounds and what they refused.
#[derive(Debug)]
pub struct Quotas {
    refused: [AtomicU64; Quota::ALL.len()],
    log_lines: LogRate,
    kv: KvQuota,
}

impl Default for Quotas {
    /// The default `[limits]`' bounds.
    fn default() -> Self {
        let kv = KvQuota { keys: DEFAULT_KV_KEYS, bytes: (DEFAULT_KV_MIB << 20) as usize };
        Quotas::new(kv, DEFAULT_LOG_LINES_PER_SECOND)
    }
}

impl Quotas {
    /// A kv namespace held to `kv`, a log of at most `log_lines_per_second`.
    pub fn new(kv: KvQuota, log_lines_per_second: u32) -> Self {
        Quotas { refused: Default::default(), log_lines: LogRate::new(log_lines_per_second), kv }
    }

    /// What the provider's kv namespace may hold.
    pub fn kv(&self) -> KvQuota {
        self.kv
    }

    /// Count `n` refusals (or cut items, or suppressed lines) of `quota`.
    pub fn refused(&self, quota: Quota, n: u64) {
        self.refused[quota.index()].fetch_add(n, Ordering::Relaxed);
    }

    /// The count of `quota` so far.
    pub fn count(&self, quota: Quota) -> u64 {
        self.refused[quota.index()].load(Ordering::Relaxed)
    }

    /// Whether one more line of `provider`'s (its `log` calls, its stdout
    /// and stderr, the host's warnings about it) may be written now. A
    /// suppressed one is counted; how many were suppressed is said, once,
    /// before the next line that passes.
    pub(crate) fn log_line_allowed(&self, provider: &str) -> bool {
        match self.log_lines.admit(Instant::now()) {
            Admit::Suppress => {
                self.refused(Quota::LogLines, 1);
                false
            }
            Admit::Write { suppressed: 0 } => true,
            Admit::Write { suppressed } => {
                tracing::warn!(
                    provider,
                    suppressed,
                    limit = Quota::LogLines.name(),
                    "suppressed {suppressed} guest log lines over the provider's log-lines-per-second"
                );
                true
            }
        }
    }

    /// Every bound with its count.
    pub fn iter(&self) -> impl Iterator<Item = (Quota, u64)> + '_ {
        Quota::ALL.into_iter().map(|q| (q, self.count(q)))
    }
}

/// Seconds of lines a provider may write at once, over its rate.
const BURST_SECONDS: f64 = 10.0;

/// A log rate: a token bucket.
#[derive(Debug)]
struct LogRate {
    per_second: f64,
    bucket: Mutex<Bucket>,
}

#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
    suppressed: u64,
}

/// Whether a line may be written.
#[derive(Debug, PartialEq, Eq)]
enum Admit {
    /// Write it; `suppressed` lines were dropped since the last one written.
    Write {
        /// Lines dropped before this one.
        suppressed: u64,
    },
    /// Over the rate: drop it.
    Suppress,
}

impl LogRate {
    /// `per_second` lines a second, a burst of ten seconds' worth.
    fn new(per_second: u32) -> Self {
        let per_second = f64::from(per_second);
        let bucket = Bucket { tokens: per_second * BURST_SECONDS, at: Instant::now(), suppressed: 0 };
        LogRate { per_second, bucket: Mutex::new(bucket) }
    }

    /// Take one line's token at `now`.
    fn admit(&self, now: Instant) -> Admit {
        let mut bucket = self.bucket.lock().unwrap_or_else(|p| p.into_inner());
        let refill = now.saturating_duration_since(bucket.at).as_secs_f64() * self.per_second;
        bucket.tokens = (bucket.tokens + refill).min(self.per_second * BURST_SECONDS);
        // `now` was read before the lock: never move the clock back.
        bucket.at = bucket.at.max(now);
        if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            Admit::Write { suppressed: std::mem::take(&mut bucket.suppressed) }
        } else {
            bucket.suppressed += 1;
            Admit::Suppress
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_over_the_rate_are_suppressed_and_said_with_the_next_that_passes() {
        use std::time::Duration;
        let rate = LogRate::new(2);
        let start = Instant::now();
        // The burst: ten seconds' worth at once.
        for _ in 0..20 {
            assert!(matches!(rate.admit(start), Admit::Write { .. }));
        }
        for _ in 0..1000 {
            assert_eq!(rate.admit(start), Admit::Suppress);
        }
        // Half a second later one line's token is back, and it says what was dropped.
        assert_eq!(rate.admit(start + Duration::from_millis(500)), Admit::Write { suppressed: 1000 });
        assert_eq!(rate.admit(start + Duration::from_millis(500)), Admit::Suppress);
        // However long the silence, the burst stays ten seconds' worth.
        let later = start + Duration::from_secs(3600);
        let passed = (0..100).filter(|_| matches!(rate.admit(later), Admit::Write { .. })).count();
        assert_eq!(passed, 20);
    }

    #[test]
    fn each_bound_counts_apart() {
        let counters = Quotas::default();
        counters.refused(Quota::LogLines, 3);
        counters.refused(Quota::Records, 1);
        assert_eq!(counters.count(Quota::LogLines), 3);
        assert_eq!(counters.count(Quota::Records), 1);
        assert_eq!(counters.count(Quota::CallData), 0);
        let names: Vec<_> = counters.iter().map(|(q, _)| q.name()).collect();
        assert_eq!(names.len(), Quota::ALL.len());
        assert!(names.contains(&"call-data-mib"));
    }
}
