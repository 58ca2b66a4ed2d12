//! How many instances the host records per provider, and how many starts are
//! under way: a provider's `max-records` is checked before its start runs, in
//! constant time. Counted once when the store opens (the id index is made by
//! the same scan), then kept with the commits that add or remove records.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Records and starts under way, per provider.
#[derive(Debug, Default)]
pub struct RecordCounts {
    counts: Mutex<HashMap<String, Count>>,
}

#[derive(Debug, Default, Clone, Copy)]
struct Count {
    recorded: usize,
    starting: usize,
}

/// A start would take a provider past its bound: refused before it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AtBound {
    /// Instances recorded for the provider.
    pub recorded: usize,
    /// Its starts under way.
    pub starting: usize,
}

/// A start under way, counted toward its provider's bound until it is dropped
/// (by then its record is counted, if it made one).
#[derive(Debug)]
pub struct StartSlot {
    counts: Arc<RecordCounts>,
    provider: String,
    /// Its start recorded its instance: the slot is the record's now.
    taken: bool,
}

impl RecordCounts {
    pub(crate) fn new(recorded: HashMap<String, usize>) -> RecordCounts {
        let counts = recorded.into_iter().map(|(name, recorded)| (name, Count { recorded, starting: 0 })).collect();
        RecordCounts { counts: Mutex::new(counts) }
    }

    fn counts(&self) -> std::sync::MutexGuard<'_, HashMap<String, Count>> {
        self.counts.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Instances recorded for `provider`.
    pub fn recorded(&self, provider: &str) -> usize {
        self.counts().get(provider).map_or(0, |count| count.recorded)
    }

    /// A commit added (or removed, if negative) `change` records of `provider`.
    pub(crate) fn committed(&self, provider: &str, change: isize) {
        if change == 0 {
            return;
        }
        let mut counts = self.counts();
        let count = counts.entry(provider.to_owned()).or_default();
        count.recorded = count.recorded.saturating_add_signed(change);
        if count.recorded == 0 && count.starting == 0 {
            counts.remove(provider);
        }
    }

    /// A slot for one more start of `provider`, unless its records and the
    /// starts under way already reach `bound`.
    pub fn reserve(self: &Arc<Self>, provider: &str, bound: usize) -> Result<StartSlot, AtBound> {
        let mut counts = self.counts();
        let count = counts.entry(provider.to_owned()).or_default();
        if count.recorded.saturating_add(count.starting) >= bound {
            let refused = AtBound { recorded: count.recorded, starting: count.starting };
            if count.recorded == 0 && count.starting == 0 {
                counts.remove(provider);
            }
            return Err(refused);
        }
        count.starting += 1;
        Ok(StartSlot { counts: self.clone(), provider: provider.to_owned(), taken: false })
    }
}

impl StartSlot {
    /// Its start's record committed (`added` records, 0 or 1): counted as
    /// recorded and no longer as starting, in one step.
    pub(crate) fn recorded(mut self, added: isize) {
        let mut counts = self.counts.counts();
        if let Some(count) = counts.get_mut(&self.provider) {
            count.starting = count.starting.saturating_sub(1);
            count.recorded = count.recorded.saturating_add_signed(added);
        }
        self.taken = true;
    }
}

impl Drop for StartSlot {
    fn drop(&mut self) {
        if self.taken {
            return;
        }
        let mut counts = self.counts.counts();
        if let Some(count) = counts.get_mut(&self.provider) {
            count.starting = count.starting.saturating_sub(1);
            if count.recorded == 0 && count.starting == 0 {
                counts.remove(&self.provider);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_under_way_count_toward_the_bound_until_they_end() {
        let counts = Arc::new(RecordCounts::new(HashMap::from([("p".to_owned(), 2)])));
        let first = counts.reserve("p", 4).unwrap();
        let _second = counts.reserve("p", 4).unwrap();
        assert_eq!(counts.reserve("p", 4).unwrap_err(), AtBound { recorded: 2, starting: 2 });
        // The first start recorded its instance: its slot is the record's, still at the bound.
        first.recorded(1);
        assert_eq!(counts.reserve("p", 4).unwrap_err(), AtBound { recorded: 3, starting: 1 });
        counts.committed("p", -2);
        assert_eq!(counts.recorded("p"), 1);
        assert!(counts.reserve("p", 4).is_ok());
        assert_eq!(counts.recorded("other"), 0);
        assert!(counts.reserve("other", 0).is_err(), "a bound of 0 takes nothing");
        assert!(counts.counts().get("other").is_none(), "a refused provider leaves no entry");
    }
}
