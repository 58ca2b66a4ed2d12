//! The instance ids this process's starts and stops are working on now: a
//! reconcile running beside them must not report an instance a start has
//! made but not yet recorded as unknown to the host, nor one a stop has
//! ended but not yet forgotten as vanished, nor maintain it.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

/// Ids in flight, per provider, each counted by the calls working on it.
#[derive(Debug, Default)]
pub(crate) struct InFlight {
    ids: Mutex<HashMap<(String, String), usize>>,
}

/// One call's ids in flight (a start's claimed and answered id, a stop's
/// ids): noted as it learns them, all let go when it is dropped.
#[derive(Debug)]
pub(crate) struct CallIds {
    flight: Arc<InFlight>,
    provider: String,
    noted: Mutex<Vec<String>>,
}

impl InFlight {
    fn ids(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), usize>> {
        self.ids.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A call of `provider`'s, with no id noted yet.
    pub(crate) fn call(self: &Arc<Self>, provider: &str) -> CallIds {
        CallIds { flight: self.clone(), provider: provider.to_owned(), noted: Mutex::default() }
    }

    /// `provider`'s ids some call is working on now.
    pub(crate) fn of(&self, provider: &str) -> HashSet<String> {
        self.ids().keys().filter(|(owner, _)| owner == provider).map(|(_, id)| id.clone()).collect()
    }
}

impl CallIds {
    /// The call works on `id` from now until it ends.
    pub(crate) fn note(&self, id: &str) {
        let mut noted = self.noted.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if noted.iter().any(|known| known == id) {
            return;
        }
        noted.push(id.to_owned());
        *self.flight.ids().entry((self.provider.clone(), id.to_owned())).or_default() += 1;
    }
}

impl Drop for CallIds {
    fn drop(&mut self) {
        let noted = std::mem::take(self.noted.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner));
        let mut ids = self.flight.ids();
        for id in noted {
            let key = (self.provider.clone(), id);
            if let Some(calls) = ids.get_mut(&key) {
                *calls -= 1;
                if *calls == 0 {
                    ids.remove(&key);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_is_in_flight_while_any_call_that_noted_it_runs() {
        let flight = Arc::new(InFlight::default());
        let (start, stop) = (flight.call("p"), flight.call("p"));
        start.note("a");
        start.note("a");
        stop.note("a");
        stop.note("b");
        flight.call("q").note("a");
        assert_eq!(flight.of("p"), HashSet::from(["a".to_owned(), "b".to_owned()]));
        drop(stop);
        assert_eq!(flight.of("p"), HashSet::from(["a".to_owned()]));
        drop(start);
        assert!(flight.of("p").is_empty() && flight.of("q").is_empty());
    }
}
