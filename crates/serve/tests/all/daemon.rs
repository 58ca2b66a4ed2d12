//! `broker serve` end to end: the real binary as a daemon, spoken to over its
//! unix socket with plain HTTP/1.1.

use crate::common::{Daemon, exchange, fake_manifest, request};
use serde_json::Value;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::time::{Duration, Instant};

#[test]
fn the_api_serves_providers_instances_swaps_events_and_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = Daemon::start(dir.path());
    assert_eq!(std::fs::metadata(&daemon.socket).unwrap().permissions().mode() & 0o777, 0o600);
    assert_eq!(daemon.request("GET", "/healthz", None), (200, "ok\n".to_owned()));

    let manifest = fake_manifest(dir.path(), "");
    let (status, added) = daemon.json("POST", "/v1/providers", Some(&format!("{{\"manifest\":\"{manifest}\"}}")));
    assert_eq!((status, added["name"].as_str()), (201, Some("fake")));

    // Start streams the provider's status lines as they come, then the record.
    let (status, stream) =
        daemon.request("POST", "/v1/instances", Some(br#"{"provider":"fake","constraints":"mem=2G cores=2"}"#));
    assert_eq!(status, 200);
    let lines: Vec<Value> = stream.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines[0]["event"], "status");
    assert_eq!(lines[0]["status"], "allocating");
    let last = lines.last().unwrap();
    assert_eq!(last["event"], "started", "{stream}");
    let id = last["instance"]["id"].as_str().unwrap().to_owned();
    assert_eq!(last["instance"]["hardware"]["mem"], 2048);

    let (_, listed) = daemon.json("GET", "/v1/instances?provider=fake", None);
    assert_eq!(listed[0]["id"], id.as_str());
    assert_eq!(daemon.json("POST", &format!("/v1/instances/{id}/maintain"), None).0, 200);

    // Swap while serving: the next start is answered by 0.2.0 and sees the first instance.
    let next = guest_artifacts::wasm("fake_next").display().to_string();
    let (status, swapped) =
        daemon.json("POST", "/v1/providers/fake/swap", Some(&format!("{{\"component\":\"{next}\",\"check\":true}}")));
    assert_eq!((status, swapped["new-version"].as_str()), (200, Some("0.2.0")), "{swapped}");
    let (_, listed) = daemon.json("GET", "/v1/instances", None);
    assert_eq!(listed.as_array().unwrap().len(), 1);
    let (status, refused) =
        daemon.json("POST", "/v1/providers/fake/swap", Some(r#"{"component":"/nonexistent/x.wasm"}"#));
    assert_eq!(status, 422, "{refused}");
    // Neither a FIFO (an open for reading would wait for a writer) nor a device
    // (read until memory runs out) is read as a candidate: refused at once, twice each.
    let fifo = dir.path().join("fifo.wasm");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    for (candidate, what) in [(fifo.display().to_string(), "a FIFO"), ("/dev/zero".to_owned(), "a device")] {
        for _ in 0..2 {
            let body = format!("{{\"component\":\"{candidate}\"}}");
            let (status, refused) = daemon.json("POST", "/v1/providers/fake/swap", Some(&body));
            assert_eq!(status, 422, "{refused}");
            assert!(
                refused["error"]["message"].as_str().unwrap().contains(&format!("not a regular file ({what})")),
                "{refused}"
            );
            assert_eq!(refused["error"]["kind"], "invalid-provider", "{refused}");
        }
    }
    assert_eq!(daemon.request("GET", "/healthz", None).0, 200);
    let garbage = dir.path().join("garbage.wasm");
    std::fs::write(&garbage, b"\0asm garbage").unwrap();
    let body = format!("{{\"component\":\"{}\"}}", garbage.display());
    let (status, refused) = daemon.json("POST", "/v1/providers/fake/swap", Some(&body));
    assert_eq!(status, 409, "a refused candidate: {refused}");
    assert!(refused["error"]["message"].as_str().unwrap().contains("0.2.0 keeps serving"), "{refused}");
    assert_eq!((&refused["error"]["kind"], &refused["error"]["provider"]), (&"conflict".into(), &"fake".into()));

    let (status, stopped) = daemon.json("DELETE", &format!("/v1/instances/{id}"), None);
    assert_eq!((status, &stopped), (200, &serde_json::json!({"id": id, "provider": "fake", "stopped": true})));
    // Idempotent: stopped again, or never known, is nothing to stop.
    let (status, again) = daemon.json("DELETE", &format!("/v1/instances/{id}"), None);
    assert_eq!((status, &again), (200, &serde_json::json!({"id": id, "provider": null, "stopped": false})));
    assert_eq!(daemon.json("GET", "/v1/instances", None).1, serde_json::json!([]));

    let (_, events) = daemon.json("GET", "/v1/events", None);
    let kinds: Vec<&str> = events.as_array().unwrap().iter().map(|e| e["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["added", "swapped", "swap-refused"]);
    let (status, metrics) = daemon.request("GET", "/metrics", None);
    assert_eq!(status, 200);
    assert!(metrics.contains("broker_swaps_total 1\n"), "{metrics}");
    assert!(metrics.contains("broker_swap_refusals_total 1\n"), "{metrics}");
    // The fake keeps its instances in kv: its namespace was read into memory once, and is held.
    assert!(metrics.contains("broker_kv_mirror_namespaces 1\n"), "{metrics}");
    assert!(metrics.contains("broker_kv_mirror_loads_total 1\n"), "{metrics}");
    // Outcomes and a latency histogram per loaded version and method: the one stop ran on 0.2.0.
    let stop_ok = metrics
        .lines()
        .find(|l| l.starts_with("broker_calls_total{") && l.contains("method=\"stop-instances\",outcome=\"ok\""))
        .unwrap_or_else(|| panic!("{metrics}"));
    assert!(stop_ok.ends_with(" 1"), "{stop_ok}");
    let histogram_count = metrics
        .lines()
        .find(|l| l.starts_with("broker_call_duration_seconds_count{") && l.contains("method=\"stop-instances\""))
        .unwrap_or_else(|| panic!("{metrics}"));
    assert!(histogram_count.ends_with(" 1"), "{histogram_count}");
    assert!(metrics.contains("le=\"+Inf\"} 1\n"), "{metrics}");
    // The version swapped out keeps its series for a while: its start is still counted.
    let old = &swapped["old-sha256"].as_str().unwrap()[..12];
    let old_start = format!(
        "broker_calls_total{{provider=\"fake\",sha256=\"{old}\",method=\"start-instance\",outcome=\"ok\"}} 1\n"
    );
    assert!(metrics.contains(&old_start), "{old_start} in {metrics}");
    assert!(!metrics.contains(&format!("broker_provider_half_open{{provider=\"fake\",sha256=\"{old}\"}}")));
    // The machine lock, as `broker lock --json` reports it.
    let (status, lock) = daemon.json("GET", "/v1/lock?history=5", None);
    assert_eq!(status, 200, "{lock}");
    assert_eq!((lock["name"].as_str(), lock["holder"].is_null()), (Some("machine-lock"), true), "{lock}");
    assert_eq!(lock["waiting"], serde_json::json!([]));
    assert_eq!(daemon.request("GET", "/v1/lock?history=lots", None).0, 400);
    assert!(metrics.contains("broker_provider_calls_total{provider=\"fake\""), "{metrics}");
}

#[test]
fn garbage_gets_a_4xx_with_a_message_and_the_daemon_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = Daemon::start(dir.path());
    let manifest = fake_manifest(dir.path(), "");
    daemon.json("POST", "/v1/providers", Some(&format!("{{\"manifest\":\"{manifest}\"}}")));
    let huge = vec![b'x'; 200 * 1024];
    for (method, path, body, expected, kind) in [
        ("POST", "/v1/instances", &b"{not json"[..], 400, "bad-request"),
        ("POST", "/v1/instances", &br#"{"provider":"fake","surprise":1}"#[..], 400, "bad-request"),
        ("POST", "/v1/instances", &br#"{"provider":"fake","constraints":"mem=lots"}"#[..], 400, "bad-request"),
        ("POST", "/v1/instances", &br#"{"provider":"nonesuch"}"#[..], 404, "unknown-provider"),
        ("POST", "/v1/instances", &huge[..], 413, "bad-request"),
        ("POST", "/v1/instances/never-started/maintain", &b""[..], 404, "unknown-instance"),
        ("POST", "/v1/providers", &br#"{"manifest":"/nonexistent/provider.toml"}"#[..], 422, "invalid-provider"),
        ("GET", "/v1/providers/nonesuch", &b""[..], 404, "unknown-provider"),
    ] {
        let (status, text) = daemon.request(method, path, Some(body));
        assert_eq!(status, expected, "{method} {path}: {text}");
        let error: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("{path}: {text}"));
        assert!(!error["error"]["message"].as_str().unwrap().is_empty(), "{text}");
        assert_eq!(error["error"]["kind"], kind, "{method} {path}: {text}");
    }
    // What the error is about: the instance named in the path.
    let (_, text) = daemon.request("POST", "/v1/instances/never-started/maintain", Some(b""));
    assert_eq!(serde_json::from_str::<Value>(&text).unwrap()["error"]["instance"], "never-started", "{text}");
    assert_eq!(daemon.request("GET", "/healthz", None).0, 200);
    assert_eq!(daemon.json("GET", "/v1/providers", None).1[0]["name"], "fake");
}

/// Attack 4 of the sandbox issue: the daemon reads manifests as root for any
/// API caller, so an error about a file that is not a manifest names the file
/// and what is wrong, but never quotes what is in it.
#[test]
fn a_file_named_as_a_manifest_is_never_quoted_back_to_the_caller() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = Daemon::start(dir.path());
    let secret = dir.path().join("shadow");
    std::fs::write(&secret, "root:$6$secret-hash-line:19000:0:99999:7:::\nsecond-secret-line\n").unwrap();
    let body = format!("{{\"manifest\":\"{}\"}}", secret.display());
    let (status, text) = daemon.request("POST", "/v1/providers", Some(body.as_bytes()));
    assert_eq!(status, 422, "{text}");
    let error: Value = serde_json::from_str(&text).unwrap();
    let error = error["error"]["message"].as_str().unwrap();
    assert!(error.contains(&secret.display().to_string()), "the file is named: {error}");
    for piece in ["root:", "$6$", "secret-hash-line", "second-secret-line", "19000"] {
        assert!(!text.contains(piece), "{piece} quoted in {text}");
    }
    assert_eq!(daemon.json("GET", "/v1/providers", None).1, serde_json::json!([]), "nothing was added");
}

#[test]
fn sigterm_lets_a_start_in_flight_finish_then_exits() {
    let dir = tempfile::tempdir().unwrap();
    let mut daemon = Daemon::start(dir.path());
    let manifest = fake_manifest(dir.path(), "start-delay-ms = 1500");
    daemon.json("POST", "/v1/providers", Some(&format!("{{\"manifest\":\"{manifest}\"}}")));
    let socket = daemon.socket.clone();
    let slow = std::thread::spawn(move || request(&socket, "POST", "/v1/instances", Some(br#"{"provider":"fake"}"#)));
    std::thread::sleep(Duration::from_millis(400));
    let exit = daemon.terminate();
    let (status, stream) = slow.join().unwrap();
    assert_eq!(status, 200);
    assert!(stream.lines().last().unwrap().contains("\"event\":\"started\""), "{stream}");
    assert!(exit.success(), "{exit:?}");
    assert!(!daemon.socket.exists(), "the socket is removed on the way out");
    // The instance it finished is recorded: a new daemon lists it.
    let again = Daemon::start(dir.path());
    assert_eq!(again.json("GET", "/v1/instances", None).1.as_array().unwrap().len(), 1);
}

/// F7: a start whose client went away still runs to its end when SIGTERM
/// comes: the drain waits for it, and the next daemon has its record.
#[test]
fn sigterm_lets_a_start_whose_client_left_finish() {
    let dir = tempfile::tempdir().unwrap();
    let mut daemon = Daemon::start(dir.path());
    let manifest = fake_manifest(dir.path(), "start-delay-ms = 1500");
    daemon.json("POST", "/v1/providers", Some(&format!("{{\"manifest\":\"{manifest}\"}}")));
    let mut client = std::os::unix::net::UnixStream::connect(&daemon.socket).unwrap();
    let body = br#"{"provider":"fake"}"#;
    let head = "POST /v1/instances HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\n";
    write!(client, "{head}Content-Length: {}\r\n\r\n", body.len()).unwrap();
    client.write_all(body).unwrap();
    // The start has begun once its first status line comes; then the client goes.
    let mut seen = Vec::new();
    let mut buf = [0u8; 512];
    while !String::from_utf8_lossy(&seen).contains("allocating") {
        let n = client.read(&mut buf).unwrap();
        assert!(n > 0, "the daemon closed: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    drop(client);
    let exit = daemon.terminate();
    assert!(exit.success(), "{exit:?}");
    let again = Daemon::start(dir.path());
    let (_, listed) = again.json("GET", "/v1/instances", None);
    assert_eq!(listed.as_array().unwrap().len(), 1, "the start finished and was recorded: {listed}");
}

#[test]
fn tcp_needs_loopback_a_private_token_file_and_the_token_on_every_request() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "s3cret-token-for-the-test\n").unwrap();
    let broker = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_broker")).arg("--data-dir").arg(dir.path()).args(args).output().unwrap()
    };
    let token = token_file.display().to_string();

    // Refused before serving: a token file others can read, a non-loopback address, --listen alone.
    std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = broker(&["serve", "--listen", "127.0.0.1:1", "--token-file", &token]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("readable by group or others"), "{out:?}");
    std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let out = broker(&["serve", "--listen", "0.0.0.0:1", "--token-file", &token]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("loopback"), "{out:?}");
    let out = broker(&["serve", "--listen", "127.0.0.1:1"]);
    assert_eq!(out.status.code(), Some(2), "--listen needs --token-file: {out:?}");

    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let daemon = Daemon::start_with(dir.path(), &["--listen", &addr, "--token-file", &token]);
    let tcp = |path: &str, headers: &str| {
        let started = Instant::now();
        let stream = loop {
            match std::net::TcpStream::connect(&addr) {
                Ok(stream) => break stream,
                Err(e) if started.elapsed() > Duration::from_secs(10) => panic!("no TCP listener on {addr}: {e}"),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        exchange(stream, "GET", path, None, headers)
    };
    assert_eq!(tcp("/healthz", ""), (200, "ok\n".to_owned()), "health needs no token");
    let (status, body) = tcp("/v1/providers", "");
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("missing Authorization"), "{body}");
    let (status, body) = tcp("/v1/providers", "Authorization: Bearer s3cret-token-for-the-tesT\r\n");
    assert_eq!((status, body.contains("wrong bearer token")), (401, true), "{body}");
    assert_eq!(tcp("/metrics", "Authorization: Basic czNjcmV0\r\n").0, 401);
    let (status, body) = tcp("/v1/providers", "Authorization: Bearer s3cret-token-for-the-test\r\n");
    assert_eq!((status, body.as_str()), (200, "[]"));
    // The unix socket still serves, as before.
    assert_eq!(daemon.request("GET", "/v1/providers", None), (200, "[]".to_owned()));
}

/// Issue 36, class 3: a program that took the `--listen` port while the
/// daemon was down would be handed the clients' bearer tokens. The daemon
/// refuses to start beside it, at once (before the state is opened), naming
/// the process that holds the port: here this test's own.
#[test]
fn a_held_listen_address_refuses_the_start_naming_its_holder() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "s3cret-token-for-the-test\n").unwrap();
    std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let squatter = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = squatter.local_addr().unwrap().to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_broker"))
        .arg("--data-dir")
        .arg(dir.path())
        .args(["serve", "--listen", &addr, "--token-file"])
        .arg(&token_file)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{out:?}");
    let holder = format!("it is held by pid {} (uid ", std::process::id());
    assert!(stderr.contains(&format!("cannot listen on {addr}")) && stderr.contains(&holder), "{stderr}");
    assert!(stderr.contains("bearer token"), "{stderr}");
    assert!(!dir.path().join("state.redb").exists(), "refused before the state was opened");
    assert!(!dir.path().join("broker.sock").exists(), "and before the unix socket");
    drop(squatter);
}

#[test]
fn openapi_names_every_route_the_daemon_serves() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = Daemon::start(dir.path());
    let (status, spec) = daemon.json("GET", "/openapi.json", None);
    assert_eq!(status, 200);
    assert_eq!(spec["openapi"], "3.0.3");
    let paths = spec["paths"].as_object().unwrap();
    let mut seen = 0;
    for (path, item) in paths {
        for (method, _) in item.as_object().unwrap().iter().filter(|(m, _)| *m != "parameters") {
            let concrete = path.replace("{name}", "nonesuch").replace("{id}", "nonesuch");
            let (status, body) = daemon.request(&method.to_ascii_uppercase(), &concrete, Some(b"{}"));
            // A route that exists answers; an unknown one is axum's bare 404 or a 405.
            assert_ne!(status, 405, "{method} {path} is in the spec but not served");
            assert!(status != 404 || body.contains("\"error\""), "{method} {path} is in the spec but not served");
            seen += 1;
        }
    }
    assert_eq!(seen, 24, "the spec names every route: {:?}", paths.keys().collect::<Vec<_>>());
    // And the daemon serves nothing the spec does not name.
    assert_eq!(daemon.request("GET", "/v1/nonesuch", None).0, 404);
}

#[test]
fn on_start_the_daemon_maintains_its_instances_and_reports_what_differs() {
    let dir = tempfile::tempdir().unwrap();
    let started = {
        let daemon = Daemon::start(dir.path());
        let manifest = fake_manifest(dir.path(), "");
        assert_eq!(daemon.json("POST", "/v1/providers", Some(&format!("{{\"manifest\":\"{manifest}\"}}"))).0, 201);
        let mut ids = Vec::new();
        for _ in 0..3 {
            let (status, stream) = daemon.request("POST", "/v1/instances", Some(br#"{"provider":"fake"}"#));
            assert_eq!(status, 200);
            let last: Value = serde_json::from_str(stream.lines().last().unwrap()).unwrap();
            ids.push(last["instance"]["id"].as_str().unwrap().to_owned());
        }
        ids
    };
    // While the daemon is down: the host forgets one instance, the provider another.
    {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let broker = broker_core::broker::Broker::open(dir.path()).unwrap();
        broker.store().remove_instances("fake", std::slice::from_ref(&started[0])).wait().unwrap();
        let fake = runtime.block_on(broker.registry().get("fake")).unwrap();
        let hooks = broker_capabilities::rooms::context::CallHooks::default();
        runtime.block_on(fake.stop_instances(&hooks, std::slice::from_ref(&started[1]))).unwrap();
    }
    let daemon = Daemon::start(dir.path());
    let waited = Instant::now();
    let reconciled = loop {
        let (_, events) = daemon.json("GET", "/v1/events", None);
        if let Some(event) = events.as_array().unwrap().iter().find(|e| e["kind"] == "reconciled") {
            break event.clone();
        }
        assert!(waited.elapsed() < Duration::from_secs(30), "no reconcile event: {events}");
        std::thread::sleep(Duration::from_millis(50));
    };
    let detail = reconciled["detail"].as_str().unwrap();
    assert!(detail.starts_with("maintained 1"), "{detail}");
    assert!(detail.contains(&format!("maintain failed: {} (", started[1])), "{detail}");
    assert!(detail.contains(&format!("unknown to the host: {}", started[0])), "{detail}");
    assert!(detail.contains(&format!("vanished: {}", started[1])), "{detail}");
    assert_eq!(reconciled["provider"], "fake");
}

#[test]
fn the_daemon_follows_its_providers_directory() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = Daemon::start(dir.path());
    let wait_for = |what: &str, mut done: Box<dyn FnMut() -> bool>| {
        let waited = Instant::now();
        while !done() {
            assert!(waited.elapsed() < Duration::from_secs(30), "the daemon never {what}");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let fake = dir.path().join("providers/fake");
    std::fs::create_dir_all(&fake).unwrap();
    std::fs::copy(guest_artifacts::wasm("fake"), fake.join("fake.wasm")).unwrap();
    let manifest = guest_artifacts::manifest_text("fake")
        .replace(&format!("\"{}/fake.wasm\"", guest_artifacts::wasm_dir().display()), "\"fake.wasm\"");
    assert!(manifest.contains("component = \"fake.wasm\""), "{manifest}");
    std::fs::write(fake.join("provider.toml"), manifest).unwrap();
    wait_for(
        "added the dropped-in provider",
        Box::new(|| daemon.json("GET", "/v1/providers", None).1[0]["name"] == "fake"),
    );
    let (status, _) = daemon.request("POST", "/v1/instances", Some(br#"{"provider":"fake"}"#));
    assert_eq!(status, 200);

    // A new component, copied over the old one in place: swapped in once the writes settle.
    std::fs::copy(guest_artifacts::wasm("fake_next"), fake.join("fake.wasm")).unwrap();
    wait_for(
        "swapped in the new component",
        Box::new(|| daemon.json("GET", "/v1/providers/fake", None).1["version"] == "0.2.0"),
    );
    assert_eq!(daemon.json("GET", "/v1/instances", None).1.as_array().unwrap().len(), 1);

    // The manifest removed: refused while an instance is recorded, done once it is stopped.
    std::fs::remove_file(fake.join("provider.toml")).unwrap();
    let refusal = |events: &Value| events.as_array().unwrap().iter().any(|e| e["kind"] == "remove-refused");
    wait_for(
        "refused to remove a provider with an instance",
        Box::new(|| refusal(&daemon.json("GET", "/v1/events", None).1)),
    );
    assert_eq!(daemon.json("GET", "/v1/providers", None).1.as_array().unwrap().len(), 1);
    assert_eq!(daemon.json("DELETE", "/v1/instances/fake-0", None).0, 200);
    wait_for("removed the provider", Box::new(|| daemon.json("GET", "/v1/providers", None).1 == serde_json::json!([])));
    let (_, events) = daemon.json("GET", "/v1/events", None);
    let kinds: Vec<&str> = events.as_array().unwrap().iter().map(|e| e["kind"].as_str().unwrap()).collect();
    let kinds: Vec<&str> = kinds.into_iter().filter(|k| *k != "reconciled").collect();
    assert_eq!(kinds, ["added", "swapped", "remove-refused", "removed"], "{events}");
}

/// Listing pages: `limit` bounds the answer and `X-Next-After` names where
/// the next page starts; the pages together are the whole listing, and the
/// whole listing (streamed a page at a time, past one page of the stream)
/// is what they are.
#[test]
fn instance_listing_pages() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = Daemon::start(dir.path());
    let manifest = fake_manifest(dir.path(), "");
    daemon.json("POST", "/v1/providers", Some(&format!("{{\"manifest\":\"{manifest}\"}}")));
    let (status, empty) = daemon.json("GET", "/v1/instances", None);
    assert_eq!((status, empty), (200, serde_json::json!([])), "an empty listing streams as an empty array");
    for _ in 0..5 {
        assert_eq!(daemon.request("POST", "/v1/instances", Some(br#"{"provider":"fake"}"#)).0, 200);
    }
    let (mut seen, mut after) = (Vec::new(), String::new());
    for _ in 0..3 {
        let (status, body, next) = crate::common::list_page(&daemon.socket, &format!("/v1/instances?limit=2{after}"));
        assert_eq!(status, 200, "{body}");
        let page: Value = serde_json::from_str(&body).unwrap();
        seen.extend(page.as_array().unwrap().iter().map(|r| r["id"].as_str().unwrap().to_owned()));
        match next {
            Some(next) => after = format!("&after={next}"),
            None => after.clear(),
        }
    }
    assert_eq!(seen, ["fake-0", "fake-1", "fake-2", "fake-3", "fake-4"]);
    assert!(after.is_empty(), "the last page names no next one");
    let (status, refused) = daemon.json("GET", "/v1/instances?after=fake-1", None);
    assert_eq!(status, 400, "{refused}");
    let (status, refused) = daemon.json("GET", "/v1/instances?after=~1.bm90IGEgY3Vyc29y", None);
    assert!(status == 400 && refused["error"]["message"].as_str().unwrap().contains("X-Next-After"), "{refused}");
    let (status, refused) = daemon.json("GET", "/v1/instances?provider=other&after=fake/fake-1", None);
    assert_eq!(status, 400, "a cursor of another provider: {refused}");
    // The old cursor form goes on after its id.
    let (_, rest) = daemon.json("GET", "/v1/instances?limit=10&after=fake/fake-2", None);
    let rest: Vec<&str> = rest.as_array().unwrap().iter().map(|r| r["id"].as_str().unwrap()).collect();
    assert_eq!(rest, ["fake-3", "fake-4"]);

    // More than one page of the stream: streamed whole, it is every page.
    for _ in 5..2600 {
        assert_eq!(daemon.request("POST", "/v1/instances", Some(br#"{"provider":"fake"}"#)).0, 200);
    }
    let (status, whole) = daemon.json("GET", "/v1/instances", None);
    assert_eq!(status, 200);
    let whole = whole.as_array().unwrap().clone();
    assert_eq!(whole.len(), 2600);
    let (mut paged, mut after) = (Vec::new(), String::new());
    loop {
        let (_, body, next) = crate::common::list_page(&daemon.socket, &format!("/v1/instances?limit=700{after}"));
        paged.extend(serde_json::from_str::<Vec<Value>>(&body).unwrap());
        let Some(next) = next else { break };
        after = format!("&after={next}");
    }
    assert_eq!(paged, whole);
}

/// A daemon started while a CLI command holds the state (a supervisor's
/// restart racing it) waits for the state instead of failing.
#[test]
fn a_daemon_waits_for_the_state_a_command_holds() {
    let dir = tempfile::tempdir().unwrap();
    let held = broker_core::store::Store::open(dir.path()).unwrap();
    let releasing = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(700));
        drop(held);
    });
    let daemon = Daemon::start(dir.path());
    releasing.join().unwrap();
    assert_eq!(daemon.request("GET", "/healthz", None).0, 200);
}

/// A socket that takes connections but never answers (a dead daemon's,
/// inherited by a process that outlives it) is stale, not another daemon:
/// the daemon replaces it and serves.
#[test]
fn a_socket_that_accepts_but_never_answers_is_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let _silent = std::os::unix::net::UnixListener::bind(data.join("broker.sock")).unwrap();
    // Connecting succeeds at once (the silent listener), so start waits for nothing.
    let mut daemon = Daemon::start(&data);
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let mut stream = std::os::unix::net::UnixStream::connect(&daemon.socket).unwrap();
        stream.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
        stream.write_all(b"GET /healthz HTTP/1.0\r\n\r\n").unwrap();
        let mut answer = String::new();
        if stream.read_to_string(&mut answer).is_ok() && answer.contains(" 200 ") {
            break;
        }
        assert!(daemon.child.try_wait().unwrap().is_none(), "the daemon took the silent socket for another daemon");
        assert!(Instant::now() < until, "the daemon never served in the silent socket's place");
    }
}
