//! The conformance kit on real components: the bundled fake passes in both
//! isolation modes, the bundled LXD provider passes on its own script (no
//! daemon anywhere), and the hostile guest fails exactly the scenarios it breaks.

use broker_core::conformance;
use broker_core::manifest::Manifest;
use broker_tests::{bundled_manifest, fake_manifest_extra, write_manifest};

#[tokio::test]
async fn the_fake_provider_passes_every_scenario_in_both_modes() {
    for isolation in ["pooled", "per-call"] {
        let dir = tempfile::tempdir().unwrap();
        let manifest =
            Manifest::load(&write_manifest(dir.path(), "fake", "fake", &fake_manifest_extra(isolation))).unwrap();
        let report = conformance::run(&manifest).await.unwrap();
        assert!(report.passed(), "{isolation}:\n{}", report.text());
        let names: Vec<&str> = report.cases.iter().map(|c| &*c.name).collect();
        for expected in [
            "describe is well formed",
            "validate-config rejects garbage: not JSON",
            "validate-config rejects garbage: an unknown setting",
            "hardware satisfies the constraints",
            "stopped instance is gone",
            "stop of an unknown id is ok",
            "double stop is ok",
            "maintain-instance on a known instance",
            "distribution group is spread over zones",
            "a placement in a zone is honoured",
        ] {
            assert!(names.contains(&expected), "{expected} was run");
        }
    }
    let bundled = Manifest::load(&bundled_manifest("fake")).unwrap();
    assert!(conformance::run(&bundled).await.unwrap().passed());

    // Recorded, the fake writes down nothing (its kv is the kit's own), and the
    // empty script replays to the same result, strictly.
    use broker_core::conformance::{Answers, KitOptions, Recording, Scripted};
    let recording = std::sync::Arc::new(Recording::default());
    let options = KitOptions {
        answers: Answers::Record(recording.clone()),
        strict: false,
        sandbox: Default::default(),
        credentials: None,
        secrets: None,
    };
    let recorded = conformance::run_with(&bundled, options).await.unwrap();
    let script = recording.to_script_json();
    assert_eq!(script.trim(), "{}");
    let answers = Answers::Script(std::sync::Arc::new(Scripted::parse(&script).unwrap()));
    let replayed = conformance::run_with(
        &bundled,
        KitOptions { answers, strict: true, sandbox: Default::default(), credentials: None, secrets: None },
    )
    .await
    .unwrap();
    // A recording runs the built-in cases only: the provider's own would make real instances it does not tag.
    let own = |r: &conformance::Report| r.cases.iter().filter(|c| c.name.starts_with("scenario: ")).count();
    assert_eq!((own(&replayed), own(&recorded)), (2, 2), "{}", recorded.text());
    assert!(recorded.cases.iter().filter(|c| c.name.starts_with("scenario: ")).all(|c| c.skipped));
    let outcome = |r: &conformance::Report| {
        let built_in = r.cases.iter().filter(|c| !c.name.starts_with("scenario: "));
        built_in.map(|c| (c.name.to_string(), c.passed)).collect::<Vec<_>>()
    };
    assert_eq!(outcome(&replayed), outcome(&recorded));
    assert!(replayed.passed(), "{}", replayed.text());
}

/// A provider's own scenarios (beside its manifest) run with the built-in
/// cases: each a case, failed by its first step that does not answer as
/// expected, saying which and why; a malformed file is refused before anything runs.
#[tokio::test]
async fn a_providers_own_scenarios_run_as_cases_and_fail_at_their_step() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_manifest(dir.path(), "fake", "fake", &fake_manifest_extra("pooled"));
    let scenarios = r#"{"scenarios": [
        {"name": "kept", "steps": [
            {"call": "start-instance", "params": {"placement": "zone=zone-c"}, "save": "s",
             "expect": {"answer": {"hardware": {"availability_zone": "zone-c"}}}},
            {"call": "stop-instances", "params": ["${s.instance.id}"]}]},
        {"name": "wrong", "steps": [
            {"call": "describe", "expect": {"answer": {"name": "fake"}}},
            {"call": "all-instances", "params": {"cursor": null, "size": 5}, "expect": {"error": "not-found"}}]}
    ]}"#;
    std::fs::write(conformance::scenarios_path(&path), scenarios).unwrap();
    let report = conformance::run(&Manifest::load(&path).unwrap()).await.unwrap();
    let case = |name: &str| report.cases.iter().find(|c| c.name == name).unwrap_or_else(|| panic!("{}", report.text()));
    assert!(case("scenario: kept").passed, "{}", report.text());
    let wrong = case("scenario: wrong");
    assert!(!wrong.passed && !wrong.skipped);
    assert!(
        wrong.detail.starts_with("step 2 (all-instances): expected a not-found error, got the answer"),
        "{}",
        wrong.detail
    );
    assert!(!report.passed());

    std::fs::write(
        conformance::scenarios_path(&path),
        r#"{"scenarios": [{"name": "n", "steps": [{"call": "reboot"}]}]}"#,
    )
    .unwrap();
    let refused = conformance::run(&Manifest::load(&path).unwrap()).await.err().map(|e| e.to_string());
    assert!(
        refused.as_deref().is_some_and(|e| e.contains("fake.scenarios.json") && e.contains("no method \"reboot\"")),
        "{refused:?}"
    );
}

#[tokio::test]
pub(crate) async fn the_lxd_provider_passes_strictly_on_the_script_it_ships_and_fails_without_one() {
    use broker_core::conformance::KitOptions;
    let bundled = Manifest::load(&bundled_manifest("lxd")).unwrap();
    assert!(conformance::script_path(&bundled.path).exists(), "guests/lxd ships provider.script.json");
    let mut options = KitOptions::beside(&bundled).unwrap();
    options.strict = true;
    let report = conformance::run_with(&bundled, options).await.unwrap();
    assert!(report.passed(), "{}", report.text());
    assert!(report.cases.len() >= 12, "{}", report.text());

    // The same manifest where no script lies beside it: the first request is unscripted.
    let dir = tempfile::tempdir().unwrap();
    let elsewhere = dir.path().join("lxd.toml");
    std::fs::write(&elsewhere, broker_tests::bundled_manifest_text("lxd")).unwrap();
    let manifest = Manifest::load(&elsewhere).unwrap();
    let mut options = KitOptions::beside(&manifest).unwrap();
    options.strict = true;
    let report = conformance::run_with(&manifest, options).await.unwrap();
    let start = report.cases.iter().find(|c| c.name == "start-instance succeeds").unwrap();
    assert!(!start.passed);
    assert!(start.detail.contains("unscripted http request GET lxd/1.0/images/aliases/busybox"), "{}", start.detail);
    let missing = format!("no script at {}", dir.path().join("lxd.script.json").display());
    assert!(start.detail.contains(&missing) && !start.detail.contains("exhausted"), "{}", start.detail);
    // What the failed start left unrun is reported as skipped, in the totals.
    let (passed, failed, skipped) = report.totals();
    let names: Vec<&str> = report.cases.iter().filter(|c| c.skipped).map(|c| &*c.name).collect();
    assert_eq!(
        names,
        [
            "status updates of a start are progress",
            "hardware satisfies the constraints",
            "started instance is listed",
            "maintain-instance on a known instance",
            "stop-instances succeeds",
            "stopped instance is gone",
            "double stop is ok",
        ],
        "{}",
        report.text()
    );
    assert_eq!(skipped, 7, "{}", report.text());
    assert_eq!(passed + failed + skipped, report.cases.len());
    assert!(report.text().contains("skip stopped instance is gone"), "{}", report.text());
}

#[tokio::test]
pub(crate) async fn the_kvm_provider_passes_strictly_on_its_script_without_running_anything() {
    use broker_core::conformance::{Answers, KitOptions};
    let bundled = Manifest::load(&bundled_manifest("kvm")).unwrap();
    let KitOptions { answers: Answers::Script(scripted), .. } = KitOptions::beside(&bundled).unwrap() else {
        panic!("the bundled kvm provider ships a script");
    };
    assert!(scripted.remaining() >= 3, "qemu-img, genisoimage and one qemu child are scripted");
    let options = KitOptions {
        answers: Answers::Script(scripted.clone()),
        strict: true,
        sandbox: Default::default(),
        credentials: None,
        secrets: None,
    };
    let report = conformance::run_with(&bundled, options).await.unwrap();
    assert!(report.passed(), "{}", report.text());
    assert_eq!(report.cases.len(), 15, "{}", report.text());
    // Each run and the child were answered by the script, strictly: none reached the host.
    assert_eq!(scripted.remaining(), 0, "every scripted run and child was used");
    let start = report.cases.iter().find(|c| c.name == "start-instance succeeds").unwrap();
    let calls = start.trace.join("\n");
    for expected in
        ["process.run(program=\"qemu-img\"", "process.spawn(name=\"juju-host0-vm1\"", "local-socket.connect("]
    {
        assert!(calls.contains(expected), "{expected} in\n{calls}");
    }

    // The script with something taken out: the strict kit fails the start and names the call.
    let text = std::fs::read_to_string(conformance::script_path(&bundled.path)).unwrap();
    type Edit = fn(&mut serde_json::Value);
    let edits: [(Edit, &str); 3] = [
        (|s| s["runs"].as_array_mut().unwrap().truncate(1), "unscripted run genisoimage -quiet -output"),
        (|s| s["children"] = serde_json::json!([]), "unscripted spawn qemu-system-x86_64"),
        (
            |s| {
                s["children"][0]["answers"]
                    .as_array_mut()
                    .unwrap()
                    .retain(|a| !a["line"].to_string().contains("query-kvm"))
            },
            "unscripted line to qemu-system-x86_64 child \"juju-host0-vm1\": {\"execute\":\"query-kvm\"}",
        ),
    ];
    for (edit, named) in edits {
        let mut script: serde_json::Value = serde_json::from_str(&text).unwrap();
        edit(&mut script);
        let scripted = conformance::Scripted::parse(&script.to_string()).unwrap();
        let options = KitOptions {
            answers: Answers::Script(std::sync::Arc::new(scripted)),
            strict: true,
            sandbox: Default::default(),
            credentials: None,
            secrets: None,
        };
        let report = conformance::run_with(&bundled, options).await.unwrap();
        let start = report.cases.iter().find(|c| c.name == "start-instance succeeds").unwrap();
        assert!(!start.passed && start.detail.contains(named), "{named} in {}", start.detail);
    }
}

/// A recording runs against real endpoints: it never stops an instance that
/// was there before it, even one its own start answered with (a provider whose
/// ids repeat, over a kv the kit starts empty), and says why.
#[tokio::test]
async fn a_recording_never_stops_what_existed_before_it() {
    use broker_core::conformance::{Answers, KitOptions, Recording};
    let dir = tempfile::tempdir().unwrap();
    let manifest = broken_manifest(dir.path(), "test-broken", "takes-over");
    let recording = std::sync::Arc::new(Recording::default());
    let options = KitOptions {
        answers: Answers::Record(recording),
        strict: false,
        sandbox: Default::default(),
        credentials: None,
        secrets: None,
    };
    let report = conformance::run_with(&manifest, options).await.unwrap();
    let stop = report.cases.iter().find(|c| c.name == "stop-instances succeeds").unwrap();
    assert!(!stop.passed, "{}", report.text());
    assert!(
        stop.detail.contains("refused to stop [\"fake-0\"] (an instance that existed before this run)"),
        "{}",
        stop.detail
    );
    // Not recording, the same provider's own instance is stopped as usual.
    let replayed = conformance::run(&manifest).await.unwrap();
    assert!(replayed.cases.iter().find(|c| c.name == "stop-instances succeeds").unwrap().passed, "{}", replayed.text());
}

#[tokio::test]
async fn the_hostile_guest_fails_what_it_breaks_with_a_reason() {
    let dir = tempfile::tempdir().unwrap();
    let manifest =
        Manifest::load(&write_manifest(dir.path(), "hostile", "test-hostile", "[grants]\nkv = true\n")).unwrap();
    let report = conformance::run(&manifest).await.unwrap();
    assert!(!report.passed());
    let failed: Vec<(&str, &str)> =
        report.cases.iter().filter(|c| !c.passed && !c.skipped).map(|c| (&*c.name, c.detail.as_str())).collect();
    assert_eq!(
        failed,
        [
            ("validate-config rejects garbage: not JSON", "accepted garbage config not json at all"),
            (
                "validate-config rejects garbage: an unknown setting",
                r#"accepted garbage config {"definitely-not-a-setting": [1, 2, 3]}"#,
            ),
            ("start-instance succeeds", "not supported: the hostile provider starts nothing"),
        ]
    );
    assert!(report.text().contains("FAIL start-instance succeeds"));
}

/// The broken guest's manifest: the fake's config with `breaks`, short deadlines.
fn broken_manifest(dir: &std::path::Path, guest: &str, breaks: &str) -> Manifest {
    let extra = format!(
        "[limits.deadlines]\ndefault = \"2s\"\nmaintain-instance = \"300ms\"\n[grants]\nkv = true\n\
         [config]\nzones = [\"zone-a\", \"zone-b\"]\nbreaks = \"{breaks}\"\n"
    );
    Manifest::load(&write_manifest(dir, "broken", guest, &extra)).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
pub(crate) async fn each_broken_guest_fails_exactly_the_scenario_it_breaks_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let intact = conformance::run(&broken_manifest(dir.path(), "test-broken", "")).await.unwrap();
    assert!(intact.passed(), "unbroken, it is the fake:\n{}", intact.text());
    assert_eq!(intact.cases.len(), 18, "{}", intact.text());

    // (breaks, the guest, the cases that must fail, words each failure must carry)
    let cases: &[(&str, &str, &[&str], &str)] = &[
        ("", "test-broken-describe", &["describe is well formed"], "empty field"),
        ("accepts-config", "test-broken", &["validate-config accepts its config"], "refuses every config"),
        (
            "rejects-garbage",
            "test-broken",
            &["validate-config rejects garbage: not JSON", "validate-config rejects garbage: an unknown setting"],
            "accepted garbage config",
        ),
        ("start", "test-broken", &["start-instance succeeds"], "cannot start an instance with a cores constraint"),
        ("status", "test-broken", &["status updates of a start are progress"], "reported error"),
        ("hardware", "test-broken", &["hardware satisfies the constraints"], "cpu-cores Some(1) for cores=2"),
        ("listed", "test-broken", &["started instance is listed"], "missing from"),
        ("maintain", "test-broken", &["maintain-instance on a known instance"], "not found"),
        ("stop", "test-broken", &["stopped instance is gone"], "still listed after stop"),
        ("double-stop", "test-broken", &["double stop is ok"], "second stop of fake-0 returned not found"),
        (
            "unknown-stop",
            "test-broken",
            &["stop of an unknown id is ok"],
            "stop-instances of an unknown id returned not found",
        ),
        ("zones", "test-broken", &["distribution group is spread over zones"], "the first was in"),
        ("typed-errors", "test-broken", &["an unknown zone is a typed error"], "not a typed error"),
        (
            "placement",
            "test-broken",
            &["a placement in a zone is honoured"],
            "placement zone=zone-b landed in Some(\"zone-a\")",
        ),
        (
            "ungranted",
            "test-broken",
            &["no call touches an ungranted capability"],
            "called machine-lock without a grant, 2 time(s)",
        ),
        (
            "ungranted-process",
            "test-broken",
            &["no call touches an ungranted capability"],
            "called process without a grant, 2 time(s): process is not granted",
        ),
        ("symlink", "test-broken", &["no call touches an ungranted capability"], "called filesystem without a grant"),
        ("bad-id", "test-broken", &["start-instance succeeds"], r#"the host refuses the id "fake-0\x1b]0;owned\x07""#),
        // A deadline overrun is also the failure of the call it happened in.
        (
            "deadline",
            "test-broken",
            &["maintain-instance on a known instance", "every call returns within its deadline"],
            "deadline",
        ),
    ];
    for (breaks, guest, expected, words) in cases {
        let report = conformance::run(&broken_manifest(dir.path(), guest, breaks)).await.unwrap();
        let failed: Vec<&conformance::Case> = report.cases.iter().filter(|c| !c.passed && !c.skipped).collect();
        let names: Vec<&str> = failed.iter().map(|c| &*c.name).collect();
        assert_eq!(names, *expected, "breaks = {breaks:?} ({guest}):\n{}", report.text());
        for case in failed {
            assert!(case.detail.contains(words), "breaks = {breaks:?}: {:?} lacks {words:?}", case.detail);
        }
        if *breaks == "double-stop" {
            // Under the failure, what the provider asked of the host during that case.
            let case = report.cases.iter().find(|c| c.name == "double stop is ok").unwrap();
            let looked = r#"kv.get(key="broken/stopped/fake-0")"#;
            assert!(case.trace.iter().any(|call| call.starts_with(looked)), "{:?}", case.trace);
            assert!(report.text().contains(&format!("\n       {looked}")), "{}", report.text());
        }
    }
}

/// The sandbox issue's attacks through a granted program fail the kit too: a
/// loader variable and a host path argument are refused by the host (before
/// the kit's simulated process is asked), and a provider that swallows the
/// refusal still fails "no call touches an ungranted capability".
#[tokio::test(flavor = "multi_thread")]
async fn a_granted_program_misused_fails_the_ungranted_case() {
    let dir = tempfile::tempdir().unwrap();
    for (breaks, words) in [("loader-env", "LD_PRELOAD"), ("host-path", "/etc/shadow")] {
        let extra = format!(
            "[limits.deadlines]\ndefault = \"2s\"\n[grants]\nkv = true\nprocess = [\"true\"]\n\
             [config]\nzones = [\"zone-a\", \"zone-b\"]\nbreaks = \"{breaks}\"\n"
        );
        let manifest = Manifest::load(&write_manifest(dir.path(), "broken", "test-broken", &extra)).unwrap();
        let report = conformance::run(&manifest).await.unwrap();
        let failed: Vec<&conformance::Case> = report.cases.iter().filter(|c| !c.passed && !c.skipped).collect();
        let names: Vec<&str> = failed.iter().map(|c| &*c.name).collect();
        assert_eq!(names, ["no call touches an ungranted capability"], "{breaks}:\n{}", report.text());
        assert!(failed[0].detail.contains("process") && failed[0].detail.contains(words), "{}", failed[0].detail);
    }
}

/// Issue 36, class 2, in the kit: on the simulated network, whose script
/// says which devices another provider made, a provider that touches one (or
/// unbridges the host's bridge) and swallows the refusal fails "no call
/// touches an ungranted capability", the refusal naming the owner; its own
/// tap on the host bridge (`attach-to`) is no finding.
#[tokio::test(flavor = "multi_thread")]
async fn touching_another_providers_device_fails_the_ungranted_case() {
    use broker_core::conformance::{Answers, KitOptions, Scripted};
    use std::sync::Arc;
    let dir = tempfile::tempdir().unwrap();
    let extra = "[limits.deadlines]\ndefault = \"2s\"\n[grants]\nkv = true\n[grants.bridge]\n\
                 devices = [\"kt*\"]\nbridges = [\"br-*\"]\nattach-to = [\"br-host\"]\n\
                 [config]\nzones = [\"zone-a\", \"zone-b\"]\nbreaks = \"anothers-device\"\n";
    let manifest = Manifest::load(&write_manifest(dir.path(), "broken", "test-broken", extra)).unwrap();
    let device = |name: &str, kind: &str, controller: Option<&str>| {
        serde_json::json!({"name": name, "mac": "02:00:00:00:00:01", "mtu": 1500, "kind": kind,
                           "controller": controller, "up": true})
    };
    let script = serde_json::json!({
        "devices": [device("br-host", "bridge", None), device("br-mine", "bridge", None),
                    device("kt-other", "tun", Some("br-host"))],
        "owners": {"kt-other": "kvm2", "br-mine": "broken"},
    });
    let scripted = Arc::new(Scripted::parse(&script.to_string()).unwrap());
    let options = KitOptions {
        answers: Answers::Script(scripted),
        strict: false,
        sandbox: Default::default(),
        credentials: None,
        secrets: None,
    };
    let report = conformance::run_with(&manifest, options).await.unwrap();
    let failed: Vec<&conformance::Case> = report.cases.iter().filter(|c| !c.passed && !c.skipped).collect();
    let names: Vec<&str> = failed.iter().map(|c| &*c.name).collect();
    assert_eq!(names, ["no call touches an ungranted capability"], "{}", report.text());
    for words in ["tap kt-other belongs to provider kvm2", "bridge br-host is the host's"] {
        assert!(failed[0].detail.contains(words), "{:?} lacks {words:?}", failed[0].detail);
    }
    assert!(!failed[0].detail.contains("kt-mine exists"), "its own tap is no finding: {}", failed[0].detail);
}

#[tokio::test]
async fn importing_what_the_manifest_does_not_grant_is_a_finding_not_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    // The fake imports kv; this manifest grants nothing.
    let manifest = Manifest::load(&write_manifest(dir.path(), "fake", "fake", "")).unwrap();
    let report = conformance::run(&manifest).await.unwrap();
    assert!(!report.passed());
    let [case] = report.cases.as_slice() else { panic!("{}", report.text()) };
    assert_eq!(case.name, "no call touches an ungranted capability");
    assert!(case.detail.contains("broker:provider/kv") && case.detail.contains("kv = true"), "{}", case.detail);
}

/// A provider's `[secrets]` in the kit: a scripted run gives the guest the
/// stand-in `kit-secret:NAME`; a recording gives it the operator's value and
/// its reports (text, JSON, JUnit) show the stand-in in its place.
#[tokio::test]
async fn the_kit_gives_stand_ins_for_secrets_and_its_reports_never_hold_one() {
    use broker_core::conformance::{Answers, KitOptions, Recording};
    use std::os::unix::fs::PermissionsExt;
    const SECRET: &str = "kit-run-real-s3cr3t-value";
    let dir = tempfile::tempdir().unwrap();
    let secrets = dir.path().join("secrets");
    std::fs::create_dir_all(secrets.join("leaky")).unwrap();
    std::fs::write(secrets.join("leaky/api"), SECRET).unwrap();
    std::fs::set_permissions(secrets.join("leaky/api"), std::fs::Permissions::from_mode(0o600)).unwrap();
    let extra = "[grants]\nkv = true\n[config]\nmode = \"leak\"\n[secrets]\napi-token = \"api\"\n";
    let manifest = Manifest::load(&write_manifest(dir.path(), "leaky", "test-hostile", extra)).unwrap();
    let reports = |report: &conformance::Report| {
        [report.text(), serde_json::to_string(report).unwrap(), report.junit()].join("\n")
    };

    let scripted = conformance::run(&manifest).await.unwrap();
    let text = reports(&scripted);
    assert!(text.contains("the cloud refused token kit-secret:api"), "the guest had the stand-in: {text}");

    let recording = std::sync::Arc::new(Recording::default());
    let options = KitOptions {
        answers: Answers::Record(recording.clone()),
        strict: false,
        sandbox: Default::default(),
        credentials: None,
        secrets: Some(secrets.clone()),
    };
    let recorded = conformance::run_with(&manifest, options).await.unwrap();
    let text = reports(&recorded);
    assert!(text.contains("the cloud refused token kit-secret:api"), "the real value, shown as its stand-in: {text}");
    assert!(text.contains("accepted {\"api-token\":\"kit-secret:api\""), "the config, its secret hidden: {text}");
    assert!(!text.contains(SECRET), "a report holds the secret: {text}");
    assert!(!recorded.redacted_json(&serde_json::json!({"said": format!("x {SECRET} y")})).contains(SECRET));
}
