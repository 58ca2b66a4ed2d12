//! The `broker` binary end to end, on the bundled fake provider.

use crate::common::{broker, broker_command};
use serde_json::Value;
use sha2::Digest;
use std::path::Path;
use std::process::Command;

fn ok(data_dir: &Path, args: &[&str]) -> String {
    let out = broker(data_dir, args);
    assert!(out.status.success(), "broker {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn json(data_dir: &Path, args: &[&str]) -> Value {
    serde_json::from_str(&ok(data_dir, args)).expect("--json prints JSON")
}

/// The names of the files under `dir`, at any depth.
fn file_names(dir: &Path) -> Vec<String> {
    let mut names = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            names.extend(file_names(&path));
        } else {
            names.push(entry.file_name().to_string_lossy().into_owned());
        }
    }
    names
}

fn fake_manifest() -> String {
    guest_artifacts::manifest("fake").display().to_string()
}

#[test]
fn start_list_stop_maintain_through_the_fake_provider() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path();
    assert!(ok(data, &["provider", "add", &fake_manifest()]).contains("added provider fake"));
    // Compiled apart (a child of the binary) and kept, named by the component's hash.
    let sha256 = hex::encode(sha2::Sha256::digest(std::fs::read(guest_artifacts::wasm("fake")).unwrap()));
    let kept = file_names(&data.join("cache"));
    assert!(
        kept.iter().any(|n| n.starts_with(&sha256) && n.ends_with(".cwasm")),
        "the compiled component is kept on disk for the next run: {kept:?}"
    );
    let providers = json(data, &["provider", "list", "--json"]);
    assert_eq!(providers[0]["name"], "fake");
    let shown = json(data, &["provider", "show", "fake", "--json"]);
    assert_eq!(
        shown["grants"],
        serde_json::json!({
            "kv": true, "log": true, "machine-lock": false, "local-sockets": false, "process": [],
            "paths": [], "bridge-devices": [], "bridge-bridges": [], "bridge-attach-to": [], "http": []
        })
    );
    assert_eq!(shown["deadlines"][2], serde_json::json!(["start-instance", "10m"]));
    assert_eq!(shown["isolation"], "pooled");
    assert!(ok(data, &["provider", "show", "fake"]).contains("machine-lock       denied"));

    let out = broker(
        data,
        &[
            "instance",
            "start",
            "--provider",
            "fake",
            "--constraints",
            "mem=2G cores=2 arch=amd64 tags=a,b zones=zone-b",
            "--json",
        ],
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let progress = String::from_utf8_lossy(&out.stderr);
    let statuses: Vec<String> = progress
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap_or_else(|_| panic!("not a JSON line: {l}")))
        .map(|line| line["status"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(statuses, ["allocating", "running"], "--json: status updates as JSON lines on stderr");
    let started: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(started["id"], "fake-0");
    assert_eq!(started["provider"], "fake");
    assert_eq!(started["status"], "running");
    let hw = &started["hardware"];
    assert_eq!((hw["mem"].as_u64(), hw["cpu-cores"].as_u64()), (Some(2048), Some(2)));
    assert_eq!(hw["arch"], "amd64");
    assert_eq!(hw["availability-zone"], "zone-b");
    assert_eq!(hw["tags"], serde_json::json!(["a", "b"]));
    assert!(hw.get("root-disk").is_none(), "unknown hardware is absent, not null");

    let placed = json(data, &["instance", "start", "--provider", "fake", "--placement", "zone=zone-c", "--json"]);
    assert_eq!(placed["hardware"]["availability-zone"], "zone-c");

    let listed = json(data, &["instance", "list", "--json"]);
    let ids: Vec<&str> = listed.as_array().unwrap().iter().map(|i| i["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["fake-0", "fake-1"]);
    let table = ok(data, &["instance", "list"]);
    assert!(table.starts_with("ID") && table.contains("fake-1") && table.contains("zone-c"), "{table}");

    assert!(ok(data, &["instance", "maintain", "fake-0"]).contains("maintained fake-0"));
    assert!(ok(data, &["instance", "stop", "fake-0"]).contains("stopped fake-0"));
    let listed = json(data, &["instance", "list", "--provider", "fake", "--json"]);
    assert_eq!(listed.as_array().unwrap().len(), 1);
    // Stopping an id the provider never had is fine when the provider is named.
    ok(data, &["instance", "stop", "--provider", "fake", "fake-0"]);
}

#[test]
fn exit_codes_separate_usage_errors_from_failures() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path();
    assert_eq!(broker(data, &["instance", "frobnicate"]).status.code(), Some(2));
    assert_eq!(broker(data, &["--help"]).status.code(), Some(0));

    ok(data, &["provider", "add", &fake_manifest()]);
    let unknown_key = broker(data, &["instance", "start", "--provider", "fake", "--constraints", "colour=red"]);
    assert_eq!(unknown_key.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&unknown_key.stderr).contains("unknown constraint \"colour\""));
    let twice = broker(data, &["instance", "start", "--provider", "fake", "--constraints", "mem=1G mem=2G"]);
    assert_eq!(twice.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&twice.stderr).contains("\"mem\" constraint: already set"));

    // Each kind of error exits with its own code, and with --json is an object on stdout.
    let no_provider = broker(data, &["instance", "start", "--provider", "nope"]);
    assert_eq!(no_provider.status.code(), Some(4));
    assert!(String::from_utf8_lossy(&no_provider.stderr).contains("unknown provider \"nope\""));
    assert!(no_provider.stdout.is_empty(), "no JSON unless asked");
    let bad_zone = broker(data, &["instance", "start", "--provider", "fake", "--placement", "zone=mars", "--json"]);
    assert_eq!(bad_zone.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&bad_zone.stderr).contains("invalid params"));
    let error: Value = serde_json::from_slice(&bad_zone.stdout).expect("the error as JSON on stdout");
    let error = &error["error"];
    assert_eq!(
        (&error["kind"], &error["provider"], &error["method"]),
        (&"invalid-params".into(), &"fake".into(), &"start-instance".into())
    );
    assert!(error["message"].as_str().unwrap().contains("zone"), "{error}");
    // Stopping is idempotent (Juju's StopInstances): an unknown id is reported, not a failure.
    let unknown_instance = broker(data, &["instance", "stop", "fake-99"]);
    assert_eq!(unknown_instance.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&unknown_instance.stdout).contains("fake-99: no such instance, recorded or"));
}

#[test]
fn refuses_a_provider_with_instances_and_a_missing_manifest() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path();
    ok(data, &["provider", "add", &fake_manifest()]);
    ok(data, &["instance", "start", "--provider", "fake"]);
    let remove = broker(data, &["provider", "remove", "fake"]);
    assert_eq!(remove.status.code(), Some(5), "a conflict");
    assert!(String::from_utf8_lossy(&remove.stderr).contains("still has 1 recorded instance"));
    let missing = broker(data, &["provider", "add", "/nonexistent/provider.toml"]);
    assert_eq!(missing.status.code(), Some(3), "an invalid provider");
    ok(data, &["instance", "stop", "fake-0"]);
    ok(data, &["provider", "remove", "fake"]);
    assert_eq!(json(data, &["provider", "list", "--json"]), serde_json::json!([]));
}

/// The binary compiles apart (a child of itself): what the compiler says of
/// a component it refuses reaches the user as the compile error, the exit
/// code is an invalid provider's, and nothing is kept of it.
#[test]
fn a_component_the_compiler_child_refuses_is_named_and_nothing_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    // The wasm magic and a component's layer, then bytes no parser takes.
    let junk = dir.path().join("junk.wasm");
    std::fs::write(&junk, b"\0asm\x0d\0\x01\0\xff\xff\xff").unwrap();
    let manifest = dir.path().join("junk.toml");
    std::fs::write(&manifest, format!("name = \"junk\"\ncomponent = \"{}\"\n", junk.display())).unwrap();
    let added = broker(&data, &["provider", "add", &manifest.display().to_string()]);
    let said = String::from_utf8_lossy(&added.stderr);
    assert_eq!(added.status.code(), Some(3), "{said}");
    assert!(said.contains("cannot compile component") && said.contains("junk.wasm"), "{said}");
    assert!(!said.contains("__compile-component"), "the child's own arguments are not the user's business: {said}");
    assert_eq!(file_names(&data.join("cache")), Vec::<String>::new(), "nothing kept");
}

/// The compiler child is held to `--compile-memory-mib`: a compile past it
/// is refused with the limit named (not a hang, not the machine's memory),
/// nothing is kept of it, and the same component compiles within the default.
#[test]
fn a_compile_past_its_memory_is_refused_with_the_limit_named() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path();
    let started = std::time::Instant::now();
    let added = broker(data, &["--compile-memory-mib", "16", "provider", "add", &fake_manifest()]);
    let said = String::from_utf8_lossy(&added.stderr);
    assert_eq!(added.status.code(), Some(3), "{said}");
    assert!(said.contains("cannot compile component"), "{said}");
    assert!(said.contains("a compile may take 16 MiB: `--compile-memory-mib` allows more"), "{said}");
    assert!(!said.contains("RUST_BACKTRACE") && !said.contains("not applied"), "{said}");
    assert!(started.elapsed() < std::time::Duration::from_secs(60), "refused, not stuck: {:?}", started.elapsed());
    assert!(!file_names(&data.join("cache")).iter().any(|n| n.ends_with(".cwasm")), "nothing kept");
    assert!(ok(data, &["provider", "add", &fake_manifest()]).contains("added provider fake"));
}

/// A cache dir that cannot be written (here immutable) does not take the
/// compile into the CLI's own process: the child's limits still hold (a
/// compile past them is refused; before, the compile ran unbounded in the
/// process itself), and within them the child's artifact is loaded from
/// memory, kept nowhere, and the provider works.
#[test]
fn a_cache_that_cannot_keep_an_artifact_keeps_the_compile_apart_and_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    std::fs::set_permissions(&data, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let cache = data.join("cache");
    std::fs::create_dir(&cache).unwrap();
    std::fs::set_permissions(&cache, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let chattr = |flag: &str| Command::new("chattr").arg(flag).arg(&cache).status().unwrap().success();
    assert!(chattr("+i"), "chattr +i on {}", cache.display());
    let bounded = broker(&data, &["--compile-memory-mib", "16", "provider", "add", &fake_manifest()]);
    let added = broker(&data, &["provider", "add", &fake_manifest()]);
    let started = broker(&data, &["instance", "start", "--provider", "fake"]);
    assert!(chattr("-i"));
    let said = String::from_utf8_lossy(&bounded.stderr);
    assert_eq!(bounded.status.code(), Some(3), "{said}");
    assert!(said.contains("a compile may take 16 MiB"), "{said}");
    assert!(added.status.success(), "{}", String::from_utf8_lossy(&added.stderr));
    assert!(started.status.success(), "{}", String::from_utf8_lossy(&started.stderr));
    assert_eq!(file_names(&cache), Vec::<String>::new(), "nothing kept");
}

/// Kill the CLI with SIGKILL at many points of `instance start`: the state
/// always reopens, and every instance the host recorded exists in the
/// provider's kv (the provider writes first, the host records after).
#[test]
fn a_killed_start_leaves_the_state_consistent() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path();
    ok(data, &["provider", "add", &fake_manifest()]);
    for round in 0..24u64 {
        let mut child = broker_command(data, &["instance", "start", "--provider", "fake"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(round * 4));
        let _ = child.kill();
        let _ = child.wait();
    }
    let listed = json(data, &["instance", "list", "--json"]);
    for instance in listed.as_array().unwrap() {
        assert_ne!(instance["status"], "unknown", "every recorded instance is known to the provider: {instance}");
    }
    // And the host still works on that state.
    let started = json(data, &["instance", "start", "--provider", "fake", "--json"]);
    assert_eq!(started["status"], "running");
}

#[test]
fn provider_test_exits_zero_only_when_every_scenario_passes() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path();
    let fake = broker(
        data,
        &["provider", "test", guest_artifacts::wasm("fake").to_str().unwrap(), "--manifest", &fake_manifest()],
    );
    assert_eq!(fake.status.code(), Some(0), "{}", String::from_utf8_lossy(&fake.stdout));
    assert!(String::from_utf8_lossy(&fake.stdout).contains(" passed, 0 failed"));
    let hostile = broker(
        data,
        &["provider", "test", guest_artifacts::wasm("test-hostile").to_str().unwrap(), "--format", "json"],
    );
    assert_eq!(hostile.status.code(), Some(1));
    let report: Value = serde_json::from_slice(&hostile.stdout).unwrap();
    assert_eq!(report["provider"], "hostile");
    assert!(report["cases"].as_array().unwrap().iter().any(|c| c["passed"] == false));
    let junit = broker(
        data,
        &["provider", "test", guest_artifacts::wasm("test-hostile").to_str().unwrap(), "--format", "junit"],
    );
    assert_eq!(junit.status.code(), Some(1));
    let xml = String::from_utf8_lossy(&junit.stdout);
    let cases = report["cases"].as_array().unwrap();
    let skipped = cases.iter().filter(|c| c["skipped"] == true).count();
    let failed = cases.iter().filter(|c| c["passed"] == false).count() - skipped;
    assert!(xml.starts_with("<?xml") && xml.contains(&format!("failures=\"{failed}\"")), "{xml}");
    assert_eq!(xml.matches("<failure ").count(), failed);
    // What the hostile guest's failed start left unrun is skipped, and said so in both.
    assert_eq!(skipped, 7, "{report}");
    assert_eq!(xml.matches("<skipped ").count(), skipped);
    assert!(xml.contains(&format!("skipped=\"{skipped}\"")), "{xml}");
    // The JSON has the verdict and the totals; JUnit's testcases have unique names.
    assert_eq!(report["passed"], false);
    let totals = &report["totals"];
    assert_eq!(totals["cases"], cases.len());
    assert_eq!((totals["failed"].as_u64(), totals["skipped"].as_u64()), (Some(failed as u64), Some(skipped as u64)));
    assert_eq!(totals["passed"], cases.len() - failed - skipped);
    let names: Vec<&str> =
        xml.split("<testcase ").skip(1).filter_map(|case| case.split(" name=\"").nth(1)?.split('"').next()).collect();
    assert_eq!(names.len(), cases.len(), "{xml}");
    assert_eq!(
        names.iter().collect::<std::collections::BTreeSet<_>>().len(),
        names.len(),
        "a testcase name twice: {names:?}"
    );
    assert!(!data.join("state.redb").exists(), "a conformance run touches no host state");

    // The LXD and KVM providers on their shipped scripts: HTTP requests run in wasi:http's
    // own tasks, under the binary's log subscriber, while the kit traces the run under its own.
    for provider in ["lxd", "kvm"] {
        let manifest = guest_artifacts::manifest(provider).display().to_string();
        let wasm = guest_artifacts::wasm(provider).display().to_string();
        for verbose in [None, Some("-vv")] {
            let mut args = vec!["provider", "test", &wasm, "--manifest", &manifest, "--strict"];
            args.extend(verbose);
            let run = broker(data, &args);
            let report = String::from_utf8_lossy(&run.stdout);
            let stderr = String::from_utf8_lossy(&run.stderr);
            assert_eq!(run.status.code(), Some(0), "{provider} {verbose:?}: {report}{stderr}");
            assert!(report.contains("15 passed, 0 failed"), "{report}");
        }
    }
}

#[test]
fn provider_swap_replaces_the_component_and_the_event_log_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path();
    ok(data, &["provider", "add", &fake_manifest()]);
    let started = json(data, &["instance", "start", "--provider", "fake", "--json"]);
    let next = guest_artifacts::wasm("fake_next").display().to_string();
    let swapped = ok(data, &["provider", "swap", "fake", &next, "--check"]);
    assert!(swapped.starts_with("swapped provider fake: 0.1.0 (") && swapped.contains(") -> 0.2.0 ("), "{swapped}");
    assert!(swapped.contains("conformance passed"), "{swapped}");
    assert_eq!(json(data, &["provider", "show", "fake", "--json"])["version"], "0.2.0");
    // The instance started by 0.1.0 is there for 0.2.0: the state is the host's.
    let listed = json(data, &["instance", "list", "--json"]);
    assert_eq!(listed[0]["id"], started["id"]);
    assert_eq!(listed[0]["status"], "running");

    let garbage = data.join("garbage.wasm");
    std::fs::write(&garbage, b"not wasm").unwrap();
    let refused = broker(data, &["provider", "swap", "fake", garbage.to_str().unwrap()]);
    assert_eq!(refused.status.code(), Some(5), "a conflict: the version serving stays");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("refused; version 0.2.0 keeps serving"), "{stderr}");

    let events = ok(data, &["events"]);
    let kinds: Vec<&str> = events.lines().map(|l| l.split_whitespace().nth(2).unwrap()).collect();
    assert_eq!(kinds, ["added", "swapped", "swap-refused"], "{events}");
    assert!(events.lines().nth(1).unwrap().contains("0.1.0 (") && events.contains("-> 0.2.0 ("), "{events}");
    let last: Value = serde_json::from_str(ok(data, &["events", "--json", "--after", "2"]).trim()).unwrap();
    assert_eq!(last["kind"], "swap-refused");
    assert!(last["detail"].as_str().unwrap().contains("candidate ") && events.lines().count() == 3, "{last}");
    let kept = file_names(&data.join("components"));
    assert_eq!(kept.len(), 1, "only the swapped-in component is kept, not the refused one: {kept:?}");
}

/// Attack 4 of the sandbox issue, end to end: what a provider chose (here a
/// zone with a terminal title sequence and a newline, and an id with a screen
/// clear) reaches the terminal escaped, never as the bytes a terminal acts on.
#[test]
fn what_a_provider_chose_is_printed_escaped() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let manifest = dir.path().join("hostile.toml");
    let component = guest_artifacts::wasm("test-hostile");
    std::fs::write(
        &manifest,
        format!("name = \"hostile\"\ncomponent = \"{}\"\n[grants]\nkv = true\n", component.display()),
    )
    .unwrap();
    ok(&data, &["provider", "add", manifest.to_str().unwrap()]);
    let zone = "\x1b]0;pwned\x07zone-a\nforged-row";
    {
        let store = broker_core::store::Store::open(&data).unwrap();
        let kv = store.kv();
        use broker_capabilities::rooms::kv::KvBackend;
        kv.set("hostile", "start-id", b"hostile-1").unwrap();
        kv.set("hostile", "start-zone", zone.as_bytes()).unwrap();
    }
    let terminal_bytes = |text: &str| text.bytes().any(|b| b == 0x1b || b == 0x07);
    let started = ok(&data, &["instance", "start", "--provider", "hostile"]);
    let listed = ok(&data, &["instance", "list"]);
    for printed in [&started, &listed] {
        assert!(!terminal_bytes(printed), "{printed:?}");
        assert!(!printed.contains("\nforged-row"), "no forged row: {printed}");
    }
    assert!(listed.contains(r"\x1b]0;pwned\x07zone-a\nforged-row"), "shown escaped: {listed}");
    assert!(!listed.lines().any(|l| l.starts_with("forged-row")), "no forged row: {listed}");

    {
        let store = broker_core::store::Store::open(&data).unwrap();
        use broker_capabilities::rooms::kv::KvBackend;
        store.kv().set("hostile", "start-id", b"\x1b[2J\nhostile-2").unwrap();
    }
    let refused = broker(&data, &["instance", "start", "--provider", "hostile"]);
    assert_eq!(refused.status.code(), Some(7), "a bad answer from the provider");
    let stderr = String::from_utf8(refused.stderr).unwrap();
    assert!(!terminal_bytes(&stderr) && stderr.contains(r#""\x1b[2J\nhostile-2""#), "{stderr:?}");
}

/// F11: a relative `--data-dir` is the directory it names from where the
/// command runs (it was refused by the component cache: "path has to be absolute").
#[test]
fn a_relative_data_dir_works() {
    let dir = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_broker"))
            .current_dir(dir.path())
            .args(["--data-dir", "state"])
            .args(args)
            .env_remove("BROKER_SOCKET")
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    run(&["provider", "add", &fake_manifest()]);
    assert!(run(&["instance", "start", "--provider", "fake"]).contains("started fake-0"));
    assert!(dir.path().join("state/state.redb").is_file());
    assert!(
        ok(&dir.path().join("state"), &["instance", "list"]).contains("fake-0"),
        "the same state, named absolutely"
    );
}

/// F8/F9 through the binary: an empty state file is refused without a word
/// changed; a damaged one is refused with what to do, never a panic; `store
/// check` says what is wrong (exit 1) and `store recover` makes a store that
/// the next command opens.
#[test]
fn a_damaged_state_file_is_refused_checked_and_recovered() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path();
    let state = data.join("state.redb");
    std::fs::write(&state, b"").unwrap();
    let empty = broker(data, &["provider", "list"]);
    assert_eq!(empty.status.code(), Some(9), "the host's storage");
    assert!(String::from_utf8_lossy(&empty.stderr).contains("is empty (0 bytes)"), "{empty:?}");
    assert_eq!(std::fs::metadata(&state).unwrap().len(), 0);
    std::fs::remove_file(&state).unwrap();

    ok(data, &["provider", "add", &fake_manifest()]);
    ok(data, &["instance", "start", "--provider", "fake"]);
    assert_eq!(broker(data, &["store", "check"]).status.code(), Some(0), "a sound store");
    // Garbage over the file's header page: not a redb file any more.
    let mut bytes = std::fs::read(&state).unwrap();
    bytes[..64].fill(0x5a);
    std::fs::write(&state, &bytes).unwrap();
    let refused = broker(data, &["instance", "list"]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(9), "{stderr}");
    assert!(stderr.contains("is damaged") && stderr.contains("broker store recover"), "{stderr}");
    assert!(!stderr.contains("panicked at"), "{stderr}");
    let checked = broker(data, &["store", "check"]);
    assert_eq!(checked.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&checked.stdout).contains("cannot be opened"), "{checked:?}");

    let recovered = broker(data, &["store", "recover"]);
    assert_eq!(recovered.status.code(), Some(0), "{recovered:?}");
    let said = String::from_utf8_lossy(&recovered.stdout);
    assert!(said.contains("the damaged file is kept as") && said.contains("the new state file opens"), "{said}");
    // Nothing was readable, so the host starts over, and says so plainly.
    assert_eq!(json(data, &["provider", "list", "--json"]), serde_json::json!([]));
    assert!(file_names(data).iter().any(|name| name.starts_with("state.redb.damaged-")));
}

/// An instance the provider has but the host has no record of (its record
/// lost, or a crash between the start and the record) is stopped through the
/// provider that reports it.
#[test]
fn an_instance_without_a_record_is_stopped_through_the_provider_reporting_it() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path();
    ok(data, &["provider", "add", &fake_manifest()]);
    ok(data, &["instance", "start", "--provider", "fake"]);
    {
        let store = broker_core::store::Store::open(data).unwrap();
        store.remove_instances("fake", &["fake-0".to_owned()]).wait().unwrap();
    }
    let listed = json(data, &["instance", "list", "--json"]);
    assert_eq!(listed[0]["id"], "fake-0", "the provider still reports it: {listed}");
    assert!(ok(data, &["instance", "stop", "fake-0"]).contains("stopped fake-0 (fake)"));
    assert_eq!(json(data, &["instance", "list", "--json"]), serde_json::json!([]));
}

/// A command (or a daemon starting) waits for the state file another broker
/// process holds, instead of failing at once: a CLI call racing a supervisor's
/// restart of the daemon, or two commands at once.
#[test]
fn a_command_waits_for_the_state_another_process_holds() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path();
    ok(data, &["provider", "add", &fake_manifest()]);
    let held = broker_core::store::Store::open(data).unwrap();
    let waiting = broker_command(data, &["provider", "list", "--json"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(700));
    drop(held);
    let out = waiting.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let listed: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(listed[0]["name"], "fake");
}
