//! The daemon on a disk that fills up and empties again: writes are refused
//! with the disk's own error while `/healthz` says so, and once space is
//! back the host takes writes again, without a restart and losing nothing.

use crate::common::{Daemon, fake_manifest};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A small tmpfs of the test's own, unmounted when dropped.
struct SmallDisk(PathBuf);

impl SmallDisk {
    fn mount(at: &Path, mib: u64) -> SmallDisk {
        std::fs::create_dir_all(at).unwrap();
        let options = format!("size={mib}m,mode=0700");
        nix::mount::mount(Some("tmpfs"), at, Some("tmpfs"), nix::mount::MsFlags::empty(), Some(options.as_str()))
            .expect("mount a tmpfs (the tests run as root)");
        SmallDisk(at.to_owned())
    }

    /// Write `filler` until the disk is full.
    fn fill(&self, filler: &Path) {
        let mut file = std::fs::File::create(filler).unwrap();
        let chunk = vec![0x5au8; 64 << 10];
        loop {
            match file.write_all(&chunk) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(nix::libc::ENOSPC) => break,
                Err(e) => panic!("filling the disk: {e}"),
            }
        }
        // What is left, less than a chunk, too.
        while file.write_all(&[0x5a; 512]).is_ok() {}
        let _ = file.sync_all();
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        crate::common::detach_mounts_under(&self.0);
        let _ = nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH);
    }
}

fn start(daemon: &Daemon) -> (u16, String) {
    daemon.request("POST", "/v1/instances", Some(br#"{"provider":"fake"}"#))
}

fn started(answer: &(u16, String)) -> bool {
    answer.0 == 200 && answer.1.lines().last().is_some_and(|line| line.contains(r#""event":"started""#))
}

fn metric(daemon: &Daemon, name: &str) -> u64 {
    let (_, text) = daemon.request("GET", "/metrics", None);
    let line = text.lines().find(|l| l.starts_with(&format!("{name} "))).unwrap_or_else(|| panic!("{name}: {text}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

#[test]
fn a_full_disk_refuses_writes_with_its_cause_then_heals_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let disk = SmallDisk::mount(&dir.path().join("disk"), 48);
    let data = disk.0.join("data");
    let manifest = fake_manifest(dir.path(), "");
    let log = dir.path().join("daemon.log");
    let mut daemon = Daemon::start_logging(&data, &log);
    let log_tail = || {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        text.lines().rev().take(30).collect::<Vec<_>>().join("\n")
    };
    daemon.json("POST", "/v1/providers", Some(&format!("{{\"manifest\":\"{manifest}\"}}")));
    let mut ids = 0;
    for _ in 0..20 {
        assert!(started(&start(&daemon)));
        ids += 1;
    }

    let filler = disk.0.join("filler");
    disk.fill(&filler);
    // Writes fail, each with the disk's own error; the daemon serves on.
    let mut refusals = Vec::new();
    for _ in 0..5 {
        let answer = start(&daemon);
        if started(&answer) {
            // It fit in what the files had already allocated.
            ids += 1;
        } else {
            refusals.push(answer.1);
        }
    }
    assert!(!refusals.is_empty(), "every start fit on a full disk");
    for refused in &refusals {
        assert!(refused.contains("No space left on device"), "not the disk's cause: {refused}");
        assert!(!refused.contains("Previous I/O error"), "redb's word, not the cause: {refused}");
    }
    let (status, health) = daemon.request("GET", "/healthz", None);
    assert_eq!(status, 503, "{health}");
    assert!(health.contains("No space left on device") && health.contains(r#""kind":"storage""#), "{health}");
    assert_eq!(metric(&daemon, "broker_store_faulted"), 1);
    assert!(metric(&daemon, "broker_store_faults_total") >= 1);
    // A command through the daemon still reaches it (a 503 healthz is a daemon serving).
    let listed = crate::common::broker(&data, &["instance", "list", "--json"]);
    assert!(listed.status.success() || String::from_utf8_lossy(&listed.stdout).contains("storage"), "{listed:?}");

    // Space comes back, but the state file is gone (moved away under the
    // daemon): it is not made anew, empty; writes stay refused, naming why.
    let away = data.join("state.redb.away");
    std::fs::rename(data.join("state.redb"), &away).unwrap();
    std::fs::remove_file(&filler).unwrap();
    std::thread::sleep(Duration::from_millis(2500));
    let (status, health) = daemon.request("GET", "/healthz", None);
    assert_eq!(status, 503, "{health}");
    let said = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        said.contains("the state file cannot be reopened yet") && said.contains("No such file or directory"),
        "{}",
        log_tail()
    );
    assert!(!data.join("state.redb").exists(), "made anew");
    // It is put back: the store reopens by itself, and writes are taken again.
    std::fs::rename(&away, data.join("state.redb")).unwrap();
    let healed = Instant::now();
    while daemon.request("GET", "/healthz", None).0 != 200 {
        let health = daemon.request("GET", "/healthz", None);
        assert!(healed.elapsed() < Duration::from_secs(20), "{health:?}\n{}", log_tail());
        std::thread::sleep(Duration::from_millis(100));
    }
    for _ in 0..3 {
        let answer = start(&daemon);
        assert!(started(&answer), "{answer:?}");
        ids += 1;
    }
    assert_eq!(metric(&daemon, "broker_store_faulted"), 0);
    assert!(metric(&daemon, "broker_store_reopens_total") >= 1);

    // Nothing answered as done was lost: all of it is there after a restart too.
    let (_, listed) = daemon.json("GET", "/v1/instances", None);
    assert_eq!(listed.as_array().unwrap().len(), ids, "{listed}");
    assert!(daemon.terminate().success());
    let daemon = Daemon::start(&data);
    let (_, listed) = daemon.json("GET", "/v1/instances", None);
    assert_eq!(listed.as_array().unwrap().len(), ids, "{listed}");
    drop(daemon);
    drop(disk);
}

/// After a daemon is killed its state file is not closed cleanly: `store
/// check` says so, and that the next open repairs it, and reads what that
/// open will see (the log applied) without changing a byte; `store recover`
/// reports the rows of the store it made, the log applied.
#[test]
fn store_check_and_recover_after_a_sigkill_report_what_the_next_open_sees() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let manifest = fake_manifest(dir.path(), "");
    let mut daemon = Daemon::start(&data);
    daemon.json("POST", "/v1/providers", Some(&format!("{{\"manifest\":\"{manifest}\"}}")));
    for _ in 0..7 {
        assert!(started(&start(&daemon)));
    }
    daemon.child.kill().unwrap();
    daemon.child.wait().unwrap();
    let state = data.join("state.redb");
    let before = (std::fs::read(&state).unwrap(), std::fs::read(data.join("state.wal")).unwrap());

    let checked = crate::common::broker(&data, &["store", "check"]);
    let said = String::from_utf8_lossy(&checked.stdout);
    assert_eq!(checked.status.code(), Some(0), "{checked:?}");
    assert!(said.contains("not closed cleanly") && said.contains("the next open repairs it"), "{said}");
    assert!(!said.contains("cannot be opened"), "{said}");
    let rows = |text: &str, table: &str| -> Vec<u64> {
        let lines = text.lines().filter(|l| l.split_whitespace().next() == Some(table));
        lines.map(|l| l.split_whitespace().nth(1).unwrap().parse().unwrap()).collect()
    };
    assert_eq!(rows(&said, "instances"), [7], "{said}");
    let checked = crate::common::broker(&data, &["store", "check", "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&checked.stdout).unwrap();
    assert_eq!(report["unclean"], true, "{report}");
    // Checked, not changed: the same bytes, and no copy left behind.
    let after = (std::fs::read(&state).unwrap(), std::fs::read(data.join("state.wal")).unwrap());
    assert!(before == after, "store check changed the state file or its log");
    let names: Vec<String> =
        std::fs::read_dir(&data).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(!names.iter().any(|n| n.starts_with(".store-check-")), "{names:?}");

    let recovered = crate::common::broker(&data, &["store", "recover"]);
    let said = String::from_utf8_lossy(&recovered.stdout);
    assert_eq!(recovered.status.code(), Some(0), "{recovered:?}");
    let (_, with_log) = said.split_once("its write-ahead log applied:").expect("the rows after the log");
    assert_eq!(rows(with_log, "instances"), [7], "{said}");
    let daemon = Daemon::start(&data);
    let (_, listed) = daemon.json("GET", "/v1/instances", None);
    assert_eq!(listed.as_array().unwrap().len(), 7, "{listed}");
}
