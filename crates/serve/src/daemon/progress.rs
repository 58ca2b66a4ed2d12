//! The progress lines of a start on their way to a client that may read
//! slowly or not at all. A provider decides how many statuses it reports, so
//! what waits for the client is bounded: when the queue is full the newest
//! waiting line is replaced by the one that comes next (the client sees the
//! first lines and the latest, as a progress display wants), and the final
//! line is always delivered, after every line queued before it.

use std::collections::VecDeque;
use std::sync::Mutex;
use tokio::sync::Notify;

/// Lines a start may have waiting for its client.
pub(crate) const QUEUED_LINES: usize = 64;

pub(crate) struct ProgressQueue<T> {
    capacity: usize,
    state: Mutex<State<T>>,
    ready: Notify,
}

struct State<T> {
    lines: VecDeque<T>,
    last: Option<T>,
    closed: bool,
    coalesced: u64,
}

impl<T> ProgressQueue<T> {
    pub(crate) fn new(capacity: usize) -> Self {
        let state = State { lines: VecDeque::new(), last: None, closed: false, coalesced: 0 };
        ProgressQueue { capacity: capacity.max(1), state: Mutex::new(state), ready: Notify::new() }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State<T>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queue an intermediate line, replacing the newest waiting one when full.
    pub(crate) fn push(&self, line: T) {
        {
            let mut state = self.state();
            if state.closed {
                return;
            }
            if state.lines.len() >= self.capacity {
                state.lines.pop_back();
                state.coalesced += 1;
            }
            state.lines.push_back(line);
        }
        self.ready.notify_one();
    }

    /// The final line: delivered after every line queued, then nothing more.
    pub(crate) fn finish(&self, line: T) {
        {
            let mut state = self.state();
            state.last = Some(line);
            state.closed = true;
        }
        self.ready.notify_one();
    }

    /// Lines replaced so far because the client was behind.
    pub(crate) fn coalesced(&self) -> u64 {
        self.state().coalesced
    }

    /// The next line, waiting for one; `None` after the final line.
    pub(crate) async fn next(&self) -> Option<T> {
        loop {
            // Made before looking, so a push between the look and the wait is not missed.
            let pushed = self.ready.notified();
            {
                let mut state = self.state();
                if let Some(line) = state.lines.pop_front() {
                    return Some(line);
                }
                if let Some(last) = state.last.take() {
                    return Some(last);
                }
                if state.closed {
                    return None;
                }
            }
            pushed.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[tokio::test]
    async fn a_client_that_does_not_read_holds_a_bounded_queue_and_gets_the_first_the_latest_and_the_end() {
        let queue = ProgressQueue::new(4);
        for n in 0..10_000 {
            queue.push(n);
        }
        queue.finish(-1);
        queue.push(99_999); // after the end: nothing
        assert_eq!(queue.coalesced(), 9_996);
        let mut seen = Vec::new();
        while let Some(line) = queue.next().await {
            seen.push(line);
        }
        assert_eq!(seen, [0, 1, 2, 9_999, -1]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_that_keeps_up_misses_nothing() {
        let queue = Arc::new(ProgressQueue::new(QUEUED_LINES));
        let writer = queue.clone();
        let reader = tokio::spawn(async move {
            let mut seen = Vec::new();
            while let Some(line) = queue.next().await {
                seen.push(line);
            }
            seen
        });
        for n in 0..50 {
            writer.push(n);
            tokio::task::yield_now().await;
        }
        writer.finish(-1);
        let seen = reader.await.unwrap();
        assert_eq!(seen.len(), 51, "{seen:?}");
        assert_eq!(seen.last(), Some(&-1));
        assert!(seen.windows(2).take(49).all(|w| w[0] < w[1]), "in order: {seen:?}");
    }
}
