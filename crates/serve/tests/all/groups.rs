//! `broker group …` through the daemon, which runs the convergence loops: a
//! spec file (the README's example) commits, converges, rolls, survives a
//! restart; bad input is a clear error.

use crate::common::{Daemon, broker};
use std::path::Path;
use std::time::{Duration, Instant};

fn run(data_dir: &Path, args: &[&str]) -> (i32, String, String) {
    let out = broker(data_dir, args);
    let text = |bytes: Vec<u8>| String::from_utf8(bytes).unwrap();
    (out.status.code().unwrap(), text(out.stdout), text(out.stderr))
}

fn example() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/workers.yaml")
}

/// `describe --json` until converged with `size` members (60 s at most).
fn converged(data_dir: &Path, size: usize) -> serde_json::Value {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let (code, out, err) = run(data_dir, &["group", "describe", "workers", "--json"]);
        assert_eq!(code, 0, "{err}");
        let described: serde_json::Value = serde_json::from_str(&out).unwrap();
        if described["converged"] == true && described["instances"].as_array().unwrap().len() == size {
            return described;
        }
        assert!(Instant::now() < until, "not converged: {out}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_group_converges_rolls_and_survives_a_restart_through_the_daemon() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path();
    let mut daemon = Daemon::start(data);
    let manifest = guest_artifacts::manifest("fake").display().to_string();
    assert_eq!(run(data, &["provider", "add", &manifest]).0, 0);
    let example = example();
    let example = example.to_str().unwrap();

    assert_eq!(run(data, &["group", "commit", example, "--pretend"]).1, "Managing 3 instances\n");
    assert_eq!(run(data, &["group", "ls"]).1.lines().count(), 1, "pretend committed nothing");
    assert_eq!(run(data, &["group", "commit", example]).1, "Managing 3 instances\n");
    let first = converged(data, 3);
    let listed: serde_json::Value = serde_json::from_str(&run(data, &["instance", "list", "--json"]).1).unwrap();
    let zones: std::collections::BTreeSet<&str> =
        listed.as_array().unwrap().iter().filter_map(|r| r["hardware"]["availability-zone"].as_str()).collect();
    assert_eq!(zones.len(), 3, "one member per zone");

    // The daemon restarts; the group is still there and still converged.
    assert!(daemon.terminate().success());
    let _daemon = Daemon::start(data);
    assert_eq!(converged(data, 3)["instances"], first["instances"]);

    assert_eq!(run(data, &["group", "size", "workers"]).1, "3\n");
    assert_eq!(run(data, &["group", "size", "workers", "5"]).1, "Adding 2 instances to increase the group size to 5\n");
    converged(data, 5);

    // A template change rolls every member, and the group converges again.
    let changed = dir.path().join("changed.yaml");
    std::fs::write(&changed, std::fs::read_to_string(example).unwrap().replace("mem=1G", "mem=2G")).unwrap();
    let (code, plan, err) = run(data, &["group", "commit", changed.to_str().unwrap()]);
    // The file says 3, the group had 5: InfraKit's combined plan.
    let plan_text =
        "Terminating 2 instances to reduce the group size to 3, then performing a rolling update on 3 instances\n";
    assert_eq!((code, plan.as_str()), (0, plan_text), "{err}");
    let rolled = converged(data, 3);
    let first_ids: Vec<&serde_json::Value> = first["instances"].as_array().unwrap().iter().map(|m| &m["id"]).collect();
    assert!(rolled["instances"].as_array().unwrap().iter().all(|m| !first_ids.contains(&&m["id"])), "{rolled}");

    let (code, _, err) = run(data, &["group", "destroy-instances", "workers", "nosuch"]);
    assert_eq!(code, 5, "a conflict");
    assert!(err.contains(r#"instance "nosuch" is not a member of group "workers": nothing was destroyed"#), "{err}");

    // Bad input: clear errors naming the field or file, exit 2 for a bad spec.
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, r#"{"ID": "w", "Properties": {"Allocation": {"Size": 1, "LogicalIDs": ["a"]}, "Instance": {"Plugin": "fake"}}}"#).unwrap();
    let (code, _, err) = run(data, &["group", "commit", bad.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("Properties.Allocation: Size and LogicalIDs are both given"), "{err}");
    let (code, _, err) = run(data, &["group", "commit", "/dev/zero"]);
    assert_eq!(code, 1);
    assert!(err.contains("/dev/zero"), "{err}");
    let (code, _, err) = run(data, &["group", "describe", "nosuch"]);
    assert_eq!(code, 4, "an unknown group");
    assert!(err.contains(r#"no group "nosuch" is committed"#), "{err}");

    assert_eq!(run(data, &["group", "destroy", "workers"]).0, 0);
    assert_eq!(run(data, &["instance", "list", "--json"]).1.trim(), "[]");
}
