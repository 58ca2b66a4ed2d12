//! Groups on the fake, through the real host: plans, passes, rolling updates,
//! quorum groups, destroy-instances, free and destroy, and a restart mid-way.
//! Most tests drive passes one by one (`converge_once`) so that what each pass
//! does is checked; the restart test runs the loops as `broker serve` does.

use broker_host::broker::Broker;
use broker_host::capabilities::kv::KvBackend;
use broker_host::groups::{GroupError, GroupSettings, Groups, Pass};
use broker_tests::write_manifest;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn spec(size: &str, constraints: &str) -> String {
    format!(
        r#"{{"ID": "workers", "Properties": {{
            "Allocation": {size},
            "Instance": {{"Plugin": "fake", "Properties": {{"Constraints": "{constraints}", "Tags": {{"role": "worker"}}}}}},
            "Flavor": {{"Plugin": "vanilla", "Properties": {{"Init": ["echo hello"]}}}}}}}}"#
    )
}

fn sized(size: u32) -> String {
    spec(&format!(r#"{{"Size": {size}}}"#), "mem=1G")
}

async fn host(dir: &Path, config: &str) -> (Arc<Broker>, Arc<Groups>) {
    let manifest = write_manifest(
        dir,
        "fake",
        "fake",
        &format!("[limits]\nmemory-mib = 64\n[grants]\nkv = true\n[config]\n{config}\n"),
    );
    let broker = Arc::new(Broker::open(&dir.join("data")).unwrap());
    broker.registry().add(&manifest).await.unwrap();
    let settings = GroupSettings { poll: Duration::from_millis(50), ..GroupSettings::default() };
    (broker.clone(), Groups::new(broker, settings))
}

/// Passes until one changes nothing (at most 60).
async fn converge(groups: &Groups, id: &str) -> usize {
    for pass in 1..=60 {
        if groups.converge_once(id).await.unwrap() == Pass::Steady {
            return pass;
        }
    }
    panic!("group {id} did not settle in 60 passes");
}

async fn member_ids(groups: &Groups) -> Vec<String> {
    groups.describe("workers").await.unwrap().instances.into_iter().map(|m| m.id).collect()
}

fn events_of(broker: &Broker, after: u64) -> Vec<(String, String)> {
    let events = broker.store().events(after, 10_000).unwrap();
    events.into_iter().filter(|e| e.group.is_some()).map(|e| (e.kind, e.detail)).collect()
}

#[tokio::test]
async fn a_group_scales_0_5_2_0_with_infrakits_plans_and_its_events() {
    let dir = tempfile::tempdir().unwrap();
    let (broker, groups) = host(dir.path(), "").await;
    assert_eq!(groups.commit_text(&sized(0), false).await.unwrap(), "Managing 0 instances");
    converge(&groups, "workers").await;
    assert!(member_ids(&groups).await.is_empty());

    assert_eq!(
        groups.commit_text(&sized(5), false).await.unwrap(),
        "Adding 5 instances to increase the group size to 5"
    );
    converge(&groups, "workers").await;
    let five = groups.describe("workers").await.unwrap();
    assert_eq!(five.instances.len(), 5);
    assert!(five.converged);
    for member in &five.instances {
        assert_eq!(member.tags["infrakit.group"], "workers");
        assert_eq!(member.tags["role"], "worker");
        assert_eq!(member.tags["infrakit.config.hash"].len(), 32);
        assert_eq!(member.status, "running");
    }

    assert_eq!(groups.set_size("workers", 2).await.unwrap(), "Terminating 3 instances to reduce the group size to 2");
    assert_eq!(groups.size("workers").unwrap(), 2);
    converge(&groups, "workers").await;
    // The surplus went by id: the two that sort last stay.
    let mut ids: Vec<String> = five.instances.iter().map(|m| m.id.clone()).collect();
    ids.sort();
    assert_eq!(member_ids(&groups).await, ids[3..]);

    assert_eq!(groups.set_size("workers", 0).await.unwrap(), "Terminating 2 instances to reduce the group size to 0");
    converge(&groups, "workers").await;
    assert!(member_ids(&groups).await.is_empty());
    assert!(broker.list_instances(Some("fake")).await.unwrap().is_empty(), "the provider has none left either");

    let kinds: Vec<String> = events_of(&broker, 0).into_iter().map(|(kind, _)| kind).collect();
    let count = |kind: &str| kinds.iter().filter(|k| *k == kind).count();
    assert_eq!(
        (count("group-committed"), count("instance-added"), count("instance-destroyed"), count("converged")),
        (4, 5, 5, 4),
        "{kinds:?}"
    );
}

#[tokio::test]
async fn pretend_changes_nothing_and_bad_commits_are_refused_before_anything_changes() {
    let dir = tempfile::tempdir().unwrap();
    let (broker, groups) = host(dir.path(), "").await;
    assert_eq!(groups.commit_text(&sized(3), true).await.unwrap(), "Managing 3 instances");
    assert!(matches!(groups.size("workers"), Err(GroupError::UnknownGroup(_))), "a pretend commit commits nothing");
    groups.commit_text(&sized(3), false).await.unwrap();
    converge(&groups, "workers").await;

    let snapshot = |broker: &Broker| {
        let kv = broker.store().kv();
        let fake_kv: Vec<_> = (0..3).map(|i| kv.get("fake", &format!("instance/fake-{i}")).unwrap()).collect();
        (
            broker.store().instances(None).unwrap(),
            fake_kv,
            broker.store().events(0, 10_000).unwrap(),
            broker.store().groups().unwrap(),
        )
    };
    let before = snapshot(&broker);
    let changed = spec(r#"{"Size": 5}"#, "mem=2G");
    assert_eq!(
        groups.commit_text(&changed, true).await.unwrap(),
        "Performing a rolling update on 3 instances, then adding 2 instances to increase the group size to 5"
    );
    assert_eq!(
        groups.commit_text(&sized(1), true).await.unwrap(),
        "Terminating 2 instances to reduce the group size to 1"
    );
    assert_eq!(groups.commit_text(&sized(3), true).await.unwrap(), "Noop");
    let wrong_provider = sized(3).replace(r#""Plugin": "fake""#, r#""Plugin": "nosuch""#);
    let refused = groups.commit_text(&wrong_provider, false).await.unwrap_err().to_string();
    assert!(refused.contains(r#"Properties.Instance.Plugin: no provider "nosuch""#), "{refused}");
    let unknown_field = sized(3).replace("Constraints", "Constraint");
    let refused = groups.commit_text(&unknown_field, false).await.unwrap_err().to_string();
    assert!(refused.contains("unknown field `Constraint`"), "{refused}");
    assert_eq!(snapshot(&broker), before, "records, the provider's kv, events and specs are as they were");
}

#[tokio::test]
async fn an_instance_stopped_behind_the_groups_back_is_replaced_in_one_pass() {
    let dir = tempfile::tempdir().unwrap();
    let (broker, groups) = host(dir.path(), "").await;
    groups.commit_text(&sized(3), false).await.unwrap();
    converge(&groups, "workers").await;
    let before = member_ids(&groups).await;
    // Gone from the provider: its record stays, listed as unknown.
    assert!(broker.store().kv().delete("fake", &format!("instance/{}", before[0])).unwrap());
    assert!(!groups.describe("workers").await.unwrap().converged);
    assert_eq!(groups.converge_once("workers").await.unwrap(), Pass::Changed);
    let after = groups.describe("workers").await.unwrap();
    assert!(after.converged, "{after:?}");
    assert_eq!(after.instances.len(), 3);
    assert!(!after.instances.iter().any(|m| m.id == before[0]), "its record is gone");
    let replaced: Vec<_> = events_of(&broker, 0).into_iter().filter(|(kind, _)| kind == "instance-replaced").collect();
    assert_eq!(replaced.len(), 1, "{replaced:?}");
    assert!(replaced[0].1.starts_with(&format!("{}: unknown", before[0])), "{replaced:?}");
}

#[tokio::test]
async fn a_template_change_rolls_one_member_at_a_time_and_converges_again() {
    let dir = tempfile::tempdir().unwrap();
    let (broker, groups) = host(dir.path(), "").await;
    groups.commit_text(&sized(4), false).await.unwrap();
    converge(&groups, "workers").await;
    let old_hash = groups.describe("workers").await.unwrap().instances[0].tags["infrakit.config.hash"].clone();
    let seq = broker.store().events(0, 10_000).unwrap().last().unwrap().seq;

    let plan = groups.commit_text(&spec(r#"{"Size": 4}"#, "mem=2G"), false).await.unwrap();
    assert_eq!(plan, "Performing a rolling update on 4 instances");
    let mut fewest = usize::MAX;
    for _ in 0..60 {
        let described = groups.describe("workers").await.unwrap();
        fewest = fewest.min(described.instances.iter().filter(|m| m.status == "running").count());
        if described.converged {
            break;
        }
        groups.converge_once("workers").await.unwrap();
    }
    let done = groups.describe("workers").await.unwrap();
    assert!(done.converged, "{done:?}");
    assert!(done.instances.iter().all(|m| m.tags["infrakit.config.hash"] != old_hash));
    assert!(fewest >= 3, "never fewer than size - 1 healthy members: saw {fewest}");
    // From the events: each step destroys one old member, and its replacement
    // is added before the next step.
    let events: Vec<String> = events_of(&broker, seq).into_iter().map(|(kind, _)| kind).collect();
    let steps: Vec<&str> =
        events.iter().map(String::as_str).filter(|k| *k == "update-step" || *k == "instance-added").collect();
    assert_eq!(steps, ["update-step", "instance-added"].repeat(4), "{events:?}");
    assert_eq!(events.last().map(String::as_str), Some("converged"), "{events:?}");
    let params = broker.store().instance("fake", &done.instances[0].id).unwrap().unwrap().params.unwrap();
    assert_eq!(params.constraints.mem, Some(2048), "the new template");
}

#[tokio::test]
async fn a_quorum_group_keeps_exactly_its_logical_ids() {
    let dir = tempfile::tempdir().unwrap();
    let (broker, groups) = host(dir.path(), "").await;
    let quorum = |ids: &str| spec(&format!(r#"{{"LogicalIDs": [{ids}]}}"#), "mem=1G");
    assert_eq!(groups.commit_text(&quorum(r#""m1", "m2", "m3""#), false).await.unwrap(), "Managing 3 instances");
    converge(&groups, "workers").await;
    let logical = |described: &broker_host::groups::GroupDescription| {
        let mut ids: Vec<String> = described.instances.iter().filter_map(|m| m.logical_id.clone()).collect();
        ids.sort();
        ids
    };
    assert_eq!(logical(&groups.describe("workers").await.unwrap()), ["m1", "m2", "m3"]);

    let m2 =
        groups.describe("workers").await.unwrap().instances.into_iter().find(|m| m.logical_id.as_deref() == Some("m2"));
    assert!(broker.store().kv().delete("fake", &format!("instance/{}", m2.unwrap().id)).unwrap());
    let plan = groups.commit_text(&quorum(r#""m1", "m2", "m4""#), false).await.unwrap();
    assert_eq!(plan, "Adding 2 instances for logical ids m2, m4, then Terminating 1 instances of logical ids m3");
    converge(&groups, "workers").await;
    let described = groups.describe("workers").await.unwrap();
    assert_eq!(logical(&described), ["m1", "m2", "m4"]);
    assert!(described.converged);
    assert_eq!(broker.list_instances(Some("fake")).await.unwrap().len(), 3, "no stray instance");
    assert!(matches!(groups.set_size("workers", 5).await, Err(GroupError::QuorumSize(_))));
}

#[tokio::test]
async fn destroy_instances_free_and_destroy() {
    let dir = tempfile::tempdir().unwrap();
    let (broker, groups) = host(dir.path(), "").await;
    let outsider =
        broker.start_instance("fake", &broker_host::contract::empty_params(), &Default::default()).await.unwrap().id;
    groups.commit_text(&sized(4), false).await.unwrap();
    converge(&groups, "workers").await;
    let ids = member_ids(&groups).await;

    let error = groups.destroy_instances("workers", &[ids[0].clone(), outsider.clone()]).await.unwrap_err();
    assert_eq!(
        error.to_string(),
        format!("instance {outsider:?} is not a member of group \"workers\": nothing was destroyed")
    );
    assert_eq!(member_ids(&groups).await, ids, "nothing was destroyed");

    groups.destroy_instances("workers", &ids[..2]).await.unwrap();
    assert_eq!(groups.size("workers").unwrap(), 2, "the size is reduced before the call returns");
    assert_eq!(member_ids(&groups).await, ids[2..]);
    converge(&groups, "workers").await;
    assert_eq!(member_ids(&groups).await, ids[2..], "not made again");

    groups.free("workers").await.unwrap();
    assert!(matches!(groups.describe("workers").await, Err(GroupError::UnknownGroup(_))));
    assert_eq!(groups.converge_once("workers").await.unwrap(), Pass::Gone);
    let listed = broker.list_instances(Some("fake")).await.unwrap();
    assert_eq!(listed.len(), 3, "freed members run on, with the outsider");
    assert!(listed.iter().all(|r| !r.instance_tags.contains_key("infrakit.group")), "recorded as ungrouped");

    // A new group of the same name adopts none of them; destroying it destroys only its own.
    groups.commit_text(&sized(2), false).await.unwrap();
    converge(&groups, "workers").await;
    assert_eq!(broker.list_instances(Some("fake")).await.unwrap().len(), 5);
    groups.destroy("workers").await.unwrap();
    assert_eq!(broker.list_instances(Some("fake")).await.unwrap().len(), 3);
    assert!(groups.inspect().unwrap().is_empty());
}

/// The loops as `broker serve` runs them, cut off mid-way (starts in flight
/// dropped with the host), then a new host: reconcile, loops, and the group
/// ends at its size with no duplicate and no orphan.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_mid_convergence_resumes_and_ends_converged_without_duplicates() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (broker, groups) = host(dir.path(), "answer-delay-ms = 40").await;
        groups.start_loops().unwrap();
        groups.commit_text(&sized(12), false).await.unwrap();
        let until = Instant::now() + Duration::from_secs(30);
        while broker.list_instances(Some("fake")).await.unwrap().len() < 4 {
            assert!(Instant::now() < until, "the loop started nothing");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        groups.stop_loops();
    }
    // The aborted loops let go of the host as the runtime drops them.
    let data = dir.path().join("data");
    let broker = Arc::new(Broker::open_when_free(&data, Duration::from_secs(10), async || true).await.unwrap());
    broker.reconcile_after_restart(broker_host::broker::reconcile::HarvestMode::Destroyed).await;
    let groups = Groups::new(broker.clone(), GroupSettings { poll: Duration::from_millis(50), ..Default::default() });
    groups.start_loops().unwrap();
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let described = groups.describe("workers").await.unwrap();
        if described.converged {
            break;
        }
        assert!(Instant::now() < until, "not converged: {described:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    groups.stop_loops();
    let listed = broker.list_instances(Some("fake")).await.unwrap();
    assert_eq!(listed.len(), 12, "exactly the group's size, every one recorded: {listed:?}");
    assert!(listed.iter().all(|r| !r.created.is_empty() && r.instance_tags["infrakit.group"] == "workers"));
}

/// Juju's zone rule with the group as the distribution group: each start goes
/// to the allowed zone with fewest members (ties by name), and one answering
/// `zone-unavailable` sends the start on to the next.
#[tokio::test]
async fn members_spread_over_the_zones_and_an_unavailable_zone_is_skipped() {
    let zoned = |size: u32| spec(&format!(r#"{{"Size": {size}}}"#), "mem=1G zones=zone-a,zone-b,zone-c");
    let per_zone = |listed: Vec<broker_host::store::InstanceRecord>| {
        let mut counts = std::collections::BTreeMap::new();
        for record in listed {
            *counts.entry(record.hardware.availability_zone.unwrap_or_default()).or_insert(0) += 1;
        }
        counts.into_iter().collect::<Vec<(String, usize)>>()
    };
    let dir = tempfile::tempdir().unwrap();
    let (broker, groups) = host(dir.path(), "").await;
    groups.commit_text(&zoned(6), false).await.unwrap();
    converge(&groups, "workers").await;
    let spread = per_zone(broker.list_instances(Some("fake")).await.unwrap());
    assert_eq!(spread, [("zone-a".into(), 2), ("zone-b".into(), 2), ("zone-c".into(), 2)]);

    let dir = tempfile::tempdir().unwrap();
    let (broker, groups) = host(dir.path(), r#"unavailable-zones = ["zone-b"]"#).await;
    groups.commit_text(&zoned(4), false).await.unwrap();
    converge(&groups, "workers").await;
    let spread = per_zone(broker.list_instances(Some("fake")).await.unwrap());
    assert_eq!(spread, [("zone-a".into(), 2), ("zone-c".into(), 2)]);
    let skipped = events_of(&broker, 0).into_iter().filter(|(kind, _)| kind == "zone-unavailable").count();
    assert!(skipped >= 1, "each start placed in zone-b went on to the next zone");
    assert!(groups.describe("workers").await.unwrap().converged);
}
