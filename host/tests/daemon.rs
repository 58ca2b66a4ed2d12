//! `broker serve` end to end: the real binary as a daemon, spoken to over its
//! unix socket with plain HTTP/1.1.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use serde_json::Value;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Daemon {
    child: Child,
    socket: PathBuf,
}

impl Daemon {
    fn start(data_dir: &Path) -> Daemon {
        Daemon::start_with(data_dir, &[])
    }

    fn start_with(data_dir: &Path, serve_args: &[&str]) -> Daemon {
        let child = Command::new(env!("CARGO_BIN_EXE_broker"))
            .arg("--data-dir")
            .arg(data_dir)
            .arg("serve")
            .args(serve_args)
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let socket = data_dir.join("broker.sock");
        let started = Instant::now();
        while UnixStream::connect(&socket).is_err() {
            assert!(started.elapsed() < Duration::from_secs(30), "the daemon never listened on {}", socket.display());
            std::thread::sleep(Duration::from_millis(20));
        }
        Daemon { child, socket }
    }

    fn request(&self, method: &str, path: &str, body: Option<&[u8]>) -> (u16, String) {
        request(&self.socket, method, path, body)
    }

    fn json(&self, method: &str, path: &str, body: Option<&str>) -> (u16, Value) {
        let (status, text) = self.request(method, path, body.map(str::as_bytes));
        (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: not JSON ({e}): {text}")))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One request on the unix socket; returns the status and the (de-chunked) body.
fn request(socket: &Path, method: &str, path: &str, body: Option<&[u8]>) -> (u16, String) {
    exchange(UnixStream::connect(socket).unwrap(), method, path, body, "")
}

/// One request on `stream`, with `headers` (each ending in CRLF) added.
fn exchange(
    mut stream: impl Read + Write,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    headers: &str,
) -> (u16, String) {
    let body = body.unwrap_or_default();
    write!(
            stream,
            "{method} {path} HTTP/1.1\r\nHost: broker\r\nConnection: close\r\n{headers}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        )
        .unwrap();
    let _ = stream.write_all(body); // an oversized body may be refused before it is all read
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let chunked = head.to_ascii_lowercase().contains("transfer-encoding: chunked");
    (status, if chunked { dechunk(rest) } else { rest.to_owned() })
}

fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    while let Some((size, after)) = rest.split_once("\r\n") {
        let size = usize::from_str_radix(size.trim(), 16).unwrap();
        if size == 0 {
            break;
        }
        out.push_str(&after[..size]);
        rest = &after[size + 2..];
    }
    out
}

/// The bundled fake's manifest, with `line` added to its [config].
fn fake_manifest(dir: &Path, line: &str) -> String {
    let text = guest_artifacts::manifest_text("fake");
    let path = dir.join("fake.toml");
    std::fs::write(&path, format!("{text}{line}\n")).unwrap();
    path.display().to_string()
}

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
    let garbage = dir.path().join("garbage.wasm");
    std::fs::write(&garbage, b"\0asm garbage").unwrap();
    let body = format!("{{\"component\":\"{}\"}}", garbage.display());
    let (status, refused) = daemon.json("POST", "/v1/providers/fake/swap", Some(&body));
    assert_eq!(status, 409, "a refused candidate: {refused}");
    assert!(refused["error"].as_str().unwrap().contains("0.2.0 keeps serving"), "{refused}");

    let (status, _) = daemon.json("DELETE", &format!("/v1/instances/{id}"), None);
    assert_eq!(status, 200);
    assert_eq!(daemon.json("GET", "/v1/instances", None).1, serde_json::json!([]));

    let (_, events) = daemon.json("GET", "/v1/events", None);
    let kinds: Vec<&str> = events.as_array().unwrap().iter().map(|e| e["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["added", "swapped", "swap-refused"]);
    let (status, metrics) = daemon.request("GET", "/metrics", None);
    assert_eq!(status, 200);
    assert!(metrics.contains("broker_swaps_total 1\n"), "{metrics}");
    assert!(metrics.contains("broker_swap_refusals_total 1\n"), "{metrics}");
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
    for (method, path, body, expected) in [
        ("POST", "/v1/instances", &b"{not json"[..], 400),
        ("POST", "/v1/instances", &br#"{"provider":"fake","surprise":1}"#[..], 400),
        ("POST", "/v1/instances", &br#"{"provider":"fake","constraints":"mem=lots"}"#[..], 400),
        ("POST", "/v1/instances", &br#"{"provider":"nonesuch"}"#[..], 404),
        ("POST", "/v1/instances", &huge[..], 413),
        ("DELETE", "/v1/instances/never-started", &b""[..], 404),
        ("POST", "/v1/providers", &br#"{"manifest":"/nonexistent/provider.toml"}"#[..], 422),
        ("GET", "/v1/providers/nonesuch", &b""[..], 404),
    ] {
        let (status, text) = daemon.request(method, path, Some(body));
        assert_eq!(status, expected, "{method} {path}: {text}");
        if status != 413 {
            let error: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("{path}: {text}"));
            assert!(!error["error"].as_str().unwrap().is_empty());
        }
    }
    assert_eq!(daemon.request("GET", "/healthz", None).0, 200);
    assert_eq!(daemon.json("GET", "/v1/providers", None).1[0]["name"], "fake");
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
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(daemon.child.id() as i32), nix::sys::signal::SIGTERM).unwrap();
    let (status, stream) = slow.join().unwrap();
    assert_eq!(status, 200);
    assert!(stream.lines().last().unwrap().contains("\"event\":\"started\""), "{stream}");
    let exit = daemon.child.wait().unwrap();
    assert!(exit.success(), "{exit:?}");
    assert!(!daemon.socket.exists(), "the socket is removed on the way out");
    // The instance it finished is recorded: a new daemon lists it.
    let again = Daemon::start(dir.path());
    assert_eq!(again.json("GET", "/v1/instances", None).1.as_array().unwrap().len(), 1);
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
    assert_eq!(seen, 14, "the spec names every route: {:?}", paths.keys().collect::<Vec<_>>());
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
        let broker = broker_host::broker::Broker::open(dir.path()).unwrap();
        broker.store().remove_instances("fake", std::slice::from_ref(&started[0])).unwrap();
        let fake = runtime.block_on(broker.registry().get("fake")).unwrap();
        let hooks = broker_host::capabilities::context::CallHooks::default();
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
