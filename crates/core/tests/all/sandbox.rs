//! Containment: hostile guests trap, loop and hog memory; each gets its typed
//! error, the bad instance is never reused, and the host serves the next call.

use broker_capabilities::rooms::context::CallHooks;
use broker_capabilities::rooms::kv::{KvBackend, MemoryKv};
use broker_core::error_report::ErrorKind;
use broker_core::manifest::Method;
use broker_core::runtime::Runtime;
use broker_core::store::EventKind;
use broker_core::version::method_stats::Outcome;
use broker_core::version::{CallError, ProviderVersion};
use broker_tests::{fake_manifest_extra, load_provider, runtime};
use std::sync::Arc;
use std::sync::atomic::Ordering;

struct Hostile {
    _dir: tempfile::TempDir,
    kv: Arc<MemoryKv>,
    provider: ProviderVersion,
    runtime: Arc<Runtime>,
}

fn hostile(isolation: &str) -> Hostile {
    hostile_with(isolation, "", "300ms")
}

/// `limits`: extra lines for the manifest's [limits] table.
/// `deadline`: every method's.
fn hostile_with(isolation: &str, limits: &str, deadline: &str) -> Hostile {
    let dir = tempfile::tempdir().unwrap();
    let kv = Arc::new(MemoryKv::default());
    let runtime = runtime();
    let extra = format!(
        "isolation = \"{isolation}\"\n[limits]\nmemory-mib = 16\n{limits}\n[limits.deadlines]\ndefault = \"{deadline}\"\n[grants]\nkv = true\n"
    );
    let provider = load_provider(&runtime, kv.clone(), dir.path(), "hostile", "test-hostile", &extra).expect("load");
    Hostile { _dir: dir, kv, provider, runtime }
}

impl Hostile {
    fn mode(&self, mode: &str) {
        self.kv.set("hostile", "mode", mode.as_bytes()).unwrap();
    }

    /// The number of calls the answering instance has served, counted in wasm memory.
    async fn served(&self) -> u64 {
        self.mode("count");
        let instances = self.provider.all_instances(&CallHooks::default()).await.expect("count call");
        instances[0].id.parse().unwrap()
    }
}

#[tokio::test]
async fn pooled_instances_are_reused_per_call_instances_are_not() {
    let pooled = hostile("pooled");
    assert_eq!([pooled.served().await, pooled.served().await, pooled.served().await], [1, 2, 3]);
    assert_eq!(pooled.provider.stats().instantiations.load(Ordering::Relaxed), 1);

    let per_call = hostile("per-call");
    assert_eq!([per_call.served().await, per_call.served().await, per_call.served().await], [1, 1, 1]);
    assert_eq!(per_call.provider.stats().instantiations.load(Ordering::Relaxed), 3);
    assert_eq!(per_call.provider.pooled_instances(), 0);
}

#[tokio::test]
async fn pooled_instances_retire_after_max_calls_and_max_age() {
    let by_calls = hostile_with("pooled", "max-calls = 2", "300ms");
    let mut served = Vec::new();
    for _ in 0..5 {
        served.push(by_calls.served().await);
    }
    assert_eq!(served, [1, 2, 1, 2, 1]);

    let by_age = hostile_with("pooled", "max-age = \"500ms\"", "300ms");
    assert_eq!(by_age.served().await, 1);
    assert_eq!(by_age.served().await, 2);
    tokio::time::sleep(std::time::Duration::from_millis(600)).await;
    assert_eq!(by_age.served().await, 1, "an instance older than max-age is not reused");
}

#[tokio::test]
pub(crate) async fn trap_gives_typed_error_and_the_instance_is_never_reused() {
    let h = hostile("pooled");
    assert_eq!(h.served().await, 1);
    h.mode("trap");
    let err = h.provider.all_instances(&CallHooks::default()).await.unwrap_err();
    assert!(matches!(&err, CallError::Trap { provider, .. } if provider == "hostile"), "{err}");
    assert!(err.to_string().contains("all-instances trapped"), "{err}");
    // The guest's panic message, with its file and line, is quoted from its stderr.
    let CallError::Trap { stderr, .. } = &err else { unreachable!() };
    assert!(stderr.iter().any(|line| line.contains("panicked at ") && line.contains("src/lib.rs:")), "{stderr:?}");
    assert!(stderr.iter().any(|line| line == "hostile guest traps on purpose"), "{stderr:?}");
    assert!(err.to_string().contains("its last stderr lines: "), "{err}");
    let report = err.report();
    assert_eq!((report.kind, report.method.as_deref()), (ErrorKind::Trap, Some("all-instances")));
    assert!(report.message.contains("hostile guest traps on purpose"), "{}", report.message);
    assert_eq!(h.provider.pooled_instances(), 0, "the trapped instance went back to no pool");
    assert_eq!(h.served().await, 1, "the next call runs on a fresh instance");
    let all = h.provider.stats().methods.get(Method::AllInstances);
    assert_eq!((all.outcome(Outcome::Ok), all.outcome(Outcome::Trap), all.count()), (2, 1, 3), "counted for /metrics");
}

#[tokio::test]
async fn loop_past_deadline_is_stopped() {
    let h = hostile("pooled");
    h.mode("loop");
    let err = h.provider.all_instances(&CallHooks::default()).await.unwrap_err();
    match &err {
        CallError::Deadline { provider, method, deadline } => {
            assert_eq!(provider, "hostile");
            assert_eq!(method.name(), "all-instances");
            assert_eq!(deadline.as_millis(), 300);
        }
        other => panic!("expected a deadline error, got {other}"),
    }
    assert_eq!(h.served().await, 1, "the looping instance was discarded");
    assert_eq!(h.provider.stats().methods.get(Method::AllInstances).outcome(Outcome::Deadline), 1);
}

#[tokio::test]
async fn memory_hog_hits_its_limit() {
    let h = hostile("pooled");
    h.mode("memhog");
    let err = h.provider.all_instances(&CallHooks::default()).await.unwrap_err();
    assert!(matches!(&err, CallError::Limit { limit, .. } if limit.contains("memory limit of 16 MiB")), "{err}");
    assert_eq!(h.served().await, 1, "the instance that hit the limit was discarded");
    assert_eq!(h.provider.stats().methods.get(Method::AllInstances).outcome(Outcome::Limit), 1);
}

/// A looping guest yields its worker at every epoch tick: other providers keep
/// answering while it spins, and it is stopped at its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_providers_keep_serving_while_one_misbehaves() {
    // A long deadline, so a loaded machine still answers the 20 calls well within it.
    let h = Arc::new(hostile_with("pooled", "", "3s"));
    let dir = tempfile::tempdir().unwrap();
    let fake = load_provider(
        &h.runtime,
        Arc::new(MemoryKv::default()),
        dir.path(),
        "fake",
        "fake",
        &fake_manifest_extra("pooled"),
    )
    .unwrap();
    h.mode("loop");
    let spinning = h.clone();
    let looping = tokio::spawn(async move { spinning.provider.all_instances(&CallHooks::default()).await });
    tokio::task::yield_now().await;
    for _ in 0..20 {
        fake.all_instances(&CallHooks::default()).await.expect("fake answers");
    }
    assert!(!looping.is_finished(), "20 calls to the fake were answered while the hostile guest was still spinning");
    assert!(matches!(looping.await.unwrap(), Err(CallError::Deadline { .. })));
}

/// Collects what a `tracing` fmt subscriber writes.
#[derive(Clone, Default)]
struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn guest_stdout_and_stderr_become_tracing_events_with_the_provider_name() {
    let captured = Captured::default();
    let sink = captured.clone();
    let subscriber = tracing_subscriber::fmt().with_writer(move || sink.clone()).with_ansi(false).finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let h = hostile("per-call");
    h.mode("print");
    assert!(h.provider.all_instances(&CallHooks::default()).await.unwrap().is_empty());

    let logs = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    let line_of = |stream: &str| logs.lines().find(|l| l.contains(&format!("stream=\"{stream}\""))).map(str::to_owned);
    let stdout = line_of("stdout").unwrap_or_else(|| panic!("no stdout event in:\n{logs}"));
    assert!(
        stdout.contains("provider=\"hostile\"") && stdout.contains("hello from the hostile guest's stdout"),
        "{stdout}"
    );
    let stderr = line_of("stderr").unwrap_or_else(|| panic!("no stderr event in:\n{logs}"));
    assert!(stderr.contains("hello from the hostile guest's stderr"), "{stderr}");
}

/// Host capabilities with a machine lock in a temp dir, and the kv the guest sees.
fn with_machine_lock() -> (
    tempfile::TempDir,
    broker_capabilities::machine_lock::MachineLock,
    Arc<MemoryKv>,
    broker_core::runtime::HostCapabilities,
) {
    use broker_capabilities::machine_lock::MachineLock;
    let dir = tempfile::tempdir().unwrap();
    let lock = MachineLock::new(dir.path(), "machine-lock", "test").unwrap();
    let kv = Arc::new(MemoryKv::default());
    let base = broker_tests::host_capabilities(dir.path(), kv.clone());
    let backends =
        base.backends.clone().with::<broker_capabilities::rooms::machine_lock::MachineLockRoom>(Arc::new(lock.clone()));
    let caps = broker_core::runtime::HostCapabilities { backends, ..base };
    (dir, lock, kv, caps)
}

/// The machine lock through a real guest: access-denied without the grant; with
/// it, a guard the guest forgets is released when its call ends.
#[tokio::test]
async fn machine_lock_needs_its_grant_and_cannot_leak() {
    use broker_capabilities::bindings::BrokerError;

    let (dir, lock, kv, caps) = with_machine_lock();
    let rt = runtime();
    let base = "[limits.deadlines]\ndefault = \"5s\"\n[grants]\nkv = true\n";
    let ungranted =
        broker_tests::load_provider_with(&rt, caps.clone(), dir.path(), "hostile", "test-hostile", base).unwrap();
    kv.set("hostile", "mode", b"lock").unwrap();
    let err = ungranted.all_instances(&CallHooks::default()).await.unwrap_err();
    assert!(matches!(err.broker_error(), Some(BrokerError::AccessDenied(m)) if m.contains("machine-lock")), "{err}");

    let granted = broker_tests::load_provider_with(
        &rt,
        caps,
        dir.path(),
        "hostile",
        "test-hostile",
        &format!("{base}machine-lock = true\n"),
    )
    .unwrap();
    assert_eq!(granted.all_instances(&CallHooks::default()).await.unwrap()[0].id, "locked");
    kv.set("hostile", "mode", b"lock-leak").unwrap();
    assert_eq!(granted.all_instances(&CallHooks::default()).await.unwrap()[0].id, "locked");
    let report = lock.report(10);
    assert!(report.holder.is_none(), "the forgotten guard was released at the end of the call");
    assert_eq!(report.history.len(), 2);
    assert!(report.history[1].contains("hostile (lock-leak)"), "{:?}", report.history);

    // While the host holds the lock, the guest's acquire times out with Juju's message.
    let _held = lock
        .acquire(broker_capabilities::machine_lock::Spec { worker: "host".into(), ..Default::default() })
        .await
        .unwrap();
    let err = granted.all_instances(&CallHooks::default()).await.unwrap_err();
    assert!(matches!(err.broker_error(), Some(BrokerError::Timeout(m)) if m == "timeout acquiring mutex"), "{err}");
}

/// Attack 4 of the sandbox issue through a real guest: a worker with a newline
/// (a forged history line) and a comment far past its cap are refused as
/// invalid, and nothing reaches `machine-lock.log`.
#[tokio::test]
async fn a_guest_cannot_forge_or_flood_the_machine_lock_history() {
    use broker_capabilities::bindings::BrokerError;
    use broker_capabilities::machine_lock::MAX_COMMENT_BYTES;

    let (dir, _lock, kv, caps) = with_machine_lock();
    let grants = "[limits.deadlines]\ndefault = \"5s\"\n[grants]\nkv = true\nmachine-lock = true\n";
    let provider =
        broker_tests::load_provider_with(&runtime(), caps, dir.path(), "hostile", "test-hostile", grants).unwrap();
    kv.set("hostile", "mode", b"lock-as").unwrap();
    let history = dir.path().join("machine-lock.log");
    let attempts = [
        ("hostile\n2026-12-01 00:00:00 forged: root (rm -rf /)".to_owned(), "c".to_owned(), "control character"),
        ("hostile".to_owned(), "c".repeat(MAX_COMMENT_BYTES * 64), "comment is"),
    ];
    for (worker, comment, why) in attempts {
        kv.set("hostile", "lock-worker", worker.as_bytes()).unwrap();
        kv.set("hostile", "lock-comment", comment.as_bytes()).unwrap();
        let err = provider.all_instances(&CallHooks::default()).await.unwrap_err();
        assert!(matches!(err.broker_error(), Some(BrokerError::InvalidParams(m)) if m.contains(why)), "{err}");
        assert!(!history.exists(), "nothing was written to the history");
    }
    // A worker and comment within bounds are taken, as one line.
    kv.set("hostile", "lock-worker", b"hostile").unwrap();
    kv.set("hostile", "lock-comment", b"fine").unwrap();
    assert_eq!(provider.all_instances(&CallHooks::default()).await.unwrap()[0].id, "locked");
    let written = std::fs::read_to_string(&history).unwrap();
    assert_eq!(written.lines().count(), 1, "{written}");
    assert!(written.contains("hostile (fine)") && !written.contains("forged"), "{written}");
}

#[tokio::test]
async fn repeated_crashes_put_a_provider_half_open_until_all_instances_answers_again() {
    let h = hostile_with("pooled", "breaker-failures = 2\nbreaker-window = \"60s\"", "300ms");
    h.mode("trap");
    for _ in 0..2 {
        let err = h.provider.all_instances(&CallHooks::default()).await.unwrap_err();
        assert!(matches!(err, CallError::Trap { .. }), "{err}");
    }
    assert_eq!(h.provider.breaker_state(), (true, 1), "two traps in the window trip it");

    // Half-open: the next call first re-observes; all-instances still traps, so it is refused.
    let err = h.provider.all_instances(&CallHooks::default()).await.unwrap_err();
    assert!(matches!(&err, CallError::Unavailable { .. }), "{err}");
    assert!(err.to_string().contains("re-observe failed") && err.to_string().contains("trapped"), "{err}");
    assert!(h.provider.breaker_state().0);

    // The provider is healthy again: the re-observe passes and the call is served.
    h.mode("count");
    assert!(h.provider.all_instances(&CallHooks::default()).await.is_ok());
    assert_eq!(h.provider.breaker_state(), (false, 1));
    let all = h.provider.stats().methods.get(Method::AllInstances);
    assert_eq!(all.outcome(Outcome::Unavailable), 1, "the refusal is counted under the method asked");
    // Two traps, the failed re-observe (a third), the passing re-observe and the served call.
    assert_eq!((all.outcome(Outcome::Trap), all.outcome(Outcome::Ok)), (3, 2));
}

#[tokio::test(flavor = "multi_thread")]
async fn calls_arriving_together_on_a_half_open_provider_share_one_reobserve() {
    let h = Arc::new(hostile_with("pooled", "breaker-failures = 2\nbreaker-window = \"60s\"\npool-size = 8", "1s"));
    h.mode("loop");
    for _ in 0..2 {
        let err = h.provider.all_instances(&CallHooks::default()).await.unwrap_err();
        assert!(matches!(err, CallError::Deadline { .. }), "{err}");
    }
    assert!(h.provider.breaker_state().0);
    // Six calls at once while all-instances still spins: one re-observe runs (to its
    // 1 s deadline); the calls that waited on it are refused with its verdict.
    let calls: Vec<_> = (0..6)
        .map(|_| {
            let h = h.clone();
            tokio::spawn(async move { h.provider.all_instances(&CallHooks::default()).await })
        })
        .collect();
    for call in calls {
        let err = call.await.unwrap().unwrap_err();
        assert!(matches!(&err, CallError::Unavailable { .. }), "{err}");
        assert!(err.to_string().contains("re-observe failed"), "{err}");
    }
    let all = h.provider.stats().methods.get(Method::AllInstances);
    assert_eq!(all.outcome(Outcome::Unavailable), 6);
    assert_eq!(all.outcome(Outcome::Deadline), 3, "two that tripped it and a single re-observe, not six");
}

/// Instance ids are checked where the host takes them (issue 14, attack 4): a
/// start whose id is not printable, or is another provider's, is refused naming
/// the provider and why, and nothing is recorded; such `all-instances` entries are
/// dropped from listings and reported by reconcile, while the valid ones stay.
#[tokio::test]
async fn a_provider_cannot_return_an_unprintable_id_or_another_providers_id() {
    use broker_capabilities::contract::empty_params;
    use broker_core::broker::Broker;
    use broker_core::broker::service::BrokerServiceError;
    use broker_tests::write_manifest;

    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::open(&dir.path().join("data")).unwrap();
    let fake = write_manifest(dir.path(), "fake", "fake", &fake_manifest_extra("pooled"));
    broker.registry().add(&fake).await.unwrap();
    let hostile = write_manifest(dir.path(), "hostile", "test-hostile", "[grants]\nkv = true\n");
    broker.registry().add(&hostile).await.unwrap();
    let hooks = CallHooks::default();
    let theirs = broker.start_instance("fake", &empty_params(), &hooks).await.unwrap().id;
    let kv = broker.store().kv();
    let stopped = || -> Vec<String> {
        let bytes = kv.get("hostile", "stopped").unwrap().unwrap_or_default();
        String::from_utf8(bytes).unwrap().split_terminator('\0').map(str::to_owned).collect()
    };

    let forged = "\x1b[2J\nforged";
    kv.set("hostile", "start-id", forged.as_bytes()).unwrap();
    let err = broker.start_instance("hostile", &empty_params(), &hooks).await.unwrap_err();
    assert!(matches!(err, BrokerServiceError::InvalidInstanceId { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains(r#"provider hostile returned an unusable instance id "\x1b[2J\nforged": it has the control character U+001B at byte 0"#),
        "{text}"
    );
    assert!(!text.contains('\x1b') && !text.contains('\n'), "{text:?}");
    assert_eq!(stopped(), [forged], "an instance the host cannot record is stopped again");

    kv.set("hostile", "start-id", theirs.as_bytes()).unwrap();
    let err = broker.start_instance("hostile", &empty_params(), &hooks).await.unwrap_err();
    assert!(matches!(err, BrokerServiceError::InstanceIdTaken { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains(&format!(
            "provider hostile returned instance id \"{theirs}\", which is recorded for provider fake"
        )),
        "{text}"
    );
    assert_eq!(stopped(), [forged], "another provider's id is not stopped");
    assert!(broker.store().instances(Some("hostile")).unwrap().is_empty(), "nothing was recorded");
    assert_eq!(broker.provider_of(&theirs).unwrap(), "fake", "stopping it is not made ambiguous");

    kv.set("hostile", "start-id", b"hostile-1").unwrap();
    let group_tag = std::collections::BTreeMap::from([("infrakit.group".to_owned(), "workers".to_owned())]);
    let tagged =
        broker_core::groups::spec::start_params("Properties", &serde_json::Value::Null, &[], group_tag, true).unwrap();
    assert_eq!(broker.start_instance("hostile", &tagged, &hooks).await.unwrap().id, "hostile-1");
    // A second start answered with the same id: refused, the first record kept
    // as it was (a group member cannot be taken over or retagged this way).
    let err = broker.start_instance("hostile", &empty_params(), &hooks).await.unwrap_err();
    assert!(matches!(err, BrokerServiceError::InstanceIdReused { .. }), "{err}");
    assert!(err.to_string().contains("already recorded as one of its instances"), "{err}");
    let kept = broker.store().instance("hostile", "hostile-1").unwrap().unwrap();
    assert_eq!(kept.instance_tags.get("infrakit.group").map(String::as_str), Some("workers"), "{kept:?}");

    kv.set("hostile", "mode", b"ids").unwrap();
    // Out of order, one id twice: listed in order, once.
    let reported = format!("hostile-2\0{forged}\0hostile-1\0{theirs}\0has space\0{}\0hostile-2", "x".repeat(256));
    kv.set("hostile", "ids", reported.as_bytes()).unwrap();
    let listed = broker.list_instances(None).await.unwrap();
    let listed: Vec<(&str, &str)> = listed.iter().map(|r| (r.provider.as_str(), r.id.as_str())).collect();
    assert_eq!(listed, [("fake", theirs.as_str()), ("hostile", "hostile-1"), ("hostile", "hostile-2")]);

    let reconciled = broker.reconcile().await;
    let found = reconciled.iter().find(|r| r.provider == "hostile").unwrap();
    assert_eq!(found.error, None);
    assert_eq!(found.unknown_to_host, ["hostile-2"], "valid entries stay visible");
    assert!(found.vanished.is_empty());
    assert_eq!(found.refused.len(), 4, "{:?}", found.refused);
    let summary = found.summary();
    for why in [
        r#""\x1b[2J\nforged" (it has the control character U+001B at byte 0"#,
        &format!("\"{theirs}\" (it is recorded for provider fake)"),
        r#""has space" (it has the whitespace U+0020 at byte 3"#,
        "(256 bytes) (it is 256 bytes long; at most 255 are allowed)",
    ] {
        assert!(summary.contains(why), "{why} in {summary}");
    }
    let events = broker.store().events(0, 100).unwrap();
    let event = events.iter().find(|e| e.kind == EventKind::Reconciled && e.provider == "hostile").unwrap();
    assert!(event.detail.contains("refused ids") && !event.detail.contains('\x1b'), "{:?}", event.detail);
}

/// Attacks 2 and 3 of the sandbox issue, by a guest through the real host with
/// only `qemu-img` granted: a link out of `/data`, a `json:` filename naming a
/// host file, a loader variable. Each fails with a clear error, nothing outside
/// the data dir is read or written, and each refusal is noted where the
/// conformance kit looks for calls to what was not granted.
#[tokio::test]
async fn a_guest_with_only_qemu_img_cannot_reach_host_files() {
    use broker_capabilities::bindings::BrokerError;
    use broker_capabilities::rooms::denials::Denials;
    use broker_core::runtime::HostCapabilities;

    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("secret.raw");
    std::fs::write(&secret, "host secret in a raw image").unwrap();
    let kv = Arc::new(MemoryKv::default());
    let (denials, denied) = Denials::collecting();
    let caps = HostCapabilities { denials, ..broker_tests::host_capabilities(dir.path(), kv.clone()) };
    let grants = "[grants]\nkv = true\nprocess = [\"qemu-img\"]\n";
    let provider =
        broker_tests::load_provider_with(&runtime(), caps, dir.path(), "hostile", "test-hostile", grants).unwrap();
    let data = provider.data_dir().to_owned();
    let hooks = CallHooks::default();

    kv.set("hostile", "mode", b"symlink").unwrap();
    let err = provider.all_instances(&hooks).await.unwrap_err().to_string();
    assert!(err.contains("symlink refused"), "{err}");
    assert!(std::fs::symlink_metadata(data.join("escape")).is_err(), "no link was made");

    kv.set("hostile", "mode", b"exec").unwrap();
    let json = format!(r#"json:{{"file":{{"driver":"file","filename":"{}"}}}}"#, secret.display());
    let words = ["qemu-img", "convert", "-O", "raw", &json, "/data/stolen.raw"].join("\0");
    kv.set("hostile", "exec", words.as_bytes()).unwrap();
    let ran = provider.all_instances(&hooks).await.unwrap();
    assert_ne!(ran[0].id, "exit-0", "{}", String::from_utf8_lossy(&kv.get("hostile", "exec-stderr").unwrap().unwrap()));
    assert!(!data.join("stolen.raw").exists());

    kv.set("hostile", "exec", "qemu-img\0--version".as_bytes()).unwrap();
    kv.set("hostile", "exec-env", b"LD_PRELOAD=/data/evil.so").unwrap();
    let err = provider.all_instances(&hooks).await.unwrap_err();
    assert!(matches!(err.broker_error(), Some(BrokerError::AccessDenied(m)) if m.contains("LD_PRELOAD")), "{err}");

    // A qcow2 the guest wrote whose backing file is a host path: qemu-img looks
    // for it inside the sandbox, where it does not exist.
    kv.set("hostile", "exec-env", b"").unwrap();
    let create =
        ["qemu-img", "create", "-f", "qcow2", "-u", "-F", "raw", "-b", "evil-backing", "/data/evil.qcow2", "1M"];
    kv.set("hostile", "exec", create.join("\0").as_bytes()).unwrap();
    assert_eq!(provider.all_instances(&hooks).await.unwrap()[0].id, "exit-0");
    let image = qcow2_backed_by(&std::fs::read(data.join("evil.qcow2")).unwrap(), &secret.display().to_string());
    std::fs::remove_file(data.join("evil.qcow2")).unwrap();
    kv.set("hostile", "mode", b"write").unwrap();
    kv.set("hostile", "write-path", b"evil.qcow2").unwrap();
    kv.set("hostile", "write-bytes", &image).unwrap();
    assert_eq!(provider.all_instances(&hooks).await.unwrap()[0].id, "written");
    kv.set("hostile", "mode", b"exec").unwrap();
    let convert = ["qemu-img", "convert", "-O", "raw", "/data/evil.qcow2", "/data/stolen2.raw"];
    kv.set("hostile", "exec", convert.join("\0").as_bytes()).unwrap();
    let ran = provider.all_instances(&hooks).await.unwrap();
    let stderr = String::from_utf8(kv.get("hostile", "exec-stderr").unwrap().unwrap()).unwrap();
    assert_ne!(ran[0].id, "exit-0", "{stderr}");
    assert!(stderr.contains(&secret.display().to_string()) && stderr.contains("No such file"), "{stderr}");
    let stolen = std::fs::read(data.join("stolen2.raw")).unwrap_or_default();
    assert!(!String::from_utf8_lossy(&stolen).contains("host secret"));

    let denied = denied.lock().unwrap().clone();
    assert!(denied.iter().any(|d| d.starts_with("filesystem:") && d.contains("symlink")), "{denied:?}");
    assert!(denied.iter().any(|d| d.starts_with("process:") && d.contains("LD_PRELOAD")), "{denied:?}");
    assert_eq!(std::fs::read_to_string(&secret).unwrap(), "host secret in a raw image");
}

/// A qcow2 image (as `qemu-img create -b evil-backing` made it) with its backing
/// file name rewritten to `target`, as a guest can write it byte by byte.
pub(crate) fn qcow2_backed_by(image: &[u8], target: &str) -> Vec<u8> {
    let at = image.windows(12).position(|w| w == b"evil-backing").unwrap();
    let mut out = image[..at].to_vec();
    out[8..16].copy_from_slice(&(at as u64).to_be_bytes());
    out[16..20].copy_from_slice(&(target.len() as u32).to_be_bytes());
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(&image[at + 12..]);
    out
}

/// The host's own spawn log, through a real guest: a link a granted program
/// planted where the log goes (the guest cannot make links itself) is refused
/// when the host opens the log, and the file it points at is untouched.
#[tokio::test]
async fn a_guest_cannot_have_the_host_write_a_spawn_log_through_a_link() {
    use broker_capabilities::bindings::BrokerError;

    let dir = tempfile::tempdir().unwrap();
    let victim = dir.path().join("victim");
    std::fs::write(&victim, "untouched").unwrap();
    let kv = Arc::new(MemoryKv::default());
    let caps = broker_tests::host_capabilities(dir.path(), kv.clone());
    let grants = "[grants]\nkv = true\nprocess = [\"sh\", \"echo\"]\n";
    let provider =
        broker_tests::load_provider_with(&runtime(), caps, dir.path(), "hostile", "test-hostile", grants).unwrap();
    let data = provider.data_dir().to_owned();
    let hooks = CallHooks::default();

    kv.set("hostile", "mode", b"write").unwrap();
    kv.set("hostile", "write-path", b"logs/.keep").unwrap();
    kv.set("hostile", "write-bytes", b"").unwrap();
    provider.all_instances(&hooks).await.unwrap();
    kv.set("hostile", "mode", b"exec").unwrap();
    // In a script, spelled so the argument check (a convenience, not the wall)
    // sees no `..`: from `logs/` up and out of the data dir to the victim.
    let depth = data.strip_prefix(dir.path()).unwrap().components().count() + 1;
    let script = format!("d=.; ln -s {}victim logs/vm.log", "$d$d/".repeat(depth));
    let plant = ["sh", "-c", &script].join("\0");
    kv.set("hostile", "exec", plant.as_bytes()).unwrap();
    assert_eq!(provider.all_instances(&hooks).await.unwrap()[0].id, "exit-0");
    assert!(std::fs::symlink_metadata(data.join("logs/vm.log")).unwrap().is_symlink(), "the link is planted");
    assert_eq!(
        std::fs::canonicalize(data.join("logs/vm.log")).unwrap(),
        victim.canonicalize().unwrap(),
        "at the victim"
    );

    kv.set("hostile", "mode", b"spawn").unwrap();
    kv.set("hostile", "spawn-name", b"vm").unwrap();
    kv.set("hostile", "exec", b"echo\0appended").unwrap();
    let err = provider.all_instances(&hooks).await.unwrap_err();
    assert!(matches!(err.broker_error(), Some(BrokerError::AccessDenied(m)) if m.contains("link")), "{err}");
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "untouched");
}

/// A hostile provider granted `sh` (arbitrary code in its sandbox) with
/// `limits` in `[limits]`, named `name` (its sandbox user, group and /tmp are
/// the name's own: tests in parallel share none).
fn shell_provider(name: &str, limits: &str) -> (tempfile::TempDir, Arc<MemoryKv>, ProviderVersion, ProcessBackendRef) {
    let dir = tempfile::tempdir().unwrap();
    let kv = Arc::new(MemoryKv::default());
    let caps = broker_tests::host_capabilities(dir.path(), kv.clone());
    let backend = caps.backends.of::<broker_capabilities::rooms::process::Process>().expect("the host's programs");
    let extra = format!(
        "[limits]\nmemory-mib = 32\n{limits}\n[limits.deadlines]\ndefault = \"20s\"\n[grants]\nkv = true\nprocess = [\"sh\"]\n"
    );
    let provider =
        broker_tests::load_provider_with(&runtime(), caps, dir.path(), name, "test-hostile", &extra).expect("load");
    (dir, kv, provider, backend)
}

type ProcessBackendRef = Arc<dyn broker_capabilities::rooms::process::ProcessBackend>;

/// Run `script` with the provider's `sh` (through the guest, confined as
/// every granted program is): its exit code and stderr.
async fn run_script(kv: &MemoryKv, provider: &ProviderVersion, name: &str, script: &str) -> (String, String) {
    kv.set(name, "mode", b"write").unwrap();
    kv.set(name, "write-path", b"script.sh").unwrap();
    kv.set(name, "write-bytes", script.as_bytes()).unwrap();
    assert_eq!(provider.all_instances(&CallHooks::default()).await.unwrap()[0].id, "written");
    kv.set(name, "mode", b"exec").unwrap();
    kv.set(name, "exec", b"sh\0/data/script.sh").unwrap();
    let id = provider.all_instances(&CallHooks::default()).await.unwrap()[0].id.clone();
    let stderr = String::from_utf8_lossy(&kv.get(name, "exec-stderr").unwrap().unwrap_or_default()).into_owned();
    (id, stderr)
}

/// The processes running as `uid` now.
fn processes_of(uid: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|status| {
                status.lines().any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some(&uid.to_string()))
            })
        })
        .collect()
}

fn root_only() -> bool {
    let root = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata("/proc/self").unwrap()) == 0;
    if !root {
        eprintln!("skipped: sandbox users, cgroups and the host's tmpfs need root");
    }
    root
}

/// `/tmp` and `/dev/shm` are one tmpfs of `tmp-mib` that runs nothing; `/dev`
/// takes no new file; what the programs take of memory is bounded by their
/// group, and the program over it dies, not the host.
#[tokio::test]
async fn a_programs_tmp_dev_and_memory_are_bounded_and_tmp_runs_nothing() {
    if !root_only() {
        return;
    }
    let (_dir, kv, provider, _) = shell_provider("hostile-bounds", "tmp-mib = 8\nprogram-memory-mib = 48");
    let script = "head -c 20000000 /dev/zero > /tmp/big; echo \"tmp=$(stat -c %s /tmp/big)\" >&2\n\
                  head -c 20000000 /dev/zero > /dev/shm/more; echo \"shm=$(stat -c %s /dev/shm/more)\" >&2\n\
                  rm -f /tmp/big /dev/shm/more\n\
                  cp /usr/bin/true /tmp/t && /tmp/t; echo \"exec-tmp=$?\" >&2\n\
                  cp /usr/bin/true /dev/shm/t && /dev/shm/t; echo \"exec-shm=$?\" >&2\n\
                  echo x > /dev/planted; echo \"dev=$?\" >&2\n\
                  python3 -c 'x = bytearray(400 << 20); print(\"survived\")' >&2; echo \"hog=$?\" >&2\n";
    let (_, stderr) = run_script(&kv, &provider, "hostile-bounds", script).await;
    let value = |key: &str| -> i64 {
        let line = stderr
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{key}=")))
            .unwrap_or_else(|| panic!("{key}: {stderr}"));
        line.trim().parse().unwrap_or_else(|_| panic!("{key}: {stderr}"))
    };
    assert!(value("tmp") <= 8 << 20, "/tmp held more than tmp-mib: {stderr}");
    assert!(value("tmp") + value("shm") <= 8 << 20, "/tmp and /dev/shm are one bound: {stderr}");
    assert_eq!(value("exec-tmp"), 126, "a program copied to /tmp ran: {stderr}");
    assert_eq!(value("exec-shm"), 126, "a program copied to /dev/shm ran: {stderr}");
    assert_ne!(value("dev"), 0, "a file was made in /dev: {stderr}");
    assert!(!stderr.contains("survived"), "400 MiB fitted in program-memory-mib = 48: {stderr}");
    assert_eq!(value("hog"), 137, "the hog was killed (SIGKILL) and the shell, in the same group, went on: {stderr}");
}

/// `sh -c 'sleep & exit'` (as `qemu -daemonize` does): the spawned child's
/// program exits at once, but its record stays running while its sandbox
/// has a process, and stopping the provider's children (what a removal
/// does) leaves no process of its user.
#[tokio::test]
async fn a_child_that_leaves_processes_behind_lives_until_its_sandbox_is_empty() {
    if !root_only() {
        return;
    }
    let (_dir, kv, provider, backend) = shell_provider("hostile-daemonize", "");
    let name = "hostile-daemonize";
    let uid = broker_capabilities::sandbox::Sandbox::default().uid_for(name).unwrap();
    kv.set(name, "mode", b"write").unwrap();
    kv.set(name, "write-path", b"bg.sh").unwrap();
    kv.set(name, "write-bytes", b"sleep 600 &\nexit 0\n").unwrap();
    provider.all_instances(&CallHooks::default()).await.unwrap();
    kv.set(name, "mode", b"spawn").unwrap();
    kv.set(name, "exec", b"sh\0/data/bg.sh").unwrap();
    kv.set(name, "spawn-name", b"bg").unwrap();
    assert_eq!(provider.all_instances(&CallHooks::default()).await.unwrap()[0].id, "spawned");

    let record = backend.adopt(name, "bg").await.unwrap().expect("recorded");
    // The shell is gone within moments; its sleep is not.
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while broker_capabilities::rooms::process::proc_stat(record.pid)
        .is_some_and(|(s, state)| s == record.start_time && state != 'Z')
    {
        assert!(std::time::Instant::now() < until, "the spawned shell never exited");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    backend.liveness(&record); // reaps the handle's status
    assert!(record.sandbox.is_some(), "bubblewrap said which process holds the sandbox");
    assert_eq!(
        backend.liveness(&record),
        broker_capabilities::rooms::process::Liveness::Running,
        "the record outlived the processes it stands for"
    );
    assert!(!processes_of(uid).is_empty(), "the sleep runs as the provider's user");

    let stopped =
        broker_capabilities::rooms::process::stop_children(&*backend, name, std::time::Duration::from_secs(1))
            .await
            .unwrap();
    assert_eq!(stopped, 1);
    let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !processes_of(uid).is_empty() {
        assert!(std::time::Instant::now() < until, "left running: {:?}", processes_of(uid));
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(backend.children(name).unwrap().is_empty(), "its record went with it");
}
