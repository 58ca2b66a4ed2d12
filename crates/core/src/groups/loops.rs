//! The convergence loops: one per group while `broker serve` runs, each
//! with its pass lock, its wake-up and what it remembers between passes.

use super::{GroupError, Groups, Pass, lock};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How a member has looked to the rolling update.
#[derive(Debug, Clone, Copy)]
pub(super) struct Health {
    /// Since when it has been listed running, pass after pass.
    pub(super) since: Instant,
    /// On how many passes in a row.
    pub(super) passes: u32,
    /// Whether `maintain-instance` answered for it once it settled (asked once).
    pub(super) answered: bool,
}

/// What a convergence loop remembers between passes (not across restarts:
/// a restarted host waits out a replacement's health again, the safe side).
#[derive(Default)]
pub(super) struct LoopState {
    /// The members listed running, by id.
    pub(super) healthy: HashMap<String, Health>,
    /// When the last rolling-update step destroyed an old member.
    pub(super) step_at: Option<Instant>,
    /// Passes in a row that replaced members lost soon after their start.
    pub(super) failed_passes: u32,
    /// When the last of those passes ran: a failure window without another
    /// ends the row.
    pub(super) last_failed: Option<Instant>,
    /// Set when those passes reached the most: no pass changes anything
    /// until the next commit.
    pub(super) replacing_stopped: bool,
    /// Why the group stopped converging, until the next commit; read by
    /// `describe` without waiting for a pass.
    pub(super) halted: Arc<Mutex<Option<String>>>,
    /// Whether `converged` was announced (once per convergence).
    pub(super) announced: bool,
}

impl LoopState {
    pub(super) fn halted(&self) -> Option<String> {
        lock(&self.halted).clone()
    }
    pub(super) fn halt(&self, why: String) {
        *lock(&self.halted) = Some(why);
    }
    /// A new spec: a fresh start for the update and the failure count.
    pub(super) fn recommitted(&mut self) {
        *lock(&self.halted) = None;
        self.step_at = None;
        self.failed_passes = 0;
        self.last_failed = None;
        self.replacing_stopped = false;
        self.announced = false;
    }
}

/// A group's loop: its pass lock, its wake-up, and what `describe` reads without the lock.
#[derive(Clone)]
pub(super) struct Slot {
    /// One pass at a time; the calls that change members take it too.
    pub(super) state: Arc<tokio::sync::Mutex<LoopState>>,
    pub(super) wake: Arc<tokio::sync::Notify>,
    pub(super) halted: Arc<Mutex<Option<String>>>,
}

impl Default for Slot {
    fn default() -> Self {
        let state = LoopState::default();
        let halted = state.halted.clone();
        Slot { state: Arc::new(tokio::sync::Mutex::new(state)), wake: Arc::default(), halted }
    }
}

#[derive(Default)]
pub(super) struct GroupLoop {
    pub(super) slot: Slot,
    pub(super) running: bool,
    pub(super) task: Option<tokio::task::AbortHandle>,
}

impl Groups {
    fn slot(&self, id: &str) -> Slot {
        lock(&self.loops).entry(id.to_owned()).or_default().slot.clone()
    }

    /// The group's pass lock, held on the slot the map holds (a loop that
    /// ended may have removed the one first looked up: then again). With
    /// `committed`, an id no group has is refused before any slot is made
    /// for it, so a caller cannot fill the map with ids.
    pub(super) async fn locked(
        &self,
        id: &str,
        committed: bool,
    ) -> Result<(Slot, tokio::sync::OwnedMutexGuard<LoopState>), GroupError> {
        loop {
            if committed && self.broker.store().group(id)?.is_none() {
                return Err(GroupError::UnknownGroup(id.to_owned()));
            }
            let slot = self.slot(id);
            let guard = slot.state.clone().lock_owned().await;
            let current = lock(&self.loops).get(id).is_some_and(|entry| Arc::ptr_eq(&entry.slot.state, &slot.state));
            if current {
                return Ok((slot, guard));
            }
        }
    }

    /// Forget `slot` if nothing uses it: no loop, no committed group (a
    /// refused or pretend first commit).
    pub(super) fn drop_idle_slot(&self, id: &str, slot: &Slot) {
        let mut loops = lock(&self.loops);
        let idle = loops.get(id).is_some_and(|entry| !entry.running && Arc::ptr_eq(&entry.slot.state, &slot.state));
        if idle && matches!(self.broker.store().group(id), Ok(None)) {
            Self::remove_unheld(&mut loops, id, slot);
        }
    }

    /// Remove `id`'s entry if it is `slot` and nobody holds its pass lock:
    /// a holder works on, sure that no other pass runs, so its slot stays
    /// until it lets go. One waiting for the lock finds it gone and looks
    /// the slot up again ([`Groups::locked`]). Whether it was removed.
    fn remove_unheld(loops: &mut HashMap<String, GroupLoop>, id: &str, slot: &Slot) -> bool {
        if !loops.get(id).is_some_and(|entry| Arc::ptr_eq(&entry.slot.state, &slot.state)) {
            return false;
        }
        // Held across the removal: the map's lock keeps a new holder from checking it meanwhile.
        let Ok(_unheld) = slot.state.try_lock() else { return false };
        loops.remove(id);
        true
    }

    /// Start a convergence loop for every committed group, and for each
    /// committed from now on. The loops end when the runtime does.
    pub fn start_loops(self: &Arc<Self>) -> Result<(), GroupError> {
        self.serving.store(true, std::sync::atomic::Ordering::SeqCst);
        for (id, _) in self.broker.store().groups()? {
            self.ensure_loop(&id);
        }
        Ok(())
    }

    pub(super) fn ensure_loop(self: &Arc<Self>, id: &str) {
        if !self.converging() {
            return;
        }
        let slot = {
            let mut loops = lock(&self.loops);
            let entry = loops.entry(id.to_owned()).or_default();
            if entry.running {
                entry.slot.wake.notify_one();
                return;
            }
            entry.running = true;
            entry.slot.clone()
        };
        let (groups, group_id, own) = (self.clone(), id.to_owned(), slot.clone());
        let task = tokio::spawn(async move {
            let id = group_id;
            let mut failures = 0u32;
            loop {
                let span = tracing::info_span!("group pass", group = %id);
                let pass = tracing::Instrument::instrument(groups.converge_once(&id), span);
                // A pass that panics is a failed pass: the loop goes on (with
                // its backoff), never leaving the group marked running unconverged.
                let outcome = match futures_util::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(pass)).await {
                    Ok(outcome) => outcome,
                    Err(_) => Err(GroupError::PassPanicked(id.clone())),
                };
                let wait = match outcome {
                    Ok(Pass::Gone) => {
                        // Unless a commit made the group again meanwhile (its
                        // wake-up found this loop running), the loop ends. A
                        // slot in use (a destroy still stopping) stays, and the
                        // next pass waits for it.
                        let mut loops = lock(&groups.loops);
                        let gone = matches!(groups.broker.store().group(&id), Ok(None));
                        if !gone {
                            // Made again, or the store cannot tell: the loop goes on.
                            Duration::ZERO
                        } else if Self::remove_unheld(&mut loops, &id, &slot) {
                            break;
                        } else if loops.get(&id).is_some_and(|entry| Arc::ptr_eq(&entry.slot.state, &slot.state)) {
                            Duration::ZERO
                        } else {
                            // Not this loop's slot any more (never expected): end, leaving it be.
                            break;
                        }
                    }
                    Ok(pass) => {
                        failures = 0;
                        pass.wait(groups.settings.poll)
                    }
                    Err(error) => {
                        // Backoff: never a tight loop against a failing provider.
                        failures = failures.saturating_add(1);
                        let backoff = Duration::from_millis(100u64 << failures.min(10));
                        tracing::warn!(group = %id, error = %broker_capabilities::error_text::error_text(&error), "a group pass failed");
                        backoff.min(groups.settings.poll)
                    }
                };
                tokio::select! {
                    () = slot.wake.notified() => {}
                    () = tokio::time::sleep(wait) => {}
                }
            }
        });
        let mut loops = lock(&self.loops);
        // Loops stopped between the spawn and here: this one too.
        if !self.converging() {
            task.abort();
            return;
        }
        // Only on this loop's own entry: one that ended at once may have been replaced.
        if let Some(entry) = loops.get_mut(id)
            && Arc::ptr_eq(&entry.slot.state, &own.state)
            && !task.is_finished()
        {
            entry.task = Some(task.abort_handle());
        }
    }

    /// End every convergence loop where it stands (the host is going away:
    /// a start cut short is left pending, for the next host to resolve).
    pub fn stop_loops(&self) {
        self.serving.store(false, std::sync::atomic::Ordering::SeqCst);
        let mut loops = lock(&self.loops);
        for slot in loops.values_mut() {
            if let Some(task) = slot.task.take() {
                task.abort();
            }
            slot.running = false;
        }
    }

    /// Wake the group's loop for a pass now.
    pub fn wake(&self, id: &str) {
        if let Some(entry) = lock(&self.loops).get(id) {
            entry.slot.wake.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_is_removed_only_if_it_is_the_ids_own_and_its_pass_lock_is_free() {
        let mut loops = HashMap::from([("g".to_owned(), GroupLoop::default())]);
        let slot = loops["g"].slot.clone();
        assert!(!Groups::remove_unheld(&mut loops, "g", &Slot::default()), "another slot is not removed for it");
        let held = slot.state.try_lock().unwrap();
        assert!(!Groups::remove_unheld(&mut loops, "g", &slot), "a holder keeps its slot");
        assert!(loops.contains_key("g"));
        drop(held);
        assert!(Groups::remove_unheld(&mut loops, "g", &slot));
        assert!(loops.is_empty());
    }
}
