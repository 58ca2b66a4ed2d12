//! The machine lock across real processes: `broker lock run` contending,
//! a holder killed with SIGKILL, timeouts, exit statuses and the report.

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn broker(data_dir: &Path) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_broker"));
    command.arg("--data-dir").arg(data_dir).env_remove("RUST_LOG");
    command
}

fn run(data_dir: &Path, args: &[&str]) -> Output {
    broker(data_dir).args(args).output().unwrap()
}

fn report(data_dir: &Path) -> serde_json::Value {
    serde_json::from_slice(&run(data_dir, &["lock", "--json", "--history", "1000"]).stdout).unwrap()
}

/// Poll until `ready` holds, for at most 10 s (a bound, not a measurement).
fn wait_until(mut ready: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ready() {
        assert!(start.elapsed() < Duration::from_secs(10), "condition never became true");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn contending_processes_never_hold_the_lock_together() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path();
    // mkdir is atomic: it fails if another holder is inside.
    let critical = format!(
        "mkdir {d}/inside 2>/dev/null || echo overlap >> {d}/violations; sleep 0.01; rmdir {d}/inside",
        d = data.display()
    );
    let (processes, rounds) = (4, 6);
    let children: Vec<_> = (0..processes)
        .map(|p| {
            let script = format!(
                "for i in $(seq {rounds}); do {broker} --data-dir {data} lock run --worker w{p} --comment \"round $i\" \
                 -- sh -c '{critical}' || exit 1; done",
                broker = env!("CARGO_BIN_EXE_broker"),
                data = data.display(),
            );
            Command::new("sh").arg("-c").arg(script).spawn().unwrap()
        })
        .collect();
    for mut child in children {
        assert!(child.wait().unwrap().success());
    }
    assert!(!data.join("violations").exists(), "two holders were inside at once");
    let history = report(data)["history"].as_array().unwrap().clone();
    assert_eq!(history.len(), processes * rounds, "one history line per hold");
    let line = history[0].as_str().unwrap();
    assert!(is_history_line(line), "history line format: {line}");
}

/// `YYYY-MM-DD HH:MM:SS broker: wN (round K), waited Xs, held Ys`
fn is_history_line(line: &str) -> bool {
    let (stamp, rest) = line.split_at(19);
    let stamp_ok = stamp.chars().enumerate().all(|(i, c)| match i {
        4 | 7 => c == '-',
        10 => c == ' ',
        13 | 16 => c == ':',
        _ => c.is_ascii_digit(),
    });
    stamp_ok
        && rest.starts_with(" broker: w")
        && rest.contains(" (round ")
        && rest.contains("), waited ")
        && rest.contains("s, held ")
        && rest.ends_with('s')
}

#[test]
fn a_killed_holder_releases_the_lock_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path();
    let pid_file = data.join("sleeper.pid");
    let mut holder = broker(data)
        .args(["lock", "run", "--worker", "victim", "--comment", "long job", "--", "sh", "-c"])
        .arg(format!("echo $$ > {}; exec sleep 30", pid_file.display()))
        .spawn()
        .unwrap();
    wait_until(|| report(data)["holder"]["worker"] == "victim");

    let text = String::from_utf8(run(data, &["lock"]).stdout).unwrap();
    assert!(text.contains("holder: victim (long job), holding "), "{text}");

    // While it is held, a waiter with a timeout gives up with Juju's message.
    let timed_out = run(data, &["lock", "run", "--worker", "late", "--timeout", "200ms", "--", "true"]);
    assert_eq!(timed_out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&timed_out.stderr).contains("timeout acquiring mutex"));

    holder.kill().unwrap(); // SIGKILL: no release code runs
    holder.wait().unwrap();
    // The lock fd was close-on-exec, so the orphaned `sleep` does not hold it.
    let next = run(data, &["lock", "run", "--worker", "next", "--timeout", "2s", "--", "true"]);
    assert!(next.status.success(), "{}", String::from_utf8_lossy(&next.stderr));
    assert!(report(data)["holder"].is_null());

    let sleeper = std::fs::read_to_string(&pid_file).unwrap();
    let _ = Command::new("kill").arg(sleeper.trim()).status();
}

#[test]
fn lock_run_passes_the_programs_status_and_arguments_through() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path();
    let out = run(data, &["lock", "run", "--worker", "w", "--", "sh", "-c", "echo \"$1\"; exit 3", "sh", "two words"]);
    assert_eq!(out.status.code(), Some(3));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "two words\n");
    let missing = run(data, &["lock", "run", "--worker", "w", "--", "/nonexistent/program"]);
    assert_eq!(missing.status.code(), Some(1));
    assert!(report(data)["holder"].is_null(), "the lock is released when the program cannot start");
    let no_worker = run(data, &["lock", "run", "--", "true"]);
    assert_eq!(no_worker.status.code(), Some(2));
    let group = run(data, &["lock", "--group", "net"]);
    assert!(String::from_utf8_lossy(&group.stdout).starts_with("machine-lock-net:"));
    let bad_group = run(data, &["lock", "--group", "../etc"]);
    assert_eq!(bad_group.status.code(), Some(2));
}
