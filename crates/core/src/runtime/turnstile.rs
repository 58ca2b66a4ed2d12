//! A fair share of executor time between guests.
//!
//! A guest call runs on the host's tokio workers. A call that is still
//! running after its first slice (one to two epoch ticks) is a long-runner,
//! and from then on it runs wasm only while it holds a **turn**: there are
//! one fewer turns than the executor has workers, so one worker is always
//! left for the host's own work and for short calls, whichever provider
//! spins. At every epoch tick a long-runner gives its turn back and queues
//! for the next one.
//!
//! Turns are taken through the provider's **lane** first, which has as many
//! places as there are turns, so one provider's many long-runners queue in
//! its lane and never fill the turnstile's queue ahead of another provider:
//! two providers' long-runners alternate, however many calls each has.
//!
//! A turn is for running wasm. A long-runner that sits in a host call (a
//! timer, an HTTP request, a child's exit) for more than a tick loses its turn
//! to the sweeper on the epoch thread, and queues for a new one when the host
//! call returns, before it runs wasm again.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Ticks a call runs before it needs a turn (1–2 epoch ticks: the first is partial).
pub(crate) const FIRST_SLICE_TICKS: u64 = 2;

/// The host's turns, and the long-runners holding them.
pub struct Turnstile {
    turns: Arc<Semaphore>,
    count: usize,
    /// How long a long-runner may sit in one host call holding its turn.
    tick: Duration,
    /// Slots that took a turn: what the sweeper looks at (at most a few per turn).
    holders: Mutex<Vec<Weak<Slot>>>,
    /// Stores waiting for a place or a turn: only then is a turn taken from a host call.
    waiting: AtomicUsize,
}

/// Turns for a host whose executor has `workers` threads: one fewer, at least one.
pub(crate) fn turns_for(workers: usize) -> usize {
    workers.saturating_sub(1).max(1)
}

impl Turnstile {
    /// `count` turns (at least one); a turn held in a host call for more than `tick` is taken back.
    pub fn new(count: usize, tick: Duration) -> Arc<Turnstile> {
        let count = count.max(1);
        Arc::new(Turnstile {
            turns: Arc::new(Semaphore::new(count)),
            count,
            tick,
            holders: Mutex::default(),
            waiting: AtomicUsize::new(0),
        })
    }

    /// How many long-runners run wasm at once, at most.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Turns held now.
    pub fn held(&self) -> usize {
        self.count - self.turns.available_permits()
    }

    /// A lane for one provider (version); `taken` counts the turns its guests take.
    pub(crate) fn lane(self: &Arc<Self>, taken: Arc<AtomicU64>) -> Lane {
        Lane { turnstile: self.clone(), places: Arc::new(Semaphore::new(self.count)), taken }
    }

    /// While somebody waits, take the turns of long-runners that have been in
    /// one host call for more than a tick; forget slots that hold none. Run at
    /// every epoch tick.
    pub(crate) fn sweep(&self) {
        let contended = self.waiting.load(Ordering::Relaxed) > 0;
        let mut holders = lock(&self.holders);
        holders.retain(|weak| {
            let Some(slot) = weak.upgrade() else { return false };
            let mut state = lock(&slot.state);
            let idle_in_host = contended && state.in_host_since.is_some_and(|since| since.elapsed() >= self.tick);
            if state.held.is_none() || idle_in_host {
                state.held = None;
                state.registered = false;
                return false;
            }
            true
        });
    }
}

/// One provider's way to the turnstile.
#[derive(Clone)]
pub(crate) struct Lane {
    turnstile: Arc<Turnstile>,
    places: Arc<Semaphore>,
    taken: Arc<AtomicU64>,
}

impl Lane {
    /// Whether the provider already has long-runners holding or waiting for
    /// every place of its lane: then a new call of it starts in the queue, as
    /// its first slice would only take a worker from somebody else.
    pub(crate) fn is_full(&self) -> bool {
        self.places.available_permits() == 0
    }

    /// The turn-keeping of one store.
    pub(crate) fn store_turn(&self) -> StoreTurn {
        StoreTurn { lane: self.clone(), slot: Arc::new(Slot::default()), holding: false }
    }
}

/// A lane's place and a turn, given back together when dropped.
struct Held {
    _place: OwnedSemaphorePermit,
    _turn: OwnedSemaphorePermit,
}

#[derive(Default)]
struct SlotState {
    held: Option<Held>,
    /// Set while a turn holder is in a host call.
    in_host_since: Option<Instant>,
    /// Listed in the turnstile's holders.
    registered: bool,
}

/// What one store shares with the sweeper.
#[derive(Default)]
struct Slot {
    state: Mutex<SlotState>,
}

/// The turn of one store's guest (in its `HostState`). The epoch callback and
/// the call hook drive it; the call's end gives back whatever it holds.
pub(crate) struct StoreTurn {
    lane: Lane,
    slot: Arc<Slot>,
    /// This store holds a turn, or is waiting for one (then the guest is not running).
    holding: bool,
}

/// Waits for a turn; wasmtime resumes the guest when it is done.
pub(crate) type TurnFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

impl StoreTurn {
    /// The guest reached its epoch deadline: give back the turn it holds,
    /// let the executor run others, and wait for the next turn.
    pub(crate) fn next_turn(&mut self) -> TurnFuture {
        self.release();
        self.holding = true;
        let (lane, slot) = (self.lane.clone(), self.slot.clone());
        Box::pin(async move {
            YieldOnce(false).await;
            let waiting = Waiting::new(&lane.turnstile);
            // Neither semaphore is ever closed.
            let Ok(place) = lane.places.clone().acquire_owned().await else { return };
            let Ok(turn) = lane.turnstile.turns.clone().acquire_owned().await else { return };
            drop(waiting);
            lane.taken.fetch_add(1, Ordering::Relaxed);
            let register = {
                let mut state = lock(&slot.state);
                state.held = Some(Held { _place: place, _turn: turn });
                state.in_host_since = None;
                !std::mem::replace(&mut state.registered, true)
            };
            if register {
                lock(&lane.turnstile.holders).push(Arc::downgrade(&slot));
            }
        })
    }

    /// Give back the turn held, if any (the call ended, or the next turn is
    /// due); whether one was held.
    pub(crate) fn release(&mut self) -> bool {
        if !std::mem::take(&mut self.holding) {
            return false;
        }
        let mut state = lock(&self.slot.state);
        state.in_host_since = None;
        state.held.take().is_some()
    }

    /// The guest calls into the host: from now the sweeper may take its turn.
    pub(crate) fn entering_host(&mut self) {
        if self.holding {
            lock(&self.slot.state).in_host_since = Some(Instant::now());
        }
    }

    /// The host call returns: whether its turn was taken meanwhile, so the
    /// guest must queue for one before it runs on.
    pub(crate) fn returning_from_host(&mut self) -> bool {
        if !self.holding {
            return false;
        }
        let mut state = lock(&self.slot.state);
        state.in_host_since = None;
        if state.held.is_none() {
            self.holding = false;
            return true;
        }
        false
    }
}

/// Counts a store as waiting while it lives (a cancelled wait too).
struct Waiting<'a>(&'a Turnstile);

impl<'a> Waiting<'a> {
    fn new(turnstile: &'a Turnstile) -> Self {
        turnstile.waiting.fetch_add(1, Ordering::Relaxed);
        Waiting(turnstile)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Let the executor run what else is ready, this task going to the back of
/// its worker's queue: after giving a turn back, so the store given it runs
/// before this task goes on (tokio puts it where only this worker looks).
pub(crate) async fn yield_once() {
    YieldOnce(false).await
}

/// Pending once, waking itself at once: the task goes to the back of its
/// worker's queue, so the executor runs what else is ready and sees the
/// call's deadline. (Not `tokio::task::yield_now`, whose wake-up waits until
/// the worker parks, which a worker busy with guests seldom does: a guest
/// queued that way missed its turn for many ticks.)
struct YieldOnce(bool);

impl Future for YieldOnce {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        if std::mem::replace(&mut self.0, true) {
            return std::task::Poll::Ready(());
        }
        cx.waker().wake_by_ref();
        std::task::Poll::Pending
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::task::Poll;

    fn lane(turnstile: &Arc<Turnstile>) -> (Lane, Arc<AtomicU64>) {
        let taken = Arc::new(AtomicU64::new(0));
        (turnstile.lane(taken.clone()), taken)
    }

    /// Polls `future` until it is done or has stalled (a few polls, yielding between).
    async fn settles(future: &mut TurnFuture) -> bool {
        for _ in 0..4 {
            if futures_poll(future).await.is_ready() {
                return true;
            }
            tokio::task::yield_now().await;
        }
        false
    }

    async fn futures_poll(future: &mut TurnFuture) -> Poll<()> {
        std::future::poll_fn(|cx| Poll::Ready(future.as_mut().poll(cx))).await
    }

    #[test]
    fn one_fewer_turn_than_workers_and_never_none() {
        assert_eq!(turns_for(0), 1);
        assert_eq!(turns_for(1), 1);
        assert_eq!(turns_for(2), 1);
        assert_eq!(turns_for(8), 7);
    }

    #[tokio::test]
    async fn a_turn_passes_when_its_holder_reaches_its_next_tick() {
        let turnstile = Turnstile::new(1, Duration::from_secs(60));
        let (first_lane, first_taken) = lane(&turnstile);
        let (second_lane, _) = lane(&turnstile);
        let mut first = first_lane.store_turn();
        let mut second = second_lane.store_turn();

        assert!(settles(&mut first.next_turn()).await);
        assert_eq!(turnstile.held(), 1);
        let mut waiting = second.next_turn();
        assert!(!settles(&mut waiting).await, "one turn, and it is held");

        // The holder's next tick: its turn goes to the one waiting, and it queues.
        let mut requeued = first.next_turn();
        assert!(settles(&mut waiting).await);
        assert!(!settles(&mut requeued).await);
        second.release();
        assert!(settles(&mut requeued).await);
        assert_eq!(first_taken.load(Ordering::Relaxed), 2);
        first.release();
        assert_eq!(turnstile.held(), 0);
    }

    /// Polls every pending future a few times, in order (so each waiter
    /// queues); the ones done are taken out and named.
    async fn round(pending: &mut Vec<(usize, TurnFuture)>) -> Vec<usize> {
        let mut done = Vec::new();
        for _ in 0..3 {
            let mut at = 0;
            while at < pending.len() {
                if futures_poll(&mut pending[at].1).await.is_ready() {
                    done.push(pending.remove(at).0);
                } else {
                    at += 1;
                }
            }
            tokio::task::yield_now().await;
        }
        done
    }

    #[tokio::test]
    async fn a_provider_with_many_long_runners_queues_in_its_lane_not_ahead_of_others() {
        let turnstile = Turnstile::new(1, Duration::from_secs(60));
        let (many_lane, many_taken) = lane(&turnstile);
        let (one_lane, one_taken) = lane(&turnstile);
        let mut stores: Vec<StoreTurn> = (0..8).map(|_| many_lane.store_turn()).collect();
        stores.push(one_lane.store_turn());
        let lone = stores.len() - 1;
        let mut pending: Vec<(usize, TurnFuture)> =
            stores.iter_mut().enumerate().map(|(i, t)| (i, t.next_turn())).collect();
        // Each round one store holds the turn, and passes it on at its next tick.
        for _ in 0..8 {
            let done = round(&mut pending).await;
            assert_eq!(done.len(), 1, "one turn: {done:?}");
            pending.push((done[0], stores[done[0]].next_turn()));
        }
        assert!(many_lane.is_full(), "the eight queue in their lane");
        // The lone provider took every other turn, not one in nine.
        let (many_n, one_n) = (many_taken.load(Ordering::Relaxed), one_taken.load(Ordering::Relaxed));
        assert_eq!((many_n, one_n), (4, 4), "store {lone} is the lone provider's");
    }

    #[tokio::test]
    async fn a_turn_held_in_a_long_host_call_is_swept_and_taken_again_on_return() {
        let turnstile = Turnstile::new(1, Duration::from_millis(1));
        let (sleeper_lane, _) = lane(&turnstile);
        let (other_lane, _) = lane(&turnstile);
        let mut sleeper = sleeper_lane.store_turn();
        let mut other = other_lane.store_turn();
        assert!(settles(&mut sleeper.next_turn()).await);
        sleeper.entering_host();
        tokio::time::sleep(Duration::from_millis(5)).await;
        turnstile.sweep();
        assert_eq!(turnstile.held(), 1, "nobody waits: the turn stays through the host call");

        let mut waiting = other.next_turn();
        assert!(!settles(&mut waiting).await);
        sleeper.returning_from_host();
        sleeper.entering_host();
        // Not yet a tick in the host: the sweep leaves it.
        turnstile.sweep();
        assert_eq!(turnstile.held(), 1);
        tokio::time::sleep(Duration::from_millis(5)).await;
        turnstile.sweep();
        assert!(settles(&mut waiting).await, "the sweeper gave the idle holder's turn away");
        assert!(sleeper.returning_from_host(), "back from the host, it must queue again");
        assert!(!other.returning_from_host(), "the other never left wasm");

        // A short host call keeps its turn.
        other.entering_host();
        turnstile.sweep();
        assert!(!other.returning_from_host());
        assert_eq!(turnstile.held(), 1);
    }
}
