//! The README's daemon examples, run as written: curl on the daemon's unix
//! socket, bodies sent with `-d` (which says nothing of JSON).

use crate::common::Daemon;
use std::path::Path;
use std::process::Command;

/// The shell block after "As a daemon" in the README.
fn daemon_examples(readme: &str) -> Vec<&str> {
    let at = readme.find("As a daemon (").expect("the README has its daemon examples");
    let block = &readme[at..];
    let block = &block[block.find("```sh\n").expect("a sh block") + "```sh\n".len()..];
    block[..block.find("```").expect("the block ends")].lines().collect()
}

#[test]
fn the_readme_s_daemon_examples_work_as_written() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap();
    let readme = std::fs::read_to_string(repo.join("README.md")).unwrap();
    let lines = daemon_examples(&readme);
    let curl = Command::new("curl").arg("--version").output();
    assert!(
        curl.is_ok_and(|out| out.status.success()),
        "the README's examples need curl (scripts/install-test-deps.sh installs it)"
    );
    // The first starts the daemon, which the test does itself (and stops at the end).
    assert!(lines[0].starts_with("$B --data-dir /tmp/b serve &"), "{}", lines[0]);
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("b");
    let mut daemon = Daemon::start(&data);
    let data_dir = data.display().to_string();

    // Each command as written (its data dir moved), each curl's status noted after its output.
    // `$B` as the README's first block sets it: this build's `broker`.
    let mut script = format!("set -u\nB={}\n", env!("CARGO_BIN_EXE_broker"));
    for line in &lines[1..] {
        script.push_str(&line.replace("/tmp/b", &data_dir));
        script.push('\n');
        if line.starts_with("S=") {
            script.push_str("S=\"$S -w \\n@status=%{http_code}\\n\"\n");
        }
        script.push_str("echo @done\n");
    }
    let run = Command::new("bash").arg("-c").arg(&script).current_dir(&repo).output().expect("bash");
    let out = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{out}{}", String::from_utf8_lossy(&run.stderr));
    let outputs: Vec<&str> = out.split("@done\n").collect();
    for (line, output) in lines[1..].iter().zip(&outputs) {
        let statuses: Vec<&str> = output.lines().filter_map(|l| l.strip_prefix("@status=")).collect();
        if line.starts_with("S=") {
            continue;
        }
        assert!(!statuses.is_empty(), "{line}: no request made: {output}");
        if line.contains("/path/new.wasm") {
            // A placeholder: refused, saying which file.
            assert!(statuses.iter().all(|s| s.starts_with('4')), "{line}: {output}");
            assert!(output.contains("/path/new.wasm"), "{line}: {output}");
        } else {
            assert!(statuses.iter().all(|s| s.starts_with('2')), "{line}: {output}");
        }
    }
    // What they did (as the README has them today: the fake added, two
    // instances started, the first, fake-0, stopped).
    let (status, listed) = daemon.json("GET", "/v1/instances?provider=fake", None);
    assert_eq!(status, 200);
    let ids: Vec<&str> = listed.as_array().unwrap().iter().filter_map(|r| r["id"].as_str()).collect();
    assert_eq!(ids.len(), 1, "{listed}");
    assert!(!ids.contains(&"fake-0"), "{listed}");
    assert!(daemon.terminate().success());
}
