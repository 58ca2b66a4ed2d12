//! The machine lock itself (Juju's `juju/mutex` machine lock): one named
//! `flock` per machine, FIFO waiters, a holder report and a history log. A
//! host facility, not a capability: the host (HostPreparer), `broker lock`
//! and the `machine-lock` capability's guests all take this one lock.

mod history;
mod lock;

pub use lock::LockGuard;
pub use lock::{LockError, MAX_COMMENT_BYTES, MachineLock, Report, Spec};
#[cfg(test)]
pub(crate) use lock::{MAX_WORKER_BYTES, Party};

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    /// The machine lock under `dir`, held for `test-agent` (also for the capability's tests).
    pub(crate) fn lock(dir: &std::path::Path) -> MachineLock {
        MachineLock::new(dir, "machine-lock", "test-agent").unwrap()
    }

    /// A lock that cannot be made says where, and keeps the OS error typed.
    #[test]
    fn a_lock_in_a_file_is_refused_with_its_io_error() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("not-a-dir");
        std::fs::write(&file, "").unwrap();
        let Err(err) = MachineLock::new(&file, "machine-lock", "test-agent") else { panic!("a lock inside a file") };
        let LockError::Io { path, cause } = &err else { panic!("not an i/o error: {err}") };
        assert!(path.starts_with(&*file.to_string_lossy()), "{err}");
        assert!(cause.raw_os_error().is_some(), "the OS error, typed: {err}");
        // Named once: in the message, not again as its source.
        assert!(std::error::Error::source(&err).is_none());
        assert!(err.to_string().ends_with(&cause.to_string()), "{err}");
    }

    /// A spec commented `testing` (also for the capability's tests).
    pub(crate) fn spec(worker: &str, timeout: Option<Duration>) -> Spec {
        Spec { worker: worker.into(), comment: "testing".into(), timeout, abort: None }
    }

    #[tokio::test]
    async fn waiters_are_served_in_arrival_order() {
        let dir = tempfile::tempdir().unwrap();
        let lock = lock(dir.path());
        let first = lock.acquire(spec("first", None)).await.unwrap();
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for name in ["a", "b", "c", "d"] {
            let (waiter, order) = (lock.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let _guard = waiter.acquire(spec(name, None)).await.unwrap();
                order.lock().unwrap().push(name);
                tokio::task::yield_now().await;
            }));
            // Each waiter is queued before the next one arrives.
            while lock.report(0).waiting.len() < tasks.len() {
                tokio::task::yield_now().await;
            }
        }
        assert_eq!(lock.report(0).holder.unwrap().worker, "first");
        drop(first);
        for task in tasks {
            task.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), ["a", "b", "c", "d"]);
    }

    #[tokio::test]
    async fn timeout_and_abort_give_jujus_errors_and_pass_the_turn_on() {
        let dir = tempfile::tempdir().unwrap();
        let lock = lock(dir.path());
        let mut held = lock.acquire(spec("holder", None)).await.unwrap();
        let err = lock.acquire(spec("impatient", Some(Duration::from_millis(30)))).await.err().unwrap();
        assert_eq!(err.to_string(), "timeout acquiring mutex");

        let abort = Arc::new(AtomicBool::new(false));
        let aborting = {
            let lock = lock.clone();
            let abort = abort.clone();
            tokio::spawn(async move { lock.acquire(Spec { abort: Some(abort), ..spec("aborter", None) }).await.err() })
        };
        abort.store(true, Ordering::SeqCst);
        assert_eq!(aborting.await.unwrap().unwrap().to_string(), "cancelled acquiring mutex");
        assert!(lock.report(0).waiting.is_empty(), "waiters that gave up left the queue");

        held.release();
        held.release(); // idempotent
        let again = lock.acquire(spec("next", Some(Duration::from_millis(500)))).await;
        assert!(again.is_ok(), "the turn passed on to a new waiter");
    }

    #[tokio::test]
    async fn release_writes_history_and_the_report_shows_the_holder() {
        let dir = tempfile::tempdir().unwrap();
        let lock = lock(dir.path());
        let guard = lock.acquire(spec("uniter", None)).await.unwrap();
        let report = lock.report(10);
        assert_eq!(report.holder.as_ref().map(Party::label).as_deref(), Some("uniter (testing)"));
        assert!(report.text().contains("holder: uniter (testing), holding 0s"), "{}", report.text());
        drop(guard);
        let report = lock.report(10);
        assert!(report.text().contains("holder: none"), "{}", report.text());
        assert_eq!(report.history.len(), 1);
        assert!(
            report.history[0].ends_with(" test-agent: uniter (testing), waited 0s, held 0s"),
            "{:?}",
            report.history
        );
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(lock.path()).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }

    #[test]
    fn lock_names_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        assert!(MachineLock::new(dir.path(), "machine-lock-net", "a").is_ok());
        assert!(MachineLock::new(dir.path(), "other", "a").is_err());
        assert!(MachineLock::new(dir.path(), "machine-lock-../x", "a").is_err());
    }

    #[test]
    fn the_report_escapes_what_other_processes_wrote() {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
        let party = |worker: &str| Party {
            agent: "agent\x1b[2J".into(),
            pid: 1,
            worker: worker.into(),
            comment: "c\nforged".into(),
            since: now,
        };
        let report = Report {
            name: "machine-lock".into(),
            holder: Some(party("holder")),
            waiting: vec![party("waiter")],
            history: vec!["old \x1b]0;title\x07 line".into()],
        };
        let text = report.text();
        assert!(!text.contains('\x1b') && !text.contains('\x07'), "{text:?}");
        assert!(text.contains("holder (c\\nforged)") && text.contains("agent\\x1b[2J pid 1"), "{text}");
        assert!(text.contains("old \\x1b]0;title\\x07 line"), "{text}");
        assert_eq!(text.lines().count(), 6, "{text}");
    }
}
