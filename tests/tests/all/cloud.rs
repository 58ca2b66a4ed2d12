//! The cloud path against a real EC2-compatible server: moto with signature
//! checking on, behind a TLS front with the test's own CA, reached through
//! the real host and a real component (test-hostile's `http` mode, the SDK's
//! client). The host signs with a credentials file the guest never sees and
//! holds the grant's rules before anything leaves.

use broker_host::bindings::BrokerError;
use broker_host::broker::Broker;
use broker_host::capabilities::context::CallHooks;
use broker_host::capabilities::kv::KvBackend;
use broker_tests::moto::{Moto, TlsFront};
use std::os::unix::fs::PermissionsExt;

/// One request from the guest: `form` as its body; the answer's status line
/// and the whole exchange as the guest read it (kv `http-response`).
async fn ec2(broker: &Broker, form: &str) -> Result<(String, String), BrokerError> {
    let kv = broker.store().kv();
    kv.set("cloud", "http-body", form.as_bytes()).unwrap();
    kv.set("cloud", "http-form", b"yes").unwrap();
    kv.set("cloud", "mode", b"http:POST:ec2:/").unwrap();
    let wasm = broker.registry().get("cloud").await.unwrap();
    let answered = match wasm.all_instances(&CallHooks::default()).await {
        Ok(instances) => instances[0].id.clone(),
        Err(err) => return Err(err.broker_error().cloned().unwrap_or_else(|| panic!("not the guest's error: {err}"))),
    };
    let seen = kv.get("cloud", "http-response").unwrap().unwrap_or_default();
    Ok((answered, String::from_utf8_lossy(&seen).into_owned()))
}

fn write_credentials(path: &std::path::Path, key: &str, secret: &str) {
    std::fs::write(path, format!("access-key-id = \"{key}\"\nsecret-access-key = \"{secret}\"\n")).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_host_signs_for_the_guest_holds_the_rules_and_keeps_the_secret() {
    let moto = tokio::task::spawn_blocking(Moto::start).await.unwrap();
    let front = TlsFront::start(moto.port).await;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, &front.ca_pem).unwrap();
    let broker = Broker::open(&data).unwrap();
    let credentials = data.join("credentials");
    std::fs::create_dir_all(&credentials).unwrap();
    let file = credentials.join("moto.toml");
    write_credentials(&file, &moto.key.access_key_id, &moto.key.secret_access_key);
    let grant = format!(
        "[grants]\nkv = true\n[grants.http.ec2]\nurl = \"https://localhost:{}\"\nca-file = \"{}\"\n\
         sign = \"aws-sigv4\"\nservice = \"ec2\"\nregion = \"us-east-1\"\ncredentials = \"moto\"\n\
         actions = [\"DescribeAvailabilityZones\", \"RunInstances\", \"DescribeInstances\"]\nmax-count = 2\n\
         require-tag = \"broker-namespace=ns1\"\n[config]\nregion = \"us-east-1\"\n",
        front.port,
        ca_file.display()
    );
    let manifest = broker_tests::write_manifest(dir.path(), "cloud", "test-hostile", &grant);
    broker.registry().add(&manifest).await.unwrap();

    let (answered, seen) = ec2(&broker, "Action=DescribeAvailabilityZones&Version=2016-11-15").await.unwrap();
    assert_eq!(answered, "answered-200", "{seen}");
    assert!(seen.contains("us-east-1a"), "{seen}");
    let run = |extra: &str| {
        format!(
            "Action=RunInstances&Version=2016-11-15&ImageId=ami-12c6146b&InstanceType=t2.micro&MinCount=2&MaxCount=2\
             &TagSpecification.1.ResourceType=instance&TagSpecification.1.Tag.1.Key=broker-namespace\
             &TagSpecification.1.Tag.1.Value=ns1{extra}"
        )
    };
    let (answered, seen) = ec2(&broker, &run("")).await.unwrap();
    assert_eq!(answered, "answered-200", "{seen}");
    assert_eq!(seen.matches("<instanceId>").count(), 2, "{seen}");
    let (_, listed) = ec2(&broker, "Action=DescribeInstances&Version=2016-11-15").await.unwrap();
    assert_eq!(listed.matches("<instanceId>").count(), 2, "{listed}");
    assert!(listed.contains("<key>broker-namespace</key>") && listed.contains("<value>ns1</value>"), "{listed}");
    let reached = front.requests();
    assert_eq!(reached, 3);

    // What the rules refuse never reaches the server.
    for (form, why) in [
        ("Action=TerminateInstances&Version=2016-11-15&InstanceId.1=i-1".to_owned(), "an action not granted"),
        (run("").replace("MaxCount=2", "MaxCount=3"), "over max-count"),
        (run("").replace("Value=ns1", "Value=other"), "without the namespace tag"),
        (run("&Action=TerminateInstances"), "an Action given twice"),
    ] {
        match ec2(&broker, &form).await {
            Err(BrokerError::Provider(message)) => assert!(message.contains("denied"), "{why}: {message}"),
            other => panic!("{why}: not refused: {other:?}"),
        }
    }
    assert_eq!(front.requests(), reached, "nothing refused reached the front");

    // A wrong secret: moto refuses the signature; the right one, read again, works.
    write_credentials(&file, &moto.key.access_key_id, "not-the-secret-at-all");
    let (answered, seen) = ec2(&broker, "Action=DescribeAvailabilityZones&Version=2016-11-15").await.unwrap();
    assert_ne!(answered, "answered-200", "{seen}");
    assert!(seen.contains("AuthFailure") || seen.contains("SignatureDoesNotMatch"), "{seen}");
    write_credentials(&file, &moto.key.access_key_id, &moto.key.secret_access_key);
    let (answered, _) = ec2(&broker, "Action=DescribeAvailabilityZones&Version=2016-11-15").await.unwrap();
    assert_eq!(answered, "answered-200");

    // The guest looks everywhere it can; nothing the host shows has the secret.
    let secret = moto.key.secret_access_key.as_str();
    broker.store().kv().set("cloud", "mode", b"snoop").unwrap();
    let wasm = broker.registry().get("cloud").await.unwrap();
    assert_eq!(wasm.all_instances(&CallHooks::default()).await.unwrap()[0].id, "snooped");
    let snooped = broker.store().kv().get("cloud", "snooped").unwrap().unwrap();
    let snooped = String::from_utf8_lossy(&snooped);
    assert!(snooped.contains("config ") && !snooped.contains(secret), "the guest saw the secret: {snooped}");
    assert!(!seen.contains(secret));
    let shown = format!("{:?}", broker.registry().show("cloud").unwrap());
    assert!(shown.contains("with credentials moto") || shown.contains("moto"), "{shown}");
    assert!(!shown.contains(secret), "provider show has the secret");
    for event in broker.store().events(0, 10_000).unwrap() {
        assert!(!format!("{event:?}").contains(secret), "an event has the secret: {event:?}");
    }
    let state = std::fs::read(data.join("state.redb")).unwrap();
    assert!(!state.windows(secret.len()).any(|w| w == secret.as_bytes()), "the store has the secret");
}
