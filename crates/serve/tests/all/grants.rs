//! Hostile grants through the real binary: what a grant hands a provider is
//! that provider's alone (issue 36). Each test asserts the refusal and that
//! nothing happened.

use super::common::broker;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// A manifest of the hostile guest named `name`, with `grants` in `[grants]`.
fn hostile(dir: &Path, name: &str, grants: &str) -> PathBuf {
    let path = dir.join(format!("{name}.toml"));
    let text = format!(
        "name = \"{name}\"\ncomponent = \"{}\"\n[limits]\nmemory-mib = 32\n[grants]\nkv = true\n{grants}\n",
        guest_artifacts::wasm("test-hostile").display()
    );
    std::fs::write(&path, text).unwrap();
    path
}

fn add(data: &Path, manifest: &Path) -> std::process::Output {
    broker(data, &["provider", "add", &manifest.display().to_string()])
}

fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The named-user entries of `path`'s access ACL, read without following a link.
fn acl_users(path: &Path) -> Vec<u32> {
    use rustix::fs::{Mode, OFlags};
    let fd = rustix::fs::open(path, OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK, Mode::empty()).unwrap();
    let mut buf = vec![0u8; 4096];
    let Ok(n) = rustix::fs::fgetxattr(&fd, "system.posix_acl_access", &mut buf[..]) else { return Vec::new() };
    buf[4..n]
        .chunks_exact(8)
        .filter(|e| u16::from_le_bytes([e[0], e[1]]) == 0x02)
        .map(|e| u32::from_le_bytes([e[4], e[5], e[6], e[7]]))
        .collect()
}

fn as_root() -> bool {
    if rustix::process::geteuid().is_root() {
        return true;
    }
    eprintln!("skipped: sandbox users, ACLs and claims are a root host's");
    false
}

/// Provider A may write `shared`; B is granted a path inside it. A could swap
/// that path for a link to anything of root's (the state, another's data dir):
/// B is refused at add, and so is a grant reached through a link, one inside
/// the host's data dir, and one holding it. A grant that is fine is shared and,
/// once its provider is removed, taken back.
#[test]
fn a_grant_another_provider_could_replace_is_refused_and_a_removed_ones_acls_go() {
    if !as_root() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("state");
    let srv = dir.path().join("srv");
    std::fs::create_dir_all(srv.join("shared/images")).unwrap();
    std::fs::create_dir_all(srv.join("ro/sub")).unwrap();
    std::fs::write(srv.join("ro/sub/base.img"), "base").unwrap();
    std::os::unix::fs::symlink(&srv, dir.path().join("link")).unwrap();

    let a = hostile(dir.path(), "a", &format!("process = [\"sh\"]\npaths-rw = [\"{}\"]", srv.join("shared").display()));
    let out = add(&data, &a);
    assert!(out.status.success(), "{}", stderr(&out));

    let b =
        hostile(dir.path(), "b", &format!("process = [\"sh\"]\npaths = [\"{}\"]", srv.join("shared/images").display()));
    let out = add(&data, &b);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert!(stderr(&out).contains("provider \"a\" may write"), "{}", stderr(&out));
    assert!(acl_users(&srv.join("shared/images")).len() == 1, "only a's entry: b was given nothing");

    let linked = hostile(
        dir.path(),
        "c",
        &format!("process = [\"sh\"]\npaths = [\"{}\"]", dir.path().join("link/ro").display()),
    );
    let out = add(&data, &linked);
    assert_eq!(out.status.code(), Some(3));
    assert!(stderr(&out).contains("symbolic link"), "{}", stderr(&out));
    assert!(acl_users(&srv.join("ro")).is_empty(), "nothing shared through the link");

    for (name, path) in [("in-state", data.join("data")), ("above-state", dir.path().to_owned())] {
        let manifest = hostile(dir.path(), name, &format!("process = [\"sh\"]\npaths = [\"{}\"]", path.display()));
        let out = add(&data, &manifest);
        assert_eq!(out.status.code(), Some(3), "{name}");
        assert!(stderr(&out).contains("the host's data dir"), "{name}: {}", stderr(&out));
    }
    assert!(acl_users(&data.join("state.redb")).is_empty(), "the state was shared with no one");

    let d = hostile(dir.path(), "d", &format!("process = [\"sh\"]\npaths = [\"{}\"]", srv.join("ro").display()));
    let out = add(&data, &d);
    assert!(out.status.success(), "{}", stderr(&out));
    let file = srv.join("ro/sub/base.img");
    let shared_with = acl_users(&file);
    assert_eq!(shared_with.len(), 1, "d's user reads the file it was granted");
    let out = broker(&data, &["provider", "remove", "d"]);
    assert!(out.status.success(), "{}", stderr(&out));
    for path in [srv.join("ro"), srv.join("ro/sub"), file, dir.path().to_owned()] {
        assert!(!acl_users(&path).contains(&shared_with[0]), "{} kept the removed provider's entry", path.display());
    }
}

/// Two broker hosts on one machine never give their providers one uid: each
/// uid is claimed in the machine's directory, naming the host's data dir.
#[test]
fn two_hosts_on_one_machine_never_share_a_sandbox_uid() {
    if !as_root() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut uids = Vec::new();
    for host in ["one", "two"] {
        let data = dir.path().join(host);
        let manifest = hostile(dir.path(), "p", "process = [\"sh\"]");
        let out = add(&data, &manifest);
        assert!(out.status.success(), "{}", stderr(&out));
        // The machine's claims: the one naming this host's data dir is its provider's.
        let host = format!("\"data_dir\":{:?}", data.display().to_string());
        let claimed: Vec<u32> = std::fs::read_dir("/var/lib/wasm-broker/uids")
            .unwrap()
            .flatten()
            .filter(|e| std::fs::read_to_string(e.path()).is_ok_and(|claim| claim.contains(&host)))
            .filter_map(|e| e.file_name().to_str()?.parse().ok())
            .collect();
        assert_eq!(claimed.len(), 1, "{host}: {claimed:?}");
        uids.push(claimed[0]);
    }
    assert_ne!(uids[0], uids[1], "two hosts' first providers got one uid");
}

/// Whatever mode the operator gave DATA_DIR, no other local user reads a
/// provider's files; a DATA_DIR others may write is refused.
#[test]
fn data_dirs_are_private_and_a_writable_data_dir_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("state");
    std::fs::create_dir(&data).unwrap();
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o777)).unwrap();
    let manifest = hostile(dir.path(), "p", "");
    let out = add(&data, &manifest);
    assert_eq!(out.status.code(), Some(9), "the host's storage is unsafe");
    assert!(stderr(&out).contains("writable by its group or by every user"), "{}", stderr(&out));
    assert!(!data.join("state.redb").exists());

    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = add(&data, &manifest);
    assert!(out.status.success(), "{}", stderr(&out));
    for path in [data.join("data"), data.join("data/p")] {
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        // Group bits are the ACL's mask where the provider's user has an entry: others have nothing.
        assert_eq!(mode & 0o007, 0, "{} is {mode:o}", path.display());
    }
}

/// A provider's output cannot pass for a line of the host's own: a carriage
/// return or an escape sequence in it is shown escaped.
#[test]
fn a_providers_output_cannot_forge_a_log_line() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("state");
    let manifest = hostile(dir.path(), "p", "[config]\nmode = \"forge\"");
    let out = add(&data, &manifest);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = super::common::broker_command(&data, &["-v", "instance", "list", "--provider", "p"]).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let log = stderr(&out);
    let forged: Vec<&str> = log.lines().filter(|l| l.contains("forged")).collect();
    assert_eq!(forged.len(), 1, "{log}");
    assert!(forged[0].contains("provider=\"p\""), "{}", forged[0]);
    assert!(!log.contains('\r') && !log.contains('\x1b'), "a raw control character reached the log: {log:?}");
    assert!(forged[0].contains("\\r") && forged[0].contains("\\x1b"), "shown escaped: {}", forged[0]);
}
