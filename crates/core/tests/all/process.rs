//! The process capability: host implementation called directly (no wasm), and
//! through a real guest with and without its grant.

use broker_capabilities::bindings::BrokerError;
use broker_capabilities::bindings::broker::provider::process::{ChildStatus, Host, HostChild};
use broker_capabilities::rooms::context::CallHooks;
use broker_capabilities::rooms::kv::{KvBackend, MemoryKv};
use broker_capabilities::rooms::process::{
    ChildRecord, ChildRecords, HostProcesses, MAX_OUTPUT_BYTES, MemoryChildRecords, ProcessCtx, ProcessPolicy,
    ProcessView, proc_stat,
};
use broker_capabilities::sandbox::{Grants, Sandbox};
use broker_core::store::Store;
use broker_tests::{load_provider, runtime};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use wasmtime::component::{Resource, ResourceTable};

struct ProcessHost {
    ctx: ProcessCtx,
    table: ResourceTable,
}

impl ProcessHost {
    fn new(data_dir: &Path, programs: &[&str], paths: &[&str], records: Arc<dyn ChildRecords>) -> ProcessHost {
        Self::with_paths(data_dir, programs, paths, &[], records)
    }

    /// With `paths` granted read-only and `paths_rw` read-write.
    fn with_paths(
        data_dir: &Path,
        programs: &[&str],
        paths: &[&str],
        paths_rw: &[&str],
        records: Arc<dyn ChildRecords>,
    ) -> ProcessHost {
        std::fs::create_dir_all(data_dir).unwrap();
        let programs: Vec<String> = programs.iter().map(|p| p.to_string()).collect();
        let paths: Vec<PathBuf> = paths.iter().map(PathBuf::from).collect();
        let paths_rw: Vec<PathBuf> = paths_rw.iter().map(PathBuf::from).collect();
        let confinement = Sandbox::default()
            .confine(
                "p",
                &Grants {
                    data_dir,
                    paths: &paths,
                    paths_rw: &paths_rw,
                    devices: &[],
                    programs: &[],
                    limits: Default::default(),
                },
            )
            .unwrap();
        let every_path: Vec<PathBuf> = paths.iter().chain(&paths_rw).cloned().collect();
        let policy = Arc::new(ProcessPolicy::resolve(&programs, &every_path, data_dir).unwrap().confined(confinement));
        ProcessHost {
            ctx: ProcessCtx::new("p", Some(policy), Some(host_processes(records)), Default::default()),
            table: ResourceTable::new(),
        }
    }

    fn view(&mut self) -> ProcessView<'_> {
        ProcessView { ctx: &mut self.ctx, table: &mut self.table }
    }
}

/// The host's real process backend over `records`, with live handles of its own.
fn host_processes(records: Arc<dyn ChildRecords>) -> Arc<HostProcesses> {
    Arc::new(HostProcesses::new(records, Arc::default()))
}

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| s.to_string()).collect()
}

fn pid_alive(pid: u32) -> bool {
    proc_stat(pid).is_some_and(|(_, state)| state != 'Z')
}

#[tokio::test]
async fn granted_programs_run_verbatim_and_others_are_denied() {
    let dir = tempfile::tempdir().unwrap();
    let mut host = ProcessHost::new(dir.path(), &["sh", "touch", "cat"], &[], Arc::new(MemoryChildRecords::default()));
    let out = host
        .view()
        .run(
            "sh".into(),
            strings(&["-c", "echo \"$1|$LANG\"; echo oops >&2; exit 4", "sh", "a b; rm -rf /"]),
            vec![("LANG".into(), "hi".into())],
            vec![],
            5000,
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(out.exit_code, Some(4));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "a b; rm -rf /|hi\n", "arguments are passed verbatim, no shell");
    assert_eq!(String::from_utf8_lossy(&out.stderr), "oops\n");
    assert!(!out.truncated && !out.timed_out);

    let env = host
        .view()
        .run("sh".into(), strings(&["-c", "env | grep -v '^PWD=' | wc -l"]), vec![], vec![], 5000)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&env.stdout).trim(), "2", "PATH and HOME only, unless given");
    let ungranted_env = host
        .view()
        .run("sh".into(), strings(&["-c", "true"]), vec![("GREETING".into(), "hi".into())], vec![], 5000)
        .await
        .unwrap();
    assert!(matches!(&ungranted_env, Err(BrokerError::AccessDenied(m)) if m.contains("GREETING")), "{ungranted_env:?}");

    let denied = host.view().run("ls".into(), vec![], vec![], vec![], 5000).await.unwrap();
    assert!(matches!(denied, Err(BrokerError::AccessDenied(m)) if m.contains("\"ls\" is not granted")));
    let outside = host.view().run("cat".into(), strings(&["/etc/passwd"]), vec![], vec![], 5000).await.unwrap();
    assert!(matches!(outside, Err(BrokerError::AccessDenied(m)) if m.contains("/etc/passwd")));

    // `/data/...` is the provider's data dir on the host.
    host.view().run("touch".into(), strings(&["/data/made-by-touch"]), vec![], vec![], 5000).await.unwrap().unwrap();
    assert!(dir.path().join("made-by-touch").exists());

    let mut ungranted =
        ProcessCtx::new("p", None, Some(host_processes(Arc::new(MemoryChildRecords::default()))), Default::default());
    let mut table = ResourceTable::new();
    let mut view = ProcessView { ctx: &mut ungranted, table: &mut table };
    let none = view.run("sh".into(), vec![], vec![], vec![], 1000).await.unwrap();
    assert!(matches!(none, Err(BrokerError::AccessDenied(m)) if m.contains("process = [")));
}

#[tokio::test]
async fn timeout_kills_the_whole_group_and_output_is_capped() {
    let dir = tempfile::tempdir().unwrap();
    let mut host =
        ProcessHost::new(dir.path(), &["sh", "head"], &["/dev/zero"], Arc::new(MemoryChildRecords::default()));
    let out = host
        .view()
        .run("sh".into(), strings(&["-c", "(sleep 1; touch late) & touch early; wait"]), vec![], vec![], 300)
        .await
        .unwrap()
        .unwrap();
    assert!(out.timed_out);
    assert_eq!(out.exit_code, None);
    assert!(dir.path().join("early").exists(), "the program ran");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!dir.path().join("late").exists(), "the grandchild in the same process group was killed too");

    let big = host
        .view()
        .run("head".into(), strings(&["-c", "3000000", "/dev/zero"]), vec![], vec![], 5000)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(big.stdout.len(), MAX_OUTPUT_BYTES);
    assert!(big.truncated);
    assert_eq!(big.exit_code, Some(0), "the program ran to completion while its output was drained");
}

#[tokio::test]
async fn a_spawned_child_outlives_the_host_and_is_readopted_by_pid_and_start_time() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("state");
    let provider_dir = dir.path().join("provider");
    let (name, pid) = {
        let store = Store::open(&data).unwrap();
        let mut host = ProcessHost::new(&provider_dir, &["sleep"], &[], store.child_records());
        let child = host.view().spawn("vm-1".into(), "sleep".into(), strings(&["30"]), vec![]).await.unwrap().unwrap();
        let pid = host.view().pid(Resource::new_own(child.rep())).await.unwrap();
        assert_eq!(host.view().status(Resource::new_own(child.rep())).await.unwrap(), ChildStatus::Running);
        let again = host.view().spawn("vm-1".into(), "sleep".into(), strings(&["30"]), vec![]).await.unwrap();
        assert!(matches!(again, Err(BrokerError::InvalidParams(_))), "a running child's name is taken");
        ("vm-1".to_string(), pid)
        // The host goes away here: its store, its live handles; the child keeps running.
    };
    assert!(pid_alive(pid));

    // A new host on the same state finds it again.
    let store = Store::open(&data).unwrap();
    let mut host = ProcessHost::new(&provider_dir, &["sleep"], &[], store.child_records());
    assert_eq!(host.view().children().await.unwrap(), vec![name.clone()]);
    let adopted = host.view().adopt(name.clone()).await.unwrap().unwrap().expect("re-adopted");
    assert_eq!(host.view().pid(Resource::new_own(adopted.rep())).await.unwrap(), pid);
    assert_eq!(host.view().status(Resource::new_own(adopted.rep())).await.unwrap(), ChildStatus::Running);
    // KILL, not TERM: a TERM that reaches the sandbox while it is still
    // setting up (pid 1 of its namespace, no default actions) is lost, which
    // made this test flaky on a loaded machine; KILL takes the whole sandbox.
    host.view().signal(Resource::new_own(adopted.rep()), 9).await.unwrap().unwrap();
    let status = host.view().wait(Resource::new_own(adopted.rep()), 5000).await.unwrap();
    assert_eq!(status, ChildStatus::Gone, "not our child any more, so only its disappearance is seen");
    assert!(host.view().adopt(name).await.unwrap().unwrap().is_none(), "a gone child is forgotten");
}

#[tokio::test]
async fn a_recycled_pid_is_never_mistaken_for_the_child() {
    let dir = tempfile::tempdir().unwrap();
    let records = Arc::new(MemoryChildRecords::default());
    // A record whose pid now belongs to another process (this test), with another start time.
    let (start, _) = proc_stat(std::process::id()).unwrap();
    records
        .put(&ChildRecord {
            provider: "p".into(),
            name: "old-vm".into(),
            pid: std::process::id(),
            start_time: start + 1,
            program: "/usr/bin/qemu-system-x86_64".into(),
            args: vec![],
            log: String::new(),
            sandbox: None,
        })
        .await
        .unwrap();
    let mut host = ProcessHost::new(dir.path(), &["sleep"], &[], records);
    assert!(host.view().adopt("old-vm".into()).await.unwrap().unwrap().is_none());
}

#[tokio::test]
async fn a_guest_runs_granted_programs_and_sees_only_its_data_dir() {
    let dir = tempfile::tempdir().unwrap();
    let kv = Arc::new(MemoryKv::default());
    let rt = runtime();
    let base = "[grants]\nkv = true\n";
    let ungranted = load_provider(&rt, kv.clone(), dir.path(), "hostile", "test-hostile", base).unwrap();
    kv.set("hostile", "mode", b"run").unwrap();
    let err = ungranted.all_instances(&CallHooks::default()).await.unwrap_err();
    assert!(matches!(err.broker_error(), Some(BrokerError::AccessDenied(m)) if m.contains("process")), "{err}");

    let granted =
        load_provider(&rt, kv.clone(), dir.path(), "hostile", "test-hostile", &format!("{base}process = [\"echo\"]\n"))
            .unwrap();
    assert_eq!(granted.all_instances(&CallHooks::default()).await.unwrap()[0].id, "hello");

    kv.set("hostile", "mode", b"fs").unwrap();
    assert_eq!(granted.all_instances(&CallHooks::default()).await.unwrap()[0].id, "written by the guest");
    let on_host = std::fs::read_to_string(granted.data_dir().join("hello.txt")).unwrap();
    assert_eq!(on_host, "written by the guest");
}

#[tokio::test]
async fn a_grant_of_a_missing_program_is_refused_at_load() {
    let dir = tempfile::tempdir().unwrap();
    let err = load_provider(
        &runtime(),
        Arc::new(MemoryKv::default()),
        dir.path(),
        "hostile",
        "test-hostile",
        "[grants]\nkv = true\nprocess = [\"no-such-program-anywhere\"]\n",
    )
    .err()
    .unwrap();
    assert!(err.to_string().contains("\"no-such-program-anywhere\" was not found"), "{err}");
}

/// A shell script run as a granted program: arguments after `-c` are not paths
/// the host can parse, so only the sandbox stands between it and the host.
async fn sh(host: &mut ProcessHost, script: &str) -> (String, String) {
    let out = host.view().run("sh".into(), strings(&["-c", script]), vec![], vec![], 10_000).await.unwrap().unwrap();
    (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[tokio::test]
async fn a_granted_program_sees_only_its_data_dir_as_an_unprivileged_user_with_nothing_inherited() {
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "host secret").unwrap();
    let data = dir.path().join("data/p");
    let mut host = ProcessHost::new(&data, &["sh"], &[], Arc::new(MemoryChildRecords::default()));

    let (out, _) = sh(&mut host, "id -u; id -G; grep -E '^(NoNewPrivs|CapEff)' /proc/self/status").await;
    let lines: Vec<&str> = out.lines().collect();
    assert_ne!(lines[0], "0", "not root: {out}");
    assert!(!lines[1].split_whitespace().any(|g| g == "0"), "no root group: {out}");
    assert!(out.contains("NoNewPrivs:\t1"), "{out}");
    assert!(out.contains("CapEff:\t0000000000000000"), "{out}");

    // Descriptors: only stdin, stdout, stderr (and the one ls opens to list them).
    let (fds, _) = sh(&mut host, "ls /proc/self/fd").await;
    let fds: Vec<&str> = fds.split_whitespace().collect();
    assert!(fds.len() <= 4 && fds.starts_with(&["0", "1", "2"]), "inherited descriptors: {fds:?}");

    // The host's files are not there: not the secret beside the data dir, not /etc, not the state.
    let (out, err) = sh(&mut host, &format!("cat {} /etc/hostname /etc/shadow; ls /", secret.display())).await;
    assert!(!out.contains("host secret") && err.contains("No such file"), "{out} {err}");
    assert!(!out.contains("root") && !out.contains("home"), "only the sandbox's root: {out}");

    // A link the guest planted in /data resolves inside the sandbox, where its target is not.
    std::os::unix::fs::symlink(format!("../../{}", "secret"), data.join("link")).unwrap();
    let (out, _) = sh(&mut host, "cat link; cp link copied").await;
    assert!(!out.contains("host secret"), "{out}");
    assert!(!data.join("copied").exists());

    // Read-only system, no network but loopback, a pid namespace of its own.
    let (_, err) = sh(&mut host, "touch /usr/evil").await;
    assert!(err.contains("Read-only") || err.contains("Permission denied"), "{err}");
    let (out, _) = sh(&mut host, "ls /sys/class/net 2>/dev/null; cat /proc/net/dev; echo pid=$$").await;
    assert!(!out.contains("eth") && out.contains("lo:"), "{out}");
    assert!(out.contains("pid=2") || out.contains("pid=1"), "{out}");
    // No user namespace of its own to play root in.
    let (out, err) = sh(&mut host, "command -v unshare; unshare -U -r true; echo rc=$?").await;
    assert!(out.starts_with("/usr/bin/unshare\n"), "unshare is there to try: {out}");
    assert!(out.contains("rc=") && !out.contains("rc=0"), "a nested user namespace was made: {out}");
    assert!(err.contains("No space left on device"), "refused by the namespace limit: {err}");

    // It can write its data dir, and the host (the guest, through WASI) can read what it wrote, and back.
    std::fs::create_dir_all(data.join("made-by-guest")).unwrap();
    let (_, err) = sh(&mut host, "echo hi > made-by-guest/by-program && cat made-by-guest/by-program").await;
    assert_eq!(err, "");
    assert_eq!(std::fs::read_to_string(data.join("made-by-guest/by-program")).unwrap(), "hi\n");
    assert_eq!(std::fs::read_to_string(&secret).unwrap(), "host secret");
}

/// Granted paths are what the manifest says: `paths` visible read-only,
/// `paths-rw` writable, nothing beside them; and the resource limits hold.
#[tokio::test]
async fn granted_paths_are_read_only_unless_granted_rw_and_limits_hold() {
    let dir = tempfile::tempdir().unwrap();
    let (ro, rw) = (dir.path().join("images"), dir.path().join("scratch"));
    for granted in [&ro, &rw] {
        std::fs::create_dir_all(granted).unwrap();
        std::fs::write(granted.join("base"), "as the operator left it").unwrap();
    }
    std::fs::write(dir.path().join("beside"), "not granted").unwrap();
    let data = dir.path().join("data/p");
    let (ro_text, rw_text) = (ro.display().to_string(), rw.display().to_string());
    let mut host =
        ProcessHost::with_paths(&data, &["sh"], &[&ro_text], &[&rw_text], Arc::new(MemoryChildRecords::default()));

    let (out, err) = sh(&mut host, &format!("cat {ro_text}/base; echo x > {ro_text}/base; touch {ro_text}/new")).await;
    assert_eq!(out, "as the operator left it", "read-only paths can be read");
    assert!(err.contains("Read-only file system"), "{err}");
    assert_eq!(std::fs::read_to_string(ro.join("base")).unwrap(), "as the operator left it");
    assert!(!ro.join("new").exists());

    let (_, err) = sh(&mut host, &format!("echo changed > {rw_text}/base && touch {rw_text}/new")).await;
    assert_eq!(err, "", "paths-rw can be written");
    assert_eq!(std::fs::read_to_string(rw.join("base")).unwrap(), "changed\n");
    assert!(rw.join("new").exists());

    let beside = dir.path().join("beside").display().to_string();
    let (out, err) = sh(&mut host, &format!("cat {beside}")).await;
    assert!(!out.contains("not granted") && err.contains("No such file"), "{out} {err}");

    let (limits, _) = sh(&mut host, "cat /proc/self/limits").await;
    let limit = |name: &str| {
        let line = limits.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("{name}: {limits}"));
        line[name.len()..].split_whitespace().take(2).collect::<Vec<_>>().join(" ")
    };
    assert_eq!(limit("Max processes"), "512 512", "{limits}");
    assert_eq!(limit("Max open files"), "1024 1024", "{limits}");
    assert_eq!(limit("Max core file size"), "0 0", "{limits}");
}

#[tokio::test]
async fn loader_variables_are_refused_before_anything_runs() {
    let dir = tempfile::tempdir().unwrap();
    let mut host = ProcessHost::new(dir.path(), &["sh"], &[], Arc::new(MemoryChildRecords::default()));
    for name in ["LD_PRELOAD", "LD_LIBRARY_PATH", "GCONV_PATH", "GLIBC_TUNABLES"] {
        let env = vec![(name.to_owned(), "/data/evil.so".to_owned())];
        let denied = host.view().run("sh".into(), strings(&["-c", "touch ran"]), env, vec![], 5000).await.unwrap();
        assert!(matches!(&denied, Err(BrokerError::AccessDenied(m)) if m.contains(name)), "{name}: {denied:?}");
    }
    assert!(!dir.path().join("ran").exists(), "nothing ran");
}

/// qemu-img follows what an image names: a `json:` filename and a backing file
/// are both paths the host's argument check cannot see. In the sandbox they
/// name nothing.
#[tokio::test]
async fn qemu_img_cannot_be_pointed_at_host_files() {
    if std::process::Command::new("qemu-img").arg("--version").output().is_err() {
        panic!("qemu-img is needed (qemu-utils; scripts/install-test-deps.sh installs it)");
    }
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("secret.raw");
    std::fs::write(&secret, "host secret in a raw image").unwrap();
    let data = dir.path().join("data/kvm");
    let mut host = ProcessHost::new(&data, &["qemu-img"], &[], Arc::new(MemoryChildRecords::default()));
    let json = format!(r#"json:{{"file":{{"driver":"file","filename":"{}"}}}}"#, secret.display());
    let out = host
        .view()
        .run("qemu-img".into(), strings(&["convert", "-O", "raw", &json, "/data/stolen.raw"]), vec![], vec![], 10_000)
        .await
        .unwrap()
        .unwrap();
    assert_ne!(out.exit_code, Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!data.join("stolen.raw").exists());

    // A qcow2 the guest wrote whose backing file is a host path.
    let made = host
        .view()
        .run(
            "qemu-img".into(),
            strings(&["create", "-f", "qcow2", "-u", "-F", "raw", "-b", "evil-backing", "/data/evil.qcow2", "1M"]),
            vec![],
            vec![],
            10_000,
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(made.exit_code, Some(0), "{}", String::from_utf8_lossy(&made.stderr));
    // Point the backing file at the host secret by rewriting the header, as a guest could.
    let image = std::fs::read(data.join("evil.qcow2")).unwrap();
    let image = crate::sandbox::qcow2_backed_by(&image, &secret.display().to_string());
    std::fs::write(data.join("evil.qcow2"), &image).unwrap();
    let out = host
        .view()
        .run(
            "qemu-img".into(),
            strings(&["convert", "-O", "raw", "/data/evil.qcow2", "/data/stolen2.raw"]),
            vec![],
            vec![],
            10_000,
        )
        .await
        .unwrap()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.exit_code, Some(0), "{stderr}");
    assert!(stderr.contains("backing file") && stderr.contains("No such file"), "{stderr}");
    let stolen = std::fs::read(data.join("stolen2.raw")).unwrap_or_default();
    assert!(!String::from_utf8_lossy(&stolen).contains("host secret"), "{stderr}");
}

#[tokio::test]
async fn a_spawned_childs_log_is_never_written_through_a_planted_link() {
    let dir = tempfile::tempdir().unwrap();
    let victim = dir.path().join("victim");
    std::fs::write(&victim, "untouched").unwrap();
    let data = dir.path().join("data/p");
    let mut host = ProcessHost::new(&data, &["echo"], &[], Arc::new(MemoryChildRecords::default()));
    std::fs::create_dir_all(data.join("logs")).unwrap();
    std::os::unix::fs::symlink(&victim, data.join("logs/vm.log")).unwrap();
    let spawned = host.view().spawn("vm".into(), "echo".into(), strings(&["appended"]), vec![]).await.unwrap();
    assert!(matches!(&spawned, Err(BrokerError::AccessDenied(m)) if m.contains("link")), "{spawned:?}");
    // And a link in place of the logs directory itself.
    std::fs::remove_dir_all(data.join("logs")).unwrap();
    std::os::unix::fs::symlink(dir.path(), data.join("logs")).unwrap();
    let spawned = host.view().spawn("victim".into(), "echo".into(), strings(&["appended"]), vec![]).await.unwrap();
    assert!(spawned.is_err(), "{spawned:?}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "untouched");
}
