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

    // Space comes back: the store reopens by itself, and writes are taken again.
    std::fs::remove_file(&filler).unwrap();
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
