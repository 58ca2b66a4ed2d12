//! Quotas: what a hostile guest can make the host hold outside its own linear
//! memory is bounded, each bound refuses with an error naming it and counts
//! the refusal, and a bystander provider in the same host keeps answering.

use broker_capabilities::quotas::Quota;
use broker_capabilities::rooms::context::{
    CallEvent, CallHooks, MAX_STATUS_DATA_BYTES, MAX_STATUS_ENTRIES, MAX_STATUS_VALUE_BYTES,
};
use broker_capabilities::rooms::kv::{KvBackend, MemoryKv};
use broker_core::manifest::Method;
use broker_core::runtime::Runtime;
use broker_core::store::EventKind;
use broker_core::version::method_stats::Outcome;
use broker_core::version::{CallError, ProviderVersion};
use broker_tests::{fake_manifest_extra, load_provider, runtime};
use std::sync::{Arc, Mutex};
use std::time::Duration;

struct Attack {
    _dir: tempfile::TempDir,
    kv: Arc<MemoryKv>,
    hostile: Arc<ProviderVersion>,
    bystander: ProviderVersion,
}

/// A hostile provider with `limits` added to its `[limits]` and `grants` to
/// its `[grants]`, and the fake beside it in the same runtime.
fn attack(limits: &str, grants: &str) -> Attack {
    attack_with(limits, "5s", grants)
}

/// As [`attack`], every method's deadline `deadline`.
fn attack_with(limits: &str, deadline: &str, grants: &str) -> Attack {
    let dir = tempfile::tempdir().unwrap();
    let kv = Arc::new(MemoryKv::default());
    let runtime: Arc<Runtime> = runtime();
    let extra = format!(
        "[limits]\nmemory-mib = 64\n{limits}\n[limits.deadlines]\ndefault = \"{deadline}\"\n[grants]\nkv = true\n{grants}\n"
    );
    let hostile = load_provider(&runtime, kv.clone(), dir.path(), "hostile", "test-hostile", &extra).expect("load");
    let bystander =
        load_provider(&runtime, kv.clone(), dir.path(), "fake", "fake", &fake_manifest_extra("pooled")).expect("load");
    Attack { _dir: dir, kv, hostile: Arc::new(hostile), bystander }
}

impl Attack {
    fn set(&self, key: &str, value: impl ToString) {
        self.kv.set("hostile", key, value.to_string().as_bytes()).unwrap();
    }

    async fn bystander_answers(&self) {
        self.bystander.all_instances(&CallHooks::default()).await.expect("the bystander answers");
    }

    fn refused(&self, quota: Quota) -> u64 {
        self.hostile.stats().quotas.count(quota)
    }
}

#[tokio::test]
async fn status_data_is_bounded_in_each_copy_and_in_what_the_host_keeps() {
    let a = attack("", "");
    // Six entries naming one 20 MiB string: 120 MiB for the host to copy.
    a.set("mode", "status-flood");
    a.set("flood-bytes", 20 << 20);
    a.set("flood-entries", 6);
    a.set("flood-calls", 40);
    let err = a.hostile.all_instances(&CallHooks::default()).await.unwrap_err();
    assert!(matches!(&err, CallError::Limit { limit, .. } if limit.contains("call-data-mib limit of 16 MiB")), "{err}");
    assert_eq!(a.refused(Quota::CallData), 1);
    a.bystander_answers().await;

    // Under the copy's bound: every status is kept, each cut to the host's bounds.
    a.set("flood-bytes", 100 << 10);
    a.set("flood-entries", 64);
    let events = Arc::new(Mutex::new(Vec::new()));
    let sink = events.clone();
    let hooks = CallHooks::with_events(move |event| sink.lock().unwrap().push(event));
    let answer = a.hostile.all_instances(&hooks).await.expect("a flood under the copy's bound is answered");
    assert_eq!(answer[0].id, "flooded");
    let events = std::mem::take(&mut *events.lock().unwrap());
    assert_eq!(events.len(), 40);
    for event in events.iter() {
        let CallEvent::Status { data, .. } = event else { panic!("{event:?}") };
        let bytes: usize = data.iter().map(|(k, v)| k.len() + v.len()).sum();
        assert!(
            data.len() <= MAX_STATUS_ENTRIES && bytes <= MAX_STATUS_DATA_BYTES,
            "{} entries, {bytes} bytes",
            data.len()
        );
        assert!(data.iter().all(|(_, v)| v.len() <= MAX_STATUS_VALUE_BYTES));
        assert!(!data.is_empty(), "what fits is kept");
    }
    // All 64 entries of each status were cut or left out.
    assert_eq!(a.refused(Quota::StatusData), 40 * 64);
    a.bystander_answers().await;
}

#[tokio::test]
async fn an_all_instances_answer_is_bounded_in_records_and_in_bytes() {
    let a = attack("max-records = 1000", "");
    a.set("mode", "records");
    a.set("flood-entries", 1000);
    assert_eq!(a.hostile.all_instances(&CallHooks::default()).await.expect("at the bound").len(), 1000);
    a.set("flood-entries", 1001);
    let err = a.hostile.all_instances(&CallHooks::default()).await.unwrap_err();
    assert!(
        matches!(&err, CallError::Limit { limit, .. } if limit.contains("max-records limit of 1000 instances per answer (1001 answered)")),
        "{err}"
    );
    assert_eq!(a.refused(Quota::Records), 1);

    // Pages that break the contract: more than asked for, a cursor that never moves.
    a.set("mode", "page-overrun");
    let err = a.hostile.all_instances(&CallHooks::default()).await.unwrap_err().to_string();
    assert!(err.contains("broke the contract: a page of 1001 instances, asked for at most 1000"), "{err}");
    a.set("mode", "same-cursor");
    let err = a.hostile.all_instances(&CallHooks::default()).await.unwrap_err().to_string();
    assert!(err.contains("the next page's cursor is the one it was asked with"), "{err}");

    // 200 records whose messages name one 1 MiB string: 200 MiB to copy.
    a.set("mode", "aliased-records");
    a.set("flood-entries", 200);
    a.set("flood-bytes", 1 << 20);
    let err = a.hostile.all_instances(&CallHooks::default()).await.unwrap_err();
    assert!(matches!(&err, CallError::Limit { limit, .. } if limit.contains("call-data-mib")), "{err}");
    assert_eq!(a.refused(Quota::CallData), 1);
    let all = a.hostile.stats().methods.get(Method::AllInstances);
    assert_eq!(all.outcome(Outcome::Limit), 2, "both counted as limits (and by the crash policy)");
    assert_eq!(all.outcome(Outcome::Trap), 2, "the broken pages");
    a.bystander_answers().await;
}

#[tokio::test]
async fn output_lines_past_the_log_rate_are_suppressed_and_counted() {
    // A burst of ten seconds' worth: 100 lines pass at once.
    let a = attack("log-lines-per-second = 10", "");
    a.set("mode", "log-flood");
    a.set("flood-entries", 5000);
    let answer = a.hostile.all_instances(&CallHooks::default()).await.expect("logging is never an error");
    assert_eq!(answer[0].id, "logged");
    let suppressed = a.refused(Quota::LogLines);
    // The call takes well under a second, so at most a few more tokens came back.
    assert!((4890..=4900).contains(&suppressed), "{suppressed} suppressed");
    // Past the log rate a trap still quotes its panic, and only this call's lines.
    a.set("mode", "trap");
    let err = a.hostile.all_instances(&CallHooks::default()).await.unwrap_err();
    let CallError::Trap { stderr, .. } = &err else { panic!("{err}") };
    assert!(stderr.iter().any(|line| line == "hostile guest traps on purpose"), "{stderr:?}");
    assert!(!stderr.iter().any(|line| line.starts_with("flood line")), "{stderr:?}");
    a.bystander_answers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_past_max_concurrent_calls_wait_then_are_refused_as_busy() {
    let a = attack("max-concurrent-calls = 2\nqueue-wait = \"100ms\"", "");
    a.set("mode", "loop");
    let spinners: Vec<_> = (0..2)
        .map(|_| {
            let hostile = a.hostile.clone();
            tokio::spawn(async move { hostile.all_instances(&CallHooks::default()).await })
        })
        .collect();
    while a.hostile.calls_running() < 2 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let err = a.hostile.all_instances(&CallHooks::default()).await.unwrap_err();
    assert!(matches!(&err, CallError::Busy { limit: 2, waited, .. } if *waited == Duration::from_millis(100)), "{err}");
    assert!(err.to_string().contains("max-concurrent-calls"), "{err}");
    assert_eq!(a.refused(Quota::Concurrency), 1);
    assert_eq!(a.hostile.stats().methods.get(Method::AllInstances).outcome(Outcome::Busy), 1);
    a.bystander_answers().await;
    for spinner in spinners {
        let stopped = spinner.await.unwrap().unwrap_err();
        assert!(matches!(stopped, CallError::Deadline { .. }), "{stopped}");
    }
    assert_eq!(a.hostile.calls_running(), 0, "a stopped call gives its slot back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_that_finds_a_slot_within_queue_wait_runs() {
    let a = attack_with("max-concurrent-calls = 1\nqueue-wait = \"30s\"", "300ms", "");
    a.set("mode", "loop");
    let hostile = a.hostile.clone();
    let first = tokio::spawn(async move { hostile.all_instances(&CallHooks::default()).await });
    while a.hostile.calls_running() < 1 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Waits for the first to be stopped, then runs (and is stopped in its turn).
    let second = a.hostile.all_instances(&CallHooks::default()).await.unwrap_err();
    assert!(matches!(second, CallError::Deadline { .. }), "it ran: {second}");
    assert!(first.await.unwrap().is_err());
    assert_eq!(a.refused(Quota::Concurrency), 0);
}

/// One provider whose `all-instances` fails (here: its answer is over
/// `max-records`) fails no other provider's listing: the others answer, and
/// its recorded instances show as unknown with its error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listing_every_provider_isolates_the_one_that_does_not_answer() {
    use broker_capabilities::contract::empty_params;
    use broker_core::broker::Broker;
    use broker_tests::write_manifest;

    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::open(&dir.path().join("data")).unwrap();
    broker.registry().add(&write_manifest(dir.path(), "fake", "fake", &fake_manifest_extra("pooled"))).await.unwrap();
    let hostile =
        write_manifest(dir.path(), "hostile", "test-hostile", "[limits]\nmax-records = 10\n[grants]\nkv = true\n");
    broker.registry().add(&hostile).await.unwrap();
    let hooks = CallHooks::default();
    let theirs = broker.start_instance("fake", &empty_params(), &hooks).await.unwrap().id;
    let kv = broker.store().kv();
    kv.set("hostile", "start-id", b"hostile-1").unwrap();
    broker.start_instance("hostile", &empty_params(), &hooks).await.unwrap();

    kv.set("hostile", "mode", b"records").unwrap();
    kv.set("hostile", "flood-entries", b"11").unwrap();
    let listed = broker.list_instances(None).await.expect("listing all answers");
    let fake = listed.iter().find(|r| r.id == theirs).expect("the fake's instance is listed");
    assert_eq!(fake.status, "running");
    let hostile = listed.iter().find(|r| r.id == "hostile-1").expect("the hostile's record is listed");
    assert_eq!(hostile.status, "unknown");
    assert!(hostile.message.starts_with("provider hostile did not answer: "), "{}", hostile.message);
    assert!(hostile.message.contains("max-records limit of 10"), "{}", hostile.message);
    // Asked alone, its failure is the answer (the CLI then shows the listing of all's view of it).
    assert!(broker.list_instances(Some("hostile")).await.is_err());

    // Reconciling every provider: the failing one is reported by name, the fake is reconciled.
    let reconciled = broker.reconcile().await;
    let of = |name: &str| reconciled.iter().find(|r| r.provider == name).unwrap();
    assert!(
        of("hostile").error.as_deref().is_some_and(|e| e.contains("max-records limit of 10")),
        "{:?}",
        of("hostile")
    );
    assert_eq!(of("fake").error, None);
    assert!(of("fake").vanished.is_empty() && of("fake").unknown_to_host.is_empty(), "{:?}", of("fake"));
    assert_eq!(of("fake").summary(), "maintained 1");
}

#[tokio::test]
async fn a_kv_namespace_is_held_to_its_keys_and_bytes() {
    let a = attack("kv-mib = 1", "");
    a.set("mode", "kv-flood");
    a.set("flood-bytes", 65536);
    let answer = a.hostile.all_instances(&CallHooks::default()).await.expect("a refused set is the guest's to handle");
    // 15 values of 64 KiB and their keys fit in 1 MiB; the 16th does not.
    assert_eq!(answer[0].id, "refused-after-15");
    assert!(answer[0].message.starts_with("KvError::QuotaExceeded(") || answer[0].message.contains("QuotaExceeded"));
    assert!(answer[0].message.contains("past its kv-mib limit of 1 MiB"), "{}", answer[0].message);
    assert_eq!(a.refused(Quota::KvBytes), 1);
    assert_eq!(a.kv.get("hostile", "flood/15").unwrap(), None, "nothing of the refused change was kept");

    let a = attack("kv-keys = 10", "");
    a.set("mode", "kv-flood");
    a.set("flood-bytes", 1);
    let answer = a.hostile.all_instances(&CallHooks::default()).await.unwrap();
    // `mode` and `flood-bytes` are two of the ten.
    assert_eq!(answer[0].id, "refused-after-8");
    assert!(answer[0].message.contains("kv-keys limit"), "{}", answer[0].message);
    assert_eq!(a.refused(Quota::KvKeys), 1);
    a.bystander_answers().await;
}

/// Compare-and-swap and transactions (contract 0.3.0), through the guest's
/// imports: each answers whether it applied, and a failed check writes nothing.
#[tokio::test]
async fn kv_compare_and_swap_and_transactions_apply_whole_or_not_at_all() {
    let a = attack("", "");
    a.set("mode", "kv-cas");
    let answer = a.hostile.all_instances(&CallHooks::default()).await.unwrap();
    assert_eq!(answer[0].message, "[true, false, false, true, true, false, false, true] [Some([51]), None, None]");
}

/// Each provider version reserves its calls at once and its warm pool out of
/// the engine's instance slots while it is loaded: one provider cannot take
/// another's, and a load past what is free is refused, naming the limits.
#[tokio::test]
async fn instance_slots_are_reserved_per_provider_and_a_load_past_them_is_refused() {
    use broker_core::runtime::{INSTANCE_SLOTS, RuntimeError};
    use broker_core::version::LoadError;
    let dir = tempfile::tempdir().unwrap();
    let kv = Arc::new(MemoryKv::default());
    let runtime = runtime();
    let extra = "[limits]\nmax-concurrent-calls = 128\npool-size = 4\n[grants]\nkv = true\n";
    let load = |name: &str| load_provider(&runtime, kv.clone(), dir.path(), name, "test-hostile", extra);
    let mut loaded: Vec<_> = ["a", "b", "c"].into_iter().map(|name| load(name).expect("fits")).collect();
    assert_eq!(runtime.free_slots(), INSTANCE_SLOTS - 3 * 132);
    let Err(refused) = load("d") else { panic!("a fourth fitted") };
    assert!(matches!(&refused, LoadError::Runtime(RuntimeError::NoSlots { wanted: 132, free: 116, .. })), "{refused}");
    assert!(refused.to_string().contains("max-concurrent-calls and pool-size"), "{refused}");
    loaded.pop();
    assert_eq!(runtime.free_slots(), INSTANCE_SLOTS - 2 * 132, "an unloaded version gives its slots back");
    load("d").expect("fits once one is gone");
}

/// Whether a process runs `sleep` (by any path) with exactly `arg`.
fn sleeping(arg: &str) -> bool {
    std::fs::read_dir("/proc").unwrap().flatten().any(|entry| {
        std::fs::read(entry.path().join("cmdline")).is_ok_and(|cmdline| {
            let words: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
            words.len() == 3 && words[0].ends_with(b"sleep") && words[1] == arg.as_bytes()
        })
    })
}

/// Nothing of a removed provider runs on: the children it spawned are stopped
/// with it (TERM, then KILL), and the event says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_providers_children_are_stopped() {
    use broker_core::broker::Broker;
    use broker_tests::write_manifest;

    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::open(&dir.path().join("data")).unwrap();
    let grants = "[grants]\nkv = true\nprocess = [\"sleep\"]\n";
    broker.registry().add(&write_manifest(dir.path(), "hostile", "test-hostile", grants)).await.unwrap();
    let kv = broker.store().kv();
    // An argument no other process has: how the test finds the child.
    let arg = format!("600.{}", std::process::id());
    kv.set("hostile", "mode", b"spawn").unwrap();
    kv.set("hostile", "exec", format!("sleep\0{arg}").as_bytes()).unwrap();
    kv.set("hostile", "spawn-name", b"left-behind").unwrap();
    let listed = broker.list_instances(Some("hostile")).await.unwrap();
    assert_eq!(listed[0].id, "spawned");
    let began = std::time::Instant::now();
    while !sleeping(&arg) {
        assert!(began.elapsed() < Duration::from_secs(15), "the child never ran");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    broker.registry().remove("hostile").await.unwrap();
    let began = std::time::Instant::now();
    while sleeping(&arg) {
        assert!(began.elapsed() < Duration::from_secs(15), "the removed provider's child still runs");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let removed = broker.store().events(0, 100).unwrap().into_iter().find(|e| e.kind == EventKind::Removed).unwrap();
    assert!(removed.detail.contains("1 child process(es) it left running stopped"), "{removed:?}");
}

/// A listing past `max-records` is refused, each time, as a limit, but it
/// never trips the breaker, however low its threshold: the provider is not
/// failing, and a half-open one would refuse the stops that bring it back
/// within its bound.
#[tokio::test]
async fn a_listing_past_max_records_is_refused_without_tripping_the_breaker() {
    let a = attack("max-records = 10\nbreaker-failures = 1", "");
    a.set("mode", "records");
    a.set("flood-entries", 11);
    for _ in 0..3 {
        let refused = a.hostile.all_instances(&CallHooks::default()).await.unwrap_err();
        assert!(
            matches!(&refused, CallError::Limit { limit, .. } if limit.contains("max-records limit of 10")),
            "{refused}"
        );
    }
    assert_eq!(a.hostile.breaker_state(), (false, 0), "a read-only limit tripped the breaker");
    a.hostile.stop_instances(&CallHooks::default(), &["any".to_owned()]).await.unwrap();
    a.bystander_answers().await;
}

/// Two hostile providers, `modes` of each in kv, on a runtime with one turn
/// of executor time for long-running guests (as a 2-core host has); each call's deadline `deadline`.
fn turn_takers(
    names: [&str; 2],
    modes: [&str; 2],
    deadline: &str,
) -> (tempfile::TempDir, Arc<Runtime>, [Arc<ProviderVersion>; 2]) {
    let dir = tempfile::tempdir().unwrap();
    let kv = Arc::new(MemoryKv::default());
    let runtime = Runtime::with_guest_turns(None, 1).expect("engine");
    let extra =
        format!("[limits]\nmemory-mib = 64\n[limits.deadlines]\ndefault = \"{deadline}\"\n[grants]\nkv = true\n");
    let providers = [0, 1].map(|i| {
        kv.set(names[i], "mode", modes[i].as_bytes()).unwrap();
        let loaded = load_provider(&runtime, kv.clone(), dir.path(), names[i], "test-hostile", &extra).expect("load");
        Arc::new(loaded)
    });
    (dir, runtime, providers)
}

/// `n` calls of `all-instances` at once, answering how many records each got.
fn spawn_calls(provider: &Arc<ProviderVersion>, n: usize) -> Vec<tokio::task::JoinHandle<Result<usize, CallError>>> {
    (0..n)
        .map(|_| {
            let provider = provider.clone();
            tokio::spawn(async move { provider.all_instances(&CallHooks::default()).await.map(|answer| answer.len()) })
        })
        .collect()
}

async fn all_stopped_at_their_deadlines(calls: Vec<tokio::task::JoinHandle<Result<usize, CallError>>>) {
    for call in calls {
        let stopped = call.await.unwrap().unwrap_err();
        assert!(matches!(stopped, CallError::Deadline { .. }), "{stopped}");
    }
}

fn turns(provider: &ProviderVersion) -> u64 {
    provider.stats().turns.load(std::sync::atomic::Ordering::Relaxed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_running_guests_of_two_providers_take_turns_however_many_calls_each_has() {
    let (_dir, runtime, [many, lone]) = turn_takers(["many", "lone"], ["loop", "loop"], "600ms");
    let mut calls = spawn_calls(&many, 8);
    calls.extend(spawn_calls(&lone, 1));
    all_stopped_at_their_deadlines(calls).await;
    let (many_turns, lone_turns) = (turns(&many), turns(&lone));
    // Taken in turn by provider, the lone call gets about half; by call, one in nine.
    assert!(many_turns > 0 && lone_turns > 0, "many took {many_turns} turns, lone {lone_turns}");
    assert!(
        lone_turns * 10 >= (many_turns + lone_turns) * 3,
        "the lone provider's call took {lone_turns} of {} turns",
        many_turns + lone_turns
    );
    assert_eq!(runtime.turnstile().held(), 0, "the calls gave their turns back as they ended");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_asleep_in_a_host_call_does_not_keep_the_turn_it_held() {
    // The sleeper spins 50 ms (taking turns), then sits in a timer past its deadline.
    let (_dir, runtime, [sleeper, spinner]) = turn_takers(["sleeper", "spinner"], ["spin-then-sleep", "loop"], "1s");
    let mut calls = spawn_calls(&sleeper, 1);
    calls.extend(spawn_calls(&spinner, 1));
    all_stopped_at_their_deadlines(calls).await;
    // Were the sleeper's turn kept through its sleep, the spinner would have
    // had only the turns of the sleeper's first 50 ms (~25 of ~1000 ticks).
    let (slept, spun) = (turns(&sleeper), turns(&spinner));
    assert!(slept > 0, "the sleeper ran long enough to take a turn");
    assert!(spun >= 100, "the spinner took {spun} turns while the other slept");
    assert_eq!(runtime.turnstile().held(), 0);
}

/// The finding 3 (2000 MiB written to `/data` in 4.7 s): a data dir
/// is a filesystem of `data-mib`, and the kernel holds to it whoever writes,
/// the guest through the host or a program it was granted.
#[tokio::test]
async fn a_data_dir_is_held_to_data_mib_by_the_guest_and_by_its_programs() {
    use broker_capabilities::data_fs::{DATA_IMAGES, DataFilesystems};
    use broker_core::runtime::HostCapabilities;
    use std::os::unix::fs::MetadataExt;
    if std::fs::metadata("/proc/self").unwrap().uid() != 0 {
        eprintln!("skipped: a data dir of its own needs root to mount");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let kv = Arc::new(MemoryKv::default());
    let filesystems = Arc::new(DataFilesystems::new(dir.path().join(DATA_IMAGES)));
    let caps = HostCapabilities {
        data_filesystems: Some(filesystems),
        ..broker_tests::host_capabilities(dir.path(), kv.clone())
    };
    let extra = "[limits]\nmemory-mib = 64\ndata-mib = 16\n[grants]\nkv = true\nprocess = [\"qemu-img\"]\n";
    let hostile =
        broker_tests::load_provider_with(&runtime(), caps, dir.path(), "hostile", "test-hostile", extra).unwrap();
    let hooks = CallHooks::default();

    kv.set("hostile", "mode", b"fill").unwrap();
    let answer = hostile.all_instances(&hooks).await.unwrap();
    let (written, refused) = answer[0].message.split_once(" MiB, then ").expect("the guest's report");
    let written: u64 = written.parse().unwrap();
    assert!((1..=16).contains(&written), "{written} MiB written into a 16 MiB data dir");
    // Through wasi's streams the guest's std sees an I/O error, not ENOSPC.
    assert_ne!(refused, "not refused", "the guest's writes were refused");

    // A granted program (its own user, in its own namespaces) meets the same bound.
    std::fs::remove_file(hostile.data_dir().join("fill")).unwrap();
    kv.set("hostile", "mode", b"exec").unwrap();
    let words = ["qemu-img", "create", "-f", "raw", "-o", "preallocation=full", "/data/big.raw", "64M"];
    kv.set("hostile", "exec", words.join("\0").as_bytes()).unwrap();
    let ran = hostile.all_instances(&hooks).await.unwrap();
    let stderr = String::from_utf8_lossy(&kv.get("hostile", "exec-stderr").unwrap().unwrap()).into_owned();
    assert_ne!(ran[0].id, "exit-0", "64 MiB fitted in a 16 MiB data dir");
    assert!(stderr.contains("space"), "{stderr}");
    let _ = std::fs::remove_file(hostile.data_dir().join("big.raw"));

    // Emptied, it takes writes again: the bound is on what it holds.
    kv.set("hostile", "mode", b"write").unwrap();
    kv.set("hostile", "write-path", b"small").unwrap();
    kv.set("hostile", "write-bytes", &vec![1u8; 1 << 20]).unwrap();
    assert_eq!(hostile.all_instances(&hooks).await.unwrap()[0].id, "written");
}

/// `scan` is refused past 16 MiB; `scan-page` reads a namespace of any size a
/// page at a time (the guest holds one page), and the SDK's `scan` pages too.
#[tokio::test]
async fn a_namespace_past_one_scan_is_read_a_page_at_a_time() {
    use broker_capabilities::rooms::kv::{MAX_SCAN_BYTES, MAX_VALUE_BYTES};
    let a = attack("kv-mib = 64", "");
    // 24 values of 1 MiB: past what one scan returns.
    for n in 0..24 {
        a.kv.set("hostile", &format!("big/{n:02}"), &vec![n as u8; MAX_VALUE_BYTES]).unwrap();
    }
    const { assert!(24 * MAX_VALUE_BYTES > MAX_SCAN_BYTES) };
    a.set("mode", "scan-pages");
    a.set("page-bytes", 3 << 20);
    let answer = a.hostile.all_instances(&CallHooks::default()).await.unwrap();
    let (paged, whole) = answer[0].message.split_once("; ").unwrap();
    assert_eq!(paged, format!("24 entries, {} bytes", 24 * MAX_VALUE_BYTES));
    assert!(whole.contains("TooLarge") && whole.contains("scan-page"), "{whole}");
}
