//! The conformance kit on real components: the bundled fake passes in both
//! isolation modes, the bundled LXD provider passes on its own script (no
//! daemon anywhere), and the hostile guest fails exactly the scenarios it breaks.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use broker_host::conformance;
use broker_host::providers::Manifest;
use broker_tests::{bundled_manifest, fake_manifest_extra, write_manifest};

#[tokio::test]
async fn the_fake_provider_passes_every_scenario_in_both_modes() {
    for isolation in ["pooled", "per-call"] {
        let dir = tempfile::tempdir().unwrap();
        let manifest =
            Manifest::load(&write_manifest(dir.path(), "fake", "fake", &fake_manifest_extra(isolation))).unwrap();
        let report = conformance::run(&manifest).await.unwrap();
        assert!(report.passed(), "{isolation}:\n{}", report.text());
        let names: Vec<&str> = report.cases.iter().map(|c| c.name).collect();
        for expected in [
            "describe is well formed",
            "validate-config rejects garbage",
            "hardware satisfies the constraints",
            "stopped instance is gone",
            "stop of an unknown id is ok",
            "double stop is ok",
            "maintain-instance on a known instance",
            "distribution group is spread over zones",
        ] {
            assert!(names.contains(&expected), "{expected} was run");
        }
    }
    let bundled = Manifest::load(&bundled_manifest("fake")).unwrap();
    assert!(conformance::run(&bundled).await.unwrap().passed());
}

#[tokio::test]
async fn the_lxd_provider_passes_strictly_on_the_script_it_ships_and_fails_without_one() {
    use broker_host::conformance::{HttpWorld, KitOptions};
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
    let options = KitOptions { http: HttpWorld::Script(Default::default()), strict: true };
    let report = conformance::run_with(&manifest, options).await.unwrap();
    let start = report.cases.iter().find(|c| c.name == "start-instance succeeds").unwrap();
    assert!(!start.passed);
    assert!(start.detail.contains("unscripted http request GET lxd/1.0/images/aliases/busybox"), "{}", start.detail);
}

#[tokio::test]
async fn the_hostile_guest_fails_what_it_breaks_with_a_reason() {
    let dir = tempfile::tempdir().unwrap();
    let manifest =
        Manifest::load(&write_manifest(dir.path(), "hostile", "test-hostile", "[grants]\nkv = true\n")).unwrap();
    let report = conformance::run(&manifest).await.unwrap();
    assert!(!report.passed());
    let failed: Vec<(&str, &str)> =
        report.cases.iter().filter(|c| !c.passed).map(|c| (c.name, c.detail.as_str())).collect();
    assert_eq!(
        failed,
        [
            ("validate-config rejects garbage", "accepted garbage config not json at all"),
            ("validate-config rejects garbage", r#"accepted garbage config {"definitely-not-a-setting": [1, 2, 3]}"#),
            ("start-instance succeeds", "not supported: the hostile provider starts nothing"),
        ]
    );
    assert!(report.text().contains("FAIL start-instance succeeds"));
}
