//! A thread that advances the engine's epoch and sweeps the turnstile. Each
//! tick a long-running guest passes its turn on and yields to the executor,
//! which is where a call past its deadline is stopped: without this thread a
//! spinning guest never yields and no deadline holds, so failing to start it
//! fails the host's start.

use super::turnstile::Turnstile;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;
use wasmtime::Engine;

pub(crate) struct EpochTicker {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl EpochTicker {
    pub(crate) fn start(engine: Engine, tick: Duration, turnstile: Arc<Turnstile>) -> std::io::Result<Self> {
        Self::start_on(std::thread::Builder::new(), engine, tick, turnstile)
    }

    fn start_on(
        builder: std::thread::Builder,
        engine: Engine,
        tick: Duration,
        turnstile: Arc<Turnstile>,
    ) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = builder.name("broker-epoch".into()).spawn(move || {
            while !flag.load(Ordering::Relaxed) {
                std::thread::sleep(tick);
                engine.increment_epoch();
                turnstile.sweep();
            }
        })?;
        Ok(EpochTicker { stop, thread: Some(thread) })
    }
}

impl Drop for EpochTicker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ticker_that_cannot_start_says_so() {
        let engine = Engine::default();
        // A stack no machine can map: the thread cannot be made.
        let impossible = std::thread::Builder::new().stack_size(usize::MAX / 2);
        let tick = Duration::from_millis(1);
        let turnstile = Turnstile::new(1, tick);
        assert!(EpochTicker::start_on(impossible, engine.clone(), tick, turnstile.clone()).is_err());
        let ticker = EpochTicker::start(engine, tick, turnstile).unwrap();
        assert!(ticker.thread.is_some());
    }
}
