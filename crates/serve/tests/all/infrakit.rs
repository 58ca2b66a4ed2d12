//! InfraKit's wire protocol on the real daemon: `broker serve --infrakit-dir`
//! makes the `group` and per-provider sockets, and the project's client
//! speaks to them exactly as InfraKit's own does (Hello, then every Group and
//! Instance method, bad requests and errors included).

use crate::common::{Daemon, broker, broker_command};
use broker_serve::infrakit::client::InfrakitClient;
use broker_serve::infrakit::rpc::{INVALID_PARAMS, METHOD_NOT_FOUND, PARSE_ERROR, SERVER_ERROR};
use serde_json::{Value, json};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

fn wait_for(path: &Path) {
    let until = Instant::now() + Duration::from_secs(30);
    while !path.exists() {
        assert!(Instant::now() < until, "{} never appeared", path.display());
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn spec(size: u32) -> Value {
    json!({"ID": "workers", "Properties": {
        "Allocation": {"Size": size},
        "Instance": {"Plugin": "fake", "Properties": {"Constraints": "mem=1G", "Tags": {"role": "worker"}}},
        "Flavor": {"Plugin": "vanilla", "Properties": {"Init": ["echo hello"]}}}})
}

async fn ok(client: &InfrakitClient, method: &str, params: Value) -> Value {
    client.call(method, params).await.unwrap().unwrap_or_else(|e| panic!("{method}: {e}"))
}

async fn refused(client: &InfrakitClient, method: &str, params: Value) -> (i64, String) {
    match client.call(method, params).await.unwrap() {
        Ok(result) => panic!("{method} should fail: {result}"),
        Err(error) => (error.code, error.message),
    }
}

/// DescribeGroup until converged with `size` members (60 s at most).
async fn converged(group: &InfrakitClient, size: usize) -> Value {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let described = ok(group, "Group.DescribeGroup", json!({"Name": "group", "ID": "workers"})).await;
        let description = &described["Description"];
        if description["Converged"] == true && description["Instances"].as_array().unwrap().len() == size {
            return described;
        }
        assert!(Instant::now() < until, "not converged: {described}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `broker serve --infrakit-dir DIR` on `data`, which must fail to start: what it said.
fn refused_serve(data: &Path, dir: &str) -> String {
    let mut serving =
        broker_command(data, &["serve", "--infrakit-dir", dir]).stderr(std::process::Stdio::piped()).spawn().unwrap();
    let until = Instant::now() + Duration::from_secs(30);
    while serving.try_wait().unwrap().is_none() {
        if Instant::now() > until {
            let _ = serving.kill();
            panic!("the daemon on {} kept serving", data.display());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let output = serving.wait_with_output().unwrap();
    assert!(!output.status.success());
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn infrakits_group_and_instance_plugins_are_served_on_their_sockets() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let plugins = dir.path().join("plugins");
    std::fs::create_dir_all(&plugins).unwrap();
    // A socket left by a dead plugin: replaced.
    drop(std::os::unix::net::UnixListener::bind(plugins.join("group")).unwrap());
    let plugins_arg = plugins.to_str().unwrap();
    let mut daemon = Daemon::start_with(&data, &["--infrakit-dir", plugins_arg, "--group-poll", "1s"]);
    let manifest = guest_artifacts::manifest("fake").display().to_string();
    assert!(broker(&data, &["provider", "add", &manifest]).status.success());
    wait_for(&plugins.join("fake"));
    for socket in ["group", "fake"] {
        let mode = std::fs::metadata(plugins.join(socket)).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{socket}");
    }

    // A second daemon on the same plugin dir is refused: the sockets are live.
    let said = refused_serve(&dir.path().join("data2"), plugins_arg);
    assert!(said.contains("is served by another process"), "{said}");
    // A plugin dir others can write to is refused: they could swap the sockets.
    let open_dir = dir.path().join("open");
    std::fs::create_dir(&open_dir).unwrap();
    std::fs::set_permissions(&open_dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let said = refused_serve(&dir.path().join("data3"), open_dir.to_str().unwrap());
    assert!(said.contains("writable by it alone"), "{said}");
    // A dir whose socket paths would not fit sun_path: said plainly, before binding.
    let deep = dir.path().join("d".repeat(100));
    std::fs::create_dir(&deep).unwrap();
    std::fs::set_permissions(&deep, std::fs::Permissions::from_mode(0o700)).unwrap();
    let said = refused_serve(&dir.path().join("data4"), deep.to_str().unwrap());
    assert!(said.contains("a Unix socket's path must be under 108 bytes"), "{said}");

    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let group = InfrakitClient::new(&plugins.join("group"));
        let objects = group.hello("Group/0.1.1").await.unwrap();
        assert_eq!(objects, json!({"Group/0.1.1": [{"Name": ".", "ProxyFor": ""}]}));
        assert!(group.hello("Instance/0.6.1").await.is_err(), "a client refuses the wrong plugin");
        let implements = ok(&group, "Handshake.Implements", json!({})).await;
        assert_eq!(implements, json!({"APIs": [{"Name": "Group", "Version": "0.1.1"}]}));
        let (status, info) = group.get("/info/api.json").await.unwrap();
        assert_eq!(status, 200);
        let methods: Vec<&str> = info["Interfaces"][0]["Methods"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["Request"]["method"].as_str().unwrap())
            .collect();
        assert_eq!(methods.len(), 8, "{info}");
        assert!(methods.contains(&"Group.CommitGroup") && methods.contains(&"Group.SetSize"), "{methods:?}");

        // Commit: pretend changes nothing; then for real.
        let pretend = ok(&group, "Group.CommitGroup", json!({"Name": "group", "Spec": spec(2), "Pretend": true})).await;
        assert_eq!(pretend, json!({"Name": "group", "ID": "workers", "Details": "Managing 2 instances"}));
        assert_eq!(ok(&group, "Group.InspectGroups", json!({"Name": "group"})).await["Groups"], json!([]));
        let committed = ok(&group, "Group.CommitGroup", json!({"Name": "group", "Spec": spec(2)})).await;
        assert_eq!(committed["Details"], "Managing 2 instances");
        let described = converged(&group, 2).await;
        for member in described["Description"]["Instances"].as_array().unwrap() {
            assert_eq!(member["Tags"]["infrakit.group"], "workers", "{member}");
            assert_eq!(member["Properties"]["Status"], "running", "{member}");
        }

        // Size and SetSize; params as an array of one object, as older clients send.
        let size = ok(&group, "Group.Size", json!([{"Name": "group", "ID": "workers"}])).await;
        assert_eq!(size, json!({"Name": "group", "ID": "workers", "Size": 2}));
        ok(&group, "Group.SetSize", json!({"Name": "group", "ID": "workers", "Size": 3})).await;
        assert_eq!(ok(&group, "Group.Size", json!({"ID": "workers"})).await["Size"], 3);
        let three = converged(&group, 3).await;
        let ids: Vec<String> = three["Description"]["Instances"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["ID"].as_str().unwrap().to_owned())
            .collect();

        // DestroyInstances: a stranger fails the call and destroys nothing.
        let (code, message) =
            refused(&group, "Group.DestroyInstances", json!({"ID": "workers", "Instances": [ids[0], "nosuch"]})).await;
        assert_eq!(code, SERVER_ERROR);
        assert!(message.contains(r#"instance "nosuch" is not a member of group "workers""#), "{message}");
        assert_eq!(ok(&group, "Group.Size", json!({"ID": "workers"})).await["Size"], 3);
        ok(&group, "Group.DestroyInstances", json!({"Name": "group", "ID": "workers", "Instances": [ids[0]]})).await;
        assert_eq!(ok(&group, "Group.Size", json!({"ID": "workers"})).await["Size"], 2);
        let inspected = ok(&group, "Group.InspectGroups", json!({"Name": "group"})).await;
        assert_eq!(inspected["Groups"][0]["ID"], "workers", "{inspected}");
        assert_eq!(inspected["Groups"][0]["Properties"]["Allocation"]["Size"], 2, "{inspected}");

        // Bad requests: each its JSON-RPC code, the id echoed exactly.
        assert_eq!(refused(&group, "Group.Nosuch", json!({})).await.0, METHOD_NOT_FOUND);
        assert_eq!(refused(&group, "Group.Size", json!({"ID": ["workers"]})).await.0, INVALID_PARAMS);
        // Go's nil slices and maps arrive as null; newer fields are ignored.
        let sized = ok(&group, "Group.Size", json!({"Name": null, "ID": "workers", "Newer": true})).await;
        assert_eq!(sized["Size"], 2, "{sized}");
        assert_eq!(refused(&group, "Group.SetSize", json!({"ID": "workers", "Size": -1})).await.0, INVALID_PARAMS);
        let (code, message) = refused(&group, "Group.CommitGroup", json!({"Spec": {"ID": "w", "Properties": {
            "Allocation": {"Size": 1, "LogicalIDs": ["a"]}, "Instance": {"Plugin": "fake"}}}}))
        .await;
        assert!(code == SERVER_ERROR && message.contains("Properties.Allocation"), "{message}");
        let (status, garbage) = group.post("{not json").await.unwrap();
        assert_eq!((status, garbage["error"]["code"].as_i64()), (200, Some(PARSE_ERROR)), "{garbage}");
        let big_id = r#"{"jsonrpc": "2.0", "method": "Group.Size", "params": {"ID": "workers"}, "id": 9223372036854775808}"#;
        let (_, answer) = group.post(big_id).await.unwrap();
        assert_eq!(answer["id"].to_string(), "9223372036854775808");
        assert_eq!(answer["result"]["Size"], 2, "{answer}");

        // The instance plugin of provider `fake`.
        let fake = InfrakitClient::new(&plugins.join("fake"));
        fake.hello("Instance/0.6.1").await.unwrap();
        let valid = ok(&fake, "Instance.Validate", json!({"Type": "", "Properties": {"Constraints": "mem=1G"}})).await;
        assert_eq!(valid, json!({"Type": "", "OK": true}));
        let (code, message) = refused(&fake, "Instance.Validate", json!({"Properties": {"Constraints": "mem=lots"}})).await;
        assert!(code == SERVER_ERROR && message.contains("Properties.Constraints"), "{message}");
        let spec = json!({"Properties": {"Constraints": "mem=1G"}, "Tags": {"role": "db"}, "Init": "echo hi", "LogicalID": "db-1"});
        let provisioned = ok(&fake, "Instance.Provision", json!({"Type": "", "Spec": spec})).await;
        let id = provisioned["ID"].as_str().unwrap().to_owned();
        ok(&fake, "Instance.Label", json!({"Instance": id, "Labels": {"tier": "gold"}})).await;
        let gold = ok(&fake, "Instance.DescribeInstances", json!({"Tags": {"tier": "gold"}, "Properties": true})).await;
        let descriptions = gold["Descriptions"].as_array().unwrap();
        assert_eq!(descriptions.len(), 1, "{gold}");
        assert_eq!(descriptions[0]["ID"], id.as_str());
        assert_eq!(descriptions[0]["LogicalID"], "db-1");
        assert_eq!(descriptions[0]["Tags"]["role"], "db");
        assert_eq!(descriptions[0]["Properties"]["Status"], "running");
        let workers = ok(&fake, "Instance.DescribeInstances", json!({"Tags": {"infrakit.group": "workers"}})).await;
        assert_eq!(workers["Descriptions"].as_array().unwrap().len(), 2, "the group's members: {workers}");
        assert!(workers["Descriptions"][0].get("Properties").is_none(), "asked without properties");
        let (code, _) = refused(&fake, "Instance.Label", json!({"Instance": "nosuch", "Labels": {"a": "b"}})).await;
        assert_eq!(code, SERVER_ERROR);
        let too_long = "x".repeat(300);
        assert_eq!(refused(&fake, "Instance.Label", json!({"Instance": id, "Labels": {"a": too_long}})).await.0, INVALID_PARAMS);
        assert_eq!(refused(&fake, "Instance.Destroy", json!({"Instance": "nosuch"})).await.0, SERVER_ERROR);
        let destroyed = ok(&fake, "Instance.Destroy", json!({"Instance": id, "Context": {"Reason": "terminate"}})).await;
        assert_eq!(destroyed["OK"], true);
        let gone = ok(&fake, "Instance.DescribeInstances", json!({"Tags": {"tier": "gold"}})).await;
        assert_eq!(gone["Descriptions"], json!([]));

        // FreeGroup forgets it; its instances run on.
        assert_eq!(ok(&group, "Group.FreeGroup", json!({"Name": "group", "ID": "workers"})).await["ID"], "workers");
        let (code, message) = refused(&group, "Group.DescribeGroup", json!({"ID": "workers"})).await;
        assert!(code == SERVER_ERROR && message.contains("no group"), "{message}");
        let all = ok(&fake, "Instance.DescribeInstances", json!({})).await;
        assert_eq!(all["Descriptions"].as_array().unwrap().len(), 2, "{all}");
    });

    // A provider whose socket path is taken gets its socket once the path is free.
    let held = plugins.join("held");
    std::fs::write(&held, "not a socket").unwrap();
    let text = guest_artifacts::manifest_text("fake").replacen("name = \"fake\"", "name = \"held\"", 1);
    assert!(text.contains("name = \"held\""), "{text}");
    let manifest = dir.path().join("held.toml");
    std::fs::write(&manifest, text).unwrap();
    assert!(broker(&data, &["provider", "add", manifest.to_str().unwrap()]).status.success());
    // Past the daemon's first look (it looks each second): refused then, served only on a retry.
    std::thread::sleep(Duration::from_millis(2500));
    assert!(std::fs::symlink_metadata(&held).unwrap().is_file(), "what was there is not replaced");
    std::fs::remove_file(&held).unwrap();
    wait_for(&held);
    assert!(std::os::unix::fs::FileTypeExt::is_socket(&std::fs::symlink_metadata(&held).unwrap().file_type()));

    // The sockets go with the daemon.
    assert!(daemon.terminate().success());
    assert!(!plugins.join("group").exists() && !plugins.join("fake").exists() && !held.exists());
}
