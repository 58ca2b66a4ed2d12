//! The LXD provider against a real Incus daemon: the real host (`Broker`),
//! the real component, `wasi:http` routed by the host to the daemon's unix
//! socket. Each test starts its own incusd in namespaces of its own
//! (broker_tests::incus) and stops it by pid at the end.

// A test binary of its own, as broker-serve's kvm.rs: real VMs and containers share no process
// and no test threads with the rest of the suite (in one binary with it, a VM
// here twice failed to boot within its deadline; cause not yet found).
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use broker_capabilities::bindings::InstanceStatus;
use broker_capabilities::contract::constraints;
use broker_capabilities::contract::{interface_on, params_with};
use broker_capabilities::rooms::context::CallHooks;
use broker_core::broker::Broker;
use broker_tests::incus::{IncusDaemon, lxd_manifest_text};
use broker_tests::netns::in_netns_of;
use broker_tests::recording_hooks;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The bundled manifest for this daemon, written into `dir`.
fn lxd_manifest(dir: &Path, daemon: &IncusDaemon, name: &str, namespace: &str, grant: bool) -> PathBuf {
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, lxd_manifest_text(&daemon.socket(), name, namespace, grant)).unwrap();
    path
}

fn image_alias(alias: &str) -> broker_capabilities::bindings::ImageMetadata {
    broker_capabilities::bindings::ImageMetadata {
        id: alias.into(),
        arch: "amd64".into(),
        base: String::new(),
        region: String::new(),
        endpoint: String::new(),
        stream: String::new(),
        virt_type: Some("lxd".into()),
        storage: None,
        extra: vec![("alias".into(), alias.into())],
    }
}

/// The memory limit the kernel enforces on a container, from its cgroup on the host.
fn memory_limit_bytes(daemon: &IncusDaemon, name: &str) -> u64 {
    let pid = daemon.api(&format!("/1.0/instances/{name}/state")).unwrap()["pid"].as_u64().unwrap();
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let memory = cgroups.lines().find_map(|l| l.split_once(":memory:").map(|(_, path)| path.to_owned()));
    let file = match memory {
        Some(path) => format!("/sys/fs/cgroup/memory{path}/memory.limit_in_bytes"),
        None => {
            let path = cgroups.lines().find_map(|l| l.strip_prefix("0::")).unwrap().to_owned();
            format!("/sys/fs/cgroup{path}/memory.max")
        }
    };
    std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{file}: {e}")).trim().parse().unwrap()
}

fn exec(daemon: &IncusDaemon, name: &str, command: &[&str]) -> String {
    let mut args = vec!["exec", name, "--", "/bin/busybox"];
    args.extend_from_slice(command);
    daemon.incus_ok(&args).trim().to_owned()
}

#[test]
fn three_containers_run_with_their_limits_a_nic_on_the_bridge_and_stop_cleanly() {
    let daemon = IncusDaemon::start("br-lxdtest");
    let daemon_pid = daemon.pid();
    let daemon = Arc::new(daemon);
    let d = daemon.clone();
    in_netns_of(daemon.netns(), move || async move {
        let daemon = d;
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path();
        let broker = Broker::open(data).unwrap();
        broker.registry().add(&lxd_manifest(data, &daemon, "lxd", "t1", true)).await.unwrap();

        let asked = [("cores=1 mem=128M", Some(1), 128), ("cores=2 mem=256M", Some(2), 256), ("mem=192M", None, 192)];
        let mut ids = Vec::new();
        for (i, (text, ..)) in asked.iter().enumerate() {
            let mut params = params_with(constraints::parse(text).unwrap());
            if i == 1 {
                params.network_info = vec![interface_on("br-lxdtest", "00:16:3e:12:34:56")];
            }
            let (hooks, seen) = recording_hooks();
            let record = broker.start_instance("lxd", &params, &hooks).await.unwrap();
            let seen = seen.lock().unwrap().clone();
            let infos: Vec<&str> = seen.iter().map(|(_, info)| info.as_str()).collect();
            assert_eq!(
                infos,
                ["Creating container spec", "acquiring LXD image", "Creating container", "Container started"]
            );
            assert_eq!(seen.last().unwrap().0, InstanceStatus::Running);
            assert!(record.id.starts_with("juju-t1-"), "{}", record.id);
            ids.push(record.id);
        }

        for (id, (_, cores, mem)) in ids.iter().zip(asked) {
            let instance = daemon.api(&format!("/1.0/instances/{id}")).unwrap();
            assert_eq!(instance["status"], "Running", "{id}");
            assert_eq!(instance["expanded_config"]["limits.memory"], format!("{mem}MiB").as_str());
            assert_eq!(instance["expanded_config"]["boot.autostart"], "true");
            // The kernel enforces what LXD was told.
            assert_eq!(memory_limit_bytes(&daemon, id), mem << 20, "{id}");
            match cores {
                Some(n) => {
                    assert_eq!(instance["expanded_config"]["limits.cpu"], n.to_string().as_str());
                    assert_eq!(exec(&daemon, id, &["nproc"]), n.to_string(), "{id}");
                }
                None => assert!(instance["expanded_config"].get("limits.cpu").is_none()),
            }
            // busybox is alive in there: its init is pid 1, and it runs what it is asked.
            assert_eq!(exec(&daemon, id, &["cat", "/proc/1/comm"]), "init", "{id}");
            assert_eq!(exec(&daemon, id, &["hostname"]), id.as_str());
        }
        // The NIC on the test bridge has the MAC asked for, inside and in LXD's config.
        assert_eq!(exec(&daemon, &ids[1], &["cat", "/sys/class/net/eth0/address"]), "00:16:3e:12:34:56");
        let nic = &daemon.api(&format!("/1.0/instances/{}", ids[1])).unwrap()["expanded_devices"]["eth0"];
        assert_eq!((nic["nictype"].as_str(), nic["parent"].as_str()), (Some("bridged"), Some("br-lxdtest")));
        let network_config =
            daemon.api(&format!("/1.0/instances/{}", ids[1])).unwrap()["config"]["user.network-config"]
                .as_str()
                .map(str::to_owned)
                .unwrap();
        let network_config: serde_json::Value = serde_json::from_str(&network_config).unwrap();
        assert_eq!(network_config["ethernets"]["eth0"]["match"]["macaddress"], "00:16:3e:12:34:56");

        // all-instances shows exactly them, running, with the hardware LXD reports.
        let listed = broker.list_instances(Some("lxd")).await.unwrap();
        assert_eq!(listed.iter().map(|r| r.id.clone()).collect::<Vec<_>>(), ids);
        for (record, (_, cores, mem)) in listed.iter().zip(asked) {
            assert_eq!(record.status, "running", "{record:?}");
            assert_eq!((record.hardware.mem, record.hardware.cpu_cores), (Some(mem), cores));
            assert_eq!(record.hardware.arch.as_deref(), Some("amd64"));
            assert_eq!(record.hardware.virt_type.as_deref(), Some("container"));
        }

        // Stop one: gone from the daemon; stopping it again, or ids that are not ours, is fine.
        broker.stop_instances("lxd", std::slice::from_ref(&ids[0])).await.unwrap();
        assert!(daemon.api(&format!("/1.0/instances/{}", ids[0])).is_none(), "{} still exists", ids[0]);
        assert_eq!(broker.list_instances(Some("lxd")).await.unwrap().len(), 2);
        broker.stop_instances("lxd", std::slice::from_ref(&ids[0])).await.unwrap();
        broker.stop_instances("lxd", &["juju-t1-nonesuch".to_owned(), "someone-elses".to_owned()]).await.unwrap();

        // An unknown image alias: a clear error, and nothing left in the daemon.
        let before = daemon.instance_names().unwrap();
        let mut params = params_with(constraints::parse("mem=128M").unwrap());
        params.image_metadata = vec![image_alias("nope")];
        let (hooks, seen) = recording_hooks();
        let err = broker.start_instance("lxd", &params, &hooks).await.unwrap_err().to_string();
        assert!(err.contains("image alias \"nope\" not found"), "{err}");
        let (status, info) = seen.lock().unwrap().last().unwrap().clone();
        assert_eq!(status, InstanceStatus::ProvisioningError);
        assert!(info.starts_with("Creating container: image alias \"nope\""), "{info}");
        assert_eq!(daemon.instance_names().unwrap(), before);

        // The same component without its socket grant: access-denied, nothing made.
        broker.registry().add(&lxd_manifest(data, &daemon, "lxd-ungranted", "t2", false)).await.unwrap();
        let err =
            broker.start_instance("lxd-ungranted", &params_with(constraints::empty()), &CallHooks::default()).await;
        let err = format!("{:?}", err.unwrap_err());
        assert!(err.contains("AccessDenied") && err.contains("[grants.http]"), "{err}");
        assert_eq!(daemon.instance_names().unwrap(), before);

        broker.stop_instances("lxd", &ids[1..]).await.unwrap();
        assert!(broker.list_instances(Some("lxd")).await.unwrap().is_empty());
        assert!(daemon.instance_names().unwrap().is_empty());
    });
    // Teardown stops the daemon this test started, by its pid.
    drop(Arc::into_inner(daemon).expect("the test thread released the daemon"));
    assert!(!Path::new(&format!("/proc/{daemon_pid}")).exists(), "incusd {daemon_pid} still runs");
}

/// Params for Juju machine `machine`, with cloud-init user data.
fn machine_params(machine: &str, constraints_text: &str) -> broker_capabilities::bindings::StartInstanceParams {
    let mut params = params_with(constraints::parse(constraints_text).unwrap());
    params.instance_config = Some(broker_capabilities::bindings::InstanceConfig {
        machine_id: machine.into(),
        machine_nonce: format!("machine-{machine}:nonce"),
        controller_uuid: "deadbeef-0000-4000-8000-000000000001".into(),
        container_type: Some("lxd".into()),
        user_data: Some(b"#cloud-config\nhostname: test\n".to_vec()),
        ..broker_capabilities::contract::empty_instance_config()
    });
    params
}

#[test]
fn maintain_checks_nics_a_foreign_container_is_never_taken_over_and_a_failed_start_leaves_nothing() {
    let daemon = Arc::new(IncusDaemon::start("br-lxdmaint"));
    let d = daemon.clone();
    in_netns_of(daemon.netns(), move || async move {
        let daemon = d;
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path();
        let broker = Broker::open(data).unwrap();
        broker.registry().add(&lxd_manifest(data, &daemon, "lxd", "t3", true)).await.unwrap();

        // Juju's name for machine 7, its user data in LXD's config; maintain finds its NIC.
        let mut params = machine_params("7", "cores=1");
        params.network_info = vec![interface_on("br-lxdmaint", "00:16:3e:00:07:01")];
        let record = broker.start_instance("lxd", &params, &CallHooks::default()).await.unwrap();
        assert_eq!(record.id, "juju-t3-7");
        let config = &daemon.api("/1.0/instances/juju-t3-7").unwrap()["config"];
        assert_eq!(config["user.user-data"], "#cloud-config\nhostname: test\n");
        broker.maintain_instance("lxd", "juju-t3-7").await.unwrap();
        daemon.incus_ok(&["config", "device", "remove", "juju-t3-7", "eth0"]);
        let err = broker.maintain_instance("lxd", "juju-t3-7").await.unwrap_err().to_string();
        assert!(err.contains("NIC eth0 is missing"), "{err}");

        // Someone else's container under the name machine 8 would get: refused, and left alone.
        daemon.incus_ok(&["init", "busybox", "juju-t3-8", "--config", "limits.cpu=2"]);
        let (hooks, seen) = recording_hooks();
        let err = broker.start_instance("lxd", &machine_params("8", "cores=1"), &hooks).await.unwrap_err().to_string();
        assert!(err.contains("juju-t3-8 already exists with a different spec") && err.contains("limits.cpu"), "{err}");
        assert_eq!(seen.lock().unwrap().last().unwrap().0, InstanceStatus::ProvisioningError);
        let foreign = daemon.api("/1.0/instances/juju-t3-8").expect("the foreign container is still there");
        assert_eq!(foreign["config"]["limits.cpu"], "2");

        // Created but cannot start (a charm profile with a NIC on a bridge that does not exist):
        // the container is deleted again and the error says why.
        daemon.incus_ok(&["profile", "create", "broken"]);
        daemon.incus_ok(&[
            "profile",
            "device",
            "add",
            "broken",
            "eth9",
            "nic",
            "nictype=bridged",
            "parent=br-nonesuch",
        ]);
        let mut params = machine_params("9", "mem=128M");
        params.charm_lxd_profiles = vec!["broken".into()];
        let (hooks, seen) = recording_hooks();
        let err = broker.start_instance("lxd", &params, &hooks).await.unwrap_err().to_string();
        assert!(err.contains("Creating container: starting juju-t3-9"), "{err}");
        let infos: Vec<String> = seen.lock().unwrap().iter().map(|(_, info)| info.clone()).collect();
        assert_eq!(&infos[..3], ["Creating container spec", "acquiring LXD image", "Creating container"]);
        assert!(daemon.api("/1.0/instances/juju-t3-9").is_none(), "the container that failed to start remains");

        // A restarted host (new store handle, new component instance) lists what is in its
        // namespace, as Juju's LXD broker does: what it made, and the squatter on machine 8's name.
        drop(broker);
        let broker = Broker::open(data).unwrap();
        let listed: Vec<String> = broker.list_instances(Some("lxd")).await.unwrap().into_iter().map(|r| r.id).collect();
        assert_eq!(listed, ["juju-t3-7", "juju-t3-8"]);
        broker.stop_instances("lxd", &["juju-t3-7".to_owned()]).await.unwrap();
        assert_eq!(daemon.instance_names().unwrap(), ["juju-t3-8"]);
    });
}

#[test]
fn the_conformance_kit_records_a_real_run_and_replays_it_without_the_daemon() {
    use broker_core::conformance::{self, Answers, KitOptions, Recording, Scripted};
    use broker_core::manifest::Manifest;

    let daemon = IncusDaemon::start("br-lxdkit");
    let dir = tempfile::tempdir().unwrap();
    let manifest = Manifest::load(&lxd_manifest(dir.path(), &daemon, "lxd", "kit", true)).unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();

    // Against the real daemon, every exchange on tape.
    let recording = Arc::new(Recording::default());
    let recorded = runtime.block_on(conformance::run_with(
        &manifest,
        KitOptions {
            answers: Answers::Record(recording.clone()),
            strict: false,
            sandbox: Default::default(),
            credentials: None,
            secrets: None,
        },
    ));
    let recorded = recorded.unwrap();
    assert!(recorded.passed(), "{}", recorded.text());
    let exchanges = recording.script().get("http").and_then(|http| http.as_array()).map_or(0, Vec::len);
    assert!(exchanges >= 10, "{exchanges} exchanges");
    assert!(daemon.instance_names().unwrap().is_empty(), "the kit stops what it starts");
    let script = recording.to_script_json();
    let daemon_pid = daemon.pid();
    drop(daemon);
    assert!(!Path::new(&format!("/proc/{daemon_pid}")).exists());

    // The daemon is gone; the script alone gives the same result, strictly.
    let replay = Arc::new(Scripted::parse(&script).unwrap());
    let options = KitOptions {
        answers: Answers::Script(replay.clone()),
        strict: true,
        sandbox: Default::default(),
        credentials: None,
        secrets: None,
    };
    let replayed = runtime.block_on(conformance::run_with(&manifest, options)).unwrap();
    let outcome = |r: &conformance::Report| r.cases.iter().map(|c| (c.name.to_string(), c.passed)).collect::<Vec<_>>();
    assert_eq!(outcome(&replayed), outcome(&recorded), "{}", replayed.text());
    assert_eq!(replay.remaining(), 0, "every scripted answer was asked for");

    // A script missing its last answers: the strict kit fails those cases and names the calls.
    let mut short: serde_json::Value = serde_json::from_str(&script).unwrap();
    let http = short["http"].as_array_mut().unwrap();
    http.truncate(http.len() - 3);
    let options = KitOptions {
        answers: Answers::Script(Arc::new(Scripted::parse(&short.to_string()).unwrap())),
        strict: true,
        sandbox: Default::default(),
        credentials: None,
        secrets: None,
    };
    let failed = runtime.block_on(conformance::run_with(&manifest, options)).unwrap();
    assert!(!failed.passed());
    let reasons: Vec<&str> =
        failed.cases.iter().filter(|c| !c.passed && !c.skipped).map(|c| c.detail.as_str()).collect();
    assert!(
        reasons.iter().any(|d| d.contains("host calls not in the script") && d.contains("the script is exhausted")),
        "{reasons:?}"
    );
}

/// A group of 3 on real Incus containers: it converges (each container
/// carrying the group's tags in its LXD config), survives a restart of the
/// host without making or losing a container, and a template change rolls it
/// one container at a time to the new limits.
#[test]
fn a_group_of_three_containers_converges_survives_a_restart_and_rolls() {
    use broker_core::groups::{GroupSettings, Groups};
    use std::time::{Duration, Instant};

    let daemon = Arc::new(IncusDaemon::start("br-lxdgroup"));
    let d = daemon.clone();
    in_netns_of(daemon.netns(), move || async move {
        let daemon = d;
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let manifest = lxd_manifest(dir.path(), &daemon, "lxd", "g1", true);
        let settings = GroupSettings { poll: Duration::from_millis(500), ..GroupSettings::default() };
        let spec = |mem: &str| {
            format!(
                r#"{{"ID": "workers", "Properties": {{"Allocation": {{"Size": 3}},
                    "Instance": {{"Plugin": "lxd", "Properties": {{"Constraints": "mem={mem}", "Tags": {{"role": "worker"}}}}}}}}}}"#
            )
        };
        // Until converged with 3 members (120 s at most); the fewest running seen meanwhile.
        let converged = async |groups: &Groups| {
            let until = Instant::now() + Duration::from_secs(120);
            let mut fewest = usize::MAX;
            loop {
                let described = groups.describe("workers").await.unwrap();
                fewest = fewest.min(described.instances.iter().filter(|m| m.status == "running").count());
                if described.converged && described.instances.len() == 3 {
                    let mut ids: Vec<String> = described.instances.into_iter().map(|m| m.id).collect();
                    ids.sort();
                    return (ids, fewest);
                }
                assert!(Instant::now() < until, "not converged: {described:?}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        };
        let limits = |daemon: &IncusDaemon, id: &str| {
            let config = daemon.api(&format!("/1.0/instances/{id}")).unwrap()["expanded_config"].clone();
            (
                config["limits.memory"].as_str().map(str::to_owned),
                config["user.infrakit.group"].as_str().map(str::to_owned),
            )
        };

        let first = {
            let broker = Arc::new(Broker::open(&data).unwrap());
            broker.registry().add(&manifest).await.unwrap();
            let groups = Groups::new(broker.clone(), settings);
            groups.start_loops().unwrap();
            assert_eq!(groups.commit_text(&spec("128M"), false).await.unwrap(), "Managing 3 instances");
            let (ids, _) = converged(&groups).await;
            let mut names = daemon.instance_names().unwrap();
            names.sort();
            assert_eq!(names, ids, "exactly the group's containers");
            for id in &ids {
                let role = daemon.api(&format!("/1.0/instances/{id}")).unwrap()["expanded_config"]["user.role"].clone();
                assert_eq!(limits(&daemon, id), (Some("128MiB".into()), Some("workers".into())), "{id}");
                assert_eq!(role, "worker", "{id}");
            }
            groups.stop_loops();
            ids
        };

        // A new host on the same state: the group resumes, converged as it was.
        let broker = Arc::new(Broker::open_when_free(&data, Duration::from_secs(10), async || true).await.unwrap());
        broker.reconcile_after_restart(broker_core::broker::reconcile::HarvestMode::Destroyed).await;
        let groups = Groups::new(broker.clone(), settings);
        groups.start_loops().unwrap();
        assert_eq!(converged(&groups).await.0, first, "no container made or lost by the restart");
        assert_eq!(daemon.instance_names().unwrap().len(), 3);

        // A template change rolls every member, never fewer than 2 running.
        let plan = groups.commit_text(&spec("192M"), false).await.unwrap();
        assert_eq!(plan, "Performing a rolling update on 3 instances");
        let (rolled, fewest) = converged(&groups).await;
        assert!(rolled.iter().all(|id| !first.contains(id)), "{rolled:?} {first:?}");
        assert!(fewest >= 2, "never fewer than size - 1 running: saw {fewest}");
        for id in &rolled {
            assert_eq!(limits(&daemon, id).0.as_deref(), Some("192MiB"), "{id}");
        }
        let mut names = daemon.instance_names().unwrap();
        names.sort();
        assert_eq!(names, rolled, "the old containers are gone");

        groups.destroy("workers").await.unwrap();
        groups.stop_loops();
        assert!(daemon.instance_names().unwrap().is_empty());
    });
    let daemon_pid = daemon.pid();
    drop(Arc::into_inner(daemon).expect("the test thread released the daemon"));
    assert!(!Path::new(&format!("/proc/{daemon_pid}")).exists(), "incusd {daemon_pid} still runs");
}
