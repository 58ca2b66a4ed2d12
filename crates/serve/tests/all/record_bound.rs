//! A provider's `max-records` through the daemon: a start that would pass it
//! is refused before it runs, naming the bound; a provider already past it
//! (its bound lowered) is never bricked: its listing, a page at a time,
//! answers whole and trips no breaker, stops are served, and once the count
//! is back within the bound everything works again.

use crate::common::Daemon;
use serde_json::Value;
use std::path::Path;

fn manifest_with_bound(dir: &Path, bound: usize) -> String {
    let text =
        guest_artifacts::manifest_text("fake").replace("[limits]\n", &format!("[limits]\nmax-records = {bound}\n"));
    let path = dir.join("fake.toml");
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

fn start(daemon: &Daemon) -> (u16, String) {
    daemon.request("POST", "/v1/instances", Some(br#"{"provider":"fake"}"#))
}

fn started(answer: &(u16, String)) -> bool {
    answer.0 == 200 && answer.1.lines().last().is_some_and(|line| line.contains(r#""event":"started""#))
}

/// The refusal of a start past the bound: before it ran, the bound named.
fn assert_refused_at_bound(answer: &(u16, String), bound: usize) {
    // The start's stream: its one line says it failed.
    assert_eq!(answer.0, 200, "{answer:?}");
    assert_eq!(answer.1.lines().count(), 1, "no status came before the refusal: {answer:?}");
    let refused: Value = serde_json::from_str(&answer.1).unwrap();
    assert_eq!(refused["event"], "failed", "{refused}");
    assert_eq!(refused["error"]["kind"], "limit", "{refused}");
    let message = refused["error"]["message"].as_str().unwrap();
    assert!(message.contains(&format!("bound of {bound} instances")) && message.contains("max-records"), "{message}");
}

fn half_open(daemon: &Daemon) -> bool {
    let (_, shown) = daemon.json("GET", "/v1/providers/fake", None);
    shown["breaker"]["half-open"].as_bool().or_else(|| shown["half-open"].as_bool()).unwrap_or_else(|| {
        let (_, text) = daemon.request("GET", "/metrics", None);
        text.lines().any(|l| l.starts_with("broker_provider_half_open{") && l.ends_with(" 1"))
    })
}

#[test]
fn a_provider_past_its_record_bound_is_never_bricked() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let manifest = manifest_with_bound(dir.path(), 8);
    let mut daemon = Daemon::start(&data);
    assert_eq!(daemon.json("POST", "/v1/providers", Some(&format!("{{\"manifest\":\"{manifest}\"}}"))).0, 201);
    for _ in 0..8 {
        assert!(started(&start(&daemon)));
    }
    // The ninth would pass the bound: refused before the provider is asked.
    let calls_before = daemon.request("GET", "/metrics", None).1;
    assert_refused_at_bound(&start(&daemon), 8);
    let calls_after = daemon.request("GET", "/metrics", None).1;
    let starts = |text: &str| {
        let calls = text.lines().filter(|l| l.starts_with("broker_calls_total{") && l.contains("start-instance"));
        calls.collect::<Vec<_>>().join("\n")
    };
    assert!(!starts(&calls_before).is_empty(), "{calls_before}");
    assert_eq!(starts(&calls_before), starts(&calls_after), "the provider was not asked");
    assert!(daemon.terminate().success());

    // The operator lowers the bound: the provider now holds more than it may.
    // Its listing is read a page at a time, so it still answers, every time
    // and whole. (A whole answer past the bound, where one is still asked
    // for, is refused as a limit that trips no breaker: core's quotas tests.)
    manifest_with_bound(dir.path(), 5);
    let daemon = Daemon::start(&data);
    for _ in 0..6 {
        let (status, listed) = daemon.json("GET", "/v1/instances?provider=fake", None);
        assert_eq!(status, 200, "{listed}");
        let listed = listed.as_array().unwrap();
        assert_eq!(listed.len(), 8);
        assert!(listed.iter().all(|r| r["status"] == "running"), "{listed:?}");
    }
    assert!(!half_open(&daemon), "listing a provider past its max-records tripped the breaker");
    let (status, all) = daemon.json("GET", "/v1/instances", None);
    assert_eq!(status, 200, "{all}");
    let all = all.as_array().unwrap();
    assert_eq!(all.len(), 8);
    assert_refused_at_bound(&start(&daemon), 5);

    // Stops are served, and bring it back within its bound.
    for record in &all[..4] {
        let id = record["id"].as_str().unwrap();
        let (status, answer) = daemon.request("DELETE", &format!("/v1/instances/{id}"), None);
        assert!(status < 300 && answer.contains(r#""stopped":true"#), "stop {id}: {status} {answer}");
    }
    let (status, listed) = daemon.json("GET", "/v1/instances?provider=fake", None);
    assert_eq!(status, 200, "{listed}");
    assert_eq!(listed.as_array().unwrap().len(), 4, "stopped {:?}, listed {listed}", &all[..4]);
    assert!(started(&start(&daemon)));
    assert_refused_at_bound(&start(&daemon), 5);
}
