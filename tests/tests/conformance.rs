//! The conformance kit on real components: the bundled fake passes in both
//! isolation modes; the hostile guest fails exactly the scenarios it breaks.

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
