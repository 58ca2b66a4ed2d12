//! The process capability: host implementation called directly (no wasm), and
//! through a real guest with and without its grant.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use broker_host::bindings::BrokerError;
use broker_host::bindings::broker::provider::process::{ChildStatus, Host, HostChild};
use broker_host::capabilities::context::CallHooks;
use broker_host::capabilities::kv::{KvBackend, MemoryKv};
use broker_host::capabilities::process::{
    ChildRecord, ChildRecords, LiveChildren, MAX_OUTPUT_BYTES, MemoryChildRecords, ProcessCtx, ProcessPolicy,
    ProcessView, proc_stat,
};
use broker_host::store::Store;
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
        std::fs::create_dir_all(data_dir).unwrap();
        let programs: Vec<String> = programs.iter().map(|p| p.to_string()).collect();
        let paths: Vec<PathBuf> = paths.iter().map(PathBuf::from).collect();
        let policy = Arc::new(ProcessPolicy::resolve(&programs, &paths, data_dir).unwrap());
        ProcessHost {
            ctx: ProcessCtx::new("p", Some(policy), records, Arc::new(LiveChildren::default()), Default::default()),
            table: ResourceTable::new(),
        }
    }

    fn view(&mut self) -> ProcessView<'_> {
        ProcessView { ctx: &mut self.ctx, table: &mut self.table }
    }
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
            strings(&["-c", "echo \"$1|$GREETING\"; echo oops >&2; exit 4", "sh", "a b; rm -rf /"]),
            vec![("GREETING".into(), "hi".into())],
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
    assert_eq!(String::from_utf8_lossy(&env.stdout).trim(), "0", "the environment is empty unless given");

    let denied = host.view().run("ls".into(), vec![], vec![], vec![], 5000).await.unwrap();
    assert!(matches!(denied, Err(BrokerError::AccessDenied(m)) if m.contains("\"ls\" is not granted")));
    let outside = host.view().run("cat".into(), strings(&["/etc/passwd"]), vec![], vec![], 5000).await.unwrap();
    assert!(matches!(outside, Err(BrokerError::AccessDenied(m)) if m.contains("/etc/passwd")));

    // `/data/...` is the provider's data dir on the host.
    host.view().run("touch".into(), strings(&["/data/made-by-touch"]), vec![], vec![], 5000).await.unwrap().unwrap();
    assert!(dir.path().join("made-by-touch").exists());

    let mut ungranted =
        ProcessCtx::new("p", None, Arc::new(MemoryChildRecords::default()), Arc::default(), Default::default());
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
        .run("sh".into(), strings(&["-c", "sleep 30 & echo $! > bg.pid; wait"]), vec![], vec![], 300)
        .await
        .unwrap()
        .unwrap();
    assert!(out.timed_out);
    assert_eq!(out.exit_code, None);
    let background: u32 = std::fs::read_to_string(dir.path().join("bg.pid")).unwrap().trim().parse().unwrap();
    for _ in 0..200 {
        if !pid_alive(background) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!pid_alive(background), "the grandchild in the same process group was killed too");

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
    host.view().signal(Resource::new_own(adopted.rep()), 15).await.unwrap().unwrap();
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
        })
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
