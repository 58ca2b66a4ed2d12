//! The CLI with a daemon serving on its data dir: every command goes through
//! the daemon's API and prints what it prints without one.

use crate::common::{Daemon, broker};
use serde_json::Value;
use std::path::Path;
use std::process::Command;

/// What a command printed: exit code, stdout, stderr.
fn run(data_dir: &Path, args: &[&str]) -> (i32, String, String) {
    let out = broker(data_dir, args);
    let text = |bytes: Vec<u8>| String::from_utf8(bytes).unwrap();
    (out.status.code().unwrap(), text(out.stdout), text(out.stderr))
}

/// `text` as JSON without `added` and `created`: when something was added or
/// started, the only fields that differ between two runs.
fn without_times(text: &str) -> Value {
    fn strip(value: &mut Value) {
        match value {
            Value::Object(map) => {
                map.remove("added");
                map.remove("created");
                map.values_mut().for_each(strip);
            }
            Value::Array(items) => items.iter_mut().for_each(strip),
            _ => {}
        }
    }
    let mut value: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"));
    strip(&mut value);
    value
}

#[test]
fn every_command_prints_the_same_through_a_daemon_as_without_one() {
    let embedded = tempfile::tempdir().unwrap();
    let served = tempfile::tempdir().unwrap();
    let daemon = Daemon::start(served.path());
    let manifest = guest_artifacts::manifest("fake").display().to_string();
    let next = guest_artifacts::wasm("fake_next").display().to_string();

    let same = |args: &[&str]| {
        let alone = run(embedded.path(), args);
        let through = run(served.path(), args);
        assert_eq!(alone, through, "broker {args:?} alone vs through the daemon");
        alone
    };
    assert_eq!(same(&["provider", "add", &manifest]).0, 0);
    assert!(same(&["provider", "list"]).1.contains("fake"));
    let listed = |dir: &Path| without_times(&run(dir, &["provider", "list", "--json"]).1);
    assert_eq!(listed(embedded.path()), listed(served.path()));
    let (code, started, progress) =
        same(&["instance", "start", "--provider", "fake", "--constraints", "mem=2G cores=2"]);
    assert_eq!(code, 0, "{progress}");
    assert_eq!(started, "started fake-0 (fake): arch=amd64 cores=2 mem=2048M availability-zone=zone-a\n");
    assert_eq!(progress, "[fake] allocating: allocating instance\n[fake] running\n", "status lines as they came");

    // --json: the record on stdout, the API's status lines on stderr.
    let args = ["instance", "start", "--provider", "fake", "--placement", "zone=zone-c", "--json"];
    let (alone, through) = (run(embedded.path(), &args), run(served.path(), &args));
    assert_eq!((alone.0, through.0), (0, 0), "{} / {}", alone.2, through.2);
    assert_eq!(without_times(&alone.1), without_times(&through.1));
    assert_eq!(without_times(&through.1)["hardware"]["availability-zone"], "zone-c");
    assert_eq!(alone.2, through.2);
    let statuses: Vec<Value> = through.2.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(
        statuses[0],
        serde_json::json!({"event": "status", "status": "allocating", "info": "allocating instance", "data": []})
    );

    // User data, tags and the whole params, from files, the same both ways.
    let files = tempfile::tempdir().unwrap();
    let (user_data, params) = (files.path().join("user-data"), files.path().join("params.json"));
    std::fs::write(&user_data, "#cloud-config\nhostname: m3\n").unwrap();
    std::fs::write(
        &params,
        r#"{"placement": "zone=zone-b", "instance_config": {"machine_id": "3", "tags": [["team", "red"]]}}"#,
    )
    .unwrap();
    let (user_data, params) = (user_data.display().to_string(), params.display().to_string());
    let args = ["instance", "start", "--provider", "fake", "--params", &params, "--user-data", &user_data];
    let args = [&args[..], &["--tag", "team=blue", "--tag", "env=ci", "--json"]].concat();
    let (alone, through) = (run(embedded.path(), &args), run(served.path(), &args));
    assert_eq!((alone.0, through.0), (0, 0), "{} / {}", alone.2, through.2);
    assert_eq!(without_times(&alone.1), without_times(&through.1));
    let started = without_times(&through.1);
    assert_eq!(started["hardware"]["availability-zone"], "zone-b", "{started}");
    assert_eq!(started["instance-tags"], serde_json::json!({"env": "ci", "team": "blue"}), "{started}");
    for (bad, needle) in [
        (vec!["--params", "/nonexistent/params.json"], "--params /nonexistent/params.json"),
        (vec!["--params", &user_data], "not JSON"),
        (vec!["--tag", "novalue"], "is not KEY=VALUE"),
        (vec!["--user-data", "/dev/zero"], "not a regular file"),
    ] {
        let args = [&["instance", "start", "--provider", "fake"][..], &bad[..]].concat();
        let (code, _, error) = same(&args);
        assert_eq!(code, 2, "{bad:?}: {error}");
        assert!(error.contains(needle), "{bad:?}: {error}");
    }
    std::fs::write(files.path().join("typo.json"), r#"{"instance_config": {"machine": "3"}}"#).unwrap();
    let typo = files.path().join("typo.json").display().to_string();
    let (code, _, error) = same(&["instance", "start", "--provider", "fake", "--params", &typo]);
    assert_eq!(code, 2, "{error}");
    assert!(error.contains("unknown field instance_config.machine"), "{error}");
    // The API refuses the same, as a bad request.
    let body = br#"{"provider": "fake", "params": {"placment": "x"}}"#;
    let (status, answer) = daemon.request("POST", "/v1/instances", Some(body));
    assert_eq!(status, 400, "{answer}");
    assert!(answer.contains("unknown field placment"), "{answer}");
    assert_eq!(same(&["instance", "stop", "fake-2"]).0, 0);

    assert!(same(&["instance", "list"]).1.contains("zone-c"));
    assert_eq!(same(&["instance", "maintain", "fake-0"]).1, "maintained fake-0 (fake)\n");
    // Idempotent, as Juju's StopInstances: the known ids are stopped, an unknown
    // one (never started, or stopped already) is reported, and the command succeeds.
    let (code, stopped, _) = same(&["instance", "stop", "fake-0", "nosuch", "fake-1"]);
    assert_eq!(code, 0, "{stopped}");
    assert_eq!(
        stopped,
        "stopped fake-0 (fake)\nstopped fake-1 (fake)\nnosuch: no such instance, recorded or reported by a provider (nothing to stop)\n"
    );
    assert_eq!(same(&["instance", "stop", "fake-0"]).0, 0, "stopped a second time");
    assert_eq!(same(&["instance", "stop", "--provider", "fake", "fake-7"]).0, 0, "unknown ids are fine");
    assert_eq!(same(&["instance", "list", "--json"]).1, "[]\n");
    let swapped = same(&["provider", "swap", "fake", &next]);
    assert!(swapped.1.starts_with("swapped provider fake: 0.1.0 ("), "{swapped:?}");

    // Failures: the same message and the same exit code, its kind's; a usage
    // error is caught before any call, exit 2.
    let (code, _, error) = same(&["instance", "maintain", "never-started"]);
    assert_eq!(code, 4, "{error}");
    assert!(error.contains("never-started"), "{error}");
    assert_eq!(same(&["provider", "show", "nonesuch"]).0, 4);
    let (code, json, _) = same(&["instance", "start", "--provider", "nonesuch", "--json"]);
    assert_eq!(code, 4);
    let json: Value = serde_json::from_str(&json).unwrap();
    assert_eq!((&json["error"]["kind"], &json["error"]["provider"]), (&"unknown-provider".into(), &"nonesuch".into()));
    // A start the provider refuses: its kind, provider and method, both ways.
    let (code, json, _) = same(&["instance", "start", "--provider", "fake", "--placement", "zone=mars", "--json"]);
    assert_eq!(code, 3, "{json}");
    let error = serde_json::from_str::<Value>(&json).unwrap()["error"].clone();
    assert_eq!(
        (&error["kind"], &error["provider"], &error["method"]),
        (&"invalid-params".into(), &"fake".into(), &"start-instance".into())
    );
    assert_eq!(same(&["instance", "start", "--provider", "fake", "--constraints", "mem=lots"]).0, 2);
    let (code, _, error) = same(&["provider", "swap", "fake", "/nonexistent/x.wasm"]);
    assert_eq!(code, 3, "{error}");
    assert!(error.contains("/nonexistent/x.wasm"), "{error}");

    // `show` is the same but for the crash policy's state, which only a daemon has.
    // (A swapped-in component is kept in the data dir, which differs.)
    let shown = |dir: &Path| run(dir, &["provider", "show", "fake"]).1.replace(&dir.display().to_string(), "DATA");
    let (alone, through) = (shown(embedded.path()), shown(served.path()));
    assert!(alone.contains("component:  DATA/components/fake-"), "{alone}");
    assert_eq!(through, format!("{alone}breaker:    closed (0 trips)\n"));
    let shown: Value = serde_json::from_str(&run(served.path(), &["provider", "show", "fake", "--json"]).1).unwrap();
    assert_eq!(shown["breaker"], serde_json::json!({"half-open": false, "trips": 0}));
    assert_eq!(shown["version"], "0.2.0");

    // The daemon did the work: its event log is the one the CLI reads, and it is the log of this data dir.
    let kinds = |dir: &Path| -> Vec<String> {
        let out = run(dir, &["events", "--json"]).1;
        out.lines().map(|l| serde_json::from_str::<Value>(l).unwrap()["kind"].as_str().unwrap().to_owned()).collect()
    };
    assert_eq!(kinds(served.path()), kinds(embedded.path()));
    let (_, events) = daemon.json("GET", "/v1/events", None);
    assert_eq!(events.as_array().unwrap().len(), kinds(served.path()).len());
}

#[test]
fn a_daemon_that_died_leaves_a_socket_the_cli_sees_through() {
    let dir = tempfile::tempdir().unwrap();
    let manifest = guest_artifacts::manifest("fake").display().to_string();
    {
        let daemon = Daemon::start(dir.path());
        assert_eq!(run(dir.path(), &["provider", "add", &manifest]).0, 0);
        // While it serves, the state is the daemon's: a second daemon is refused, by name.
        let (code, _, error) = run(dir.path(), &["serve"]);
        assert_eq!(code, 1);
        assert!(error.contains("another broker daemon is serving on"), "{error}");
        assert!(daemon.socket.exists());
    } // SIGKILL: no chance to remove its socket
    assert!(dir.path().join("broker.sock").exists());
    let (code, listed, error) = run(dir.path(), &["provider", "list"]);
    assert_eq!(code, 0, "{error}");
    assert!(listed.contains("fake"), "{listed}");
    let (code, started, error) = run(dir.path(), &["instance", "start", "--provider", "fake"]);
    assert_eq!(code, 0, "{error}");
    assert!(started.starts_with("started fake-0"), "{started}");
}

#[test]
fn socket_names_a_daemon_serving_elsewhere() {
    let data = tempfile::tempdir().unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let socket = elsewhere.path().join("api.sock");
    let socket_arg = socket.display().to_string();
    let mut daemon = Command::new(env!("CARGO_BIN_EXE_broker"))
        .args(["--data-dir", &data.path().display().to_string(), "serve", "--socket", &socket_arg])
        .env_remove("RUST_LOG")
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let waited = std::time::Instant::now();
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        assert!(waited.elapsed() < std::time::Duration::from_secs(30), "no daemon on {socket_arg}");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let manifest = guest_artifacts::manifest("fake").display().to_string();
    // A CLI pointed at another (empty) data dir but at this socket talks to this daemon.
    let other = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_broker"))
        .args(["--data-dir", &other.path().display().to_string(), "provider", "add", &manifest])
        .env("BROKER_SOCKET", &socket)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    daemon.kill().unwrap();
    daemon.wait().unwrap();
    crate::common::detach_mounts_under(data.path());
    // Registered in the daemon's data dir, not in the one the CLI was given.
    assert!(!other.path().join("state.redb").exists());
    let (code, listed, _) = run(data.path(), &["provider", "list"]);
    assert_eq!(code, 0);
    assert!(listed.contains("fake"), "{listed}");
}

#[test]
fn a_daemon_that_cannot_listen_says_so_and_exits() {
    let data = tempfile::tempdir().unwrap();
    let mut daemon = Command::new(env!("CARGO_BIN_EXE_broker"))
        .args(["--data-dir", &data.path().display().to_string(), "serve", "--socket", "/nonexistent-dir/broker.sock"])
        .env_remove("RUST_LOG")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let waited = std::time::Instant::now();
    let status = loop {
        if let Some(status) = daemon.try_wait().unwrap() {
            break status;
        }
        if waited.elapsed() > std::time::Duration::from_secs(30) {
            daemon.kill().unwrap();
            panic!("the daemon kept running without its socket (the directory watcher held it up)");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let mut error = String::new();
    std::io::Read::read_to_string(&mut daemon.stderr.take().unwrap(), &mut error).unwrap();
    assert_eq!(status.code(), Some(1));
    assert!(error.contains("cannot listen on /nonexistent-dir/broker.sock"), "{error}");
}

/// The compile limits are the process's that compiles: with a daemon
/// answering, `provider add` is compiled by the daemon within its own
/// limits, and the CLI says that the flags given on its command line were
/// not applied (here a 16 MiB budget, which the fake's compile exceeds alone).
#[test]
fn compile_flags_given_to_a_command_a_daemon_runs_are_said_not_applied() {
    let served = tempfile::tempdir().unwrap();
    let _daemon = Daemon::start(served.path());
    let manifest = guest_artifacts::manifest("fake").display().to_string();
    let (code, added, said) = run(served.path(), &["--compile-memory-mib", "16", "provider", "add", &manifest]);
    assert_eq!(code, 0, "{said}");
    assert!(added.contains("added provider fake"), "{added}");
    assert!(
        said.contains("warning: --compile-memory-mib is not applied: the daemon on ")
            && said.contains("compiles components with the limits it was started with (give them to `broker serve`)"),
        "{said}"
    );
    // After the subcommand too, both named.
    let next = guest_artifacts::wasm("fake_next").display().to_string();
    let args = ["provider", "swap", "fake", &next, "--compile-memory-mib", "16", "--compile-timeout", "1m"];
    let (code, _, said) = run(served.path(), &args);
    assert_eq!(code, 0, "{said}");
    assert!(said.contains("warning: --compile-memory-mib and --compile-timeout are not applied"), "{said}");
    // Commands that compile nothing say nothing of it, nor do the variables,
    // which may be set in this shell for the daemon itself.
    let (code, _, said) = run(served.path(), &["--compile-timeout", "10s", "provider", "list"]);
    assert_eq!((code, said.as_str()), (0, ""));
    let back = guest_artifacts::wasm("fake").display().to_string();
    let out = crate::common::broker_command(served.path(), &["provider", "swap", "fake", &back])
        .env("BROKER_COMPILE_TIMEOUT", "10s")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && !said.contains("not applied"), "{said}");
}
