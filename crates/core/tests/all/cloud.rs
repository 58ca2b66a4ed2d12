//! The cloud path against a real EC2-compatible server: moto with signature
//! checking on, behind a TLS front with the test's own CA, reached through
//! the real host and a real component (test-hostile's `http` mode, the SDK's
//! client). The host signs with a credentials file the guest never sees and
//! holds the grant's rules before anything leaves.

use broker_capabilities::bindings::BrokerError;
use broker_capabilities::contract::empty_params;
use broker_capabilities::rooms::context::{CallEvent, CallHooks};
use broker_capabilities::rooms::kv::KvBackend;
use broker_core::broker::Broker;
use broker_tests::moto::{Moto, TlsFront};
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::sync::{Arc, Mutex};

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

/// moto with signatures checked, its TLS front, and a host whose
/// credentials dir holds moto's key as `moto`.
struct Cloud {
    moto: Moto,
    front: TlsFront,
    dir: tempfile::TempDir,
    data: std::path::PathBuf,
    broker: Broker,
}

impl Cloud {
    async fn start() -> Cloud {
        let moto = tokio::task::spawn_blocking(Moto::start).await.unwrap();
        let front = TlsFront::start(moto.port).await;
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        std::fs::write(dir.path().join("ca.pem"), &front.ca_pem).unwrap();
        let broker = Broker::open(&data).unwrap();
        std::fs::create_dir_all(data.join("credentials")).unwrap();
        write_credentials(&data.join("credentials/moto.toml"), &moto.key.access_key_id, &moto.key.secret_access_key);
        Cloud { moto, front, dir, data, broker }
    }
}

/// A grant's route to the front, signed with `moto` (the table's lines up to its rules).
fn signed_route(front: &TlsFront, dir: &std::path::Path) -> String {
    format!(
        "url = \"https://localhost:{}\"\nca-file = \"{}\"\nsign = \"aws-sigv4\"\nservice = \"ec2\"\n\
         region = \"us-east-1\"\ncredentials = \"moto\"\n",
        front.port,
        dir.join("ca.pem").display()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_host_signs_for_the_guest_holds_the_rules_and_keeps_the_secret() {
    let Cloud { moto, front, dir, data, broker } = Cloud::start().await;
    let file = data.join("credentials/moto.toml");
    let grant = format!(
        "[grants]\nkv = true\n[grants.http.ec2]\n{}\
         actions = [\"DescribeAvailabilityZones\", \"RunInstances\", \"DescribeInstances\"]\nmax-count = 2\n\
         require-tag = \"broker-namespace=ns1\"\n[config]\nregion = \"us-east-1\"\n",
        signed_route(&front, dir.path())
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

/// What moto holds, asked directly with boto3: `(id, state, zone, tags)` of every instance.
fn moto_instances(moto: &Moto) -> Vec<(String, String, String, BTreeMap<String, String>)> {
    let listed = moto.boto3(
        "out = []\n\
         for r in ec2.describe_instances()['Reservations']:\n\
         \x20   for i in r['Instances']:\n\
         \x20       out.append([i['InstanceId'], i['State']['Name'], i['Placement']['AvailabilityZone'],\n\
         \x20                   {t['Key']: t['Value'] for t in i.get('Tags', [])}])\n\
         print(json.dumps(out))\n",
    );
    serde_json::from_str(&listed).unwrap()
}

fn machine(n: usize) -> broker_capabilities::bindings::InstanceConfig {
    broker_capabilities::bindings::InstanceConfig {
        machine_id: n.to_string(),
        machine_nonce: format!("machine-{n}:nonce"),
        controller_uuid: "deadbeef-0000-4000-8000-000000000001".into(),
        user_data: Some(format!("#cloud-config\nhostname: m{n}\n").into_bytes()),
        tags: vec![("team".into(), "blue".into())],
        ..broker_capabilities::contract::empty_instance_config()
    }
}

/// The EC2 provider on moto (signatures checked, behind TLS), through the
/// real host: Juju's zone rule over a distribution group, every tag set by
/// RunInstances itself, status while waiting for running, all-instances
/// following NextToken and seeing only its namespace, terminate idempotent
/// and never touching an instance without the namespace's tag, maintain
/// re-tagging drift, user data as given; no secret anywhere the host shows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
pub(crate) async fn the_ec2_provider_runs_juju_s_broker_on_moto() {
    let Cloud { moto, front, dir, broker, .. } = Cloud::start().await;
    let manifest_text = format!(
        "[grants]\nkv = true\nlog = true\n[grants.http.ec2]\n{}\
         actions = [\"DescribeAvailabilityZones\", \"DescribeInstances\", \"RunInstances\", \"TerminateInstances\", \"CreateTags\"]\n\
         max-count = 1\nrequire-tag = \"broker-namespace=host0\"\n\
         [config]\nnamespace = \"host0\"\nregion = \"us-east-1\"\nzones = [\"us-east-1a\", \"us-east-1b\", \"us-east-1c\"]\n\
         images = {{ amd64 = \"ami-12c6146b\" }}\nwait-running-s = 60\ndescribe-page-size = 5\n",
        signed_route(&front, dir.path())
    );
    let manifest = broker_tests::write_manifest(dir.path(), "ec2", "ec2", &manifest_text);
    broker.registry().add(&manifest).await.unwrap();

    // Five machines in one distribution group: 2/2/1 over the three zones.
    let statuses = Arc::new(Mutex::new(Vec::<String>::new()));
    let mut ids: Vec<String> = Vec::new();
    for n in 0..5 {
        let group = ids.clone();
        let seen = statuses.clone();
        let hooks = CallHooks {
            distribution_group: Some(Arc::new(move || Ok(group.clone()))),
            events: Some(Arc::new(move |event| {
                if let CallEvent::Status { info, .. } = event {
                    seen.lock().unwrap().push(info);
                }
            })),
            ..CallHooks::default()
        };
        let mut params = empty_params();
        params.instance_config = Some(machine(n));
        let record = broker.start_instance("ec2", &params, &hooks).await.unwrap();
        assert!(record.id.starts_with("i-"), "{record:?}");
        assert_eq!(record.display_name, format!("juju-host0-machine-{n}"));
        ids.push(record.id);
    }
    let statuses = statuses.lock().unwrap().clone();
    assert!(statuses.iter().any(|s| s.starts_with("running t3.micro (ami-12c6146b) in us-east-1")), "{statuses:?}");
    assert!(statuses.iter().any(|s| s.ends_with("is running")), "{statuses:?}");
    let held = moto_instances(&moto);
    let mut per_zone = BTreeMap::<String, usize>::new();
    for (id, _, zone, tags) in &held {
        assert!(ids.contains(id));
        assert_eq!(tags.get("broker-namespace").map(String::as_str), Some("host0"), "{tags:?}");
        assert_eq!(tags.get("team").map(String::as_str), Some("blue"), "{tags:?}");
        *per_zone.entry(zone.clone()).or_default() += 1;
    }
    assert_eq!(per_zone.into_values().collect::<Vec<_>>(), [2, 2, 1], "{held:?}");
    let user_data = moto.boto3(&format!(
        "print(ec2.describe_instance_attribute(InstanceId='{}', Attribute='userData')['UserData']['Value'])",
        ids[2]
    ));
    assert_eq!(user_data.trim(), "I2Nsb3VkLWNvbmZpZwpob3N0bmFtZTogbTIK", "base64 of machine 2's user data");
    // describe now lists the zones the host may place in.
    let info = broker.registry().get("ec2").await.unwrap().describe().await.unwrap();
    assert!(info.features.contains(&"zone=us-east-1c".to_owned()), "{:?}", info.features);

    // Another's instance, without the namespace tag: never listed, never terminated.
    let foreign = moto.boto3(
        "print(ec2.run_instances(ImageId='ami-12c6146b', MinCount=1, MaxCount=1)['Instances'][0]['InstanceId'])",
    );
    let foreign = foreign.trim().to_owned();
    let wasm = broker.registry().get("ec2").await.unwrap();
    let before = front.requests();
    let mut listed: Vec<String> =
        wasm.all_instances(&CallHooks::default()).await.unwrap().into_iter().map(|i| i.id).collect();
    listed.sort();
    let mut expected = ids.clone();
    expected.sort();
    assert_eq!(listed, expected);
    assert_eq!(front.requests() - before, 1, "5 of ours fit one page of 5");
    let mut params = empty_params();
    params.instance_config = Some(machine(5));
    ids.push(broker.start_instance("ec2", &params, &CallHooks::default()).await.unwrap().id);
    let before = front.requests();
    assert_eq!(wasm.all_instances(&CallHooks::default()).await.unwrap().len(), 6);
    assert_eq!(front.requests() - before, 2, "6 take two pages: NextToken followed");

    // Terminate two, and again: idempotent. The foreign one survives being named.
    let stopping = vec![ids[0].clone(), ids[1].clone()];
    broker.stop_instances("ec2", &stopping).await.unwrap();
    broker.stop_instances("ec2", &stopping).await.unwrap();
    wasm.stop_instances(&CallHooks::default(), std::slice::from_ref(&foreign)).await.unwrap();
    let held = moto_instances(&moto);
    let state = |id: &str| held.iter().find(|(i, ..)| i == id).map(|(_, s, ..)| s.clone()).unwrap();
    assert_eq!((state(&ids[0]), state(&ids[1])), ("terminated".into(), "terminated".into()));
    assert_eq!(state(&foreign), "running", "an instance without the namespace tag is not ours to stop");
    assert_eq!(wasm.all_instances(&CallHooks::default()).await.unwrap().len(), 4);

    // Drift: a tag removed behind the host's back is put back by maintain.
    moto.boto3(&format!("ec2.delete_tags(Resources=['{}'], Tags=[{{'Key': 'team'}}])", ids[2]));
    broker.maintain_instance("ec2", &ids[2]).await.unwrap();
    let held = moto_instances(&moto);
    let tags = &held.iter().find(|(i, ..)| *i == ids[2]).unwrap().3;
    assert_eq!(tags.get("team").map(String::as_str), Some("blue"), "{tags:?}");

    let secret = moto.key.secret_access_key.as_str();
    let shown = format!("{:?}", broker.registry().show("ec2").unwrap());
    assert!(!shown.contains(secret));
    for event in broker.store().events(0, 10_000).unwrap() {
        assert!(!format!("{event:?}").contains(secret), "an event has the secret: {event:?}");
    }

    // The kit, recording against the same endpoint where this namespace has live
    // instances: it passes, stops only what it made, and no report or recording
    // holds the secret or a signature.
    use broker_core::conformance::{self, Answers, KitOptions, RECORDING_TAG, Recording};
    let recording = Arc::new(Recording::default());
    let options = KitOptions {
        answers: Answers::Record(recording.clone()),
        strict: false,
        sandbox: Default::default(),
        credentials: Some(dir.path().join("data/credentials")),
        secrets: None,
    };
    let manifest = broker_core::manifest::Manifest::load(&manifest).unwrap();
    let report = conformance::run_with(&manifest, options).await.unwrap();
    assert!(report.passed(), "{}", report.text());
    let held = moto_instances(&moto);
    let kits: Vec<_> = held.iter().filter(|(.., tags)| tags.contains_key(RECORDING_TAG)).collect();
    assert!(kits.len() >= 4, "the kit's starts are tagged as its own: {held:?}");
    assert!(kits.iter().all(|(_, state, ..)| state == "terminated"), "the kit stops what it made: {kits:?}");
    let ours_live = held.iter().filter(|(i, state, ..)| ids.contains(i) && state == "running").count();
    assert_eq!(ours_live, 4, "the namespace's own instances are untouched by the recording");
    let script = recording.to_script_json();
    for (what, text) in [
        ("text report", report.text()),
        ("JSON report", serde_json::to_string(&report).unwrap()),
        ("JUnit report", report.junit()),
        ("recording", script.clone()),
    ] {
        assert!(!text.contains(secret), "the {what} holds the secret");
        assert!(!text.contains(&moto.key.access_key_id), "the {what} holds the key id");
        assert!(!text.to_ascii_lowercase().contains("x-amz-date"), "the {what} holds a signing header");
    }
    assert!(script.contains("RunInstances"), "the recording has the exchanges");
}

/// The kit's scripted EC2 world (the bundled recording, its answers edited):
/// RunInstances in the zone the provider chose answers
/// InsufficientInstanceCapacity, and the host places the start in the next
/// zone, which the provider asks EC2 for by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capacity_failure_in_one_zone_moves_the_start_to_the_next() {
    use broker_capabilities::rooms::http_egress::{Exchange, HttpEgress, RecordedEgress, Script, Tape};
    let script = std::fs::read_to_string(broker_tests::bundled_manifest("ec2").with_file_name("provider.script.json"));
    let recorded: serde_json::Value = serde_json::from_str(&script.unwrap()).unwrap();
    let exchange = |i: usize| serde_json::from_value::<Exchange>(recorded["http"][i].clone()).unwrap();
    let (zones, mut full, mut ran, mut running) = (exchange(0), exchange(1), exchange(1), exchange(2));
    assert!(zones.request_body.starts_with("Action=DescribeAvailabilityZones"), "{}", zones.request_body);
    assert!(ran.request_body.starts_with("Action=RunInstances") && ran.request_body.contains("us-east-1a"));
    assert!(running.request_body.starts_with("Action=DescribeInstances"));
    full.status = 500;
    full.response_body = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Response><Errors><Error>\
        <Code>InsufficientInstanceCapacity</Code><Message>We currently do not have sufficient t3.micro capacity \
        in the Availability Zone you requested (us-east-1a).</Message></Error></Errors>\
        <RequestID>r-1</RequestID></Response>"
        .into();
    for answer in [&mut ran, &mut running] {
        answer.response_body = answer.response_body.replace("us-east-1a", "us-east-1b");
    }
    // EC2 says a full zone with a 500, which the provider does not ask again. The
    // host knows only the zones the provider lists, emptiest first by name: the
    // full one comes round again before the next.
    let answers = vec![zones.clone(), full.clone(), zones.clone(), full, zones, ran, running];
    let script = Arc::new(Script::new(answers));
    let tape = Arc::new(Tape::default());
    let egress = Arc::new(RecordedEgress::new(script.clone(), tape.clone()));
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::open_with(&dir.path().join("data"), |caps| {
        caps.backends = caps.backends.clone().with::<HttpEgress>(egress);
    })
    .unwrap();
    broker.registry().add(&broker_tests::bundled_manifest("ec2")).await.unwrap();

    let record = broker.start_instance("ec2", &empty_params(), &Default::default()).await.unwrap();
    assert_eq!(record.hardware.availability_zone.as_deref(), Some("us-east-1b"), "{record:?}");
    assert_eq!(script.remaining(), 0, "every scripted answer was asked for");
    assert!(script.take_unexpected().is_empty());
    let runs: Vec<String> = (tape.exchanges().into_iter())
        .filter(|e| e.request_body.starts_with("Action=RunInstances"))
        .map(|e| e.request_body)
        .collect();
    assert_eq!(runs.len(), 3, "{runs:#?}");
    assert!(runs[..2].iter().all(|r| r.contains("Placement.AvailabilityZone=us-east-1a")), "{runs:#?}");
    assert!(runs[2].contains("Placement.AvailabilityZone=us-east-1b"), "the host's next zone: {runs:#?}");
    let token = |r: &str| r.split('&').find(|p| p.starts_with("ClientToken=")).map(str::to_owned);
    assert!(token(&runs[0]) != token(&runs[1]) && token(&runs[1]) != token(&runs[2]), "a token per start call");
}
